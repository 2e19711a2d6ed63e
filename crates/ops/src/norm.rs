//! RMSNorm: `y = x / sqrt(mean(x^2) + eps) * weight`, row by row.

pub mod cuda;

use rayon::prelude::*;

/// Normalizes each row of `x` (`[rows, dim]`, `dim == weight.len()`) into `out` (same shape).
/// The mean of squares is accumulated in f64 so long rows stay exact to f32 rounding. Many
/// rows (a prefill) run in parallel; each row's arithmetic is the same, so the same bits.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    assert_eq!(x.len(), out.len(), "rms_norm: x and out differ in length");
    assert_eq!(x.len() % dim.max(1), 0, "rms_norm: x is not [rows, dim]");
    if dim == 0 {
        return;
    }
    let normalize = |(row, out_row): (&[f32], &mut [f32])| {
        let scale = inverse_rms(row, eps);
        for ((o, v), w) in out_row.iter_mut().zip(row).zip(weight) {
            *o = v * scale * w;
        }
    };
    if x.len() / dim < PARALLEL_ROWS {
        x.chunks_exact(dim)
            .zip(out.chunks_exact_mut(dim))
            .for_each(normalize);
    } else {
        x.par_chunks_exact(dim)
            .zip(out.par_chunks_exact_mut(dim))
            .with_min_len(8)
            .for_each(normalize);
    }
}

/// RMSNorm in place (used for the per-head q/k norms of Qwen3); rows in parallel as
/// [`rms_norm`].
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let dim = weight.len();
    assert_eq!(x.len() % dim.max(1), 0, "rms_norm: x is not [rows, dim]");
    if dim == 0 {
        return;
    }
    let normalize = |row: &mut [f32]| {
        let scale = inverse_rms(row, eps);
        for (v, w) in row.iter_mut().zip(weight) {
            *v = *v * scale * w;
        }
    };
    if x.len() / dim < PARALLEL_ROWS {
        x.chunks_exact_mut(dim).for_each(normalize);
    } else {
        x.par_chunks_exact_mut(dim)
            .with_min_len(8)
            .for_each(normalize);
    }
}

/// Rows from which the norms run in parallel (a decode step's few rows stay on the calling
/// thread).
const PARALLEL_ROWS: usize = 32;

fn inverse_rms(row: &[f32], eps: f32) -> f32 {
    let sum_squares: f64 = row.iter().map(|v| (*v as f64) * (*v as f64)).sum();
    (1.0 / (sum_squares / row.len() as f64 + eps as f64).sqrt()) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_hand_computed_values() {
        let x = [1.0f32, 2.0, 3.0, 4.0, -2.0, 0.0, 0.0, 2.0];
        let w = [1.0f32, 0.5, 2.0, 1.0];
        let mut out = [0f32; 8];
        rms_norm(&x, &w, 0.0, &mut out);
        let r1 = (30.0f64 / 4.0).sqrt() as f32;
        let r2 = (8.0f64 / 4.0).sqrt() as f32;
        let expected = [
            1.0 / r1,
            1.0 / r1,
            6.0 / r1,
            4.0 / r1,
            -2.0 / r2,
            0.0,
            0.0,
            2.0 / r2,
        ];
        for (a, b) in out.iter().zip(expected) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        let mut in_place = x;
        rms_norm_in_place(&mut in_place, &w, 0.0);
        assert_eq!(in_place, out);
    }

    /// Many rows (the parallel path) give each row's bits as normalized alone.
    #[test]
    fn parallel_rows_give_the_single_row_bits() {
        let dim = 64;
        let w: Vec<f32> = (0..dim).map(|i| 0.5 + i as f32 / 37.0).collect();
        let x: Vec<f32> = (0..100 * dim)
            .map(|i| ((i * 7919) % 1009) as f32 / 101.0 - 5.0)
            .collect();
        let mut all = vec![0f32; x.len()];
        rms_norm(&x, &w, 1e-5, &mut all);
        let mut in_place = x.clone();
        rms_norm_in_place(&mut in_place, &w, 1e-5);
        for (row, (got, again)) in x
            .chunks_exact(dim)
            .zip(all.chunks_exact(dim).zip(in_place.chunks_exact(dim)))
        {
            let mut alone = vec![0f32; dim];
            rms_norm(row, &w, 1e-5, &mut alone);
            assert!(alone
                .iter()
                .zip(got)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            assert!(alone
                .iter()
                .zip(again)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }
}
