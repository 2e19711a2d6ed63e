//! The tables of `pagoda bench moe` (`bench_moe.rs`): one stage's and one batch's results,
//! and their markdown rows.

use serde::Serialize;

#[derive(Serialize)]
pub(super) struct StageResult {
    pub(super) stage: &'static str,
    pub(super) median_us: f64,
    pub(super) min_us: f64,
    /// Weight bytes read per call (mean over the sets), for the stages that read weights.
    pub(super) weight_mb: Option<f64>,
    pub(super) gb_per_s: Option<f64>,
    /// The weight bytes at the copy rate, and the median over it.
    pub(super) floor_us: Option<f64>,
    pub(super) times_floor: Option<f64>,
}

#[derive(Serialize)]
pub(super) struct BatchResult {
    pub(super) batch: usize,
    pub(super) sets: usize,
    pub(super) weight_copies: usize,
    /// Router copies the router stage's graph rotates through (one call each).
    pub(super) router_copies: usize,
    /// Distinct experts the rows of a set hit (mean over the sets).
    pub(super) distinct_experts: f64,
    /// The stages' medians added up, against the block's.
    pub(super) stages_sum_us: f64,
    pub(super) stages: Vec<StageResult>,
}

/// One markdown row per stage of `result` (the header before the first batch).
pub(super) fn print_rows(result: &BatchResult, header: bool) {
    if header {
        println!(
            "| B | stage | median us | min us | weight MB | GB/s | floor us | x floor |\n\
             |---:|---|---:|---:|---:|---:|---:|---:|"
        );
    }
    let or_dash = |value: Option<f64>, decimals: usize| {
        value.map_or("-".to_string(), |v| format!("{v:.decimals$}"))
    };
    for stage in &result.stages {
        println!(
            "| {} | {} | {:.1} | {:.1} | {} | {} | {} | {} |",
            result.batch,
            stage.stage,
            stage.median_us,
            stage.min_us,
            or_dash(stage.weight_mb, 1),
            or_dash(stage.gb_per_s, 0),
            or_dash(stage.floor_us, 1),
            or_dash(stage.times_floor, 2),
        );
    }
    println!(
        "| {} | stages summed | {:.1} | | | | | {:.1} distinct experts a set, {} sets, {} weight copies, {} routers |",
        result.batch,
        result.stages_sum_us,
        result.distinct_experts,
        result.sets,
        result.weight_copies,
        result.router_copies
    );
}
