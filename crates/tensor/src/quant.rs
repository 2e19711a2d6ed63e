//! Dequantization of GGML block formats to `f32`.
//!
//! OWNED BY THE GGUF HELPER: replace this stub with the real block decoders.

use crate::{GgmlType, UnsupportedType};

/// Decodes `out.len()` values stored as `ty` in `src` into `out`.
///
/// `src` must hold exactly `ty.bytes_for(out.len())` bytes (callers validate; this panics on a
/// length mismatch because that is a bug in the caller, never bad input).
pub fn dequantize(ty: GgmlType, src: &[u8], out: &mut [f32]) -> Result<(), UnsupportedType> {
    let _ = (src, out);
    Err(UnsupportedType { ty })
}
