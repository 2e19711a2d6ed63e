//! The streaming tensor-core prefill (`prefill_stream.cu`): the FlashAttention-2 schedule of
//! [`super::prefill_attention_mma`] with raw MMA, the softmax in registers, the Q tile and a
//! ring of swizzled K/V tiles in dynamic shared memory. Its tile shapes
//! ([`PrefillStreamTiling`]) are the candidates `pagoda bench attention --prefill` compares.

use super::kv_fp8::KvScales;
use super::prefill::{prefill_attention_tiled_fp8, PrefillKernel, QueryTiledKernel};
use super::{PagedKv, Queries, PREFILL_STREAM};
use pagoda_cuda::{CudaError, DType, DeviceRead, DeviceWrite, Element, Gpu, KernelSpec};

/// Head sizes `prefill_attention_stream` is specialised for.
pub const STREAM_PREFILL_HEAD_DIMS: [usize; 2] = [64, 128];

/// The tile shape of the streaming prefill: query rows per CTA (four warps of one or two
/// 16-row MMA tiles), keys per K/V tile, and the cp.async ring's depth.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PrefillStreamTiling {
    /// Query rows per CTA: 64 or 128.
    pub rows: usize,
    /// Keys per K/V tile: 32 or 64.
    pub keys: usize,
    /// Tiles in the cp.async ring: 2 or 3.
    pub stages: usize,
}

impl PrefillStreamTiling {
    /// The tilings the kernel is instantiated for, the default first: 128 rows (two MMA
    /// tiles a warp, so each K/V fragment read from shared memory feeds two MMAs) and 64-key
    /// tiles, double-buffered (96 KB at head_dim 128, two CTAs per SM).
    pub const ALL: [PrefillStreamTiling; 5] = [
        PrefillStreamTiling::new(128, 64, 2),
        PrefillStreamTiling::new(128, 32, 2),
        PrefillStreamTiling::new(64, 64, 2),
        PrefillStreamTiling::new(64, 64, 3),
        PrefillStreamTiling::new(64, 32, 2),
    ];

    /// The default tiling.
    pub const DEFAULT: PrefillStreamTiling = Self::ALL[0];

    /// The built-in choice where no tuning-table row applies, for a step of `requests`
    /// prompts of `tokens` tokens each: 64-row tiles (twice the CTAs) when the step has at
    /// most 2048 tokens, else [`DEFAULT`](Self::DEFAULT). Measured on the H200 beside
    /// FlashInfer (`docs/benchmark_results/prefill-h200-2026-12-04.md`).
    pub fn heuristic(requests: usize, tokens: usize) -> PrefillStreamTiling {
        if requests.saturating_mul(tokens) <= 2048 {
            PrefillStreamTiling::new(64, 64, 2)
        } else {
            Self::DEFAULT
        }
    }

    /// A tiling of `rows` query rows, `keys`-key tiles and `stages` stages.
    pub const fn new(rows: usize, keys: usize, stages: usize) -> Self {
        PrefillStreamTiling { rows, keys, stages }
    }

    /// Dynamic shared memory at `head_dim`, as `SHARED_BYTES` in `prefill_stream.cu`: the
    /// Q tile, `stages` K and V tiles, and a byte per key per stage.
    pub fn shared_bytes(&self, head_dim: usize) -> usize {
        let row = head_dim * 2;
        self.rows * row + 2 * self.stages * self.keys * row + self.stages * self.keys
    }

    /// Dynamic shared memory of the fp8-cache build (`PAGODA_KV_FP8`, as `SHARED_BYTES` in
    /// `prefill_stream_common.cu`): a ring of byte tiles, the widened bf16 K and V tiles and
    /// the ring's f32 scales.
    pub fn shared_bytes_fp8(&self, head_dim: usize) -> usize {
        let (rows, keys, stages) = (self.rows, self.keys, self.stages);
        rows * head_dim * 2
            + 2 * stages * keys * head_dim
            + 2 * keys * head_dim * 2
            + 2 * stages * keys * 4
            + stages * keys
    }

    /// The tiling named `name` (`128x64x2`: rows x keys x stages), if it is one of [`ALL`](Self::ALL).
    pub fn parse(name: &str) -> Option<PrefillStreamTiling> {
        let mut parts = name.split('x').map(|part| part.parse::<usize>().ok());
        let tiling = match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some(Some(rows)), Some(Some(keys)), Some(Some(stages)), None) => {
                PrefillStreamTiling::new(rows, keys, stages)
            }
            _ => return None,
        };
        Self::ALL.contains(&tiling).then_some(tiling)
    }
}

impl std::fmt::Display for PrefillStreamTiling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}x{}", self.rows, self.keys, self.stages)
    }
}

/// The specialisation of `prefill_attention_stream` for `dtype` (bf16 only), `head_dim` (one
/// of [`STREAM_PREFILL_HEAD_DIMS`]) and `tiling` (one of [`PrefillStreamTiling::ALL`]).
pub fn specialize_prefill_stream(
    dtype: DType,
    head_dim: usize,
    tiling: PrefillStreamTiling,
) -> Result<KernelSpec, CudaError> {
    if dtype != DType::BF16 || !STREAM_PREFILL_HEAD_DIMS.contains(&head_dim) {
        return Err(CudaError::invalid(format!(
            "streaming prefill: bf16 at head_dim {STREAM_PREFILL_HEAD_DIMS:?}, not {dtype} at \
             {head_dim}"
        )));
    }
    if !PrefillStreamTiling::ALL.contains(&tiling) {
        return Err(CudaError::invalid(format!(
            "streaming prefill: no tiling {tiling} (one of {:?})",
            PrefillStreamTiling::ALL.map(|t| t.to_string())
        )));
    }
    Ok(KernelSpec {
        source: &PREFILL_STREAM,
        entry: "prefill_attention_stream",
        params: vec![
            ("HEAD_DIM", head_dim as i64),
            ("BLOCK_KEYS", tiling.keys as i64),
            ("ROW_TILES", (tiling.rows / 64) as i64),
            ("STAGES", tiling.stages as i64),
        ],
        dtypes: vec![("T", dtype), ("INDEX_T", DType::U32)],
    })
}

/// [`super::prefill_attention_mma`]'s contract on the streaming kernel at `tiling`; bf16 at
/// [`STREAM_PREFILL_HEAD_DIMS`] (`num_q_heads / num_kv_heads` at most `tiling.rows`). Its
/// cp.async copies need 16-byte aligned pools and queries (a row stride of a multiple of 8),
/// and its softmax tracks maxima of unscaled scores (a positive `scale`): other calls run the
/// WMMA kernel.
pub fn prefill_attention_stream<T: Element>(
    gpu: &Gpu,
    tiling: PrefillStreamTiling,
    queries: &Queries<'_, T>,
    kv: &PagedKv<'_, T>,
    qo_indptr: &impl DeviceRead<u32>,
    scale: f32,
    out: &mut impl DeviceWrite<T>,
) -> Result<(), CudaError> {
    let pointers = kv.k_pool.device_ptr() | kv.v_pool.device_ptr() | queries.data.device_ptr();
    let aligned = pointers.is_multiple_of(16) && queries.row_stride.is_multiple_of(8);
    if !(aligned && scale > 0.0 && scale.is_finite()) {
        return super::prefill_attention_mma(gpu, queries, kv, qo_indptr, scale, out);
    }
    let spec = specialize_prefill_stream(T::DTYPE, kv.layout.head_dim, tiling)?;
    let kernel = QueryTiledKernel {
        what: "streaming prefill",
        spec: &spec,
        block_rows: tiling.rows,
        threads: 128,
        shared_bytes: tiling.shared_bytes(kv.layout.head_dim),
    };
    kernel.launch(gpu, queries, kv, None, qo_indptr, scale, out)
}

/// The fp8-pool build of `prefill_attention_stream` (bf16 queries and output).
pub fn specialize_prefill_stream_fp8(
    dtype: DType,
    head_dim: usize,
    tiling: PrefillStreamTiling,
) -> Result<KernelSpec, CudaError> {
    let mut spec = specialize_prefill_stream(dtype, head_dim, tiling)?;
    spec.params.push(("KV_FP8", 1));
    Ok(spec)
}

/// [`prefill_attention_stream`] over an e4m3 cache (same contract; each K/V tile staged as
/// bytes and widened to bf16 in shared memory, K's scale on the score columns, V's folded
/// into P). Where the streaming kernel cannot run (unaligned queries or pools, a head size it
/// is not built for) the tiled fp8 prefill does.
pub fn prefill_attention_stream_fp8<T: Element>(
    gpu: &Gpu,
    tiling: PrefillStreamTiling,
    queries: &Queries<'_, T>,
    (kv, scales): (&PagedKv<'_, u8>, &KvScales<'_>),
    qo_indptr: &impl DeviceRead<u32>,
    scale: f32,
    out: &mut impl DeviceWrite<T>,
) -> Result<(), CudaError> {
    let pointers = kv.k_pool.device_ptr() | kv.v_pool.device_ptr() | queries.data.device_ptr();
    let aligned = pointers.is_multiple_of(16) && queries.row_stride.is_multiple_of(8);
    let head_dim = kv.layout.head_dim;
    let streams = aligned && scale > 0.0 && scale.is_finite();
    if !streams || !STREAM_PREFILL_HEAD_DIMS.contains(&head_dim) {
        return prefill_attention_tiled_fp8(gpu, queries, (kv, scales), qo_indptr, scale, out);
    }
    let spec = specialize_prefill_stream_fp8(T::DTYPE, head_dim, tiling)?;
    let kernel = QueryTiledKernel {
        what: "streaming fp8 prefill",
        spec: &spec,
        block_rows: tiling.rows,
        threads: 128,
        shared_bytes: tiling.shared_bytes_fp8(head_dim),
    };
    kernel.launch(gpu, queries, kv, Some(scales), qo_indptr, scale, out)
}

impl PrefillKernel {
    /// The kernel that runs in place of `self` over an fp8 (e4m3) KV cache at `head_dim`:
    /// the streaming kernel where it is built for the head size, else the tiled one (the
    /// only two that read fp8 pages).
    pub fn reading_fp8(self, head_dim: usize) -> PrefillKernel {
        match self {
            PrefillKernel::Stream(tiling) if STREAM_PREFILL_HEAD_DIMS.contains(&head_dim) => {
                PrefillKernel::Stream(tiling)
            }
            _ => PrefillKernel::Tiled,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tilings_fit_and_parse() {
        assert_eq!(PrefillStreamTiling::DEFAULT.to_string(), "128x64x2");
        assert_eq!(
            PrefillStreamTiling::heuristic(1, 2048).to_string(),
            "64x64x2"
        );
        assert_eq!(
            PrefillStreamTiling::heuristic(4, 512).to_string(),
            "64x64x2"
        );
        assert_eq!(
            PrefillStreamTiling::heuristic(4, 1024),
            PrefillStreamTiling::DEFAULT
        );
        assert!(PrefillStreamTiling::ALL.contains(&PrefillStreamTiling::heuristic(1, 1)));
        for tiling in PrefillStreamTiling::ALL {
            assert_eq!(
                PrefillStreamTiling::parse(&tiling.to_string()),
                Some(tiling)
            );
            for head_dim in STREAM_PREFILL_HEAD_DIMS {
                let bytes = tiling.shared_bytes(head_dim);
                assert!(bytes <= 227 * 1024, "{tiling} at {head_dim}: {bytes}");
                let fp8 = tiling.shared_bytes_fp8(head_dim);
                assert!(fp8 <= 227 * 1024, "fp8 {tiling} at {head_dim}: {fp8}");
                // The copy layout: every thread copies whole 16-byte pieces of the tiles.
                assert_eq!(tiling.keys * head_dim / 8 % 128, 0);
                assert_eq!(tiling.rows * head_dim / 8 % 128, 0);
            }
            assert!(specialize_prefill_stream(DType::BF16, 128, tiling).is_ok());
        }
        // Worked example: 128 rows x 256 B + 2 stages x (K + V) x 64 keys x 256 B + 128 flags.
        assert_eq!(
            PrefillStreamTiling::DEFAULT.shared_bytes(128),
            32768 + 65536 + 128
        );
        for name in ["128x64", "128x64x4", "96x64x2", "axbxc", ""] {
            assert_eq!(PrefillStreamTiling::parse(name), None, "{name}");
        }
        let other = PrefillStreamTiling::new(128, 64, 3);
        let error = specialize_prefill_stream(DType::BF16, 128, other).unwrap_err();
        assert!(error.to_string().contains("no tiling 128x64x3"), "{error}");
        assert!(specialize_prefill_stream(DType::F16, 128, PrefillStreamTiling::DEFAULT).is_err());
        assert!(specialize_prefill_stream(DType::BF16, 256, PrefillStreamTiling::DEFAULT).is_err());
    }
}
