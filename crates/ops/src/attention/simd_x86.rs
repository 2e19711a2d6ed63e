//! AVX2+FMA and AVX-512F split-KV chunk kernels (x86-64 only; selected at run time by
//! `super::kernel`).
//!
//! Same contract and the same base-2 online softmax as the scalar `decode::chunk_attention`,
//! restructured for vectors. For each tile of up to [`TILE`] visible tokens (tiles may span
//! pages; each token's row is looked up in the page table) and each pass of up to
//! [`MAX_HEADS`] query heads (of one KV head, or of several consecutive KV heads: then the
//! pass reads their K/V as one contiguous span of each token row):
//!
//! 1. scores: every K row is read once and dotted with all heads of the pass (FMA across
//!    `head_dim`, then a horizontal add), times `scale * log2(e)`;
//! 2. softmax: tile max (vector), rescale of the running sum and accumulator when the max
//!    grows, weights `exp2(s - max)` by a vector polynomial ([`Lanes::exp2`], ~2e-7 relative);
//! 3. values: every V row is read once and accumulated into all heads (FMA).
//!
//! The generic body is `#[inline(always)]` into two `#[target_feature]` entry points, so each
//! is compiled for its instruction set whatever the crate's baseline target.

use std::arch::x86_64::*;

use super::{PagedKv, LOG2_E};

/// Tokens per tile (a multiple of every vector width).
const TILE: usize = 32;
/// Query heads per pass over the chunk; more heads run several passes.
const MAX_HEADS: usize = 16;

/// The inputs of one work item (see `decode::chunk_attention`).
pub(crate) struct ChunkArgs<'a, 'kv> {
    /// The layer's paged K/V.
    pub kv: &'a PagedKv<'kv>,
    /// Request index in the page table.
    pub request: usize,
    /// Visible-token range of the chunk.
    pub tokens: std::ops::Range<usize>,
    /// KV head of the first query head of `q_group`.
    pub first_kv_head: usize,
    /// Query heads per KV head (GQA group size): query head `i` of `q_group` reads KV head
    /// `first_kv_head + i / n_rep`.
    pub n_rep: usize,
    /// Softmax scale (natural units; converted to log2 here).
    pub scale: f32,
    /// `[num_heads, head_dim]` queries (`num_heads` = the output's `lse_group.len()`).
    pub q_group: &'a [f32],
}

/// A vector of f32 lanes. Every method is `unsafe` because it executes instructions of the
/// implementor's instruction set: call them only on a CPU that has it. The impls carry
/// `#[target_feature]` (not `#[inline(always)]` wrappers around intrinsics), so once inlined
/// into the kernel entry points the vectors stay in registers.
trait Lanes: Copy {
    const LANES: usize;
    unsafe fn splat(value: f32) -> Self;
    /// Reads `LANES` floats at `pointer`.
    unsafe fn load(pointer: *const f32) -> Self;
    /// Writes `LANES` floats at `pointer`.
    unsafe fn store(self, pointer: *mut f32);
    unsafe fn add(self, other: Self) -> Self;
    unsafe fn sub(self, other: Self) -> Self;
    unsafe fn mul(self, other: Self) -> Self;
    /// `self * factor + addend`, fused.
    unsafe fn mul_add(self, factor: Self, addend: Self) -> Self;
    /// Lane-wise max; a NaN lane of `self` yields `other`'s lane (as `f32::max` ignores NaN).
    unsafe fn max(self, other: Self) -> Self;
    unsafe fn reduce_add(self) -> f32;
    unsafe fn reduce_max(self) -> f32;
    /// `2^x` per lane for `x <= 0` (the softmax case): Cephes' degree-6 polynomial on the
    /// fraction after rounding to the nearest integer (relative error ~2e-7); lanes below
    /// -126 (including `-inf`) give exactly 0.
    unsafe fn exp2(self) -> Self;
}

/// Cephes `exp2f` coefficients, highest degree first: `2^f = 1 + f * P(f)`, `|f| <= 0.5`.
const EXP2_POLY: [f32; 6] = [
    1.535_336_2e-4,
    1.339_887_4e-3,
    9.618_437e-3,
    5.550_332_5e-2,
    2.402_264_8e-1,
    6.931_472e-1,
];

#[derive(Clone, Copy)]
struct Ymm(__m256);

impl Lanes for Ymm {
    const LANES: usize = 8;
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn splat(value: f32) -> Self {
        Ymm(_mm256_set1_ps(value))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load(pointer: *const f32) -> Self {
        // SAFETY: the caller guarantees 8 readable floats.
        Ymm(unsafe { _mm256_loadu_ps(pointer) })
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn store(self, pointer: *mut f32) {
        // SAFETY: the caller guarantees 8 writable floats.
        unsafe { _mm256_storeu_ps(pointer, self.0) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn add(self, other: Self) -> Self {
        Ymm(_mm256_add_ps(self.0, other.0))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn sub(self, other: Self) -> Self {
        Ymm(_mm256_sub_ps(self.0, other.0))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn mul(self, other: Self) -> Self {
        Ymm(_mm256_mul_ps(self.0, other.0))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn mul_add(self, factor: Self, addend: Self) -> Self {
        Ymm(_mm256_fmadd_ps(self.0, factor.0, addend.0))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn max(self, other: Self) -> Self {
        // maxps returns the second operand when either is NaN.
        Ymm(_mm256_max_ps(self.0, other.0))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn reduce_add(self) -> f32 {
        let quad = _mm_add_ps(
            _mm256_castps256_ps128(self.0),
            _mm256_extractf128_ps::<1>(self.0),
        );
        let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
        _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn reduce_max(self) -> f32 {
        let quad = _mm_max_ps(
            _mm256_castps256_ps128(self.0),
            _mm256_extractf128_ps::<1>(self.0),
        );
        let pair = _mm_max_ps(quad, _mm_movehl_ps(quad, quad));
        _mm_cvtss_f32(_mm_max_ss(pair, _mm_movehdup_ps(pair)))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp2(self) -> Self {
        let x = _mm256_min_ps(
            _mm256_max_ps(self.0, _mm256_set1_ps(-126.0)),
            _mm256_set1_ps(126.0),
        );
        let whole = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        let fraction = _mm256_sub_ps(x, whole);
        let mut poly = _mm256_set1_ps(EXP2_POLY[0]);
        for &coefficient in &EXP2_POLY[1..] {
            poly = _mm256_fmadd_ps(poly, fraction, _mm256_set1_ps(coefficient));
        }
        let mantissa = _mm256_fmadd_ps(poly, fraction, _mm256_set1_ps(1.0));
        let exponent = _mm256_slli_epi32::<23>(_mm256_cvtps_epi32(whole));
        let value = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(mantissa), exponent));
        let underflow = _mm256_cmp_ps::<_CMP_LT_OQ>(self.0, _mm256_set1_ps(-126.0));
        Ymm(_mm256_andnot_ps(underflow, value))
    }
}

#[derive(Clone, Copy)]
struct Zmm(__m512);

impl Lanes for Zmm {
    const LANES: usize = 16;
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn splat(value: f32) -> Self {
        Zmm(_mm512_set1_ps(value))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn load(pointer: *const f32) -> Self {
        // SAFETY: the caller guarantees 16 readable floats.
        Zmm(unsafe { _mm512_loadu_ps(pointer) })
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn store(self, pointer: *mut f32) {
        // SAFETY: the caller guarantees 16 writable floats.
        unsafe { _mm512_storeu_ps(pointer, self.0) }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn add(self, other: Self) -> Self {
        Zmm(_mm512_add_ps(self.0, other.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn sub(self, other: Self) -> Self {
        Zmm(_mm512_sub_ps(self.0, other.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn mul(self, other: Self) -> Self {
        Zmm(_mm512_mul_ps(self.0, other.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn mul_add(self, factor: Self, addend: Self) -> Self {
        Zmm(_mm512_fmadd_ps(self.0, factor.0, addend.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn max(self, other: Self) -> Self {
        Zmm(_mm512_max_ps(self.0, other.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn reduce_add(self) -> f32 {
        let half = _mm256_add_ps(
            _mm512_castps512_ps256(self.0),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(self.0))),
        );
        // SAFETY: this function's features include AVX2 and FMA.
        unsafe { Ymm(half).reduce_add() }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn reduce_max(self) -> f32 {
        let half = _mm256_max_ps(
            _mm512_castps512_ps256(self.0),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(self.0))),
        );
        // SAFETY: this function's features include AVX2 and FMA.
        unsafe { Ymm(half).reduce_max() }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn exp2(self) -> Self {
        let x = _mm512_min_ps(
            _mm512_max_ps(self.0, _mm512_set1_ps(-126.0)),
            _mm512_set1_ps(126.0),
        );
        let whole = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        let fraction = _mm512_sub_ps(x, whole);
        let mut poly = _mm512_set1_ps(EXP2_POLY[0]);
        for &coefficient in &EXP2_POLY[1..] {
            poly = _mm512_fmadd_ps(poly, fraction, _mm512_set1_ps(coefficient));
        }
        let mantissa = _mm512_fmadd_ps(poly, fraction, _mm512_set1_ps(1.0));
        let exponent = _mm512_slli_epi32::<23>(_mm512_cvtps_epi32(whole));
        let value = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(mantissa), exponent));
        let underflow = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(self.0, _mm512_set1_ps(-126.0));
        Zmm(_mm512_maskz_mov_ps(!underflow, value))
    }
}

/// The AVX2+FMA kernel. Writes `v_group [num_heads, head_dim]` (normalized) and
/// `lse_group [num_heads]` (log2; zeros and `-inf` for an empty range).
///
/// # Safety
/// The CPU must support AVX2 and FMA; `head_dim % 8 == 0`; the caller validated the pool,
/// the page table and the lengths (`q_group` and `v_group` hold `num_heads * head_dim`, the
/// KV heads read exist).
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn chunk_avx2(
    args: &ChunkArgs<'_, '_>,
    v_group: &mut [f32],
    lse_group: &mut [f32],
) {
    // SAFETY: forwarded from this function's contract.
    unsafe { chunk_body::<Ymm>(args, v_group, lse_group) }
}

/// The AVX-512F kernel; as [`chunk_avx2`] with `head_dim % 16 == 0`.
///
/// # Safety
/// The CPU must support AVX-512F, AVX2 and FMA; otherwise as [`chunk_avx2`].
#[target_feature(enable = "avx512f,avx2,fma")]
pub(crate) unsafe fn chunk_avx512(
    args: &ChunkArgs<'_, '_>,
    v_group: &mut [f32],
    lse_group: &mut [f32],
) {
    // SAFETY: forwarded from this function's contract.
    unsafe { chunk_body::<Zmm>(args, v_group, lse_group) }
}

#[inline(always)]
unsafe fn chunk_body<V: Lanes>(
    args: &ChunkArgs<'_, '_>,
    v_group: &mut [f32],
    lse_group: &mut [f32],
) {
    let kv = args.kv;
    let layout = &kv.layout;
    let table = kv.page_table;
    let (page_size, head_dim) = (layout.page_size, layout.head_dim);
    let vectors = head_dim / V::LANES;
    let num_heads = lse_group.len();
    let n_rep = args.n_rep.max(1);
    let first_page_offset = table.first_page_offset[args.request] as usize;
    let request_pages = &table.indices
        [table.indptr[args.request] as usize..table.indptr[args.request + 1] as usize];
    let scale_log2 = args.scale * LOG2_E;
    assert!(
        vectors * V::LANES == head_dim
            && args.q_group.len() == num_heads * head_dim
            && v_group.len() == num_heads * head_dim
            && args.first_kv_head + num_heads.saturating_sub(1) / n_rep < layout.num_kv_heads,
        "chunk kernel: head_dim {head_dim} or group lengths do not fit"
    );
    v_group.fill(0.0);

    let mut head_start = 0;
    while head_start < num_heads {
        let heads = MAX_HEADS.min(num_heads - head_start);
        // The pass reads KV heads `pass_kv..` (relative to `first_kv_head`) as one span of
        // `span` floats of each token row; head `h` of the pass starts at `head_offsets[h]`.
        let pass_kv = head_start / n_rep;
        let span = ((head_start + heads - 1) / n_rep - pass_kv + 1) * head_dim;
        let mut head_offsets = [0usize; MAX_HEADS];
        for (head, offset) in head_offsets[..heads].iter_mut().enumerate() {
            *offset = ((head_start + head) / n_rep - pass_kv) * head_dim;
        }
        let q_heads = &args.q_group[head_start * head_dim..(head_start + heads) * head_dim];
        let accumulators = &mut v_group[head_start * head_dim..(head_start + heads) * head_dim];
        let mut running_max = [f32::NEG_INFINITY; MAX_HEADS];
        let mut denominator = [0.0f32; MAX_HEADS];
        let mut scores = [[0.0f32; TILE]; MAX_HEADS];
        // Row offsets of the tile being computed and of the next one (prefetched meanwhile).
        let fill = |first: usize, rows: &mut [usize; TILE]| -> usize {
            let count = TILE.min(args.tokens.end.saturating_sub(first));
            let absolute = first_page_offset + first;
            let (mut page_index, mut offset) = (absolute / page_size, absolute % page_size);
            for row in rows[..count].iter_mut() {
                let page = request_pages[page_index] as usize;
                *row = layout.head_offset(page, offset, args.first_kv_head + pass_kv);
                offset += 1;
                if offset == page_size {
                    (page_index, offset) = (page_index + 1, 0);
                }
            }
            count
        };
        let mut rows = [0usize; TILE];
        let mut next_rows = [0usize; TILE];
        let mut token = args.tokens.start;
        let mut count = fill(token, &mut rows);
        while count > 0 {
            let next_count = fill(token + count, &mut next_rows);
            for &row in &next_rows[..next_count] {
                for line in (0..span).step_by(16) {
                    let key = kv.k_pool.as_ptr().wrapping_add(row + line) as *const i8;
                    let value = kv.v_pool.as_ptr().wrapping_add(row + line) as *const i8;
                    // SAFETY: a prefetch is a hint; it never faults or reads into Rust values.
                    unsafe {
                        _mm_prefetch::<_MM_HINT_T0>(key);
                        _mm_prefetch::<_MM_HINT_T0>(value);
                    }
                }
            }

            // 1. Scores: one K span at a time, dotted with every head of the pass.
            for (index, &row) in rows[..count].iter().enumerate() {
                let keys = &kv.k_pool[row..row + span];
                for head in 0..heads {
                    let key = keys[head_offsets[head]..].as_ptr();
                    let query = q_heads[head * head_dim..].as_ptr();
                    // SAFETY: `key` and `query` hold `vectors * LANES` floats.
                    let dot = unsafe {
                        let mut sum = V::load(query).mul(V::load(key));
                        for vector in 1..vectors {
                            let offset = vector * V::LANES;
                            sum = V::load(query.add(offset)).mul_add(V::load(key.add(offset)), sum);
                        }
                        sum.reduce_add()
                    };
                    scores[head][index] = dot * scale_log2;
                }
            }

            // 2. Online softmax per head over the tile.
            let padded = count.div_ceil(V::LANES) * V::LANES;
            for head in 0..heads {
                let tile = &mut scores[head];
                tile[count..padded].fill(f32::NEG_INFINITY);
                // SAFETY: `tile` holds TILE >= padded floats.
                let tile_max = unsafe {
                    let mut max = V::splat(f32::NEG_INFINITY);
                    for start in (0..padded).step_by(V::LANES) {
                        max = V::load(tile[start..].as_ptr()).max(max);
                    }
                    max.reduce_max()
                };
                let new_max = running_max[head].max(tile_max);
                if new_max == f32::NEG_INFINITY {
                    tile[..count].fill(0.0);
                    continue;
                }
                // exp2(-inf - finite) = 0 on the first tile: no (-inf) - (-inf).
                let correction = (running_max[head] - new_max).exp2();
                if correction != 1.0 {
                    denominator[head] *= correction;
                    accumulators[head * head_dim..(head + 1) * head_dim]
                        .iter_mut()
                        .for_each(|value| *value *= correction);
                }
                running_max[head] = new_max;
                // SAFETY: `tile` holds TILE >= padded floats.
                let sum = unsafe {
                    let max = V::splat(new_max);
                    let mut sum = V::splat(0.0);
                    for start in (0..padded).step_by(V::LANES) {
                        let pointer = tile[start..].as_mut_ptr();
                        let weight = V::load(pointer).sub(max).exp2();
                        weight.store(pointer);
                        sum = sum.add(weight);
                    }
                    sum.reduce_add()
                };
                denominator[head] += sum;
            }

            // 3. Values: per head, its accumulator in registers and the tile's values streamed
            // past it (each element's additions in token order, as one row at a time).
            for head in 0..heads {
                let accumulator = &mut accumulators[head * head_dim..(head + 1) * head_dim];
                let weights = &scores[head][..count];
                let offset = head_offsets[head];
                // SAFETY: every row + offset + head_dim is inside the V pool (checked by
                // `head_row`), and the accumulator holds head_dim = vectors * LANES floats.
                unsafe {
                    match vectors {
                        4 => accumulate_head::<V, 4>(
                            kv.v_pool,
                            &rows[..count],
                            offset,
                            weights,
                            accumulator,
                        ),
                        8 => accumulate_head::<V, 8>(
                            kv.v_pool,
                            &rows[..count],
                            offset,
                            weights,
                            accumulator,
                        ),
                        _ => accumulate_head_any::<V>(
                            kv.v_pool,
                            &rows[..count],
                            offset,
                            weights,
                            accumulator,
                        ),
                    }
                }
            }
            token += count;
            (rows, count) = (next_rows, next_count);
        }
        for head in 0..heads {
            let accumulator = &mut accumulators[head * head_dim..(head + 1) * head_dim];
            let lse = &mut lse_group[head_start + head];
            if running_max[head] == f32::NEG_INFINITY || denominator[head] == 0.0 {
                accumulator.fill(0.0);
                *lse = f32::NEG_INFINITY;
            } else {
                let inverse = 1.0 / denominator[head];
                accumulator.iter_mut().for_each(|value| *value *= inverse);
                *lse = running_max[head] + denominator[head].log2();
            }
        }
        head_start += heads;
    }
}

/// The `head_dim` floats of the V row of one head: `pool[row + offset..]`, bounds-checked.
#[inline(always)]
fn head_row(pool: &[f32], row: usize, offset: usize, head_dim: usize) -> *const f32 {
    pool[row + offset..row + offset + head_dim].as_ptr()
}

/// `accumulator += weights[i] * V row rows[i]` over the tile for a head of `N` vectors, the
/// accumulator held in `N` registers: each element's fused multiply-adds in token order, as
/// [`accumulate_head_any`].
///
/// # Safety
/// The CPU must run `V`'s instructions; `accumulator.len() == N * V::LANES`.
#[inline(always)]
unsafe fn accumulate_head<V: Lanes, const N: usize>(
    pool: &[f32],
    rows: &[usize],
    offset: usize,
    weights: &[f32],
    accumulator: &mut [f32],
) {
    // SAFETY: `accumulator` holds N * LANES floats and each value row head_dim of them.
    unsafe {
        let mut sums = [V::splat(0.0); N];
        for (vector, sum) in sums.iter_mut().enumerate() {
            *sum = V::load(accumulator[vector * V::LANES..].as_ptr());
        }
        for (&row, &weight) in rows.iter().zip(weights) {
            let value = head_row(pool, row, offset, N * V::LANES);
            let weight = V::splat(weight);
            for (vector, sum) in sums.iter_mut().enumerate() {
                *sum = V::load(value.add(vector * V::LANES)).mul_add(weight, *sum);
            }
        }
        for (vector, sum) in sums.iter().enumerate() {
            sum.store(accumulator[vector * V::LANES..].as_mut_ptr());
        }
    }
}

/// [`accumulate_head`] for any number of vectors (accumulator updated in memory).
///
/// # Safety
/// As [`accumulate_head`], with `accumulator.len()` a multiple of `V::LANES`.
#[inline(always)]
unsafe fn accumulate_head_any<V: Lanes>(
    pool: &[f32],
    rows: &[usize],
    offset: usize,
    weights: &[f32],
    accumulator: &mut [f32],
) {
    let vectors = accumulator.len() / V::LANES;
    // SAFETY: as above.
    unsafe {
        for (&row, &weight) in rows.iter().zip(weights) {
            let value = head_row(pool, row, offset, accumulator.len());
            let weight = V::splat(weight);
            for vector in 0..vectors {
                let target = accumulator[vector * V::LANES..].as_mut_ptr();
                V::load(value.add(vector * V::LANES))
                    .mul_add(weight, V::load(target))
                    .store(target);
            }
        }
    }
}
