//! When speculation pays: per batch size, the measured seconds of plain steps and of
//! speculative steps (drafting, verifying, sampling), and the tokens each request gained per
//! speculative step, each the median of the last few. Speculation runs where `tokens per
//! request x plain step time` beats the speculative step time, and is tried again now and
//! then where it lost, so the estimates follow the workload.

/// Batch sizes are grouped by powers of two: 1, 2, 3-4, 5-8, ...
const BUCKETS: usize = 12;

/// Measurements kept per bucket and kind of step; the decision uses their median, so a
/// one-off step (a draft model prefilling a new prompt) does not sway it.
const WINDOW: usize = 8;

/// Speculative steps measured at a size before the policy may turn speculation off there,
/// and plain steps before it compares.
const FIRST_SPECULATIVE: u64 = 4;
const FIRST_PLAIN: u64 = 2;

/// Where speculation lost, it is tried again once in this many steps.
pub const PROBE_EVERY: u64 = 32;

/// The last [`WINDOW`] measurements.
#[derive(Debug, Clone, Copy, Default)]
struct Window {
    values: [f64; WINDOW],
    samples: u64,
}

impl Window {
    fn add(&mut self, x: f64) {
        self.values[(self.samples % WINDOW as u64) as usize] = x;
        self.samples += 1;
    }

    fn median(&self) -> Option<f64> {
        let len = (self.samples as usize).min(WINDOW);
        if len == 0 {
            return None;
        }
        let mut values = self.values[..len].to_vec();
        values.sort_by(f64::total_cmp);
        Some(if len % 2 == 1 {
            values[len / 2]
        } else {
            (values[len / 2 - 1] + values[len / 2]) / 2.0
        })
    }
}

/// The cost model of one engine.
#[derive(Debug, Clone, Default)]
pub struct SpeculationPolicy {
    /// Seconds per plain step, by batch bucket.
    plain: [Window; BUCKETS],
    /// Seconds per speculative step, by batch bucket.
    speculative: [Window; BUCKETS],
    /// Tokens emitted per request per speculative step, by batch bucket.
    gained: [Window; BUCKETS],
    /// Steps decided in each bucket (for the probes).
    decided: [u64; BUCKETS],
}

fn bucket(batch: usize) -> usize {
    (batch.max(1).next_power_of_two().trailing_zeros() as usize).min(BUCKETS - 1)
}

impl SpeculationPolicy {
    /// Whether a step of `batch` decoding requests should speculate: first a few
    /// speculative steps and a few plain ones at this size, then where the medians of the
    /// recent measurements say it pays (`tokens gained x plain step > speculative step`),
    /// and once in [`PROBE_EVERY`] steps where they say it does not.
    pub fn speculate(&mut self, batch: usize) -> bool {
        let b = bucket(batch);
        self.decided[b] += 1;
        if self.speculative[b].samples < FIRST_SPECULATIVE {
            return true;
        }
        if self.plain[b].samples < FIRST_PLAIN {
            return false;
        }
        let (Some(plain), Some(speculative), Some(gained)) = (
            self.plain[b].median(),
            self.speculative[b].median(),
            self.gained[b].median(),
        ) else {
            return true;
        };
        gained * plain > speculative || self.decided[b].is_multiple_of(PROBE_EVERY)
    }

    /// Records a step of `batch` decoding requests that took `seconds`; `gained`: the tokens
    /// each request emitted on average when it speculated, `None` for a plain step.
    pub fn record(&mut self, batch: usize, seconds: f64, gained: Option<f64>) {
        let b = bucket(batch);
        match gained {
            Some(tokens) => {
                self.speculative[b].add(seconds);
                self.gained[b].add(tokens);
            }
            None => self.plain[b].add(seconds),
        }
    }

    /// Tokens per second per request, speculating and not, at `batch` (for reports).
    pub fn rates(&self, batch: usize) -> (Option<f64>, Option<f64>) {
        let b = bucket(batch);
        let plain = self.plain[b].median().map(|s| 1.0 / s);
        let speculative = match (self.speculative[b].median(), self.gained[b].median()) {
            (Some(s), Some(g)) => Some(g / s),
            _ => None,
        };
        (plain, speculative)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `steps` decisions at `batch` with the given step costs; returns how many
    /// speculated.
    fn run(
        policy: &mut SpeculationPolicy,
        batch: usize,
        steps: u64,
        plain: f64,
        speculative: f64,
        gained: f64,
    ) -> u64 {
        let mut speculated = 0;
        for _ in 0..steps {
            if policy.speculate(batch) {
                speculated += 1;
                policy.record(batch, speculative, Some(gained));
            } else {
                policy.record(batch, plain, None);
            }
        }
        speculated
    }

    #[test]
    fn speculation_stays_on_where_it_pays() {
        let mut policy = SpeculationPolicy::default();
        // 2.5 tokens per step of 1.5x the plain cost: 1.67x.
        let speculated = run(&mut policy, 1, 320, 0.010, 0.015, 2.5);
        assert!(speculated >= 318, "{speculated}");
    }

    #[test]
    fn speculation_turns_off_where_it_loses_and_is_probed_again() {
        let mut policy = SpeculationPolicy::default();
        // 1.2 tokens per step of 1.5x the cost: 0.8x.
        let speculated = run(&mut policy, 16, 320, 0.010, 0.015, 1.2);
        // The first four, then one step in 32.
        assert!(
            (13..=15).contains(&speculated),
            "one step in {PROBE_EVERY}: {speculated}"
        );
        // Sizes are measured apart: batch 1 still speculates where it pays.
        assert!(run(&mut policy, 1, 64, 0.010, 0.012, 2.0) >= 62);
    }

    #[test]
    fn one_slow_first_step_does_not_turn_speculation_off() {
        let mut policy = SpeculationPolicy::default();
        // The draft model prefills the prompt in the first speculative step: 20x slower.
        assert!(policy.speculate(1));
        policy.record(1, 0.300, Some(5.0));
        let speculated = run(&mut policy, 1, 100, 0.020, 0.030, 4.5);
        assert!(speculated >= 96, "{speculated}");
    }

    #[test]
    fn the_estimates_follow_a_changing_workload() {
        let mut policy = SpeculationPolicy::default();
        run(&mut policy, 1, 200, 0.010, 0.015, 3.0);
        // The guesses stop being accepted: the probes see it and turn speculation off.
        let late = run(&mut policy, 1, 320, 0.010, 0.015, 1.0);
        assert!(late < 40, "{late}");
        let (plain, speculative) = policy.rates(1);
        assert!(plain.unwrap() > speculative.unwrap());
    }
}
