//! A ragged prefill batch over a paged pool (random pools, a fused QKV buffer, leading and
//! trailing rows outside `qo_indptr`), its f64 reference attention, and a device copy that
//! runs any of the prefill kernels. Shared by the prefill kernel tests.

use half::bf16;
use pagoda_cuda::{DeviceBuffer, DeviceRead, DeviceWrite, Gpu};
use pagoda_ops::cuda::{self as ops, DevicePageTable, PagedKv, PoolLayout, Queries};
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use super::{download, poisoned, random_vec, round, upload, TestFloat};

/// One request: visible tokens (new ones included), new (query) tokens, first visible row of
/// its first page, and its pages in table order.
pub struct Request {
    pub seq_len: usize,
    pub q_len: usize,
    pub first_page_offset: usize,
    pub pages: Vec<u32>,
}

impl Request {
    /// Pool row of visible token `v`, or `None` when its page id is out of the pool (the
    /// kernels skip such keys).
    pub fn row(&self, v: usize, layout: &PoolLayout) -> Option<usize> {
        let logical = self.first_page_offset + v;
        let page = self.pages[logical / layout.page_size] as usize;
        (page < layout.num_pages).then_some(page * layout.page_size + logical % layout.page_size)
    }
}

/// Shape of one request in a batch.
#[derive(Clone, Copy)]
pub struct Shape {
    pub seq_len: usize,
    pub q_len: usize,
    /// Taken modulo the page size.
    pub first_page_offset: usize,
    /// Pages listed in decreasing id order (scattered ids otherwise).
    pub reversed: bool,
}

pub const fn shape(
    seq_len: usize,
    q_len: usize,
    first_page_offset: usize,
    reversed: bool,
) -> Shape {
    Shape {
        seq_len,
        q_len,
        first_page_offset,
        reversed,
    }
}

/// A ragged batch over a paged pool, with random pools and a fused QKV buffer.
pub struct Batch {
    pub layout: PoolLayout,
    pub num_q_heads: usize,
    pub requests: Vec<Request>,
    /// Query rows before the first request (they must come out as zeros).
    pub leading_rows: usize,
    /// Query rows after the last request (zeros too).
    pub trailing_rows: usize,
    pub k_pool: Vec<f32>,
    pub v_pool: Vec<f32>,
    /// `[leading + sum(q_len) + trailing, qkv_width]`, rows `[q | k | v]`.
    pub qkv: Vec<f32>,
}

impl Batch {
    /// Random batch; values are rounded through `T` (what the GPU sees).
    pub fn new<T: TestFloat>(
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

    pub fn qkv_width(&self) -> usize {
        (self.num_q_heads + 2 * self.layout.num_kv_heads) * self.layout.head_dim
    }

    pub fn num_rows(&self) -> usize {
        self.qkv.len() / self.qkv_width()
    }

    pub fn row_elems(&self) -> usize {
        self.num_q_heads * self.layout.head_dim
    }

    /// CSR arrays: indptr, indices, last_page_len, first_page_offset.
    pub fn csr(&self) -> [Vec<u32>; 4] {
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

    pub fn qo_indptr(&self) -> Vec<u32> {
        let mut indptr = vec![self.leading_rows as u32];
        for request in &self.requests {
            indptr.push(indptr.last().unwrap() + request.q_len as u32);
        }
        indptr
    }

    /// `(request, j)` of every query row inside `qo_indptr` (`None` outside).
    pub fn row_owners(&self) -> Vec<Option<(usize, usize)>> {
        let mut owners = vec![None; self.leading_rows];
        for (index, request) in self.requests.iter().enumerate() {
            owners.extend((0..request.q_len).map(|j| Some((index, j))));
        }
        owners.extend(std::iter::repeat_n(None, self.trailing_rows));
        owners
    }

    /// Naive f64 attention of query row `row` (request `r`, query `j`), all heads:
    /// `[num_q_heads * head_dim]`.
    pub fn reference_row(&self, row: usize, (r, j): (usize, usize), scale: f32) -> Vec<f32> {
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

/// Which prefill kernel [`DeviceBatch::run`] launches.
pub use pagoda_ops::cuda::PrefillKernel as Kernel;

/// The batch in device memory.
pub struct DeviceBatch<T: TestFloat> {
    pub k_pool: DeviceBuffer<T>,
    pub v_pool: DeviceBuffer<T>,
    pub qkv: DeviceBuffer<T>,
    pub table: [DeviceBuffer<u32>; 4],
    pub qo_indptr: DeviceBuffer<u32>,
}

impl<T: TestFloat> DeviceBatch<T> {
    pub fn upload(gpu: &Gpu, batch: &Batch) -> Self {
        DeviceBatch {
            k_pool: upload::<T>(gpu, &batch.k_pool),
            v_pool: upload::<T>(gpu, &batch.v_pool),
            qkv: upload::<T>(gpu, &batch.qkv),
            table: batch.csr().map(|array| gpu.upload(&array).unwrap()),
            qo_indptr: gpu.upload(&batch.qo_indptr()).unwrap(),
        }
    }

    pub fn page_table(&self) -> DevicePageTable<'_> {
        let t = &self.table;
        DevicePageTable::new(&t[0], &t[1], &t[2], &t[3]).unwrap()
    }

    /// Launches `kernel` on explicit q / pools / out (views allowed).
    pub fn launch(
        &self,
        gpu: &Gpu,
        batch: &Batch,
        (kernel, scale): (Kernel, f32),
        (q, k_pool, v_pool): (
            &impl DeviceRead<T>,
            &impl DeviceRead<T>,
            &impl DeviceRead<T>,
        ),
        out: &mut impl DeviceWrite<T>,
    ) {
        let queries = Queries::new(q, batch.num_q_heads, batch.qkv_width());
        let kv = PagedKv::new(k_pool, v_pool, batch.layout, self.page_table());
        ops::prefill_attention_with(kernel, gpu, &queries, &kv, &self.qo_indptr, scale, out)
            .unwrap();
    }

    /// Runs `kernel` into a NaN-poisoned output and downloads it.
    pub fn run(&self, gpu: &Gpu, batch: &Batch, scale: f32, kernel: Kernel) -> Vec<f32> {
        let mut out = poisoned::<T>(gpu, batch.num_rows() * batch.row_elems());
        let inputs = (&self.qkv, &self.k_pool, &self.v_pool);
        self.launch(gpu, batch, (kernel, scale), inputs, &mut out);
        download(gpu, &out)
    }
}

/// bf16 is what the tensor-core kernel runs.
pub type Bf16Batch = DeviceBatch<bf16>;

/// Long prefills, decode rows, an empty request, chunked prefill, offsets, reversed pages.
pub const STANDARD_SHAPES: [Shape; 8] = [
    shape(300, 300, 0, false),
    shape(37, 1, 3, true),
    shape(0, 0, 0, false),
    shape(700, 700, 5, true),
    shape(1, 1, 0, false),
    shape(520, 130, 9, false),
    shape(64, 1, 0, true),
    shape(45, 45, 15, false),
];

/// Compares `kernel` with the per-token kernel on every row of a [`STANDARD_SHAPES`] batch
/// (plus one padding row, which must be zeros), and with the f64 reference on a sample of
/// rows (every 11th, plus the first and last of each request).
pub fn check_against_oracles<T: TestFloat>(
    gpu: &Gpu,
    kernel: Kernel,
    (head_dim, group, page_size): (usize, usize, usize),
    seed: u64,
    tolerance: f32,
) {
    let mut rng = super::rng(seed);
    let num_kv_heads = 2;
    let batch = Batch::new::<T>(
        &mut rng,
        (page_size, num_kv_heads, head_dim),
        num_kv_heads * group,
        &STANDARD_SHAPES,
        (0, 1),
    );
    let device = DeviceBatch::<T>::upload(gpu, &batch);
    let scale = 1.0 / (head_dim as f32).sqrt();
    let what = format!(
        "{kernel:?} {} head_dim {head_dim} group {group} page_size {page_size}",
        T::NAME
    );
    let got = device.run(gpu, &batch, scale, kernel);
    let per_token = device.run(gpu, &batch, scale, Kernel::PerToken);
    let row_elems = batch.row_elems();
    let padding = &got[(batch.num_rows() - 1) * row_elems..];
    assert!(
        padding.iter().all(|&v| v == 0.0),
        "padding row is zeros ({what})"
    );
    super::assert_close(&format!("{what} vs per-token"), &got, &per_token, tolerance);
    let mut sampled = Vec::new();
    let mut expected = Vec::new();
    for (row, owner) in batch.row_owners().iter().enumerate() {
        let Some((r, j)) = *owner else { continue };
        if row % 11 == 0 || j == 0 || j + 1 == batch.requests[r].q_len {
            sampled.extend_from_slice(&got[row * row_elems..(row + 1) * row_elems]);
            expected.extend(batch.reference_row(row, (r, j), scale));
        }
    }
    super::assert_close(
        &format!("{what} vs f64 reference"),
        &sampled,
        &expected,
        tolerance,
    );
}

/// Rows before `qo_indptr[0]` and after `qo_indptr[B]` are zeros, `q_len > seq_len` is NaN,
/// a page id past the pool is skipped, an empty request is harmless.
pub fn check_edge_rows<T: TestFloat>(
    gpu: &Gpu,
    kernel: Kernel,
    (head_dim, group, page_size): (usize, usize, usize),
    (leading_rows, trailing_rows): (usize, usize),
    tolerance: f32,
) {
    let mut rng = super::rng(7 + head_dim as u64);
    let shapes = [
        shape(5, 3, 0, false),
        shape(0, 0, 0, false),
        shape(2, 3, 1, false),
        shape(130, 130, 2, true),
    ];
    let mut batch = Batch::new::<T>(
        &mut rng,
        (page_size, 2, head_dim),
        2 * group,
        &shapes,
        (leading_rows, trailing_rows),
    );
    // Request 3's fourth page points past the pool.
    batch.requests[3].pages[3] = batch.layout.num_pages as u32 + 7;
    let device = DeviceBatch::<T>::upload(gpu, &batch);
    let scale = 0.125;
    let out = device.run(gpu, &batch, scale, kernel);
    let row_elems = batch.row_elems();
    for (row, owner) in batch.row_owners().iter().enumerate() {
        let actual = &out[row * row_elems..(row + 1) * row_elems];
        match *owner {
            None => assert!(actual.iter().all(|&v| v == 0.0), "row {row} is zeros"),
            Some((2, _)) => assert!(actual.iter().all(|v| v.is_nan()), "row {row} is NaN"),
            Some(owner) => super::assert_close(
                &format!("{kernel:?} edge row {row} head_dim {head_dim}"),
                actual,
                &batch.reference_row(row, owner, scale),
                tolerance,
            ),
        }
    }
}

/// The launch of `kernel` replays from a CUDA graph with the same result as a direct run.
pub fn check_graph_replay<T: TestFloat>(gpu: &Gpu, kernel: Kernel, head_dim: usize) {
    let mut rng = super::rng(9);
    let shapes = [shape(90, 90, 0, false), shape(200, 17, 6, true)];
    let batch = Batch::new::<T>(&mut rng, (16, 2, head_dim), 8, &shapes, (0, 0));
    let device = DeviceBatch::<T>::upload(gpu, &batch);
    let direct = device.run(gpu, &batch, 0.1, kernel);
    let mut out = poisoned::<T>(gpu, batch.num_rows() * batch.row_elems());
    let inputs = (&device.qkv, &device.k_pool, &device.v_pool);
    let graph = gpu
        .capture(|gpu| {
            device.launch(gpu, &batch, (kernel, 0.1), inputs, &mut out);
            Ok(())
        })
        .unwrap();
    graph.launch().unwrap();
    gpu.synchronize().unwrap();
    assert_eq!(download(gpu, &out), direct, "{kernel:?} graph replay");
}
