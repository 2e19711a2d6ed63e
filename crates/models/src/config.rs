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
    /// DeepSeek-V2, V2-Lite, V3 and V3.2 (GGUF `deepseek2`): multi-head latent attention
    /// ([`MlaConfig`]) and mixture-of-experts blocks with shared experts after leading dense
    /// layers.
    DeepSeek2,
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
            Architecture::DeepSeek2 => "deepseek2",
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

/// How the router scores experts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExpertScoring {
    /// The softmax over every expert (Qwen3-MoE, Mixtral, DeepSeek-V2).
    #[default]
    Softmax,
    /// Each expert's sigmoid (DeepSeek-V3, `scoring_func: sigmoid`).
    Sigmoid,
}

/// How an expert group ranks under group-limited routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GroupScoring {
    /// Its best expert's score (DeepSeek-V2's `group_limited_greedy`).
    Max,
    /// The sum of its two best selection scores, bias included (DeepSeek-V3's `noaux_tc`).
    TopTwoSum,
}

/// Group-limited routing (DeepSeek): experts in `num_groups` equal groups, each row picks
/// its top-k among the experts of its `groups_per_token` best groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertGroupLimit {
    /// `n_group`.
    pub num_groups: usize,
    /// `topk_group`.
    pub groups_per_token: usize,
    /// How a group ranks.
    pub score: GroupScoring,
}

/// The mixture-of-experts MLP blocks of a model: each row's `experts_per_token` best experts
/// by router score (ties: the lower expert index), each a SiLU-gated MLP of
/// `expert_intermediate_size`, summed with the router's weights, plus the shared experts'
/// dense MLP where the model has them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// How logits become scores.
    #[serde(default)]
    pub scoring: ExpertScoring,
    /// Multiplies every routed weight, after any renormalisation (`routed_scaling_factor`,
    /// GGUF's `expert_weights_scale`).
    #[serde(default = "one")]
    pub routed_scaling_factor: f32,
    /// Group-limited routing, if any.
    #[serde(default)]
    pub group_limit: Option<ExpertGroupLimit>,
    /// Whether each MoE layer has a per-expert selection bias (DeepSeek-V3's
    /// `e_score_correction_bias`, GGUF's `exp_probs_b`), used to choose experts, not to weigh
    /// them. Sigmoid scoring only.
    #[serde(default)]
    pub selection_bias: bool,
    /// Shared experts: one dense SiLU-gated MLP of `num_shared_experts *
    /// expert_intermediate_size` every row goes through, added to the routed sum (DeepSeek).
    #[serde(default)]
    pub num_shared_experts: usize,
}

fn one() -> f32 {
    1.0
}

impl Default for MoeConfig {
    /// No experts, softmax scoring, weights as they are: a base for struct updates.
    fn default() -> Self {
        MoeConfig {
            num_experts: 0,
            experts_per_token: 0,
            expert_intermediate_size: 0,
            top_k_weights: TopKWeights::Normalized,
            dense_layers: Vec::new(),
            scoring: ExpertScoring::Softmax,
            routed_scaling_factor: 1.0,
            group_limit: None,
            selection_bias: false,
            num_shared_experts: 0,
        }
    }
}

/// DeepSeek's YaRN RoPE scaling (`rope_scaling.type: yarn`): per-pair frequencies blended
/// between interpolated (`/ factor`) and original by a linear ramp over the correction range
/// of `beta_fast`/`beta_slow` rotations, the rotated values scaled by
/// `mscale(factor, mscale) / mscale(factor, mscale_all_dim)`, and the softmax scale by
/// `mscale(factor, mscale_all_dim)^2`, where `mscale(s, m) = 0.1 * m * ln(s) + 1` (1 for
/// `s <= 1`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct YarnScaling {
    /// Context extension factor (`factor`; 40 in V2/V3).
    pub factor: f32,
    /// The context the model was trained on before the extension.
    pub original_max_position_embeddings: u32,
    /// Rotations bounding the ramp at the high-frequency end (32).
    pub beta_fast: f32,
    /// Rotations bounding the ramp at the low-frequency end (1).
    pub beta_slow: f32,
    /// The rotation's magnitude coefficient (`mscale`).
    pub mscale: f32,
    /// The softmax scale's coefficient, also dividing the rotation's (`mscale_all_dim`; 0
    /// leaves both alone).
    pub mscale_all_dim: f32,
}

impl YarnScaling {
    /// `0.1 * mscale * ln(factor) + 1`, or 1 when `factor <= 1`.
    pub fn mscale_of(&self, mscale: f32) -> f32 {
        if self.factor <= 1.0 {
            1.0
        } else {
            0.1 * mscale * self.factor.ln() + 1.0
        }
    }

    /// Per-pair divisors of the base frequencies (`rope_dim / 2` of them, what
    /// `pagoda_ops::rope::Rope::new` takes): 1 where the ramp keeps the original
    /// frequency, `factor` where it interpolates fully.
    pub fn frequency_factors(&self, base: f32, rope_dim: usize) -> Vec<f32> {
        let (dim, base) = (rope_dim as f64, base as f64);
        let max_positions = self.original_max_position_embeddings as f64;
        let correction_dim = |rotations: f64| {
            dim * (max_positions / (rotations * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * base.ln())
        };
        let low = correction_dim(self.beta_fast as f64).floor().max(0.0);
        let high = correction_dim(self.beta_slow as f64).ceil().min(dim - 1.0);
        let high = if low == high { high + 0.001 } else { high };
        (0..rope_dim / 2)
            .map(|i| {
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                // The share of the original frequency kept.
                let extrapolation = 1.0 - ramp;
                let inverse = (1.0 - extrapolation) / self.factor as f64 + extrapolation;
                (1.0 / inverse) as f32
            })
            .collect()
    }
}

/// Multi-head latent attention (DeepSeek-V2/V3). Per token, `kv_lora_rank` latent values
/// (after their RMSNorm) and one shared `qk_rope_head_dim` RoPE key are cached; each head's
/// key is `[W_UK_h c, k_rope]` (`qk_nope_head_dim + qk_rope_head_dim`) and its value
/// `W_UV_h c` (`v_head_dim`). The query is projected directly (`q_lora_rank` none) or
/// through a `q_lora_rank` bottleneck with its own RMSNorm. V3.2 adds the sparse-attention
/// [`IndexerConfig`], whose key is cached after the latent row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MlaConfig {
    /// The query bottleneck's width; `None` projects the query directly (V2-Lite).
    pub q_lora_rank: Option<usize>,
    /// The cached latent's width (512 in V2/V3).
    pub kv_lora_rank: usize,
    /// Each head's key/query part without RoPE (128).
    pub qk_nope_head_dim: usize,
    /// The rotated part, shared by every head's key (64).
    pub qk_rope_head_dim: usize,
    /// Each head's value width (128).
    pub v_head_dim: usize,
    /// YaRN scaling of the RoPE part, if any.
    pub yarn: Option<YarnScaling>,
    /// DeepSeek-V3.2's lightning indexer (sparse attention); `None` attends densely.
    #[serde(default)]
    pub indexer: Option<IndexerConfig>,
}

/// DeepSeek-V3.2's lightning indexer: per token an `head_dim` key (`LayerNorm(wk x)`), per
/// query `num_heads` heads of `head_dim` (`wq_b` of the compressed query) and their weights
/// (`weights_proj x`); the first `qk_rope_head_dim` dims of each rotate (rotate-half). A
/// query that sees more than `top_k` tokens attends to its `top_k` best-scored ones only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexerConfig {
    /// `index_n_heads` (64 in V3.2).
    pub num_heads: usize,
    /// `index_head_dim` (128), cached per token after the latent row.
    pub head_dim: usize,
    /// `index_topk` (2048).
    pub top_k: usize,
}

impl MlaConfig {
    /// The eps of the latent RMSNorms (`q_a_layernorm`, `kv_a_layernorm`): their modules'
    /// default in DeepSeek's and transformers' code, whatever `rms_norm_eps` says (llama.cpp
    /// uses `rms_norm_eps`; every released DeepSeek config has 1e-6 there too).
    pub const LATENT_NORM_EPS: f32 = 1e-6;

    /// A query (and expanded key) head's width, `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn q_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// The latent row of a token, `kv_lora_rank + qk_rope_head_dim`: `kv_a`'s output and the
    /// absorbed query's width.
    pub fn latent_row(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    /// One cached row per token: the latent row, then the indexer key where the model has
    /// one (V3.2: `+ index_head_dim`).
    pub fn cache_row(&self) -> usize {
        self.latent_row() + self.indexer.map_or(0, |indexer| indexer.head_dim)
    }

    /// The softmax scale: `1 / sqrt(q_head_dim)`, times `mscale(factor, mscale_all_dim)^2`
    /// under YaRN.
    pub fn softmax_scale(&self) -> f32 {
        let base = 1.0 / (self.q_head_dim() as f32).sqrt();
        match &self.yarn {
            Some(yarn) => {
                let m = yarn.mscale_of(yarn.mscale_all_dim);
                base * m * m
            }
            None => base,
        }
    }

    /// What the rotated q and k values are multiplied by (YaRN's cos/sin scale; 1 without
    /// YaRN, and in every released DeepSeek config, whose `mscale` equals `mscale_all_dim`).
    pub fn rope_scale(&self) -> f32 {
        match &self.yarn {
            Some(yarn) => yarn.mscale_of(yarn.mscale) / yarn.mscale_of(yarn.mscale_all_dim),
            None => 1.0,
        }
    }
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
    /// Multi-head latent attention (DeepSeek); `None` for grouped-query attention. With it,
    /// `num_kv_heads` is 1 and `head_dim` is the cached row (`kv_lora_rank +
    /// qk_rope_head_dim`): the KV cache holds one latent row per token and no V.
    #[serde(default)]
    pub mla: Option<MlaConfig>,
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

    /// Whether any layer's MLP block is a mixture of experts (a DeepSeek configuration whose
    /// `dense_layers` list every layer has none).
    pub fn has_expert_layers(&self) -> bool {
        (0..self.num_layers).any(|layer| self.is_moe_layer(layer))
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
        self.validate_mla()?;
        let moe_architecture = matches!(
            self.architecture,
            Architecture::Qwen3Moe | Architecture::Mixtral | Architecture::DeepSeek2
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

impl ModelConfig {
    fn validate_mla(&self) -> Result<(), InvalidModelConfig> {
        let fail = |what: String| Err(InvalidModelConfig(what));
        let mla = match (&self.mla, self.architecture) {
            (None, Architecture::DeepSeek2) => {
                return fail(
                    "architecture deepseek2 needs its latent attention settings (kv_lora_rank)"
                        .into(),
                )
            }
            (None, _) => return Ok(()),
            (Some(_), architecture) if architecture != Architecture::DeepSeek2 => {
                return fail(format!(
                    "architecture {} has no latent attention",
                    architecture.name()
                ))
            }
            (Some(mla), _) => mla,
        };
        let dims = [
            ("kv_lora_rank", mla.kv_lora_rank),
            ("qk_nope_head_dim", mla.qk_nope_head_dim),
            ("qk_rope_head_dim", mla.qk_rope_head_dim),
            ("v_head_dim", mla.v_head_dim),
            ("q_lora_rank", mla.q_lora_rank.unwrap_or(1)),
        ];
        if let Some((name, _)) = dims.iter().find(|(_, value)| *value == 0) {
            return fail(format!("{name} must be positive"));
        }
        if self.num_kv_heads != 1
            || self.head_dim != mla.cache_row()
            || self.rope_dim != mla.qk_rope_head_dim
        {
            return fail(format!(
                "latent attention caches one row of kv_lora_rank + qk_rope_head_dim (+ index_head_dim) ({}) per token: num_kv_heads must be 1, head_dim {} and rope_dim {} (got {}, {}, {})",
                mla.cache_row(),
                mla.cache_row(),
                mla.qk_rope_head_dim,
                self.num_kv_heads,
                self.head_dim,
                self.rope_dim
            ));
        }
        if let Some(indexer) = &mla.indexer {
            if indexer.num_heads == 0 || indexer.top_k == 0 {
                return fail(format!(
                    "index_n_heads ({}) and index_topk ({}) must be positive",
                    indexer.num_heads, indexer.top_k
                ));
            }
            if indexer.head_dim < mla.qk_rope_head_dim {
                return fail(format!(
                    "index_head_dim ({}) must be at least qk_rope_head_dim ({}): the indexer rotates its first qk_rope_head_dim dims",
                    indexer.head_dim, mla.qk_rope_head_dim
                ));
            }
            if mla.q_lora_rank.is_none() {
                return fail(
                    "the sparse-attention indexer (index_topk) needs q_lora_rank: its query reads the compressed query".into(),
                );
            }
        }
        if let Some(yarn) = &mla.yarn {
            let values = [yarn.factor, yarn.beta_fast, yarn.beta_slow];
            if values.iter().any(|v| !v.is_finite() || *v <= 0.0)
                || yarn.original_max_position_embeddings == 0
                || !yarn.mscale.is_finite()
                || !yarn.mscale_all_dim.is_finite()
            {
                return fail(format!(
                    "yarn rope scaling {yarn:?} has a non-positive or non-finite value"
                ));
            }
        }
        Ok(())
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
        if !self.routed_scaling_factor.is_finite() || self.routed_scaling_factor <= 0.0 {
            return Err(InvalidModelConfig(format!(
                "routed_scaling_factor {} must be positive",
                self.routed_scaling_factor
            )));
        }
        if self.selection_bias && self.scoring != ExpertScoring::Sigmoid {
            return Err(InvalidModelConfig(
                "an expert selection bias (e_score_correction_bias, exp_probs_b) needs sigmoid scoring".into(),
            ));
        }
        if let Some(limit) = &self.group_limit {
            let fits = limit.num_groups >= 1
                && self.num_experts.is_multiple_of(limit.num_groups)
                && (1..=limit.num_groups).contains(&limit.groups_per_token)
                && limit.groups_per_token * (self.num_experts / limit.num_groups)
                    >= self.experts_per_token;
            if !fits {
                return Err(InvalidModelConfig(format!(
                    "expert groups: n_group {} must divide num_experts {}, and topk_group {} (1..=n_group) groups must hold at least experts_per_token {} experts",
                    limit.num_groups, self.num_experts, limit.groups_per_token, self.experts_per_token
                )));
            }
            if limit.score == GroupScoring::TopTwoSum && self.scoring != ExpertScoring::Sigmoid {
                return Err(InvalidModelConfig(
                    "noaux_tc group scores (top-two sums) need sigmoid scoring".into(),
                ));
            }
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
