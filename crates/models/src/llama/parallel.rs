//! One rank of a tensor-parallel model (issue 40): the rank's shard of the weights
//! ([`crate::shard`]), its communicator and its slice of the vocabulary. The layer sequence is
//! the whole model's; the CPU steps add the ranks' partial sums after each row-parallel
//! projection (`step.rs`), and the LM head gives the rank's vocabulary slice of the logits.

use std::ops::Range;
use std::sync::Arc;

use pagoda_ops::collective::{CollectiveError, Communicator};
use pagoda_ops::linear::Weight;

use super::{fetch, weight_from_bytes, Model, WeightPrecision};
use crate::config::ModelConfig;
use crate::shard::{slice_axis, ShardSpec, ShardedSource};
use crate::weight_plan::ModelPlan;
use crate::weights::{LoadError, TensorSource};

/// A rank's place in its tensor-parallel group.
pub(super) struct Parallel {
    comm: Arc<dyn Communicator>,
    /// The vocabulary ids of this rank's LM head rows.
    vocab: Range<usize>,
}

impl Parallel {
    /// The rank's rows of the LM head (of the embedding when the head is tied to it).
    pub(super) fn load_head(
        &self,
        source: &dyn TensorSource,
        plan: &ModelPlan,
        precision: WeightPrecision,
    ) -> Result<Weight, LoadError> {
        let spec = plan.lm_head.as_ref().unwrap_or(&plan.embedding);
        let raw = fetch(source, &spec.name)?;
        if raw.shape != spec.shape {
            return Err(LoadError(format!(
                "tensor {} has shape {:?}, expected {:?}",
                spec.name, raw.shape, spec.shape
            )));
        }
        let rows = slice_axis(&raw, 0, self.vocab.clone())
            .map_err(|why| LoadError(format!("tensor {}: {why}", spec.name)))?;
        let shape = [self.vocab.len(), spec.cols()];
        // The kernels the whole model's head gets: those of the tensor's own name (a tied
        // head is the embedding's).
        weight_from_bytes(
            &spec.name,
            rows.ty,
            shape,
            rows.data.into_owned(),
            precision,
        )
        .map_err(|why| LoadError(format!("tensor {}: {why}", spec.name)))
    }

    /// `values <- Σ_ranks values` (the row-parallel projections' partial sums).
    pub(super) fn all_reduce_sum(&self, values: &mut [f32]) -> Result<(), CollectiveError> {
        self.comm.all_reduce_sum(values)
    }
}

impl Model {
    /// Rank `comm.rank()` of `config` split over `comm.world()` ranks (see [`crate::shard`]
    /// for the split): `source` holds the whole model, the rank keeps its slices. Every rank
    /// must then run the same batches, each on its own KV cache ([`Model::new_kv_cache`]
    /// sizes it for the rank's KV heads). One rank is the whole model, loaded as
    /// [`Model::load`] does: no collective runs.
    pub fn load_shard(
        config: ModelConfig,
        source: &dyn TensorSource,
        precision: WeightPrecision,
        comm: Arc<dyn Communicator>,
    ) -> Result<Model, LoadError> {
        let spec = ShardSpec {
            rank: comm.rank(),
            world: comm.world(),
        };
        if spec.world == 1 {
            return Model::load(config, source, precision);
        }
        config.validate().map_err(|e| LoadError(e.to_string()))?;
        let rank_config = spec.rank_config(&config)?;
        let vocab = spec.vocab_range(config.vocab_size);
        if vocab.is_empty() {
            return Err(LoadError(format!(
                "a vocabulary of {} ids leaves rank {} of {} no LM head rows",
                config.vocab_size, spec.rank, spec.world
            )));
        }
        let sharded = ShardedSource::new(source, spec);
        let parallel = Parallel { comm, vocab };
        Model::load_rank(
            rank_config,
            &sharded,
            precision,
            &mut |_, _| {},
            Some(parallel),
        )
        .map_err(|error| sharded.error().map_or(error, LoadError))
    }

    /// The vocabulary ids whose logits [`Model::forward`] returns: all of them, or a
    /// tensor-parallel rank's slice.
    pub fn vocab_range(&self) -> Range<usize> {
        match &self.parallel {
            Some(parallel) => parallel.vocab.clone(),
            None => 0..self.config.vocab_size,
        }
    }

    /// The communicator of a tensor-parallel rank (`None` for the whole model).
    pub fn communicator(&self) -> Option<&dyn Communicator> {
        self.parallel.as_ref().map(|parallel| &*parallel.comm)
    }
}
