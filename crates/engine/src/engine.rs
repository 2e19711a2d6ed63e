//! Requests, steps and the batched forward.

use std::collections::VecDeque;

use pagoda_kv::{BlockPool, BlockTable, PageTable};
use pagoda_models::llama::{AttentionPolicy, ForwardBatch, KvCache, Model};
use pagoda_ops::attention::AttentionPath;
use pagoda_ops::sampling::{Sampler, SamplingParams};

/// Identifies a request inside one engine.
pub type RequestId = u64;

/// Engine sizing and paths.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Tokens per KV page.
    pub page_size: usize,
    /// Pages in the KV pool (shared by all requests).
    pub num_pages: usize,
    /// Most new tokens (prefill + decode) one step may run.
    pub max_batch_tokens: usize,
    /// Longest sequence (prompt + generated) a request may reach.
    pub max_context: usize,
    /// How each step picks its CPU attention path.
    pub attention: AttentionPolicy,
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token was sampled (it is reported, then the request ends).
    Stop,
    /// `max_new_tokens` or the context limit was reached.
    Length,
}

/// What one step produced for one request.
#[derive(Debug, Clone)]
pub struct StepEvent {
    pub request: RequestId,
    /// The sampled token.
    pub token: u32,
    /// Log-softmax of the raw logits at this position, when the request asked for them.
    pub logprobs: Option<Vec<f32>>,
    /// Set when this token ends the request.
    pub finished: Option<FinishReason>,
}

/// Errors the caller can act on.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("max_new_tokens must be at least 1")]
    NoNewTokens,
    #[error("a prompt of {prompt} tokens plus {max_new_tokens} new tokens exceeds the context size of {context} tokens; shorten the prompt, ask for fewer tokens, or raise the context size")]
    ContextOverflow {
        prompt: usize,
        max_new_tokens: usize,
        context: usize,
    },
    #[error("token id {token} is outside the vocabulary (size {vocab_size})")]
    TokenOutOfRange { token: u32, vocab_size: usize },
    #[error("the KV cache is full: {needed} pages needed, {free} free of {total}; raise the KV pool size")]
    OutOfPages {
        needed: usize,
        free: usize,
        total: usize,
    },
    #[error("invalid sampling parameters: {0}")]
    Sampling(String),
    #[error("internal error (please report): {0}")]
    Internal(String),
}

/// Counters of what the engine ran, for benchmarks and metrics: a harness reads these to prove
/// which path served a run.
#[derive(Debug, Clone, Default)]
pub struct EngineCounters {
    /// Forward passes whose attention ran split-KV decode.
    pub steps_split_kv: u64,
    /// Forward passes whose attention ran gather-then-attend.
    pub steps_gather: u64,
    /// Tokens run through the model.
    pub tokens_forwarded: u64,
}

impl EngineCounters {
    fn record(&mut self, path: AttentionPath, num_tokens: usize) {
        static LOGGED_SPLIT_KV: std::sync::Once = std::sync::Once::new();
        static LOGGED_GATHER: std::sync::Once = std::sync::Once::new();
        match path {
            AttentionPath::SplitKv => {
                LOGGED_SPLIT_KV.call_once(|| {
                    tracing::info!(
                        "attention path taken: split_kv (CPU split-KV decode + LSE merge)"
                    )
                });
                self.steps_split_kv += 1;
            }
            AttentionPath::Gather => {
                LOGGED_GATHER.call_once(|| {
                    tracing::info!("attention path taken: gather (gather-then-attend)")
                });
                self.steps_gather += 1;
            }
        }
        self.tokens_forwarded += num_tokens as u64;
    }
}

struct Request {
    id: RequestId,
    /// Prompt followed by generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens whose K/V are in the cache.
    num_computed: usize,
    max_new_tokens: usize,
    stop_tokens: Vec<u32>,
    sampler: Sampler,
    block_table: BlockTable,
    want_logprobs: bool,
}

/// A CPU inference engine over one model.
pub struct Engine {
    model: Model,
    config: EngineConfig,
    kv: KvCache,
    pool: BlockPool,
    running: VecDeque<Request>,
    next_id: RequestId,
    counters: EngineCounters,
}

impl Engine {
    /// An engine with a zeroed KV pool sized by `config`.
    pub fn new(model: Model, config: EngineConfig) -> Result<Engine, String> {
        let pool = BlockPool::new(config.num_pages, config.page_size).map_err(|e| e.to_string())?;
        let kv = KvCache::new(
            model.config().num_layers,
            model.kv_layout(config.num_pages, config.page_size),
        );
        Ok(Engine {
            model,
            config,
            kv,
            pool,
            running: VecDeque::new(),
            next_id: 0,
            counters: EngineCounters::default(),
        })
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The engine's configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Bytes held by the KV pools.
    pub fn kv_bytes(&self) -> usize {
        self.kv.size_bytes()
    }

    /// What has run so far.
    pub fn counters(&self) -> &EngineCounters {
        &self.counters
    }

    /// Pages in use.
    pub fn pages_used(&self) -> usize {
        self.pool.num_used()
    }

    /// Requests not yet finished.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Admits a request. `stop_tokens` end generation (the end-of-generation ids of the
    /// tokenizer, usually).
    pub fn add_request(
        &mut self,
        prompt: Vec<u32>,
        params: SamplingParams,
        max_new_tokens: usize,
        stop_tokens: Vec<u32>,
        want_logprobs: bool,
    ) -> Result<RequestId, EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if max_new_tokens == 0 {
            return Err(EngineError::NoNewTokens);
        }
        let vocab_size = self.model.config().vocab_size;
        if let Some(&token) = prompt.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(EngineError::TokenOutOfRange { token, vocab_size });
        }
        if prompt.len() + max_new_tokens > self.config.max_context {
            return Err(EngineError::ContextOverflow {
                prompt: prompt.len(),
                max_new_tokens,
                context: self.config.max_context,
            });
        }
        let sampler = Sampler::new(params).map_err(EngineError::Sampling)?;
        let id = self.next_id;
        self.next_id += 1;
        self.running.push_back(Request {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            num_computed: 0,
            max_new_tokens,
            stop_tokens,
            sampler,
            block_table: BlockTable::new(),
            want_logprobs,
        });
        Ok(id)
    }

    /// Ends a request early and frees its pages. Unknown ids are ignored.
    pub fn cancel(&mut self, id: RequestId) {
        if let Some(index) = self.running.iter().position(|r| r.id == id) {
            let mut request = self.running.remove(index).expect("index from position");
            let _ = request.block_table.release(&mut self.pool);
        }
    }

    /// The seed a request's sampler uses (reported so runs can be replayed).
    pub fn seed_of(&self, id: RequestId) -> Option<u64> {
        self.running
            .iter()
            .find(|r| r.id == id)
            .map(|r| r.sampler.seed())
    }

    /// Runs one step: every running request contributes its next prefill chunk or its decode
    /// token, within the token budget, in one batched forward. Returns one event per request
    /// that sampled a token this step (a request still prefilling a long prompt samples
    /// nothing until its last chunk).
    pub fn step(&mut self) -> Result<Vec<StepEvent>, EngineError> {
        // Plan: which requests run how many tokens.
        let mut budget = self.config.max_batch_tokens.max(1);
        let mut plan: Vec<(usize, usize)> = Vec::new(); // (index into running, new tokens)
        let page_size = self.pool.page_size();
        let mut free_pages = self.pool.num_free();
        for (index, request) in self.running.iter_mut().enumerate() {
            if budget == 0 {
                break;
            }
            let pending = request.tokens.len() - request.num_computed;
            // As many pending tokens as the budget and the still-unclaimed pages allow (a
            // prefill chunk may shrink; a request that cannot take one token waits).
            let table = &request.block_table;
            let room = (table.pages().len() + free_pages) * page_size - table.num_tokens();
            let take = pending.min(budget).min(room);
            if take == 0 {
                continue;
            }
            free_pages -= pages_needed(table, take, page_size);
            budget -= take;
            plan.push((index, take));
        }
        if plan.is_empty() {
            if self.running.is_empty() {
                return Ok(Vec::new());
            }
            return Err(EngineError::OutOfPages {
                needed: pages_needed(&self.running[0].block_table, 1, self.pool.page_size()),
                free: self.pool.num_free(),
                total: self.pool.num_pages(),
            });
        }

        // Host inputs: tokens, positions, slots, ragged ranges, the page table.
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut slots = Vec::new();
        let mut qo_indptr = vec![0u32];
        let mut logits_for = Vec::new();
        let mut samples = Vec::new(); // (index into running) for each logits row
        for &(index, take) in &plan {
            let request = &mut self.running[index];
            let start = request.num_computed;
            let new_slots = request
                .block_table
                .append_slots(&mut self.pool, take)
                .map_err(|e| {
                    EngineError::Internal(format!("pages planned but not granted: {e}"))
                })?;
            for (offset, slot) in new_slots.into_iter().enumerate() {
                tokens.push(request.tokens[start + offset]);
                positions.push((start + offset) as u32);
                slots.push(slot);
            }
            request.num_computed += take;
            qo_indptr.push(tokens.len() as u32);
            if request.num_computed == request.tokens.len() {
                logits_for.push(tokens.len() - 1);
                samples.push(index);
            }
        }
        let tables: Vec<&BlockTable> = plan
            .iter()
            .map(|&(index, _)| &self.running[index].block_table)
            .collect();
        let page_table = PageTable::from_block_tables(&tables, &self.pool)
            .map_err(|e| EngineError::Internal(e.to_string()))?;

        let batch = ForwardBatch {
            tokens: &tokens,
            positions: &positions,
            slots: &slots,
            qo_indptr: &qo_indptr,
            page_table: &page_table,
            logits_for: &logits_for,
        };
        // Run the whole forward on a pool worker: the ops' parallel loops then start from inside
        // the pool instead of handing every one of them across threads.
        let (model, kv, path) = (&self.model, &mut self.kv, self.config.attention);
        let output = rayon::scope(|_| model.forward(&batch, kv, path))
            .map_err(|e| EngineError::Internal(e.to_string()))?;
        self.counters.record(output.attention_path, tokens.len());
        let logits = output.logits;

        // Sample and finish.
        let vocab_size = self.model.config().vocab_size;
        let mut events = Vec::with_capacity(samples.len());
        let mut finished_ids = Vec::new();
        for (row, &index) in samples.iter().enumerate() {
            let request = &mut self.running[index];
            let row_logits = &logits[row * vocab_size..(row + 1) * vocab_size];
            let generated = &request.tokens[request.prompt_len..];
            let token = request.sampler.sample(row_logits, generated);
            let logprobs = request
                .want_logprobs
                .then(|| pagoda_ops::sampling::log_softmax(row_logits));
            request.tokens.push(token);
            let num_generated = request.tokens.len() - request.prompt_len;
            let finished = if request.stop_tokens.contains(&token) {
                Some(FinishReason::Stop)
            } else if num_generated >= request.max_new_tokens
                || request.tokens.len() >= self.config.max_context
            {
                Some(FinishReason::Length)
            } else {
                None
            };
            if finished.is_some() {
                finished_ids.push(request.id);
            }
            events.push(StepEvent {
                request: request.id,
                token,
                logprobs,
                finished,
            });
        }
        for id in finished_ids {
            self.cancel(id);
        }
        Ok(events)
    }
}

/// Pages a block table must add to hold `new_tokens` more tokens.
fn pages_needed(table: &BlockTable, new_tokens: usize, page_size: usize) -> usize {
    let total = table.num_tokens() + new_tokens;
    total
        .div_ceil(page_size)
        .saturating_sub(table.pages().len())
}
