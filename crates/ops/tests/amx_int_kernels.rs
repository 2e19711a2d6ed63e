//! The AMX-INT8 matmul against the scalar and interleaved VNNI kernels (bit for bit) and an
//! f64 reference.
//!
//! The emulated tiles (`TileBackend::Emulated`) run the whole AMX code path (activation
//! panels, weight tiles, edge tiles, the f32 combine) on any CPU; the hardware tiles run only
//! where CPUID and Linux allow AMX-INT8, otherwise their test prints a line and returns. Run
//! alone with `cargo test -p pagoda-ops --release --test amx_int_kernels`. The timing probe of
//! the INT8 tiles against `vnni8` (and the BF16 tiles) is `amx_bf16_kernels.rs`'s
//! `bf16_vs_int8_timing`.

mod common;

use common::{random_rows, REPACKED};

use pagoda_ops::linear::cpu::amx::bf16::AmxPrefill;
use pagoda_ops::linear::cpu::amx::{self, AmxError, TileBackend, AMX_MIN_TOKENS};
use pagoda_ops::linear::cpu::int_dot::IntIsa;
use pagoda_ops::linear::cpu::int_matmul;
use pagoda_ops::linear::cpu::interleaved::{self, Interleaved};
use pagoda_ops::linear::{CpuKernels, Weight};
use pagoda_tensor::quant::q8::Q8Rows;
use pagoda_tensor::quant::repack::{dot_scalar, repack, RepackedRows};
use pagoda_tensor::{quant, GgmlType};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::sync::{Mutex, MutexGuard};

/// Held by every test that runs hardware tiles: `amx::hardware_matmul_count` is one counter
/// for the process, and the test harness runs tests in parallel, so a test that reads it to
/// learn whether its own matmul used the tiles must not overlap another test's matmuls.
static HARDWARE_COUNTER: Mutex<()> = Mutex::new(());

fn hardware_counter() -> MutexGuard<'static, ()> {
    HARDWARE_COUNTER
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Token counts: below, at and above one B tile's 16 tokens, and a long prefill.
const TOKENS: [usize; 6] = [1, 2, 15, 16, 17, 100];

/// `(out_features, in_features)`: rows below, at and past 8, 16 and 32 (half and whole A
/// tiles, a partial last interleaved group); 1 to 16 blocks.
fn shapes(ty: GgmlType) -> Vec<(usize, usize)> {
    if matches!(
        ty,
        GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K
    ) {
        vec![(1, 256), (15, 256), (17, 512), (40, 256)]
    } else {
        vec![
            (1, 32),
            (7, 64),
            (15, 64),
            (16, 96),
            (17, 160),
            (33, 256),
            (40, 32),
            (24, 512),
        ]
    }
}

/// Formats with sub-scales, which the AMX tiles decline.
fn sub_scaled(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q6K)
}

struct Case {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    stored: Vec<u8>,
    weights: RepackedRows,
    interleaved: Interleaved,
    x: Vec<f32>,
    activations: Q8Rows,
}

/// Every (format, shape, token count) case, from one seed.
fn cases(seed: u64) -> Vec<Case> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::new();
    // Sub-scaled weights (Q2_K, Q3_K, Q6_K) have no AMX kernel: `sub_scaled_weights_are_declined`.
    for ty in REPACKED.into_iter().filter(|&ty| !sub_scaled(ty)) {
        for (rows, cols) in shapes(ty) {
            let stored = random_rows(ty, rows, cols, &mut rng, false);
            let weights = repack(ty, rows, cols, &stored).unwrap();
            let interleaved = Interleaved::new(&weights);
            // Q8 and Q15 activation rows (two tile dots per block).
            for (num_tokens, q15) in TOKENS.into_iter().flat_map(|t| [(t, false), (t, true)]) {
                let x = common::random_activations(num_tokens, cols, &mut rng);
                let activations = if q15 {
                    Q8Rows::quantize_q15(&x, cols).unwrap()
                } else {
                    Q8Rows::quantize(&x, cols).unwrap()
                };
                out.push(Case {
                    ty,
                    rows,
                    cols,
                    stored: stored.clone(),
                    weights: weights.clone(),
                    interleaved: interleaved.clone(),
                    x,
                    activations,
                });
            }
        }
    }
    out
}

fn run(backend: TileBackend, case: &Case) -> Vec<f32> {
    let mut y = vec![f32::NAN; case.rows * case.activations.num_rows()];
    amx::matmul(backend, &case.interleaved, &case.activations, &mut y).unwrap();
    y
}

/// The portable scalar kernel ([`pagoda_tensor::quant::repack::dot_scalar`] per pair).
fn scalar(case: &Case) -> Vec<f32> {
    let mut y = vec![f32::NAN; case.rows * case.activations.num_rows()];
    if case.activations.is_q15() {
        // The per-row kernels take Q8 rows only; `dot_scalar` is their chain for either.
        for (t, y) in y.chunks_exact_mut(case.rows).enumerate() {
            for (r, y) in y.iter_mut().enumerate() {
                *y = dot_scalar(&case.weights, r, &case.activations, t);
            }
        }
    } else {
        int_matmul::matmul(IntIsa::Scalar, &case.weights, &case.activations, &mut y);
    }
    y
}

fn vnni8(case: &Case) -> Vec<f32> {
    let mut y = vec![f32::NAN; case.rows * case.activations.num_rows()];
    interleaved::matmul(&case.interleaved, &case.activations, &mut y);
    y
}

fn assert_same_bits(got: &[f32], want: &[f32], what: &str, case: &Case) {
    assert_eq!(got.len(), want.len());
    let tokens = case.activations.num_rows();
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g.to_bits(),
            w.to_bits(),
            "{what}: {} [{} x {}] tokens {tokens}, q15 {}: token {} row {}: {g} vs {w}",
            case.ty,
            case.rows,
            case.cols,
            case.activations.is_q15(),
            i / case.rows,
            i % case.rows
        );
    }
}

#[test]
fn emulated_amx_equals_the_scalar_and_vnni8_kernels_bit_for_bit() {
    let vnni = interleaved::is_supported();
    for case in cases(11) {
        let emulated = run(TileBackend::Emulated, &case);
        assert_same_bits(&emulated, &scalar(&case), "emulated vs scalar", &case);
        if vnni {
            assert_same_bits(&emulated, &vnni8(&case), "emulated vs vnni8", &case);
        }
    }
    if !vnni {
        println!("AVX-512 VNNI not available on this CPU: bit-equality with vnni8 skipped");
    }
}

/// The independent oracle: f64 dots of the dequantized weights with the dequantized Q8
/// activations the kernel sees, within f32 rounding of the magnitudes summed.
#[test]
fn emulated_amx_matches_the_f64_reference() {
    for case in cases(12) {
        let (rows, cols) = (case.rows, case.cols);
        let num_tokens = case.activations.num_rows();
        let mut weights = vec![0f32; rows * cols];
        quant::dequantize(case.ty, &case.stored, &mut weights).unwrap();
        let mut seen = vec![0f32; case.x.len()];
        for (t, row) in seen.chunks_mut(cols).enumerate() {
            case.activations.dequantize_row(t, row);
        }
        let y = run(TileBackend::Emulated, &case);
        let what = format!("{} [{rows} x {cols}] tokens {num_tokens}", case.ty);
        common::assert_f64_dots(&what, &y, &weights, &seen, cols);
    }
}

/// The hardware tiles against the emulated ones, the scalar kernel and `vnni8`, every case.
#[test]
fn hardware_amx_equals_the_emulator_scalar_and_vnni8() {
    if !amx::is_available() {
        println!("AMX not available on this CPU: hardware check skipped");
        return;
    }
    let _counter = hardware_counter();
    let before = amx::hardware_matmul_count();
    let cases = cases(13);
    for case in &cases {
        let hardware = run(TileBackend::Hardware, case);
        assert_same_bits(
            &hardware,
            &run(TileBackend::Emulated, case),
            "hardware vs emulated",
            case,
        );
        assert_same_bits(&hardware, &scalar(case), "hardware vs scalar", case);
        assert_same_bits(&hardware, &vnni8(case), "hardware vs vnni8", case);
    }
    assert!(amx::hardware_matmul_count() >= before + cases.len() as u64);
    println!(
        "AMX hardware: {} cases bit-identical to the emulator, the scalar kernel and vnni8",
        cases.len()
    );
}

/// `Weight::matmul` with the `amx` set gives `vnni8`'s bits for decode and prefill, and a
/// prefill of at least `AMX_MIN_TOKENS` tokens runs on the tiles where they exist (the
/// hardware's, or the emulated ones with `PAGODA_CPU_AMX_TILES=emulated`).
#[test]
fn weight_matmul_with_the_amx_set_equals_vnni8() {
    if !CpuKernels::Vnni8.is_supported() {
        println!("AVX-512 VNNI not available on this CPU: amx kernel set check skipped");
        return;
    }
    let _counter = hardware_counter();
    // Prefills on the BF16 tiles are not vnni8's bits: those token counts are checked only
    // with the INT8 tiles (`PAGODA_CPU_AMX_PREFILL=int8`; `amx_bf16_kernels.rs` tests BF16).
    let bf16_prefill =
        !pagoda_ops::linear::batch_invariant() || AmxPrefill::selected() == AmxPrefill::Bf16;
    if bf16_prefill {
        println!(
            "prefills run on the AMX-BF16 tiles: only token counts below {} compared",
            amx::bf16::MIN_TOKENS
        );
    }
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    for ty in REPACKED {
        let (rows, cols) = (37, 256);
        let stored = random_rows(ty, rows, cols, &mut rng, false);
        for (num_tokens, q15) in [1, AMX_MIN_TOKENS - 1, AMX_MIN_TOKENS, 33]
            .into_iter()
            .flat_map(|t| [(t, false), (t, true)])
        {
            if bf16_prefill && num_tokens >= amx::bf16::MIN_TOKENS {
                continue;
            }
            let amx_weight = Weight::with_kernels(ty, rows, cols, stored.clone(), CpuKernels::Amx)
                .unwrap()
                .with_q15_activations(q15);
            let vnni_weight =
                Weight::with_kernels(ty, rows, cols, stored.clone(), CpuKernels::Vnni8)
                    .unwrap()
                    .with_q15_activations(q15);
            assert_eq!(amx_weight.int_isa(), Some(IntIsa::Amx));
            assert_eq!(amx_weight.q15_activations(), q15);
            let x = common::random_activations(num_tokens, cols, &mut rng);
            let tile_matmuls = || amx::hardware_matmul_count() + amx::emulated_matmul_count();
            let before = tile_matmuls();
            let mut y_amx = vec![f32::NAN; num_tokens * rows];
            amx_weight.matmul(&x, num_tokens, &mut y_amx);
            let used_amx = tile_matmuls() > before;
            let mut y_vnni = vec![f32::NAN; num_tokens * rows];
            vnni_weight.matmul(&x, num_tokens, &mut y_vnni);
            for (i, (a, v)) in y_amx.iter().zip(&y_vnni).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    v.to_bits(),
                    "{ty} tokens {num_tokens} q15 {q15} value {i}: {a} vs {v}"
                );
            }
            // Sub-scaled weights fall back to vnni8.
            let expected = num_tokens >= AMX_MIN_TOKENS && !sub_scaled(ty);
            match amx::backend() {
                Some(TileBackend::Hardware) => {
                    assert_eq!(used_amx, expected, "{ty} tokens {num_tokens}")
                }
                // Other tests run the emulator directly, so only a missed dispatch shows.
                Some(TileBackend::Emulated) => {
                    assert!(
                        used_amx || !expected,
                        "{ty} tokens {num_tokens}: no tiles ran"
                    )
                }
                None => {}
            }
        }
    }
}

/// The tiles decline weights with sub-scales (Q6_K) before touching `y`; `Weight::matmul`
/// then runs vnni8 (`weight_matmul_with_the_amx_set_equals_vnni8`).
#[test]
fn sub_scaled_weights_are_declined() {
    let mut rng = ChaCha8Rng::seed_from_u64(16);
    let stored = random_rows(GgmlType::Q6K, 4, 256, &mut rng, false);
    let weights = Interleaved::new(&repack(GgmlType::Q6K, 4, 256, &stored).unwrap());
    let activations = Q8Rows::quantize(&common::random_activations(3, 256, &mut rng), 256).unwrap();
    let mut y = vec![7f32; 12];
    assert_eq!(
        amx::matmul(TileBackend::Emulated, &weights, &activations, &mut y),
        Err(AmxError::SubScales)
    );
    assert!(y.iter().all(|&v| v == 7.0), "y written");
}

#[test]
fn bad_shapes_and_missing_hardware_are_errors() {
    let mut rng = ChaCha8Rng::seed_from_u64(15);
    let stored = random_rows(GgmlType::Q4_0, 4, 64, &mut rng, false);
    let weights = Interleaved::new(&repack(GgmlType::Q4_0, 4, 64, &stored).unwrap());
    let activations = Q8Rows::quantize(&common::random_activations(3, 64, &mut rng), 64).unwrap();
    let mut y = vec![0f32; 11];
    assert_eq!(
        amx::matmul(TileBackend::Emulated, &weights, &activations, &mut y),
        Err(AmxError::OutputSize {
            got: 11,
            expected: 12
        })
    );
    let short = Q8Rows::quantize(&common::random_activations(3, 32, &mut rng), 32).unwrap();
    let mut y = vec![0f32; 12];
    assert_eq!(
        amx::matmul(TileBackend::Emulated, &weights, &short, &mut y),
        Err(AmxError::BlockMismatch {
            weights: 2,
            activations: 1
        })
    );
    if !amx::is_available() {
        assert_eq!(
            amx::matmul(TileBackend::Hardware, &weights, &activations, &mut y),
            Err(AmxError::NotAvailable)
        );
        assert!(!IntIsa::Amx.is_supported() && !CpuKernels::Amx.is_supported());
    }
}
