//! The seam between model files and architectures.
//!
//! Every loader (GGUF, safetensors) exposes its tensors under the **canonical names**, which are
//! GGUF's (`token_embd.weight`, `blk.{i}.attn_q.weight`, `output_norm.weight`, ...), with shapes
//! in row-major order (outermost first: a weight applied as `y = W x` is `[out, in]`).

use std::borrow::Cow;

use pagoda_tensor::GgmlType;

/// Why a model could not be built from its tensors.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct LoadError(pub String);

/// A tensor's bytes and how to read them.
#[derive(Debug, Clone)]
pub struct RawTensor<'a> {
    pub ty: GgmlType,
    /// Row-major shape, outermost first (`[out_features, in_features]` for a linear weight).
    pub shape: Vec<usize>,
    /// The stored bytes: borrowed from a memory map, or owned when the loader had to convert.
    pub data: Cow<'a, [u8]>,
}

/// An FP8 (e4m3) matrix as the file stores it, with one factor per row (per-channel, or a
/// per-tensor factor repeated): the value at `[r, c]` is `code(codes[r * cols + c]) * row_scales[r]`.
/// The codes are borrowed from a memory map, or owned where the source makes them
/// ([`crate::random::RandomWeights`] of the `:fp8` format).
#[derive(Debug, Clone)]
pub struct Fp8Rows<'a> {
    pub codes: Cow<'a, [u8]>,
    pub row_scales: Vec<f32>,
}

/// Where an architecture gets its weights from.
pub trait TensorSource: Send + Sync {
    /// The tensor stored under a canonical name, if present.
    fn tensor(&self, name: &str) -> Option<RawTensor<'_>>;
    /// Every canonical tensor name, for diagnostics.
    fn tensor_names(&self) -> Vec<String>;
    /// The tensor as stored FP8 codes and one factor per row, where it is stored so (the GPU
    /// keeps such matrices in their bytes, `PAGODA_CUDA_FP8_WEIGHTS`); `tensor` serves the
    /// same values dequantized.
    fn fp8_rows(&self, _name: &str) -> Option<Fp8Rows<'_>> {
        None
    }
}

/// Canonical GGUF names of a decoder layer's tensors.
pub mod names {
    pub const TOKEN_EMBEDDING: &str = "token_embd.weight";
    pub const OUTPUT_NORM: &str = "output_norm.weight";
    pub const OUTPUT: &str = "output.weight";

    /// `blk.{layer}.{suffix}`, e.g. `layer(3, "attn_q.weight")`.
    pub fn layer(layer: usize, suffix: &str) -> String {
        format!("blk.{layer}.{suffix}")
    }

    /// Per-layer suffixes: norms, projections, optional biases and q/k norms.
    pub const ATTN_NORM: &str = "attn_norm.weight";
    pub const ATTN_Q: &str = "attn_q.weight";
    pub const ATTN_K: &str = "attn_k.weight";
    pub const ATTN_V: &str = "attn_v.weight";
    pub const ATTN_Q_BIAS: &str = "attn_q.bias";
    pub const ATTN_K_BIAS: &str = "attn_k.bias";
    pub const ATTN_V_BIAS: &str = "attn_v.bias";
    pub const ATTN_Q_NORM: &str = "attn_q_norm.weight";
    pub const ATTN_K_NORM: &str = "attn_k_norm.weight";
    pub const ATTN_OUTPUT: &str = "attn_output.weight";
    pub const FFN_NORM: &str = "ffn_norm.weight";
    pub const FFN_GATE: &str = "ffn_gate.weight";
    pub const FFN_UP: &str = "ffn_up.weight";
    pub const FFN_DOWN: &str = "ffn_down.weight";

    /// Mixture-of-experts suffixes: the router `[num_experts, hidden]` and the experts' gate,
    /// up and down projections stacked expert by expert, `[num_experts, out, in]`.
    pub const FFN_GATE_INP: &str = "ffn_gate_inp.weight";
    pub const FFN_GATE_EXPS: &str = "ffn_gate_exps.weight";
    pub const FFN_UP_EXPS: &str = "ffn_up_exps.weight";
    pub const FFN_DOWN_EXPS: &str = "ffn_down_exps.weight";
    // DeepSeek's latent attention (llama.cpp's `deepseek2` names).
    /// `[num_heads * q_head_dim, hidden]` with no query compression is [`ATTN_Q`]; else:
    /// `[q_lora_rank, hidden]`.
    pub const ATTN_Q_A: &str = "attn_q_a.weight";
    /// `[q_lora_rank]`.
    pub const ATTN_Q_A_NORM: &str = "attn_q_a_norm.weight";
    /// `[num_heads * q_head_dim, q_lora_rank]`.
    pub const ATTN_Q_B: &str = "attn_q_b.weight";
    /// `[kv_lora_rank + qk_rope_head_dim, hidden]`.
    pub const ATTN_KV_A_MQA: &str = "attn_kv_a_mqa.weight";
    /// `[kv_lora_rank]`.
    pub const ATTN_KV_A_NORM: &str = "attn_kv_a_norm.weight";
    /// `[num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]` (HF's `kv_b_proj`, older
    /// GGUF files).
    pub const ATTN_KV_B: &str = "attn_kv_b.weight";
    /// `[num_heads, kv_lora_rank, qk_nope_head_dim]`: `kv_b`'s key rows per head, transposed
    /// (GGUF files since llama.cpp's MLA change).
    pub const ATTN_K_B: &str = "attn_k_b.weight";
    /// `[num_heads, v_head_dim, kv_lora_rank]`: `kv_b`'s value rows per head.
    pub const ATTN_V_B: &str = "attn_v_b.weight";
    /// `[num_experts]`: DeepSeek-V3's expert selection bias.
    pub const FFN_EXP_PROBS_B: &str = "exp_probs_b.bias";
    /// The shared experts' MLP: `[shared_width, hidden]`.
    pub const FFN_GATE_SHEXP: &str = "ffn_gate_shexp.weight";
    /// `[shared_width, hidden]`.
    pub const FFN_UP_SHEXP: &str = "ffn_up_shexp.weight";
    /// `[hidden, shared_width]`.
    pub const FFN_DOWN_SHEXP: &str = "ffn_down_shexp.weight";
    // DeepSeek-V3.2's sparse-attention indexer (HF `self_attn.indexer.*`).
    /// `[index_n_heads * index_head_dim, q_lora_rank]` (`wq_b`).
    pub const INDEXER_ATTN_Q_B: &str = "indexer.attn_q_b.weight";
    /// `[index_head_dim, hidden]` (`wk`).
    pub const INDEXER_ATTN_K: &str = "indexer.attn_k.weight";
    /// `[index_head_dim]`: the key's LayerNorm weight and bias (`k_norm`).
    pub const INDEXER_K_NORM: &str = "indexer.k_norm.weight";
    pub const INDEXER_K_NORM_BIAS: &str = "indexer.k_norm.bias";
    /// `[index_n_heads, hidden]` (`weights_proj`).
    pub const INDEXER_PROJ: &str = "indexer.proj.weight";
}
