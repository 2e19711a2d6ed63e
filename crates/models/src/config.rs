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
}

impl Architecture {
    /// The GGUF `general.architecture` / HF `model_type` spelling.
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
        }
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
}

impl ModelConfig {
    /// Query heads per KV head.
    pub fn group_size(&self) -> usize {
        self.num_attention_heads / self.num_kv_heads
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
        Ok(())
    }
}

/// A model configuration the forward pass cannot run ([`ModelConfig::validate`]); the message
/// names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidModelConfig(pub String);
