//! The absorbed MLA decode's plan and workspace ([`MlaDecode`]): the fused decode's
//! [`PagedDecodePlan`] over the head tiles ([`ops::mla_head_tiles`], the "KV heads" of the
//! plan), made on the host for each decode step before it runs and uploaded into the
//! [`MlaDecodeWorkspace`], whose chunks [`ops::mla_decode`] merges by log-sum-exp.
//!
//! A step whose rows are not all decode rows (a prefill or a mixed step) stages no plan: its
//! latent attention runs [`ops::mla_prefill`] over every row. As the fused decode's
//! (`decode_path.rs`), a decode step's plan is made within the grid of its batch bucket
//! ([`MlaDecode::grid_chunks`], the launch's width whatever the plan), padding requests with
//! no pages, and uploaded from pinned memory, queued before the step's kernels: the launches
//! read nothing from the host that changes within a bucket, so decode steps replay from a
//! CUDA graph per bucket (ADR 0009); chunks past the plan's exit at once.

use pagoda_cuda::{CudaError, Gpu, PinnedBuffer};
use pagoda_ops::cuda::{
    self as ops, MlaDecodeWorkspace, MlaKernel, PagedDecodePlan, PlanCapacity, PlanPolicy,
};

use super::CudaCacheOptions;
use crate::config::ModelConfig;

/// The smallest chunk of the MLA decode's plan, in keys. Each chunk writes a partial of
/// heads x 512 f32 that the merge reads back, 16 times the fused decode's per head, so chunks
/// are larger than its 64 keys. Measured on an H100 (`pagoda bench attention --mla --q-heads
/// 16 --min-chunk-keys K`, docs/benchmark_results/moe-mla-cuda-h100-2026-12-05.md): 256 keys
/// take B=1 at 16K from 87 to 47 us and B=4 at 4K from 42 to 36 us, cost 2 us at B=1 4K,
/// and change nothing from B=16 on; 1024 keys lose at small batches.
const MIN_CHUNK_KEYS: usize = 256;

/// The MLA decode of a model's step buffers.
pub struct MlaDecode {
    workspace: MlaDecodeWorkspace,
    /// The encoded plan in pinned memory (rewritten by the next step's staging only after
    /// the step has finished: every step ends with a synchronization).
    staging: PinnedBuffer<u32>,
    policy: PlanPolicy,
    /// Head tiles (the plan's "KV heads").
    tiles: usize,
    /// Requests of the plan staged for the coming step (`None`: the step runs the prefill
    /// kernel over every row).
    staged: Option<usize>,
}

impl MlaDecode {
    /// The decode of `config`'s latent attention for steps of at most
    /// `options.max_batch_requests` requests: the tensor-core partial kernel for bf16, the
    /// CUDA-core one otherwise (f32, the exact path).
    pub(super) fn new(
        gpu: &Gpu,
        config: &ModelConfig,
        options: &CudaCacheOptions,
        dtype: pagoda_cuda::DType,
    ) -> Result<Option<Self>, CudaError> {
        let Some(mla) = &config.mla else {
            return Ok(None);
        };
        let heads = config.num_attention_heads;
        let tiles = ops::mla_head_tiles(heads);
        let sm_count = gpu.info().sm_count.max(1) as usize;
        let policy = PlanPolicy {
            target_ctas: 2 * sm_count,
            pages_per_chunk: None,
            // Chunks of at least MIN_CHUNK_KEYS keys (a whole number of 64-key tiles).
            min_pages_per_chunk: MIN_CHUNK_KEYS.div_ceil(options.page_size.max(1)),
            // Two CTAs per SM: the CUDA-core kernel and the 2-stage tensor-core one.
            resident_ctas: Some(2 * sm_count),
        };
        let capacity =
            PlanCapacity::for_batch(options.max_batch_requests.max(1), tiles, policy.target_ctas);
        let mut workspace = MlaDecodeWorkspace::new(gpu, capacity, heads, mla.kv_lora_rank)?;
        let kernel = if dtype == pagoda_cuda::DType::BF16 {
            MlaKernel::TensorCore {
                stages: ops::MLA_MMA_STAGES,
            }
        } else {
            MlaKernel::CudaCore
        };
        workspace.set_kernel(kernel);
        static LOGGED: std::sync::Once = std::sync::Once::new();
        LOGGED.call_once(|| {
            tracing::info!(
                "CUDA latent attention (MLA): decode steps on the split-KV absorbed decode \
                 ({kernel:?}), prefill and mixed steps on the MLA prefill kernel"
            )
        });
        Ok(Some(MlaDecode {
            staging: gpu.alloc_pinned(capacity.encoded_len())?,
            workspace,
            policy,
            tiles,
            staged: None,
        }))
    }

    /// The grid width in chunks of a decode step of a batch bucket of `requests` rows (as
    /// the fused decode's `grid_chunks`): room for every request's chunk and the policy's
    /// CTA target, within the workspace.
    pub fn grid_chunks(&self, requests: usize) -> usize {
        PlanCapacity::for_batch(requests, self.tiles, self.policy.target_ctas)
            .max_chunks
            .min(self.workspace.capacity().max_chunks)
    }

    /// Plans the coming step: a decode step (one row per request, padding requests with no
    /// pages) whose page table has the row pointer `indptr`, within `grid_chunks` chunks,
    /// the launch's grid (`Some`, [`MlaDecode::grid_chunks`] of its bucket); or a step of
    /// any other shape (`None`: the prefill kernel attends every row).
    pub fn stage(&mut self, gpu: &Gpu, decode: Option<(&[u32], usize)>) -> Result<(), CudaError> {
        self.staged = None;
        let Some((indptr, grid_chunks)) = decode else {
            return Ok(());
        };
        let capacity = self.workspace.capacity();
        let bucket = PlanCapacity {
            max_chunks: grid_chunks,
            max_requests: capacity.max_requests,
        };
        let plan = PagedDecodePlan::new(indptr, self.tiles, self.policy, bucket)?;
        plan.encode_into(capacity, self.staging.as_mut_slice()?)?;
        gpu.upload_pinned(&self.staging, self.workspace.plan_buffer_mut())?;
        self.workspace.set_grid_chunks(grid_chunks)?;
        self.staged = Some(indptr.len().saturating_sub(1));
        Ok(())
    }

    /// The workspace of a decode step of `num_requests` rows whose plan was staged, else
    /// `None` (the step runs the prefill kernel).
    pub(super) fn planned(&mut self, num_requests: usize) -> Option<&mut MlaDecodeWorkspace> {
        (self.staged == Some(num_requests)).then_some(&mut self.workspace)
    }
}
