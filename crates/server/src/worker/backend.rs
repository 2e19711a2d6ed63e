//! What the engine loop needs from an engine, and the real engine's side of it.

use pagoda_engine::{CacheEvent, Engine, EngineError, RequestId, StepEvent};
use pagoda_ops::sampling::SamplingParams;

use super::EngineSnapshot;

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
    /// Constrains a running request's tokens to a grammar (see [`Engine::set_constraint`]).
    fn set_constraint(
        &mut self,
        _id: RequestId,
        _constraint: pagoda_grammar::Constraint,
    ) -> Result<(), EngineError> {
        Err(EngineError::Internal(
            "this engine does not constrain output".into(),
        ))
    }
    /// Sets a running request's sparse decode settings (see
    /// [`Engine::set_sparse_attention`]); engines without sparse decode refuse settings.
    fn set_sparse_attention(
        &mut self,
        _id: RequestId,
        sparse: Option<pagoda_ops::attention::SparseAttention>,
    ) -> Result<(), EngineError> {
        match sparse {
            None => Ok(()),
            Some(_) => Err(EngineError::SparseAttention(
                "this engine has no sparse decode".into(),
            )),
        }
    }
    /// The sparse decode settings of requests that do not set theirs (`--sparse-attention`);
    /// `None`: no sparse decode, so settings are refused.
    fn sparse_attention(&self) -> Option<pagoda_ops::attention::SparseAttention> {
        None
    }
    /// A snapshot of the engine's gauges and counters.
    fn snapshot(&self) -> EngineSnapshot;
    /// The embedding of `tokens` (see [`Engine::embed`]).
    fn embed(&mut self, _tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        Err(EngineError::Internal(
            "this engine computes no embeddings".into(),
        ))
    }
    /// Starts (or stops) recording the prefix cache's changes (see
    /// [`Engine::record_kv_events`]); engines without a prefix cache record nothing.
    fn record_kv_events(&mut self, _on: bool) {}
    /// The prefix cache's changes since the last call, oldest first.
    fn take_kv_events(&mut self) -> Vec<CacheEvent> {
        Vec::new()
    }
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
    fn set_sparse_attention(
        &mut self,
        id: RequestId,
        sparse: Option<pagoda_ops::attention::SparseAttention>,
    ) -> Result<(), EngineError> {
        Engine::set_sparse_attention(self, id, sparse)
    }
    fn sparse_attention(&self) -> Option<pagoda_ops::attention::SparseAttention> {
        self.settings().sparse_attention
    }
    fn set_constraint(
        &mut self,
        id: RequestId,
        constraint: pagoda_grammar::Constraint,
    ) -> Result<(), EngineError> {
        Engine::set_constraint(self, id, constraint)
    }
    fn snapshot(&self) -> EngineSnapshot {
        EngineSnapshot {
            pages_used: self.pages_used(),
            pages_total: self.config().num_pages,
            num_running: self.num_running(),
            counters: self.counters().clone(),
            pages_cached: self.pages_cached(),
            sampling: pagoda_ops::sampling::sampling_counters(),
            batch_dependent: !self.batch_invariant(),
        }
    }
    fn embed(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        Engine::embed(self, tokens)
    }
    fn record_kv_events(&mut self, on: bool) {
        Engine::record_kv_events(self, on)
    }
    fn take_kv_events(&mut self) -> Vec<CacheEvent> {
        Engine::take_kv_events(self)
    }
    fn needs_warmup(&self) -> bool {
        Engine::needs_warmup(self)
    }
    fn warm_up(&mut self, progress: &mut dyn FnMut(&str)) -> Result<(), EngineError> {
        Engine::warm_up(self, progress).map(|_| ())
    }
}
