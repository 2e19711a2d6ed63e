//! The engine loop: one std thread owns the engine; requests arrive on a channel, each with its
//! own event sender; the loop admits, steps and routes tokens back.
//!
//! A client that goes away (its event receiver dropped) is cancelled before the next step, so
//! its pages are free within one step. An engine error or panic fails the requests of that
//! step with a message; the loop itself keeps serving.

use std::collections::{HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::time::Instant;

use pagoda_engine::{Engine, EngineError, FinishReason, RequestId, StepEvent};
use pagoda_ops::sampling::SamplingParams;
use tokio::sync::mpsc::UnboundedSender;

use crate::error::ApiError;
pub use crate::metrics::EngineSnapshot;
use crate::metrics::Metrics;
use crate::readiness::Readiness;

/// What the loop needs from an engine (implemented by [`pagoda_engine::Engine`]; tests use a
/// scripted fake).
pub trait EngineBackend: Send + 'static {
    /// Admits a request (see [`Engine::add_request`]).
    fn add_request(
        &mut self,
        prompt: Vec<u32>,
        params: SamplingParams,
        max_new_tokens: usize,
        stop_tokens: Vec<u32>,
        want_logprobs: bool,
    ) -> Result<RequestId, EngineError>;
    /// Runs one step (see [`Engine::step`]).
    fn step(&mut self) -> Result<Vec<StepEvent>, EngineError>;
    /// Ends a request and frees its pages; unknown ids are ignored.
    fn cancel(&mut self, id: RequestId);
    /// The seed a running request samples with.
    fn seed_of(&self, id: RequestId) -> Option<u64>;
    /// Sets a running request's logit biases (see [`Engine::set_logit_bias`]).
    fn set_logit_bias(&mut self, id: RequestId, bias: Vec<(u32, f32)>) -> Result<(), EngineError>;
    /// A snapshot of the engine's gauges and counters.
    fn snapshot(&self) -> EngineSnapshot;
    /// Whether [`warm_up`](Self::warm_up) has work to do (asked once, before the loop
    /// starts; when false the server is ready at once).
    fn needs_warmup(&self) -> bool {
        false
    }
    /// Gets ready before the first request (see [`Engine::warm_up`]); `progress` hears each
    /// stage's name.
    fn warm_up(&mut self, _progress: &mut dyn FnMut(&str)) -> Result<(), EngineError> {
        Ok(())
    }
}

impl EngineBackend for Engine {
    fn add_request(
        &mut self,
        prompt: Vec<u32>,
        params: SamplingParams,
        max_new_tokens: usize,
        stop_tokens: Vec<u32>,
        want_logprobs: bool,
    ) -> Result<RequestId, EngineError> {
        Engine::add_request(
            self,
            prompt,
            params,
            max_new_tokens,
            stop_tokens,
            want_logprobs,
        )
    }
    fn step(&mut self) -> Result<Vec<StepEvent>, EngineError> {
        Engine::step(self)
    }
    fn cancel(&mut self, id: RequestId) {
        Engine::cancel(self, id)
    }
    fn seed_of(&self, id: RequestId) -> Option<u64> {
        Engine::seed_of(self, id)
    }
    fn set_logit_bias(&mut self, id: RequestId, bias: Vec<(u32, f32)>) -> Result<(), EngineError> {
        Engine::set_logit_bias(self, id, bias)
    }
    fn snapshot(&self) -> EngineSnapshot {
        EngineSnapshot {
            pages_used: self.pages_used(),
            pages_total: self.config().num_pages,
            num_running: self.num_running(),
            counters: self.counters().clone(),
            pages_cached: self.pages_cached(),
            sampling: pagoda_ops::sampling::sampling_counters(),
            batch_dependent: self.is_cuda() || !pagoda_ops::linear::batch_invariant(),
        }
    }
    fn needs_warmup(&self) -> bool {
        Engine::needs_warmup(self)
    }
    fn warm_up(&mut self, progress: &mut dyn FnMut(&str)) -> Result<(), EngineError> {
        Engine::warm_up(self, progress).map(|_| ())
    }
}

/// One request for the loop.
#[derive(Debug)]
pub struct Job {
    /// Prompt token ids (non-empty).
    pub prompt: Vec<u32>,
    /// Validated sampling parameters.
    pub params: SamplingParams,
    /// Most tokens to generate (at least 1).
    pub max_new_tokens: usize,
    /// Token ids that end generation.
    pub stop_tokens: Vec<u32>,
    /// `Some(n)`: report each sampled token's log-probability and the `n` most likely
    /// alternatives.
    pub top_logprobs: Option<usize>,
    /// `(token, bias)` pairs added to the logits before each draw (OpenAI's `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    /// Where the loop sends this request's events; dropping the receiver cancels it.
    pub events: UnboundedSender<WorkerEvent>,
}

/// Log-probability of a sampled token and the most likely alternatives, natural log.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// Log-probability of the sampled token.
    pub logprob: f32,
    /// The most likely tokens as `(id, logprob)`, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// What the loop reports about one request.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkerEvent {
    /// The request was admitted to the engine; `seed` is its sampler's seed.
    Started { seed: Option<u64> },
    /// A token was sampled; `finished` is set on the last one.
    Token {
        token: u32,
        logprob: Option<TokenLogprob>,
        finished: Option<FinishReason>,
    },
    /// The request failed; `client_error` when the request itself was at fault (400).
    Failed { message: String, client_error: bool },
}

impl WorkerEvent {
    /// The API error of a `Failed` event.
    pub fn failure(message: &str, client_error: bool) -> ApiError {
        if client_error {
            ApiError::invalid(message, None)
        } else {
            ApiError::internal(message)
        }
    }
}

/// The handlers' side of the loop: submits jobs, bounded by the queue limit.
#[derive(Debug, Clone)]
pub struct WorkerHandle {
    sender: Sender<Job>,
    queued: Arc<AtomicUsize>,
    max_queue: usize,
    readiness: Arc<Readiness>,
}

impl WorkerHandle {
    /// Queues `job`; a 503 while the engine warms up (or after its warm-up failed), a 429
    /// when `max_queue` jobs already wait for admission.
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        if let Err(not_ready) = self.readiness.check() {
            let retry = match not_ready.status {
                "loading" => "; retry when /health answers 200",
                _ => "",
            };
            return Err(
                ApiError::unavailable(format!("{}{retry}", not_ready.reason))
                    .with_code("model_loading"),
            );
        }
        let queued = self.queued.fetch_add(1, Ordering::SeqCst);
        if queued >= self.max_queue {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError::queue_full(queued));
        }
        self.sender.send(job).map_err(|_| {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            ApiError::internal("the engine loop has stopped")
        })
    }

    /// Jobs waiting for admission.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }

    /// Whether the engine is ready (its warm-up done).
    pub fn readiness(&self) -> &Readiness {
        &self.readiness
    }
}

/// Starts the loop on its own thread. It runs at most `parallel` requests at once; at most
/// `max_queue` more wait. It ends when every handle is dropped and the running requests are
/// done.
pub fn spawn_worker<B: EngineBackend>(
    backend: B,
    parallel: usize,
    max_queue: usize,
    metrics: Arc<Metrics>,
) -> std::io::Result<(WorkerHandle, std::thread::JoinHandle<()>)> {
    let (sender, receiver) = mpsc::channel();
    let queued = Arc::new(AtomicUsize::new(0));
    let readiness = Arc::new(if backend.needs_warmup() {
        Readiness::warming()
    } else {
        Readiness::ready()
    });
    let handle = WorkerHandle {
        sender,
        queued: queued.clone(),
        max_queue,
        readiness: readiness.clone(),
    };
    let mut worker = Worker {
        backend,
        parallel: parallel.max(1),
        receiver,
        queued,
        waiting: VecDeque::new(),
        running: HashMap::new(),
        metrics,
    };
    let thread = std::thread::Builder::new()
        .name("pagoda-engine".into())
        .spawn(move || {
            if readiness.check().is_err() {
                match worker.backend.warm_up(&mut |stage| readiness.stage(stage)) {
                    Ok(()) => readiness.set_ready(),
                    Err(error) => readiness.set_failed(&error.to_string()),
                }
            }
            worker.run()
        })?;
    Ok((handle, thread))
}

struct Slot {
    events: UnboundedSender<WorkerEvent>,
    top_logprobs: Option<usize>,
    enqueued_at: Instant,
    last_token_at: Option<Instant>,
}

struct Worker<B> {
    backend: B,
    parallel: usize,
    receiver: Receiver<Job>,
    queued: Arc<AtomicUsize>,
    waiting: VecDeque<(Job, Instant)>,
    running: HashMap<RequestId, Slot>,
    metrics: Arc<Metrics>,
}

impl<B: EngineBackend> Worker<B> {
    fn run(&mut self) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                self.publish_gauges();
                match self.receiver.recv() {
                    Ok(job) => self.waiting.push_back((job, Instant::now())),
                    Err(_) => return, // every handle is gone and nothing runs
                }
            }
            while let Ok(job) = self.receiver.try_recv() {
                self.waiting.push_back((job, Instant::now()));
            }
            self.cancel_disconnected();
            self.admit();
            self.publish_gauges();
            if !self.running.is_empty() {
                self.step();
                self.publish_gauges();
            }
        }
    }

    /// Cancels running requests whose client went away, and drops waiting ones (their place in
    /// the queue is freed at once, so live clients do not get 429 for them).
    fn cancel_disconnected(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|(job, _)| !job.events.is_closed());
        let dropped = before - self.waiting.len();
        if dropped > 0 {
            self.queued.fetch_sub(dropped, Ordering::SeqCst);
            for _ in 0..dropped {
                self.metrics.cancelled.inc();
            }
        }
        let gone: Vec<RequestId> = self
            .running
            .iter()
            .filter(|(_, slot)| slot.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            self.backend.cancel(id);
            self.running.remove(&id);
            self.metrics.cancelled.inc();
        }
    }

    fn admit(&mut self) {
        while self.running.len() < self.parallel {
            let Some((job, enqueued_at)) = self.waiting.pop_front() else {
                break;
            };
            self.queued.fetch_sub(1, Ordering::SeqCst);
            if job.events.is_closed() {
                self.metrics.cancelled.inc();
                continue;
            }
            let greedy = job.params.is_greedy();
            let added = self.backend.add_request(
                job.prompt,
                job.params,
                job.max_new_tokens,
                job.stop_tokens,
                job.top_logprobs.is_some(),
            );
            let added = added.and_then(|id| {
                if job.logit_bias.is_empty() {
                    return Ok(id);
                }
                self.backend
                    .set_logit_bias(id, job.logit_bias)
                    .inspect_err(|_| self.backend.cancel(id))
                    .map(|()| id)
            });
            match added {
                Ok(id) => {
                    if greedy {
                        self.metrics.sampling_greedy_requests.inc();
                    } else {
                        self.metrics.sampling_random_requests.inc();
                    }
                    let seed = self.backend.seed_of(id);
                    let _ = job.events.send(WorkerEvent::Started { seed });
                    self.running.insert(
                        id,
                        Slot {
                            events: job.events,
                            top_logprobs: job.top_logprobs,
                            enqueued_at,
                            last_token_at: None,
                        },
                    );
                }
                Err(error) => {
                    let client_error = !matches!(
                        error,
                        EngineError::Internal(_) | EngineError::OutOfPages { .. }
                    );
                    let _ = job.events.send(WorkerEvent::Failed {
                        message: error.to_string(),
                        client_error,
                    });
                }
            }
        }
    }

    fn step(&mut self) {
        let backend = &mut self.backend;
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| backend.step()));
        let events = match result {
            Ok(Ok(events)) => events,
            Ok(Err(error)) => return self.fail_running(&format!("the engine failed: {error}")),
            Err(panic) => {
                let what = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown panic".to_owned());
                tracing::error!("the engine panicked: {what}");
                return self.fail_running(&format!(
                    "internal error (please report): the engine panicked: {what}"
                ));
            }
        };
        let now = Instant::now();
        for event in events {
            let Some(slot) = self.running.get_mut(&event.request) else {
                continue; // cancelled meanwhile
            };
            match slot.last_token_at {
                None => self
                    .metrics
                    .time_to_first_token
                    .observe((now - slot.enqueued_at).as_secs_f64()),
                Some(last) => self
                    .metrics
                    .inter_token_latency
                    .observe((now - last).as_secs_f64()),
            }
            slot.last_token_at = Some(now);
            self.metrics.generated_tokens.inc();
            let logprob = match (&event.logprobs, slot.top_logprobs) {
                (Some(row), Some(n)) => Some(token_logprob(row, event.token, n)),
                _ => None,
            };
            let sent = slot.events.send(WorkerEvent::Token {
                token: event.token,
                logprob,
                finished: event.finished,
            });
            if event.finished.is_some() {
                self.running.remove(&event.request);
            } else if sent.is_err() {
                self.backend.cancel(event.request);
                self.running.remove(&event.request);
                self.metrics.cancelled.inc();
            }
        }
        // A request the engine dropped without a final event would hang its client.
        if self.backend.snapshot().num_running == 0 && !self.running.is_empty() {
            self.fail_running("internal error (please report): the engine dropped the request");
        }
    }

    /// Fails and cancels every running request.
    fn fail_running(&mut self, message: &str) {
        for (id, slot) in self.running.drain() {
            let _ = slot.events.send(WorkerEvent::Failed {
                message: message.to_owned(),
                client_error: false,
            });
            self.backend.cancel(id);
        }
        self.metrics.engine_errors.inc();
    }

    fn publish_gauges(&self) {
        let snapshot = self.backend.snapshot();
        self.metrics.update_engine(&snapshot, self.waiting.len());
    }
}

/// The sampled token's log-probability and the `n` most likely tokens of a log-softmax row.
pub fn token_logprob(row: &[f32], token: u32, n: usize) -> TokenLogprob {
    let logprob = row
        .get(token as usize)
        .copied()
        .unwrap_or(f32::NEG_INFINITY);
    let mut ids: Vec<u32> = (0..row.len() as u32).collect();
    let order = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
    let count = n.min(ids.len());
    if count > 0 && count < ids.len() {
        ids.select_nth_unstable_by(count - 1, order);
    }
    ids.truncate(count);
    ids.sort_unstable_by(order);
    TokenLogprob {
        logprob,
        top: ids.into_iter().map(|id| (id, row[id as usize])).collect(),
    }
}
