//! Query-tiled causal prefill attention over the paged KV cache (`prefill.cu`): one CTA per
//! (tile of consecutive queries of one request, KV head), K/V tiles staged in shared memory
//! once and reused by every query row of the tile and of the GQA group.

use super::kv_fp8::KvScales;
use super::{PagedKv, Queries, PREFILL, SUPPORTED_HEAD_DIMS};
use crate::cuda_dtypes::check_float;
use pagoda_cuda::{
    check_len, check_min_len, ptr, to_u32, CudaError, DType, DeviceRead, DeviceWrite, Element, Gpu,
    KernelArg, KernelSpec, LaunchDims,
};

/// Tile geometry of one `prefill_attention_tiled` specialisation (per head size).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillTiling {
    /// Query rows per CTA (`block_q * group` of them are used, `block_q = rows / group`).
    pub block_rows: usize,
    /// Keys per K/V tile staged in shared memory.
    pub block_keys: usize,
    /// Threads per CTA.
    pub threads: usize,
}

impl PrefillTiling {
    /// The tiling for `head_dim` (one of [`SUPPORTED_HEAD_DIMS`]). Every tile is staged as
    /// f32 with a 4-float row pad, so the static shared memory is
    /// `4 * (rows * (d + 4) + 2 * keys * (d + 4) + rows * keys + 3 * rows) + 8 * keys` bytes
    /// (at most 48 KiB; [`shared_bytes`](Self::shared_bytes)).
    pub fn for_head_dim(head_dim: usize) -> Result<PrefillTiling, CudaError> {
        let (block_rows, block_keys, threads) = match head_dim {
            32 => (64, 64, 256),
            64 => (64, 32, 256),
            96 => (64, 16, 192),
            128 => (64, 8, 256),
            256 => (32, 4, 256),
            _ => {
                return Err(CudaError::invalid(format!(
                    "tiled prefill head_dim {head_dim} is not supported (one of \
                     {SUPPORTED_HEAD_DIMS:?})"
                )))
            }
        };
        Ok(PrefillTiling {
            block_rows,
            block_keys,
            threads,
        })
    }

    /// Static shared memory of the kernel for `head_dim` under this tiling, in bytes.
    pub fn shared_bytes(&self, head_dim: usize) -> usize {
        let pitch = head_dim + 4;
        let (rows, keys) = (self.block_rows, self.block_keys);
        4 * (rows * pitch + 2 * keys * pitch + rows * keys + 3 * rows) + 8 * keys
    }
}

/// The specialisation of `prefill_attention_tiled` for `dtype` (f32 or bf16) and `head_dim`
/// (one of [`SUPPORTED_HEAD_DIMS`]); the tiling of [`PrefillTiling::for_head_dim`] is part of
/// the key.
pub fn specialize_prefill(dtype: DType, head_dim: usize) -> Result<KernelSpec, CudaError> {
    check_float("tiled prefill", dtype)?;
    let tiling = PrefillTiling::for_head_dim(head_dim)?;
    Ok(KernelSpec {
        source: &PREFILL,
        entry: "prefill_attention_tiled",
        params: vec![
            ("HEAD_DIM", head_dim as i64),
            ("BLOCK_ROWS", tiling.block_rows as i64),
            ("BLOCK_KEYS", tiling.block_keys as i64),
            ("THREADS", tiling.threads as i64),
        ],
        dtypes: vec![("T", dtype), ("INDEX_T", DType::U32)],
    })
}

/// Device addresses and lengths of the page table's `indptr`, `indices`, `last_page_len`
/// and `first_page_offset`, in that order.
///
/// Causal ragged attention over the paged cache (queries already appended to it), query
/// tiled: same arguments, layout and results as [`super::prefill_attention`], with K/V read
/// once per tile of queries instead of once per query.
///
/// `q`: `num_tokens` rows, `q_row_stride` apart (e.g. inside a fused QKV buffer),
/// `num_q_heads` heads of `layout.head_dim` each; `k_pool`/`v_pool` are
/// `[num_pages, page_size, num_kv_heads, head_dim]`; `qo_indptr [B + 1]` splits the rows by
/// request; `out` is `[num_tokens, num_q_heads, head_dim]` (fully overwritten; `num_tokens =
/// out.len() / (num_q_heads * head_dim)`). Query `j` of request `r` (`q_len` queries,
/// `seq_len` visible tokens) attends to visible tokens `0 ..= seq_len - q_len + j`. `scale`
/// is the softmax scale (e.g. `1 / sqrt(head_dim)`). Rows outside `qo_indptr` get zeros; a
/// request with more queries than visible tokens gets NaN; page ids `>= num_pages` are
/// skipped. `num_q_heads / num_kv_heads` (the GQA group) must be a whole number of at most
/// [`PrefillTiling::block_rows`]. The launch reads every count on the device (capturable in a
/// CUDA graph); its grid is `(B + ceil(num_tokens / block_q), num_kv_heads)`.
pub fn prefill_attention_tiled<T: Element>(
    gpu: &Gpu,
    queries: &Queries<'_, T>,
    kv: &PagedKv<'_, T>,
    qo_indptr: &impl DeviceRead<u32>,
    scale: f32,
    out: &mut impl DeviceWrite<T>,
) -> Result<(), CudaError> {
    let layout = &kv.layout;
    let spec = specialize_prefill(T::DTYPE, layout.head_dim)?;
    let tiling = PrefillTiling::for_head_dim(layout.head_dim)?;
    let kernel = QueryTiledKernel {
        what: "tiled prefill",
        spec: &spec,
        block_rows: tiling.block_rows,
        threads: tiling.threads,
        shared_bytes: 0,
    };
    kernel.launch(gpu, queries, kv, None, qo_indptr, scale, out)
}

/// The prefill attention kernels, all with the arguments and results of
/// [`super::prefill_attention`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillKernel {
    /// [`super::prefill_attention`]: one CTA per query token (the oracle).
    PerToken,
    /// [`prefill_attention_tiled`]: query tiles on CUDA cores.
    Tiled,
    /// [`super::prefill_attention_mma`]: query tiles on tensor cores, WMMA (bf16 only).
    Mma,
    /// [`super::prefill_attention_stream`]: query tiles on tensor cores, raw MMA with the
    /// softmax in registers (bf16 at head_dim 64 and 128), at this tiling.
    Stream(super::PrefillStreamTiling),
}

/// Runs the prefill attention `kernel` (same contract as [`super::prefill_attention`]).
pub fn prefill_attention_with<T: Element>(
    kernel: PrefillKernel,
    gpu: &Gpu,
    queries: &Queries<'_, T>,
    kv: &PagedKv<'_, T>,
    qo_indptr: &impl DeviceRead<u32>,
    scale: f32,
    out: &mut impl DeviceWrite<T>,
) -> Result<(), CudaError> {
    let run = match kernel {
        PrefillKernel::PerToken => super::prefill_attention,
        PrefillKernel::Tiled => prefill_attention_tiled,
        PrefillKernel::Mma => super::prefill_attention_mma,
        PrefillKernel::Stream(tiling) => {
            return super::prefill_attention_stream(gpu, tiling, queries, kv, qo_indptr, scale, out)
        }
    };
    run(gpu, queries, kv, qo_indptr, scale, out)
}

/// A query-tiled prefill kernel (`prefill_attention_tiled` or `prefill_attention_mma`: the
/// same parameter list and slot mapping), with what its launch needs from the host.
pub(crate) struct QueryTiledKernel<'a> {
    /// Name for error messages.
    pub what: &'static str,
    /// The specialisation to launch.
    pub spec: &'a KernelSpec,
    /// Query rows (tokens x GQA heads) per CTA.
    pub block_rows: usize,
    /// Threads per CTA.
    pub threads: usize,
    /// Dynamic shared memory per CTA (0 for kernels with static shared memory only).
    pub shared_bytes: usize,
}

impl QueryTiledKernel<'_> {
    /// Validates the geometry and launches over `(B + ceil(num_tokens / block_q),
    /// num_kv_heads)` CTAs, `block_q = block_rows / group` (see [`prefill_attention_tiled`]
    /// for the arguments' contract).
    ///
    /// Pools of `K` other than `T` are e4m3 bytes read with their `fp8` scales (the tiled
    /// kernel's fp8 build only, [`prefill_attention_tiled_fp8`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch<T: Element, K: Element>(
        &self,
        gpu: &Gpu,
        queries: &Queries<'_, T>,
        kv: &PagedKv<'_, K>,
        fp8: Option<&KvScales<'_>>,
        qo_indptr: &impl DeviceRead<u32>,
        scale: f32,
        out: &mut impl DeviceWrite<T>,
    ) -> Result<(), CudaError> {
        let (q, num_q_heads, q_row_stride) = (&queries.data, queries.num_heads, queries.row_stride);
        let PagedKv {
            k_pool,
            v_pool,
            layout,
            page_table,
        } = kv;
        let what = self.what;
        layout.validate()?;
        let group = num_q_heads / layout.num_kv_heads;
        if group == 0 || group * layout.num_kv_heads != num_q_heads || group > self.block_rows {
            return Err(CudaError::invalid(format!(
                "{what}: num_q_heads {num_q_heads} must be a multiple (at most {}x) of \
                 num_kv_heads {}",
                self.block_rows, layout.num_kv_heads
            )));
        }
        if layout.num_kv_heads > 65535 {
            return Err(CudaError::invalid(format!(
                "{what}: num_kv_heads must be <= 65535"
            )));
        }
        check_len(&format!("{what} k_pool"), layout.pool_len(), k_pool.len())?;
        check_len(&format!("{what} v_pool"), layout.pool_len(), v_pool.len())?;
        let num_requests = page_table.num_requests();
        check_len(
            &format!("{what} qo_indptr [B + 1]"),
            num_requests + 1,
            qo_indptr.len(),
        )?;
        let row = num_q_heads * layout.head_dim;
        if out.len() % row != 0 {
            return Err(CudaError::invalid(format!(
                "{what} out has {} elements, not [T, {num_q_heads}, {}]",
                out.len(),
                layout.head_dim
            )));
        }
        let num_tokens = out.len() / row;
        if fp8.is_some() != (K::DTYPE != T::DTYPE) {
            return Err(CudaError::invalid(format!(
                "{what}: {} pools need scales exactly when they are not {}",
                K::DTYPE,
                T::DTYPE
            )));
        }
        if let Some(scales) = fp8 {
            scales.check(layout, K::DTYPE)?;
        }
        if q_row_stride < row {
            return Err(CudaError::invalid(format!(
                "{what} q row_stride {q_row_stride} < num_q_heads * head_dim {row}"
            )));
        }
        if num_tokens > 0 {
            check_min_len(
                &format!("{what} q"),
                (num_tokens - 1) * q_row_stride + row,
                q.len(),
            )?;
        }
        let num_indices = page_table.indices.len();
        let block_q = self.block_rows / group;
        let max_tiles = num_requests + num_tokens.div_ceil(block_q);
        let mut args = vec![
            ptr(q),
            ptr(k_pool),
            ptr(v_pool),
            ptr(qo_indptr),
            ptr(&page_table.indptr),
            ptr(&page_table.indices),
            ptr(&page_table.last_page_len),
            ptr(&page_table.first_page_offset),
            ptr(out),
            KernelArg::U32(to_u32("num_requests", num_requests)?),
            KernelArg::U32(to_u32("num_tokens", num_tokens)?),
            KernelArg::U32(to_u32("page table indices", num_indices)?),
            KernelArg::U32(to_u32("num_q_heads", num_q_heads)?),
            KernelArg::U32(to_u32("num_kv_heads", layout.num_kv_heads)?),
            KernelArg::U32(to_u32("page_size", layout.page_size)?),
            KernelArg::U32(to_u32("num_pages", layout.num_pages)?),
            KernelArg::U32(to_u32("q_row_stride", q_row_stride)?),
            KernelArg::U32(to_u32("block_q", block_q)?),
            KernelArg::F32(scale * std::f32::consts::LOG2_E),
        ];
        if let Some(scales) = fp8 {
            args.extend([ptr(&scales.k), ptr(&scales.v)]);
        }
        let tiles = to_u32(&format!("{what} tiles"), max_tiles)?;
        if tiles > i32::MAX as u32 {
            return Err(CudaError::invalid(format!(
                "{what}: {max_tiles} tiles exceed the grid limit"
            )));
        }
        let grid = (tiles, layout.num_kv_heads as u32);
        let dims = LaunchDims {
            shared_mem_bytes: to_u32("shared memory", self.shared_bytes)?,
            // CTAs per SM are bounded by the dynamic shared memory: the largest carveout.
            prefer_shared: self.shared_bytes > 0,
            ..LaunchDims::new(grid, to_u32("threads", self.threads)?)
        };
        // SAFETY: both kernels take exactly these arguments (prefill.cu, prefill_mma.cu; the
        // fp8 build of prefill.cu the two scale pools last, their extents checked above);
        // extents validated above; the kernels bound every access by num_tokens, num_indices
        // and num_pages.
        unsafe { gpu.launch(self.spec, dims, &args) }
    }
}

/// The fp8-pool build of `prefill_attention_tiled` for query/output `dtype`.
pub fn specialize_prefill_fp8(dtype: DType, head_dim: usize) -> Result<KernelSpec, CudaError> {
    let mut spec = specialize_prefill(dtype, head_dim)?;
    spec.params.push(("KV_FP8", 1));
    Ok(spec)
}

/// [`prefill_attention_tiled`] over an e4m3 cache (same contract; K/V dequantized as they
/// are staged).
pub fn prefill_attention_tiled_fp8<T: Element>(
    gpu: &Gpu,
    queries: &Queries<'_, T>,
    (kv, scales): (&PagedKv<'_, u8>, &KvScales<'_>),
    qo_indptr: &impl DeviceRead<u32>,
    scale: f32,
    out: &mut impl DeviceWrite<T>,
) -> Result<(), CudaError> {
    let spec = specialize_prefill_fp8(T::DTYPE, kv.layout.head_dim)?;
    let tiling = PrefillTiling::for_head_dim(kv.layout.head_dim)?;
    let kernel = QueryTiledKernel {
        what: "tiled fp8 prefill",
        spec: &spec,
        block_rows: tiling.block_rows,
        threads: tiling.threads,
        shared_bytes: 0,
    };
    kernel.launch(gpu, queries, kv, Some(scales), qo_indptr, scale, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tilings_fit_static_shared_memory_and_divide_evenly() {
        for &head_dim in &SUPPORTED_HEAD_DIMS {
            let tiling = PrefillTiling::for_head_dim(head_dim).unwrap();
            assert!(tiling.shared_bytes(head_dim) <= 48 * 1024, "{head_dim}");
            let chunks = head_dim / 4;
            assert_eq!(tiling.threads % 32, 0);
            assert_eq!(tiling.threads % chunks, 0, "{head_dim}");
            assert_eq!(tiling.block_rows % (tiling.threads / chunks), 0);
            assert!(tiling.block_keys.is_power_of_two() && (4..=64).contains(&tiling.block_keys));
            assert!(tiling.block_rows >= 32, "groups up to 32 fit");
        }
        assert!(PrefillTiling::for_head_dim(48).is_err());
        assert!(specialize_prefill(DType::F16, 64).is_err());
    }

    /// The kernel's slot mapping (base(r) = r + qo_indptr[r] / block_q, last r with
    /// base(r) <= slot) gives every tile of every request exactly one slot of the grid, and
    /// the zero windows of the slots cover every token.
    #[test]
    fn slot_mapping_covers_every_tile_once() {
        let batches: [&[u32]; 5] = [
            &[0, 300, 301, 301, 1001, 1002, 1132],
            &[0, 1, 2, 3, 4],
            &[0, 0, 0],
            &[0, 64, 128, 129],
            &[5, 9, 77],
        ];
        for qo_indptr in batches {
            for block_q in [1usize, 2, 6, 12, 21, 32, 64] {
                let num_requests = qo_indptr.len() - 1;
                let num_tokens = *qo_indptr.last().unwrap() as usize + 3;
                let grid = num_requests + num_tokens.div_ceil(block_q);
                let base = |r: usize| r + qo_indptr[r] as usize / block_q;
                let mut seen = std::collections::HashSet::new();
                for slot in 0..grid {
                    let owner = (0..num_requests).rev().find(|&r| base(r) <= slot);
                    let Some(r) = owner else { continue };
                    let q_len = (qo_indptr[r + 1] - qo_indptr[r]) as usize;
                    let tile = slot - base(r);
                    if tile * block_q < q_len {
                        assert!(seen.insert((r, tile)), "tile ({r}, {tile}) twice");
                    }
                }
                for r in 0..num_requests {
                    let q_len = (qo_indptr[r + 1] - qo_indptr[r]) as usize;
                    for tile in 0..q_len.div_ceil(block_q) {
                        assert!(
                            seen.contains(&(r, tile)),
                            "tile ({r}, {tile}) of {qo_indptr:?} missed with block_q {block_q}"
                        );
                    }
                }
                assert!(
                    grid * block_q >= num_tokens,
                    "zero windows cover every token"
                );
            }
        }
    }
}
