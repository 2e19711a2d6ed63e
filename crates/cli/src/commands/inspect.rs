//! `pagoda inspect`: what a model file holds and what it needs.

use std::collections::BTreeMap;

use anyhow::{bail, Result};
use clap::Args;
use pagoda_engine::ModelSource;
use pagoda_models::formats::gguf::{GgufFile, MetadataValue};
use pagoda_models::gguf_model::config_from_gguf;
use pagoda_models::hf::HfModelDir;
use pagoda_tensor::GgmlType;

use crate::common;

/// Flags of `pagoda inspect`.
#[derive(Args, Debug)]
pub struct InspectArgs {
    /// Model: a .gguf file or a Hugging Face directory (default: the embedded model).
    #[arg(short = 'm', long = "model")]
    pub model: Option<std::path::PathBuf>,
    /// Context size to compute the KV-cache memory for. Default: the model's, at most 4096.
    #[arg(short = 'c', long = "ctx-size", allow_negative_numbers = true)]
    pub ctx_size: Option<usize>,
    /// List every tensor.
    #[arg(long)]
    pub tensors: bool,
}

/// Runs `pagoda inspect`.
pub fn run(args: InspectArgs) -> Result<()> {
    if args.ctx_size == Some(0) {
        bail!("--ctx-size must be at least 1 (omit it to use the model's context, at most 4096)");
    }
    let source = common::resolve_model(&args.model)?;
    // The report is printed only once complete, so a bad file gives an error, not half a report.
    let mut report = String::new();
    macro_rules! say {
        ($($arg:tt)*) => {{
            report.push_str(&format!($($arg)*));
            report.push('\n');
        }};
    }
    say!("model: {}", source.path().display());
    let (config, tensors) = match &source {
        ModelSource::Gguf(path) => {
            let file = GgufFile::open(path)?;
            say!(
                "format: GGUF v{} (alignment {})",
                file.version,
                file.alignment
            );
            say!("metadata:");
            for (key, value) in &file.metadata {
                say!("  {key} = {}", summarize(value));
            }
            let config = config_from_gguf(&file).map_err(anyhow::Error::msg)?;
            let tensors: Vec<(String, GgmlType, Vec<usize>, usize)> = file
                .tensors
                .iter()
                .map(|t| {
                    (
                        t.name.clone(),
                        t.ty,
                        t.dims.iter().rev().map(|&d| d as usize).collect(),
                        t.n_bytes as usize,
                    )
                })
                .collect();
            (config, tensors)
        }
        ModelSource::HfDir(dir) => {
            let hf = HfModelDir::open(dir)?;
            say!("format: Hugging Face directory");
            say!("weights: {} file(s)", hf.weights.shard_paths().len());
            let fp8 = hf.weights.fp8_tensors();
            if fp8 > 0 {
                use pagoda_models::weights::TensorSource;
                let rows: Vec<usize> = (hf.weights.tensor_names().iter())
                    .filter_map(|name| hf.weights.fp8_rows(name).map(|f| f.codes.len()))
                    .collect();
                let mib = |b: usize| b as f64 / (1 << 20) as f64;
                say!(
                    "FP8 (e4m3): {fp8} weights, {:.1} MiB in the file, dequantized at load; on \
                     CUDA (bf16, PAGODA_CUDA_FP8_WEIGHTS on by default) {} matrices with a factor per \
                     row ({:.1} MiB) stay FP8 on the device (steps over 2 rows on the FP8 GEMM, \
                     activations e4m3 per token: PAGODA_CUDA_FP8_GEMM)",
                    mib(hf.weights.fp8_bytes()),
                    rows.len(),
                    mib(rows.iter().sum())
                );
            }
            let g = &hf.generation;
            say!(
                "generation defaults: temperature {}, top_k {}, top_p {}, min_p {}, repetition_penalty {}, eos {:?}",
                shown(g.temperature),
                shown(g.top_k),
                shown(g.top_p),
                shown(g.min_p),
                shown(g.repetition_penalty),
                g.eos_token_ids
            );
            say!(
                "tokenizer.json: {}, tokenizer_config.json: {}",
                if hf.tokenizer_path.is_some() {
                    "present"
                } else {
                    "missing"
                },
                if hf.tokenizer_config_path.is_some() {
                    "present"
                } else {
                    "missing"
                }
            );
            let mut tensors = Vec::new();
            for name in pagoda_models::weights::TensorSource::tensor_names(&hf.weights) {
                if let Some(t) = pagoda_models::weights::TensorSource::tensor(&hf.weights, &name) {
                    tensors.push((name, t.ty, t.shape.clone(), t.data.len()));
                }
            }
            (hf.config, tensors)
        }
    };
    let ctx = common::checked_context_size(args.ctx_size, config.max_position_embeddings)?;
    say!("architecture: {:?}", config.architecture);
    say!(
        "rope: theta {}, {} of {} dims, {:?} pairing{}; tied embeddings: {}",
        config.rope_theta,
        config.rope_dim,
        config.head_dim,
        config.rope_style,
        match config.rope_scaling {
            Some(s) => format!(
                ", llama3 scaling (factor {}, low {}, high {}, original context {})",
                s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings
            ),
            None => String::new(),
        },
        config.tie_word_embeddings
    );
    say!(
        "shape: {} layers, hidden {}, {} heads / {} KV heads x {}, FFN {}, vocab {}, context {}",
        config.num_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.num_kv_heads,
        config.head_dim,
        config.intermediate_size,
        config.vocab_size,
        config.max_position_embeddings
    );
    if let Some(moe) = &config.moe {
        say!(
            "experts: {} per MoE layer, {} per token, FFN {} each, top-k weights {:?}, dense layers {:?}",
            moe.num_experts,
            moe.experts_per_token,
            moe.expert_intermediate_size,
            moe.top_k_weights,
            moe.dense_layers
        );
        if config.mla.is_some() {
            say!(
                "router: {:?} scores, groups {:?}, selection bias {}, scaling {}, {} shared experts",
                moe.scoring,
                moe.group_limit,
                moe.selection_bias,
                moe.routed_scaling_factor,
                moe.num_shared_experts
            );
        }
    }
    if let Some(mla) = &config.mla {
        say!(
            "latent attention: q_lora_rank {:?}, kv_lora_rank {}, heads of {} + {} (values {}), one cached row of {} per token, softmax scale {:.5}, YaRN {:?}, sparse-attention indexer {:?}",
            mla.q_lora_rank,
            mla.kv_lora_rank,
            mla.qk_nope_head_dim,
            mla.qk_rope_head_dim,
            mla.v_head_dim,
            mla.cache_row(),
            mla.softmax_scale(),
            mla.yarn,
            mla.indexer
        );
    }
    let mut by_type: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    let mut parameters = 0usize;
    let mut bytes = 0usize;
    for (_, ty, shape, n_bytes) in &tensors {
        let entry = by_type.entry(ty.name()).or_default();
        entry.0 += 1;
        entry.1 += n_bytes;
        parameters += shape.iter().product::<usize>();
        bytes += n_bytes;
    }
    say!(
        "tensors: {} ({})",
        tensors.len(),
        by_type
            .iter()
            .map(|(t, (n, _))| format!("{n} {t}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    say!("parameters: {} ({})", parameters, human_count(parameters));
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    say!(
        "weights: {:.1} MiB as stored, {:.1} MiB in exact (f32) mode",
        mib(bytes),
        mib(parameters * 4)
    );
    // The CUDA model in bf16: matrices in a GPU block format stay as stored, the rest bf16.
    let (mut kept, mut gpu_bytes) = (0, 0);
    for (_, ty, shape, n_bytes) in &tensors {
        if shape.len() == 2 && pagoda_models::weight_plan::gpu_keeps_blocks(*ty, shape[1]) {
            kept += 1;
            gpu_bytes += n_bytes;
        } else {
            gpu_bytes += 2 * shape.iter().product::<usize>();
        }
    }
    say!(
        "on CUDA (bf16): {:.1} MiB of weights, {kept} matrices kept in their GGUF blocks and \
         multiplied in place, the rest as bf16 (PAGODA_CUDA_QUANT_WEIGHTS=off: all bf16, {:.1} MiB)",
        mib(gpu_bytes),
        mib(parameters * 2)
    );
    // A MoE file's stacked experts (3-D `ffn_*_exps`): dequantized to bf16 at load unless
    // PAGODA_CUDA_MOE_QUANT keeps them in their blocks.
    let (mut experts, mut blocks, mut dequantized, mut other) = (0, 0, 0, 0);
    for (name, ty, shape, n_bytes) in &tensors {
        if shape.len() == 3 && name.contains("_exps") {
            if pagoda_models::weight_plan::gpu_keeps_blocks(*ty, shape[2]) {
                experts += 1;
                blocks += n_bytes;
                dequantized += 2 * shape.iter().product::<usize>();
            } else {
                other += 1;
            }
        }
    }
    if experts + other > 0 {
        say!(
            "on CUDA (bf16): {experts} stacked expert tensors stay in their GGUF blocks with \
             PAGODA_CUDA_MOE_QUANT=on, {:.1} MiB in place of the {:.1} MiB of bf16 the line \
             above counts (off, the default: dequantized at load){}",
            mib(blocks),
            mib(dequantized),
            if other > 0 {
                format!("; {other} in other formats are dequantized either way")
            } else {
                String::new()
            }
        );
    }
    // A latent cache (DeepSeek) stores one row per token and layer, no separate V.
    let sides = if config.mla.is_some() { 1 } else { 2 };
    let kv_per_token = sides * config.num_layers * config.num_kv_heads * config.head_dim * 4;
    say!(
        "KV cache (f32): {} bytes per token, {:.1} MiB for a context of {}",
        kv_per_token,
        mib(kv_per_token * ctx),
        ctx
    );
    say!(
        "memory for context {}: {:.1} MiB (weights as stored + KV)",
        ctx,
        mib(bytes + kv_per_token * ctx)
    );
    if args.tensors {
        for (name, ty, shape, n_bytes) in &tensors {
            say!("  {name:40} {:6} {shape:?} {n_bytes} bytes", ty.name());
        }
    }
    print!("{report}");
    Ok(())
}

/// `count` with a K/M/B suffix (e.g. "134.5 M", "41.2 K").
fn human_count(count: usize) -> String {
    let value = count as f64;
    if value >= 1e9 {
        format!("{:.2} B", value / 1e9)
    } else if value >= 1e6 {
        format!("{:.1} M", value / 1e6)
    } else if value >= 1e3 {
        format!("{:.1} K", value / 1e3)
    } else {
        count.to_string()
    }
}

fn summarize(value: &MetadataValue) -> String {
    match value {
        MetadataValue::String(s) if s.len() > 120 => format!(
            "{:?}... ({} chars)",
            s.chars().take(100).collect::<String>(),
            s.chars().count()
        ),
        MetadataValue::String(s) => format!("{s:?}"),
        MetadataValue::Array(items) if items.len() > 8 => {
            let head: Vec<String> = items.iter().take(4).map(summarize).collect();
            format!("[{}, ...] ({} items)", head.join(", "), items.len())
        }
        MetadataValue::Array(items) => format!(
            "[{}]",
            items.iter().map(summarize).collect::<Vec<_>>().join(", ")
        ),
        MetadataValue::U8(v) => v.to_string(),
        MetadataValue::I8(v) => v.to_string(),
        MetadataValue::U16(v) => v.to_string(),
        MetadataValue::I16(v) => v.to_string(),
        MetadataValue::U32(v) => v.to_string(),
        MetadataValue::I32(v) => v.to_string(),
        MetadataValue::U64(v) => v.to_string(),
        MetadataValue::I64(v) => v.to_string(),
        MetadataValue::F32(v) => v.to_string(),
        MetadataValue::F64(v) => v.to_string(),
        MetadataValue::Bool(v) => v.to_string(),
    }
}

/// An optional setting for display: its value, or `-` when unset.
fn shown<T: std::fmt::Display>(value: Option<T>) -> String {
    value.map_or_else(|| "-".to_string(), |v| v.to_string())
}
