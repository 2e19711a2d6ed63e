//! FP8 (e4m3) weights with one f32 factor per output row, kept on the device in their bytes
//! (`gemv_fp8.cu`): `gemv_fp8` multiplies up to [`FP8_GEMV_MAX_ROWS`] bf16 activation rows in
//! place (decode), `dequantize_fp8` decodes the matrix into a dense scratch for the GEMM of
//! more rows (prefill).

use pagoda_cuda::{
    check_len, ptr, to_u32, view, view_mut, CudaError, DType, DeviceBuffer, DeviceRead,
    DeviceWrite, Element, Gpu, KernelArg, KernelSource, KernelSpec, LaunchDims,
};

use crate::cuda_dtypes::{check_float, FLOAT_DTYPES};

/// The CUDA source of the FP8 kernels.
pub(crate) static GEMV_FP8: KernelSource = KernelSource::new(
    "gemv_fp8.cu",
    concat!(
        include_str!("../../attention/cuda/kv_fp8.cu"),
        include_str!("gemv_fp8.cu")
    ),
);

/// Activation rows the in-place FP8 kernel takes at most.
pub const FP8_GEMV_MAX_ROWS: usize = 16;

/// Weight rows (outputs) per CTA: eight warps of four rows (`WARPS * ROWS` in the kernel).
const ROWS_PER_CTA: usize = 32;

/// The `gemv_fp8` specialisation for `rows` activation rows (1..=[`FP8_GEMV_MAX_ROWS`],
/// rounded up to a power of two) writing `out` (f32 or bf16).
pub fn specialize_gemv_fp8(out: DType, rows: usize) -> Result<KernelSpec, CudaError> {
    check_float("FP8 linear output", out)?;
    if !(1..=FP8_GEMV_MAX_ROWS).contains(&rows) {
        return Err(CudaError::invalid(format!(
            "FP8 linear takes 1..={FP8_GEMV_MAX_ROWS} rows, not {rows}"
        )));
    }
    Ok(KernelSpec {
        source: &GEMV_FP8,
        entry: "gemv_fp8",
        params: vec![("M_TILE", rows.next_power_of_two() as i64)],
        dtypes: vec![("T_OUT", out)],
    })
}

/// The `dequant_fp8` specialisation writing `out`.
pub fn specialize_dequant_fp8(out: DType) -> Result<KernelSpec, CudaError> {
    check_float("FP8 dequantization output", out)?;
    Ok(KernelSpec {
        source: &GEMV_FP8,
        entry: "dequant_fp8",
        params: Vec::new(),
        dtypes: vec![("T", out)],
    })
}

/// Whether [`gemv_fp8`] takes `x [m, k]` (bf16) against an e4m3 `w [n, k]`: 1..=
/// [`FP8_GEMV_MAX_ROWS`] rows, `k` a multiple of 16, both 16-byte aligned.
pub fn gemv_fp8_applies<TIn: Element>(
    x: &impl DeviceRead<TIn>,
    w: &impl DeviceRead<u8>,
    (m, _, k): (usize, usize, usize),
) -> bool {
    TIn::DTYPE == DType::BF16
        && (1..=FP8_GEMV_MAX_ROWS).contains(&m)
        && k.is_multiple_of(16)
        && (x.device_ptr() | w.device_ptr()).is_multiple_of(16)
}

/// `out [m, n] = beta * out + (x [m, k] code(w) [n, k]^T) * scales [n]` (each output column
/// times its row's factor), f32 accumulation, for the products [`gemv_fp8_applies`] accepts.
pub fn gemv_fp8<TIn: Element, TOut: Element>(
    gpu: &Gpu,
    x: &impl DeviceRead<TIn>,
    (w, scales): (&impl DeviceRead<u8>, &impl DeviceRead<f32>),
    out: &mut impl DeviceWrite<TOut>,
    (m, n, k): (usize, usize, usize),
    beta: f32,
) -> Result<(), CudaError> {
    if !gemv_fp8_applies(x, w, (m, n, k)) || n == 0 {
        return Err(CudaError::invalid(format!(
            "FP8 linear needs bf16 activations, 1..={FP8_GEMV_MAX_ROWS} rows, n >= 1, k a \
             multiple of 16 and 16-byte aligned inputs (have {} m {m} n {n} k {k})",
            TIn::DTYPE
        )));
    }
    let spec = specialize_gemv_fp8(TOut::DTYPE, m)?;
    check_len("FP8 linear x [m, k]", m * k, x.len())?;
    check_len("FP8 linear w [n, k] (bytes)", n * k, w.len())?;
    check_len("FP8 linear scales [n]", n, scales.len())?;
    check_len("FP8 linear out [m, n]", m * n, out.len())?;
    let args = [
        ptr(x),
        ptr(w),
        ptr(scales),
        ptr(out),
        KernelArg::U32(to_u32("m", m)?),
        KernelArg::U32(to_u32("n", n)?),
        KernelArg::U32(to_u32("k", k)?),
        KernelArg::F32(beta),
    ];
    let grid = (to_u32("FP8 linear CTAs", n.div_ceil(ROWS_PER_CTA))?, 1);
    // SAFETY: arguments match `gemv_fp8`; lengths, alignment and k validated.
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, 256), &args) }
}

/// `out [n, k] = code(w) [n, k] * scales [n]` (row by row), `k` a multiple of 4.
pub fn dequantize_fp8<T: Element>(
    gpu: &Gpu,
    (w, scales): (&impl DeviceRead<u8>, &impl DeviceRead<f32>),
    out: &mut impl DeviceWrite<T>,
    (n, k): (usize, usize),
) -> Result<(), CudaError> {
    let spec = specialize_dequant_fp8(T::DTYPE)?;
    if !k.is_multiple_of(4) {
        return Err(CudaError::invalid(format!(
            "FP8 dequantization needs k a multiple of 4, not {k}"
        )));
    }
    check_len("FP8 dequantization w [n, k] (bytes)", n * k, w.len())?;
    check_len("FP8 dequantization scales [n]", n, scales.len())?;
    check_len("FP8 dequantization out [n, k]", n * k, out.len())?;
    if n * k == 0 {
        return Ok(());
    }
    let args = [
        ptr(w),
        ptr(scales),
        ptr(out),
        KernelArg::U32(to_u32("n", n)?),
        KernelArg::U32(to_u32("k", k)?),
    ];
    let grid = (
        to_u32("FP8 dequantization rows", n)?,
        to_u32("FP8 dequantization CTAs", (k / 4).div_ceil(256))?,
    );
    // SAFETY: arguments match `dequant_fp8`; lengths and k validated.
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, 256), &args) }
}

/// The `quant_rows_fp8` specialisation reading `input`.
pub fn specialize_quant_rows_fp8(input: DType) -> Result<KernelSpec, CudaError> {
    check_float("FP8 activation quantization input", input)?;
    Ok(KernelSpec {
        source: &GEMV_FP8,
        entry: "quant_rows_fp8",
        params: Vec::new(),
        dtypes: vec![("T", input)],
    })
}

/// `codes [m, k]` and `scales [m]` of `x [m, k]`, row by row: scale = the row's largest
/// magnitude / 448, code = e4m3(x / scale) rounded to nearest even (the KV cache's codec,
/// `attention::fp8::quantize_head` on the host); `k` a multiple of 4.
pub fn quantize_rows_fp8<T: Element>(
    gpu: &Gpu,
    x: &impl DeviceRead<T>,
    (codes, scales): (&mut impl DeviceWrite<u8>, &mut impl DeviceWrite<f32>),
    (m, k): (usize, usize),
) -> Result<(), CudaError> {
    let spec = specialize_quant_rows_fp8(T::DTYPE)?;
    if !k.is_multiple_of(4) || k == 0 {
        return Err(CudaError::invalid(format!(
            "FP8 activation quantization needs k a positive multiple of 4, not {k}"
        )));
    }
    check_len("FP8 activation quantization x [m, k]", m * k, x.len())?;
    check_len("FP8 activation codes [m, k]", m * k, codes.len())?;
    check_len("FP8 activation scales [m]", m, scales.len())?;
    if m == 0 {
        return Ok(());
    }
    let args = [
        ptr(x),
        ptr(codes),
        ptr(scales),
        KernelArg::U32(to_u32("k", k)?),
    ];
    let grid = (to_u32("FP8 activation rows", m)?, 1);
    // SAFETY: arguments match `quant_rows_fp8`; lengths and k validated.
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, 256), &args) }
}

/// The activations' e4m3 codes and per-row factors for [`fp8_gemm`]: room for `rows` rows of
/// up to `width` values (a longer step runs in pieces of `rows`).
pub struct Fp8Activations {
    codes: DeviceBuffer<u8>,
    scales: DeviceBuffer<f32>,
    rows: usize,
    width: usize,
}

impl Fp8Activations {
    /// Scratch for `rows` rows of up to `width` values.
    pub fn new(gpu: &Gpu, rows: usize, width: usize) -> Result<Self, CudaError> {
        Ok(Fp8Activations {
            codes: gpu.alloc(rows * width)?,
            scales: gpu.alloc(rows)?,
            rows,
            width,
        })
    }
}

/// Whether [`fp8_gemm`] takes an FP8 matrix `[n, k]` into a `TOut` output: FP8 tensor
/// cores, bf16 or f32 out, `k` a multiple of 16 within the scratch's width and `n` a multiple
/// of 8 (cuBLASLt's FP8 leading dimensions).
pub fn fp8_gemm_applies<TOut: Element>(
    gpu: &Gpu,
    scratch: &Fp8Activations,
    (n, k): (usize, usize),
) -> bool {
    gpu.fp8_gemm_supported()
        && matches!(TOut::DTYPE, DType::BF16 | DType::F32)
        && k.is_multiple_of(16)
        && k > 0
        && k <= scratch.width
        && n.is_multiple_of(8)
}

/// `out [m, n] = beta * out + x [m, k] code(w) [n, k]^T * scales [n]` on FP8 tensor cores:
/// each row of `x` quantized to e4m3 with its own factor ([`quantize_rows_fp8`]), then
/// cuBLASLt's FP8 GEMM with both factors in its epilogue ([`Gpu::gemm_fp8`]), in pieces of
/// the scratch's rows. For the shapes [`fp8_gemm_applies`] accepts.
pub fn fp8_gemm<TIn: Element, TOut: Element>(
    gpu: &Gpu,
    x: &impl DeviceRead<TIn>,
    weights: (&impl DeviceRead<u8>, &impl DeviceRead<f32>),
    scratch: &mut Fp8Activations,
    out: &mut impl DeviceWrite<TOut>,
    (m, n, k): (usize, usize, usize),
    beta: f32,
) -> Result<(), CudaError> {
    if !fp8_gemm_applies::<TOut>(gpu, scratch, (n, k)) {
        return Err(CudaError::invalid(format!(
            "FP8 GEMM needs FP8 tensor cores, bf16 or f32 out, k a multiple of 16 up to {} and n of 8 (have n \
             {n} k {k})",
            scratch.width
        )));
    }
    check_len("FP8 GEMM x [m, k]", m * k, x.len())?;
    check_len("FP8 GEMM out [m, n]", m * n, out.len())?;
    let x = view(x, 0..m * k)?;
    let mut out = view_mut(out, 0..m * n)?;
    let mut start = 0;
    while start < m {
        let rows = scratch.rows.min(m - start);
        let piece = view(&x, start * k..(start + rows) * k)?;
        let mut codes = view_mut(&mut scratch.codes, 0..rows * k)?;
        let mut scales = view_mut(&mut scratch.scales, 0..rows)?;
        quantize_rows_fp8(gpu, &piece, (&mut codes, &mut scales), (rows, k))?;
        let mut piece_out = view_mut(&mut out, start * n..(start + rows) * n)?;
        let activations = (
            &view(&scratch.codes, 0..rows * k)?,
            &view(&scratch.scales, 0..rows)?,
        );
        gpu.gemm_fp8(activations, weights, &mut piece_out, (rows, n, k), beta)?;
        start += rows;
    }
    Ok(())
}

/// Every specialisation the FP8 launchers can request.
pub fn specializations() -> Result<Vec<KernelSpec>, CudaError> {
    let mut specs = Vec::new();
    for &dtype in &FLOAT_DTYPES {
        specs.push(specialize_dequant_fp8(dtype)?);
        specs.push(specialize_quant_rows_fp8(dtype)?);
        for rows in [1, 2, 4, 8, 16] {
            specs.push(specialize_gemv_fp8(dtype, rows)?);
        }
    }
    Ok(specs)
}
