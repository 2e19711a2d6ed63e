//! Cascade planning over a split-KV step plan: which decode rows' chunks run as shared
//! items ([`cascade`](super::cascade) holds the plan's types and the rule). Apart from
//! both so that the step (which runs the items) and the cascade types do not import each
//! other.

use std::collections::BTreeMap;

use pagoda_kv::{PageTable, ShareGroups};

use super::cascade::{CascadePlan, CascadeRule, CascadeStats, SharedChunk};
use super::chunk::MAX_ITEM_HEADS;
use super::step::StepAttentionPlan;

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
