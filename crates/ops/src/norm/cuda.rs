//! RMSNorm, the fused residual add + RMSNorm, and RMSNorm writing the q8 activations of the
//! quantized linear layer that reads it besides its output.

use crate::cuda_dtypes::{check_float, FLOAT_DTYPES};
use crate::linear::cuda::Q8Rows;
use pagoda_cuda::{
    check_len, ptr, to_u32, CudaError, DType, DeviceRead, DeviceWrite, Element, Gpu, KernelArg,
    KernelSource, KernelSpec, LaunchDims,
};

mod qkv;
pub use qkv::{add_bias_rows, rms_norm_heads, specialize_qkv, QkvEntry};

/// The CUDA source of this op's `rms_norm.cu` kernels.
pub(crate) static RMS_NORM: KernelSource = KernelSource::new(
    "rms_norm.cu",
    concat!(
        include_str!("../linear/cuda/q8_block.cu"),
        include_str!("cuda/rms_norm.cu")
    ),
);

/// The CUDA source of this op's `qkv.cu` kernels.
pub(crate) static QKV: KernelSource = KernelSource::new("qkv.cu", include_str!("cuda/qkv.cu"));

/// The entry points of `rms_norm.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormEntry {
    /// `rms_norm`.
    RmsNorm,
    /// `add_rms_norm` (residual add fused).
    AddRmsNorm,
    /// `rms_norm_q8` (the output quantized besides, for the quantized linear layer).
    RmsNormQ8,
}

/// The specialisation of `entry` for weight/output dtype `dtype` and input dtype `x_dtype`
/// (`add_rms_norm` needs `x_dtype == dtype`).
pub fn specialize_norm(
    entry: NormEntry,
    dtype: DType,
    x_dtype: DType,
) -> Result<KernelSpec, CudaError> {
    check_float("rms_norm", dtype)?;
    check_float("rms_norm input", x_dtype)?;
    if entry == NormEntry::AddRmsNorm && x_dtype != dtype {
        return Err(CudaError::invalid(
            "add_rms_norm takes one dtype for residual, x and out",
        ));
    }
    Ok(KernelSpec {
        source: &RMS_NORM,
        entry: match entry {
            NormEntry::RmsNorm => "rms_norm",
            NormEntry::AddRmsNorm => "add_rms_norm",
            NormEntry::RmsNormQ8 => "rms_norm_q8",
        },
        params: vec![],
        dtypes: vec![("T", dtype), ("X_T", x_dtype)],
    })
}

/// Threads per row: about four elements each, whole warps, at most 1024 (a kernel launched
/// with one block per row is latency-bound; fewer loads per thread finish sooner).
fn block_for(dim: usize) -> u32 {
    (dim.div_ceil(4).next_multiple_of(32)).clamp(32, 1024) as u32
}

fn rows_of(what: &str, len: usize, dim: usize) -> Result<u32, CudaError> {
    if dim == 0 || !len.is_multiple_of(dim) {
        return Err(CudaError::invalid(format!(
            "{what} has {len} elements, not a whole number of rows of weight length {dim}"
        )));
    }
    to_u32("rows", len / dim)
}

/// `out = x / sqrt(mean(x^2) + eps) * weight` per row; `x` and `out` are `[rows, dim]`,
/// `weight` `[dim]` (`dim = weight.len()`). `out` is fully overwritten. `x` may have another
/// dtype than `weight` and `out` (an f32 residual stream normalised into bf16).
pub fn rms_norm<TX: Element, T: Element>(
    gpu: &Gpu,
    x: &impl DeviceRead<TX>,
    weight: &impl DeviceRead<T>,
    out: &mut impl DeviceWrite<T>,
    eps: f32,
) -> Result<(), CudaError> {
    let spec = specialize_norm(NormEntry::RmsNorm, T::DTYPE, TX::DTYPE)?;
    let dim = weight.len();
    let rows = rows_of("rms_norm x", x.len(), dim)?;
    check_len("rms_norm out [rows, dim]", x.len(), out.len())?;
    let args = [
        ptr(x),
        ptr(weight),
        ptr(out),
        KernelArg::U32(to_u32("dim", dim)?),
        KernelArg::F32(eps),
    ];
    // SAFETY: arguments match `rms_norm`; lengths validated.
    unsafe { gpu.launch(&spec, LaunchDims::new((rows, 1), block_for(dim)), &args) }
}

/// [`rms_norm`] that also quantizes its output into `q8` (rows of `dim` values, `dim` a
/// multiple of 32) for [`crate::linear::cuda::gemv_quant`]: the bytes and scales
/// [`crate::linear::cuda::quantize_rows_q8`] would write from `out`, in the same launch.
pub fn rms_norm_q8<TX: Element, T: Element>(
    gpu: &Gpu,
    x: &impl DeviceRead<TX>,
    weight: &impl DeviceRead<T>,
    out: &mut impl DeviceWrite<T>,
    q8: &mut Q8Rows,
    eps: f32,
) -> Result<(), CudaError> {
    let spec = specialize_norm(NormEntry::RmsNormQ8, T::DTYPE, TX::DTYPE)?;
    let dim = weight.len();
    let rows = rows_of("rms_norm_q8 x", x.len(), dim)?;
    check_len("rms_norm_q8 out [rows, dim]", x.len(), out.len())?;
    let (values, scales) = q8.outputs((rows as usize, dim))?;
    let args = [
        ptr(x),
        ptr(weight),
        ptr(out),
        ptr(values),
        ptr(scales),
        KernelArg::U32(to_u32("dim", dim)?),
        KernelArg::F32(eps),
    ];
    // SAFETY: arguments match `rms_norm_q8`; lengths validated, `q8` holds rows x dim values
    // (dim a multiple of 32: whole warps per block of 32, `block_for` gives whole warps).
    unsafe { gpu.launch(&spec, LaunchDims::new((rows, 1), block_for(dim)), &args) }
}

/// Fused residual add + RMSNorm: `residual += x` (in place, rounded to `T`), then
/// `out = rms_norm(residual)`. All of `residual`, `x`, `out` are `[rows, dim]`.
pub fn add_rms_norm<T: Element>(
    gpu: &Gpu,
    residual: &mut impl DeviceWrite<T>,
    x: &impl DeviceRead<T>,
    weight: &impl DeviceRead<T>,
    out: &mut impl DeviceWrite<T>,
    eps: f32,
) -> Result<(), CudaError> {
    let spec = specialize_norm(NormEntry::AddRmsNorm, T::DTYPE, T::DTYPE)?;
    let dim = weight.len();
    let rows = rows_of("add_rms_norm residual", residual.len(), dim)?;
    check_len("add_rms_norm x [rows, dim]", residual.len(), x.len())?;
    check_len("add_rms_norm out [rows, dim]", residual.len(), out.len())?;
    let args = [
        ptr(residual),
        ptr(x),
        ptr(weight),
        ptr(out),
        KernelArg::U32(to_u32("dim", dim)?),
        KernelArg::F32(eps),
    ];
    // SAFETY: arguments match `add_rms_norm`; lengths validated.
    unsafe { gpu.launch(&spec, LaunchDims::new((rows, 1), block_for(dim)), &args) }
}

/// Every specialisation the norm launchers can request.
pub fn specializations() -> Result<Vec<KernelSpec>, CudaError> {
    let mut specs = Vec::new();
    for &dtype in &FLOAT_DTYPES {
        for &x_dtype in &FLOAT_DTYPES {
            specs.push(specialize_norm(NormEntry::RmsNorm, dtype, x_dtype)?);
            specs.push(specialize_norm(NormEntry::RmsNormQ8, dtype, x_dtype)?);
        }
        specs.push(specialize_norm(NormEntry::AddRmsNorm, dtype, dtype)?);
        for entry in QkvEntry::ALL {
            specs.push(specialize_qkv(entry, dtype)?);
        }
    }
    Ok(specs)
}
