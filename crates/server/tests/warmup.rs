//! Readiness while the engine warms up (issue 46): an engine whose warm-up waits for the test.
//! Until it is done, `/health` answers 503 `loading` with the stage and a completion 503
//! `model_loading`; then both serve. A failed warm-up leaves `/health` at 503 `error` with
//! the reason, and requests refused with it.

mod common;

use std::sync::mpsc::{channel, Receiver, Sender};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::*;
use pagoda_engine::{EngineError, RequestId, StepEvent};
use pagoda_ops::sampling::SamplingParams;
use pagoda_server::worker::{EngineBackend, EngineSnapshot};
use pagoda_server::{router, AppState};
use serde_json::Value;

/// [`Scripted`] behind a warm-up that names a stage, then waits for the test's verdict.
struct Warming {
    inner: Scripted,
    verdict: Receiver<Result<(), String>>,
}

impl EngineBackend for Warming {
    fn add_request(
        &mut self,
        prompt: Vec<u32>,
        params: SamplingParams,
        max_new: usize,
        stop: Vec<u32>,
        logprobs: bool,
    ) -> Result<RequestId, EngineError> {
        self.inner
            .add_request(prompt, params, max_new, stop, logprobs)
    }
    fn step(&mut self) -> Result<Vec<StepEvent>, EngineError> {
        self.inner.step()
    }
    fn cancel(&mut self, id: RequestId) {
        self.inner.cancel(id)
    }
    fn seed_of(&self, id: RequestId) -> Option<u64> {
        self.inner.seed_of(id)
    }
    fn set_logit_bias(&mut self, id: RequestId, bias: Vec<(u32, f32)>) -> Result<(), EngineError> {
        self.inner.set_logit_bias(id, bias)
    }
    fn snapshot(&self) -> EngineSnapshot {
        self.inner.snapshot()
    }
    fn needs_warmup(&self) -> bool {
        true
    }
    fn warm_up(&mut self, progress: &mut dyn FnMut(&str)) -> Result<(), EngineError> {
        progress("compiling CUDA kernels");
        let verdict = self.verdict.recv().unwrap_or(Ok(()));
        verdict.map_err(EngineError::Internal)
    }
}

fn start() -> Option<(axum::Router, Sender<Result<(), String>>)> {
    let tokenizer = tokenizer()?;
    let mut script = tokenizer.encode(" ready", false).unwrap();
    script.push(EOS);
    let (verdict, receiver) = channel();
    let backend = Warming {
        inner: Scripted::new(script, Mode::Replay),
        verdict: receiver,
    };
    let state = AppState::start(test_config(), text_model()?, backend).unwrap();
    Some((router(state), verdict))
}

async fn health(app: &axum::Router) -> (StatusCode, Value) {
    let request = Request::get("/health").body(Body::empty()).unwrap();
    let (status, body) = answer(app, request).await;
    (status, serde_json::from_str(&body).unwrap())
}

/// Polls `/health` until `done` holds (at most 10 s).
async fn health_until(app: &axum::Router, done: impl Fn(StatusCode, &Value) -> bool) -> Value {
    let started = Instant::now();
    loop {
        let (status, body) = health(app).await;
        if done(status, &body) {
            return body;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "/health stayed at {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

const COMPLETION: &str = r#"{"prompt": "hi", "max_tokens": 2}"#;

#[tokio::test]
async fn not_ready_until_the_warm_up_is_done() {
    let Some((app, verdict)) = start() else {
        return;
    };
    let body = health_until(&app, |status, body| {
        status == StatusCode::SERVICE_UNAVAILABLE
            && body["reason"]
                .as_str()
                .is_some_and(|r| r.contains("compiling CUDA kernels"))
    })
    .await;
    assert_eq!(body["status"], "loading", "{body}");
    let (status, text) = call(&app, "/v1/completions", COMPLETION, None).await;
    let error = error_of(status, &text, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(error["code"], "model_loading", "{error}");
    let message = error["message"].as_str().unwrap();
    assert!(
        message.contains("compiling CUDA kernels") && message.contains("retry when /health"),
        "{message}"
    );

    verdict.send(Ok(())).unwrap();
    let body = health_until(&app, |status, _| status == StatusCode::OK).await;
    assert_eq!(body["status"], "ok");
    let (status, text) = call(&app, "/v1/completions", COMPLETION, None).await;
    assert_eq!(status, StatusCode::OK, "{text}");
}

#[tokio::test]
async fn a_failed_warm_up_is_reported_and_refuses_requests() {
    let Some((app, verdict)) = start() else {
        return;
    };
    verdict
        .send(Err("no kernel image for this GPU".into()))
        .unwrap();
    let body = health_until(&app, |_, body| body["status"] == "error").await;
    let reason = body["reason"].as_str().unwrap();
    assert!(reason.contains("no kernel image for this GPU"), "{body}");
    let (status, text) = call(&app, "/v1/completions", COMPLETION, None).await;
    let error = error_of(status, &text, StatusCode::SERVICE_UNAVAILABLE);
    let message = error["message"].as_str().unwrap();
    assert!(
        message.contains("no kernel image") && !message.contains("retry"),
        "{message}"
    );
}
