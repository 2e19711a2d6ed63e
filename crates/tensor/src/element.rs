//! Element types of buffers in memory.

/// Element type of a buffer in memory (activations, weights in a float format, the KV cache,
/// ids and indptrs): the one dtype enum of tensor, ops and cuda. Storage formats of model
/// files, quantized blocks included, are [`crate::GgmlType`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// IEEE single.
    F32,
    /// bfloat16.
    BF16,
    /// IEEE half.
    F16,
    /// 32-bit unsigned integer (ids, indptrs).
    U32,
    /// 32-bit signed integer (slots).
    I32,
    /// Raw bytes (quantized blocks).
    U8,
}

impl DType {
    /// Stable lowercase name used in keys and messages.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::U32 => "u32",
            DType::I32 => "i32",
            DType::U8 => "u8",
        }
    }

    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::U32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::U8 => 1,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(self.name())
    }
}
