//! GGUF dequantization to bf16/f32 (whole tensors, or the rows of an embedding table kept
//! quantized), and the small-batch linear layers: `gemv_small` (a few activation rows against
//! a bf16 weight matrix at its read rate) and `gemv_quant` (against GGUF blocks in place).

mod gemm_quant_mma;
mod gemv;
mod gemv_fp8;
mod gemv_quant;
mod quant_splits;

pub use gemm_quant_mma::{
    gemm_quant_mma, gemm_quant_mma_pair, specialize_gemm_quant_mma, specialize_gemm_quant_mma_pair,
    QUANT_MMA_MAX_ROWS,
};
pub(crate) use gemv::GEMV_SMALL;
pub use gemv::{gemv_small, gemv_small_applies, specialize_gemv_small, GEMV_MAX_ROWS};
pub use gemv_fp8::{
    dequantize_fp8, fp8_gemm, fp8_gemm_applies, gemv_fp8, gemv_fp8_applies, quantize_rows_fp8,
    specialize_dequant_fp8, specialize_gemv_fp8, specialize_quant_rows_fp8, Fp8Activations,
    FP8_GEMV_MAX_ROWS,
};
pub use gemv_quant::{
    dequantize_fast, gemv_quant, gemv_quant_pair, quantize_rows_q8, specialize_dequant_groups,
    specialize_gemv_quant, specialize_gemv_quant_pair, specialize_quantize_q8, Q8Rows,
    QuantGemvKernel, QuantPartRef, QUANT_GEMV_MAX_ROWS, QUANT_PADDING, QUANT_PAIRS,
};

use crate::cuda_dtypes::{check_float, FLOAT_DTYPES};
use pagoda_cuda::{
    check_len, ptr, to_u32, CudaError, DType, DeviceRead, DeviceWrite, Element, Gpu, KernelArg,
    KernelSource, KernelSpec, LaunchDims,
};

/// The CUDA source of this op's `dequant.cu` kernels.
pub(crate) static DEQUANT: KernelSource =
    KernelSource::new("dequant.cu", include_str!("cuda/dequant.cu"));

/// GGML block formats the GPU dequantizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    /// 32 values, f16 scale, 4-bit.
    Q4_0,
    /// 32 values, f16 scale and min, 4-bit.
    Q4_1,
    /// 32 values, f16 scale, 5-bit (a 32-bit word of fifth bits).
    Q5_0,
    /// 32 values, f16 scale and min, 5-bit.
    Q5_1,
    /// 32 values, f16 scale, 8-bit.
    Q8_0,
    /// 256-value super-block, 4-bit with 6-bit sub-scales/mins.
    Q4K,
    /// 256-value super-block, 5-bit.
    Q5K,
    /// 256-value super-block, 6-bit.
    Q6K,
}

impl QuantFormat {
    /// Every format.
    pub const ALL: [QuantFormat; 8] = [
        QuantFormat::Q4_0,
        QuantFormat::Q4_1,
        QuantFormat::Q5_0,
        QuantFormat::Q5_1,
        QuantFormat::Q8_0,
        QuantFormat::Q4K,
        QuantFormat::Q5K,
        QuantFormat::Q6K,
    ];

    /// Values per block.
    pub fn block_values(self) -> usize {
        match self {
            QuantFormat::Q4_0
            | QuantFormat::Q4_1
            | QuantFormat::Q5_0
            | QuantFormat::Q5_1
            | QuantFormat::Q8_0 => 32,
            QuantFormat::Q4K | QuantFormat::Q5K | QuantFormat::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantFormat::Q4_0 => 18,
            QuantFormat::Q4_1 => 20,
            QuantFormat::Q5_0 => 22,
            QuantFormat::Q5_1 => 24,
            QuantFormat::Q8_0 => 34,
            QuantFormat::Q4K => 144,
            QuantFormat::Q5K => 176,
            QuantFormat::Q6K => 210,
        }
    }

    /// Bytes of a row of `values` values (a whole number of blocks).
    pub fn row_bytes(self, values: usize) -> usize {
        values / self.block_values() * self.block_bytes()
    }

    /// The format's name in kernel entries (`dequant_q4_k`, ...).
    fn suffix(self) -> &'static str {
        match self {
            QuantFormat::Q4_0 => "q4_0",
            QuantFormat::Q4_1 => "q4_1",
            QuantFormat::Q5_0 => "q5_0",
            QuantFormat::Q5_1 => "q5_1",
            QuantFormat::Q8_0 => "q8_0",
            QuantFormat::Q4K => "q4_k",
            QuantFormat::Q5K => "q5_k",
            QuantFormat::Q6K => "q6_k",
        }
    }

    /// The format's number in `gemv_quant.cu` (`PAGODA_FORMAT`; `quant_decode.cu`'s `Format`).
    pub(crate) fn code(self) -> i64 {
        QuantFormat::ALL
            .iter()
            .position(|&f| f == self)
            .expect("every format is in ALL") as i64
    }
}

impl std::fmt::Display for QuantFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.suffix().to_uppercase())
    }
}

/// The dequantization entries: a whole tensor, or rows gathered from a table.
fn entry(format: QuantFormat, gather: bool) -> &'static str {
    macro_rules! entries {
        ($($format:ident => $dequant:literal, $gather:literal;)*) => {
            match format {
                $(QuantFormat::$format => if gather { $gather } else { $dequant },)*
            }
        };
    }
    entries! {
        Q4_0 => "dequant_q4_0", "gather_q4_0";
        Q4_1 => "dequant_q4_1", "gather_q4_1";
        Q5_0 => "dequant_q5_0", "gather_q5_0";
        Q5_1 => "dequant_q5_1", "gather_q5_1";
        Q8_0 => "dequant_q8_0", "gather_q8_0";
        Q4K => "dequant_q4_k", "gather_q4_k";
        Q5K => "dequant_q5_k", "gather_q5_k";
        Q6K => "dequant_q6_k", "gather_q6_k";
    }
}

/// The dequantization specialisation of `format` to `out` dtype: a whole tensor, or (`gather`)
/// rows of a table.
pub fn specialize_dequantize(
    format: QuantFormat,
    out: DType,
    gather: bool,
) -> Result<KernelSpec, CudaError> {
    check_float("dequantize output", out)?;
    Ok(KernelSpec {
        source: &DEQUANT,
        entry: entry(format, gather),
        params: vec![],
        dtypes: vec![("T", out), ("BLOCKS_T", DType::U8)],
    })
}

/// Decodes `out.len()` values stored as `format` in `blocks` into `out` (bit-exact with
/// ggml's scalar dequantization, then rounded to nearest-even `T`). `out.len()` must be a
/// whole number of blocks and `blocks.len()` exactly their bytes.
pub fn dequantize<T: Element>(
    gpu: &Gpu,
    format: QuantFormat,
    blocks: &impl DeviceRead<u8>,
    out: &mut impl DeviceWrite<T>,
) -> Result<(), CudaError> {
    let spec = specialize_dequantize(format, T::DTYPE, false)?;
    let num_values = out.len();
    if num_values % format.block_values() != 0 {
        return Err(CudaError::invalid(format!(
            "dequantize {format:?}: {num_values} values are not a whole number of {}-value blocks",
            format.block_values()
        )));
    }
    let bytes = format.row_bytes(num_values);
    if blocks.len() != bytes && blocks.len() != bytes + QUANT_PADDING {
        check_len("dequantize blocks (bytes)", bytes, blocks.len())?;
    }
    let args = [ptr(blocks), ptr(out), KernelArg::U64(num_values as u64)];
    let grid = (to_u32("blocks", num_values.div_ceil(256))?, 1);
    // SAFETY: arguments match the entry; lengths validated.
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, 256), &args) }
}

/// `out[t, :] = table[ids[t], :]` decoded from a `[num_rows, width]` table of `format` blocks
/// (`width` a whole number of blocks; the table may carry [`QUANT_PADDING`]); an id
/// `>= num_rows` gives a NaN row.
pub fn gather_dequantized<T: Element>(
    gpu: &Gpu,
    format: QuantFormat,
    table: &impl DeviceRead<u8>,
    ids: &impl DeviceRead<u32>,
    out: &mut impl DeviceWrite<T>,
    (num_rows, width): (usize, usize),
) -> Result<(), CudaError> {
    let spec = specialize_dequantize(format, T::DTYPE, true)?;
    if width == 0 || width % format.block_values() != 0 {
        return Err(CudaError::invalid(format!(
            "gather {format}: width {width} is not a whole number of {}-value blocks",
            format.block_values()
        )));
    }
    let bytes = num_rows * format.row_bytes(width);
    if table.len() != bytes && table.len() != bytes + QUANT_PADDING {
        check_len("gather table (bytes)", bytes, table.len())?;
    }
    check_len("gather out [tokens, width]", ids.len() * width, out.len())?;
    if ids.is_empty() {
        return Ok(());
    }
    let args = [
        ptr(table),
        ptr(ids),
        ptr(out),
        KernelArg::U32(to_u32("width", width)?),
        KernelArg::U32(to_u32("num_rows", num_rows)?),
    ];
    let grid = (
        to_u32("gather blocks", width.div_ceil(256))?,
        to_u32("gather tokens", ids.len())?,
    );
    // SAFETY: arguments match the entry; lengths validated.
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, 256), &args) }
}

/// Every specialisation the dequantisation and small-batch launchers can request.
pub fn specializations() -> Result<Vec<KernelSpec>, CudaError> {
    let mut specs = gemv::specializations()?;
    specs.extend(gemv_fp8::specializations()?);
    specs.extend(gemv_quant::specializations()?);
    specs.extend(gemm_quant_mma::specializations()?);
    for &dtype in &FLOAT_DTYPES {
        for format in QuantFormat::ALL {
            for gather in [false, true] {
                specs.push(specialize_dequantize(format, dtype, gather)?);
            }
        }
    }
    Ok(specs)
}
