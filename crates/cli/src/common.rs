//! Flags and helpers shared by the subcommands: model resolution and loading, sampling flags,
//! engine sizing.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

pub use crate::model_args::{model_flag_values, model_source, ModelArgs};
pub use crate::sampling_args::SamplingArgs;
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use pagoda_config::{Config, FlagValue};
use pagoda_engine::{
    load_model, Backend, Device, Engine, EngineConfig, EngineSettings, LoadOptions, LoadedModel,
    ModelSource,
};
use pagoda_models::chat_template::ChatTemplate;
use pagoda_models::hf::GenerationDefaults;
use pagoda_models::llama::{AttentionPolicy, WeightPrecision};
use pagoda_models::llama_cuda::{DType, PagedDecodeMode};
use pagoda_models::tokenizer::Tokenizer;
use pagoda_ops::attention::{AttentionPath, KvCacheTypes, KvType};
use pagoda_ops::sampling::SamplerKind;

/// File name of the default model under `models/`.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Resolves the settings from `flags` and the environment once and installs them for the
/// process: a bad value is an error naming the allowed ones; a `PAGODA_*` variable that is no
/// setting gets a warning.
pub fn configure(flags: &[FlagValue]) -> Result<()> {
    let config = Config::from_process(flags).map_err(|e| anyhow::anyhow!("{e}"))?;
    pagoda_ops::attention::SparseAttention::from_config(&config).map_err(anyhow::Error::msg)?;
    for warning in config.unknown_variable_warnings() {
        tracing::warn!("{warning}");
    }
    if pagoda_config::install(config).is_err() {
        bail!("the configuration was read before it was resolved (a bug: please report it)");
    }
    Ok(())
}

/// The CUDA decode attention path: `--paged-decode`, else `PAGODA_PAGED_DECODE`, else auto.
pub fn paged_decode() -> PagedDecodeMode {
    PagedDecodeMode::from_config(pagoda_config::global())
}

/// Whether CUDA graphs are on: off with `--enforce-eager` or `PAGODA_CUDA_GRAPHS=off`.
pub fn cuda_graphs() -> bool {
    pagoda_config::global().on("PAGODA_CUDA_GRAPHS")
}

/// The device the flags ask for, resolved: `auto` probes for a usable GPU. A tensor-parallel
/// size over 1 runs on the CPU only (its ranks as threads); CUDA refuses it here, and sparse
/// decode (`--sparse-attention`) is refused with either.
pub fn resolve_device(args: &ModelArgs) -> Result<Device> {
    let device = resolve_one_device(args)?;
    let ranks = pagoda_config::global()
        .number("PAGODA_TENSOR_PARALLEL_SIZE")
        .unwrap_or(1);
    if let Device::Cuda { .. } = device {
        if ranks > 1 {
            bail!(
                "-tp {ranks}: tensor parallelism on CUDA needs the NCCL increment (issue 40); use --device cpu or -tp 1"
            );
        }
    }
    // Sparse decode is refused here, before the model loads, where the flags alone show it
    // cannot run (the engine checks the model's attention, and again the rest, when made).
    let sparse = pagoda_ops::attention::SparseAttention::from_config(pagoda_config::global());
    if matches!(sparse, Ok(Some(_))) {
        pagoda_engine::check_sparse_attention_setup(ranks as usize, false)
            .map_err(anyhow::Error::msg)?;
    }
    Ok(device)
}

/// [`resolve_device`] before the tensor-parallel check.
fn resolve_one_device(args: &ModelArgs) -> Result<Device> {
    let dtype = match args.dtype.as_str() {
        "bf16" => DType::BF16,
        "f32" => DType::F32,
        other => bail!("unknown --dtype `{other}` (use bf16 or f32)"),
    };
    match args.device.as_str() {
        "cpu" => Ok(Device::Cpu),
        "cuda" | "gpu" => match pagoda_cuda::available() {
            Ok(info) => {
                tracing::info!("device: {info}");
                Ok(Device::Cuda { dtype })
            }
            Err(error) => bail!("--device cuda: {error}"),
        },
        "auto" => match pagoda_cuda::available() {
            Ok(info) => {
                eprintln!("device: {info}");
                Ok(Device::Cuda { dtype })
            }
            Err(pagoda_cuda::CudaError::NotCompiled) => Ok(Device::Cpu),
            Err(error) => {
                eprintln!("device: no usable CUDA GPU ({error}); running on the CPU");
                Ok(Device::Cpu)
            }
        },
        other => bail!("unknown --device `{other}` (use auto, cpu or cuda)"),
    }
}

/// The sampler from the flag or $PAGODA_SAMPLER (the flag wins); fused when neither.
pub fn sampler_kind() -> SamplerKind {
    SamplerKind::from_config(pagoda_config::global())
}

/// Tokenizes a prompt; a chat-templated one through [`Tokenizer::encode_chat`].
pub fn encode_prompt(tokenizer: &Tokenizer, text: &str, templated: bool) -> Result<Vec<u32>> {
    let ids = if templated {
        tokenizer.encode_chat(text)
    } else {
        tokenizer.encode(text, true)
    };
    ids.map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))
}

/// The tokens that end generation: the tokenizer's end-of-generation set plus any
/// `eos_token_id` the model's generation config names.
pub fn stop_tokens(
    loaded_tokenizer: &pagoda_models::tokenizer::Tokenizer,
    model: &GenerationDefaults,
) -> Vec<u32> {
    let mut stop = loaded_tokenizer.end_of_generation_ids();
    for &id in &model.eos_token_ids {
        if !stop.contains(&id) {
            stop.push(id);
        }
    }
    stop
}

/// Sets up logging to stderr (WARN by default so one-time path lines show with -v only;
/// progress of long start-up work, target `pagoda_progress`, shows at INFO; with
/// `access_log`, the server's per-request lines, target `pagoda_access`, show too).
pub fn init_logging(verbose: u8, access_log: bool) {
    let level = match verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let default = match (verbose, access_log) {
        (0, true) => format!("{level},pagoda_progress=info,pagoda_access=info"),
        (0, false) => format!("{level},pagoda_progress=info"),
        _ => level.to_owned(),
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .try_init();
}

/// The model to use: the flag, $PAGODA_MODEL, or the default model under `models/`.
pub fn resolve_model(arg: &Option<PathBuf>) -> Result<ModelSource> {
    if let Some(path) = arg {
        return model_source(path);
    }
    if let Some(path) = pagoda_config::global().text("PAGODA_MODEL") {
        return model_source(Path::new(path)).context("$PAGODA_MODEL");
    }
    let mut candidates = vec![PathBuf::from("models").join(DEFAULT_MODEL_FILE)];
    if let Ok(exe) = std::env::current_exe() {
        // target/{debug,release}/pagoda -> <repo>/models
        for ancestor in exe.ancestors().skip(1).take(4) {
            candidates.push(ancestor.join("models").join(DEFAULT_MODEL_FILE));
        }
    }
    match candidates.iter().find(|p| p.is_file()) {
        Some(path) => Ok(ModelSource::Gguf(path.clone())),
        None => bail!(
            "no model given and the default model ({DEFAULT_MODEL_FILE}) is not under ./models; \
             run `scripts/fetch-model.sh` to fetch it, or pass -m MODEL"
        ),
    }
}

/// Applies the thread-count flag to the global pool.
pub fn configure_threads(threads: Option<usize>) -> Result<()> {
    if let Some(n) = threads {
        if n == 0 {
            bail!("--threads must be at least 1");
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if n > cores {
            eprintln!(
                "warning: --threads {n} is more than the {cores} cores this process may use; \
                 threads beyond the cores only wait for each other (much slower)"
            );
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("configuring the thread pool")?;
    }
    Ok(())
}

/// The attention policy from the flag or $PAGODA_ATTENTION (the flag wins).
pub fn attention_policy() -> AttentionPolicy {
    match pagoda_config::global().word("PAGODA_ATTENTION") {
        "split-kv" => AttentionPolicy::Force(AttentionPath::SplitKv),
        "gather" => AttentionPolicy::Force(AttentionPath::Gather),
        _ => AttentionPolicy::Auto,
    }
}

/// The KV cache types from -ctk/-ctv or $PAGODA_CACHE_TYPE_K/_V (the flags win; the values
/// were checked against the registry when the configuration was resolved).
pub fn kv_cache_types() -> KvCacheTypes {
    let config = pagoda_config::global();
    // --kv-cache-dtype fp8 (vLLM's alias) is both flags at once.
    if matches!(config.word("PAGODA_KV_CACHE_DTYPE"), "fp8" | "fp8_e4m3") {
        return KvCacheTypes {
            k: KvType::Fp8,
            v: KvType::Fp8,
        };
    }
    let kv_type = |setting| KvType::parse(config.word(setting)).unwrap_or_default();
    KvCacheTypes {
        k: kv_type("PAGODA_CACHE_TYPE_K"),
        v: kv_type("PAGODA_CACHE_TYPE_V"),
    }
}

/// The name of a policy for logs and reports.
pub fn policy_name(policy: AttentionPolicy) -> &'static str {
    match policy {
        AttentionPolicy::Auto => "auto",
        AttentionPolicy::Force(path) => path.name(),
    }
}

/// Loads the model with a progress bar on stderr (hidden when stderr is not a terminal).
pub fn load(args: &ModelArgs) -> Result<LoadedModel> {
    configure_threads(args.threads)?;
    // Read before the (slow) load, so a wrong path fails at once.
    let template_source = read_chat_template_file(args)?;
    let source = resolve_model(&args.model)?;
    let started = Instant::now();
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} layers")
            .expect("static template")
            .progress_chars("=> "),
    );
    bar.set_message(
        source
            .path()
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
    );
    let precision = if args.exact {
        WeightPrecision::F32
    } else {
        WeightPrecision::AsStored
    };
    let device = resolve_device(args)?;
    if args.exact && device != Device::Cpu {
        bail!("--exact is the CPU parity mode; on the GPU use --dtype f32 (or --device cpu)");
    }
    let options = LoadOptions { precision, device };
    let mut progress = |done: usize, total: usize| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    };
    let loaded = match load_model(&source, options, &mut progress) {
        Ok(loaded) => loaded,
        // `auto` chose the GPU but this model cannot run there (an architecture or tensor
        // type the CUDA backend lacks): say why and run on the CPU instead.
        Err(error) if args.device == "auto" && device != Device::Cpu => {
            eprintln!("device: the model cannot run on the GPU ({error}); running on the CPU");
            let cpu = LoadOptions {
                precision,
                device: Device::Cpu,
            };
            load_model(&source, cpu, &mut progress).map_err(anyhow::Error::msg)?
        }
        Err(error) => return Err(anyhow::Error::msg(error)),
    };
    bar.finish_and_clear();
    let mut loaded = loaded;
    apply_chat_template_file(args, &mut loaded, template_source)?;
    tracing::info!(
        "loaded {} on {} in {:.2}s ({} weights, {:.1} MiB)",
        source.path().display(),
        loaded.model.device_name(),
        started.elapsed().as_secs_f64(),
        if args.exact { "f32" } else { "as stored" },
        loaded.model.weight_bytes() as f64 / (1 << 20) as f64
    );
    Ok(loaded)
}

/// `--chat-template-file`'s text, read before the (slow) load so a wrong path fails at once.
fn read_chat_template_file(args: &ModelArgs) -> Result<Option<String>> {
    args.chat_template_file
        .as_ref()
        .map(|path| {
            std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("--chat-template-file {}: {e}", path.display()))
        })
        .transpose()
}

/// `--chat-template-file`'s template (read before loading: `source`) in place of the model's.
fn apply_chat_template_file(
    args: &ModelArgs,
    loaded: &mut LoadedModel,
    source: Option<String>,
) -> Result<()> {
    if let (Some(template), Some(path)) = (source, &args.chat_template_file) {
        let (bos, eos) = (loaded.tokenizer.bos_token(), loaded.tokenizer.eos_token());
        loaded.chat_template = ChatTemplate::new(&template, bos.as_deref(), eos.as_deref())
            .map_err(|e| anyhow::anyhow!("--chat-template-file {}: {e}", path.display()))?;
        loaded.chat_template_from_model = false;
        tracing::info!("chat template: {}", path.display());
    }
    Ok(())
}

/// Random weights of `spec` (a built-in architecture or a config.json) served with the
/// tokenizer and chat template of the model `args` names (the default model when none), whose
/// vocabulary replaces the architecture's (`pagoda serve --random-weights`).
pub fn load_random_served(args: &ModelArgs, spec: &str) -> Result<LoadedModel> {
    configure_threads(args.threads)?;
    if args.exact {
        bail!("--exact and --random-weights do not go together: random weights are f32 on the CPU already");
    }
    let template_source = read_chat_template_file(args)?;
    let source = resolve_model(&args.model)?;
    let device = resolve_device(args)?;
    let options = LoadOptions {
        precision: WeightPrecision::F32,
        device,
    };
    let started = Instant::now();
    let mut loaded = pagoda_engine::load_random_served(spec, 1, &source, options, &mut |_, _| {})
        .map_err(anyhow::Error::msg)?;
    apply_chat_template_file(args, &mut loaded, template_source)?;
    tracing::info!(
        "random weights of {spec} (vocabulary {} from {}'s tokenizer) on {} in {:.2}s \
         ({:.1} MiB)",
        loaded.model.config().vocab_size,
        source.path().display(),
        loaded.model.device_name(),
        started.elapsed().as_secs_f64(),
        loaded.model.weight_bytes() as f64 / (1 << 20) as f64
    );
    Ok(loaded)
}

/// The context size to use: the flag (bounded by the model) or min(model, 4096).
pub fn context_size(args: &ModelArgs, loaded: &LoadedModel) -> Result<usize> {
    checked_context_size(args.ctx_size, loaded.model.config().max_position_embeddings)
}

/// Context size: `requested` if given (at least 1 and at most `model_max`), else min(model_max, 4096).
pub fn checked_context_size(requested: Option<usize>, model_max: usize) -> Result<usize> {
    match requested {
        Some(0) => bail!(
            "--ctx-size must be at least 1 (omit it to use min(model context, 4096) = {})",
            model_max.min(4096)
        ),
        Some(n) if n > model_max => {
            bail!("--ctx-size {n} exceeds the model's context length {model_max}; pass -c {model_max} or less")
        }
        Some(n) => Ok(n),
        None => Ok(model_max.min(4096)),
    }
}

/// Tokens one step may carry in the engines `generate`, `chat` and `bench` build.
pub const MAX_BATCH_TOKENS: usize = 512;

/// Builds an engine for `parallel` concurrent sequences of up to `ctx` tokens each, with
/// the draft model `--spec draft` asks for (`tokenizer`: the model's, to check the draft's
/// vocabulary against; `None` for random weights).
pub fn engine(
    model: Backend,
    args: &ModelArgs,
    ctx: usize,
    parallel: usize,
    tokenizer: Option<&Tokenizer>,
) -> Result<Engine> {
    if args.page_size == 0 || args.page_size > 1024 {
        bail!("--page-size must be between 1 and 1024");
    }
    let pages_per_sequence = ctx.div_ceil(args.page_size);
    let config = EngineConfig {
        page_size: args.page_size,
        num_pages: pages_per_sequence * parallel.max(1),
        max_batch_tokens: MAX_BATCH_TOKENS,
        max_context: ctx,
        attention: attention_policy(),
        sampler: sampler_kind(),
        cuda_graphs: cuda_graphs(),
        paged_decode: paged_decode(),
        kv_types: kv_cache_types(),
    };
    tracing::info!(
        "attention policy: {}, sampler: {}",
        policy_name(config.attention),
        config.sampler
    );
    let settings = EngineSettings::from_config(pagoda_config::global());
    let mut engine = Engine::with_settings(model, config, settings).map_err(anyhow::Error::msg)?;
    // On CUDA, the kernels compile and the graphs are captured here, before the first token
    // is timed (a `generate` pays the cost once, not inside its first request).
    engine.warm_up(&mut |_| {}).map_err(anyhow::Error::msg)?;
    crate::draft::attach_draft(&mut engine, args, tokenizer)?;
    Ok(engine)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagoda_ops::sampling::SamplingParams;

    fn no_flags() -> SamplingArgs {
        SamplingArgs {
            temperature: None,
            top_k: None,
            top_p: None,
            min_p: None,
            repeat_penalty: None,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: None,
        }
    }

    #[test]
    fn flags_override_model_defaults_which_override_builtins() {
        let model = GenerationDefaults {
            temperature: Some(0.6),
            top_p: Some(0.9),
            repetition_penalty: Some(1.05),
            ..GenerationDefaults::default()
        };
        let from_model = no_flags().resolve(&model).unwrap();
        assert_eq!(
            (
                from_model.temperature,
                from_model.top_p,
                from_model.repetition_penalty
            ),
            (0.6, 0.9, 1.05)
        );
        assert_eq!(from_model.top_k, SamplingParams::default().top_k);
        let flags = SamplingArgs {
            temperature: Some(0.0),
            top_p: Some(0.5),
            ..no_flags()
        };
        let from_flags = flags.resolve(&model).unwrap();
        assert_eq!((from_flags.temperature, from_flags.top_p), (0.0, 0.5));
        let builtin = no_flags().params().unwrap();
        assert_eq!(builtin.temperature, SamplingParams::default().temperature);
    }

    #[test]
    fn do_sample_false_means_greedy_unless_a_temperature_flag_is_given() {
        let model = GenerationDefaults {
            do_sample: Some(false),
            temperature: Some(0.7),
            ..GenerationDefaults::default()
        };
        assert_eq!(no_flags().resolve(&model).unwrap().temperature, 0.0);
        let flags = SamplingArgs {
            temperature: Some(1.0),
            ..no_flags()
        };
        assert_eq!(flags.resolve(&model).unwrap().temperature, 1.0);
    }

    #[test]
    fn invalid_model_defaults_are_reported() {
        let model = GenerationDefaults {
            top_p: Some(1.5),
            ..GenerationDefaults::default()
        };
        assert!(no_flags()
            .resolve(&model)
            .unwrap_err()
            .to_string()
            .contains("top_p"));
    }
}

#[cfg(test)]
mod prompt_tests {
    use super::*;

    #[test]
    fn a_template_that_writes_bos_does_not_get_a_second_one() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../models/tests/data/tokenizer/tiny_byte_level_bpe");
        let tokenizer = Tokenizer::from_hf_dir(&dir).unwrap();
        let bos = tokenizer.bos_id().unwrap();
        assert!(tokenizer.add_bos());
        // Plain prompts get the model's BOS.
        let plain = encode_prompt(&tokenizer, "hi", false).unwrap();
        assert_eq!(plain[0], bos);
        // A rendered template that starts with the BOS text keeps exactly one.
        let templated = encode_prompt(&tokenizer, "<s>[user] hi</s>", true).unwrap();
        assert_eq!(
            templated.iter().filter(|&&t| t == bos).count(),
            1,
            "{templated:?}"
        );
        assert_eq!(templated[0], bos);
        // A template without BOS text still gets the model's BOS.
        let without = encode_prompt(&tokenizer, "[user] hi", true).unwrap();
        assert_eq!(without[0], bos);
    }
}
