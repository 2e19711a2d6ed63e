//! The row-interleaved integer kernel (`linear::cpu::interleaved`) against the scalar kernel: every
//! (row, token) dot equal bit for bit to `dot_scalar`, for every repacked format, row counts
//! that leave a partial group, and token counts that leave partial tiles; and against the
//! f64 dots of ggml's dequantized weights, whose values the interleaved rows also decode to.
//! One-token matmuls run the decode width `PAGODA_CPU_INT_DECODE` selects and prefills the
//! width `PAGODA_CPU_INT_PREFILL` selects (run with `=avx512` and `=avx2` for both the
//! 16-row and the 8-row kernels; the default prefill is `avx512`).
//! Skipped on CPUs without AVX-512 VNNI. An ignored test times it against the VNNI tiles.

mod common;

use common::{assert_f64_dots, random_rows, REPACKED};

use pagoda_ops::linear::cpu::interleaved::planes::{self, HighBits};
use pagoda_ops::linear::cpu::interleaved::{self, Interleaved};
use pagoda_tensor::quant::q8::Q8Rows;
use pagoda_tensor::quant::repack::{dot_scalar, repack};
use pagoda_tensor::GgmlType;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn random_activations(rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    (0..rows * cols)
        .map(|_| rng.random_range(-2.0f32..2.0))
        .collect()
}

#[test]
fn interleaved_dots_equal_the_scalar_kernel_bit_for_bit() {
    if !interleaved::is_supported() {
        println!("AVX-512 VNNI not available on this CPU: skipped");
        return;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let mut cases = 0;
    for ty in REPACKED {
        let cols = 512;
        // 33, 40 and 64 rows give one-token decode tasks of whole pairs of groups (the 512-bit
        // kernel under `PAGODA_CPU_INT_DECODE=avx512`, the default on Intel) and a single
        // group.
        for rows in [1, 7, 8, 13, 33, 40, 64] {
            let bytes = random_rows(ty, rows, cols, &mut rng, false);
            let weights = repack(ty, rows, cols, &bytes).unwrap();
            let interleaved = Interleaved::new(&weights);
            let mut dequantized = vec![0f32; rows * cols];
            pagoda_tensor::quant::dequantize(ty, &bytes, &mut dequantized).unwrap();
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                interleaved.dequantize_row(r, &mut row);
                let want = &dequantized[r * cols..(r + 1) * cols];
                // Equal values (a zero's sign may differ, as for the repacked rows).
                assert!(
                    row.iter().zip(want).all(|(a, b)| a == b),
                    "{ty} row {r} decodes to other values"
                );
            }
            // Q8 and Q15 activation rows (`lo` plane, two dots per block).
            for (tokens, q15) in [1, 3, 4, 9]
                .into_iter()
                .flat_map(|t| [(t, false), (t, true)])
            {
                let x = random_activations(tokens, cols, &mut rng);
                let q = if q15 {
                    Q8Rows::quantize_q15(&x, cols).unwrap()
                } else {
                    Q8Rows::quantize(&x, cols).unwrap()
                };
                let mut y = vec![f32::NAN; rows * tokens];
                interleaved::matmul(&interleaved, &q, &mut y);
                let mut seen = vec![0f32; tokens * cols];
                for (t, values) in seen.chunks_exact_mut(cols).enumerate() {
                    q.dequantize_row(t, values);
                }
                assert_f64_dots(
                    &format!("{ty} {rows}x{tokens} q15 {q15}"),
                    &y,
                    &dequantized,
                    &seen,
                    cols,
                );
                for t in 0..tokens {
                    for r in 0..rows {
                        let scalar = dot_scalar(&weights, r, &q, t);
                        assert_eq!(
                            y[t * rows + r].to_bits(),
                            scalar.to_bits(),
                            "{ty} {rows} rows x {tokens} tokens, q15 {q15}: r{r} t{t}: {} vs {scalar}",
                            y[t * rows + r]
                        );
                    }
                }
                cases += 1;
            }
        }
    }
    println!("interleaved: {cases} cases bit-identical to dot_scalar");
    if interleaved::IntDecode::selected() == interleaved::IntDecode::Avx512 {
        assert!(
            interleaved::wide_decode_count() > 0,
            "the 512-bit decode did not run"
        );
    }
    if interleaved::IntPrefill::selected() == interleaved::IntPrefill::Avx512 {
        assert!(
            interleaved::wide_prefill_count() > 0,
            "the 512-bit prefill did not run"
        );
    }
}

/// Values of 5 and 6 bits (Q5_0, Q5_1, Q5_K: one plane; Q6_K: two) laid out as bit planes
/// decode and multiply to the bits of the byte layout, at one token (both decode widths run
/// through `PAGODA_CPU_INT_DECODE`) and many, Q8 and Q15; other formats have no planes.
#[test]
fn bit_planes_give_the_byte_layouts_bits() {
    if !interleaved::is_supported() {
        println!("AVX-512 VNNI not available on this CPU: skipped");
        return;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    let before = planes::plane_matmul_count();
    for ty in REPACKED {
        let cols = 512;
        let rows = 40;
        let bytes = random_rows(ty, rows, cols, &mut rng, false);
        let weights = repack(ty, rows, cols, &bytes).unwrap();
        let with_planes = Interleaved::with_high_bits(&weights, HighBits::Planes);
        let with_bytes = Interleaved::with_high_bits(&weights, HighBits::Bytes);
        let want = match ty {
            GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5K => 1,
            GgmlType::Q6K => 2,
            _ => 0,
        };
        assert_eq!(with_planes.planes(), want, "{ty}");
        assert_eq!(with_bytes.planes(), 0, "{ty}");
        if want > 0 {
            assert!(with_planes.size_bytes() < with_bytes.size_bytes(), "{ty}");
        }
        // Values of at most 4 bits are nibbles in either layout.
        assert_eq!(
            with_bytes.is_nibble(),
            ty != GgmlType::Q8_0 && want == 0,
            "{ty}"
        );
        let (mut a, mut b) = (vec![0f32; cols], vec![0f32; cols]);
        for r in 0..rows {
            with_planes.dequantize_row(r, &mut a);
            with_bytes.dequantize_row(r, &mut b);
            assert_eq!(a, b, "{ty} row {r}");
        }
        for (tokens, q15) in [(1, false), (1, true), (6, false), (6, true)] {
            let x = random_activations(tokens, cols, &mut rng);
            let q = if q15 {
                Q8Rows::quantize_q15(&x, cols).unwrap()
            } else {
                Q8Rows::quantize(&x, cols).unwrap()
            };
            let (mut ya, mut yb) = (vec![f32::NAN; rows * tokens], vec![0f32; rows * tokens]);
            interleaved::matmul(&with_planes, &q, &mut ya);
            interleaved::matmul(&with_bytes, &q, &mut yb);
            let same = ya.iter().zip(&yb).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{ty} {tokens} tokens q15 {q15}");
        }
    }
    assert!(
        planes::plane_matmul_count() > before,
        "no plane matmul counted"
    );
}
