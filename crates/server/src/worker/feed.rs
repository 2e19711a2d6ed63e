//! What the loop publishes once per turn: the engine's gauges (`/metrics`), the slots
//! (`/slots`), and for a KV-aware router outside the server (NVIDIA Dynamo's worker,
//! `crates/dynamo`) the prefix cache's changes and the load.

use std::sync::{Arc, Mutex};

use pagoda_engine::CacheEvent;
use tokio::sync::mpsc::UnboundedSender;

use super::{idle_slots, EngineBackend, SlotState, Worker};

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

impl<B: EngineBackend> Worker<B> {
    /// The engine's gauges for `/metrics`, and the load for a router.
    pub(super) fn publish_gauges(&self) {
        let snapshot = self.backend.snapshot();
        let waiting = self.waiting.len() + self.embeds.len();
        self.metrics.update_engine(&snapshot, waiting);
        *self.load.0.lock().unwrap_or_else(|e| e.into_inner()) = WorkerLoad {
            running: self.running.len(),
            waiting,
            pages_used: snapshot.pages_used,
            pages_total: snapshot.pages_total,
        };
    }

    /// Sends the prefix cache's changes of this turn to the router feed, if there is one.
    pub(super) fn publish_kv_events(&mut self) {
        let Some(sink) = &self.kv_events else {
            return;
        };
        let events = self.backend.take_kv_events();
        if !events.is_empty() && sink.send(events).is_err() {
            self.kv_events = None;
            self.backend.record_kv_events(false);
        }
    }

    /// What each slot runs, for `GET /slots`.
    pub(super) fn publish_slots(&self) {
        let mut slots = idle_slots(self.parallel);
        for (&id, slot) in &self.running {
            if let Some(state) = slots.get_mut(slot.number) {
                *state = SlotState {
                    id: slot.number,
                    request: Some(id),
                    prompt_tokens: slot.prompt_tokens,
                    decoded: slot.decoded,
                    seed: slot.seed,
                };
            }
        }
        *self.slots.lock().unwrap_or_else(|e| e.into_inner()) = slots;
    }
}
