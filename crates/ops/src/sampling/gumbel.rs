//! Gumbel-max: an exact draw from `softmax(z / T)` as `argmax_i ((z_i - z_max) / T + g_i)`
//! with `g_i = -ln(-ln(u_i))` and `u_i` i.i.d. uniform; one pass, no normalisation, no sort.
//!
//! # Arithmetic (vectorised f32)
//!
//! The row is processed in chunks of [`CHUNK`] elements (16 Philox blocks); Philox, the two
//! logarithms ([`ln_f32`], Cephes' `logf` polynomial, about 1e-7 relative) and the scores are
//! branch-free loops over fixed-size arrays that LLVM vectorises (AVX-512 or AVX2 chosen at run
//! time, SSE2 otherwise). Only IEEE `+ - * /` and conversions are used, no fused multiply-add,
//! so every instruction set gives bit-identical noise and therefore the same token.
//!
//! The uniform keeps all 32 bits of its word. `-ln(u)` loses precision near `u = 1`, exactly
//! where the winner's noise lives (for a flat row of `V` tokens the winner has
//! `1 - u ~ 1 / V`), so the upper half of the words uses `v = 1 - u` directly:
//! - `w < 2^31`: `u = (w + 0.5) 2^-32`, `E = -ln(u)`;
//! - `w >= 2^31`: `v = (!w + 0.5) 2^-32`, `E = -log1p(-v)` (Goldberg's
//!   `ln(y) * v / (1 - y)` with `y = 1 - v`, `1 - y` exact; `E = v` once `y` rounds to 1).
//!
//! `g = -ln(E)`. `E` ranges over `[1.16e-10, 22.87]`, so `g` is finite, in about
//! `[-3.13, 22.87]`: the same range as the exact f64 noise of the 32-bit word. No truncation
//! beyond the word's own granularity (the f64 noise's tail `P(g > 22.87) ~ 1.2e-10` per element
//! is cut the same way). (The 23-bit `open_uniform_f32` would cut the tail at 16.6 and, worse,
//! quantise the winner's noise in steps of about `2^-23 V`: at `V = 151936` two tokens share the
//! winning cell about 1.8% of the time and the lowest id wins the tie, a visible bias; that is
//! why it is not used here.) The f32 rounding of the score (`|score| < 32`, ulp `<= 2^-19`) and
//! of `(z - z_max) / T` (relative `2^-23`) perturb the probabilities by a factor
//! `exp(+-3e-6)` at most: far below anything a draw count can detect.

use super::philox::{DrawPurpose, PHILOX_M4X32_0, PHILOX_M4X32_1, PHILOX_W32_0, PHILOX_W32_1};

/// Elements per vectorised chunk (16 Philox blocks of 4 words).
const CHUNK: usize = 64;
/// Philox blocks per chunk.
const CHUNK_BLOCKS: usize = CHUNK / 4;

/// Natural logarithm of a positive, finite, normal f32 (Cephes `logf`: `x = m 2^e`,
/// `m` in `[sqrt(1/2), sqrt(2))`, degree-9 polynomial in `m - 1`, `ln 2` split in two).
/// Branch-free so it vectorises; about 1e-7 relative error.
#[inline(always)]
pub(crate) fn ln_f32(x: f32) -> f32 {
    let bits = x.to_bits() as i32;
    let exponent = (bits >> 23) - 126;
    let mantissa = f32::from_bits(((bits & 0x007F_FFFF) | 0x3F00_0000) as u32);
    let below = mantissa < std::f32::consts::FRAC_1_SQRT_2;
    let exponent = (exponent - below as i32) as f32;
    let m = if below {
        mantissa + mantissa - 1.0
    } else {
        mantissa - 1.0
    };
    let z = m * m;
    let mut y = 7.037_683_6e-2f32;
    y = y * m - 1.151_461e-1;
    y = y * m + 1.167_699_84e-1;
    y = y * m - 1.242_014_1e-1;
    y = y * m + 1.424_932_3e-1;
    y = y * m - 1.666_805_8e-1;
    y = y * m + 2.000_071_4e-1;
    y = y * m - 2.499_999_4e-1;
    y = y * m + 3.333_333e-1;
    y = y * m * z;
    y += -2.121_944_4e-4 * exponent;
    y += -0.5 * z;
    let result = m + y;
    result + 0.693_359_4 * exponent
}

/// The Gumbel noise of one Philox word, as the fused sampler computes it (see the module
/// documentation): finite, in about `[-3.13, 22.87]`, non-decreasing in `word`.
#[inline(always)]
pub fn gumbel_noise(word: u32) -> f32 {
    const SCALE: f32 = 1.0 / 4_294_967_296.0;
    let upper = word >= 0x8000_0000;
    let small = if upper { !word } else { word };
    // `small < 2^31`: the signed conversion is exact in range and vectorises everywhere.
    let tail = ((small as i32) as f32 + 0.5) * SCALE;
    let near_one = 1.0 - tail;
    let log_input = if upper { near_one } else { tail };
    let log = ln_f32(log_input);
    let complement = 1.0 - near_one;
    let denominator = if complement == 0.0 { 1.0 } else { complement };
    let log1p_form = -log * tail / denominator;
    let exponential = if upper {
        if complement == 0.0 {
            tail
        } else {
            log1p_form
        }
    } else {
        -log
    };
    -ln_f32(exponential)
}

/// Upper bound of [`gumbel_noise`] over every word, with slack for rounding: an element whose
/// noiseless score plus this bound is below the best score so far cannot win.
const NOISE_UPPER_BOUND: f32 = 22.9;

/// Slack of the word-based chunk pruning: far above the noise's deviation from monotonicity
/// (2e-5) and the f32 rounding of a score (2e-6).
const PRUNE_SLACK: f32 = 1e-3;

/// Philox-4x32-10 of the 16 consecutive blocks `first_block..first_block + 16` of the draw
/// `(key, step, Gumbel)`, written in element order (`words[4 * b + w]` = word `w` of block
/// `first_block + b`). Structure of arrays over the blocks so the rounds vectorise.
#[inline(always)]
fn philox_chunk(first_block: u32, step: u64, key: [u32; 2], words: &mut [u32; CHUNK]) {
    let mut c0 = [0u32; CHUNK_BLOCKS];
    let mut c1 = [step as u32; CHUNK_BLOCKS];
    let mut c2 = [(step >> 32) as u32; CHUNK_BLOCKS];
    let mut c3 = [DrawPurpose::Gumbel as u32; CHUNK_BLOCKS];
    for (lane, counter) in c0.iter_mut().enumerate() {
        *counter = first_block.wrapping_add(lane as u32);
    }
    let (mut key0, mut key1) = (key[0], key[1]);
    for round in 0..10 {
        if round > 0 {
            key0 = key0.wrapping_add(PHILOX_W32_0);
            key1 = key1.wrapping_add(PHILOX_W32_1);
        }
        for lane in 0..CHUNK_BLOCKS {
            let product0 = PHILOX_M4X32_0 as u64 * c0[lane] as u64;
            let product1 = PHILOX_M4X32_1 as u64 * c2[lane] as u64;
            let next0 = (product1 >> 32) as u32 ^ c1[lane] ^ key0;
            let next2 = (product0 >> 32) as u32 ^ c3[lane] ^ key1;
            c0[lane] = next0;
            c1[lane] = product1 as u32;
            c2[lane] = next2;
            c3[lane] = product0 as u32;
        }
    }
    for lane in 0..CHUNK_BLOCKS {
        words[4 * lane] = c0[lane];
        words[4 * lane + 1] = c1[lane];
        words[4 * lane + 2] = c2[lane];
        words[4 * lane + 3] = c3[lane];
    }
}

/// The largest of 64 values (none NaN), as 16 vertical lanes folded at the end so it
/// vectorises.
#[inline(always)]
fn chunk_maximum(values: &[f32; CHUNK]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    for group in values.chunks_exact(16) {
        for lane in 0..16 {
            lanes[lane] = if group[lane] > lanes[lane] {
                group[lane]
            } else {
                lanes[lane]
            };
        }
    }
    let mut maximum = f32::NEG_INFINITY;
    for lane in lanes {
        maximum = if lane > maximum { lane } else { maximum };
    }
    maximum
}

/// Running winner of the row: best score, lowest index among equal scores.
struct Best {
    score: f32,
    token: Option<u32>,
}

/// What every chunk of one row's draw shares: the row maximum, the temperature, the
/// Philox key and step, and whether chunks that cannot win are skipped.
#[derive(Clone, Copy)]
struct RowDraw {
    z_max: f32,
    inverse_temperature: f32,
    key: [u32; 2],
    step: u64,
    prune: bool,
}

/// Scores one chunk (`logits` padded with `-inf` to [`CHUNK`]) starting at element `start`
/// and folds it into `best`. `cutoff`: skip the chunk if no tempered logit reaches it.
#[inline(always)]
fn score_chunk(logits: &[f32; CHUNK], start: usize, row: &RowDraw, best: &mut Best) {
    let RowDraw {
        z_max,
        inverse_temperature,
        key,
        step,
        prune,
    } = *row;
    let mut tempered = [0f32; CHUNK];
    for index in 0..CHUNK {
        tempered[index] = (logits[index] - z_max) * inverse_temperature;
    }
    let chunk_tempered_max = chunk_maximum(&tempered);
    if chunk_tempered_max == f32::NEG_INFINITY
        || (prune && chunk_tempered_max + NOISE_UPPER_BOUND < best.score)
    {
        return;
    }
    let mut words = [0u32; CHUNK];
    philox_chunk((start / 4) as u32, step, key, &mut words);
    if prune && best.token.is_some() {
        // Every word of the chunk is at most `largest_word`, so (the noise being monotone
        // up to its 1e-5 error) no noise of the chunk exceeds `gumbel_noise(largest_word)`
        // by more than 2e-5: with PRUNE_SLACK to spare, no score can reach the best.
        let largest_word = words.iter().copied().fold(0, u32::max);
        if chunk_tempered_max + gumbel_noise(largest_word) + PRUNE_SLACK < best.score {
            return;
        }
    }
    let mut scores = [0f32; CHUNK];
    for index in 0..CHUNK {
        scores[index] = tempered[index] + gumbel_noise(words[index]);
    }
    let chunk_max = chunk_maximum(&scores);
    if chunk_max == f32::NEG_INFINITY || chunk_max < best.score {
        return;
    }
    let Some(first) = scores.iter().position(|&score| score == chunk_max) else {
        return;
    };
    let token = (start + first) as u32;
    if chunk_max > best.score || best.token.is_none_or(|best_token| token < best_token) {
        best.score = chunk_max;
        best.token = Some(token);
    }
}

/// The whole row: the chunk holding the first row maximum first (it seeds the pruning bound),
/// then every other chunk in order.
#[inline(always)]
fn argmax_row(
    z: &[f32],
    z_max: f32,
    inverse_temperature: f32,
    key: [u32; 2],
    step: u64,
    prune: bool,
) -> Option<u32> {
    let row = RowDraw {
        z_max,
        inverse_temperature,
        key,
        step,
        prune,
    };
    let mut best = Best {
        score: f32::NEG_INFINITY,
        token: None,
    };
    let chunk_count = z.len().div_ceil(CHUNK);
    let load = |chunk: usize| -> [f32; CHUNK] {
        let start = chunk * CHUNK;
        let end = (start + CHUNK).min(z.len());
        let mut padded = [f32::NEG_INFINITY; CHUNK];
        padded[..end - start].copy_from_slice(&z[start..end]);
        padded
    };
    let first_chunk = if prune {
        z.iter()
            .position(|&logit| logit == z_max)
            .map(|i| i / CHUNK)
    } else {
        None
    };
    if let Some(chunk) = first_chunk {
        let logits = load(chunk);
        score_chunk(&logits, chunk * CHUNK, &row, &mut best);
    }
    for chunk in 0..chunk_count {
        if Some(chunk) == first_chunk {
            continue;
        }
        let start = chunk * CHUNK;
        if start + CHUNK <= z.len() {
            let logits: &[f32; CHUNK] = z[start..start + CHUNK].try_into().expect("chunk");
            score_chunk(logits, start, &row, &mut best);
        } else {
            let logits = load(chunk);
            score_chunk(&logits, start, &row, &mut best);
        }
    }
    best.token
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
fn argmax_row_avx512(
    z: &[f32],
    z_max: f32,
    inverse_temperature: f32,
    key: [u32; 2],
    step: u64,
    prune: bool,
) -> Option<u32> {
    argmax_row(z, z_max, inverse_temperature, key, step, prune)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn argmax_row_avx2(
    z: &[f32],
    z_max: f32,
    inverse_temperature: f32,
    key: [u32; 2],
    step: u64,
    prune: bool,
) -> Option<u32> {
    argmax_row(z, z_max, inverse_temperature, key, step, prune)
}

/// True when the AVX-512 kernels may run (F, BW, DQ, VL and FMA detected; cached by std).
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512dq")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("fma")
}

/// True when the AVX2 kernels may run (AVX2 and FMA detected; cached by std).
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}

/// The Gumbel-max draw over one row of (penalised, sanitised) logits `z`.
///
/// Returns `argmax_i ((z_i - z_max) * inverse_temperature + g_i)` (computed in f32, lowest
/// index on exact ties) where `g_i` = [`gumbel_noise`] of word `i % 4` of Philox block `i / 4`
/// of the draw `(key, step, DrawPurpose::Gumbel)`. `inverse_temperature = 1 / T > 0`; `z_max`
/// must be the row maximum (finite). `-inf` entries never win (their score is `-inf`, and the
/// argmax element's score is finite). `None` only when no entry is above `-inf`.
///
/// With `prune`, chunks of 64 elements whose scores cannot reach the best so far even with the
/// largest possible noise are skipped without computing their noise, and so are chunks whose
/// largest Philox word gives too little noise (one scalar noise per chunk instead of 64; on a
/// typical row most chunks end there once a good score is known); the result is identical
/// to the unpruned pass (a test checks it) because the noise of every element is fixed by its
/// counter, not by the order of evaluation.
pub fn gumbel_argmax(
    z: &[f32],
    z_max: f32,
    inverse_temperature: f64,
    key: [u32; 2],
    step: u64,
    prune: bool,
) -> Option<u32> {
    let inverse_temperature = inverse_temperature as f32;
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx512() {
            // SAFETY: the features the function enables were detected just above.
            return unsafe { argmax_row_avx512(z, z_max, inverse_temperature, key, step, prune) };
        }
        if has_avx2() {
            // SAFETY: as above.
            return unsafe { argmax_row_avx2(z, z_max, inverse_temperature, key, step, prune) };
        }
    }
    argmax_row(z, z_max, inverse_temperature, key, step, prune)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ln_f32` against f64 `ln` on positive normals: within 2e-7 relative (1e-7 absolute near 1).
    #[test]
    fn ln_f32_is_accurate() {
        let mut bits = 0x0080_0000u32; // smallest normal
        while bits < 0x7F80_0000 {
            let x = f32::from_bits(bits);
            let exact = (x as f64).ln();
            let error = (ln_f32(x) as f64 - exact).abs();
            assert!(
                error <= 2e-7 * exact.abs().max(0.5),
                "x {x:e}: error {error:e}"
            );
            bits += 9973;
        }
    }

    /// The f32 noise against the exact f64 noise of the same 32-bit word: within 1e-5 absolute
    /// everywhere, both extremes included.
    #[test]
    fn noise_matches_the_f64_definition() {
        let exact = |word: u32| {
            let u = (word as f64 + 0.5) / 4_294_967_296.0;
            -(-u.ln()).ln()
        };
        let mut worst = 0.0f64;
        let words = (0..=u32::MAX)
            .step_by(65_521)
            .chain(0..2000)
            .chain(u32::MAX - 2000..=u32::MAX)
            .chain(0x7FFF_F000..0x8000_1000);
        for word in words {
            worst = worst.max((gumbel_noise(word) as f64 - exact(word)).abs());
        }
        assert!(worst < 1e-5, "worst absolute error {worst:e}");
    }
}
