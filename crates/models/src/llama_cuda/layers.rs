//! CUDA's steps of the decoder sequence ([`crate::decoder`]), queued on the stream (what a
//! decode graph captures): embedding, the layers, the final norm and the LM head of the rows
//! that need logits. q, k and v come out of one GEMM into one QKV buffer (`[q | k | v]` per
//! token row) and the residual adds ride on the output GEMMs (`beta = 1` into the f32
//! residual stream). A MoE model's layers run the MoE sequence, whose expert steps live in
//! `experts.rs`.

use pagoda_cuda::{view, view_mut, CudaError, DeviceBuffer, DeviceView, DeviceViewMut, Gpu};
use pagoda_ops::cuda::{
    self as ops, DecodeWorkspace, DevicePageTable, PagedKv, PoolLayout, PrefillKernel, Queries,
};

use super::buffers::{Attention, StepShape};
use super::cascade_path::cascade_decode;
use super::decode_path::{fused_decode, FusedDecode};
use super::experts::{ExpertStep, GpuExperts, MoeBuffers};
use super::matrix::{Linear, Matrix, QuantScratch};
use super::sparse_path::{decode_selected, SparseDecode};
use super::{GpuLayer, GpuMlp, GpuModel, GqaWeights, HostFloat, LayerAttention, StepBuffers};
use crate::decoder::{deepseek_layers, llama_layers, llama_moe_layers, DecoderStep, MoeStep};

mod fp8;
mod fused_q8;
mod mla;

impl<T: HostFloat> GpuModel<T> {
    /// Queues every kernel of one step of `shape` on the stream (this is what a graph
    /// captures): the decoder sequence on [`GpuStep`].
    pub fn run(
        &self,
        gpu: &Gpu,
        buffers: &mut StepBuffers<T>,
        layout: &PoolLayout,
        shape: &StepShape,
    ) -> Result<(), CudaError> {
        let mut step = self.step(gpu, buffers, layout, shape)?;
        // DeepSeek: latent attention, then a dense or expert MLP block per layer.
        if self.config.mla.is_some() {
            return deepseek_layers(&mut step, &self.layers);
        }
        if self.config.moe.is_some() {
            return llama_moe_layers(&mut step, &self.layers);
        }
        llama_layers(&mut step, &self.layers)
    }

    /// The step of `shape` over `buffers`, ready to queue its kernels.
    pub(super) fn step<'a>(
        &'a self,
        gpu: &'a Gpu,
        buffers: &'a mut StepBuffers<T>,
        layout: &'a PoolLayout,
        shape: &StepShape,
    ) -> Result<GpuStep<'a, T>, CudaError> {
        let c = &self.config;
        let StepBuffers {
            k_pools,
            v_pools,
            fp8,
            scratch: s,
            decode,
            fused,
            mla_decode,
            prefill,
            fused_rope_append,
            gemv,
            quant,
            moe,
            sparse,
        } = buffers;
        let StepShape {
            num_tokens,
            num_requests,
            num_logits,
            attention,
            hidden_only,
        } = *shape;
        let (hidden, q_dim, kv_dim) = (
            c.hidden_size,
            c.num_attention_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
        );
        let qkv_dim = q_dim + 2 * kv_dim;
        let inter = c.intermediate_size;

        // The whole indices buffer: the kernels read the page count from the indptr on the
        // device; the other arrays cut to the step's requests.
        let page_table = DevicePageTable::new(
            &s.page_indptr,
            &s.page_indices,
            &s.last_page_len,
            &s.first_page_offset,
        )?
        .requests(0..num_requests)?;
        // A latent attention model attends with its own kernels (`layers/mla.rs`).
        let prefill = match c.mla {
            Some(_) => PrefillKernel::Tiled,
            None => prefill.runnable::<T>(gpu, c.head_dim, num_requests, num_tokens),
        };
        Ok(GpuStep {
            model: self,
            gpu,
            layout,
            k_pools,
            v_pools,
            fp8,
            decode,
            fused,
            mla: mla::MlaStepBuffers::new(c, s.mla.as_mut(), mla_decode, num_tokens)?,
            attention,
            prefill,
            fused_rope_append: *fused_rope_append,
            gemv: *gemv,
            quant: {
                quant.prequantized = false;
                quant
            },
            down_quantized: false,
            moe: moe.as_mut(),
            sparse: sparse.as_mut(),
            page_table,
            num_tokens,
            num_logits,
            hidden_only,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
            tokens: view(&s.tokens, 0..num_tokens)?,
            positions: view(&s.positions, 0..num_tokens)?,
            slots: view(&s.slots, 0..num_tokens)?,
            qo_indptr: view(&s.qo_indptr, 0..num_requests + 1)?,
            logits_rows: view(&s.logits_rows, 0..num_logits)?,
            x: view_mut(&mut s.x, 0..num_tokens * hidden)?,
            normed: view_mut(&mut s.normed, 0..num_tokens * hidden)?,
            qkv: view_mut(&mut s.qkv, 0..num_tokens * qkv_dim)?,
            attn: view_mut(&mut s.attn, 0..num_tokens * q_dim)?,
            gate_up: view_mut(&mut s.gate_up, 0..num_tokens * 2 * inter)?,
            act: view_mut(&mut s.act, 0..num_tokens * inter)?,
            selected: view_mut(&mut s.selected, 0..num_logits * hidden)?,
            selected_normed: view_mut(&mut s.selected_normed, 0..num_logits * hidden)?,
            logits: view_mut(&mut s.logits, 0..num_logits * c.vocab_size)?,
        })
    }
}

/// One step on the GPU: the model, the KV pools, the decode workspaces, the step's inputs
/// (staged and uploaded before) and its activations, each a view of the step buffers sized
/// for this step.
pub(super) struct GpuStep<'a, T> {
    model: &'a GpuModel<T>,
    gpu: &'a Gpu,
    layout: &'a PoolLayout,
    k_pools: &'a mut [DeviceBuffer<T>],
    v_pools: &'a mut [DeviceBuffer<T>],
    /// The e4m3 cache's layers (empty unless `-ctk fp8 -ctv fp8`; then the pools above are).
    fp8: &'a mut [ops::Fp8KvLayer],
    decode: &'a mut Option<DecodeWorkspace<T>>,
    fused: &'a mut Option<FusedDecode>,
    /// A latent attention model's own activations and decode (`None` for the others).
    mla: Option<mla::MlaStepBuffers<'a, T>>,
    attention: Attention,
    prefill: PrefillKernel,
    /// RoPE and the KV append in one launch (`PAGODA_CUDA_FUSED_ROPE_APPEND`).
    fused_rope_append: bool,
    /// Linear layers of a few rows on the small-batch kernel (`PAGODA_CUDA_GEMV`).
    gemv: bool,
    /// What linear layers over quantized matrices need.
    quant: &'a mut QuantScratch<T>,
    /// The down projection after the gate/up one is quantized (`layers/fused_q8.rs`).
    down_quantized: bool,
    /// A MoE model's expert buffers.
    moe: Option<&'a mut MoeBuffers<T>>,
    /// Sparse decode's summaries and selection (`--sparse-attention`).
    sparse: Option<&'a mut SparseDecode<T>>,
    page_table: DevicePageTable<'a>,
    num_tokens: usize,
    num_logits: usize,
    hidden_only: bool,
    scale: f32,
    tokens: DeviceView<'a, u32>,
    positions: DeviceView<'a, u32>,
    slots: DeviceView<'a, i32>,
    qo_indptr: DeviceView<'a, u32>,
    logits_rows: DeviceView<'a, u32>,
    /// The residual stream, f32 whatever the model's dtype.
    x: DeviceViewMut<'a, f32>,
    normed: DeviceViewMut<'a, T>,
    qkv: DeviceViewMut<'a, T>,
    attn: DeviceViewMut<'a, T>,
    gate_up: DeviceViewMut<'a, T>,
    act: DeviceViewMut<'a, T>,
    selected: DeviceViewMut<'a, f32>,
    selected_normed: DeviceViewMut<'a, T>,
    logits: DeviceViewMut<'a, f32>,
}

impl<T> GpuLayer<T> {
    /// The layer's grouped-query attention weights (an error on a latent attention layer).
    fn gqa(&self) -> Result<&GqaWeights<T>, CudaError> {
        match &self.attention {
            LayerAttention::Gqa(weights) => Ok(weights),
            LayerAttention::Mla(_) => Err(CudaError::invalid(
                "a grouped-query attention step ran on a latent attention layer",
            )),
        }
    }
}

impl<T: HostFloat> GpuStep<'_, T> {
    /// `(q_dim, kv_dim, qkv_dim)`: a QKV row is `[q | k | v]`.
    fn qkv_dims(&self) -> (usize, usize, usize) {
        let c = &self.model.config;
        let (q_dim, kv_dim) = (
            c.num_attention_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
        );
        (q_dim, kv_dim, q_dim + 2 * kv_dim)
    }
}

impl<T: HostFloat> DecoderStep for GpuStep<'_, T> {
    type Layer = GpuLayer<T>;
    type Error = CudaError;

    fn embed(&mut self) -> Result<(), CudaError> {
        let c = &self.model.config;
        let (gpu, tokens, x) = (self.gpu, &self.tokens, &mut self.x);
        let shape = (c.vocab_size, c.hidden_size);
        match &self.model.embedding {
            Matrix::Dense(table) => ops::embedding_gather(gpu, table, tokens, x, shape.0, shape.1),
            Matrix::Quantized(q) => {
                let [part] = &q.parts[..] else {
                    return Err(CudaError::invalid(
                        "a quantized embedding table of one part",
                    ));
                };
                ops::gather_dequantized(gpu, part.format, &part.blocks, tokens, x, shape)
            }
            Matrix::Fp8(_) => Err(CudaError::invalid("an FP8 embedding table")),
        }
    }

    fn attention_norm(&mut self, layer: &GpuLayer<T>) -> Result<(), CudaError> {
        let next =
            matches!(&layer.attention, LayerAttention::Gqa(w) if fused_q8::quantized(&w.wqkv));
        let io = (&self.x, &layer.attn_norm, &mut self.normed);
        let rows = (self.num_tokens, self.model.config.rms_norm_eps);
        fused_q8::rms_norm_for(self.gpu, self.quant, next, io, rows)
    }

    fn qkv_projection(&mut self, layer: &GpuLayer<T>) -> Result<(), CudaError> {
        let (num_tokens, hidden) = (self.num_tokens, self.model.config.hidden_size);
        let (_, _, qkv_dim) = self.qkv_dims();
        let shape = (num_tokens, qkv_dim, hidden);
        let mut linear = Linear {
            gpu: self.gpu,
            small: self.gemv,
            quant: &mut *self.quant,
        };
        let layer = layer.gqa()?;
        linear.run(&self.normed, &layer.wqkv, &mut self.qkv, shape, 0.0)?;
        if let Some(bias) = &layer.qkv_bias {
            ops::add_bias_rows(self.gpu, &mut self.qkv, bias, num_tokens, qkv_dim)?;
        }
        Ok(())
    }

    fn qk_norm(&mut self, layer: &GpuLayer<T>) -> Result<(), CudaError> {
        let c = &self.model.config;
        let num_tokens = self.num_tokens;
        let (q_dim, _, qkv_dim) = self.qkv_dims();
        let layer = layer.gqa()?;
        if let Some(q_norm) = &layer.q_norm {
            let mut q = view_mut(&mut self.qkv, 0..num_tokens * qkv_dim)?;
            let geometry = (num_tokens, c.num_attention_heads, qkv_dim);
            ops::rms_norm_heads(self.gpu, &mut q, q_norm, geometry, c.rms_norm_eps)?;
        }
        if let Some(k_norm) = &layer.k_norm {
            let mut k = view_mut(&mut self.qkv, q_dim..num_tokens * qkv_dim)?;
            let geometry = (num_tokens, c.num_kv_heads, qkv_dim);
            ops::rms_norm_heads(self.gpu, &mut k, k_norm, geometry, c.rms_norm_eps)?;
        }
        Ok(())
    }

    fn rope(&mut self) -> Result<(), CudaError> {
        // q's and k's heads in one launch: k's heads follow q's in a QKV row.
        let c = &self.model.config;
        let (_, _, qkv_dim) = self.qkv_dims();
        let geometry = (c.num_attention_heads + c.num_kv_heads, c.head_dim, qkv_dim);
        let (inv_freq, style) = (&self.model.inv_freq, self.model.rope_style);
        ops::rope(
            self.gpu,
            &mut self.qkv,
            &self.positions,
            inv_freq,
            geometry,
            style,
        )
    }

    fn append_kv(&mut self, index: usize) -> Result<(), CudaError> {
        if !self.fp8.is_empty() {
            return self.append_kv_fp8(index);
        }
        let num_tokens = self.num_tokens;
        let (q_dim, kv_dim, qkv_dim) = self.qkv_dims();
        let new = ops::NewKv {
            k: view(&self.qkv, q_dim..num_tokens * qkv_dim)?,
            v: view(&self.qkv, q_dim + kv_dim..num_tokens * qkv_dim)?,
            row_strides: (qkv_dim, qkv_dim),
            slots: self.slots,
        };
        let (k_pool, v_pool) = (&mut self.k_pools[index], &mut self.v_pools[index]);
        ops::kv_append(self.gpu, &new, k_pool, v_pool, self.layout)
    }

    fn rope_append_kv(&mut self, index: usize) -> Result<(), CudaError> {
        if !self.fp8.is_empty() && self.fused_rope_append {
            return self.rope_append_kv_fp8(index);
        }
        if !self.fused_rope_append {
            self.rope()?;
            self.append_kv(index)?;
        } else {
            let c = &self.model.config;
            let (_, _, qkv_dim) = self.qkv_dims();
            let rope = (&self.positions, &self.model.inv_freq, self.model.rope_style);
            let pools = (
                &self.slots,
                &mut self.k_pools[index],
                &mut self.v_pools[index],
            );
            let geometry = (c.num_attention_heads, qkv_dim);
            ops::rope_kv_append(self.gpu, &mut self.qkv, rope, geometry, pools, self.layout)?;
        }
        match self.sparse.as_deref_mut() {
            Some(sparse) => sparse.update(
                self.gpu,
                index,
                &self.k_pools[index],
                self.layout,
                &self.slots,
            ),
            None => Ok(()),
        }
    }

    fn attention(&mut self, index: usize) -> Result<(), CudaError> {
        if !self.fp8.is_empty() {
            return self.attention_fp8(index);
        }
        let (gpu, scale) = (self.gpu, self.scale);
        let (_, _, qkv_dim) = self.qkv_dims();
        let heads = self.model.config.num_attention_heads;
        let queries = Queries::new(&self.qkv, heads, qkv_dim);
        let (k_pool, v_pool) = (&self.k_pools[index], &self.v_pools[index]);
        let kv = PagedKv::new(k_pool, v_pool, *self.layout, self.page_table);
        let out = &mut self.attn;
        match self.attention {
            Attention::Gather { num_splits } => {
                let workspace = self
                    .decode
                    .as_mut()
                    .ok_or_else(|| CudaError::invalid("gather decode without its workspace"))?;
                ops::decode_attention_gathered(
                    gpu, &queries, &kv, workspace, num_splits, scale, out,
                )
            }
            Attention::Fused {
                grid_chunks,
                variant,
                ..
            } => {
                let plan = (grid_chunks, variant, scale);
                fused_decode(self.fused, gpu, &queries, &kv, plan, out)
            }
            Attention::Cascade {
                grid_chunks,
                variant,
                ..
            } => {
                let fused = self
                    .fused
                    .as_mut()
                    .ok_or_else(|| CudaError::invalid("a cascade step without the fused decode"))?;
                let plan = (grid_chunks, variant.kernel, scale);
                cascade_decode(fused, gpu, (&queries, &kv), plan, out)
            }
            Attention::Sparse {
                grid_chunks,
                variant,
                grid_pages,
                ..
            } => {
                let sparse = self.sparse.as_deref_mut().ok_or_else(|| {
                    CudaError::invalid("a sparse decode step without its summaries")
                })?;
                let grid = (self.layout, grid_pages);
                let table = sparse.select(gpu, index, &queries, grid, &self.page_table)?;
                let kv = PagedKv::new(k_pool, v_pool, *self.layout, table);
                let plan = (grid_chunks, variant, scale);
                decode_selected(self.fused, gpu, &queries, &kv, plan, out)
            }
            Attention::Latent { .. } => Err(CudaError::invalid(
                "a latent attention decode ran on a grouped-query layer",
            )),
            Attention::Prefill => {
                let qo = &self.qo_indptr;
                ops::prefill_attention_with(self.prefill, gpu, &queries, &kv, qo, scale, out)
            }
            Attention::Mixed {
                decode_rows,
                grid_chunks,
                variant,
                grid_pages,
                ..
            } => {
                // The chunks first: the prefill kernel zeroes the output rows outside its
                // queries' range, the decode rows, which the fused decode then writes.
                let requests = self.page_table.num_requests();
                let chunks = self.page_table.requests(decode_rows..requests)?;
                let kv = PagedKv::new(k_pool, v_pool, *self.layout, chunks);
                let qo = self.qo_indptr.slice(decode_rows..requests + 1)?;
                ops::prefill_attention_with(self.prefill, gpu, &queries, &kv, &qo, scale, out)?;
                let rows = view(&self.qkv, 0..decode_rows * qkv_dim)?;
                let queries = Queries::new(&rows, heads, qkv_dim);
                let mut decodes = self.page_table.requests(0..decode_rows)?;
                let mut selected = false;
                if let (Some(sparse), 1..) = (self.sparse.as_deref_mut(), grid_pages) {
                    let grid = (self.layout, grid_pages);
                    decodes = sparse.select(gpu, index, &queries, grid, &decodes)?;
                    selected = true;
                }
                let kv = PagedKv::new(k_pool, v_pool, *self.layout, decodes);
                let q_dim = heads * self.model.config.head_dim;
                let mut out = view_mut(out, 0..decode_rows * q_dim)?;
                let plan = (grid_chunks, variant, scale);
                if selected {
                    decode_selected(self.fused, gpu, &queries, &kv, plan, &mut out)
                } else {
                    fused_decode(self.fused, gpu, &queries, &kv, plan, &mut out)
                }
            }
        }
    }

    fn output_projection(&mut self, layer: &GpuLayer<T>) -> Result<(), CudaError> {
        let (q_dim, _, _) = self.qkv_dims();
        let shape = (self.num_tokens, self.model.config.hidden_size, q_dim);
        let mut linear = Linear {
            gpu: self.gpu,
            small: self.gemv,
            quant: &mut *self.quant,
        };
        linear.run(&self.attn, &layer.gqa()?.wo, &mut self.x, shape, 1.0)
    }

    fn mlp_norm(&mut self, layer: &GpuLayer<T>) -> Result<(), CudaError> {
        let next =
            matches!(&layer.mlp, GpuMlp::Dense { w_gate_up, .. } if fused_q8::quantized(w_gate_up));
        let io = (&self.x, &layer.ffn_norm, &mut self.normed);
        let rows = (self.num_tokens, self.model.config.rms_norm_eps);
        fused_q8::rms_norm_for(self.gpu, self.quant, next, io, rows)
    }

    fn gate_up_projection(&mut self, layer: &GpuLayer<T>) -> Result<(), CudaError> {
        let (w_gate_up, w_down) = dense(layer)?;
        self.down_quantized = fused_q8::quantized(w_down);
        let c = &self.model.config;
        let shape = (self.num_tokens, 2 * c.intermediate_size, c.hidden_size);
        let mut linear = Linear {
            gpu: self.gpu,
            small: self.gemv,
            quant: &mut *self.quant,
        };
        linear.run(&self.normed, w_gate_up, &mut self.gate_up, shape, 0.0)
    }

    fn silu_mul(&mut self) -> Result<(), CudaError> {
        self.silu_mul_for_down()
    }

    fn down_projection(&mut self, layer: &GpuLayer<T>) -> Result<(), CudaError> {
        let (_, w_down) = dense(layer)?;
        let c = &self.model.config;
        let shape = (self.num_tokens, c.hidden_size, c.intermediate_size);
        let mut linear = Linear {
            gpu: self.gpu,
            small: self.gemv,
            quant: &mut *self.quant,
        };
        linear.run(&self.act, w_down, &mut self.x, shape, 1.0)
    }

    fn logits(&mut self) -> Result<(), CudaError> {
        if self.num_logits == 0 {
            // A prefill chunk that samples nothing: the KV is written, no logits needed.
            return Ok(());
        }
        // Only the rows that need logits go through the final norm and the LM head.
        let (model, gpu) = (self.model, self.gpu);
        let c = &model.config;
        let (hidden, num_tokens) = (c.hidden_size, self.num_tokens);
        let (x, rows) = (&self.x, &self.logits_rows);
        ops::embedding_gather(gpu, x, rows, &mut self.selected, num_tokens, hidden)?;
        let head = model.lm_head.as_ref().unwrap_or(&model.embedding);
        let next = !self.hidden_only && fused_q8::quantized(head);
        let io = (
            &self.selected,
            &model.output_norm,
            &mut self.selected_normed,
        );
        let rows = (self.num_logits, c.rms_norm_eps);
        fused_q8::rms_norm_for(gpu, self.quant, next, io, rows)?;
        if self.hidden_only {
            return Ok(());
        }
        let shape = (self.num_logits, c.vocab_size, hidden);
        let mut linear = Linear {
            gpu,
            small: self.gemv,
            quant: &mut *self.quant,
        };
        linear.run(&self.selected_normed, head, &mut self.logits, shape, 0.0)
    }
}

impl<T: HostFloat> MoeStep for GpuStep<'_, T> {
    fn is_moe(layer: &GpuLayer<T>) -> bool {
        matches!(layer.mlp, GpuMlp::Experts(_))
    }

    fn route(&mut self, layer: &GpuLayer<T>) -> Result<(), CudaError> {
        let (experts, buffers) = expert_parts(layer, &mut self.moe)?;
        let mut step = ExpertStep {
            gpu: self.gpu,
            linear: Linear {
                gpu: self.gpu,
                small: self.gemv,
                quant: &mut *self.quant,
            },
            num_tokens: self.num_tokens,
            hidden: self.model.config.hidden_size,
        };
        step.route(experts, &self.normed, buffers)
    }

    fn experts(&mut self, layer: &GpuLayer<T>) -> Result<(), CudaError> {
        let (experts, buffers) = expert_parts(layer, &mut self.moe)?;
        let mut step = ExpertStep {
            gpu: self.gpu,
            linear: Linear {
                gpu: self.gpu,
                small: self.gemv,
                quant: &mut *self.quant,
            },
            num_tokens: self.num_tokens,
            hidden: self.model.config.hidden_size,
        };
        step.experts(experts, &self.normed, buffers, &mut self.x)
    }
}

/// The gate/up and down matrices of a dense MLP block.
fn dense<T>(layer: &GpuLayer<T>) -> Result<(&Matrix<T>, &Matrix<T>), CudaError> {
    match &layer.mlp {
        GpuMlp::Dense { w_gate_up, w_down } => Ok((w_gate_up, w_down)),
        GpuMlp::Experts(_) => Err(CudaError::invalid(
            "a dense MLP step ran on a mixture-of-experts layer",
        )),
    }
}

/// The experts of a MoE layer and the step's expert buffers.
fn expert_parts<'l, 'b, T>(
    layer: &'l GpuLayer<T>,
    buffers: &'b mut Option<&mut MoeBuffers<T>>,
) -> Result<(&'l GpuExperts<T>, &'b mut MoeBuffers<T>), CudaError> {
    let GpuMlp::Experts(experts) = &layer.mlp else {
        return Err(CudaError::invalid(
            "a mixture-of-experts step ran on a dense layer",
        ));
    };
    let buffers = buffers
        .as_deref_mut()
        .ok_or_else(|| CudaError::invalid("a MoE step without its expert buffers"))?;
    Ok((experts, buffers))
}
