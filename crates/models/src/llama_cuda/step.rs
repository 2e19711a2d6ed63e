//! One forward step on the GPU, and the KV cache and step buffers it runs in.

use pagoda_cuda::ops::{self, DevicePageTable, PoolLayout};
use pagoda_cuda::{view, view_mut, CudaError, DeviceBuffer, DeviceRead, Element, Gpu};

use super::{CudaCacheOptions, GpuCache, GpuLlama, HostFloat, Scratch};
use crate::config::ModelConfig;
use crate::llama::ForwardBatch;

impl<T: HostFloat> GpuLlama<T> {
    pub(super) fn prepare(&mut self, options: CudaCacheOptions) -> Result<(), CudaError> {
        let c = &self.config;
        let layout = PoolLayout {
            num_pages: options.num_pages,
            page_size: options.page_size,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
        };
        layout.validate()?;
        // Free the old cache before allocating the new one.
        self.cache = None;
        let gpu = &*self.gpu;
        let mut k_pools = Vec::with_capacity(c.num_layers);
        let mut v_pools = Vec::with_capacity(c.num_layers);
        for _ in 0..c.num_layers {
            k_pools.push(gpu.zeros(layout.pool_len())?);
            v_pools.push(gpu.zeros(layout.pool_len())?);
        }
        let scratch = Scratch::new(gpu, c, &options)?;
        self.cache = Some(GpuCache {
            options,
            layout,
            k_pools,
            v_pools,
            scratch,
        });
        Ok(())
    }

    pub(super) fn forward(&mut self, batch: &ForwardBatch<'_>) -> Result<Vec<f32>, CudaError> {
        let c = &self.config;
        let gpu = &*self.gpu;
        let Some(cache) = self.cache.as_mut() else {
            return Err(CudaError::invalid(
                "the KV cache is not allocated: call prepare first",
            ));
        };
        let options = cache.options;
        let layout = cache.layout;
        let num_tokens = batch.tokens.len();
        let num_requests = batch.qo_indptr.len().saturating_sub(1);
        let num_logits = batch.logits_for.len();
        let table = batch.page_table;
        if num_tokens == 0 || num_tokens > options.max_batch_tokens {
            return Err(CudaError::invalid(format!(
                "a step of {num_tokens} tokens (at most {} per step)",
                options.max_batch_tokens
            )));
        }
        if num_requests > options.max_batch_requests || num_logits > num_tokens {
            return Err(CudaError::invalid(format!(
                "a step of {num_requests} requests / {num_logits} logit rows exceeds the buffers"
            )));
        }
        if batch.positions.len() != num_tokens || batch.slots.len() != num_tokens {
            return Err(CudaError::invalid(
                "tokens, positions and slots differ in length",
            ));
        }
        if let Some(&token) = batch.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(CudaError::invalid(format!(
                "token {token} is outside the vocabulary ({})",
                c.vocab_size
            )));
        }
        if let Some(&row) = batch.logits_for.iter().find(|&&t| t >= num_tokens) {
            return Err(CudaError::invalid(format!(
                "logits requested for token {row} of {num_tokens}"
            )));
        }
        if table.indices.len() > cache.scratch.page_indices.len() {
            return Err(CudaError::invalid("the page table is larger than the pool"));
        }
        let (hidden, q_dim, kv_dim) = (
            c.hidden_size,
            c.num_attention_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
        );
        let qkv_dim = q_dim + 2 * kv_dim;
        let inter = c.intermediate_size;
        let page_size = layout.page_size;

        // Host inputs into the fixed device buffers.
        let s = &mut cache.scratch;
        let slots: Vec<i32> = batch
            .slots
            .iter()
            .map(|slot| slot.physical_index(page_size) as i32)
            .collect();
        let logits_rows: Vec<u32> = batch.logits_for.iter().map(|&t| t as u32).collect();
        upload_prefix(gpu, batch.tokens, &mut s.tokens)?;
        upload_prefix(gpu, batch.positions, &mut s.positions)?;
        upload_prefix(gpu, &slots, &mut s.slots)?;
        upload_prefix(gpu, batch.qo_indptr, &mut s.qo_indptr)?;
        upload_prefix(gpu, &table.indptr, &mut s.page_indptr)?;
        upload_prefix(gpu, &table.indices, &mut s.page_indices)?;
        upload_prefix(gpu, &table.last_page_len, &mut s.last_page_len)?;
        upload_prefix(gpu, &table.first_page_offset, &mut s.first_page_offset)?;
        upload_prefix(gpu, &logits_rows, &mut s.logits_rows)?;

        let tokens = view(&s.tokens, 0..num_tokens)?;
        let positions = view(&s.positions, 0..num_tokens)?;
        let slots = view(&s.slots, 0..num_tokens)?;
        let qo_indptr = view(&s.qo_indptr, 0..num_requests + 1)?;
        let page_indptr = view(&s.page_indptr, 0..num_requests + 1)?;
        let page_indices = view(&s.page_indices, 0..table.indices.len().max(1))?;
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

        ops::embedding_gather(gpu, &self.embedding, &tokens, &mut x, c.vocab_size, hidden)?;
        for ((layer, k_pool), v_pool) in self
            .layers
            .iter()
            .zip(&mut cache.k_pools)
            .zip(&mut cache.v_pools)
        {
            ops::rms_norm(gpu, &x, &layer.attn_norm, &mut normed, c.rms_norm_eps)?;
            gpu.gemm(
                &normed,
                &layer.wqkv,
                &mut qkv,
                (num_tokens, qkv_dim, hidden),
                0.0,
            )?;
            {
                let mut q = view_mut(&mut qkv, 0..num_tokens * qkv_dim)?;
                ops::rope(
                    gpu,
                    &mut q,
                    &positions,
                    &self.inv_freq,
                    (c.num_attention_heads, c.head_dim, qkv_dim),
                    self.rope_style,
                )?;
            }
            {
                let mut k = view_mut(&mut qkv, q_dim..num_tokens * qkv_dim)?;
                ops::rope(
                    gpu,
                    &mut k,
                    &positions,
                    &self.inv_freq,
                    (c.num_kv_heads, c.head_dim, qkv_dim),
                    self.rope_style,
                )?;
            }
            {
                let k_new = view(&qkv, q_dim..num_tokens * qkv_dim)?;
                let v_new = view(&qkv, q_dim + kv_dim..num_tokens * qkv_dim)?;
                ops::kv_append(
                    gpu,
                    k_pool,
                    v_pool,
                    &layout,
                    &k_new,
                    &v_new,
                    &slots,
                    (qkv_dim, qkv_dim),
                )?;
            }
            ops::prefill_attention(
                gpu,
                &qkv,
                (c.num_attention_heads, qkv_dim),
                &*k_pool,
                &*v_pool,
                &layout,
                &page_table,
                &qo_indptr,
                scale,
                &mut attn,
            )?;
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
            return Ok(Vec::new());
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
        )?;
        gpu.download(&logits)
    }
}

impl<T: HostFloat> Scratch<T> {
    fn new(gpu: &Gpu, c: &ModelConfig, o: &CudaCacheOptions) -> Result<Self, CudaError> {
        let tokens = o.max_batch_tokens.max(1);
        let requests = o.max_batch_requests.max(1);
        let q_dim = c.num_attention_heads * c.head_dim;
        let kv_dim = c.num_kv_heads * c.head_dim;
        // Shared prefix pages appear once per request that holds them.
        let table_pages =
            o.num_pages.max(1) + requests * o.max_context.div_ceil(o.page_size.max(1));
        Ok(Scratch {
            x: gpu.zeros(tokens * c.hidden_size)?,
            normed: gpu.zeros(tokens * c.hidden_size)?,
            qkv: gpu.zeros(tokens * (q_dim + 2 * kv_dim))?,
            attn: gpu.zeros(tokens * q_dim)?,
            gate_up: gpu.zeros(tokens * 2 * c.intermediate_size)?,
            act: gpu.zeros(tokens * c.intermediate_size)?,
            selected: gpu.zeros(tokens * c.hidden_size)?,
            selected_normed: gpu.zeros(tokens * c.hidden_size)?,
            logits: gpu.zeros(tokens * c.vocab_size)?,
            tokens: gpu.zeros(tokens)?,
            positions: gpu.zeros(tokens)?,
            slots: gpu.zeros(tokens)?,
            qo_indptr: gpu.zeros(requests + 1)?,
            page_indptr: gpu.zeros(requests + 1)?,
            page_indices: gpu.zeros(table_pages)?,
            last_page_len: gpu.zeros(requests)?,
            first_page_offset: gpu.zeros(requests)?,
            logits_rows: gpu.zeros(tokens)?,
        })
    }
}

fn upload_prefix<T: Element>(
    gpu: &Gpu,
    host: &[T],
    buffer: &mut DeviceBuffer<T>,
) -> Result<(), CudaError> {
    if host.is_empty() {
        return Ok(());
    }
    if host.len() > buffer.len() {
        return Err(CudaError::invalid(format!(
            "{} step inputs exceed a buffer of {}",
            host.len(),
            buffer.len()
        )));
    }
    let mut destination = view_mut(buffer, 0..host.len())?;
    gpu.upload_into(host, &mut destination)
}
