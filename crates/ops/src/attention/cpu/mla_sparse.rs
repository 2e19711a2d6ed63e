//! DeepSeek-V3.2's sparse attention (DSA) over the latent cache: the lightning indexer's
//! top-k token selection ([`select_tokens`]) and absorbed MLA over each query row's selected
//! tokens ([`mla_attention_selected`]).
//!
//! A V3.2 cache row is `[c, k_rope, k_index]`: the latent and the RoPE key of V2/V3, then the
//! token's `index_head_dim` indexer key, so the indexer's keys go through the same pages,
//! prefix cache and preemption as the latents. Row `t`'s index score of visible token `s` is
//! `Σ_h w[t, h] · relu(q[t, h] · k_index[s])` (the caller folds the indexer's scales into
//! `w`). A row that sees at most `top_k` tokens keeps them all (it is the dense row: no
//! scores are computed); otherwise it keeps the `top_k` best scores, ties broken by the
//! lower position, and attends to them in ascending position order. Everything is per row:
//! a row's selection, and so its output, does not depend on its batch.

use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;

use super::math::dot;
use super::mla::{attend, gather_rows, validate_latent_step, AbsorbedQuery, LatentKv};
pub use super::selection::TokenSelection;
use crate::attention::{validate, AttentionError};

/// The indexer's queries of a step.
#[derive(Clone, Copy, Debug)]
pub struct IndexerQuery<'a> {
    /// `[T, num_heads, head_dim]`, rotated like the keys.
    pub q: &'a [f32],
    /// `[T, num_heads]`: each head's weight, every scale folded in.
    pub weights: &'a [f32],
    /// Indexer heads.
    pub num_heads: usize,
    /// Indexer head width (the key's width).
    pub head_dim: usize,
}

/// What one [`select_tokens`] call selected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SelectionStats {
    /// Rows that saw more than `top_k` tokens and ran the selection.
    pub sparse_rows: u64,
    /// Tokens those rows kept (`top_k` each).
    pub kept_tokens: u64,
    /// Tokens those rows could see.
    pub visible_tokens: u64,
}

static SPARSE_CALLS: AtomicU64 = AtomicU64::new(0);
static SPARSE_ROWS: AtomicU64 = AtomicU64::new(0);
static KEPT_TOKENS: AtomicU64 = AtomicU64::new(0);
static VISIBLE_TOKENS: AtomicU64 = AtomicU64::new(0);

/// Process-wide totals of [`select_tokens`]: `(calls with at least one sparse row, sparse
/// rows, tokens they kept, tokens they could see)`. A call is one layer of one step.
pub fn sparse_selection_counts() -> (u64, u64, u64, u64) {
    let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
    (
        load(&SPARSE_CALLS),
        load(&SPARSE_ROWS),
        load(&KEPT_TOKENS),
        load(&VISIBLE_TOKENS),
    )
}

/// The lightning indexer's top-`top_k` selection for every query row of the step (see the
/// module docs), reading each token's key at columns `key_offset..key_offset + head_dim` of
/// its cache row. Rows that see at most `top_k` tokens get an empty (dense) range.
pub fn select_tokens(
    kv: &LatentKv<'_>,
    key_offset: usize,
    query: &IndexerQuery<'_>,
    qo_indptr: &[u32],
    top_k: usize,
    selection: &mut TokenSelection,
) -> Result<SelectionStats, AttentionError> {
    let layout = &kv.layout;
    let (heads, dim) = (query.num_heads, query.head_dim);
    if layout.num_kv_heads != 1
        || heads == 0
        || dim == 0
        || top_k == 0
        || key_offset + dim > layout.head_dim
    {
        return Err(AttentionError::Geometry(format!(
            "indexer keys at {key_offset}..{} of a latent row of {} values ({} heads), {heads} indexer heads, top_k {top_k}",
            key_offset + dim,
            layout.head_dim,
            layout.num_kv_heads
        )));
    }
    validate::geometry(layout, 1)?;
    let num_tokens = validate_latent_step(kv, qo_indptr)?;
    let table = kv.page_table;
    validate::length(
        "indexer q [T, heads, head_dim]",
        num_tokens * heads * dim,
        query.q.len(),
    )?;
    validate::length(
        "indexer weights [T, heads]",
        num_tokens * heads,
        query.weights.len(),
    )?;
    selection.indptr.clear();
    selection.indptr.push(0);
    selection.tokens.clear();
    let mut stats = SelectionStats::default();
    for request in 0..table.num_requests() {
        let (first, last) = (qo_indptr[request] as usize, qo_indptr[request + 1] as usize);
        let q_len = last - first;
        let seq_len = table.seq_lens[request] as usize;
        // Row `j` of the request sees `seq_len - q_len + 1 + j` tokens.
        let oldest_visible = seq_len + 1 - q_len;
        if seq_len <= top_k || q_len == 0 {
            // Every row of the request is dense.
            let end = selection.tokens.len() as u32;
            selection.indptr.extend(std::iter::repeat_n(end, q_len));
            continue;
        }
        let rows = gather_rows(kv, request, seq_len);
        let keys: Vec<&[f32]> = rows
            .chunks_exact(layout.head_dim)
            .map(|row| &row[key_offset..key_offset + dim])
            .collect();
        let kept: Vec<Vec<u32>> = (first..last)
            .into_par_iter()
            .map(|t| {
                let visible = oldest_visible + (t - first);
                if visible <= top_k {
                    return Vec::new();
                }
                let q = &query.q[t * heads * dim..][..heads * dim];
                let weights = &query.weights[t * heads..][..heads];
                top_k_tokens(&index_scores(q, weights, &keys[..visible]), top_k)
            })
            .collect();
        for row in kept {
            if !row.is_empty() {
                stats.sparse_rows += 1;
                stats.kept_tokens += row.len() as u64;
            }
            selection.tokens.extend_from_slice(&row);
            selection.indptr.push(selection.tokens.len() as u32);
        }
        for t in first..last {
            let visible = oldest_visible + (t - first);
            if visible > top_k {
                stats.visible_tokens += visible as u64;
            }
        }
    }
    if stats.sparse_rows > 0 {
        SPARSE_CALLS.fetch_add(1, Ordering::Relaxed);
        SPARSE_ROWS.fetch_add(stats.sparse_rows, Ordering::Relaxed);
        KEPT_TOKENS.fetch_add(stats.kept_tokens, Ordering::Relaxed);
        VISIBLE_TOKENS.fetch_add(stats.visible_tokens, Ordering::Relaxed);
    }
    Ok(stats)
}

/// `Σ_h weights[h] · relu(q_h · key)` for every key, `q` `[heads, dim]`.
pub fn index_scores(q: &[f32], weights: &[f32], keys: &[&[f32]]) -> Vec<f32> {
    let dim = q.len() / weights.len().max(1);
    keys.iter()
        .map(|key| {
            q.chunks_exact(dim)
                .zip(weights)
                .map(|(q_head, &w)| w * dot(q_head, key).max(0.0))
                .sum()
        })
        .collect()
}

/// The indices of the `top_k` best `scores` (higher first, ties to the lower index; NaN
/// ranks by `f32::total_cmp`), ascending. All of them when `top_k >= scores.len()`.
pub fn top_k_tokens(scores: &[f32], top_k: usize) -> Vec<u32> {
    let mut order: Vec<u32> = (0..scores.len() as u32).collect();
    if top_k < order.len() {
        let better = |a: &u32, b: &u32| {
            scores[*b as usize]
                .total_cmp(&scores[*a as usize])
                .then(a.cmp(b))
        };
        order.select_nth_unstable_by(top_k, better);
        order.truncate(top_k);
        order.sort_unstable();
    }
    order
}

/// Absorbed MLA where each query row attends to its `selection` (ascending visible indices;
/// an empty row, or no selection, attends to every visible token exactly as
/// [`super::mla::mla_attention`]). Shapes as [`super::mla::mla_attention`], with the query
/// width `query.width` a prefix of the cache row.
pub fn mla_attention_selected(
    kv: &LatentKv<'_>,
    query: &AbsorbedQuery<'_>,
    qo_indptr: &[u32],
    scale: f32,
    selection: Option<&TokenSelection>,
    out: &mut [f32],
) -> Result<(), AttentionError> {
    attend(kv, query, qo_indptr, scale, selection, out)
}
