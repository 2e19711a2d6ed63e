//! A GGUF file as a model: its [`ModelConfig`] from the metadata and its tensors as a
//! [`TensorSource`].

use std::borrow::Cow;

use crate::config::{Architecture, ModelConfig, MoeConfig, RopeStyle, TopKWeights};
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
        other => {
            return Err(fail(format!(
                "architecture `{other}` is not supported (supported: llama, mistral, qwen2, qwen3, qwen3moe)"
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
        }),
        _ => None,
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
        // the NeoX layout.
        rope_style: match architecture {
            Architecture::Llama | Architecture::Mixtral => RopeStyle::Interleaved,
            Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe => RopeStyle::Halves,
        },
        // Llama 3 scaling arrives precomputed as the `rope_freqs.weight` tensor.
        rope_scaling: None,
        max_position_embeddings: uint("context_length")?.unwrap_or(4096),
        tie_word_embeddings: file.tensor("output.weight").is_none(),
        moe,
    };
    config.validate().map_err(|e| fail(e.to_string()))?;
    Ok(config)
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
