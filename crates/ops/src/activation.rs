//! Elementwise ops of the MLP and the residual stream.

/// `out[i] = silu(gate[i]) * up[i]`, `silu(x) = x / (1 + e^-x)`, with libm's `expf` (the
/// reference of [`silu_mul_in_place`]).
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(
        gate.len() == up.len() && up.len() == out.len(),
        "silu_mul: length mismatch"
    );
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = silu_gate_libm(g, u);
    }
}

/// `silu(g) * u` with libm's `expf`: the reference formula of both SiLU functions.
#[inline(always)]
fn silu_gate_libm(g: f32, u: f32) -> f32 {
    g / (1.0 + (-g).exp()) * u
}

/// Values per task of the parallel in-place SiLU: below two of them (a decode step's
/// 1536-8192 values) the loop stays on the calling thread.
const SILU_TASK: usize = 8192;

pub mod cuda;
mod silu;
pub use silu::{silu_polynomial_calls, SiluPath, SILU_ENV_VAR};

/// `gate[i] = silu(gate[i]) * up[i]`, in place, with `e^-x` from the path
/// [`SiluPath::selected`] picks (libm's `expf` by default, the vector polynomial under
/// `PAGODA_CPU_SILU=polynomial`); long inputs (prefill) in parallel, with the same
/// per-element formula, so the same bits whatever the length or the position of an element.
pub fn silu_mul_in_place(gate: &mut [f32], up: &[f32]) {
    use rayon::prelude::*;
    assert_eq!(gate.len(), up.len(), "silu_mul: length mismatch");
    let path = SiluPath::selected();
    if path == SiluPath::Polynomial {
        silu::count_call();
    }
    let apply = |(gate, up): (&mut [f32], &[f32])| match path {
        SiluPath::Polynomial => silu::silu_mul_polynomial(gate, up),
        SiluPath::Libm => {
            for (g, &u) in gate.iter_mut().zip(up) {
                *g = silu_gate_libm(*g, u);
            }
        }
    };
    if gate.len() < 2 * SILU_TASK {
        apply((gate, up));
    } else {
        gate.par_chunks_mut(SILU_TASK)
            .zip(up.par_chunks(SILU_TASK))
            .for_each(apply);
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
        for (a, b) in in_place.iter().zip(out) {
            assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{a} vs {b}");
        }
    }

    /// The parallel path (a prefill's length) gives the sequential formula's bits (the
    /// selected path's formula).
    #[test]
    fn long_in_place_silu_equals_the_elementwise_formula() {
        let n = 5 * SILU_TASK + 17;
        let gate: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 1001) as f32 - 500.0) / 61.0)
            .collect();
        let up: Vec<f32> = (0..n)
            .map(|i| ((i * 11 % 97) as f32 - 48.0) / 7.0)
            .collect();
        let mut out = vec![0f32; n];
        if SiluPath::selected() == SiluPath::Polynomial {
            out.copy_from_slice(&gate);
            silu::silu_mul_portable(&mut out, &up);
        } else {
            silu_mul(&gate, &up, &mut out);
        }
        let mut in_place = gate.clone();
        silu_mul_in_place(&mut in_place, &up);
        assert!(in_place
            .iter()
            .zip(&out)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}
