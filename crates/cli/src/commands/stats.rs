//! Summaries of repeated measurements, shared by the bench subcommands: the median, the
//! percentiles, the range, and whether repetitions disagree.
//!
//! Conventions, the same in every bench:
//! - The median of an even count is the mean of the two middle values.
//! - Percentiles interpolate linearly between the closest ranks (numpy's default), so the
//!   50th percentile is the median.
//! - Values are ordered with `f64::total_cmp`: a NaN never panics; a positive NaN sorts
//!   after +inf (it becomes the maximum), a negative one before -inf.
//! - An empty list has no summary: the functions return `None` instead of panicking.

/// Repetitions disagree when the largest exceeds this many times the smallest.
pub const DISAGREEMENT_FACTOR: f64 = 2.0;

/// Median and range of a non-empty list of measurements.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    /// The middle value; for an even count, the mean of the two middle values.
    pub median: f64,
    /// The smallest value.
    pub min: f64,
    /// The largest value.
    pub max: f64,
}

impl Summary {
    /// The summary of `values` (in any order); `None` when there are none.
    pub fn of(values: &[f64]) -> Option<Summary> {
        let sorted = sorted(values);
        Some(Summary {
            median: median_of_sorted(&sorted)?,
            min: *sorted.first()?,
            max: *sorted.last()?,
        })
    }

    /// Whether the largest value exceeds `factor` times the smallest (for non-negative
    /// measurements: max / min > factor; a zero minimum under a positive maximum disagrees,
    /// all zeros agree).
    pub fn disagrees(&self, factor: f64) -> bool {
        self.max > factor * self.min
    }
}

/// The median of `values` (in any order): the middle value, or the mean of the two middle
/// values for an even count; `None` when there are none.
pub fn median(values: &[f64]) -> Option<f64> {
    median_of_sorted(&sorted(values))
}

/// The `fraction` percentile of `values` (in any order; `fraction` in [0, 1], clamped),
/// interpolated linearly between the two closest ranks; `None` when there are none.
pub fn percentile(values: &[f64], fraction: f64) -> Option<f64> {
    let sorted = sorted(values);
    let last = sorted.len().checked_sub(1)?;
    let position = fraction.clamp(0.0, 1.0) * last as f64;
    let below = (position.floor() as usize).min(last);
    let above = (below + 1).min(last);
    let weight = position - below as f64;
    Some(sorted[below] + (sorted[above] - sorted[below]) * weight)
}

/// One line naming `metric` when its `values` (one per repetition) disagree by more than
/// [`DISAGREEMENT_FACTOR`]: `"ttft_p50_ms: 2.400 to 31.000 over 3 repetitions (12.92x)"`;
/// `None` when they agree or there are none.
pub fn disagreement(metric: &str, values: &[f64]) -> Option<String> {
    let summary = Summary::of(values)?;
    summary.disagrees(DISAGREEMENT_FACTOR).then(|| {
        format!(
            "{metric}: {:.3} to {:.3} over {} repetitions ({:.2}x)",
            summary.min,
            summary.max,
            values.len(),
            summary.max / summary.min
        )
    })
}

fn sorted(values: &[f64]) -> Vec<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted
}

fn median_of_sorted(sorted: &[f64]) -> Option<f64> {
    let middle = sorted.len() / 2;
    match sorted.len() {
        0 => None,
        n if n % 2 == 1 => Some(sorted[middle]),
        _ => Some((sorted[middle - 1] + sorted[middle]) / 2.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_single_and_empty_lists() {
        assert_eq!(median(&[5.0, 1.0, 4.0, 2.0, 3.0]), Some(3.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        // Two repetitions: the mean, not either one.
        assert_eq!(median(&[33.0, 10.0]), Some(21.5));
        assert_eq!(median(&[7.0]), Some(7.0));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn summary_gives_median_min_and_max() {
        let summary = Summary::of(&[4.0, 1.0, 3.0, 2.0]).unwrap();
        assert_eq!(
            summary,
            Summary {
                median: 2.5,
                min: 1.0,
                max: 4.0
            }
        );
        assert_eq!(
            Summary::of(&[7.0]),
            Some(Summary {
                median: 7.0,
                min: 7.0,
                max: 7.0
            })
        );
        assert_eq!(Summary::of(&[]), None);
    }

    #[test]
    fn nan_sorts_last_instead_of_panicking() {
        let summary = Summary::of(&[f64::NAN, 1.0, 3.0]).unwrap();
        assert_eq!((summary.median, summary.min), (3.0, 1.0));
        assert!(summary.max.is_nan());
        assert!(!summary.disagrees(DISAGREEMENT_FACTOR));
        assert_eq!(median(&[2.0, f64::NAN, 1.0, 3.0]), Some(2.5));
    }

    #[test]
    fn percentiles_interpolate_and_the_50th_is_the_median() {
        let values = [5.0, 1.0, 4.0, 2.0, 3.0];
        assert_eq!(percentile(&values, 0.0), Some(1.0));
        assert_eq!(percentile(&values, 1.0), Some(5.0));
        assert_eq!(percentile(&values, 0.5), Some(3.0));
        assert!((percentile(&values, 0.95).unwrap() - 4.8).abs() < 1e-12);
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 0.5), Some(2.5));
        assert_eq!(percentile(&[7.0], 0.95), Some(7.0));
        assert_eq!(percentile(&[], 0.5), None);
        // Out-of-range fractions are clamped.
        assert_eq!(percentile(&values, 1.5), Some(5.0));
    }

    #[test]
    fn disagreement_is_more_than_twice() {
        // Exactly 2x agrees; just over disagrees.
        assert_eq!(disagreement("tok/s", &[10.0, 20.0, 15.0]), None);
        assert_eq!(
            disagreement("ttft_p50_ms", &[2.4, 31.0, 30.0]).as_deref(),
            Some("ttft_p50_ms: 2.400 to 31.000 over 3 repetitions (12.92x)")
        );
        assert!(disagreement("x", &[10.0, 20.001]).is_some());
        // One repetition, or none, cannot disagree.
        assert_eq!(disagreement("x", &[3.0]), None);
        assert_eq!(disagreement("x", &[]), None);
        // Zero under a positive value disagrees; all zeros agree.
        assert!(disagreement("x", &[0.0, 1.0]).is_some());
        assert_eq!(disagreement("x", &[0.0, 0.0]), None);
    }
}
