//! GGUF dequantization to bf16/f32 at load time, and the small-batch linear layer
//! (`gemv_small`: a few activation rows against a bf16 weight matrix at its read rate).

mod gemv;

pub use gemv::{gemv_small, gemv_small_applies, specialize_gemv_small, GEMV_MAX_ROWS};

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
    pub const ALL: [QuantFormat; 6] = [
        QuantFormat::Q4_0,
        QuantFormat::Q4_1,
        QuantFormat::Q8_0,
        QuantFormat::Q4K,
        QuantFormat::Q5K,
        QuantFormat::Q6K,
    ];

    /// Values per block.
    pub fn block_values(self) -> usize {
        match self {
            QuantFormat::Q4_0 | QuantFormat::Q4_1 | QuantFormat::Q8_0 => 32,
            QuantFormat::Q4K | QuantFormat::Q5K | QuantFormat::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantFormat::Q4_0 => 18,
            QuantFormat::Q4_1 => 20,
            QuantFormat::Q8_0 => 34,
            QuantFormat::Q4K => 144,
            QuantFormat::Q5K => 176,
            QuantFormat::Q6K => 210,
        }
    }

    fn entry(self) -> &'static str {
        match self {
            QuantFormat::Q4_0 => "dequant_q4_0",
            QuantFormat::Q4_1 => "dequant_q4_1",
            QuantFormat::Q8_0 => "dequant_q8_0",
            QuantFormat::Q4K => "dequant_q4_k",
            QuantFormat::Q5K => "dequant_q5_k",
            QuantFormat::Q6K => "dequant_q6_k",
        }
    }
}

/// The dequantization specialisation of `format` to `out` dtype.
pub fn specialize_dequantize(format: QuantFormat, out: DType) -> Result<KernelSpec, CudaError> {
    check_float("dequantize output", out)?;
    Ok(KernelSpec {
        source: &DEQUANT,
        entry: format.entry(),
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
    let spec = specialize_dequantize(format, T::DTYPE)?;
    let num_values = out.len();
    if num_values % format.block_values() != 0 {
        return Err(CudaError::invalid(format!(
            "dequantize {format:?}: {num_values} values are not a whole number of {}-value blocks",
            format.block_values()
        )));
    }
    check_len(
        "dequantize blocks (bytes)",
        num_values / format.block_values() * format.block_bytes(),
        blocks.len(),
    )?;
    let args = [ptr(blocks), ptr(out), KernelArg::U64(num_values as u64)];
    let grid = (to_u32("blocks", num_values.div_ceil(256))?, 1);
    // SAFETY: arguments match the entry; lengths validated.
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, 256), &args) }
}

/// Every specialisation the dequantisation and small-batch launchers can request.
pub fn specializations() -> Result<Vec<KernelSpec>, CudaError> {
    let mut specs = gemv::specializations()?;
    for &dtype in &FLOAT_DTYPES {
        for format in QuantFormat::ALL {
            specs.push(specialize_dequantize(format, dtype)?);
        }
    }
    Ok(specs)
}
