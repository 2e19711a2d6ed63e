//! Which attention a CUDA decode step runs, and the fused decode's per-step plan.
//!
//! Decode steps (one query per request) run either the fused split-KV paged decode
//! (`ops::paged_decode_attention`: reads the pages in place, chunks merged in the same
//! launch) or the gather baseline (`ops::decode_attention_gathered`: copies the pages, then
//! attends), which stays as the fallback and the oracle. `PAGODA_PAGED_DECODE` or
//! `--paged-decode` force either; `auto` runs the fused path wherever the geometry allows
//! (it measured faster than gather in every cell of the op-level benchmark and every
//! end-to-end scenario on the H200: `docs/benchmark_results/paged-decode-h200-*.md`).

use std::str::FromStr;

use pagoda_cuda::{CudaError, DType, Gpu, PinnedBuffer};
use pagoda_ops::cuda::{
    self as ops, PagedDecodePlan, PagedDecodeWorkspace, PlanCapacity, PlanPolicy,
};

use super::CudaCacheOptions;
use crate::config::ModelConfig;

/// The decode attention path on CUDA.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PagedDecodeMode {
    /// The fused path wherever it supports the geometry, else gather.
    #[default]
    Auto,
    /// Always the fused path (an unsupported geometry is an error at load).
    Fused,
    /// Always the gather baseline.
    Gather,
}

/// The environment variable that picks the decode path when no flag does.
pub const PAGED_DECODE_ENV_VAR: &str = "PAGODA_PAGED_DECODE";

impl FromStr for PagedDecodeMode {
    type Err = String;

    fn from_str(value: &str) -> Result<Self, String> {
        match value {
            "auto" => Ok(PagedDecodeMode::Auto),
            "fused" => Ok(PagedDecodeMode::Fused),
            "gather" => Ok(PagedDecodeMode::Gather),
            other => Err(format!(
                "paged decode path `{other}`: use auto, fused or gather"
            )),
        }
    }
}

impl std::fmt::Display for PagedDecodeMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PagedDecodeMode::Auto => "auto",
            PagedDecodeMode::Fused => "fused",
            PagedDecodeMode::Gather => "gather",
        })
    }
}

impl PagedDecodeMode {
    /// The [`PAGED_DECODE_ENV_VAR`] setting of `config` (`PAGODA_PAGED_DECODE` or
    /// `--paged-decode`, checked when `config` was resolved).
    pub fn from_config(config: &pagoda_config::Config) -> Self {
        config
            .word(PAGED_DECODE_ENV_VAR)
            .parse()
            .unwrap_or_default()
    }
}

/// The fused decode's device workspace and the pinned staging of its plan.
pub struct FusedDecode {
    workspace: PagedDecodeWorkspace,
    staging: PinnedBuffer<u32>,
    policy: PlanPolicy,
    num_kv_heads: usize,
    merge: ops::MergeMode,
}

impl FusedDecode {
    /// The fused decode for `config` under `options`, or `None` when the mode or the
    /// geometry selects gather (logged once by the caller). `Fused` on an unsupported
    /// geometry is an error.
    pub(super) fn new(
        gpu: &Gpu,
        config: &ModelConfig,
        options: &CudaCacheOptions,
        dtype: DType,
    ) -> Result<Option<Self>, CudaError> {
        if options.paged_decode == PagedDecodeMode::Gather || options.kernels.deterministic {
            return Ok(None);
        }
        let layout = ops::PoolLayout {
            num_pages: options.num_pages.max(1),
            page_size: options.page_size,
            num_kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
        };
        if let Some(reason) =
            ops::paged_decode_unsupported(dtype, &layout, config.num_attention_heads)
        {
            if options.paged_decode == PagedDecodeMode::Fused {
                return Err(CudaError::invalid(format!(
                    "--paged-decode fused: the fused decode does not support {reason} \
                     (use auto or gather)"
                )));
            }
            tracing::info!("CUDA decode attention: fused path unavailable ({reason}); gather");
            return Ok(None);
        }
        // Two waves of CTAs by default (`docs/benchmark_results/paged-decode-h200-*.md`);
        // the chunk size can be pinned (the autotuner's hook).
        let kernels = &options.kernels;
        let target_ctas = kernels
            .target_ctas
            .unwrap_or(2 * gpu.info().sm_count.max(1) as usize);
        let policy = PlanPolicy {
            target_ctas,
            pages_per_chunk: kernels.pages_per_chunk,
            // At least one 64-key tile per chunk: smaller chunks only add merge work
            // (measured at batch 1, 1K context on the H200).
            min_pages_per_chunk: 64usize.div_ceil(options.page_size.max(1)),
        };
        let mut capacity = PlanCapacity::for_batch(
            options.max_batch_requests.max(1),
            config.num_kv_heads,
            target_ctas,
        );
        if let Some(fixed) = policy.pages_per_chunk {
            // Every request may hold a full context of pages.
            let pages = options.max_context.div_ceil(options.page_size.max(1)) + 1;
            capacity.max_chunks = capacity
                .max_chunks
                .max(capacity.max_requests * pages.div_ceil(fixed))
                .min(ops::MAX_CHUNKS);
        }
        let mut workspace = PagedDecodeWorkspace::new(
            gpu,
            capacity,
            config.num_attention_heads,
            config.num_kv_heads,
            config.head_dim,
        )?;
        let kernel = kernels.decode_kernel(dtype, config.head_dim)?;
        workspace.set_kernel(kernel);
        let merge = kernels.merge;
        tracing::info!("CUDA fused decode: {kernel:?} partial kernel, {merge:?} merge");
        let staging = gpu.alloc_pinned(capacity.encoded_len())?;
        tracing::debug!(
            "CUDA fused decode: {} target CTAs, up to {} chunks, {:.1} MB of workspace",
            policy.target_ctas,
            capacity.max_chunks,
            workspace.bytes() as f64 / 1e6
        );
        Ok(Some(FusedDecode {
            workspace,
            staging,
            policy,
            num_kv_heads: config.num_kv_heads,
            merge,
        }))
    }

    /// The plan capacity of a batch bucket of `requests` rows: its grid width.
    pub fn grid_chunks(&self, requests: usize) -> usize {
        if self.policy.pages_per_chunk.is_some() {
            return self.workspace.capacity().max_chunks;
        }
        PlanCapacity::for_batch(requests, self.num_kv_heads, self.policy.target_ctas)
            .max_chunks
            .min(self.workspace.capacity().max_chunks)
    }

    /// Plans the step whose (padded) page table has the row pointer `indptr`, within
    /// `grid_chunks` chunks, and queues the plan's upload from pinned memory.
    pub fn stage(
        &mut self,
        gpu: &Gpu,
        indptr: &[u32],
        grid_chunks: usize,
    ) -> Result<PagedDecodePlan, CudaError> {
        let capacity = self.workspace.capacity();
        let bucket = PlanCapacity {
            max_chunks: grid_chunks,
            max_requests: capacity.max_requests,
        };
        let plan = PagedDecodePlan::new(indptr, self.num_kv_heads, self.policy, bucket)?;
        plan.encode_into(capacity, self.staging.as_mut_slice()?)?;
        gpu.upload_pinned(&self.staging, self.workspace.plan_buffer_mut())?;
        Ok(plan)
    }

    /// Where the chunks are merged.
    pub(super) fn merge(&self) -> ops::MergeMode {
        self.merge
    }

    /// The workspace, for the launch.
    pub(super) fn workspace_mut(&mut self) -> &mut PagedDecodeWorkspace {
        &mut self.workspace
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_print() {
        for mode in [
            PagedDecodeMode::Auto,
            PagedDecodeMode::Fused,
            PagedDecodeMode::Gather,
        ] {
            assert_eq!(mode.to_string().parse::<PagedDecodeMode>(), Ok(mode));
        }
        let err = "fast".parse::<PagedDecodeMode>().unwrap_err();
        assert!(err.contains("auto, fused or gather"), "{err}");
    }
}
