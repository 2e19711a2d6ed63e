//! The independent oracle of the attention tests: random paged fixtures whose pages are
//! scattered over the pool, with a contiguous f64 copy of every request's visible K/V, and
//! a naive f64 causal softmax attention over those copies. Other `attention_*` test files
//! include this file with `#[path]`; run alone it checks the oracle on a hand-computed case.
#![allow(dead_code)]

use pagoda_kv::{PageId, PageTable, PageTableRequest, Slot};
use pagoda_ops::attention::{append_kv, KvLayout, PagedKv, QueryBatch};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// How a request's pages are placed in the pool.
#[derive(Clone, Copy, Debug)]
pub enum PageOrder {
    /// Physical pages in descending id order across the batch (reads run backwards).
    Reverse,
    /// A random permutation of the pool's pages.
    Random,
}

/// One request of a fixture: tokens written, first visible token, queries (the newest).
#[derive(Clone, Copy, Debug)]
pub struct RequestSpec {
    pub num_tokens: usize,
    pub logical_start: usize,
    pub num_queries: usize,
}

pub fn request(num_tokens: usize, logical_start: usize, num_queries: usize) -> RequestSpec {
    RequestSpec {
        num_tokens,
        logical_start,
        num_queries,
    }
}

/// A paged batch plus its contiguous f64 twin.
pub struct Fixture {
    pub layout: KvLayout,
    pub num_q_heads: usize,
    pub scale: f32,
    pub k_pool: Vec<f32>,
    pub v_pool: Vec<f32>,
    pub page_table: PageTable,
    pub q: Vec<f32>,
    pub qo_indptr: Vec<u32>,
    /// Per request: visible K and V, `[seq_len, num_kv_heads, head_dim]`, f64.
    pub visible_k: Vec<Vec<f64>>,
    pub visible_v: Vec<Vec<f64>>,
}

impl Fixture {
    /// Builds a fixture: pool with 3 spare pages, K/V uniform in [-1, 1] (written through
    /// `append_kv` at hand-computed slots), q uniform in [-1, 1], scale `1/sqrt(head_dim)`.
    pub fn new(
        specs: &[RequestSpec],
        page_size: usize,
        num_kv_heads: usize,
        n_rep: usize,
        head_dim: usize,
        order: PageOrder,
        seed: u64,
    ) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let pages_needed: usize = specs
            .iter()
            .map(|spec| spec.num_tokens.div_ceil(page_size))
            .sum();
        let num_pages = pages_needed + 3;
        let layout = KvLayout {
            num_pages,
            page_size,
            num_kv_heads,
            head_dim,
        };
        let mut physical: Vec<u32> = (0..num_pages as u32).rev().collect();
        if let PageOrder::Random = order {
            physical.shuffle(&mut rng);
        }
        let mut next_page = physical.into_iter();
        // Garbage in every row first, so reads of unwritten rows would show.
        let mut k_pool: Vec<f32> = (0..layout.pool_len())
            .map(|_| rng.random_range(50.0..60.0))
            .collect();
        let mut v_pool: Vec<f32> = (0..layout.pool_len())
            .map(|_| rng.random_range(50.0..60.0))
            .collect();
        let stride = layout.token_stride();
        let (mut visible_k, mut visible_v, mut page_lists) = (Vec::new(), Vec::new(), Vec::new());
        for spec in specs {
            let pages: Vec<PageId> = (0..spec.num_tokens.div_ceil(page_size))
                .map(|_| PageId(next_page.next().unwrap()))
                .collect();
            let slots: Vec<Slot> = (0..spec.num_tokens)
                .map(|token| Slot {
                    page: pages[token / page_size],
                    offset: (token % page_size) as u32,
                })
                .collect();
            let k_new: Vec<f32> = (0..spec.num_tokens * stride)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let v_new: Vec<f32> = (0..spec.num_tokens * stride)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            append_kv(&mut k_pool, &mut v_pool, &layout, &slots, &k_new, &v_new).unwrap();
            let visible = spec.logical_start * stride..spec.num_tokens * stride;
            visible_k.push(k_new[visible.clone()].iter().map(|&x| x as f64).collect());
            visible_v.push(v_new[visible].iter().map(|&x| x as f64).collect());
            page_lists.push(pages);
        }
        let requests: Vec<PageTableRequest<'_>> = specs
            .iter()
            .zip(&page_lists)
            .map(|(spec, pages)| PageTableRequest {
                pages,
                num_tokens: spec.num_tokens,
                logical_start: spec.logical_start,
            })
            .collect();
        let page_table = PageTable::build(&requests, num_pages, page_size).unwrap();
        let mut qo_indptr = vec![0u32];
        for spec in specs {
            qo_indptr.push(qo_indptr.last().unwrap() + spec.num_queries as u32);
        }
        let num_q_heads = num_kv_heads * n_rep;
        let q_len = *qo_indptr.last().unwrap() as usize * num_q_heads * head_dim;
        let q = (0..q_len).map(|_| rng.random_range(-1.0..1.0)).collect();
        Fixture {
            layout,
            num_q_heads,
            scale: 1.0 / (head_dim as f32).sqrt(),
            k_pool,
            v_pool,
            page_table,
            q,
            qo_indptr,
            visible_k,
            visible_v,
        }
    }

    pub fn kv(&self) -> PagedKv<'_> {
        PagedKv {
            k_pool: (&self.k_pool).into(),
            v_pool: (&self.v_pool).into(),
            layout: self.layout,
            page_table: &self.page_table,
        }
    }

    pub fn queries(&self) -> QueryBatch<'_> {
        QueryBatch {
            q: &self.q,
            qo_indptr: &self.qo_indptr,
            num_q_heads: self.num_q_heads,
        }
    }

    pub fn num_query_tokens(&self) -> usize {
        *self.qo_indptr.last().unwrap() as usize
    }

    pub fn output_len(&self) -> usize {
        self.num_query_tokens() * self.num_q_heads * self.layout.head_dim
    }

    /// Naive causal attention in f64 over the contiguous copies: `[T, num_q_heads,
    /// head_dim]`. Also returns the natural-log LSE of the scores per `(query, head)`.
    pub fn reference(&self) -> (Vec<f64>, Vec<f64>) {
        let (head_dim, num_kv_heads) = (self.layout.head_dim, self.layout.num_kv_heads);
        let n_rep = self.num_q_heads / num_kv_heads;
        let mut out = vec![0.0; self.output_len()];
        let mut lse = vec![f64::NEG_INFINITY; self.num_query_tokens() * self.num_q_heads];
        for request in 0..self.visible_k.len() {
            let seq_len = self.visible_k[request].len() / (num_kv_heads * head_dim);
            let (first, last) = (
                self.qo_indptr[request] as usize,
                self.qo_indptr[request + 1] as usize,
            );
            for token in first..last {
                let limit = seq_len - (last - first) + (token - first);
                for head in 0..self.num_q_heads {
                    let kv_head = head / n_rep;
                    let q_row = &self.q[(token * self.num_q_heads + head) * head_dim..][..head_dim];
                    let scores: Vec<f64> = (0..=limit)
                        .map(|position| {
                            let key = &self.visible_k[request]
                                [(position * num_kv_heads + kv_head) * head_dim..][..head_dim];
                            q_row
                                .iter()
                                .zip(key)
                                .map(|(&a, &b)| a as f64 * b)
                                .sum::<f64>()
                                * self.scale as f64
                        })
                        .collect();
                    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let weights: Vec<f64> =
                        scores.iter().map(|score| (score - max).exp()).collect();
                    let total: f64 = weights.iter().sum();
                    let out_row =
                        &mut out[(token * self.num_q_heads + head) * head_dim..][..head_dim];
                    for (position, weight) in weights.iter().enumerate() {
                        let value = &self.visible_v[request]
                            [(position * num_kv_heads + kv_head) * head_dim..][..head_dim];
                        for (target, v) in out_row.iter_mut().zip(value) {
                            *target += weight / total * v;
                        }
                    }
                    lse[token * self.num_q_heads + head] = max + total.ln();
                }
            }
        }
        (out, lse)
    }
}

/// Largest absolute difference, relative to the reference's peak magnitude (at least 1).
pub fn max_relative_error(actual: &[f32], expected: &[f64]) -> f64 {
    assert_eq!(actual.len(), expected.len(), "length mismatch");
    let peak = expected
        .iter()
        .fold(1.0f64, |peak, value| peak.max(value.abs()));
    actual
        .iter()
        .zip(expected)
        .map(|(&a, &e)| {
            if a.is_finite() {
                (a as f64 - e).abs() / peak
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0, f64::max)
}

/// Asserts `actual` matches `expected` within `tolerance` (relative to peak), naming `what`.
pub fn assert_close(what: &str, actual: &[f32], expected: &[f64], tolerance: f64) {
    let error = max_relative_error(actual, expected);
    assert!(
        error <= tolerance,
        "{what}: max relative error {error:e} > {tolerance:e}"
    );
}

#[test]
fn reference_matches_a_hand_computed_case() {
    // One request, two tokens, one head of dim 2; q = k0, scale 1:
    // scores [1, 0] -> weights [e, 1] / (e + 1).
    let mut fixture = Fixture::new(&[request(2, 0, 1)], 4, 1, 1, 2, PageOrder::Reverse, 7);
    fixture.q = vec![1.0, 0.0];
    fixture.scale = 1.0;
    fixture.visible_k[0] = vec![1.0, 0.0, 0.0, 1.0];
    fixture.visible_v[0] = vec![1.0, 2.0, 3.0, 4.0];
    let (out, lse) = fixture.reference();
    let e = std::f64::consts::E;
    let (w0, w1) = (e / (e + 1.0), 1.0 / (e + 1.0));
    assert!((out[0] - (w0 + 3.0 * w1)).abs() < 1e-12);
    assert!((out[1] - (2.0 * w0 + 4.0 * w1)).abs() < 1e-12);
    assert!((lse[0] - (e + 1.0).ln()).abs() < 1e-12);
}
