//! The process-wide CPU kernel choices and counters of `/metrics` (`pagoda_cpu_kernels_info`
//! through `pagoda_cpu_attention_kernel_info`, the cascade attention counters), sparse
//! decode's counters (`pagoda_sparse_decode_*_total`), and the process-wide CUDA kernel counters
//! `pagoda_cuda_moe_mma_launches_total`, `pagoda_cuda_moe_quant_launches_total` and
//! `pagoda_cuda_moe_quant_dense_decodes_total`: read from `pagoda_ops`, not from the engine.

use std::fmt::Write;

/// Appends the CPU kernel lines to `out`.
pub(super) fn render(out: &mut String) {
    let sparse = pagoda_ops::attention::sparse_decode_counts();
    let _ = writeln!(
        out,
        "# HELP pagoda_sparse_decode_steps_total Layer steps in which sparse decode (Quest page \
         selection, --sparse-attention) shortened at least one request's page list.\n\
         # TYPE pagoda_sparse_decode_steps_total counter\npagoda_sparse_decode_steps_total {}\n\
         # HELP pagoda_sparse_decode_pages_scanned_total Pages scored by sparse decode.\n\
         # TYPE pagoda_sparse_decode_pages_scanned_total counter\n\
         pagoda_sparse_decode_pages_scanned_total {}\n\
         # HELP pagoda_sparse_decode_pages_kept_total Pages sparse decode kept.\n\
         # TYPE pagoda_sparse_decode_pages_kept_total counter\n\
         pagoda_sparse_decode_pages_kept_total {}\n\
         # HELP pagoda_sparse_decode_dense_past_limit_total Requests a CUDA sparse step left \
         dense: longer than the device selection's pages (counted once a step).\n\
         # TYPE pagoda_sparse_decode_dense_past_limit_total counter\n\
         pagoda_sparse_decode_dense_past_limit_total {}",
        sparse.steps, sparse.pages_scanned, sparse.pages_kept, sparse.dense_past_limit
    );
    let _ = writeln!(
        out,
        "# HELP pagoda_cpu_kernels_info The CPU matmul kernel set in use (PAGODA_CPU_KERNELS).\n\
         # TYPE pagoda_cpu_kernels_info gauge\npagoda_cpu_kernels_info{{set=\"{}\"}} 1",
        pagoda_ops::linear::cpu_kernels_name()
    );
    let _ = writeln!(
        out,
        "# HELP pagoda_cpu_neon_matmuls_total Integer matmuls (or shared decode regions) run \
         on the NEON kernels (PAGODA_CPU_KERNELS=neon_dotprod|neon, aarch64).\n\
         # TYPE pagoda_cpu_neon_matmuls_total counter\npagoda_cpu_neon_matmuls_total {}",
        pagoda_ops::linear::cpu::int_dot::neon_matmul_count()
    );
    let _ = writeln!(
        out,
        "# HELP pagoda_cpu_neon_f32_matmuls_total f32-activation matmuls run on the NEON f32 \
         tiles (aarch64: ffn_down under auto, PAGODA_CPU_KERNELS=f32, f32/f16 weights).\n\
         # TYPE pagoda_cpu_neon_f32_matmuls_total counter\npagoda_cpu_neon_f32_matmuls_total {}",
        pagoda_ops::linear::cpu::f32_tile::neon_matmul_count()
    );
    let _ = writeln!(
        out,
        "# HELP pagoda_cpu_amx_matmuls_total Integer matmuls run on the AMX-INT8 tiles \
         (PAGODA_CPU_KERNELS=amx).\n\
         # TYPE pagoda_cpu_amx_matmuls_total counter\npagoda_cpu_amx_matmuls_total {}",
        pagoda_ops::linear::cpu::amx::hardware_matmul_count()
    );
    let _ = writeln!(
        out,
        "# HELP pagoda_cpu_amx_bf16_matmuls_total Prefill matmuls run on the AMX-BF16 tiles \
         (PAGODA_CPU_AMX_PREFILL=bf16).\n\
         # TYPE pagoda_cpu_amx_bf16_matmuls_total counter\npagoda_cpu_amx_bf16_matmuls_total {}",
        pagoda_ops::linear::cpu::amx::bf16::matmul_count()
    );
    let _ = writeln!(
        out,
        "# HELP pagoda_cpu_q15_matmuls_total Integer matmuls run on Q15 activations \
         (PAGODA_CPU_KERNELS=...+q15_ffn_down).\n\
         # TYPE pagoda_cpu_q15_matmuls_total counter\npagoda_cpu_q15_matmuls_total {}",
        pagoda_ops::linear::cpu::int_matmul::q15_matmul_count()
    );
    let _ = writeln!(
        out,
        "# HELP pagoda_cpu_f32_wide_matmuls_total Matmuls of 1-8 tokens on f32 activations run \
         eight rows at a time (PAGODA_CPU_F32_DECODE=avx512|avx2).\n\
         # TYPE pagoda_cpu_f32_wide_matmuls_total counter\npagoda_cpu_f32_wide_matmuls_total {}",
        pagoda_ops::linear::cpu::f32_decode::wide_matmul_count()
    );
    let _ = writeln!(
        out,
        "# HELP pagoda_cpu_f32_pair_matmuls_total f32 prefill matmuls run with two tokens \
         per 512-bit register (PAGODA_CPU_F32_DECODE=avx512).\n\
         # TYPE pagoda_cpu_f32_pair_matmuls_total counter\npagoda_cpu_f32_pair_matmuls_total {}",
        pagoda_ops::linear::cpu::f32_tile::pair_matmul_count()
    );
    let _ = writeln!(
        out,
        "# HELP pagoda_cpu_int_wide_decodes_total One-token integer matmuls (or shared decode \
         regions) run sixteen rows per 512-bit register (PAGODA_CPU_INT_DECODE=avx512).\n\
         # TYPE pagoda_cpu_int_wide_decodes_total counter\npagoda_cpu_int_wide_decodes_total {}",
        pagoda_ops::linear::cpu::interleaved::wide_decode_count()
    );
    let _ = writeln!(
        out,
        "# HELP pagoda_cpu_int_wide_prefills_total Integer prefill matmuls run sixteen rows \
         per 512-bit register (PAGODA_CPU_INT_PREFILL=avx512).\n\
         # TYPE pagoda_cpu_int_wide_prefills_total counter\npagoda_cpu_int_wide_prefills_total {}",
        pagoda_ops::linear::cpu::interleaved::wide_prefill_count()
    );
    let _ = writeln!(
        out,
        "# HELP pagoda_cpu_prefetch_matmuls_total Integer matmuls (or shared decode regions) \
         of the interleaved kernels run with software prefetch of the weights \
         (PAGODA_CPU_PREFETCH).\n\
         # TYPE pagoda_cpu_prefetch_matmuls_total counter\npagoda_cpu_prefetch_matmuls_total {}",
        pagoda_ops::linear::cpu::prefetch::prefetched_matmul_count()
    );
    let _ = writeln!(
        out,
        "# HELP pagoda_cpu_prefetch_bytes How far ahead of the weight stream the integer \
         kernels prefetch (0: off; PAGODA_CPU_PREFETCH).\n\
         # TYPE pagoda_cpu_prefetch_bytes gauge\npagoda_cpu_prefetch_bytes {}",
        pagoda_ops::linear::cpu::prefetch::distance()
    );
    let _ = writeln!(
        out,
        "# HELP pagoda_cpu_plane_matmuls_total Integer matmuls (or shared decode regions) over \
         5- and 6-bit weights held as a nibble and bit planes (PAGODA_CPU_HIGH_BITS).\n\
         # TYPE pagoda_cpu_plane_matmuls_total counter\npagoda_cpu_plane_matmuls_total {}",
        pagoda_ops::linear::cpu::interleaved::planes::plane_matmul_count()
    );
    let _ = writeln!(
        out,
        "# HELP pagoda_cpu_silu_polynomial_calls_total SiLU x up calls run with the vector \
         polynomial exp (PAGODA_CPU_SILU=polynomial).\n\
         # TYPE pagoda_cpu_silu_polynomial_calls_total counter\n\
         pagoda_cpu_silu_polynomial_calls_total {}",
        pagoda_ops::activation::silu_polynomial_calls()
    );
    let (calls, rows, kept, visible) = pagoda_ops::attention::sparse_selection_counts();
    let _ = writeln!(
        out,
        "# HELP pagoda_cpu_sparse_attention_calls_total Layer attention passes with at least one \
         query row on DeepSeek-V3.2's top-k token selection (index_topk).\n\
         # TYPE pagoda_cpu_sparse_attention_calls_total counter\n\
         pagoda_cpu_sparse_attention_calls_total {calls}\n\
         # HELP pagoda_cpu_sparse_attention_rows_total Query rows (per layer) that saw more than \
         index_topk tokens and attended to the indexer's selection.\n\
         # TYPE pagoda_cpu_sparse_attention_rows_total counter\n\
         pagoda_cpu_sparse_attention_rows_total {rows}\n\
         # HELP pagoda_cpu_sparse_attention_kept_tokens_total Tokens those rows attended to.\n\
         # TYPE pagoda_cpu_sparse_attention_kept_tokens_total counter\n\
         pagoda_cpu_sparse_attention_kept_tokens_total {kept}\n\
         # HELP pagoda_cpu_sparse_attention_visible_tokens_total Tokens those rows could see.\n\
         # TYPE pagoda_cpu_sparse_attention_visible_tokens_total counter\n\
         pagoda_cpu_sparse_attention_visible_tokens_total {visible}"
    );
    let _ = writeln!(
        out,
        "# HELP pagoda_cpu_attention_kernel_info The CPU attention kernel in use \
         (PAGODA_CPU_ATTENTION).\n\
         # TYPE pagoda_cpu_attention_kernel_info gauge\n\
         pagoda_cpu_attention_kernel_info{{kernel=\"{}\"}} 1",
        pagoda_ops::attention::AttentionKernel::selected().name()
    );
    let (steps, groups, shared, saved) = pagoda_ops::attention::cascade_counts();
    let _ = writeln!(
        out,
        "# HELP pagoda_cpu_cascade_steps_total CPU steps in which decode rows of several \
         requests read shared prompt pages once (PAGODA_CASCADE_ATTENTION).\n\
         # TYPE pagoda_cpu_cascade_steps_total counter\n\
         pagoda_cpu_cascade_steps_total {steps}\n\
         # HELP pagoda_cpu_cascade_groups_total Share groups of those steps (summed per step).\n\
         # TYPE pagoda_cpu_cascade_groups_total counter\n\
         pagoda_cpu_cascade_groups_total {groups}\n\
         # HELP pagoda_cpu_cascade_shared_tokens_total Shared KV tokens read once for a whole \
         group (per step; every layer reads them).\n\
         # TYPE pagoda_cpu_cascade_shared_tokens_total counter\n\
         pagoda_cpu_cascade_shared_tokens_total {shared}\n\
         # HELP pagoda_cpu_cascade_saved_token_reads_total KV token reads the shared reads \
         saved, per step and layer.\n\
         # TYPE pagoda_cpu_cascade_saved_token_reads_total counter\n\
         pagoda_cpu_cascade_saved_token_reads_total {saved}"
    );
    let _ = writeln!(
        out,
        "# HELP pagoda_cuda_moe_mma_launches_total MoE expert matmul launches (gate/up or \
         down) run on tensor cores (PAGODA_CUDA_MOE_MMA, bf16 steps of 32+ rows).\n\
         # TYPE pagoda_cuda_moe_mma_launches_total counter\npagoda_cuda_moe_mma_launches_total {}",
        pagoda_ops::cuda::moe_mma_launches()
    );
    let _ = writeln!(
        out,
        "# HELP pagoda_cuda_moe_quant_launches_total MoE expert matmul launches (gate/up or \
         down) over experts kept in their GGUF blocks (PAGODA_CUDA_MOE_QUANT).\n\
         # TYPE pagoda_cuda_moe_quant_launches_total counter\npagoda_cuda_moe_quant_launches_total {}",
        pagoda_ops::cuda::moe_quant_launches()
    );
    let _ = writeln!(
        out,
        "# HELP pagoda_cuda_moe_quant_dense_decodes_total Stacked expert projections decoded \
         from their GGUF blocks for a large step's dense expert kernels \
         (PAGODA_CUDA_MOE_QUANT_DENSE_ROWS).\n\
         # TYPE pagoda_cuda_moe_quant_dense_decodes_total counter\n\
         pagoda_cuda_moe_quant_dense_decodes_total {}",
        pagoda_ops::cuda::moe_quant_dense_decodes()
    );
}
