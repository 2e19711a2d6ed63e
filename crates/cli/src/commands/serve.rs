//! `pagoda serve`: the OpenAI-compatible HTTP server (llama-server flag spellings).

use anyhow::{bail, Result};
use clap::Args;
use pagoda_engine::{Engine, EngineConfig};
use pagoda_server::{ServerConfig, TextModel};

use crate::common::{self, ModelArgs, SamplingArgs};

/// Flags of `pagoda serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Server-wide sampling defaults (a request's own fields win).
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Sequences decoded together at most (llama-server's `-np N` works too); more requests
    /// wait in the queue [default: 4].
    #[arg(
        short = 'n',
        long = "parallel",
        value_name = "N",
        allow_negative_numbers = true
    )]
    pub parallel: Option<String>,
    /// The value of `-np N` (clap reads `-np` as `-n p`).
    #[arg(hide = true)]
    pub trailing: Vec<String>,
    /// Requests that may wait for a free sequence before new ones get 429.
    #[arg(long, default_value_t = 64, allow_negative_numbers = true)]
    pub max_queue: usize,
    /// Require `Authorization: Bearer KEY` on /v1/ endpoints. Also $PAGODA_API_KEY.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Token budget of one engine step (prefill chunks + decode tokens).
    #[arg(
        short = 'b',
        long = "batch-size",
        default_value_t = 512,
        allow_negative_numbers = true
    )]
    pub batch_size: usize,
    /// KV-cache pages in the pool. Default: enough for --parallel full contexts.
    #[arg(
        long,
        conflicts_with = "kv_memory_fraction",
        allow_negative_numbers = true
    )]
    pub kv_pages: Option<usize>,
    /// KV pool size as a fraction of the memory left after the weights (0 < f <= 0.9).
    #[arg(long, allow_negative_numbers = true)]
    pub kv_memory_fraction: Option<f64>,
    /// Model name served in /v1/models and answers. Default: the model file's stem.
    #[arg(short = 'a', long)]
    pub alias: Option<String>,
    /// Largest request body in bytes (larger: 413).
    #[arg(long, default_value_t = 4 << 20, allow_negative_numbers = true)]
    pub max_body_bytes: usize,
}

/// Runs `pagoda serve`.
pub fn run(args: ServeArgs) -> Result<()> {
    let parallel = parallel_flag(&args)?;
    let api_key = args
        .api_key
        .clone()
        .or_else(|| std::env::var("PAGODA_API_KEY").ok())
        .filter(|key| !key.is_empty());
    if args.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    if args.kv_pages == Some(0) {
        bail!("--kv-pages must be at least 1");
    }
    if let Some(fraction) = args.kv_memory_fraction {
        if !(fraction > 0.0 && fraction <= 0.9) {
            bail!("--kv-memory-fraction must be in (0, 0.9], got {fraction}");
        }
    }
    args.sampling.params()?; // fail fast on bad flags, before loading
    let loaded = common::load(&args.model)?;
    let ctx = common::context_size(&args.model, &loaded)?;
    let sampling_defaults = args.sampling.resolve(&loaded.generation)?;
    let stop_tokens = common::stop_tokens(&loaded.tokenizer, &loaded.generation);
    let file_name = loaded
        .source
        .path()
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".to_owned());
    let stem = file_name
        .strip_suffix(".gguf")
        .unwrap_or(&file_name)
        .to_owned();
    let model_name = args.alias.clone().unwrap_or_else(|| stem.clone());
    let source_path = loaded.source.path().display().to_string();

    // The engine: sized like `common::engine`, with the server's budget and pool flags.
    let page_size = args.model.page_size;
    if page_size == 0 || page_size > 1024 {
        bail!("--page-size must be between 1 and 1024");
    }
    // K and V, every layer, in the backend's KV dtype.
    let page_bytes = loaded.model.kv_page_bytes(page_size);
    let pages_per_sequence = ctx.div_ceil(page_size);
    let num_pages = match (args.kv_pages, args.kv_memory_fraction) {
        (Some(pages), _) => pages,
        (None, Some(fraction)) => pages_for_fraction(fraction, page_bytes)?,
        (None, None) => pages_per_sequence * parallel,
    };
    if num_pages < pages_per_sequence {
        eprintln!(
            "warning: {num_pages} KV pages hold less than one full context ({pages_per_sequence} pages of {page_size} tokens)"
        );
    }
    let config = EngineConfig {
        page_size,
        num_pages,
        max_batch_tokens: args.batch_size,
        max_context: ctx,
        attention: common::attention_policy(&args.model.attention)?,
        sampler: common::sampler_kind(&args.model)?,
        cuda_graphs: common::cuda_graphs(&args.model)?,
        paged_decode: common::paged_decode(&args.model)?,
    };
    let device_name = loaded.model.device_name();
    let engine = Engine::new(loaded.model, config.clone()).map_err(anyhow::Error::msg)?;

    eprintln!("pagoda serve");
    eprintln!("  model        {source_path} (served as `{model_name}`)");
    eprintln!("  device       {device_name}");
    eprintln!("  context      {ctx} tokens");
    eprintln!(
        "  parallel     {} sequences, queue up to {}",
        parallel, args.max_queue
    );
    eprintln!("  batch        {} tokens per step", config.max_batch_tokens);
    eprintln!(
        "  kv cache     {} pages x {} tokens ({:.1} MiB)",
        config.num_pages,
        config.page_size,
        engine.kv_bytes() as f64 / (1 << 20) as f64
    );
    eprintln!("  attention    {}", common::policy_name(config.attention));
    eprintln!("  sampler      {}", config.sampler);
    eprintln!(
        "  sampling     temp {} top_k {} top_p {} min_p {} repeat_penalty {}",
        sampling_defaults.temperature,
        sampling_defaults.top_k,
        sampling_defaults.top_p,
        sampling_defaults.min_p,
        sampling_defaults.repetition_penalty
    );
    eprintln!(
        "  api key      {}",
        if api_key.is_some() {
            "required"
        } else {
            "none"
        }
    );

    let server_config = ServerConfig {
        host: args.host.clone(),
        port: args.port,
        model_name,
        model_aliases: vec![file_name, stem],
        context_size: ctx,
        parallel,
        max_queue: args.max_queue,
        api_key,
        max_body_bytes: args.max_body_bytes,
        sampling_defaults,
    };
    let text = TextModel {
        tokenizer: loaded.tokenizer,
        chat_template: loaded.chat_template,
        stop_tokens,
    };
    pagoda_server::serve(server_config, text, engine, |url| {
        eprintln!("listening on {url} (OpenAI API at {url}/v1)");
    })
    .map_err(anyhow::Error::msg)
}

/// The sequence count from `--parallel N`, `-n N` or `-np N` (default 4).
fn parallel_flag(args: &ServeArgs) -> Result<usize> {
    let mut trailing = args.trailing.iter();
    let text = match args.parallel.as_deref() {
        None => None,
        Some("p") => match trailing.next() {
            Some(value) => Some(value.clone()),
            None => bail!("-np needs a value: -np N"),
        },
        Some(value) => Some(value.strip_prefix('p').unwrap_or(value).to_owned()),
    };
    if let Some(extra) = trailing.next() {
        bail!("unexpected argument `{extra}`");
    }
    let parallel = match text {
        None => 4,
        Some(text) => text
            .parse::<usize>()
            .map_err(|_| anyhow::anyhow!("--parallel must be a whole number, got `{text}`"))?,
    };
    if parallel == 0 {
        bail!("--parallel must be at least 1");
    }
    Ok(parallel)
}

/// Pages for `fraction` of the memory available now (from /proc/meminfo), at `page_bytes` each.
fn pages_for_fraction(fraction: f64, page_bytes: usize) -> Result<usize> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let available_kib = meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemAvailable:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse::<u64>().ok());
    let Some(available_kib) = available_kib else {
        bail!("--kv-memory-fraction: cannot read MemAvailable from /proc/meminfo; pass --kv-pages instead");
    };
    let bytes = (available_kib as f64 * 1024.0 * fraction) as usize;
    Ok((bytes / page_bytes.max(1)).max(1))
}
