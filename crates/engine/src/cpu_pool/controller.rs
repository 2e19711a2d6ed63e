//! The pure decision logic of the adaptive CPU pool: given the measured time of each step, on
//! which pool (all threads or one thread) to run the next one. No threads, no clock: the runner
//! feeds it step shapes and durations, the tests feed it synthetic ones.
//!
//! Per bucket of comparable steps (decode or prefill, and the number of tokens rounded down to
//! a power of two) it keeps the recent per-token times of each pool. It mostly runs the
//! current pool and now and then *probes* the other one for a short burst:
//! - the first probe comes after [`ControllerSettings::first_probe_after`] steps, then every
//!   `probe_interval` steps; the interval starts at `min_probe_interval` and doubles (up to
//!   `max_probe_interval`) each time a probe loses, so on an idle machine probes soon become
//!   rare (one slow step in several hundred);
//! - a probe alternates the other pool and the current one (`probe_len` steps on the other),
//!   so both are measured under the same load; it ends early, after one step, when a step on
//!   the other pool is clearly slower than the current pool (`1 + abort_margin` times its
//!   median): on an idle machine a losing probe costs one step;
//! - a probe wins when the median of its steps on the other pool is below `1 - switch_margin`
//!   times the current pool's time (the lower of the median of its recent steps and the
//!   median of its steps within the burst): the bucket switches, and the interval resets;
//! - when the current pool's recent median rises above `spike_ratio` times the median it had
//!   when it last won or held a comparison (load arrived), the next step is a probe.
//!
//! Medians over windows and the margins keep single noisy steps from switching (no flapping).

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

/// Which rayon pool runs a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PoolChoice {
    /// The pool of all configured threads (rayon's global pool, `--threads`).
    AllThreads,
    /// A pool of one thread: the step never waits for a descheduled worker.
    OneThread,
}

impl PoolChoice {
    /// The other pool.
    pub fn other(self) -> PoolChoice {
        match self {
            PoolChoice::AllThreads => PoolChoice::OneThread,
            PoolChoice::OneThread => PoolChoice::AllThreads,
        }
    }

    /// `all-threads` or `one-thread`, for logs.
    pub fn name(self) -> &'static str {
        match self {
            PoolChoice::AllThreads => "all-threads",
            PoolChoice::OneThread => "one-thread",
        }
    }
}

/// What a step looks like, for grouping steps whose times are comparable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepShape {
    /// Tokens run through the model in the step (prefill and decode).
    pub num_tokens: usize,
    /// Requests in the step; a step is decode-only when `num_tokens == num_requests`.
    pub num_requests: usize,
}

/// Steps compared with each other: decode-only or not, and `floor(log2(num_tokens))`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct BucketKey {
    decode: bool,
    size_class: u32,
}

impl From<StepShape> for BucketKey {
    fn from(shape: StepShape) -> Self {
        BucketKey {
            decode: shape.num_tokens <= shape.num_requests,
            size_class: shape.num_tokens.max(1).ilog2(),
        }
    }
}

/// Tuning of the [`PoolController`] (all counts are steps of one bucket).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ControllerSettings {
    /// Recent steps per pool whose median is compared.
    pub window: usize,
    /// Steps of one probe burst (at least 1).
    pub probe_len: usize,
    /// Steps of a new bucket before its first probe.
    pub first_probe_after: usize,
    /// Steps between probes right after a switch; doubles on each losing probe.
    pub min_probe_interval: usize,
    /// The longest interval between probes.
    pub max_probe_interval: usize,
    /// A probe wins when its median is below `(1 - switch_margin)` times the current median.
    pub switch_margin: f64,
    /// A probe stops after one step slower than `(1 + abort_margin)` times the current median.
    pub abort_margin: f64,
    /// Probe at once when the current median exceeds `spike_ratio` times its reference.
    pub spike_ratio: f64,
}

impl Default for ControllerSettings {
    /// Probes at step 8, then after 32, 64, ... 512 steps while they lose: on an idle 2-core
    /// machine a probe of one thread costs about 0.7 of a step, so under 0.2% once backed off.
    fn default() -> Self {
        ControllerSettings {
            window: 8,
            probe_len: 3,
            first_probe_after: 8,
            min_probe_interval: 32,
            max_probe_interval: 512,
            switch_margin: 0.15,
            abort_margin: 0.3,
            spike_ratio: 1.5,
        }
    }
}

/// What [`PoolController::observe`] concluded from a step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// Nothing decided (a regular step, or a probe still running).
    Continue,
    /// A probe ended and the bucket stays on its pool.
    ProbeLost,
    /// A probe won: the bucket now runs on `to`. `speedup` is the current pool's median over
    /// the probe's median (above 1).
    Switched {
        /// The pool the bucket moved to.
        to: PoolChoice,
        /// How much faster the probe was than the pool it replaced.
        speedup: f64,
        /// Whether the steps were decode-only.
        decode: bool,
    },
}

/// A probe burst in progress: steps alternate between the other pool and the current one
/// (other first), so both are measured under the same load, at the same moment.
#[derive(Debug, Clone, Default)]
struct Probe {
    /// Per-token seconds of the burst's steps on the other pool.
    other: Vec<f64>,
    /// Per-token seconds of the burst's steps on the current pool.
    current: Vec<f64>,
}

/// One bucket's state.
#[derive(Debug, Clone)]
struct Bucket {
    current: PoolChoice,
    /// Per-token seconds of the current pool's recent steps (at most `window`).
    recent: VecDeque<f64>,
    /// The current pool's median when it last held or won a comparison.
    reference: Option<f64>,
    steps_until_probe: usize,
    probe_interval: usize,
    probe: Option<Probe>,
}

impl Bucket {
    /// Ends the probe; the next one comes after `interval` steps.
    fn end_probe(&mut self, interval: usize) {
        self.probe = None;
        self.probe_interval = interval;
        self.steps_until_probe = interval;
    }
}

/// The median of `values` (`None` when empty).
fn median(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let mut sorted: Vec<f64> = values.into_iter().collect();
    if sorted.is_empty() {
        return None;
    }
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    Some(if sorted.len() % 2 == 1 {
        sorted[mid]
    } else {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    })
}

/// Picks a pool per step from measured step times (see the module docs).
#[derive(Debug, Clone)]
pub struct PoolController {
    settings: ControllerSettings,
    buckets: HashMap<BucketKey, Bucket>,
    /// Probe bursts started so far.
    pub probes: u64,
    /// Switches made so far.
    pub switches: u64,
}

impl PoolController {
    /// A controller whose buckets start on all threads.
    pub fn new(settings: ControllerSettings) -> PoolController {
        PoolController {
            settings: ControllerSettings {
                window: settings.window.max(1),
                probe_len: settings.probe_len.max(1),
                ..settings
            },
            buckets: HashMap::new(),
            probes: 0,
            switches: 0,
        }
    }

    /// The settings in use.
    pub fn settings(&self) -> &ControllerSettings {
        &self.settings
    }

    /// The pool a bucket's regular steps run on (all threads for a bucket not seen yet).
    pub fn current(&self, shape: StepShape) -> PoolChoice {
        self.buckets
            .get(&BucketKey::from(shape))
            .map_or(PoolChoice::AllThreads, |bucket| bucket.current)
    }

    /// The pool to run a step of `shape` on: the bucket's current pool, or during a probe
    /// (which starts here when due) the other pool and the current one in turn.
    pub fn choose(&mut self, shape: StepShape) -> PoolChoice {
        let settings = self.settings;
        let bucket = self
            .buckets
            .entry(BucketKey::from(shape))
            .or_insert_with(|| Bucket {
                current: PoolChoice::AllThreads,
                recent: VecDeque::new(),
                reference: None,
                steps_until_probe: settings.first_probe_after,
                probe_interval: settings.min_probe_interval,
                probe: None,
            });
        if let Some(probe) = &bucket.probe {
            return if probe.other.len() <= probe.current.len() {
                bucket.current.other()
            } else {
                bucket.current
            };
        }
        let spiked = bucket.recent.len() >= settings.window
            && match (median(bucket.recent.iter().copied()), bucket.reference) {
                (Some(now), Some(reference)) => now > settings.spike_ratio * reference,
                _ => false,
            };
        if (bucket.steps_until_probe == 0 || spiked) && !bucket.recent.is_empty() {
            bucket.probe = Some(Probe::default());
            self.probes += 1;
            return bucket.current.other();
        }
        bucket.current
    }

    /// Records that a step of `shape` ran on `choice` in `elapsed`, and decides what follows.
    /// Call it once after each [`choose`](Self::choose), with the pool it returned.
    pub fn observe(&mut self, shape: StepShape, choice: PoolChoice, elapsed: Duration) -> Verdict {
        let settings = self.settings;
        let key = BucketKey::from(shape);
        let Some(bucket) = self.buckets.get_mut(&key) else {
            return Verdict::Continue; // observe without choose: nothing to compare with
        };
        let per_token = elapsed.as_secs_f64() / shape.num_tokens.max(1) as f64;
        if choice == bucket.current {
            bucket.recent.push_back(per_token);
            while bucket.recent.len() > settings.window {
                bucket.recent.pop_front();
            }
            match bucket.probe.as_mut() {
                Some(probe) => probe.current.push(per_token),
                None => bucket.steps_until_probe = bucket.steps_until_probe.saturating_sub(1),
            }
            return Verdict::Continue;
        }
        let Some(probe) = bucket.probe.as_mut() else {
            return Verdict::Continue; // the other pool outside a probe: not this controller's
        };
        probe.other.push(per_token);
        // The current pool's time: the lower of its recent median and its median within the
        // burst, so a noisy stretch of the current pool alone does not make the probe win.
        let window_median = median(bucket.recent.iter().copied()).unwrap_or(f64::INFINITY);
        let current_median = median(probe.current.iter().copied())
            .map_or(window_median, |burst| burst.min(window_median));
        let backed_off = (bucket.probe_interval * 2).min(settings.max_probe_interval);
        if per_token > (1.0 + settings.abort_margin) * current_median {
            bucket.reference = Some(window_median);
            bucket.end_probe(backed_off);
            return Verdict::ProbeLost;
        }
        if probe.other.len() < settings.probe_len {
            return Verdict::Continue;
        }
        let probe_median = median(probe.other.iter().copied()).unwrap_or(f64::INFINITY);
        if probe_median < (1.0 - settings.switch_margin) * current_median {
            let to = bucket.current.other();
            // The new pool's window starts from its probe steps (the old pool's steps
            // describe the other pool).
            bucket.recent = probe.other.drain(..).collect();
            bucket.current = to;
            bucket.reference = Some(probe_median);
            bucket.end_probe(settings.min_probe_interval);
            self.switches += 1;
            return Verdict::Switched {
                to,
                speedup: current_median / probe_median,
                decode: key.decode,
            };
        }
        bucket.reference = Some(window_median);
        bucket.end_probe(backed_off);
        Verdict::ProbeLost
    }
}

#[cfg(test)]
#[path = "controller_tests.rs"]
mod tests;
