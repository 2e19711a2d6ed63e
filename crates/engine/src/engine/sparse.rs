//! Sparse decode (Quest page selection, `--sparse-attention`): the key summaries switched on
//! with the KV cache, each request's settings (the server's, or its body's), and the step's
//! per-request list handed to the forward.

use pagoda_ops::attention::SparseAttention;
use pagoda_scheduler::StepPlan;

use super::{Engine, EngineError, RequestId};
use crate::backend::Runner;

/// Keeps the key summaries when the settings ask for sparse decode (`wanted`) and the runner
/// can serve it (the CPU backend, one rank of `tensor_parallel_size`, grouped-query
/// attention); says so once at INFO, or why not at WARN. Returns the engine's effective
/// default (`None`: off).
pub(super) fn enable(
    runner: &mut Runner,
    wanted: Option<SparseAttention>,
    tensor_parallel_size: usize,
) -> Option<SparseAttention> {
    let sparse = wanted?;
    let refusal = if runner.is_cuda() {
        Some("not on CUDA yet (the CPU only, this release)")
    } else if tensor_parallel_size > 1 {
        Some("not with tensor parallelism yet")
    } else if runner.config().mla.is_some() {
        Some("not for latent attention (DeepSeek's MLA)")
    } else {
        None
    };
    static LOGGED: std::sync::Once = std::sync::Once::new();
    if let Some(reason) = refusal {
        LOGGED.call_once(|| tracing::warn!("--sparse-attention ignored: {reason}"));
        return None;
    }
    let bytes = runner.enable_key_summaries();
    LOGGED.call_once(|| {
        tracing::info!(
            "sparse attention: Quest page selection ({sparse}) on decode rows of at least \
             {} tokens; key summaries {:.1} MiB",
            sparse.min_context.max(sparse.budget + 1),
            bytes as f64 / (1u64 << 20) as f64
        )
    });
    Some(sparse)
}

impl Engine {
    /// Whether this engine keeps the key summaries sparse decode needs (started with
    /// `--sparse-attention` on a backend that serves it).
    pub fn sparse_attention_available(&self) -> bool {
        self.settings.sparse_attention.is_some()
    }

    /// Sets request `id`'s sparse decode settings (a request body's `sparse_attention`):
    /// `None` keeps it dense. Errors: settings on an engine without sparse decode, an unknown
    /// request.
    pub fn set_sparse_attention(
        &mut self,
        id: RequestId,
        sparse: Option<SparseAttention>,
    ) -> Result<(), EngineError> {
        if sparse.is_some() && !self.sparse_attention_available() {
            return Err(EngineError::SparseAttention(
                "sparse_attention needs a server started with --sparse-attention (CPU backend)"
                    .into(),
            ));
        }
        let state = self
            .requests
            .get_mut(&id)
            .ok_or_else(|| EngineError::Internal(format!("request {id} is not running")))?;
        state.sparse = sparse;
        Ok(())
    }

    /// The step's per-request settings, in the plan's order (empty: every request dense).
    pub(super) fn step_sparse(&self, plan: &StepPlan) -> Vec<Option<SparseAttention>> {
        if !self.sparse_attention_available() {
            return Vec::new();
        }
        let sparse: Vec<Option<SparseAttention>> = plan
            .sequences
            .iter()
            .map(|s| self.requests.get(&s.id).and_then(|state| state.sparse))
            .collect();
        if sparse.iter().all(Option::is_none) {
            return Vec::new();
        }
        sparse
    }
}
