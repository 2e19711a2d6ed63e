//! Multi-head latent attention (DeepSeek-V2/V3's MLA) in its absorbed form, over a latent
//! paged cache.
//!
//! The cache holds ONE row per token, `[latent_dim + rope_dim]`: the compressed KV latent
//! `c` (after its RMSNorm) then the shared, rotated RoPE key `k_rope`. It is a pool of the
//! usual [`KvLayout`] with `num_kv_heads = 1` and `head_dim = latent_dim + rope_dim`, read
//! through the same CSR page table as every other cache. Every query head reads that one row:
//! the query arrives absorbed, `q = [W_UK_h^T q_nope_h, q_rope_h]` per head, so a score is one
//! dot product `q·row = q_latent·c + q_rope·k_rope`, and the output is the latent
//! `Σ p · c` (`[latent_dim]` per head), which the caller takes through `W_UV_h` and the
//! output projection. DeepSeek-V3.2's row also holds the token's indexer key after
//! `k_rope` (`mla_sparse.rs`); attention reads the row's first `latent_dim + rope_dim`.

use rayon::prelude::*;

use super::append::check_slots;
use super::math::{add_scaled, dot, LOG2_E};
use super::selection::TokenSelection;
use crate::attention::{validate, AttentionError, KvLayout, KvPool, KvSlice};
use pagoda_kv::{PageTable, Slot};

/// One layer's latent cache as this step's batch sees it.
#[derive(Clone, Copy, Debug)]
pub struct LatentKv<'a> {
    /// `[num_pages, page_size, 1, latent_dim + rope_dim]` values.
    pub pool: KvSlice<'a>,
    /// The pool's shape (`num_kv_heads` 1, `head_dim = latent_dim + rope_dim`).
    pub layout: KvLayout,
    /// The batch's CSR page table over this pool.
    pub page_table: &'a PageTable,
}

/// Ragged causal absorbed MLA over the latent cache.
///
/// Shapes: `q` `[T, num_heads, latent_dim + rope_dim]` grouped by `qo_indptr [B + 1]`;
/// `out` `[T, num_heads, latent_dim]`, fully overwritten. Query `j` of request `r` (of
/// `q_len` queries) attends to visible tokens `0..=seq_len - q_len + j`. Scores are
/// `scale * q·row`. Each (query, head) runs on its own over the visible tokens in order, so
/// a row's result never depends on the batch or the thread count.
pub fn mla_attention(
    kv: &LatentKv<'_>,
    q: &[f32],
    qo_indptr: &[u32],
    num_heads: usize,
    latent_dim: usize,
    scale: f32,
    out: &mut [f32],
) -> Result<(), AttentionError> {
    let query = AbsorbedQuery {
        q,
        num_heads,
        latent_dim,
        width: kv.layout.head_dim,
    };
    attend(kv, &query, qo_indptr, scale, None, out)
}

/// A step's absorbed queries: `q` `[T, num_heads, width]`, each head `[W_UK_h^T q_nope_h,
/// q_rope_h]`. `width` (`latent_dim + rope_dim`) is a prefix of the cache row: a
/// DeepSeek-V3.2 row also holds its token's indexer key after it, which attention does not
/// read.
#[derive(Clone, Copy, Debug)]
pub struct AbsorbedQuery<'a> {
    /// `[T, num_heads, width]`.
    pub q: &'a [f32],
    /// Query heads.
    pub num_heads: usize,
    /// The latent part of the row (the value each head reads), `kv_lora_rank`.
    pub latent_dim: usize,
    /// `latent_dim + rope_dim`: the row prefix a score is taken over.
    pub width: usize,
}

/// Checks a step over a latent cache: the pool's length against its layout, the page table,
/// and the query rows' indptr against the table; returns the step's query rows.
pub(crate) fn validate_latent_step(
    kv: &LatentKv<'_>,
    qo_indptr: &[u32],
) -> Result<usize, AttentionError> {
    let layout = &kv.layout;
    validate::length(
        "latent pool [num_pages, page_size, 1, latent_dim + rope_dim (+ index key)]",
        layout.pool_len(),
        kv.pool.len(),
    )?;
    let table = kv.page_table;
    table.validate(layout.num_pages, layout.page_size)?;
    let num_tokens = qo_indptr.last().copied().unwrap_or(0) as usize;
    validate::query_indptr(qo_indptr, &table.seq_lens, num_tokens)?;
    Ok(num_tokens)
}

/// The shared body of [`mla_attention`] and [`super::mla_sparse::mla_attention_selected`]:
/// every (query, head) over its visible tokens in order, or over its `selection` (ascending
/// visible indices) where it has one.
pub(crate) fn attend(
    kv: &LatentKv<'_>,
    query: &AbsorbedQuery<'_>,
    qo_indptr: &[u32],
    scale: f32,
    selection: Option<&TokenSelection>,
    out: &mut [f32],
) -> Result<(), AttentionError> {
    let layout = &kv.layout;
    let (row_width, width) = (layout.head_dim, query.width);
    let (num_heads, latent_dim, q) = (query.num_heads, query.latent_dim, query.q);
    if layout.num_kv_heads != 1
        || latent_dim == 0
        || latent_dim > width
        || width > row_width
        || num_heads == 0
    {
        return Err(AttentionError::Geometry(format!(
            "a latent cache has one head of latent_dim + rope_dim (+ index key) values; got {} heads of {}, latent_dim {latent_dim}, query width {width}, {num_heads} query heads",
            layout.num_kv_heads, layout.head_dim
        )));
    }
    validate::geometry(layout, num_heads)?;
    let num_tokens = validate_latent_step(kv, qo_indptr)?;
    let table = kv.page_table;
    validate::length(
        "q [T, num_heads, latent_dim + rope_dim]",
        num_tokens * num_heads * width,
        q.len(),
    )?;
    validate::length(
        "out [T, num_heads, latent_dim]",
        num_tokens * num_heads * latent_dim,
        out.len(),
    )?;
    if let Some(selection) = selection {
        selection.validate(qo_indptr, &table.seq_lens)?;
    }
    let scale_log2 = scale * LOG2_E;
    for request in 0..table.num_requests() {
        let (first, last) = (qo_indptr[request] as usize, qo_indptr[request + 1] as usize);
        if first == last {
            continue;
        }
        let q_len = last - first;
        let seq_len = table.seq_lens[request] as usize;
        let rows = gather_rows(kv, request, seq_len);
        let out_request = &mut out[first * num_heads * latent_dim..last * num_heads * latent_dim];
        let q_request = &q[first * num_heads * width..last * num_heads * width];
        out_request
            .par_chunks_mut(latent_dim)
            .enumerate()
            .for_each(|(query_head, out_head)| {
                let query = query_head / num_heads;
                let visible = seq_len - q_len + query + 1;
                let q_head = &q_request[query_head * width..][..width];
                let row = |token: usize| &rows[token * row_width..][..row_width];
                let kept = selection.map_or(&[][..], |s| s.row(first + query));
                if kept.is_empty() {
                    softmax_rows(q_head, (0..visible).map(row), scale_log2, out_head);
                } else {
                    let tokens = kept.iter().map(|&token| row(token as usize));
                    softmax_rows(q_head, tokens, scale_log2, out_head);
                }
            });
    }
    Ok(())
}

/// `out <- Σ softmax(scale · q·row[..width]) row[..latent]` over `rows` in order (base 2).
fn softmax_rows<'r>(
    q_head: &[f32],
    rows: impl Iterator<Item = &'r [f32]> + Clone,
    scale_log2: f32,
    out_head: &mut [f32],
) {
    let (width, latent_dim) = (q_head.len(), out_head.len());
    let scores: Vec<f32> = rows
        .clone()
        .map(|row| dot(q_head, &row[..width]) * scale_log2)
        .collect();
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    out_head.fill(0.0);
    let mut denominator = 0.0f32;
    for (row, &score) in rows.zip(&scores) {
        let weight = (score - max).exp2();
        denominator += weight;
        add_scaled(out_head, weight, &row[..latent_dim]);
    }
    let inverse = 1.0 / denominator;
    out_head.iter_mut().for_each(|value| *value *= inverse);
}

/// The first `seq_len` visible rows of request `request`, `[seq_len, row_width]` f32.
pub(crate) fn gather_rows(kv: &LatentKv<'_>, request: usize, seq_len: usize) -> Vec<f32> {
    let (layout, table) = (&kv.layout, kv.page_table);
    let first_page = table.indptr[request] as usize;
    let first_page_offset = table.first_page_offset[request] as usize;
    let mut rows = Vec::with_capacity(seq_len * layout.head_dim);
    for visible in 0..seq_len {
        let absolute = first_page_offset + visible;
        let page = table.indices[first_page + absolute / layout.page_size] as usize;
        let offset = layout.head_offset(page, absolute % layout.page_size, 0);
        kv.pool.extend_into(offset, layout.head_dim, &mut rows);
    }
    rows
}

/// Writes the new tokens' latent rows (`rows` `[slots.len(), latent_dim + rope_dim]`) into
/// the latent pool at their slots, in the pool's type (f32, f16 or q8_0; q8_0 needs a row
/// width that 32 divides). All or nothing: every slot is checked first.
pub fn append_latent(
    pool: &mut KvPool,
    layout: &KvLayout,
    slots: &[Slot],
    rows: &[f32],
) -> Result<(), AttentionError> {
    pool.kv_type().check_head_dim(layout.head_dim)?;
    validate::length(
        "latent pool [num_pages, page_size, 1, latent_dim + rope_dim]",
        layout.pool_len(),
        pool.len(),
    )?;
    check_slots(layout, slots, rows, rows)?;
    let stride = layout.token_stride();
    for (token, slot) in slots.iter().enumerate() {
        let offset = slot.physical_index(layout.page_size) * stride;
        pool.write(offset, &rows[token * stride..(token + 1) * stride]);
    }
    Ok(())
}
