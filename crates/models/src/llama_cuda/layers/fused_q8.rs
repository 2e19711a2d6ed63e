//! The producers of a quantized linear layer's input writing its q8 activations in their own
//! launch (`PAGODA_CUDA_QUANT_FUSED_Q8`): in a step that multiplies quantized matrices in
//! place, the RMSNorm before QKV, gate/up and the LM head, and the SiLU x up before the down
//! projection, run `rms_norm_q8` / `silu_mul_q8` (their output, and the bytes and scales
//! `quantize_rows_q8` would write from it) and mark the activations ready; the next
//! [`Linear::run`](super::Linear::run) skips its quantize launch. Three launches fewer a
//! layer, the same bits.

use pagoda_cuda::{view, CudaError, DeviceRead, DeviceWrite, Gpu};
use pagoda_ops::cuda as ops;

use super::{GpuStep, Matrix, QuantScratch};
use crate::llama_cuda::HostFloat;

/// `out <- rms_norm(x) * weight` (`rows` rows of `weight.len()` values), with the q8
/// activations of the linear layer that reads `out` next where `next_quantized` and the step
/// fuses ([`QuantScratch::producer_q8`]).
pub(super) fn rms_norm_for<T: HostFloat>(
    gpu: &Gpu,
    quant: &mut QuantScratch<T>,
    next_quantized: bool,
    (x, weight, out): (
        &impl DeviceRead<f32>,
        &impl DeviceRead<T>,
        &mut impl DeviceWrite<T>,
    ),
    (rows, eps): (usize, f32),
) -> Result<(), CudaError> {
    match quant.producer_q8(next_quantized, rows, weight.len()) {
        Some(q8) => ops::rms_norm_q8(gpu, x, weight, out, q8, eps),
        None => ops::rms_norm(gpu, x, weight, out, eps),
    }
}

/// Whether `matrix` is kept in GGUF blocks.
pub(super) fn quantized<T>(matrix: &Matrix<T>) -> bool {
    matches!(matrix, Matrix::Quantized(_))
}

impl<T: HostFloat> GpuStep<'_, T> {
    /// `act <- silu(gate) * up`, with the down projection's q8 activations where it is
    /// quantized (`down_quantized`, set by the gate/up projection) and the step fuses.
    pub(super) fn silu_mul_for_down(&mut self) -> Result<(), CudaError> {
        let (inter, num_tokens) = (self.model.config.intermediate_size, self.num_tokens);
        let gate = view(&self.gate_up, 0..num_tokens * 2 * inter)?;
        let up = view(&self.gate_up, inter..num_tokens * 2 * inter)?;
        let strides = (2 * inter, 2 * inter);
        let next_quantized = std::mem::take(&mut self.down_quantized);
        match self.quant.producer_q8(next_quantized, num_tokens, inter) {
            Some(q8) => ops::silu_mul_q8(self.gpu, (&gate, &up), &mut self.act, q8, inter, strides),
            None => ops::silu_mul(self.gpu, &gate, &up, &mut self.act, inter, strides),
        }
    }
}
