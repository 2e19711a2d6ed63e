//! FP8 (e4m3) matrices for the FP8 weight and GEMM tests: an independent decoder, random
//! codes with row factors, float64 products and a bounded comparison.

use pagoda_cuda::{DeviceBuffer, Gpu};
use rand::Rng;

use super::rng;

/// An independent e4m3 decoder: eight subnormal steps of 2^-9, then eight steps a binade.
pub fn e4m3(byte: u8) -> f64 {
    let code = usize::from(byte & 0x7f);
    let magnitude = if code < 8 {
        code as f64 * 2f64.powi(-9)
    } else {
        (1.0 + (code % 8) as f64 / 8.0) * 2f64.powi((code / 8) as i32 - 7)
    };
    if byte & 0x80 != 0 {
        -magnitude
    } else {
        magnitude
    }
}

/// A random `[n, k]` FP8 matrix (no NaN codes) and its row factors.
pub struct Fp8 {
    pub codes: Vec<u8>,
    pub scales: Vec<f32>,
    pub n: usize,
    pub k: usize,
}

impl Fp8 {
    pub fn random(seed: u64, n: usize, k: usize) -> Fp8 {
        let mut rng = rng(seed);
        let codes = (0..n * k)
            .map(|_| match rng.random::<u8>() {
                0x7f => 0x7e,
                0xff => 0xfe,
                byte => byte,
            })
            .collect();
        let scales = (0..n).map(|_| rng.random_range(1e-3f32..1e-2)).collect();
        Fp8 {
            codes,
            scales,
            n,
            k,
        }
    }

    pub fn value(&self, row: usize, col: usize) -> f64 {
        e4m3(self.codes[row * self.k + col]) * f64::from(self.scales[row])
    }

    pub fn upload(&self, gpu: &Gpu) -> (DeviceBuffer<u8>, DeviceBuffer<f32>) {
        (
            gpu.upload(&self.codes).unwrap(),
            gpu.upload(&self.scales).unwrap(),
        )
    }

    /// `x w^T` in float64 for `x` FP8 too (`[m, k]`, a factor per row), with the sums of
    /// |terms|.
    pub fn product(&self, x: &Fp8) -> (Vec<f64>, Vec<f64>) {
        assert_eq!(x.k, self.k);
        let (mut out, mut magnitude) = (vec![0f64; x.n * self.n], vec![0f64; x.n * self.n]);
        for i in 0..x.n {
            for j in 0..self.n {
                for c in 0..self.k {
                    let term = x.value(i, c) * self.value(j, c);
                    out[i * self.n + j] += term;
                    magnitude[i * self.n + j] += term.abs();
                }
            }
        }
        (out, magnitude)
    }

    /// `x [m, k] w^T` in float64, and the sums of |terms| (each output's error scale).
    pub fn reference(&self, x: &[f32], m: usize) -> (Vec<f64>, Vec<f64>) {
        let (mut out, mut magnitude) = (vec![0f64; m * self.n], vec![0f64; m * self.n]);
        for i in 0..m {
            for j in 0..self.n {
                for c in 0..self.k {
                    let term = f64::from(x[i * self.k + c]) * self.value(j, c);
                    out[i * self.n + j] += term;
                    magnitude[i * self.n + j] += term.abs();
                }
            }
        }
        (out, magnitude)
    }
}

/// Every `|got - want| <= relative * magnitude + absolute * |want|`; returns the worst ratio.
pub fn check(what: &str, got: &[f32], (want, magnitude): &(Vec<f64>, Vec<f64>), bound: (f64, f64)) {
    assert_eq!(got.len(), want.len(), "{what}");
    let mut worst = 0f64;
    for (index, (&g, (&w, &s))) in got.iter().zip(want.iter().zip(magnitude)).enumerate() {
        let allowed = bound.0 * s + bound.1 * w.abs() + 1e-30;
        let ratio = (f64::from(g) - w).abs() / allowed;
        assert!(
            ratio <= 1.0,
            "{what}: [{index}] {g} vs {w} (magnitude {s}, ratio {ratio})"
        );
        worst = worst.max(ratio);
    }
    eprintln!("{what}: worst error {worst:.3} of the bound");
}
