//! What a KV-aware router outside the server needs from the loop (NVIDIA Dynamo's worker,
//! `crates/dynamo`): the prefix cache's changes and the load, published once per turn.

use pagoda_engine::CacheEvent;
use tokio::sync::mpsc::UnboundedSender;

/// The loop's load after its last turn ([`WorkerHandle::load`](super::WorkerHandle::load)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerLoad {
    /// Requests admitted to the engine and not finished.
    pub running: usize,
    /// Requests (and embedding inputs) waiting for admission.
    pub waiting: usize,
    /// KV pages held by requests (evictable cached pages not counted).
    pub pages_used: usize,
    /// KV pages in the pool.
    pub pages_total: usize,
}

/// Options of [`spawn_worker_with`](super::spawn_worker_with).
#[derive(Debug, Default)]
pub struct WorkerOptions {
    /// Receives the prefix cache's changes, one batch per loop turn that changed it, oldest
    /// first. Recording starts before the first request; when the receiver is dropped the
    /// loop stops recording.
    pub kv_events: Option<UnboundedSender<Vec<CacheEvent>>>,
}
