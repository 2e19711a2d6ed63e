//! The model's kernels: one `specialize_*` function per entry point (the only place where
//! runtime values become template constants) and a validating launcher per op.
//!
//! Activation dtypes: f32 and bf16 ([`FLOAT_DTYPES`]); math is f32 inside every kernel.
//! [`all_specializations`] lists every specialisation the launchers can request; CI
//! compiles all of them through NVRTC for `compute_90a` and `compute_80`.

mod attention;
mod decode_plan;
mod dequant;
mod elementwise;
mod embedding;
mod norm;
mod paged_decode;
mod prefill;
mod prefill_mma;
mod qkv;
mod rope;
mod sampling;

pub use attention::{
    decode_attention_gathered, decode_splits, prefill_attention, specialize_attention,
    AttentionEntry, DecodeWorkspace, DevicePageTable, PoolLayout, MAX_DECODE_SPLITS,
    SUPPORTED_HEAD_DIMS,
};
pub use decode_plan::{PagedDecodePlan, PlanCapacity, PlanPolicy, MAX_CHUNKS, PLAN_HEADER_WORDS};
pub use dequant::{dequantize, specialize_dequantize, QuantFormat};
pub use elementwise::{
    add_in_place, argmax_rows, silu_mul, specialize_elementwise, ElementwiseEntry,
};
pub use embedding::{embedding_gather, specialize_embedding};
pub use norm::{add_rms_norm, rms_norm, specialize_norm, NormEntry};
pub use paged_decode::{
    merge_attention_partials, mma_decode_stages, paged_decode_attention, paged_decode_unsupported,
    specialize_paged_decode, MergeMode, PagedDecodeEntry, PagedDecodeKernel, PagedDecodeWorkspace,
    MAX_DECODE_GROUP, PAGED_DECODE_HEAD_DIMS, PAGED_DECODE_MMA_HEAD_DIMS,
};
pub use prefill::{
    prefill_attention_tiled, prefill_attention_with, specialize_prefill, PrefillKernel,
    PrefillTiling,
};
pub use prefill_mma::{
    prefill_attention_mma, specialize_prefill_mma, MmaPrefillTiling, MMA_PREFILL_HEAD_DIMS,
};
pub use qkv::{add_bias_rows, rms_norm_heads, specialize_qkv, QkvEntry};
pub use rope::{kv_append, rope, specialize_kv_append, specialize_rope, RopeStyle};
pub use sampling::{
    decode_row_stats, default_fast_rounds, encode_row_params, filter_splits, plan_sampling,
    sample_rows, sample_rows_with, sampling_splits, specialize_cluster, specialize_sampling,
    ClusterShape, FilteredSampling, RowPath, RowSamplingStats, SamplingEntry, SamplingMix,
    SamplingOptions, SamplingPlan, SamplingRowParams, SamplingShapes, SamplingTotals,
    SamplingWorkspace, SmBudget, DEFAULT_MAX_REJECTION_ROUNDS, MAX_SAMPLING_ROWS,
    MAX_SAMPLING_SPLITS, SAMPLING_PARAM_WORDS, SAMPLING_TOTALS_WORDS,
};

use crate::error::CudaError;
use crate::key::{DType, KernelSource, KernelSpec};

/// Activation/weight dtypes the kernels are instantiated for.
pub const FLOAT_DTYPES: [DType; 2] = [DType::F32, DType::BF16];

pub(crate) static EMBEDDING: KernelSource =
    KernelSource::new("embedding.cu", include_str!("../../kernels/embedding.cu"));
pub(crate) static RMS_NORM: KernelSource =
    KernelSource::new("rms_norm.cu", include_str!("../../kernels/rms_norm.cu"));
pub(crate) static ROPE: KernelSource =
    KernelSource::new("rope.cu", include_str!("../../kernels/rope.cu"));
pub(crate) static KV_APPEND: KernelSource =
    KernelSource::new("kv_append.cu", include_str!("../../kernels/kv_append.cu"));
pub(crate) static ATTENTION: KernelSource =
    KernelSource::new("attention.cu", include_str!("../../kernels/attention.cu"));
pub(crate) static PAGED_DECODE: KernelSource = KernelSource::new(
    "paged_decode.cu",
    concat!(
        include_str!("../../kernels/paged_decode_common.cu"),
        include_str!("../../kernels/paged_decode.cu")
    ),
);
pub(crate) static PAGED_DECODE_MMA: KernelSource = KernelSource::new(
    "paged_decode_mma.cu",
    concat!(
        include_str!("../../kernels/paged_decode_common.cu"),
        include_str!("../../kernels/paged_decode_mma.cu")
    ),
);
pub(crate) static ELEMENTWISE: KernelSource = KernelSource::new(
    "elementwise.cu",
    include_str!("../../kernels/elementwise.cu"),
);
pub(crate) static DEQUANT: KernelSource =
    KernelSource::new("dequant.cu", include_str!("../../kernels/dequant.cu"));
pub(crate) static QKV: KernelSource =
    KernelSource::new("qkv.cu", include_str!("../../kernels/qkv.cu"));
pub(crate) static PREFILL: KernelSource =
    KernelSource::new("prefill.cu", include_str!("../../kernels/prefill.cu"));
pub(crate) static SAMPLING: KernelSource = KernelSource::new(
    "sampling.cu",
    concat!(
        include_str!("../../kernels/sampling_common.cu"),
        include_str!("../../kernels/sampling_walk.cu"),
        include_str!("../../kernels/sampling_gumbel.cu"),
        include_str!("../../kernels/sampling_fast.cu"),
        include_str!("../../kernels/sampling_list.cu"),
        include_str!("../../kernels/sampling_cluster_steps.cu"),
        include_str!("../../kernels/sampling_cluster.cu"),
        include_str!("../../kernels/sampling_rejection.cu")
    ),
);
pub(crate) static PREFILL_MMA: KernelSource = KernelSource::new(
    "prefill_mma.cu",
    include_str!("../../kernels/prefill_mma.cu"),
);

/// `dtype` is one of [`FLOAT_DTYPES`], or an error naming `what`.
pub(crate) fn check_float(what: &str, dtype: DType) -> Result<(), CudaError> {
    if FLOAT_DTYPES.contains(&dtype) {
        Ok(())
    } else {
        Err(CudaError::invalid(format!(
            "{what}: dtype {dtype} is not supported (f32, bf16)"
        )))
    }
}

/// Every kernel specialisation the launchers of this module can request.
pub fn all_specializations() -> Vec<KernelSpec> {
    let mut specs = Vec::new();
    let mut push =
        |spec: Result<KernelSpec, CudaError>| specs.push(spec.expect("catalogue entry is valid"));
    for &dtype in &FLOAT_DTYPES {
        for &table in &FLOAT_DTYPES {
            push(specialize_embedding(table, dtype));
        }
        for &x_dtype in &FLOAT_DTYPES {
            push(specialize_norm(NormEntry::RmsNorm, dtype, x_dtype));
        }
        push(specialize_norm(NormEntry::AddRmsNorm, dtype, dtype));
        for style in [RopeStyle::Interleaved, RopeStyle::Halves] {
            push(specialize_rope(dtype, style));
        }
        push(specialize_kv_append(dtype));
        for &head_dim in &SUPPORTED_HEAD_DIMS {
            for entry in [
                AttentionEntry::Prefill,
                AttentionEntry::PagedGather,
                AttentionEntry::DecodeGathered,
                AttentionEntry::MergeStates,
            ] {
                push(specialize_attention(entry, dtype, head_dim));
            }
        }
        for entry in [ElementwiseEntry::SiluMul, ElementwiseEntry::AddInPlace] {
            push(specialize_elementwise(entry, dtype));
        }
        for format in QuantFormat::ALL {
            push(specialize_dequantize(format, dtype));
        }
        for entry in QkvEntry::ALL {
            push(specialize_qkv(entry, dtype));
        }
        for &head_dim in &SUPPORTED_HEAD_DIMS {
            push(specialize_prefill(dtype, head_dim));
        }
    }
    for &head_dim in &PAGED_DECODE_HEAD_DIMS {
        for entry in [
            AttentionEntry::PagedGather,
            AttentionEntry::DecodeGathered,
            AttentionEntry::MergeStates,
        ] {
            push(specialize_attention(entry, DType::F16, head_dim));
        }
    }
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for &head_dim in &PAGED_DECODE_HEAD_DIMS {
            for group in 1..=MAX_DECODE_GROUP {
                push(specialize_paged_decode(
                    PagedDecodeEntry::Partial,
                    dtype,
                    head_dim,
                    group,
                ));
            }
            if dtype == DType::BF16 && PAGED_DECODE_MMA_HEAD_DIMS.contains(&head_dim) {
                for group in 1..=MAX_DECODE_GROUP {
                    push(specialize_paged_decode(
                        PagedDecodeEntry::PartialMma {
                            stages: mma_decode_stages(head_dim),
                        },
                        dtype,
                        head_dim,
                        group,
                    ));
                }
            }
            push(specialize_paged_decode(
                PagedDecodeEntry::Merge,
                dtype,
                head_dim,
                1,
            ));
        }
    }
    for &head_dim in &MMA_PREFILL_HEAD_DIMS {
        push(specialize_prefill_mma(DType::BF16, head_dim));
    }
    push(specialize_elementwise(
        ElementwiseEntry::ArgmaxRows,
        DType::F32,
    ));
    for entry in SamplingEntry::ALL {
        // The cluster kernel is launched in the shapes below only.
        if entry != SamplingEntry::Cluster {
            specs.push(specialize_sampling(entry));
        }
    }
    for shape in ClusterShape::CANDIDATES {
        specs.push(specialize_cluster(shape));
    }
    specs
}
