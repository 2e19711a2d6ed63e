//! The CUDA runs of the attention cases, one output per kernel: every prefill kernel
//! (`per_token`, `tiled`, and the tensor-core `mma` for bf16) on a prefill batch; on a decode
//! batch the gather decode and the fused split-KV decode (CUDA cores, and tensor cores for
//! bf16; both merge modes; the searched plan and one page per chunk, the most merging).

use pagoda_cuda::{DeviceBuffer, Gpu};
use pagoda_ops::cuda::{
    self as ops, DevicePageTable, MergeMode, PagedDecodeKernel, PagedDecodePlan,
    PagedDecodeWorkspace, PagedKv, PlanCapacity, PlanPolicy, PoolLayout, PrefillKernel,
    PrefillStreamTiling, Queries, StreamTiling, MMA_PREFILL_HEAD_DIMS, PAGED_DECODE_MMA_HEAD_DIMS,
    STREAM_PREFILL_HEAD_DIMS,
};

use super::attention::Attention;
use crate::framework::{with_dtype, GpuDtype, Output};
use crate::gpu_common::{download, poisoned, upload, TestFloat};

/// The case's batch in device memory as `T`.
struct Device<T: TestFloat> {
    layout: PoolLayout,
    q: DeviceBuffer<T>,
    k_pool: DeviceBuffer<T>,
    v_pool: DeviceBuffer<T>,
    table: [DeviceBuffer<u32>; 4],
    qo_indptr: DeviceBuffer<u32>,
}

impl<T: TestFloat> Device<T> {
    fn new(gpu: &Gpu, case: &Attention, dtype: GpuDtype) -> Self {
        let f = &case.fixture;
        let [q, k_pool, v_pool] = case.inputs(dtype);
        let table = &f.page_table;
        Device {
            layout: PoolLayout {
                num_pages: f.layout.num_pages,
                page_size: f.layout.page_size,
                num_kv_heads: f.layout.num_kv_heads,
                head_dim: f.layout.head_dim,
            },
            q: upload::<T>(gpu, &q),
            k_pool: upload::<T>(gpu, &k_pool),
            v_pool: upload::<T>(gpu, &v_pool),
            table: [
                &table.indptr,
                &table.indices,
                &table.last_page_len,
                &table.first_page_offset,
            ]
            .map(|array| gpu.upload(array).unwrap()),
            qo_indptr: gpu.upload(&f.qo_indptr).unwrap(),
        }
    }

    fn kv(&self) -> PagedKv<'_, T> {
        let t = &self.table;
        let table = DevicePageTable::new(&t[0], &t[1], &t[2], &t[3]).unwrap();
        PagedKv::new(&self.k_pool, &self.v_pool, self.layout, table)
    }

    fn queries(&self, num_q_heads: usize) -> Queries<'_, T> {
        Queries::new(&self.q, num_q_heads, num_q_heads * self.layout.head_dim)
    }
}

/// Every CUDA kernel of the case's kind on `dtype`, one output each.
pub fn run(case: &Attention, gpu: &Gpu, dtype: GpuDtype) -> Vec<Output> {
    with_dtype!(dtype, T => {
        let device = Device::<T>::new(gpu, case, dtype);
        if case.is_decode() {
            decode(case, gpu, &device, dtype)
        } else {
            prefill(case, gpu, &device, dtype)
        }
    })
}

fn prefill<T: TestFloat>(
    case: &Attention,
    gpu: &Gpu,
    device: &Device<T>,
    dtype: GpuDtype,
) -> Vec<Output> {
    let f = &case.fixture;
    let mut kernels = vec![PrefillKernel::PerToken, PrefillKernel::Tiled];
    if dtype == GpuDtype::Bf16 && MMA_PREFILL_HEAD_DIMS.contains(&f.layout.head_dim) {
        kernels.push(PrefillKernel::Mma);
    }
    if dtype == GpuDtype::Bf16 && STREAM_PREFILL_HEAD_DIMS.contains(&f.layout.head_dim) {
        kernels.extend(PrefillStreamTiling::ALL.map(PrefillKernel::Stream));
    }
    kernels
        .into_iter()
        .map(|kernel| {
            let mut out = poisoned::<T>(gpu, f.output_len());
            let (queries, kv) = (device.queries(f.num_q_heads), device.kv());
            ops::prefill_attention_with(
                kernel,
                gpu,
                &queries,
                &kv,
                &device.qo_indptr,
                f.scale,
                &mut out,
            )
            .unwrap();
            Output {
                variant: format!("{kernel:?}"),
                values: download(gpu, &out),
            }
        })
        .collect()
}

fn decode<T: TestFloat>(
    case: &Attention,
    gpu: &Gpu,
    device: &Device<T>,
    dtype: GpuDtype,
) -> Vec<Output> {
    let f = &case.fixture;
    let (num_q_heads, num_kv_heads) = (f.num_q_heads, f.layout.num_kv_heads);
    let num_requests = f.page_table.num_requests();
    let mut outputs = Vec::new();

    let mut workspace = ops::DecodeWorkspace::<T>::new(
        gpu,
        &device.layout,
        num_q_heads,
        num_requests,
        f.page_table.indices.len(),
    )
    .unwrap();
    let splits = ops::decode_splits(num_requests, num_kv_heads, gpu.info().sm_count as usize);
    let mut out = poisoned::<T>(gpu, f.output_len());
    let (queries, kv) = (device.queries(num_q_heads), device.kv());
    ops::decode_attention_gathered(
        gpu,
        &queries,
        &kv,
        &mut workspace,
        splits,
        f.scale,
        &mut out,
    )
    .unwrap();
    outputs.push(Output {
        variant: "gathered".into(),
        values: download(gpu, &out),
    });

    if let Some(reason) = ops::paged_decode_unsupported(T::DTYPE, &device.layout, num_q_heads) {
        println!("fused paged decode skipped: {reason}");
        return outputs;
    }
    let mut kernels = vec![PagedDecodeKernel::CudaCore];
    if dtype == GpuDtype::Bf16 && PAGED_DECODE_MMA_HEAD_DIMS.contains(&f.layout.head_dim) {
        kernels.push(PagedDecodeKernel::TensorCore);
        let tilings = StreamTiling::ALL.into_iter();
        let fitting = tilings.filter(|t| t.fits(f.layout.head_dim));
        kernels.extend(fitting.map(PagedDecodeKernel::Streaming));
    }
    let sm_count = gpu.info().sm_count as usize;
    let policies = [
        (
            "searched",
            PlanPolicy {
                target_ctas: 2 * sm_count,
                pages_per_chunk: None,
                min_pages_per_chunk: 1,
                resident_ctas: None,
            },
        ),
        (
            "page-chunks",
            PlanPolicy {
                target_ctas: 1,
                pages_per_chunk: Some(1),
                min_pages_per_chunk: 1,
                resident_ctas: None,
            },
        ),
    ];
    for kernel in kernels {
        for merge in [MergeMode::InKernel, MergeMode::Separate] {
            for (policy_name, policy) in policies {
                let mut capacity =
                    PlanCapacity::for_batch(num_requests, num_kv_heads, policy.target_ctas);
                if policy.pages_per_chunk.is_some() {
                    capacity.max_chunks = f.page_table.indices.len() + num_requests;
                }
                let indptr = &f.page_table.indptr;
                let plan = PagedDecodePlan::new(indptr, num_kv_heads, policy, capacity).unwrap();
                let head_dim = f.layout.head_dim;
                let mut workspace =
                    PagedDecodeWorkspace::new(gpu, capacity, num_q_heads, num_kv_heads, head_dim)
                        .unwrap();
                workspace.upload_plan(gpu, &plan).unwrap();
                workspace.set_kernel(kernel);
                let mut out = poisoned::<T>(gpu, f.output_len());
                // Twice: the in-kernel merge must leave its semaphores at zero.
                for _ in 0..2 {
                    let (queries, kv) = (device.queries(num_q_heads), device.kv());
                    ops::paged_decode_attention(
                        gpu,
                        &queries,
                        &kv,
                        &mut workspace,
                        merge,
                        f.scale,
                        &mut out,
                    )
                    .unwrap();
                }
                outputs.push(Output {
                    variant: format!("{kernel:?}/{merge:?}/{policy_name}"),
                    values: download(gpu, &out),
                });
            }
        }
    }
    outputs
}
