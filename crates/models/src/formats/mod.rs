//! On-disk model formats.

pub mod gguf;
pub mod safetensors;
