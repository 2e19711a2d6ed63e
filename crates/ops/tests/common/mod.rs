//! Oracles shared by the linear-kernel tests.

/// Asserts that `y` (`[num_tokens, rows]`) holds the f64 dots of `weights` (`[rows, cols]`,
/// dequantized) with `activations` (`[num_tokens, cols]`, the values the kernel saw), each
/// within f32 rounding of its magnitude: 1e-5 of the sum of |products|, plus 1e-6. `what`
/// names the case in the failure message.
pub fn assert_f64_dots(what: &str, y: &[f32], weights: &[f32], activations: &[f32], cols: usize) {
    let rows = weights.len() / cols;
    let num_tokens = activations.len() / cols;
    assert_eq!(y.len(), rows * num_tokens, "{what}: output length");
    for t in 0..num_tokens {
        let a = &activations[t * cols..(t + 1) * cols];
        for r in 0..rows {
            let w = &weights[r * cols..(r + 1) * cols];
            let products = w.iter().zip(a).map(|(w, a)| *w as f64 * *a as f64);
            let reference: f64 = products.clone().sum();
            let scale: f64 = products.map(f64::abs).sum();
            let got = y[t * rows + r] as f64;
            assert!(
                (got - reference).abs() <= 1e-5 * scale + 1e-6,
                "{what} t{t} r{r}: {got} vs {reference}"
            );
        }
    }
}
