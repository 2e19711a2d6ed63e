//! [`Scheduler`]: continuous batching over a paged KV pool.
//!
//! Each [`Scheduler::schedule`] call plans one step under the token budget:
//! 1. every running sequence with one pending token (decodes, and prefills down to their last
//!    token) gets it: all decodes are batched together;
//! 2. running sequences still prefilling get chunks from what budget and pages remain;
//! 3. waiting requests are admitted in FIFO order while budget, the running limit and pages
//!    allow, each first sharing the longest cached full-page prefix of its tokens (capped so
//!    that at least the last token is computed, to have logits). The one exception to FIFO:
//!    with `prefix_wait_tokens` set, a request whose prompt shares that many tokens not yet
//!    cached with a running request that is still computing them waits for them (at the
//!    front) while the requests behind it are admitted (see `admission`).
//!
//! When a running sequence needs a page and none is free or evictable, the youngest running
//! sequence is preempted by recompute: its pages are released (its full pages stay in the
//! prefix cache while not evicted) and it goes back to the FRONT of the queue with prompt +
//! generated tokens as its new prefill. A sequence that is itself the youngest preempts
//! itself. Because [`Scheduler::add`] refuses requests that could not fit the pool alone,
//! the oldest running sequence can always progress, so every request eventually finishes.

mod admission;

use std::collections::VecDeque;

use pagoda_kv::{hash_page, BlockPool, BlockTable, PrefixCache, ROOT_HASH};

use crate::plan::{
    FinishReason, Finished, Request, RequestId, SampledToken, ScheduledSequence, SchedulerConfig,
    SchedulerError, SchedulerStats, StepPlan,
};

/// One request's state.
#[derive(Debug, Clone)]
struct Sequence {
    id: RequestId,
    /// Prompt followed by generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    max_new_tokens: usize,
    /// Pages and reserved slots; `table.num_tokens()` tokens have KV (or are being computed
    /// by the plan in flight).
    table: BlockTable,
    /// Chained key of each full, computed page, in order (the chain for cache registration).
    page_keys: Vec<u64>,
    /// Speculative tokens proposed for the next step ([`Scheduler::set_draft`]).
    draft: Vec<u32>,
}

/// A chunk of the plan in flight, remembered for `postprocess`.
#[derive(Debug, Clone)]
struct InFlight {
    id: RequestId,
    end: usize,
    samples: bool,
    /// The draft tokens the chunk ends with.
    draft: Vec<u32>,
}

/// The continuous-batching scheduler; owns the page pool and the prefix cache.
#[derive(Debug, Clone)]
pub struct Scheduler {
    config: SchedulerConfig,
    pool: BlockPool,
    cache: PrefixCache,
    waiting: VecDeque<Sequence>,
    /// Admission order: the last is the youngest.
    running: Vec<Sequence>,
    in_flight: Option<Vec<InFlight>>,
    prefix_hit_tokens: u64,
    preemptions: u64,
    /// Admissions passed over to wait for a running request's prefix pages, cumulative.
    prefix_waits: u64,
}

impl Scheduler {
    /// A scheduler over a fresh pool. Errors on a zero page size, pool or token budget.
    pub fn new(mut config: SchedulerConfig) -> Result<Self, SchedulerError> {
        if config.max_batch_tokens == 0 {
            return Err(SchedulerError::Config(
                "max_batch_tokens must be >= 1".into(),
            ));
        }
        if config.num_pages == 0 {
            return Err(SchedulerError::Config("num_pages must be >= 1".into()));
        }
        config.max_running = config.max_running.clamp(1, config.max_batch_tokens);
        let pool = BlockPool::new(config.num_pages, config.page_size)
            .map_err(|e| SchedulerError::Config(e.to_string()))?;
        Ok(Self {
            cache: PrefixCache::new(config.page_size),
            config,
            pool,
            waiting: VecDeque::new(),
            running: Vec::new(),
            in_flight: None,
            prefix_hit_tokens: 0,
            preemptions: 0,
            prefix_waits: 0,
        })
    }

    /// The configuration (with `max_running` clamped).
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Takes `count` free pages out of the pool for work outside the step plans (an
    /// embedding's prefill), evicting cached prefix pages as needed; `None`, with nothing
    /// taken, when free and evictable pages are fewer. Give them back with
    /// [`return_pages`](Self::return_pages) before the next [`schedule`](Self::schedule).
    pub fn borrow_pages(&mut self, count: usize) -> Option<Vec<pagoda_kv::PageId>> {
        if !self.cache.ensure_free(&mut self.pool, count) {
            return None;
        }
        self.pool.allocate_n(count)
    }

    /// Frees pages taken by [`borrow_pages`](Self::borrow_pages).
    pub fn return_pages(&mut self, pages: &[pagoda_kv::PageId]) -> Result<(), SchedulerError> {
        for &page in pages {
            self.pool
                .free(page)
                .map_err(|e| SchedulerError::Internal(e.to_string()))?;
        }
        Ok(())
    }

    /// The page pool (read-only: refcounts, free list).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The prefix cache (read-only).
    pub fn prefix_cache(&self) -> &PrefixCache {
        &self.cache
    }

    /// Starts (or stops) recording the prefix cache's changes for an external KV-aware router
    /// ([`PrefixCache::record_events`]).
    pub fn record_cache_events(&mut self, on: bool) {
        self.cache.record_events(on);
    }

    /// The prefix cache's changes since the last call, oldest first.
    pub fn take_cache_events(&mut self) -> Vec<pagoda_kv::CacheEvent> {
        self.cache.take_events()
    }

    /// Queues a request at the back. Errors on an empty prompt, zero `max_new_tokens`, a live
    /// duplicate id, or a request whose longest state (`prompt + max_new_tokens - 1` stored
    /// tokens) needs more pages than the whole pool.
    pub fn add(&mut self, request: Request) -> Result<(), SchedulerError> {
        let id = request.id;
        if request.prompt.is_empty() {
            return Err(SchedulerError::EmptyPrompt { id });
        }
        if request.max_new_tokens == 0 {
            return Err(SchedulerError::NoNewTokens { id });
        }
        if self.contains(id) {
            return Err(SchedulerError::DuplicateId { id });
        }
        let longest = request.prompt.len() + request.max_new_tokens - 1;
        let needed = longest.div_ceil(self.config.page_size);
        if needed > self.config.num_pages {
            return Err(SchedulerError::TooLargeForPool {
                id,
                needed,
                total: self.config.num_pages,
            });
        }
        self.waiting.push_back(Sequence {
            id,
            prompt_len: request.prompt.len(),
            tokens: request.prompt,
            max_new_tokens: request.max_new_tokens,
            table: BlockTable::new(),
            page_keys: Vec::new(),
            draft: Vec::new(),
        });
        Ok(())
    }

    /// Whether `id` is waiting or running.
    pub fn contains(&self, id: RequestId) -> bool {
        self.waiting.iter().any(|s| s.id == id) || self.running.iter().any(|s| s.id == id)
    }

    /// Prompt + generated tokens of a live request.
    pub fn tokens(&self, id: RequestId) -> Option<&[u32]> {
        self.waiting
            .iter()
            .chain(self.running.iter())
            .find(|s| s.id == id)
            .map(|s| s.tokens.as_slice())
    }

    /// Ids of running requests, oldest admission first.
    pub fn running_ids(&self) -> Vec<RequestId> {
        self.running.iter().map(|s| s.id).collect()
    }

    /// Ids of waiting requests, front of the queue first.
    pub fn waiting_ids(&self) -> Vec<RequestId> {
        self.waiting.iter().map(|s| s.id).collect()
    }

    /// The pages a running request holds, in token order.
    pub fn pages_of(&self, id: RequestId) -> Option<&[pagoda_kv::PageId]> {
        self.running
            .iter()
            .find(|s| s.id == id)
            .map(|s| s.table.pages())
    }

    /// Tokens of a running request not yet computed or reserved (1 for a decode; the rest of
    /// the prompt for a chunked prefill). `None` when it is not running.
    pub fn pending_tokens(&self, id: RequestId) -> Option<usize> {
        self.running
            .iter()
            .find(|s| s.id == id)
            .map(|s| s.tokens.len() - s.table.num_tokens())
    }

    /// Waiting + running requests.
    pub fn num_unfinished(&self) -> usize {
        self.waiting.len() + self.running.len()
    }

    /// Current counters and gauges.
    pub fn stats(&self) -> SchedulerStats {
        let pages_free = self.pool.num_free();
        let pages_evictable = self.cache.num_evictable();
        SchedulerStats {
            pages_total: self.pool.num_pages(),
            pages_free,
            pages_used: self.pool.num_pages() - pages_free - pages_evictable,
            pages_cached: self.cache.num_cached(),
            pages_evictable,
            prefix_hit_tokens: self.prefix_hit_tokens,
            preemptions: self.preemptions,
            prefix_waits: self.prefix_waits,
            num_waiting: self.waiting.len(),
            num_running: self.running.len(),
        }
    }

    /// Ends a request now: a running one releases its pages immediately (cached pages stay in
    /// the cache). Returns whether it was live. Its row in a plan in flight is ignored by
    /// `postprocess`.
    pub fn abort(&mut self, id: RequestId) -> Result<bool, SchedulerError> {
        if let Some(index) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(index);
            return Ok(true);
        }
        if let Some(index) = self.running.iter().position(|s| s.id == id) {
            let mut sequence = self.running.remove(index);
            self.cache.release(&mut self.pool, &mut sequence.table)?;
            return Ok(true);
        }
        Ok(false)
    }

    /// Plans the next step (see the module docs). Slots are reserved now; the caller runs the
    /// forward and must call [`Scheduler::postprocess`] before the next `schedule`.
    pub fn schedule(&mut self) -> Result<StepPlan, SchedulerError> {
        if self.in_flight.is_some() {
            return Err(SchedulerError::StepInFlight);
        }
        let mut plan = StepPlan {
            page_size: self.config.page_size,
            num_pages: self.config.num_pages,
            ..StepPlan::default()
        };
        let mut budget = self.config.max_batch_tokens;
        // Pass 1 and 2: single-token rows first, then prefill chunks, oldest first.
        let mut order: Vec<(bool, RequestId)> = self
            .running
            .iter()
            .map(|s| (s.tokens.len() - s.table.num_tokens() > 1, s.id))
            .collect();
        order.sort_by_key(|&(is_chunk, _)| is_chunk);
        // Drafts only take budget that every single-token row after them leaves.
        let mut singles_left = order.iter().filter(|&&(is_chunk, _)| !is_chunk).count();
        for (is_chunk, id) in order {
            if budget == 0 {
                break;
            }
            if !is_chunk {
                singles_left -= 1;
            }
            self.schedule_running(id, &mut budget, singles_left, &mut plan)?;
        }
        // Pass 3: admission, FIFO, never after a preemption in the same step; a request that
        // waits for a running request's prefix pages is passed over (see `admission`).
        let mut next = 0;
        while plan.preempted.is_empty()
            && budget > 0
            && self.running.len() < self.config.max_running
            && next < self.waiting.len()
        {
            if self.waits_for_prefix(next) {
                self.prefix_waits += 1;
                next += 1;
                continue;
            }
            if !self.admit_waiting(next, &mut budget, &mut plan)? {
                break;
            }
        }
        self.in_flight = Some(
            plan.sequences
                .iter()
                .map(|s| InFlight {
                    id: s.id,
                    end: s.positions.end,
                    samples: s.samples,
                    draft: s.tokens[s.tokens.len() - s.draft..].to_vec(),
                })
                .collect(),
        );
        Ok(plan)
    }

    /// Gives one running sequence its pending tokens (as many as budget and pages allow),
    /// and a decode its draft as far as the budget beyond `reserve` more tokens allows,
    /// preempting younger sequences when no page is left.
    fn schedule_running(
        &mut self,
        id: RequestId,
        budget: &mut usize,
        reserve: usize,
        plan: &mut StepPlan,
    ) -> Result<(), SchedulerError> {
        let page_size = self.config.page_size;
        loop {
            let Some(index) = self.running.iter().position(|s| s.id == id) else {
                return Ok(());
            };
            let sequence = &self.running[index];
            let start = sequence.table.num_tokens();
            let pending = sequence.tokens.len() - start;
            // A draft rides behind the one pending token of a decode.
            let draft = if pending == 1 {
                sequence.draft.len().min(budget.saturating_sub(1 + reserve))
            } else {
                0
            };
            let available = self.pool.num_free() + self.cache.num_evictable();
            let room = (sequence.table.pages().len() + available) * page_size - start;
            let take = (pending + draft).min(*budget).min(room);
            if take > 0 {
                let needed = (start + take).div_ceil(page_size) - sequence.table.pages().len();
                if !self.cache.ensure_free(&mut self.pool, needed) {
                    return Err(SchedulerError::Internal(format!(
                        "request {id}: {needed} pages counted as available but not freed"
                    )));
                }
                let sequence = &mut self.running[index];
                let slots = sequence
                    .table
                    .append_slots(&mut self.pool, take)
                    .map_err(|e| SchedulerError::Internal(e.to_string()))?;
                *budget -= take;
                let own = take.min(pending);
                let drafted = take - own;
                let mut tokens = sequence.tokens[start..start + own].to_vec();
                tokens.extend(&sequence.draft[..drafted]);
                sequence.draft.clear();
                plan.sequences.push(ScheduledSequence {
                    id,
                    positions: start..start + take,
                    tokens,
                    slots,
                    pages: sequence.table.pages().to_vec(),
                    samples: start + own == sequence.tokens.len(),
                    prefix_hit_tokens: 0,
                    draft: drafted,
                });
                return Ok(());
            }
            // No room for a single token: preempt the youngest (possibly this sequence).
            let victim = self.running.len() - 1;
            let victim_id = self.running[victim].id;
            self.preempt(victim, budget, plan)?;
            if victim_id == id {
                return Ok(());
            }
        }
    }

    /// Releases the running sequence at `index` and re-queues it at the front for recompute;
    /// drops its row from `plan` if it was already scheduled this step.
    fn preempt(
        &mut self,
        index: usize,
        budget: &mut usize,
        plan: &mut StepPlan,
    ) -> Result<(), SchedulerError> {
        let mut sequence = self.running.remove(index);
        if let Some(row) = plan.sequences.iter().position(|s| s.id == sequence.id) {
            let removed = plan.sequences.remove(row);
            *budget += removed.positions.len();
            self.prefix_hit_tokens -= removed.prefix_hit_tokens as u64;
        }
        self.cache.release(&mut self.pool, &mut sequence.table)?;
        sequence.page_keys.clear();
        sequence.draft.clear();
        self.preemptions += 1;
        plan.preempted.push(sequence.id);
        self.waiting.push_front(sequence);
        Ok(())
    }

    /// Speculation: proposes `draft` to follow the pending token of running request `id` in
    /// the next step, where its rows are then all sampled ([`ScheduledSequence::draft`]).
    /// Only a decode (one pending token) takes a draft, cut so that the pending token, the
    /// draft and a bonus token fit `max_new_tokens`; the step may shorten it further (token
    /// budget, pages). Returns how many tokens were kept (0: none, the request is prefilling,
    /// not running, or a step is in flight). A draft lives for one step.
    pub fn set_draft(&mut self, id: RequestId, mut draft: Vec<u32>) -> usize {
        if self.in_flight.is_some() {
            return 0;
        }
        let Some(sequence) = self.running.iter_mut().find(|s| s.id == id) else {
            return 0;
        };
        if sequence.tokens.len() - sequence.table.num_tokens() != 1 {
            return 0;
        }
        // Generated after this step: the pending token's successor, plus one per accepted guess.
        let generated = sequence.tokens.len() - sequence.prompt_len;
        let room = sequence.max_new_tokens.saturating_sub(generated + 1);
        draft.truncate(room);
        sequence.draft = draft;
        sequence.draft.len()
    }

    /// Completes the plan in flight: marks its tokens computed (registering pages that became
    /// full in the prefix cache), appends each sampled token, and finishes requests that hit
    /// a stop (`SampledToken::stop`) or `max_new_tokens`, releasing their pages. `sampled`
    /// must hold exactly one entry per sampling row of the plan (rows of requests aborted
    /// since are skipped), in any order. On error nothing changes.
    pub fn postprocess(
        &mut self,
        sampled: &[SampledToken],
    ) -> Result<Vec<Finished>, SchedulerError> {
        let Some(flight) = self.in_flight.as_ref() else {
            return Err(SchedulerError::NoStepInFlight);
        };
        let live = |id: RequestId| self.running.iter().any(|s| s.id == id);
        for (position, token) in sampled.iter().enumerate() {
            let row = flight.iter().find(|f| f.id == token.id && f.samples);
            let expected = row.is_some_and(|row| token.accepted <= row.draft.len());
            let repeated = sampled[..position].iter().any(|t| t.id == token.id);
            if (!expected && live(token.id)) || repeated {
                return Err(SchedulerError::UnexpectedSample { id: token.id });
            }
        }
        for row in flight.iter().filter(|f| f.samples && live(f.id)) {
            if !sampled.iter().any(|t| t.id == row.id) {
                return Err(SchedulerError::MissingSample { id: row.id });
            }
        }
        let flight = self.in_flight.take().unwrap_or_default();
        let mut finished = Vec::new();
        for row in flight {
            let Some(index) = self.running.iter().position(|s| s.id == row.id) else {
                continue;
            };
            let token = sampled.iter().find(|t| t.id == row.id && row.samples);
            // The KV of rejected draft tokens goes: the table ends after the accepted ones,
            // and only pages full of kept tokens are registered.
            let accepted = token.map_or(0, |t| t.accepted);
            let kept = row.end - row.draft.len() + accepted;
            if kept < row.end {
                self.running[index]
                    .table
                    .truncate(&mut self.pool, kept)
                    .map_err(|e| SchedulerError::Internal(e.to_string()))?;
            }
            let Some(token) = token else {
                self.register_full_pages(index, kept)?;
                continue;
            };
            let sequence = &mut self.running[index];
            sequence.tokens.extend(&row.draft[..accepted]);
            sequence.tokens.push(token.token);
            self.register_full_pages(index, kept)?;
            let sequence = &mut self.running[index];
            let generated = sequence.tokens.len() - sequence.prompt_len;
            let reason = if token.stop {
                Some(FinishReason::Stop)
            } else if generated >= sequence.max_new_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            if let Some(reason) = reason {
                let mut sequence = self.running.remove(index);
                self.cache.release(&mut self.pool, &mut sequence.table)?;
                finished.push(Finished {
                    id: sequence.id,
                    reason,
                    generated: sequence.tokens[sequence.prompt_len..].to_vec(),
                });
            }
        }
        Ok(finished)
    }

    /// Extends the page-key chain of the running sequence at `index` over every page full
    /// among its first `computed` tokens, registering each in the cache when caching is on.
    fn register_full_pages(&mut self, index: usize, computed: usize) -> Result<(), SchedulerError> {
        if !self.config.prefix_caching {
            return Ok(());
        }
        let page_size = self.config.page_size;
        let sequence = &mut self.running[index];
        while (sequence.page_keys.len() + 1) * page_size <= computed {
            let page_index = sequence.page_keys.len();
            let parent = sequence.page_keys.last().copied().unwrap_or(ROOT_HASH);
            let page_tokens =
                &sequence.tokens[page_index * page_size..(page_index + 1) * page_size];
            let page = sequence.table.pages()[page_index];
            self.cache
                .insert(&mut self.pool, page, parent, page_tokens)?;
            sequence.page_keys.push(hash_page(parent, page_tokens));
        }
        Ok(())
    }
}
