//! CUDA's KV steps over an e4m3 cache (`-ctk fp8 -ctv fp8`): the appends quantize the new
//! rows into the layer's byte pools and scales ([`ops::Fp8KvLayer`]), and attention reads
//! them through the kernels built for it: the fused decode (the step's variant: streaming
//! tensor-core or CUDA-core) and the prefill (the step's kernel: streaming tensor-core or
//! tiled). `StepBuffers::new` refused every configuration that would need another kernel
//! (gather decode, deterministic mode, a latent cache), so the other arms are errors.

use pagoda_cuda::{view, view_mut, CudaError, DeviceViewMut, Gpu};
use pagoda_ops::cuda::{self as ops, Queries};

use super::super::buffers::Attention;
use super::super::decode_path::{launch_workspace, FusedDecode};
use super::super::HostFloat;
use super::GpuStep;

impl<T: HostFloat> GpuStep<'_, T> {
    /// [`ops::kv_append_fp8`] of the step's K and V rows (in the QKV buffer) into layer
    /// `index`.
    pub(super) fn append_kv_fp8(&mut self, index: usize) -> Result<(), CudaError> {
        let num_tokens = self.num_tokens;
        let (q_dim, kv_dim, qkv_dim) = self.qkv_dims();
        let new = ops::NewKv {
            k: view(&self.qkv, q_dim..num_tokens * qkv_dim)?,
            v: view(&self.qkv, q_dim + kv_dim..num_tokens * qkv_dim)?,
            row_strides: (qkv_dim, qkv_dim),
            slots: self.slots,
        };
        ops::kv_append_fp8(self.gpu, &new, &mut self.fp8[index], self.layout)
    }

    /// RoPE and [`ops::rope_kv_append_fp8`] in one launch.
    pub(super) fn rope_append_kv_fp8(&mut self, index: usize) -> Result<(), CudaError> {
        let c = &self.model.config;
        let (_, _, qkv_dim) = self.qkv_dims();
        let rope = (&self.positions, &self.model.inv_freq, self.model.rope_style);
        let geometry = (c.num_attention_heads, qkv_dim);
        let pools = (&self.slots, &mut self.fp8[index]);
        ops::rope_kv_append_fp8(self.gpu, &mut self.qkv, rope, geometry, pools, self.layout)
    }

    /// The step's attention over layer `index`'s e4m3 cache.
    pub(super) fn attention_fp8(&mut self, index: usize) -> Result<(), CudaError> {
        let (gpu, scale) = (self.gpu, self.scale);
        let (_, _, qkv_dim) = self.qkv_dims();
        let heads = self.model.config.num_attention_heads;
        let queries = Queries::new(&self.qkv, heads, qkv_dim);
        let layer = &self.fp8[index];
        let out = &mut self.attn;
        match self.attention {
            Attention::Fused {
                grid_chunks,
                variant,
                ..
            } => {
                let kv = layer.paged(*self.layout, self.page_table);
                let plan = (grid_chunks, variant, scale);
                fused_decode_fp8(self.fused, gpu, &queries, kv, plan, out)
            }
            Attention::Prefill => {
                let kv = layer.paged(*self.layout, self.page_table);
                let (kv, qo) = ((&kv.0, &kv.1), &self.qo_indptr);
                prefill_fp8(self.prefill, gpu, &queries, kv, qo, scale, out)
            }
            Attention::Mixed {
                decode_rows,
                grid_chunks,
                variant,
                ..
            } => {
                // The chunks first: the prefill kernel zeroes the output rows outside its
                // queries' range, the decode rows, which the fused decode then writes.
                let requests = self.page_table.num_requests();
                let chunks = layer.paged(
                    *self.layout,
                    self.page_table.requests(decode_rows..requests)?,
                );
                let qo = self.qo_indptr.slice(decode_rows..requests + 1)?;
                let kv = (&chunks.0, &chunks.1);
                prefill_fp8(self.prefill, gpu, &queries, kv, &qo, scale, out)?;
                let rows = view(&self.qkv, 0..decode_rows * qkv_dim)?;
                let queries = Queries::new(&rows, heads, qkv_dim);
                let decodes = layer.paged(*self.layout, self.page_table.requests(0..decode_rows)?);
                let q_dim = heads * self.model.config.head_dim;
                let mut out = view_mut(out, 0..decode_rows * q_dim)?;
                let plan = (grid_chunks, variant, scale);
                fused_decode_fp8(self.fused, gpu, &queries, decodes, plan, &mut out)
            }
            Attention::Gather { .. }
            | Attention::Latent { .. }
            | Attention::Cascade { .. }
            | Attention::Sparse { .. } => Err(CudaError::invalid(
                "the fp8 KV cache is read by the fused decode and the streaming or tiled prefill",
            )),
        }
    }
}

/// The fused decode over an e4m3 cache with `plan`'s grid, variant (its kernel and merge) and
/// softmax scale (the plan staged before the step).
fn fused_decode_fp8<T: HostFloat>(
    fused: &mut Option<FusedDecode>,
    gpu: &Gpu,
    queries: &Queries<'_, T>,
    (kv, scales): (ops::PagedKv<'_, u8>, ops::KvScales<'_>),
    (grid_chunks, variant, scale): (usize, ops::DecodeVariant, f32),
    out: &mut DeviceViewMut<'_, T>,
) -> Result<(), CudaError> {
    let workspace = launch_workspace(fused, grid_chunks, variant.kernel)?;
    let merge = variant.merge;
    ops::paged_decode_attention_fp8(gpu, queries, (&kv, &scales), workspace, merge, scale, out)
}

/// The step's prefill `kernel` over an e4m3 cache: the streaming kernel with its tiling,
/// else the tiled one (the only other that reads fp8).
fn prefill_fp8<T: HostFloat>(
    kernel: ops::PrefillKernel,
    gpu: &Gpu,
    queries: &Queries<'_, T>,
    kv: (&ops::PagedKv<'_, u8>, &ops::KvScales<'_>),
    qo: &impl pagoda_cuda::DeviceRead<u32>,
    scale: f32,
    out: &mut DeviceViewMut<'_, T>,
) -> Result<(), CudaError> {
    match kernel {
        ops::PrefillKernel::Stream(tiling) => {
            ops::prefill_attention_stream_fp8(gpu, tiling, queries, kv, qo, scale, out)
        }
        _ => ops::prefill_attention_tiled_fp8(gpu, queries, kv, qo, scale, out),
    }
}
