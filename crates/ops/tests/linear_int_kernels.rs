//! The integer kernels against independent references: repacked weights decode bit-exactly
//! as `quant::dequantize` does; the scalar integer dot equals the f64 dot of the dequantized
//! weights and the dequantized Q8 activations; every SIMD tile this CPU runs equals the
//! scalar kernel (exactly when all scales are 1, so every float is an exact integer); and
//! `Weight::matmul` with each kernel set matches the f64 reference for decode and prefill.

mod common;

use common::{random_rows, REPACKED};

use pagoda_ops::linear::cpu::int_dot::{tile, IntIsa};
use pagoda_ops::linear::{CpuKernels, Weight};
use pagoda_tensor::quant::q8::Q8Rows;
use pagoda_tensor::quant::repack::{dot_scalar, repack};
use pagoda_tensor::{quant, GgmlType};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn random_activations(rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    (0..rows * cols)
        .map(|_| rng.random_range(-2.0f32..2.0))
        .collect()
}

fn dequantized(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Vec<f32> {
    let mut out = vec![0f32; rows * cols];
    quant::dequantize(ty, bytes, &mut out).unwrap();
    out
}

fn supported_isas() -> Vec<IntIsa> {
    let isas: Vec<IntIsa> = [
        IntIsa::Vnni,
        IntIsa::Avx2,
        IntIsa::NeonDot,
        IntIsa::Neon,
        IntIsa::Scalar,
    ]
    .into_iter()
    .filter(|isa| isa.is_supported())
    .collect();
    println!("integer kernels tested on this CPU: {isas:?}");
    isas
}

#[test]
fn repacked_rows_decode_bit_exactly() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for ty in REPACKED {
        let (rows, cols) = (3, 512);
        let bytes = random_rows(ty, rows, cols, &mut rng, false);
        let packed = repack(ty, rows, cols, &bytes).unwrap();
        let reference = dequantized(ty, rows, cols, &bytes);
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            packed.dequantize_row(r, &mut row);
            for (i, (a, b)) in row.iter().zip(&reference[r * cols..]).enumerate() {
                assert!(a == b, "{ty} row {r} value {i}: {a} != {b}");
            }
        }
    }
    assert!(
        repack(GgmlType::F16, 1, 32, &[0u8; 64]).is_none(),
        "a float format has no repacked form"
    );
    assert!(
        repack(GgmlType::Q4_1, 2, 64, &[0u8; 10]).is_none(),
        "wrong size accepted"
    );
}

#[test]
fn activation_quantization_is_within_half_a_step() {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let x = random_activations(3, 96, &mut rng);
    let q = Q8Rows::quantize(&x, 96).unwrap();
    let mut back = vec![0f32; 96];
    for t in 0..3 {
        q.dequantize_row(t, &mut back);
        for (b, (chunk, back)) in x[t * 96..(t + 1) * 96]
            .chunks(32)
            .zip(back.chunks(32))
            .enumerate()
        {
            let d = q.row_scales(t)[b];
            let amax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!((d - amax / 127.0).abs() <= 1e-7 * amax);
            for (a, b) in chunk.iter().zip(back) {
                assert!((a - b).abs() <= d * 0.5 + 1e-6, "{a} vs {b}");
            }
            let sum: i32 = q.row_qs(t)[b * 32..(b + 1) * 32]
                .iter()
                .map(|&v| v as i32)
                .sum();
            assert_eq!(q.row_sums(t)[b], d * sum as f32);
        }
    }
    assert!(Q8Rows::quantize(&x, 48).is_err());
    assert!(Q8Rows::quantize(&x[..100], 96).is_err());
    // The vectorized, parallel quantizer gives the same bytes as the portable one.
    let many = random_activations(40, 96, &mut rng);
    let portable = Q8Rows::quantize(&many, 96).unwrap();
    for isa in supported_isas() {
        let mut fast = Q8Rows::default();
        pagoda_ops::linear::cpu::int_matmul::quantize_activations(isa, &many, 96, &mut fast);
        for t in 0..40 {
            assert_eq!(fast.row_qs(t), portable.row_qs(t), "{isa:?} token {t}");
            assert_eq!(fast.row_scales(t), portable.row_scales(t));
            assert_eq!(fast.row_sums(t), portable.row_sums(t));
        }
    }
}

#[test]
fn scalar_integer_dot_matches_dequantized_f64_dot() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for ty in REPACKED {
        let (rows, cols) = (4, 512);
        let bytes = random_rows(ty, rows, cols, &mut rng, false);
        let packed = repack(ty, rows, cols, &bytes).unwrap();
        let weights = dequantized(ty, rows, cols, &bytes);
        let x = random_activations(2, cols, &mut rng);
        let q = Q8Rows::quantize(&x, cols).unwrap();
        let mut a = vec![0f32; cols];
        for t in 0..2 {
            q.dequantize_row(t, &mut a);
            for r in 0..rows {
                let w = &weights[r * cols..(r + 1) * cols];
                let reference: f64 = w.iter().zip(&a).map(|(w, a)| *w as f64 * *a as f64).sum();
                let scale: f64 = w
                    .iter()
                    .zip(&a)
                    .map(|(w, a)| (*w as f64 * *a as f64).abs())
                    .sum();
                let got = dot_scalar(&packed, r, &q, t) as f64;
                assert!(
                    (got - reference).abs() <= 1e-5 * scale + 1e-6,
                    "{ty} r{r} t{t}: {got} vs {reference}"
                );
            }
        }
    }
}

fn check_tiles<const R: usize, const T: usize>(
    isa: IntIsa,
    ty: GgmlType,
    unit: bool,
    seed: u64,
    cols: usize,
) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let bytes = random_rows(ty, R + 1, cols, &mut rng, unit);
    let packed = repack(ty, R + 1, cols, &bytes).unwrap();
    let x: Vec<f32> = if unit {
        // Integers with one +-127 per block: every activation scale is exactly 1.
        (0..(T + 1) * cols)
            .map(|i| {
                if i % 32 == 5 {
                    127.0
                } else {
                    rng.random_range(-127i32..=127) as f32
                }
            })
            .collect()
    } else {
        random_activations(T + 1, cols, &mut rng)
    };
    let q = Q8Rows::quantize(&x, cols).unwrap();
    let rows: [usize; R] = std::array::from_fn(|r| (r + 1) % (R + 1));
    let tokens: [usize; T] = std::array::from_fn(|t| T - t);
    let got = tile::<R, T>(isa, &packed, rows, &q, tokens);
    for r in 0..R {
        for t in 0..T {
            let want = dot_scalar(&packed, rows[r], &q, tokens[t]);
            if unit {
                assert_eq!(
                    got[r][t], want,
                    "{isa:?} {ty} {R}x{T} exact integers, r{r} t{t}"
                );
            } else {
                let scale = 1e-5 * want.abs().max(1.0);
                assert!(
                    (got[r][t] - want).abs() <= scale,
                    "{isa:?} {ty} {R}x{T}: {} vs {want}",
                    got[r][t]
                );
            }
        }
    }
}

#[test]
fn every_supported_tile_matches_the_scalar_kernel() {
    for isa in supported_isas() {
        for (i, ty) in REPACKED.into_iter().enumerate() {
            for unit in [true, false] {
                let seed = 10 + i as u64;
                // 256 columns: an even number of blocks (the VNNI nibble kernel takes two
                // at a time); 224: seven blocks, the one-block-at-a-time kernel.
                let widths: &[usize] = match ty {
                    GgmlType::Q2K
                    | GgmlType::Q3K
                    | GgmlType::Q4K
                    | GgmlType::Q5K
                    | GgmlType::Q6K => &[256],
                    _ => &[256, 224],
                };
                for &cols in widths {
                    check_tiles::<4, 4>(isa, ty, unit, seed, cols);
                    check_tiles::<4, 1>(isa, ty, unit, seed, cols);
                    check_tiles::<1, 4>(isa, ty, unit, seed, cols);
                    check_tiles::<1, 1>(isa, ty, unit, seed, cols);
                    check_tiles::<2, 3>(isa, ty, unit, seed, cols);
                }
            }
        }
    }
}

#[test]
fn matmul_with_every_kernel_set_matches_the_reference() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let mut sets = vec![CpuKernels::F32, CpuKernels::Scalar];
    for set in [
        CpuKernels::Avx2,
        CpuKernels::Vnni,
        CpuKernels::Vnni8,
        CpuKernels::NeonDot,
        CpuKernels::Neon,
    ] {
        if set.is_supported() {
            sets.push(set);
        }
    }
    for ty in REPACKED {
        let (rows, cols) = (37, 256);
        let bytes = random_rows(ty, rows, cols, &mut rng, false);
        let weights = dequantized(ty, rows, cols, &bytes);
        for num_tokens in [1usize, 3, 6, 21] {
            let x = random_activations(num_tokens, cols, &mut rng);
            for &set in &sets {
                let weight = Weight::with_kernels(ty, rows, cols, bytes.clone(), set).unwrap();
                let quantized = set != CpuKernels::F32;
                assert_eq!(weight.int_isa().is_some(), quantized, "{set:?} {ty}");
                // The reference: f64 dots with the activations the kernel actually sees.
                let seen: Vec<f32> = if quantized {
                    let q = Q8Rows::quantize(&x, cols).unwrap();
                    let mut out = vec![0f32; x.len()];
                    for (t, row) in out.chunks_mut(cols).enumerate() {
                        q.dequantize_row(t, row);
                    }
                    out
                } else {
                    x.clone()
                };
                let mut y = vec![f32::NAN; num_tokens * rows];
                weight.matmul(&x, num_tokens, &mut y);
                let what = format!("{set:?} {ty} tokens {num_tokens}");
                common::assert_f64_dots(&what, &y, &weights, &seen, cols);
            }
        }
    }
}

#[test]
fn kernel_switch_parses_every_name() {
    for (name, want) in [
        ("vnni", CpuKernels::Vnni),
        ("vnni8", CpuKernels::Vnni8),
        ("AVX2", CpuKernels::Avx2),
        ("neon_dotprod", CpuKernels::NeonDot),
        ("Neon-DotProd", CpuKernels::NeonDot),
        ("neon", CpuKernels::Neon),
        ("scalar", CpuKernels::Scalar),
        ("f32", CpuKernels::F32),
    ] {
        assert_eq!(CpuKernels::parse(name), Ok(want));
    }
    assert_eq!(CpuKernels::parse("auto"), Ok(CpuKernels::best()));
    assert!(CpuKernels::parse("sse9")
        .unwrap_err()
        .to_string()
        .contains("sse9"));
    assert!(CpuKernels::best().is_supported());
}
