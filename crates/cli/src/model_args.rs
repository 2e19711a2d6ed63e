//! The flags that choose and size the model (`ModelArgs`, shared by every subcommand that
//! loads one), and the settings they set.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use pagoda_engine::ModelSource;

use clap::Args;
use pagoda_config::FlagValue;

/// Flags that choose and size the model.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model: a .gguf file or a Hugging Face directory. Default: the embedded SmolLM2-135M-Instruct
    /// (models/SmolLM2-135M-Instruct.Q4_1.gguf; `scripts/fetch-model.sh` fetches it), or $PAGODA_MODEL.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// Exact mode: weights dequantized to f32, f32 activations and KV (for parity checks).
    #[arg(long)]
    pub exact: bool,
    /// Context size in tokens (prompt + generated). Default: the model's, at most 4096.
    #[arg(short = 'c', long = "ctx-size", allow_negative_numbers = true)]
    pub ctx_size: Option<usize>,
    /// Worker threads. Default: all cores.
    #[arg(short = 't', long = "threads", allow_negative_numbers = true)]
    pub threads: Option<usize>,
    /// Tokens per KV-cache page.
    #[arg(long, default_value_t = 16, allow_negative_numbers = true)]
    pub page_size: usize,
    /// CPU attention, chosen per query row (so a request's numbers never depend on its batch):
    /// `auto` (the default: split-KV for rows that see at least 16 tokens, gather below),
    /// `split-kv` (every row; the CPU twin of the GPU kernel) or `gather` (the
    /// gather-then-attend reference). Also $PAGODA_ATTENTION.
    #[arg(long)]
    pub attention: Option<String>,
    /// KV cache type of K (llama.cpp's `-ctk`): on the CPU `f32` (the default), `f16` (half
    /// the bytes) or `q8_0` (llama.cpp's 8-bit blocks: 34 bytes per 32 values); on CUDA the
    /// default (the model's dtype) or `fp8` (e4m3 with per-head scales, with `-ctv fp8`).
    /// Also $PAGODA_CACHE_TYPE_K.
    #[arg(long = "cache-type-k", value_name = "f32|f16|q8_0|fp8")]
    pub cache_type_k: Option<String>,
    /// KV cache type of V (llama.cpp's `-ctv`): as for K. Also $PAGODA_CACHE_TYPE_V.
    #[arg(long = "cache-type-v", value_name = "f32|f16|q8_0|fp8")]
    pub cache_type_v: Option<String>,
    /// vLLM's spelling of the KV cache type: `fp8` (or `fp8_e4m3`) is `-ctk fp8 -ctv fp8`
    /// (CUDA); `auto` leaves -ctk/-ctv as they are. Also $PAGODA_KV_CACHE_DTYPE.
    #[arg(long = "kv-cache-dtype", value_name = "auto|fp8|fp8_e4m3")]
    pub kv_cache_dtype: Option<String>,
    /// Sparse decode (CPU and CUDA): `budget=N,window=W,min-context=C` (any subset; `on`: the defaults
    /// 1024, 128, 2048). Long decode rows attend to the first page, the recent window and the
    /// pages whose key summaries promise the highest scores, within the token budget
    /// (Quest). Requests may override it (`sparse_attention`; keys they leave out take these
    /// values). Refused with -tp over 1, an MLA model, and on CUDA with the fp8 KV cache,
    /// --deterministic or --paged-decode gather. Also $PAGODA_SPARSE_ATTENTION.
    #[arg(
        long = "sparse-attention",
        value_name = "budget=N,window=W,min-context=C"
    )]
    pub sparse_attention: Option<String>,
    /// Where to run: `auto` (a CUDA GPU when this build has CUDA and one is usable, else the
    /// CPU, saying why in one line), `cpu` or `cuda`.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Ranks to split the model over (vLLM's spelling; `-tp N`): on the CPU the ranks run as
    /// threads of this process (tensor parallelism, issue 40); CUDA needs the NCCL increment.
    /// Also $PAGODA_TENSOR_PARALLEL_SIZE.
    #[arg(long = "tensor-parallel-size", value_name = "N")]
    pub tensor_parallel_size: Option<String>,
    /// Weight and activation dtype on the GPU: `bf16` or `f32` (the CPU parity mode's twin).
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Token sampler: `fused` (sort-free: Gumbel-max and rejection filters) or `reference`
    /// (the sort-based oracle). Default: $PAGODA_SAMPLER, else fused. On CUDA, `fused`
    /// samples on the GPU (only token ids leave the device; requests with penalties or
    /// logprobs sample on the CPU) and `reference` keeps every draw on the CPU.
    #[arg(long)]
    pub sampler: Option<String>,
    /// On the GPU, launch every kernel from the host instead of replaying decode steps from
    /// CUDA graphs (vLLM's spelling). `PAGODA_CUDA_GRAPHS=0` does the same.
    #[arg(long)]
    pub enforce_eager: bool,
    /// On the GPU, batch-invariant kernels: a seeded request gives the same tokens and
    /// log-probabilities alone, beside others, preempted or from the prefix cache (GEMMs on
    /// one algorithm per weight shape, every attention row on one kernel); costs speed, see
    /// the README. `PAGODA_DETERMINISTIC=on` does the same. The CPU is always so.
    #[arg(long)]
    pub deterministic: bool,
    /// Skip the warm-ups (llama.cpp's spelling): on the GPU, kernels then compile at their
    /// first launch and decode graphs are captured at first use (`PAGODA_CUDA_WARMUP=off`
    /// does the same); `pagoda bench` also skips its untimed warm-up runs.
    #[arg(long)]
    pub no_warmup: bool,
    /// On the GPU, the decode attention: `fused` (split-KV over the page table, pages read
    /// in place), `gather` (copy the pages, then attend: the baseline) or `auto` (fused
    /// wherever it supports the model). Default: $PAGODA_PAGED_DECODE, else auto.
    #[arg(long, value_name = "auto|fused|gather")]
    pub paged_decode: Option<String>,
    /// Speculative decoding: `off`, `ngram` (prompt lookup: guesses the continuation of the
    /// longest recent suffix seen before; no second model) or `draft` (a draft model,
    /// --model-draft; giving one alone turns this on). Under the default rule the output is
    /// exactly plain decoding's (the guesses are verified against the request's own sampler;
    /// on CUDA bit for bit with --deterministic). Default: $PAGODA_SPEC, else off.
    #[arg(long, value_name = "off|ngram|draft")]
    pub spec: Option<String>,
    /// The draft model of speculative decoding (llama-server's `-md`): a .gguf file or a
    /// Hugging Face directory whose vocabulary matches the model's. It runs on the same
    /// device with its own KV pool; its weights as stored.
    #[arg(long = "model-draft", value_name = "FILE")]
    pub model_draft: Option<PathBuf>,
    /// How guesses are verified: `invariant` (the default: a guess stands while it equals
    /// the request's own seeded draw, so outputs equal plain decoding's) or `leviathan`
    /// (accept with probability min(1, p/q): plain decoding's distribution, not its tokens).
    #[arg(long, value_name = "invariant|leviathan")]
    pub spec_rule: Option<String>,
    /// The draft model stops drafting at a token it drew with probability below P
    /// (llama-server's spelling; default 0: never).
    #[arg(long, value_name = "P")]
    pub draft_p_min: Option<String>,
    /// Most guessed tokens per request and step (llama-server's spelling; default 4).
    #[arg(long, value_name = "N")]
    pub draft_max: Option<String>,
    /// Fewest guessed tokens worth a draft (default 1).
    #[arg(long, value_name = "N")]
    pub draft_min: Option<String>,
    /// Shortest suffix the n-gram proposer matches (default 2).
    #[arg(long, value_name = "N")]
    pub spec_ngram_min: Option<String>,
    /// Longest suffix the n-gram proposer matches, tried first (default 4).
    #[arg(long, value_name = "N")]
    pub spec_ngram_max: Option<String>,
    /// Render chats with the Jinja template in FILE instead of the model's (llama.cpp's
    /// spelling; the template sees `messages`, `tools`, `add_generation_prompt`,
    /// `bos_token` and `eos_token`, as transformers passes them).
    #[arg(long, value_name = "FILE")]
    pub chat_template_file: Option<PathBuf>,
}

/// The settings the model flags set: each wins over its environment variable.
pub fn model_flag_values(args: &ModelArgs) -> Vec<FlagValue> {
    let mut flags = Vec::new();
    let mut push = |setting, flag, value: Option<String>| {
        if let Some(value) = value {
            flags.push(FlagValue {
                setting,
                flag,
                value,
            })
        }
    };
    push(
        "PAGODA_MODEL",
        "--model",
        args.model.as_ref().map(|p| p.display().to_string()),
    );
    push("PAGODA_ATTENTION", "--attention", args.attention.clone());
    push(
        "PAGODA_TENSOR_PARALLEL_SIZE",
        "--tensor-parallel-size",
        args.tensor_parallel_size.clone(),
    );
    push("PAGODA_SAMPLER", "--sampler", args.sampler.clone());
    push(
        "PAGODA_CACHE_TYPE_K",
        "--cache-type-k",
        args.cache_type_k.clone(),
    );
    push(
        "PAGODA_CACHE_TYPE_V",
        "--cache-type-v",
        args.cache_type_v.clone(),
    );
    push(
        "PAGODA_KV_CACHE_DTYPE",
        "--kv-cache-dtype",
        args.kv_cache_dtype.clone(),
    );
    push(
        "PAGODA_PAGED_DECODE",
        "--paged-decode",
        args.paged_decode.clone(),
    );
    push(
        "PAGODA_CUDA_GRAPHS",
        "--enforce-eager",
        args.enforce_eager.then(|| "off".to_owned()),
    );
    push(
        "PAGODA_SPARSE_ATTENTION",
        "--sparse-attention",
        args.sparse_attention.clone(),
    );
    push("PAGODA_SPEC", "--spec", args.spec.clone());
    push(
        "PAGODA_MODEL_DRAFT",
        "--model-draft",
        args.model_draft.as_ref().map(|p| p.display().to_string()),
    );
    push("PAGODA_SPEC_RULE", "--spec-rule", args.spec_rule.clone());
    push(
        "PAGODA_DRAFT_P_MIN",
        "--draft-p-min",
        args.draft_p_min.clone(),
    );
    push("PAGODA_DRAFT_MAX", "--draft-max", args.draft_max.clone());
    push("PAGODA_DRAFT_MIN", "--draft-min", args.draft_min.clone());
    push(
        "PAGODA_SPEC_NGRAM_MIN",
        "--spec-ngram-min",
        args.spec_ngram_min.clone(),
    );
    push(
        "PAGODA_SPEC_NGRAM_MAX",
        "--spec-ngram-max",
        args.spec_ngram_max.clone(),
    );
    push(
        "PAGODA_DETERMINISTIC",
        "--deterministic",
        args.deterministic.then(|| "on".to_owned()),
    );
    push(
        "PAGODA_CUDA_WARMUP",
        "--no-warmup",
        args.no_warmup.then(|| "off".to_owned()),
    );
    flags
}

/// The model source for an explicit path, with a hint when the path is a directory that is not
/// a Hugging Face model or a file that belongs inside one.
pub fn model_source(path: &Path) -> Result<ModelSource> {
    if path.is_dir() && !path.join("config.json").is_file() {
        bail!(
            "{} is a directory but not a Hugging Face model directory (it has no config.json); \
             pass a .gguf file or a directory holding config.json, tokenizer.json and *.safetensors",
            path.display()
        );
    }
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let belongs_in_hf_dir = file_name.ends_with(".safetensors")
        || file_name.ends_with(".safetensors.index.json")
        || matches!(
            file_name.as_str(),
            "config.json" | "tokenizer.json" | "tokenizer_config.json"
        );
    if path.is_file() && belongs_in_hf_dir {
        let parent = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        bail!(
            "{} is part of a Hugging Face model directory; pass the directory instead: -m {}",
            path.display(),
            parent.display()
        );
    }
    ModelSource::from_path(path).map_err(anyhow::Error::msg)
}
