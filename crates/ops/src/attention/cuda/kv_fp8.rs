//! The e4m3 KV cache on the GPU, its storage (`kv_fp8.cu` is the codec of
//! [`crate::attention::fp8`]): one layer's byte pools and per-(slot, KV head) f32 scales
//! ([`Fp8KvLayer`]) and the scales as the kernels read them ([`KvScales`]). This module is a
//! leaf: the ops over the cache live with the op they specialise.
//!
//! Which kernels read fp8 (each an fp8 build with `PAGODA_KV_FP8=1`): the streaming
//! tensor-core decode (`paged_decode_stream.cu`) and the CUDA-core fused decode
//! (`paged_decode.cu`), both through [`super::paged_decode_attention_fp8`] as the workspace's
//! kernel says ([`super::fp8_kv_unsupported`] says which models can hold the cache), and the
//! query-tiled prefill (`prefill.cu`, [`super::prefill_attention_tiled_fp8`]). The appends
//! that fill it live with the plain appends (`crate::rope::cuda`: `kv_append_fp8`,
//! `rope_kv_append_fp8`). The WMMA decode, the WMMA and streaming prefills, the per-token and
//! gather kernels and MLA's latent kernels do not read fp8; callers choose the three above.

use super::gathered::{DevicePageTable, PagedKv, PoolLayout};
use pagoda_cuda::{check_len, whole, CudaError, DType, DeviceBuffer, DeviceRead, DeviceView, Gpu};

/// The f32 scales of an e4m3 cache's K and V pools, `[num_pages * page_size, num_kv_heads]`
/// each: the cached value is `scale * e4m3(byte)`.
#[derive(Clone, Copy, Debug)]
pub struct KvScales<'a> {
    /// K scales.
    pub k: DeviceView<'a, f32>,
    /// V scales.
    pub v: DeviceView<'a, f32>,
}

impl KvScales<'_> {
    /// Checks the extents against `layout` and that the pools are bytes (whether the kernel
    /// asked for reads fp8 is the caller's check).
    pub(super) fn check(&self, layout: &PoolLayout, pools: DType) -> Result<(), CudaError> {
        if pools != DType::U8 {
            return Err(CudaError::invalid(format!(
                "the fp8 KV cache is read from u8 pools, not {pools}"
            )));
        }
        let heads = layout.num_pages * layout.page_size * layout.num_kv_heads;
        check_len("fp8 k_scale [slots, num_kv_heads]", heads, self.k.len())?;
        check_len("fp8 v_scale [slots, num_kv_heads]", heads, self.v.len())
    }
}

/// One layer's e4m3 KV cache in device memory: K and V bytes `[num_pages, page_size,
/// num_kv_heads, head_dim]` and their scales `[num_pages * page_size, num_kv_heads]`.
pub struct Fp8KvLayer {
    /// K bytes.
    pub k: DeviceBuffer<u8>,
    /// V bytes.
    pub v: DeviceBuffer<u8>,
    /// K scales.
    pub k_scale: DeviceBuffer<f32>,
    /// V scales.
    pub v_scale: DeviceBuffer<f32>,
}

impl Fp8KvLayer {
    /// A zeroed layer of `layout` (scales zero: nothing is read before it is appended).
    pub fn new(gpu: &Gpu, layout: &PoolLayout) -> Result<Self, CudaError> {
        let heads = layout.num_pages * layout.page_size * layout.num_kv_heads;
        Ok(Fp8KvLayer {
            k: gpu.zeros(layout.pool_len())?,
            v: gpu.zeros(layout.pool_len())?,
            k_scale: gpu.zeros(heads)?,
            v_scale: gpu.zeros(heads)?,
        })
    }

    /// Checks the pools and scales against `layout`.
    pub(crate) fn check(&self, layout: &PoolLayout) -> Result<(), CudaError> {
        let heads = layout.num_pages * layout.page_size * layout.num_kv_heads;
        check_len("fp8 k_pool", layout.pool_len(), self.k.len())?;
        check_len("fp8 v_pool", layout.pool_len(), self.v.len())?;
        check_len("fp8 k_scale", heads, self.k_scale.len())?;
        check_len("fp8 v_scale", heads, self.v_scale.len())
    }

    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        self.k.len() + self.v.len() + 4 * (self.k_scale.len() + self.v_scale.len())
    }

    /// The pools and scales as the attention launchers read them, under `page_table`.
    pub fn paged<'a>(
        &'a self,
        layout: PoolLayout,
        page_table: DevicePageTable<'a>,
    ) -> (PagedKv<'a, u8>, KvScales<'a>) {
        let kv = PagedKv::new(&self.k, &self.v, layout, page_table);
        let scales = KvScales {
            k: whole(&self.k_scale),
            v: whole(&self.v_scale),
        };
        (kv, scales)
    }
}
