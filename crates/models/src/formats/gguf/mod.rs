//! GGUF reader (v2 and v3), memory-mapped.
//!
//! [`GgufFile::open`] maps the file and validates all of it up front: header, every metadata
//! value (nested arrays included), every tensor info, the alignment, and that every tensor's
//! byte range lies inside the file. After that, [`GgufFile::tensor_data`] is a plain slice of
//! the map. Malformed files give a [`GgufError`] naming the file and what is wrong; the parser
//! never panics and never reserves memory for a count the file cannot hold.
//!
//! Layout (little-endian): magic `"GGUF"`, version `u32`, tensor count `u64`, metadata count
//! `u64`, the metadata key/values, the tensor infos, padding to `general.alignment`, then the
//! tensor data; each tensor's `offset` is relative to the start of that data section.

mod metadata;
mod parse;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use pagoda_tensor::{GgmlType, UnsupportedType};

/// One metadata value, with the exact on-disk type. Arrays may nest. Typed accessors
/// (`as_u64`, `as_str`, ...) live in the `metadata` submodule.
#[derive(Debug, Clone, PartialEq)]
pub enum MetadataValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetadataValue>),
}

/// A tensor's description from the GGUF header.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions in GGML order: `dims[0]` is the innermost (contiguous) dimension.
    /// For a weight matrix `[out, in]` in row-major terms, `dims == [in, out]`.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset of the data relative to the start of the tensor-data section.
    pub offset: u64,
    /// Size in bytes of the data, from `dims` and `ty`. For a type this reader does not know
    /// ([`GgmlType::Other`]) it is an upper bound: the bytes up to the next tensor or the end.
    pub n_bytes: u64,
}

/// Why a GGUF file could not be read. The message always names the file.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {kind}")]
pub struct GgufError {
    /// The file (or, for [`GgufFile::from_bytes`], the label) the error is about.
    pub path: PathBuf,
    /// What is wrong, e.g. `"tensor `blk.0.attn_q.weight`: data offset 7 is not a multiple
    /// of the alignment 32"`.
    pub kind: String,
}

/// The bytes a [`GgufFile`] reads from.
enum Backing {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mapped(map) => map,
            Backing::Owned(bytes) => bytes,
        }
    }
}

/// An open, memory-mapped GGUF file. All fields are validated at open time.
pub struct GgufFile {
    /// The file path (or the label given to [`GgufFile::from_bytes`]).
    pub path: PathBuf,
    /// GGUF version: 2 or 3.
    pub version: u32,
    /// Metadata in file order is not needed; sorted by key.
    pub metadata: BTreeMap<String, MetadataValue>,
    /// Tensor infos in file order. Treat as read-only: [`GgufFile::tensor`] looks names up
    /// in an index built at open, and [`GgufFile::tensor_data`] trusts the validated ranges.
    pub tensors: Vec<TensorInfo>,
    /// Alignment of the tensor data (from `general.alignment`, default 32).
    pub alignment: u64,
    /// Absolute file offset of the tensor-data section (a multiple of `alignment`).
    pub data_offset: u64,
    /// Tensor name -> index into `tensors`.
    tensor_index: std::collections::HashMap<String, usize>,
    backing: Backing,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("num_metadata", &self.metadata.len())
            .field("num_tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

impl GgufFile {
    /// Opens and validates `path`: header, every metadata value, every tensor info, and that
    /// every tensor's bytes lie inside the file.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref();
        let error = |kind: String| GgufError {
            path: path.to_path_buf(),
            kind,
        };
        let file = std::fs::File::open(path).map_err(|e| error(format!("cannot open: {e}")))?;
        let length = file
            .metadata()
            .map_err(|e| error(format!("cannot read file metadata: {e}")))?
            .len();
        let backing = if length == 0 {
            Backing::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only and lives as long as `GgufFile`. As with any
            // memory map, another process truncating or rewriting the file while it is open
            // is outside what we can guard against; model files are not edited in place.
            let map = unsafe { memmap2::Mmap::map(&file) }
                .map_err(|e| error(format!("cannot memory-map: {e}")))?;
            Backing::Mapped(map)
        };
        GgufFile::from_backing(path.to_path_buf(), backing)
    }

    /// Parses and validates a GGUF file held in memory (tests, fuzzing, embedded models).
    /// `label` stands in for the path in error messages and in [`GgufFile::path`].
    pub fn from_bytes(label: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        GgufFile::from_backing(label.into(), Backing::Owned(bytes))
    }

    fn from_backing(path: PathBuf, backing: Backing) -> Result<GgufFile, GgufError> {
        let header = match parse::parse(backing.bytes()) {
            Ok(header) => header,
            Err(kind) => return Err(GgufError { path, kind }),
        };
        Ok(GgufFile {
            path,
            version: header.version,
            metadata: header.metadata,
            tensors: header.tensors,
            tensor_index: header.tensor_index,
            alignment: header.alignment,
            data_offset: header.data_offset,
            backing,
        })
    }

    /// The raw bytes of a tensor (borrowed from the memory map): `info.n_bytes` bytes.
    ///
    /// `info` must be one of this file's [`GgufFile::tensors`] (their ranges were validated
    /// at open); passing an info from another file whose range falls outside this file
    /// panics, as that is a caller bug, not bad input.
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        let range = self.byte_range(info);
        let bytes = self.backing.bytes();
        match range.and_then(|range| bytes.get(range)) {
            Some(data) => data,
            None => panic!(
                "{}: tensor `{}` (offset {}, {} bytes) is not a tensor of this file",
                self.path.display(),
                info.name,
                info.offset,
                info.n_bytes
            ),
        }
    }

    fn byte_range(&self, info: &TensorInfo) -> Option<std::ops::Range<usize>> {
        let start = self.data_offset.checked_add(info.offset)?;
        let end = start.checked_add(info.n_bytes)?;
        Some(usize::try_from(start).ok()?..usize::try_from(end).ok()?)
    }

    /// Looks up a tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index
            .get(name)
            .map(|&index| &self.tensors[index])
    }

    /// The bytes of the tensor called `name`, or an error naming the file and tensor.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8], GgufError> {
        let info = self.tensor(name).ok_or_else(|| GgufError {
            path: self.path.clone(),
            kind: format!("no tensor named `{name}`"),
        })?;
        Ok(self.tensor_data(info))
    }

    /// Dequantizes a whole tensor to `f32` (all `dims` multiplied, GGML order: `dims[0]`
    /// contiguous). Fails for types [`pagoda_tensor::quant::dequantize`] cannot decode.
    pub fn tensor_to_f32(&self, info: &TensorInfo) -> Result<Vec<f32>, GgufError> {
        let num_values: u64 = info.dims.iter().product();
        let error = |kind: String| GgufError {
            path: self.path.clone(),
            kind: format!("tensor `{}`: {kind}", info.name),
        };
        if !info.ty.is_dequantizable() {
            return Err(error(UnsupportedType { ty: info.ty }.to_string()));
        }
        let data = self.tensor_data(info);
        // Check the size before allocating: `dims` of an unvalidated info could be huge.
        let num_values = usize::try_from(num_values)
            .ok()
            .filter(|&n| info.ty.bytes_for(n) == Some(data.len()))
            .ok_or_else(|| {
                error(format!(
                    "dims {:?} do not match {} bytes",
                    info.dims,
                    data.len()
                ))
            })?;
        let mut out = vec![0f32; num_values];
        pagoda_tensor::quant::dequantize(info.ty, data, &mut out)
            .map_err(|e| error(e.to_string()))?;
        Ok(out)
    }

    /// A metadata value by key.
    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        self.metadata.get(key)
    }
}
