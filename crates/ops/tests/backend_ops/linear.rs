//! Linear-layer cases: `y = W x` for every GGML weight format the CPU decodes (F32, F16,
//! BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K), at a decode shape (1 token) and a prefill
//! shape (70 tokens: past the AMX tiles' 64). Reference: the f64 dots of the dequantized
//! weights (`pagoda_tensor::quant::dequantize`) with the activations the backend sees (Q8
//! rows, `Q8Rows`, for the integer kernel sets on repacked weights), each within a fraction
//! of the sum of |products|, as `common::assert_f64_dots` checks. CPU backends:
//! `Weight::with_kernels` with each kernel set. CUDA: the loader's path (blocks dequantized on
//! the device where a `QuantFormat` exists, on the host otherwise) then the cuBLAS GEMM, with
//! `beta = 1` (the residual fusion) and, for bf16, an f32 output (the logits) as variants.

use half::bf16;
use pagoda_cuda::{DeviceBuffer, Gpu};
use pagoda_ops::cuda::{self as ops, QuantFormat};
use pagoda_ops::linear::{CpuKernels, Weight};
use pagoda_tensor::quant::q8::Q8Rows;
use pagoda_tensor::{quant, GgmlType};
use rand_chacha::ChaCha8Rng;

use crate::common::{f64_dots, random_activations, random_rows, REPACKED};
use crate::framework::{Backend, Expected, Family, GpuDtype, OpCase, Output};
use crate::gpu_common::{download, poisoned, rng, round, upload, TestFloat};

/// Every format `Weight` takes.
pub const FORMATS: [GgmlType; 13] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

pub fn cases() -> Vec<Box<dyn OpCase>> {
    let mut cases: Vec<Box<dyn OpCase>> = Vec::new();
    for (index, ty) in FORMATS.into_iter().enumerate() {
        for tokens in [1, 70] {
            let seed = 100 + 2 * index as u64 + (tokens > 1) as u64;
            cases.push(Box::new(Linear::new(ty, (tokens, 37, 512), seed)));
        }
    }
    // Model-sized GEMMs of float weights (`[tokens, rows, cols]`): square, a wide
    // projection, a narrow one with many tokens.
    for (index, ty) in [GgmlType::F32, GgmlType::BF16].into_iter().enumerate() {
        for (shape_index, shape) in [(1, 576, 576), (7, 1536, 576), (33, 200, 64)]
            .into_iter()
            .enumerate()
        {
            let seed = 150 + 3 * index as u64 + shape_index as u64;
            cases.push(Box::new(Linear::new(ty, shape, seed)));
        }
    }
    cases
}

/// Random stored rows of `ty`: float formats from values in [-0.1, 0.1), block formats from
/// `common::random_rows` (random scales, signed where the format allows).
pub fn weight_bytes(ty: GgmlType, rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
    let mut values = || crate::gpu_common::random_vec(rng, rows * cols, 0.1).into_iter();
    match ty {
        GgmlType::F32 => values().flat_map(f32::to_le_bytes).collect(),
        GgmlType::F16 => values()
            .flat_map(|v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        GgmlType::BF16 => values()
            .flat_map(|v| bf16::from_f32(v).to_le_bytes())
            .collect(),
        _ => random_rows(ty, rows, cols, rng, false),
    }
}

/// The stored rows decoded to f32 (the reference decoder).
pub fn dequantized(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Vec<f32> {
    let mut out = vec![0f32; rows * cols];
    quant::dequantize(ty, bytes, &mut out).unwrap();
    out
}

/// The GPU's dequantizer of `ty`, if it has one.
pub fn quant_format(ty: GgmlType) -> Option<QuantFormat> {
    match ty {
        GgmlType::Q4_0 => Some(QuantFormat::Q4_0),
        GgmlType::Q4_1 => Some(QuantFormat::Q4_1),
        GgmlType::Q5_0 => Some(QuantFormat::Q5_0),
        GgmlType::Q5_1 => Some(QuantFormat::Q5_1),
        GgmlType::Q8_0 => Some(QuantFormat::Q8_0),
        GgmlType::Q4K => Some(QuantFormat::Q4K),
        GgmlType::Q5K => Some(QuantFormat::Q5K),
        GgmlType::Q6K => Some(QuantFormat::Q6K),
        _ => None,
    }
}

/// The weight in device memory as `T`, as the CUDA loader uploads it: blocks dequantized on
/// the device where the GPU has a dequantizer, decoded on the host (bit-exact) otherwise.
pub fn upload_weight<T: TestFloat>(
    gpu: &Gpu,
    ty: GgmlType,
    bytes: &[u8],
    values: &[f32],
) -> DeviceBuffer<T> {
    match quant_format(ty) {
        Some(format) => {
            let mut out = poisoned::<T>(gpu, values.len());
            ops::dequantize(gpu, format, &gpu.upload(bytes).unwrap(), &mut out).unwrap();
            out
        }
        None => upload::<T>(gpu, values),
    }
}

/// `x [tokens, cols] W [rows, cols]^T` of random stored rows (also the quantized GPU kernel's
/// case, `linear_quant.rs`).
pub struct Linear {
    pub ty: GgmlType,
    pub tokens: usize,
    pub rows: usize,
    pub cols: usize,
    pub bytes: Vec<u8>,
    pub weights: Vec<f32>,
    pub x: Vec<f32>,
}

impl Linear {
    pub fn new(ty: GgmlType, (tokens, rows, cols): (usize, usize, usize), seed: u64) -> Linear {
        let mut rng = rng(seed);
        let bytes = weight_bytes(ty, rows, cols, &mut rng);
        Linear {
            ty,
            tokens,
            rows,
            cols,
            weights: dequantized(ty, rows, cols, &bytes),
            bytes,
            // A wide range (every 37th value 40 times larger), so Q8 values reach +-127 and
            // blocks differ in scale; bf16 values, so every backend sees the same inputs.
            x: round::<bf16>(&random_activations(tokens, cols, &mut rng)),
        }
    }

    /// The f64 dots of the dequantized weights with the activations, or (`q8`) with the Q8
    /// rows the integer kernels quantize them to; each value's scale the sum of |products|
    /// (assert_f64_dots' bound, 1e-5 * sum + 1e-6, as one scale per value).
    pub fn expected(&self, q8: bool) -> Expected {
        let seen = if q8 {
            let q = Q8Rows::quantize(&self.x, self.cols).unwrap();
            let mut seen = vec![0f32; self.x.len()];
            for (t, row) in seen.chunks_mut(self.cols).enumerate() {
                q.dequantize_row(t, row);
            }
            seen
        } else {
            self.x.clone()
        };
        let dots = f64_dots(&self.weights, &seen, self.cols);
        let values = dots.iter().map(|&(dot, _)| dot as f32).collect();
        let scales = dots.iter().map(|&(_, sum)| (sum + 0.1) as f32).collect();
        Expected { values, scales }
    }

    /// Whether `set` runs this weight on Q8 activations (a repacked integer weight).
    fn quantizes(&self, set: CpuKernels) -> bool {
        set.int_isa().is_some() && REPACKED.contains(&self.ty)
    }

    /// Whether `set`'s prefill runs on the AMX-BF16 tiles (`PAGODA_CPU_AMX_PREFILL=bf16`):
    /// bf16 activations and weights, not the integer kernels' Q8 arithmetic.
    fn bf16_tiles(&self, set: CpuKernels) -> bool {
        set == CpuKernels::Amx && !pagoda_ops::linear::batch_invariant()
    }

    fn gemm<TIn: TestFloat, TOut: TestFloat>(&self, gpu: &Gpu, beta_one: bool) -> Vec<f32> {
        let weights = upload_weight::<TIn>(gpu, self.ty, &self.bytes, &self.weights);
        let x = upload::<TIn>(gpu, &self.x);
        let shape = (self.tokens, self.rows, self.cols);
        let mut out = poisoned::<TOut>(gpu, self.tokens * self.rows);
        gpu.gemm(&x, &weights, &mut out, shape, 0.0).unwrap();
        if !beta_one {
            return download(gpu, &out);
        }
        // beta = 1 adds to the output: twice the product, halved exactly.
        gpu.gemm(&x, &weights, &mut out, shape, 1.0).unwrap();
        download(gpu, &out).iter().map(|v| v / 2.0).collect()
    }
}

impl OpCase for Linear {
    fn op(&self) -> &'static str {
        "linear"
    }

    fn shape(&self) -> String {
        format!(
            "{} x[{}, {}] W[{}, {}]",
            self.ty.name(),
            self.tokens,
            self.cols,
            self.rows,
            self.cols
        )
    }

    fn family(&self) -> Family {
        Family::Weights
    }

    fn reference(&self, backend: &Backend<'_>) -> Expected {
        let q8 = matches!(backend, Backend::CpuLinear(set) if self.quantizes(*set) && !self.bf16_tiles(*set));
        self.expected(q8)
    }

    fn run(&self, backend: &Backend<'_>) -> Option<Vec<Output>> {
        let output = |variant: &str, values| Output {
            variant: variant.into(),
            values,
        };
        match backend {
            Backend::CpuLinear(set) => {
                let weight =
                    Weight::with_kernels(self.ty, self.rows, self.cols, self.bytes.clone(), *set)
                        .unwrap();
                assert_eq!(
                    weight.int_isa().is_some(),
                    self.quantizes(*set),
                    "kernel choice"
                );
                let mut y = vec![f32::NAN; self.tokens * self.rows];
                weight.matmul(&self.x, self.tokens, &mut y);
                Some(vec![output("", y)])
            }
            Backend::Cuda(gpu, GpuDtype::F32) => Some(vec![
                output("", self.gemm::<f32, f32>(gpu, false)),
                output("beta=1", self.gemm::<f32, f32>(gpu, true)),
            ]),
            Backend::Cuda(gpu, GpuDtype::Bf16) => Some(vec![
                output("", self.gemm::<bf16, bf16>(gpu, false)),
                output("beta=1", self.gemm::<bf16, bf16>(gpu, true)),
                output("out=f32", self.gemm::<bf16, f32>(gpu, false)),
            ]),
            _ => None,
        }
    }

    fn tolerance(&self, backend: &Backend<'_>) -> f64 {
        match backend {
            Backend::CpuLinear(set) if self.bf16_tiles(*set) => 5e-3,
            // f32 accumulation in any order: K * 2^-24 at worst, far less in practice.
            Backend::CpuLinear(_) => 1e-5,
            Backend::Cuda(_, GpuDtype::F32) => 1e-4,
            // bf16 weights (2^-9 of each product) and a bf16 output (2^-9 of the sum).
            Backend::Cuda(_, GpuDtype::Bf16) => 5e-3,
            _ => 0.0,
        }
    }
}
