//! The quantized linear layer for batched decode on the tensor cores (`gemm_quant_mma.cu`):
//! GGUF blocks decoded in registers to bytes, as [`super::gemv_quant`] does, and multiplied
//! with the same q8 activations ([`super::quantize_rows_q8`]) by `mma.sync` s8 products of one
//! 32-value group each, every weight byte read once per [`QUANT_MMA_MAX_ROWS`] rows. Between
//! the in-place kernel of a few rows and the decoded copy's GEMM of prefill.

use super::gemv_quant::{check_quant_linear, check_specialization, QuantPartRef};
use super::quant_splits::CTA_ROWS;
pub use super::quant_splits::QUANT_MMA_MAX_ROWS;
use super::{Q8Rows, QuantFormat, QUANT_PAIRS};
use pagoda_cuda::{
    ptr, to_u32, view, view_mut, CudaError, DType, DeviceRead, DeviceWrite, Element, Gpu,
    KernelArg, KernelSource, KernelSpec, LaunchDims,
};

/// The CUDA source of the tensor-core quantized kernels.
static GEMM_QUANT_MMA: KernelSource = KernelSource::new(
    "gemm_quant_mma.cu",
    concat!(
        include_str!("quant_decode.cu"),
        include_str!("gemm_quant_mma.cu")
    ),
);

/// Threads of a CTA (`WARPS * 32`).
const CTA_THREADS: u32 = 128;

/// The tile of activation rows (`M_TILE`: 8, 16, 32 or 64) a launch of `rows` rows takes.
fn m_tile(rows: usize) -> usize {
    rows.next_power_of_two().max(8)
}

/// The `gemm_quant_mma` specialisation of `format` for `rows` activation rows (1..=64)
/// writing `out` (f32 or bf16).
pub fn specialize_gemm_quant_mma(
    format: QuantFormat,
    out: DType,
    rows: usize,
) -> Result<KernelSpec, CudaError> {
    check_specialization(
        "quantized tensor-core linear",
        out,
        rows,
        QUANT_MMA_MAX_ROWS,
    )?;
    Ok(KernelSpec {
        source: &GEMM_QUANT_MMA,
        entry: "gemm_quant_mma",
        params: vec![("FORMAT", format.code()), ("M_TILE", m_tile(rows) as i64)],
        dtypes: vec![("T_OUT", out)],
    })
}

/// The `gemm_quant_mma_pair` specialisation of parts `(a, b)` (one of [`QUANT_PAIRS`]).
pub fn specialize_gemm_quant_mma_pair(
    (a, b): (QuantFormat, QuantFormat),
    out: DType,
    rows: usize,
) -> Result<KernelSpec, CudaError> {
    if !QUANT_PAIRS.contains(&(a, b)) {
        return Err(CudaError::invalid(format!(
            "quantized linear: no kernel for the parts {a} then {b} in one launch"
        )));
    }
    let mut spec = specialize_gemm_quant_mma(a, out, rows)?;
    spec.entry = "gemm_quant_mma_pair";
    spec.params.push(("FORMAT_B", b.code()));
    Ok(spec)
}

/// `out [m, n] = beta * out + x w^T` on the tensor cores for the activations last quantized
/// into `q8` (`[m, k]`) against `w`: `n` rows of `k` values in `format`'s blocks, followed by
/// [`super::QUANT_PADDING`] bytes; row `i` of the output at `i * ldo`. The arithmetic of
/// [`super::gemv_quant`] (exact integer dots, each group's scales once, f32 sums) in another
/// order of the sums; launches of up to [`QUANT_MMA_MAX_ROWS`] rows.
#[allow(clippy::too_many_arguments)]
pub fn gemm_quant_mma<TOut: Element>(
    gpu: &Gpu,
    format: QuantFormat,
    w: &impl DeviceRead<u8>,
    q8: &Q8Rows,
    out: &mut impl DeviceWrite<TOut>,
    n: usize,
    ldo: usize,
    beta: f32,
) -> Result<(), CudaError> {
    let (m, k) = q8.shape();
    check_quant_linear(&[(format, w.len(), n)], (m, k), ldo, out.len())?;
    for first in (0..m).step_by(QUANT_MMA_MAX_ROWS) {
        let rows = (m - first).min(QUANT_MMA_MAX_ROWS);
        let spec = specialize_gemm_quant_mma(format, TOut::DTYPE, rows)?;
        launch(gpu, &spec, &[w], q8, out, (first, rows), &[n], (ldo, beta))?;
    }
    Ok(())
}

/// [`gemm_quant_mma`] over two stacked parts of the formats of one of [`QUANT_PAIRS`] in one
/// launch per [`QUANT_MMA_MAX_ROWS`] rows: `a`'s rows into output columns `0..n_a`, `b`'s into
/// `n_a..n_a + n_b`; each part's groups split as its own launch would: the same bits as a
/// launch a part.
pub fn gemm_quant_mma_pair<TOut: Element, W: DeviceRead<u8>>(
    gpu: &Gpu,
    (format_a, w_a, n_a): QuantPartRef<'_, W>,
    (format_b, w_b, n_b): QuantPartRef<'_, W>,
    q8: &Q8Rows,
    out: &mut impl DeviceWrite<TOut>,
    ldo: usize,
    beta: f32,
) -> Result<(), CudaError> {
    let (m, k) = q8.shape();
    let parts = [(format_a, w_a.len(), n_a), (format_b, w_b.len(), n_b)];
    check_quant_linear(&parts, (m, k), ldo, out.len())?;
    for first in (0..m).step_by(QUANT_MMA_MAX_ROWS) {
        let rows = (m - first).min(QUANT_MMA_MAX_ROWS);
        let spec = specialize_gemm_quant_mma_pair((format_a, format_b), TOut::DTYPE, rows)?;
        let (weights, parts) = ([w_a, w_b], [n_a, n_b]);
        launch(
            gpu,
            &spec,
            &weights,
            q8,
            out,
            (first, rows),
            &parts,
            (ldo, beta),
        )?;
    }
    Ok(())
}

/// One launch of `spec` (one part, or a pair) over activation rows `first..first + rows`,
/// each part's groups split as [`SplitScratch::plan`] says.
#[allow(clippy::too_many_arguments)]
fn launch<TOut: Element, W: DeviceRead<u8>>(
    gpu: &Gpu,
    spec: &KernelSpec,
    weights: &[&W],
    q8: &Q8Rows,
    out: &mut impl DeviceWrite<TOut>,
    (first, rows): (usize, usize),
    part_rows: &[usize],
    (ldo, beta): (usize, f32),
) -> Result<(), CudaError> {
    let (m, k) = q8.shape();
    let n: usize = part_rows.iter().sum();
    let tiles: Vec<usize> = part_rows.iter().map(|n| n.div_ceil(CTA_ROWS)).collect();
    let scratch = q8.splits.as_ref().ok_or_else(|| {
        CudaError::invalid("gemm_quant_mma: activations quantized into a Q8Rows without the split scratch (build it with Q8Rows::with_splits)".to_string())
    })?;
    let splits = scratch.plan(&tiles, k / 32, m_tile(rows));
    let (values, scales) = q8.buffers();
    let values = view(values, first * k / 4..m * k / 4)?;
    let scales = view(scales, first * k / 16..m * k / 16)?;
    let o = view_mut(out, first * ldo..(m - 1) * ldo + n)?;
    let mut args: Vec<KernelArg> = weights.iter().map(|w| ptr(*w)).collect();
    args.extend([ptr(&values), ptr(&scales), ptr(&o)]);
    args.push(KernelArg::U32(to_u32("m", rows)?));
    for &n in part_rows {
        args.push(KernelArg::U32(to_u32("n", n)?));
    }
    args.extend([
        KernelArg::U32(to_u32("k", k)?),
        KernelArg::U32(to_u32("ldo", ldo)?),
        KernelArg::F32(beta),
        ptr(scratch.partials()),
        ptr(scratch.tickets()),
    ]);
    for &count in &splits {
        args.push(KernelArg::U32(to_u32("splits", count)?));
    }
    let most = splits.iter().copied().max().unwrap_or(1);
    let ctas = tiles.iter().sum::<usize>();
    let grid = (
        to_u32("quantized tensor-core linear CTAs", ctas)?,
        to_u32("splits", most)?,
    );
    // SAFETY: arguments match `gemm_quant_mma` (one part) or `gemm_quant_mma_pair` (two);
    // each part holds its padded rows of k values (checked by the caller), the activations
    // `rows` rows of k from `first`, the output (rows - 1) * ldo + n values from row `first`;
    // the sums take the grid's CTAs times CTA_ROWS * m_tile floats and the tickets one a row tile,
    // both within the scratch when split (`SplitScratch::plan`).
    unsafe { gpu.launch(spec, LaunchDims::new(grid, CTA_THREADS), &args) }
}

/// Every specialisation the tensor-core quantized launchers can request.
pub fn specializations() -> Result<Vec<KernelSpec>, CudaError> {
    let mut specs = Vec::new();
    for out in [DType::F32, DType::BF16] {
        for rows in [8, 16, 32, 64] {
            for format in QuantFormat::ALL {
                specs.push(specialize_gemm_quant_mma(format, out, rows)?);
            }
            for pair in QUANT_PAIRS {
                specs.push(specialize_gemm_quant_mma_pair(pair, out, rows)?);
            }
        }
    }
    Ok(specs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_launch_takes_the_smallest_tile_of_its_rows() {
        let tiles: Vec<usize> = [1, 8, 9, 16, 17, 33, 64].into_iter().map(m_tile).collect();
        assert_eq!(tiles, [8, 8, 16, 16, 32, 64, 64]);
        let spec = specialize_gemm_quant_mma(QuantFormat::Q4K, DType::BF16, 20).unwrap();
        assert!(spec.params.contains(&("M_TILE", 32)));
        assert!(specialize_gemm_quant_mma(QuantFormat::Q4K, DType::F16, 20).is_err());
        assert!(specialize_gemm_quant_mma(QuantFormat::Q4K, DType::F32, 65).is_err());
        let pair = (QuantFormat::Q6K, QuantFormat::Q4K);
        assert!(specialize_gemm_quant_mma_pair(pair, DType::F32, 16).is_err());
    }
}
