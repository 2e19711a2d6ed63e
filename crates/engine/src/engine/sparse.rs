//! Sparse decode (Quest page selection, `--sparse-attention`): the check that the setup can
//! run it (one rank, grouped-query attention, and on CUDA the fused decode over a bf16/f32
//! cache; anything else is refused at start), the key summaries switched on with the KV cache,
//! each request's settings (the server's, or its body's), and the step's per-request list
//! handed to the forward.

use pagoda_ops::attention::SparseAttention;
use pagoda_scheduler::StepPlan;

use super::{Engine, EngineError, RequestId};
use crate::backend::Runner;

/// Checks that sparse decode can run on this setup: one rank (`tensor_parallel_size` 1),
/// grouped-query attention (`mla` false). The error is the one-line refusal a start prints,
/// naming the switch and the way out (the CUDA runner's own limits are checked when it
/// keeps the summaries, [`enable`]).
pub fn check_sparse_attention_setup(tensor_parallel_size: usize, mla: bool) -> Result<(), String> {
    if tensor_parallel_size > 1 {
        return Err(format!(
            "{SPARSE_SWITCH} does not run with tensor parallelism yet (-tp \
             {tensor_parallel_size}); drop it or use -tp 1"
        ));
    }
    if mla {
        return Err(format!(
            "{SPARSE_SWITCH} does not run on latent-attention models (DeepSeek's MLA) yet; \
             drop it for this model"
        ));
    }
    Ok(())
}

const SPARSE_SWITCH: &str = "--sparse-attention (PAGODA_SPARSE_ATTENTION)";

/// Keeps the key summaries when the settings ask for sparse decode (`wanted`) and says so
/// once at INFO; a runner that cannot serve it (see [`check_sparse_attention_setup`]) is an
/// error. Returns the engine's default (`None`: off).
pub(super) fn enable(
    runner: &mut Runner,
    wanted: Option<SparseAttention>,
    tensor_parallel_size: usize,
) -> Result<Option<SparseAttention>, EngineError> {
    let Some(sparse) = wanted else {
        return Ok(None);
    };
    check_sparse_attention_setup(tensor_parallel_size, runner.config().mla.is_some())
        .map_err(EngineError::SparseAttention)?;
    let bytes = runner.enable_key_summaries().map_err(|reason| {
        EngineError::SparseAttention(format!(
            "{SPARSE_SWITCH} does not run on CUDA with {reason} yet; drop it or change that"
        ))
    })?;
    static LOGGED: std::sync::Once = std::sync::Once::new();
    LOGGED.call_once(|| {
        tracing::info!(
            "sparse attention: Quest page selection ({sparse}) on decode rows of at least \
             {} tokens; key summaries {:.1} MiB",
            sparse.min_context.max(sparse.budget + 1),
            bytes as f64 / (1u64 << 20) as f64
        )
    });
    Ok(Some(sparse))
}

impl Engine {
    /// Whether this engine keeps the key summaries sparse decode needs (started with
    /// `--sparse-attention`).
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
                "sparse_attention needs a server started with --sparse-attention".into(),
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
