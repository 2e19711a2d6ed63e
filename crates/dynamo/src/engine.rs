//! Dynamo's `LLMEngine` over pagoda's engine loop (`pagoda_server::worker`): the loop runs on
//! its own thread as under `pagoda serve`; each `generate` submits a job and turns the loop's
//! events into Dynamo chunks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use dynamo_backend_common::engine::GenerateContext;
use dynamo_backend_common::{
    chunk, usage, BackendError, DynamoError, EngineConfig, ErrorType, KvEventSource, LLMEngine,
    LLMEngineOutput, LLMEngineOutputExt, LlmRegistration, MetricsBindings, MetricsCtx,
    PreprocessedRequest,
};
use futures::stream::BoxStream;
use pagoda_engine::{CacheEvent, FinishReason};
use pagoda_server::metrics::Metrics;
use pagoda_server::worker::{Job, WorkerEvent, WorkerHandle};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::feed::{forward_kv_events, publish_load};
use crate::mapping::{map_request, Limits, Mapped};

/// What `start` advertises to Dynamo (the router and the planner read it).
#[derive(Debug, Clone)]
pub struct Registration {
    /// The served model name.
    pub model: String,
    pub context_length: usize,
    /// Tokens per KV page (Dynamo's KV block).
    pub page_size: usize,
    /// Pages in the KV pool.
    pub num_pages: usize,
    /// Sequences decoded together at most.
    pub parallel: usize,
    /// Token budget of one engine step.
    pub batch_tokens: usize,
}

/// The LLMEngine: a handle on pagoda's engine loop.
pub struct PagodaEngine {
    worker: Mutex<Option<(WorkerHandle, std::thread::JoinHandle<()>)>>,
    limits: Limits,
    registration: Registration,
    /// The loop's prefix-cache changes, until Dynamo asks for the KV event source.
    kv_feed: Mutex<Option<UnboundedReceiver<Vec<CacheEvent>>>>,
    /// Ends the load publisher at cleanup.
    stop: Arc<AtomicBool>,
    /// pagoda's own counters (prefix-cache hits, steps, ...), bridged into the runtime's
    /// `/metrics` (`DYN_SYSTEM_PORT`).
    metrics: Arc<Metrics>,
}

fn error(kind: BackendError, message: impl Into<String>) -> DynamoError {
    DynamoError::builder()
        .error_type(ErrorType::Backend(kind))
        .message(message)
        .build()
}

impl PagodaEngine {
    pub fn new(
        handle: WorkerHandle,
        thread: std::thread::JoinHandle<()>,
        limits: Limits,
        registration: Registration,
        kv_feed: UnboundedReceiver<Vec<CacheEvent>>,
        metrics: Arc<Metrics>,
    ) -> PagodaEngine {
        PagodaEngine {
            worker: Mutex::new(Some((handle, thread))),
            limits,
            registration,
            kv_feed: Mutex::new(Some(kv_feed)),
            stop: Arc::new(AtomicBool::new(false)),
            metrics,
        }
    }

    fn handle(&self) -> Result<WorkerHandle, DynamoError> {
        let worker = self.worker.lock().unwrap_or_else(|e| e.into_inner());
        match worker.as_ref() {
            Some((handle, _)) => Ok(handle.clone()),
            None => Err(error(
                BackendError::EngineShutdown,
                "the pagoda engine has shut down",
            )),
        }
    }
}

#[async_trait]
impl LLMEngine for PagodaEngine {
    async fn start(&self, worker_id: u64) -> Result<EngineConfig, DynamoError> {
        let handle = self.handle()?;
        // The loop warms up on its thread (CUDA kernels and graphs); serve once it is done.
        loop {
            match handle.readiness().check() {
                Ok(()) => break,
                Err(not_ready) if not_ready.status == "loading" => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(not_ready) => {
                    return Err(error(BackendError::EngineShutdown, not_ready.reason));
                }
            }
        }
        let r = &self.registration;
        tracing::info!(
            "pagoda engine ready as Dynamo worker {worker_id}: {} pages of {} tokens, {} sequences",
            r.num_pages,
            r.page_size,
            r.parallel
        );
        Ok(EngineConfig {
            model: r.model.clone(),
            served_model_name: None,
            model_aliases: Vec::new(),
            runtime_data: HashMap::new(),
            llm: Some(LlmRegistration {
                context_length: Some(r.context_length as u32),
                kv_cache_block_size: Some(r.page_size as u32),
                total_kv_blocks: Some(r.num_pages as u64),
                max_num_seqs: Some(r.parallel as u64),
                max_num_batched_tokens: Some(r.batch_tokens as u64),
                ..LlmRegistration::default()
            }),
        })
    }

    async fn generate(
        &self,
        request: PreprocessedRequest,
        ctx: GenerateContext,
    ) -> Result<BoxStream<'static, Result<LLMEngineOutput, DynamoError>>, DynamoError> {
        let mapped = map_request(&request, &self.limits)
            .map_err(|message| error(BackendError::InvalidArgument, message))?;
        let Mapped {
            prompt,
            params,
            max_new_tokens,
            stop_tokens,
            visible_stop_tokens,
        } = mapped;
        let prompt_tokens = prompt.len() as u32;
        let (events, mut receiver) = tokio::sync::mpsc::unbounded_channel();
        let job = Job {
            prompt,
            params,
            max_new_tokens,
            stop_tokens: stop_tokens.clone(),
            top_logprobs: None,
            logit_bias: Vec::new(),
            constraint: None,
            sparse_attention: None,
            events,
        };
        self.handle()?.submit(job).map_err(|e| {
            let kind = match e.status.as_u16() {
                400 => BackendError::InvalidArgument,
                _ => BackendError::EngineShutdown,
            };
            error(kind, e.message)
        })?;
        let ctx = ctx.inner_arc();
        // Dropping `receiver` (the stream dropped, however that happens) cancels the request
        // in pagoda's loop before its next step.
        let stream = async_stream::stream! {
            let mut completion: u32 = 0;
            loop {
                let event = tokio::select! {
                    biased;
                    _ = ctx.stopped() => None,
                    event = receiver.recv() => Some(event),
                };
                let Some(event) = event else {
                    yield Ok(LLMEngineOutput::cancelled().with_usage(usage(prompt_tokens, completion)));
                    break;
                };
                match event {
                    None => {
                        yield Err(error(BackendError::EngineShutdown, "the pagoda engine loop stopped"));
                        break;
                    }
                    Some(WorkerEvent::Started { .. }) => {}
                    Some(WorkerEvent::Token { token, finished, .. }) => match finished {
                        None => {
                            completion += 1;
                            yield Ok(chunk::token(token));
                        }
                        Some(reason) => {
                            // A hidden stop token ends generation without being output.
                            let hidden = stop_tokens.contains(&token)
                                && !visible_stop_tokens.contains(&token);
                            let tokens = if hidden { Vec::new() } else { vec![token] };
                            completion += tokens.len() as u32;
                            let terminal = match reason {
                                FinishReason::Stop => LLMEngineOutput::stop(),
                                FinishReason::Length => LLMEngineOutput::length(),
                            };
                            yield Ok(terminal.with_tokens(tokens).with_usage(usage(prompt_tokens, completion)));
                            break;
                        }
                    },
                    Some(WorkerEvent::Failed { message, client_error }) => {
                        let kind = if client_error {
                            BackendError::InvalidArgument
                        } else {
                            BackendError::Unknown
                        };
                        yield Err(error(kind, message));
                        break;
                    }
                }
            }
        };
        Ok(Box::pin(stream))
    }

    /// One push source: a thread forwards the loop's prefix-cache changes to Dynamo's
    /// publisher (KV-aware routing).
    async fn kv_event_sources(&self) -> Result<Vec<KvEventSource>, DynamoError> {
        let taken = self
            .kv_feed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let Some(feed) = taken else {
            return Ok(Vec::new());
        };
        let page_size = self.registration.page_size as u32;
        let on_ready = Box::new(move |publisher| {
            std::thread::Builder::new()
                .name("pagoda-kv-events".into())
                .spawn(move || forward_kv_events(feed, publisher, page_size))
                .map(|_| ())
                .map_err(|e| error(BackendError::Unknown, format!("KV event thread: {e}")))
        });
        Ok(vec![KvEventSource::Push {
            on_ready,
            dp_rank: 0,
        }])
    }

    /// pagoda's counters in the runtime's `/metrics`; rank 0's load (pages in use of the
    /// pool) for the router and the component gauges.
    async fn setup_metrics(&self, ctx: MetricsCtx<'_>) -> Result<MetricsBindings, DynamoError> {
        let metrics = self.metrics.clone();
        ctx.metrics
            .add_expfmt_callback(Arc::new(move || Ok::<_, anyhow::Error>(metrics.render())));
        let gauge = self.handle()?.load_gauge();
        let stop = self.stop.clone();
        Ok(MetricsBindings {
            dp_ranks: vec![0],
            on_publisher_ready: Some(Box::new(move |publisher| {
                std::thread::Builder::new()
                    .name("pagoda-load".into())
                    .spawn(move || publish_load(gauge, publisher, stop))
                    .map(|_| ())
                    .map_err(|e| error(BackendError::Unknown, format!("load thread: {e}")))
            })),
        })
    }

    async fn cleanup(&self) -> Result<(), DynamoError> {
        self.stop.store(true, Ordering::Relaxed);
        let taken = self.worker.lock().unwrap_or_else(|e| e.into_inner()).take();
        // Dropping the last handle ends the loop once its running requests are done.
        if let Some((handle, thread)) = taken {
            drop(handle);
            let joined = tokio::task::spawn_blocking(move || thread.join()).await;
            if !matches!(joined, Ok(Ok(()))) {
                tracing::warn!("the pagoda engine thread ended with a panic");
            }
        }
        Ok(())
    }
}
