//! pagoda's OpenAI-compatible HTTP server.
//!
//! The engine runs on its own thread ([`worker`]); HTTP handlers ([`routes`]) parse and
//! validate requests ([`request`]), queue them with a per-request event channel, and turn the
//! token events into text ([`session`], with stop strings held back by [`stop`]) answered as
//! whole JSON or server-sent events ([`format`]). Errors use the OpenAI body ([`error`]);
//! `/metrics` is Prometheus text ([`metrics`]). API keys are checked by [`auth`]; HTTPS is
//! terminated by [`tls`]. `/` is a chat page for browsers ([`webui`]).

pub mod access;
mod answer;
pub mod auth;
pub mod connections;
pub mod drain;
pub mod embeddings;
pub mod error;
pub mod format;
pub mod metrics;
pub mod props;
pub mod readiness;
pub mod request;
pub mod routes;
pub mod session;
pub mod sparse;
pub mod stop;
pub mod structured;
pub mod tls;
pub mod tokenize;
pub mod tools;
pub mod unsupported;
pub mod webui;
pub mod worker;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;
use pagoda_models::chat_template::ChatTemplate;
use pagoda_models::tokenizer::Tokenizer;
use pagoda_ops::sampling::SamplingParams;

use crate::auth::ApiKeys;
pub use crate::connections::ConnectionLimits;
use crate::format::Kind;
use crate::metrics::Metrics;
use crate::worker::{spawn_worker, EngineBackend, WorkerHandle};

/// How the server runs.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to bind (`127.0.0.1`, `0.0.0.0`, ...).
    pub host: String,
    /// Port to bind (0: any free port).
    pub port: u16,
    /// The model name served (`/v1/models`, the `model` field of answers).
    pub model_name: String,
    /// Other names a request's `model` may use (the file name, its stem).
    pub model_aliases: Vec<String>,
    /// Longest sequence (prompt + generated) in tokens.
    pub context_size: usize,
    /// Sequences run at once.
    pub parallel: usize,
    /// Requests that may wait for admission before new ones get 429.
    pub max_queue: usize,
    /// Keys of which one is required on every path but [`auth::PUBLIC_PATHS`] (empty: open).
    pub api_keys: ApiKeys,
    /// Serve `/metrics` without a key (`--metrics-public`).
    pub metrics_public: bool,
    /// Serve HTTPS with this configuration (`--ssl-cert-file`, `--ssl-key-file`).
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// Largest request body in bytes (larger: 413).
    pub max_body_bytes: usize,
    /// Sampling parameters of a request that does not set them.
    pub sampling_defaults: SamplingParams,
    /// How long a shutdown waits for running requests (`--shutdown-timeout`).
    pub shutdown_timeout: std::time::Duration,
    /// Origins a browser page may call the API from (`--cors`; `*`: any; empty: no CORS
    /// headers, so browsers refuse cross-origin calls).
    pub cors_origins: Vec<String>,
    /// Connections open at once and how long a client may take to send a request
    /// (`--max-connections`, `--timeout`).
    pub limits: ConnectionLimits,
    /// How the model writes tool calls (`--tool-call-parser`); `None`: read from the chat
    /// template ([`tools::ToolFormat::detect`]).
    pub tool_call_parser: Option<tools::ToolFormat>,
    /// Serve the chat page at `/` ([`webui`]; off with `--no-webui`: `/` is a 404).
    pub webui: bool,
}

impl ServerConfig {
    /// Whether a request's `model` names the served model.
    pub fn accepts_model(&self, name: &str) -> bool {
        name == self.model_name || self.model_aliases.iter().any(|alias| alias == name)
    }
}

/// The model's text side.
pub struct TextModel {
    /// Tokenizer of the model.
    pub tokenizer: Tokenizer,
    /// Chat template rendering messages into a prompt.
    pub chat_template: ChatTemplate,
    /// Token ids that end generation (not shown as text).
    pub stop_tokens: Vec<u32>,
}

/// Shared state of the handlers.
pub struct AppState {
    /// Configuration.
    pub config: ServerConfig,
    /// Tokenizer of the served model.
    pub tokenizer: Arc<Tokenizer>,
    /// Chat template of the served model.
    pub chat_template: ChatTemplate,
    /// End-of-generation token ids.
    pub stop_tokens: Vec<u32>,
    /// The engine loop.
    pub worker: WorkerHandle,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Unix seconds when the server started.
    pub created: u64,
    /// Unix nanoseconds when the server started (the prefix of response ids).
    start_nanos: u128,
    next_id: AtomicU64,
    /// Graceful shutdown: whether the server drains, and the requests in flight.
    pub drain: Arc<drain::Drain>,
    /// The grammar engine of structured output, built at the first constrained request.
    pub grammars: structured::LazyGrammars,
    /// How the model writes tool calls, when its template can show it tools (it reads
    /// `tools`) and the format is known; `None`: requests with tools are a 400.
    pub tool_format: Option<tools::ToolFormat>,
    /// The engine's sparse decode settings (`--sparse-attention`), which fill the keys a
    /// request's `sparse_attention` leaves out; `None`: settings are a 400.
    pub sparse_attention: Option<pagoda_ops::attention::SparseAttention>,
}

impl AppState {
    /// Starts the engine loop over `backend` and returns the handlers' state.
    pub fn start<B: EngineBackend>(
        config: ServerConfig,
        text: TextModel,
        backend: B,
    ) -> std::io::Result<Arc<AppState>> {
        Self::start_joinable(config, text, backend).map(|(state, _thread)| state)
    }

    /// [`AppState::start`], with the engine thread, which ends (dropping the model) once
    /// every clone of the state is dropped and its running requests are done.
    pub fn start_joinable<B: EngineBackend>(
        config: ServerConfig,
        text: TextModel,
        backend: B,
    ) -> std::io::Result<(Arc<AppState>, std::thread::JoinHandle<()>)> {
        let metrics = Arc::new(Metrics::default());
        let sparse_attention = backend.sparse_attention();
        let (worker, thread) =
            spawn_worker(backend, config.parallel, config.max_queue, metrics.clone())?;
        let since_epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let tool_format = tools::resolve(config.tool_call_parser, &text.chat_template);
        let state = Arc::new(AppState {
            config,
            tokenizer: Arc::new(text.tokenizer),
            chat_template: text.chat_template,
            stop_tokens: text.stop_tokens,
            worker,
            metrics,
            created: since_epoch.as_secs(),
            start_nanos: since_epoch.as_nanos(),
            next_id: AtomicU64::new(0),
            drain: Arc::new(drain::Drain::default()),
            grammars: structured::LazyGrammars::default(),
            tool_format,
            sparse_attention,
        });
        Ok((state, thread))
    }

    /// A fresh response id: the server's start (nanoseconds, hex) and a counter, so ids do not
    /// repeat across restarts.
    pub fn next_id(&self, kind: Kind) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let start = self.start_nanos;
        match kind {
            Kind::Chat => format!("chatcmpl-{start:x}-{n}"),
            Kind::Completion => format!("cmpl-{start:x}-{n}"),
        }
    }
}

/// The router with every endpoint and middleware.
pub fn router(state: Arc<AppState>) -> Router {
    let cors = cors_layer(&state.config.cors_origins);
    let mut router = Router::new();
    if state.config.webui {
        router = router.route("/", get(webui::page));
    }
    let router = router
        .route("/v1/chat/completions", post(routes::chat_completions))
        .route("/v1/completions", post(routes::completions))
        .route("/v1/models", get(routes::models))
        .route("/v1/models/{id}", get(routes::model))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/apply-template", post(props::apply_template))
        .route("/props", get(props::props))
        .route("/slots", get(props::slots))
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/embeddings", post(embeddings::embeddings))
        .route("/health", get(routes::health))
        .route("/metrics", get(routes::metrics))
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_api_key,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            routes::count_requests,
        ))
        .with_state(state);
    // Outermost: a preflight is answered before authentication and routing.
    match cors {
        Some(cors) => router.layer(cors),
        None => router,
    }
}

/// The CORS layer of `origins` (`*`: any origin), or `None` without origins. Origins were
/// checked by [`check_cors_origins`].
fn cors_layer(origins: &[String]) -> Option<tower_http::cors::CorsLayer> {
    use axum::http::{header, HeaderValue, Method};
    use tower_http::cors::{AllowOrigin, CorsLayer};
    if origins.is_empty() {
        return None;
    }
    let allow = if origins.iter().any(|origin| origin == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(
            origins
                .iter()
                .filter_map(|origin| HeaderValue::from_str(origin).ok()),
        )
    };
    Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST])
            .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE])
            .max_age(std::time::Duration::from_secs(600)),
    )
}

/// Checks `--cors` origins: `*`, or `scheme://host[:port]` each; the error names the bad one.
pub fn check_cors_origins(origins: &[String]) -> Result<(), String> {
    for origin in origins {
        let host = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"));
        let well_formed = origin == "*"
            || host.is_some_and(|host| {
                !host.is_empty()
                    && !host.contains('/')
                    && !host.contains(char::is_whitespace)
                    && axum::http::HeaderValue::from_str(origin).is_ok()
            });
        if !well_formed {
            return Err(format!(
                "--cors {origin:?} is not an origin: give `*` or scheme://host[:port] \
                 (e.g. http://localhost:3000), without a path"
            ));
        }
    }
    Ok(())
}

/// Binds `config.host:config.port` and serves (HTTPS when `config.tls` is set) until SIGINT
/// or SIGTERM, then drains (see [`drain`]). `on_listening` gets the URL once the socket is
/// bound.
pub fn serve<B: EngineBackend>(
    config: ServerConfig,
    text: TextModel,
    backend: B,
    on_listening: impl FnOnce(&str),
) -> Result<(), String> {
    serve_until(config, text, backend, on_listening, drain::signal)
}

/// [`serve`], with `shutdown()` as the signal that starts the drain (called twice: a second
/// resolution skips the wait for running requests).
pub fn serve_until<B: EngineBackend, S, F>(
    config: ServerConfig,
    text: TextModel,
    backend: B,
    on_listening: impl FnOnce(&str),
    shutdown: S,
) -> Result<(), String>
where
    S: Fn() -> F + Send + 'static,
    F: std::future::Future<Output = ()> + Send,
{
    let address = format!("{}:{}", config.host, config.port);
    let tls = config.tls.clone();
    let timeout = config.shutdown_timeout;
    let (state, engine) = AppState::start_joinable(config, text, backend)
        .map_err(|e| format!("starting the engine thread: {e}"))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("starting the async runtime: {e}"))?;
    let served = runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&address)
            .await
            .map_err(|e| format!("binding {address}: {e}"))?;
        let bound = listener
            .local_addr()
            .map_err(|e| format!("reading the bound address: {e}"))?;
        let drain = state.drain.clone();
        let limits = state.config.limits;
        let app = router(state);
        // The drain runs while the listener still accepts (health probes see the 503); once
        // it ends, the server stops accepting and closes its connections.
        let drained = async move {
            shutdown().await;
            tracing::info!(
                "shutting down: draining {} running requests (up to {} s; signal again to stop now)",
                drain.in_flight(),
                timeout.as_secs_f64()
            );
            let aborted = drain.finish(timeout, shutdown()).await;
            if aborted > 0 {
                tracing::warn!("shutdown: {aborted} requests were still running and were ended");
            }
        };
        match tls {
            None => {
                on_listening(&format!("http://{bound}"));
                connections::serve_connections(listener, app, limits, drained).await;
            }
            Some(tls) => {
                let listener = tls::TlsListener::new(listener, tls)
                    .map_err(|e| format!("starting TLS on {address}: {e}"))?;
                on_listening(&format!("https://{bound}"));
                connections::serve_connections(listener, app, limits, drained).await;
            }
        }
        Ok(())
    });
    // The connection tasks hold the state, whose handle keeps the engine loop running: end
    // them, then let the engine thread drop the model before the process exits (a GPU
    // model's graphs, memory and context freed in order, not raced by the exit handlers of
    // the CUDA libraries, which crashed the process on SIGTERM).
    runtime.shutdown_timeout(ENGINE_STOP_TIMEOUT);
    let deadline = std::time::Instant::now() + ENGINE_STOP_TIMEOUT;
    while !engine.is_finished() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    if engine.is_finished() {
        let _ = engine.join();
    } else {
        tracing::warn!("shutdown: the engine thread did not stop in time; exiting anyway");
    }
    served
}

/// How long shutdown waits for the connection tasks, then for the engine thread.
const ENGINE_STOP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
