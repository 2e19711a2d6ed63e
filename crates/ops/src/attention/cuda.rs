//! Attention on the GPU: the launchers, their plan types and the CUDA sources, with the list
//! of specialisations they can request ([`specializations`]).
//!
//! - [`gathered`](self): causal ragged prefill (per token) and the baseline decode (gather
//!   the pages, then attend), the device page table and pool layout every launcher takes.
//! - `prefill` / `prefill_mma` / `prefill_stream`: the query-tiled prefill kernels (CUDA
//!   cores, WMMA tensor cores, raw-MMA streaming with its tilings).
//! - `paged_decode` + `decode_plan` + `paged_decode_merge`: the fused split-KV paged decode
//!   with its work plan and the log-sum-exp merge, the production batched decode;
//!   `decode_tuning`: the table of which kernel, merge and CTA target runs each shape bucket
//!   (`pagoda tune`).
//! - `kv_fp8`: the e4m3 KV cache's storage and scales (the kernels that read it are fp8 builds
//!   of the decode and the tiled prefill; its appends are rope's).
//! - `mla`: DeepSeek's latent attention (absorbed decode and prefill over the latent pool,
//!   the latent append), on the same plan and merge.
//! - `sparse` + `sparse_plan`: Quest sparse decode's key summaries and page selection (a
//!   shorter page table for the fused decode), with the host plan of the selected table.

mod cascade;
mod cascade_plan;
mod decode_plan;
mod decode_tuning;
mod gathered;
mod kv_fp8;
mod mla;
mod mla_decode;
mod paged_decode;
mod paged_decode_merge;
mod prefill;
mod prefill_mma;
mod prefill_stream;
mod sparse;
mod sparse_plan;
mod stream_tiling;

pub use cascade::{
    cascade_decode_attention, cascade_unsupported, specialize_cascade_shared, CascadeWorkspace,
    CASCADE_TILINGS,
};
pub use cascade_plan::{CascadeCapacity, CascadeGeometry, CascadePlan, SuffixTable};
pub use decode_plan::{
    PagedDecodePlan, PlanCapacity, PlanPolicy, MAX_CHUNKS, PLAN_HEADER_WORDS, RESERVED_CHUNK,
};
pub use decode_tuning::{
    kernel_name, parse_kernel, tuned_sources_hash, DecodeBucket, DecodeGeometry, DecodeVariant,
    TableKey, TunedDecode, TunedPrefill, TuningTable, CANDIDATE_WAVES, MIN_CONTEXT_BUCKET,
};
pub use gathered::{
    decode_attention_gathered, decode_splits, prefill_attention, specialize_attention,
    AttentionEntry, DecodeWorkspace, DevicePageTable, PagedKv, PoolLayout, Queries,
    MAX_DECODE_SPLITS, SUPPORTED_HEAD_DIMS,
};
pub use kv_fp8::{Fp8KvLayer, KvScales};
pub use mla::{
    mla_append, mla_decode, mla_head_tiles, mla_prefill, mla_unsupported, specialize_mla,
    LatentPool, MlaDecodeWorkspace, MlaEntry, MlaKernel, NewLatent, MLA_HEAD_TILE, MLA_LATENT_DIMS,
    MLA_MMA_STAGES, MLA_ROPE_DIM,
};
pub use paged_decode::{
    fp8_kv_unsupported, mma_decode_stages, paged_decode_attention, paged_decode_attention_fp8,
    paged_decode_unsupported, specialize_paged_decode, specialize_paged_decode_fp8,
    specialize_paged_decode_fp8_entry, MergeMode, PagedDecodeEntry, PagedDecodeKernel,
    PagedDecodeWorkspace,
};
pub use paged_decode_merge::{merge_attention_partials, Partials};
pub use prefill::{
    prefill_attention_tiled, prefill_attention_tiled_fp8, prefill_attention_with,
    specialize_prefill, specialize_prefill_fp8, PrefillKernel, PrefillTiling,
};
pub use prefill_mma::{
    prefill_attention_mma, specialize_prefill_mma, MmaPrefillTiling, MMA_PREFILL_HEAD_DIMS,
};
pub use prefill_stream::{
    prefill_attention_stream, prefill_attention_stream_fp8, specialize_prefill_stream,
    specialize_prefill_stream_fp8, PrefillStreamTiling, STREAM_PREFILL_HEAD_DIMS,
};
pub use sparse::{
    score_pages_per_cta, sparse_decode, sparse_page_scores, sparse_select, sparse_select_entries,
    sparse_summaries_len, sparse_summaries_update, specialize_sparse, SparseEntry,
    SparseSelectKernels, SparseSelectPlan, SparseSelectWorkspace, SPARSE_DENSE, SPARSE_DTYPES,
    SPARSE_MAX_HEAD_DIM, SPARSE_MAX_KV_HEADS, SPARSE_MAX_PAGES, SPARSE_MAX_QUERY_BYTES,
    SPARSE_REQUEST_WORDS,
};
pub use stream_tiling::{
    StreamTiling, MAX_DECODE_GROUP, PAGED_DECODE_HEAD_DIMS, PAGED_DECODE_MMA_HEAD_DIMS,
};

use crate::cuda_dtypes::FLOAT_DTYPES;
use pagoda_cuda::{CudaError, DType, KernelSource, KernelSpec};

/// Prefill, gather, gathered decode and the state merge.
pub(crate) static ATTENTION: KernelSource =
    KernelSource::new("attention.cu", include_str!("cuda/attention.cu"));
/// The fused paged decode on CUDA cores.
pub(crate) static PAGED_DECODE: KernelSource = KernelSource::new(
    "paged_decode.cu",
    concat!(
        include_str!("cuda/tensor_core.cu"),
        include_str!("cuda/kv_fp8.cu"),
        include_str!("cuda/paged_decode_common.cu"),
        include_str!("cuda/paged_decode.cu"),
        include_str!("cuda/paged_decode_merge.cu")
    ),
);
/// The log-sum-exp merge alone, for head sizes the partial kernels of `paged_decode.cu` are
/// not built for (MLA's latent widths).
pub(crate) static PAGED_DECODE_MERGE: KernelSource = KernelSource::new(
    "paged_decode_merge.cu",
    concat!(
        include_str!("cuda/tensor_core.cu"),
        include_str!("cuda/paged_decode_common.cu"),
        include_str!("cuda/paged_decode_merge.cu")
    ),
);
/// The MLA latent append.
pub(crate) static MLA_APPEND: KernelSource =
    KernelSource::new("mla_append.cu", include_str!("cuda/mla_append.cu"));
/// The MLA decode and prefill on CUDA cores.
pub(crate) static MLA_DECODE: KernelSource = KernelSource::new(
    "mla_decode.cu",
    concat!(
        include_str!("cuda/tensor_core.cu"),
        include_str!("cuda/mla_common.cu"),
        include_str!("cuda/mla_decode.cu")
    ),
);
/// The MLA decode on tensor cores.
pub(crate) static MLA_DECODE_MMA: KernelSource = KernelSource::new(
    "mla_decode_mma.cu",
    concat!(
        include_str!("cuda/tensor_core.cu"),
        include_str!("cuda/mla_common.cu"),
        include_str!("cuda/mla_decode_mma.cu")
    ),
);
/// The fused paged decode on tensor cores.
pub(crate) static PAGED_DECODE_MMA: KernelSource = KernelSource::new(
    "paged_decode_mma.cu",
    concat!(
        include_str!("cuda/tensor_core.cu"),
        include_str!("cuda/paged_decode_common.cu"),
        include_str!("cuda/paged_decode_mma.cu")
    ),
);
/// The streaming paged decode on tensor cores (softmax in registers; bf16 or e4m3 pools).
pub(crate) static PAGED_DECODE_STREAM: KernelSource = KernelSource::new(
    "paged_decode_stream.cu",
    concat!(
        include_str!("cuda/tensor_core.cu"),
        include_str!("cuda/kv_fp8.cu"),
        include_str!("cuda/paged_decode_common.cu"),
        include_str!("cuda/paged_decode_stream.cu")
    ),
);
/// The query-tiled prefill on CUDA cores.
pub(crate) static PREFILL: KernelSource = KernelSource::new(
    "prefill.cu",
    concat!(
        include_str!("cuda/kv_fp8.cu"),
        include_str!("cuda/prefill.cu")
    ),
);
/// The streaming prefill on tensor cores (softmax in registers).
pub(crate) static PREFILL_STREAM: KernelSource = KernelSource::new(
    "prefill_stream.cu",
    concat!(
        include_str!("cuda/tensor_core.cu"),
        include_str!("cuda/kv_fp8.cu"),
        include_str!("cuda/prefill_stream_common.cu"),
        include_str!("cuda/prefill_stream.cu")
    ),
);
/// The query-tiled prefill on tensor cores.
pub(crate) static PREFILL_MMA: KernelSource =
    KernelSource::new("prefill_mma.cu", include_str!("cuda/prefill_mma.cu"));

/// Every specialisation the attention launchers can request.
pub fn specializations() -> Result<Vec<KernelSpec>, CudaError> {
    let mut specs = Vec::new();
    let gathered = [
        AttentionEntry::PagedGather,
        AttentionEntry::DecodeGathered,
        AttentionEntry::MergeStates,
    ];
    for &dtype in &FLOAT_DTYPES {
        for &head_dim in &SUPPORTED_HEAD_DIMS {
            specs.push(specialize_attention(
                AttentionEntry::Prefill,
                dtype,
                head_dim,
            )?);
            for entry in gathered {
                specs.push(specialize_attention(entry, dtype, head_dim)?);
            }
            specs.push(specialize_prefill(dtype, head_dim)?);
        }
    }
    // The fp8 KV cache's builds (bf16 activations; the appends are rope's).
    for &head_dim in &PAGED_DECODE_HEAD_DIMS {
        if SUPPORTED_HEAD_DIMS.contains(&head_dim) {
            specs.push(specialize_prefill_fp8(DType::BF16, head_dim)?);
        }
        for group in 1..=MAX_DECODE_GROUP {
            specs.push(specialize_paged_decode_fp8(DType::BF16, head_dim, group)?);
            for tiling in StreamTiling::ALL.iter().filter(|t| t.fits(head_dim)) {
                let entry = PagedDecodeEntry::PartialStream(*tiling);
                specs.push(specialize_paged_decode_fp8_entry(
                    entry,
                    DType::BF16,
                    head_dim,
                    group,
                )?);
            }
        }
    }
    for &head_dim in &PAGED_DECODE_HEAD_DIMS {
        for entry in gathered {
            specs.push(specialize_attention(entry, DType::F16, head_dim)?);
        }
    }
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for &head_dim in &PAGED_DECODE_HEAD_DIMS {
            for group in 1..=MAX_DECODE_GROUP {
                let entry = PagedDecodeEntry::Partial;
                specs.push(specialize_paged_decode(entry, dtype, head_dim, group)?);
            }
            if dtype == DType::BF16 && PAGED_DECODE_MMA_HEAD_DIMS.contains(&head_dim) {
                for group in 1..=MAX_DECODE_GROUP {
                    let stages = mma_decode_stages(head_dim);
                    let entry = PagedDecodeEntry::PartialMma { stages };
                    specs.push(specialize_paged_decode(entry, dtype, head_dim, group)?);
                    for tiling in StreamTiling::ALL.iter().filter(|t| t.fits(head_dim)) {
                        let entry = PagedDecodeEntry::PartialStream(*tiling);
                        specs.push(specialize_paged_decode(entry, dtype, head_dim, group)?);
                    }
                }
            }
            let merge = PagedDecodeEntry::Merge;
            specs.push(specialize_paged_decode(merge, dtype, head_dim, 1)?);
        }
    }
    for &head_dim in &MMA_PREFILL_HEAD_DIMS {
        specs.push(specialize_prefill_mma(DType::BF16, head_dim)?);
    }
    for &head_dim in &STREAM_PREFILL_HEAD_DIMS {
        for tiling in PrefillStreamTiling::ALL {
            specs.push(specialize_prefill_stream(DType::BF16, head_dim, tiling)?);
            specs.push(specialize_prefill_stream_fp8(
                DType::BF16,
                head_dim,
                tiling,
            )?);
        }
        for tiling in CASCADE_TILINGS {
            specs.push(specialize_cascade_shared(DType::BF16, head_dim, tiling)?);
        }
    }
    for &latent_dim in &MLA_LATENT_DIMS {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let merge = PagedDecodeEntry::Merge;
            specs.push(specialize_paged_decode(merge, dtype, latent_dim, 1)?);
        }
    }
    specs.extend(mla::specializations()?);
    specs.extend(sparse::specializations()?);
    Ok(specs)
}
