//! Typed access to GGUF metadata values.

use super::{GgufError, GgufFile, MetadataValue};

impl MetadataValue {
    /// The value as a `u64` if it is an integer of any width that is non-negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetadataValue::U8(v) => Some(v.into()),
            MetadataValue::U16(v) => Some(v.into()),
            MetadataValue::U32(v) => Some(v.into()),
            MetadataValue::U64(v) => Some(v),
            MetadataValue::I8(v) => u64::try_from(v).ok(),
            MetadataValue::I16(v) => u64::try_from(v).ok(),
            MetadataValue::I32(v) => u64::try_from(v).ok(),
            MetadataValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as an `i64` if it is an integer of any width that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetadataValue::I8(v) => Some(v.into()),
            MetadataValue::I16(v) => Some(v.into()),
            MetadataValue::I32(v) => Some(v.into()),
            MetadataValue::I64(v) => Some(v),
            MetadataValue::U8(v) => Some(v.into()),
            MetadataValue::U16(v) => Some(v.into()),
            MetadataValue::U32(v) => Some(v.into()),
            MetadataValue::U64(v) => i64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as an `f32`: an `F32` as is, an `F64` rounded, or an integer converted.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            MetadataValue::F32(v) => Some(v),
            MetadataValue::F64(v) => Some(v as f32),
            _ => self.as_i64().map(|v| v as f32),
        }
    }

    /// The value if it is a `Bool`.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetadataValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// The value if it is a `String`.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetadataValue::String(v) => Some(v),
            _ => None,
        }
    }

    /// The elements if the value is an `Array`.
    pub fn as_array(&self) -> Option<&[MetadataValue]> {
        match self {
            MetadataValue::Array(v) => Some(v),
            _ => None,
        }
    }

    /// The GGUF name of the value's type, for error messages (`"u32"`, `"array"`, ...).
    pub fn type_name(&self) -> &'static str {
        match self {
            MetadataValue::U8(_) => "u8",
            MetadataValue::I8(_) => "i8",
            MetadataValue::U16(_) => "u16",
            MetadataValue::I16(_) => "i16",
            MetadataValue::U32(_) => "u32",
            MetadataValue::I32(_) => "i32",
            MetadataValue::U64(_) => "u64",
            MetadataValue::I64(_) => "i64",
            MetadataValue::F32(_) => "f32",
            MetadataValue::F64(_) => "f64",
            MetadataValue::Bool(_) => "bool",
            MetadataValue::String(_) => "string",
            MetadataValue::Array(_) => "array",
        }
    }
}

/// Typed getters. Each fails with a [`GgufError`] naming the file and key when the key is
/// missing or holds a value of the wrong type or range; for optional keys use
/// [`GgufFile::get`] with the `MetadataValue::as_*` accessors.
impl GgufFile {
    fn metadata_error(&self, key: &str, what: String) -> GgufError {
        GgufError {
            path: self.path.clone(),
            kind: format!("metadata `{key}`: {what}"),
        }
    }

    fn require(&self, key: &str) -> Result<&MetadataValue, GgufError> {
        self.get(key)
            .ok_or_else(|| self.metadata_error(key, "missing".into()))
    }

    fn typed<'a, T>(
        &'a self,
        key: &str,
        expected: &str,
        convert: impl FnOnce(&'a MetadataValue) -> Option<T>,
    ) -> Result<T, GgufError> {
        let value = self.require(key)?;
        convert(value).ok_or_else(|| {
            self.metadata_error(
                key,
                format!("expected {expected}, found {}", describe(value)),
            )
        })
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        self.typed(key, "a string", MetadataValue::as_str)
    }

    /// An integer value of any width that fits in `u32`.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        self.typed(key, "an integer in u32 range", |v| {
            v.as_u64().and_then(|n| u32::try_from(n).ok())
        })
    }

    /// An integer value of any width that fits in `u64`.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.typed(key, "a non-negative integer", MetadataValue::as_u64)
    }

    /// An integer value of any width that fits in `usize`.
    pub fn get_usize(&self, key: &str) -> Result<usize, GgufError> {
        self.typed(key, "an integer in usize range", |v| {
            v.as_u64().and_then(|n| usize::try_from(n).ok())
        })
    }

    /// An integer value of any width that fits in `i64`.
    pub fn get_i64(&self, key: &str) -> Result<i64, GgufError> {
        self.typed(key, "an integer", MetadataValue::as_i64)
    }

    /// A float (`f32`, `f64` rounded to `f32`, or an integer converted).
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        self.typed(key, "a number", MetadataValue::as_f32)
    }

    /// A bool value.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        self.typed(key, "a bool", MetadataValue::as_bool)
    }

    /// An array value's elements.
    pub fn get_array(&self, key: &str) -> Result<&[MetadataValue], GgufError> {
        self.typed(key, "an array", MetadataValue::as_array)
    }

    /// An array of strings (e.g. `tokenizer.ggml.tokens`), borrowed.
    pub fn get_string_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        self.typed_array(key, "strings", MetadataValue::as_str)
    }

    /// An array of numbers as `f32` (e.g. `tokenizer.ggml.scores`).
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>, GgufError> {
        self.typed_array(key, "numbers", MetadataValue::as_f32)
    }

    /// An array of integers that fit in `i32` (e.g. `tokenizer.ggml.token_type`).
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>, GgufError> {
        self.typed_array(key, "integers in i32 range", |v| {
            v.as_i64().and_then(|n| i32::try_from(n).ok())
        })
    }

    fn typed_array<'a, T>(
        &'a self,
        key: &str,
        expected: &str,
        convert: impl Fn(&'a MetadataValue) -> Option<T>,
    ) -> Result<Vec<T>, GgufError> {
        let elements = self.get_array(key)?;
        elements
            .iter()
            .enumerate()
            .map(|(index, element)| {
                convert(element).ok_or_else(|| {
                    self.metadata_error(
                        key,
                        format!(
                            "expected an array of {expected}, element {index} is {}",
                            describe(element)
                        ),
                    )
                })
            })
            .collect()
    }
}

/// `"<type> <debug text>"`, the debug text cut to about 80 characters.
fn describe(value: &MetadataValue) -> String {
    let mut text = format!("{value:?}");
    if let Some((cut, _)) = text.char_indices().nth(80) {
        text.truncate(cut);
        text.push_str("...");
    }
    format!("{} {text}", value.type_name())
}
