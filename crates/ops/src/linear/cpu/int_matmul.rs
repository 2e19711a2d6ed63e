//! `y = W x` with repacked weights and activations quantized once per call to Q8 (or Q15 for
//! the interleaved kernels, see [`pagoda_tensor::quant::q8`]).
//!
//! Decode (one token) streams four weight rows at a time past the quantized activation row
//! (`tile::<4, 1>`). Prefill splits the output rows into chunks of 16 per task and covers
//! each chunk x all tokens with 4 x 4 tiles: each weight block loaded feeds four tokens and
//! each activation block four rows. Interleaved weights ([`IntRows::Interleaved`]) run
//! [`crate::linear::cpu::interleaved`]; with [`IntIsa::Amx`], their prefills of at least
//! [`AMX_MIN_TOKENS`] tokens run on the AMX tiles ([`crate::linear::cpu::amx::matmul`], the same
//! bits) where the CPU and OS allow it.

use pagoda_tensor::quant::q8::{quantize_block, quantize_block_q15, Q8Rows, Q8_BLOCK};
use pagoda_tensor::quant::repack::RepackedRows;
use rayon::prelude::*;

use crate::linear::cpu::amx::{self, AMX_MIN_TOKENS};
use crate::linear::cpu::int_dot::{tile, IntIsa};
use crate::linear::cpu::interleaved::{self, Interleaved};
use crate::linear::cpu::tasks::decode_rows_per_task;

/// Repacked weights in the layout of their kernel set: one row after another (the
/// per-lane tiles of [`crate::linear::cpu::int_dot`]), or eight rows interleaved
/// ([`crate::linear::cpu::interleaved`] and the AMX tiles: the `vnni8` and `amx` sets).
#[derive(Debug, Clone)]
pub enum IntRows {
    /// Row after row ([`RepackedRows`]).
    Rows(RepackedRows),
    /// Eight rows interleaved ([`Interleaved`]).
    Interleaved(Interleaved),
}

impl IntRows {
    /// Bytes held.
    pub fn size_bytes(&self) -> usize {
        match self {
            IntRows::Rows(rows) => rows.size_bytes(),
            IntRows::Interleaved(rows) => rows.size_bytes(),
        }
    }

    /// Decodes row `row` into `out`, bit-exactly as ggml's dequantizer does.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        match self {
            IntRows::Rows(rows) => rows.dequantize_row(row, out),
            IntRows::Interleaved(rows) => rows.dequantize_row(row, out),
        }
    }

    /// `y[t, r] = dot(weights[r], activations[t])` ([`matmul`] or [`interleaved::matmul`]).
    pub fn matmul(&self, isa: IntIsa, activations: &Q8Rows, y: &mut [f32]) {
        match self {
            IntRows::Rows(rows) => {
                assert!(
                    !activations.is_q15(),
                    "per-row integer kernels take Q8 rows"
                );
                crate::linear::cpu::int_dot::count_simd_matmul(isa);
                matmul(isa, rows, activations, y)
            }
            IntRows::Interleaved(rows) => {
                let tiles = isa == IntIsa::Amx
                    && activations.num_rows() >= AMX_MIN_TOKENS
                    && amx::backend()
                        .is_some_and(|backend| amx::matmul(backend, rows, activations, y).is_ok());
                if !tiles {
                    interleaved::matmul(rows, activations, y)
                }
            }
        }
    }
}

static Q15_MATMULS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many integer matmuls have quantized their activations to Q15 in this process.
pub fn q15_matmul_count() -> u64 {
    Q15_MATMULS.load(std::sync::atomic::Ordering::Relaxed)
}

pub(crate) fn count_q15_matmul() {
    Q15_MATMULS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// Quantizes `x` (`[num_tokens, k]`) into `out` as Q8 rows, in parallel over tokens when
/// there are many.
pub fn quantize_activations(isa: IntIsa, x: &[f32], k: usize, out: &mut Q8Rows) {
    quantize(isa, x, k, out, false)
}

/// [`quantize_activations`] into Q15 rows (see [`pagoda_tensor::quant::q8`]).
pub fn quantize_activations_q15(isa: IntIsa, x: &[f32], k: usize, out: &mut Q8Rows) {
    quantize(isa, x, k, out, true)
}

fn quantize(isa: IntIsa, x: &[f32], k: usize, out: &mut Q8Rows, q15: bool) {
    let num_tokens = x.len() / k;
    let sized = if q15 {
        out.reset_q15(num_tokens, k)
    } else {
        out.reset(num_tokens, k)
    };
    sized.expect("in_features is a multiple of 32 for repacked weights");
    let (qs, lo, scales, sums) = out.parts_mut();
    let tokens_per_task = 16;
    if num_tokens <= tokens_per_task {
        quantize_slice(isa, x, qs, lo, scales, sums);
        return;
    }
    let values = tokens_per_task * k;
    let blocks = values / Q8_BLOCK;
    // Q8 rows have no `lo` plane: each task gets an empty one.
    let tasks = num_tokens.div_ceil(tokens_per_task);
    let lo: Vec<&mut [i8]> = if q15 {
        lo.chunks_mut(values).collect()
    } else {
        (0..tasks).map(|_| <&mut [i8]>::default()).collect()
    };
    x.par_chunks(values)
        .zip(qs.par_chunks_mut(values))
        .zip(lo.into_par_iter())
        .zip(scales.par_chunks_mut(blocks))
        .zip(sums.par_chunks_mut(blocks))
        .for_each(|((((x, qs), lo), scales), sums)| quantize_slice(isa, x, qs, lo, scales, sums));
}

/// Quantizes whole blocks of `x`: Q8 when `lo` is empty, else Q15 (`qs` the `hi` plane).
fn quantize_slice(
    isa: IntIsa,
    x: &[f32],
    qs: &mut [i8],
    lo: &mut [i8],
    scales: &mut [f32],
    sums: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        if isa != IntIsa::Scalar && IntIsa::Avx2.is_supported() {
            // SAFETY: the CPU supports AVX2 and FMA (checked above).
            unsafe {
                if lo.is_empty() {
                    quantize_slice_avx2::<false>(x, qs, lo, scales, sums)
                } else {
                    quantize_slice_avx2::<true>(x, qs, lo, scales, sums)
                }
            };
            return;
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if isa != IntIsa::Scalar && std::arch::is_aarch64_feature_detected!("neon") {
            // SAFETY: the CPU supports NEON (checked above).
            unsafe {
                if lo.is_empty() {
                    neon::quantize_slice::<false>(x, qs, lo, scales, sums)
                } else {
                    neon::quantize_slice::<true>(x, qs, lo, scales, sums)
                }
            };
            return;
        }
    }
    let _ = isa;
    quantize_slice_portable(x, qs, lo, scales, sums);
}

#[cfg(target_arch = "aarch64")]
mod neon;

#[inline(always)]
fn quantize_slice_portable(
    x: &[f32],
    qs: &mut [i8],
    lo: &mut [i8],
    scales: &mut [f32],
    sums: &mut [f32],
) {
    for (block, ((xs, qs), (scale, sum))) in x
        .chunks_exact(Q8_BLOCK)
        .zip(qs.chunks_exact_mut(Q8_BLOCK))
        .zip(scales.iter_mut().zip(sums.iter_mut()))
        .enumerate()
    {
        let xs = xs.try_into().unwrap();
        (*scale, *sum) = if lo.is_empty() {
            quantize_block(xs, qs.try_into().unwrap())
        } else {
            let lo = &mut lo[block * Q8_BLOCK..(block + 1) * Q8_BLOCK];
            quantize_block_q15(xs, qs.try_into().unwrap(), lo.try_into().unwrap())
        };
    }
}

/// [`quantize_block`] (or, with `Q15`, [`quantize_block_q15`]) per block in AVX2 registers,
/// with its exact operations: the absolute maximum, `d = amax / 127` (`16256`) and `1 / d` in
/// scalar f32, then per value `x * (1 / d)` rounded to the nearest even integer, clamped,
/// converted (exact) and packed to i8 (Q15: `hi = (q + 64) >> 7` and `lo = q - 128 hi`, each
/// packed), and the integers summed. (The portable loop compiled with AVX2 converted one
/// value at a time: 4% of a pp512 run.) `x`, `qs` (and `lo` for Q15) hold whole blocks;
/// `scales`, `sums` one entry per block.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_slice_avx2<const Q15: bool>(
    x: &[f32],
    qs: &mut [i8],
    lo: &mut [i8],
    scales: &mut [f32],
    sums: &mut [f32],
) {
    use std::arch::x86_64::*;
    let blocks = x.len() / Q8_BLOCK;
    assert!(qs.len() == x.len() && scales.len() == blocks && sums.len() == blocks);
    assert!(!Q15 || lo.len() == x.len());
    let limit = if Q15 {
        pagoda_tensor::quant::q8::Q15_MAX as f32
    } else {
        127.0
    };
    let sign = _mm256_set1_ps(-0.0);
    let (low, high) = (_mm256_set1_ps(-limit), _mm256_set1_ps(limit));
    // i32 -> i16 -> i8 packs work per 128-bit lane; this restores the value order.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for block in 0..blocks {
        // SAFETY: block `block` of `x`, `qs` (and `lo`) holds 32 values (asserted above).
        unsafe {
            let src = x.as_ptr().add(block * Q8_BLOCK);
            let values: [__m256; 4] = [
                _mm256_loadu_ps(src),
                _mm256_loadu_ps(src.add(8)),
                _mm256_loadu_ps(src.add(16)),
                _mm256_loadu_ps(src.add(24)),
            ];
            // max(|x|) over the block; `max` of non-NaN values in any order is exact.
            let mut amax = _mm256_andnot_ps(sign, values[0]);
            for value in &values[1..] {
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, *value));
            }
            let quad = _mm_max_ps(
                _mm256_castps256_ps128(amax),
                _mm256_extractf128_ps::<1>(amax),
            );
            let pair = _mm_max_ps(quad, _mm_movehl_ps(quad, quad));
            let amax = _mm_cvtss_f32(_mm_max_ss(pair, _mm_movehdup_ps(pair))).max(0.0);
            let d = amax / limit;
            let inverse = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
            // A loop, not `array::from_fn`: a closure would not inherit the target features.
            let mut ints = [_mm256_setzero_si256(); 4];
            for (int, value) in ints.iter_mut().zip(values) {
                let scaled = _mm256_mul_ps(value, inverse);
                let rounded =
                    _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(scaled);
                *int = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(rounded, low), high));
            }
            let total = _mm256_add_epi32(
                _mm256_add_epi32(ints[0], ints[1]),
                _mm256_add_epi32(ints[2], ints[3]),
            );
            let total = _mm_add_epi32(
                _mm256_castsi256_si128(total),
                _mm256_extracti128_si256::<1>(total),
            );
            let total = _mm_add_epi32(total, _mm_shuffle_epi32::<0b01_00_11_10>(total));
            let total = _mm_cvtsi128_si32(_mm_add_epi32(
                total,
                _mm_shuffle_epi32::<0b10_11_00_01>(total),
            ));
            let at = block * Q8_BLOCK;
            if Q15 {
                let mut highs = ints;
                let mut lows = ints;
                for i in 0..4 {
                    highs[i] =
                        _mm256_srai_epi32::<7>(_mm256_add_epi32(ints[i], _mm256_set1_epi32(64)));
                    lows[i] = _mm256_sub_epi32(ints[i], _mm256_slli_epi32::<7>(highs[i]));
                }
                _mm256_storeu_si256(
                    qs.as_mut_ptr().add(at) as *mut __m256i,
                    pack_bytes(&highs, order),
                );
                _mm256_storeu_si256(
                    lo.as_mut_ptr().add(at) as *mut __m256i,
                    pack_bytes(&lows, order),
                );
            } else {
                _mm256_storeu_si256(
                    qs.as_mut_ptr().add(at) as *mut __m256i,
                    pack_bytes(&ints, order),
                );
            }
            scales[block] = d;
            sums[block] = d * total as f32;
        }
    }
}

/// Packs 32 i32 (each in i8 range) to bytes in value order (`order` undoes the per-lane
/// interleaving of the packs). SAFETY: AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn pack_bytes(
    ints: &[std::arch::x86_64::__m256i; 4],
    order: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let words01 = _mm256_packs_epi32(ints[0], ints[1]);
    let words23 = _mm256_packs_epi32(ints[2], ints[3]);
    _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words01, words23), order)
}

/// `y[t, r] = dot(weights[r], activations[t])`; `y` is `[num_tokens, num_rows]`.
pub fn matmul(isa: IntIsa, weights: &RepackedRows, activations: &Q8Rows, y: &mut [f32]) {
    let n = weights.num_rows();
    let num_tokens = activations.num_rows();
    assert_eq!(
        y.len(),
        n * num_tokens,
        "y must be [num_tokens, out_features]"
    );
    if num_tokens == 1 {
        let rows_per_task = decode_rows_per_task(n);
        y.par_chunks_mut(rows_per_task)
            .enumerate()
            .for_each(|(task, out)| {
                decode_rows(isa, weights, task * rows_per_task, activations, out)
            });
        return;
    }
    super::tasks::by_row_tasks(n, num_tokens, 16, y, |rows| {
        rows_by_tokens(isa, weights, rows, activations)
    });
}

/// Decode (one token, row 0 of `activations`): `out[i] = dot(weights[row_start + i],
/// activations[0])`, four rows per pass (`tile::<4, 1>`), the leftover rows one by one (the
/// same per-row chain, see [`crate::linear::cpu::int_dot`]).
pub fn decode_rows(
    isa: IntIsa,
    weights: &RepackedRows,
    row_start: usize,
    activations: &Q8Rows,
    out: &mut [f32],
) {
    let done = out.len() / 4 * 4;
    let mut quads = out.chunks_exact_mut(4);
    for (quad_index, quad) in (&mut quads).enumerate() {
        let r = row_start + 4 * quad_index;
        let dots = tile::<4, 1>(isa, weights, [r, r + 1, r + 2, r + 3], activations, [0]);
        for (value, dot) in quad.iter_mut().zip(dots) {
            *value = dot[0];
        }
    }
    for (i, value) in quads.into_remainder().iter_mut().enumerate() {
        *value = tile::<1, 1>(isa, weights, [row_start + done + i], activations, [0])[0][0];
    }
}

/// Dots of `rows` with every token, as `[rows.len(), num_tokens]`.
fn rows_by_tokens(
    isa: IntIsa,
    weights: &RepackedRows,
    rows: std::ops::Range<usize>,
    activations: &Q8Rows,
) -> Vec<f32> {
    let num_tokens = activations.num_rows();
    let mut local = vec![0f32; rows.len() * num_tokens];
    let full_rows = rows.start + rows.len() / 4 * 4;
    let full_tokens = num_tokens / 4 * 4;
    // Token-major, as `by_row_tasks` takes it.
    let width = rows.len();
    let mut put = |r: usize, t: usize, value: f32| local[t * width + r - rows.start] = value;
    for t in (0..full_tokens).step_by(4) {
        let tokens = [t, t + 1, t + 2, t + 3];
        for r in (rows.start..full_rows).step_by(4) {
            let block = tile::<4, 4>(isa, weights, [r, r + 1, r + 2, r + 3], activations, tokens);
            for (i, values) in block.iter().enumerate() {
                for (j, &value) in values.iter().enumerate() {
                    put(r + i, t + j, value);
                }
            }
        }
        for r in full_rows..rows.end {
            let block = tile::<1, 4>(isa, weights, [r], activations, tokens);
            for (j, &value) in block[0].iter().enumerate() {
                put(r, t + j, value);
            }
        }
    }
    for t in full_tokens..num_tokens {
        for r in (rows.start..full_rows).step_by(4) {
            let block = tile::<4, 1>(isa, weights, [r, r + 1, r + 2, r + 3], activations, [t]);
            for (i, values) in block.iter().enumerate() {
                put(r + i, t, values[0]);
            }
        }
        for r in full_rows..rows.end {
            put(
                r,
                t,
                tile::<1, 1>(isa, weights, [r], activations, [t])[0][0],
            );
        }
    }
    local
}

thread_local! {
    static SCRATCH: std::cell::Cell<Q8Rows> = std::cell::Cell::new(Q8Rows::default());
}

/// Runs `f` with this thread's reusable activation buffer, so a matmul allocates nothing
/// once the buffer has grown to the largest input seen. The buffer is taken out for the
/// call: a nested call on the same thread (a rayon worker that steals another matmul while
/// it waits) gets a fresh one instead of a conflict.
pub fn with_scratch<R>(f: impl FnOnce(&mut Q8Rows) -> R) -> R {
    let mut rows = SCRATCH.with(|cell| cell.take());
    let result = f(&mut rows);
    SCRATCH.with(|cell| cell.set(rows));
    result
}

// Tests of the AVX2 quantizer only.
#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// The AVX2 quantizer writes the portable one's values, scales and sums bit for bit, on
    /// blocks with ties (values at exact half steps), zeros, a lone maximum and wide ranges.
    #[test]
    fn avx2_quantization_equals_the_portable_loop() {
        #[cfg(target_arch = "x86_64")]
        {
            if !IntIsa::Avx2.is_supported() {
                return;
            }
            let mut state = 0x853C_49E6_748F_EA9Bu64;
            let mut next = || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state
            };
            let mut x = Vec::new();
            for block in 0..400 {
                let scale = 2f32.powi((next() % 30) as i32 - 15);
                for i in 0..Q8_BLOCK {
                    let value = match block % 4 {
                        // Half steps of amax / 127: ties for the rounding.
                        0 => (i as f32 - 15.5) * scale,
                        1 => 0.0,
                        2 if i == 7 => 127.0 * scale,
                        _ => ((next() % 20001) as f32 - 10000.0) / 10000.0 * scale,
                    };
                    x.push(value);
                }
            }
            let blocks = x.len() / Q8_BLOCK;
            let same =
                |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits());
            // Q8 (empty `lo`), then Q15 (the portable loop is `quantize_block_q15` per block).
            for q15 in [false, true] {
                let lo_len = if q15 { x.len() } else { 0 };
                let (mut qs, mut lo, mut scales, mut sums) = (
                    vec![0i8; x.len()],
                    vec![0i8; lo_len],
                    vec![0f32; blocks],
                    vec![0f32; blocks],
                );
                quantize_slice_portable(&x, &mut qs, &mut lo, &mut scales, &mut sums);
                let (mut qs2, mut lo2, mut scales2, mut sums2) = (
                    vec![1i8; x.len()],
                    vec![1i8; lo_len],
                    vec![1f32; blocks],
                    vec![1f32; blocks],
                );
                // SAFETY: AVX2 and FMA checked above; the slices hold whole blocks.
                unsafe {
                    if q15 {
                        quantize_slice_avx2::<true>(
                            &x,
                            &mut qs2,
                            &mut lo2,
                            &mut scales2,
                            &mut sums2,
                        )
                    } else {
                        quantize_slice_avx2::<false>(
                            &x,
                            &mut qs2,
                            &mut lo2,
                            &mut scales2,
                            &mut sums2,
                        )
                    }
                };
                assert_eq!((&qs, &lo), (&qs2, &lo2), "q15 {q15}");
                assert!(same(&scales, &scales2) && same(&sums, &sums2), "q15 {q15}");
                if q15 {
                    // Not the Q8 values: the planes differ from `quantize_block`'s bytes.
                    let mut q8 = vec![0i8; x.len()];
                    quantize_slice_portable(&x, &mut q8, &mut [], &mut scales2, &mut sums2);
                    assert_ne!(q8, qs);
                }
            }
        }
    }
}
