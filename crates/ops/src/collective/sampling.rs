//! Sampling from vocabulary-parallel logits without gathering them: each rank holds the
//! logits of its vocabulary slice (`[rows, slice_len]`, its first id `vocab_start`), finds
//! its best candidate, and one [`Communicator::all_reduce_argmax`] picks the winner.
//!
//! - Greedy: the winner of the `(logit, global id)` pairs, which is the single-rank argmax
//!   (the largest logit, the lowest id among equal ones).
//! - Gumbel-max (the unfiltered seeded draw of `pagoda_ops::sampling::gumbel_argmax`): the
//!   noise of id `i` is word `i % 4` of Philox block `i / 4` of `(seed key, step, Gumbel)`,
//!   a function of the global id only, and the score `(z_i - z_max) / T + g_i` uses the row's
//!   global maximum (itself an argmax all-reduce, exact): every element's score is the bits
//!   the single-rank draw computes for the same logits, so the winner is the same token.
//! - The filtered samplers (top-k, top-p, min-p) gather the row ([`gather_rows`]) in this
//!   increment; their pivot searches over slices are left for the NCCL increment.

use super::{chunk_range, Candidate, CollectiveError, Communicator};
use crate::sampling::gumbel_noise;
use crate::sampling::philox::{draw_block, DrawPurpose};

/// The best `(logit, global id)` of one slice row: the first largest non-NaN logit.
fn best_of(row: &[f32], vocab_start: usize) -> Candidate {
    let mut best = Candidate::NONE;
    for (offset, &value) in row.iter().enumerate() {
        let candidate = Candidate {
            value,
            index: (vocab_start + offset) as u32,
        };
        if candidate.beats(&best) {
            best = candidate;
        }
    }
    best
}

/// The greedy token of each of `rows` rows of slice logits `[rows, slice_len]`.
pub fn greedy_rows(
    comm: &dyn Communicator,
    logits: &[f32],
    rows: usize,
    vocab_start: usize,
) -> Result<Vec<u32>, CollectiveError> {
    let width = logits.len().checked_div(rows).unwrap_or(0);
    let mut best: Vec<Candidate> = (0..rows)
        .map(|row| best_of(&logits[row * width..(row + 1) * width], vocab_start))
        .collect();
    comm.all_reduce_argmax(&mut best)?;
    Ok(best.iter().map(|c| c.index).collect())
}

/// One row's Gumbel-max draw over the slice `row` (global ids from `vocab_start`):
/// `argmax_i ((z_i - z_max) * inverse_temperature + g_i)` over the whole vocabulary, `None`
/// when every logit is `-inf` (see the module documentation).
pub fn gumbel_row(
    comm: &dyn Communicator,
    row: &[f32],
    vocab_start: usize,
    inverse_temperature: f64,
    key: [u32; 2],
    step: u64,
) -> Result<Option<u32>, CollectiveError> {
    let mut maximum = [best_of(row, vocab_start)];
    comm.all_reduce_argmax(&mut maximum)?;
    let z_max = maximum[0].value;
    let inverse_temperature = inverse_temperature as f32;
    let mut best = Candidate::NONE;
    if z_max.is_finite() {
        for (offset, &z) in row.iter().enumerate() {
            let id = vocab_start + offset;
            let word = draw_block(key, step, DrawPurpose::Gumbel, (id / 4) as u32)[id % 4];
            // The same f32 operations as the single-rank draw (no fused multiply-add).
            let score = (z - z_max) * inverse_temperature + gumbel_noise(word);
            let candidate = Candidate {
                value: score,
                index: id as u32,
            };
            if score > f32::NEG_INFINITY && candidate.beats(&best) {
                best = candidate;
            }
        }
    }
    let mut winner = [best];
    comm.all_reduce_argmax(&mut winner)?;
    Ok((winner[0].value > f32::NEG_INFINITY).then_some(winner[0].index))
}

/// The whole rows from every rank's slice (`[rows, chunk_range(vocab, rank, world).len()]`),
/// `[rows, vocab_size]`, for the samplers that need the row (the filtered chain, logprobs).
pub fn gather_rows(
    comm: &dyn Communicator,
    logits: &[f32],
    rows: usize,
    vocab_size: usize,
) -> Result<Vec<f32>, CollectiveError> {
    let world = comm.world();
    let chunk = vocab_size.div_ceil(world);
    let local = chunk_range(vocab_size, comm.rank(), world).len();
    if logits.len() != rows * local {
        return Err(CollectiveError(format!(
            "rank {} holds {} logits, expected {rows} rows of {local}",
            comm.rank(),
            logits.len()
        )));
    }
    // Every rank sends `rows * chunk` values (the collective's lengths must agree): its slice
    // padded with -inf.
    let mut padded = vec![f32::NEG_INFINITY; rows * chunk];
    for row in 0..rows {
        padded[row * chunk..row * chunk + local]
            .copy_from_slice(&logits[row * local..(row + 1) * local]);
    }
    let mut gathered = vec![0f32; world * rows * chunk];
    comm.all_gather(&padded, &mut gathered)?;
    let mut full = vec![0f32; rows * vocab_size];
    for rank in 0..world {
        let range = chunk_range(vocab_size, rank, world);
        for row in 0..rows {
            let from = (rank * rows + row) * chunk;
            full[row * vocab_size + range.start..row * vocab_size + range.end]
                .copy_from_slice(&gathered[from..from + range.len()]);
        }
    }
    Ok(full)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::run_ranks;
    use crate::sampling::{argmax, gumbel_argmax};

    /// Deterministic logits with ties and a flat tail.
    fn logits(rows: usize, vocab: usize) -> Vec<f32> {
        (0..rows * vocab)
            .map(|i| (((i * 7919) % 1009) as f32 * 0.013).sin() * 4.0)
            .collect()
    }

    fn slice(full: &[f32], rows: usize, vocab: usize, rank: usize, world: usize) -> Vec<f32> {
        let range = chunk_range(vocab, rank, world);
        (0..rows)
            .flat_map(|row| full[row * vocab + range.start..row * vocab + range.end].to_vec())
            .collect()
    }

    /// Greedy, Gumbel-max and the gather over 1..=8 ranks against the single-rank functions on
    /// the same logits: identical tokens and rows.
    #[test]
    fn sharded_sampling_matches_one_rank() {
        let (rows, vocab) = (3, 301);
        let full = logits(rows, vocab);
        for world in 1..=8 {
            let results = run_ranks(world, |group| {
                let (rank, world) = (group.rank(), group.world());
                let local = slice(&full, rows, vocab, rank, world);
                let start = chunk_range(vocab, rank, world).start;
                let greedy = greedy_rows(&group, &local, rows, start).unwrap();
                let width = local.len() / rows;
                let drawn: Vec<_> = (0..rows)
                    .flat_map(|row| {
                        [0.5, 1.0, 3.0].map(|inverse_temperature| {
                            let row_logits = &local[row * width..(row + 1) * width];
                            gumbel_row(&group, row_logits, start, inverse_temperature, [7, 9], 11)
                                .unwrap()
                        })
                    })
                    .collect();
                let gathered = gather_rows(&group, &local, rows, vocab).unwrap();
                (greedy, drawn, gathered)
            });
            for (greedy, drawn, gathered) in results {
                assert_eq!(gathered, full, "world {world}");
                for row in 0..rows {
                    let z = &full[row * vocab..(row + 1) * vocab];
                    assert_eq!(greedy[row], argmax(z), "world {world} row {row}");
                    let z_max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    for (i, inverse_temperature) in [0.5, 1.0, 3.0].into_iter().enumerate() {
                        let expected =
                            gumbel_argmax(z, z_max, inverse_temperature, [7, 9], 11, true);
                        assert_eq!(drawn[row * 3 + i], expected, "world {world} row {row}");
                    }
                }
            }
        }
    }
}
