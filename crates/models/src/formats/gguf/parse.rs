//! The GGUF header parser: a bounds-checked cursor over the file bytes.
//!
//! Every read checks the remaining length first, and every count read from the file is
//! checked against the bytes that remain before anything is reserved, so a malformed file
//! can neither panic the parser nor make it allocate more than a small multiple of the
//! file's own size. Errors are plain strings saying what is wrong and where; the caller
//! prefixes the file path.

use std::collections::{BTreeMap, HashMap};

use pagoda_tensor::GgmlType;

use super::{MetadataValue, TensorInfo};

/// GGML supports at most this many dimensions per tensor (`GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;
/// Arrays of arrays deeper than this are rejected (real files nest at most once).
const MAX_ARRAY_DEPTH: usize = 8;
/// Alignment of the tensor-data section when `general.alignment` is absent.
pub(super) const DEFAULT_ALIGNMENT: u64 = 32;

/// Everything the header says, with every tensor's byte range validated against the file.
pub(super) struct Header {
    pub version: u32,
    pub metadata: BTreeMap<String, MetadataValue>,
    pub tensors: Vec<TensorInfo>,
    /// Tensor name -> index into `tensors`.
    pub tensor_index: HashMap<String, usize>,
    pub alignment: u64,
    /// Absolute file offset where the tensor-data section starts.
    pub data_offset: u64,
}

type ParseResult<T> = Result<T, String>;

/// Little-endian reader over the whole file.
struct Cursor<'a> {
    bytes: &'a [u8],
    position: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.position
    }

    fn take(&mut self, count: usize) -> ParseResult<&'a [u8]> {
        if count > self.remaining() {
            return Err(format!(
                "unexpected end of file at byte {}: needed {count} bytes, {} remain",
                self.position,
                self.remaining()
            ));
        }
        let slice = &self.bytes[self.position..self.position + count];
        self.position += count;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self) -> ParseResult<[u8; N]> {
        let slice = self.take(N)?;
        let mut out = [0u8; N];
        out.copy_from_slice(slice);
        Ok(out)
    }

    fn u8(&mut self) -> ParseResult<u8> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> ParseResult<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> ParseResult<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> ParseResult<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A count that will be followed by `count` items of at least `min_item_bytes` each.
    /// Rejects counts the rest of the file cannot possibly hold, so callers may reserve.
    fn count(&mut self, min_item_bytes: usize, what: &str) -> ParseResult<usize> {
        let at = self.position;
        let count = self.u64().map_err(|e| format!("reading {what}: {e}"))?;
        let fits = usize::try_from(count)
            .ok()
            .and_then(|c| c.checked_mul(min_item_bytes))
            .is_some_and(|bytes| bytes <= self.remaining());
        if !fits {
            let need = if min_item_bytes == 1 {
                format!("needs {count} bytes")
            } else {
                format!("needs at least {min_item_bytes} bytes each")
            };
            return Err(format!(
                "{what} {count} (at byte {at}) cannot fit: {need} and only {} bytes remain \
                 (truncated or corrupt file)",
                self.remaining()
            ));
        }
        Ok(count as usize)
    }

    /// A GGUF string: u64 byte length, then UTF-8 bytes (no terminator).
    fn string(&mut self) -> ParseResult<String> {
        let at = self.position;
        let length = self.count(1, "string length")?;
        let bytes = self.take(length)?;
        match std::str::from_utf8(bytes) {
            Ok(text) => Ok(text.to_owned()),
            Err(error) => Err(format!(
                "string at byte {at} (length {length}) is not valid UTF-8: {error}"
            )),
        }
    }
}

/// GGUF metadata value type ids.
mod value_type {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

/// The fewest bytes a value of `type_id` can take on disk, or `None` for an unknown id.
fn min_value_bytes(type_id: u32) -> Option<usize> {
    use value_type::*;
    Some(match type_id {
        U8 | I8 | BOOL => 1,
        U16 | I16 => 2,
        U32 | I32 | F32 => 4,
        U64 | I64 | F64 | STRING => 8,
        ARRAY => 12,
        _ => return None,
    })
}

fn read_value(cursor: &mut Cursor<'_>, type_id: u32, depth: usize) -> ParseResult<MetadataValue> {
    use value_type::*;
    let at = cursor.position;
    Ok(match type_id {
        U8 => MetadataValue::U8(cursor.u8()?),
        I8 => MetadataValue::I8(cursor.u8()? as i8),
        U16 => MetadataValue::U16(cursor.u16()?),
        I16 => MetadataValue::I16(cursor.u16()? as i16),
        U32 => MetadataValue::U32(cursor.u32()?),
        I32 => MetadataValue::I32(cursor.u32()? as i32),
        U64 => MetadataValue::U64(cursor.u64()?),
        I64 => MetadataValue::I64(cursor.u64()? as i64),
        F32 => MetadataValue::F32(f32::from_bits(cursor.u32()?)),
        F64 => MetadataValue::F64(f64::from_bits(cursor.u64()?)),
        BOOL => match cursor.u8()? {
            0 => MetadataValue::Bool(false),
            1 => MetadataValue::Bool(true),
            other => {
                return Err(format!(
                    "bool at byte {at} has value {other} (must be 0 or 1)"
                ))
            }
        },
        STRING => MetadataValue::String(cursor.string()?),
        ARRAY => {
            if depth >= MAX_ARRAY_DEPTH {
                return Err(format!(
                    "array at byte {at} nests deeper than {MAX_ARRAY_DEPTH} levels"
                ));
            }
            let element_type = cursor.u32()?;
            let min_bytes = min_value_bytes(element_type).ok_or_else(|| {
                format!("array at byte {at} has unknown element type {element_type}")
            })?;
            let length = cursor.count(min_bytes, "array length")?;
            let mut elements = Vec::with_capacity(length);
            for index in 0..length {
                let element = read_value(cursor, element_type, depth + 1)
                    .map_err(|e| format!("array element {index}: {e}"))?;
                elements.push(element);
            }
            MetadataValue::Array(elements)
        }
        other => return Err(format!("unknown metadata value type {other} at byte {at}")),
    })
}

/// Reads the magic and version, rejecting v1, unknown versions and big-endian files.
fn read_version(cursor: &mut Cursor<'_>) -> ParseResult<u32> {
    if cursor.remaining() < 8 {
        return Err(format!(
            "file is {} bytes, too short for a GGUF header",
            cursor.bytes.len()
        ));
    }
    let magic = cursor.array::<4>()?;
    match &magic {
        b"GGUF" => {}
        b"FUGG" => return Err("big-endian GGUF files are not supported".into()),
        _ => {
            return Err(format!(
                "not a GGUF file: magic bytes are {magic:02x?}, expected \"GGUF\""
            ))
        }
    }
    let version = cursor.u32()?;
    match version {
        2 | 3 => Ok(version),
        1 => Err("GGUF version 1 is not supported (only versions 2 and 3)".into()),
        other if other.swap_bytes() <= 3 => {
            Err("big-endian GGUF files are not supported (version field is byte-swapped)".into())
        }
        other => Err(format!(
            "unknown GGUF version {other} (only versions 2 and 3 are supported)"
        )),
    }
}

fn read_metadata(cursor: &mut Cursor<'_>) -> ParseResult<BTreeMap<String, MetadataValue>> {
    // Each key/value pair takes at least: key length (8) + value type (4) + 1 value byte.
    let count = cursor.count(13, "metadata key/value count")?;
    let mut metadata = BTreeMap::new();
    for index in 0..count {
        let key = cursor
            .string()
            .map_err(|e| format!("metadata entry {index}: key: {e}"))?;
        let value = cursor
            .u32()
            .and_then(|type_id| read_value(cursor, type_id, 0))
            .map_err(|e| format!("metadata `{key}`: {e}"))?;
        if metadata.contains_key(&key) {
            return Err(format!("metadata key `{key}` appears more than once"));
        }
        metadata.insert(key, value);
    }
    Ok(metadata)
}

/// `general.alignment`: any non-negative integer type, a non-zero power of two.
fn alignment_from(metadata: &BTreeMap<String, MetadataValue>) -> ParseResult<u64> {
    let Some(value) = metadata.get("general.alignment") else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    match value.as_u64() {
        Some(alignment) if alignment.is_power_of_two() => Ok(alignment),
        Some(alignment) => Err(format!(
            "general.alignment is {alignment}, which is not a non-zero power of two"
        )),
        None => Err(format!(
            "general.alignment must be an unsigned integer, found {value:?}"
        )),
    }
}

/// One tensor info as stored: name, dims, type, offset. `n_bytes` is filled in later.
fn read_tensor_info(cursor: &mut Cursor<'_>) -> ParseResult<TensorInfo> {
    let name = cursor.string().map_err(|e| format!("name: {e}"))?;
    let in_tensor = |e: String| format!("tensor `{name}`: {e}");
    let dims_at = cursor.position;
    let num_dims = cursor.u32().map_err(in_tensor)?;
    if num_dims > MAX_DIMS {
        return Err(in_tensor(format!(
            "has {num_dims} dimensions (at byte {dims_at}); at most {MAX_DIMS} are allowed"
        )));
    }
    let mut dims = Vec::with_capacity(num_dims as usize);
    for _ in 0..num_dims {
        dims.push(cursor.u64().map_err(in_tensor)?);
    }
    let ty = GgmlType::from_id(cursor.u32().map_err(in_tensor)?);
    let offset = cursor.u64().map_err(in_tensor)?;
    Ok(TensorInfo {
        name,
        dims,
        ty,
        offset,
        n_bytes: 0,
    })
}

/// Byte size of a tensor of a known type, checking dims, block divisibility and overflow.
fn known_tensor_bytes(info: &TensorInfo) -> ParseResult<Option<u64>> {
    let mut num_values: u64 = 1;
    for &dim in &info.dims {
        if dim > i64::MAX as u64 {
            return Err(format!("dimension {dim} is too large"));
        }
        num_values = num_values
            .checked_mul(dim)
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| format!("dims {:?} overflow the element count", info.dims))?;
    }
    let Some(block_size) = info.ty.block_size() else {
        return Ok(None);
    };
    let row_length = info.dims.first().copied().unwrap_or(1);
    if row_length % block_size as u64 != 0 {
        return Err(format!(
            "row length {row_length} is not a multiple of {}'s block size {block_size}",
            info.ty
        ));
    }
    let num_values = usize::try_from(num_values)
        .map_err(|_| format!("{num_values} elements do not fit in memory"))?;
    let bytes = info
        .ty
        .bytes_for(num_values)
        .ok_or_else(|| format!("byte size of {num_values} {} values overflows", info.ty))?;
    Ok(Some(bytes as u64))
}

/// Parses and validates a whole GGUF file held in `bytes`.
pub(super) fn parse(bytes: &[u8]) -> ParseResult<Header> {
    let mut cursor = Cursor { bytes, position: 0 };
    let version = read_version(&mut cursor)?;
    // Smallest tensor info: name length (8) + n_dims (4) + type (4) + offset (8).
    let tensor_count = cursor.count(24, "tensor count")?;
    let metadata = read_metadata(&mut cursor)?;
    let alignment = alignment_from(&metadata)?;

    let mut tensors = Vec::with_capacity(tensor_count);
    let mut tensor_index = HashMap::with_capacity(tensor_count);
    for index in 0..tensor_count {
        let info =
            read_tensor_info(&mut cursor).map_err(|e| format!("tensor info {index}: {e}"))?;
        if tensor_index.insert(info.name.clone(), index).is_some() {
            return Err(format!(
                "tensor name `{}` appears more than once",
                info.name
            ));
        }
        tensors.push(info);
    }

    let file_length = bytes.len() as u64;
    let data_offset = (cursor.position as u64)
        .checked_next_multiple_of(alignment)
        .ok_or("data section offset overflows")?;
    if !tensors.is_empty() && data_offset > file_length {
        return Err(format!(
            "tensor data section would start at byte {data_offset}, past the end of the \
             {file_length}-byte file"
        ));
    }
    let data_length = file_length.saturating_sub(data_offset);

    for info in &mut tensors {
        let in_tensor = |e: String| format!("tensor `{}`: {e}", info.name);
        if info.offset % alignment != 0 {
            return Err(in_tensor(format!(
                "data offset {} is not a multiple of the alignment {alignment}",
                info.offset
            )));
        }
        if let Some(n_bytes) = known_tensor_bytes(info).map_err(in_tensor)? {
            info.n_bytes = n_bytes;
        }
    }
    // Tensors of a type this reader does not know get every byte up to the next tensor
    // (or the end of the file): an upper bound, since their exact size is unknown.
    let mut starts: Vec<u64> = tensors.iter().map(|t| t.offset).collect();
    starts.sort_unstable();
    for info in &mut tensors {
        if info.ty.block_size().is_none() {
            let next = starts.iter().copied().find(|&s| s > info.offset);
            info.n_bytes = next.unwrap_or(data_length).saturating_sub(info.offset);
        }
    }

    for info in &tensors {
        let end = info.offset.checked_add(info.n_bytes);
        if end.is_none_or(|end| end > data_length) {
            return Err(format!(
                "tensor `{}` ({} {:?}) needs bytes {}..{} of the data section, which has \
                 only {data_length} bytes (file truncated?)",
                info.name,
                info.ty,
                info.dims,
                info.offset,
                end.map_or_else(|| "overflow".to_string(), |e| e.to_string()),
            ));
        }
    }

    Ok(Header {
        version,
        metadata,
        tensors,
        tensor_index,
        alignment,
        data_offset,
    })
}
