//! `pagoda-dynamo`: pagoda as a worker of NVIDIA Dynamo (issue 41).
//!
//! It implements `dynamo-backend-common`'s `LLMEngine` contract over pagoda's engine loop (the
//! one `pagoda serve` runs) and hands it to Dynamo's `run`, which registers the model with
//! Dynamo's discovery and serves the `generate` endpoint. Dynamo's OpenAI frontend
//! (`python -m dynamo.frontend`) tokenizes, applies the chat template, routes and detokenizes;
//! this worker receives token ids and streams token ids back.
//!
//! Built on its own, not as part of pagoda's workspace: Dynamo's runtime brings about 880
//! crates (and needs `--cfg tokio_unstable` and `protoc`), so pagoda's default build, its CI
//! and its lockfile stay as they are. `pagoda dynamo-worker ARGS` runs this binary when it
//! sits next to `pagoda` or on PATH; build it with
//! `cd crates/dynamo && cargo build --release` (the `cuda` feature adds the GPU backend).
//!
//! What works: registration (context length, the KV page size as Dynamo's block size, the
//! pool's pages, the most sequences and the step's token budget), streaming generation with
//! temperature, top_p, top_k, min_p, the three penalties and the seed, max_tokens, stop and EOS
//! tokens (hidden or visible) and ignore_eos, usage on the terminal chunk, and cancellation
//! (the context stopped, or the stream dropped). Unsupported request fields (n > 1, beam
//! search, logprobs, guided decoding, min_tokens, multimodal input, disaggregation) are
//! refused with an `InvalidArgument` naming them.
//!
//! KV-aware routing: the engine loop's prefix-cache changes go to Dynamo's KV event publisher
//! (`feed.rs`: a page's chained key as the block hash, Dynamo's own hash of its tokens), its load
//! (pages used of the pool) to the load publisher, and pagoda's counters into the runtime's
//! `/metrics`. Tried with file discovery, the TCP request plane and ZMQ events
//! (`scripts/test-dynamo.sh`), and with requests and events over NATS; not yet with etcd
//! discovery, nor on CUDA.

mod card;
mod engine;
mod feed;
mod mapping;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Parser;
use dynamo_backend_common::{CommonArgs, DisaggregationMode, WorkerConfig};
use pagoda_engine::{
    load_model, Device, Engine, EngineConfig, EngineSettings, LoadOptions, ModelSource,
};
use pagoda_models::llama::{AttentionPolicy, WeightPrecision};
use pagoda_models::llama_cuda::DType;
use pagoda_server::metrics::Metrics;

/// File name of pagoda's default model under `models/`.
const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// pagoda as a worker of NVIDIA Dynamo (start Dynamo's frontend separately).
#[derive(Parser, Debug)]
#[command(name = "pagoda-dynamo", version)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    /// The model pagoda runs: a .gguf file or a Hugging Face directory. Default: $PAGODA_MODEL,
    /// else the default model under ./models.
    #[arg(short = 'm', long)]
    model: Option<PathBuf>,
    /// The Hugging Face directory Dynamo's frontend reads the tokenizer and chat template from.
    /// Default: the model's directory for an HF model; for a GGUF, a card written from its
    /// metadata into --card-dir.
    #[arg(long)]
    model_path: Option<PathBuf>,
    /// Where a GGUF's card is written. Default: $TMPDIR/pagoda-dynamo-cards/<model stem>.
    #[arg(long)]
    card_dir: Option<PathBuf>,
    /// Name served to clients. Default: the model file's stem.
    #[arg(long)]
    served_model_name: Option<String>,
    /// auto, cpu or cuda.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Compute threads (default: every core).
    #[arg(short = 't', long)]
    threads: Option<usize>,
    /// Context size in tokens (default: min(model, 4096)).
    #[arg(short = 'c', long)]
    ctx_size: Option<usize>,
    /// Sequences decoded together at most.
    #[arg(long, default_value_t = 4)]
    parallel: usize,
    /// Requests that may wait for a free sequence.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Token budget of one engine step.
    #[arg(short = 'b', long, default_value_t = 512)]
    batch_size: usize,
    /// Tokens per KV page (advertised to Dynamo as its KV block size).
    #[arg(long, default_value_t = 16)]
    page_size: usize,
    /// KV pages in the pool. Default: --parallel full contexts.
    #[arg(long)]
    kv_pages: Option<usize>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.common.disaggregation_mode != DisaggregationMode::Aggregated {
        bail!("pagoda's Dynamo worker runs aggregated only (no prefill/decode/encode roles yet)");
    }
    if args.parallel == 0 || args.batch_size == 0 || args.kv_pages == Some(0) {
        bail!("--parallel, --batch-size and --kv-pages must be at least 1");
    }
    if args.page_size == 0 || args.page_size > 1024 {
        bail!("--page-size must be between 1 and 1024");
    }
    if let Some(threads) = args.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .build_global()
            .context("configuring the thread pool")?;
    }
    let source = model_source(args.model.as_deref())?;
    let device = match args.device.as_str() {
        "cpu" => Device::Cpu,
        "cuda" | "gpu" => Device::Cuda { dtype: DType::BF16 },
        "auto" => match pagoda_cuda::available() {
            Ok(_) => Device::Cuda { dtype: DType::BF16 },
            Err(_) => Device::Cpu,
        },
        other => bail!("unknown --device `{other}` (use auto, cpu or cuda)"),
    };
    let options = LoadOptions {
        precision: WeightPrecision::AsStored,
        device,
    };
    let loaded = load_model(&source, options, &mut |_, _| {}).map_err(anyhow::Error::msg)?;
    let model_max = loaded.model.config().max_position_embeddings;
    let ctx = match args.ctx_size {
        Some(n) if n == 0 || n > model_max => bail!("--ctx-size must be in 1..={model_max}"),
        Some(n) => n,
        None => model_max.min(4096),
    };
    let mut eos = loaded.tokenizer.end_of_generation_ids();
    for &id in &loaded.generation.eos_token_ids {
        if !eos.contains(&id) {
            eos.push(id);
        }
    }
    let stem = source
        .path()
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let card = match (&args.model_path, &source) {
        (Some(dir), _) => dir.clone(),
        (None, ModelSource::HfDir(dir)) => dir.clone(),
        (None, ModelSource::Gguf(path)) => {
            let dir = args
                .card_dir
                .clone()
                .unwrap_or_else(|| card::default_card_dir(path));
            let facts = card::CardFacts {
                tokenizer: &loaded.tokenizer,
                chat_template: loaded.tokenizer.chat_template(),
                eos_ids: &eos,
                context_length: ctx,
            };
            card::write_gguf_card(path, &dir, &facts)?;
            dir
        }
    };
    let defaults = mapping::sampling_defaults(&loaded.generation);
    let num_pages = args
        .kv_pages
        .unwrap_or(ctx.div_ceil(args.page_size) * args.parallel);
    let config = EngineConfig {
        page_size: args.page_size,
        num_pages,
        max_batch_tokens: args.batch_size,
        max_context: ctx,
        attention: AttentionPolicy::Auto,
        sampler: pagoda_ops::sampling::SamplerKind::from_config(pagoda_config::global()),
        cuda_graphs: pagoda_config::global().on("PAGODA_CUDA_GRAPHS"),
        paged_decode: pagoda_models::llama_cuda::PagedDecodeMode::from_config(
            pagoda_config::global(),
        ),
        kv_types: Default::default(),
    };
    let settings = EngineSettings::from_config(pagoda_config::global());
    let engine =
        Engine::with_settings(loaded.model, config, settings).map_err(anyhow::Error::msg)?;
    // The prefix cache's changes feed Dynamo's KV router (see `feed.rs`).
    let (kv_events, kv_feed) = tokio::sync::mpsc::unbounded_channel();
    let metrics = Arc::new(Metrics::default());
    let (handle, thread) = pagoda_server::worker::spawn_worker_with(
        engine,
        args.parallel,
        args.max_queue,
        metrics.clone(),
        pagoda_server::worker::WorkerOptions {
            kv_events: Some(kv_events),
        },
    )?;
    let model_name = args.served_model_name.clone().unwrap_or(stem);
    eprintln!(
        "pagoda-dynamo: {} as `{model_name}`, card {}, {ctx} tokens of context, {num_pages} pages of {}",
        source.path().display(),
        card.display(),
        args.page_size
    );
    let limits = mapping::Limits {
        max_context: ctx,
        model_eos: eos,
        defaults,
    };
    let registration = engine::Registration {
        model: model_name.clone(),
        context_length: ctx,
        page_size: args.page_size,
        num_pages,
        parallel: args.parallel,
        batch_tokens: args.batch_size,
    };
    let engine = engine::PagodaEngine::new(handle, thread, limits, registration, kv_feed, metrics);
    let common = args.common;
    let worker = WorkerConfig {
        namespace: common.namespace,
        component: common.component,
        endpoint: common.endpoint,
        model_name: card.display().to_string(),
        served_model_name: Some(model_name),
        endpoint_types: common.endpoint_types,
        custom_jinja_template: common.custom_jinja_template,
        tool_call_parser: common.dyn_tool_call_parser,
        reasoning_parser: common.dyn_reasoning_parser,
        exclude_tools_when_tool_choice_none: common.exclude_tools_when_tool_choice_none,
        // No KV events are published yet, so there is no index to keep.
        enable_local_indexer: false,
        disaggregation_mode: common.disaggregation_mode,
        runtime: common.runtime,
        route_to_encoder: common.route_to_encoder,
        enable_rl: common.enable_rl,
        ..WorkerConfig::default()
    };
    dynamo_backend_common::run(Arc::new(engine), worker)
}

/// The model to run: the flag, $PAGODA_MODEL, or the default model under ./models (or next
/// to the executable's ancestors, as `pagoda` looks for it).
fn model_source(arg: Option<&std::path::Path>) -> Result<ModelSource> {
    let from_path = |path: PathBuf| {
        if path.is_dir() {
            ModelSource::HfDir(path)
        } else {
            ModelSource::Gguf(path)
        }
    };
    if let Some(path) = arg {
        return Ok(from_path(path.to_path_buf()));
    }
    if let Ok(path) = std::env::var("PAGODA_MODEL") {
        return Ok(from_path(PathBuf::from(path)));
    }
    let mut candidates = vec![PathBuf::from("models").join(DEFAULT_MODEL_FILE)];
    if let Ok(exe) = std::env::current_exe() {
        for ancestor in exe.ancestors().skip(1).take(5) {
            candidates.push(ancestor.join("models").join(DEFAULT_MODEL_FILE));
        }
    }
    match candidates.into_iter().find(|p| p.is_file()) {
        Some(path) => Ok(ModelSource::Gguf(path)),
        None => bail!(
            "no model given and the default model ({DEFAULT_MODEL_FILE}) is not under ./models; \
             pass -m MODEL"
        ),
    }
}
