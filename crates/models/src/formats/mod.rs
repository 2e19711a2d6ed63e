//! On-disk model formats.

pub mod fp8;
pub mod gguf;
pub mod safetensors;
