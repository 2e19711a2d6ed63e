//! Several weights applied to one input: `y_i = W_i x` (q/k/v share the attention norm's
//! output, gate/up the MLP norm's).
//!
//! With the integer kernels the input is quantized to Q8 once for all of them, and a decode
//! step (one token) runs the rows of every weight in one parallel region instead of one
//! region per weight. Each output element is computed by exactly the chain
//! [`Weight::matmul`] uses for it (the same tiles, the same per-(row, token) recipe), so the
//! results are bit-identical to separate calls; weights that do not share one integer
//! instruction set (f32 kernels, exact mode, F32), and prefills on the AMX-BF16 tiles (f32
//! inputs), simply run their own matmul.

use rayon::prelude::*;

use super::int_matmul::{self, decode_rows, IntRows};
use super::tasks::decode_rows_per_task;
use crate::linear::cpu::interleaved;
use crate::linear::{Storage, Weight};

/// `y = W x` for each `(W, y)` of `outputs`, all with the input `x` (`[num_tokens,
/// in_features]` row-major; every weight must have the same `in_features`); each `y` is
/// `[num_tokens, W.out_features]` and is overwritten. Bit-identical to calling
/// [`Weight::matmul`] on each pair. Panics on a shape mismatch, as [`Weight::matmul`] does.
pub fn matmul_shared(x: &[f32], num_tokens: usize, outputs: &mut [(&Weight, &mut [f32])]) {
    for (weight, y) in outputs.iter() {
        assert_eq!(
            x.len(),
            num_tokens * weight.in_features,
            "x must be [num_tokens, in_features]"
        );
        assert_eq!(
            y.len(),
            num_tokens * weight.out_features,
            "y must be [num_tokens, out_features]"
        );
    }
    let Some((first, _)) = outputs.first() else {
        return;
    };
    // Q15 weights take their own activations (each weight's `matmul` below).
    let shared_isa = first.int_isa().filter(|&isa| {
        outputs
            .iter()
            .all(|(weight, _)| weight.int_isa() == Some(isa) && !weight.q15_activations())
    });
    // Prefills on the AMX-BF16 tiles take f32 inputs: each weight runs its own matmul.
    let bf16 = outputs
        .iter()
        .any(|(weight, _)| weight.bf16_tiles(num_tokens).is_some());
    let Some(isa) = shared_isa.filter(|_| !bf16) else {
        for (weight, y) in outputs.iter_mut() {
            weight.matmul(x, num_tokens, y);
        }
        return;
    };
    if num_tokens == 0 {
        return;
    }
    let k = first.in_features;
    int_matmul::with_scratch(|activations| {
        int_matmul::quantize_activations(isa, x, k, activations);
        if num_tokens > 1 {
            for (weight, y) in outputs.iter_mut() {
                let Storage::Repacked(rows, _) = &weight.storage else {
                    unreachable!("int_isa() is Some only for repacked weights")
                };
                rows.matmul(isa, activations, y);
            }
            return;
        }
        // Decode: one region over every weight's rows (tasks of whole interleaved groups).
        let total_rows: usize = outputs.iter().map(|(w, _)| w.out_features).sum();
        let rows_per_task =
            decode_rows_per_task(total_rows).next_multiple_of(2 * interleaved::GROUP);
        if outputs.iter().any(|(weight, _)| {
            matches!(
                weight.storage,
                Storage::Repacked(IntRows::Interleaved(_), _)
            )
        }) {
            interleaved::count_wide_decode();
        }
        if outputs.iter().any(|(weight, _)| {
            matches!(&weight.storage, Storage::Repacked(IntRows::Interleaved(rows), _) if rows.planes() > 0)
        }) {
            interleaved::planes::count_matmul();
        }
        // Every x86 SIMD kernel of the region prefetches (the scalar and NEON ones do not).
        crate::linear::cpu::int_dot::count_simd_matmul(isa);
        // The interleaved kernels' block starts, one list per weight, computed once.
        let starts: Vec<Vec<i32>> = outputs
            .iter()
            .map(|(weight, _)| match &weight.storage {
                Storage::Repacked(IntRows::Interleaved(rows), _) => {
                    interleaved::block_starts(rows, activations)
                }
                _ => Vec::new(),
            })
            .collect();
        let mut tasks = Vec::with_capacity(total_rows / rows_per_task + outputs.len());
        for ((weight, y), starts) in outputs.iter_mut().zip(&starts) {
            let Storage::Repacked(rows, _) = &weight.storage else {
                unreachable!("int_isa() is Some only for repacked weights")
            };
            for (index, out) in y.chunks_mut(rows_per_task).enumerate() {
                tasks.push((rows, starts.as_slice(), index * rows_per_task, out));
            }
        }
        tasks
            .into_par_iter()
            .for_each(|(rows, starts, row_start, out)| match rows {
                IntRows::Rows(rows) => decode_rows(isa, rows, row_start, activations, out),
                IntRows::Interleaved(rows) => {
                    interleaved::decode_rows(rows, row_start, activations, starts, out)
                }
            });
    });
}
