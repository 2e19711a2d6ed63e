//! GPU tests of the KV append, paged prefill attention and baseline decode against a naive
//! f64 CPU reference (ignored without `--include-ignored`: they need a GPU).

#[path = "gpu_common/mod.rs"]
mod common;

use common::*;
use half::bf16;
use pagoda_cuda::{view, whole, Gpu};
use pagoda_ops::cuda::{self as ops, DevicePageTable, PagedKv, PoolLayout, Queries};
use rand::seq::SliceRandom;

/// One request of the scenario: visible tokens, new (query) tokens, first visible row.
struct Request {
    seq_len: usize,
    q_len: usize,
    first_page_offset: usize,
    pages: Vec<u32>,
}

impl Request {
    /// Pool row of visible token `v`.
    fn row(&self, v: usize, page_size: usize) -> usize {
        let logical = self.first_page_offset + v;
        self.pages[logical / page_size] as usize * page_size + logical % page_size
    }
}

struct Scenario {
    layout: PoolLayout,
    num_q_heads: usize,
    requests: Vec<Request>,
}

impl Scenario {
    fn new(
        rng: &mut rand_chacha::ChaCha8Rng,
        layout: PoolLayout,
        num_q_heads: usize,
        shapes: &[(usize, usize, usize)],
    ) -> Scenario {
        let mut free: Vec<u32> = (0..layout.num_pages as u32).collect();
        free.shuffle(rng);
        let requests = shapes
            .iter()
            .map(|&(seq_len, q_len, first_page_offset)| {
                let first_page_offset = first_page_offset % layout.page_size;
                let num_pages = (first_page_offset + seq_len).div_ceil(layout.page_size);
                let pages = free.split_off(free.len() - num_pages);
                Request {
                    seq_len,
                    q_len,
                    first_page_offset,
                    pages,
                }
            })
            .collect();
        Scenario {
            layout,
            num_q_heads,
            requests,
        }
    }

    /// CSR arrays: indptr, indices, last_page_len, first_page_offset.
    fn csr(&self) -> [Vec<u32>; 4] {
        let ps = self.layout.page_size;
        let mut table: [Vec<u32>; 4] = [vec![0], vec![], vec![], vec![]];
        for request in &self.requests {
            table[1].extend(&request.pages);
            table[0].push(table[1].len() as u32);
            table[2].push(((request.first_page_offset + request.seq_len - 1) % ps + 1) as u32);
            table[3].push(request.first_page_offset as u32);
        }
        table
    }

    fn num_tokens(&self) -> usize {
        self.requests.iter().map(|r| r.q_len).sum()
    }

    /// Naive attention of every query row (`q` `[T, Hq, D]`) over the pools.
    fn reference(&self, q: &[f32], k_pool: &[f32], v_pool: &[f32], scale: f32) -> Vec<f32> {
        let (hq, d, ps) = (
            self.num_q_heads,
            self.layout.head_dim,
            self.layout.page_size,
        );
        let stride = self.layout.token_stride();
        let n_rep = hq / self.layout.num_kv_heads;
        let mut out = Vec::new();
        for request in &self.requests {
            for j in 0..request.q_len {
                let row = out.len() / (hq * d);
                for h in 0..hq {
                    let query = &q[(row * hq + h) * d..(row * hq + h + 1) * d];
                    let kv_offset = (h / n_rep) * d;
                    let visible = request.seq_len - request.q_len + j + 1;
                    let scores: Vec<f64> = (0..visible)
                        .map(|v| {
                            let key = &k_pool[request.row(v, ps) * stride + kv_offset..][..d];
                            query
                                .iter()
                                .zip(key)
                                .map(|(a, b)| *a as f64 * *b as f64)
                                .sum::<f64>()
                                * scale as f64
                        })
                        .collect();
                    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let total: f64 = weights.iter().sum();
                    for i in 0..d {
                        let value: f64 = (0..visible)
                            .map(|v| {
                                weights[v]
                                    * v_pool[request.row(v, ps) * stride + kv_offset + i] as f64
                            })
                            .sum();
                        out.push((value / total) as f32);
                    }
                }
            }
        }
        out
    }
}

fn check_attention<T: TestFloat>(gpu: &Gpu, head_dim: usize, page_size: usize, seed: u64) {
    let mut rng = rng(seed);
    let layout = PoolLayout {
        num_pages: 128,
        page_size,
        num_kv_heads: 2,
        head_dim,
    };
    let num_q_heads = 6;
    let scenario = Scenario::new(
        &mut rng,
        layout,
        num_q_heads,
        &[(1, 1, 0), (17, 5, 0), (40, 40, 0), (50, 3, 7)],
    );
    let stride = layout.token_stride();
    let mut k_pool = round::<T>(&random_vec(&mut rng, layout.pool_len(), 1.0));
    let mut v_pool = round::<T>(&random_vec(&mut rng, layout.pool_len(), 1.0));
    // Fused QKV rows [q | k | v] for the new tokens, plus one padding row (slot -1).
    let qkv_width = (num_q_heads + 2 * layout.num_kv_heads) * head_dim;
    let num_tokens = scenario.num_tokens();
    let qkv = round::<T>(&random_vec(&mut rng, (num_tokens + 1) * qkv_width, 1.0));
    let mut slots: Vec<i32> = Vec::new();
    for request in &scenario.requests {
        for j in 0..request.q_len {
            slots.push(request.row(request.seq_len - request.q_len + j, page_size) as i32);
        }
    }
    slots.push(-1);
    let (k_pool_d, v_pool_d) = (upload::<T>(gpu, &k_pool), upload::<T>(gpu, &v_pool));
    let (mut k_pool_d, mut v_pool_d) = (k_pool_d, v_pool_d);
    let qkv_d = upload::<T>(gpu, &qkv);
    let q_offset = num_q_heads * head_dim;
    let k_new = view(&qkv_d, q_offset..qkv.len()).unwrap();
    let v_new = view(&qkv_d, q_offset + stride..qkv.len()).unwrap();
    let slots_d = gpu.upload(&slots).unwrap();
    let new = ops::NewKv {
        k: k_new,
        v: v_new,
        row_strides: (qkv_width, qkv_width),
        slots: whole(&slots_d),
    };
    ops::kv_append(gpu, &new, &mut k_pool_d, &mut v_pool_d, &layout).unwrap();
    for (t, &slot) in slots.iter().enumerate().filter(|(_, &slot)| slot >= 0) {
        let (row, source) = (slot as usize * stride, t * qkv_width + q_offset);
        k_pool[row..row + stride].copy_from_slice(&qkv[source..source + stride]);
        v_pool[row..row + stride].copy_from_slice(&qkv[source + stride..source + 2 * stride]);
    }
    let what = format!("{} head_dim {head_dim} page_size {page_size}", T::NAME);
    assert_eq!(download(gpu, &k_pool_d), k_pool, "kv_append K pool {what}");
    assert_eq!(download(gpu, &v_pool_d), v_pool, "kv_append V pool {what}");

    // Prefill over the ragged batch; the padding row must come out as zeros.
    let [indptr, indices, last, first] = scenario.csr();
    let table_buffers = [indptr, indices, last, first].map(|array| gpu.upload(&array).unwrap());
    let table = DevicePageTable::new(
        &table_buffers[0],
        &table_buffers[1],
        &table_buffers[2],
        &table_buffers[3],
    )
    .unwrap();
    let mut qo_indptr = vec![0u32];
    for request in &scenario.requests {
        qo_indptr.push(qo_indptr.last().unwrap() + request.q_len as u32);
    }
    let scale = 1.0 / (head_dim as f32).sqrt();
    let mut out = poisoned::<T>(gpu, (num_tokens + 1) * num_q_heads * head_dim);
    ops::prefill_attention(
        gpu,
        &Queries::new(&qkv_d, num_q_heads, qkv_width),
        &PagedKv::new(&k_pool_d, &v_pool_d, layout, table),
        &gpu.upload(&qo_indptr).unwrap(),
        scale,
        &mut out,
    )
    .unwrap();
    let q_rows: Vec<f32> = qkv
        .chunks(qkv_width)
        .flat_map(|row| row[..q_offset].to_vec())
        .collect();
    let mut expected = scenario.reference(&q_rows, &k_pool, &v_pool, scale);
    expected.extend(std::iter::repeat_n(0.0, num_q_heads * head_dim));
    let tolerance = if T::NAME == "f32" { 1e-5 } else { 2e-2 };
    assert_close(
        &format!("prefill {what}"),
        &download(gpu, &out),
        &expected,
        tolerance,
    );

    // Baseline decode: the last query of every request, as a decode batch.
    let mut last_rows = Vec::new();
    let mut row = 0;
    for request in &scenario.requests {
        row += request.q_len;
        last_rows.push(row - 1);
    }
    let decode_q: Vec<f32> = last_rows
        .iter()
        .flat_map(|&r| q_rows[r * q_offset..(r + 1) * q_offset].to_vec())
        .collect();
    let decode_expected: Vec<f32> = last_rows
        .iter()
        .flat_map(|&r| expected[r * q_offset..(r + 1) * q_offset].to_vec())
        .collect();
    // Every split count the planner can pick must give the same answer, including 1 (no
    // merge) and more splits than a short request has keys.
    let total_pages: usize = scenario.requests.iter().map(|r| r.pages.len()).sum();
    let mut workspace = ops::DecodeWorkspace::<T>::new(
        gpu,
        &layout,
        num_q_heads,
        scenario.requests.len(),
        total_pages,
    )
    .unwrap();
    let decode_q_d = upload::<T>(gpu, &decode_q);
    for num_splits in [1, 3, ops::MAX_DECODE_SPLITS] {
        let mut decode_out = poisoned::<T>(gpu, decode_q.len());
        ops::decode_attention_gathered(
            gpu,
            &Queries::new(&decode_q_d, num_q_heads, q_offset),
            &PagedKv::new(&k_pool_d, &v_pool_d, layout, table),
            &mut workspace,
            num_splits,
            scale,
            &mut decode_out,
        )
        .unwrap();
        assert_close(
            &format!("decode {what} splits {num_splits}"),
            &download(gpu, &decode_out),
            &decode_expected,
            tolerance,
        );
    }

    // A workspace too small for the table poisons (NaN) the requests beyond it rather than
    // reading out of bounds or truncating.
    let mut small =
        ops::DecodeWorkspace::<T>::new(gpu, &layout, num_q_heads, scenario.requests.len(), 1)
            .unwrap();
    let mut short_out = poisoned::<T>(gpu, decode_q.len());
    ops::decode_attention_gathered(
        gpu,
        &Queries::new(&decode_q_d, num_q_heads, q_offset),
        &PagedKv::new(&k_pool_d, &v_pool_d, layout, table),
        &mut small,
        2,
        scale,
        &mut short_out,
    )
    .unwrap();
    let short = download(gpu, &short_out);
    assert!(
        short[q_offset * 2..q_offset * 3].iter().all(|v| v.is_nan()),
        "a request beyond the workspace is NaN"
    );
}

/// The baseline decode over long contexts (many keys per split), GQA groups 4 and 8, every
/// split count from 1 to the maximum, against the f64 reference.
fn check_long_decode<T: TestFloat>(gpu: &Gpu, num_q_heads: usize, num_kv_heads: usize, seed: u64) {
    let mut rng = rng(seed);
    let layout = PoolLayout {
        num_pages: 256,
        page_size: 16,
        num_kv_heads,
        head_dim: 128,
    };
    let scenario = Scenario::new(
        &mut rng,
        layout,
        num_q_heads,
        &[(1500, 1, 3), (1, 1, 0), (333, 1, 15), (64, 1, 0)],
    );
    let k_pool = round::<T>(&random_vec(&mut rng, layout.pool_len(), 1.0));
    let v_pool = round::<T>(&random_vec(&mut rng, layout.pool_len(), 1.0));
    let (k_pool_d, v_pool_d) = (upload::<T>(gpu, &k_pool), upload::<T>(gpu, &v_pool));
    let row = num_q_heads * layout.head_dim;
    let q = round::<T>(&random_vec(&mut rng, scenario.requests.len() * row, 2.0));
    let scale = 1.0 / (layout.head_dim as f32).sqrt();
    let expected = scenario.reference(&q, &k_pool, &v_pool, scale);
    let [indptr, indices, last, first] = scenario.csr();
    let total_pages = indices.len();
    let buffers = [indptr, indices, last, first].map(|array| gpu.upload(&array).unwrap());
    let table = DevicePageTable::new(&buffers[0], &buffers[1], &buffers[2], &buffers[3]).unwrap();
    let mut workspace =
        ops::DecodeWorkspace::<T>::new(gpu, &layout, num_q_heads, 4, total_pages).unwrap();
    let q_d = upload::<T>(gpu, &q);
    let tolerance = if T::NAME == "f32" { 1e-5 } else { 2e-2 };
    for num_splits in [1, 2, 7, 47, ops::MAX_DECODE_SPLITS] {
        let mut out = poisoned::<T>(gpu, q.len());
        ops::decode_attention_gathered(
            gpu,
            &Queries::new(&q_d, num_q_heads, row),
            &PagedKv::new(&k_pool_d, &v_pool_d, layout, table),
            &mut workspace,
            num_splits,
            scale,
            &mut out,
        )
        .unwrap();
        assert_close(
            &format!(
                "long decode {} GQA {num_q_heads}/{num_kv_heads} splits {num_splits}",
                T::NAME
            ),
            &download(gpu, &out),
            &expected,
            tolerance,
        );
    }
}

#[test]
#[ignore = "needs a GPU"]
fn long_decode_matches_reference_at_every_split() {
    let gpu = gpu();
    for (q_heads, kv_heads) in [(32, 8), (8, 1), (3, 3)] {
        check_long_decode::<f32>(&gpu, q_heads, kv_heads, 7 + q_heads as u64);
        check_long_decode::<bf16>(&gpu, q_heads, kv_heads, 9 + q_heads as u64);
    }
}

#[test]
#[ignore = "needs a GPU"]
fn paged_attention_matches_reference() {
    let gpu = gpu();
    for (head_dim, page_size) in [(64, 16), (128, 5), (32, 1), (256, 16)] {
        check_attention::<f32>(&gpu, head_dim, page_size, 10 + head_dim as u64);
        check_attention::<bf16>(&gpu, head_dim, page_size, 20 + head_dim as u64);
    }
}

#[test]
#[ignore = "needs a GPU"]
fn attention_rejects_bad_geometry() {
    let gpu = gpu();
    let layout = PoolLayout {
        num_pages: 2,
        page_size: 4,
        num_kv_heads: 2,
        head_dim: 48,
    };
    let pool = gpu.zeros::<f32>(layout.pool_len()).unwrap();
    let table_arrays = [vec![0u32, 1], vec![0], vec![1], vec![0]].map(|a| gpu.upload(&a).unwrap());
    let table = DevicePageTable::new(
        &table_arrays[0],
        &table_arrays[1],
        &table_arrays[2],
        &table_arrays[3],
    )
    .unwrap();
    let q = gpu.zeros::<f32>(4 * 48).unwrap();
    let mut out = gpu.zeros::<f32>(4 * 48).unwrap();
    let qo = gpu.upload(&[0u32, 1]).unwrap();
    let error = ops::prefill_attention(
        &gpu,
        &Queries::new(&q, 4, 4 * 48),
        &PagedKv::new(&pool, &pool, layout, table),
        &qo,
        1.0,
        &mut out,
    )
    .unwrap_err();
    assert!(error.to_string().contains("head_dim 48"), "{error}");
}

/// `rope_kv_append` gives the bits of `rope` over the q and k heads followed by `kv_append`:
/// both pairings, full and partial rotation, GQA, padding slots (-1 and past the pool).
fn check_rope_kv_append<T: TestFloat>(
    gpu: &Gpu,
    style: ops::RopeStyle,
    rope_dim: usize,
    seed: u64,
) {
    let mut rng = rng(seed);
    let (num_q_heads, head_dim, page_size) = (8, 64, 16);
    let layout = PoolLayout {
        num_pages: 12,
        page_size,
        num_kv_heads: 2,
        head_dim,
    };
    let kv_width = layout.token_stride();
    let row_stride = num_q_heads * head_dim + 2 * kv_width + 8; // a padded QKV row
    let num_tokens = 37;
    let qkv = round::<T>(&random_vec(&mut rng, num_tokens * row_stride, 2.0));
    let positions: Vec<u32> = (0..num_tokens as u32).map(|t| 3 * t + 500).collect();
    let inv_freq: Vec<f32> = (0..rope_dim / 2)
        .map(|i| 10_000f32.powf(-2.0 * i as f32 / rope_dim as f32))
        .collect();
    let num_slots = (layout.num_pages * page_size) as i32;
    let mut slots: Vec<i32> = (0..num_slots).collect();
    slots.shuffle(&mut rng);
    slots.truncate(num_tokens);
    slots[5] = -1;
    slots[11] = num_slots + 3;
    let pool = round::<T>(&random_vec(&mut rng, layout.pool_len(), 1.0));
    let (positions_d, inv_freq_d, slots_d) = (
        gpu.upload(&positions).unwrap(),
        gpu.upload(&inv_freq).unwrap(),
        gpu.upload(&slots).unwrap(),
    );
    // Two launches: rope over the q and k heads, then the append of k and v.
    let mut qkv_two = upload::<T>(gpu, &qkv);
    let (mut k_two, mut v_two) = (upload::<T>(gpu, &pool), upload::<T>(gpu, &pool));
    let heads = (num_q_heads + layout.num_kv_heads, head_dim, row_stride);
    ops::rope(gpu, &mut qkv_two, &positions_d, &inv_freq_d, heads, style).unwrap();
    let q_width = num_q_heads * head_dim;
    let new = ops::NewKv {
        k: view(&qkv_two, q_width..qkv.len()).unwrap(),
        v: view(&qkv_two, q_width + kv_width..qkv.len()).unwrap(),
        row_strides: (row_stride, row_stride),
        slots: whole(&slots_d),
    };
    ops::kv_append(gpu, &new, &mut k_two, &mut v_two, &layout).unwrap();
    // One launch.
    let mut qkv_one = upload::<T>(gpu, &qkv);
    let (mut k_one, mut v_one) = (upload::<T>(gpu, &pool), upload::<T>(gpu, &pool));
    ops::rope_kv_append(
        gpu,
        &mut qkv_one,
        (&positions_d, &inv_freq_d, style),
        (num_q_heads, row_stride),
        (&slots_d, &mut k_one, &mut v_one),
        &layout,
    )
    .unwrap();
    let what = format!("{} {style:?} rope_dim {rope_dim}", T::NAME);
    let two = download(gpu, &qkv_two);
    assert_ne!(
        two,
        download(gpu, &upload::<T>(gpu, &qkv)),
        "rope moved q ({what})"
    );
    assert_eq!(download(gpu, &qkv_one), two, "rotated q and k ({what})");
    assert_eq!(
        download(gpu, &k_one),
        download(gpu, &k_two),
        "K pool ({what})"
    );
    assert_eq!(
        download(gpu, &v_one),
        download(gpu, &v_two),
        "V pool ({what})"
    );
    // The padding rows wrote nothing: the pool row of the slot that was not used is intact.
    let untouched = (0..num_slots as usize)
        .find(|row| !slots.contains(&(*row as i32)))
        .unwrap();
    let row = untouched * kv_width..(untouched + 1) * kv_width;
    assert_eq!(
        download(gpu, &k_one)[row.clone()],
        pool[row],
        "an unused pool row ({what})"
    );
    // A slot list of the wrong length is refused.
    let short = gpu.upload(&slots[..3]).unwrap();
    let error = ops::rope_kv_append(
        gpu,
        &mut qkv_one,
        (&positions_d, &inv_freq_d, style),
        (num_q_heads, row_stride),
        (&short, &mut k_one, &mut v_one),
        &layout,
    )
    .unwrap_err();
    assert!(error.to_string().contains("slots"), "{error}");
}

#[test]
#[ignore = "needs a GPU"]
fn rope_kv_append_equals_rope_then_append() {
    let gpu = gpu();
    let mut seed = 900;
    for style in [ops::RopeStyle::Interleaved, ops::RopeStyle::Halves] {
        for rope_dim in [64, 32] {
            seed += 1;
            check_rope_kv_append::<f32>(&gpu, style, rope_dim, seed);
            check_rope_kv_append::<bf16>(&gpu, style, rope_dim, seed);
        }
    }
}
