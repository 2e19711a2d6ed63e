//! Collectives for tensor parallelism: the ranks of one model exchange partial sums, logit
//! slices and sampling candidates through a [`Communicator`].
//!
//! A tensor-parallel model runs one rank per device; every rank holds a shard of the weights
//! (see `pagoda_models::shard`) and runs the same layer sequence. The model calls
//! [`Communicator::all_reduce_sum`] after each row-parallel projection (attention output,
//! MLP down, the experts' mix) and samples from its slice of the vocabulary with
//! [`Communicator::all_reduce_argmax`] ([`sampling`]): no rank ever holds the whole logits.
//!
//! Implementations:
//! - [`LocalGroup`]: one thread per rank in one process, over shared host buffers and a
//!   barrier (the CPU's tensor parallelism, and the oracle of the tests);
//! - NCCL (issue 40's next increment, behind the `cuda` feature): one process per GPU, the
//!   same trait, so the layer sequence does not change.
//!
//! # Determinism
//! Every reduction combines the ranks' values in rank order `((r0 + r1) + r2) + ...`, on every
//! rank, so the result is the same bits on every rank and from run to run. Against one rank
//! the sums differ by float reassociation only (a few ulp of the partial sums).

use std::ops::Range;

mod local;
pub mod sampling;

pub use local::{run_ranks, LocalGroup};

/// A collective failed (a peer is gone, buffers disagree in length, the transport failed).
#[derive(Debug, Clone, thiserror::Error)]
#[error("collective: {0}")]
pub struct CollectiveError(pub String);

/// One rank's candidate of an argmax all-reduce: a score and its global index.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// The score (`-inf` when the rank has no candidate; NaN never wins).
    pub value: f32,
    /// The global index (a vocabulary id).
    pub index: u32,
}

impl Candidate {
    /// The candidate that loses to every other: `(-inf, u32::MAX)`.
    pub const NONE: Candidate = Candidate {
        value: f32::NEG_INFINITY,
        index: u32::MAX,
    };

    /// Whether `self` beats `other`: the larger value, the lower index on equal values (the
    /// single-rank argmax's tie rule); a NaN value loses to everything.
    pub fn beats(&self, other: &Candidate) -> bool {
        if self.value.is_nan() {
            return false;
        }
        other.value.is_nan()
            || self.value > other.value
            || (self.value == other.value && self.index < other.index)
    }
}

/// The ranks of one tensor-parallel group, seen from one rank.
///
/// Every rank must call the same collectives in the same order with buffers of the same
/// lengths (the layer sequence guarantees it: every rank runs every step).
pub trait Communicator: Send + Sync {
    /// This rank, `0..world()`.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world(&self) -> usize;
    /// `values <- Σ_r values_r`, summed in rank order (see the module's determinism note).
    fn all_reduce_sum(&self, values: &mut [f32]) -> Result<(), CollectiveError>;
    /// `gathered <- concat_r local_r` (`gathered.len() == world * local.len()`).
    fn all_gather(&self, local: &[f32], gathered: &mut [f32]) -> Result<(), CollectiveError>;
    /// `bytes <- root's bytes` on every rank (small host data: a step's plan, a seed).
    fn broadcast(&self, root: usize, bytes: &mut Vec<u8>) -> Result<(), CollectiveError>;
    /// Element-wise, `candidates[i] <- the best of candidates_r[i]` over the ranks
    /// ([`Candidate::beats`]): the same winner on every rank.
    fn all_reduce_argmax(&self, candidates: &mut [Candidate]) -> Result<(), CollectiveError>;
}

/// Rank `rank`'s slice of `len` items split over `world` ranks in contiguous chunks of
/// `ceil(len / world)` (the last chunks may be shorter or empty): the vocabulary-parallel LM
/// head's rows.
pub fn chunk_range(len: usize, rank: usize, world: usize) -> Range<usize> {
    let chunk = len.div_ceil(world.max(1));
    let start = (rank * chunk).min(len);
    start..(start + chunk).min(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_range_in_order() {
        for (len, world) in [(97, 8), (512, 4), (3, 8), (0, 2), (10, 1)] {
            let mut next = 0;
            for rank in 0..world {
                let range = chunk_range(len, rank, world);
                assert_eq!(range.start, next.min(len));
                next = range.end;
            }
            assert_eq!(next, len);
        }
    }

    #[test]
    fn candidates_order_by_value_then_lower_index() {
        let a = Candidate {
            value: 1.0,
            index: 5,
        };
        let b = Candidate {
            value: 1.0,
            index: 7,
        };
        let nan = Candidate {
            value: f32::NAN,
            index: 0,
        };
        assert!(a.beats(&b) && !b.beats(&a));
        assert!(a.beats(&nan) && !nan.beats(&a));
        assert!(Candidate::NONE.beats(&nan));
        assert!(a.beats(&Candidate::NONE));
    }
}
