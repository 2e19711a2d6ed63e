//! Piecewise graphs of the steps that are not all decode rows (prefill and mixed steps of
//! up to `PAGODA_CUDA_PIECEWISE_TOKENS` tokens): the step is padded to a 16-token bucket, and
//! its kernels between the attention launches replay from graphs captured per bucket
//! (`pagoda_models::llama_cuda::Pieces`). A bucket's first step runs eagerly (loading its
//! kernels and GEMM plans), its second captures the pieces, every later one replays them.

use std::collections::HashMap;

use pagoda_cuda::{CapturedGraph, CudaError, Gpu};
use pagoda_models::llama_cuda::{GpuModel, HostFloat, Pieces, StepBuffers, StepShape};
use pagoda_ops::cuda::PoolLayout;

use crate::counters::EngineCounters;

/// Tokens per piecewise bucket.
pub(super) const PIECE_BUCKET_TOKENS: usize = 16;

/// A token bucket's piecewise graphs.
enum Bucket {
    /// Ran eagerly once; captured at its next step.
    Seen,
    /// The pieces, in step order.
    Captured(Vec<CapturedGraph>),
    /// Its capture failed: the bucket runs eagerly from now on.
    Eager,
}

/// Piecewise graphs by token bucket.
#[derive(Default)]
pub(super) struct PieceGraphs {
    buckets: HashMap<usize, Bucket>,
    /// A capture has failed (logged once).
    warned: bool,
}

/// The bucket a step of `num_tokens` tokens is padded to: the next multiple of
/// [`PIECE_BUCKET_TOKENS`], at most `max_batch_tokens` (the buffers' size).
pub(super) fn piece_bucket(num_tokens: usize, max_batch_tokens: usize) -> usize {
    num_tokens
        .next_multiple_of(PIECE_BUCKET_TOKENS)
        .min(max_batch_tokens)
        .max(num_tokens)
}

impl PieceGraphs {
    /// Runs the step of `shape` (padded to its bucket, `shape.num_tokens`) eagerly, as a
    /// capture, or from its pieces, as the bucket's history says.
    pub(super) fn run<T: HostFloat>(
        &mut self,
        model: &GpuModel<T>,
        gpu: &Gpu,
        buffers: &mut StepBuffers<T>,
        layout: &PoolLayout,
        shape: &StepShape,
        counters: &mut EngineCounters,
    ) -> Result<(), CudaError> {
        let bucket = shape.num_tokens;
        match self.buckets.get(&bucket) {
            None => {
                model.run(gpu, buffers, layout, shape)?;
                self.buckets.insert(bucket, Bucket::Seen);
                counters.steps_cuda_eager += 1;
            }
            Some(Bucket::Seen) => {
                let mut graphs = Vec::new();
                let captured =
                    model.run_pieces(gpu, buffers, layout, shape, Pieces::Capture(&mut graphs));
                match captured {
                    Ok(()) => {
                        counters.cuda_piece_graphs_captured += graphs.len() as u64;
                        counters.steps_cuda_piecewise += 1;
                        self.buckets.insert(bucket, Bucket::Captured(graphs));
                    }
                    Err(error) => {
                        // The capture ended (run_pieces closes it), so the stream is usable:
                        // the step runs again eagerly from its embedding (its KV writes are
                        // the same values), and the bucket stays eager.
                        if !self.warned {
                            self.warned = true;
                            tracing::warn!(
                                "CUDA: capturing the piecewise graphs of a {bucket}-token step \
                                 failed ({error}); that bucket runs eagerly"
                            );
                        }
                        counters.cuda_piece_capture_failures += 1;
                        model.run(gpu, buffers, layout, shape)?;
                        counters.steps_cuda_eager += 1;
                        self.buckets.insert(bucket, Bucket::Eager);
                    }
                }
            }
            Some(Bucket::Eager) => {
                model.run(gpu, buffers, layout, shape)?;
                counters.steps_cuda_eager += 1;
            }
            Some(Bucket::Captured(graphs)) => {
                model.run_pieces(gpu, buffers, layout, shape, Pieces::Replay(graphs))?;
                counters.steps_cuda_piecewise += 1;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_multiples_of_16_within_the_buffers() {
        assert_eq!(piece_bucket(1, 512), 16);
        assert_eq!(piece_bucket(16, 512), 16);
        assert_eq!(piece_bucket(17, 512), 32);
        assert_eq!(piece_bucket(250, 256), 256);
        assert_eq!(piece_bucket(250, 250), 250);
        assert_eq!(piece_bucket(241, 250), 250);
    }
}
