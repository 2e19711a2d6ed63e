//! The GGML storage types and their block geometry.

/// Storage format of a tensor as stored in a GGUF file (the `ggml_type` enum).
///
/// Quantized formats store `block_size()` consecutive values of a row in `type_size()` bytes.
/// Rows always hold a whole number of blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    I8,
    I16,
    I32,
    I64,
    F64,
    BF16,
    /// A type id this reader knows exists but cannot decode (IQ quants, ternary types, ...).
    Other(u32),
}

/// Raised when a tensor has a storage type pagoda cannot decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("tensor type {ty} is not supported (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)")]
pub struct UnsupportedType {
    pub ty: GgmlType,
}

impl GgmlType {
    /// Maps the on-disk `ggml_type` id to a type. Unknown ids become [`GgmlType::Other`].
    pub fn from_id(id: u32) -> GgmlType {
        use GgmlType::*;
        match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2K,
            11 => Q3K,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            15 => Q8K,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            30 => BF16,
            other => Other(other),
        }
    }

    /// The on-disk `ggml_type` id.
    pub fn id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2K => 10,
            Q3K => 11,
            Q4K => 12,
            Q5K => 13,
            Q6K => 14,
            Q8K => 15,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            BF16 => 30,
            Other(id) => id,
        }
    }

    /// Number of values in one block (1 for plain types). `None` for [`GgmlType::Other`].
    pub fn block_size(self) -> Option<usize> {
        use GgmlType::*;
        Some(match self {
            F32 | F16 | BF16 | I8 | I16 | I32 | I64 | F64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 => 32,
            Q2K | Q3K | Q4K | Q5K | Q6K | Q8K => 256,
            Other(_) => return None,
        })
    }

    /// Bytes in one block. `None` for [`GgmlType::Other`].
    pub fn type_size(self) -> Option<usize> {
        use GgmlType::*;
        Some(match self {
            F32 | I32 => 4,
            F16 | BF16 | I16 => 2,
            I8 => 1,
            I64 | F64 => 8,
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q8_1 => 36,
            Q2K => 84,
            Q3K => 110,
            Q4K => 144,
            Q5K => 176,
            Q6K => 210,
            Q8K => 292,
            Other(_) => return None,
        })
    }

    /// Bytes needed for `n` values, or `None` when `n` is not a whole number of blocks,
    /// the type is unknown, or the size overflows.
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        let block = self.block_size()?;
        if !n.is_multiple_of(block) {
            return None;
        }
        (n / block).checked_mul(self.type_size()?)
    }

    /// Whether [`crate::quant::dequantize`] can decode this type.
    pub fn is_dequantizable(self) -> bool {
        use GgmlType::*;
        matches!(
            self,
            F32 | F16 | BF16 | Q8_0 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q2K | Q3K | Q4K | Q5K | Q6K
        )
    }

    /// Whether the type is a block-quantized format.
    pub fn is_quantized(self) -> bool {
        self.block_size().is_some_and(|b| b > 1)
    }

    /// The name GGML uses (`"Q4_K"`, `"F16"`, ...).
    pub fn name(self) -> String {
        use GgmlType::*;
        match self {
            F32 => "F32".into(),
            F16 => "F16".into(),
            Q4_0 => "Q4_0".into(),
            Q4_1 => "Q4_1".into(),
            Q5_0 => "Q5_0".into(),
            Q5_1 => "Q5_1".into(),
            Q8_0 => "Q8_0".into(),
            Q8_1 => "Q8_1".into(),
            Q2K => "Q2_K".into(),
            Q3K => "Q3_K".into(),
            Q4K => "Q4_K".into(),
            Q5K => "Q5_K".into(),
            Q6K => "Q6_K".into(),
            Q8K => "Q8_K".into(),
            I8 => "I8".into(),
            I16 => "I16".into(),
            I32 => "I32".into(),
            I64 => "I64".into(),
            F64 => "F64".into(),
            BF16 => "BF16".into(),
            Other(id) => format!("type#{id}"),
        }
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}
