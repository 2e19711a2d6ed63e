//! Hugging Face model directories: `config.json` -> [`ModelConfig`],
//! `generation_config.json` -> [`GenerationDefaults`], and the safetensors weights.
//!
//! Supported `model_type`s (or, when it is absent, `architectures[0]`): `llama` (Llama 2/3,
//! SmolLM/SmolLM2), `mistral`, `qwen2`, `qwen3`, `qwen3_moe`, `mixtral`, `deepseek_v2`,
//! `deepseek_v3`, `deepseek_v32`. q/k rows are in rotate-half order (DeepSeek: interleaved).

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::config::{Architecture, Llama3RopeScaling, ModelConfig, RopeStyle};
use crate::formats::safetensors::{SafetensorsError, SafetensorsWeights};
use crate::weights::names;

mod deepseek;
mod moe;
mod quantization;
pub(crate) use deepseek::deepseek_layer_tensors;
use moe::moe_of;

/// File name of the model config inside a HF directory.
pub const CONFIG_FILE_NAME: &str = "config.json";
/// File name of the sampling defaults inside a HF directory.
pub const GENERATION_CONFIG_FILE_NAME: &str = "generation_config.json";

/// Why a HF model directory (or one of its files) could not be loaded. The message names
/// the file and, where there is one, the field.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {kind}")]
pub struct HfError {
    /// The file or directory the problem is in.
    pub path: PathBuf,
    /// What is wrong.
    pub kind: String,
}

impl HfError {
    fn new(path: &Path, kind: impl Into<String>) -> HfError {
        HfError {
            path: path.to_path_buf(),
            kind: kind.into(),
        }
    }
}

impl From<SafetensorsError> for HfError {
    fn from(error: SafetensorsError) -> HfError {
        HfError {
            path: error.path,
            kind: error.kind,
        }
    }
}

/// Sampling defaults from `generation_config.json`; `None` (or empty) where the file is
/// silent. `eos_token_ids` accepts HF's int-or-list `eos_token_id`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationDefaults {
    /// `do_sample`: when `Some(false)` HF decodes greedily whatever the temperature says.
    pub do_sample: Option<bool>,
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// Tokens that end generation (`eos_token_id`, int or list).
    pub eos_token_ids: Vec<u32>,
    /// `bos_token_id`, if given.
    pub bos_token_id: Option<u32>,
    pub max_new_tokens: Option<usize>,
}

/// An opened HF model directory: parsed configs, memory-mapped weights, tokenizer paths.
#[derive(Debug)]
pub struct HfModelDir {
    /// The directory.
    pub path: PathBuf,
    /// From `config.json`.
    pub config: ModelConfig,
    /// From `generation_config.json` (all `None` when the file is absent). When that file
    /// names no EOS, `config.json`'s `eos_token_id` is used.
    pub generation: GenerationDefaults,
    /// The weights under canonical names; shapes checked against `config` at open.
    pub weights: SafetensorsWeights,
    /// `tokenizer.json`, if present.
    pub tokenizer_path: Option<PathBuf>,
    /// `tokenizer_config.json` (chat template, special tokens), if present.
    pub tokenizer_config_path: Option<PathBuf>,
}

impl HfModelDir {
    /// Opens `dir`: parses `config.json` (required) and `generation_config.json` (optional),
    /// maps the weights (`model.safetensors` or the sharded index) and checks that every
    /// tensor the config implies is present with the implied shape.
    pub fn open(dir: impl AsRef<Path>) -> Result<HfModelDir, HfError> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            return Err(HfError::new(dir, "not a directory"));
        }
        let config_path = dir.join(CONFIG_FILE_NAME);
        let config_text = read_text(&config_path)?;
        let config_json = parse_object(&config_text, &config_path)?;
        let config = config_from_object(&config_json, &config_path)?;

        let generation_path = dir.join(GENERATION_CONFIG_FILE_NAME);
        let mut generation = if generation_path.is_file() {
            generation_from_object(
                &parse_object(&read_text(&generation_path)?, &generation_path)?,
                &generation_path,
            )?
        } else {
            GenerationDefaults::default()
        };
        if generation.eos_token_ids.is_empty() {
            let fields = Fields {
                map: &config_json,
                path: &config_path,
                prefix: "",
            };
            generation.eos_token_ids = fields.token_ids("eos_token_id")?;
        }

        let weights = SafetensorsWeights::open_dir(dir)?;
        check_weights(&config, &weights, dir)?;
        let optional_file = |name: &str| Some(dir.join(name)).filter(|path| path.is_file());
        Ok(HfModelDir {
            path: dir.to_path_buf(),
            config,
            generation,
            weights,
            tokenizer_path: optional_file("tokenizer.json"),
            tokenizer_config_path: optional_file("tokenizer_config.json"),
        })
    }
}

/// Parses the text of a `config.json` (errors name the file as `config.json`).
pub fn config_from_hf_json(json: &str) -> Result<ModelConfig, HfError> {
    let path = Path::new(CONFIG_FILE_NAME);
    config_from_object(&parse_object(json, path)?, path)
}

/// Parses the text of a `generation_config.json`.
pub fn generation_defaults_from_json(json: &str) -> Result<GenerationDefaults, HfError> {
    let path = Path::new(GENERATION_CONFIG_FILE_NAME);
    generation_from_object(&parse_object(json, path)?, path)
}

fn read_text(path: &Path) -> Result<String, HfError> {
    std::fs::read_to_string(path)
        .map_err(|error| HfError::new(path, format!("cannot read: {error}")))
}

fn parse_object(text: &str, path: &Path) -> Result<Map<String, Value>, HfError> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(HfError::new(path, "top-level JSON value must be an object")),
        Err(error) => Err(HfError::new(path, format!("malformed JSON: {error}"))),
    }
}

/// Typed access to the fields of one JSON object; errors name `prefix + key` and the file.
/// A field set to `null` counts as absent (HF writes `"head_dim": null`).
struct Fields<'a> {
    map: &'a Map<String, Value>,
    path: &'a Path,
    prefix: &'a str,
}

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|value| !value.is_null())
    }

    fn error(&self, key: &str, what: &str) -> HfError {
        HfError::new(self.path, format!("field `{}{key}` {what}", self.prefix))
    }

    fn usize(&self, key: &str) -> Result<Option<usize>, HfError> {
        match self.get(key) {
            None => Ok(None),
            Some(value) => value
                .as_u64()
                .and_then(|number| usize::try_from(number).ok())
                .map(Some)
                .ok_or_else(|| {
                    self.error(
                        key,
                        &format!("must be a non-negative integer, found {value}"),
                    )
                }),
        }
    }

    fn required_usize(&self, key: &str) -> Result<usize, HfError> {
        self.usize(key)?
            .ok_or_else(|| self.error(key, "is missing"))
    }

    fn f32(&self, key: &str) -> Result<Option<f32>, HfError> {
        match self.get(key) {
            None => Ok(None),
            Some(value) => value
                .as_f64()
                .map(|number| Some(number as f32))
                .ok_or_else(|| self.error(key, &format!("must be a number, found {value}"))),
        }
    }

    fn required_f32(&self, key: &str) -> Result<f32, HfError> {
        self.f32(key)?.ok_or_else(|| self.error(key, "is missing"))
    }

    fn bool(&self, key: &str) -> Result<Option<bool>, HfError> {
        match self.get(key) {
            None => Ok(None),
            Some(value) => value
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.error(key, &format!("must be true or false, found {value}"))),
        }
    }

    fn str(&self, key: &str) -> Result<Option<&str>, HfError> {
        match self.get(key) {
            None => Ok(None),
            Some(value) => value
                .as_str()
                .map(Some)
                .ok_or_else(|| self.error(key, &format!("must be a string, found {value}"))),
        }
    }

    fn object(&self, key: &str) -> Result<Option<&Map<String, Value>>, HfError> {
        match self.get(key) {
            None => Ok(None),
            Some(value) => value
                .as_object()
                .map(Some)
                .ok_or_else(|| self.error(key, &format!("must be an object, found {value}"))),
        }
    }

    /// A list of non-negative integers; absent gives an empty list.
    fn usize_list(&self, key: &str) -> Result<Vec<usize>, HfError> {
        let invalid = |value: &Value| {
            self.error(
                key,
                &format!("must be a list of non-negative integers, found {value}"),
            )
        };
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|item| {
                    item.as_u64()
                        .and_then(|number| usize::try_from(number).ok())
                        .ok_or_else(|| invalid(item))
                })
                .collect(),
            Some(value) => Err(invalid(value)),
        }
    }

    /// An int or a list of ints (HF's `eos_token_id`); absent gives an empty list.
    fn token_ids(&self, key: &str) -> Result<Vec<u32>, HfError> {
        let as_id = |value: &Value| value.as_u64().and_then(|id| u32::try_from(id).ok());
        let invalid = |value: &Value| {
            self.error(
                key,
                &format!("must be a token id or a list of token ids, found {value}"),
            )
        };
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|item| as_id(item).ok_or_else(|| invalid(item)))
                .collect(),
            Some(value) => as_id(value)
                .map(|id| vec![id])
                .ok_or_else(|| invalid(value)),
        }
    }
}

fn architecture_of(fields: &Fields<'_>) -> Result<Architecture, HfError> {
    if let Some(model_type) = fields.str("model_type")? {
        return match model_type {
            "llama" | "mistral" => Ok(Architecture::Llama),
            "qwen2" => Ok(Architecture::Qwen2),
            "qwen3" => Ok(Architecture::Qwen3),
            "qwen3_moe" => Ok(Architecture::Qwen3Moe),
            "mixtral" => Ok(Architecture::Mixtral),
            "deepseek_v2" | "deepseek_v3" | "deepseek_v32" => Ok(Architecture::DeepSeek2),
            other => Err(fields.error(
                "model_type",
                &format!("is `{other}`, which pagoda does not support (supported: llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, deepseek_v2, deepseek_v3, deepseek_v32)"),
            )),
        };
    }
    let first = fields
        .get("architectures")
        .and_then(|value| value.as_array())
        .and_then(|list| list.first())
        .and_then(|value| value.as_str())
        .ok_or_else(|| {
            fields.error(
                "model_type",
                "is missing (and `architectures` names no class either)",
            )
        })?;
    match first {
        "LlamaForCausalLM" | "MistralForCausalLM" => Ok(Architecture::Llama),
        "Qwen2ForCausalLM" => Ok(Architecture::Qwen2),
        "Qwen3ForCausalLM" => Ok(Architecture::Qwen3),
        "Qwen3MoeForCausalLM" => Ok(Architecture::Qwen3Moe),
        "MixtralForCausalLM" => Ok(Architecture::Mixtral),
        "DeepseekV2ForCausalLM" | "DeepseekV3ForCausalLM" => Ok(Architecture::DeepSeek2),
        "DeepseekV32ForCausalLM" => Ok(Architecture::DeepSeek2),
        other => Err(fields.error(
            "architectures",
            &format!("names `{other}`, which pagoda does not support"),
        )),
    }
}

/// The RoPE scaling section, `rope_scaling` (transformers 4) or `rope_parameters`
/// (transformers 5), read by `read` with its fields and its type (`rope_type`, or the older
/// `type`); `None` without a section or for type `default`.
fn rope_scaling_section<T>(
    fields: &Fields<'_>,
    read: impl FnOnce(&Fields<'_>, &str) -> Result<T, HfError>,
) -> Result<Option<T>, HfError> {
    let (key, map) = match fields.object("rope_scaling")? {
        Some(map) => ("rope_scaling", map),
        None => match fields.object("rope_parameters")? {
            Some(map) => ("rope_parameters", map),
            None => return Ok(None),
        },
    };
    let prefix = format!("{key}.");
    let scaling = Fields {
        map,
        path: fields.path,
        prefix: &prefix,
    };
    let rope_type = match scaling.str("rope_type")? {
        Some(rope_type) => rope_type,
        None => scaling.str("type")?.unwrap_or("default"),
    };
    if rope_type == "default" {
        return Ok(None);
    }
    read(&scaling, rope_type).map(Some)
}

/// Llama 3's RoPE scaling; `None` for no scaling or `rope_type: "default"`.
fn rope_scaling_of(fields: &Fields<'_>) -> Result<Option<Llama3RopeScaling>, HfError> {
    rope_scaling_section(fields, |scaling, rope_type| match rope_type {
        "llama3" => Ok(Llama3RopeScaling {
            factor: scaling.required_f32("factor")?,
            low_freq_factor: scaling.required_f32("low_freq_factor")?,
            high_freq_factor: scaling.required_f32("high_freq_factor")?,
            original_max_position_embeddings: u32::try_from(
                scaling.required_usize("original_max_position_embeddings")?,
            )
            .map_err(|_| {
                scaling.error(
                    "original_max_position_embeddings",
                    "does not fit in 32 bits",
                )
            })?,
        }),
        other => Err(scaling.error(
            "rope_type",
            &format!("is `{other}`; only `default` and `llama3` RoPE scaling are supported"),
        )),
    })
}

fn config_from_object(map: &Map<String, Value>, path: &Path) -> Result<ModelConfig, HfError> {
    let fields = Fields {
        map,
        path,
        prefix: "",
    };
    let architecture = architecture_of(&fields)?;
    quantization::check_quantization(&fields)?;
    if architecture == Architecture::DeepSeek2 {
        return deepseek::deepseek_config(&fields, path);
    }
    let model_type = fields.str("model_type")?.unwrap_or(match architecture {
        Architecture::Qwen3Moe => "qwen3_moe",
        other => other.name(),
    });

    if let Some(activation) = fields.str("hidden_act")? {
        if activation != "silu" {
            return Err(fields.error(
                "hidden_act",
                &format!("is `{activation}`; only `silu` is supported"),
            ));
        }
    }
    let hidden_size = fields.required_usize("hidden_size")?;
    let num_attention_heads = fields.required_usize("num_attention_heads")?;
    if num_attention_heads == 0 {
        return Err(fields.error("num_attention_heads", "must be positive"));
    }
    let head_dim = match fields.usize("head_dim")? {
        Some(head_dim) => head_dim,
        None if hidden_size % num_attention_heads == 0 => hidden_size / num_attention_heads,
        None => {
            return Err(fields.error(
                "head_dim",
                &format!("is missing and hidden_size {hidden_size} is not a multiple of num_attention_heads {num_attention_heads}"),
            ))
        }
    };
    let rope_parameters = fields.object("rope_parameters")?;
    let rope_theta = match fields.f32("rope_theta")? {
        Some(theta) => theta,
        None => match rope_parameters {
            Some(parameters) => Fields {
                map: parameters,
                path,
                prefix: "rope_parameters.",
            }
            .f32("rope_theta")?,
            None => None,
        }
        .unwrap_or(10_000.0),
    };
    // transformers' per-class defaults where the field is absent.
    let default_max_positions = match model_type {
        "mistral" => 131_072,
        "qwen2" | "qwen3" | "qwen3_moe" | "mixtral" => 32_768,
        _ => 2_048,
    };
    if model_type == "mistral" || model_type == "mixtral" {
        if let Some(window) = fields.usize("sliding_window")? {
            tracing::warn!(
                "{}: sliding_window {window} is ignored; attention is full-context",
                path.display()
            );
        }
    }
    if fields.bool("use_sliding_window")? == Some(true) {
        tracing::warn!(
            "{}: use_sliding_window is ignored; attention is full-context",
            path.display()
        );
    }

    let num_layers = fields.required_usize("num_hidden_layers")?;
    let config = ModelConfig {
        architecture,
        hidden_size,
        num_layers,
        num_attention_heads,
        num_kv_heads: fields
            .usize("num_key_value_heads")?
            .unwrap_or(num_attention_heads),
        head_dim,
        intermediate_size: fields.required_usize("intermediate_size")?,
        vocab_size: fields.required_usize("vocab_size")?,
        rms_norm_eps: fields.f32("rms_norm_eps")?.unwrap_or(1e-6),
        rope_theta,
        rope_dim: head_dim,
        rope_style: RopeStyle::Halves,
        rope_scaling: rope_scaling_of(&fields)?,
        max_position_embeddings: fields
            .usize("max_position_embeddings")?
            .unwrap_or(default_max_positions),
        tie_word_embeddings: fields.bool("tie_word_embeddings")?.unwrap_or(false),
        moe: moe_of(&fields, architecture, num_layers)?,
        mla: None,
    };
    config
        .validate()
        .map_err(|message| HfError::new(path, format!("invalid config: {message}")))?;
    Ok(config)
}

fn generation_from_object(
    map: &Map<String, Value>,
    path: &Path,
) -> Result<GenerationDefaults, HfError> {
    let fields = Fields {
        map,
        path,
        prefix: "",
    };
    Ok(GenerationDefaults {
        do_sample: fields.bool("do_sample")?,
        temperature: fields.f32("temperature")?,
        top_k: fields.usize("top_k")?,
        top_p: fields.f32("top_p")?,
        min_p: fields.f32("min_p")?,
        repetition_penalty: fields.f32("repetition_penalty")?,
        eos_token_ids: fields.token_ids("eos_token_id")?,
        bos_token_id: fields.token_ids("bos_token_id")?.first().copied(),
        max_new_tokens: fields.usize("max_new_tokens")?,
    })
}

/// Every canonical tensor `config` implies, with its row-major shape and whether it must be
/// present (biases are optional for llama, which HF allows with `attention_bias`).
pub fn expected_tensors(config: &ModelConfig) -> Vec<(String, Vec<usize>, bool)> {
    let hidden = config.hidden_size;
    let q_width = config.num_attention_heads * config.head_dim;
    let kv_width = config.num_kv_heads * config.head_dim;
    let mut expected = vec![
        (
            names::TOKEN_EMBEDDING.to_string(),
            vec![config.vocab_size, hidden],
            true,
        ),
        (names::OUTPUT_NORM.to_string(), vec![hidden], true),
        (
            names::OUTPUT.to_string(),
            vec![config.vocab_size, hidden],
            !config.tie_word_embeddings,
        ),
    ];
    let biases_required = config.architecture == Architecture::Qwen2;
    for layer in 0..config.num_layers {
        if config.mla.is_some() {
            let tensors = deepseek_layer_tensors(config, layer);
            expected.extend(tensors.into_iter().map(|(name, shape)| (name, shape, true)));
            continue;
        }
        let mut add = |suffix: &str, shape: Vec<usize>, required: bool| {
            expected.push((names::layer(layer, suffix), shape, required));
        };
        add(names::ATTN_NORM, vec![hidden], true);
        add(names::ATTN_Q, vec![q_width, hidden], true);
        add(names::ATTN_K, vec![kv_width, hidden], true);
        add(names::ATTN_V, vec![kv_width, hidden], true);
        add(names::ATTN_OUTPUT, vec![hidden, q_width], true);
        add(names::ATTN_Q_BIAS, vec![q_width], biases_required);
        add(names::ATTN_K_BIAS, vec![kv_width], biases_required);
        add(names::ATTN_V_BIAS, vec![kv_width], biases_required);
        if config.architecture.has_qk_norm() {
            add(names::ATTN_Q_NORM, vec![config.head_dim], true);
            add(names::ATTN_K_NORM, vec![config.head_dim], true);
        }
        add(names::FFN_NORM, vec![hidden], true);
        match &config.moe {
            Some(moe) if moe.is_moe_layer(layer) => {
                let (experts, width) = (moe.num_experts, moe.expert_intermediate_size);
                add(names::FFN_GATE_INP, vec![experts, hidden], true);
                add(names::FFN_GATE_EXPS, vec![experts, width, hidden], true);
                add(names::FFN_UP_EXPS, vec![experts, width, hidden], true);
                add(names::FFN_DOWN_EXPS, vec![experts, hidden, width], true);
            }
            _ => {
                let width = config.intermediate_size;
                add(names::FFN_GATE, vec![width, hidden], true);
                add(names::FFN_UP, vec![width, hidden], true);
                add(names::FFN_DOWN, vec![hidden, width], true);
            }
        }
    }
    expected
}

/// Every required tensor present, every present expected tensor with the expected shape.
fn check_weights(
    config: &ModelConfig,
    weights: &SafetensorsWeights,
    dir: &Path,
) -> Result<(), HfError> {
    for (name, shape, required) in expected_tensors(config) {
        match weights.shape(&name) {
            None if required => {
                return Err(HfError::new(
                    dir,
                    format!(
                        "tensor `{name}` is missing from the weights but the config requires it"
                    ),
                ))
            }
            None => {}
            Some(found) if found != shape => {
                let hf_name = weights.hf_name(&name).unwrap_or(&name);
                return Err(HfError::new(
                    dir,
                    format!("tensor `{hf_name}` has shape {found:?}, the config implies {shape:?}"),
                ));
            }
            Some(_) => {}
        }
    }
    Ok(())
}
