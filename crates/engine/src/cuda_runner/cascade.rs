//! Whether a CUDA decode step runs as cascade (`pagoda_models::llama_cuda::CascadeLevels`):
//! a fused decode step whose requests share leading pages that the rule finds worth it; or
//! as sparse decode (`pagoda_models::llama_cuda::SparseDecode`): a fused decode step some of
//! whose requests ask for it (`--sparse-attention`, a body's `sparse_attention`) and are long
//! enough. Sparse wins where both would apply.

use pagoda_cuda::CudaError;
use pagoda_models::llama::ForwardBatch;
use pagoda_models::llama_cuda::{Attention, HostFloat, StepShape};

use super::{GpuCache, TypedRunner};

impl<T: HostFloat> TypedRunner<T> {
    /// Bytes of sparse decode's key summaries, or why this runner cannot run it.
    pub(super) fn sparse_summaries(&self) -> Result<usize, String> {
        let Some(cache) = self.cache.as_ref() else {
            return Err("the KV cache not allocated".into());
        };
        match cache.buffers.sparse.as_ref() {
            Some(sparse) => Ok(sparse.bytes()),
            None => Err(pagoda_models::llama_cuda::sparse_unsupported(
                self.model.config(),
                &cache.options,
                T::DTYPE,
            )
            .unwrap_or_else(|| "a setup without the fused decode".into())),
        }
    }

    /// Turns a fused decode step (or a mixed step's decode rows) into sparse decode when
    /// `batch` asks for it and some request is shortened (the plan is kept for staging): the
    /// fused decode's variant and grid are chosen again for the shortened context. Counts it.
    pub(super) fn sparse_step(
        &mut self,
        cache: &mut GpuCache<T>,
        batch: &ForwardBatch<'_>,
        shape: &mut StepShape,
    ) -> Result<(), CudaError> {
        let (rows, mixed) = match shape.attention {
            Attention::Fused { .. } => (shape.num_requests, None),
            Attention::Mixed { decode_rows, .. } => (decode_rows, Some(decode_rows)),
            _ => return Ok(()),
        };
        let (Some(sparse), Some(fused)) =
            (cache.buffers.sparse.as_mut(), cache.buffers.fused.as_ref())
        else {
            return Ok(());
        };
        // A mixed step selects for its decode rows only, which lead the step (the chunks
        // attend densely).
        let (qo, params) = match mixed {
            None => (batch.qo_indptr, batch.sparse),
            Some(d) => (
                &batch.qo_indptr[..=d],
                &batch.sparse[..d.min(batch.sparse.len())],
            ),
        };
        let planned = sparse.plan(batch.page_table, qo, params, rows)?;
        let Some((grid_pages, stats, context)) = planned else {
            return Ok(());
        };
        let (variant, source) = fused.variant(rows, context);
        let grid_chunks = fused.grid_chunks(rows, &variant);
        shape.attention = match mixed {
            None => Attention::Sparse {
                grid_chunks,
                variant,
                source,
                grid_pages,
            },
            Some(decode_rows) => Attention::Mixed {
                decode_rows,
                grid_chunks,
                variant,
                source,
                grid_pages,
            },
        };
        self.counters.steps_cuda_sparse += 1;
        let layers = self.model.config().num_layers as u64;
        pagoda_ops::attention::record_sparse_layers(&stats, layers);
        static LOGGED: std::sync::Once = std::sync::Once::new();
        LOGGED.call_once(|| {
            tracing::info!(
                "CUDA sparse decode active: {} of {} pages kept a layer in the first sparse \
                 step (selected on the device per layer)",
                stats.pages_kept,
                stats.pages_scanned
            )
        });
        Ok(())
    }

    /// Turns a fused decode step's attention into cascade when the fused decode's levels
    /// plan one for `batch` (the plan is kept for staging), and counts it.
    pub(super) fn cascade_step(
        &mut self,
        cache: &mut GpuCache<T>,
        batch: &ForwardBatch<'_>,
        shape: &mut StepShape,
    ) -> Result<(), CudaError> {
        let Attention::Fused {
            grid_chunks,
            variant,
            source,
        } = shape.attention
        else {
            return Ok(());
        };
        let Some(fused) = cache.buffers.fused.as_mut().filter(|f| f.cascades()) else {
            return Ok(());
        };
        let planned =
            fused.plan_cascade(batch.page_table, shape.num_requests, grid_chunks, &variant)?;
        if let Some((rows, grid_chunks, stats)) = planned {
            shape.attention = Attention::Cascade {
                grid_chunks,
                variant,
                source,
                rows,
            };
            let c = &mut self.counters;
            c.steps_cuda_cascade += 1;
            c.cuda_cascade_groups += stats.groups as u64;
            c.cuda_cascade_shared_tokens += stats.shared_tokens as u64;
            c.cuda_cascade_saved_token_reads += stats.saved_token_reads as u64;
        }
        Ok(())
    }
}
