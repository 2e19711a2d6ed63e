//! Structured output's token masks on the device: the packed bitmask of each constrained
//! row, computed on the host, is uploaded and applied to the row's logits in place before
//! [`sample_rows_with`](super::sample_rows_with) runs, so a constrained row samples on the
//! device like any other (no logits round trip).

use pagoda_cuda::{ptr, CudaError, DeviceRead, DeviceWrite, Gpu, KernelArg, LaunchDims};

use super::entries::{specialize_sampling, SamplingEntry};

/// Threads of a mask CTA (one per token).
const MASK_THREADS: u32 = 256;

/// Applies `mask_rows.len()` packed token masks to rows of `logits` (`[rows, vocab]` f32):
/// mask `m` (the `m`-th run of `masks.len() / mask_rows.len()` words; bit `v % 32` of word
/// `v / 32` set when token `v` is allowed) goes to row `mask_rows[m]`, whose every other
/// logit (and every id past the mask's words) becomes NaN, which the sampling kernels treat
/// as masked. Every entry of `mask_rows` must be below `logits.len() / vocab` (the device
/// reads it; the caller writes it). Enqueued on the GPU's stream; nothing is synchronised.
pub fn apply_token_masks(
    gpu: &Gpu,
    logits: &mut impl DeviceWrite<f32>,
    vocab: usize,
    masks: &impl DeviceRead<u32>,
    mask_rows: &impl DeviceRead<u32>,
) -> Result<(), CudaError> {
    let count = mask_rows.len();
    if count == 0 {
        return Ok(());
    }
    if vocab == 0 || logits.len() % vocab != 0 || logits.len() / vocab < count {
        return Err(CudaError::invalid(format!(
            "token masks: {} logits are not rows of vocab {vocab} for {count} masks",
            logits.len()
        )));
    }
    if masks.len() % count != 0 || masks.len() / count == 0 {
        return Err(CudaError::invalid(format!(
            "token masks: {} mask words are not {count} equal masks",
            masks.len()
        )));
    }
    let words = masks.len() / count;
    let grid = LaunchDims::new(
        ((vocab as u32).div_ceil(MASK_THREADS), count as u32),
        MASK_THREADS,
    );
    let args = [
        ptr(logits),
        ptr(masks),
        ptr(mask_rows),
        KernelArg::U32(vocab as u32),
        KernelArg::U32(words as u32),
    ];
    // SAFETY: the arguments match `sampling_token_mask` in sampling_mask.cu; every mask read
    // is within `count * words` words, and every write within row `mask_rows[m] < rows` of
    // `vocab` logits (the caller's contract above).
    unsafe { gpu.launch(&specialize_sampling(SamplingEntry::TokenMask), grid, &args) }
}
