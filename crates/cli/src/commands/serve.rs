//! `pagoda serve`: the OpenAI-compatible HTTP server (llama-server flag spellings).

use anyhow::{bail, Result};
use clap::Args;
use pagoda_engine::{Engine, EngineConfig, EngineSettings};
use pagoda_models::random::RandomFormat;
use pagoda_server::auth::ApiKeys;
use pagoda_server::tls::TlsFiles;
use pagoda_server::{ConnectionLimits, ServerConfig, TextModel};

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
    /// wait in the queue.
    #[arg(
        long = "parallel",
        value_name = "N",
        default_value_t = 4,
        allow_negative_numbers = true
    )]
    pub parallel: usize,
    /// Requests that may wait for a free sequence before new ones get 429.
    #[arg(long, default_value_t = 64, allow_negative_numbers = true)]
    pub max_queue: usize,
    /// On SIGTERM or Ctrl-C, seconds to let running requests finish (new ones get 503 and
    /// /health says draining) before their streams end with an error. A second signal stops
    /// at once.
    #[arg(long, default_value_t = 30.0, value_name = "SECONDS")]
    pub shutdown_timeout: f64,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health and the chat page
    /// (/). Also $PAGODA_API_KEY. Prefer --api-key-file: a key on the command line shows in
    /// `ps`.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Accept the keys in FILE (one per line; blank lines and `#` comments skipped), with
    /// --api-key's too.
    #[arg(long, value_name = "FILE")]
    pub api_key_file: Option<std::path::PathBuf>,
    /// Serve /metrics without the API key (for a scraper on a trusted network).
    #[arg(long)]
    pub metrics_public: bool,
    /// Serve HTTPS with this PEM certificate chain (needs --ssl-key-file).
    #[arg(
        long,
        alias = "ssl-certfile",
        value_name = "FILE",
        requires = "ssl_key_file"
    )]
    pub ssl_cert_file: Option<std::path::PathBuf>,
    /// The PEM private key of --ssl-cert-file.
    #[arg(
        long,
        alias = "ssl-keyfile",
        value_name = "FILE",
        requires = "ssl_cert_file"
    )]
    pub ssl_key_file: Option<std::path::PathBuf>,
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
    /// Model name served in /v1/models and answers. Default: the model file's stem
    /// (`random-<ARCH>` with `--random-weights`).
    #[arg(short = 'a', long)]
    pub alias: Option<String>,
    /// Serve random weights of a built-in architecture (llama-3.1-8b, qwen2.5-7b,
    /// smollm2-135m, qwen3-30b-a3b, mixtral-8x7b, qwen3-moe-tiny, mixtral-tiny, deepseek-v2-lite,
    /// deepseek-v2-tiny, deepseek-v3-tiny, deepseek-v32-tiny) or of a config.json's shapes instead of the model's weights, with the
    /// model's tokenizer and chat template (`-m`, default the default model) and its
    /// vocabulary in place of the architecture's: serving measured at shapes whose weights are
    /// not on the machine (vLLM's `--load-format dummy`). The text is noise. A `:fp8` suffix
    /// makes the dense projections FP8 (e4m3) with a factor per row (as `bench`).
    #[arg(long, value_name = "ARCH[:fp8]|CONFIG[:fp8]")]
    pub random_weights: Option<String>,
    /// Largest request body in bytes (larger: 413).
    #[arg(long, default_value_t = 4 << 20, allow_negative_numbers = true)]
    pub max_body_bytes: usize,
    /// Let web pages from these origins call the API (comma-separated
    /// `scheme://host[:port]`, or `*` for any): CORS headers and preflight answers. Default:
    /// none, so browsers refuse cross-origin calls.
    #[arg(long, value_delimiter = ',', value_name = "ORIGINS")]
    pub cors: Vec<String>,
    /// How the model writes tool calls: `hermes` (`<tool_call>` JSON: Qwen2.5/Qwen3,
    /// Hermes) or `llama3_json` (Llama 3.1-3.3), vLLM's names. Default: read from the chat
    /// template; a template that never reads `tools` takes no tools either way.
    #[arg(long, value_name = "FORMAT", value_parser = parse_tool_format)]
    pub tool_call_parser: Option<pagoda_server::tools::ToolFormat>,
    /// Connections open at once; more wait until one closes (a guard against clients that
    /// open many and send nothing).
    #[arg(
        long,
        default_value_t = 512,
        value_name = "N",
        allow_negative_numbers = true
    )]
    pub max_connections: usize,
    /// Seconds a client may take to send a request's headers or its body, and to start the
    /// next request on a kept-alive connection; then the connection is closed (llama-server's
    /// `-to`). Generation itself is not limited.
    #[arg(
        long,
        visible_alias = "to",
        default_value_t = 60.0,
        value_name = "SECONDS"
    )]
    pub timeout: f64,
    /// Do not serve the chat page at `/` (llama-server's flag); the API is unchanged.
    #[arg(long)]
    pub no_webui: bool,
}

/// Runs `pagoda serve`.
pub fn run(args: ServeArgs) -> Result<()> {
    let parallel = args.parallel;
    if parallel == 0 {
        bail!("--parallel must be at least 1");
    }
    let api_keys = api_keys(&args)?;
    let tls = match (&args.ssl_cert_file, &args.ssl_key_file) {
        (Some(cert_file), Some(key_file)) => Some(
            TlsFiles {
                cert_file: cert_file.clone(),
                key_file: key_file.clone(),
            }
            .load()
            .map_err(anyhow::Error::msg)?,
        ),
        _ => None,
    };
    if args.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    if !(args.shutdown_timeout.is_finite() && (0.0..=86_400.0).contains(&args.shutdown_timeout)) {
        bail!(
            "--shutdown-timeout must be between 0 and 86400 seconds, got {}",
            args.shutdown_timeout
        );
    }
    if args.kv_pages == Some(0) {
        bail!("--kv-pages must be at least 1");
    }
    if args.max_connections == 0 {
        bail!("--max-connections must be at least 1");
    }
    if !(args.timeout.is_finite() && (0.1..=86_400.0).contains(&args.timeout)) {
        bail!(
            "--timeout must be between 0.1 and 86400 seconds, got {}",
            args.timeout
        );
    }
    if let Some(fraction) = args.kv_memory_fraction {
        if !(fraction > 0.0 && fraction <= 0.9) {
            bail!("--kv-memory-fraction must be in (0, 0.9], got {fraction}");
        }
    }
    pagoda_server::check_cors_origins(&args.cors).map_err(anyhow::Error::msg)?;
    args.sampling.params()?; // fail fast on bad flags, before loading
    let loaded = match &args.random_weights {
        Some(spec) => common::load_random_served(&args.model, spec)?,
        None => common::load(&args.model)?,
    };
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
    let (file_name, stem) = match &args.random_weights {
        // Named after the architecture (a config.json after its folder), not the tokenizer's file.
        Some(spec) => {
            // `:fp8` (the format of the projections) stays at the end of the name.
            let (base, format) = match pagoda_models::random::random_spec(spec)? {
                (base, RandomFormat::Fp8) => (base, ":fp8"),
                (base, RandomFormat::F32) => (base, ""),
            };
            let path = std::path::Path::new(base);
            // A preset's name as given (`llama-3.1-8b` has no extension to strip).
            let arch = match path.file_name().and_then(|n| n.to_str()) {
                Some("config.json") => path.parent().and_then(|p| p.file_name()),
                Some(name) if name.ends_with(".json") => path.file_stem(),
                _ => None,
            };
            let name = format!(
                "random-{}{format}",
                arch.map_or(base.into(), |a| a.to_string_lossy())
            );
            (name.clone(), name)
        }
        None => (file_name, stem),
    };
    let model_name = args.alias.clone().unwrap_or_else(|| stem.clone());
    let source_path = match &args.random_weights {
        Some(spec) => format!(
            "random weights of {spec}, tokenizer of {} (vocabulary {})",
            loaded.source.path().display(),
            loaded.model.config().vocab_size
        ),
        None => loaded.source.path().display().to_string(),
    };

    // The engine: sized like `common::engine`, with the server's budget and pool flags.
    let page_size = args.model.page_size;
    if page_size == 0 || page_size > 1024 {
        bail!("--page-size must be between 1 and 1024");
    }
    // K and V, every layer, in the backend's KV dtype.
    let kv_types = common::kv_cache_types();
    loaded
        .model
        .check_kv_types(kv_types)
        .map_err(anyhow::Error::msg)?;
    let page_bytes = loaded.model.kv_page_bytes(page_size, kv_types);
    let pages_per_sequence = ctx.div_ceil(page_size);
    let free_bytes = loaded.model.free_memory_bytes();
    let num_pages = match (args.kv_pages, args.kv_memory_fraction) {
        (Some(pages), _) => pages,
        (None, Some(fraction)) => pages_for_fraction(fraction, page_bytes, free_bytes)?,
        (None, None) => pages_per_sequence.saturating_mul(parallel),
    };
    // Refuse a KV reservation the memory cannot hold, with the numbers, rather than let the
    // allocation fail (or the host swap) later.
    let kv_bytes = (num_pages as u64).saturating_mul(page_bytes as u64);
    if let Some(free) = free_bytes.filter(|&free| kv_bytes > free) {
        let gib = |bytes: u64| bytes as f64 / (1u64 << 30) as f64;
        let sizing = match (args.kv_pages, args.kv_memory_fraction) {
            (Some(_), _) => format!("--kv-pages {num_pages}"),
            (None, Some(fraction)) => format!("--kv-memory-fraction {fraction}"),
            (None, None) => format!("{parallel} sequences (-np) of {ctx} tokens (-c)"),
        };
        bail!(
            "the KV cache for {sizing} needs {:.1} GiB ({num_pages} pages of {page_size} tokens) \
             but {:.1} GiB are free on the {}; lower -np or -c, or size the pool with --kv-pages \
             or --kv-memory-fraction",
            gib(kv_bytes),
            gib(free),
            loaded.model.device_name()
        );
    }
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
        attention: common::attention_policy(),
        sampler: common::sampler_kind(),
        cuda_graphs: common::cuda_graphs(),
        paged_decode: common::paged_decode(),
        kv_types,
    };
    let device_name = loaded.model.device_name();
    let kv_cache = loaded.model.kv_cache_name(config.kv_types);
    let settings = EngineSettings::from_config(pagoda_config::global());
    let mut engine = Engine::with_settings(loaded.model, config.clone(), settings)
        .map_err(anyhow::Error::msg)?;
    crate::draft::attach_draft(&mut engine, &args.model, Some(&loaded.tokenizer))?;

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
        "  kv cache     {} pages x {} tokens, {} ({:.1} MiB)",
        config.num_pages,
        config.page_size,
        kv_cache,
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
        match api_keys.len() {
            0 => "none: every endpoint is open".to_owned(),
            1 => "required".to_owned(),
            n => format!("required (any of {n})"),
        }
    );
    if args.metrics_public {
        eprintln!("  metrics      public (no key on /metrics)");
    }
    if let Some(cert_file) = &args.ssl_cert_file {
        eprintln!("  tls          {}", cert_file.display());
    }
    if !args.cors.is_empty() {
        eprintln!("  cors         {}", args.cors.join(", "));
    }
    eprintln!(
        "  tool calls   {}",
        match pagoda_server::tools::resolve(args.tool_call_parser, &loaded.chat_template) {
            Some(format) => format.name(),
            None => "none (the chat template shows no tools; --chat-template-file)",
        }
    );

    let webui = !args.no_webui;
    let server_config = ServerConfig {
        host: args.host.clone(),
        port: args.port,
        model_name,
        model_aliases: vec![file_name, stem],
        context_size: ctx,
        parallel,
        max_queue: args.max_queue,
        api_keys,
        metrics_public: args.metrics_public,
        tls,
        max_body_bytes: args.max_body_bytes,
        sampling_defaults,
        shutdown_timeout: std::time::Duration::from_secs_f64(args.shutdown_timeout),
        cors_origins: args.cors.clone(),
        limits: ConnectionLimits {
            max_connections: args.max_connections,
            timeout: std::time::Duration::from_secs_f64(args.timeout),
        },
        tool_call_parser: args.tool_call_parser,
        webui,
    };
    let text = TextModel {
        tokenizer: loaded.tokenizer,
        chat_template: loaded.chat_template,
        stop_tokens,
    };
    pagoda_server::serve(server_config, text, engine, |url| {
        if webui {
            eprintln!("listening on {url} (chat page at {url}/, OpenAI API at {url}/v1)");
        } else {
            eprintln!("listening on {url} (OpenAI API at {url}/v1)");
        }
    })
    .map_err(anyhow::Error::msg)
}

fn parse_tool_format(name: &str) -> Result<pagoda_server::tools::ToolFormat, String> {
    pagoda_server::tools::ToolFormat::from_name(name).ok_or_else(|| {
        format!(
            "unknown tool-call format {name:?}; use one of {}",
            pagoda_server::tools::ToolFormat::NAMES.join(", ")
        )
    })
}

/// The keys of `--api-key` (or `$PAGODA_API_KEY`) and `--api-key-file`, refusing an empty
/// `--api-key` or a key file without keys (either would turn authentication off unsaid).
fn api_keys(args: &ServeArgs) -> Result<ApiKeys> {
    let mut keys = Vec::new();
    if args
        .api_key
        .as_deref()
        .is_some_and(|key| key.trim().is_empty())
    {
        bail!("--api-key is empty; give a key, or leave the flag out to serve without one");
    }
    // `--api-key` is merged into the setting (the flag wins over $PAGODA_API_KEY).
    keys.extend(
        pagoda_config::global()
            .text("PAGODA_API_KEY")
            .map(str::to_owned),
    );
    if let Some(path) = &args.api_key_file {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("reading --api-key-file {}: {e}", path.display()))?;
        let from_file = ApiKeys::parse_file_text(&text);
        if from_file.is_empty() {
            bail!(
                "--api-key-file {} holds no key (one key per line; `#` starts a comment)",
                path.display()
            );
        }
        keys.extend(from_file);
    }
    ApiKeys::new(keys).map_err(anyhow::Error::msg)
}

/// Pages for `fraction` of the memory free now where the KV cache lives (the host's for the
/// CPU, the device's for CUDA), at `page_bytes` each.
fn pages_for_fraction(fraction: f64, page_bytes: usize, free_bytes: Option<u64>) -> Result<usize> {
    let Some(free) = free_bytes else {
        bail!("--kv-memory-fraction: cannot read the free memory of this device; pass --kv-pages instead");
    };
    let bytes = (free as f64 * fraction) as usize;
    Ok((bytes / page_bytes.max(1)).max(1))
}
