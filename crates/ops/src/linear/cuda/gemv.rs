//! The small-batch linear layer (`gemv_small.cu`): `out = beta * out + x w^T` for at most
//! [`GEMV_MAX_ROWS`] rows of bf16 activations against a bf16 weight matrix, on CUDA cores at
//! the weights' read rate, where cuBLAS's tensor-core tiles pad the rows to 16 or more.

use pagoda_cuda::{
    check_len, ptr, to_u32, CudaError, DType, DeviceRead, DeviceWrite, Element, Gpu, KernelArg,
    KernelSource, KernelSpec, LaunchDims,
};

/// The CUDA source of the small-batch kernel.
pub(crate) static GEMV_SMALL: KernelSource =
    KernelSource::new("gemv_small.cu", include_str!("gemv_small.cu"));

/// Activation rows the small-batch kernel takes at most.
pub const GEMV_MAX_ROWS: usize = 8;

/// Weight rows (outputs) per CTA: eight warps of four rows (`WARPS * ROWS` in the kernel).
const ROWS_PER_CTA: usize = 32;

/// The `gemv_small` specialisation for `rows` activation rows (1..=[`GEMV_MAX_ROWS`], rounded
/// up to a power of two) writing `out` (f32 or bf16).
pub fn specialize_gemv_small(out: DType, rows: usize) -> Result<KernelSpec, CudaError> {
    if !matches!(out, DType::F32 | DType::BF16) {
        return Err(CudaError::invalid(format!(
            "small-batch linear writes f32 or bf16, not {out}"
        )));
    }
    if !(1..=GEMV_MAX_ROWS).contains(&rows) {
        return Err(CudaError::invalid(format!(
            "small-batch linear takes 1..={GEMV_MAX_ROWS} rows, not {rows}"
        )));
    }
    Ok(KernelSpec {
        source: &GEMV_SMALL,
        entry: "gemv_small",
        params: vec![("M_TILE", rows.next_power_of_two() as i64)],
        dtypes: vec![("T_OUT", out)],
    })
}

/// Whether [`gemv_small`] takes `x [m, k] w [n, k]^T`: bf16 inputs, 1..=[`GEMV_MAX_ROWS`]
/// rows, `k` a multiple of 8, both 16-byte aligned.
pub fn gemv_small_applies<TIn: Element>(
    x: &impl DeviceRead<TIn>,
    w: &impl DeviceRead<TIn>,
    (m, _, k): (usize, usize, usize),
) -> bool {
    TIn::DTYPE == DType::BF16
        && (1..=GEMV_MAX_ROWS).contains(&m)
        && k.is_multiple_of(8)
        && (x.device_ptr() | w.device_ptr()).is_multiple_of(16)
}

/// `out [m, n] = beta * out + x [m, k] w [n, k]^T` with f32 accumulation (the contract of
/// `Gpu::gemm`) for the products [`gemv_small_applies`] accepts.
pub fn gemv_small<TIn: Element, TOut: Element>(
    gpu: &Gpu,
    x: &impl DeviceRead<TIn>,
    w: &impl DeviceRead<TIn>,
    out: &mut impl DeviceWrite<TOut>,
    (m, n, k): (usize, usize, usize),
    beta: f32,
) -> Result<(), CudaError> {
    if !gemv_small_applies(x, w, (m, n, k)) || n == 0 {
        return Err(CudaError::invalid(format!(
            "small-batch linear needs bf16 inputs, 1..={GEMV_MAX_ROWS} rows, n >= 1, k a \
             multiple of 8 and 16-byte aligned inputs (have {} m {m} n {n} k {k})",
            TIn::DTYPE
        )));
    }
    let spec = specialize_gemv_small(TOut::DTYPE, m)?;
    check_len("small-batch linear x [m, k]", m * k, x.len())?;
    check_len("small-batch linear w [n, k]", n * k, w.len())?;
    check_len("small-batch linear out [m, n]", m * n, out.len())?;
    let args = [
        ptr(x),
        ptr(w),
        ptr(out),
        KernelArg::U32(to_u32("m", m)?),
        KernelArg::U32(to_u32("n", n)?),
        KernelArg::U32(to_u32("k", k)?),
        KernelArg::F32(beta),
    ];
    let grid = (
        to_u32("small-batch linear CTAs", n.div_ceil(ROWS_PER_CTA))?,
        1,
    );
    // SAFETY: arguments match `gemv_small`; lengths, alignment and k validated.
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, 256), &args) }
}

/// Every specialisation the small-batch launcher can request.
pub fn specializations() -> Result<Vec<KernelSpec>, CudaError> {
    let mut specs = Vec::new();
    for out in [DType::F32, DType::BF16] {
        for rows in [1, 2, 4, 8] {
            specs.push(specialize_gemv_small(out, rows)?);
        }
    }
    Ok(specs)
}
