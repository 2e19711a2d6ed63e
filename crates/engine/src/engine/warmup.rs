//! [`Engine::warm_up`]: what the engine does between loading and serving its first request.

use std::time::Instant;

use super::{Engine, EngineError};
use crate::backend::Runner;
use crate::cuda_runner::{WarmupReport, WARMUP_STAGES};

impl Engine {
    /// Whether [`warm_up`](Self::warm_up) has work to do: on CUDA with
    /// `PAGODA_CUDA_WARMUP` on.
    pub fn needs_warmup(&self) -> bool {
        matches!(self.runner, Runner::Cuda { .. }) && self.settings.cuda_warmup
    }

    /// Gets the device ready so the first request runs as fast as the tenth. On CUDA (unless
    /// `PAGODA_CUDA_WARMUP=off`): compiles every kernel the model can launch (or reads them
    /// from the disk cache), captures the decode graphs and runs warm-up steps through every
    /// sampling path (see `cuda_runner::warmup`); on the CPU there is nothing to do and
    /// `None` comes back. `progress` hears each stage's name as it starts (`/health` shows
    /// it); each stage and the total are logged.
    pub fn warm_up(
        &mut self,
        progress: &mut dyn FnMut(&str),
    ) -> Result<Option<WarmupReport>, EngineError> {
        if !self.needs_warmup() {
            if self.is_cuda() {
                tracing::info!(
                    "warm-up: off (--no-warmup): kernels compile at their first launch, \
                     graphs are captured at first use"
                );
            }
            return Ok(None);
        }
        let Runner::Cuda { model } = &mut self.runner else {
            return Ok(None);
        };
        let started = Instant::now();
        let total = WARMUP_STAGES.len();
        let report = model
            .warm_up(&mut |stage| {
                let name = WARMUP_STAGES[stage];
                tracing::info!(target: "pagoda_progress", "warm-up {}/{total}: {name}", stage + 1);
                progress(name);
            })
            .map_err(EngineError::Warmup)?;
        let kernels = &report.kernels;
        let [compile, capture, steps] = report.stage_seconds;
        tracing::info!(
            target: "pagoda_progress",
            "warm-up: done in {:.2} s: {} kernels in {compile:.2} s ({} compiled, {} from the \
             disk cache, {} already loaded); {} decode graphs in {capture:.2} s; {} warm-up steps \
             and the pieces of {} prefill buckets in {steps:.2} s",
            started.elapsed().as_secs_f64(),
            kernels.requested - kernels.failed.len(),
            kernels.compiled,
            kernels.from_cache,
            kernels.already_loaded,
            report.graphs,
            report.steps,
            report.piece_buckets,
        );
        self.absorb_runner_counters();
        Ok(Some(report))
    }
}
