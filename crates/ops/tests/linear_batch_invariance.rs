//! Batch invariance of `Weight::matmul`: row `t` of a matmul over `num_tokens` rows is
//! bit-identical to the matmul of that activation row alone, whatever the row count and
//! whatever the other rows hold, for every weight type and every kernel set this CPU runs.
//! The oracle is the one-row call (the decode kernels) against the many-row calls (the
//! prefill tiles); an f64 dot of the dequantized weights checks the one-row result itself,
//! so a kernel returning the same wrong value everywhere still fails.

use pagoda_ops::linear::{CpuKernels, Weight};
use pagoda_tensor::{quant, GgmlType};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Up to the AMX tiles' thresholds and past them (`amx::bf16::MIN_TOKENS`, `AMX_MIN_TOKENS`).
const TOKEN_COUNTS: [usize; 12] = [1, 2, 3, 4, 5, 7, 8, 16, 17, 33, 64, 65];

/// Distinct activation rows the batches draw from.
const POOL: usize = 33;

fn f16(value: f32) -> [u8; 2] {
    half::f16::from_f32(value).to_le_bytes()
}

/// Random stored rows of `ty` with sane scales (random f16 bits would give NaN and inf).
fn random_rows(ty: GgmlType, rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
    let values = |n: usize, rng: &mut ChaCha8Rng| -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    };
    let bytes =
        |n: usize, rng: &mut ChaCha8Rng| (0..n).map(|_| rng.random::<u8>()).collect::<Vec<u8>>();
    let scale = |rng: &mut ChaCha8Rng| f16(rng.random_range(0.001f32..0.05));
    let signed_scale = |rng: &mut ChaCha8Rng| f16(rng.random_range(-0.05f32..0.05));
    match ty {
        GgmlType::F32 => values(rows * cols, rng)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        GgmlType::F16 => values(rows * cols, rng)
            .iter()
            .flat_map(|&v| f16(v))
            .collect(),
        GgmlType::BF16 => values(rows * cols, rng)
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        _ => {
            let block = ty.block_size().unwrap();
            let mut out = Vec::new();
            for _ in 0..rows * cols / block {
                match ty {
                    GgmlType::Q4_0 => {
                        out.extend(signed_scale(rng));
                        out.extend(bytes(16, rng));
                    }
                    GgmlType::Q4_1 => {
                        out.extend(scale(rng));
                        out.extend(signed_scale(rng));
                        out.extend(bytes(16, rng));
                    }
                    GgmlType::Q8_0 => {
                        out.extend(signed_scale(rng));
                        out.extend(bytes(32, rng));
                    }
                    GgmlType::Q5_0 => {
                        out.extend(signed_scale(rng));
                        out.extend(bytes(20, rng));
                    }
                    GgmlType::Q5_1 => {
                        out.extend(scale(rng));
                        out.extend(signed_scale(rng));
                        out.extend(bytes(20, rng));
                    }
                    GgmlType::Q4K | GgmlType::Q5K => {
                        out.extend(scale(rng));
                        out.extend(scale(rng));
                        let rest = if ty == GgmlType::Q4K { 140 } else { 172 };
                        out.extend(bytes(rest, rng));
                    }
                    GgmlType::Q6K => {
                        out.extend(bytes(208, rng));
                        out.extend(scale(rng));
                    }
                    GgmlType::Q3K => {
                        out.extend(bytes(108, rng));
                        out.extend(signed_scale(rng));
                    }
                    GgmlType::Q2K => {
                        out.extend(bytes(80, rng));
                        out.extend(scale(rng));
                        out.extend(scale(rng));
                    }
                    _ => unreachable!("{ty}"),
                }
            }
            out
        }
    }
}

/// Kernel sets this CPU runs.
fn kernel_sets() -> Vec<CpuKernels> {
    let sets: Vec<CpuKernels> = [
        CpuKernels::F32,
        CpuKernels::Amx,
        CpuKernels::Vnni8,
        CpuKernels::Vnni,
        CpuKernels::Avx2,
        CpuKernels::NeonDot,
        CpuKernels::Neon,
        CpuKernels::Scalar,
    ]
    .into_iter()
    .filter(|kernels| kernels.is_supported())
    // With PAGODA_CPU_AMX_PREFILL=bf16 the `amx` set's prefills are not invariant (opt-in).
    .filter(|&kernels| {
        kernels != CpuKernels::Amx
            || pagoda_ops::linear::cpu::amx::bf16::AmxPrefill::selected()
                != pagoda_ops::linear::cpu::amx::bf16::AmxPrefill::Bf16
    })
    .collect();
    println!("kernel sets tested on this CPU: {sets:?}");
    sets
}

/// Checks one weight: every row of every batch against the one-row results, and the one-row
/// results against the f64 reference within `tolerance` of `sum |w x|`.
fn check(weight: &Weight, reference_rows: &[f32], pool: &[f32], tolerance: f64, context: &str) {
    let (n, k) = (weight.out_features(), weight.in_features());
    let single: Vec<Vec<f32>> = pool
        .chunks(k)
        .map(|x| {
            let mut y = vec![0f32; n];
            weight.matmul(x, 1, &mut y);
            y
        })
        .collect();
    for (token, (x, y)) in pool.chunks(k).zip(&single).enumerate() {
        for (row, (&got, w)) in y.iter().zip(reference_rows.chunks(k)).enumerate() {
            let exact: f64 = w.iter().zip(x).map(|(a, b)| *a as f64 * *b as f64).sum();
            let scale: f64 = w
                .iter()
                .zip(x)
                .map(|(a, b)| (*a as f64 * *b as f64).abs())
                .sum();
            assert!(
                (got as f64 - exact).abs() <= tolerance * scale.max(1e-6),
                "{context}: token {token} row {row}: {got} vs f64 {exact}"
            );
        }
    }
    for num_tokens in TOKEN_COUNTS {
        // Position p of the batch holds pool row (7 p + num_tokens) mod POOL, so a row meets
        // different neighbours and positions from one batch size to the next.
        let members: Vec<usize> = (0..num_tokens)
            .map(|p| (7 * p + num_tokens) % POOL)
            .collect();
        let x: Vec<f32> = members
            .iter()
            .flat_map(|&m| pool[m * k..(m + 1) * k].iter().copied())
            .collect();
        let mut y = vec![0f32; num_tokens * n];
        weight.matmul(&x, num_tokens, &mut y);
        for (position, (got, &member)) in y.chunks(n).zip(&members).enumerate() {
            let differing = got
                .iter()
                .zip(&single[member])
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(
                differing, 0,
                "{context}: position {position} of a {num_tokens}-row matmul differs from the \
                 1-row matmul in {differing} of {n} outputs"
            );
        }
    }
}

#[test]
fn matmul_rows_are_bit_identical_whatever_the_batch() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let cases = [
        // (type, columns): odd block counts, partial decode chunks, a k % 8 tail.
        (GgmlType::F32, 301),
        (GgmlType::F32, 576),
        (GgmlType::F16, 301),
        (GgmlType::BF16, 264),
        (GgmlType::Q4_0, 544),
        (GgmlType::Q4_1, 576),
        (GgmlType::Q4_1, 544),
        (GgmlType::Q8_0, 544),
        (GgmlType::Q5_0, 544),
        (GgmlType::Q5_1, 576),
        (GgmlType::Q4K, 768),
        (GgmlType::Q5K, 512),
        (GgmlType::Q6K, 512),
        (GgmlType::Q3K, 512),
        (GgmlType::Q2K, 512),
    ];
    let rows = 37;
    let wide_before = pagoda_ops::linear::cpu::f32_decode::wide_matmul_count();
    let pairs_before = pagoda_ops::linear::cpu::f32_tile::pair_matmul_count();
    for kernels in kernel_sets() {
        for (ty, cols) in cases {
            let bytes = random_rows(ty, rows, cols, &mut rng);
            let mut reference = vec![0f32; rows * cols];
            quant::dequantize(ty, &bytes, &mut reference).unwrap();
            let weight = Weight::with_kernels(ty, rows, cols, bytes, kernels).unwrap();
            let pool: Vec<f32> = (0..POOL * cols)
                .map(|_| rng.random_range(-2.0f32..2.0))
                .collect();
            // Q8 activations round each value to 1/254 of its block's range.
            let tolerance = if weight.int_isa().is_some() {
                2e-2
            } else {
                1e-5
            };
            let context = format!("{kernels:?} {ty} [{rows}, {cols}]");
            check(&weight, &reference, &pool, tolerance, &context);
        }
    }
    // Unless PAGODA_CPU_F32_DECODE=tile (or the CPU lacks AVX2), the f32 matmuls of 1-8 tokens
    // of the Q4_0, Q4_1, Q8_0 and K-quant cases ran eight rows at a time, so the checks above
    // compared that kernel with the prefill tiles. CI runs the default (`avx512` or `avx2`);
    // `PAGODA_CPU_F32_DECODE=avx2 cargo test ...` covers the other.
    use pagoda_ops::linear::cpu::f32_decode::F32Decode;
    let wide = pagoda_ops::linear::cpu::f32_decode::wide_matmul_count() - wide_before;
    println!(
        "f32 matmuls of 1-8 tokens on {}: {wide} eight rows at a time",
        F32Decode::selected().name()
    );
    assert_eq!(wide > 0, F32Decode::selected() != F32Decode::Tile);
    // With `avx512`, the f32 prefills ran two tokens per 512-bit register (`tile_pairs`), so
    // the checks above also compared that form with the one-token kernels.
    let pairs = pagoda_ops::linear::cpu::f32_tile::pair_matmul_count() - pairs_before;
    assert_eq!(
        pairs > 0,
        F32Decode::selected() == F32Decode::Avx512
            && pagoda_ops::linear::cpu::f32_tile::pairs_supported()
    );
}

#[test]
fn dot_row_equals_the_matmul_row_with_f32_activations() {
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    for (ty, cols) in [
        (GgmlType::F32, 301),
        (GgmlType::Q4_1, 544),
        (GgmlType::Q6K, 512),
    ] {
        let rows = 9;
        let bytes = random_rows(ty, rows, cols, &mut rng);
        let weight = Weight::with_kernels(ty, rows, cols, bytes, CpuKernels::F32).unwrap();
        let x: Vec<f32> = (0..3 * cols)
            .map(|_| rng.random_range(-2.0f32..2.0))
            .collect();
        let mut y = vec![0f32; 3 * rows];
        weight.matmul(&x, 3, &mut y);
        for (t, xt) in x.chunks(cols).enumerate() {
            for row in 0..rows {
                let got = weight.dot_row(row, xt);
                assert_eq!(got.to_bits(), y[t * rows + row].to_bits(), "{ty} row {row}");
            }
        }
    }
}

/// Re-runs this file's other tests under every CPU kernel configuration this machine can
/// run (the `amx` set on emulated tiles where it lacks them) and prints which ran.
#[test]
fn under_every_cpu_configuration() {
    pagoda_testkit::rerun_under_every_cpu_configuration("under_every_cpu_configuration");
}
