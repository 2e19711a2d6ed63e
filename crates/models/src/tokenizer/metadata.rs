//! Typed reads of GGUF metadata values, with errors that name the key.

use std::collections::BTreeMap;

use super::TokenizerError;
use crate::formats::gguf::MetadataValue;

/// The GGUF metadata map.
pub(crate) type Metadata = BTreeMap<String, MetadataValue>;

fn wrong_type(key: &str, expected: &str, value: &MetadataValue) -> TokenizerError {
    let found = match value {
        MetadataValue::Array(items) => format!("an array of {} values", items.len()),
        other => format!("{other:?}"),
    };
    TokenizerError::Metadata(format!("`{key}` should be {expected}, found {found}"))
}

fn as_i64(value: &MetadataValue) -> Option<i64> {
    Some(match *value {
        MetadataValue::U8(v) => v.into(),
        MetadataValue::I8(v) => v.into(),
        MetadataValue::U16(v) => v.into(),
        MetadataValue::I16(v) => v.into(),
        MetadataValue::U32(v) => v.into(),
        MetadataValue::I32(v) => v.into(),
        MetadataValue::U64(v) => i64::try_from(v).ok()?,
        MetadataValue::I64(v) => v,
        _ => return None,
    })
}

/// A string value; `Ok(None)` when the key is absent.
pub(crate) fn string<'a>(
    metadata: &'a Metadata,
    key: &str,
) -> Result<Option<&'a str>, TokenizerError> {
    match metadata.get(key) {
        None => Ok(None),
        Some(MetadataValue::String(s)) => Ok(Some(s)),
        Some(other) => Err(wrong_type(key, "a string", other)),
    }
}

/// A boolean value (integers 0/1 accepted); `Ok(None)` when absent.
pub(crate) fn boolean(metadata: &Metadata, key: &str) -> Result<Option<bool>, TokenizerError> {
    match metadata.get(key) {
        None => Ok(None),
        Some(MetadataValue::Bool(b)) => Ok(Some(*b)),
        Some(other) => match as_i64(other) {
            Some(0) => Ok(Some(false)),
            Some(1) => Ok(Some(true)),
            _ => Err(wrong_type(key, "a boolean", other)),
        },
    }
}

/// A token id, checked against `vocab_size`; `Ok(None)` when absent or negative (llama.cpp
/// writes -1 for "none").
pub(crate) fn token_id(
    metadata: &Metadata,
    key: &str,
    vocab_size: usize,
) -> Result<Option<u32>, TokenizerError> {
    let Some(value) = metadata.get(key) else {
        return Ok(None);
    };
    let id = as_i64(value).ok_or_else(|| wrong_type(key, "an integer token id", value))?;
    if id < 0 {
        return Ok(None);
    }
    if id as u64 >= vocab_size as u64 {
        return Err(TokenizerError::Metadata(format!(
            "`{key}` = {id} is outside the vocabulary of {vocab_size} tokens"
        )));
    }
    Ok(Some(id as u32))
}

fn array<'a>(
    metadata: &'a Metadata,
    key: &str,
) -> Result<Option<&'a [MetadataValue]>, TokenizerError> {
    match metadata.get(key) {
        None => Ok(None),
        Some(MetadataValue::Array(items)) => Ok(Some(items)),
        Some(other) => Err(wrong_type(key, "an array", other)),
    }
}

/// An array of strings; `Ok(None)` when absent.
pub(crate) fn string_array(
    metadata: &Metadata,
    key: &str,
) -> Result<Option<Vec<String>>, TokenizerError> {
    let Some(items) = array(metadata, key)? else {
        return Ok(None);
    };
    items
        .iter()
        .enumerate()
        .map(|(index, item)| match item {
            MetadataValue::String(s) => Ok(s.clone()),
            other => Err(wrong_type(&format!("{key}[{index}]"), "a string", other)),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// An array of integers; `Ok(None)` when absent.
pub(crate) fn int_array(
    metadata: &Metadata,
    key: &str,
) -> Result<Option<Vec<i64>>, TokenizerError> {
    let Some(items) = array(metadata, key)? else {
        return Ok(None);
    };
    items
        .iter()
        .enumerate()
        .map(|(index, item)| {
            as_i64(item).ok_or_else(|| wrong_type(&format!("{key}[{index}]"), "an integer", item))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// An array of floats (integers accepted); `Ok(None)` when absent.
pub(crate) fn float_array(
    metadata: &Metadata,
    key: &str,
) -> Result<Option<Vec<f32>>, TokenizerError> {
    let Some(items) = array(metadata, key)? else {
        return Ok(None);
    };
    items
        .iter()
        .enumerate()
        .map(|(index, item)| match *item {
            MetadataValue::F32(v) => Ok(v),
            MetadataValue::F64(v) => Ok(v as f32),
            ref other => as_i64(other)
                .map(|v| v as f32)
                .ok_or_else(|| wrong_type(&format!("{key}[{index}]"), "a float", other)),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}
