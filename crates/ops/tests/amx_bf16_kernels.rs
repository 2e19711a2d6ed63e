//! The AMX-BF16 prefill matmul: its inputs against ggml's dequantizer (bf16 of the same
//! values), its tile loops (emulated, any CPU) against an f64 reference of those inputs, the
//! hardware tiles against the same reference, and its error against the integer path's.
//!
//! Run alone with `cargo test -p pagoda-ops --release --test amx_bf16_kernels`; the timing
//! probe with `-- --ignored --nocapture bf16_vs_int8_timing` on an AMX machine.

mod common;

use common::{random_rows, REPACKED};

use pagoda_ops::linear::cpu::amx::bf16::{self, pack, AmxPrefill};
use pagoda_ops::linear::cpu::amx::{self, AmxError, TileBackend};
use pagoda_ops::linear::cpu::interleaved::Interleaved;
use pagoda_ops::linear::{CpuKernels, Weight};
use pagoda_tensor::quant::q8::Q8Rows;
use pagoda_tensor::quant::repack::repack;
use pagoda_tensor::{quant, GgmlType};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Formats with sub-scales, which the BF16 tiles decline (as the integer ones do).
fn sub_scaled(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q6K)
}

fn kquant(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4K | GgmlType::Q5K)
}

/// `(rows, cols)`: partial chunks (8, 33, 40 rows), one and many blocks.
fn shapes(ty: GgmlType) -> Vec<(usize, usize)> {
    if kquant(ty) {
        vec![(8, 256), (40, 512)]
    } else {
        vec![(8, 32), (33, 64), (40, 160), (64, 96)]
    }
}

fn bf16_value(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

struct Case {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    /// ggml's dequantized weights, `[rows][cols]`.
    dequantized: Vec<f32>,
    interleaved: Interleaved,
}

fn cases(seed: u64) -> Vec<Case> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::new();
    for ty in REPACKED.into_iter().filter(|&ty| !sub_scaled(ty)) {
        for (rows, cols) in shapes(ty) {
            let stored = random_rows(ty, rows, cols, &mut rng, false);
            let mut dequantized = vec![0f32; rows * cols];
            quant::dequantize(ty, &stored, &mut dequantized).unwrap();
            let interleaved = Interleaved::new(&repack(ty, rows, cols, &stored).unwrap());
            out.push(Case {
                ty,
                rows,
                cols,
                dequantized,
                interleaved,
            });
        }
    }
    out
}

#[test]
fn rounding_to_bf16_is_to_nearest_even() {
    assert_eq!(pack::to_bf16(1.0), 0x3F80);
    assert_eq!(pack::to_bf16(-2.5), 0xC020);
    // Ties: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 (to even: 1), 1 + 3 * 2^-8 between
    // 1 + 2^-7 and 1 + 2^-6 (to even: 1 + 2^-6).
    assert_eq!(pack::to_bf16(f32::from_bits(0x3F80_8000)), 0x3F80);
    assert_eq!(pack::to_bf16(f32::from_bits(0x3F81_8000)), 0x3F82);
    assert_eq!(pack::to_bf16(f32::from_bits(0x3F80_8001)), 0x3F81);
    assert_eq!(
        pack::to_bf16(f32::MAX),
        0x7F80,
        "overflow rounds to infinity"
    );
    assert_eq!(pack::to_bf16(f32::NEG_INFINITY), 0xFF80);
    assert!(bf16_value(pack::to_bf16(f32::NAN)).is_nan());
    assert_eq!(
        pack::to_bf16(-1e-40),
        0x8000,
        "denormals become signed zero"
    );
}

/// Every value of every chunk's B tiles is ggml's dequantized weight rounded to bf16, from
/// the scalar and the AVX-512 fill alike.
#[test]
fn weight_tiles_hold_ggml_values_in_bf16() {
    for case in cases(21) {
        let chunks = case.rows.div_ceil(pack::CHUNK_ROWS);
        for chunk in 0..chunks {
            let mut scalar = pack::TileBuffer::new();
            pack::weights(&case.interleaved, chunk, &mut scalar, false);
            let mut vector = pack::TileBuffer::new();
            pack::weights(&case.interleaved, chunk, &mut vector, true);
            let (scalar, vector) = (scalar.as_bytes(), vector.as_bytes());
            for r in 0..pack::CHUNK_ROWS.min(case.rows - chunk * pack::CHUNK_ROWS) {
                let row = chunk * pack::CHUNK_ROWS + r;
                for k in 0..case.cols {
                    // As values: ggml's zeros may be -0.0 where `* d + min` gives +0.0.
                    let want = bf16_value(pack::to_bf16(case.dequantized[row * case.cols + k]));
                    let what = format!(
                        "{} [{} x {}] row {row} k {k}",
                        case.ty, case.rows, case.cols
                    );
                    let got_scalar = bf16_value(pack::b_value(scalar, r, k));
                    let got_vector = bf16_value(pack::b_value(vector, r, k));
                    assert_eq!(got_scalar, want, "scalar fill, {what}");
                    assert_eq!(got_vector, want, "vector fill, {what}");
                }
            }
        }
    }
    if !pack::vector() {
        println!("AVX-512 BF16 not available on this CPU: the vector fill ran the scalar loop");
    }
}

/// Remainders of values that are not finite, or that rounded to infinity, are 0 on both
/// paths; the `hi` terms keep the infinity or NaN.
#[test]
fn split_remainders_of_non_finite_values_are_zero() {
    let mut x = vec![1.5f32; 32];
    x[0] = f32::INFINITY;
    x[1] = f32::NAN;
    x[2] = f32::MAX;
    x[3] = -f32::MAX;
    x[4] = 1.0 + 2f32.powi(-12);
    for use_vector in [false, true] {
        let (mut hi, mut lo) = (pack::TileBuffer::new(), pack::TileBuffer::new());
        pack::activations(&x, 32, &mut hi, use_vector);
        pack::remainders(&x, 32, &hi, &mut lo, use_vector);
        let lo = lo.as_u16();
        assert_eq!(&lo[..4], &[0, 0, 0, 0], "vector {use_vector}");
        assert_eq!(bf16_value(lo[4]), 2f32.powi(-12), "vector {use_vector}");
        assert_eq!(lo[5], 0, "vector {use_vector}");
        assert!(bf16_value(hi.as_u16()[1]).is_nan());
    }
}

#[test]
fn activation_rows_are_rounded_and_padded() {
    let mut rng = ChaCha8Rng::seed_from_u64(22);
    for tokens in [1, 31, 32, 33, 70] {
        let x = common::random_activations(tokens, 64, &mut rng);
        let (mut scalar, mut vector) = (pack::TileBuffer::new(), pack::TileBuffer::new());
        pack::activations(&x, 64, &mut scalar, false);
        pack::activations(&x, 64, &mut vector, true);
        let (scalar, vector) = (scalar.as_u16(), vector.as_u16());
        assert_eq!(scalar.len(), tokens.div_ceil(32) * 32 * 64);
        assert_eq!(scalar, vector, "tokens {tokens}");
        assert_eq!(scalar.as_ptr() as usize % 64, 0, "64-byte aligned");
        for (i, &bits) in scalar.iter().enumerate() {
            let want = x.get(i).map_or(0, |&v| pack::to_bf16(v));
            assert_eq!(bits, want, "tokens {tokens} value {i}");
        }
    }
}

/// `hi + lo` of each value of `x` (`[tokens][cols]`): what the split tiles multiply.
fn split_values(x: &[f32], cols: usize, use_vector: bool) -> Vec<f32> {
    let (mut hi, mut lo) = (pack::TileBuffer::new(), pack::TileBuffer::new());
    pack::activations(x, cols, &mut hi, use_vector);
    pack::remainders(x, cols, &hi, &mut lo, use_vector);
    hi.as_u16()[..x.len()]
        .iter()
        .zip(lo.as_u16())
        .map(|(&h, &l)| bf16_value(h) + bf16_value(l))
        .collect()
}

/// The bf16 inputs the tiles multiply, as f32: weights and activations.
fn bf16_inputs(case: &Case, x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let round = |v: &f32| bf16_value(pack::to_bf16(*v));
    (
        case.dequantized.iter().map(round).collect(),
        x.iter().map(round).collect(),
    )
}

fn run(backend: TileBackend, case: &Case, x: &[f32], tokens: usize) -> Vec<f32> {
    let mut y = vec![f32::NAN; case.rows * tokens];
    bf16::matmul(backend, &case.interleaved, x, tokens, &mut y).unwrap();
    y
}

/// The emulated tiles (the whole kernel: fills, passes, partial chunks and passes, the
/// writes) against f64 dots of the bf16 inputs.
#[test]
fn emulated_bf16_matches_the_f64_reference() {
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    for case in cases(24) {
        for tokens in [1, 17, 33, 64] {
            let x = common::random_activations(tokens, case.cols, &mut rng);
            let y = run(TileBackend::Emulated, &case, &x, tokens);
            let (w, a) = bf16_inputs(&case, &x);
            let what = format!(
                "{} [{} x {}] tokens {tokens}",
                case.ty, case.rows, case.cols
            );
            common::assert_f64_dots(&what, &y, &w, &a, case.cols);
        }
    }
}

/// The hardware tiles against the same reference and the emulator (reported: bit-exact or
/// not, the hardware may round in another order).
#[test]
fn hardware_bf16_matches_the_reference() {
    if !bf16::is_available() {
        println!("AMX-BF16 not available on this CPU: hardware check skipped");
        return;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(25);
    let (mut values, mut same) = (0usize, 0usize);
    for case in cases(26) {
        for tokens in [17, 64, 100] {
            let x = common::random_activations(tokens, case.cols, &mut rng);
            let hardware = run(TileBackend::Hardware, &case, &x, tokens);
            let (w, a) = bf16_inputs(&case, &x);
            let what = format!(
                "{} [{} x {}] tokens {tokens}",
                case.ty, case.rows, case.cols
            );
            common::assert_f64_dots(&what, &hardware, &w, &a, case.cols);
            let emulated = run(TileBackend::Emulated, &case, &x, tokens);
            values += hardware.len();
            same += hardware
                .iter()
                .zip(&emulated)
                .filter(|(h, e)| h.to_bits() == e.to_bits())
                .count();
        }
    }
    println!("AMX-BF16 hardware: within the f64 bound everywhere; {same} of {values} values bit-identical to the emulator");
}

/// The error of the BF16 path against exact f32 math is of the size of the integer path's
/// (Q8 activations): RMS over many dots within 2x.
#[test]
fn bf16_error_is_of_the_integer_paths_size() {
    let mut rng = ChaCha8Rng::seed_from_u64(27);
    let (rows, cols, tokens) = (64, 576, 40);
    let ty = GgmlType::Q4_1;
    let stored = random_rows(ty, rows, cols, &mut rng, false);
    let mut w = vec![0f32; rows * cols];
    quant::dequantize(ty, &stored, &mut w).unwrap();
    let interleaved = Interleaved::new(&repack(ty, rows, cols, &stored).unwrap());
    let x: Vec<f32> = (0..tokens * cols)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let mut bf = vec![0f32; rows * tokens];
    bf16::matmul(TileBackend::Emulated, &interleaved, &x, tokens, &mut bf).unwrap();
    let q8 = Q8Rows::quantize(&x, cols).unwrap();
    let mut int = vec![0f32; rows * tokens];
    amx::matmul(TileBackend::Emulated, &interleaved, &q8, &mut int).unwrap();
    let (mut bf_err, mut int_err) = (0f64, 0f64);
    for t in 0..tokens {
        for r in 0..rows {
            let exact: f64 = (0..cols)
                .map(|i| w[r * cols + i] as f64 * x[t * cols + i] as f64)
                .sum();
            bf_err += (bf[t * rows + r] as f64 - exact).powi(2);
            int_err += (int[t * rows + r] as f64 - exact).powi(2);
        }
    }
    let (bf_rms, int_rms) = (bf_err.sqrt(), int_err.sqrt());
    println!("RMS error against exact: bf16 {bf_rms:.4e}, Q8 integer {int_rms:.4e}");
    assert!(
        bf_rms > 0.0 && bf_rms <= 2.0 * int_rms,
        "bf16 {bf_rms} vs Q8 {int_rms}"
    );
}

#[test]
fn sub_scaled_weights_and_bad_shapes_are_errors() {
    let mut rng = ChaCha8Rng::seed_from_u64(28);
    let stored = random_rows(GgmlType::Q6K, 16, 256, &mut rng, false);
    let q6 = Interleaved::new(&repack(GgmlType::Q6K, 16, 256, &stored).unwrap());
    let x = vec![0.5f32; 64 * 256];
    let mut y = vec![7.0f32; 16 * 64];
    let error = bf16::matmul(TileBackend::Emulated, &q6, &x, 64, &mut y).unwrap_err();
    assert_eq!(error, AmxError::SubScales);
    assert!(y.iter().all(|&v| v == 7.0), "nothing written on an error");
    let case = &cases(29)[0];
    let mut y = vec![0f32; case.rows * 3];
    assert!(matches!(
        bf16::matmul(
            TileBackend::Emulated,
            &case.interleaved,
            &[0.0; 5],
            3,
            &mut y
        ),
        Err(AmxError::BlockMismatch { .. })
    ));
    let x = vec![0f32; 3 * case.cols];
    assert!(matches!(
        bf16::matmul(TileBackend::Emulated, &case.interleaved, &x, 3, &mut y[1..]),
        Err(AmxError::OutputSize { .. })
    ));
    if !bf16::is_available() {
        assert_eq!(
            bf16::matmul(TileBackend::Hardware, &case.interleaved, &x, 3, &mut y),
            Err(AmxError::NotAvailable)
        );
    }
}

#[test]
fn the_switch_parses_its_values() {
    assert_eq!(AmxPrefill::parse(" BF16 "), Ok(Some(AmxPrefill::Bf16)));
    assert_eq!(AmxPrefill::parse("int8"), Ok(Some(AmxPrefill::Int8)));
    assert_eq!(AmxPrefill::parse(""), Ok(None));
    let error = AmxPrefill::parse("fp8").unwrap_err().to_string();
    assert!(error.contains(bf16::AMX_PREFILL_ENV_VAR) && error.contains("fp8"));
    // The reproducible tiles by default on every CPU; BF16 is an opt-in.
    assert_eq!(AmxPrefill::auto(), AmxPrefill::Int8);
}

/// `Weight::matmul` with the `amx` set runs prefills on the BF16 tiles where they are
/// selected (`PAGODA_CPU_AMX_PREFILL=bf16`, on the hardware or emulated tiles), and its result
/// is the reference's.
#[test]
fn weight_matmul_with_the_amx_set_takes_the_bf16_tiles() {
    if AmxPrefill::selected() != AmxPrefill::Bf16 {
        println!(
            "AMX-BF16 not selected ({}=bf16, with the hardware or {}=emulated): \
             kernel-set check skipped",
            bf16::AMX_PREFILL_ENV_VAR,
            amx::TILES_ENV_VAR
        );
        return;
    }
    // Other tests here run the emulator directly: with it, only a missed dispatch shows.
    let emulated = amx::backend() == Some(TileBackend::Emulated);
    let count = || {
        if emulated {
            bf16::emulated_matmul_count()
        } else {
            bf16::matmul_count()
        }
    };
    let case = &cases(30)[1];
    let (rows, cols) = (case.rows, case.cols);
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    let stored = random_rows(GgmlType::Q4_1, rows, cols, &mut rng, false);
    let weight =
        Weight::with_kernels(GgmlType::Q4_1, rows, cols, stored.clone(), CpuKernels::Amx).unwrap();
    let tokens = 128;
    let x = common::random_activations(tokens, cols, &mut rng);
    let before = count();
    let mut y = vec![0f32; rows * tokens];
    weight.matmul(&x, tokens, &mut y);
    assert!(count() > before, "the prefill ran on the BF16 tiles");
    let mut w = vec![0f32; rows * cols];
    quant::dequantize(GgmlType::Q4_1, &stored, &mut w).unwrap();
    let round = |v: &f32| bf16_value(pack::to_bf16(*v));
    let (w, a): (Vec<f32>, Vec<f32>) =
        (w.iter().map(round).collect(), x.iter().map(round).collect());
    common::assert_f64_dots("Weight::matmul, amx set", &y, &w, &a, cols);
    // Q15 weights (`ffn_down`): split activations on the BF16 tiles, or (with
    // PAGODA_CPU_AMX_BF16_Q15=int8) the INT8 tiles, with vnni8's bits.
    let q15 = Weight::with_kernels(GgmlType::Q4_1, rows, cols, stored.clone(), CpuKernels::Amx)
        .unwrap()
        .with_q15_activations(true);
    let before = count();
    let mut y_q15 = vec![0f32; rows * tokens];
    q15.matmul(&x, tokens, &mut y_q15);
    if bf16::split_q15() {
        assert!(count() > before, "Q15 weights ran on the BF16 tiles");
        let split = split_values(&x, cols, true);
        common::assert_f64_dots("Weight::matmul, Q15 split", &y_q15, &w, &split, cols);
    } else {
        let vnni = Weight::with_kernels(GgmlType::Q4_1, rows, cols, stored, CpuKernels::Vnni8)
            .unwrap()
            .with_q15_activations(true);
        let mut y_vnni = vec![0f32; rows * tokens];
        vnni.matmul(&x, tokens, &mut y_vnni);
        assert!(
            emulated || count() == before,
            "Q15 weights ran on the BF16 tiles"
        );
        assert!(y_q15
            .iter()
            .zip(&y_vnni)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

/// Split activations (`hi + lo`, two dots per tile and block): the emulated tiles against
/// f64 dots of the bf16 weights with `hi + lo`, which is within 2^-16 of each value; on
/// wide-range inputs the error against exact math falls well below the one-term path's.
#[test]
fn emulated_split_matches_the_f64_reference() {
    let mut rng = ChaCha8Rng::seed_from_u64(34);
    for case in cases(35) {
        for tokens in [17, 40] {
            let x = common::random_activations(tokens, case.cols, &mut rng);
            let sum = split_values(&x, case.cols, false);
            let vector = split_values(&x, case.cols, true);
            assert!(sum
                .iter()
                .zip(&vector)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            for (s, v) in sum.iter().zip(&x) {
                assert!((s - v).abs() <= v.abs() * 2f32.powi(-16), "{s} vs {v}");
            }
            let mut y = vec![f32::NAN; case.rows * tokens];
            bf16::matmul_split(TileBackend::Emulated, &case.interleaved, &x, tokens, &mut y)
                .unwrap();
            let (w, _) = bf16_inputs(&case, &x);
            let what = format!(
                "split {} [{} x {}] tokens {tokens}",
                case.ty, case.rows, case.cols
            );
            common::assert_f64_dots(&what, &y, &w, &sum, case.cols);
        }
    }
}
