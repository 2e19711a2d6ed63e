//! The architecture-independent description of a model's shapes and numerics.
//!
//! Both loaders (GGUF metadata and Hugging Face `config.json`) resolve into one
//! [`ModelConfig`]; the forward pass reads nothing else.

use serde::{Deserialize, Serialize};

/// Supported architecture families.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Architecture {
    /// Llama 2/3, SmolLM/SmolLM2, Mistral (no biases, no q/k norm).
    Llama,
    /// Qwen2/Qwen2.5: bias on the q, k and v projections.
    Qwen2,
    /// Qwen3: RMSNorm on q and k per head before RoPE, no biases.
    Qwen3,
    /// Qwen3-MoE: Qwen3's attention with mixture-of-experts MLP blocks ([`MoeConfig`]).
    Qwen3Moe,
    /// Mixtral: llama's attention with mixture-of-experts MLP blocks in every layer (GGUF
    /// stores it as `llama` with `llama.expert_count`).
    Mixtral,
}

impl Architecture {
    /// The GGUF `general.architecture` / HF `model_type` spelling.
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Qwen3Moe => "qwen3moe",
            Architecture::Mixtral => "mixtral",
        }
    }

    /// Whether the layers normalise q and k per head before RoPE (Qwen3's q/k norm).
    pub fn has_qk_norm(self) -> bool {
        matches!(self, Architecture::Qwen3 | Architecture::Qwen3Moe)
    }
}

/// How the router weighs the `experts_per_token` experts it picks for a row, from the softmax
/// of the row's router logits over every expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TopKWeights {
    /// The picked experts' softmax probabilities as they are; they sum to less than 1
    /// (Qwen3-MoE with `norm_topk_prob: false`).
    Softmax,
    /// The picked experts' probabilities divided by their sum, which is the softmax over the
    /// picked logits alone (Mixtral; Qwen3-MoE with `norm_topk_prob: true`, as in every GGUF
    /// `qwen3moe` file).
    Normalized,
}

/// The mixture-of-experts MLP blocks of a model: each row's `experts_per_token` best experts
/// by router logit (ties: the lower expert index), each a SiLU-gated MLP of
/// `expert_intermediate_size`, summed with the router's weights.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Experts per MoE layer.
    pub num_experts: usize,
    /// Experts each row is routed to (top-k).
    pub experts_per_token: usize,
    /// Intermediate width of one expert's MLP.
    pub expert_intermediate_size: usize,
    /// How the picked experts are weighed.
    pub top_k_weights: TopKWeights,
    /// Layers whose MLP block is dense ([`ModelConfig::intermediate_size`] wide), ascending
    /// (Qwen3-MoE's `mlp_only_layers` and `decoder_sparse_step`); every other layer is MoE.
    pub dense_layers: Vec<usize>,
}

impl MoeConfig {
    /// Whether layer `layer`'s MLP block is a mixture of experts.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.dense_layers.binary_search(&layer).is_err()
    }
}

/// How RoPE pairs the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RopeStyle {
    /// Rotates adjacent pairs `(2i, 2i+1)`: GGUF llama-family weights (llama.cpp's
    /// `convert_hf_to_gguf` permutes the q/k rows so this matches HF's rotate-half).
    Interleaved,
    /// Rotates `(i, i + d/2)` (GPT-NeoX, HF's `rotate_half`): HF llama checkpoints and Qwen.
    Halves,
}

/// Llama 3 frequency scaling (`rope_scaling.rope_type == "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Llama3RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: u32,
}

/// Shapes and numerics of a decoder-only transformer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_attention_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    /// Number of leading dims of each head that RoPE rotates (usually `head_dim`).
    pub rope_dim: usize,
    pub rope_style: RopeStyle,
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Longest context the model was trained for.
    pub max_position_embeddings: usize,
    /// The LM head reuses the token embedding.
    pub tie_word_embeddings: bool,
    /// The mixture-of-experts blocks; `None` for a dense model.
    #[serde(default)]
    pub moe: Option<MoeConfig>,
}

impl ModelConfig {
    /// Query heads per KV head.
    pub fn group_size(&self) -> usize {
        self.num_attention_heads / self.num_kv_heads
    }

    /// Whether layer `layer`'s MLP block is a mixture of experts.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|moe| moe.is_moe_layer(layer))
    }

    /// Checks the shape relations the forward pass relies on; the error names the field.
    pub fn validate(&self) -> Result<(), InvalidModelConfig> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("num_layers", self.num_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.intermediate_size),
            ("vocab_size", self.vocab_size),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(InvalidModelConfig(format!("{name} must be positive")));
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_kv_heads) {
            return Err(InvalidModelConfig(format!(
                "num_attention_heads ({}) is not a multiple of num_kv_heads ({})",
                self.num_attention_heads, self.num_kv_heads
            )));
        }
        if self.rope_dim > self.head_dim || !self.rope_dim.is_multiple_of(2) {
            return Err(InvalidModelConfig(format!(
                "rope dimension {} must be even and at most head_dim {}",
                self.rope_dim, self.head_dim
            )));
        }
        if self.rms_norm_eps.is_nan()
            || self.rms_norm_eps <= 0.0
            || self.rope_theta.is_nan()
            || self.rope_theta <= 0.0
        {
            return Err(InvalidModelConfig(
                "rms_norm_eps and rope_theta must be positive".into(),
            ));
        }
        let moe_architecture = matches!(
            self.architecture,
            Architecture::Qwen3Moe | Architecture::Mixtral
        );
        match &self.moe {
            None if moe_architecture => Err(InvalidModelConfig(format!(
                "architecture {} needs its mixture-of-experts settings (num_experts)",
                self.architecture.name()
            ))),
            None => Ok(()),
            Some(_) if !moe_architecture => Err(InvalidModelConfig(format!(
                "architecture {} has no mixture-of-experts layers",
                self.architecture.name()
            ))),
            Some(moe) => moe.validate(self.num_layers),
        }
    }
}

impl MoeConfig {
    fn validate(&self, num_layers: usize) -> Result<(), InvalidModelConfig> {
        if self.num_experts == 0 || self.expert_intermediate_size == 0 {
            return Err(InvalidModelConfig(
                "num_experts and expert_intermediate_size must be positive".into(),
            ));
        }
        if self.experts_per_token == 0 || self.experts_per_token > self.num_experts {
            return Err(InvalidModelConfig(format!(
                "experts_per_token ({}) must be between 1 and num_experts ({})",
                self.experts_per_token, self.num_experts
            )));
        }
        if !self.dense_layers.is_sorted_by(|a, b| a < b)
            || self.dense_layers.last().is_some_and(|&l| l >= num_layers)
        {
            return Err(InvalidModelConfig(format!(
                "dense_layers {:?} must be ascending layer indices below num_layers ({num_layers})",
                self.dense_layers
            )));
        }
        Ok(())
    }
}

/// A model configuration the forward pass cannot run ([`ModelConfig::validate`]); the message
/// names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidModelConfig(pub String);
