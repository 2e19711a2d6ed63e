//! The race of `pagoda tune`: a bucket's candidates, each captured in a CUDA graph, replayed
//! in alternating rounds; the fastest median wins, but is stored only when it beats the
//! built-in rule (candidate 0) by [`MIN_GAIN`] in the same rounds.

use anyhow::Result;
use pagoda_cuda::Gpu;

use super::decode_rig::Captured;
use super::stats::Summary;

/// A candidate replaces the heuristic only when at least this much faster (1%): near-ties
/// are noise and would flip between runs.
pub const MIN_GAIN: f64 = 0.01;

/// The last column of a bucket's line: the heuristic, the stored winner, or a winner within
/// the margin (not stored).
pub fn winner_label(best: usize, stored: bool, heuristic: String, winner: String) -> String {
    match (best, stored) {
        (0, _) => heuristic,
        (_, true) => winner,
        (_, false) => format!("{heuristic}; {winner} less than 1% faster, not stored"),
    }
}

/// The outcome of one bucket's race: the fastest candidate, its median, the heuristic's
/// (candidate 0) median, and whether the winner goes in the table.
pub struct Race {
    pub best: usize,
    pub best_us: f64,
    pub heuristic_us: f64,
    pub stored: bool,
}

/// A captured candidate the race can time: microseconds per call of `count` replays.
pub trait Timed {
    fn time(&self, gpu: &Gpu, count: usize) -> Result<Vec<f64>>;
}

impl Timed for Captured {
    fn time(&self, gpu: &Gpu, count: usize) -> Result<Vec<f64>> {
        Captured::time(self, gpu, count)
    }
}

/// Replays every captured candidate in `rounds` alternating rounds of `replays` each and
/// compares the medians; candidate 0 is the heuristic, which a winner must beat by
/// [`MIN_GAIN`] to be stored.
pub fn race(gpu: &Gpu, captured: &[impl Timed], rounds: usize, replays: usize) -> Result<Race> {
    let mut samples = vec![Vec::new(); captured.len()];
    for _ in 0..rounds {
        for (graph, times) in captured.iter().zip(&mut samples) {
            times.extend(graph.time(gpu, replays)?);
        }
    }
    let medians: Vec<f64> = samples
        .iter()
        .map(|times| Summary::of(times).map_or(f64::INFINITY, |s| s.median))
        .collect();
    let (best, &best_us) = medians
        .iter()
        .enumerate()
        .min_by(|a, b| a.1.total_cmp(b.1))
        .expect("at least the heuristic");
    let heuristic_us = medians[0];
    Ok(Race {
        best,
        best_us,
        heuristic_us,
        stored: best != 0 && best_us < heuristic_us * (1.0 - MIN_GAIN),
    })
}
