//! The quantized small-batch linear layer on CUDA (`quantize_rows_q8` then `gemv_quant`): GGUF
//! blocks multiplied in place by activations quantized to 8 bits per 32 values. Reference: the
//! f64 dots of the dequantized weights (`pagoda_tensor::quant::dequantize`) with the Q8 rows
//! the CPU's integer kernels quantize the same activations to (`Q8Rows`: the GPU's quantizer
//! rounds identically), within 2e-5 (f32 out) or 5e-3 (bf16 out) of the sum of |products|.
//! Variants: f32 and bf16 outputs, `beta = 1` (the residual fusion), and a column slice of a
//! wider output (`ldo > n`: the parts of a stacked QKV or gate/up of mixed formats), each in
//! both layouts (`QuantGemvKernel::Groups`, and `Units` with its rule for a warp's weight rows,
//! 1 and 4), and the tensor-core kernel of batched decode (`gemm_quant_mma`, "mma"). Shapes
//! cover every
//! specialisation (1, 2, 3, 4, 6 and 8 rows; the tensor cores' 8, 16, 32 and 64: 16, 37, 64;
//! k of 4608 and 1280 split over CTAs),
//! two launches (11 rows; 70 for the tensor cores), weight row counts that
//! are not a multiple of a CTA's rows (1, 5, 19, 33, 37, 67, 130), k from one 256-value
//! super-block to 37 (a K-quant row of 148 units: not a multiple of a warp's 32 lanes) and k
//! of 3 super-blocks (12 units: most lanes idle). And the decoder of the
//! larger batches' path (`dequantize_fast`, blocks to a dense copy for the GEMM): within one
//! rounding of the bit-exact `pagoda_tensor::quant::dequantize`.

use pagoda_cuda::{view_mut, Gpu};
use pagoda_ops::cuda::{self as ops, Q8Rows as GpuQ8Rows, QuantGemvKernel, QUANT_PADDING};
use pagoda_tensor::GgmlType;

use crate::framework::{with_dtype, Backend, Expected, Family, GpuDtype, OpCase, Output};
use crate::gpu_common::{download, poisoned, rng, upload, TestFloat};
use crate::linear::{dequantized, quant_format, weight_bytes, Linear, FORMATS};

pub fn cases() -> Vec<Box<dyn OpCase>> {
    let mut cases: Vec<Box<dyn OpCase>> = Vec::new();
    // The formats the GPU multiplies in place.
    let formats = FORMATS.into_iter().filter(|&ty| quant_format(ty).is_some());
    for (index, ty) in formats.enumerate() {
        let shapes = [
            (1, 67, 512),
            (3, 37, 2560),
            (8, 64, 512),
            (11, 33, 256),
            (2, 5, 768),
            (4, 1, 9472),
            (6, 130, 1280),
            (1, 19, 9472),
            (16, 64, 4608),
            (37, 33, 1280),
            (64, 130, 256),
            (70, 19, 768),
        ];
        for (shape_index, shape) in shapes.into_iter().enumerate() {
            let seed = match shape_index {
                0..4 => 300 + 4 * index as u64 + shape_index as u64,
                4..8 => 1000 + 8 * index as u64 + shape_index as u64,
                _ => 2000 + 8 * index as u64 + shape_index as u64,
            };
            cases.push(Box::new(QuantLinear(Linear::new(ty, shape, seed))));
        }
        cases.push(Box::new(QuantDecode::new(
            ty,
            (37, 768),
            340 + index as u64,
        )));
    }
    cases
}

/// A `[rows, cols]` matrix decoded by `dequantize_fast`.
struct QuantDecode {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    bytes: Vec<u8>,
    values: Vec<f32>,
}

impl QuantDecode {
    fn new(ty: GgmlType, (rows, cols): (usize, usize), seed: u64) -> QuantDecode {
        let bytes = weight_bytes(ty, rows, cols, &mut rng(seed));
        QuantDecode {
            ty,
            rows,
            cols,
            values: dequantized(ty, rows, cols, &bytes),
            bytes,
        }
    }
}

impl OpCase for QuantDecode {
    fn op(&self) -> &'static str {
        "dequantize_fast"
    }

    fn shape(&self) -> String {
        format!("{} [{}, {}]", self.ty.name(), self.rows, self.cols)
    }

    fn family(&self) -> Family {
        Family::ReferenceOnly
    }

    fn reference(&self, backend: &Backend<'_>) -> Expected {
        match backend {
            Backend::Cuda(_, dtype) => Expected::relative(dtype.round(&self.values)),
            _ => Expected::relative(self.values.clone()),
        }
    }

    fn run(&self, backend: &Backend<'_>) -> Option<Vec<Output>> {
        let Backend::Cuda(gpu, dtype) = backend else {
            return None;
        };
        let format = quant_format(self.ty).expect("a GPU format");
        let w = gpu.upload(&self.bytes).unwrap();
        with_dtype!(*dtype, T => {
            let mut out = poisoned::<T>(gpu, self.rows * self.cols);
            ops::dequantize_fast(gpu, format, &w, &mut out, (self.rows, self.cols)).unwrap();
            Some(vec![Output { variant: String::new(), values: download(gpu, &out) }])
        })
    }

    fn tolerance(&self, backend: &Backend<'_>) -> f64 {
        match backend {
            // dw * q + mw in one FMA where ggml rounds twice: an ulp of f32, or of bf16 after.
            Backend::Cuda(_, GpuDtype::F32) => 1e-6,
            Backend::Cuda(_, GpuDtype::Bf16) => 5e-3,
            _ => 0.0,
        }
    }
}

/// The case of `linear`, run through the quantized kernel.
struct QuantLinear(Linear);

impl QuantLinear {
    /// `x w^T` through the quantized kernel (`None`: the tensor-core `gemm_quant_mma`) into
    /// `TOut`, with `beta = 1` (twice the product, halved exactly) and into the middle columns
    /// of a wider output when asked.
    fn run_kernel<TIn: TestFloat, TOut: TestFloat>(
        &self,
        gpu: &Gpu,
        kernel: Option<QuantGemvKernel>,
        beta_one: bool,
        slice: bool,
    ) -> Vec<f32> {
        let l = &self.0;
        let format = quant_format(l.ty).expect("a GPU format");
        let mut padded = l.bytes.clone();
        padded.resize(l.bytes.len() + QUANT_PADDING, 0);
        let w = gpu.upload(&padded).unwrap();
        let x = upload::<TIn>(gpu, &l.x);
        let mut q8 = GpuQ8Rows::with_splits(gpu, l.tokens, l.cols).unwrap();
        ops::quantize_rows_q8(gpu, &x, &mut q8, (l.tokens, l.cols)).unwrap();
        let (n, (ldo, first)) = (l.rows, if slice { (l.rows + 7, 5) } else { (l.rows, 0) });
        let mut out = poisoned::<TOut>(gpu, l.tokens * ldo);
        let mut run = |beta: f32| {
            let mut o = view_mut(&mut out, first..l.tokens * ldo).unwrap();
            match kernel {
                Some(kernel) => ops::gemv_quant(gpu, kernel, format, &w, &q8, &mut o, n, ldo, beta),
                None => ops::gemm_quant_mma(gpu, format, &w, &q8, &mut o, n, ldo, beta),
            }
            .unwrap();
        };
        run(0.0);
        if beta_one {
            run(1.0);
        }
        let all = download(gpu, &out);
        let scale = if beta_one { 0.5 } else { 1.0 };
        all.chunks(ldo)
            .flat_map(|row| row[first..first + n].iter().map(move |v| v * scale))
            .collect()
    }
}

impl OpCase for QuantLinear {
    fn op(&self) -> &'static str {
        "linear_quant"
    }

    fn shape(&self) -> String {
        let l = &self.0;
        let (ty, t, r, c) = (l.ty.name(), l.tokens, l.rows, l.cols);
        format!("{ty} x[{t}, {c}] W[{r}, {c}]")
    }

    fn family(&self) -> Family {
        Family::ReferenceOnly
    }

    fn reference(&self, _: &Backend<'_>) -> Expected {
        self.0.expected(true)
    }

    fn run(&self, backend: &Backend<'_>) -> Option<Vec<Output>> {
        let Backend::Cuda(gpu, dtype) = backend else {
            return None;
        };
        let output = |variant: &str, values| Output {
            variant: variant.into(),
            values,
        };
        let mut outputs = Vec::new();
        for (name, kernel) in [
            ("", Some(QuantGemvKernel::Groups)),
            ("units ", Some(QuantGemvKernel::UNITS)),
            (
                "units1 ",
                Some(QuantGemvKernel::Units { warp_rows: Some(1) }),
            ),
            (
                "units4 ",
                Some(QuantGemvKernel::Units { warp_rows: Some(4) }),
            ),
            ("mma ", None),
        ] {
            let run = |beta_one, slice, variant: &str| {
                with_dtype!(*dtype, T => {
                    let values = if variant == "out=f32" {
                        self.run_kernel::<T, f32>(gpu, kernel, beta_one, slice)
                    } else {
                        self.run_kernel::<T, T>(gpu, kernel, beta_one, slice)
                    };
                    output(&format!("{name}{variant}"), values)
                })
            };
            outputs.push(run(false, false, ""));
            outputs.push(run(true, false, "beta=1"));
            outputs.push(run(false, true, "ldo>n"));
            outputs.push(run(false, false, "out=f32"));
        }
        Some(outputs)
    }

    fn tolerance(&self, backend: &Backend<'_>) -> f64 {
        match backend {
            // Exact integer dots; f32 scales, sums and output (one variant writes bf16).
            Backend::Cuda(_, GpuDtype::F32) => 2e-5,
            Backend::Cuda(_, GpuDtype::Bf16) => 5e-3,
            _ => 0.0,
        }
    }
}
