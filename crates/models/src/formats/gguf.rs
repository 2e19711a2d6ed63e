//! GGUF reader (v2 and v3), memory-mapped.
//!
//! OWNED BY THE GGUF HELPER: the public API below is the contract other modules build
//! against; fill in the bodies (and split into submodules as needed) without changing it
//! unless you tell the team lead.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use pagoda_tensor::GgmlType;

/// One metadata value. Arrays may nest.
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
    /// Size in bytes of the data.
    pub n_bytes: u64,
}

/// Why a GGUF file could not be read. The message always names the file.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {kind}")]
pub struct GgufError {
    pub path: PathBuf,
    pub kind: String,
}

/// An open, memory-mapped GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    /// Metadata in file order is not needed; sorted by key.
    pub metadata: BTreeMap<String, MetadataValue>,
    pub tensors: Vec<TensorInfo>,
    /// Alignment of the tensor data (from `general.alignment`, default 32).
    pub alignment: u64,
}

impl GgufFile {
    /// Opens and validates `path`: header, every metadata value, every tensor info, and that
    /// every tensor's bytes lie inside the file.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        Err(GgufError {
            path: path.as_ref().to_path_buf(),
            kind: "GGUF reader not implemented yet".into(),
        })
    }

    /// The raw bytes of a tensor (borrowed from the memory map).
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        let _ = info;
        &[]
    }

    /// Looks up a tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// A metadata value by key.
    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        self.metadata.get(key)
    }
}
