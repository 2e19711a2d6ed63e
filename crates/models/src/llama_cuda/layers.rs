//! The kernel sequence of one step (what a decode graph captures): embedding, the layers,
//! the final norm and the LM head of the rows that need logits.

use pagoda_cuda::{view, view_mut, CudaError, DeviceRead, Gpu};
use pagoda_ops::cuda::{self as ops, DevicePageTable, PagedKv, PoolLayout, Queries};

use super::step::{prefill_kernel, Attention, StepShape};
use super::{GpuLlama, HostFloat, StepBuffers};

impl<T: HostFloat> GpuLlama<T> {
    /// Queues every kernel of one step of `shape` on the stream (this is what a graph
    /// captures): embedding, the layers, the final norm and the LM head of the logits rows.
    pub(super) fn run(
        &self,
        gpu: &Gpu,
        buffers: &mut StepBuffers<T>,
        layout: &PoolLayout,
        shape: &StepShape,
    ) -> Result<(), CudaError> {
        let c = &self.config;
        let StepBuffers {
            k_pools,
            v_pools,
            scratch: s,
            decode,
            fused,
        } = buffers;
        let StepShape {
            num_tokens,
            num_requests,
            num_logits,
            attention,
        } = *shape;
        let (hidden, q_dim, kv_dim) = (
            c.hidden_size,
            c.num_attention_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
        );
        let qkv_dim = q_dim + 2 * kv_dim;
        let inter = c.intermediate_size;

        let tokens = view(&s.tokens, 0..num_tokens)?;
        let positions = view(&s.positions, 0..num_tokens)?;
        let slots = view(&s.slots, 0..num_tokens)?;
        let qo_indptr = view(&s.qo_indptr, 0..num_requests + 1)?;
        let page_indptr = view(&s.page_indptr, 0..num_requests + 1)?;
        // The whole buffer: the kernels read the page count from the indptr on the device.
        let page_indices = view(&s.page_indices, 0..s.page_indices.len())?;
        let last_page_len = view(&s.last_page_len, 0..num_requests)?;
        let first_page_offset = view(&s.first_page_offset, 0..num_requests)?;
        let page_table = DevicePageTable::new(
            &page_indptr,
            &page_indices,
            &last_page_len,
            &first_page_offset,
        )?;

        let mut x = view_mut(&mut s.x, 0..num_tokens * hidden)?;
        let mut normed = view_mut(&mut s.normed, 0..num_tokens * hidden)?;
        let mut qkv = view_mut(&mut s.qkv, 0..num_tokens * qkv_dim)?;
        let mut attn = view_mut(&mut s.attn, 0..num_tokens * q_dim)?;
        let mut gate_up = view_mut(&mut s.gate_up, 0..num_tokens * 2 * inter)?;
        let mut act = view_mut(&mut s.act, 0..num_tokens * inter)?;
        let scale = 1.0 / (c.head_dim as f32).sqrt();

        // The tensor-core kernel runs bf16 at its head dims, where it compiles; else tiled.
        let prefill = match prefill_kernel()? {
            ops::PrefillKernel::Mma
                if T::DTYPE == pagoda_cuda::DType::BF16
                    && ops::MMA_PREFILL_HEAD_DIMS.contains(&c.head_dim)
                    && mma_compiles(gpu, c.head_dim) =>
            {
                ops::PrefillKernel::Mma
            }
            ops::PrefillKernel::Mma => ops::PrefillKernel::Tiled,
            other => other,
        };
        ops::embedding_gather(gpu, &self.embedding, &tokens, &mut x, c.vocab_size, hidden)?;
        for ((layer, k_pool), v_pool) in self.layers.iter().zip(k_pools).zip(v_pools) {
            ops::rms_norm(gpu, &x, &layer.attn_norm, &mut normed, c.rms_norm_eps)?;
            gpu.gemm(
                &normed,
                &layer.wqkv,
                &mut qkv,
                (num_tokens, qkv_dim, hidden),
                0.0,
            )?;
            if let Some(bias) = &layer.qkv_bias {
                ops::add_bias_rows(gpu, &mut qkv, bias, num_tokens, qkv_dim)?;
            }
            if let Some(q_norm) = &layer.q_norm {
                let mut q = view_mut(&mut qkv, 0..num_tokens * qkv_dim)?;
                let geometry = (num_tokens, c.num_attention_heads, qkv_dim);
                ops::rms_norm_heads(gpu, &mut q, q_norm, geometry, c.rms_norm_eps)?;
            }
            if let Some(k_norm) = &layer.k_norm {
                let mut k = view_mut(&mut qkv, q_dim..num_tokens * qkv_dim)?;
                let geometry = (num_tokens, c.num_kv_heads, qkv_dim);
                ops::rms_norm_heads(gpu, &mut k, k_norm, geometry, c.rms_norm_eps)?;
            }
            // RoPE on the q and k heads in one launch: k's heads follow q's in a QKV row.
            ops::rope(
                gpu,
                &mut qkv,
                &positions,
                &self.inv_freq,
                (c.num_attention_heads + c.num_kv_heads, c.head_dim, qkv_dim),
                self.rope_style,
            )?;
            {
                let k_new = view(&qkv, q_dim..num_tokens * qkv_dim)?;
                let v_new = view(&qkv, q_dim + kv_dim..num_tokens * qkv_dim)?;
                let new = ops::NewKv {
                    k: k_new,
                    v: v_new,
                    row_strides: (qkv_dim, qkv_dim),
                    slots,
                };
                ops::kv_append(gpu, &new, k_pool, v_pool, layout)?;
            }
            let queries = Queries::new(&qkv, c.num_attention_heads, qkv_dim);
            let kv = PagedKv::new(&*k_pool, &*v_pool, *layout, page_table);
            match attention {
                Attention::Gather { num_splits } => ops::decode_attention_gathered(
                    gpu,
                    &queries,
                    &kv,
                    decode
                        .as_mut()
                        .ok_or_else(|| CudaError::invalid("gather decode without its workspace"))?,
                    num_splits,
                    scale,
                    &mut attn,
                )?,
                Attention::Fused { grid_chunks } => {
                    let fused = fused
                        .as_mut()
                        .ok_or_else(|| CudaError::invalid("fused decode without its workspace"))?;
                    let merge = fused.merge();
                    let workspace = fused.workspace_mut();
                    workspace.set_grid_chunks(grid_chunks)?;
                    ops::paged_decode_attention(
                        gpu, &queries, &kv, workspace, merge, scale, &mut attn,
                    )?
                }
                Attention::Prefill => ops::prefill_attention_with(
                    prefill, gpu, &queries, &kv, &qo_indptr, scale, &mut attn,
                )?,
            }
            // x += attn · Wo^T (the residual add rides on the GEMM).
            gpu.gemm(&attn, &layer.wo, &mut x, (num_tokens, hidden, q_dim), 1.0)?;
            ops::rms_norm(gpu, &x, &layer.ffn_norm, &mut normed, c.rms_norm_eps)?;
            gpu.gemm(
                &normed,
                &layer.w_gate_up,
                &mut gate_up,
                (num_tokens, 2 * inter, hidden),
                0.0,
            )?;
            {
                let gate = view(&gate_up, 0..num_tokens * 2 * inter)?;
                let up = view(&gate_up, inter..num_tokens * 2 * inter)?;
                ops::silu_mul(gpu, &gate, &up, &mut act, inter, (2 * inter, 2 * inter))?;
            }
            gpu.gemm(
                &act,
                &layer.w_down,
                &mut x,
                (num_tokens, hidden, inter),
                1.0,
            )?;
        }

        if num_logits == 0 {
            // A prefill chunk that samples nothing: the KV is written, no logits needed.
            return Ok(());
        }
        // Only the rows that need logits go through the final norm and the LM head.
        let rows = view(&s.logits_rows, 0..num_logits)?;
        let mut selected = view_mut(&mut s.selected, 0..num_logits * hidden)?;
        ops::embedding_gather(gpu, &x, &rows, &mut selected, num_tokens, hidden)?;
        let mut selected_normed = view_mut(&mut s.selected_normed, 0..num_logits * hidden)?;
        ops::rms_norm(
            gpu,
            &selected,
            &self.output_norm,
            &mut selected_normed,
            c.rms_norm_eps,
        )?;
        let mut logits = view_mut(&mut s.logits, 0..num_logits * c.vocab_size)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embedding);
        gpu.gemm(
            &selected_normed,
            head,
            &mut logits,
            (num_logits, c.vocab_size, hidden),
            0.0,
        )
    }
}

/// Whether the tensor-core prefill compiles here (its `<mma.h>` needs the CUDA `crt` headers,
/// which a runtime-only install may lack); a failure is logged once and the tiled kernel runs.
fn mma_compiles(gpu: &Gpu, head_dim: usize) -> bool {
    use std::collections::HashMap;
    use std::sync::Mutex;
    static CHECKED: Mutex<Option<HashMap<usize, bool>>> = Mutex::new(None);
    let mut checked = CHECKED.lock().unwrap_or_else(|e| e.into_inner());
    *checked
        .get_or_insert_with(HashMap::new)
        .entry(head_dim)
        .or_insert_with(|| {
            let compiled = ops::specialize_prefill_mma(pagoda_cuda::DType::BF16, head_dim)
                .and_then(|spec| gpu.prepare(&spec));
            match compiled {
                Ok(()) => true,
                Err(error) => {
                    tracing::warn!(
                        "tensor-core prefill unavailable ({error}); using the tiled kernel \
                         (install the CUDA crt headers, e.g. the nvidia-cuda-crt wheel, and \
                         point PAGODA_CUDA_INCLUDE at them)"
                    );
                    false
                }
            }
        })
}
