//! Dequantization against gguf-py's numpy implementation of ggml's formats.
//!
//! Fixtures (`tests/data/dequant/<TYPE>.blocks` + `<TYPE>.f32`) come from
//! `scripts/fixtures/gguf_fixtures.py`: random bytes for every block, f16 scales random but
//! finite (half of them arbitrary bit patterns including subnormals, half realistic). numpy
//! evaluates each formula in the same operation order as ggml, so the comparison is
//! bit-exact (no ulp tolerance needed).

use std::path::Path;

use pagoda_tensor::quant::{dequantize, dot_row};
use pagoda_tensor::GgmlType;

const SUPPORTED: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

fn fixture(ty: GgmlType) -> (Vec<u8>, Vec<f32>) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/dequant");
    let blocks = std::fs::read(dir.join(format!("{}.blocks", ty.name()))).unwrap();
    let values = std::fs::read(dir.join(format!("{}.f32", ty.name())))
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (blocks, values)
}

#[test]
fn bit_exact_with_numpy_for_every_supported_type() {
    for &ty in SUPPORTED {
        let (blocks, expected) = fixture(ty);
        assert_eq!(ty.bytes_for(expected.len()), Some(blocks.len()), "{ty}");
        let mut out = vec![f32::NAN; expected.len()];
        dequantize(ty, &blocks, &mut out).unwrap();
        for (index, (got, want)) in out.iter().zip(&expected).enumerate() {
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{ty} value {index}: got {got:e}, numpy {want:e}"
            );
        }
    }
}

#[test]
fn decoding_block_by_block_equals_decoding_the_whole_row() {
    for &ty in SUPPORTED {
        let (blocks, expected) = fixture(ty);
        let block_size = ty.block_size().unwrap();
        let type_size = ty.type_size().unwrap();
        for (index, block) in blocks.chunks_exact(type_size).enumerate() {
            let mut out = vec![0f32; block_size];
            dequantize(ty, block, &mut out).unwrap();
            assert_eq!(out, expected[index * block_size..][..block_size], "{ty}");
        }
    }
}

/// Deterministic pseudo-random `x` in [-1, 1).
fn test_vector(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

#[test]
fn dot_row_matches_f64_dot_of_numpy_values() {
    for &ty in SUPPORTED {
        let (blocks, expected) = fixture(ty);
        let x = test_vector(expected.len(), ty.id() as u64);
        let reference: f64 = expected
            .iter()
            .zip(&x)
            .map(|(&w, &v)| w as f64 * v as f64)
            .sum();
        let magnitude: f64 = expected
            .iter()
            .zip(&x)
            .map(|(&w, &v)| (w as f64 * v as f64).abs())
            .sum();
        let got = dot_row(ty, &blocks, &x) as f64;
        // Each product is exact-ish (1 rounding) and each of >= 8 lanes sums n / 8 terms:
        // error <= (n / 8 + 8) * eps * sum|terms|.
        let steps = (expected.len() / 8 + 8) as f64;
        let tolerance = magnitude * steps * f32::EPSILON as f64 + 1e-30;
        assert!(
            (got - reference).abs() <= tolerance,
            "{ty}: dot_row {got:e}, f64 reference {reference:e}, tolerance {tolerance:e}"
        );
        // Per-block tails for the plain types: odd lengths exercise the remainder loop.
        if !ty.is_quantized() {
            let n = expected.len() - 3;
            let bytes = ty.bytes_for(n).unwrap();
            let partial: f64 = expected[..n]
                .iter()
                .zip(&x)
                .map(|(&w, &v)| w as f64 * v as f64)
                .sum();
            let got = dot_row(ty, &blocks[..bytes], &x[..n]) as f64;
            assert!(
                (got - partial).abs() <= tolerance,
                "{ty} tail: {got:e} vs {partial:e}"
            );
        }
    }
}

#[test]
fn unsupported_types_are_reported_not_decoded() {
    for ty in [GgmlType::Q8_1, GgmlType::I32, GgmlType::Other(39)] {
        let mut out = vec![0f32; 32];
        let error = dequantize(ty, &[], &mut out).unwrap_err();
        assert_eq!(error.ty, ty);
        assert!(error.to_string().contains(&ty.name()), "{error}");
    }
}

#[test]
#[should_panic(expected = "Q4_K")]
fn length_mismatch_is_a_caller_bug() {
    let mut out = vec![0f32; 256];
    let _ = dequantize(GgmlType::Q4K, &[0u8; 100], &mut out);
}

/// Hand-built Q4_K block: checks the 6-bit scale unpacking against values computed by hand
/// from ggml's `get_scale_min_k4` description (independent of numpy).
#[test]
fn q4_k_packed_scales_by_hand() {
    let mut block = [0u8; 144];
    block[0..2].copy_from_slice(&half::f16::from_f32(1.0).to_bits().to_le_bytes()); // d
    block[2..4].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes()); // dmin
                                                                                    // Sub-block 1: scale = scales[1] & 63 = 5, min = scales[5] & 63 = 3.
    block[4 + 1] = 5;
    block[4 + 5] = 3;
    // Sub-block 6: scale = (scales[10] & 15) | (scales[2] >> 6) << 4 = 2 | 3 << 4 = 50;
    //              min   = (scales[10] >> 4) | (scales[6] >> 6) << 4 = 1 | 2 << 4 = 33.
    block[4 + 10] = 0x12;
    block[4 + 2] = 0b1100_0000;
    block[4 + 6] = 0b1000_0000;
    // Sub-block 2's scale is then scales[2] & 63 = 0 and min scales[6] & 63 = 0.
    // Every nibble = 7.
    for q in &mut block[16..] {
        *q = 0x77;
    }
    let mut out = [0f32; 256];
    dequantize(GgmlType::Q4K, &block, &mut out).unwrap();
    // Sub-block 1 is the high nibbles of chunk 0: values 32..64.
    assert_eq!(out[40], 5.0 * 7.0 - 0.5 * 3.0);
    // Sub-block 6 is the low nibbles of chunk 3: values 192..224.
    assert_eq!(out[200], 50.0 * 7.0 - 0.5 * 33.0);
    assert_eq!(out[64], 0.0);
}

/// The branch-free f16 conversion against the `half` crate for all 65536 bit patterns.
#[test]
fn f16_conversion_exhaustive() {
    for bits in 0..=u16::MAX {
        let got = pagoda_tensor::quant::blocks::f16_bits_to_f32(bits);
        let want = half::f16::from_bits(bits).to_f32();
        if want.is_nan() {
            assert!(got.is_nan(), "{bits:#06x}");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "{bits:#06x}");
        }
    }
}
