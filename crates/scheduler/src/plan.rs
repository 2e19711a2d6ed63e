//! The scheduler's data types: configuration, requests, the [`StepPlan`] a step runs, what
//! the caller reports back, statistics and errors.

use std::ops::Range;

use pagoda_kv::{PageId, PageTable, PageTableError, PageTableRequest, PoolError, Slot};

/// Identifies a request; chosen by the caller, unique among live requests.
pub type RequestId = u64;

/// Scheduler sizing and switches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Tokens per KV page (>= 1).
    pub page_size: usize,
    /// Pages in the KV pool.
    pub num_pages: usize,
    /// Most new tokens (prefill chunks + decode tokens) one step may schedule (>= 1).
    pub max_batch_tokens: usize,
    /// Most sequences running at once; clamped to `max_batch_tokens` so every running
    /// sequence's decode token always fits one step's budget.
    pub max_running: usize,
    /// Share cached full pages between prompts with a common prefix.
    pub prefix_caching: bool,
    /// Prefix-aware admission: a waiting request that shares at least this many tokens not
    /// yet cached with a running request still computing them waits for them (0: off, plain
    /// FIFO; needs `prefix_caching`).
    pub prefix_wait_tokens: usize,
}

impl SchedulerConfig {
    /// A config with `max_running = max_batch_tokens`, prefix caching on and prefix-aware
    /// admission off.
    pub fn new(page_size: usize, num_pages: usize, max_batch_tokens: usize) -> Self {
        Self {
            page_size,
            num_pages,
            max_batch_tokens,
            max_running: max_batch_tokens,
            prefix_caching: true,
            prefix_wait_tokens: 0,
        }
    }
}

/// A request as handed to [`Scheduler::add`](crate::Scheduler::add).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Caller-chosen id.
    pub id: RequestId,
    /// Prompt token ids (non-empty).
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (>= 1); reaching it finishes with [`FinishReason::Length`].
    pub max_new_tokens: usize,
}

/// One sequence's share of a step: a contiguous run of its tokens to compute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledSequence {
    /// The request.
    pub id: RequestId,
    /// Positions computed this step (absolute, from the start of the sequence).
    pub positions: Range<usize>,
    /// The token ids at those positions (`positions.len()` entries).
    pub tokens: Vec<u32>,
    /// KV slot of each of those tokens, in order.
    pub slots: Vec<Slot>,
    /// The sequence's pages after this step's reservation (token `t` in
    /// `pages[t / page_size]`), for the CSR page table.
    pub pages: Vec<PageId>,
    /// Whether the chunk reaches the sequence's end, so its last position's logits must be
    /// sampled and reported to `postprocess`.
    pub samples: bool,
    /// Prompt tokens taken from the prefix cache when this sequence was admitted this step
    /// (0 otherwise).
    pub prefix_hit_tokens: usize,
    /// Speculation: the last `draft` tokens of the chunk are a proposer's guesses
    /// ([`Scheduler::set_draft`](crate::Scheduler::set_draft)), after the one pending token;
    /// every row from the pending token on is sampled (0 without speculation).
    pub draft: usize,
}

impl ScheduledSequence {
    /// Tokens stored for the sequence once this step has run (`positions.end`).
    pub fn num_tokens_after(&self) -> usize {
        self.positions.end
    }

    /// Whether this is a single-token decode of an already generated token (rather than a
    /// prompt or recompute chunk).
    pub fn is_decode(&self) -> bool {
        self.positions.len() == 1 && self.positions.start > 0 && self.samples
    }
}

/// Everything one step runs, in batch order (single-token rows first, then prefill chunks).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// The scheduled sequences.
    pub sequences: Vec<ScheduledSequence>,
    /// Requests preempted while planning this step (their pages are released; they wait at
    /// the front of the queue to be recomputed).
    pub preempted: Vec<RequestId>,
    /// Tokens per page.
    pub page_size: usize,
    /// Pages in the pool.
    pub num_pages: usize,
}

impl StepPlan {
    /// Whether nothing runs this step.
    pub fn is_empty(&self) -> bool {
        self.sequences.is_empty()
    }

    /// New tokens this step (sum of chunk lengths; never above `max_batch_tokens`).
    pub fn num_tokens(&self) -> usize {
        self.sequences.iter().map(|s| s.positions.len()).sum()
    }

    /// Token ids of every row, sequences concatenated.
    pub fn flat_tokens(&self) -> Vec<u32> {
        self.sequences
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect()
    }

    /// Absolute position of every row.
    pub fn flat_positions(&self) -> Vec<u32> {
        self.sequences
            .iter()
            .flat_map(|s| s.positions.clone().map(|p| p as u32))
            .collect()
    }

    /// KV slot of every row.
    pub fn flat_slots(&self) -> Vec<Slot> {
        self.sequences
            .iter()
            .flat_map(|s| s.slots.iter().copied())
            .collect()
    }

    /// `[B + 1]` ragged row offsets: sequence `b` owns rows `qo_indptr[b]..qo_indptr[b + 1]`.
    pub fn qo_indptr(&self) -> Vec<u32> {
        let mut indptr = vec![0u32];
        let mut total = 0u32;
        for sequence in &self.sequences {
            total += sequence.positions.len() as u32;
            indptr.push(total);
        }
        indptr
    }

    /// Rows whose logits are sampled, in order: the last row of each sampling sequence, or
    /// with a draft its last `draft + 1` rows (the pending token's and each guess's).
    pub fn logits_for(&self) -> Vec<usize> {
        let mut rows = Vec::new();
        let mut end = 0;
        for sequence in &self.sequences {
            end += sequence.positions.len();
            if sequence.samples {
                rows.extend(end - 1 - sequence.draft..end);
            }
        }
        rows
    }

    /// Ids of the sequences whose logits are sampled, in `logits_for` order.
    pub fn sampling_ids(&self) -> Vec<RequestId> {
        self.sequences
            .iter()
            .filter(|s| s.samples)
            .map(|s| s.id)
            .collect()
    }

    /// The validated CSR page table over every scheduled sequence (all tokens visible).
    pub fn page_table(&self) -> Result<PageTable, PageTableError> {
        let requests: Vec<PageTableRequest<'_>> = self
            .sequences
            .iter()
            .map(|s| PageTableRequest {
                pages: &s.pages,
                num_tokens: s.positions.end,
                logical_start: 0,
            })
            .collect();
        PageTable::build(&requests, self.num_pages, self.page_size)
    }
}

/// The token sampled for one scheduled sequence, reported to `postprocess`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampledToken {
    /// The request.
    pub id: RequestId,
    /// The sampled token id.
    pub token: u32,
    /// The caller decided this token ends the request (a stop token); it is still appended.
    pub stop: bool,
    /// Speculation: how many of the row's draft tokens were accepted, in order, before
    /// `token` (0 without a draft). They are appended before it; the KV of the rejected
    /// ones is dropped.
    pub accepted: usize,
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// The caller flagged the token as a stop token.
    Stop,
    /// `max_new_tokens` were generated.
    Length,
}

/// A request that ended in `postprocess`; its pages are already released.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    /// The request.
    pub id: RequestId,
    /// Why.
    pub reason: FinishReason,
    /// The generated tokens (prompt excluded).
    pub generated: Vec<u32>,
}

/// Counters and gauges of the scheduler.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Pages in the pool.
    pub pages_total: usize,
    /// Pages on the free list.
    pub pages_free: usize,
    /// Pages held by at least one sequence (`total - free - evictable`).
    pub pages_used: usize,
    /// Pages registered in the prefix cache (shared or evictable).
    pub pages_cached: usize,
    /// Cached pages no sequence holds: resident, reclaimed LRU on demand.
    pub pages_evictable: usize,
    /// Prompt (or recompute) tokens served from the prefix cache, cumulative.
    pub prefix_hit_tokens: u64,
    /// Preemptions by recompute, cumulative.
    pub preemptions: u64,
    /// Admissions passed over to wait for a running request's prefix pages (one per request
    /// and step), cumulative.
    pub prefix_waits: u64,
    /// Requests waiting for admission (including preempted ones).
    pub num_waiting: usize,
    /// Requests admitted and holding pages.
    pub num_running: usize,
}

/// Misuse of the scheduler or an internal inconsistency; each names the request or value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedulerError {
    /// The configuration is unusable.
    #[error("invalid scheduler config: {0}")]
    Config(String),
    /// A request with no prompt tokens.
    #[error("request {id}: the prompt is empty")]
    EmptyPrompt {
        /// The request.
        id: RequestId,
    },
    /// A request asking for zero new tokens.
    #[error("request {id}: max_new_tokens must be at least 1")]
    NoNewTokens {
        /// The request.
        id: RequestId,
    },
    /// The id is already live.
    #[error("request {id} is already queued or running")]
    DuplicateId {
        /// The request.
        id: RequestId,
    },
    /// Even alone the request could never fit the pool.
    #[error(
        "request {id} needs {needed} KV pages at its longest, the pool has {total}; \
         raise the KV pool size or shorten the request"
    )]
    TooLargeForPool {
        /// The request.
        id: RequestId,
        /// Pages the request needs at its longest.
        needed: usize,
        /// Pages in the pool.
        total: usize,
    },
    /// `schedule` was called while the previous plan still awaits `postprocess`.
    #[error("the previous step plan has not been postprocessed")]
    StepInFlight,
    /// `postprocess` without a pending plan.
    #[error("postprocess called with no step plan in flight")]
    NoStepInFlight,
    /// A sampled token for a request that was not scheduled to sample, or twice.
    #[error(
        "request {id}: sampled token not expected (not a sampling row of the plan, or repeated)"
    )]
    UnexpectedSample {
        /// The request.
        id: RequestId,
    },
    /// A sampling row of the plan got no token.
    #[error("request {id}: the plan samples it but postprocess got no token")]
    MissingSample {
        /// The request.
        id: RequestId,
    },
    /// Pool bookkeeping failed (a bug).
    #[error("KV bookkeeping: {0}")]
    Pool(#[from] PoolError),
    /// Anything else inconsistent (a bug).
    #[error("internal scheduler error: {0}")]
    Internal(String),
}
