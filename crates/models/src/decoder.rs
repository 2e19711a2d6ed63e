//! The decoder's layer sequence, written once for every device.
//!
//! [`llama_layers`] is the llama family's forward pass (Llama 2/3, SmolLM2, Mistral, Qwen2's
//! q/k/v bias, Qwen3's per-head q/k norm) as a sequence of steps; a device runs it by
//! implementing [`DecoderStep`] over its own buffers, weights and kernels: the CPU in
//! `llama/step.rs`, CUDA in `llama_cuda/layers.rs`. The step owns the activations (the
//! residual stream `x`, the normalised input, q/k/v, the attention output, the MLP's
//! intermediates) and the KV cache of the batch; the sequence only says what happens to them,
//! in which order. A device may fuse inside a step (CUDA projects q, k and v with one GEMM and
//! adds the residual inside the output projections), never across steps, so both devices
//! compute the same function and every step is a place to measure.
//!
//! Adding an architecture of this shape (another norm placement, a gated MLP variant) is a new
//! sequence here plus the steps it needs on each device. The mixture-of-experts MLP block
//! (Qwen3-MoE, Mixtral) is such a sequence, [`llama_moe_layers`]: its steps form the optional
//! capability [`MoeStep`], which the CPU and CUDA have (ADR 0008, ADR 0010). DeepSeek's
//! sequence, [`deepseek_layers`], adds the latent attention steps of [`MlaStep`], which CUDA
//! has too: both devices run every DeepSeek model (dense leading layers, expert layers with
//! shared experts) through it.

/// One forward step of a ragged batch on a device: the operations the layer sequence is
/// made of. Every method acts on the step's own buffers.
pub(crate) trait DecoderStep {
    /// The device's weights of one decoder layer.
    type Layer;
    /// The device's error.
    type Error;

    /// `x <- embedding rows of the batch's tokens`.
    fn embed(&mut self) -> Result<(), Self::Error>;
    /// `normed <- rms_norm(x) * attn_norm`.
    fn attention_norm(&mut self, layer: &Self::Layer) -> Result<(), Self::Error>;
    /// `q, k, v <- normed · [Wq; Wk; Wv]^T (+ their biases where the layer has them)`.
    fn qkv_projection(&mut self, layer: &Self::Layer) -> Result<(), Self::Error>;
    /// Per-head RMSNorm of q and of k where the layer has those norms (Qwen3).
    fn qk_norm(&mut self, layer: &Self::Layer) -> Result<(), Self::Error>;
    /// Rotary embedding of q and k at the batch's positions.
    fn rope(&mut self) -> Result<(), Self::Error>;
    /// Writes k and v of the new tokens into layer `index`'s KV cache at the batch's slots.
    fn append_kv(&mut self, index: usize) -> Result<(), Self::Error>;
    /// [`rope`](Self::rope) then [`append_kv`](Self::append_kv): one step, so a device may
    /// fuse the two (CUDA does, behind `PAGODA_CUDA_FUSED_ROPE_APPEND`).
    fn rope_append_kv(&mut self, index: usize) -> Result<(), Self::Error> {
        self.rope()?;
        self.append_kv(index)
    }
    /// `attn <- attention(q, layer index's KV cache)`, causal over each request's tokens.
    fn attention(&mut self, index: usize) -> Result<(), Self::Error>;
    /// `x += attn · Wo^T`.
    fn output_projection(&mut self, layer: &Self::Layer) -> Result<(), Self::Error>;
    /// `normed <- rms_norm(x) * ffn_norm`.
    fn mlp_norm(&mut self, layer: &Self::Layer) -> Result<(), Self::Error>;
    /// `gate, up <- normed · [Wgate; Wup]^T`.
    fn gate_up_projection(&mut self, layer: &Self::Layer) -> Result<(), Self::Error>;
    /// `act <- silu(gate) * up`.
    fn silu_mul(&mut self) -> Result<(), Self::Error>;
    /// `x += act · Wdown^T`.
    fn down_projection(&mut self, layer: &Self::Layer) -> Result<(), Self::Error>;
    /// The logits of the rows that asked for them: final norm, then the LM head.
    fn logits(&mut self) -> Result<(), Self::Error>;
}

/// The steps of a mixture-of-experts MLP block, on a device that runs one.
pub(crate) trait MoeStep: DecoderStep {
    /// Whether `layer`'s MLP block is a mixture of experts (else it is dense).
    fn is_moe(layer: &Self::Layer) -> bool;
    /// `router_logits <- normed · Wrouter^T`, then each row's top-k experts and their weights.
    fn route(&mut self, layer: &Self::Layer) -> Result<(), Self::Error>;
    /// `x += Σ_k weight_k · down_k(silu(gate_k(normed)) * up_k(normed))` over each row's
    /// routed experts, summed in ascending expert order whatever the batch, plus the shared
    /// experts' dense MLP where the layer has them.
    fn experts(&mut self, layer: &Self::Layer) -> Result<(), Self::Error>;
}

/// The attention block of layer `index`: pre-norm, q/k/v, q/k norm, RoPE, KV append,
/// attention, output projection with the residual add.
fn attention_block<S: DecoderStep>(
    step: &mut S,
    index: usize,
    layer: &S::Layer,
) -> Result<(), S::Error> {
    step.attention_norm(layer)?;
    step.qkv_projection(layer)?;
    step.qk_norm(layer)?;
    step.rope_append_kv(index)?;
    step.attention(index)?;
    step.output_projection(layer)
}

/// The dense MLP block: pre-norm, gate/up, SiLU gating, down projection with the residual add.
fn dense_mlp_block<S: DecoderStep>(step: &mut S, layer: &S::Layer) -> Result<(), S::Error> {
    step.mlp_norm(layer)?;
    step.gate_up_projection(layer)?;
    step.silu_mul()?;
    step.down_projection(layer)
}

/// The llama family's forward pass: embedding, every layer (attention block, then gated
/// MLP block, each with a pre-norm and a residual add), the final norm and the LM head.
pub(crate) fn llama_layers<S: DecoderStep>(
    step: &mut S,
    layers: &[S::Layer],
) -> Result<(), S::Error> {
    step.embed()?;
    for (index, layer) in layers.iter().enumerate() {
        attention_block(step, index, layer)?;
        dense_mlp_block(step, layer)?;
    }
    step.logits()
}

/// [`llama_layers`] with mixture-of-experts MLP blocks where a layer has one (Qwen3-MoE,
/// Mixtral): pre-norm, routing, the experts with the residual add.
pub(crate) fn llama_moe_layers<S: MoeStep>(
    step: &mut S,
    layers: &[S::Layer],
) -> Result<(), S::Error> {
    step.embed()?;
    for (index, layer) in layers.iter().enumerate() {
        attention_block(step, index, layer)?;
        moe_or_dense_mlp_block(step, layer)?;
    }
    step.logits()
}

/// A layer's MLP block on a MoE-capable device: pre-norm, routing and the experts (with the
/// residual add) for a MoE layer, the dense block otherwise.
fn moe_or_dense_mlp_block<S: MoeStep>(step: &mut S, layer: &S::Layer) -> Result<(), S::Error> {
    if !S::is_moe(layer) {
        return dense_mlp_block(step, layer);
    }
    step.mlp_norm(layer)?;
    step.route(layer)?;
    step.experts(layer)
}

/// The steps of DeepSeek's multi-head latent attention block, on a device that runs one. The
/// cache holds one row per token: the normalised latent `c` then the rotated RoPE key.
pub(crate) trait MlaStep: DecoderStep {
    /// `q <- normed · Wq^T` (or `rms_norm(normed · Wq_a^T) · Wq_b^T`), `[T, heads, nope +
    /// rope]`; `row <- normed · Wkv_a^T`, `[T, latent + rope]`, its latent part RMSNormed;
    /// V3.2's index queries, keys and head weights.
    fn mla_projection(&mut self, layer: &Self::Layer) -> Result<(), Self::Error>;
    /// RoPE (YaRN-scaled where configured) on q's rope parts and the rows' rope keys, then
    /// the rows into layer `index`'s latent cache at the batch's slots.
    fn mla_rope_append(&mut self, index: usize) -> Result<(), Self::Error>;
    /// The absorbed query: per head `[W_UK_h^T q_nope_h, q_rope_h]`, `[T, heads, latent +
    /// rope]`.
    fn mla_absorb(&mut self, layer: &Self::Layer) -> Result<(), Self::Error>;
    /// The latent output of each head: softmax attention of the absorbed query over layer
    /// `index`'s latent cache (V3.2: over each row's top-k index scores), `[T, heads, latent]`.
    fn mla_attention(&mut self, index: usize) -> Result<(), Self::Error>;
    /// `x += concat_h(W_UV_h · latent_h) · Wo^T`.
    fn mla_output(&mut self, layer: &Self::Layer) -> Result<(), Self::Error>;
}

/// DeepSeek-V2/V3/V3.2's forward pass: every layer's latent attention block, then its dense MLP
/// block (the leading layers) or its mixture of experts with the shared experts.
pub(crate) fn deepseek_layers<S: MlaStep + MoeStep>(
    step: &mut S,
    layers: &[S::Layer],
) -> Result<(), S::Error> {
    step.embed()?;
    for (index, layer) in layers.iter().enumerate() {
        latent_attention_block(step, index, layer)?;
        moe_or_dense_mlp_block(step, layer)?;
    }
    step.logits()
}

/// The latent attention block of layer `index`: pre-norm, the projections and latent norms,
/// RoPE and the latent cache append, the absorbed query, attention over the latent rows, the
/// value and output projections with the residual add.
fn latent_attention_block<S: MlaStep>(
    step: &mut S,
    index: usize,
    layer: &S::Layer,
) -> Result<(), S::Error> {
    step.attention_norm(layer)?;
    step.mla_projection(layer)?;
    step.mla_rope_append(index)?;
    step.mla_absorb(layer)?;
    step.mla_attention(index)?;
    step.mla_output(layer)
}
