//! Element and block types shared by every pagoda crate.
//!
//! [`GgmlType`] names the storage formats a GGUF tensor can have (plain floats and the GGML
//! block-quantized formats); [`quant`] turns rows of any supported format into `f32`.
//! This crate has no device dependency.

pub mod dtype;
pub mod element;
pub mod quant;

pub use dtype::{GgmlType, UnsupportedType};
pub use element::DType;
