//! The CPU's steps of DeepSeek's latent attention block ([`MlaStep`]): projections, RoPE and
//! the latent cache append, the absorbed query, attention over the latent rows, and the value
//! and output projections. Every step keeps rows independent (row-wise matmuls and norms, a
//! per-(query, head) attention), so a row's bits do not depend on its batch. DeepSeek-V3.2's
//! indexer (`mla_index.rs`) rides along: its projections with the query's, its RoPE with
//! the latent's, its key in the cache row, its top-k selection before the attention.

use pagoda_ops::activation::add_in_place;
use pagoda_ops::attention::{self, AbsorbedQuery, IndexerQuery, LatentKv};
use pagoda_ops::linear::{matmul_shared, Weight};
use pagoda_ops::norm::rms_norm_in_place;
use pagoda_ops::profile::{self, Op};

use super::super::mla::{MlaQuery, MlaWeights};
use super::mla_index::{self, fit, IndexScratch};
use super::{CpuStep, ForwardError};
use crate::config::MlaConfig;
use crate::decoder::MlaStep;
use crate::llama::{Attention, Layer, Model};

/// Latent attention's activations, grown to the step's size on first use.
#[derive(Default)]
pub(super) struct MlaScratch {
    /// `[T, heads, nope + rope]`.
    q: Vec<f32>,
    /// `[T, q_lora_rank]`.
    q_compressed: Vec<f32>,
    /// `[T, latent + rope]`: the latent rows (the rows the cache stores, but for V3.2's
    /// index key).
    rows: Vec<f32>,
    /// `[T, heads, latent + rope]`.
    q_absorbed: Vec<f32>,
    /// `[T, heads, latent]`.
    latent_out: Vec<f32>,
    /// `[T, heads * v]`.
    values: Vec<f32>,
    /// One head's strided columns gathered contiguously, `[T, width]`, and its product.
    head_in: Vec<f32>,
    head_out: Vec<f32>,
    /// DeepSeek-V3.2's indexer.
    index: IndexScratch,
}

/// `out[t] <- weight · x[t, offset..offset + weight.in_features]` for the `T` rows of `x`
/// (row stride `x_stride`), written to `out[t * out_stride + out_offset..]`: one head's
/// matmul over strided columns.
#[allow(clippy::too_many_arguments)]
fn head_matmul(
    weight: &Weight,
    x: &[f32],
    (x_stride, x_offset): (usize, usize),
    out: &mut [f32],
    (out_stride, out_offset): (usize, usize),
    num_tokens: usize,
    head_in: &mut Vec<f32>,
    head_out: &mut Vec<f32>,
) {
    let (k, n) = (weight.in_features(), weight.out_features());
    let input = fit(head_in, num_tokens * k);
    for (t, row) in input.chunks_exact_mut(k).enumerate() {
        row.copy_from_slice(&x[t * x_stride + x_offset..][..k]);
    }
    let output = fit(head_out, num_tokens * n);
    weight.matmul(input, num_tokens, output);
    for (t, row) in output.chunks_exact(n).enumerate() {
        out[t * out_stride + out_offset..][..n].copy_from_slice(row);
    }
}

fn mla_config(model: &Model) -> Result<&MlaConfig, ForwardError> {
    model.config.mla.as_ref().ok_or_else(|| {
        ForwardError::Batch("a latent attention step ran on a model without one".into())
    })
}

fn mla(layer: &Layer) -> Result<&MlaWeights, ForwardError> {
    match &layer.attention {
        Attention::Mla(weights) => Ok(weights),
        Attention::Gqa(_) => Err(ForwardError::Batch(
            "a latent attention step ran on a grouped-query layer".into(),
        )),
    }
}

impl MlaStep for CpuStep<'_> {
    fn mla_projection(&mut self, layer: &Layer) -> Result<(), ForwardError> {
        let weights = mla(layer)?;
        let c = &self.model.config;
        let m = mla_config(self.model)?;
        let num_tokens = self.num_tokens();
        // The latent norms (`q_a_layernorm`, `kv_a_layernorm`) are built with RMSNorm's
        // default eps in DeepSeek's modelling code and transformers', not `rms_norm_eps`.
        let (eps, latent, row_width) = (MlaConfig::LATENT_NORM_EPS, m.kv_lora_rank, m.latent_row());
        let s = &mut self.mla;
        let q = fit(
            &mut s.q,
            num_tokens * c.num_attention_heads * m.q_head_dim(),
        );
        let rows = fit(&mut s.rows, num_tokens * row_width);
        let normed = &self.normed;
        let index = &mut s.index;
        let indexer = weights.indexer.as_ref().zip(m.indexer.as_ref());
        profile::time(Op::QkvProj, || match &weights.query {
            MlaQuery::Direct(wq) => {
                matmul_shared(normed, num_tokens, &mut [(wq, q), (&weights.kv_a, rows)])
            }
            MlaQuery::Compressed { q_a, q_a_norm, q_b } => {
                let compressed = fit(&mut s.q_compressed, num_tokens * q_a.out_features());
                match indexer {
                    None => matmul_shared(
                        normed,
                        num_tokens,
                        &mut [(q_a, &mut *compressed), (&weights.kv_a, &mut *rows)],
                    ),
                    Some((iw, config)) => {
                        let (keys, head_weights) = index.keys_and_weights(num_tokens, config);
                        matmul_shared(
                            normed,
                            num_tokens,
                            &mut [
                                (q_a, &mut *compressed),
                                (&weights.kv_a, &mut *rows),
                                (&iw.k, keys),
                                (&iw.proj, head_weights),
                            ],
                        );
                    }
                }
                rms_norm_in_place(compressed, q_a_norm, eps);
                q_b.matmul(compressed, num_tokens, q);
                if let Some((iw, config)) = indexer {
                    let queries = index.queries(num_tokens, config);
                    iw.q_b.matmul(compressed, num_tokens, queries);
                }
            }
        });
        profile::time(Op::Norm, || {
            for row in rows.chunks_exact_mut(row_width) {
                rms_norm_in_place(&mut row[..latent], &weights.kv_a_norm, eps);
            }
            if let Some((iw, config)) = indexer {
                mla_index::normalize(iw, config, index);
            }
        });
        Ok(())
    }

    fn mla_rope_append(&mut self, index: usize) -> Result<(), ForwardError> {
        let c = &self.model.config;
        let m = mla_config(self.model)?;
        let num_tokens = self.num_tokens();
        let (heads, q_head, nope, rope_dim) = (
            c.num_attention_heads,
            m.q_head_dim(),
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
        );
        let (latent, row_width, scale) = (m.kv_lora_rank, m.latent_row(), m.rope_scale());
        let (rope, table) = (&self.model.rope, &self.rope_table);
        let s = &mut self.mla;
        profile::time(Op::Rope, || {
            // The rope parts are the tails of q's heads and of the rows: gather, rotate,
            // scatter back.
            let parts = fit(&mut s.head_in, num_tokens * heads * rope_dim);
            for (part, head) in parts
                .chunks_exact_mut(rope_dim)
                .zip(s.q.chunks_exact(q_head))
            {
                part.copy_from_slice(&head[nope..]);
            }
            rope.apply_table(table, parts, heads, rope_dim);
            for (part, head) in parts
                .chunks_exact(rope_dim)
                .zip(s.q.chunks_exact_mut(q_head))
            {
                head[nope..]
                    .iter_mut()
                    .zip(part)
                    .for_each(|(q, p)| *q = p * scale);
            }
            let keys = fit(&mut s.head_out, num_tokens * rope_dim);
            for (key, row) in keys
                .chunks_exact_mut(rope_dim)
                .zip(s.rows.chunks_exact(row_width))
            {
                key.copy_from_slice(&row[latent..]);
            }
            rope.apply_table(table, keys, 1, rope_dim);
            for (key, row) in keys
                .chunks_exact(rope_dim)
                .zip(s.rows.chunks_exact_mut(row_width))
            {
                row[latent..]
                    .iter_mut()
                    .zip(key)
                    .for_each(|(r, k)| *r = k * scale);
            }
        });
        let rows = match &m.indexer {
            Some(config) => {
                profile::time(Op::Rope, || {
                    mla_index::rotate((rope, table), config, rope_dim, scale, &mut s.index)
                });
                mla_index::cache_rows(&s.rows, row_width, config.head_dim, &mut s.index)
            }
            None => &s.rows,
        };
        let kv = &mut *self.kv;
        let (pool, layout, slots) = (&mut kv.k[index], &kv.layout, self.batch.slots);
        profile::time(Op::KvAppend, || {
            attention::append_latent(pool, layout, slots, rows)
        })?;
        Ok(())
    }

    fn mla_absorb(&mut self, layer: &Layer) -> Result<(), ForwardError> {
        let weights = mla(layer)?;
        let c = &self.model.config;
        let m = mla_config(self.model)?;
        let num_tokens = self.num_tokens();
        let heads = c.num_attention_heads;
        let (q_head, nope, latent, row_width) = (
            m.q_head_dim(),
            m.qk_nope_head_dim,
            m.kv_lora_rank,
            m.latent_row(),
        );
        let s = &mut self.mla;
        let absorbed = fit(&mut s.q_absorbed, num_tokens * heads * row_width);
        profile::time(Op::QkvProj, || {
            for (head, k_up_t) in weights.k_up_t.iter().enumerate() {
                head_matmul(
                    k_up_t,
                    &s.q,
                    (heads * q_head, head * q_head),
                    absorbed,
                    (heads * row_width, head * row_width),
                    num_tokens,
                    &mut s.head_in,
                    &mut s.head_out,
                );
            }
            for (out, q) in absorbed
                .chunks_exact_mut(row_width)
                .zip(s.q.chunks_exact(q_head))
            {
                out[latent..].copy_from_slice(&q[nope..]);
            }
        });
        Ok(())
    }

    fn mla_attention(&mut self, index: usize) -> Result<(), ForwardError> {
        let c = &self.model.config;
        let m = mla_config(self.model)?;
        let (heads, latent) = (c.num_attention_heads, m.kv_lora_rank);
        let kv = LatentKv {
            pool: self.kv.k[index].as_slice(),
            layout: self.kv.layout,
            page_table: self.batch.page_table,
        };
        let scale = m.softmax_scale();
        let s = &mut self.mla;
        let out = fit(&mut s.latent_out, self.batch.tokens.len() * heads * latent);
        let (q, qo_indptr) = (&s.q_absorbed, self.batch.qo_indptr);
        let Some(config) = &m.indexer else {
            profile::time(Op::Attention, || {
                attention::mla_attention(&kv, q, qo_indptr, heads, latent, scale, out)
            })?;
            return Ok(());
        };
        // V3.2: each row that sees more than index_topk tokens keeps its best-scored ones.
        let index = &mut s.index;
        let query = IndexerQuery {
            q: &index.q,
            weights: &index.weights,
            num_heads: config.num_heads,
            head_dim: config.head_dim,
        };
        let absorbed = AbsorbedQuery {
            q,
            num_heads: heads,
            latent_dim: latent,
            width: m.latent_row(),
        };
        let selection = &mut index.selection;
        profile::time(Op::Attention, || {
            let stats = attention::select_tokens(
                &kv,
                m.latent_row(),
                &query,
                qo_indptr,
                config.top_k,
                selection,
            )?;
            let selection = (stats.sparse_rows > 0).then_some(&*selection);
            attention::mla_attention_selected(&kv, &absorbed, qo_indptr, scale, selection, out)
        })?;
        Ok(())
    }

    fn mla_output(&mut self, layer: &Layer) -> Result<(), ForwardError> {
        let weights = mla(layer)?;
        let c = &self.model.config;
        let m = mla_config(self.model)?;
        let num_tokens = self.num_tokens();
        let (heads, latent, v) = (c.num_attention_heads, m.kv_lora_rank, m.v_head_dim);
        let s = &mut self.mla;
        let values = fit(&mut s.values, num_tokens * heads * v);
        let proj = &mut self.proj;
        profile::time(Op::OutProj, || {
            for (head, v_up) in weights.v_up.iter().enumerate() {
                head_matmul(
                    v_up,
                    &s.latent_out,
                    (heads * latent, head * latent),
                    values,
                    (heads * v, head * v),
                    num_tokens,
                    &mut s.head_in,
                    &mut s.head_out,
                );
            }
            weights.wo.matmul(values, num_tokens, proj);
        });
        self.reduce_partial_sums()?;
        profile::time(Op::Residual, || add_in_place(&mut self.x, &self.proj));
        Ok(())
    }
}
