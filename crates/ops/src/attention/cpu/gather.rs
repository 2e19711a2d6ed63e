//! The baseline path: gather each request's visible K/V into a contiguous buffer, then run
//! ragged causal softmax attention over it. Serves prefill and decode; the parity reference
//! for split-KV.

use rayon::prelude::*;

use super::math::{add_scaled, dot, LOG2_E};
use crate::attention::{validate, AttentionError, PagedKv, QueryBatch};

/// Ragged causal attention over the paged cache, by gathering.
///
/// Shapes: `queries.q` `[T, num_q_heads, head_dim]` grouped by `queries.qo_indptr [B + 1]`
/// (`B` = requests of `kv.page_table`); `out` `[T, num_q_heads, head_dim]`, fully
/// overwritten. Query `j` of request `r` (of `q_len` queries) attends to visible tokens
/// `0..=seq_len - q_len + j`; query head `h` reads KV head `h / (num_q_heads /
/// num_kv_heads)`. Scores are `scale * q·k`. Parallel over requests and queries.
pub fn gather_attention(
    kv: &PagedKv<'_>,
    queries: &QueryBatch<'_>,
    scale: f32,
    out: &mut [f32],
) -> Result<(), AttentionError> {
    let n_rep = validate::paged_kv(kv, queries.num_q_heads)?;
    let table = kv.page_table;
    let num_tokens = queries.qo_indptr.last().copied().unwrap_or(0) as usize;
    validate::query_indptr(queries.qo_indptr, &table.seq_lens, num_tokens)?;
    let query_row = queries.num_q_heads * kv.layout.head_dim;
    validate::length(
        "q [T, num_q_heads, head_dim]",
        num_tokens * query_row,
        queries.q.len(),
    )?;
    validate::length(
        "out [T, num_q_heads, head_dim]",
        num_tokens * query_row,
        out.len(),
    )?;

    let mut per_request = Vec::with_capacity(table.num_requests());
    let mut rest = out;
    for request in 0..table.num_requests() {
        let rows = (queries.qo_indptr[request + 1] - queries.qo_indptr[request]) as usize;
        let (head, tail) = rest.split_at_mut(rows * query_row);
        per_request.push(head);
        rest = tail;
    }
    per_request
        .into_par_iter()
        .enumerate()
        .for_each(|(request, out_request)| {
            let first_row = queries.qo_indptr[request] as usize * query_row;
            let q_request = &queries.q[first_row..first_row + out_request.len()];
            let seq_len = table.seq_lens[request] as usize;
            attend_rows(kv, request, seq_len, n_rep, scale, q_request, out_request);
        });
    Ok(())
}

/// Gathers the first `seq_len` visible K and V rows of request `request` into
/// `[seq_len, num_kv_heads, head_dim]` buffers (visible token order).
fn gather_request(kv: &PagedKv<'_>, request: usize, seq_len: usize) -> (Vec<f32>, Vec<f32>) {
    let layout = &kv.layout;
    let table = kv.page_table;
    let stride = layout.token_stride();
    let first_page = table.indptr[request] as usize;
    let first_page_offset = table.first_page_offset[request] as usize;
    let mut keys = Vec::with_capacity(seq_len * stride);
    let mut values = Vec::with_capacity(seq_len * stride);
    for visible in 0..seq_len {
        let absolute = first_page_offset + visible;
        let page = table.indices[first_page + absolute / layout.page_size] as usize;
        let row = layout.head_offset(page, absolute % layout.page_size, 0);
        kv.k_pool.extend_into(row, stride, &mut keys);
        kv.v_pool.extend_into(row, stride, &mut values);
    }
    (keys, values)
}

/// Attention for `q_len` consecutive query rows of one request, the last of which sees
/// `seq_len` visible tokens (row `j` sees `seq_len - q_len + j + 1`): `q_request` and
/// `out_request` are `[q_len, num_q_heads, head_dim]`. A row's result depends only on its own
/// query, its visible length and the cache, never on the other rows, so the batch-invariant
/// step (`super::step`) may call it on any prefix of a request's rows.
pub(crate) fn attend_rows(
    kv: &PagedKv<'_>,
    request: usize,
    seq_len: usize,
    n_rep: usize,
    scale: f32,
    q_request: &[f32],
    out_request: &mut [f32],
) {
    let head_dim = kv.layout.head_dim;
    let num_q_heads = n_rep * kv.layout.num_kv_heads;
    let query_row = num_q_heads * head_dim;
    if out_request.is_empty() {
        return;
    }
    let q_len = out_request.len() / query_row;
    let (keys, values) = gather_request(kv, request, seq_len);
    let stride = kv.layout.token_stride();
    let scale_log2 = scale * LOG2_E;
    out_request
        .par_chunks_mut(query_row)
        .enumerate()
        .for_each(|(query, out_row)| {
            let visible = seq_len - q_len + query + 1;
            let mut scores = vec![0.0f32; visible];
            for head in 0..num_q_heads {
                let kv_offset = (head / n_rep) * head_dim;
                let q_head = &q_request[(query * num_q_heads + head) * head_dim..][..head_dim];
                for (token, score) in scores.iter_mut().enumerate() {
                    let key = &keys[token * stride + kv_offset..][..head_dim];
                    *score = dot(q_head, key) * scale_log2;
                }
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let out_head = &mut out_row[head * head_dim..(head + 1) * head_dim];
                out_head.fill(0.0);
                let mut denominator = 0.0f32;
                for (token, &score) in scores.iter().enumerate() {
                    let weight = (score - max).exp2();
                    denominator += weight;
                    add_scaled(
                        out_head,
                        weight,
                        &values[token * stride + kv_offset..][..head_dim],
                    );
                }
                let inverse = 1.0 / denominator;
                out_head.iter_mut().for_each(|value| *value *= inverse);
            }
        });
}
