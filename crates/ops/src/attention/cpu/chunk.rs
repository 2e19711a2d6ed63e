//! One split-KV work item: its shared inputs ([`ChunkArgs`]), its query heads
//! ([`HeadTask`]), and the scalar kernel ([`scalar`]), the portable fallback and the oracle of
//! the SIMD kernels.

use super::math::{add_scaled, dot, LOG2_E};
use crate::attention::PagedKv;

/// The shared inputs of one work item (see [`super::kernel::attend_heads`]).
pub(crate) struct ChunkArgs<'a, 'kv> {
    /// The layer's paged K/V.
    pub kv: &'a PagedKv<'kv>,
    /// Request index in the page table.
    pub request: usize,
    /// The KV head every task reads.
    pub kv_head: usize,
    /// First visible token of the chunk (each task ends at its own `end`).
    pub start: usize,
    /// Softmax scale (natural units; converted to log2 here).
    pub scale: f32,
}

/// Most query heads one split-KV work item takes (a SIMD kernel's pass): with GQA groups of
/// `n_rep` heads, `MAX_ITEM_HEADS / n_rep` consecutive rows of one request share an item.
pub(crate) const MAX_ITEM_HEADS: usize = 48;

/// One query head's share of a split-KV work item: its query, the end of its visible range
/// in this chunk, and where its normalized partial output and LSE (log2) go.
pub(crate) struct HeadTask<'a> {
    /// `[head_dim]` query of the head.
    pub query: &'a [f32],
    /// The head attends to visible tokens `[start, end)` of the work item's request
    /// (`end <= start`: no token, zeros and `-inf`).
    pub end: usize,
    /// `[head_dim]` normalized partial output.
    pub v: &'a mut [f32],
    /// The partial's log-sum-exp (log2 units).
    pub lse: &'a mut f32,
}

/// The scalar kernel over every task of one work item, one head after the other.
pub(crate) fn scalar(args: &ChunkArgs<'_, '_>, tasks: &mut [HeadTask<'_>]) {
    for task in tasks.iter_mut() {
        chunk_attention(
            args,
            args.start..task.end.max(args.start),
            task.query,
            task.v,
            std::slice::from_mut(task.lse),
        );
    }
}

/// One work item: the online softmax of `n_rep` query heads (`q_group [n_rep, head_dim]`)
/// over visible tokens `tokens` of `args.request`, for KV head `args.kv_head`. Writes
/// `v_group [n_rep, head_dim]` (normalized) and `lse_group [n_rep]` (log2; `-inf` and zeros
/// when the range is empty). Depends only on its arguments and the cache, so a row's partials
/// are the same whatever else runs in the step. The scalar kernel: the portable fallback and
/// the oracle of the SIMD kernels (`super::simd`).
fn chunk_attention(
    args: &ChunkArgs<'_, '_>,
    tokens: std::ops::Range<usize>,
    q_group: &[f32],
    v_group: &mut [f32],
    lse_group: &mut [f32],
) {
    let ChunkArgs {
        kv,
        request,
        kv_head,
        scale,
        ..
    } = *args;
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
    // Dequantized head rows of an f16 or q8_0 pool (an f32 pool lends its own rows).
    let scratch_len = if kv.k_pool.as_f32().is_some() && kv.v_pool.as_f32().is_some() {
        0
    } else {
        head_dim
    };
    let mut scratch = vec![0.0f32; scratch_len];
    v_group.fill(0.0);
    let mut token = token_begin;
    while token < token_end {
        // One page segment: tokens [token, segment_end) share a page.
        let absolute = first_page_offset + token;
        let page = request_pages[absolute / page_size] as usize;
        let first_offset = absolute % page_size;
        let count = (page_size - first_offset).min(token_end - token);
        for index in 0..count {
            let offset = layout.head_offset(page, first_offset + index, kv_head);
            let key = kv.k_pool.row(offset, head_dim, &mut scratch);
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
            let offset = layout.head_offset(page, first_offset + index, kv_head);
            let value = kv.v_pool.row(offset, head_dim, &mut scratch);
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
