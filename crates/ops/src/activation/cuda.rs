//! SiLU-and-multiply (also writing the q8 activations of the quantized linear layer that
//! reads it), the residual add and greedy argmax.

use crate::cuda_dtypes::{check_float, FLOAT_DTYPES};
use crate::linear::cuda::Q8Rows;
use pagoda_cuda::{
    check_len, check_min_len, ptr, to_u32, CudaError, DType, DeviceRead, DeviceWrite, Element, Gpu,
    KernelArg, KernelSource, KernelSpec, LaunchDims,
};

/// The CUDA source of this op's `elementwise.cu` kernels.
pub(crate) static ELEMENTWISE: KernelSource = KernelSource::new(
    "elementwise.cu",
    concat!(
        include_str!("../linear/cuda/q8_block.cu"),
        include_str!("cuda/elementwise.cu")
    ),
);

/// The entry points of `elementwise.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElementwiseEntry {
    /// `silu_mul`.
    SiluMul,
    /// `silu_mul_q8` (the output quantized besides, for the quantized linear layer).
    SiluMulQ8,
    /// `add_in_place`.
    AddInPlace,
    /// `argmax_rows` (f32 logits only).
    ArgmaxRows,
}

/// The specialisation of `entry` for `dtype` (`ArgmaxRows` accepts only f32).
pub fn specialize_elementwise(
    entry: ElementwiseEntry,
    dtype: DType,
) -> Result<KernelSpec, CudaError> {
    check_float("elementwise", dtype)?;
    let (name, dtypes) = match entry {
        ElementwiseEntry::SiluMul => ("silu_mul", vec![("T", dtype)]),
        ElementwiseEntry::SiluMulQ8 => ("silu_mul_q8", vec![("T", dtype)]),
        ElementwiseEntry::AddInPlace => ("add_in_place", vec![("T", dtype)]),
        ElementwiseEntry::ArgmaxRows => {
            if dtype != DType::F32 {
                return Err(CudaError::invalid(format!(
                    "argmax_rows takes f32 logits, not {dtype}"
                )));
            }
            // The source's typed buffers are f32 logits and u32 ids; T is unused but named.
            (
                "argmax_rows",
                vec![
                    ("T", DType::F32),
                    ("LOGITS_T", DType::F32),
                    ("IDS_T", DType::U32),
                ],
            )
        }
    };
    Ok(KernelSpec {
        source: &ELEMENTWISE,
        entry: name,
        params: vec![],
        dtypes,
    })
}

/// `out[t, i] = silu(gate[t, i]) * up[t, i]`, `silu(x) = x / (1 + e^-x)`, for `i < width`;
/// `out` is `[num_tokens, width]` (`num_tokens = out.len() / width`); `gate`/`up` rows are
/// `gate_row_stride`/`up_row_stride` apart (so a fused `[gate | up]` GEMM output works).
pub fn silu_mul<T: Element>(
    gpu: &Gpu,
    gate: &impl DeviceRead<T>,
    up: &impl DeviceRead<T>,
    out: &mut impl DeviceWrite<T>,
    width: usize,
    strides: (usize, usize),
) -> Result<(), CudaError> {
    silu_mul_with(gpu, (gate, up), out, None, width, strides)
}

/// [`silu_mul`] that also quantizes its output into `q8` (`width` a multiple of 32) for
/// [`crate::linear::cuda::gemv_quant`]: the bytes and scales
/// [`crate::linear::cuda::quantize_rows_q8`] would write from `out`, in the same launch.
pub fn silu_mul_q8<T: Element>(
    gpu: &Gpu,
    (gate, up): (&impl DeviceRead<T>, &impl DeviceRead<T>),
    out: &mut impl DeviceWrite<T>,
    q8: &mut Q8Rows,
    width: usize,
    strides: (usize, usize),
) -> Result<(), CudaError> {
    silu_mul_with(gpu, (gate, up), out, Some(q8), width, strides)
}

fn silu_mul_with<T: Element>(
    gpu: &Gpu,
    (gate, up): (&impl DeviceRead<T>, &impl DeviceRead<T>),
    out: &mut impl DeviceWrite<T>,
    q8: Option<&mut Q8Rows>,
    width: usize,
    (gate_row_stride, up_row_stride): (usize, usize),
) -> Result<(), CudaError> {
    let entry = match q8 {
        Some(_) => ElementwiseEntry::SiluMulQ8,
        None => ElementwiseEntry::SiluMul,
    };
    let spec = specialize_elementwise(entry, T::DTYPE)?;
    if width == 0 || out.len() % width != 0 || gate_row_stride < width || up_row_stride < width {
        return Err(CudaError::invalid(format!(
            "silu_mul: width {width}, out {} elements, row strides ({gate_row_stride}, {up_row_stride}): \
             need out = [num_tokens, width] and strides >= width",
            out.len()
        )));
    }
    let num_tokens = out.len() / width;
    if num_tokens > 65535 {
        return Err(CudaError::invalid(format!(
            "silu_mul: {num_tokens} tokens > 65535 per launch"
        )));
    }
    if num_tokens > 0 {
        check_min_len(
            "silu_mul gate",
            (num_tokens - 1) * gate_row_stride + width,
            gate.len(),
        )?;
        check_min_len(
            "silu_mul up",
            (num_tokens - 1) * up_row_stride + width,
            up.len(),
        )?;
    }
    let mut args = vec![ptr(gate), ptr(up), ptr(out)];
    if let Some(q8) = q8 {
        let (values, scales) = q8.outputs((num_tokens, width))?;
        args.extend([ptr(values), ptr(scales)]);
    }
    args.extend([
        KernelArg::U32(to_u32("width", width)?),
        KernelArg::U32(to_u32("gate_row_stride", gate_row_stride)?),
        KernelArg::U32(to_u32("up_row_stride", up_row_stride)?),
    ]);
    let grid = (to_u32("blocks", width.div_ceil(256))?, num_tokens as u32);
    // SAFETY: arguments match `silu_mul` (or `silu_mul_q8`: `q8` holds num_tokens x width
    // values, width a multiple of 32 checked by `outputs`); extents validated.
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, 256), &args) }
}

/// `accumulator[i] += x[i]` (the residual add), rounded to `T`. Lengths must match.
pub fn add_in_place<T: Element>(
    gpu: &Gpu,
    accumulator: &mut impl DeviceWrite<T>,
    x: &impl DeviceRead<T>,
) -> Result<(), CudaError> {
    let spec = specialize_elementwise(ElementwiseEntry::AddInPlace, T::DTYPE)?;
    check_len("add_in_place x", accumulator.len(), x.len())?;
    let len = accumulator.len();
    let args = [ptr(accumulator), ptr(x), KernelArg::U64(len as u64)];
    let grid = (to_u32("blocks", len.div_ceil(256))?, 1);
    // SAFETY: arguments match `add_in_place`; lengths validated.
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, 256), &args) }
}

/// Greedy argmax of each row of `logits` (`[rows, cols]`, f32) into `token_ids [rows]`:
/// the first index of the largest value; NaN never wins; an all -inf/NaN row gives 0.
pub fn argmax_rows(
    gpu: &Gpu,
    logits: &impl DeviceRead<f32>,
    token_ids: &mut impl DeviceWrite<u32>,
    cols: usize,
) -> Result<(), CudaError> {
    let spec = specialize_elementwise(ElementwiseEntry::ArgmaxRows, DType::F32)?;
    if cols == 0 || cols > u32::MAX as usize - 1 {
        return Err(CudaError::invalid(format!(
            "argmax_rows: cols {cols} must be in 1..u32::MAX"
        )));
    }
    check_len(
        "argmax logits [rows, cols]",
        token_ids.len() * cols,
        logits.len(),
    )?;
    let args = [ptr(logits), ptr(token_ids), KernelArg::U32(cols as u32)];
    let grid = (to_u32("rows", token_ids.len())?, 1);
    // SAFETY: arguments match `argmax_rows`; lengths validated.
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, 1024), &args) }
}

/// Every specialisation the elementwise launchers can request.
pub fn specializations() -> Result<Vec<KernelSpec>, CudaError> {
    let mut specs = Vec::new();
    for &dtype in &FLOAT_DTYPES {
        for entry in [
            ElementwiseEntry::SiluMul,
            ElementwiseEntry::SiluMulQ8,
            ElementwiseEntry::AddInPlace,
        ] {
            specs.push(specialize_elementwise(entry, dtype)?);
        }
    }
    specs.push(specialize_elementwise(
        ElementwiseEntry::ArgmaxRows,
        DType::F32,
    )?);
    Ok(specs)
}
