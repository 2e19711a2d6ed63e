//! A weight matrix on the GPU ([`Matrix`]): dense in the model's dtype, or GGUF blocks kept
//! as the file stores them (`PAGODA_CUDA_QUANT_WEIGHTS`), so device memory is the file's size.
//! A quantized matrix multiplies a few rows in place (`gemv_quant`: activations quantized to
//! 8 bits per 32 values, integer dots against the blocks), a few dozen on the tensor cores in
//! place (`gemm_quant_mma`, the same activations) and more rows by decoding itself into a
//! dense scratch for the GEMM ([`Linear`]).

use pagoda_cuda::{view, view_mut, CudaError, DeviceBuffer, DeviceRead, DeviceWrite, Element, Gpu};
use pagoda_ops::cuda::{self as ops, Q8Rows, QuantFormat};

/// Rows of activations the FP8 GEMM quantizes at a time (a longer step runs in pieces).
pub const FP8_GEMM_PIECE_ROWS: usize = 2048;

/// A `[rows, cols]` weight matrix on the device.
pub(crate) enum Matrix<T> {
    Dense(DeviceBuffer<T>),
    Quantized(QuantMatrix),
    /// FP8 (e4m3) codes as the file stores them, one factor per row
    /// (`PAGODA_CUDA_FP8_WEIGHTS`).
    Fp8(Box<Fp8Matrix>),
}

/// `rows * cols` e4m3 codes (row-major) and `rows` f32 factors.
pub(crate) struct Fp8Matrix {
    pub codes: DeviceBuffer<u8>,
    pub scales: DeviceBuffer<f32>,
    pub rows: usize,
    pub cols: usize,
}

/// Rows in GGUF blocks: consecutive parts of one format each (a stacked QKV of Q4_K q and k
/// and a Q6_K v is two parts), each buffer padded by [`ops::QUANT_PADDING`] bytes.
pub(crate) struct QuantMatrix {
    pub parts: Vec<QuantPart>,
    pub cols: usize,
}

pub(crate) struct QuantPart {
    pub format: QuantFormat,
    pub rows: usize,
    pub blocks: DeviceBuffer<u8>,
}

impl<T> Matrix<T> {
    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        match self {
            Matrix::Dense(buffer) => buffer.len() * std::mem::size_of::<T>(),
            Matrix::Quantized(q) => q.parts.iter().map(|p| p.blocks.len()).sum(),
            Matrix::Fp8(f) => f.codes.len() + 4 * f.scales.len(),
        }
    }

    /// Values a dense copy holds (`rows * cols`) if the matrix is quantized, else 0: the
    /// size of the scratch the GEMM path decodes it into.
    pub fn quantized_values(&self) -> usize {
        match self {
            Matrix::Dense(_) => 0,
            Matrix::Quantized(q) => q.parts.iter().map(|p| p.rows).sum::<usize>() * q.cols,
            Matrix::Fp8(f) => f.rows * f.cols,
        }
    }

    /// The formats of its quantized parts (none when dense or FP8).
    pub fn formats(&self) -> Vec<QuantFormat> {
        match self {
            Matrix::Quantized(q) => q.parts.iter().map(|p| p.format).collect(),
            Matrix::Dense(_) | Matrix::Fp8(_) => Vec::new(),
        }
    }

    /// Bytes of FP8 codes (0 unless [`Matrix::Fp8`]).
    pub fn fp8_bytes(&self) -> usize {
        match self {
            Matrix::Fp8(f) => f.codes.len(),
            _ => 0,
        }
    }
}

/// What a linear layer over a quantized matrix needs besides its input and output: the
/// quantized activations, the dense scratch and the largest row count the in-place kernel
/// takes (`PAGODA_CUDA_QUANT_GEMV_ROWS`; 0 in deterministic mode, whose GEMMs are
/// batch-invariant) and its layout (`PAGODA_CUDA_QUANT_GEMV_KERNEL`).
pub struct QuantScratch<T> {
    pub q8: Option<Q8Rows>,
    pub dense: Option<DeviceBuffer<T>>,
    pub gemv_rows: usize,
    /// Steps of more than `gemv_rows` and up to this many rows run the tensor-core kernel
    /// (`PAGODA_CUDA_QUANT_MMA_ROWS`; 0 in deterministic mode).
    pub mma_rows: usize,
    pub gemv_kernel: ops::QuantGemvKernel,
    /// The producers of a quantized layer's input (RMSNorm, SiLU x up) write its q8
    /// activations in their own launch (`PAGODA_CUDA_QUANT_FUSED_Q8`).
    pub fused_q8: bool,
    /// `q8` holds the input of the next linear layer, written by its producer
    /// ([`QuantScratch::producer_q8`]): the next [`Linear::run`] skips its quantize launch.
    pub prequantized: bool,
    /// A matrix of two parts of one of [`ops::QUANT_PAIRS`] (a Q4_K_M QKV with a Q6_K v)
    /// multiplies in one launch (`PAGODA_CUDA_QUANT_PAIR`, the `Groups` layout).
    pub pair: bool,
    /// The model's matrices of two such parts (set by the runner, for its counter).
    pub pair_matrices: usize,
    /// The model keeps FP8 matrices in their codes (set by the runner, for its counter).
    pub fp8: bool,
    /// Steps of more rows than [`Self::fp8_in_place`] takes multiply FP8 matrices on
    /// cuBLASLt's FP8 GEMM through this scratch (`PAGODA_CUDA_FP8_GEMM`; [`Self::keep_fp8`]).
    pub fp8_gemm: Option<ops::Fp8Activations>,
    /// With the FP8 GEMM, steps of up to this many rows still multiply in place
    /// (`PAGODA_CUDA_FP8_GEMV_ROWS`); without it, up to [`ops::FP8_GEMV_MAX_ROWS`].
    fp8_gemv_rows: usize,
    /// The widest input of a linear layer.
    width: usize,
}

impl<T: Element> QuantScratch<T> {
    /// Scratch for a model whose quantized matrices hold at most `values` values (0: none
    /// quantized, nothing allocated) with inputs of at most `width` values.
    pub fn new(
        gpu: &Gpu,
        values: usize,
        width: usize,
        (gemv_rows, mma_rows): (usize, usize),
        (gemv_kernel, fused_q8, pair): (ops::QuantGemvKernel, bool, bool),
    ) -> Result<Self, CudaError> {
        if values == 0 {
            return Ok(QuantScratch {
                q8: None,
                dense: None,
                gemv_rows: 0,
                mma_rows: 0,
                gemv_kernel,
                fused_q8,
                prequantized: false,
                pair,
                pair_matrices: 0,
                fp8: false,
                fp8_gemm: None,
                fp8_gemv_rows: ops::FP8_GEMV_MAX_ROWS,
                width,
            });
        }
        Ok(QuantScratch {
            q8: match (gemv_rows.max(mma_rows), mma_rows) {
                (0, _) => None,
                (rows, 0) => Some(Q8Rows::new(gpu, rows, width)?),
                (rows, _) => Some(Q8Rows::with_splits(gpu, rows, width)?),
            },
            dense: Some(gpu.alloc::<T>(values)?),
            gemv_rows,
            mma_rows,
            gemv_kernel,
            fused_q8,
            prequantized: false,
            pair,
            pair_matrices: 0,
            fp8: false,
            fp8_gemm: None,
            fp8_gemv_rows: ops::FP8_GEMV_MAX_ROWS,
            width,
        })
    }

    /// The model keeps FP8 matrices: with `gemm` (and FP8 tensor cores) its steps of more
    /// than `gemv_rows` rows run the FP8 GEMM, activations quantized through scratch for
    /// `rows` rows at a time (at most [`FP8_GEMM_PIECE_ROWS`]).
    pub fn keep_fp8(
        &mut self,
        gpu: &Gpu,
        rows: usize,
        (gemm, gemv_rows): (bool, usize),
    ) -> Result<(), CudaError> {
        self.fp8 = true;
        self.fp8_gemv_rows = gemv_rows.min(ops::FP8_GEMV_MAX_ROWS);
        if gemm && gpu.fp8_gemm_supported() {
            let rows = rows.clamp(1, FP8_GEMM_PIECE_ROWS);
            self.fp8_gemm = Some(ops::Fp8Activations::new(gpu, rows, self.width)?);
        }
        static LOGGED: std::sync::Once = std::sync::Once::new();
        let large = match self.fp8_gemm {
            Some(_) => "cuBLASLt's FP8 GEMM, activations quantized to e4m3 per token",
            None => "decoded into a bf16 scratch for cuBLAS",
        };
        LOGGED.call_once(|| {
            tracing::info!(
                "CUDA FP8 matrices: up to {} rows in place (gemv_fp8), more on {large} \
                 (PAGODA_CUDA_FP8_GEMM)",
                if self.gemv_rows > 0 {
                    self.fp8_in_place_rows()
                } else {
                    0
                }
            )
        });
        Ok(())
    }

    /// Whether a step of `rows` rows multiplies FP8 matrices on the FP8 GEMM.
    pub fn fp8_gemm_runs(&self, rows: usize) -> bool {
        self.fp8_gemm.is_some() && !self.fp8_in_place(rows)
    }

    /// Whether a step of `rows` rows multiplies FP8 matrices in place (`gemv_fp8`): up to
    /// `PAGODA_CUDA_FP8_GEMV_ROWS` with the FP8 GEMM, else [`ops::FP8_GEMV_MAX_ROWS`], unless
    /// in place is off (deterministic mode).
    pub fn fp8_in_place(&self, rows: usize) -> bool {
        self.gemv_rows > 0 && rows <= self.fp8_in_place_rows()
    }

    /// The most rows a step multiplies FP8 matrices in place.
    fn fp8_in_place_rows(&self) -> usize {
        match self.fp8_gemm {
            Some(_) => self.fp8_gemv_rows,
            None => ops::FP8_GEMV_MAX_ROWS,
        }
    }

    /// Whether a step of `rows` rows multiplies quantized matrices in place.
    pub fn in_place(&self, rows: usize) -> bool {
        self.q8.is_some() && rows <= self.gemv_rows
    }

    /// Whether a step of `rows` rows multiplies quantized matrices on the tensor cores.
    pub fn mma(&self, rows: usize) -> bool {
        self.q8.is_some() && !self.in_place(rows) && rows <= self.mma_rows
    }

    /// The two parts of `q` when they multiply in one launch ([`Self::pair`]; in place only
    /// in the `Groups` layout, always on the tensor cores).
    pub(crate) fn pair_parts<'q>(
        &self,
        q: &'q QuantMatrix,
        mma: bool,
    ) -> Option<[&'q QuantPart; 2]> {
        let [a, b] = &q.parts[..] else {
            return None;
        };
        let applies = self.pair
            && (mma || self.gemv_kernel == ops::QuantGemvKernel::Groups)
            && ops::QUANT_PAIRS.contains(&(a.format, b.format));
        applies.then_some([a, b])
    }

    /// Whether the model's matrices of two parts multiply in one launch each (in place).
    pub fn pairs_in_one_launch(&self) -> bool {
        self.pair && self.gemv_kernel == ops::QuantGemvKernel::Groups && self.pair_matrices > 0
    }

    /// Whether a step of `rows` rows has the producers of quantized layers' inputs write
    /// their q8 activations (`PAGODA_CUDA_QUANT_FUSED_Q8`, in place or on the tensor cores).
    pub fn fuses(&self, rows: usize) -> bool {
        self.fused_q8 && (self.in_place(rows) || self.mma(rows))
    }

    /// The q8 activations the producer of `rows` rows of `width` values writes for the
    /// linear layer that reads them directly after (marked ready for it): `None` (the
    /// producer writes only its output, the layer quantizes it) unless [`Self::fuses`], that
    /// layer is quantized (`next_quantized`) and `width` a whole number of 32-value blocks.
    pub fn producer_q8(
        &mut self,
        next_quantized: bool,
        rows: usize,
        width: usize,
    ) -> Option<&mut Q8Rows> {
        self.prequantized = false;
        if !self.fuses(rows) || !next_quantized || !width.is_multiple_of(32) {
            return None;
        }
        self.prequantized = true;
        self.q8.as_mut()
    }
}

/// The linear layers of one step: `out = beta * out + a w^T`, dense weights on cuBLAS (or the
/// small-batch bf16 kernel, `PAGODA_CUDA_GEMV`), quantized ones as [`QuantScratch`] says.
pub(crate) struct Linear<'a, T> {
    pub gpu: &'a Gpu,
    /// `PAGODA_CUDA_GEMV`: dense bf16 rows on the small-batch kernel.
    pub small: bool,
    pub quant: &'a mut QuantScratch<T>,
}

impl<T: Element> Linear<'_, T> {
    pub fn run<TOut: Element>(
        &mut self,
        a: &impl DeviceRead<T>,
        w: &Matrix<T>,
        out: &mut impl DeviceWrite<TOut>,
        (m, n, k): (usize, usize, usize),
        beta: f32,
    ) -> Result<(), CudaError> {
        let gpu = self.gpu;
        // Activations its producer quantized (for this layer only: any run clears the mark).
        let prequantized = std::mem::take(&mut self.quant.prequantized);
        let q = match w {
            Matrix::Dense(w) if self.small && ops::gemv_small_applies(a, w, (m, n, k)) => {
                return ops::gemv_small(gpu, a, w, out, (m, n, k), beta);
            }
            Matrix::Dense(w) => return gpu.gemm(a, w, out, (m, n, k), beta),
            Matrix::Fp8(f) => return self.run_fp8(a, f, out, (m, n, k), beta),
            Matrix::Quantized(q) => q,
        };
        let mma = self.quant.mma(m);
        if self.quant.in_place(m) || mma {
            let pair = self.quant.pair_parts(q, mma);
            let kernel = self.quant.gemv_kernel;
            let q8 = self.quant.q8.as_mut().expect("in_place and mma checked it");
            if !prequantized || q8.shape() != (m, k) {
                ops::quantize_rows_q8(gpu, a, q8, (m, k))?;
            }
            if let Some([pa, pb]) = pair {
                let parts = (
                    (pa.format, &pa.blocks, pa.rows),
                    (pb.format, &pb.blocks, pb.rows),
                );
                return match mma {
                    true => ops::gemm_quant_mma_pair(gpu, parts.0, parts.1, q8, out, n, beta),
                    false => ops::gemv_quant_pair(gpu, parts.0, parts.1, q8, out, n, beta),
                };
            }
            let mut column = 0;
            for part in &q.parts {
                let (format, blocks, rows) = (part.format, &part.blocks, part.rows);
                let mut slice = view_mut(out, column..m * n)?;
                match mma {
                    true => {
                        ops::gemm_quant_mma(gpu, format, blocks, q8, &mut slice, rows, n, beta)?
                    }
                    false => {
                        ops::gemv_quant(gpu, kernel, format, blocks, q8, &mut slice, rows, n, beta)?
                    }
                }
                column += part.rows;
            }
            return Ok(());
        }
        let dense =
            self.quant.dense.as_mut().ok_or_else(|| {
                CudaError::invalid("a quantized matrix without its dense scratch")
            })?;
        let mut row = 0;
        for part in &q.parts {
            let mut rows = view_mut(dense, row * k..(row + part.rows) * k)?;
            ops::dequantize_fast(gpu, part.format, &part.blocks, &mut rows, (part.rows, k))?;
            row += part.rows;
        }
        gpu.gemm(a, &view(dense, 0..n * k)?, out, (m, n, k), beta)
    }
}

impl<T: Element> Linear<'_, T> {
    /// An FP8 matrix: in place (`gemv_fp8`) for up to [`ops::FP8_GEMV_MAX_ROWS`] bf16 rows
    /// when the model multiplies a few rows in place at all (not in deterministic mode,
    /// whose GEMMs are batch-invariant), else on the FP8 GEMM where the model has its scratch
    /// and the shape fits, else decoded into the dense scratch for the GEMM.
    fn run_fp8<TOut: Element>(
        &mut self,
        a: &impl DeviceRead<T>,
        f: &Fp8Matrix,
        out: &mut impl DeviceWrite<TOut>,
        (m, n, k): (usize, usize, usize),
        beta: f32,
    ) -> Result<(), CudaError> {
        let gpu = self.gpu;
        let weights = (&f.codes, &f.scales);
        if self.quant.fp8_in_place(m) && ops::gemv_fp8_applies(a, &f.codes, (m, n, k)) {
            return ops::gemv_fp8(gpu, a, weights, out, (m, n, k), beta);
        }
        if let Some(scratch) = self.quant.fp8_gemm.as_mut() {
            if ops::fp8_gemm_applies::<TOut>(gpu, scratch, (n, k)) {
                match ops::fp8_gemm(gpu, a, weights, scratch, out, (m, n, k), beta) {
                    Err(CudaError::Blas { context, message }) => {
                        tracing::warn!(
                            "cuBLASLt refused an FP8 GEMM of [{m}, {k}] x [{n}, {k}] ({context}: \
                             {message}); FP8 matrices are decoded for cuBLAS from now on"
                        );
                        self.quant.fp8_gemm = None;
                    }
                    done => return done,
                }
            }
        }
        let dense = self
            .quant
            .dense
            .as_mut()
            .ok_or_else(|| CudaError::invalid("an FP8 matrix without its dense scratch"))?;
        let mut rows = view_mut(dense, 0..n * k)?;
        ops::dequantize_fp8(gpu, weights, &mut rows, (n, k))?;
        gpu.gemm(a, &view(dense, 0..n * k)?, out, (m, n, k), beta)
    }
}
