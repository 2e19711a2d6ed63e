//! GPU tests of the query-tiled prefill attention (`ops::prefill_attention_tiled`) against a
//! naive f64 CPU reference and against the per-token `ops::prefill_attention` on the same
//! inputs (run with `PAGODA_GPU_TESTS=1`; SKIP elsewhere).

#![cfg(feature = "cuda")]

mod common;

use common::*;
use half::bf16;
use pagoda_cuda::ops::{self, DevicePageTable, PoolLayout};
use pagoda_cuda::{DeviceBuffer, Gpu};
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

/// One request: visible tokens (new ones included), new (query) tokens, first visible row of
/// its first page, and its pages in table order.
struct Request {
    seq_len: usize,
    q_len: usize,
    first_page_offset: usize,
    pages: Vec<u32>,
}

impl Request {
    /// Pool row of visible token `v`, or `None` when its page id is out of the pool (the
    /// kernels skip such keys).
    fn row(&self, v: usize, layout: &PoolLayout) -> Option<usize> {
        let logical = self.first_page_offset + v;
        let page = self.pages[logical / layout.page_size] as usize;
        (page < layout.num_pages).then_some(page * layout.page_size + logical % layout.page_size)
    }
}

/// Shape of one request in a batch.
#[derive(Clone, Copy)]
struct Shape {
    seq_len: usize,
    q_len: usize,
    /// Taken modulo the page size.
    first_page_offset: usize,
    /// Pages listed in decreasing id order (scattered ids otherwise).
    reversed: bool,
}

const fn shape(seq_len: usize, q_len: usize, first_page_offset: usize, reversed: bool) -> Shape {
    Shape {
        seq_len,
        q_len,
        first_page_offset,
        reversed,
    }
}

/// A ragged batch over a paged pool, with random pools and a fused QKV buffer.
struct Batch {
    layout: PoolLayout,
    num_q_heads: usize,
    requests: Vec<Request>,
    /// Query rows before the first request (they must come out as zeros).
    leading_rows: usize,
    /// Query rows after the last request (zeros too).
    trailing_rows: usize,
    k_pool: Vec<f32>,
    v_pool: Vec<f32>,
    /// `[leading + sum(q_len) + trailing, qkv_width]`, rows `[q | k | v]`.
    qkv: Vec<f32>,
}

impl Batch {
    /// Random batch; values are rounded through `T` (what the GPU sees).
    fn new<T: TestFloat>(
        rng: &mut ChaCha8Rng,
        (page_size, num_kv_heads, head_dim): (usize, usize, usize),
        num_q_heads: usize,
        shapes: &[Shape],
        (leading_rows, trailing_rows): (usize, usize),
    ) -> Batch {
        let pages_of =
            |s: &Shape| (s.first_page_offset % page_size + s.seq_len).div_ceil(page_size);
        let needed: usize = shapes.iter().map(pages_of).sum();
        let layout = PoolLayout {
            num_pages: needed + needed / 2 + 3,
            page_size,
            num_kv_heads,
            head_dim,
        };
        let mut free: Vec<u32> = (0..layout.num_pages as u32).collect();
        free.shuffle(rng);
        let requests = shapes
            .iter()
            .map(|s| {
                let mut pages = free.split_off(free.len() - pages_of(s));
                if s.reversed {
                    pages.sort_unstable_by(|a, b| b.cmp(a));
                }
                Request {
                    seq_len: s.seq_len,
                    q_len: s.q_len,
                    first_page_offset: s.first_page_offset % page_size,
                    pages,
                }
            })
            .collect::<Vec<_>>();
        let rows = leading_rows + requests.iter().map(|r| r.q_len).sum::<usize>() + trailing_rows;
        let qkv_width = (num_q_heads + 2 * num_kv_heads) * head_dim;
        Batch {
            layout,
            num_q_heads,
            requests,
            leading_rows,
            trailing_rows,
            k_pool: round::<T>(&random_vec(rng, layout.pool_len(), 1.0)),
            v_pool: round::<T>(&random_vec(rng, layout.pool_len(), 1.0)),
            qkv: round::<T>(&random_vec(rng, rows * qkv_width, 2.0)),
        }
    }

    fn qkv_width(&self) -> usize {
        (self.num_q_heads + 2 * self.layout.num_kv_heads) * self.layout.head_dim
    }

    fn num_rows(&self) -> usize {
        self.qkv.len() / self.qkv_width()
    }

    fn row_elems(&self) -> usize {
        self.num_q_heads * self.layout.head_dim
    }

    /// CSR arrays: indptr, indices, last_page_len, first_page_offset.
    fn csr(&self) -> [Vec<u32>; 4] {
        let ps = self.layout.page_size;
        let mut table: [Vec<u32>; 4] = [vec![0], vec![], vec![], vec![]];
        for request in &self.requests {
            table[1].extend(&request.pages);
            table[0].push(table[1].len() as u32);
            let last = if request.pages.is_empty() {
                0
            } else {
                (request.first_page_offset + request.seq_len - 1) % ps + 1
            };
            table[2].push(last as u32);
            table[3].push(request.first_page_offset as u32);
        }
        table
    }

    fn qo_indptr(&self) -> Vec<u32> {
        let mut indptr = vec![self.leading_rows as u32];
        for request in &self.requests {
            indptr.push(indptr.last().unwrap() + request.q_len as u32);
        }
        indptr
    }

    /// `(request, j)` of every query row inside `qo_indptr` (`None` outside).
    fn row_owners(&self) -> Vec<Option<(usize, usize)>> {
        let mut owners = vec![None; self.leading_rows];
        for (index, request) in self.requests.iter().enumerate() {
            owners.extend((0..request.q_len).map(|j| Some((index, j))));
        }
        owners.extend(std::iter::repeat_n(None, self.trailing_rows));
        owners
    }

    /// Naive f64 attention of query row `row` (request `r`, query `j`), all heads:
    /// `[num_q_heads * head_dim]`.
    fn reference_row(&self, row: usize, (r, j): (usize, usize), scale: f32) -> Vec<f32> {
        let (hq, d) = (self.num_q_heads, self.layout.head_dim);
        let stride = self.layout.token_stride();
        let group = hq / self.layout.num_kv_heads;
        let request = &self.requests[r];
        let visible = request.seq_len - request.q_len + j + 1;
        let keys: Vec<usize> = (0..visible)
            .filter_map(|v| request.row(v, &self.layout))
            .collect();
        let mut out = Vec::with_capacity(hq * d);
        for h in 0..hq {
            let query = &self.qkv[row * self.qkv_width() + h * d..][..d];
            let kv_offset = (h / group) * d;
            let scores: Vec<f64> = keys
                .iter()
                .map(|&key_row| {
                    let key = &self.k_pool[key_row * stride + kv_offset..][..d];
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
                let value: f64 = keys
                    .iter()
                    .zip(&weights)
                    .map(|(&key_row, w)| w * self.v_pool[key_row * stride + kv_offset + i] as f64)
                    .sum();
                out.push(if total > 0.0 {
                    (value / total) as f32
                } else {
                    0.0
                });
            }
        }
        out
    }
}

/// The batch in device memory.
struct DeviceBatch<T: TestFloat> {
    k_pool: DeviceBuffer<T>,
    v_pool: DeviceBuffer<T>,
    qkv: DeviceBuffer<T>,
    table: [DeviceBuffer<u32>; 4],
    qo_indptr: DeviceBuffer<u32>,
}

impl<T: TestFloat> DeviceBatch<T> {
    fn upload(gpu: &Gpu, batch: &Batch) -> Self {
        DeviceBatch {
            k_pool: upload::<T>(gpu, &batch.k_pool),
            v_pool: upload::<T>(gpu, &batch.v_pool),
            qkv: upload::<T>(gpu, &batch.qkv),
            table: batch.csr().map(|array| gpu.upload(&array).unwrap()),
            qo_indptr: gpu.upload(&batch.qo_indptr()).unwrap(),
        }
    }

    fn page_table(&self) -> DevicePageTable<'_> {
        DevicePageTable::new(
            &self.table[0],
            &self.table[1],
            &self.table[2],
            &self.table[3],
        )
        .unwrap()
    }

    /// Runs the tiled kernel (or the per-token one) into a NaN-poisoned output.
    fn run(&self, gpu: &Gpu, batch: &Batch, scale: f32, tiled: bool) -> Vec<f32> {
        let mut out = poisoned::<T>(gpu, batch.num_rows() * batch.row_elems());
        let heads = (batch.num_q_heads, batch.qkv_width());
        let table = self.page_table();
        let (q, k, v, qo) = (&self.qkv, &self.k_pool, &self.v_pool, &self.qo_indptr);
        let result = if tiled {
            ops::prefill_attention_tiled(
                gpu,
                q,
                heads,
                k,
                v,
                &batch.layout,
                &table,
                qo,
                scale,
                &mut out,
            )
        } else {
            ops::prefill_attention(
                gpu,
                q,
                heads,
                k,
                v,
                &batch.layout,
                &table,
                qo,
                scale,
                &mut out,
            )
        };
        result.unwrap();
        download(gpu, &out)
    }
}

fn tolerance<T: TestFloat>() -> f32 {
    if T::NAME == "f32" {
        1e-5
    } else {
        2e-2
    }
}

/// Compares the tiled kernel with the per-token kernel on every row, and with the f64
/// reference on a sample of rows (every 11th, plus the first and last of each request).
fn check_tiled<T: TestFloat>(
    gpu: &Gpu,
    head_dim: usize,
    group: usize,
    page_size: usize,
    seed: u64,
) {
    let mut rng = rng(seed);
    let num_kv_heads = 2;
    let shapes = [
        shape(300, 300, 0, false),
        shape(37, 1, 3, true),
        shape(0, 0, 0, false),
        shape(700, 700, 5, true),
        shape(1, 1, 0, false),
        shape(520, 130, 9, false),
        shape(64, 1, 0, true),
        shape(45, 45, 15, false),
    ];
    let batch = Batch::new::<T>(
        &mut rng,
        (page_size, num_kv_heads, head_dim),
        num_kv_heads * group,
        &shapes,
        (0, 1),
    );
    let device = DeviceBatch::<T>::upload(gpu, &batch);
    let scale = 1.0 / (head_dim as f32).sqrt();
    let what = format!(
        "{} head_dim {head_dim} group {group} page_size {page_size}",
        T::NAME
    );
    let tiled = device.run(gpu, &batch, scale, true);
    let per_token = device.run(gpu, &batch, scale, false);
    let row_elems = batch.row_elems();
    let padding = &tiled[(batch.num_rows() - 1) * row_elems..];
    assert!(
        padding.iter().all(|&v| v == 0.0),
        "padding row is zeros ({what})"
    );
    assert_close(
        &format!("tiled vs per-token prefill {what}"),
        &tiled,
        &per_token,
        tolerance::<T>(),
    );
    let owners = batch.row_owners();
    let mut sampled = Vec::new();
    let mut expected = Vec::new();
    for (row, owner) in owners.iter().enumerate() {
        let Some((r, j)) = *owner else { continue };
        let q_len = batch.requests[r].q_len;
        if row % 11 == 0 || j == 0 || j + 1 == q_len {
            sampled.extend_from_slice(&tiled[row * row_elems..(row + 1) * row_elems]);
            expected.extend(batch.reference_row(row, (r, j), scale));
        }
    }
    assert_close(
        &format!("tiled prefill vs f64 reference {what}"),
        &sampled,
        &expected,
        tolerance::<T>(),
    );
}

#[test]
fn tiled_prefill_matches_reference_and_per_token_kernel() {
    let Some(gpu) = gpu("tiled_prefill_matches_reference_and_per_token_kernel") else {
        return;
    };
    let mut seed = 100;
    for head_dim in [64, 128, 256] {
        for group in [1, 4, 8] {
            for page_size in [16, 32] {
                seed += 1;
                check_tiled::<f32>(&gpu, head_dim, group, page_size, seed);
                check_tiled::<bf16>(&gpu, head_dim, group, page_size, seed + 1000);
            }
        }
    }
}

#[test]
fn tiled_prefill_other_head_dims_and_odd_groups() {
    let Some(gpu) = gpu("tiled_prefill_other_head_dims_and_odd_groups") else {
        return;
    };
    for (head_dim, group, page_size) in [(32, 3, 16), (96, 2, 32), (64, 3, 16), (128, 5, 1)] {
        let seed = 500 + head_dim as u64 + group as u64;
        check_tiled::<f32>(&gpu, head_dim, group, page_size, seed);
        check_tiled::<bf16>(&gpu, head_dim, group, page_size, seed + 1000);
    }
}

/// Rows before `qo_indptr[0]` and after `qo_indptr[B]` are zeros, `q_len > seq_len` is NaN,
/// a page id past the pool is skipped, an empty request is harmless.
#[test]
fn tiled_prefill_edge_rows() {
    let Some(gpu) = gpu("tiled_prefill_edge_rows") else {
        return;
    };
    let mut rng = rng(7);
    let (head_dim, group, page_size) = (64, 4, 4);
    let shapes = [
        shape(5, 3, 0, false),
        shape(0, 0, 0, false),
        shape(2, 3, 1, false),
        shape(30, 30, 2, true),
    ];
    let mut batch = Batch::new::<f32>(
        &mut rng,
        (page_size, 2, head_dim),
        2 * group,
        &shapes,
        (2, 3),
    );
    // Request 3's third page (tokens 10..14 of its visible range) points past the pool.
    batch.requests[3].pages[3] = batch.layout.num_pages as u32 + 7;
    let device = DeviceBatch::<f32>::upload(&gpu, &batch);
    let scale = 0.125;
    let out = device.run(&gpu, &batch, scale, true);
    let row_elems = batch.row_elems();
    for (row, owner) in batch.row_owners().iter().enumerate() {
        let actual = &out[row * row_elems..(row + 1) * row_elems];
        match *owner {
            None => assert!(actual.iter().all(|&v| v == 0.0), "row {row} is zeros"),
            Some((2, _)) => assert!(actual.iter().all(|v| v.is_nan()), "row {row} is NaN"),
            Some(owner) => assert_close(
                &format!("edge row {row}"),
                actual,
                &batch.reference_row(row, owner, scale),
                1e-5,
            ),
        }
    }
}

/// The launch replays from a CUDA graph with the same result.
#[test]
fn tiled_prefill_replays_from_a_graph() {
    let Some(gpu) = gpu("tiled_prefill_replays_from_a_graph") else {
        return;
    };
    let mut rng = rng(9);
    let shapes = [shape(90, 90, 0, false), shape(200, 17, 6, true)];
    let batch = Batch::new::<bf16>(&mut rng, (16, 2, 128), 8, &shapes, (0, 0));
    let device = DeviceBatch::<bf16>::upload(&gpu, &batch);
    let direct = device.run(&gpu, &batch, 0.1, true);
    let mut out = poisoned::<bf16>(&gpu, batch.num_rows() * batch.row_elems());
    let table = device.page_table();
    let graph = gpu
        .capture(|gpu| {
            ops::prefill_attention_tiled(
                gpu,
                &device.qkv,
                (batch.num_q_heads, batch.qkv_width()),
                &device.k_pool,
                &device.v_pool,
                &batch.layout,
                &table,
                &device.qo_indptr,
                0.1,
                &mut out,
            )
        })
        .unwrap();
    graph.launch().unwrap();
    gpu.synchronize().unwrap();
    assert_eq!(download(&gpu, &out), direct, "graph replay");
}

#[test]
fn tiled_prefill_rejects_bad_geometry() {
    let Some(gpu) = gpu("tiled_prefill_rejects_bad_geometry") else {
        return;
    };
    let layout = PoolLayout {
        num_pages: 2,
        page_size: 4,
        num_kv_heads: 2,
        head_dim: 64,
    };
    let pool = gpu.zeros::<f32>(layout.pool_len()).unwrap();
    let arrays = [vec![0u32, 1], vec![0], vec![1], vec![0]].map(|a| gpu.upload(&a).unwrap());
    let table = DevicePageTable::new(&arrays[0], &arrays[1], &arrays[2], &arrays[3]).unwrap();
    let qo = gpu.upload(&[0u32, 1]).unwrap();
    let run = |num_q_heads: usize,
               q_len: usize,
               out_len: usize,
               layout: PoolLayout,
               qo: &DeviceBuffer<u32>| {
        let q = gpu.zeros::<f32>(q_len).unwrap();
        let mut out = gpu.zeros::<f32>(out_len).unwrap();
        let row = num_q_heads * layout.head_dim;
        ops::prefill_attention_tiled(
            &gpu,
            &q,
            (num_q_heads, row),
            &pool,
            &pool,
            &layout,
            &table,
            qo,
            1.0,
            &mut out,
        )
        .unwrap_err()
        .to_string()
    };
    let odd = PoolLayout {
        head_dim: 48,
        ..layout
    };
    assert!(run(4, 4 * 48, 4 * 48, odd, &qo).contains("head_dim 48"));
    assert!(run(3, 3 * 64, 3 * 64, layout, &qo).contains("num_q_heads 3"));
    assert!(run(4, 4 * 64 - 1, 4 * 64, layout, &qo).contains("q"));
    assert!(run(4, 4 * 64, 4 * 64 + 1, layout, &qo).contains("out"));
    let long_qo = gpu.upload(&[0u32, 1, 1]).unwrap();
    assert!(run(4, 4 * 64, 4 * 64, layout, &long_qo).contains("qo_indptr"));
}
