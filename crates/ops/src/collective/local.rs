//! [`LocalGroup`]: the ranks of a group as threads of one process, exchanging through shared
//! host buffers between two barrier waits.

use std::sync::{Arc, Barrier, Mutex};

use super::{Candidate, CollectiveError, Communicator};

/// What the ranks of a [`LocalGroup`] share: one slot per rank and the barrier.
struct Shared {
    barrier: Barrier,
    /// Each rank's contribution to the collective in flight, as 32-bit words.
    slots: Mutex<Vec<Vec<u32>>>,
}

/// One rank of an in-process group: every collective is "publish my words, wait for all,
/// read every rank's words in rank order, wait again" (the second wait keeps a fast rank
/// from overwriting its slot before a slow one has read it).
///
/// A rank that stops calling collectives (an error, a panic) leaves the others waiting on
/// the barrier: the group runs ranks that fail together, which the layer sequence does (its
/// checks depend on the batch, not on the rank). Each rank must run on its own OS thread
/// ([`run_ranks`]), never as a task of a rayon pool: a rank blocked on the barrier would hold
/// a pool thread the other ranks' kernels may need.
pub struct LocalGroup {
    rank: usize,
    world: usize,
    shared: Arc<Shared>,
}

impl LocalGroup {
    /// The `world` ranks of a new group, rank `r` at index `r`.
    pub fn new(world: usize) -> Vec<LocalGroup> {
        let world = world.max(1);
        let shared = Arc::new(Shared {
            barrier: Barrier::new(world),
            slots: Mutex::new(vec![Vec::new(); world]),
        });
        (0..world)
            .map(|rank| LocalGroup {
                rank,
                world,
                shared: Arc::clone(&shared),
            })
            .collect()
    }

    /// Publishes `words`, then returns every rank's words, in rank order.
    fn exchange(&self, words: Vec<u32>) -> Result<Vec<Vec<u32>>, CollectiveError> {
        let lock = || {
            self.shared
                .slots
                .lock()
                .map_err(|_| CollectiveError("a rank panicked inside a collective".into()))
        };
        lock()?[self.rank] = words;
        self.shared.barrier.wait();
        let all = lock()?.clone();
        self.shared.barrier.wait();
        if all.iter().any(|words| words.len() != all[self.rank].len()) {
            return Err(CollectiveError(format!(
                "the ranks passed buffers of different lengths: {:?}",
                all.iter().map(Vec::len).collect::<Vec<_>>()
            )));
        }
        Ok(all)
    }
}

impl Communicator for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, values: &mut [f32]) -> Result<(), CollectiveError> {
        if self.world == 1 {
            return Ok(());
        }
        let all = self.exchange(values.iter().map(|v| v.to_bits()).collect())?;
        for (i, value) in values.iter_mut().enumerate() {
            // Rank order, from rank 0: the same bits on every rank.
            let mut sum = f32::from_bits(all[0][i]);
            for words in &all[1..] {
                sum += f32::from_bits(words[i]);
            }
            *value = sum;
        }
        Ok(())
    }

    fn all_gather(&self, local: &[f32], gathered: &mut [f32]) -> Result<(), CollectiveError> {
        if gathered.len() != self.world * local.len() {
            return Err(CollectiveError(format!(
                "all_gather of {} values over {} ranks into {}",
                local.len(),
                self.world,
                gathered.len()
            )));
        }
        let all = self.exchange(local.iter().map(|v| v.to_bits()).collect())?;
        for (out, words) in gathered.chunks_exact_mut(local.len().max(1)).zip(&all) {
            for (value, &word) in out.iter_mut().zip(words) {
                *value = f32::from_bits(word);
            }
        }
        Ok(())
    }

    fn broadcast(&self, root: usize, bytes: &mut Vec<u8>) -> Result<(), CollectiveError> {
        if root >= self.world {
            return Err(CollectiveError(format!(
                "broadcast from rank {root} of {}",
                self.world
            )));
        }
        // Lengths may differ before the broadcast: exchange one length word, then the bytes
        // padded to the root's length.
        let lengths = self.exchange(vec![bytes.len() as u32])?;
        let len = lengths[root][0] as usize;
        let mut padded = std::mem::take(bytes);
        padded.resize(len.div_ceil(4) * 4, 0);
        let words = padded
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let all = self.exchange(words)?;
        *bytes = all[root].iter().flat_map(|w| w.to_le_bytes()).collect();
        bytes.truncate(len);
        Ok(())
    }

    fn all_reduce_argmax(&self, candidates: &mut [Candidate]) -> Result<(), CollectiveError> {
        if self.world == 1 {
            return Ok(());
        }
        let words = candidates
            .iter()
            .flat_map(|c| [c.value.to_bits(), c.index])
            .collect();
        let all = self.exchange(words)?;
        for (i, best) in candidates.iter_mut().enumerate() {
            *best = Candidate::NONE;
            for words in &all {
                let candidate = Candidate {
                    value: f32::from_bits(words[2 * i]),
                    index: words[2 * i + 1],
                };
                if candidate.beats(best) {
                    *best = candidate;
                }
            }
        }
        Ok(())
    }
}

/// Runs `rank_main` once per rank of a new [`LocalGroup`] of `world` ranks, each on its own
/// scoped thread, and returns their results in rank order (a panic of a rank is re-raised).
pub fn run_ranks<T: Send>(world: usize, rank_main: impl Fn(LocalGroup) -> T + Sync) -> Vec<T> {
    let rank_main = &rank_main;
    std::thread::scope(|scope| {
        let handles: Vec<_> = LocalGroup::new(world)
            .into_iter()
            .map(|group| scope.spawn(move || rank_main(group)))
            .collect();
        handles
            .into_iter()
            .map(|handle| {
                handle
                    .join()
                    .unwrap_or_else(|e| std::panic::resume_unwind(e))
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_in_rank_order_and_agree_on_every_rank() {
        for world in [1, 2, 3, 8] {
            let results = run_ranks(world, |group| {
                let rank = group.rank() as f32;
                let mut values = vec![rank, 1e8, -1e8 + rank, 0.1 * rank];
                group.all_reduce_sum(&mut values).unwrap();
                values
            });
            let mut expected = vec![0.0, 1e8, -1e8, 0.0f32];
            for rank in 1..world {
                let r = rank as f32;
                for (e, v) in expected.iter_mut().zip([r, 1e8, -1e8 + r, 0.1 * r]) {
                    *e += v;
                }
            }
            for values in &results {
                assert_eq!(values, &expected, "world {world}");
            }
        }
    }

    #[test]
    fn gathers_broadcasts_and_picks_one_winner() {
        let results = run_ranks(4, |group| {
            let rank = group.rank();
            let mut gathered = vec![0.0; 8];
            group
                .all_gather(&[rank as f32, -(rank as f32)], &mut gathered)
                .unwrap();
            let mut bytes = if rank == 2 { b"plan".to_vec() } else { vec![9] };
            group.broadcast(2, &mut bytes).unwrap();
            // Ranks 1 and 3 tie on the value: the lower index wins.
            let value = if rank % 2 == 1 { 5.0 } else { rank as f32 };
            let mut best = [Candidate {
                value,
                index: 10 - rank as u32,
            }];
            group.all_reduce_argmax(&mut best).unwrap();
            (gathered, bytes, best[0])
        });
        for (gathered, bytes, best) in results {
            assert_eq!(gathered, [0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 3.0, -3.0]);
            assert_eq!(bytes, b"plan");
            assert_eq!(
                best,
                Candidate {
                    value: 5.0,
                    index: 7
                }
            );
        }
    }
}
