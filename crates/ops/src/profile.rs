//! Where a forward pass spends its time, op by op: wall time summed per [`Op`] over the
//! process, on when `PAGODA_PROFILE=1` (read once). Off, a timed call costs one relaxed load.
//! `pagoda bench` prints the table after its runs, so a profile needs no external tool (the
//! GPU machine's host has no `perf`). Times are of the calling thread, which waits for the
//! op's parallel work, so the rows add up to the forward pass.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// The timed ops of a llama-style forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Token embedding lookup.
    Embed,
    /// RMS norms (attention, MLP, final; q/k norms).
    Norm,
    /// q, k, v projections (one shared call) and their biases.
    QkvProj,
    /// Rotary embedding of q and k.
    Rope,
    /// K and V appended to the paged cache.
    KvAppend,
    /// Attention over the paged cache.
    Attention,
    /// The attention output projection.
    OutProj,
    /// gate and up projections (one shared call).
    GateUp,
    /// SiLU(gate) * up.
    SiluMul,
    /// The MLP down projection.
    Down,
    /// Mixture-of-experts routing: the router logits and each row's top-k experts.
    Router,
    /// The mixture-of-experts experts: rows gathered per expert, each expert's gate/up,
    /// SiLU-mul and down projection, the outputs weighed and summed.
    ExpertMix,
    /// Residual additions.
    Residual,
    /// The LM head.
    LmHead,
    /// Tensor parallelism's all-reduce of the row-parallel layers' partial sums.
    AllReduce,
}

/// Every op, in table order.
pub const OPS: [Op; 15] = [
    Op::Embed,
    Op::Norm,
    Op::QkvProj,
    Op::Rope,
    Op::KvAppend,
    Op::Attention,
    Op::OutProj,
    Op::GateUp,
    Op::SiluMul,
    Op::Down,
    Op::Router,
    Op::ExpertMix,
    Op::Residual,
    Op::LmHead,
    Op::AllReduce,
];

impl Op {
    /// The table name.
    pub fn name(self) -> &'static str {
        match self {
            Op::Embed => "embed",
            Op::Norm => "norm",
            Op::QkvProj => "qkv_proj",
            Op::Rope => "rope",
            Op::KvAppend => "kv_append",
            Op::Attention => "attention",
            Op::OutProj => "out_proj",
            Op::GateUp => "gate_up",
            Op::SiluMul => "silu_mul",
            Op::Down => "down",
            Op::Router => "router",
            Op::ExpertMix => "expert_mix",
            Op::Residual => "residual",
            Op::LmHead => "lm_head",
            Op::AllReduce => "all_reduce",
        }
    }
}

static NANOS: [AtomicU64; OPS.len()] = [const { AtomicU64::new(0) }; OPS.len()];
static CALLS: [AtomicU64; OPS.len()] = [const { AtomicU64::new(0) }; OPS.len()];
static FORCED: AtomicBool = AtomicBool::new(false);

/// Whether ops are timed: the `PAGODA_PROFILE` setting (read once), or [`enable`] called.
pub fn enabled() -> bool {
    static FROM_CONFIG: OnceLock<bool> = OnceLock::new();
    FORCED.load(Ordering::Relaxed)
        || *FROM_CONFIG.get_or_init(|| pagoda_config::global().on("PAGODA_PROFILE"))
}

/// Turns timing on for the rest of the process (as `PAGODA_PROFILE=1` does).
pub fn enable() {
    FORCED.store(true, Ordering::Relaxed);
}

/// Runs `f`, adding its wall time to `op` when profiling is on.
#[inline]
pub fn time<R>(op: Op, f: impl FnOnce() -> R) -> R {
    if !enabled() {
        return f();
    }
    let start = Instant::now();
    let result = f();
    let index = op as usize;
    NANOS[index].fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    CALLS[index].fetch_add(1, Ordering::Relaxed);
    result
}

/// `(op, seconds, calls)` summed so far, in table order.
pub fn totals() -> Vec<(Op, f64, u64)> {
    OPS.iter()
        .map(|&op| {
            let index = op as usize;
            (
                op,
                NANOS[index].load(Ordering::Relaxed) as f64 * 1e-9,
                CALLS[index].load(Ordering::Relaxed),
            )
        })
        .collect()
}

/// Zeroes the sums (between a warm-up and the measured runs).
pub fn reset() {
    for (nanos, calls) in NANOS.iter().zip(&CALLS) {
        nanos.store(0, Ordering::Relaxed);
        calls.store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timed_calls_add_up_per_op() {
        enable();
        reset();
        let value = time(Op::Rope, || {
            std::thread::sleep(std::time::Duration::from_millis(3));
            7
        });
        assert_eq!(value, 7);
        time(Op::Rope, || ());
        let totals = totals();
        let (op, seconds, calls) = totals[Op::Rope as usize];
        assert_eq!((op, calls), (Op::Rope, 2));
        assert!(seconds >= 0.003, "{seconds}");
        assert!(totals.iter().filter(|t| t.0 != Op::Rope).all(|t| t.2 == 0));
    }
}
