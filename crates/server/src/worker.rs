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
use std::sync::{Arc, Mutex};
use std::time::Instant;

use pagoda_engine::{EngineError, FinishReason, RequestId};
use pagoda_ops::sampling::SamplingParams;
use tokio::sync::mpsc::UnboundedSender;

use crate::error::ApiError;
pub use crate::metrics::EngineSnapshot;
use crate::metrics::Metrics;
use crate::readiness::Readiness;

mod backend;
mod feed;
pub use backend::EngineBackend;
pub use feed::{LoadGauge, WorkerLoad, WorkerOptions};

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
    /// Structured output: the grammar the tokens must follow (boxed: a matcher is large).
    pub constraint: Option<Box<pagoda_grammar::Constraint>>,
    /// Sparse decode for this request (`sparse_attention`): `None` the server's setting,
    /// `Some(None)` dense.
    pub sparse_attention: Option<Option<pagoda_ops::attention::SparseAttention>>,
    /// Where the loop sends this request's events; dropping the receiver cancels it.
    pub events: UnboundedSender<WorkerEvent>,
}

/// One embedding request for the loop: its inputs' token ids (each non-empty), and where the
/// vectors go (one per input, in order); dropping the receiver cancels it.
#[derive(Debug)]
pub struct EmbedJob {
    pub inputs: Vec<Vec<u32>>,
    pub reply: tokio::sync::oneshot::Sender<Result<Vec<Vec<f32>>, ApiError>>,
}

/// What the handlers send the loop.
#[derive(Debug)]
enum Work {
    Generate(Job),
    Embed(EmbedJob),
}

/// What one of the `--parallel` slots does now, as `GET /slots` shows it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SlotState {
    /// The slot's number, `0..parallel`.
    pub id: usize,
    /// The engine's id of the request it runs (`None`: idle).
    pub request: Option<RequestId>,
    /// Tokens of the request's prompt.
    pub prompt_tokens: usize,
    /// Tokens generated so far.
    pub decoded: usize,
    /// The request's sampler seed.
    pub seed: Option<u64>,
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
    /// A token was sampled; `finished` is set on the last one, and `note` when the request
    /// ended early for a reason the finish reason does not say (a grammar's dead end).
    Token {
        token: u32,
        logprob: Option<TokenLogprob>,
        finished: Option<FinishReason>,
        note: Option<String>,
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
    sender: Sender<Work>,
    queued: Arc<AtomicUsize>,
    max_queue: usize,
    readiness: Arc<Readiness>,
    slots: Arc<Mutex<Vec<SlotState>>>,
    load: LoadGauge,
}

impl WorkerHandle {
    /// Queues `job`; a 503 while the engine warms up (or after its warm-up failed), a 429
    /// when `max_queue` jobs already wait for admission.
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        self.send(Work::Generate(job))
    }

    /// Queues an embedding request, under the same readiness and queue limits as
    /// [`submit`](Self::submit).
    pub fn submit_embedding(&self, job: EmbedJob) -> Result<(), ApiError> {
        self.send(Work::Embed(job))
    }

    fn send(&self, work: Work) -> Result<(), ApiError> {
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
        self.sender.send(work).map_err(|_| {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            ApiError::internal("the engine loop has stopped")
        })
    }

    /// Jobs waiting for admission.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }

    /// What each slot runs now (published by the loop after every step).
    pub fn slots(&self) -> Vec<SlotState> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The loop's load after its last turn.
    pub fn load(&self) -> WorkerLoad {
        self.load.get()
    }

    /// The load, for a reader that must not keep the loop alive.
    pub fn load_gauge(&self) -> LoadGauge {
        self.load.clone()
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
    spawn_worker_with(
        backend,
        parallel,
        max_queue,
        metrics,
        WorkerOptions::default(),
    )
}

/// [`spawn_worker`] with the options a router-facing worker needs.
pub fn spawn_worker_with<B: EngineBackend>(
    mut backend: B,
    parallel: usize,
    max_queue: usize,
    metrics: Arc<Metrics>,
    options: WorkerOptions,
) -> std::io::Result<(WorkerHandle, std::thread::JoinHandle<()>)> {
    if options.kv_events.is_some() {
        backend.record_kv_events(true);
    }
    let (sender, receiver) = mpsc::channel();
    let queued = Arc::new(AtomicUsize::new(0));
    let readiness = Arc::new(if backend.needs_warmup() {
        Readiness::warming()
    } else {
        Readiness::ready()
    });
    let parallel = parallel.max(1);
    let slots = Arc::new(Mutex::new(idle_slots(parallel)));
    let load = LoadGauge::default();
    let handle = WorkerHandle {
        sender,
        queued: queued.clone(),
        max_queue,
        readiness: readiness.clone(),
        slots: slots.clone(),
        load: load.clone(),
    };
    let mut worker = Worker {
        backend,
        parallel,
        receiver,
        queued,
        waiting: VecDeque::new(),
        embeds: VecDeque::new(),
        running: HashMap::new(),
        metrics,
        slots,
        load,
        kv_events: options.kv_events,
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

fn idle_slots(parallel: usize) -> Vec<SlotState> {
    (0..parallel)
        .map(|id| SlotState {
            id,
            ..SlotState::default()
        })
        .collect()
}

struct Slot {
    events: UnboundedSender<WorkerEvent>,
    top_logprobs: Option<usize>,
    enqueued_at: Instant,
    last_token_at: Option<Instant>,
    /// The slot number shown by `/slots`.
    number: usize,
    prompt_tokens: usize,
    decoded: usize,
    seed: Option<u64>,
}

/// An embedding request being worked through, one input per turn of the loop.
struct Embedding {
    job: EmbedJob,
    vectors: Vec<Vec<f32>>,
}

struct Worker<B> {
    backend: B,
    parallel: usize,
    receiver: Receiver<Work>,
    queued: Arc<AtomicUsize>,
    waiting: VecDeque<(Job, Instant)>,
    embeds: VecDeque<Embedding>,
    running: HashMap<RequestId, Slot>,
    metrics: Arc<Metrics>,
    slots: Arc<Mutex<Vec<SlotState>>>,
    load: LoadGauge,
    kv_events: Option<UnboundedSender<Vec<pagoda_engine::CacheEvent>>>,
}

impl<B: EngineBackend> Worker<B> {
    fn run(&mut self) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() && self.embeds.is_empty() {
                self.publish_gauges();
                self.publish_slots();
                self.publish_kv_events();
                match self.receiver.recv() {
                    Ok(work) => self.receive(work),
                    Err(_) => return, // every handle is gone and nothing runs
                }
            }
            while let Ok(work) = self.receiver.try_recv() {
                self.receive(work);
            }
            self.cancel_disconnected();
            self.embed_one();
            self.admit();
            self.publish_gauges();
            if !self.running.is_empty() {
                self.step();
                self.publish_gauges();
            }
            // Once per turn: what admission and the step changed.
            self.publish_slots();
            self.publish_kv_events();
        }
    }

    fn receive(&mut self, work: Work) {
        match work {
            Work::Generate(job) => self.waiting.push_back((job, Instant::now())),
            Work::Embed(job) => self.embeds.push_back(Embedding {
                vectors: Vec::with_capacity(job.inputs.len()),
                job,
            }),
        }
    }

    /// Embeds the next input of the oldest embedding request (one input per turn, so long
    /// batches of inputs interleave with the running requests' steps); answers the request
    /// when its last input is done. When running requests hold the pages it needs, it waits
    /// for their next step.
    fn embed_one(&mut self) {
        let Some(front) = self.embeds.front_mut() else {
            return;
        };
        if front.job.reply.is_closed() {
            self.embeds.pop_front();
            self.queued.fetch_sub(1, Ordering::SeqCst);
            self.metrics.cancelled.inc();
            return;
        }
        let input = &front.job.inputs[front.vectors.len()];
        let backend = &mut self.backend;
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| backend.embed(input)));
        let failure = match result {
            Ok(Ok(vector)) => {
                front.vectors.push(vector);
                if front.vectors.len() < front.job.inputs.len() {
                    return;
                }
                None
            }
            Ok(Err(EngineError::OutOfPages { .. })) if !self.running.is_empty() => return,
            Ok(Err(error)) => Some(match error {
                EngineError::Internal(_) | EngineError::OutOfPages { .. } => {
                    ApiError::internal(error.to_string())
                }
                client => ApiError::invalid(client.to_string(), Some("input")),
            }),
            Err(_) => Some(ApiError::internal(
                "internal error (please report): the engine panicked computing an embedding",
            )),
        };
        let Some(done) = self.embeds.pop_front() else {
            return;
        };
        self.queued.fetch_sub(1, Ordering::SeqCst);
        let answer = match failure {
            Some(error) => Err(error),
            None => Ok(done.vectors),
        };
        let _ = done.job.reply.send(answer);
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
            let prompt_tokens = job.prompt.len();
            let added = self.backend.add_request(
                job.prompt,
                job.params,
                job.max_new_tokens,
                job.stop_tokens,
                job.top_logprobs.is_some(),
            );
            let added = added.and_then(|id| {
                let biased = if job.logit_bias.is_empty() {
                    Ok(())
                } else {
                    self.backend.set_logit_bias(id, job.logit_bias)
                };
                biased
                    .and_then(|()| match job.sparse_attention {
                        Some(sparse) => self.backend.set_sparse_attention(id, sparse),
                        None => Ok(()),
                    })
                    .and_then(|()| match job.constraint {
                        Some(constraint) => self.backend.set_constraint(id, *constraint),
                        None => Ok(()),
                    })
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
                    let number = (0..)
                        .find(|n| self.running.values().all(|slot| slot.number != *n))
                        .unwrap_or(0);
                    self.running.insert(
                        id,
                        Slot {
                            events: job.events,
                            top_logprobs: job.top_logprobs,
                            enqueued_at,
                            last_token_at: None,
                            number,
                            prompt_tokens,
                            decoded: 0,
                            seed,
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
            slot.decoded += 1;
            self.metrics.generated_tokens.inc();
            let logprob = match (&event.logprobs, slot.top_logprobs) {
                (Some(row), Some(n)) => Some(token_logprob(row, event.token, n)),
                _ => None,
            };
            if let Some(note) = &event.note {
                tracing::warn!("request {} ended early: {note}", event.request);
            }
            let sent = slot.events.send(WorkerEvent::Token {
                token: event.token,
                logprob,
                finished: event.finished,
                note: event.note.clone(),
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
