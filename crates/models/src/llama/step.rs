//! The CPU's steps of the decoder sequence ([`crate::decoder`]), the mixture-of-experts steps
//! included: f32 activations in host memory, the weights in their stored formats, each step
//! timed under its profile op.

use pagoda_ops::activation::{add_bias, add_in_place, silu_mul_in_place};
use pagoda_ops::attention::{self, PagedKv, QueryBatch, StepAttentionPlan, StepWorkspace};
use pagoda_ops::linear::{matmul_shared, Weight};
use pagoda_ops::moe::ExpertRouting;
use pagoda_ops::norm::{rms_norm, rms_norm_in_place};
use pagoda_ops::profile::{self, Op};
use pagoda_ops::rope::RopeTable;

use super::moe::{ExpertScratch, Experts, Mlp};
use super::{Attention, ForwardBatch, ForwardError, GqaWeights, KvCache, Layer, Model};
use crate::decoder::{DecoderStep, MoeStep};

mod mla;
mod mla_index;
mod sparse;

/// What the last step computes for the rows of `batch.logits_for`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Head {
    /// The LM head's logits.
    Logits,
    /// The hidden states after the final norm (embeddings), `[rows, hidden_size]`.
    Hidden,
}

/// One forward step on the CPU: the batch, its KV cache, its attention routing and every
/// activation buffer, sized for the batch.
pub(super) struct CpuStep<'a> {
    model: &'a Model,
    head: Head,
    batch: &'a ForwardBatch<'a>,
    kv: &'a mut KvCache,
    plan: &'a StepAttentionPlan,
    /// The step's routing scratch, shared by every layer.
    workspace: StepWorkspace,
    /// The rotary angles of the batch's positions, shared by q and k of every layer.
    rope_table: RopeTable,
    scale: f32,
    x: Vec<f32>,
    normed: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn_out: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    /// `[num_tokens, num_experts]`: the MoE router's logits of the current layer.
    router_logits: Vec<f32>,
    /// The current MoE layer's routing.
    routing: ExpertRouting,
    expert_scratch: ExpertScratch,
    /// Latent attention's buffers (DeepSeek), sized by its first step.
    mla: mla::MlaScratch,
    /// Sparse decode's per-step state, when a request asked for it and the cache keeps key
    /// summaries.
    sparse: Option<sparse::SparseLayers>,
    /// `[logits_for.len(), vocab_size]` (or `hidden_size` with [`Head::Hidden`]), written by
    /// the last step.
    pub(super) logits: Vec<f32>,
}

impl<'a> CpuStep<'a> {
    /// Buffers for `batch` (already validated against the model).
    pub(super) fn new(
        model: &'a Model,
        batch: &'a ForwardBatch<'a>,
        kv: &'a mut KvCache,
        plan: &'a StepAttentionPlan,
        head: Head,
    ) -> Self {
        let c = &model.config;
        let num_tokens = batch.tokens.len();
        // Latent attention keeps its own buffers (`mla.rs`): no grouped-query ones.
        let gqa = c.mla.is_none();
        let q_dim = if gqa {
            c.num_attention_heads * c.head_dim
        } else {
            0
        };
        let kv_dim = if gqa { c.num_kv_heads * c.head_dim } else { 0 };
        let mut workspace = StepWorkspace::default();
        if gqa {
            workspace.fit(plan, c.num_attention_heads, c.head_dim);
        }
        let rope_table = profile::time(Op::Rope, || model.rope.table(batch.positions));
        let zeros = |len: usize| vec![0f32; num_tokens * len];
        // A model whose every MLP block is a mixture of experts needs no dense buffers.
        let any_dense = (0..c.num_layers).any(|layer| !c.is_moe_layer(layer));
        let dense_width = if any_dense { c.intermediate_size } else { 0 };
        CpuStep {
            model,
            head,
            batch,
            kv,
            plan,
            workspace,
            rope_table,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
            x: zeros(c.hidden_size),
            normed: zeros(c.hidden_size),
            q: zeros(q_dim),
            k: zeros(kv_dim),
            v: zeros(kv_dim),
            attn_out: zeros(q_dim),
            proj: zeros(c.hidden_size),
            gate: zeros(dense_width),
            up: zeros(dense_width),
            router_logits: Vec::new(),
            routing: ExpertRouting::default(),
            expert_scratch: ExpertScratch::default(),
            mla: mla::MlaScratch::default(),
            sparse: None,
            logits: Vec::new(),
        }
    }

    /// Turns sparse decode on for this step, with the dense step's routing `config`.
    pub(super) fn set_sparse(&mut self, config: Option<attention::StepAttentionConfig>) {
        self.sparse = config.map(sparse::SparseLayers::new);
    }

    fn num_tokens(&self) -> usize {
        self.batch.tokens.len()
    }

    /// A tensor-parallel rank's row-parallel projection left a partial sum in `proj`: the
    /// ranks' parts are added (in rank order) before the residual add. Nothing on the whole
    /// model.
    pub(super) fn reduce_partial_sums(&mut self) -> Result<(), ForwardError> {
        if let Some(parallel) = &self.model.parallel {
            let proj = &mut self.proj;
            profile::time(Op::AllReduce, || parallel.all_reduce_sum(proj))?;
        }
        Ok(())
    }
}

impl DecoderStep for CpuStep<'_> {
    type Layer = Layer;
    type Error = ForwardError;

    fn embed(&mut self) -> Result<(), ForwardError> {
        let hidden = self.model.config.hidden_size;
        let (embedding, tokens, x) = (&self.model.embedding, self.batch.tokens, &mut self.x);
        profile::time(Op::Embed, || {
            for (t, &token) in tokens.iter().enumerate() {
                embedding.dequantize_row(token as usize, &mut x[t * hidden..(t + 1) * hidden]);
            }
        });
        Ok(())
    }

    fn attention_norm(&mut self, layer: &Layer) -> Result<(), ForwardError> {
        let eps = self.model.config.rms_norm_eps;
        let (x, normed) = (&self.x, &mut self.normed);
        profile::time(Op::Norm, || rms_norm(x, &layer.attn_norm, eps, normed));
        Ok(())
    }

    fn qkv_projection(&mut self, layer: &Layer) -> Result<(), ForwardError> {
        // q, k and v share their input: quantized once, one parallel region for decode.
        let num_tokens = self.num_tokens();
        let layer = gqa(layer)?;
        let (normed, q, k, v) = (&self.normed, &mut self.q, &mut self.k, &mut self.v);
        profile::time(Op::QkvProj, || {
            matmul_shared(
                normed,
                num_tokens,
                &mut [
                    (&layer.wq, &mut *q),
                    (&layer.wk, &mut *k),
                    (&layer.wv, &mut *v),
                ],
            );
            for (bias, out) in [(&layer.q_bias, q), (&layer.k_bias, k), (&layer.v_bias, v)] {
                if let Some(bias) = bias {
                    add_bias(out, bias);
                }
            }
        });
        Ok(())
    }

    fn qk_norm(&mut self, layer: &Layer) -> Result<(), ForwardError> {
        let eps = self.model.config.rms_norm_eps;
        let layer = gqa(layer)?;
        let (q, k) = (&mut self.q, &mut self.k);
        profile::time(Op::Norm, || {
            if let Some(w) = &layer.q_norm {
                rms_norm_in_place(q, w, eps);
            }
            if let Some(w) = &layer.k_norm {
                rms_norm_in_place(k, w, eps);
            }
        });
        Ok(())
    }

    fn rope(&mut self) -> Result<(), ForwardError> {
        let c = &self.model.config;
        let (rope, table) = (&self.model.rope, &self.rope_table);
        let (q, k) = (&mut self.q, &mut self.k);
        profile::time(Op::Rope, || {
            rope.apply_table(table, q, c.num_attention_heads, c.head_dim);
            rope.apply_table(table, k, c.num_kv_heads, c.head_dim);
        });
        Ok(())
    }

    fn append_kv(&mut self, index: usize) -> Result<(), ForwardError> {
        let kv = &mut *self.kv;
        let (k_pool, v_pool) = (&mut kv.k[index], &mut kv.v[index]);
        let (slots, k, v) = (self.batch.slots, &self.k, &self.v);
        profile::time(Op::KvAppend, || {
            attention::append_kv_pool(k_pool, v_pool, &kv.layout, slots, k, v)?;
            match kv.summaries.get_mut(index) {
                Some(summaries) => summaries.update(k_pool.as_slice(), &kv.layout, slots),
                None => Ok(()),
            }
        })?;
        Ok(())
    }

    fn attention(&mut self, index: usize) -> Result<(), ForwardError> {
        let paged = PagedKv {
            k_pool: self.kv.k[index].as_slice(),
            v_pool: self.kv.v[index].as_slice(),
            layout: self.kv.layout,
            page_table: self.batch.page_table,
        };
        let queries = QueryBatch {
            q: &self.q,
            qo_indptr: self.batch.qo_indptr,
            num_q_heads: self.model.config.num_attention_heads,
        };
        let (plan, scale) = (self.plan, self.scale);
        let (workspace, out) = (&mut self.workspace, &mut self.attn_out);
        if let (Some(sparse), Some(summaries)) = (&mut self.sparse, self.kv.summaries.get(index)) {
            let params = self.batch.sparse;
            profile::time(Op::Attention, || {
                sparse.attention(
                    &paged, &queries, summaries, params, plan, scale, workspace, out,
                )
            })?;
            return Ok(());
        }
        profile::time(Op::Attention, || {
            attention::step_attention(&paged, &queries, plan, scale, workspace, out)
        })?;
        Ok(())
    }

    fn output_projection(&mut self, layer: &Layer) -> Result<(), ForwardError> {
        let num_tokens = self.num_tokens();
        let (attn_out, proj) = (&self.attn_out, &mut self.proj);
        let wo = &gqa(layer)?.wo;
        profile::time(Op::OutProj, || wo.matmul(attn_out, num_tokens, proj));
        self.reduce_partial_sums()?;
        profile::time(Op::Residual, || add_in_place(&mut self.x, &self.proj));
        Ok(())
    }

    fn mlp_norm(&mut self, layer: &Layer) -> Result<(), ForwardError> {
        let eps = self.model.config.rms_norm_eps;
        let (x, normed) = (&self.x, &mut self.normed);
        profile::time(Op::Norm, || rms_norm(x, &layer.ffn_norm, eps, normed));
        Ok(())
    }

    fn gate_up_projection(&mut self, layer: &Layer) -> Result<(), ForwardError> {
        let num_tokens = self.num_tokens();
        let (w_gate, w_up, _) = dense(layer)?;
        let (normed, gate, up) = (&self.normed, &mut self.gate, &mut self.up);
        profile::time(Op::GateUp, || {
            matmul_shared(normed, num_tokens, &mut [(w_gate, gate), (w_up, up)])
        });
        Ok(())
    }

    fn silu_mul(&mut self) -> Result<(), ForwardError> {
        let (gate, up) = (&mut self.gate, &self.up);
        profile::time(Op::SiluMul, || silu_mul_in_place(gate, up));
        Ok(())
    }

    fn down_projection(&mut self, layer: &Layer) -> Result<(), ForwardError> {
        let num_tokens = self.num_tokens();
        let (_, _, w_down) = dense(layer)?;
        let (gate, proj) = (&self.gate, &mut self.proj);
        profile::time(Op::Down, || w_down.matmul(gate, num_tokens, proj));
        self.reduce_partial_sums()?;
        profile::time(Op::Residual, || add_in_place(&mut self.x, &self.proj));
        Ok(())
    }

    fn logits(&mut self) -> Result<(), ForwardError> {
        // Only the requested rows go through the final norm and the LM head.
        let model = self.model;
        let c = &model.config;
        let (hidden, rows) = (c.hidden_size, self.batch.logits_for);
        let mut selected = Vec::with_capacity(rows.len() * hidden);
        for &t in rows {
            selected.extend_from_slice(&self.x[t * hidden..(t + 1) * hidden]);
        }
        let mut final_normed = vec![0f32; selected.len()];
        profile::time(Op::Norm, || {
            rms_norm(
                &selected,
                &model.output_norm,
                c.rms_norm_eps,
                &mut final_normed,
            )
        });
        if self.head == Head::Hidden {
            self.logits = final_normed;
            return Ok(());
        }
        let mut logits = vec![0f32; rows.len() * model.head_rows()];
        let head = model.lm_head.as_ref().unwrap_or(&model.embedding);
        profile::time(Op::LmHead, || {
            head.matmul(&final_normed, rows.len(), &mut logits)
        });
        self.logits = logits;
        Ok(())
    }
}

impl MoeStep for CpuStep<'_> {
    fn is_moe(layer: &Layer) -> bool {
        matches!(layer.mlp, Mlp::Experts(_))
    }

    fn route(&mut self, layer: &Layer) -> Result<(), ForwardError> {
        let num_tokens = self.num_tokens();
        let experts = experts(layer)?;
        let (normed, logits) = (&self.normed, &mut self.router_logits);
        self.routing = profile::time(Op::Router, || experts.route(normed, num_tokens, logits));
        Ok(())
    }

    fn experts(&mut self, layer: &Layer) -> Result<(), ForwardError> {
        let experts = experts(layer)?;
        let (normed, routing) = (&self.normed, &self.routing);
        let (scratch, mix) = (&mut self.expert_scratch, &mut self.proj);
        profile::time(Op::ExpertMix, || experts.mix(normed, routing, scratch, mix));
        self.reduce_partial_sums()?;
        profile::time(Op::Residual, || add_in_place(&mut self.x, &self.proj));
        Ok(())
    }
}

/// The grouped-query attention weights of a layer.
fn gqa(layer: &Layer) -> Result<&GqaWeights, ForwardError> {
    match &layer.attention {
        Attention::Gqa(weights) => Ok(weights),
        Attention::Mla(_) => Err(ForwardError::Batch(
            "a grouped-query attention step ran on a latent attention layer".into(),
        )),
    }
}

/// The gate, up and down weights of a dense MLP block.
fn dense(layer: &Layer) -> Result<(&Weight, &Weight, &Weight), ForwardError> {
    match &layer.mlp {
        Mlp::Dense { gate, up, down } => Ok((gate, up, down)),
        Mlp::Experts(_) => Err(ForwardError::Batch(
            "a dense MLP step ran on a mixture-of-experts layer".into(),
        )),
    }
}

/// The experts of a mixture-of-experts MLP block.
fn experts(layer: &Layer) -> Result<&Experts, ForwardError> {
    match &layer.mlp {
        Mlp::Experts(experts) => Ok(experts),
        Mlp::Dense { .. } => Err(ForwardError::Batch(
            "a mixture-of-experts step ran on a dense layer".into(),
        )),
    }
}
