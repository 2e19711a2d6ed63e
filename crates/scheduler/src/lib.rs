//! pagoda's scheduler: continuous batching over the paged KV pool of `pagoda_kv`, with
//! chunked prefill under a per-step token budget, preemption by recompute and prefix caching.
//!
//! Pure logic over integers: a step is `schedule()` -> [`StepPlan`] (tokens, positions, KV
//! slots, pages for the CSR page table) -> the caller's forward and sampling ->
//! `postprocess(sampled tokens)`.

mod plan;
mod scheduler;

pub use pagoda_kv::{PageId, PageTable, Slot};
pub use plan::{
    FinishReason, Finished, Request, RequestId, SampledToken, ScheduledSequence, SchedulerConfig,
    SchedulerError, SchedulerStats, StepPlan,
};
pub use scheduler::Scheduler;
