//! `matmul_shared` (several weights, one input: q/k/v, gate/up) against separate
//! `Weight::matmul` calls, bit for bit, for every kernel set this CPU runs, for decode (one
//! token) and prefill (several), with weights of the same and of mixed storage kinds; and
//! against an f64 dot of the dequantized weights, so a kernel that is wrong the same way in
//! both calls still fails.

use pagoda_ops::linear::{matmul_shared, CpuKernels, Weight};
use pagoda_tensor::GgmlType;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn f16(value: f32) -> [u8; 2] {
    half::f16::from_f32(value).to_le_bytes()
}

/// Random stored rows of `ty` (Q4_1, Q8_0, Q4_K or F32) with sane scales.
fn random_rows(ty: GgmlType, rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
    let bytes =
        |n: usize, rng: &mut ChaCha8Rng| (0..n).map(|_| rng.random::<u8>()).collect::<Vec<u8>>();
    let scale = |rng: &mut ChaCha8Rng| f16(rng.random_range(0.001f32..0.05));
    let signed_scale = |rng: &mut ChaCha8Rng| f16(rng.random_range(-0.05f32..0.05));
    let mut out = Vec::new();
    match ty {
        GgmlType::F32 => {
            for _ in 0..rows * cols {
                out.extend(rng.random_range(-1.0f32..1.0).to_le_bytes());
            }
        }
        GgmlType::Q4_1 => {
            for _ in 0..rows * cols / 32 {
                out.extend(scale(rng));
                out.extend(signed_scale(rng));
                out.extend(bytes(16, rng));
            }
        }
        GgmlType::Q8_0 => {
            for _ in 0..rows * cols / 32 {
                out.extend(signed_scale(rng));
                out.extend(bytes(32, rng));
            }
        }
        GgmlType::Q4K => {
            for _ in 0..rows * cols / 256 {
                out.extend(scale(rng));
                out.extend(scale(rng));
                out.extend(bytes(140, rng));
            }
        }
        _ => unreachable!("{ty}"),
    }
    out
}

fn kernel_sets() -> Vec<CpuKernels> {
    [
        CpuKernels::F32,
        CpuKernels::Vnni8,
        CpuKernels::Vnni,
        CpuKernels::Avx2,
        CpuKernels::NeonDot,
        CpuKernels::Neon,
        CpuKernels::Scalar,
    ]
    .into_iter()
    .filter(|kernels| kernels.is_supported())
    .collect()
}

/// `types[i]` with `rows[i]` rows, all `cols` wide: shared vs separate, and vs f64.
fn check(kernels: CpuKernels, types: &[GgmlType], rows: &[usize], cols: usize, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let weights: Vec<Weight> = types
        .iter()
        .zip(rows)
        .map(|(&ty, &n)| {
            let data = random_rows(ty, n, cols, &mut rng);
            Weight::with_kernels(ty, n, cols, data, kernels).unwrap()
        })
        .collect();
    for num_tokens in [1, 2, 5, 9] {
        let x: Vec<f32> = (0..num_tokens * cols)
            .map(|_| rng.random_range(-2.0f32..2.0))
            .collect();
        let separate: Vec<Vec<f32>> = weights
            .iter()
            .map(|w| {
                let mut y = vec![0f32; num_tokens * w.out_features()];
                w.matmul(&x, num_tokens, &mut y);
                y
            })
            .collect();
        let mut shared: Vec<Vec<f32>> = weights
            .iter()
            .map(|w| vec![f32::NAN; num_tokens * w.out_features()])
            .collect();
        let mut outputs: Vec<(&Weight, &mut [f32])> = weights
            .iter()
            .zip(shared.iter_mut())
            .map(|(w, y)| (w, y.as_mut_slice()))
            .collect();
        matmul_shared(&x, num_tokens, &mut outputs);
        let context = format!("{kernels:?} {types:?} rows {rows:?} tokens {num_tokens}");
        for (i, (a, b)) in shared.iter().zip(&separate).enumerate() {
            let differing = a
                .iter()
                .zip(b)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(
                differing, 0,
                "{context}: weight {i} differs in {differing} values"
            );
        }
        for (weight, y) in weights.iter().zip(&shared) {
            let n = weight.out_features();
            let mut w = vec![0f32; cols];
            for row in 0..n {
                weight.dequantize_row(row, &mut w);
                for t in 0..num_tokens {
                    let xt = &x[t * cols..(t + 1) * cols];
                    let exact: f64 = w.iter().zip(xt).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let scale: f64 = w
                        .iter()
                        .zip(xt)
                        .map(|(a, b)| (*a as f64 * *b as f64).abs())
                        .sum();
                    // Q8 activations: each value is off by at most half a step (1/254 of
                    // its block's max), so the dot is off by at most ~1% of sum |w x|.
                    let got = y[t * n + row] as f64;
                    assert!(
                        (got - exact).abs() <= 0.02 * scale.max(1e-6),
                        "{context}: row {row} token {t}: {got} vs f64 {exact}"
                    );
                }
            }
        }
    }
}

#[test]
fn shared_input_matches_separate_matmuls_bit_for_bit() {
    for kernels in kernel_sets() {
        // q/k/v-like: one big, two small, row counts that are not multiples of 4.
        check(
            kernels,
            &[GgmlType::Q4_1, GgmlType::Q4_1, GgmlType::Q4_1],
            &[70, 18, 18],
            128,
            1,
        );
        // The odd block count takes the one-block nibble path; Q8_0 the byte path.
        check(kernels, &[GgmlType::Q8_0, GgmlType::Q4_1], &[37, 5], 96, 2);
        // f32 factors (K-quants) and a weight without a repacked form (F32) in one call.
        check(kernels, &[GgmlType::Q4K, GgmlType::Q4K], &[9, 33], 256, 3);
        check(kernels, &[GgmlType::Q4_1, GgmlType::F32], &[12, 7], 64, 4);
    }
}

#[test]
fn shared_input_with_no_weights_or_tokens_is_a_no_op() {
    matmul_shared(&[], 0, &mut []);
    let weight = Weight::from_f32(2, 32, &[0.5; 64]);
    let mut y: [f32; 0] = [];
    matmul_shared(&[], 0, &mut [(&weight, &mut y)]);
}
