//! The f32 tiles (`f32_tile::tile` and `quantized_tile`, the f32 matmuls of every weight that
//! keeps f32 activations: `ffn_down` under `auto` on the NEON sets, f32 and f16 models)
//! against the fused scalar oracle [`fused_dot`], bit for bit: the recipe of
//! `f32_tile`'s module docs with `f32::mul_add` per lane. On aarch64 the tiles run NEON
//! (`FMLA`), on x86-64 AVX2+FMA; both must give the oracle's bits, so an aarch64 build and
//! an x86 one agree on every f32 matmul. A CPU without either (x86 without AVX2) runs the
//! portable multiply-then-add and the test says so; on aarch64 it must find NEON.
//!
//! Then `Weight::matmul` with the `f32` set (decode, small batches and prefills, with row and
//! token counts that leave partial tiles), which must give the oracle's bits through every
//! path that this CPU's f32 kernels take, and counts in `neon_matmul_count` on aarch64.

mod common;

use common::{random_activations, random_rows};

use pagoda_ops::linear::cpu::f32_tile::{fused, neon_matmul_count, quantized_tile, tile};
use pagoda_ops::linear::{CpuKernels, Weight};
use pagoda_tensor::{quant, GgmlType};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The recipe with fused multiply-adds: eight lanes over `k / 8 * 8` values in order, the
/// lanes reduced as `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`, the tail added as
/// `sum + w * x`.
fn fused_dot(w: &[f32], x: &[f32]) -> f32 {
    let full = w.len() / 8 * 8;
    let mut l = [0f32; 8];
    for i in (0..full).step_by(8) {
        for lane in 0..8 {
            l[lane] = w[i + lane].mul_add(x[i + lane], l[lane]);
        }
    }
    let mut sum = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
    for (w, x) in w[full..].iter().zip(&x[full..]) {
        sum += w * x;
    }
    sum
}

/// Whether this CPU runs the fused tiles; fails on aarch64 without them.
fn fused_here() -> bool {
    let fused = fused();
    println!("f32 tiles fused on this CPU: {fused}");
    #[cfg(target_arch = "aarch64")]
    assert!(fused, "every aarch64 Linux CPU has NEON");
    fused
}

fn assert_bits(got: f32, want: f32, what: &str) {
    assert!(
        got.to_bits() == want.to_bits(),
        "{what}: {got} ({:#010x}) != fused oracle {want} ({:#010x})",
        got.to_bits(),
        want.to_bits()
    );
}

/// Values with full mantissas and a wide range, so any change of order or rounding shows.
fn noisy(k: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    (0..k)
        .map(|i| {
            let v: f32 = rng.random_range(-2.0..2.0);
            if i % 13 == 0 {
                v * 1e3
            } else {
                v
            }
        })
        .collect()
}

fn check_tile<const R: usize, const T: usize>(k: usize, rng: &mut ChaCha8Rng) {
    let w: Vec<Vec<f32>> = (0..R).map(|_| noisy(k, rng)).collect();
    let x: Vec<Vec<f32>> = (0..T).map(|_| noisy(k, rng)).collect();
    let got = tile::<R, T>(
        std::array::from_fn(|r| &w[r][..]),
        std::array::from_fn(|t| &x[t][..]),
    );
    for r in 0..R {
        for t in 0..T {
            assert_bits(
                got[r][t],
                fused_dot(&w[r], &x[t]),
                &format!("{R}x{T} k={k}"),
            );
        }
    }
}

#[test]
fn f32_tiles_equal_the_fused_oracle_bit_for_bit() {
    if !fused_here() {
        return;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(4832);
    for k in [0usize, 1, 7, 8, 9, 64, 100, 301, 1027] {
        check_tile::<1, 1>(k, &mut rng);
        check_tile::<2, 1>(k, &mut rng);
        check_tile::<1, 4>(k, &mut rng);
        check_tile::<2, 4>(k, &mut rng);
        check_tile::<3, 2>(k, &mut rng);
    }
}

/// Stored rows of `ty` (`rows x cols`): random blocks, or for F16/BF16 noisy values.
fn stored_rows(ty: GgmlType, rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
    match ty {
        GgmlType::F16 => noisy(rows * cols, rng)
            .iter()
            .flat_map(|v| half::f16::from_f32(*v * 0.01).to_le_bytes())
            .collect(),
        GgmlType::BF16 => noisy(rows * cols, rng)
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
        _ => random_rows(ty, rows, cols, rng, false),
    }
}

const TYPES: [GgmlType; 10] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::F16,
    GgmlType::BF16,
];

/// A row length for `ty`: whole blocks, 1 to 5 super-blocks' worth (F16/BF16: any, with a
/// tail of `k % 8` values).
fn cols_for(ty: GgmlType, rng: &mut ChaCha8Rng) -> usize {
    match ty {
        GgmlType::F16 | GgmlType::BF16 => rng.random_range(1..700),
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => 256 * rng.random_range(1..=5),
        _ => 32 * rng.random_range(1..=24),
    }
}

#[test]
fn quantized_tiles_equal_the_fused_oracle_on_the_decoded_rows() {
    if !fused_here() {
        return;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(4833);
    for ty in TYPES {
        for _ in 0..3 {
            let cols = cols_for(ty, &mut rng);
            let bytes = stored_rows(ty, 2, cols, &mut rng);
            let row_bytes = bytes.len() / 2;
            let rows = [&bytes[..row_bytes], &bytes[row_bytes..]];
            let x = noisy(cols, &mut rng);
            let two = quantized_tile(ty, rows, &x);
            for (r, row) in rows.iter().enumerate() {
                let mut decoded = vec![0f32; cols];
                quant::dequantize(ty, row, &mut decoded).unwrap();
                let want = fused_dot(&decoded, &x);
                assert_bits(two[r], want, &format!("{ty} 2 rows k={cols} row {r}"));
                let one = quantized_tile(ty, [*row], &x)[0];
                assert_bits(one, want, &format!("{ty} 1 row k={cols} row {r}"));
            }
        }
    }
}

#[test]
fn f32_matmuls_equal_the_fused_oracle_bit_for_bit() {
    if !fused_here() {
        return;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(4834);
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q6K, GgmlType::F16] {
        let cols = match ty {
            GgmlType::Q6K => 512,
            GgmlType::F16 => 200,
            _ => 96,
        };
        let num_rows = 2 * rng.random_range(4..12) + 1;
        let bytes = stored_rows(ty, num_rows, cols, &mut rng);
        let mut decoded = vec![0f32; num_rows * cols];
        quant::dequantize(ty, &bytes, &mut decoded).unwrap();
        let weight = Weight::with_kernels(ty, num_rows, cols, bytes, CpuKernels::F32).unwrap();
        assert_eq!(weight.int_isa(), None, "{ty}: f32 activations");
        for num_tokens in [1, 3, 9, 14] {
            let x = random_activations(num_tokens, cols, &mut rng);
            let mut y = vec![f32::NAN; num_tokens * num_rows];
            let before = neon_matmul_count();
            weight.matmul(&x, num_tokens, &mut y);
            let counted = neon_matmul_count() > before;
            assert_eq!(
                counted,
                cfg!(target_arch = "aarch64"),
                "{ty}: NEON f32 counter"
            );
            for t in 0..num_tokens {
                for r in 0..num_rows {
                    let want = fused_dot(
                        &decoded[r * cols..(r + 1) * cols],
                        &x[t * cols..(t + 1) * cols],
                    );
                    let what = format!("{ty} {num_rows}x{cols} t{t}/{num_tokens} r{r}");
                    assert_bits(y[t * num_rows + r], want, &what);
                }
            }
        }
    }
}
