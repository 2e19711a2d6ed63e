//! A stacked quantized matrix of two formats (Q4_K or Q5_K rows, then Q6_K rows: the QKV of a
//! Q4_K_M or Q5_K_M file whose v is Q6_K) multiplied in one launch (`gemv_quant_pair`, the
//! model's `PAGODA_CUDA_QUANT_PAIR`) against one `gemv_quant` launch a part, and the tensor
//! cores' `gemm_quant_mma_pair` against one `gemm_quant_mma` a part: the same bits
//! (asserted in `run`), and `linear_quant`'s tolerances against the f64 dots of the
//! dequantized weights with the CPU's Q8 rows. Variants: f32 and bf16 outputs, `beta = 1`, and
//! a column slice of a wider output; 1 to 64 rows (two in-place launches from 9), part row
//! counts that are not a multiple of a CTA's rows.

use pagoda_cuda::{view_mut, Gpu};
use pagoda_ops::cuda::{self as ops, Q8Rows as GpuQ8Rows, QuantGemvKernel, QUANT_PADDING};

use crate::framework::{with_dtype, Backend, Expected, Family, GpuDtype, OpCase, Output};
use crate::gpu_common::{download, poisoned, upload, TestFloat};
use crate::linear::{quant_format, Linear};

pub fn cases() -> Vec<Box<dyn OpCase>> {
    let mut cases: Vec<Box<dyn OpCase>> = Vec::new();
    let shapes = [
        (1, 37, 19, 512),
        (3, 67, 5, 768),
        (8, 33, 130, 256),
        (11, 5, 9, 1280),
        (24, 37, 19, 2560),
        (64, 33, 130, 256),
    ];
    for (index, (a, b)) in ops::QUANT_PAIRS.into_iter().enumerate() {
        let ty = |format| match format {
            ops::QuantFormat::Q4K => pagoda_tensor::GgmlType::Q4K,
            ops::QuantFormat::Q5K => pagoda_tensor::GgmlType::Q5K,
            _ => pagoda_tensor::GgmlType::Q6K,
        };
        for (shape_index, (tokens, n_a, n_b, cols)) in shapes.into_iter().enumerate() {
            let seed = 3000 + 8 * index as u64 + 2 * shape_index as u64;
            let first = Linear::new(ty(a), (tokens, n_a, cols), seed);
            let mut second = Linear::new(ty(b), (tokens, n_b, cols), seed + 1);
            second.x = first.x.clone();
            cases.push(Box::new(QuantPair { first, second }));
        }
    }
    cases
}

/// Two parts over the same activations (`first.x`).
struct QuantPair {
    first: Linear,
    second: Linear,
}

impl QuantPair {
    /// `[x w_a^T | x w_b^T]` through one launch, asserted to be the bits of one launch a part;
    /// `beta = 1` (twice the product, halved exactly) and into the middle columns of a wider
    /// output when asked.
    fn run_kernel<TIn: TestFloat, TOut: TestFloat>(
        &self,
        gpu: &Gpu,
        (beta_one, slice, mma): (bool, bool, bool),
    ) -> Vec<f32> {
        let (a, b) = (&self.first, &self.second);
        let (tokens, cols, n_a, n_b) = (a.tokens, a.cols, a.rows, b.rows);
        let n = n_a + n_b;
        let part = |l: &Linear| {
            let mut padded = l.bytes.clone();
            padded.resize(l.bytes.len() + QUANT_PADDING, 0);
            (
                quant_format(l.ty).unwrap(),
                gpu.upload(&padded).unwrap(),
                l.rows,
            )
        };
        let ((fa, wa, _), (fb, wb, _)) = (part(a), part(b));
        let x = upload::<TIn>(gpu, &a.x);
        let mut q8 = GpuQ8Rows::with_splits(gpu, tokens, cols).unwrap();
        ops::quantize_rows_q8(gpu, &x, &mut q8, (tokens, cols)).unwrap();
        let (ldo, first) = if slice { (n + 7, 5) } else { (n, 0) };
        let run = |one_launch: bool| {
            let mut out = poisoned::<TOut>(gpu, tokens * ldo);
            for beta in if beta_one { vec![0.0, 1.0] } else { vec![0.0] } {
                let mut o = view_mut(&mut out, first..tokens * ldo).unwrap();
                if one_launch {
                    let (pa, pb) = ((fa, &wa, n_a), (fb, &wb, n_b));
                    match mma {
                        true => ops::gemm_quant_mma_pair(gpu, pa, pb, &q8, &mut o, ldo, beta),
                        false => ops::gemv_quant_pair(gpu, pa, pb, &q8, &mut o, ldo, beta),
                    }
                    .unwrap();
                } else if mma {
                    ops::gemm_quant_mma(gpu, fa, &wa, &q8, &mut o, n_a, ldo, beta).unwrap();
                    let mut o = view_mut(&mut out, first + n_a..tokens * ldo).unwrap();
                    ops::gemm_quant_mma(gpu, fb, &wb, &q8, &mut o, n_b, ldo, beta).unwrap();
                } else {
                    let groups = QuantGemvKernel::Groups;
                    ops::gemv_quant(gpu, groups, fa, &wa, &q8, &mut o, n_a, ldo, beta).unwrap();
                    let mut o = view_mut(&mut out, first + n_a..tokens * ldo).unwrap();
                    ops::gemv_quant(gpu, groups, fb, &wb, &q8, &mut o, n_b, ldo, beta).unwrap();
                }
            }
            download(gpu, &out)
        };
        let (separate, together) = (run(false), run(true));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&separate),
            bits(&together),
            "{}: one launch and one a part differ",
            self.shape()
        );
        let scale = if beta_one { 0.5 } else { 1.0 };
        together
            .chunks(ldo)
            .flat_map(|row| row[first..first + n].iter().map(move |v| v * scale))
            .collect()
    }
}

impl OpCase for QuantPair {
    fn op(&self) -> &'static str {
        "linear_quant_pair"
    }

    fn shape(&self) -> String {
        let (a, b) = (&self.first, &self.second);
        let (ta, tb) = (a.ty.name(), b.ty.name());
        let (t, c) = (a.tokens, a.cols);
        format!("{ta}+{tb} x[{t}, {c}] W[{}+{}, {c}]", a.rows, b.rows)
    }

    fn family(&self) -> Family {
        Family::ReferenceOnly
    }

    fn reference(&self, _: &Backend<'_>) -> Expected {
        let (a, b) = (self.first.expected(true), self.second.expected(true));
        let (n_a, n_b) = (self.first.rows, self.second.rows);
        let merge = |x: &[f32], y: &[f32]| -> Vec<f32> {
            x.chunks(n_a)
                .zip(y.chunks(n_b))
                .flat_map(|(p, q)| p.iter().chain(q).copied())
                .collect()
        };
        Expected {
            values: merge(&a.values, &b.values),
            scales: merge(&a.scales, &b.scales),
        }
    }

    fn run(&self, backend: &Backend<'_>) -> Option<Vec<Output>> {
        let Backend::Cuda(gpu, dtype) = backend else {
            return None;
        };
        let mut outputs = Vec::new();
        for mma in [false, true] {
            for (variant, beta_one, slice, out_f32) in [
                ("", false, false, false),
                ("beta=1", true, false, false),
                ("ldo>n", false, true, false),
                ("out=f32", false, false, true),
            ] {
                let how = (beta_one, slice, mma);
                let values = with_dtype!(*dtype, T => match out_f32 {
                    true => self.run_kernel::<T, f32>(gpu, how),
                    false => self.run_kernel::<T, T>(gpu, how),
                });
                let variant = format!("{}{variant}", if mma { "mma " } else { "" });
                outputs.push(Output { variant, values });
            }
        }
        Some(outputs)
    }

    fn tolerance(&self, backend: &Backend<'_>) -> f64 {
        match backend {
            Backend::Cuda(_, GpuDtype::F32) => 2e-5,
            Backend::Cuda(_, GpuDtype::Bf16) => 5e-3,
            _ => 0.0,
        }
    }
}
