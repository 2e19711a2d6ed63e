//! Random weights of a real architecture's shapes, for benchmarks of models whose weights
//! cannot be had on the machine (throughput does not depend on the weight values).
//!
//! [`preset`] names the built-in configurations (`llama-3.1-8b`, `qwen2.5-7b`,
//! `smollm2-135m`, the mixture-of-experts `qwen3-30b-a3b` and `mixtral-8x7b`, and the tiny
//! `qwen3-moe-tiny` and `mixtral-tiny` for tests, DeepSeek's `deepseek-v2-lite` and the tiny
//! `deepseek-v2-tiny`, `deepseek-v3-tiny` and `deepseek-v32-tiny`); [`random_config`] also accepts the path of a
//! Hugging Face `config.json`. A spec may end in a format, `llama-3.1-8b:fp8`
//! ([`random_format`]): the dense projections as FP8 (e4m3) with a factor per row ([`fp8`]).
//! [`RandomWeights`] is a [`TensorSource`] with every tensor the llama-family loader asks for,
//! filled deterministically from a seed, in f32, one tensor at a time as the loader asks.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use pagoda_tensor::GgmlType;
use rayon::prelude::*;

use crate::config::{
    Architecture, Llama3RopeScaling, ModelConfig, MoeConfig, RopeStyle, TopKWeights,
};
use crate::hf::{config_from_hf_json, deepseek_layer_tensors};
use crate::llama::LoadError;
use crate::weights::{names, Fp8Rows, RawTensor, TensorSource};

/// Names accepted by [`preset`], for error messages and `--help`.
pub const PRESET_NAMES: &[&str] = &[
    "llama-3.1-8b",
    "qwen2.5-7b",
    "smollm2-135m",
    "qwen3-30b-a3b",
    "mixtral-8x7b",
    "qwen3-moe-tiny",
    "mixtral-tiny",
    "deepseek-v2-lite",
    "deepseek-v2-tiny",
    "deepseek-v3-tiny",
    "deepseek-v32-tiny",
    "deepseek-mla-dense-tiny",
];

mod deepseek;
pub mod fp8;

pub use fp8::RandomFormat;

/// The configuration of a built-in architecture preset, by name (case-insensitive).
pub fn preset(name: &str) -> Option<ModelConfig> {
    let config = match name.to_ascii_lowercase().as_str() {
        "llama-3.1-8b" | "llama3.1-8b" => ModelConfig {
            architecture: Architecture::Llama,
            hidden_size: 4096,
            num_layers: 32,
            num_attention_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            intermediate_size: 14336,
            vocab_size: 128256,
            rms_norm_eps: 1e-5,
            rope_theta: 500000.0,
            rope_dim: 128,
            rope_style: RopeStyle::Halves,
            rope_scaling: Some(Llama3RopeScaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            }),
            max_position_embeddings: 131072,
            tie_word_embeddings: false,
            moe: None,
            mla: None,
        },
        "qwen2.5-7b" => ModelConfig {
            architecture: Architecture::Qwen2,
            hidden_size: 3584,
            num_layers: 28,
            num_attention_heads: 28,
            num_kv_heads: 4,
            head_dim: 128,
            intermediate_size: 18944,
            vocab_size: 152064,
            rms_norm_eps: 1e-6,
            rope_theta: 1000000.0,
            rope_dim: 128,
            rope_style: RopeStyle::Halves,
            rope_scaling: None,
            max_position_embeddings: 32768,
            tie_word_embeddings: false,
            moe: None,
            mla: None,
        },
        "smollm2-135m" => ModelConfig {
            architecture: Architecture::Llama,
            hidden_size: 576,
            num_layers: 30,
            num_attention_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            intermediate_size: 1536,
            vocab_size: 49152,
            rms_norm_eps: 1e-5,
            rope_theta: 100000.0,
            rope_dim: 64,
            rope_style: RopeStyle::Halves,
            rope_scaling: None,
            max_position_embeddings: 8192,
            tie_word_embeddings: true,
            moe: None,
            mla: None,
        },
        // 30.5B parameters, 3.3B active per token.
        "qwen3-30b-a3b" => ModelConfig {
            architecture: Architecture::Qwen3Moe,
            hidden_size: 2048,
            num_layers: 48,
            num_attention_heads: 32,
            num_kv_heads: 4,
            head_dim: 128,
            intermediate_size: 6144,
            vocab_size: 151936,
            rms_norm_eps: 1e-6,
            rope_theta: 1000000.0,
            rope_dim: 128,
            rope_style: RopeStyle::Halves,
            rope_scaling: None,
            max_position_embeddings: 40960,
            tie_word_embeddings: false,
            moe: Some(MoeConfig {
                num_experts: 128,
                experts_per_token: 8,
                expert_intermediate_size: 768,
                top_k_weights: TopKWeights::Normalized,
                dense_layers: Vec::new(),
                ..MoeConfig::default()
            }),
            mla: None,
        },
        // 46.7B parameters, 12.9B active per token.
        "mixtral-8x7b" => ModelConfig {
            architecture: Architecture::Mixtral,
            hidden_size: 4096,
            num_layers: 32,
            num_attention_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            intermediate_size: 14336,
            vocab_size: 32000,
            rms_norm_eps: 1e-5,
            rope_theta: 1000000.0,
            rope_dim: 128,
            rope_style: RopeStyle::Halves,
            rope_scaling: None,
            max_position_embeddings: 32768,
            tie_word_embeddings: false,
            moe: Some(MoeConfig {
                num_experts: 8,
                experts_per_token: 2,
                expert_intermediate_size: 14336,
                top_k_weights: TopKWeights::Normalized,
                dense_layers: Vec::new(),
                ..MoeConfig::default()
            }),
            mla: None,
        },
        // Tests: a dense layer between two MoE layers, softmax weights not renormalised.
        "qwen3-moe-tiny" => ModelConfig {
            architecture: Architecture::Qwen3Moe,
            hidden_size: 64,
            num_layers: 3,
            num_attention_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            intermediate_size: 96,
            vocab_size: 512,
            rms_norm_eps: 1e-6,
            rope_theta: 1000000.0,
            rope_dim: 16,
            rope_style: RopeStyle::Halves,
            rope_scaling: None,
            max_position_embeddings: 4096,
            tie_word_embeddings: false,
            moe: Some(MoeConfig {
                num_experts: 8,
                experts_per_token: 3,
                expert_intermediate_size: 32,
                top_k_weights: TopKWeights::Softmax,
                dense_layers: vec![1],
                ..MoeConfig::default()
            }),
            mla: None,
        },
        "mixtral-tiny" => ModelConfig {
            architecture: Architecture::Mixtral,
            hidden_size: 64,
            num_layers: 2,
            num_attention_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            intermediate_size: 64,
            vocab_size: 512,
            rms_norm_eps: 1e-5,
            rope_theta: 1000000.0,
            rope_dim: 16,
            rope_style: RopeStyle::Halves,
            rope_scaling: None,
            max_position_embeddings: 4096,
            tie_word_embeddings: false,
            moe: Some(MoeConfig {
                num_experts: 4,
                experts_per_token: 2,
                expert_intermediate_size: 64,
                top_k_weights: TopKWeights::Normalized,
                dense_layers: Vec::new(),
                ..MoeConfig::default()
            }),
            mla: None,
        },
        other => return deepseek::preset(other),
    };
    Some(config)
}

/// A preset name, or the path of a Hugging Face `config.json`, with an optional format suffix
/// (`:fp8`, [`random_format`]).
pub fn random_config(spec: &str) -> Result<ModelConfig, LoadError> {
    let (spec, _) = random_spec(spec)?;
    read_random_config(spec).map_err(LoadError)
}

/// The format a spec's suffix names: `llama-3.1-8b:fp8` is [`RandomFormat::Fp8`], no suffix
/// (or `:f32`) [`RandomFormat::F32`]; another suffix is an error that names the fix.
pub fn random_format(spec: &str) -> Result<RandomFormat, LoadError> {
    random_spec(spec).map(|(_, format)| format)
}

/// `spec` without its format suffix (any case of `:fp8`, `:fp8_e4m3` or `:f32`), and the
/// format ([`random_format`]).
pub fn random_spec(spec: &str) -> Result<(&str, RandomFormat), LoadError> {
    fp8::split_spec(spec, |s| preset(s).is_some() || Path::new(s).is_file()).map_err(LoadError)
}

fn read_random_config(spec: &str) -> Result<ModelConfig, String> {
    if let Some(config) = preset(spec) {
        return Ok(config);
    }
    let path = Path::new(spec);
    if path.is_file() {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let config = config_from_hf_json(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        config.validate().map_err(|e| e.to_string())?;
        return Ok(config);
    }
    Err(format!(
        "'{spec}' is neither a built-in configuration ({}) nor a config.json file \
         (either may end in `:fp8`)",
        PRESET_NAMES.join(", ")
    ))
}

/// Every tensor the llama-family loader reads for `config`, with its row-major shape
/// (outermost first). Norm weights are vectors; projections are `[out, in]`.
pub fn tensor_shapes(config: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let c = config;
    let q_dim = c.num_attention_heads * c.head_dim;
    let kv_dim = c.num_kv_heads * c.head_dim;
    let mut shapes = vec![
        (
            names::TOKEN_EMBEDDING.to_string(),
            vec![c.vocab_size, c.hidden_size],
        ),
        (names::OUTPUT_NORM.to_string(), vec![c.hidden_size]),
    ];
    if !c.tie_word_embeddings {
        shapes.push((names::OUTPUT.to_string(), vec![c.vocab_size, c.hidden_size]));
    }
    for layer in 0..c.num_layers {
        if c.mla.is_some() {
            shapes.extend(deepseek_layer_tensors(c, layer));
            continue;
        }
        let n = |suffix: &str| names::layer(layer, suffix);
        shapes.push((n(names::ATTN_NORM), vec![c.hidden_size]));
        shapes.push((n(names::ATTN_Q), vec![q_dim, c.hidden_size]));
        shapes.push((n(names::ATTN_K), vec![kv_dim, c.hidden_size]));
        shapes.push((n(names::ATTN_V), vec![kv_dim, c.hidden_size]));
        if c.architecture == Architecture::Qwen2 {
            shapes.push((n(names::ATTN_Q_BIAS), vec![q_dim]));
            shapes.push((n(names::ATTN_K_BIAS), vec![kv_dim]));
            shapes.push((n(names::ATTN_V_BIAS), vec![kv_dim]));
        }
        if c.architecture.has_qk_norm() {
            shapes.push((n(names::ATTN_Q_NORM), vec![c.head_dim]));
            shapes.push((n(names::ATTN_K_NORM), vec![c.head_dim]));
        }
        shapes.push((n(names::ATTN_OUTPUT), vec![c.hidden_size, q_dim]));
        shapes.push((n(names::FFN_NORM), vec![c.hidden_size]));
        match &c.moe {
            Some(moe) if moe.is_moe_layer(layer) => {
                let (experts, width) = (moe.num_experts, moe.expert_intermediate_size);
                shapes.push((n(names::FFN_GATE_INP), vec![experts, c.hidden_size]));
                shapes.push((n(names::FFN_GATE_EXPS), vec![experts, width, c.hidden_size]));
                shapes.push((n(names::FFN_UP_EXPS), vec![experts, width, c.hidden_size]));
                shapes.push((n(names::FFN_DOWN_EXPS), vec![experts, c.hidden_size, width]));
            }
            _ => {
                let width = c.intermediate_size;
                shapes.push((n(names::FFN_GATE), vec![width, c.hidden_size]));
                shapes.push((n(names::FFN_UP), vec![width, c.hidden_size]));
                shapes.push((n(names::FFN_DOWN), vec![c.hidden_size, width]));
            }
        }
    }
    shapes
}

/// Bytes of f32 host memory [`RandomWeights::new`] would allocate for `config`.
pub fn random_weights_bytes(config: &ModelConfig) -> usize {
    tensor_shapes(config)
        .iter()
        .map(|(_, shape)| shape.iter().product::<usize>() * 4)
        .sum()
}

/// Deterministic random f32 weights for every tensor of `config`, generated on demand (each
/// [`TensorSource::tensor`] call fills one tensor, in parallel), so a large configuration
/// never needs all its weights in host memory at once.
///
/// Values: norm weights are 1 plus noise of 0.1; biases noise of 0.02; matrices uniform in
/// `±1/sqrt(in_features)`, so activations keep their scale through the layers and logits stay
/// finite (the text is meaningless; the shapes and the work are real). Element `i` of tensor
/// `t` is a pure function of `(seed, t, i)`. In [`RandomFormat::Fp8`]
/// ([`RandomWeights::with_format`]) the dense projections are those values quantized to
/// e4m3 with a factor per row: [`TensorSource::fp8_rows`] serves the codes and
/// [`TensorSource::tensor`] the values they stand for, in f32 (as the safetensors loader
/// serves an FP8 checkpoint).
pub struct RandomWeights {
    seed: u64,
    shapes: HashMap<String, (usize, Vec<usize>)>,
    format: RandomFormat,
}

impl RandomWeights {
    /// Weights of `config` drawn from `seed`. `max_bytes` bounds what one consumer will hold
    /// in f32 (the CPU model keeps every tensor): a configuration over it is refused with a
    /// message that names the size.
    pub fn new(config: &ModelConfig, seed: u64, max_bytes: usize) -> Result<Self, LoadError> {
        config.validate().map_err(|e| LoadError(e.to_string()))?;
        let bytes = random_weights_bytes(config);
        if bytes > max_bytes {
            return Err(LoadError(format!(
                "random f32 weights for this configuration need {:.1} GiB of memory, over the limit of {:.1} GiB",
                bytes as f64 / (1u64 << 30) as f64,
                max_bytes as f64 / (1u64 << 30) as f64
            )));
        }
        let shapes = tensor_shapes(config)
            .into_iter()
            .enumerate()
            .map(|(index, (name, shape))| (name, (index, shape)))
            .collect();
        Ok(RandomWeights {
            seed,
            shapes,
            format: RandomFormat::F32,
        })
    }

    /// These weights with the dense projections in `format`.
    pub fn with_format(self, format: RandomFormat) -> Self {
        RandomWeights { format, ..self }
    }

    /// The format of the dense projections.
    pub fn format(&self) -> RandomFormat {
        self.format
    }

    /// The FP8 matrices ([`RandomFormat::Fp8`]): how many, and the bytes of their codes.
    pub fn fp8_matrices(&self) -> (usize, usize) {
        self.shapes
            .iter()
            .filter(|(name, (_, shape))| self.is_fp8(name, shape))
            .fold((0, 0), |(n, bytes), (_, (_, shape))| {
                (n + 1, bytes + shape.iter().product::<usize>())
            })
    }

    fn is_fp8(&self, name: &str, shape: &[usize]) -> bool {
        self.format == RandomFormat::Fp8 && fp8::is_fp8_projection(name, shape)
    }

    /// An FP8 matrix's codes, row factors and columns, made afresh from its f32 values.
    fn quantized(&self, name: &str) -> Option<(Vec<u8>, Vec<f32>, usize)> {
        let (index, shape) = self.shapes.get(name)?;
        if !self.is_fp8(name, shape) {
            return None;
        }
        let values: Vec<f32> = (self.generate(name, *index, shape))
            .par_chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let (codes, scales) = fp8::quantize(&values, shape[1]);
        Some((codes, scales, shape[1]))
    }

    fn generate(&self, name: &str, index: usize, shape: &[usize]) -> Vec<u8> {
        let count: usize = shape.iter().product();
        let is_norm = name.ends_with("norm.weight");
        let scale = if is_norm {
            0.1
        } else if name.ends_with(".bias") {
            0.02
        } else {
            1.0 / (*shape.last().unwrap_or(&1) as f32).sqrt()
        };
        let offset = if is_norm { 1.0 } else { 0.0 };
        let stream = splitmix64(self.seed ^ splitmix64(index as u64 + 1));
        let mut data = vec![0u8; count * 4];
        data.par_chunks_mut(4 * 4096)
            .enumerate()
            .for_each(|(chunk, bytes)| {
                for (i, value) in bytes.chunks_exact_mut(4).enumerate() {
                    let element = (chunk * 4096 + i) as u64;
                    let bits = splitmix64(stream ^ element.wrapping_mul(0x9e37_79b9_7f4a_7c15));
                    // 24 random bits -> uniform in [-1, 1).
                    let unit = (bits >> 40) as f32 * (2.0 / (1u64 << 24) as f32) - 1.0;
                    value.copy_from_slice(&(offset + unit * scale).to_le_bytes());
                }
            });
        data
    }
}

/// The splitmix64 finalizer: a fast, well-mixed 64-bit hash.
fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl TensorSource for RandomWeights {
    fn tensor(&self, name: &str) -> Option<RawTensor<'_>> {
        let (index, shape) = self.shapes.get(name)?;
        let data = match self.quantized(name) {
            Some((codes, scales, cols)) => fp8::dequantize(&codes, &scales, cols),
            None => self.generate(name, *index, shape),
        };
        Some(RawTensor {
            ty: GgmlType::F32,
            shape: shape.clone(),
            data: Cow::Owned(data),
        })
    }

    fn fp8_rows(&self, name: &str) -> Option<Fp8Rows<'_>> {
        let (codes, row_scales, _) = self.quantized(name)?;
        Some(Fp8Rows {
            codes: Cow::Owned(codes),
            row_scales,
        })
    }

    fn tensor_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.shapes.keys().cloned().collect();
        names.sort();
        names
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_validate_and_have_the_published_sizes() {
        for name in PRESET_NAMES {
            let config = preset(name).unwrap();
            config.validate().unwrap();
        }
        // Llama-3.1-8B has 8.03 billion parameters.
        let llama = preset("llama-3.1-8b").unwrap();
        let params: usize = tensor_shapes(&llama)
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum();
        assert!((8_000_000_000..8_100_000_000).contains(&params), "{params}");
        // Qwen2.5-7B has 7.62 billion.
        let qwen = preset("qwen2.5-7b").unwrap();
        let params: usize = tensor_shapes(&qwen)
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum();
        assert!((7_600_000_000..7_650_000_000).contains(&params), "{params}");
        // Qwen3-30B-A3B has 30.5 billion, Mixtral-8x7B 46.7 billion, DeepSeek-V2-Lite 15.7.
        for (name, range) in [
            ("qwen3-30b-a3b", 30_400_000_000..30_600_000_000usize),
            ("mixtral-8x7b", 46_600_000_000..46_800_000_000),
            ("deepseek-v2-lite", 15_600_000_000..15_800_000_000),
        ] {
            let params: usize = tensor_shapes(&preset(name).unwrap())
                .iter()
                .map(|(_, s)| s.iter().product::<usize>())
                .sum();
            assert!(range.contains(&params), "{name}: {params}");
        }
    }

    #[test]
    fn unknown_spec_names_the_presets() {
        let error = random_config("gpt-5").unwrap_err().to_string();
        assert!(error.contains("llama-3.1-8b"), "{error}");
    }

    #[test]
    fn random_weights_are_deterministic_and_bounded() {
        let config = preset("smollm2-135m").unwrap();
        let small = ModelConfig {
            num_layers: 2,
            vocab_size: 512,
            ..config
        };
        let a = RandomWeights::new(&small, 7, 1 << 30).unwrap();
        let b = RandomWeights::new(&small, 7, 1 << 30).unwrap();
        let name = names::layer(1, names::ATTN_Q);
        let data = a.tensor(&name).unwrap().data.into_owned();
        assert_eq!(data, b.tensor(&name).unwrap().data.into_owned());
        let values: Vec<f32> = data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let bound = 1.0 / (small.hidden_size as f32).sqrt();
        assert!(values.iter().all(|v| v.abs() <= bound));
        let mean = values.iter().sum::<f32>() / values.len() as f32;
        assert!(mean.abs() < 0.01 * bound, "mean {mean}");
        // Different tensors get different values.
        let other = a
            .tensor(&names::layer(0, names::ATTN_Q))
            .unwrap()
            .data
            .into_owned();
        assert_ne!(data, other);
        assert!(RandomWeights::new(&small, 7, 1000).is_err());
    }
}
