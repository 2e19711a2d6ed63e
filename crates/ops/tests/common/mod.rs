//! Inputs and oracles shared by the linear-kernel tests.

use pagoda_tensor::GgmlType;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// Activations with a wide range, so Q8 values reach +-127 and many blocks differ in scale.
#[allow(dead_code)]
pub fn random_activations(num_tokens: usize, cols: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    (0..num_tokens * cols)
        .map(|i| {
            let v: f32 = rng.random_range(-2.0..2.0);
            if i % 37 == 0 {
                v * 40.0
            } else {
                v
            }
        })
        .collect()
}

/// The f64 dots of `weights` (`[rows, cols]`, dequantized) with `activations`
/// (`[num_tokens, cols]`), `[num_tokens, rows]`, each with the sum of |products| it is
/// measured against.
pub fn f64_dots(weights: &[f32], activations: &[f32], cols: usize) -> Vec<(f64, f64)> {
    let mut dots = Vec::new();
    for a in activations.chunks(cols) {
        for w in weights.chunks(cols) {
            let products = w.iter().zip(a).map(|(w, a)| *w as f64 * *a as f64);
            dots.push((products.clone().sum(), products.map(f64::abs).sum()));
        }
    }
    dots
}

/// Asserts that `y` (`[num_tokens, rows]`) holds the f64 dots of `weights` (`[rows, cols]`,
/// dequantized) with `activations` (`[num_tokens, cols]`, the values the kernel saw), each
/// within f32 rounding of its magnitude: 1e-5 of the sum of |products|, plus 1e-6. `what`
/// names the case in the failure message.
#[allow(dead_code)]
pub fn assert_f64_dots(what: &str, y: &[f32], weights: &[f32], activations: &[f32], cols: usize) {
    let rows = weights.len() / cols;
    assert_eq!(
        y.len(),
        rows * (activations.len() / cols),
        "{what}: output length"
    );
    for (index, (reference, scale)) in f64_dots(weights, activations, cols).into_iter().enumerate()
    {
        let (t, r) = (index / rows, index % rows);
        let got = y[index] as f64;
        assert!(
            (got - reference).abs() <= 1e-5 * scale + 1e-6,
            "{what} t{t} r{r}: {got} vs {reference}"
        );
    }
}

/// The weight types with repacked integer kernels.
#[allow(dead_code)]
pub const REPACKED: [GgmlType; 10] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::Q3K,
    GgmlType::Q2K,
];

pub fn f16(value: f32) -> [u8; 2] {
    half::f16::from_f32(value).to_le_bytes()
}

/// Random stored rows of `ty`; `unit_scales` makes every scale 1 and every min/bias 0.
pub fn random_rows(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    rng: &mut ChaCha8Rng,
    unit_scales: bool,
) -> Vec<u8> {
    let block = ty.block_size().unwrap();
    let mut out = Vec::new();
    for _ in 0..rows * cols / block {
        let scale = |rng: &mut ChaCha8Rng, signed: bool| {
            if unit_scales {
                f16(1.0)
            } else {
                let v: f32 = rng.random_range(0.001..0.05);
                f16(if signed && rng.random_bool(0.3) {
                    -v
                } else {
                    v
                })
            }
        };
        let bytes = |n: usize, rng: &mut ChaCha8Rng| {
            (0..n).map(|_| rng.random::<u8>()).collect::<Vec<u8>>()
        };
        match ty {
            GgmlType::Q4_0 => {
                out.extend(scale(rng, true));
                out.extend(bytes(16, rng));
            }
            GgmlType::Q4_1 => {
                out.extend(scale(rng, false));
                out.extend(if unit_scales {
                    f16(0.0)
                } else {
                    scale(rng, true)
                });
                out.extend(bytes(16, rng));
            }
            GgmlType::Q5_0 => {
                out.extend(scale(rng, true));
                out.extend(bytes(20, rng));
            }
            GgmlType::Q5_1 => {
                out.extend(scale(rng, false));
                out.extend(if unit_scales {
                    f16(0.0)
                } else {
                    scale(rng, true)
                });
                out.extend(bytes(20, rng));
            }
            GgmlType::Q8_0 => {
                out.extend(scale(rng, true));
                out.extend(bytes(32, rng));
            }
            GgmlType::Q4K | GgmlType::Q5K => {
                out.extend(scale(rng, false));
                out.extend(if unit_scales {
                    f16(0.0)
                } else {
                    scale(rng, false)
                });
                if unit_scales {
                    // scale_min_k4 gives scale 1, min 0 for every sub-block.
                    out.extend([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]);
                } else {
                    out.extend(bytes(12, rng));
                }
                let rest = if ty == GgmlType::Q4K { 128 } else { 160 };
                out.extend(bytes(rest, rng));
            }
            GgmlType::Q2K => {
                if unit_scales {
                    // Scale 1, min 0 for every sub-block; d 1, dmin 0.
                    out.extend([0x01u8; 16]);
                    out.extend(bytes(64, rng));
                    out.extend(f16(1.0));
                    out.extend(f16(0.0));
                } else {
                    out.extend(bytes(80, rng));
                    out.extend(scale(rng, false));
                    out.extend(scale(rng, false));
                }
            }
            GgmlType::Q3K => {
                out.extend(bytes(96, rng));
                if unit_scales {
                    // Every 6-bit scale 33: sub-scale 1.
                    out.extend([0x11u8; 8]);
                    out.extend([0xAAu8; 4]);
                } else {
                    out.extend(bytes(12, rng));
                }
                out.extend(scale(rng, true));
            }
            GgmlType::Q6K => {
                out.extend(bytes(192, rng));
                if unit_scales {
                    out.extend([1u8; 16]);
                } else {
                    // Sub-scales across the whole i8 range, -128 included.
                    out.extend(bytes(16, rng));
                }
                out.extend(scale(rng, false));
            }
            _ => unreachable!(),
        }
    }
    out
}
