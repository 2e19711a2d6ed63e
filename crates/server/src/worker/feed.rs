//! What a KV-aware router outside the server needs from the loop (NVIDIA Dynamo's worker,
//! `crates/dynamo`): the prefix cache's changes and the load, published once per turn.

use std::sync::{Arc, Mutex};

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

/// The loop's load, readable without keeping the loop alive (a [`WorkerHandle`](super::WorkerHandle)
/// does: the loop ends when every handle is gone).
#[derive(Debug, Clone, Default)]
pub struct LoadGauge(pub(super) Arc<Mutex<WorkerLoad>>);

impl LoadGauge {
    /// The load after the loop's last turn.
    pub fn get(&self) -> WorkerLoad {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Options of [`spawn_worker_with`](super::spawn_worker_with).
#[derive(Debug, Default)]
pub struct WorkerOptions {
    /// Receives the prefix cache's changes, one batch per loop turn that changed it, oldest
    /// first. Recording starts before the first request; when the receiver is dropped the
    /// loop stops recording.
    pub kv_events: Option<UnboundedSender<Vec<CacheEvent>>>,
}
