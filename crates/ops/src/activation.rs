//! Elementwise ops of the MLP and the residual stream.

/// `out[i] = silu(gate[i]) * up[i]`, `silu(x) = x / (1 + e^-x)`.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(
        gate.len() == up.len() && up.len() == out.len(),
        "silu_mul: length mismatch"
    );
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

/// `gate[i] = silu(gate[i]) * up[i]`, in place.
pub fn silu_mul_in_place(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "silu_mul: length mismatch");
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `x[i] += y[i]` (the residual add).
pub fn add_in_place(x: &mut [f32], y: &[f32]) {
    assert_eq!(x.len(), y.len(), "add: length mismatch");
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Adds `bias` (`[dim]`) to every row of `x` (`[rows, dim]`).
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        add_in_place(row, bias);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silu_mul_matches_definition() {
        let gate = [0.0f32, 1.0, -2.0];
        let up = [3.0f32, 2.0, 1.0];
        let mut out = [0f32; 3];
        silu_mul(&gate, &up, &mut out);
        let expected = [
            0.0,
            2.0 / (1.0 + (-1.0f32).exp()),
            -2.0 / (1.0 + 2.0f32.exp()),
        ];
        for (a, b) in out.iter().zip(expected) {
            assert!((a - b).abs() < 1e-6);
        }
        let mut in_place = gate;
        silu_mul_in_place(&mut in_place, &up);
        assert_eq!(in_place, out);
    }
}
