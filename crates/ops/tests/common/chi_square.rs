//! Pearson chi-square of drawn tokens against an exact distribution, for the statistics tests
//! of the samplers.

/// Wilson-Hilferty approximation of the chi-square upper quantile with `degrees_of_freedom`,
/// at the upper-tail standard normal quantile `z`.
pub fn critical_value(degrees_of_freedom: f64, z: f64) -> f64 {
    let a = 2.0 / (9.0 * degrees_of_freedom);
    degrees_of_freedom * (1.0 - a + z * a.sqrt()).powi(3)
}

/// Pearson statistic and degrees of freedom of `counts` against `probabilities`, pooling
/// cells (smallest expected first) until each pooled bin expects at least `min_expected`
/// draws. Panics if a zero-probability token was drawn.
pub fn statistic(
    name: &str,
    counts: &[u64],
    probabilities: &[f64],
    min_expected: f64,
) -> (f64, f64) {
    let draws: u64 = counts.iter().sum();
    let mut cells: Vec<(f64, f64)> = Vec::new(); // (observed, expected)
    for (token, (&count, &probability)) in counts.iter().zip(probabilities).enumerate() {
        if probability == 0.0 {
            assert_eq!(
                count, 0,
                "{name}: token {token} has zero mass but was drawn {count} times"
            );
        } else {
            cells.push((count as f64, probability * draws as f64));
        }
    }
    cells.sort_by(|a, b| a.1.total_cmp(&b.1));
    let mut bins: Vec<(f64, f64)> = Vec::new();
    let mut pool = (0.0, 0.0);
    for (observed, expected) in cells {
        pool = (pool.0 + observed, pool.1 + expected);
        if pool.1 >= min_expected {
            bins.push(pool);
            pool = (0.0, 0.0);
        }
    }
    if pool.1 > 0.0 {
        match bins.last_mut() {
            Some(last) => *last = (last.0 + pool.0, last.1 + pool.1),
            None => bins.push(pool),
        }
    }
    let statistic = bins.iter().map(|(o, e)| (o - e) * (o - e) / e).sum();
    (statistic, bins.len() as f64 - 1.0)
}
