//! One rank of a tensor-parallel model (issue 40): the rank's shard of the weights
//! ([`crate::shard`]), its communicator and its slice of the vocabulary. The layer sequence is
//! the whole model's; the CPU steps add the ranks' partial sums after each row-parallel
//! projection (`step.rs`), and the LM head gives the rank's vocabulary slice of the logits.

use std::ops::Range;
use std::sync::Arc;

use pagoda_ops::collective::sampling::gather_rows;
use pagoda_ops::collective::{CollectiveError, Communicator};
use pagoda_ops::linear::Weight;

use super::group::Workers;
use super::{
    fetch, step, weight_from_bytes, AttentionPolicy, ForwardBatch, ForwardError, ForwardOutput,
    KvCache, Model, WeightPrecision,
};
use crate::config::ModelConfig;
use crate::shard::{slice_axis, ShardSpec, ShardedSource};
use crate::weight_plan::ModelPlan;
use crate::weights::{LoadError, TensorSource};

/// A rank's place in its tensor-parallel group.
pub(super) struct Parallel {
    comm: Arc<dyn Communicator>,
    /// The vocabulary ids of this rank's LM head rows.
    vocab: Range<usize>,
    /// The ranks gather the whole logits after the LM head (a group in one process,
    /// [`Model::load_tensor_parallel`]); otherwise each returns its slice.
    pub(super) gather_logits: bool,
    /// The leader's worker ranks, in a group in one process.
    pub(super) workers: Option<Workers>,
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
        let parallel = Parallel {
            comm,
            vocab,
            gather_logits: false,
            workers: None,
        };
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
    /// tensor-parallel rank's slice ([`Model::load_shard`]).
    pub fn vocab_range(&self) -> Range<usize> {
        match &self.parallel {
            Some(parallel) if !parallel.gather_logits => parallel.vocab.clone(),
            _ => 0..self.config.vocab_size,
        }
    }

    /// The LM head's rows of this rank (all of them for the whole model).
    pub(super) fn head_rows(&self) -> usize {
        self.parallel
            .as_ref()
            .map_or(self.config.vocab_size, |parallel| parallel.vocab.len())
    }

    /// The step's logits as [`Model::forward`] returns them: a group in one process gathers
    /// the ranks' slices into whole rows.
    pub(super) fn gather_logits(
        &self,
        logits: Vec<f32>,
        rows: usize,
        head: step::Head,
    ) -> Result<Vec<f32>, ForwardError> {
        match &self.parallel {
            Some(parallel) if parallel.gather_logits && head == step::Head::Logits => Ok(
                gather_rows(&*parallel.comm, &logits, rows, self.config.vocab_size)?,
            ),
            _ => Ok(logits),
        }
    }

    /// [`Model::run_rank`] on every rank of a group in one process: the workers get the batch
    /// first; the leader's result once every rank has finished.
    pub(super) fn run(
        &self,
        batch: &ForwardBatch<'_>,
        kv: &mut KvCache,
        policy: AttentionPolicy,
        head: step::Head,
    ) -> Result<ForwardOutput, ForwardError> {
        let workers = self.parallel.as_ref().and_then(|p| p.workers.as_ref());
        let Some(workers) = workers else {
            return self.run_rank(batch, kv, policy, head);
        };
        let chunk_tokens = self.split_kv_chunk_tokens;
        workers.dispatch(batch, kv, policy, head, chunk_tokens, self.cascade);
        let leader = self.run_rank(batch, kv, policy, head);
        let others = workers.collect();
        let output = leader?;
        others.map_err(ForwardError::Batch)?;
        Ok(output)
    }

    /// The communicator of a tensor-parallel rank (`None` for the whole model).
    pub fn communicator(&self) -> Option<&dyn Communicator> {
        self.parallel.as_ref().map(|parallel| &*parallel.comm)
    }
}
