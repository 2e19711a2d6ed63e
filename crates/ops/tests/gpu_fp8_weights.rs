//! GPU tests of the FP8 (e4m3) weight kernels (ignored without `--include-ignored`: they need
//! a GPU): `gemv_fp8` (1..=16 bf16 rows in place) and the prefill route, `dequantize_fp8`
//! into a dense matrix then cuBLAS, against a float64 product over the dequantized weights,
//! odd sizes included; `dequantize_fp8` into f32 is bit-exact with the host's
//! `code * factor`.

#[path = "gpu_common/mod.rs"]
mod common;

use common::*;
use half::bf16;
use pagoda_cuda::{DeviceBuffer, Gpu};
use pagoda_ops::cuda as ops;
use rand::Rng;

/// An independent e4m3 decoder: eight subnormal steps of 2^-9, then eight steps a binade.
fn e4m3(byte: u8) -> f64 {
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
struct Fp8 {
    codes: Vec<u8>,
    scales: Vec<f32>,
    n: usize,
    k: usize,
}

impl Fp8 {
    fn random(seed: u64, n: usize, k: usize) -> Fp8 {
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

    fn value(&self, row: usize, col: usize) -> f64 {
        e4m3(self.codes[row * self.k + col]) * f64::from(self.scales[row])
    }

    fn upload(&self, gpu: &Gpu) -> (DeviceBuffer<u8>, DeviceBuffer<f32>) {
        (
            gpu.upload(&self.codes).unwrap(),
            gpu.upload(&self.scales).unwrap(),
        )
    }

    /// `x [m, k] w^T` in float64, and the sums of |terms| (each output's error scale).
    fn reference(&self, x: &[f32], m: usize) -> (Vec<f64>, Vec<f64>) {
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
fn check(what: &str, got: &[f32], (want, magnitude): &(Vec<f64>, Vec<f64>), bound: (f64, f64)) {
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

const SHAPES: [(usize, usize); 5] = [(1, 16), (33, 48), (130, 4112), (257, 1040), (96, 64)];

#[test]
#[ignore = "needs a GPU"]
fn gemv_fp8_matches_float64_on_1_to_16_rows() {
    let gpu = gpu();
    for (s, &(n, k)) in SHAPES.iter().enumerate() {
        let w = Fp8::random(s as u64, n, k);
        let (codes, scales) = w.upload(&gpu);
        for m in 1..=ops::FP8_GEMV_MAX_ROWS {
            let x = round::<bf16>(&random_vec(&mut rng(100 + m as u64), m * k, 1.0));
            let xd = upload::<bf16>(&gpu, &x);
            let want = w.reference(&x, m);
            // f32 out, beta 0 over a poisoned buffer: only f32 accumulation's rounding.
            let mut out = poisoned::<f32>(&gpu, m * n);
            ops::gemv_fp8(&gpu, &xd, (&codes, &scales), &mut out, (m, n, k), 0.0).unwrap();
            check(
                &format!("f32 m {m} n {n} k {k}"),
                &download(&gpu, &out),
                &want,
                (1e-5, 0.0),
            );
            // bf16 out, beta 1 over ones: plus the output's rounding.
            let mut out = upload::<bf16>(&gpu, &vec![1.0; m * n]);
            ops::gemv_fp8(&gpu, &xd, (&codes, &scales), &mut out, (m, n, k), 1.0).unwrap();
            let plus_one = (want.0.iter().map(|v| v + 1.0).collect(), want.1.clone());
            let what = format!("bf16 beta 1 m {m} n {n} k {k}");
            check(&what, &download(&gpu, &out), &plus_one, (2e-5, 1.0 / 256.0));
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn dequantize_fp8_is_the_hosts_product_and_feeds_the_prefill_gemm() {
    let gpu = gpu();
    for (s, &(n, k)) in SHAPES.iter().enumerate() {
        let w = Fp8::random(10 + s as u64, n, k);
        let (codes, scales) = w.upload(&gpu);
        let mut dense = poisoned::<f32>(&gpu, n * k);
        ops::dequantize_fp8(&gpu, (&codes, &scales), &mut dense, (n, k)).unwrap();
        let host: Vec<u32> = (0..n * k)
            .map(|i| ((e4m3(w.codes[i]) as f32) * w.scales[i / k]).to_bits())
            .collect();
        let got: Vec<u32> = download(&gpu, &dense).iter().map(|v| v.to_bits()).collect();
        assert!(
            got == host,
            "f32 dequantization of [{n}, {k}] differs from the host's"
        );
        let mut dense = poisoned::<bf16>(&gpu, n * k);
        ops::dequantize_fp8(&gpu, (&codes, &scales), &mut dense, (n, k)).unwrap();
        for m in [1, 17, 64, 129, 512] {
            let x = round::<bf16>(&random_vec(&mut rng(200 + m as u64), m * k, 1.0));
            let xd = upload::<bf16>(&gpu, &x);
            let mut out = poisoned::<f32>(&gpu, m * n);
            gpu.gemm(&xd, &dense, &mut out, (m, n, k), 0.0).unwrap();
            // The bf16 weights carry 2^-9 relative rounding each.
            let what = format!("prefill m {m} n {n} k {k}");
            check(
                &what,
                &download(&gpu, &out),
                &w.reference(&x, m),
                (1.0 / 256.0, 0.0),
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn dequantize_fp8_takes_more_rows_than_a_grid_column() {
    // An LM head's rows (here 70000 > 65535) run on the grid's x.
    let gpu = gpu();
    let (n, k) = (70_000, 16);
    let w = Fp8::random(99, n, k);
    let (codes, scales) = w.upload(&gpu);
    let mut dense = poisoned::<f32>(&gpu, n * k);
    ops::dequantize_fp8(&gpu, (&codes, &scales), &mut dense, (n, k)).unwrap();
    let got = download(&gpu, &dense);
    for (i, &g) in got.iter().enumerate() {
        let want = (e4m3(w.codes[i]) as f32) * w.scales[i / k];
        assert_eq!(g.to_bits(), want.to_bits(), "[{}, {}]", i / k, i % k);
    }
}

#[test]
#[ignore = "needs a GPU"]
fn gemv_fp8_refuses_what_it_cannot_take() {
    let gpu = gpu();
    let w = Fp8::random(7, 8, 24);
    let (codes, scales) = w.upload(&gpu);
    let x = upload::<bf16>(&gpu, &[0.0; 24]);
    let mut out = poisoned::<f32>(&gpu, 8);
    // k = 24 is not a multiple of 16.
    assert!(ops::gemv_fp8(&gpu, &x, (&codes, &scales), &mut out, (1, 8, 24), 0.0).is_err());
    let x = upload::<bf16>(&gpu, &vec![0.0; 17 * 32]);
    let codes = gpu.upload(&vec![0u8; 8 * 32]).unwrap();
    let mut out = poisoned::<f32>(&gpu, 17 * 8);
    // 17 rows are more than the in-place kernel takes.
    assert!(ops::gemv_fp8(&gpu, &x, (&codes, &scales), &mut out, (17, 8, 32), 0.0).is_err());
}
