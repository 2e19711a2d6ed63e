//! Batch-invariant f32 dot-product tiles: `R` weight rows by `T` activation rows.
//!
//! Every output element `dot(w, x)` over `k` values is computed by one fixed recipe, whatever
//! the tile shape, the number of rows or tokens in the call, or whether the weight row was
//! decoded whole (prefill) or in [`DECODE_CHUNK`]-value pieces (decode):
//!
//! 1. one 8-lane accumulator starting at zero; for `i` in `0, 8, .. k / 8 * 8` (in order),
//!    `acc[l] = w[i + l] * x[i + l] + acc[l]` (a fused multiply-add with AVX2+FMA on x86-64
//!    and with NEON on aarch64, `f32_tile/neon.rs`, the same bits; a multiply then an add in
//!    the portable path; the choice is per process, see [`fused`]);
//! 2. the lanes reduced as `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`;
//! 3. the `k % 8` tail values added one by one, in order, as `sum + w * x` (multiply, then add).
//!
//! Quantized weights are decoded with [`pagoda_tensor::quant::dequantize`], whose values are
//! exact functions of the stored bytes, so decoding whole rows or chunks gives the same
//! values. Hence a row of a matmul is bit-identical whatever else shares the call.

use pagoda_tensor::{quant, GgmlType};

/// Lanes of one accumulator.
pub const LANES: usize = 8;

/// Values decoded per weight row at a time by [`quantized_tile`]: a multiple of every block
/// size (32 and 256) and of [`LANES`].
pub const DECODE_CHUNK: usize = 256;

/// `out[r][t] = dot(weights[r], activations[t])` by the module's recipe. All slices must have
/// the same length (panics otherwise: a caller bug).
#[inline]
pub fn tile<const R: usize, const T: usize>(
    weights: [&[f32]; R],
    activations: [&[f32]; T],
) -> [[f32; T]; R] {
    let k = activations.first().map_or(0, |x| x.len());
    assert!(
        weights.iter().all(|w| w.len() == k) && activations.iter().all(|x| x.len() == k),
        "tile: rows of different lengths"
    );
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx2_fma() {
            // SAFETY: the CPU supports AVX2 and FMA (checked above); lengths checked.
            return unsafe { x86::tile(weights, activations) };
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if fused() {
            // SAFETY: the CPU supports NEON (checked above); lengths checked.
            return unsafe { neon::tile(weights, activations) };
        }
    }
    let mut acc = [[[0f32; LANES]; T]; R];
    let full = k / LANES * LANES;
    accumulate_portable(&mut acc, weights, activations, 0, full);
    finish(&acc_sums_portable(&acc), weights, activations, full)
}

/// `out[r] = dot(decode(rows[r]), x)` for `R` stored rows of type `ty`, by the module's
/// recipe: with AVX2 the block formats are decoded one block of every row at a time (the
/// block decoders inlined, no buffer beyond one block per row); otherwise (and for F16/BF16)
/// each row is decoded [`DECODE_CHUNK`] values at a time into a stack buffer. Either way the
/// result equals [`tile`] of the dequantized rows, bit for bit.
///
/// Panics if `ty` cannot be decoded or a row does not hold exactly `ty.bytes_for(x.len())`
/// bytes (weights are validated at load; either is a caller bug).
#[inline]
pub fn quantized_tile<const R: usize>(ty: GgmlType, rows: [&[u8]; R], x: &[f32]) -> [f32; R] {
    let k = x.len();
    assert!(
        ty.is_dequantizable(),
        "quantized_tile: {ty} cannot be decoded"
    );
    assert!(
        rows.iter().all(|row| ty.bytes_for(k) == Some(row.len())),
        "quantized_tile: {ty} rows must hold {k} values"
    );
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx2_fma() {
            // SAFETY: the CPU supports AVX2, FMA and F16C (checked above); lengths checked.
            return unsafe { x86::quantized_tile(ty, rows, x) };
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if fused() {
            // SAFETY: the CPU supports NEON (checked above); lengths checked.
            return unsafe { neon::quantized_tile(ty, rows, x) };
        }
    }
    let mut acc = [[[0f32; LANES]; 1]; R];
    let mut buffer = [[0f32; DECODE_CHUNK]; R];
    let full = k / LANES * LANES;
    let mut tail = [0f32; R];
    for start in (0..k).step_by(DECODE_CHUNK) {
        let end = (start + DECODE_CHUNK).min(k);
        for (row, values) in rows.iter().zip(buffer.iter_mut()) {
            decode_range(ty, row, start, end, &mut values[..end - start]);
        }
        let weights: [&[f32]; R] = std::array::from_fn(|r| &buffer[r][..end - start]);
        let chunk_full = full.min(end) - start;
        accumulate_portable(&mut acc, weights, [&x[start..end]], 0, chunk_full);
        if end == k {
            let sums = acc_sums_portable(&acc);
            let local = finish(&sums, weights, [&x[start..end]], chunk_full);
            tail = std::array::from_fn(|r| local[r][0]);
        }
    }
    tail
}

/// Decodes values `start..end` of a stored row (both multiples of the block size, or `end`
/// the row's end) into `out`.
#[inline(always)]
fn decode_range(ty: GgmlType, row: &[u8], start: usize, end: usize, out: &mut [f32]) {
    let byte_start = ty
        .bytes_for(start)
        .expect("chunk starts on a block boundary");
    let byte_end = ty.bytes_for(end).expect("chunk ends on a block boundary");
    quant::dequantize(ty, &row[byte_start..byte_end], out).expect("type checked by the caller");
}

/// Step 1 of the recipe over values `from..to` (multiples of [`LANES`]).
#[inline(always)]
fn accumulate_portable<const R: usize, const T: usize>(
    acc: &mut [[[f32; LANES]; T]; R],
    weights: [&[f32]; R],
    activations: [&[f32]; T],
    from: usize,
    to: usize,
) {
    for i in (from..to).step_by(LANES) {
        for t in 0..T {
            let x: &[f32; LANES] = activations[t][i..i + LANES].try_into().unwrap();
            for r in 0..R {
                let w: &[f32; LANES] = weights[r][i..i + LANES].try_into().unwrap();
                for l in 0..LANES {
                    acc[r][t][l] += w[l] * x[l];
                }
            }
        }
    }
}

fn acc_sums_portable<const R: usize, const T: usize>(
    acc: &[[[f32; LANES]; T]; R],
) -> [[f32; T]; R] {
    std::array::from_fn(|r| std::array::from_fn(|t| reduce_lanes(&acc[r][t])))
}

/// Activation rows in pairs for [`tile_pairs`]: for each pair of tokens and each step of
/// [`LANES`] values, the two tokens' pieces side by side (16 floats), so one 512-bit register
/// holds two (row, token) accumulators of the recipe. A last odd token is left out.
pub struct TokenPairs {
    full: usize,
    data: Vec<f32>,
}

impl TokenPairs {
    /// Lays out `x` (`[tokens, k]`) in pairs.
    pub fn new(x: &[f32], k: usize) -> TokenPairs {
        let full = k / LANES * LANES;
        let tokens = x.len().checked_div(k).unwrap_or(0);
        let mut data = Vec::with_capacity(tokens / 2 * 2 * full);
        for pair in x.chunks_exact(2 * k) {
            let (first, second) = pair.split_at(k);
            for (a, b) in first[..full]
                .chunks_exact(LANES)
                .zip(second[..full].chunks_exact(LANES))
            {
                data.extend_from_slice(a);
                data.extend_from_slice(b);
            }
        }
        TokenPairs { full, data }
    }
}

static PAIR_MATMULS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many f32 prefill matmuls ran on [`tile_pairs`] in this process (metrics, tests).
pub fn pair_matmul_count() -> u64 {
    PAIR_MATMULS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Counts one matmul for [`pair_matmul_count`].
pub(crate) fn count_pair_matmul() {
    PAIR_MATMULS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// Whether [`tile_pairs`] runs here (AVX-512F/DQ beside AVX2 and FMA).
pub fn pairs_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            has_avx2_fma()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512dq")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// [`tile`] of `R` weight rows and the four tokens `2 pair .. 2 pair + 4` (`x` holds those
/// four rows, for the recipe's tail), with two tokens' 8-lane accumulators per 512-bit
/// register: the same fused multiply-adds per lane in the same order, so the same bits as
/// `tile(weights, x)`. Panics unless [`pairs_supported`] and the shapes agree.
pub fn tile_pairs<const R: usize>(
    weights: [&[f32]; R],
    pairs: &TokenPairs,
    pair: usize,
    x: [&[f32]; 4],
) -> [[f32; 4]; R] {
    let k = x[0].len();
    assert!(
        pairs_supported()
            && pairs.full == k / LANES * LANES
            && (pair + 2) * 2 * pairs.full <= pairs.data.len()
            && weights.iter().all(|w| w.len() == k)
            && x.iter().all(|x| x.len() == k),
        "tile_pairs: shapes or CPU"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F/DQ, AVX2 and FMA are present and the lengths were checked above.
    unsafe {
        x86::tile_pairs(weights, pairs, pair, x)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("pairs_supported is false off x86-64")
}

/// Step 2 of the recipe; also the order of the VNNI kernels' `horizontal_sum`, which the AMX
/// tiles reproduce with it.
#[inline(always)]
pub(crate) fn reduce_lanes(l: &[f32; LANES]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// Step 3 of the recipe: adds the values from `full` on to the reduced sums.
#[inline(always)]
fn finish<const R: usize, const T: usize>(
    sums: &[[f32; T]; R],
    weights: [&[f32]; R],
    activations: [&[f32]; T],
    full: usize,
) -> [[f32; T]; R] {
    std::array::from_fn(|r| {
        std::array::from_fn(|t| {
            let mut sum = sums[r][t];
            for (w, x) in weights[r][full..].iter().zip(&activations[t][full..]) {
                sum += w * x;
            }
            sum
        })
    })
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// Step 1 over values `from..to` (multiples of [`LANES`]) of every slice.
    /// SAFETY (caller): AVX2+FMA; every slice holds at least `to` values.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn accumulate<const R: usize, const T: usize>(
        acc: &mut [[__m256; T]; R],
        weights: [&[f32]; R],
        activations: [&[f32]; T],
        from: usize,
        to: usize,
    ) {
        let mut w = [std::ptr::null::<f32>(); R];
        for r in 0..R {
            w[r] = weights[r].as_ptr();
        }
        let mut x = [std::ptr::null::<f32>(); T];
        for t in 0..T {
            x[t] = activations[t].as_ptr();
        }
        let mut i = from;
        while i < to {
            // SAFETY: i + LANES <= to <= every slice's length.
            unsafe {
                let mut wv = [_mm256_setzero_ps(); R];
                for r in 0..R {
                    wv[r] = _mm256_loadu_ps(w[r].add(i));
                }
                for t in 0..T {
                    let xv = _mm256_loadu_ps(x[t].add(i));
                    for r in 0..R {
                        acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
                    }
                }
            }
            i += LANES;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn sums<const R: usize, const T: usize>(acc: &[[__m256; T]; R]) -> [[f32; T]; R] {
        let mut out = [[0f32; T]; R];
        for r in 0..R {
            for t in 0..T {
                let mut lanes = [0f32; LANES];
                // SAFETY: lanes has room for 8 floats.
                unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r][t]) };
                out[r][t] = reduce_lanes(&lanes);
            }
        }
        out
    }

    /// See [`super::tile`]. SAFETY (caller): AVX2+FMA; all slices have one length.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile<const R: usize, const T: usize>(
        weights: [&[f32]; R],
        activations: [&[f32]; T],
    ) -> [[f32; T]; R] {
        let k = activations.first().map_or(0, |x| x.len());
        let full = k / LANES * LANES;
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        // SAFETY: every slice holds k >= full values.
        unsafe { accumulate(&mut acc, weights, activations, 0, full) };
        finish(&sums(&acc), weights, activations, full)
    }

    /// See [`super::tile_pairs`]. SAFETY (caller): AVX-512F/DQ, AVX2, FMA; shapes checked.
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
    pub(super) unsafe fn tile_pairs<const R: usize>(
        weights: [&[f32]; R],
        pairs: &TokenPairs,
        pair: usize,
        x: [&[f32]; 4],
    ) -> [[f32; 4]; R] {
        let full = pairs.full;
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        // SAFETY: pairs `pair` and `pair + 1` hold 2 * full floats each; rows hold k >= full.
        unsafe {
            let first = pairs.data.as_ptr().add(pair * 2 * full);
            let second = first.add(2 * full);
            let mut i = 0;
            while i < full {
                let (xa, xb) = (
                    _mm512_loadu_ps(first.add(2 * i)),
                    _mm512_loadu_ps(second.add(2 * i)),
                );
                for r in 0..R {
                    let w = _mm512_broadcast_f32x8(_mm256_loadu_ps(weights[r].as_ptr().add(i)));
                    acc[r][0] = _mm512_fmadd_ps(w, xa, acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(w, xb, acc[r][1]);
                }
                i += LANES;
            }
        }
        let mut sums = [[0f32; 4]; R];
        for r in 0..R {
            for (half, value) in acc[r].iter().enumerate() {
                let mut lanes = [0f32; 2 * LANES];
                // SAFETY: lanes has room for 16 floats.
                unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), *value) };
                sums[r][2 * half] = reduce_lanes(lanes[..LANES].try_into().unwrap());
                sums[r][2 * half + 1] = reduce_lanes(lanes[LANES..].try_into().unwrap());
            }
        }
        finish(&sums, weights, x, full)
    }

    /// See [`super::quantized_tile`]. SAFETY (caller): AVX2+FMA+F16C; row lengths checked.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantized_tile<const R: usize>(
        ty: GgmlType,
        rows: [&[u8]; R],
        x: &[f32],
    ) -> [f32; R] {
        // Block formats: one block of every row decoded into registers/L1 at a time (the
        // decoders inline here), then accumulated; the values are those `dequantize` writes.
        // SAFETY (all arms): the features are enabled here; row lengths were checked.
        unsafe {
            match ty {
                GgmlType::Q8_0 => return by_blocks_q8_0(rows, x),
                GgmlType::Q4_0 => return by_blocks_q4_0(rows, x),
                GgmlType::Q4_1 => return by_blocks_q4_1(rows, x),
                GgmlType::Q5_0 => return by_blocks_q5_0(rows, x),
                GgmlType::Q5_1 => return by_blocks_q5_1(rows, x),
                GgmlType::Q4K => return by_blocks_q4_k(rows, x),
                GgmlType::Q5K => return by_blocks_q5_k(rows, x),
                GgmlType::Q6K => return by_blocks_q6_k(rows, x),
                _ => {}
            }
        }
        let k = x.len();
        let full = k / LANES * LANES;
        let mut acc = [[_mm256_setzero_ps(); 1]; R];
        let mut buffer = [[0f32; DECODE_CHUNK]; R];
        let mut out = [0f32; R];
        for start in (0..k).step_by(DECODE_CHUNK) {
            let end = (start + DECODE_CHUNK).min(k);
            for (row, values) in rows.iter().zip(buffer.iter_mut()) {
                decode_range(ty, row, start, end, &mut values[..end - start]);
            }
            let weights: [&[f32]; R] = std::array::from_fn(|r| &buffer[r][..end - start]);
            let chunk_full = full.min(end) - start;
            // SAFETY: every slice holds end - start >= chunk_full values.
            unsafe { accumulate(&mut acc, weights, [&x[start..end]], 0, chunk_full) };
            if end == k {
                let local = finish(&sums(&acc), weights, [&x[start..end]], chunk_full);
                out = std::array::from_fn(|r| local[r][0]);
            }
        }
        out
    }

    /// `$name::<R>(rows, x)`: `out[r] = dot(decode(rows[r]), x)` one block (`$values`
    /// values, a multiple of [`LANES`]) at a time with the block decoder `$decode` (inlined:
    /// a direct call, not a function value). SAFETY (caller): AVX2+FMA+F16C; every row holds
    /// `x.len() / $values` blocks of `$bytes` bytes and `x.len()` is a multiple of `$values`.
    macro_rules! by_blocks_fn {
        ($name:ident, $decode:path, $bytes:expr, $values:expr) => {
            #[target_feature(enable = "avx2,fma,f16c")]
            pub(super) unsafe fn $name<const R: usize>(rows: [&[u8]; R], x: &[f32]) -> [f32; R] {
                const BYTES: usize = $bytes;
                const VALUES: usize = $values;
                let mut acc = [[_mm256_setzero_ps(); 1]; R];
                let mut values = [[0f32; VALUES]; R];
                for (block, xs) in x.chunks_exact(VALUES).enumerate() {
                    for r in 0..R {
                        let bytes: &[u8; BYTES] = rows[r][block * BYTES..(block + 1) * BYTES]
                            .try_into()
                            .unwrap();
                        $decode(bytes, &mut values[r]);
                    }
                    let mut weights: [&[f32]; R] = [&[]; R];
                    for r in 0..R {
                        weights[r] = &values[r];
                    }
                    // SAFETY: every slice holds VALUES values, a multiple of LANES.
                    unsafe { accumulate(&mut acc, weights, [xs], 0, VALUES) };
                }
                let sums = sums(&acc);
                let mut out = [0f32; R];
                for r in 0..R {
                    out[r] = sums[r][0];
                }
                out
            }
        };
    }

    use pagoda_tensor::quant::blocks as b;
    by_blocks_fn!(by_blocks_q8_0, b::q8_0, b::Q8_0_BYTES, b::QK);
    by_blocks_fn!(by_blocks_q4_0, b::q4_0, b::Q4_0_BYTES, b::QK);
    by_blocks_fn!(by_blocks_q4_1, b::q4_1, b::Q4_1_BYTES, b::QK);
    by_blocks_fn!(by_blocks_q5_0, b::q5_0, b::Q5_0_BYTES, b::QK);
    by_blocks_fn!(by_blocks_q5_1, b::q5_1, b::Q5_1_BYTES, b::QK);
    by_blocks_fn!(by_blocks_q4_k, b::q4_k, b::Q4_K_BYTES, b::QK_K);
    by_blocks_fn!(by_blocks_q5_k, b::q5_k, b::Q5_K_BYTES, b::QK_K);
    by_blocks_fn!(by_blocks_q6_k, b::q6_k, b::Q6_K_BYTES, b::QK_K);
}

/// Whether this process's tiles run the recipe's fused multiply-adds (AVX2+FMA+F16C on
/// x86-64, NEON on aarch64; the two give the same bits) rather than the portable multiply
/// then add. Detected once.
pub fn fused() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        has_avx2_fma()
    }
    #[cfg(target_arch = "aarch64")]
    {
        std::arch::is_aarch64_feature_detected!("neon")
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

#[cfg(target_arch = "aarch64")]
mod neon;

static NEON_MATMULS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// f32 matmuls run on the NEON tiles (`f32_tile/neon.rs`, aarch64) since the process started.
pub fn neon_matmul_count() -> u64 {
    NEON_MATMULS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Counts one f32 matmul for [`neon_matmul_count`] when the tiles run NEON.
pub(crate) fn count_matmul() {
    if cfg!(target_arch = "aarch64") && fused() {
        NEON_MATMULS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Whether the CPU has AVX2, FMA and F16C (the x86 form of the tiles), checked once.
#[cfg(target_arch = "x86_64")]
fn has_avx2_fma() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(seed: usize, k: usize) -> Vec<f32> {
        (0..k)
            .map(|i| ((i * 7 + seed * 13) % 17) as f32 * 0.125 - 1.0)
            .collect()
    }

    /// Two tokens per 512-bit register give `tile`'s bits, for every pair position and with
    /// a tail of `k % 8` values; values with many significant bits so any reordering shows.
    #[test]
    fn token_pairs_give_the_tile_bits() {
        if !pairs_supported() {
            return;
        }
        let noisy = |seed: usize, k: usize| -> Vec<f32> {
            (0..k)
                .map(|i| ((i * 2654435761 + seed * 40503) % 100003) as f32 / 7919.0 - 6.0)
                .collect()
        };
        for k in [8usize, 24, 301, 1536] {
            let x: Vec<f32> = (0..7).flat_map(|t| noisy(t + 10, k)).collect();
            let pairs = TokenPairs::new(&x, k);
            let w: Vec<Vec<f32>> = (0..4).map(|r| noisy(r, k)).collect();
            let rows = [&w[0][..], &w[1][..], &w[2][..], &w[3][..]];
            for pair in [0usize, 1] {
                let xs: [&[f32]; 4] = std::array::from_fn(|j| &x[(2 * pair + j) * k..][..k]);
                let got = tile_pairs(rows, &pairs, pair, xs);
                let want = tile(rows, xs);
                for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
                    assert_eq!(g.to_bits(), w.to_bits(), "k {k} pair {pair}");
                }
            }
        }
    }

    #[test]
    fn every_tile_shape_gives_the_same_bits_and_matches_f64() {
        for k in [0usize, 1, 7, 8, 9, 64, 100, 301] {
            let w = [row(1, k), row(2, k)];
            let x = [row(3, k), row(4, k), row(5, k)];
            let big = tile([&w[0], &w[1]], [&x[0], &x[1], &x[2]]);
            for r in 0..2 {
                for t in 0..3 {
                    let single = tile([&w[r]], [&x[t]])[0][0];
                    assert_eq!(big[r][t].to_bits(), single.to_bits(), "k={k} r={r} t={t}");
                    let reference: f64 = w[r]
                        .iter()
                        .zip(&x[t])
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum();
                    assert!((single as f64 - reference).abs() < 1e-4, "k={k}");
                }
            }
        }
    }

    #[test]
    fn quantized_tile_equals_tile_of_the_decoded_rows() {
        for k in [3usize, 16, 250, 256, 300, 520] {
            let rows: Vec<Vec<u8>> = (0..3)
                .map(|seed| {
                    row(seed, k)
                        .iter()
                        .flat_map(|v| half::f16::from_f32(*v * 0.3).to_bits().to_le_bytes())
                        .collect()
                })
                .collect();
            let x = row(9, k);
            let got = quantized_tile(GgmlType::F16, [&rows[0], &rows[1], &rows[2]], &x);
            for (r, bytes) in rows.iter().enumerate() {
                let mut decoded = vec![0f32; k];
                quant::dequantize(GgmlType::F16, bytes, &mut decoded).unwrap();
                let want = tile([&decoded], [&x])[0][0];
                assert_eq!(got[r].to_bits(), want.to_bits(), "k={k} r={r}");
            }
        }
    }
}
