//! Split-KV decode: the partial pass over `(chunk, kv_head)` work items and the driver that
//! merges the partials. CPU twin of the GPU flash-decoding kernel: same plan, same base-2
//! online softmax, same workspace layout.

use rayon::prelude::*;

use super::kernel::{self, AttentionKernel, HeadTask};
use super::merge::merge_states_into;
use super::plan::DecodePlan;
use super::{add_scaled, dot, validate, AttentionError, PagedKv, LOG2_E};

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

/// One work item: the online softmax of `n_rep` query heads (`q_group [n_rep, head_dim]`)
/// over visible tokens `tokens` of `request`, for KV head `kv_head`. Writes
/// `v_group [n_rep, head_dim]` (normalized) and `lse_group [n_rep]` (log2; `-inf` and zeros
/// when the range is empty). Depends only on its arguments and the cache, so a row's partials
/// are the same whatever else runs in the step. The scalar kernel: the portable fallback and
/// the oracle of the SIMD kernels (`super::kernel`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn chunk_attention(
    kv: &PagedKv<'_>,
    request: usize,
    tokens: std::ops::Range<usize>,
    kv_head: usize,
    scale: f32,
    q_group: &[f32],
    v_group: &mut [f32],
    lse_group: &mut [f32],
) {
    let layout = &kv.layout;
    let table = kv.page_table;
    let (page_size, head_dim) = (layout.page_size, layout.head_dim);
    let n_rep = lse_group.len();
    let first_page_offset = table.first_page_offset[request] as usize;
    let request_pages =
        &table.indices[table.indptr[request] as usize..table.indptr[request + 1] as usize];
    let (token_begin, token_end) = (tokens.start, tokens.end);
    let scale_log2 = scale * LOG2_E;

    let mut running_max = vec![f32::NEG_INFINITY; n_rep];
    let mut denominator = vec![0.0f32; n_rep];
    let mut weights = vec![0.0f32; n_rep * page_size];
    v_group.fill(0.0);
    let mut token = token_begin;
    while token < token_end {
        // One page segment: tokens [token, segment_end) share a page.
        let absolute = first_page_offset + token;
        let page = request_pages[absolute / page_size] as usize;
        let first_offset = absolute % page_size;
        let count = (page_size - first_offset).min(token_end - token);
        for index in 0..count {
            let key =
                &kv.k_pool[layout.head_offset(page, first_offset + index, kv_head)..][..head_dim];
            for head in 0..n_rep {
                let q_head = &q_group[head * head_dim..(head + 1) * head_dim];
                weights[head * page_size + index] = dot(q_head, key) * scale_log2;
            }
        }
        for head in 0..n_rep {
            let scores = &mut weights[head * page_size..head * page_size + count];
            let tile_max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let new_max = running_max[head].max(tile_max);
            if new_max == f32::NEG_INFINITY {
                scores.fill(0.0);
                continue;
            }
            // exp2(-inf - finite) = 0 on the first segment: no (-inf) - (-inf).
            let correction = (running_max[head] - new_max).exp2();
            if correction != 1.0 {
                denominator[head] *= correction;
                v_group[head * head_dim..(head + 1) * head_dim]
                    .iter_mut()
                    .for_each(|value| *value *= correction);
            }
            running_max[head] = new_max;
            for score in scores.iter_mut() {
                *score = (*score - new_max).exp2();
                denominator[head] += *score;
            }
        }
        for index in 0..count {
            let value =
                &kv.v_pool[layout.head_offset(page, first_offset + index, kv_head)..][..head_dim];
            for head in 0..n_rep {
                let accumulator = &mut v_group[head * head_dim..(head + 1) * head_dim];
                add_scaled(accumulator, weights[head * page_size + index], value);
            }
        }
        token += count;
    }
    for head in 0..n_rep {
        let accumulator = &mut v_group[head * head_dim..(head + 1) * head_dim];
        if running_max[head] == f32::NEG_INFINITY || denominator[head] == 0.0 {
            accumulator.fill(0.0);
            lse_group[head] = f32::NEG_INFINITY;
        } else {
            let inverse = 1.0 / denominator[head];
            accumulator.iter_mut().for_each(|value| *value *= inverse);
            lse_group[head] = running_max[head] + denominator[head].log2();
        }
    }
}

/// Split-KV decode end to end: [`decode_partial`] then, when `plan.needs_merge`,
/// [`merge_states_into`](super::merge_states_into) over `plan.o_indptr`; without a merge
/// the partial pass writes `out` directly.
///
/// Shapes: `q [B, num_q_heads, head_dim]`, `out [B, num_q_heads, head_dim]` (fully
/// overwritten; a request with no visible tokens gets zeros). `plan` must come from
/// [`plan_decode`](super::plan_decode) on this page table's page counts (or match them).
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
