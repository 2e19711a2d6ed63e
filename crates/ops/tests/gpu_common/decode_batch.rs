//! A decode batch for the fused paged decode tests: a CSR page table with partial last pages,
//! mid-page starts and scattered pages, its f64 attention reference, and the error metric.

use pagoda_cuda::{DeviceBuffer, Gpu};
use pagoda_ops::cuda::PoolLayout;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// One batch: the CSR page table of requests over a pool of `num_pages` pages.
pub struct Batch {
    pub indptr: Vec<u32>,
    pub indices: Vec<u32>,
    pub last_page_len: Vec<u32>,
    pub first_page_offset: Vec<u32>,
}

impl Batch {
    /// `batch` requests of about `context` tokens: partial last pages, odd requests start
    /// mid-page, pages drawn at random (even requests) or as a descending run (odd ones);
    /// with `with_empty`, the last request has no pages.
    pub fn new(
        rng: &mut ChaCha8Rng,
        batch: usize,
        context: usize,
        page_size: usize,
        num_pages: usize,
        with_empty: bool,
    ) -> Batch {
        let mut out = Batch {
            indptr: vec![0],
            indices: Vec::new(),
            last_page_len: Vec::new(),
            first_page_offset: Vec::new(),
        };
        for r in 0..batch {
            let empty = with_empty && r == batch - 1 && batch > 1;
            let len = if empty {
                0
            } else {
                context - rng.random_range(0..page_size.min(context))
            };
            let fpo = if r % 2 == 1 && !empty {
                rng.random_range(1..page_size.max(2))
            } else {
                0
            };
            let pages = if len == 0 {
                0
            } else {
                (fpo + len).div_ceil(page_size)
            };
            let start = rng.random_range(0..num_pages);
            for p in 0..pages {
                let page = if r % 2 == 0 {
                    rng.random_range(0..num_pages)
                } else {
                    (start + num_pages - p % num_pages) % num_pages
                };
                out.indices.push(page as u32);
            }
            out.indptr.push(out.indices.len() as u32);
            if pages == 0 {
                out.last_page_len.push(0);
                out.first_page_offset.push(0);
            } else {
                out.last_page_len
                    .push((fpo + len - (pages - 1) * page_size) as u32);
                out.first_page_offset.push(fpo as u32);
            }
        }
        out
    }

    pub fn upload(&self, gpu: &Gpu) -> [DeviceBuffer<u32>; 4] {
        [
            &self.indptr,
            &self.indices,
            &self.last_page_len,
            &self.first_page_offset,
        ]
        .map(|array| gpu.upload(array).unwrap())
    }

    pub fn num_requests(&self) -> usize {
        self.indptr.len() - 1
    }

    /// f64 attention of request `r`, query head `h` (the test's own oracle).
    #[allow(clippy::too_many_arguments)]
    pub fn reference(
        &self,
        layout: &PoolLayout,
        num_q_heads: usize,
        q: &[f32],
        k_pool: &[f32],
        v_pool: &[f32],
        scale: f32,
    ) -> Vec<f32> {
        let d = layout.head_dim;
        let group = num_q_heads / layout.num_kv_heads;
        let mut out = vec![0f32; self.num_requests() * num_q_heads * d];
        for r in 0..self.num_requests() {
            let pages = &self.indices[self.indptr[r] as usize..self.indptr[r + 1] as usize];
            if pages.is_empty() {
                continue;
            }
            let fpo = self.first_page_offset[r] as usize;
            let len = (pages.len() - 1) * layout.page_size + self.last_page_len[r] as usize - fpo;
            for h in 0..num_q_heads {
                let kv = h / group;
                let qh = &q[(r * num_q_heads + h) * d..][..d];
                let offset = |v: usize| {
                    let logical = fpo + v;
                    let row = pages[logical / layout.page_size] as usize * layout.page_size
                        + logical % layout.page_size;
                    (row * layout.num_kv_heads + kv) * d
                };
                let scores: Vec<f64> = (0..len)
                    .map(|v| {
                        let k = &k_pool[offset(v)..][..d];
                        qh.iter()
                            .zip(k)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                let o = &mut out[(r * num_q_heads + h) * d..][..d];
                for (v, w) in weights.iter().enumerate() {
                    let value = &v_pool[offset(v)..][..d];
                    for (slot, &x) in o.iter_mut().zip(value) {
                        *slot += (w / total * x as f64) as f32;
                    }
                }
            }
        }
        out
    }
}

/// Max |a - e| over the reference's peak |e| (the seed's metric), NaN counted as failure.
pub fn peak_error(actual: &[f32], expected: &[f32]) -> f32 {
    let peak = expected.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    actual
        .iter()
        .zip(expected)
        .map(|(a, e)| {
            if a.is_nan() {
                f32::INFINITY
            } else {
                (a - e).abs()
            }
        })
        .fold(0f32, f32::max)
        / peak
}
