//! In-place fix-ups of the fused Q/K/V GEMM output, applied before RoPE: the q/k/v bias of
//! Qwen2 ([`add_bias_rows`]) and the per-head q/k RMSNorm of Qwen3 ([`rms_norm_heads`]).

use super::QKV;
use crate::cuda_dtypes::check_float;
use pagoda_cuda::{
    check_min_len, ptr, to_u32, CudaError, DType, DeviceRead, DeviceWrite, Element, Gpu, KernelArg,
    KernelSpec, LaunchDims,
};

/// The entry points of `qkv.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkvEntry {
    /// `add_bias_rows`.
    AddBiasRows,
    /// `rms_norm_heads`.
    RmsNormHeads,
}

impl QkvEntry {
    /// Every entry point of `qkv.cu`.
    pub const ALL: [QkvEntry; 2] = [QkvEntry::AddBiasRows, QkvEntry::RmsNormHeads];
}

/// The specialisation of `entry` for the buffer and weight dtype `dtype` (f32 or bf16).
pub fn specialize_qkv(entry: QkvEntry, dtype: DType) -> Result<KernelSpec, CudaError> {
    check_float("qkv", dtype)?;
    Ok(KernelSpec {
        source: &QKV,
        entry: match entry {
            QkvEntry::AddBiasRows => "add_bias_rows",
            QkvEntry::RmsNormHeads => "rms_norm_heads",
        },
        params: vec![],
        dtypes: vec![("T", dtype)],
    })
}

const BIAS_BLOCK: u32 = 256;
/// Most blocks in y; the kernel strides over further rows.
const MAX_GRID_Y: usize = 65535;
/// Threads per block of `rms_norm_heads`: 4 warps, one (token, head) each.
const HEADS_BLOCK: u32 = 128;

/// Adds `bias` (`[width]`, `width = bias.len()`) in place to the first `width` columns of each
/// of the `num_rows` rows of `x`, rows `row_stride` elements apart:
/// `x[r * row_stride + i] += bias[i]` for `r < num_rows`, `i < width`, rounded to `T`. Other
/// elements are untouched. `x` must hold at least `(num_rows - 1) * row_stride + width`
/// elements. For the fused QKV GEMM output `[num_tokens, q_dim + 2 * kv_dim]`, `bias` is
/// `[q_bias | k_bias | v_bias]` and `width = row_stride = q_dim + 2 * kv_dim`.
pub fn add_bias_rows<T: Element>(
    gpu: &Gpu,
    x: &mut impl DeviceWrite<T>,
    bias: &impl DeviceRead<T>,
    num_rows: usize,
    row_stride: usize,
) -> Result<(), CudaError> {
    let spec = specialize_qkv(QkvEntry::AddBiasRows, T::DTYPE)?;
    let width = bias.len();
    if width == 0 || width > row_stride {
        return Err(CudaError::invalid(format!(
            "add_bias_rows: bias width {width}, row_stride {row_stride}: need 0 < width <= row_stride"
        )));
    }
    if num_rows == 0 {
        return Ok(());
    }
    let needed = (num_rows - 1)
        .checked_mul(row_stride)
        .and_then(|elements| elements.checked_add(width))
        .ok_or_else(|| CudaError::invalid("add_bias_rows: [num_rows, row_stride] overflows"))?;
    check_min_len("add_bias_rows x [num_rows, row_stride]", needed, x.len())?;
    let args = [
        ptr(x),
        ptr(bias),
        KernelArg::U32(to_u32("num_rows", num_rows)?),
        KernelArg::U32(to_u32("width", width)?),
        KernelArg::U32(to_u32("row_stride", row_stride)?),
    ];
    let grid = (
        to_u32("blocks", width.div_ceil(BIAS_BLOCK as usize))?,
        num_rows.min(MAX_GRID_Y) as u32,
    );
    // SAFETY: arguments match `add_bias_rows`; extents validated.
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, BIAS_BLOCK), &args) }
}

/// Per-head RMSNorm in place (Qwen3's `q_norm` / `k_norm`): for token `t < num_tokens` and head
/// `h < num_heads`, the slice `x[t * row_stride + h * head_dim ..][..head_dim]` becomes
/// `slice / sqrt(mean(slice^2) + eps) * weight`, with `head_dim = weight.len()`; other
/// elements are untouched. Pass a view that starts at the first head (at offset `q_dim` of a
/// fused QKV row for the k heads). `x` must hold at least
/// `(num_tokens - 1) * row_stride + num_heads * head_dim` elements.
pub fn rms_norm_heads<T: Element>(
    gpu: &Gpu,
    x: &mut impl DeviceWrite<T>,
    weight: &impl DeviceRead<T>,
    (num_tokens, num_heads, row_stride): (usize, usize, usize),
    eps: f32,
) -> Result<(), CudaError> {
    let spec = specialize_qkv(QkvEntry::RmsNormHeads, T::DTYPE)?;
    let head_dim = weight.len();
    let heads_width = num_heads.checked_mul(head_dim);
    if num_heads == 0 || head_dim == 0 || heads_width.is_none_or(|width| width > row_stride) {
        return Err(CudaError::invalid(format!(
            "rms_norm_heads geometry: num_heads {num_heads}, head_dim {head_dim} (weight length), \
             row_stride {row_stride}: need positive heads and num_heads * head_dim <= row_stride"
        )));
    }
    if !(eps >= 0.0 && eps.is_finite()) {
        return Err(CudaError::invalid(format!(
            "rms_norm_heads: eps {eps} must be finite and non-negative"
        )));
    }
    if num_tokens == 0 {
        return Ok(());
    }
    let needed = (num_tokens - 1)
        .checked_mul(row_stride)
        .and_then(|elements| elements.checked_add(num_heads * head_dim))
        .ok_or_else(|| CudaError::invalid("rms_norm_heads: [num_tokens, row_stride] overflows"))?;
    check_min_len("rms_norm_heads x [num_tokens, row_stride]", needed, x.len())?;
    let pairs = num_tokens
        .checked_mul(num_heads)
        .ok_or_else(|| CudaError::invalid("rms_norm_heads: num_tokens * num_heads overflows"))?;
    let pairs = to_u32("rms_norm_heads num_tokens * num_heads", pairs)?;
    let warps_per_block = HEADS_BLOCK / 32;
    let args = [
        ptr(x),
        ptr(weight),
        KernelArg::U32(to_u32("num_tokens", num_tokens)?),
        KernelArg::U32(to_u32("num_heads", num_heads)?),
        KernelArg::U32(to_u32("head_dim", head_dim)?),
        KernelArg::U32(to_u32("row_stride", row_stride)?),
        KernelArg::F32(eps),
    ];
    let grid = (pairs.div_ceil(warps_per_block), 1);
    // SAFETY: arguments match `rms_norm_heads`; extents validated.
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, HEADS_BLOCK), &args) }
}
