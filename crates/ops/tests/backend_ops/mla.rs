//! DeepSeek's latent attention (MLA, absorbed form): the CPU `mla_attention` is the reference;
//! CUDA runs the decode (CUDA cores; tensor cores at 2 and 3 stages for bf16; one page per
//! chunk, the most merging) on decode batches and the causal prefill on prefill batches.
//! Latent rows of 512 + 64, mid-page starts, scattered pages.

use pagoda_cuda::Gpu;
use pagoda_kv::PageTable;
use pagoda_ops::attention::{mla_attention, KvLayout, LatentKv};
use pagoda_ops::cuda::{
    self as ops, DevicePageTable, LatentPool, MlaDecodeWorkspace, MlaKernel, PagedDecodePlan,
    PlanCapacity, PlanPolicy, PoolLayout, Queries,
};
use rand::Rng;

use crate::framework::{
    random_bf16, with_dtype, Backend, Expected, Family, GpuDtype, OpCase, Output,
};
use crate::gpu_common::{download, poisoned, rng, upload, TestFloat};

const LATENT: usize = 512;
const ROW: usize = LATENT + 64;
const NUM_PAGES: usize = 96;

pub fn cases() -> Vec<Box<dyn OpCase>> {
    // (heads, page_size, visible lengths, queries per request)
    let shapes: [(usize, usize, &[usize], &[u32]); 4] = [
        (16, 16, &[1, 17, 300], &[1, 1, 1]),
        (128, 16, &[15, 64], &[1, 1]),
        (16, 1, &[33, 5], &[1, 1]),
        (16, 16, &[1, 40, 17], &[1, 5, 17]),
    ];
    shapes
        .iter()
        .enumerate()
        .map(|(index, &(heads, page_size, lens, q_lens))| {
            Box::new(MlaCase::new(
                heads,
                page_size,
                lens,
                q_lens,
                70 + index as u64,
            )) as Box<dyn OpCase>
        })
        .collect()
}

struct MlaCase {
    heads: usize,
    page_size: usize,
    table: PageTable,
    qo_indptr: Vec<u32>,
    pool: Vec<f32>,
    q: Vec<f32>,
}

impl MlaCase {
    fn new(heads: usize, page_size: usize, lens: &[usize], q_lens: &[u32], seed: u64) -> MlaCase {
        let mut rng = rng(seed);
        let mut table = PageTable {
            indices: Vec::new(),
            indptr: vec![0],
            last_page_len: Vec::new(),
            first_page_offset: Vec::new(),
            seq_lens: Vec::new(),
            rope_offsets: Vec::new(),
        };
        let num_pages = NUM_PAGES * 16 / page_size;
        for (r, &len) in lens.iter().enumerate() {
            let fpo = if r % 2 == 1 { page_size / 2 } else { 0 };
            let pages = (fpo + len).div_ceil(page_size);
            for _ in 0..pages {
                table.indices.push(rng.random_range(0..num_pages) as u32);
            }
            table.indptr.push(table.indices.len() as u32);
            table
                .last_page_len
                .push((fpo + len - (pages - 1) * page_size) as u32);
            table.first_page_offset.push(fpo as u32);
            table.seq_lens.push(len as u32);
            table.rope_offsets.push((fpo + len) as u32);
        }
        let mut qo_indptr = vec![0u32];
        for &q_len in q_lens {
            qo_indptr.push(qo_indptr.last().unwrap() + q_len);
        }
        let tokens = *qo_indptr.last().unwrap() as usize;
        MlaCase {
            heads,
            page_size,
            pool: random_bf16(&mut rng, num_pages * page_size * ROW, 1.0),
            q: random_bf16(&mut rng, tokens * heads * ROW, 2.0),
            table,
            qo_indptr,
        }
    }

    fn is_decode(&self) -> bool {
        self.qo_indptr.windows(2).all(|w| w[1] - w[0] == 1)
    }

    fn layout(&self) -> PoolLayout {
        PoolLayout {
            num_pages: self.pool.len() / (self.page_size * ROW),
            page_size: self.page_size,
            num_kv_heads: 1,
            head_dim: ROW,
        }
    }

    fn scale() -> f32 {
        1.0 / 192f32.sqrt()
    }

    fn run_cuda<T: TestFloat>(&self, gpu: &Gpu, dtype: GpuDtype) -> Vec<Output> {
        let pool = upload::<T>(gpu, &self.pool);
        let q = upload::<T>(gpu, &self.q);
        let t = [
            &self.table.indptr,
            &self.table.indices,
            &self.table.last_page_len,
            &self.table.first_page_offset,
        ]
        .map(|array| gpu.upload(array).unwrap());
        let table = DevicePageTable::new(&t[0], &t[1], &t[2], &t[3]).unwrap();
        let kv = LatentPool::new(&pool, self.layout(), table, LATENT);
        let queries = Queries::new(&q, self.heads, self.heads * ROW);
        let tokens = *self.qo_indptr.last().unwrap() as usize;
        let mut outputs = Vec::new();
        if !self.is_decode() {
            let qo = gpu.upload(&self.qo_indptr).unwrap();
            let mut out = poisoned::<T>(gpu, tokens * self.heads * LATENT);
            ops::mla_prefill(gpu, &queries, &kv, &qo, Self::scale(), &mut out).unwrap();
            outputs.push(Output {
                variant: "prefill".into(),
                values: download(gpu, &out),
            });
            return outputs;
        }
        let mut kernels = vec![("cuda-cores", MlaKernel::CudaCore)];
        if dtype == GpuDtype::Bf16 {
            kernels.push(("mma-2", MlaKernel::TensorCore { stages: 2 }));
            kernels.push(("mma-3", MlaKernel::TensorCore { stages: 3 }));
        }
        let b = self.table.num_requests();
        let tiles = ops::mla_head_tiles(self.heads);
        let policy = PlanPolicy {
            target_ctas: 1,
            pages_per_chunk: Some(1),
            min_pages_per_chunk: 1,
            resident_ctas: None,
        };
        let capacity = PlanCapacity {
            max_chunks: self.table.indices.len() + b,
            max_requests: b,
        };
        let plan = PagedDecodePlan::new(&self.table.indptr, tiles, policy, capacity).unwrap();
        for (name, kernel) in kernels {
            let mut workspace = MlaDecodeWorkspace::new(gpu, capacity, self.heads, LATENT).unwrap();
            workspace.upload_plan(gpu, &plan).unwrap();
            workspace.set_kernel(kernel);
            let mut out = poisoned::<T>(gpu, b * self.heads * LATENT);
            ops::mla_decode(gpu, &queries, &kv, &mut workspace, Self::scale(), &mut out).unwrap();
            outputs.push(Output {
                variant: format!("decode {name}"),
                values: download(gpu, &out),
            });
        }
        outputs
    }
}

impl OpCase for MlaCase {
    fn op(&self) -> &'static str {
        "mla_attention"
    }

    fn shape(&self) -> String {
        format!(
            "heads {} page {} lens {:?} q {:?}",
            self.heads,
            self.page_size,
            self.table.seq_lens,
            self.qo_indptr
                .windows(2)
                .map(|w| w[1] - w[0])
                .collect::<Vec<_>>()
        )
    }

    fn family(&self) -> Family {
        Family::ReferenceOnly
    }

    fn reference(&self, backend: &Backend<'_>) -> Expected {
        let round = |values: &[f32]| match backend {
            Backend::Cuda(_, dtype) => dtype.round(values),
            _ => values.to_vec(),
        };
        let layout = KvLayout {
            num_pages: self.layout().num_pages,
            page_size: self.page_size,
            num_kv_heads: 1,
            head_dim: ROW,
        };
        let pool = round(&self.pool);
        let kv = LatentKv {
            pool: pool.as_slice().into(),
            layout,
            page_table: &self.table,
        };
        let tokens = *self.qo_indptr.last().unwrap() as usize;
        let mut out = vec![0f32; tokens * self.heads * LATENT];
        let q = round(&self.q);
        mla_attention(
            &kv,
            &q,
            &self.qo_indptr,
            self.heads,
            LATENT,
            Self::scale(),
            &mut out,
        )
        .unwrap();
        Expected::peak(out)
    }

    fn run(&self, backend: &Backend<'_>) -> Option<Vec<Output>> {
        match backend {
            Backend::Cuda(gpu, dtype) => {
                Some(with_dtype!(*dtype, T => self.run_cuda::<T>(gpu, *dtype)))
            }
            _ => None,
        }
    }

    fn tolerance(&self, backend: &Backend<'_>) -> f64 {
        match backend {
            Backend::Cuda(_, GpuDtype::F32) => 1e-5,
            // bf16 outputs (and, on tensor cores, bf16 probabilities).
            Backend::Cuda(_, GpuDtype::Bf16) => 2e-2,
            _ => 0.0,
        }
    }
}
