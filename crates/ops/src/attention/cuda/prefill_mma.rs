//! Tensor-core causal prefill attention over the paged KV cache (`prefill_mma.cu`): the
//! FlashAttention-2 schedule of [`super::prefill_attention_tiled`] (one CTA per tile of query
//! rows of one request and one KV head, K/V tiles staged once per CTA) with `S = Q K^T` and
//! `O += P V` on WMMA 16x16x16 bf16 fragments and f32 accumulators. bf16 only.

use super::{PagedKv, Queries, PREFILL_MMA};
use pagoda_cuda::{CudaError, DType, DeviceRead, DeviceWrite, Element, Gpu, KernelSpec};

/// Head sizes `prefill_attention_mma` is specialised for.
pub const MMA_PREFILL_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// Tile geometry of one `prefill_attention_mma` specialisation (per head size).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmaPrefillTiling {
    /// Query rows per CTA, 16 per warp (`block_q * group` of them are used,
    /// `block_q = rows / group`).
    pub block_rows: usize,
    /// Keys per K/V tile staged in shared memory.
    pub block_keys: usize,
}

impl MmaPrefillTiling {
    /// The tiling for `head_dim` (one of [`MMA_PREFILL_HEAD_DIMS`]): 64 rows x 64 keys for
    /// 64, 64 rows x 32 keys for 128, 32 rows x 16 keys for 256 (static shared memory at most
    /// 48 KiB, see [`shared_bytes`](Self::shared_bytes)).
    pub fn for_head_dim(head_dim: usize) -> Result<MmaPrefillTiling, CudaError> {
        let (block_rows, block_keys) = match head_dim {
            64 => (64, 64),
            128 => (64, 32),
            256 => (32, 16),
            _ => {
                return Err(CudaError::invalid(format!(
                    "tensor-core prefill head_dim {head_dim} is not supported (one of \
                     {MMA_PREFILL_HEAD_DIMS:?})"
                )))
            }
        };
        Ok(MmaPrefillTiling {
            block_rows,
            block_keys,
        })
    }

    /// Threads per CTA: one warp per 16 query rows.
    pub fn threads(&self) -> usize {
        self.block_rows / 16 * 32
    }

    /// Static shared memory of the kernel for `head_dim` under this tiling, in bytes (the
    /// same arithmetic as the `constexpr`s of `prefill_mma.cu`): K and V tiles
    /// `keys x (d + 8)` bf16; the Q tile `rows x (d + 8)` bf16, aliased with the S scratch
    /// (`rows x (keys + 4)` f32) and P (`rows x (keys + 8)` bf16) when Q lives in registers
    /// (`d <= 128`); the epilogue's O (`rows x (d + 4)` f32) over the same area; plus the
    /// per-row and per-key arrays. Every area is rounded up to 128 bytes.
    pub fn shared_bytes(&self, head_dim: usize) -> usize {
        let align = |bytes: usize| bytes.div_ceil(128) * 128;
        let (rows, keys) = (self.block_rows, self.block_keys);
        let k_bytes = align(keys * (head_dim + 8) * 2);
        let q_bytes = align(rows * (head_dim + 8) * 2);
        let s_bytes = align(rows * (keys + 4) * 4);
        let p_bytes = align(rows * (keys + 8) * 2);
        let q_offset = 2 * k_bytes;
        let s_offset = if head_dim <= 128 {
            q_offset
        } else {
            q_offset + q_bytes
        };
        let main = (q_offset + q_bytes).max(s_offset + s_bytes + p_bytes);
        let o_bytes = rows * (head_dim + 4) * 4;
        main.max(o_bytes) + 4 * rows * 2 + 8 * keys + 8
    }
}

/// The specialisation of `prefill_attention_mma` for `dtype` (bf16 only) and `head_dim`
/// (one of [`MMA_PREFILL_HEAD_DIMS`]); the tiling of [`MmaPrefillTiling::for_head_dim`] is
/// part of the key.
pub fn specialize_prefill_mma(dtype: DType, head_dim: usize) -> Result<KernelSpec, CudaError> {
    if dtype != DType::BF16 {
        return Err(CudaError::invalid(format!(
            "tensor-core prefill: dtype {dtype} is not supported (bf16 only; use \
             prefill_attention_tiled)"
        )));
    }
    let tiling = MmaPrefillTiling::for_head_dim(head_dim)?;
    Ok(KernelSpec {
        source: &PREFILL_MMA,
        entry: "prefill_attention_mma",
        params: vec![
            ("HEAD_DIM", head_dim as i64),
            ("BLOCK_ROWS", tiling.block_rows as i64),
            ("BLOCK_KEYS", tiling.block_keys as i64),
        ],
        dtypes: vec![("T", dtype), ("INDEX_T", DType::U32)],
    })
}

/// Causal ragged attention over the paged cache (queries already appended to it) on tensor
/// cores: same arguments, layout and results as [`super::prefill_attention_tiled`] (up to
/// bf16 rounding of the probabilities), for bf16 only (`T = f32` is an error: use the tiled
/// kernel) and head dims [`MMA_PREFILL_HEAD_DIMS`].
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
/// [`MmaPrefillTiling::block_rows`]. The launch reads every count on the device (capturable
/// in a CUDA graph); its grid is `(B + ceil(num_tokens / block_q), num_kv_heads)` with
/// `block_q = block_rows / group`.
pub fn prefill_attention_mma<T: Element>(
    gpu: &Gpu,
    queries: &Queries<'_, T>,
    kv: &PagedKv<'_, T>,
    qo_indptr: &impl DeviceRead<u32>,
    scale: f32,
    out: &mut impl DeviceWrite<T>,
) -> Result<(), CudaError> {
    let layout = &kv.layout;
    let spec = specialize_prefill_mma(T::DTYPE, layout.head_dim)?;
    let tiling = MmaPrefillTiling::for_head_dim(layout.head_dim)?;
    let kernel = super::prefill::QueryTiledKernel {
        what: "tensor-core prefill",
        spec: &spec,
        block_rows: tiling.block_rows,
        threads: tiling.threads(),
        shared_bytes: 0,
    };
    kernel.launch(gpu, queries, kv, None, qo_indptr, scale, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host mirror of the kernel's shared-memory arithmetic stays within 48 KiB, and the
    /// geometry satisfies the kernel's static_asserts (16-row warps, 16-key fragments, K/V
    /// chunks split evenly over the threads, the row-map scratch inside the K tile).
    #[test]
    fn tilings_fit_static_shared_memory_and_divide_evenly() {
        for &head_dim in &MMA_PREFILL_HEAD_DIMS {
            let tiling = MmaPrefillTiling::for_head_dim(head_dim).unwrap();
            let bytes = tiling.shared_bytes(head_dim);
            assert!(bytes <= 48 * 1024, "{head_dim}: {bytes}");
            assert!(
                bytes > 32 * 1024,
                "{head_dim}: tiles use the budget ({bytes})"
            );
            let threads = tiling.threads();
            assert_eq!(tiling.block_rows % 16, 0);
            assert!((32..=128).contains(&tiling.block_rows));
            assert_eq!(tiling.block_keys % 16, 0);
            assert!(tiling.block_keys <= 64);
            assert_eq!(tiling.block_keys * head_dim / 8 % threads, 0, "{head_dim}");
            let k_bytes = (tiling.block_keys * (head_dim + 8) * 2).div_ceil(128) * 128;
            assert!(4 * 256 * threads / 32 <= k_bytes, "{head_dim}");
            assert!(tiling.block_rows >= 8, "GQA groups up to 8 fit one tile");
        }
        // Worked example (head_dim 64): K, V 9216 each, S 17408 + P 9216 over the aliased Q
        // area, plus 2 * 256 + 512 + 8 bytes of per-row / per-key arrays.
        let tiling = MmaPrefillTiling::for_head_dim(64).unwrap();
        assert_eq!(
            tiling.shared_bytes(64),
            9216 * 2 + 17408 + 9216 + 512 + 512 + 8
        );
        // What ptxas -v reports for the three specialisations (sm_80 and sm_90a).
        for (head_dim, ptxas_bytes) in [(64, 46088), (128, 35592), (256, 38280)] {
            let tiling = MmaPrefillTiling::for_head_dim(head_dim).unwrap();
            assert_eq!(tiling.shared_bytes(head_dim), ptxas_bytes, "{head_dim}");
        }
        for head_dim in [32, 48, 96] {
            let error = MmaPrefillTiling::for_head_dim(head_dim).unwrap_err();
            assert!(error.to_string().contains(&format!("head_dim {head_dim}")));
        }
    }

    #[test]
    fn only_bf16_is_specialised() {
        let error = specialize_prefill_mma(DType::F32, 64).unwrap_err();
        assert!(error.to_string().contains("bf16 only"), "{error}");
        assert!(specialize_prefill_mma(DType::F16, 128).is_err());
        let spec = specialize_prefill_mma(DType::BF16, 128).unwrap();
        assert_eq!(spec.entry, "prefill_attention_mma");
        assert!(spec.params.contains(&("BLOCK_KEYS", 32)));
    }
}

/// A host emulation of the kernel's schedule (slot mapping, query tiles, per-warp 16-row
/// groups and their skip rule, key tiles with page lookups and the validity mask, causal
/// limits, base-2 online softmax with bf16-rounded probabilities, zero / NaN rules), checked
/// against a naive f64 attention for every tiling and GQA groups 1..=8: it validates the index
/// arithmetic of `prefill_mma.cu` (every tile of every request reached by some slot)
/// and that bf16 probabilities stay well inside the GPU tests' 2e-2 tolerance.
#[cfg(test)]
mod schedule_tests {
    use super::MmaPrefillTiling;
    use half::bf16;
    use rand::{Rng, SeedableRng};

    /// One KV head, `group` query heads, head size 16, pool `[pages, page_size, 16]`.
    struct Problem {
        group: usize,
        page_size: usize,
        num_pages: usize,
        qo_indptr: Vec<u32>,
        table: [Vec<u32>; 4],
        num_tokens: usize,
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
    }

    const D: usize = 16;

    impl Problem {
        /// `shapes`: `(seq_len, q_len, first_page_offset)`; 3 rows before the first request
        /// and 2 after the last one; pages in decreasing id order.
        fn new(
            seed: u64,
            group: usize,
            page_size: usize,
            shapes: &[(usize, usize, usize)],
        ) -> Self {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let pages_of = |s: &(usize, usize, usize)| (s.2 + s.0).div_ceil(page_size);
            let num_pages = shapes.iter().map(pages_of).sum::<usize>() + 2;
            let mut table: [Vec<u32>; 4] = [vec![0], vec![], vec![], vec![]];
            let mut qo_indptr = vec![3u32];
            let mut next_page = num_pages as u32;
            for s in shapes {
                for _ in 0..pages_of(s) {
                    next_page -= 1;
                    table[1].push(next_page);
                }
                table[0].push(table[1].len() as u32);
                let last = if s.0 == 0 {
                    0
                } else {
                    (s.2 + s.0 - 1) % page_size + 1
                };
                table[2].push(last as u32);
                table[3].push(s.2 as u32);
                qo_indptr.push(qo_indptr.last().unwrap() + s.1 as u32);
            }
            let num_tokens = *qo_indptr.last().unwrap() as usize + 2;
            let mut random = |len: usize, scale: f32| -> Vec<f32> {
                let values = (0..len).map(|_| rng.random_range(-scale..scale));
                values.map(|x| bf16::from_f32(x).to_f32()).collect()
            };
            Problem {
                group,
                page_size,
                num_pages,
                q: random(num_tokens * group * D, 2.0),
                k: random(num_pages * page_size * D, 1.0),
                v: random(num_pages * page_size * D, 1.0),
                qo_indptr,
                table,
                num_tokens,
            }
        }

        fn seq_len(&self, r: usize) -> i64 {
            let pages = self.table[0][r + 1] as i64 - self.table[0][r] as i64;
            if pages <= 0 {
                return 0;
            }
            (pages - 1) * self.page_size as i64 + self.table[2][r] as i64 - self.table[3][r] as i64
        }

        /// Pool row of visible token `v` of request `r` (None: skipped page).
        fn key_row(&self, r: usize, v: i64) -> Option<usize> {
            let logical = self.table[3][r] as i64 + v;
            let index = self.table[0][r] as usize + (logical / self.page_size as i64) as usize;
            let page = *self.table[1].get(index)? as usize;
            (page < self.num_pages)
                .then(|| page * self.page_size + (logical % self.page_size as i64) as usize)
        }

        /// Naive f64 attention: `[num_tokens, group, D]` with the kernel's zero / NaN rules.
        fn reference(&self, scale: f32) -> Vec<f32> {
            let mut out = vec![0.0f32; self.num_tokens * self.group * D];
            for r in 0..self.qo_indptr.len() - 1 {
                let (first, end) = (self.qo_indptr[r] as usize, self.qo_indptr[r + 1] as usize);
                let (q_len, seq_len) = ((end - first) as i64, self.seq_len(r));
                for j in 0..q_len {
                    let token = first + j as usize;
                    for h in 0..self.group {
                        let o = &mut out[(token * self.group + h) * D..][..D];
                        if q_len > seq_len {
                            o.fill(f32::NAN);
                            continue;
                        }
                        let query = &self.q[(token * self.group + h) * D..][..D];
                        let keys: Vec<usize> = (0..=seq_len - q_len + j)
                            .filter_map(|v| self.key_row(r, v))
                            .collect();
                        let scores: Vec<f64> = keys
                            .iter()
                            .map(|&row| {
                                let key = &self.k[row * D..][..D];
                                let dot: f64 =
                                    query.iter().zip(key).map(|(a, b)| (a * b) as f64).sum();
                                dot * scale as f64
                            })
                            .collect();
                        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                        let total: f64 = weights.iter().sum();
                        for (i, value) in o.iter_mut().enumerate() {
                            let sum: f64 = keys
                                .iter()
                                .zip(&weights)
                                .map(|(&row, w)| w * self.v[row * D + i] as f64)
                                .sum();
                            *value = if total > 0.0 {
                                (sum / total) as f32
                            } else {
                                0.0
                            };
                        }
                    }
                }
            }
            out
        }

        /// The kernel's schedule, CTA by CTA, warp by warp (outputs start as NaN).
        fn emulate(&self, tiling: MmaPrefillTiling, scale: f32) -> Vec<f32> {
            let (rows, keys, group) = (tiling.block_rows, tiling.block_keys, self.group);
            let mut out = vec![f32::NAN; self.num_tokens * group * D];
            let scale_log2 = scale * std::f32::consts::LOG2_E;
            let block_q = rows / group;
            let num_requests = self.qo_indptr.len() - 1;
            let grid = num_requests + self.num_tokens.div_ceil(block_q);
            let (first_token, end_token) = (
                self.qo_indptr[0] as usize,
                self.qo_indptr[num_requests] as usize,
            );
            for slot in 0..grid {
                let window = slot * block_q..((slot + 1) * block_q).min(self.num_tokens);
                for token in window.filter(|t| *t < first_token || *t >= end_token) {
                    out[token * group * D..][..group * D].fill(0.0);
                }
                let base = |r: usize| r + self.qo_indptr[r] as usize / block_q;
                let Some(r) = (0..num_requests).rev().find(|&r| base(r) <= slot) else {
                    continue;
                };
                let q_len = (self.qo_indptr[r + 1] - self.qo_indptr[r]) as i64;
                let q_first = ((slot - base(r)) * block_q) as i64;
                if q_first >= q_len {
                    continue;
                }
                let tile_tokens = (block_q as i64).min(q_len - q_first);
                let token0 = self.qo_indptr[r] as i64 + q_first;
                let active_rows = tile_tokens as usize * group;
                let seq_len = self.seq_len(r);
                let bad = q_len > seq_len;
                let causal_base = seq_len - q_len + q_first;
                let kv_end = if bad { 0 } else { causal_base + tile_tokens };
                for warp in 0..rows / 16 {
                    let first_row = warp * 16;
                    let active = first_row < active_rows;
                    let last_token = if active {
                        ((first_row + 15).min(active_rows - 1) / group) as i64
                    } else {
                        0
                    };
                    let mut max = [f32::NEG_INFINITY; 16];
                    let mut sum = [0.0f32; 16];
                    let mut o = [[0.0f32; D]; 16];
                    let mut start = 0i64;
                    while start < kv_end {
                        let tile_rows: Vec<Option<usize>> = (0..keys as i64)
                            .map(|key| {
                                (start + key < kv_end)
                                    .then(|| self.key_row(r, start + key))
                                    .flatten()
                            })
                            .collect();
                        if active && start <= causal_base + last_token {
                            for local in 0..16 {
                                let row = first_row + local;
                                let limit = if row < active_rows {
                                    (causal_base + (row / group) as i64 - start)
                                        .clamp(-1, keys as i64 - 1)
                                } else {
                                    -1
                                };
                                let token = token0 as usize + row / group;
                                let query = (row < active_rows && token < self.num_tokens)
                                    .then(|| &self.q[(token * group + row % group) * D..][..D]);
                                let scores: Vec<f32> = (0..keys)
                                    .map(|key| match (tile_rows[key], query) {
                                        (Some(k_row), Some(query)) if key as i64 <= limit => {
                                            let key = &self.k[k_row * D..][..D];
                                            query.iter().zip(key).map(|(a, b)| a * b).sum::<f32>()
                                                * scale_log2
                                        }
                                        _ => f32::NEG_INFINITY,
                                    })
                                    .collect();
                                let new_max = scores.iter().cloned().fold(max[local], f32::max);
                                if new_max == f32::NEG_INFINITY {
                                    continue;
                                }
                                let factor = (max[local] - new_max).exp2();
                                let weights: Vec<f32> = scores
                                    .iter()
                                    .map(|s| bf16::from_f32((s - new_max).exp2()).to_f32())
                                    .collect();
                                sum[local] = sum[local] * factor + weights.iter().sum::<f32>();
                                max[local] = new_max;
                                for (i, value) in o[local].iter_mut().enumerate() {
                                    *value *= factor;
                                    for (key, w) in weights.iter().enumerate() {
                                        if let Some(v_row) = tile_rows[key] {
                                            *value += w * self.v[v_row * D + i];
                                        }
                                    }
                                }
                            }
                        }
                        start += keys as i64;
                    }
                    for local in 0..16 {
                        let row = first_row + local;
                        let token = token0 as usize + row / group;
                        if row >= active_rows || token >= self.num_tokens {
                            continue;
                        }
                        let inverse = if sum[local] > 0.0 {
                            1.0 / sum[local]
                        } else {
                            0.0
                        };
                        let dest = &mut out[(token * group + row % group) * D..][..D];
                        for (d, value) in dest.iter_mut().zip(&o[local]) {
                            *d = if bad { f32::NAN } else { value * inverse };
                        }
                    }
                }
            }
            out
        }
    }

    #[test]
    fn emulated_schedule_matches_naive_attention() {
        let shapes = [
            (150, 150, 0),
            (37, 1, 3),
            (0, 0, 0),
            (2, 3, 1),
            (220, 70, 5),
            (1, 1, 0),
            (45, 45, 7),
        ];
        let mut seed = 0;
        for head_dim in super::MMA_PREFILL_HEAD_DIMS {
            let tiling = MmaPrefillTiling::for_head_dim(head_dim).unwrap();
            for group in 1..=8 {
                for page_size in [8, 16] {
                    seed += 1;
                    let mut problem = Problem::new(seed, group, page_size, &shapes);
                    // Request 4's third page id points past the pool: its keys are skipped.
                    let index = problem.table[0][4] as usize + 2;
                    problem.table[1][index] = problem.num_pages as u32 + 5;
                    let scale = 0.25;
                    let actual = problem.emulate(tiling, scale);
                    let expected = problem.reference(scale);
                    for (index, (a, e)) in actual.iter().zip(&expected).enumerate() {
                        let what = format!(
                            "head_dim {head_dim} group {group} page {page_size} at {index}"
                        );
                        if e.is_nan() {
                            assert!(a.is_nan(), "{what}: expected NaN, got {a}");
                        } else {
                            assert!(
                                (a - e).abs() <= 5e-3 * (1.0 + e.abs()),
                                "{what}: {a} vs {e}"
                            );
                        }
                    }
                }
            }
        }
    }
}
