//! The CUDA side of every op, gathered for callers: each op keeps its launchers, plan types
//! and `.cu` sources in its own folder (`<op>/cuda.rs`, `<op>/cuda/`), and this module
//! re-exports them and lists every specialisation ([`all_specializations`]) for the
//! NVRTC check in CI and for compiling ahead of the first request.
//!
//! The launchers validate their arguments and build on `pagoda-cuda`'s driver layer
//! (context, buffers, the NVRTC registry). Built without the `cuda` feature they compile
//! against its stub and every launch fails with `CudaError::NotCompiled`.
//!
//! Activation dtypes: f32 and bf16 ([`FLOAT_DTYPES`]); math is f32 inside every kernel.

pub use crate::activation::cuda::{
    add_in_place, argmax_rows, silu_mul, silu_mul_q8, specialize_elementwise, ElementwiseEntry,
};
pub use crate::attention::cuda::{
    cascade_decode_attention, cascade_unsupported, specialize_cascade_shared, CascadeCapacity,
    CascadeGeometry, CascadePlan, CascadeWorkspace, SuffixTable, CASCADE_TILINGS, RESERVED_CHUNK,
};
pub use crate::attention::cuda::{
    decode_attention_gathered, decode_splits, kernel_name, merge_attention_partials,
    mma_decode_stages, paged_decode_attention, paged_decode_unsupported, parse_kernel,
    prefill_attention, prefill_attention_mma, prefill_attention_stream, prefill_attention_tiled,
    prefill_attention_with, specialize_attention, specialize_paged_decode, specialize_prefill,
    specialize_prefill_mma, specialize_prefill_stream, tuned_sources_hash, AttentionEntry,
    DecodeBucket, DecodeGeometry, DecodeVariant, DecodeWorkspace, DevicePageTable, MergeMode,
    MmaPrefillTiling, PagedDecodeEntry, PagedDecodeKernel, PagedDecodePlan, PagedDecodeWorkspace,
    PagedKv, Partials, PlanCapacity, PlanPolicy, PoolLayout, PrefillKernel, PrefillStreamTiling,
    PrefillTiling, Queries, StreamTiling, TableKey, TunedDecode, TunedPrefill, TuningTable,
    CANDIDATE_WAVES, MAX_CHUNKS, MAX_DECODE_GROUP, MAX_DECODE_SPLITS, MIN_CONTEXT_BUCKET,
    MMA_PREFILL_HEAD_DIMS, PAGED_DECODE_HEAD_DIMS, PAGED_DECODE_MMA_HEAD_DIMS, PLAN_HEADER_WORDS,
    STREAM_PREFILL_HEAD_DIMS, SUPPORTED_HEAD_DIMS,
};
pub use crate::attention::cuda::{
    fp8_kv_unsupported, paged_decode_attention_fp8, prefill_attention_stream_fp8,
    prefill_attention_tiled_fp8, specialize_paged_decode_fp8, specialize_paged_decode_fp8_entry,
    specialize_prefill_fp8, specialize_prefill_stream_fp8, Fp8KvLayer, KvScales,
};
pub use crate::attention::cuda::{
    mla_append, mla_decode, mla_head_tiles, mla_prefill, mla_unsupported, specialize_mla,
    LatentPool, MlaDecodeWorkspace, MlaEntry, MlaKernel, NewLatent, MLA_HEAD_TILE, MLA_LATENT_DIMS,
    MLA_MMA_STAGES, MLA_ROPE_DIM,
};
pub use crate::attention::cuda::{
    score_pages_per_cta, sparse_decode, sparse_page_scores, sparse_select, sparse_select_entries,
    sparse_summaries_len, sparse_summaries_update, specialize_sparse, SparseEntry,
    SparseSelectKernels, SparseSelectPlan, SparseSelectWorkspace, SPARSE_DENSE, SPARSE_DTYPES,
    SPARSE_MAX_HEAD_DIM, SPARSE_MAX_KV_HEADS, SPARSE_MAX_PAGES, SPARSE_MAX_QUERY_BYTES,
    SPARSE_REQUEST_WORDS,
};
pub use crate::embedding::cuda::{embedding_gather, specialize_embedding};
pub use crate::linear::cuda::{
    dequantize, dequantize_fast, dequantize_fp8, fp8_gemm, fp8_gemm_applies, gather_dequantized,
    gemm_quant_mma, gemm_quant_mma_pair, gemv_fp8, gemv_fp8_applies, gemv_quant, gemv_quant_pair,
    gemv_small, gemv_small_applies, quantize_rows_fp8, quantize_rows_q8, specialize_dequant_fp8,
    specialize_dequantize, specialize_gemm_quant_mma, specialize_gemm_quant_mma_pair,
    specialize_gemv_fp8, specialize_gemv_quant, specialize_gemv_quant_pair, specialize_gemv_small,
    specialize_quant_rows_fp8, specialize_quantize_q8, Fp8Activations, Q8Rows, QuantFormat,
    QuantGemvKernel, QuantPartRef, FP8_GEMV_MAX_ROWS, GEMV_MAX_ROWS, QUANT_GEMV_MAX_ROWS,
    QUANT_MMA_MAX_ROWS, QUANT_PADDING, QUANT_PAIRS,
};
pub use crate::moe::cuda::{
    moe_combine, moe_down, moe_down_combine, moe_down_mma, moe_experts, moe_gate_up,
    moe_gate_up_mma, moe_gate_up_with, moe_mma_launches, moe_quant_dense_decodes,
    moe_quant_dequantize, moe_quant_down, moe_quant_down_combine, moe_quant_gate_up,
    moe_quant_launches, moe_route, specialize_moe, specialize_moe_quant, DeviceRouter, MoeEntry,
    MoePath, MoeQ8, MoeQuantEntry, MoeWorkspace, QuantExperts, MOE_MAX_EXPERTS, MOE_MAX_TOP_K,
    MOE_MMA_MIN_ROWS, MOE_PER_ROW_MAX_ROWS, MOE_QUANT_DENSE_MIN_ROWS, MOE_TILE_ROWS,
};
pub use crate::norm::cuda::{
    add_bias_rows, add_rms_norm, rms_norm, rms_norm_heads, rms_norm_q8, specialize_norm,
    specialize_qkv, NormEntry, QkvEntry,
};
pub use crate::rope::cuda::{
    kv_append, kv_append_fp8, rope, rope_kv_append, rope_kv_append_fp8, specialize_kv_append,
    specialize_kv_append_fp8, specialize_rope, specialize_rope_kv_append,
    specialize_rope_kv_append_fp8, NewKv, RopeStyle,
};
pub use crate::sampling::cuda::{
    apply_token_masks, decode_row_stats, default_fast_rounds, encode_row_params, filter_splits,
    plan_sampling, sample_rows, sample_rows_with, sampling_splits, specialize_cluster,
    specialize_sampling, ClusterShape, FilteredSampling, RowPath, RowSamplingStats, SamplingEntry,
    SamplingMix, SamplingOptions, SamplingPlan, SamplingRowParams, SamplingShapes, SamplingTotals,
    SamplingWorkspace, SmBudget, DEFAULT_MAX_REJECTION_ROUNDS, MAX_SAMPLING_ROWS,
    MAX_SAMPLING_SPLITS, SAMPLING_PARAM_WORDS, SAMPLING_TOTALS_WORDS,
};

use pagoda_cuda::{DType, KernelSpec};

pub use crate::cuda_dtypes::FLOAT_DTYPES;

/// Every kernel specialisation the launchers of every op can request: one list per op
/// folder, concatenated.
pub fn all_specializations() -> Vec<KernelSpec> {
    let per_op = [
        crate::embedding::cuda::specializations(),
        crate::norm::cuda::specializations(),
        crate::rope::cuda::specializations(),
        crate::attention::cuda::specializations(),
        crate::activation::cuda::specializations(),
        crate::linear::cuda::specializations(),
        crate::moe::cuda::specializations(),
    ];
    let mut specs: Vec<KernelSpec> = per_op
        .into_iter()
        .flat_map(|list| list.expect("catalogue entry is valid"))
        .collect();
    specs.extend(crate::sampling::cuda::specializations());
    specs
}

/// The specialisations a model can launch: those of [`all_specializations`] whose head
/// dimension is the model's `head_dim`, whose decode group is its `group` (query heads per
/// KV head; the merge kernel's group 1 stays), and whose activation dtype (`T`) is `dtype`
/// or f32 (the logits and the sampler's inputs). The warm-up compiles these before the
/// server is ready; a few more than one model launches (other paths' kernels) is the price of
/// never compiling while serving.
pub fn model_specializations(dtype: DType, head_dim: usize, group: usize) -> Vec<KernelSpec> {
    let keeps = |spec: &KernelSpec| {
        // The opt-in layout of the in-place quantized GEMV compiles at its first use
        // (`PAGODA_CUDA_QUANT_GEMV_KERNEL=units*`): its specialisations would nearly double
        // a model's warm-up.
        // So do the MoE's quantized experts (`PAGODA_CUDA_MOE_QUANT`, opt-in).
        // And sparse decode's kernels (`--sparse-attention`, opt-in).
        if spec.entry == "gemv_quant_units"
            || spec.entry.starts_with("moe_quant_")
            || spec.entry.starts_with("sparse_")
        {
            return false;
        }
        let params = spec.params.iter().all(|&(name, value)| match name {
            "HEAD_DIM" => value == head_dim as i64,
            "GROUP" => value == group as i64 || value == 1,
            // MLA's attention: a latent model's `head_dim` is its latent row (ADR 0009).
            "LATENT_DIM" => value as usize + MLA_ROPE_DIM == head_dim,
            _ => true,
        });
        let dtypes = spec
            .dtypes
            .iter()
            .all(|&(role, t)| role != "T" || t == dtype || t == DType::F32);
        params && dtypes
    };
    all_specializations().into_iter().filter(keeps).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_models_specializations_are_its_head_dim_group_and_dtype() {
        let all = all_specializations();
        let model = model_specializations(DType::BF16, 64, 3);
        assert!(
            model.len() < all.len() / 2,
            "{} of {}",
            model.len(),
            all.len()
        );
        let param = |spec: &KernelSpec, name: &str| {
            spec.params
                .iter()
                .find(|(param, _)| *param == name)
                .map(|&(_, value)| value)
        };
        for spec in &model {
            assert!(
                param(spec, "HEAD_DIM").is_none_or(|dim| dim == 64),
                "{spec:?}"
            );
            assert!(
                param(spec, "GROUP").is_none_or(|g| g == 3 || g == 1),
                "{spec:?}"
            );
        }
        // Everything a bf16, head_dim 64, group 3 model launches is there: the fused decode of
        // group 3 and its merge, the prefill, every sampling kernel, the f32 argmax.
        let has = |entry: &str, group: Option<i64>| {
            model.iter().any(|spec| {
                spec.entry == entry
                    && spec.dtypes.iter().any(|&(_, t)| {
                        t == DType::BF16 || entry.starts_with("sampling") || entry == "argmax_rows"
                    })
                    && group.is_none_or(|g| param(spec, "GROUP") == Some(g))
            })
        };
        let decode_entries: Vec<&str> = all
            .iter()
            .filter(|spec| param(spec, "GROUP") == Some(3))
            .map(|spec| spec.entry)
            .collect();
        assert!(!decode_entries.is_empty());
        for entry in decode_entries {
            assert!(has(entry, Some(3)), "{entry} of group 3");
        }
        for spec in crate::sampling::cuda::specializations() {
            assert!(model.contains(&spec), "{}", spec.entry);
        }
        let prefill: Vec<&KernelSpec> = all
            .iter()
            .filter(|spec| spec.entry.contains("prefill") && param(spec, "HEAD_DIM") == Some(64))
            .filter(|spec| spec.dtypes.iter().any(|&(_, t)| t == DType::BF16))
            .collect();
        assert!(!prefill.is_empty());
        for spec in prefill {
            assert!(model.contains(spec), "{}", spec.entry);
        }
        assert!(has("argmax_rows", None));
    }
}
