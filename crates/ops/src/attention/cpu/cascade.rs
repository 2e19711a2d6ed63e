//! Cascade attention on the CPU: decode rows whose requests share leading KV pages (the
//! prefix cache's refcounted pages, found by [`ShareGroups`]) attend to each shared chunk in
//! ONE work item, so each shared K/V tile is read (and, for f16 or q8_0 pools, dequantized)
//! once per group of rows instead of once per row.
//!
//! Levels as in the GPU recipe: the shared level is the chunks inside a group's shared
//! pages, attended by the stacked query heads of all its members; the unique level is each
//! row's remaining chunks, on the usual per-row items; the per-row LSE merge
//! ([`merge_states_into`](super::merge::merge_states_into)) combines them, unchanged.
//!
//! BIT-IDENTICAL to the plain step, so it needs no reproducibility switch: the shared level
//! keeps the split-KV chunk grid ([`SplitKvChunking`](super::step::SplitKvChunking), chunk
//! bounds a function of position only), a shared item's chunk has the same bounds for every
//! member, and the chunk kernels give each head the same bits whatever other heads share
//! its work item ([`AttentionKernel`](super::kernel::AttentionKernel)). Each row's partials
//! are therefore the bits the plain step computes, merged in the same order: a request's
//! tokens do not depend on what shares its step, cascade or not.
//!
//! What is shared: a chunk `[begin, end)` of a decode row (one query, split-KV) is shared
//! with the rows of the OUTERMOST group of the row's [`ShareGroups::path`] whose pages
//! (from the start) cover `end`, among the rows of the same block of the plan that have the
//! same chunk bounds. A chunk that straddles a group's end, or a row's own tail, stays on
//! the row's own item. Rows of prefilling requests are never shared.

use std::sync::atomic::{AtomicU64, Ordering};

/// When a step's shared chunks run as cascade items (the cost rule).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CascadeRule {
    /// Fewest rows that must share a chunk (>= 2; smaller counts as 2).
    pub min_members: usize,
    /// Fewest tokens a group must share from the start (its pages' end times the page
    /// size) for its chunks to be shared.
    pub min_shared_tokens: usize,
    /// Fewest token reads a group must save, `(members - 1) * shared tokens` (members of
    /// one block of the plan).
    pub min_saved_tokens: usize,
}

impl CascadeRule {
    /// Any two rows sharing a whole chunk.
    pub const ANY: CascadeRule = CascadeRule {
        min_members: 2,
        min_shared_tokens: 0,
        min_saved_tokens: 0,
    };
}

/// What a step's cascade shares (per layer; every layer runs the same plan).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CascadeStats {
    /// Share groups with at least one shared chunk.
    pub groups: usize,
    /// Shared work items' tokens: K/V rows read once for all their members.
    pub shared_tokens: usize,
    /// Token reads saved: `Σ (members - 1) * tokens` over the shared items.
    pub saved_token_reads: usize,
}

/// One shared chunk: its members' query heads attend to `tokens` in one work item.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SharedChunk {
    /// A member request (its page list is read; the members' pages agree on the chunk).
    pub request: usize,
    /// Visible-token range of the chunk, the same for every member.
    pub tokens: (u32, u32),
    /// Chunk index within each member's row.
    pub chunk: usize,
    /// Members as split-row indices of the plan, ascending.
    pub members: Vec<usize>,
}

/// The cascade part of a [`StepAttentionPlan`](super::step::StepAttentionPlan) (empty: no
/// cascade).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct CascadePlan {
    /// Shared chunks, by block of the plan.
    pub items: Vec<SharedChunk>,
    /// `[num_blocks + 1]`: items of block `b` are `items[block_items[b]..block_items[b + 1]]`.
    pub block_items: Vec<usize>,
    /// `[num_chunks]`: whether a chunk's partial is computed by a shared item.
    pub chunk_shared: Vec<bool>,
    pub stats: CascadeStats,
}

impl CascadePlan {
    /// Whether the chunk `index` (of the whole plan) is computed by a shared item.
    pub fn is_shared(&self, index: usize) -> bool {
        self.chunk_shared.get(index).copied().unwrap_or(false)
    }

    /// The shared items of block `block`.
    pub fn block(&self, block: usize) -> &[SharedChunk] {
        match self.block_items.get(block..block + 2) {
            Some(bounds) => &self.items[bounds[0]..bounds[1]],
            None => &[],
        }
    }
}

static STEPS: AtomicU64 = AtomicU64::new(0);
static GROUPS: AtomicU64 = AtomicU64::new(0);
static SHARED_TOKENS: AtomicU64 = AtomicU64::new(0);
static SAVED_READS: AtomicU64 = AtomicU64::new(0);

/// Counts one step that ran `stats` (called once per step by the model, not per layer);
/// a step without shared chunks is not counted.
pub fn record_cascade_step(stats: &CascadeStats) {
    if stats.groups == 0 {
        return;
    }
    STEPS.fetch_add(1, Ordering::Relaxed);
    GROUPS.fetch_add(stats.groups as u64, Ordering::Relaxed);
    SHARED_TOKENS.fetch_add(stats.shared_tokens as u64, Ordering::Relaxed);
    SAVED_READS.fetch_add(stats.saved_token_reads as u64, Ordering::Relaxed);
}

/// Process-wide cascade counters: `(steps, groups, shared tokens read once, token reads
/// saved)`, each per step (every layer repeats them).
pub fn cascade_counts() -> (u64, u64, u64, u64) {
    (
        STEPS.load(Ordering::Relaxed),
        GROUPS.load(Ordering::Relaxed),
        SHARED_TOKENS.load(Ordering::Relaxed),
        SAVED_READS.load(Ordering::Relaxed),
    )
}
