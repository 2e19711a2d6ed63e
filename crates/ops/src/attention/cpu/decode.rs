//! Split-KV decode: the partial pass over `(chunk, kv_head)` work items and the driver that
//! merges the partials. CPU twin of the GPU flash-decoding kernel: same plan, same base-2
//! online softmax, same workspace layout.

use rayon::prelude::*;

use super::chunk::HeadTask;
use super::kernel::{self, AttentionKernel};
use super::merge::merge_states_into;
use crate::attention::plan::DecodePlan;
use crate::attention::{validate, AttentionError, PagedKv};

/// Buffers of the partial pass: `partial_v [num_chunks, num_q_heads, head_dim]` and
/// `lse [num_chunks, num_q_heads]` (log2), both f32. Sized by
/// [`DecodePlan::workspace_len`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DecodeWorkspace {
    /// Normalized partial outputs, `[num_chunks, num_q_heads, head_dim]`.
    pub partial_v: Vec<f32>,
    /// Partial log-sum-exp in log2 units, `[num_chunks, num_q_heads]`.
    pub lse: Vec<f32>,
    /// The merged log-sum-exp, `[B, num_q_heads]` (scratch of [`split_kv_decode_into`]).
    pub merged_lse: Vec<f32>,
}

impl DecodeWorkspace {
    /// Zeroed buffers sized for `plan`.
    pub fn for_plan(plan: &DecodePlan, num_q_heads: usize, head_dim: usize) -> Self {
        let (partial_len, lse_len) = plan.workspace_len(num_q_heads, head_dim);
        Self {
            partial_v: vec![0.0; partial_len],
            lse: vec![0.0; lse_len],
            merged_lse: vec![0.0; plan.num_requests() * num_q_heads],
        }
    }

    /// Resizes the buffers for `plan` (reusing their allocations), so one workspace can serve
    /// every layer of a step and every step of a run.
    pub fn fit(&mut self, plan: &DecodePlan, num_q_heads: usize, head_dim: usize) {
        let (partial_len, lse_len) = plan.workspace_len(num_q_heads, head_dim);
        self.partial_v.resize(partial_len, 0.0);
        self.lse.resize(lse_len, 0.0);
        self.merged_lse
            .resize(plan.num_requests() * num_q_heads, 0.0);
    }
}

/// The partial pass: for every chunk `c` of `plan` and every query head `h`, attention of
/// `q[request_indices[c], h]` over the chunk's visible tokens, written normalized to
/// `partial_v[c, h, :]` with `lse[c, h] = m + log2(l)` (scores in log2 units:
/// `scale * log2(e) * q·k`). An empty chunk writes zeros and `-inf`.
///
/// Shapes: `q [B, num_q_heads, head_dim]` (one decode query per request of
/// `kv.page_table`), `partial_v [num_chunks, num_q_heads, head_dim]`,
/// `lse [num_chunks, num_q_heads]`, both fully overwritten. One work item per
/// `(chunk, kv_head)`, run in parallel; it reads each K/V row of its chunk once and uses it
/// for all `num_q_heads / num_kv_heads` query heads of the group. Runs the process-wide
/// [`AttentionKernel::selected`].
pub fn decode_partial(
    kv: &PagedKv<'_>,
    q: &[f32],
    num_q_heads: usize,
    plan: &DecodePlan,
    scale: f32,
    partial_v: &mut [f32],
    lse: &mut [f32],
) -> Result<(), AttentionError> {
    let n_rep = validate::paged_kv(kv, num_q_heads)?;
    let table = kv.page_table;
    plan.validate(&table.page_counts(), kv.layout.num_kv_heads)?;
    let head_dim = kv.layout.head_dim;
    let num_requests = table.num_requests();
    validate::length(
        "q [B, num_q_heads, head_dim]",
        num_requests * num_q_heads * head_dim,
        q.len(),
    )?;
    let (partial_len, lse_len) = plan.workspace_len(num_q_heads, head_dim);
    validate::length(
        "partial_v [num_chunks, num_q_heads, head_dim]",
        partial_len,
        partial_v.len(),
    )?;
    validate::length("lse [num_chunks, num_q_heads]", lse_len, lse.len())?;

    let kernel = AttentionKernel::selected();
    partial_v
        .par_chunks_mut(n_rep * head_dim)
        .zip(lse.par_chunks_mut(n_rep))
        .enumerate()
        .for_each(|(work_item, (v_group, lse_group))| {
            let chunk = work_item / kv.layout.num_kv_heads;
            let kv_head = work_item % kv.layout.num_kv_heads;
            let request = plan.request_indices[chunk] as usize;
            let q_first = (request * num_q_heads + kv_head * n_rep) * head_dim;
            let q_group = &q[q_first..q_first + n_rep * head_dim];
            let tile = plan.kv_tile_indices[chunk] as usize;
            let seq_len = kv.page_table.seq_lens[request] as usize;
            let tokens = tile_tokens(kv, request, seq_len, plan.pages_per_chunk, tile);
            let mut tasks: Vec<HeadTask<'_>> = q_group
                .chunks(head_dim)
                .zip(v_group.chunks_mut(head_dim))
                .zip(lse_group.iter_mut())
                .map(|((query, v), lse)| HeadTask {
                    query,
                    end: tokens.end,
                    v,
                    lse,
                })
                .collect();
            kernel::attend_heads(
                kernel,
                kv,
                request,
                kv_head,
                tokens.start,
                scale,
                &mut tasks,
            );
        });
    Ok(())
}

/// Visible-token range `[begin, end)` of tile `tile` when a row that sees `seq_len` visible
/// tokens of `request` is cut into chunks of `pages_per_chunk` pages: page bounds minus the
/// first page's invisible rows, clamped to `seq_len`.
pub(crate) fn tile_tokens(
    kv: &PagedKv<'_>,
    request: usize,
    seq_len: usize,
    pages_per_chunk: usize,
    tile: usize,
) -> std::ops::Range<usize> {
    let first_page_offset = kv.page_table.first_page_offset[request] as usize;
    let chunk_tokens = pages_per_chunk.saturating_mul(kv.layout.page_size);
    let begin = tile
        .saturating_mul(chunk_tokens)
        .saturating_sub(first_page_offset)
        .min(seq_len);
    let end = (tile + 1)
        .saturating_mul(chunk_tokens)
        .saturating_sub(first_page_offset)
        .min(seq_len);
    begin..end
}

/// Split-KV decode end to end: [`decode_partial`] then, when `plan.needs_merge`,
/// [`merge_states_into`](crate::attention::merge_states_into) over `plan.o_indptr`; without a merge
/// the partial pass writes `out` directly.
///
/// Shapes: `q [B, num_q_heads, head_dim]`, `out [B, num_q_heads, head_dim]` (fully
/// overwritten; a request with no visible tokens gets zeros). `plan` must come from
/// [`plan_decode`](crate::attention::plan_decode) on this page table's page counts (or match them).
pub fn split_kv_decode(
    kv: &PagedKv<'_>,
    q: &[f32],
    num_q_heads: usize,
    plan: &DecodePlan,
    scale: f32,
    out: &mut [f32],
) -> Result<(), AttentionError> {
    let mut workspace = DecodeWorkspace::for_plan(plan, num_q_heads, kv.layout.head_dim);
    split_kv_decode_into(kv, q, num_q_heads, plan, scale, &mut workspace, out)
}

/// [`split_kv_decode`] with caller-owned scratch: `workspace` is fitted to `plan` (its
/// allocations are reused), so a forward pass allocates nothing per layer.
pub fn split_kv_decode_into(
    kv: &PagedKv<'_>,
    q: &[f32],
    num_q_heads: usize,
    plan: &DecodePlan,
    scale: f32,
    workspace: &mut DecodeWorkspace,
    out: &mut [f32],
) -> Result<(), AttentionError> {
    validate::geometry(&kv.layout, num_q_heads)?;
    let head_dim = kv.layout.head_dim;
    let num_requests = kv.page_table.num_requests();
    validate::length(
        "out [B, num_q_heads, head_dim]",
        num_requests * num_q_heads * head_dim,
        out.len(),
    )?;
    workspace.fit(plan, num_q_heads, head_dim);
    if !plan.needs_merge {
        // One chunk per request: the partial pass writes the output rows directly.
        return decode_partial(kv, q, num_q_heads, plan, scale, out, &mut workspace.lse);
    }
    decode_partial(
        kv,
        q,
        num_q_heads,
        plan,
        scale,
        &mut workspace.partial_v,
        &mut workspace.lse,
    )?;
    merge_states_into(
        &workspace.partial_v,
        &workspace.lse,
        &plan.o_indptr,
        num_q_heads,
        head_dim,
        out,
        &mut workspace.merged_lse,
    )
}
