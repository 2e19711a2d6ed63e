//! The aarch64 integer kernels (`neon_dotprod`: `SDOT`; `neon`: `SMULL` + `SADALP`) against
//! the scalar oracle `dot_scalar`, bit for bit: every tile shape the matmuls use and a few
//! others, for every repacked format, on random weights, scales and activations with random
//! row lengths (odd block counts included); then `Weight::matmul` with each NEON set, decode
//! and prefill, with row and token counts that leave partial tiles, against `dot_scalar` on
//! the same Q8 rows, and the set's counter.
//!
//! The `neon_dotprod` set runs its even tiles without sub-scales (`2 x 2` to `4 x 4`, the
//! prefill tiles) on `SMMLA` where the CPU has i8mm, the rest on `SDOT`.
//!
//! On a CPU without NEON (x86) nothing runs and the test says so. Under qemu, `-cpu max`
//! runs both sets (and SMMLA), `-cpu neoverse-n1` the `SDOT` tiles without i8mm and
//! `-cpu cortex-a53` (no dotprod) the plain set.
//! `PAGODA_TEST_EXPECT_INT_ISAS=NeonDot,Neon` (or `Neon`) makes the test fail unless exactly
//! those sets ran, so a CI step cannot pass by skipping.

mod common;

use common::{random_activations, random_rows, REPACKED};

use pagoda_ops::linear::cpu::int_dot::{neon_matmul_count, tile, IntIsa};
use pagoda_ops::linear::{CpuKernels, Weight};
use pagoda_tensor::quant::q8::Q8Rows;
use pagoda_tensor::quant::repack::{dot_scalar, repack, RepackedRows};
use pagoda_tensor::GgmlType;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The NEON sets this CPU runs, checked against `PAGODA_TEST_EXPECT_INT_ISAS` when set.
fn neon_sets() -> Vec<(IntIsa, CpuKernels)> {
    let sets: Vec<(IntIsa, CpuKernels)> = [
        (IntIsa::NeonDot, CpuKernels::NeonDot),
        (IntIsa::Neon, CpuKernels::Neon),
    ]
    .into_iter()
    .filter(|(isa, _)| isa.is_supported())
    .collect();
    let names: Vec<String> = sets.iter().map(|(isa, _)| format!("{isa:?}")).collect();
    #[cfg(target_arch = "aarch64")]
    let i8mm = std::arch::is_aarch64_feature_detected!("i8mm");
    #[cfg(not(target_arch = "aarch64"))]
    let i8mm = false;
    println!("NEON integer kernels tested on this CPU: {names:?} (i8mm: {i8mm})");
    if let Ok(expected) = std::env::var("PAGODA_TEST_EXPECT_INT_ISAS") {
        let expected: Vec<&str> = expected.split(',').map(str::trim).collect();
        assert_eq!(names, expected, "PAGODA_TEST_EXPECT_INT_ISAS");
    }
    #[cfg(target_arch = "aarch64")]
    assert!(
        IntIsa::Neon.is_supported(),
        "every aarch64 Linux CPU has NEON"
    );
    sets
}

/// A random row length for `ty`: whole super-blocks (256) for the K-quants, whole blocks for
/// the rest, 1 to 11 of them (odd counts included).
fn random_cols(ty: GgmlType, rng: &mut ChaCha8Rng) -> usize {
    let unit = match ty {
        GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => 256,
        _ => 32,
    };
    unit * rng.random_range(1..=11usize.min(2048 / unit))
}

fn assert_same_bits(got: f32, want: f32, what: &str) {
    assert!(
        got.to_bits() == want.to_bits(),
        "{what}: {got} ({:#010x}) != dot_scalar {want} ({:#010x})",
        got.to_bits(),
        want.to_bits()
    );
}

fn check_tile<const R: usize, const T: usize>(
    isa: IntIsa,
    ty: GgmlType,
    packed: &RepackedRows,
    q: &Q8Rows,
    rng: &mut ChaCha8Rng,
) {
    let rows: [usize; R] = std::array::from_fn(|_| rng.random_range(0..packed.num_rows()));
    let tokens: [usize; T] = std::array::from_fn(|_| rng.random_range(0..q.num_rows()));
    let got = tile::<R, T>(isa, packed, rows, q, tokens);
    for r in 0..R {
        for t in 0..T {
            let want = dot_scalar(packed, rows[r], q, tokens[t]);
            let what = format!(
                "{isa:?} {ty} {R}x{T} row {} token {} cols {}",
                rows[r],
                tokens[t],
                q.blocks_per_row() * 32
            );
            assert_same_bits(got[r][t], want, &what);
        }
    }
}

#[test]
fn neon_tiles_equal_the_scalar_kernel_bit_for_bit() {
    let sets = neon_sets();
    let mut rng = ChaCha8Rng::seed_from_u64(48);
    let mut cases = 0;
    for &(isa, _) in &sets {
        for ty in REPACKED {
            for unit in [false, true] {
                let cols = random_cols(ty, &mut rng);
                let num_rows = rng.random_range(1..=9);
                let bytes = random_rows(ty, num_rows, cols, &mut rng, unit);
                let packed = repack(ty, num_rows, cols, &bytes).unwrap();
                let x = random_activations(5, cols, &mut rng);
                let q = Q8Rows::quantize(&x, cols).unwrap();
                for _ in 0..3 {
                    check_tile::<4, 4>(isa, ty, &packed, &q, &mut rng);
                    check_tile::<4, 1>(isa, ty, &packed, &q, &mut rng);
                    check_tile::<1, 4>(isa, ty, &packed, &q, &mut rng);
                    check_tile::<1, 1>(isa, ty, &packed, &q, &mut rng);
                    check_tile::<2, 3>(isa, ty, &packed, &q, &mut rng);
                    check_tile::<3, 2>(isa, ty, &packed, &q, &mut rng);
                    check_tile::<2, 2>(isa, ty, &packed, &q, &mut rng);
                    check_tile::<4, 2>(isa, ty, &packed, &q, &mut rng);
                    check_tile::<2, 4>(isa, ty, &packed, &q, &mut rng);
                    cases += 9;
                }
            }
        }
    }
    println!("{cases} tiles equal to dot_scalar bit for bit");
}

#[test]
fn neon_matmuls_equal_the_scalar_kernel_bit_for_bit() {
    let sets = neon_sets();
    let mut rng = ChaCha8Rng::seed_from_u64(4848);
    for &(isa, kernels) in &sets {
        for ty in REPACKED {
            let cols = random_cols(ty, &mut rng);
            // Row counts that leave a partial four-row tile; token counts for decode and for
            // prefills with partial four-token tiles.
            let num_rows = 4 * rng.random_range(1..6) + rng.random_range(1..4);
            let bytes = random_rows(ty, num_rows, cols, &mut rng, false);
            let packed = repack(ty, num_rows, cols, &bytes).unwrap();
            let weight = Weight::with_kernels(ty, num_rows, cols, bytes, kernels).unwrap();
            assert_eq!(weight.int_isa(), Some(isa), "{kernels:?} {ty}");
            for num_tokens in [1, 2, 5, 9] {
                let x = random_activations(num_tokens, cols, &mut rng);
                let q = Q8Rows::quantize(&x, cols).unwrap();
                let mut y = vec![f32::NAN; num_tokens * num_rows];
                let before = neon_matmul_count();
                weight.matmul(&x, num_tokens, &mut y);
                assert!(neon_matmul_count() > before, "{kernels:?}: not counted");
                for t in 0..num_tokens {
                    for r in 0..num_rows {
                        let what =
                            format!("{kernels:?} {ty} {num_rows}x{cols} t{t}/{num_tokens} r{r}");
                        assert_same_bits(y[t * num_rows + r], dot_scalar(&packed, r, &q, t), &what);
                    }
                }
            }
        }
    }
}

/// 32-value blocks that stress the quantizer's rounding and range: exact ties at every
/// half step (`amax` 127 or 16256 with `.5` values), zeros, one value, huge and tiny
/// magnitudes, infinities and NaN, then random blocks of wide range.
fn quantizer_blocks(rng: &mut ChaCha8Rng) -> Vec<f32> {
    let mut x = Vec::new();
    for limit in [127.0f32, 16256.0] {
        let ties: Vec<f32> = (0..32).map(|i| i as f32 - 15.5).collect();
        x.extend(&ties);
        x.extend(std::iter::once(limit).chain(ties[1..].iter().copied()));
        x.extend(std::iter::once(-limit).chain(ties[1..].iter().map(|v| v * 3.0)));
    }
    x.extend([0.0f32; 32]);
    x.extend([-0.0f32; 32]);
    x.extend(std::iter::once(1.0).chain([0.0; 31]));
    x.extend((0..32).map(|i| {
        if i % 2 == 0 {
            3e38
        } else {
            -1e38 * i as f32 / 32.0
        }
    }));
    x.extend((0..32).map(|i| (i as f32 - 16.0) * 1e-42));
    x.extend((0..32).map(|i| match i {
        3 => f32::INFINITY,
        7 => f32::NEG_INFINITY,
        _ => i as f32,
    }));
    x.extend((0..32).map(|i| if i == 5 { f32::NAN } else { i as f32 - 9.25 }));
    x.extend([f32::NAN; 32]);
    for _ in 0..200 {
        let scale = 10f32.powi(rng.random_range(-6..7));
        x.extend((0..32).map(|_| rng.random_range(-1.0f32..1.0) * scale));
    }
    x
}

/// The NEON activation quantizer (Q8 for the NEON sets, Q15 in the same code) against the
/// scalar `quantize_block`: the same bytes, scales and sums, bit for bit, on one row and on
/// many rows (the parallel split).
#[test]
fn neon_activation_quantizer_equals_the_scalar_one_bit_for_bit() {
    use pagoda_ops::linear::cpu::int_matmul::{quantize_activations, quantize_activations_q15};
    let sets = neon_sets();
    let mut rng = ChaCha8Rng::seed_from_u64(4835);
    let blocks = quantizer_blocks(&mut rng);
    for &(isa, _) in &sets {
        for (cols, num_tokens) in [(blocks.len(), 1), (64, blocks.len() / 64)] {
            let x = &blocks[..cols * num_tokens];
            for q15 in [false, true] {
                let mut got = Q8Rows::default();
                let want = if q15 {
                    quantize_activations_q15(isa, x, cols, &mut got);
                    Q8Rows::quantize_q15(x, cols).unwrap()
                } else {
                    quantize_activations(isa, x, cols, &mut got);
                    Q8Rows::quantize(x, cols).unwrap()
                };
                let what = format!("{isa:?} q15 {q15} {num_tokens} rows of {cols}");
                assert_eq!(got.qs(), want.qs(), "{what}: values");
                assert_eq!(got.lo(), want.lo(), "{what}: lo plane");
                for t in 0..num_tokens {
                    let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(got.row_scales(t)), bits(want.row_scales(t)), "{what}");
                    assert_eq!(bits(got.row_sums(t)), bits(want.row_sums(t)), "{what}");
                }
            }
        }
    }
}
