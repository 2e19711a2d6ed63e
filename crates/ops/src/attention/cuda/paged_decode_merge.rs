//! The log-sum-exp merge of split attention states (`paged_decode_merge.cu`): the fused
//! decode's second launch ([`MergeMode::Separate`](super::MergeMode)) and a generic merge
//! for callers with their own partials.

use super::mla::MLA_LATENT_DIMS;
use super::stream_tiling::PAGED_DECODE_HEAD_DIMS;
use super::{PAGED_DECODE, PAGED_DECODE_MERGE};
use crate::cuda_dtypes::check_float;
use pagoda_cuda::{
    check_len, ptr, to_u32, CudaError, DType, DeviceBuffer, DeviceRead, DeviceView, DeviceWrite,
    Element, Gpu, KernelArg, KernelSpec, LaunchDims,
};

/// The `merge_attention_partials` specialisation for `dtype` and `head_dim` (one of
/// [`PAGED_DECODE_HEAD_DIMS`], from the decode's source, or MLA's latent widths
/// [`MLA_LATENT_DIMS`], from a source without the partial kernels).
pub(super) fn specialize_merge(dtype: DType, head_dim: usize) -> Result<KernelSpec, CudaError> {
    if dtype != DType::F16 {
        check_float("attention merge", dtype)?;
    }
    let source = if MLA_LATENT_DIMS.contains(&head_dim) {
        &PAGED_DECODE_MERGE
    } else if PAGED_DECODE_HEAD_DIMS.contains(&head_dim) {
        &PAGED_DECODE
    } else {
        return Err(CudaError::invalid(format!(
            "paged decode head_dim {head_dim} is not supported (one of {PAGED_DECODE_HEAD_DIMS:?})"
        )));
    };
    Ok(KernelSpec {
        source,
        entry: "merge_attention_partials",
        params: vec![("HEAD_DIM", head_dim as i64), ("GROUP", 1)],
        dtypes: vec![("T", dtype)],
    })
}

/// Attention states to merge by log-sum-exp: partial rows `o_indptr[o] .. o_indptr[o + 1]`
/// of `out [N, num_heads, head_dim]` (f32) with their base-2 log-sum-exps `lse [N,
/// num_heads]` make output row `o` (of `M = o_indptr.len() - 1`).
#[derive(Clone, Copy, Debug)]
pub struct Partials<'a> {
    /// Partial outputs, `[N, num_heads, head_dim]`.
    pub out: DeviceView<'a, f32>,
    /// Their base-2 log-sum-exps, `[N, num_heads]`.
    pub lse: DeviceView<'a, f32>,
    /// `[M + 1]`: which partial rows make each output row.
    pub o_indptr: DeviceView<'a, u32>,
    /// Heads per row.
    pub num_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

/// The generic merge: output row `o` and head `h` combine the partial rows of `partials`
/// that `o_indptr` gives it. `-inf` (and NaN) partials are skipped; a row with no finite
/// partial becomes zeros and `-inf`. `out` is `[M, num_heads, head_dim]`; `lse_out` (`[M,
/// num_heads]`, optional) gets the merged base-2 log-sum-exps, so merges chain (the
/// operation is associative). With `skip_single`, rows of exactly one partial are left
/// untouched (the fused decode wrote them).
pub fn merge_attention_partials<T: Element>(
    gpu: &Gpu,
    partials: &Partials<'_>,
    skip_single: bool,
    out: &mut impl DeviceWrite<T>,
    lse_out: Option<&mut DeviceBuffer<f32>>,
) -> Result<(), CudaError> {
    merge_partials_launch(gpu, partials, skip_single, out, lse_out, false)
}

/// [`merge_attention_partials`], launched programmatically when `programmatic` (the kernel
/// waits for the previous one with `griddepcontrol.wait`).
pub(super) fn merge_partials_launch<T: Element>(
    gpu: &Gpu,
    partials: &Partials<'_>,
    skip_single: bool,
    out: &mut impl DeviceWrite<T>,
    lse_out: Option<&mut DeviceBuffer<f32>>,
    programmatic: bool,
) -> Result<(), CudaError> {
    let Partials {
        out: partial,
        lse,
        o_indptr,
        num_heads,
        head_dim,
    } = *partials;
    let (partial, lse, o_indptr) = (&partial, &lse, &o_indptr);
    let spec = specialize_merge(T::DTYPE, head_dim)?;
    if o_indptr.is_empty() || num_heads == 0 || num_heads > 65535 {
        return Err(CudaError::invalid(format!(
            "merge: o_indptr needs M + 1 >= 1 entries and 1..=65535 heads (got {} and {num_heads})",
            o_indptr.len()
        )));
    }
    let rows = o_indptr.len() - 1;
    if partial.len() % (num_heads * head_dim) != 0 || lse.len() * head_dim != partial.len() {
        return Err(CudaError::invalid(format!(
            "merge: partial ({}) and lse ({}) are not [N, {num_heads}, {head_dim}] and [N, {num_heads}]",
            partial.len(),
            lse.len()
        )));
    }
    check_len(
        "merge out [M, num_heads, head_dim]",
        rows * num_heads * head_dim,
        out.len(),
    )?;
    let lse_arg = match lse_out {
        Some(buffer) => {
            check_len(
                "merge lse_out [M, num_heads]",
                rows * num_heads,
                buffer.len(),
            )?;
            ptr(&*buffer)
        }
        None => KernelArg::Ptr(0),
    };
    if rows == 0 {
        return Ok(());
    }
    let args = [
        ptr(partial),
        ptr(lse),
        ptr(o_indptr),
        ptr(out),
        lse_arg,
        KernelArg::U32(u32::from(skip_single)),
    ];
    // The partial row ids in o_indptr live on the device: the kernel trusts them to be
    // < N (the fused decode's plan guarantees it; other callers build them on the host).
    let grid = (to_u32("merge rows", rows)?, num_heads as u32);
    let dims = LaunchDims {
        programmatic,
        ..LaunchDims::new(grid, 128)
    };
    // SAFETY: arguments match `merge_attention_partials`; out and lse_out extents checked.
    unsafe { gpu.launch(&spec, dims, &args) }
}
