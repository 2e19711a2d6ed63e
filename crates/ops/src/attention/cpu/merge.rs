//! The generic LSE merge of normalized partial attention states, paging-agnostic so that
//! split-KV decode, cascade levels and latent (MLA) chunks all reuse it.

use rayon::prelude::*;

use super::math::add_scaled;
use crate::attention::{validate, AttentionError};

/// Output of [`merge_states`]: `v [M, num_heads, head_dim]` and `lse [M, num_heads]` (log2).
#[derive(Clone, Debug, PartialEq)]
pub struct MergedStates {
    /// Merged normalized outputs, `[M, num_heads, head_dim]`.
    pub v: Vec<f32>,
    /// Merged log-sum-exp in log2 units, `[M, num_heads]`; `-inf` for rows with no finite
    /// partial. Feed it back into `merge_states` to chain merges.
    pub lse: Vec<f32>,
}

/// Merges partial states: output row `o` combines partial rows
/// `o_indptr[o]..o_indptr[o + 1]`.
///
/// Shapes: `v_in [N, num_heads, head_dim]` (each partial already normalized by its own
/// denominator), `lse_in [N, num_heads]` in log2 units, `o_indptr [M + 1]` (starts at 0,
/// non-decreasing, ends at `N`). Per `(row, head)`: `m = max lse`, `w_i = exp2(lse_i - m)`,
/// `v = Σ w_i v_i / Σ w_i`, `lse = m + log2(Σ w_i)`. Partials whose LSE is not finite (`-inf`
/// for an empty chunk, or NaN) are skipped; a row with no finite partial gets zeros and
/// `-inf`. Associative and commutative up to rounding.
pub fn merge_states(
    v_in: &[f32],
    lse_in: &[f32],
    o_indptr: &[u32],
    num_heads: usize,
    head_dim: usize,
) -> Result<MergedStates, AttentionError> {
    let num_rows = o_indptr.len().saturating_sub(1);
    let mut merged = MergedStates {
        v: vec![0.0; num_rows * num_heads * head_dim],
        lse: vec![0.0; num_rows * num_heads],
    };
    merge_states_into(
        v_in,
        lse_in,
        o_indptr,
        num_heads,
        head_dim,
        &mut merged.v,
        &mut merged.lse,
    )?;
    Ok(merged)
}

/// [`merge_states`] writing into caller buffers: `v_out [M, num_heads, head_dim]` and
/// `lse_out [M, num_heads]`, fully overwritten. Parallel over output rows.
pub fn merge_states_into(
    v_in: &[f32],
    lse_in: &[f32],
    o_indptr: &[u32],
    num_heads: usize,
    head_dim: usize,
    v_out: &mut [f32],
    lse_out: &mut [f32],
) -> Result<(), AttentionError> {
    if num_heads == 0 || head_dim == 0 {
        return Err(AttentionError::Geometry(format!(
            "merge needs num_heads {num_heads} and head_dim {head_dim} >= 1"
        )));
    }
    if o_indptr.is_empty() {
        return Err(AttentionError::Indptr {
            what: "o_indptr",
            reason: "empty, expected M + 1 >= 1 entries".into(),
        });
    }
    let num_rows = o_indptr.len() - 1;
    let num_partials = lse_in.len() / num_heads;
    validate::length(
        "lse_in [N, num_heads]",
        num_partials * num_heads,
        lse_in.len(),
    )?;
    validate::length(
        "v_in [N, num_heads, head_dim]",
        lse_in.len() * head_dim,
        v_in.len(),
    )?;
    validate::indptr("o_indptr", o_indptr, num_rows, num_partials)?;
    validate::length(
        "v_out [M, num_heads, head_dim]",
        num_rows * num_heads * head_dim,
        v_out.len(),
    )?;
    validate::length(
        "lse_out [M, num_heads]",
        num_rows * num_heads,
        lse_out.len(),
    )?;

    let row_len = num_heads * head_dim;
    v_out
        .par_chunks_mut(row_len)
        .zip(lse_out.par_chunks_mut(num_heads))
        .enumerate()
        .for_each(|(row, (v_row, lse_row))| {
            let partials = o_indptr[row] as usize..o_indptr[row + 1] as usize;
            for head in 0..num_heads {
                let lse_of = |partial: usize| lse_in[partial * num_heads + head];
                let out_head = &mut v_row[head * head_dim..(head + 1) * head_dim];
                out_head.fill(0.0);
                let max = partials
                    .clone()
                    .map(lse_of)
                    .filter(|lse| lse.is_finite())
                    .fold(f32::NEG_INFINITY, f32::max);
                if max == f32::NEG_INFINITY {
                    lse_row[head] = f32::NEG_INFINITY;
                    continue;
                }
                let mut denominator = 0.0f32;
                for partial in partials
                    .clone()
                    .filter(|&partial| lse_of(partial).is_finite())
                {
                    let weight = (lse_of(partial) - max).exp2();
                    denominator += weight;
                    let v_head = &v_in[(partial * num_heads + head) * head_dim..][..head_dim];
                    add_scaled(out_head, weight, v_head);
                }
                let inverse = 1.0 / denominator;
                out_head.iter_mut().for_each(|value| *value *= inverse);
                lse_row[head] = max + denominator.log2();
            }
        });
    Ok(())
}
