//! GPU tests of the FP8 (e4m3) weight kernels (ignored without `--include-ignored`: they need
//! a GPU): `gemv_fp8` (1..=16 bf16 rows in place) and the prefill route, `dequantize_fp8`
//! into a dense matrix then cuBLAS, against a float64 product over the dequantized weights,
//! odd sizes included; `dequantize_fp8` into f32 is bit-exact with the host's
//! `code * factor`.

#[path = "gpu_common/mod.rs"]
mod common;

use common::fp8::{check, e4m3, Fp8};
use common::*;
use half::bf16;
use pagoda_ops::cuda as ops;

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
