//! Which attention a CUDA decode step runs, and the fused decode's per-step plan.
//!
//! Decode steps (one query per request) run either the fused split-KV paged decode
//! (`ops::paged_decode_attention`: reads the pages in place, chunks merged in the same
//! launch) or the gather baseline (`ops::decode_attention_gathered`: copies the pages, then
//! attends), which stays as the fallback and the oracle. `PAGODA_PAGED_DECODE` or
//! `--paged-decode` force either; `auto` runs the fused path wherever the geometry allows
//! (it measured faster than gather in every cell of the op-level benchmark and every
//! end-to-end scenario on the H200: `docs/benchmark_results/archive/paged-decode-h200-*.md`).

use std::collections::HashSet;
use std::str::FromStr;
use std::sync::Mutex;

use pagoda_cuda::{CudaError, DType, DeviceViewMut, Gpu, PinnedBuffer};
use pagoda_ops::cuda::{
    self as ops, PagedDecodePlan, PagedDecodeWorkspace, PagedKv, PlanCapacity, PlanPolicy, Queries,
};

use super::cascade_path::CascadeLevels;
use super::{CudaCacheOptions, HostFloat};
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

/// Where a step's decode variant came from (for the counters and the one-time log lines).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VariantSource {
    /// The tuning table's row for the step's bucket.
    Tuned,
    /// The built-in heuristic (no table row for the bucket).
    Heuristic,
    /// The configuration fixed the kernel, merge or CTA target (no table consulted).
    Configured,
}

/// The choices the configuration fixes (`None`: the table or the heuristic decides).
#[derive(Clone, Copy, Debug)]
struct Forced {
    kernel: Option<ops::PagedDecodeKernel>,
    merge: Option<ops::MergeMode>,
    target_ctas: Option<usize>,
    pages_per_chunk: Option<usize>,
}

impl Forced {
    fn any(&self) -> bool {
        self.kernel.is_some()
            || self.merge.is_some()
            || self.target_ctas.is_some()
            || self.pages_per_chunk.is_some()
    }
}

/// The fused decode's device workspace, the pinned staging of its plan, and the per-bucket
/// choice of variant (the tuning table's row, else the heuristic; the configuration's forced
/// choices win over both).
pub struct FusedDecode {
    workspace: PagedDecodeWorkspace,
    staging: PinnedBuffer<u32>,
    num_kv_heads: usize,
    sm_count: usize,
    smem_per_sm: usize,
    min_pages_per_chunk: usize,
    forced: Forced,
    heuristic: ops::DecodeVariant,
    geometry: ops::DecodeGeometry,
    table: Option<ops::TuningTable>,
    /// Buckets whose choice was logged (once each).
    logged: Mutex<HashSet<ops::DecodeBucket>>,
    /// Cascade steps' shared level (`None`: off or unavailable).
    cascade: Option<CascadeLevels>,
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
        table: Option<&ops::TuningTable>,
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
        let kernels = &options.kernels;
        let forced = Forced {
            kernel: kernels.decode_kernel(dtype, config.head_dim)?,
            merge: kernels.merge,
            target_ctas: kernels.target_ctas,
            pages_per_chunk: kernels.pages_per_chunk,
        };
        let sm_count = gpu.info().sm_count.max(1) as usize;
        // Room for the largest CTA target any variant may ask for.
        let widest = ops::CANDIDATE_WAVES.iter().max().copied().unwrap_or(2) * sm_count;
        let mut capacity = PlanCapacity::for_batch(
            options.max_batch_requests.max(1),
            config.num_kv_heads,
            forced.target_ctas.unwrap_or(0).max(widest),
        );
        if let Some(fixed) = forced.pages_per_chunk {
            // Every request may hold a full context of pages.
            let pages = options.max_context.div_ceil(options.page_size.max(1)) + 1;
            capacity.max_chunks = capacity
                .max_chunks
                .max(capacity.max_requests * pages.div_ceil(fixed))
                .min(ops::MAX_CHUNKS);
        }
        let cascade = if kernels.kv_fp8 {
            None
        } else {
            let max_pages = options.num_pages.max(1)
                + capacity.max_requests * options.max_context.div_ceil(options.page_size.max(1));
            let shape = (dtype, &layout, config.num_attention_heads);
            let sizes = (capacity.max_requests, max_pages);
            CascadeLevels::new(gpu, kernels.cascade, shape, sizes)?
        };
        if cascade.is_some() {
            capacity.max_chunks = (capacity.max_chunks
                + CascadeLevels::extra_chunks(capacity.max_requests))
            .min(ops::MAX_CHUNKS);
        }
        let workspace = PagedDecodeWorkspace::new(
            gpu,
            capacity,
            config.num_attention_heads,
            config.num_kv_heads,
            config.head_dim,
        )?;
        let geometry = tuning_geometry(config, options, dtype);
        let table = if forced.any() {
            tracing::info!(
                "CUDA fused decode: kernel, merge or CTA target set by the configuration; \
                 the tuning table is not used"
            );
            None
        } else if kernels.kv_fp8 {
            tracing::info!(
                "CUDA fused decode over the fp8 KV cache: the built-in heuristic (the tuning \
                 table times bf16 caches)"
            );
            None
        } else {
            table.cloned()
        };
        let staging = gpu.alloc_pinned(capacity.encoded_len())?;
        tracing::debug!(
            "CUDA fused decode: up to {} chunks, {:.1} MB of workspace",
            capacity.max_chunks,
            workspace.bytes() as f64 / 1e6
        );
        Ok(Some(FusedDecode {
            workspace,
            staging,
            num_kv_heads: config.num_kv_heads,
            sm_count,
            smem_per_sm: gpu.info().shared_memory_per_sm as usize,
            // At least one 64-key tile per chunk: smaller chunks only add merge work
            // (measured at batch 1, 1K context on the H200).
            min_pages_per_chunk: 64usize.div_ceil(options.page_size.max(1)),
            forced,
            heuristic: ops::DecodeVariant::heuristic(dtype == DType::BF16, config.head_dim),
            geometry,
            table,
            logged: Mutex::new(HashSet::new()),
            cascade,
        }))
    }

    /// The variant of a step of `requests` rows whose longest request has `context`
    /// tokens, and where it came from. The first step of each bucket logs the choice.
    pub fn variant(&self, requests: usize, context: usize) -> (ops::DecodeVariant, VariantSource) {
        let bucket = ops::DecodeBucket::of(requests, context);
        let (variant, source) = if self.forced.any() {
            let kernel = self.forced.kernel.unwrap_or(self.heuristic.kernel);
            let variant = ops::DecodeVariant {
                kernel,
                merge: self.forced.merge.unwrap_or(self.heuristic.merge),
                // A forced non-streaming kernel aims for two waves, as it always did.
                waves: match kernel {
                    ops::PagedDecodeKernel::Streaming(_) => self.heuristic.waves,
                    _ => 2,
                },
            };
            (variant, VariantSource::Configured)
        } else {
            match self
                .table
                .as_ref()
                .and_then(|t| t.decode_variant(&self.geometry, bucket))
            {
                Some(variant) => (variant, VariantSource::Tuned),
                None => (self.heuristic, VariantSource::Heuristic),
            }
        };
        let mut logged = self.logged.lock().unwrap_or_else(|e| e.into_inner());
        if logged.insert(bucket) {
            let how = match source {
                VariantSource::Tuned => "tuned",
                VariantSource::Heuristic => "heuristic (no tuned row)",
                VariantSource::Configured => "configured",
            };
            tracing::info!(
                "CUDA fused decode, batch <= {} and context <= {}: {variant} ({how})",
                bucket.batch,
                bucket.context
            );
        }
        (variant, source)
    }

    /// The plan policy of `variant` (the configuration's CTA target or chunk size win).
    fn policy(&self, variant: &ops::DecodeVariant) -> PlanPolicy {
        let (head_dim, group) = (
            self.geometry.head_dim,
            self.geometry.q_heads / self.num_kv_heads,
        );
        let policy = variant.policy(
            head_dim,
            group,
            self.sm_count,
            self.smem_per_sm,
            self.min_pages_per_chunk,
        );
        match self.forced.target_ctas {
            Some(target) => PlanPolicy {
                target_ctas: target,
                resident_ctas: None,
                pages_per_chunk: self.forced.pages_per_chunk,
                ..policy
            },
            None => PlanPolicy {
                pages_per_chunk: self.forced.pages_per_chunk,
                ..policy
            },
        }
    }

    /// The plan capacity of a batch bucket of `requests` rows running `variant`: its grid
    /// width.
    pub fn grid_chunks(&self, requests: usize, variant: &ops::DecodeVariant) -> usize {
        if self.forced.pages_per_chunk.is_some() {
            return self.workspace.capacity().max_chunks;
        }
        let target = self.policy(variant).target_ctas;
        PlanCapacity::for_batch(requests, self.num_kv_heads, target)
            .max_chunks
            .min(self.workspace.capacity().max_chunks)
    }

    /// Plans the step whose (padded) page table has the row pointer `indptr`, within
    /// `grid_chunks` chunks, for `variant`, and queues the plan's upload from pinned memory.
    pub fn stage(
        &mut self,
        gpu: &Gpu,
        indptr: &[u32],
        grid_chunks: usize,
        variant: &ops::DecodeVariant,
    ) -> Result<PagedDecodePlan, CudaError> {
        let capacity = self.workspace.capacity();
        let bucket = PlanCapacity {
            max_chunks: grid_chunks,
            max_requests: capacity.max_requests,
        };
        let policy = self.policy(variant);
        let plan = PagedDecodePlan::new(indptr, self.num_kv_heads, policy, bucket)?;
        plan.encode_into(capacity, self.staging.as_mut_slice()?)?;
        gpu.upload_pinned(&self.staging, self.workspace.plan_buffer_mut())?;
        Ok(plan)
    }

    /// The workspace, for the launch.
    pub(super) fn workspace_mut(&mut self) -> &mut PagedDecodeWorkspace {
        &mut self.workspace
    }

    /// Whether cascade steps are on.
    pub fn cascades(&self) -> bool {
        self.cascade.is_some()
    }

    /// Plans a decode step of `rows` (padded) rows over `table` (its real requests) running
    /// `variant` on a plain grid of `grid_chunks` as a cascade: its shared tile rows, its grid
    /// (the plain one plus the shared slots) and what it shares; `None`: the plain fused
    /// decode (cascade off, or no level pays).
    pub fn plan_cascade(
        &mut self,
        table: &pagoda_kv::PageTable,
        rows: usize,
        grid_chunks: usize,
        variant: &ops::DecodeVariant,
    ) -> Result<Option<(usize, usize, pagoda_ops::attention::CascadeStats)>, CudaError> {
        let policy = self.policy(variant);
        let max_requests = self.workspace.capacity().max_requests;
        let Some(levels) = self.cascade.as_mut() else {
            return Ok(None);
        };
        let grid = (grid_chunks + CascadeLevels::extra_chunks(rows))
            .min(self.workspace.capacity().max_chunks);
        let planned = levels.plan(table, rows, (policy, grid, max_requests))?;
        Ok(planned.map(|(tile_rows, stats)| (tile_rows, grid, stats)))
    }

    /// Queues the uploads of the planned cascade step (its fused-decode plan, shared level
    /// and suffix table), its shared tiles of `rows` rows.
    pub fn stage_cascade(&mut self, gpu: &Gpu, rows: usize) -> Result<(), CudaError> {
        let capacity = self.workspace.capacity();
        let levels = self
            .cascade
            .as_mut()
            .ok_or_else(|| CudaError::invalid("a cascade step without cascade levels"))?;
        let plan = levels
            .pending()
            .ok_or_else(|| CudaError::invalid("a cascade step without its plan"))?;
        plan.decode
            .encode_into(capacity, self.staging.as_mut_slice()?)?;
        gpu.upload_pinned(&self.staging, self.workspace.plan_buffer_mut())?;
        levels.stage(gpu, rows)
    }

    /// The cascade levels and the fused decode's workspace, for a cascade step's launch.
    pub(super) fn cascade_parts(
        &mut self,
    ) -> Result<(&CascadeLevels, &mut PagedDecodeWorkspace), CudaError> {
        let levels = self
            .cascade
            .as_ref()
            .ok_or_else(|| CudaError::invalid("a cascade step without cascade levels"))?;
        Ok((levels, &mut self.workspace))
    }
}

/// The fused split-KV paged decode of `queries` (one row per request of `kv`'s table) with
/// `plan`'s grid, variant and softmax scale, the plan staged before the step.
pub(super) fn fused_decode<T: HostFloat>(
    fused: &mut Option<FusedDecode>,
    gpu: &Gpu,
    queries: &Queries<'_, T>,
    kv: &PagedKv<'_, T>,
    (grid_chunks, variant, scale): (usize, ops::DecodeVariant, f32),
    out: &mut DeviceViewMut<'_, T>,
) -> Result<(), CudaError> {
    let workspace = launch_workspace(fused, grid_chunks, variant.kernel)?;
    ops::paged_decode_attention(gpu, queries, kv, workspace, variant.merge, scale, out)
}

/// The fused decode's workspace set for a launch on a grid of `grid_chunks` with `kernel`.
pub(super) fn launch_workspace(
    fused: &mut Option<FusedDecode>,
    grid_chunks: usize,
    kernel: ops::PagedDecodeKernel,
) -> Result<&mut PagedDecodeWorkspace, CudaError> {
    let fused = fused
        .as_mut()
        .ok_or_else(|| CudaError::invalid("a fused decode without its workspace"))?;
    let workspace = fused.workspace_mut();
    workspace.set_grid_chunks(grid_chunks)?;
    workspace.set_kernel(kernel);
    Ok(workspace)
}

/// The head geometry, dtype and page size the tuning table's rows are keyed by.
pub(super) fn tuning_geometry(
    config: &ModelConfig,
    options: &CudaCacheOptions,
    dtype: DType,
) -> ops::DecodeGeometry {
    ops::DecodeGeometry {
        q_heads: config.num_attention_heads,
        kv_heads: config.num_kv_heads,
        head_dim: config.head_dim,
        page_size: options.page_size,
        dtype: dtype.to_string(),
    }
}

/// The tuning table for `geometry` on `gpu`, logged once: `None` when there is none, it is
/// unreadable, or it was tuned for another GPU, driver or kernel sources.
pub(super) fn load_table(gpu: &Gpu, geometry: &ops::DecodeGeometry) -> Option<ops::TuningTable> {
    let key = ops::TableKey::of(gpu);
    let path = pagoda_cuda::tuning_table_path(&key.gpu)?;
    match ops::TuningTable::read(&path) {
        Ok(Some(table)) if table.key == key => {
            let decode = table
                .decode
                .iter()
                .filter(|row| &row.geometry == geometry)
                .count();
            let prefill = table
                .prefill
                .iter()
                .filter(|row| &row.geometry == geometry)
                .count();
            tracing::info!(
                "CUDA tuning table {} ({decode} decode and {prefill} prefill buckets tuned for \
                 this model; the others use the built-in heuristics)",
                path.display()
            );
            Some(table)
        }
        Ok(Some(_)) => {
            tracing::info!(
                "CUDA tuning table {} was tuned for another GPU, driver or kernels; ignored \
                 (run `pagoda tune` again); the built-in heuristics decide",
                path.display()
            );
            None
        }
        Ok(None) => {
            tracing::info!(
                "CUDA tuning: no table at {} (run `pagoda tune`); the built-in heuristics \
                 decide every bucket",
                path.display()
            );
            None
        }
        Err(error) => {
            tracing::warn!("CUDA tuning table: {error}; the built-in heuristics decide");
            None
        }
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
