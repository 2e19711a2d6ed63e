//! Sparse decode on the CPU (Quest, `pagoda_ops::attention::QuestSelector`): per layer, the
//! selector writes a shorter page table for the step's long decode rows from the layer's key
//! summaries, and the step's dense attention runs on it, routed by the same rules as the
//! dense step (its own plan, since the shortened rows see fewer tokens). Requests without
//! sparse settings, prefill rows and rows under their `min_context` keep their own pages, so
//! their bits are the dense step's.

use std::sync::Once;

use pagoda_kv::PageTable;
use pagoda_ops::attention::{
    plan_step, step_attention, AttentionError, DecodeSelector, KeySummaries, PagedKv, QueryBatch,
    QuestSelector, SparseAttention, StepAttentionConfig, StepAttentionPlan, StepWorkspace,
};

/// A step's sparse-decode state, shared by its layers.
pub(super) struct SparseLayers {
    /// Routing of the shortened tables (the dense step's rules).
    pub(super) config: StepAttentionConfig,
    /// The current layer's shortened table.
    table: PageTable,
}

impl SparseLayers {
    pub(super) fn new(config: StepAttentionConfig) -> Self {
        SparseLayers {
            config,
            table: PageTable::default(),
        }
    }

    /// One layer's attention: selection, then the dense step on the shortened table (or on
    /// `dense_plan` where no request was shortened).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention(
        &mut self,
        paged: &PagedKv<'_>,
        queries: &QueryBatch<'_>,
        summaries: &KeySummaries,
        params: &[Option<SparseAttention>],
        dense_plan: &StepAttentionPlan,
        scale: f32,
        workspace: &mut StepWorkspace,
        out: &mut [f32],
    ) -> Result<(), AttentionError> {
        let selector = QuestSelector { summaries, params };
        let stats = selector.select(paged, queries, &mut self.table)?;
        if stats.sparse_requests == 0 {
            return step_attention(paged, queries, dense_plan, scale, workspace, out);
        }
        static LOGGED: Once = Once::new();
        LOGGED.call_once(|| {
            tracing::info!(
                "sparse decode (Quest page selection) active: {} of {} pages kept in the first sparse layer",
                stats.pages_kept,
                stats.pages_scanned
            )
        });
        let shortened = PagedKv {
            page_table: &self.table,
            ..*paged
        };
        let plan = plan_step(
            &shortened,
            queries.qo_indptr,
            queries.num_q_heads,
            &self.config,
        )?;
        step_attention(&shortened, queries, &plan, scale, workspace, out)
    }
}
