//! GPU tests of the FP8 GEMM route (ignored without `--include-ignored`: they need a GPU):
//! `quantize_rows_fp8` writes, bit for bit, the codes and factors of the host's e4m3 codec
//! (`attention::fp8::quantize_head`, itself tested against a search of every code), and
//! `fp8_gemm` (those activations on cuBLASLt's FP8 GEMM, both factors in its epilogue)
//! matches a float64 product over the codes both sides hold, in pieces of the scratch's rows
//! too, f32 and bf16 out, with and without accumulation.

#[path = "gpu_common/mod.rs"]
mod common;

use common::fp8::{check, Fp8};
use common::*;
use half::bf16;
use pagoda_cuda::DeviceBuffer;
use pagoda_ops::attention::fp8::quantize_head;
use pagoda_ops::cuda as ops;

/// Random bf16 activations `[m, k]`: row 1 all zeros, row 2 with one outlier 1000x the rest.
fn activations(seed: u64, m: usize, k: usize) -> Vec<f32> {
    let mut x = random_vec(&mut rng(seed), m * k, 1.0);
    if m > 2 {
        x[k..2 * k].fill(0.0);
        x[2 * k + k / 3] = 1000.0;
    }
    round::<bf16>(&x)
}

/// The host codec's codes and factors of `x`, row by row.
fn host_codes(x: &[f32], m: usize, k: usize) -> Fp8 {
    let mut codes = vec![0u8; m * k];
    let scales = (0..m)
        .map(|i| quantize_head(&x[i * k..(i + 1) * k], &mut codes[i * k..(i + 1) * k]))
        .collect();
    Fp8 {
        codes,
        scales,
        n: m,
        k,
    }
}

#[test]
#[ignore = "needs a GPU"]
fn quantize_rows_fp8_is_the_kv_cache_codec_row_by_row() {
    let gpu = gpu();
    for (m, k) in [(1, 4), (37, 4112), (5, 14336)] {
        let x = activations(m as u64, m, k);
        let want = host_codes(&x, m, k);
        let mut codes: DeviceBuffer<u8> = gpu.upload(&vec![0x55u8; m * k]).unwrap();
        let mut scales = poisoned::<f32>(&gpu, m);
        for input in ["bf16", "f32"] {
            let scratch = (&mut codes, &mut scales);
            match input {
                "bf16" => ops::quantize_rows_fp8(&gpu, &upload::<bf16>(&gpu, &x), scratch, (m, k)),
                _ => ops::quantize_rows_fp8(&gpu, &upload::<f32>(&gpu, &x), scratch, (m, k)),
            }
            .unwrap();
            let got_scales: Vec<u32> = download(&gpu, &scales)
                .iter()
                .map(|s| s.to_bits())
                .collect();
            let want_scales: Vec<u32> = want.scales.iter().map(|s| s.to_bits()).collect();
            assert_eq!(got_scales, want_scales, "{input} m {m} k {k}: factors");
            let got = gpu.download(&codes).unwrap();
            let first = got.iter().zip(&want.codes).position(|(g, w)| g != w);
            assert_eq!(first, None, "{input} m {m} k {k}: first differing code");
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn fp8_gemm_matches_float64_over_the_codes_both_sides_hold() {
    let gpu = gpu();
    if !gpu.fp8_gemm_supported() {
        eprintln!("no FP8 tensor cores here: nothing to check");
        return;
    }
    for (s, &(n, k)) in [(96, 64), (264, 1040), (1024, 4096)].iter().enumerate() {
        let w = Fp8::random(30 + s as u64, n, k);
        let (codes, scales) = w.upload(&gpu);
        // Scratch of 128 rows: 300 rows run in three pieces.
        let mut scratch = ops::Fp8Activations::new(&gpu, 128, 4096).unwrap();
        assert!(ops::fp8_gemm_applies::<bf16>(&gpu, &scratch, (n, k)));
        for m in [17, 64, 300] {
            let x = activations(300 + m as u64, m, k);
            let want = w.product(&host_codes(&x, m, k));
            let xd = upload::<bf16>(&gpu, &x);
            let weights = (&codes, &scales);
            // f32 out over a poisoned buffer: the tensor cores' accumulation only, which
            // keeps about 14 bits in FP8 (up to 2^-9 of the sum of |terms| here, with the
            // outlier row's one large term; bf16 products stay within 2^-15).
            let mut out = poisoned::<f32>(&gpu, m * n);
            ops::fp8_gemm(&gpu, &xd, weights, &mut scratch, &mut out, (m, n, k), 0.0).unwrap();
            let what = format!("f32 m {m} n {n} k {k}");
            check(&what, &download(&gpu, &out), &want, (2e-3, 1e-6));
            // bf16 out, beta 1 over ones: plus the output's rounding, twice (the epilogue
            // rounds the scaled sum to bf16 before it adds the ones: half a bf16 step of the
            // sum, at most 2^-8 of its magnitude, then of the result). The model's GEMMs that
            // accumulate write f32.
            let mut out = upload::<bf16>(&gpu, &vec![1.0; m * n]);
            ops::fp8_gemm(&gpu, &xd, weights, &mut scratch, &mut out, (m, n, k), 1.0).unwrap();
            let plus_one = (want.0.iter().map(|v| v + 1.0).collect(), want.1.clone());
            let what = format!("bf16 beta 1 m {m} n {n} k {k}");
            check(
                &what,
                &download(&gpu, &out),
                &plus_one,
                (2e-3 + 1.0 / 256.0, 1.0 / 256.0),
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn fp8_gemm_refuses_shapes_cublaslt_cannot_take() {
    let gpu = gpu();
    let mut scratch = ops::Fp8Activations::new(&gpu, 16, 64).unwrap();
    // n not a multiple of 8, k not of 16, k wider than the scratch, an f16 output.
    assert!(!ops::fp8_gemm_applies::<bf16>(&gpu, &scratch, (12, 64)));
    assert!(!ops::fp8_gemm_applies::<bf16>(&gpu, &scratch, (16, 40)));
    assert!(!ops::fp8_gemm_applies::<bf16>(&gpu, &scratch, (16, 128)));
    assert!(!ops::fp8_gemm_applies::<half::f16>(
        &gpu,
        &scratch,
        (16, 64)
    ));
    let w = Fp8::random(9, 12, 64);
    let (codes, scales) = w.upload(&gpu);
    let x = upload::<bf16>(&gpu, &vec![1.0; 2 * 64]);
    let mut out = poisoned::<f32>(&gpu, 2 * 12);
    let weights = (&codes, &scales);
    let result = ops::fp8_gemm(&gpu, &x, weights, &mut scratch, &mut out, (2, 12, 64), 0.0);
    assert!(result.is_err(), "n = 12 is refused");
}
