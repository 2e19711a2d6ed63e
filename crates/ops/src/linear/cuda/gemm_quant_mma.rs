//! The quantized linear layer for batched decode on the tensor cores (`gemm_quant_mma.cu`):
//! GGUF blocks decoded in registers to bytes, as [`super::gemv_quant`] does, and multiplied
//! with the same q8 activations ([`super::quantize_rows_q8`]) by `mma.sync` s8 products of one
//! 32-value group each, every weight byte read once per [`QUANT_MMA_MAX_ROWS`] rows. Between
//! the in-place kernel of a few rows and the decoded copy's GEMM of prefill.

use super::gemv_quant::{check_quant_linear, check_specialization, QuantPartRef};
use super::{Q8Rows, QuantFormat, QUANT_PAIRS};
use pagoda_cuda::{
    ptr, to_u32, view, view_mut, CudaError, DType, DeviceBuffer, DeviceRead, DeviceWrite, Element,
    Gpu, KernelArg, KernelSource, KernelSpec, LaunchDims,
};

/// The CUDA source of the tensor-core quantized kernels.
static GEMM_QUANT_MMA: KernelSource = KernelSource::new(
    "gemm_quant_mma.cu",
    concat!(
        include_str!("quant_decode.cu"),
        include_str!("gemm_quant_mma.cu")
    ),
);

/// Activation rows one `gemm_quant_mma` launch takes; more rows run in launches of this many.
pub const QUANT_MMA_MAX_ROWS: usize = 64;

/// Weight rows a CTA owns (`ROWS`) and its threads (`WARPS * 32`).
const CTA_ROWS: usize = 16;
const CTA_THREADS: u32 = 128;
/// Groups a split takes at least (a warp's `STEP` for each of the CTA's warps).
const SPLIT_MIN_GROUPS: usize = 16;
/// CTAs per SM a launch aims for: a matrix of fewer row tiles splits its groups.
const CTAS_PER_SM: usize = 6;

/// The split-k scratch of [`gemm_quant_mma`]: the splits' sums and a ticket per row tile
/// (zero between launches: the last CTA of a tile resets it).
pub(crate) struct SplitScratch {
    partials: DeviceBuffer<f32>,
    tickets: DeviceBuffer<u32>,
    target_ctas: usize,
}

impl SplitScratch {
    pub(crate) fn new(gpu: &Gpu) -> Result<SplitScratch, CudaError> {
        let target_ctas = CTAS_PER_SM * (gpu.info().sm_count as usize).max(1);
        Ok(SplitScratch {
            // A part splits only with fewer tiles than the target, into at most
            // ceil(target / tiles) splits; a pair's larger count times its tiles fits four
            // times the target in the models' shapes (else `plan` does not split).
            partials: gpu.zeros::<f32>(4 * target_ctas * CTA_ROWS * QUANT_MMA_MAX_ROWS)?,
            tickets: gpu.zeros::<u32>(2 * target_ctas)?,
            target_ctas,
        })
    }

    /// The splits of each part (`tiles` row tiles each) for a launch of `m_tile` rows: one
    /// each where the sums of the grid's larger count would not fit.
    fn plan(&self, tiles: &[usize], groups: usize, m_tile: usize) -> Vec<usize> {
        let splits: Vec<usize> = tiles
            .iter()
            .map(|&t| split_count(self.target_ctas, t, groups))
            .collect();
        let most = splits.iter().copied().max().unwrap_or(1);
        let sums = most * tiles.iter().sum::<usize>() * CTA_ROWS * m_tile;
        let fits = sums <= self.partials.len() && tiles.iter().sum::<usize>() <= self.tickets.len();
        match most == 1 || fits {
            true => splits,
            false => vec![1; tiles.len()],
        }
    }
}

/// Splits of the groups of a part of `tiles` row tiles of `groups` groups for a grid of about
/// `target_ctas` CTAs: none when the tiles fill it, else enough to, each split at least
/// [`SPLIT_MIN_GROUPS`] groups.
fn split_count(target_ctas: usize, tiles: usize, groups: usize) -> usize {
    if tiles >= target_ctas {
        return 1;
    }
    target_ctas
        .div_ceil(tiles)
        .min(groups / SPLIT_MIN_GROUPS)
        .max(1)
}

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
    let splits = q8.splits.plan(&tiles, k / 32, m_tile(rows));
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
        ptr(&q8.splits.partials),
        ptr(&q8.splits.tickets),
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
    // the sums take the grid's CTAs times 16 * m_tile floats and the tickets one a row tile,
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

    #[test]
    fn few_row_tiles_split_their_groups_to_fill_the_gpu() {
        // Six CTAs an SM of the H100's 132; Llama-3.1-8B's shapes (k 4096: 128 groups).
        let target = 6 * 132;
        assert_eq!(split_count(target, 4096 / 16, 128), 4); // o: 1,024 CTAs
        assert_eq!(split_count(target, 28672 / 16, 128), 1); // gate/up fill the GPU alone
        assert_eq!(split_count(target, 1024 / 16, 128), 8); // at least 16 groups a split
        assert_eq!(split_count(target, 4096 / 16, 448), 4); // down, k 14336
        assert_eq!(split_count(target, 1, 296), 18);
        assert_eq!(split_count(target, 3, 8), 1); // fewer groups than a split takes
    }
}
