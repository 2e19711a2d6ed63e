//! Row-interleaved integer matmul (the `vnni8` kernel set): eight weight rows per group, one
//! i32 lane per row, so a block's integer dot ends as one exact integer per (row, token) with
//! no horizontal sum, and the block's float combine is one vector operation per eight rows
//! instead of one per row (1.4-1.9x the per-row VNNI tiles of [`crate::linear::cpu::int_dot`];
//! `docs/benchmark_results/cpu-interleaved-vnni8-epyc-2026-11-30.md`).
//!
//! Layout ([`Interleaved`]): for each group of 8 rows (the last padded with zero rows) and
//! each 32-value block, the weight bytes as `vpdpbusd` wants them: step `k` holds, for rows
//! 0..8 in turn, the 4 bytes that meet activation bytes `4k..4k + 4`. Nibble blocks keep the
//! repacked order (`u[j] | u[j + 16] << 4`): 4 steps of 32 bytes whose low nibbles meet
//! activation dword `k` and high nibbles dword `k + 4`. Byte blocks: 8 steps of 32 bytes (repacked
//! bytes of at most 4 bits, Q3_K, become nibbles; of 5-6 bits, a nibble and bit planes, see
//! [`planes`]).
//! After the weights, the block's 8 scales then 8 mins (f16 bits or f32, as stored; formats
//! without mins store zeros, 2 bytes more per Q4_0 or Q8_0 block than the repacked rows).
//! Formats with sub-scales (Q6_K, Q3_K, see [`pagoda_tensor::quant::repack`]) have no mins: their
//! 16 bytes hold the 8 rows' first-half sub-scales, then their second-half ones (i8). The
//! K-quants (Q4_K, Q5_K) keep their factors as stored ([`SuperFactors`]): the record ends in
//! the 8 rows' 6-bit scales `sc`, then their mins `m` (a byte each), and a separate array
//! holds per group and super-block (8 blocks) the rows' f16 `d`, then their `dmin`; the
//! kernels rebuild `d * sc` and `-(dmin * m)` in registers, the f32 values the repacked rows
//! hold (so the same bits), from 18.5 bytes per row and block instead of 24 (Q4_K).
//!
//! [`SuperFactors`]: pagoda_tensor::quant::repack::SuperFactors
//!
//! Numerics: each (row, token) pair computes exactly [`dot_scalar`]'s chain: per block the
//! exact integer `sum (u - zero) qa`, then `total += d * d_a * integer + min * s_a` in f32,
//! blocks in order, no fused multiply-add. So the result equals the scalar kernel bit for bit,
//! whatever the tile shape. Q15 activation rows ([`pagoda_tensor::quant::q8`]) run the dots
//! twice per block, `128 (u . hi)` then `+ (u . lo)` on top: the same exact integer as the
//! scalar kernel's. With sub-scales, steps 0..4 (values 0..16) and 4..8 accumulate apart,
//! each from its own start, and the block integer is `s0 * first + s1 * second` (`vpmulld`).
//!
//! [`dot_scalar`]: pagoda_tensor::quant::repack::dot_scalar

use pagoda_tensor::quant::q8::Q8Rows;

use crate::linear::cpu::tasks::Columns;
use rayon::prelude::*;

mod layout;
pub mod planes;
mod wide;
pub mod width;
pub use layout::{Interleaved, SUPER_BYTES};
pub(crate) use width::count_decode as count_wide_decode;
pub use width::{
    wide_decode_count, wide_prefill_count, IntDecode, IntPrefill, INT_DECODE_ENV_VAR,
    INT_PREFILL_ENV_VAR,
};

/// Rows per group.
pub const GROUP: usize = 8;

/// The factor layouts of a record, the kernels' `FACTORS` parameter: f32 scales and mins.
#[cfg(target_arch = "x86_64")]
pub(crate) const F32_FACTORS: u8 = 0;
/// f16 scales and mins.
#[cfg(target_arch = "x86_64")]
pub(crate) const HALF_FACTORS: u8 = 1;
/// f16 scales and the sub-scales (Q6_K, Q3_K).
#[cfg(target_arch = "x86_64")]
pub(crate) const SUB_FACTORS: u8 = 2;
/// The K-quants' stored factors (bytes in the record, `d`/`dmin` per super-block apart).
#[cfg(target_arch = "x86_64")]
pub(crate) const KQUANT_FACTORS: u8 = 3;
/// f16 scales and mins, sub-scales and sub-mins (Q2_K).
#[cfg(target_arch = "x86_64")]
pub(crate) const SUBMIN_FACTORS: u8 = 4;

/// `$kernel::<NIBBLE, FACTORS, Q15, PLANES>` for `$weights`' layout and `$q15`.
#[cfg(target_arch = "x86_64")]
macro_rules! for_layout {
    ($($kernel:ident)::+, $weights:expr, $q15:expr) => {
        for_layout!(@with [] $($kernel)::+, $weights, $q15)
    };
    (@tile $t:literal, $($kernel:ident)::+, $weights:expr, $q15:expr) => {
        for_layout!(@with [$t,] $($kernel)::+, $weights, $q15)
    };
    (@with [$($t:tt)*] $($kernel:ident)::+, $weights:expr, $q15:expr) => {{
        macro_rules! arms {
            ($q:literal) => {
                match ($weights.nibble, $weights.factor_layout(), $weights.planes) {
                    (true, F32_FACTORS, 0) => $($kernel)::+::<$($t)* true, F32_FACTORS, $q, 0>,
                    (true, HALF_FACTORS, 0) => $($kernel)::+::<$($t)* true, HALF_FACTORS, $q, 0>,
                    (true, KQUANT_FACTORS, 0) => {
                        $($kernel)::+::<$($t)* true, KQUANT_FACTORS, $q, 0>
                    }
                    (true, HALF_FACTORS, 1) => $($kernel)::+::<$($t)* true, HALF_FACTORS, $q, 1>,
                    (true, KQUANT_FACTORS, 1) => {
                        $($kernel)::+::<$($t)* true, KQUANT_FACTORS, $q, 1>
                    }
                    (true, SUB_FACTORS, 0) => $($kernel)::+::<$($t)* true, SUB_FACTORS, $q, 0>,
                    (true, SUBMIN_FACTORS, 0) => {
                        $($kernel)::+::<$($t)* true, SUBMIN_FACTORS, $q, 0>
                    }
                    (true, SUB_FACTORS, 2) => $($kernel)::+::<$($t)* true, SUB_FACTORS, $q, 2>,
                    (false, F32_FACTORS, 0) => $($kernel)::+::<$($t)* false, F32_FACTORS, $q, 0>,
                    (false, HALF_FACTORS, 0) => $($kernel)::+::<$($t)* false, HALF_FACTORS, $q, 0>,
                    (false, SUB_FACTORS, 0) => $($kernel)::+::<$($t)* false, SUB_FACTORS, $q, 0>,
                    (false, KQUANT_FACTORS, 0) => {
                        $($kernel)::+::<$($t)* false, KQUANT_FACTORS, $q, 0>
                    }
                    (nibble, factors, planes) => unreachable!(
                        "no layout of nibble {nibble}, factors {factors}, planes {planes}"
                    ),
                }
            };
        }
        if $q15 {
            arms!(true)
        } else {
            arms!(false)
        }
    }};
}

/// Whether this CPU runs the interleaved kernel (AVX-512 VNNI with VL and BW, F16C).
pub fn is_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // AVX-512 BW for the bit planes' masked byte adds (every VNNI CPU has it).
        crate::linear::cpu::int_dot::IntIsa::Vnni.is_supported()
            && is_x86_feature_detected!("avx512bw")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `y[t, r] = dot(weights[r], activations[t])` (`y` is `[num_tokens, num_rows]`), equal bit
/// for bit to [`pagoda_tensor::quant::repack::dot_scalar`] for every pair. Panics if the
/// CPU lacks the features ([`is_supported`]) or the shapes disagree.
pub fn matmul(weights: &Interleaved, activations: &Q8Rows, y: &mut [f32]) {
    assert!(is_supported(), "the interleaved kernel needs AVX-512 VNNI");
    assert_eq!(weights.blocks_per_row, activations.blocks_per_row());
    let (rows, tokens) = (weights.num_rows, activations.num_rows());
    assert_eq!(
        y.len(),
        rows * tokens,
        "y must be [num_tokens, out_features]"
    );
    let starts = block_starts(weights, activations);
    crate::linear::cpu::prefetch::count_matmul();
    if weights.planes > 0 {
        planes::count_matmul();
    }
    if tokens == 1 {
        // Decode: each task writes its rows straight into `y` (whole pairs of groups).
        width::count_decode();
        let rows_per_task = super::tasks::decode_rows_per_task(rows).next_multiple_of(2 * GROUP);
        y.par_chunks_mut(rows_per_task)
            .enumerate()
            .for_each(|(task, out)| {
                decode_rows(weights, task * rows_per_task, activations, &starts, out)
            });
        return;
    }
    // Prefill: two groups per task, all tokens, merged by `by_row_tasks`.
    let wide = IntPrefill::selected() == IntPrefill::Avx512;
    if wide {
        width::count_prefill();
    }
    crate::linear::cpu::tasks::by_row_tasks_in_place(rows, tokens, 2 * GROUP, y, |range, out| {
        if wide && range.len() == 2 * GROUP {
            let group = range.start / GROUP;
            pair_tile_dots(weights, group, activations, &starts, out, range.start);
            return;
        }
        for index in 0..range.len().div_ceil(GROUP) {
            let group = range.start / GROUP + index;
            group_dots(weights, group, activations, &starts, out, group * GROUP);
        }
    });
}

/// The dots of groups `group` and `group + 1` (both whole) with every token, at `out`'s
/// columns `col..col + 16`: four tokens at a time on the 512-bit kernel, then one.
fn pair_tile_dots(
    weights: &Interleaved,
    group: usize,
    activations: &Q8Rows,
    starts: &[i32],
    out: &mut Columns,
    col: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if weights.planes > 0 {
        // The planes unpacked once for all the tokens, not once per tile.
        let bytes = weights.groups_as_bytes(group, 2);
        return pair_tile_dots(&bytes, 0, activations, starts, out, col);
    }
    let tokens = activations.num_rows();
    let mut t = 0;
    while t < tokens {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `matmul` checked the features; both groups and the tokens are in range,
        // and `starts` is empty or holds the starts of every (token, block).
        unsafe {
            if t + 4 <= tokens {
                let dots =
                    for_layout!(@tile 4, wide::x86::pair_tile, weights, activations.is_q15());
                let dots = dots(
                    weights,
                    group,
                    activations,
                    starts,
                    [t, t + 1, t + 2, t + 3],
                );
                for (i, values) in dots.iter().enumerate() {
                    out.put(t + i, col, values);
                }
                t += 4;
            } else {
                let dots =
                    for_layout!(@tile 1, wide::x86::pair_tile, weights, activations.is_q15());
                out.put(t, col, &dots(weights, group, activations, starts, [t])[0]);
                t += 1;
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (weights, group, starts, &out, col);
            t += 1;
        }
    }
}

/// `-zero * sum(q)` per (token, block) of `activations` (Q15: `q = 128 hi + lo`): the exact
/// integer start of each block's dot (empty when the format's zero is 0); in parallel over
/// tokens for prefills. With sub-scales, one start per half block (16 values): two per
/// (token, block). With sub-mins (Q2_K, zero 0), the half blocks' sums `sum(q)`, which the
/// min integer takes.
pub fn block_starts(weights: &Interleaved, activations: &Q8Rows) -> Vec<i32> {
    // Sub-mins (zero 0): the half sums themselves, `sum(q)` per 16 values.
    let factor = if weights.submin { 1 } else { -weights.zero };
    if factor == 0 {
        return Vec::new();
    }
    let span = if weights.sub { 16 } else { 32 };
    let mut starts = vec![0i32; activations.qs().len() / span];
    let sum = |qa: &[i8]| qa.iter().map(|&q| q as i32).sum::<i32>();
    if activations.is_q15() {
        starts
            .par_iter_mut()
            .zip(activations.qs().par_chunks_exact(span))
            .zip(activations.lo().par_chunks_exact(span))
            .with_min_len(1024)
            .for_each(|((start, hi), lo)| *start = factor * (128 * sum(hi) + sum(lo)));
    } else {
        starts
            .par_iter_mut()
            .zip(activations.qs().par_chunks_exact(span))
            .with_min_len(1024)
            .for_each(|(start, qa)| *start = factor * sum(qa));
    }
    starts
}

/// Decode (one token, row 0 of `activations`): `out[i] = dot(weights[row_start + i],
/// activations[0])` for `out.len()` rows from `row_start`, a multiple of [`GROUP`]; `starts`
/// from [`block_starts`]. The same bits as [`matmul`].
pub fn decode_rows(
    weights: &Interleaved,
    row_start: usize,
    activations: &Q8Rows,
    starts: &[i32],
    out: &mut [f32],
) {
    assert!(is_supported(), "the interleaved kernel needs AVX-512 VNNI");
    assert!(row_start.is_multiple_of(GROUP) && row_start + out.len() <= weights.num_rows);
    assert_eq!(activations.num_rows(), 1, "decode takes one token");
    let wide = IntDecode::selected() == IntDecode::Avx512;
    let mut lanes = [0f32; GROUP];
    let mut done = 0;
    while done < out.len() {
        let group = (row_start + done) / GROUP;
        if wide && done + 2 * GROUP <= out.len() {
            // Two whole groups: 16 rows per 512-bit register, the same bits.
            out[done..done + 2 * GROUP].copy_from_slice(&pair_dots(
                weights,
                group,
                activations,
                starts,
            ));
            done += 2 * GROUP;
            continue;
        }
        let end = (done + GROUP).min(out.len());
        let chunk = &mut out[done..end];
        group_dots(
            weights,
            group,
            activations,
            starts,
            &mut Columns::all(&mut lanes, GROUP),
            0,
        );
        chunk.copy_from_slice(&lanes[..chunk.len()]);
        done += chunk.len();
    }
}

/// The 16 dots of groups `group` and `group + 1` (both inside the matrix) with token 0: the
/// 512-bit kernel of [`wide`], equal to two [`group_dots`] calls bit for bit.
fn pair_dots(
    weights: &Interleaved,
    group: usize,
    activations: &Q8Rows,
    starts: &[i32],
) -> [f32; 2 * GROUP] {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `decode_rows` checked the features; both groups are in range, and `starts` is
    // empty or holds one start per block of the single token.
    unsafe {
        let dots = for_layout!(wide::x86::pair, weights, activations.is_q15());
        dots(weights, group, activations, starts)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (weights, group, activations, starts);
        [0.0; 2 * GROUP]
    }
}

/// The dots of one group's rows with every token, token `t`'s at `out`'s columns `col..`
/// for the group's rows inside the matrix (the last group's padding lanes are not written).
fn group_dots(
    weights: &Interleaved,
    group: usize,
    activations: &Q8Rows,
    starts: &[i32],
    out: &mut Columns,
    col: usize,
) {
    let lanes = GROUP.min(weights.num_rows - group * GROUP);
    #[cfg(target_arch = "x86_64")]
    if weights.planes > 0 && activations.num_rows() > 1 {
        // Several tokens: the planes unpacked once for all of them, not once per tile.
        let bytes = weights.groups_as_bytes(group, 1);
        return group_dots(&bytes, 0, activations, starts, out, col);
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `matmul` checked the features; the group is in range, and `starts` is empty
    // or holds one start per (token, block).
    unsafe {
        let dots = for_layout!(x86::group, weights, activations.is_q15());
        dots(weights, group, activations, starts, out, col, lanes)
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (weights, group, activations, starts, out, col, lanes);
}

#[cfg(target_arch = "x86_64")]
mod x86;
