//! Cascade decode steps on CUDA (`PAGODA_CASCADE_ATTENTION`): when a decode step's requests
//! share leading pages (the prefix cache's), the shared pages are attended once per group
//! on tensor cores and each request's own pages by the fused decode, merged together
//! (`ops::cascade_decode_attention`; the plan in `ops::CascadePlan`). A step cascades when the
//! rule finds a group whose level pays; otherwise it runs the plain fused decode. The levels'
//! plans live in fixed buffers, so cascade steps replay from their own CUDA graphs.
//!
//! Not in deterministic mode (every decode row then runs the prefill kernel) nor over an fp8
//! KV cache (the shared level reads bf16).

use pagoda_cuda::{CudaError, DType, Gpu};
use pagoda_kv::{PageTable, ShareGroups};
use pagoda_ops::attention::{CascadeRule, CascadeStats};
use pagoda_ops::cuda::{
    self as ops, CascadeCapacity, CascadeGeometry, CascadePlan, CascadeWorkspace, PagedKv,
    PlanCapacity, PlanPolicy, PrefillStreamTiling, Queries,
};

/// Most shared-level partials one request merges (key chunks over all its levels).
pub const CASCADE_SLOTS: usize = 16;

/// The shortest shared key chunk, in tokens.
const MIN_CHUNK_TOKENS: usize = 256;

/// The level rule `auto` applies on CUDA: a level cascades when its requests share 1024+
/// tokens of it and save 32768+ token reads a layer (`(members - 1) x tokens`); the step then
/// cascades when [`auto_step_pays`] too. Measured with `pagoda bench cascade` on the H100
/// over B 2-128, shared 256-16384, own 16-4096 tokens
/// (`docs/benchmark_results/cascade-cuda-h100-2026-12-06.md`): the rule picks 1.03x-6.5x
/// cells only. Shorter levels lose (their reads mostly hit the L2 in the plain decode, 0.46x
/// at 64 requests behind 256 tokens), as do 2 requests behind any prefix (a wash at best).
pub const CUDA_AUTO_CASCADE_RULE: CascadeRule = CascadeRule {
    min_members: 2,
    min_shared_tokens: 1024,
    min_saved_tokens: 32768,
};

/// `auto`'s step rule: cascade pays when the token reads it saves reach the step's own
/// tokens (the unique level's reads), or a quarter of them with 32+ requests in its groups
/// (measured as [`CUDA_AUTO_CASCADE_RULE`]: 16 requests behind 4096 shared tokens with 4096
/// of their own each lose 0.87x, 64 of them win 1.24x).
pub fn auto_step_pays(stats: &CascadeStats, own_tokens: usize, members: usize) -> bool {
    let scale = if members >= 32 { 4 } else { 1 };
    stats.saved_token_reads * scale >= own_tokens
}

/// The shared level's workspace, its rule and the step's staged plan.
pub struct CascadeLevels {
    workspace: CascadeWorkspace,
    rule: CascadeRule,
    page_size: usize,
    num_kv_heads: usize,
    group: usize,
    sm_count: usize,
    /// The plan of the step being staged ([`Self::plan`] to [`Self::stage`]).
    pending: Option<CascadePlan>,
    /// Whether the step rule ([`auto_step_pays`]) applies (`auto`; `on` cascades whatever
    /// shares a page).
    step_rule: bool,
}

impl CascadeLevels {
    /// The levels for steps of up to `max_requests` requests and `max_pages` page indices,
    /// or `None` when `rule` is off or the geometry cannot cascade (logged once).
    pub fn new(
        gpu: &Gpu,
        rule: Option<CascadeRule>,
        (dtype, layout, num_q_heads): (DType, &ops::PoolLayout, usize),
        (max_requests, max_pages): (usize, usize),
    ) -> Result<Option<Self>, CudaError> {
        let Some(rule) = rule else {
            tracing::info!("CUDA cascade attention: off");
            return Ok(None);
        };
        if let Some(reason) = ops::cascade_unsupported(dtype, layout, num_q_heads) {
            tracing::info!("CUDA cascade attention: unavailable ({reason}); plain fused decode");
            return Ok(None);
        }
        let sm_count = gpu.info().sm_count.max(1) as usize;
        let kv_heads = layout.num_kv_heads;
        let capacity =
            CascadeCapacity::for_batch(max_requests, kv_heads, 2 * sm_count, CASCADE_SLOTS);
        tracing::info!(
            "CUDA cascade attention: on (decode steps whose {}+ requests share {}+ tokens of a \
             prefix, saving {}+ token reads{}, attend to it once per group on tensor cores; \
             not batch-invariant, off in deterministic mode)",
            rule.min_members.max(2),
            rule.min_shared_tokens,
            rule.min_saved_tokens,
            if rule == CUDA_AUTO_CASCADE_RULE {
                " and their own tokens' reads"
            } else {
                ""
            }
        );
        Ok(Some(CascadeLevels {
            workspace: CascadeWorkspace::new(gpu, capacity, max_requests, max_pages)?,
            rule,
            page_size: layout.page_size,
            num_kv_heads: kv_heads,
            group: num_q_heads / kv_heads,
            sm_count,
            pending: None,
            step_rule: rule == CUDA_AUTO_CASCADE_RULE,
        }))
    }

    /// Decode-plan chunks a cascade step of `requests` rows needs beyond the plain plan's
    /// (its requests' shared slots).
    pub fn extra_chunks(requests: usize) -> usize {
        requests * CASCADE_SLOTS
    }

    /// Plans a decode step over `table` (real requests; padded with empty ones to `rows`)
    /// whose fused decode has `policy` and a grid of `grid_chunks` (the plain grid and the
    /// shared slots, [`Self::extra_chunks`]): the shared level's
    /// tile rows and what it shares when the rule finds a level that pays (the plan is kept
    /// for [`Self::stage`]), else `None` (plain fused decode).
    pub fn plan(
        &mut self,
        table: &PageTable,
        rows: usize,
        (policy, grid_chunks, max_requests): (PlanPolicy, usize, usize),
    ) -> Result<Option<(usize, CascadeStats)>, CudaError> {
        self.pending = None;
        let real = table.num_requests();
        // Most steps share nothing worth it: decide that from the share groups alone.
        let groups = ShareGroups::build(table, self.page_size, |_| true);
        if !CascadePlan::used_levels(&groups, self.page_size, &self.rule).contains(&true) {
            return Ok(None);
        }
        let tile_rows = if real * self.group <= 64 { 64 } else { 128 };
        let geometry = CascadeGeometry {
            page_size: self.page_size,
            num_kv_heads: self.num_kv_heads,
            group: self.group,
            rows: tile_rows,
            target_ctas: 2 * self.sm_count,
            min_chunk_tokens: MIN_CHUNK_TOKENS,
            max_slots: CASCADE_SLOTS,
        };
        let capacity = PlanCapacity {
            max_chunks: grid_chunks,
            max_requests,
        };
        let sizes = (policy, capacity);
        let capacity = self.workspace.capacity();
        let step = (table, &groups, rows);
        let plan = CascadePlan::from_groups(step, &geometry, &self.rule, sizes, capacity)?;
        let plan = plan.filter(|plan| !self.step_rule || step_pays(plan, self.page_size));
        Ok(plan.map(|plan| {
            let stats = plan.stats;
            self.pending = Some(plan);
            (tile_rows, stats)
        }))
    }

    /// The decode plan of the pending cascade (for the fused decode's staging).
    pub fn pending(&self) -> Option<&CascadePlan> {
        self.pending.as_ref()
    }

    /// Queues the pending plan's shared level and suffix table for upload, its tiles of
    /// `rows` rows.
    pub fn stage(&mut self, gpu: &Gpu, rows: usize) -> Result<(), CudaError> {
        let plan = self
            .pending
            .as_ref()
            .ok_or_else(|| CudaError::invalid("a cascade step without its plan"))?;
        self.workspace.stage(gpu, plan)?;
        self.workspace
            .set_tiling(PrefillStreamTiling::new(rows, 64, 2));
        Ok(())
    }

    /// The shared level's workspace, for the launch.
    pub fn workspace(&self) -> &CascadeWorkspace {
        &self.workspace
    }
}

/// [`auto_step_pays`] for `plan`: its own tokens from the suffix table, its members from the
/// shared items.
fn step_pays(plan: &CascadePlan, page_size: usize) -> bool {
    let suffix = &plan.suffix;
    let own: usize = (0..suffix.last_page_len.len())
        .map(|r| {
            let pages = (suffix.indptr[r + 1] - suffix.indptr[r]) as usize;
            match pages {
                0 => 0,
                _ => (pages - 1) * page_size + suffix.last_page_len[r] as usize,
            }
        })
        .sum();
    let members: std::collections::BTreeSet<u32> = plan.members.iter().map(|m| m[0]).collect();
    auto_step_pays(&plan.stats, own, members.len())
}

/// Runs a cascade step's attention: `queries` (one row per request of `kv`'s table) over the
/// staged levels, the fused decode's workspace sized for `grid_chunks` chunks.
pub(super) fn cascade_decode<T: pagoda_cuda::Element>(
    fused: &mut super::FusedDecode,
    gpu: &Gpu,
    (queries, kv): (&Queries<'_, T>, &PagedKv<'_, T>),
    (grid_chunks, kernel, scale): (usize, ops::PagedDecodeKernel, f32),
    out: &mut impl pagoda_cuda::DeviceWrite<T>,
) -> Result<(), CudaError> {
    let (levels, workspace) = fused.cascade_parts()?;
    workspace.set_grid_chunks(grid_chunks)?;
    workspace.set_kernel(kernel);
    let both = (levels.workspace(), workspace);
    ops::cascade_decode_attention(gpu, queries, kv, both, scale, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The measured cells at the rule's edges (H100, `pagoda bench cascade`): each level's
    /// rule, then the step's, against whether cascade won.
    #[test]
    fn auto_picks_the_measured_wins_only() {
        // (requests, shared tokens, own tokens each, speedup measured)
        let cells = [
            (2, 4096, 16, 1.05),
            (2, 16384, 256, 0.94),
            (16, 256, 16, 0.66),
            (16, 1024, 16, 0.97),
            (16, 4096, 256, 1.71),
            (16, 4096, 4096, 0.87),
            (16, 16384, 4096, 1.75),
            (64, 256, 16, 0.46),
            (64, 1024, 256, 1.13),
            (64, 1024, 4096, 1.03),
            (64, 4096, 4096, 1.24),
            (128, 256, 4096, 1.00),
            (128, 1024, 256, 1.13),
        ];
        let rule = CUDA_AUTO_CASCADE_RULE;
        for (requests, shared, own, speedup) in cells {
            let saved = (requests - 1) * shared;
            let level = requests >= rule.min_members
                && shared >= rule.min_shared_tokens
                && saved >= rule.min_saved_tokens;
            let stats = CascadeStats {
                groups: 1,
                shared_tokens: shared,
                saved_token_reads: saved,
            };
            let picked = level && auto_step_pays(&stats, requests * own, requests);
            // Every pick won; every loss is left out (small wins may be too).
            assert!(
                !picked || speedup > 1.0,
                "{requests} x {shared} + {own}: picked at {speedup}x"
            );
            assert!(
                picked || speedup < 1.2,
                "{requests} x {shared} + {own}: {speedup}x left out"
            );
        }
    }
}
