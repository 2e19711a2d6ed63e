//! The harness of the HTTP tests: the router (tower `oneshot`, no socket) over a scripted
//! engine that replays fixed tokens, with the default model's tokenizer (tests skip when the
//! model is missing).
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use pagoda_engine::{EngineError, FinishReason, RequestId, StepEvent};
use pagoda_models::chat_template::ChatTemplate;
use pagoda_models::formats::gguf::GgufFile;
use pagoda_models::tokenizer::Tokenizer;
use pagoda_ops::attention::SparseAttention;
use pagoda_ops::sampling::SamplingParams;
use pagoda_server::auth::ApiKeys;
use pagoda_server::worker::{EngineBackend, EngineSnapshot};
use pagoda_server::{router, AppState, ServerConfig, TextModel};
use serde_json::Value;
use tower::ServiceExt;

pub const EOS: u32 = 2;

/// In [`Mode::SmallPool`] the scripted engine refuses requests of more new tokens than this,
/// as a real engine refuses one larger than its whole KV pool.
pub const SMALL_POOL_TOKENS: usize = 8;

pub fn tokenizer() -> Option<Tokenizer> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.is_file() {
        println!("skipping: {} is missing", path.display());
        return None;
    }
    Some(Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap())
}

#[derive(Clone, Copy, PartialEq)]
pub enum Mode {
    Replay,
    FailSteps,
    Panic,
    /// Replay, with a KV pool of [`SMALL_POOL_TOKENS`].
    SmallPool,
}

/// Replays `script` for every request (ending with EOS when `script` does), one token a step.
pub struct Scripted {
    script: Vec<u32>,
    mode: Mode,
    running: HashMap<RequestId, (usize, usize)>, // (position, max_new_tokens)
    next_id: RequestId,
    cancelled: Arc<Mutex<Vec<RequestId>>>,
    sparse: Arc<Mutex<Vec<Option<SparseAttention>>>>,
}

/// The sparse decode setting of a [`Mode::Replay`] engine (as if started with
/// `--sparse-attention budget=512,window=64`).
pub fn replay_sparse_attention() -> SparseAttention {
    SparseAttention::new(512, 64, 2048).unwrap()
}

impl Scripted {
    /// Replays `script` in `mode`.
    pub fn new(script: Vec<u32>, mode: Mode) -> Scripted {
        Scripted {
            script,
            mode,
            running: HashMap::new(),
            next_id: 0,
            cancelled: Arc::new(Mutex::new(Vec::new())),
            sparse: Arc::new(Mutex::new(Vec::new())),
        }
    }
}

impl EngineBackend for Scripted {
    fn add_request(
        &mut self,
        _: Vec<u32>,
        _: SamplingParams,
        max_new: usize,
        _: Vec<u32>,
        _: bool,
    ) -> Result<RequestId, EngineError> {
        if self.mode == Mode::SmallPool && max_new > SMALL_POOL_TOKENS {
            return Err(EngineError::TooLargeForPool {
                needed: max_new.div_ceil(4),
                max_new_tokens: max_new,
                total: SMALL_POOL_TOKENS / 4,
            });
        }
        let id = self.next_id;
        self.next_id += 1;
        self.running.insert(id, (0, max_new));
        Ok(id)
    }
    fn step(&mut self) -> Result<Vec<StepEvent>, EngineError> {
        std::thread::sleep(Duration::from_millis(2));
        match self.mode {
            Mode::FailSteps => return Err(EngineError::Internal("scripted failure".into())),
            Mode::Panic => panic!("scripted panic"),
            Mode::Replay | Mode::SmallPool => {}
        }
        let mut events = Vec::new();
        for (&id, (position, max_new)) in self.running.iter_mut() {
            let token = self.script[*position % self.script.len()];
            *position += 1;
            let finished = if token == EOS {
                Some(FinishReason::Stop)
            } else if *position >= *max_new {
                Some(FinishReason::Length)
            } else {
                None
            };
            let logprobs = Some(vec![-1.0f32; 8].into_iter().chain([-0.5]).collect());
            events.push(StepEvent {
                request: id,
                token,
                logprobs,
                finished,
                note: None,
            });
        }
        for event in events.iter().filter(|e| e.finished.is_some()) {
            self.running.remove(&event.request);
        }
        Ok(events)
    }
    /// Sparse decode: [`replay_sparse_attention`] in [`Mode::Replay`], none elsewhere.
    fn sparse_attention(&self) -> Option<SparseAttention> {
        (self.mode == Mode::Replay).then(replay_sparse_attention)
    }
    /// Sparse decode's settings: recorded and accepted in [`Mode::Replay`], refused
    /// elsewhere as an engine without it refuses them.
    fn set_sparse_attention(
        &mut self,
        _: RequestId,
        sparse: Option<SparseAttention>,
    ) -> Result<(), EngineError> {
        self.sparse.lock().unwrap().push(sparse);
        match (self.mode, sparse) {
            (Mode::Replay, _) | (_, None) => Ok(()),
            _ => Err(EngineError::SparseAttention(
                "sparse_attention needs a server started with --sparse-attention".into(),
            )),
        }
    }
    fn cancel(&mut self, id: RequestId) {
        if self.running.remove(&id).is_some() {
            self.cancelled.lock().unwrap().push(id);
        }
    }
    fn set_logit_bias(
        &mut self,
        _id: RequestId,
        _bias: Vec<(u32, f32)>,
    ) -> Result<(), EngineError> {
        // The script is replayed whatever the logits: nothing to bias.
        Ok(())
    }
    fn seed_of(&self, _: RequestId) -> Option<u64> {
        Some(7)
    }
    /// `[len, first token, last token]`, or in [`Mode::SmallPool`] a refusal of inputs over
    /// [`SMALL_POOL_TOKENS`].
    fn embed(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        if self.mode == Mode::SmallPool && tokens.len() > SMALL_POOL_TOKENS {
            return Err(EngineError::TooLargeForPool {
                needed: tokens.len().div_ceil(4),
                max_new_tokens: 0,
                total: SMALL_POOL_TOKENS / 4,
            });
        }
        let first = tokens.first().copied().unwrap_or_default() as f32;
        let last = tokens.last().copied().unwrap_or_default() as f32;
        Ok(vec![tokens.len() as f32, first, last])
    }
    fn snapshot(&self) -> EngineSnapshot {
        EngineSnapshot {
            pages_used: self.running.len(),
            pages_total: 100,
            num_running: self.running.len(),
            ..Default::default()
        }
    }
}

pub struct Harness {
    pub app: axum::Router,
    pub tokenizer: Tokenizer,
    pub cancelled: Arc<Mutex<Vec<RequestId>>>,
    /// The sparse decode settings each request set, in order.
    pub sparse: Arc<Mutex<Vec<Option<SparseAttention>>>>,
}

pub fn harness(text: &str, mode: Mode, tweak: impl FnOnce(&mut ServerConfig)) -> Option<Harness> {
    let tokenizer = tokenizer()?;
    let mut script = tokenizer.encode(text, false).unwrap();
    script.push(EOS);
    let backend = Scripted::new(script, mode);
    let cancelled = backend.cancelled.clone();
    let sparse = backend.sparse.clone();
    let mut config = test_config();
    tweak(&mut config);
    let text_model = text_model()?;
    let state = AppState::start(config, text_model, backend).unwrap();
    Some(Harness {
        app: router(state),
        tokenizer,
        cancelled,
        sparse,
    })
}

/// The harness's server configuration (no keys, 2 parallel, context 64).
pub fn test_config() -> ServerConfig {
    ServerConfig {
        host: "127.0.0.1".into(),
        port: 0,
        model_name: "test-model".into(),
        model_aliases: vec!["test-model.gguf".into()],
        context_size: 64,
        parallel: 2,
        max_queue: 8,
        api_keys: ApiKeys::default(),
        metrics_public: false,
        tls: None,
        max_body_bytes: 4096,
        sampling_defaults: SamplingParams::default(),
        shutdown_timeout: Duration::from_secs(30),
        cors_origins: Vec::new(),
        limits: Default::default(),
        tool_call_parser: None,
        webui: true,
    }
}

/// The default model's tokenizer with a ChatML template and EOS as the stop token.
pub fn text_model() -> Option<TextModel> {
    Some(TextModel {
        tokenizer: tokenizer()?,
        chat_template: ChatTemplate::chatml(),
        stop_tokens: vec![EOS],
    })
}

pub async fn call(
    app: &axum::Router,
    path: &str,
    body: impl Into<Body>,
    key: Option<&str>,
) -> (StatusCode, String) {
    let mut request = Request::post(path).header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("authorization", format!("Bearer {key}"));
    }
    answer(app, request.body(body.into()).unwrap()).await
}

/// Sends `request` through the router; the status and the whole body as text.
pub async fn answer(app: &axum::Router, request: Request<Body>) -> (StatusCode, String) {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

pub fn error_of(status: StatusCode, body: &str, expected: StatusCode) -> Value {
    assert_eq!(status, expected, "{body}");
    let value: Value = serde_json::from_str(body).unwrap();
    let error = value["error"].clone();
    for key in ["message", "type", "param", "code"] {
        assert!(error.get(key).is_some(), "{key} missing in {body}");
    }
    error
}
