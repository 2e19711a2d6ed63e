//! GPU tests of the tensor-core prefill attention (`ops::prefill_attention_mma`, bf16) against
//! a naive f64 CPU reference and against the per-token `ops::prefill_attention` on the same
//! ragged batches (run with `PAGODA_GPU_TESTS=1`; SKIP elsewhere).

#![cfg(feature = "cuda")]

mod common;

use common::*;
use half::bf16;
use pagoda_cuda::ops::{self, DevicePageTable, PoolLayout};
use pagoda_cuda::{view, view_mut, DeviceBuffer, DeviceRead, DeviceWrite, Gpu};
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

/// bf16 inputs and outputs, f32 accumulation, bf16 probabilities: error bound relative to
/// `1 + |expected|` (outputs are convex combinations of values in `[-1, 1]`).
const TOLERANCE: f32 = 2e-2;

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

/// Shape of one request in a batch: `(seq_len, q_len, first_page_offset (mod page size),
/// pages listed in decreasing id order)`.
type Shape = (usize, usize, usize, bool);

/// Long prefills, decode rows, an empty request, chunked prefill, offsets, reversed pages.
const SHAPES: [Shape; 8] = [
    (300, 300, 0, false),
    (37, 1, 3, true),
    (0, 0, 0, false),
    (700, 700, 5, true),
    (1, 1, 0, false),
    (520, 130, 9, false),
    (64, 1, 0, true),
    (45, 45, 15, false),
];

/// A ragged batch over a paged pool (values rounded through bf16) with a fused QKV buffer.
struct Batch {
    layout: PoolLayout,
    num_q_heads: usize,
    requests: Vec<Request>,
    /// Query rows before the first request / after the last one (they must be zeros).
    leading_rows: usize,
    trailing_rows: usize,
    k_pool: Vec<f32>,
    v_pool: Vec<f32>,
    /// `[leading + sum(q_len) + trailing, qkv_width]`, rows `[q | k | v]`.
    qkv: Vec<f32>,
}

impl Batch {
    fn new(
        rng: &mut ChaCha8Rng,
        (page_size, num_kv_heads, head_dim): (usize, usize, usize),
        num_q_heads: usize,
        shapes: &[Shape],
        (leading_rows, trailing_rows): (usize, usize),
    ) -> Batch {
        let pages_of = |s: &Shape| (s.2 % page_size + s.0).div_ceil(page_size);
        let needed: usize = shapes.iter().map(pages_of).sum();
        let layout = PoolLayout {
            num_pages: needed + needed / 2 + 3,
            page_size,
            num_kv_heads,
            head_dim,
        };
        let mut free: Vec<u32> = (0..layout.num_pages as u32).collect();
        free.shuffle(rng);
        let requests: Vec<Request> = shapes
            .iter()
            .map(|s| {
                let mut pages = free.split_off(free.len() - pages_of(s));
                if s.3 {
                    pages.sort_unstable_by(|a, b| b.cmp(a));
                }
                Request {
                    seq_len: s.0,
                    q_len: s.1,
                    first_page_offset: s.2 % page_size,
                    pages,
                }
            })
            .collect();
        let rows = leading_rows + requests.iter().map(|r| r.q_len).sum::<usize>() + trailing_rows;
        let qkv_width = (num_q_heads + 2 * num_kv_heads) * head_dim;
        Batch {
            layout,
            num_q_heads,
            requests,
            leading_rows,
            trailing_rows,
            k_pool: round::<bf16>(&random_vec(rng, layout.pool_len(), 1.0)),
            v_pool: round::<bf16>(&random_vec(rng, layout.pool_len(), 1.0)),
            qkv: round::<bf16>(&random_vec(rng, rows * qkv_width, 2.0)),
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
                    let dot: f64 = query
                        .iter()
                        .zip(key)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum();
                    dot * scale as f64
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
struct DeviceBatch {
    k_pool: DeviceBuffer<bf16>,
    v_pool: DeviceBuffer<bf16>,
    qkv: DeviceBuffer<bf16>,
    table: [DeviceBuffer<u32>; 4],
    qo_indptr: DeviceBuffer<u32>,
}

/// Which kernel [`DeviceBatch::run`] launches.
#[derive(Clone, Copy, PartialEq)]
enum Kernel {
    Mma,
    PerToken,
}

impl DeviceBatch {
    fn upload(gpu: &Gpu, batch: &Batch) -> Self {
        DeviceBatch {
            k_pool: upload::<bf16>(gpu, &batch.k_pool),
            v_pool: upload::<bf16>(gpu, &batch.v_pool),
            qkv: upload::<bf16>(gpu, &batch.qkv),
            table: batch.csr().map(|array| gpu.upload(&array).unwrap()),
            qo_indptr: gpu.upload(&batch.qo_indptr()).unwrap(),
        }
    }

    fn page_table(&self) -> DevicePageTable<'_> {
        let t = &self.table;
        DevicePageTable::new(&t[0], &t[1], &t[2], &t[3]).unwrap()
    }

    /// Launches `kernel` on explicit q / pools / out (views allowed).
    #[allow(clippy::too_many_arguments)]
    fn launch(
        &self,
        gpu: &Gpu,
        batch: &Batch,
        kernel: Kernel,
        scale: f32,
        (q, k_pool, v_pool): (
            &impl DeviceRead<bf16>,
            &impl DeviceRead<bf16>,
            &impl DeviceRead<bf16>,
        ),
        out: &mut impl DeviceWrite<bf16>,
    ) {
        let heads = (batch.num_q_heads, batch.qkv_width());
        let table = self.page_table();
        let qo = &self.qo_indptr;
        let layout = &batch.layout;
        let result = match kernel {
            Kernel::Mma => ops::prefill_attention_mma(
                gpu, q, heads, k_pool, v_pool, layout, &table, qo, scale, out,
            ),
            Kernel::PerToken => ops::prefill_attention(
                gpu, q, heads, k_pool, v_pool, layout, &table, qo, scale, out,
            ),
        };
        result.unwrap();
    }

    /// Runs `kernel` into a NaN-poisoned output and downloads it.
    fn run(&self, gpu: &Gpu, batch: &Batch, scale: f32, kernel: Kernel) -> Vec<f32> {
        let mut out = poisoned::<bf16>(gpu, batch.num_rows() * batch.row_elems());
        let inputs = (&self.qkv, &self.k_pool, &self.v_pool);
        self.launch(gpu, batch, kernel, scale, inputs, &mut out);
        download(gpu, &out)
    }
}

/// Compares the tensor-core kernel with the per-token kernel on every row and with the f64
/// reference on a sample of rows (every 11th, plus the first and last of each request);
/// checks that the padding row is zeros.
fn check_mma(gpu: &Gpu, head_dim: usize, group: usize, page_size: usize, seed: u64) {
    let mut rng = rng(seed);
    let num_kv_heads = 2;
    let batch = Batch::new(
        &mut rng,
        (page_size, num_kv_heads, head_dim),
        num_kv_heads * group,
        &SHAPES,
        (0, 1),
    );
    let device = DeviceBatch::upload(gpu, &batch);
    let scale = 1.0 / (head_dim as f32).sqrt();
    let what = format!("head_dim {head_dim} group {group} page_size {page_size}");
    let mma = device.run(gpu, &batch, scale, Kernel::Mma);
    let per_token = device.run(gpu, &batch, scale, Kernel::PerToken);
    let row_elems = batch.row_elems();
    let padding = &mma[(batch.num_rows() - 1) * row_elems..];
    assert!(
        padding.iter().all(|&v| v == 0.0),
        "padding row is zeros ({what})"
    );
    assert_close(
        &format!("mma vs per-token prefill {what}"),
        &mma,
        &per_token,
        TOLERANCE,
    );
    let mut sampled = Vec::new();
    let mut expected = Vec::new();
    for (row, owner) in batch.row_owners().iter().enumerate() {
        let Some((r, j)) = *owner else { continue };
        if row % 11 == 0 || j == 0 || j + 1 == batch.requests[r].q_len {
            sampled.extend_from_slice(&mma[row * row_elems..(row + 1) * row_elems]);
            expected.extend(batch.reference_row(row, (r, j), scale));
        }
    }
    assert_close(
        &format!("mma prefill vs f64 reference {what}"),
        &sampled,
        &expected,
        TOLERANCE,
    );
}

#[test]
fn mma_prefill_matches_reference_and_per_token_kernel() {
    let Some(gpu) = gpu("mma_prefill_matches_reference_and_per_token_kernel") else {
        return;
    };
    let mut seed = 300;
    for head_dim in [64, 128] {
        for group in [1, 3, 4, 8] {
            for page_size in [16, 32] {
                seed += 1;
                check_mma(&gpu, head_dim, group, page_size, seed);
            }
        }
    }
}

#[test]
fn mma_prefill_head_dim_256_and_every_group() {
    let Some(gpu) = gpu("mma_prefill_head_dim_256_and_every_group") else {
        return;
    };
    for (head_dim, group, page_size) in [
        (256, 1, 16),
        (256, 8, 32),
        (256, 3, 1),
        (64, 2, 16),
        (64, 5, 32),
        (64, 6, 16),
        (64, 7, 16),
        (128, 5, 1),
        (128, 7, 32),
    ] {
        let seed = 700 + head_dim as u64 + group as u64 + page_size as u64;
        check_mma(&gpu, head_dim, group, page_size, seed);
    }
}

/// Rows before `qo_indptr[0]` and after `qo_indptr[B]` are zeros, `q_len > seq_len` is NaN,
/// a page id past the pool is skipped, an empty request is harmless.
#[test]
fn mma_prefill_edge_rows() {
    let Some(gpu) = gpu("mma_prefill_edge_rows") else {
        return;
    };
    for (head_dim, group) in [(64, 4), (128, 3)] {
        let mut rng = rng(7 + head_dim as u64);
        let shapes = [
            (5, 3, 0, false),
            (0, 0, 0, false),
            (2, 3, 1, false),
            (130, 130, 2, true),
        ];
        let mut batch = Batch::new(&mut rng, (4, 2, head_dim), 2 * group, &shapes, (2, 70));
        // Request 3's fourth page (visible tokens 10..14) points past the pool.
        batch.requests[3].pages[3] = batch.layout.num_pages as u32 + 7;
        let device = DeviceBatch::upload(&gpu, &batch);
        let scale = 0.125;
        let out = device.run(&gpu, &batch, scale, Kernel::Mma);
        let row_elems = batch.row_elems();
        for (row, owner) in batch.row_owners().iter().enumerate() {
            let actual = &out[row * row_elems..(row + 1) * row_elems];
            match *owner {
                None => assert!(actual.iter().all(|&v| v == 0.0), "row {row} is zeros"),
                Some((2, _)) => assert!(actual.iter().all(|v| v.is_nan()), "row {row} is NaN"),
                Some(owner) => assert_close(
                    &format!("edge row {row} head_dim {head_dim}"),
                    actual,
                    &batch.reference_row(row, owner, scale),
                    TOLERANCE,
                ),
            }
        }
    }
}

/// q, pools and out that are not 16-byte (or 4-byte) aligned take the scalar load/store
/// paths and give bit-identical results.
#[test]
fn mma_prefill_misaligned_views_match() {
    let Some(gpu) = gpu("mma_prefill_misaligned_views_match") else {
        return;
    };
    let mut rng = rng(11);
    let shapes = [(90, 90, 0, false), (200, 17, 6, true)];
    let batch = Batch::new(&mut rng, (16, 2, 64), 6, &shapes, (0, 0));
    let device = DeviceBatch::upload(&gpu, &batch);
    let aligned = device.run(&gpu, &batch, 0.1, Kernel::Mma);
    let shifted = |values: &[f32]| {
        let mut padded = vec![0.5];
        padded.extend_from_slice(values);
        upload::<bf16>(&gpu, &padded)
    };
    let (qkv, k_pool, v_pool) = (
        shifted(&batch.qkv),
        shifted(&batch.k_pool),
        shifted(&batch.v_pool),
    );
    let len = batch.num_rows() * batch.row_elems();
    let mut out = poisoned::<bf16>(&gpu, len + 1);
    {
        let q = view(&qkv, 1..qkv.len()).unwrap();
        let k = view(&k_pool, 1..k_pool.len()).unwrap();
        let v = view(&v_pool, 1..v_pool.len()).unwrap();
        let mut out_view = view_mut(&mut out, 1..len + 1).unwrap();
        device.launch(&gpu, &batch, Kernel::Mma, 0.1, (&q, &k, &v), &mut out_view);
    }
    let misaligned = download(&gpu, &out);
    assert_eq!(&misaligned[1..], &aligned[..], "misaligned views");
}

/// The launch replays from a CUDA graph with the same result.
#[test]
fn mma_prefill_replays_from_a_graph() {
    let Some(gpu) = gpu("mma_prefill_replays_from_a_graph") else {
        return;
    };
    let mut rng = rng(9);
    let shapes = [(90, 90, 0, false), (200, 17, 6, true)];
    let batch = Batch::new(&mut rng, (16, 2, 128), 8, &shapes, (0, 0));
    let device = DeviceBatch::upload(&gpu, &batch);
    let direct = device.run(&gpu, &batch, 0.1, Kernel::Mma);
    let mut out = poisoned::<bf16>(&gpu, batch.num_rows() * batch.row_elems());
    let table = device.page_table();
    let graph = gpu
        .capture(|gpu| {
            ops::prefill_attention_mma(
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
fn mma_prefill_rejects_bad_input() {
    let Some(gpu) = gpu("mma_prefill_rejects_bad_input") else {
        return;
    };
    let layout = PoolLayout {
        num_pages: 2,
        page_size: 4,
        num_kv_heads: 2,
        head_dim: 64,
    };
    let arrays = [vec![0u32, 1], vec![0], vec![1], vec![0]].map(|a| gpu.upload(&a).unwrap());
    let table = DevicePageTable::new(&arrays[0], &arrays[1], &arrays[2], &arrays[3]).unwrap();
    let qo = gpu.upload(&[0u32, 1]).unwrap();
    let run = |num_q_heads: usize, q_len: usize, out_len: usize, layout: PoolLayout| {
        let pool = gpu.zeros::<bf16>(layout.pool_len()).unwrap();
        let q = gpu.zeros::<bf16>(q_len).unwrap();
        let mut out = gpu.zeros::<bf16>(out_len).unwrap();
        let row = num_q_heads * layout.head_dim;
        ops::prefill_attention_mma(
            &gpu,
            &q,
            (num_q_heads, row),
            &pool,
            &pool,
            &layout,
            &table,
            &qo,
            1.0,
            &mut out,
        )
        .unwrap_err()
        .to_string()
    };
    let odd = PoolLayout {
        head_dim: 96,
        ..layout
    };
    assert!(run(4, 4 * 96, 4 * 96, odd).contains("head_dim 96"));
    assert!(run(3, 3 * 64, 3 * 64, layout).contains("num_q_heads 3"));
    assert!(run(4, 4 * 64 - 1, 4 * 64, layout).contains("q"));
    assert!(run(4, 4 * 64, 4 * 64 + 1, layout).contains("out"));
    // f32 is refused with a message pointing at the tiled kernel.
    let pool = gpu.zeros::<f32>(layout.pool_len()).unwrap();
    let q = gpu.zeros::<f32>(4 * 64).unwrap();
    let mut out = gpu.zeros::<f32>(4 * 64).unwrap();
    let error = ops::prefill_attention_mma(
        &gpu,
        &q,
        (4, 4 * 64),
        &pool,
        &pool,
        &layout,
        &table,
        &qo,
        1.0,
        &mut out,
    )
    .unwrap_err()
    .to_string();
    assert!(error.contains("bf16 only"), "{error}");
}
