//! The quantized linear layer fed by a producer that writes its q8 activations in its own
//! launch (`rms_norm_q8`, `silu_mul_q8`: the model's `PAGODA_CUDA_QUANT_FUSED_Q8`) against the
//! unfused path (`rms_norm` / `silu_mul`, then `quantize_rows_q8`): the producer's outputs and
//! the GEMV's outputs must be the same bits (asserted in `run`), and the GEMV's output is held
//! to `linear_quant`'s tolerances against the f64 dots of the dequantized weights with the Q8
//! rows the CPU quantizes the producer's output (as the GPU computed it) to. Every format the
//! GPU multiplies in place, both producers, 1 to 8 rows, both layouts, bf16 and f32 outputs.

use pagoda_cuda::{DeviceBuffer, Gpu};
use pagoda_ops::cuda::{self as ops, Q8Rows as GpuQ8Rows, QuantGemvKernel, QUANT_PADDING};
use pagoda_tensor::quant::q8::Q8Rows;

use crate::common::f64_dots;
use crate::framework::{with_dtype, Backend, Expected, Family, GpuDtype, OpCase, Output};
use crate::gpu_common::{download, poisoned, random_vec, rng, upload, TestFloat};
use crate::linear::{quant_format, Linear, FORMATS};

const EPS: f32 = 1e-5;

pub fn cases() -> Vec<Box<dyn OpCase>> {
    let mut cases: Vec<Box<dyn OpCase>> = Vec::new();
    let formats = FORMATS.into_iter().filter(|&ty| quant_format(ty).is_some());
    for (index, ty) in formats.enumerate() {
        let shapes = [
            (Producer::Norm, (1, 67, 512)),
            (Producer::SiluMul, (1, 37, 768)),
            (Producer::Norm, (5, 19, 1280)),
            (Producer::SiluMul, (8, 33, 256)),
        ];
        for (shape_index, (producer, shape)) in shapes.into_iter().enumerate() {
            let seed = 2000 + 4 * index as u64 + shape_index as u64;
            let linear = Linear::new(ty, shape, seed);
            // The norm's weight [cols] (around 1), or SiLU's up [tokens, cols].
            let len = match producer {
                Producer::Norm => linear.cols,
                Producer::SiluMul => linear.tokens * linear.cols,
            };
            let other = random_vec(&mut rng(seed + 7000), len, 0.5)
                .into_iter()
                .map(|v| v + if producer == Producer::Norm { 1.0 } else { 0.0 })
                .collect();
            cases.push(Box::new(QuantFused {
                linear,
                producer,
                other,
            }));
        }
    }
    cases
}

/// The kernel before the quantized layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Producer {
    /// `rms_norm` of the f32 rows `x` (the residual stream) with weight `other`.
    Norm,
    /// `silu(x) * other`.
    SiluMul,
}

struct QuantFused {
    linear: Linear,
    producer: Producer,
    other: Vec<f32>,
}

impl QuantFused {
    /// The producer's output in `T`, its q8 activations written besides into `q8` when given.
    fn produce<T: TestFloat>(&self, gpu: &Gpu, q8: Option<&mut GpuQ8Rows>) -> DeviceBuffer<T> {
        let l = &self.linear;
        let (rows, cols) = (l.tokens, l.cols);
        let mut out = poisoned::<T>(gpu, rows * cols);
        match self.producer {
            Producer::Norm => {
                let (x, w) = (upload::<f32>(gpu, &l.x), upload::<T>(gpu, &self.other));
                match q8 {
                    Some(q8) => ops::rms_norm_q8(gpu, &x, &w, &mut out, q8, EPS),
                    None => ops::rms_norm(gpu, &x, &w, &mut out, EPS),
                }
            }
            Producer::SiluMul => {
                let (gate, up) = (upload::<T>(gpu, &l.x), upload::<T>(gpu, &self.other));
                let strides = (cols, cols);
                match q8 {
                    Some(q8) => ops::silu_mul_q8(gpu, (&gate, &up), &mut out, q8, cols, strides),
                    None => ops::silu_mul(gpu, &gate, &up, &mut out, cols, strides),
                }
            }
        }
        .unwrap();
        out
    }

    /// The GEMV's output in `TOut` through the fused producer, asserted to be the bits of
    /// the unfused path's (and the producer's output too).
    fn run_kernel<T: TestFloat, TOut: TestFloat>(
        &self,
        gpu: &Gpu,
        kernel: QuantGemvKernel,
    ) -> Vec<f32> {
        let l = &self.linear;
        let format = quant_format(l.ty).expect("a GPU format");
        let mut padded = l.bytes.clone();
        padded.resize(l.bytes.len() + QUANT_PADDING, 0);
        let w = gpu.upload(&padded).unwrap();
        let gemv = |q8: &GpuQ8Rows| {
            let mut out = poisoned::<TOut>(gpu, l.tokens * l.rows);
            ops::gemv_quant(gpu, kernel, format, &w, q8, &mut out, l.rows, l.rows, 0.0).unwrap();
            download(gpu, &out)
        };
        let mut separate = GpuQ8Rows::new(gpu, l.tokens, l.cols).unwrap();
        let unfused = self.produce::<T>(gpu, None);
        ops::quantize_rows_q8(gpu, &unfused, &mut separate, (l.tokens, l.cols)).unwrap();
        let mut written = GpuQ8Rows::new(gpu, l.tokens, l.cols).unwrap();
        let fused = self.produce::<T>(gpu, Some(&mut written));
        let bits = |values: Vec<f32>| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let what = format!("{:?} {} {kernel:?}", self.producer, self.shape());
        assert_eq!(
            bits(download(gpu, &unfused)),
            bits(download(gpu, &fused)),
            "{what}: producer output"
        );
        let (expected, got) = (gemv(&separate), gemv(&written));
        assert_eq!(bits(expected), bits(got.clone()), "{what}: GEMV output");
        got
    }
}

impl OpCase for QuantFused {
    fn op(&self) -> &'static str {
        match self.producer {
            Producer::Norm => "linear_quant_fused_norm",
            Producer::SiluMul => "linear_quant_fused_silu",
        }
    }

    fn shape(&self) -> String {
        let l = &self.linear;
        let (ty, t, r, c) = (l.ty.name(), l.tokens, l.rows, l.cols);
        format!("{ty} x[{t}, {c}] W[{r}, {c}]")
    }

    fn family(&self) -> Family {
        Family::ReferenceOnly
    }

    /// The f64 dots with the Q8 rows of the producer's output as the GPU computes it (the
    /// norm and SiLU themselves are `norm` and `activation`'s cases).
    fn reference(&self, backend: &Backend<'_>) -> Expected {
        let l = &self.linear;
        let seen = match backend {
            Backend::Cuda(gpu, dtype) => {
                with_dtype!(*dtype, T => download(gpu, &self.produce::<T>(gpu, None)))
            }
            _ => vec![f32::NAN; l.x.len()],
        };
        let q = Q8Rows::quantize(&seen, l.cols).unwrap();
        let mut quantized = vec![0f32; seen.len()];
        for (t, row) in quantized.chunks_mut(l.cols).enumerate() {
            q.dequantize_row(t, row);
        }
        let dots = f64_dots(&l.weights, &quantized, l.cols);
        let values = dots.iter().map(|&(dot, _)| dot as f32).collect();
        let scales = dots.iter().map(|&(_, sum)| (sum + 0.1) as f32).collect();
        Expected { values, scales }
    }

    fn run(&self, backend: &Backend<'_>) -> Option<Vec<Output>> {
        let Backend::Cuda(gpu, dtype) = backend else {
            return None;
        };
        let mut outputs = Vec::new();
        for (name, kernel) in [
            ("", QuantGemvKernel::Groups),
            ("units ", QuantGemvKernel::UNITS),
        ] {
            for out_f32 in [false, true] {
                let values = with_dtype!(*dtype, T => match out_f32 {
                    true => self.run_kernel::<T, f32>(gpu, kernel),
                    false => self.run_kernel::<T, T>(gpu, kernel),
                });
                let variant = format!("{name}{}", if out_f32 { "out=f32" } else { "" });
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
