//! DeepSeek-V3.2's lightning indexer on the CPU, around the latent attention steps of
//! `mla.rs`: the index keys (`LayerNorm(wk x)`, weight and bias, eps 1e-6) and head weights
//! (`weights_proj x`, scaled by `index_n_heads^-0.5 * index_head_dim^-0.5`), the index
//! queries (`wq_b` of the normed compressed query), rotate-half RoPE on the first
//! `qk_rope_head_dim` dims of both (the model's frequencies and YaRN scale, while the
//! attention itself rotates adjacent pairs), and the cache rows `[c, k_rope, k_index]`. The
//! top-k selection and the sparse attention are `pagoda_ops::attention::{select_tokens,
//! mla_attention_selected}`. Every step is row-wise, so a row's bits do not depend on its
//! batch.

use pagoda_ops::attention::TokenSelection;
use pagoda_ops::rope::{Rope, RopePairing, RopeTable};

use super::super::mla::IndexerWeights;
use crate::config::IndexerConfig;

/// The indexer key's LayerNorm epsilon (`nn.LayerNorm(index_head_dim, eps=1e-6)`).
const K_NORM_EPS: f32 = 1e-6;

/// The indexer's activations, grown to the step's size on first use.
#[derive(Default)]
pub(super) struct IndexScratch {
    /// `[T, index_heads, index_dim]`.
    pub(super) q: Vec<f32>,
    /// `[T, index_dim]`.
    pub(super) k: Vec<f32>,
    /// `[T, index_heads]`.
    pub(super) weights: Vec<f32>,
    /// `[T, latent + rope + index_dim]`: the rows the cache stores.
    pub(super) rows: Vec<f32>,
    /// Each query row's kept tokens.
    pub(super) selection: TokenSelection,
}

impl IndexScratch {
    /// The key and head-weight buffers for `num_tokens` rows.
    pub(super) fn keys_and_weights(
        &mut self,
        num_tokens: usize,
        config: &IndexerConfig,
    ) -> (&mut [f32], &mut [f32]) {
        let k = fit(&mut self.k, num_tokens * config.head_dim);
        let weights = fit(&mut self.weights, num_tokens * config.num_heads);
        (k, weights)
    }

    /// The index queries, `[T, index_heads * index_dim]`.
    pub(super) fn queries(&mut self, num_tokens: usize, config: &IndexerConfig) -> &mut [f32] {
        fit(&mut self.q, num_tokens * config.num_heads * config.head_dim)
    }
}

/// After the projections: the keys' LayerNorm, the scales folded into the head weights.
pub(super) fn normalize(weights: &IndexerWeights, config: &IndexerConfig, s: &mut IndexScratch) {
    for key in s.k.chunks_exact_mut(config.head_dim) {
        layer_norm_in_place(key, &weights.k_norm, &weights.k_norm_bias, K_NORM_EPS);
    }
    let scale = (config.num_heads as f32).powf(-0.5) * (config.head_dim as f32).powf(-0.5);
    s.weights.iter_mut().for_each(|w| *w *= scale);
}

/// `x <- (x - mean) / sqrt(var + eps) * weight + bias` (biased variance, as torch).
fn layer_norm_in_place(x: &mut [f32], weight: &[f32], bias: &[f32], eps: f32) {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let variance = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    let inverse = 1.0 / (variance + eps).sqrt();
    for ((v, w), b) in x.iter_mut().zip(weight).zip(bias) {
        *v = (*v - mean) * inverse * w + b;
    }
}

/// Rotate-half RoPE on the first `rope_dim` dims of every index query head and key, the
/// rotated dims times `scale` (YaRN's).
pub(super) fn rotate(
    (rope, table): (&Rope, &RopeTable),
    config: &IndexerConfig,
    rope_dim: usize,
    scale: f32,
    s: &mut IndexScratch,
) {
    let dim = config.head_dim;
    rope.apply_table_paired(table, &mut s.q, config.num_heads, dim, RopePairing::Halves);
    rope.apply_table_paired(table, &mut s.k, 1, dim, RopePairing::Halves);
    for head in s.q.chunks_exact_mut(dim).chain(s.k.chunks_exact_mut(dim)) {
        head[..rope_dim].iter_mut().for_each(|v| *v *= scale);
    }
}

/// The cache rows: each latent row (`latent_rows` `[T, latent_width]`) then its index key.
pub(super) fn cache_rows<'a>(
    latent_rows: &[f32],
    latent_width: usize,
    index_dim: usize,
    s: &'a mut IndexScratch,
) -> &'a [f32] {
    let num_tokens = latent_rows.len() / latent_width;
    let width = latent_width + index_dim;
    let rows = fit(&mut s.rows, num_tokens * width);
    for ((row, latent), key) in rows
        .chunks_exact_mut(width)
        .zip(latent_rows.chunks_exact(latent_width))
        .zip(s.k.chunks_exact(index_dim))
    {
        row[..latent_width].copy_from_slice(latent);
        row[latent_width..].copy_from_slice(key);
    }
    rows
}

/// `buffer` resized to `len` values (a step's scratch, reused across steps and layers).
pub(super) fn fit(buffer: &mut Vec<f32>, len: usize) -> &mut [f32] {
    buffer.resize(len, 0.0);
    &mut buffer[..]
}
