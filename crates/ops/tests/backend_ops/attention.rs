//! Paged attention cases: ragged causal prefill (full prompts, a chunked prefill whose window
//! starts mid-page, decode rows in the same batch), paged decode at several context lengths
//! (1 token to 4097, partial first and last pages, split-KV chunks), and the f16 / q8_0 KV
//! pools. Pages are scattered over a pool whose unwritten rows hold garbage
//! (`attention_reference::Fixture`). Reference: `pagoda_ops::attention::gather_attention`
//! (gather then attend, the parity path) over the f32 pools, or over the bf16-rounded inputs
//! for `cuda-bf16`. CPU backends: `step_attention` with each split-KV chunk kernel, every row
//! split-KV ("split") and routed by visible length ("routed"); the quantized pools are read
//! back by the same kernels and must stay within their measured bounds of the f32 pools. CUDA
//! runs: see `attention_cuda.rs`.

use pagoda_ops::attention::{
    gather_attention, plan_step, step_attention, KvPool, KvType, PagedKv, QueryBatch,
    SplitKvChunking, StepAttentionConfig, StepWorkspace,
};

use crate::attention_reference::{request, Fixture, PageOrder, RequestSpec};
use crate::framework::{Backend, Expected, Family, GpuDtype, OpCase, Output};

pub fn cases() -> Vec<Box<dyn OpCase>> {
    let mut cases: Vec<Box<dyn OpCase>> = Vec::new();
    let prefill = [
        request(77, 0, 77),
        request(129, 33, 12),
        request(5, 0, 5),
        request(40, 0, 1),
    ];
    let decode = [
        request(1, 0, 1),
        request(15, 0, 1),
        request(17, 0, 1),
        request(333, 0, 1),
        request(1000, 21, 1),
        request(4097, 0, 1),
    ];
    let mut seed = 300;
    // (page_size, num_kv_heads, n_rep, head_dim)
    for geometry in [(16, 2, 3, 64), (32, 2, 4, 128), (16, 1, 8, 128)] {
        seed += 1;
        cases.push(Attention::boxed(
            "attention_prefill",
            &prefill,
            geometry,
            KvType::F32,
            seed,
        ));
        cases.push(Attention::boxed(
            "attention_decode",
            &decode,
            geometry,
            KvType::F32,
            seed,
        ));
    }
    for kv_type in [KvType::F16, KvType::Q8_0] {
        for geometry in [(16, 3, 3, 64), (16, 2, 2, 128)] {
            seed += 1;
            cases.push(Attention::boxed(
                "attention_kv",
                &prefill,
                geometry,
                kv_type,
                seed,
            ));
        }
    }
    cases
}

/// Visible tokens per split-KV chunk on the CPU: several chunks for every long row.
const CHUNK_TOKENS: usize = 48;
/// The routed plan's threshold: shorter rows gather, longer ones split.
const ROUTED_MIN_SPLIT_TOKENS: usize = 64;

pub struct Attention {
    pub op: &'static str,
    pub kv_type: KvType,
    pub fixture: Fixture,
}

impl Attention {
    fn boxed(
        op: &'static str,
        specs: &[RequestSpec],
        (page_size, num_kv_heads, n_rep, head_dim): (usize, usize, usize, usize),
        kv_type: KvType,
        seed: u64,
    ) -> Box<dyn OpCase> {
        let order = if seed.is_multiple_of(2) {
            PageOrder::Random
        } else {
            PageOrder::Reverse
        };
        let fixture = Fixture::new(specs, page_size, num_kv_heads, n_rep, head_dim, order, seed);
        Box::new(Attention {
            op,
            kv_type,
            fixture,
        })
    }

    /// Every request has one query.
    pub fn is_decode(&self) -> bool {
        self.fixture.qo_indptr.windows(2).all(|w| w[1] - w[0] == 1)
    }

    /// `(q, k_pool, v_pool)` as `dtype` stores them.
    pub fn inputs(&self, dtype: GpuDtype) -> [Vec<f32>; 3] {
        let f = &self.fixture;
        [&f.q, &f.k_pool, &f.v_pool].map(|values| dtype.round(values))
    }

    fn step(&self, kv: &PagedKv<'_>, backend_kernel: Backend<'_>, min_split: usize) -> Vec<f32> {
        let Backend::CpuAttention(kernel) = backend_kernel else {
            unreachable!("CPU attention backends only")
        };
        let f = &self.fixture;
        let config = StepAttentionConfig {
            chunking: SplitKvChunking::new(f.layout.num_kv_heads, CHUNK_TOKENS),
            min_split_kv_tokens: min_split,
        };
        let plan = plan_step(kv, &f.qo_indptr, f.num_q_heads, &config)
            .unwrap()
            .with_kernel(kernel);
        let mut out = vec![f32::NAN; f.output_len()];
        let mut workspace = StepWorkspace::default();
        step_attention(kv, &f.queries(), &plan, f.scale, &mut workspace, &mut out).unwrap();
        out
    }
}

impl OpCase for Attention {
    fn op(&self) -> &'static str {
        self.op
    }

    fn shape(&self) -> String {
        let f = &self.fixture;
        let seq_lens = &f.page_table.seq_lens;
        let seq = if seq_lens.len() > 4 {
            format!("{}..{}", seq_lens[0], seq_lens[seq_lens.len() - 1])
        } else {
            format!("{seq_lens:?}")
        };
        format!(
            "kv {} q {} hq {}/{} d {} page {} seq {seq}",
            self.kv_type,
            f.num_query_tokens(),
            f.num_q_heads,
            f.layout.num_kv_heads,
            f.layout.head_dim,
            f.layout.page_size,
        )
    }

    fn family(&self) -> Family {
        Family::Attention
    }

    fn reference(&self, backend: &Backend<'_>) -> Expected {
        let dtype = match backend {
            Backend::Cuda(_, dtype) => *dtype,
            _ => GpuDtype::F32,
        };
        let [q, k_pool, v_pool] = self.inputs(dtype);
        let f = &self.fixture;
        let kv = PagedKv {
            k_pool: (&k_pool).into(),
            v_pool: (&v_pool).into(),
            ..f.kv()
        };
        let queries = QueryBatch {
            q: &q,
            ..f.queries()
        };
        let mut out = vec![f32::NAN; f.output_len()];
        gather_attention(&kv, &queries, f.scale, &mut out).unwrap();
        Expected::peak(out)
    }

    fn run(&self, backend: &Backend<'_>) -> Option<Vec<Output>> {
        match backend {
            Backend::CpuAttention(_) => {
                let f = &self.fixture;
                let pool = |values: &[f32]| {
                    let mut pool = KvPool::zeros(self.kv_type, values.len());
                    pool.write(0, values);
                    pool
                };
                let (k, v) = (pool(&f.k_pool), pool(&f.v_pool));
                let kv = PagedKv {
                    k_pool: k.as_slice(),
                    v_pool: v.as_slice(),
                    ..f.kv()
                };
                let runs = [("split", 0), ("routed", ROUTED_MIN_SPLIT_TOKENS)];
                let outputs = runs.map(|(variant, min_split)| Output {
                    variant: variant.into(),
                    values: self.step(&kv, *backend, min_split),
                });
                Some(outputs.into())
            }
            Backend::Cuda(gpu, dtype) if self.kv_type == KvType::F32 => {
                Some(super::attention_cuda::run(self, gpu, *dtype))
            }
            _ => None,
        }
    }

    fn tolerance(&self, backend: &Backend<'_>) -> f64 {
        match (backend, self.kv_type) {
            // K/V uniform in [-1, 1]; measured worst differences from the f32 pools: f16
            // 2.6e-4, q8_0 4.5e-3 (attention_kv_types.rs); about 3x.
            (_, KvType::F16) => 8e-4,
            (_, KvType::Q8_0) => 1.5e-2,
            (Backend::Cuda(_, GpuDtype::Bf16), _) => 2e-2,
            (Backend::Cuda(_, GpuDtype::F32), _) => 2e-5,
            _ => 1e-5,
        }
    }
}
