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

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use pagoda_kv::{PageTable, ShareGroups};

use super::chunk::MAX_ITEM_HEADS;
use super::step::StepAttentionPlan;

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

/// The cascade part of a [`StepAttentionPlan`] (empty: no cascade).
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

impl StepAttentionPlan {
    /// The same plan with the decode rows that share whole chunks of leading pages run as
    /// cascade items under `rule` (see the module docs); outputs are the same bits.
    /// `page_table` and `page_size` must be the ones the plan was made for, `num_q_heads`
    /// the queries' head count.
    pub fn with_cascade(
        mut self,
        page_table: &PageTable,
        page_size: usize,
        num_q_heads: usize,
        rule: &CascadeRule,
    ) -> Self {
        self.cascade = plan_cascade(&self, page_table, page_size, num_q_heads, rule);
        self
    }

    /// What the plan's cascade shares (zeros without one).
    pub fn cascade_stats(&self) -> CascadeStats {
        self.cascade.stats
    }
}

fn plan_cascade(
    plan: &StepAttentionPlan,
    table: &PageTable,
    page_size: usize,
    num_q_heads: usize,
    rule: &CascadeRule,
) -> CascadePlan {
    let n_rep = num_q_heads / plan.num_kv_heads.max(1);
    let per_item = MAX_ITEM_HEADS / n_rep.max(1);
    let min_members = rule.min_members.max(2);
    if per_item < 2 || table.num_requests() != plan.num_requests() {
        return CascadePlan::default();
    }
    // The split row of each decode request (one query row, run by split-KV).
    let mut decode_row = vec![None; plan.num_requests()];
    for (split, row) in plan.split_rows.iter().enumerate() {
        let request = row.request;
        let q_len = plan.qo_indptr[request + 1] - plan.qo_indptr[request];
        if q_len == 1 {
            decode_row[request] = Some(split);
        }
    }
    let groups = ShareGroups::build(table, page_size, |r| decode_row[r].is_some());
    if groups.groups().is_empty() {
        return CascadePlan::default();
    }
    let block_of = |split: usize| plan.block_rows.partition_point(|&start| start <= split) - 1;
    // (block, group, begin, end) -> member split rows, in a fixed order.
    let mut sets: BTreeMap<(usize, usize, u32, u32), Vec<usize>> = BTreeMap::new();
    for (request, split) in decode_row.iter().enumerate() {
        let Some(split) = *split else { continue };
        let path = groups.path(request);
        if path.is_empty() {
            continue;
        }
        let block = block_of(split);
        let chunks = plan.chunk_indptr[split] as usize..plan.chunk_indptr[split + 1] as usize;
        for index in chunks {
            let (begin, end) = plan.chunk_tokens[index];
            let covering = path
                .iter()
                .find(|&&g| groups.groups()[g].pages.end * page_size >= end as usize);
            if let Some(&group) = covering {
                sets.entry((block, group, begin, end))
                    .or_default()
                    .push(split);
            }
        }
    }
    let mut cascade = CascadePlan {
        chunk_shared: vec![false; plan.chunk_tokens.len()],
        block_items: vec![0],
        ..CascadePlan::default()
    };
    let mut used_groups = std::collections::BTreeSet::new();
    let mut current_block = 0;
    for ((block, group, begin, end), members) in sets {
        let shared_tokens = groups.groups()[group].pages.end * page_size;
        let saved = (members.len() - 1) * shared_tokens;
        if members.len() < min_members
            || shared_tokens < rule.min_shared_tokens
            || saved < rule.min_saved_tokens
        {
            continue;
        }
        while current_block < block {
            cascade.block_items.push(cascade.items.len());
            current_block += 1;
        }
        used_groups.insert(group);
        let first = members[0];
        let chunk = (0..)
            .find(|&c| plan.chunk_tokens[plan.chunk_indptr[first] as usize + c] == (begin, end))
            .expect("the chunk is one of its member's");
        // Balanced pieces of at most `per_item` members (one kernel pass each).
        let pieces = members.len().div_ceil(per_item);
        let size = members.len().div_ceil(pieces);
        for piece in members.chunks(size) {
            let tokens = (end - begin) as usize;
            cascade.stats.shared_tokens += tokens;
            cascade.stats.saved_token_reads += (piece.len() - 1) * tokens;
            for &split in piece {
                cascade.chunk_shared[plan.chunk_indptr[split] as usize + chunk] = true;
            }
            cascade.items.push(SharedChunk {
                request: plan.split_rows[first].request,
                tokens: (begin, end),
                chunk,
                members: piece.to_vec(),
            });
        }
    }
    if cascade.items.is_empty() {
        return CascadePlan::default();
    }
    let num_blocks = plan.block_rows.len() - 1;
    while cascade.block_items.len() < num_blocks + 1 {
        cascade.block_items.push(cascade.items.len());
    }
    cascade.stats.groups = used_groups.len();
    cascade
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
