//! Whether a CUDA decode step runs as cascade (`pagoda_models::llama_cuda::CascadeLevels`):
//! a fused decode step whose requests share leading pages that the rule finds worth it.

use pagoda_cuda::CudaError;
use pagoda_models::llama::ForwardBatch;
use pagoda_models::llama_cuda::{Attention, HostFloat, StepShape};

use super::{GpuCache, TypedRunner};

impl<T: HostFloat> TypedRunner<T> {
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
