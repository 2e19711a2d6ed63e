//! Small vector primitives with a runtime-selected AVX2+FMA path.
//!
//! The deep SIMD work (quantized dot products, repacked layouts, AMX) belongs to the CPU-speed
//! issue; these keep the foundation reasonably fast on any x86-64 and portable elsewhere.
//! [`f32_tile`] holds the batch-invariant f32 tiles of the linear layers ([`f32_decode`] their
//! eight-row AVX-512 form for one token), [`int_dot`] the integer tiles for repacked weights
//! and Q8 activations.

pub mod amx;
pub mod f32_decode;
pub mod f32_tile;
pub mod int_dot;
pub mod interleaved;
pub mod prefetch;

/// `sum_i a[i] * b[i]` over equal-length slices.
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx2_fma() {
            // SAFETY: the CPU supports AVX2 and FMA (checked above).
            return unsafe { dot_f32_avx2(a, b) };
        }
    }
    dot_f32_portable(a, b)
}

/// Portable dot product with 8 independent accumulators (auto-vectorizes).
pub fn dot_f32_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        sum += a[i] * b[i];
    }
    sum
}

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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_f32_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut acc2 = _mm256_setzero_ps();
    let mut acc3 = _mm256_setzero_ps();
    let mut i = 0;
    // SAFETY: every load reads 8 floats at offsets < n.
    unsafe {
        while i + 32 <= n {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
            acc1 = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i + 8)),
                _mm256_loadu_ps(pb.add(i + 8)),
                acc1,
            );
            acc2 = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i + 16)),
                _mm256_loadu_ps(pb.add(i + 16)),
                acc2,
            );
            acc3 = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i + 24)),
                _mm256_loadu_ps(pb.add(i + 24)),
                acc3,
            );
            i += 32;
        }
        while i + 8 <= n {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
            i += 8;
        }
    }
    let acc = _mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3));
    let mut lanes = [0f32; 8];
    // SAFETY: lanes has room for 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    let mut sum: f32 = lanes.iter().sum();
    while i < n {
        sum += a[i] * b[i];
        i += 1;
    }
    sum
}

/// `y[i] += a * x[i]`.
#[inline]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_f64_reference_for_all_lengths() {
        for n in 0..100 {
            let a: Vec<f32> = (0..n).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.25).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.5).collect();
            let reference: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot_f32(&a, &b) as f64 - reference).abs() < 1e-4, "n={n}");
            assert!(
                (dot_f32_portable(&a, &b) as f64 - reference).abs() < 1e-4,
                "n={n}"
            );
        }
    }
}
