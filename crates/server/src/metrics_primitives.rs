//! The Prometheus value types of the server's metrics: counters and histograms.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// A monotonically increasing count.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds one.
    pub fn inc(&self) {
        self.add(1);
    }
    /// Adds `n`.
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    /// The current value.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
    pub(super) fn set(&self, value: u64) {
        self.0.store(value, Ordering::Relaxed);
    }
}

/// A histogram of seconds with fixed upper bounds.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Per-bucket (non-cumulative) counts, one more than `bounds` (the +Inf bucket), the sum.
    state: Mutex<(Vec<u64>, f64)>,
}

impl Histogram {
    /// An empty histogram with upper bounds `bounds` (seconds, ascending).
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            state: Mutex::new((vec![0; bounds.len() + 1], 0.0)),
        }
    }

    /// Records one observation of `seconds`.
    pub fn observe(&self, seconds: f64) {
        let bucket = self
            .bounds
            .iter()
            .position(|&bound| seconds <= bound)
            .unwrap_or(self.bounds.len());
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.0[bucket] += 1;
        state.1 += seconds;
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.0.iter().sum()
    }

    pub(super) fn render(&self, out: &mut String, name: &str, help: &str) {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, count) in self.bounds.iter().zip(&state.0) {
            cumulative += count;
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        cumulative += state.0[self.bounds.len()];
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cumulative}");
        let _ = writeln!(out, "{name}_sum {}", state.1);
        let _ = writeln!(out, "{name}_count {cumulative}");
    }
}
