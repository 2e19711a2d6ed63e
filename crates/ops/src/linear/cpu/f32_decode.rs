//! One-token and small-batch (2-8 token) matmuls on f32 activations (the decode steps of
//! weights that keep f32 activations, `ffn_down` under the default kernels), eight weight
//! rows at a time, each block decoded once in registers for all the tokens.
//!
//! The [`super::f32_tile`] recipe gives every row one 8-lane accumulator chain (a fused
//! multiply-add per 8 values, in order). The two-row tile streams two rows, so two dependent
//! chains bound it by the FMA latency, and it decodes each block through a stack buffer
//! (Q6_K with scalar code). Here eight rows run eight chains, and each block is decoded
//! straight into registers: with AVX-512 one 512-bit register holds two rows' chains side by
//! side (row `2p` in lanes 0..8, row `2p + 1` in lanes 8..16, their bytes interleaved 8
//! values each); with AVX2 each row has its own 256-bit register. The values are widened,
//! converted and scaled exactly as [`pagoda_tensor::quant::dequantize`] writes them, so every
//! lane runs the recipe's chain value for value and the result equals the two-row tile's bit
//! for bit (tests compare `to_bits`). Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K; other types
//! keep the tile.
//!
//! `PAGODA_CPU_F32_DECODE=auto|avx512|avx2|tile` (unset or empty: `auto`, the widest of
//! `avx512` and `avx2` the CPU runs, both measured faster than `tile`: see
//! `docs/benchmark_results/cpu-f32-decode-epyc-2026-11-30.md`); `tile` keeps the two-row
//! tile. Logged once at INFO; [`wide_matmul_count`] counts the matmuls that ran here.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use pagoda_tensor::GgmlType;

use crate::kernel_choice::{choose_from_env, KernelChoice};

/// The environment variable that selects the f32 kernel of 1-8 token matmuls.
pub const F32_DECODE_ENV_VAR: &str = "PAGODA_CPU_F32_DECODE";

/// Rows one call of [`rows8`] dots with the activation row.
pub const WIDE_ROWS: usize = 8;

/// The f32 kernel of 1-8 token matmuls (decode steps).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum F32Decode {
    /// The two-row [`super::f32_tile::quantized_tile`] (AVX2+FMA, else portable): the oracle.
    Tile,
    /// Eight rows, one per 256-bit register (AVX2, FMA, F16C).
    Avx2,
    /// Eight rows, two per 512-bit register (AVX-512 F/BW/DQ/VL).
    Avx512,
}

impl F32Decode {
    /// Lower-case name, as [`F32_DECODE_ENV_VAR`] spells it.
    pub fn name(self) -> &'static str {
        crate::kernel_choice::word(self)
    }

    /// Whether this CPU runs the kernel.
    pub fn is_supported(self) -> bool {
        match self {
            F32Decode::Tile => true,
            F32Decode::Avx2 => cpu_features().0,
            F32Decode::Avx512 => cpu_features().1,
        }
    }

    /// The widest supported kernel: `avx512`, else `avx2`, else `tile`.
    pub fn best() -> F32Decode {
        [F32Decode::Avx512, F32Decode::Avx2]
            .into_iter()
            .find(|kernel| kernel.is_supported())
            .unwrap_or(F32Decode::Tile)
    }

    /// Parses an [`F32_DECODE_ENV_VAR`] value (ASCII case and surrounding spaces ignored):
    /// `auto` or empty give `Ok(None)` (use [`F32Decode::best`]); anything but `avx512`,
    /// `avx2` and `tile` is an error naming the value and the accepted ones.
    pub fn parse(text: &str) -> Result<Option<F32Decode>, crate::UnknownChoice> {
        crate::kernel_choice::parse(text)
    }

    /// The process-wide kernel: [`F32_DECODE_ENV_VAR`] read once (unset: `auto`),
    /// validated against the CPU (an unsupported or unknown value falls back to `auto` with
    /// a warning) and logged once at INFO.
    pub fn selected() -> F32Decode {
        static SELECTED: OnceLock<F32Decode> = OnceLock::new();
        *SELECTED.get_or_init(|| {
            let kernel = choose_from_env::<F32Decode>();
            tracing::info!(
                "CPU f32 matmuls of 1-8 tokens: {} ({F32_DECODE_ENV_VAR}=auto|avx512|avx2|tile); \
                 f32 prefills: {}",
                kernel.name(),
                if kernel == F32Decode::Avx512 {
                    "two tokens per 512-bit register"
                } else if cfg!(target_arch = "aarch64") && super::f32_tile::fused() {
                    "NEON tiles (FMLA, the AVX2+FMA tiles' bits)"
                } else {
                    "256-bit tiles"
                }
            );
            kernel
        })
    }
}

impl KernelChoice for F32Decode {
    const ENV_VAR: &'static str = F32_DECODE_ENV_VAR;
    const WORDS: &'static [(&'static str, Self)] = &[
        ("avx512", F32Decode::Avx512),
        ("avx2", F32Decode::Avx2),
        ("tile", F32Decode::Tile),
    ];
    fn choice_supported(self) -> bool {
        self.is_supported()
    }
    fn auto_choice() -> Self {
        F32Decode::best()
    }
}

/// Whether [`rows8`] handles weights of type `ty`.
pub fn supports(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q8_0
            | GgmlType::Q4K
            | GgmlType::Q5K
            | GgmlType::Q6K
    )
}

static WIDE_MATMULS: AtomicU64 = AtomicU64::new(0);

/// How many one-token matmuls have run on [`rows8`] (either width) in this process (metrics,
/// and tests that check the dispatch).
pub fn wide_matmul_count() -> u64 {
    WIDE_MATMULS.load(Ordering::Relaxed)
}

/// Counts one matmul for [`wide_matmul_count`].
pub(crate) fn count_wide_matmul() {
    WIDE_MATMULS.fetch_add(1, Ordering::Relaxed);
}

/// `(avx2 && fma && f16c, that && avx512 f/bw/dq/vl)`, detected once.
fn cpu_features() -> (bool, bool) {
    static FEATURES: OnceLock<(bool, bool)> = OnceLock::new();
    *FEATURES.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            let avx512 = avx2
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512dq")
                && is_x86_feature_detected!("avx512vl");
            (avx2, avx512)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            (false, false)
        }
    })
}

/// `$body` with the type alias `$block` set to `$module`'s block decoder for `$ty` (one of the
/// types [`supports`] accepts; Q8_0 otherwise): the one place that maps a [`GgmlType`] to a
/// decoder type.
#[cfg(target_arch = "x86_64")]
macro_rules! with_block {
    ($module:ident, $ty:expr, $block:ident, $body:expr) => {
        match $ty {
            GgmlType::Q4_0 => {
                type $block = $module::Q4_0;
                $body
            }
            GgmlType::Q4_1 => {
                type $block = $module::Q4_1;
                $body
            }
            GgmlType::Q4K => {
                type $block = $module::Q4K;
                $body
            }
            GgmlType::Q5K => {
                type $block = $module::Q5K;
                $body
            }
            GgmlType::Q6K => {
                type $block = $module::Q6K;
                $body
            }
            _ => {
                type $block = $module::Q8_0;
                $body
            }
        }
    };
}

/// `out[r][t] = dot(decode(rows[r]), x[t])` for eight stored rows of type `ty` and `T`
/// activation rows of one length, on `kernel`, by the [`super::f32_tile`] recipe (fused
/// multiply-adds): bit-identical to `quantized_tile(ty, [rows[r]], x[t])[0]` on an AVX2+FMA
/// CPU. `ahead` are rows to prefetch (the caller's next-but-one group). `None` when `kernel`
/// is [`F32Decode::Tile`] or the CPU lacks it, or [`supports`] is false for `ty`.
///
/// Panics if `T` is 0, the activation rows differ in length, or a row does not hold exactly
/// `ty.bytes_for(x[0].len())` bytes (weights are validated at load; a caller bug).
pub fn rows8<const T: usize>(
    kernel: F32Decode,
    ty: GgmlType,
    rows: [&[u8]; WIDE_ROWS],
    ahead: [&[u8]; WIDE_ROWS],
    x: [&[f32]; T],
) -> Option<[[f32; T]; WIDE_ROWS]> {
    if !supports(ty) || kernel == F32Decode::Tile || !kernel.is_supported() {
        return None;
    }
    let k = x.first().expect("rows8: at least one activation row").len();
    assert!(
        x.iter().all(|x| x.len() == k),
        "rows8: activation rows of different lengths"
    );
    assert!(
        rows.iter()
            .chain(&ahead)
            .all(|row| ty.bytes_for(k) == Some(row.len())),
        "rows8: {ty} rows must hold {k} values"
    );
    #[cfg(target_arch = "x86_64")]
    {
        use x86::{narrow, wide};
        // SAFETY (both arms): the kernel's features were detected; every row holds k /
        // block-size whole blocks of `ty` and every activation row k values (checked above).
        return Some(match kernel {
            F32Decode::Avx512 => {
                with_block!(wide, ty, B, unsafe { wide::rows8::<B, T>(rows, ahead, x) })
            }
            _ => with_block!(narrow, ty, B, unsafe {
                narrow::rows8::<B, T>(rows, ahead, x)
            }),
        });
    }
    #[allow(unreachable_code)]
    None
}

/// Decodes one stored row of type `ty` into `out` with `kernel`'s block decoders (AVX2, for
/// either eight-row kernel): the values `pagoda_tensor::quant::dequantize` writes, bit for
/// bit. `false`, writing nothing, when `kernel` is [`F32Decode::Tile`] or unsupported, or
/// [`supports`] is false for `ty`.
///
/// Panics if `row` does not hold exactly `ty.bytes_for(out.len())` bytes (a caller bug).
pub fn decode_row(kernel: F32Decode, ty: GgmlType, row: &[u8], out: &mut [f32]) -> bool {
    if !supports(ty) || kernel == F32Decode::Tile || !kernel.is_supported() {
        return false;
    }
    assert_eq!(
        ty.bytes_for(out.len()),
        Some(row.len()),
        "decode_row: {ty} row must hold {} values",
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    {
        use x86::narrow;
        // SAFETY: AVX2, FMA and F16C come with either kernel (checked above); the row holds
        // out.len() / block-size whole blocks (checked above).
        with_block!(narrow, ty, B, unsafe { narrow::decode_row::<B>(row, out) });
        return true;
    }
    #[allow(unreachable_code)]
    false
}

#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::cpu::f32_tile::quantized_tile;

    /// Deterministic bytes (an LCG), with every block's f16 scales replaced by sane values.
    fn rows_of(ty: GgmlType, k: usize, seed: u64) -> Vec<Vec<u8>> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) as u32
        };
        let values = ty.block_size().unwrap();
        let block_bytes = ty.bytes_for(values).unwrap();
        // Offsets of the block's f16 scales.
        let halves: &[usize] = match ty {
            GgmlType::Q4_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
            GgmlType::Q6K => &[208],
            _ => &[0],
        };
        (0..WIDE_ROWS)
            .map(|_| {
                let mut row: Vec<u8> = (0..ty.bytes_for(k).unwrap())
                    .map(|_| next() as u8)
                    .collect();
                for block in row.chunks_exact_mut(block_bytes) {
                    for &at in halves {
                        // Scales in +-[2^-14, 0.06]: normal halves, both signs, and now and
                        // then a subnormal half (exact in f32 too).
                        let magnitude = (next() % 4000) as f32 * 1.5e-5;
                        let value = if next() % 2 == 0 {
                            magnitude
                        } else {
                            -magnitude
                        };
                        let bits = if next() % 17 == 0 {
                            (next() % 0x3FF) as u16
                        } else {
                            half::f16::from_f32(value).to_bits()
                        };
                        block[at..at + 2].copy_from_slice(&bits.to_le_bytes());
                    }
                }
                row
            })
            .collect()
    }

    #[test]
    fn eight_rows_and_decode_row_equal_the_tile_and_dequantize_bit_for_bit() {
        let types = [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::Q4K,
            GgmlType::Q5K,
            GgmlType::Q6K,
        ];
        for ty in types {
            let block = ty.block_size().unwrap();
            for (seed, k) in [32usize, 64, 544, 576, 1536]
                .into_iter()
                .filter(|k| k % block == 0)
                .chain([256, 2048])
                .enumerate()
            {
                let rows = rows_of(ty, k, seed as u64 + 1);
                let x: Vec<f32> = (0..k)
                    .map(|i| ((i * 37 + seed * 11) % 101) as f32 / 25.0 - 2.0)
                    .collect();
                let refs: [&[u8]; WIDE_ROWS] = std::array::from_fn(|r| &rows[r][..]);
                for (r, row) in refs.iter().enumerate() {
                    let mut want = vec![0f32; k];
                    pagoda_tensor::quant::dequantize(ty, row, &mut want).unwrap();
                    let mut got = vec![f32::NAN; k];
                    if decode_row(F32Decode::Avx2, ty, row, &mut got) {
                        let same = got
                            .iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "decode_row {ty} k={k} row {r}");
                    }
                }
                // Three activation rows (the kernel's multi-token form) and one.
                let x2: Vec<f32> = x.iter().rev().copied().collect();
                let three = [&x[..], &x2[..], &x[..]];
                for kernel in [F32Decode::Avx512, F32Decode::Avx2] {
                    let Some(got) = rows8(kernel, ty, refs, refs, three) else {
                        assert!(!kernel.is_supported(), "{kernel:?} refused {ty}");
                        println!("{kernel:?} is not supported here: untested");
                        continue;
                    };
                    let one = rows8(kernel, ty, refs, refs, [&x[..]]).unwrap();
                    check(kernel, ty, &refs, &x, &got.map(|r| r[0]));
                    check(kernel, ty, &refs, &x2, &got.map(|r| r[1]));
                    check(kernel, ty, &refs, &x, &got.map(|r| r[2]));
                    check(kernel, ty, &refs, &x, &one.map(|r| r[0]));
                }
            }
        }
    }

    /// `got` (eight rows on `kernel`) against the two-row tile, bit for bit, and the f64 dot.
    fn check(kernel: F32Decode, ty: GgmlType, refs: &[&[u8]; WIDE_ROWS], x: &[f32], got: &[f32]) {
        let k = x.len();
        for r in 0..WIDE_ROWS {
            let want = quantized_tile(ty, [refs[r]], x)[0];
            let context = format!("{kernel:?} {ty} k={k} row {r}");
            assert_eq!(got[r].to_bits(), want.to_bits(), "{context}");
            let mut decoded = vec![0f32; k];
            pagoda_tensor::quant::dequantize(ty, refs[r], &mut decoded).unwrap();
            let (exact, scale) = decoded.iter().zip(x).fold((0f64, 0f64), |acc, (w, x)| {
                let p = *w as f64 * *x as f64;
                (acc.0 + p, acc.1 + p.abs())
            });
            assert!(
                (got[r] as f64 - exact).abs() <= 1e-5 * scale.max(1e-6),
                "{context}: {} vs f64 {exact}",
                got[r]
            );
        }
    }

    #[test]
    fn other_types_and_the_switch() {
        assert!(rows8(
            F32Decode::best(),
            GgmlType::F16,
            [&[][..]; WIDE_ROWS],
            [&[][..]; WIDE_ROWS],
            [&[][..]]
        )
        .is_none());
        assert!(!supports(GgmlType::F32));
        assert_eq!(F32Decode::parse(" AVX512 "), Ok(Some(F32Decode::Avx512)));
        assert_eq!(F32Decode::parse("avx2"), Ok(Some(F32Decode::Avx2)));
        assert_eq!(F32Decode::parse("Tile"), Ok(Some(F32Decode::Tile)));
        let block = [0u8; 18];
        assert!(rows8(
            F32Decode::Tile,
            GgmlType::Q4_0,
            [&block[..]; 8],
            [&block[..]; 8],
            [&[0.0; 32][..]]
        )
        .is_none());
        assert_eq!(F32Decode::parse(""), Ok(None));
        assert_eq!(F32Decode::parse("auto"), Ok(None));
        let error = F32Decode::parse("sse").unwrap_err().to_string();
        assert!(
            error.contains(F32_DECODE_ENV_VAR) && error.contains("avx512"),
            "{error}"
        );
    }
}
