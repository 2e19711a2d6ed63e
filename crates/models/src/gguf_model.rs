//! A GGUF file as a model: its [`ModelConfig`] from the metadata and its tensors as a
//! [`TensorSource`].

use std::borrow::Cow;

use crate::config::{
    Architecture, ExpertGroupLimit, ExpertScoring, GroupScoring, MlaConfig, ModelConfig, MoeConfig,
    RopeStyle, TopKWeights, YarnScaling,
};
use crate::formats::gguf::{GgufFile, MetadataValue};
use crate::llama::LoadError;
use crate::weights::{names, RawTensor, TensorSource};

/// Reads the architecture and shapes from GGUF metadata (`{arch}.block_count`, ...).
///
/// Errors name the file and the missing or malformed key.
pub fn config_from_gguf(file: &GgufFile) -> Result<ModelConfig, LoadError> {
    read_config(file).map_err(LoadError)
}

fn read_config(file: &GgufFile) -> Result<ModelConfig, String> {
    let fail = |what: String| format!("{}: {what}", file.path.display());
    let arch_name = match file.get("general.architecture") {
        Some(MetadataValue::String(s)) => s.clone(),
        _ => return Err(fail("metadata key general.architecture is missing".into())),
    };
    let key = |suffix: &str| format!("{arch_name}.{suffix}");
    let experts = match file.get(&key("expert_count")) {
        None => 0,
        Some(value) => as_usize(value).ok_or_else(|| {
            fail(format!(
                "metadata key {} is not a non-negative integer",
                key("expert_count")
            ))
        })?,
    };
    let architecture = match arch_name.as_str() {
        // llama.cpp writes Mixtral as `llama` with experts.
        "llama" | "mistral" if experts > 0 => Architecture::Mixtral,
        "llama" | "mistral" => Architecture::Llama,
        "qwen2" => Architecture::Qwen2,
        "qwen3" => Architecture::Qwen3,
        "qwen3moe" => Architecture::Qwen3Moe,
        "deepseek2" => Architecture::DeepSeek2,
        other => {
            return Err(fail(format!(
                "architecture `{other}` is not supported (supported: llama, mistral, qwen2, qwen3, qwen3moe, deepseek2)"
            )))
        }
    };
    let uint = |suffix: &str| -> Result<Option<usize>, String> {
        match file.get(&key(suffix)) {
            None => Ok(None),
            Some(value) => as_usize(value).map(Some).ok_or_else(|| {
                fail(format!(
                    "metadata key {} is not a non-negative integer",
                    key(suffix)
                ))
            }),
        }
    };
    let required = |suffix: &str| -> Result<usize, String> {
        uint(suffix)?.ok_or_else(|| fail(format!("metadata key {} is missing", key(suffix))))
    };
    let float = |suffix: &str| -> Result<Option<f32>, String> {
        match file.get(&key(suffix)) {
            None => Ok(None),
            Some(MetadataValue::F32(v)) => Ok(Some(*v)),
            Some(MetadataValue::F64(v)) => Ok(Some(*v as f32)),
            Some(_) => Err(fail(format!("metadata key {} is not a float", key(suffix)))),
        }
    };

    let text = |suffix: &str| -> Result<Option<&str>, String> {
        match file.get(&key(suffix)) {
            None => Ok(None),
            Some(MetadataValue::String(s)) => Ok(Some(s.as_str())),
            Some(_) => Err(fail(format!(
                "metadata key {} is not a string",
                key(suffix)
            ))),
        }
    };

    let hidden_size = required("embedding_length")?;
    let num_attention_heads = required("attention.head_count")?;
    let num_kv_heads = uint("attention.head_count_kv")?.unwrap_or(num_attention_heads);
    let head_dim = match uint("attention.key_length")? {
        Some(d) => d,
        None if num_attention_heads > 0 => hidden_size / num_attention_heads,
        None => 0,
    };
    let intermediate_size = required("feed_forward_length")?;
    let num_layers = required("block_count")?;
    let moe = match architecture {
        Architecture::Mixtral | Architecture::Qwen3Moe => Some(MoeConfig {
            num_experts: required("expert_count")?,
            experts_per_token: required("expert_used_count")?,
            expert_intermediate_size: uint("expert_feed_forward_length")?
                .unwrap_or(intermediate_size),
            // llama.cpp renormalises the top-k of both (`expert_weights_norm`, where a file
            // has it, says so explicitly).
            top_k_weights: match file.get(&key("expert_weights_norm")) {
                Some(MetadataValue::Bool(false)) => TopKWeights::Softmax,
                _ => TopKWeights::Normalized,
            },
            // llama.cpp writes every layer with experts; a layer without a router (a
            // converted Qwen3-MoE `mlp_only_layers` entry) is dense.
            dense_layers: (0..num_layers)
                .filter(|&layer| {
                    let router = names::layer(layer, names::FFN_GATE_INP);
                    file.tensor(&router).is_none()
                })
                .collect(),
            ..MoeConfig::default()
        }),
        Architecture::DeepSeek2 => None,
        _ => None,
    };
    let deepseek = match architecture {
        Architecture::DeepSeek2 => {
            let settings = DeepSeekKeys {
                uint: &uint,
                required: &required,
                float: &float,
                text: &text,
                fail: &fail,
                file,
            };
            Some(settings.read(num_layers, intermediate_size)?)
        }
        _ => None,
    };
    let (moe, num_kv_heads, head_dim) = match &deepseek {
        Some((mla, moe)) => (Some(moe.clone()), 1, mla.cache_row()),
        None => (moe, num_kv_heads, head_dim),
    };
    let embedding = file
        .tensor("token_embd.weight")
        .ok_or_else(|| fail("tensor token_embd.weight is missing".into()))?;
    let vocab_size = match uint("vocab_size")? {
        Some(v) => v,
        None => embedding.dims.get(1).copied().unwrap_or(0) as usize,
    };
    let config = ModelConfig {
        architecture,
        hidden_size,
        num_layers,
        num_attention_heads,
        num_kv_heads,
        head_dim,
        intermediate_size,
        vocab_size,
        rms_norm_eps: float("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5),
        rope_theta: float("rope.freq_base")?.unwrap_or(10000.0),
        rope_dim: uint("rope.dimension_count")?.unwrap_or(head_dim),
        // llama.cpp permutes llama q/k rows at conversion so adjacent pairs rotate; Qwen keeps
        // the NeoX layout. DeepSeek's RoPE part rotates adjacent pairs as stored (its HF code
        // de-interleaves q and k alike before rotate-half: the same scores).
        rope_style: match architecture {
            Architecture::Llama | Architecture::Mixtral | Architecture::DeepSeek2 => {
                RopeStyle::Interleaved
            }
            Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe => RopeStyle::Halves,
        },
        // Llama 3 scaling arrives precomputed as the `rope_freqs.weight` tensor.
        rope_scaling: None,
        max_position_embeddings: uint("context_length")?.unwrap_or(4096),
        tie_word_embeddings: file.tensor("output.weight").is_none(),
        moe,
        mla: deepseek.map(|(mla, _)| mla),
    };
    config.validate().map_err(|e| fail(e.to_string()))?;
    Ok(config)
}

type Reader<'a, T> = &'a dyn Fn(&str) -> Result<T, String>;

/// The `deepseek2.*` keys as llama.cpp's converter writes them, old and new: since its MLA
/// change the file says `attention.key_length_mla`/`value_length_mla` (the expanded head)
/// and `key_length`/`value_length` hold the latent cache row; before, `key_length` was the
/// expanded head.
struct DeepSeekKeys<'a> {
    uint: Reader<'a, Option<usize>>,
    required: Reader<'a, usize>,
    float: Reader<'a, Option<f32>>,
    text: Reader<'a, Option<&'a str>>,
    fail: &'a dyn Fn(String) -> String,
    file: &'a GgufFile,
}

impl DeepSeekKeys<'_> {
    fn read(
        &self,
        num_layers: usize,
        intermediate_size: usize,
    ) -> Result<(MlaConfig, MoeConfig), String> {
        let (uint, required, float, fail) = (self.uint, self.required, self.float, self.fail);
        let qk_rope_head_dim = required("rope.dimension_count")?;
        let kv_lora_rank = required("attention.kv_lora_rank")?;
        let (q_head_dim, v_head_dim) = match uint("attention.key_length_mla")? {
            Some(k) => (k, required("attention.value_length_mla")?),
            None => (
                required("attention.key_length")?,
                required("attention.value_length")?,
            ),
        };
        let qk_nope_head_dim = q_head_dim.checked_sub(qk_rope_head_dim).filter(|&d| d > 0);
        let Some(qk_nope_head_dim) = qk_nope_head_dim else {
            return Err(fail(format!(
                "deepseek2 key length {q_head_dim} leaves no room for the rope part ({qk_rope_head_dim})"
            )));
        };
        // V2-Lite has no query compression: the key is absent or 0, and so is `attn_q_a`.
        let q_lora_rank = uint("attention.q_lora_rank")?.filter(|&rank| rank > 0);
        let yarn = match (self.text)("rope.scaling.type")? {
            None | Some("none") => None,
            Some("yarn") => {
                // llama.cpp writes `0.1 * mscale_all_dim` and assumes `mscale == mscale_all_dim`.
                let mscale = float("rope.scaling.yarn_log_multiplier")?.unwrap_or(0.0) / 0.1;
                Some(YarnScaling {
                    factor: float("rope.scaling.factor")?.unwrap_or(1.0),
                    original_max_position_embeddings: required(
                        "rope.scaling.original_context_length",
                    )? as u32,
                    beta_fast: float("rope.scaling.yarn_beta_fast")?.unwrap_or(32.0),
                    beta_slow: float("rope.scaling.yarn_beta_slow")?.unwrap_or(1.0),
                    mscale,
                    mscale_all_dim: mscale,
                })
            }
            Some(other) => {
                return Err(fail(format!(
                    "deepseek2 rope scaling `{other}` is not supported (none or yarn)"
                )))
            }
        };
        let mla = MlaConfig {
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
            yarn,
            // llama.cpp at our anchor has no DeepSeek-V3.2 (sparse attention) layout.
            indexer: None,
        };
        let num_experts = required("expert_count")?;
        let scoring = match uint("expert_gating_func")? {
            None | Some(0) | Some(1) => ExpertScoring::Softmax,
            Some(2) => ExpertScoring::Sigmoid,
            Some(other) => {
                return Err(fail(format!(
                    "deepseek2 expert_gating_func {other} is not supported (1 softmax, 2 sigmoid)"
                )))
            }
        };
        let group_limit = match uint("expert_group_count")? {
            Some(groups) if groups > 1 => Some(ExpertGroupLimit {
                num_groups: groups,
                groups_per_token: required("expert_group_used_count")?,
                // llama.cpp sums each group's top two; DeepSeek-V2 (softmax) ranked groups by
                // their best expert, which is what its weights were trained with.
                score: match scoring {
                    ExpertScoring::Softmax => GroupScoring::Max,
                    ExpertScoring::Sigmoid => GroupScoring::TopTwoSum,
                },
            }),
            _ => None,
        };
        let leading_dense = uint("leading_dense_block_count")?.unwrap_or(0);
        let moe = MoeConfig {
            num_experts,
            experts_per_token: required("expert_used_count")?,
            expert_intermediate_size: uint("expert_feed_forward_length")?
                .unwrap_or(intermediate_size),
            top_k_weights: match self.file.get("deepseek2.expert_weights_norm") {
                Some(MetadataValue::Bool(true)) => TopKWeights::Normalized,
                _ => TopKWeights::Softmax,
            },
            dense_layers: (0..num_layers.min(leading_dense)).collect(),
            scoring,
            routed_scaling_factor: float("expert_weights_scale")?
                .filter(|&s| s != 0.0)
                .unwrap_or(1.0),
            group_limit,
            selection_bias: self
                .file
                .tensor(&format!("blk.{}.exp_probs_b.bias", leading_dense))
                .is_some(),
            num_shared_experts: uint("expert_shared_count")?.unwrap_or(0),
        };
        Ok((mla, moe))
    }
}

fn as_usize(value: &MetadataValue) -> Option<usize> {
    match *value {
        MetadataValue::U8(v) => Some(v as usize),
        MetadataValue::U16(v) => Some(v as usize),
        MetadataValue::U32(v) => Some(v as usize),
        MetadataValue::U64(v) => usize::try_from(v).ok(),
        MetadataValue::I8(v) => usize::try_from(v).ok(),
        MetadataValue::I16(v) => usize::try_from(v).ok(),
        MetadataValue::I32(v) => usize::try_from(v).ok(),
        MetadataValue::I64(v) => usize::try_from(v).ok(),
        _ => None,
    }
}

impl TensorSource for GgufFile {
    fn tensor(&self, name: &str) -> Option<RawTensor<'_>> {
        let info = GgufFile::tensor(self, name)?;
        Some(RawTensor {
            ty: info.ty,
            // GGUF lists the innermost dimension first.
            shape: info.dims.iter().rev().map(|&d| d as usize).collect(),
            data: Cow::Borrowed(self.tensor_data(info)),
        })
    }

    fn tensor_names(&self) -> Vec<String> {
        self.tensors.iter().map(|t| t.name.clone()).collect()
    }
}
