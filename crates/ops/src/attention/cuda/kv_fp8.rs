//! The e4m3 KV cache on the GPU (`kv_fp8.cu`, the codec of [`crate::attention::fp8`]): one
//! layer's byte pools and per-(slot, KV head) f32 scales ([`Fp8KvLayer`]), the appends that
//! fill them (plain and fused with RoPE) and the attention kernels that read them.
//!
//! Which kernels read fp8 (declared here, [`fp8_kv_unsupported`]): the CUDA-core fused decode
//! (`paged_decode.cu`) and the query-tiled prefill (`prefill.cu`), each a specialisation with
//! `PAGODA_KV_FP8=1`. The tensor-core decodes, the WMMA and streaming prefills, the per-token
//! and gather kernels and MLA's latent kernels do not; callers choose the two above.

use super::gathered::{PagedKv, PoolLayout, Queries};
use super::paged_decode::{
    paged_decode_launch, MergeMode, PagedDecodeKernel, PagedDecodeWorkspace,
};
use super::prefill::{PrefillTiling, QueryTiledKernel};
use super::{PAGED_DECODE, PAGED_DECODE_HEAD_DIMS, PREFILL, SUPPORTED_HEAD_DIMS};
use crate::cuda_dtypes::check_float;
use crate::rope::cuda::{rope_block, NewKv, RopeStyle, KV_APPEND, ROPE_KV_APPEND};
use pagoda_cuda::{
    check_len, check_min_len, ptr, to_u32, whole, CudaError, DType, DeviceBuffer, DeviceRead,
    DeviceView, DeviceWrite, Element, Gpu, KernelArg, KernelSpec, LaunchDims,
};

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
    /// Checks the extents against `layout`, that the pools are bytes and that `kernel` (the
    /// decode kernel asked for) reads fp8.
    pub(super) fn check(
        &self,
        layout: &PoolLayout,
        pools: DType,
        kernel: PagedDecodeKernel,
    ) -> Result<(), CudaError> {
        if pools != DType::U8 || kernel != PagedDecodeKernel::CudaCore {
            return Err(CudaError::invalid(format!(
                "the fp8 KV cache is read by the CUDA-core kernels only, from u8 pools (asked: \
                 {kernel:?} over {pools} pools)"
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

    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        self.k.len() + self.v.len() + 4 * (self.k_scale.len() + self.v_scale.len())
    }

    /// The pools and scales as the attention launchers read them, under `page_table`.
    pub fn paged<'a>(
        &'a self,
        layout: PoolLayout,
        page_table: super::DevicePageTable<'a>,
    ) -> (PagedKv<'a, u8>, KvScales<'a>) {
        let kv = PagedKv::new(&self.k, &self.v, layout, page_table);
        let scales = KvScales {
            k: whole(&self.k_scale),
            v: whole(&self.v_scale),
        };
        (kv, scales)
    }
}

/// Why this model cannot hold an fp8 KV cache on CUDA (`None`: it can): bf16 activations,
/// a head size both fp8 kernels are built for, grouped-query attention the fused decode
/// serves.
pub fn fp8_kv_unsupported(dtype: DType, layout: &PoolLayout, num_q_heads: usize) -> Option<String> {
    if dtype != DType::BF16 {
        return Some(format!("{dtype} activations (run --dtype bf16)"));
    }
    if !(PAGED_DECODE_HEAD_DIMS.contains(&layout.head_dim)
        && SUPPORTED_HEAD_DIMS.contains(&layout.head_dim))
    {
        return Some(format!("head_dim {}", layout.head_dim));
    }
    super::paged_decode_unsupported(dtype, layout, num_q_heads)
}

/// The fp8-pool build of `paged_decode_partial` (CUDA cores) for query/output `dtype`.
pub fn specialize_paged_decode_fp8(
    dtype: DType,
    head_dim: usize,
    group: usize,
) -> Result<KernelSpec, CudaError> {
    let mut spec =
        super::specialize_paged_decode(super::PagedDecodeEntry::Partial, dtype, head_dim, group)?;
    debug_assert!(std::ptr::eq(spec.source, &PAGED_DECODE));
    spec.params.push(("KV_FP8", 1));
    Ok(spec)
}

/// The fp8-pool build of `prefill_attention_tiled` for query/output `dtype`.
pub fn specialize_prefill_fp8(dtype: DType, head_dim: usize) -> Result<KernelSpec, CudaError> {
    let mut spec = super::specialize_prefill(dtype, head_dim)?;
    debug_assert!(std::ptr::eq(spec.source, &PREFILL));
    spec.params.push(("KV_FP8", 1));
    Ok(spec)
}

/// [`super::paged_decode_attention`] over an e4m3 cache: the same contract, with K and V
/// read as `scale * e4m3(byte)`. The workspace's kernel must be CUDA cores.
pub fn paged_decode_attention_fp8<T: Element>(
    gpu: &Gpu,
    queries: &Queries<'_, T>,
    (kv, scales): (&PagedKv<'_, u8>, &KvScales<'_>),
    workspace: &mut PagedDecodeWorkspace,
    merge: MergeMode,
    scale: f32,
    out: &mut impl DeviceWrite<T>,
) -> Result<(), CudaError> {
    paged_decode_launch(
        gpu,
        queries,
        kv,
        Some(scales),
        workspace,
        (merge, scale),
        out,
    )
}

/// [`super::prefill_attention_tiled`] over an e4m3 cache (same contract; K/V dequantized as
/// they are staged).
pub fn prefill_attention_tiled_fp8<T: Element>(
    gpu: &Gpu,
    queries: &Queries<'_, T>,
    (kv, scales): (&PagedKv<'_, u8>, &KvScales<'_>),
    qo_indptr: &impl DeviceRead<u32>,
    scale: f32,
    out: &mut impl DeviceWrite<T>,
) -> Result<(), CudaError> {
    let spec = specialize_prefill_fp8(T::DTYPE, kv.layout.head_dim)?;
    let tiling = PrefillTiling::for_head_dim(kv.layout.head_dim)?;
    let kernel = QueryTiledKernel {
        what: "tiled fp8 prefill",
        spec: &spec,
        block_rows: tiling.block_rows,
        threads: tiling.threads,
        shared_bytes: 0,
    };
    kernel.launch(gpu, queries, kv, Some(scales), qo_indptr, scale, out)
}

/// The `kv_append_fp8` specialisation for new rows of `dtype`.
pub fn specialize_kv_append_fp8(dtype: DType) -> Result<KernelSpec, CudaError> {
    check_float("kv_append_fp8", dtype)?;
    Ok(KernelSpec {
        source: &KV_APPEND,
        entry: "kv_append_fp8",
        params: vec![("KV_FP8", 1)],
        dtypes: vec![("T", dtype), ("SLOTS_T", DType::I32)],
    })
}

/// The `rope_kv_append_fp8` specialisation for `dtype` and `style`.
pub fn specialize_rope_kv_append_fp8(
    dtype: DType,
    style: RopeStyle,
) -> Result<KernelSpec, CudaError> {
    let mut spec = crate::rope::cuda::specialize_rope_kv_append(dtype, style)?;
    debug_assert!(std::ptr::eq(spec.source, &ROPE_KV_APPEND));
    spec.entry = "rope_kv_append_fp8";
    spec.params.push(("KV_FP8", 1));
    Ok(spec)
}

/// Block size of the fp8 appends without RoPE: one warp per head, K and V heads together.
const APPEND_THREADS: u32 = 256;

/// [`crate::rope::cuda::kv_append`] into an e4m3 cache: token `t`'s heads are quantized
/// (the codec of [`crate::attention::fp8`]) into pool row `slots[t]`, bytes and scales.
pub fn kv_append_fp8<T: Element>(
    gpu: &Gpu,
    new: &NewKv<'_, T>,
    layer: &mut Fp8KvLayer,
    layout: &PoolLayout,
) -> Result<(), CudaError> {
    let spec = specialize_kv_append_fp8(T::DTYPE)?;
    layout.validate()?;
    check_layer(layer, layout)?;
    let (k_row_stride, v_row_stride) = new.row_strides;
    let token_stride = layout.token_stride();
    if k_row_stride < token_stride || v_row_stride < token_stride {
        return Err(CudaError::invalid(format!(
            "kv_append_fp8 row strides ({k_row_stride}, {v_row_stride}) must be >= \
             num_kv_heads * head_dim {token_stride}"
        )));
    }
    let num_tokens = new.slots.len();
    if num_tokens > 0 {
        let k_end = (num_tokens - 1) * k_row_stride + token_stride;
        let v_end = (num_tokens - 1) * v_row_stride + token_stride;
        check_min_len("kv_append_fp8 k_new", k_end, new.k.len())?;
        check_min_len("kv_append_fp8 v_new", v_end, new.v.len())?;
    }
    let args = [
        ptr(&layer.k),
        ptr(&layer.v),
        ptr(&new.k),
        ptr(&new.v),
        ptr(&new.slots),
        KernelArg::U32(to_u32("num_kv_heads", layout.num_kv_heads)?),
        KernelArg::U32(to_u32("head_dim", layout.head_dim)?),
        KernelArg::U32(to_u32("k_row_stride", k_row_stride)?),
        KernelArg::U32(to_u32("v_row_stride", v_row_stride)?),
        KernelArg::I64((layout.num_pages * layout.page_size) as i64),
        ptr(&layer.k_scale),
        ptr(&layer.v_scale),
    ];
    let grid = (to_u32("num_tokens", num_tokens)?, 1);
    // SAFETY: arguments match `kv_append_fp8`; extents validated, slots bounds-checked on
    // the device.
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, APPEND_THREADS), &args) }
}

/// [`crate::rope::cuda::rope_kv_append`] into an e4m3 cache: the q and k heads of `qkv`
/// rotate in place exactly as there, then the rotated k and the v heads are quantized into
/// pool row `slots[t]` as [`kv_append_fp8`] does (the same bytes as rope then that append).
pub fn rope_kv_append_fp8<T: Element>(
    gpu: &Gpu,
    qkv: &mut impl DeviceWrite<T>,
    (positions, inv_freq, style): (&impl DeviceRead<u32>, &impl DeviceRead<f32>, RopeStyle),
    (num_q_heads, row_stride): (usize, usize),
    (slots, layer): (&impl DeviceRead<i32>, &mut Fp8KvLayer),
    layout: &PoolLayout,
) -> Result<(), CudaError> {
    let spec = specialize_rope_kv_append_fp8(T::DTYPE, style)?;
    layout.validate()?;
    check_layer(layer, layout)?;
    let (num_kv_heads, head_dim) = (layout.num_kv_heads, layout.head_dim);
    let rope_dim = 2 * inv_freq.len();
    let width = (num_q_heads + 2 * num_kv_heads) * head_dim;
    if num_q_heads == 0 || rope_dim == 0 || rope_dim > head_dim || width > row_stride {
        return Err(CudaError::invalid(format!(
            "rope_kv_append_fp8 geometry: {num_q_heads} q heads, {num_kv_heads} kv heads, \
             head_dim {head_dim}, rope_dim {rope_dim}, row_stride {row_stride}"
        )));
    }
    let num_tokens = positions.len();
    check_len("rope_kv_append_fp8 slots", num_tokens, slots.len())?;
    if num_tokens > 0 {
        let end = (num_tokens - 1) * row_stride + width;
        check_min_len("rope_kv_append_fp8 qkv", end, qkv.len())?;
    }
    let args = [
        ptr(qkv),
        ptr(positions),
        ptr(inv_freq),
        ptr(slots),
        ptr(&layer.k),
        ptr(&layer.v),
        KernelArg::U32(to_u32("num_q_heads", num_q_heads)?),
        KernelArg::U32(to_u32("num_kv_heads", num_kv_heads)?),
        KernelArg::U32(to_u32("head_dim", head_dim)?),
        KernelArg::U32(to_u32("rope_dim", rope_dim)?),
        KernelArg::U32(to_u32("row_stride", row_stride)?),
        KernelArg::I64((layout.num_pages * layout.page_size) as i64),
        ptr(&layer.k_scale),
        ptr(&layer.v_scale),
    ];
    let block = rope_block(rope_dim, num_q_heads + num_kv_heads)?;
    let grid = (to_u32("num_tokens", num_tokens)?, 1);
    // SAFETY: arguments match `rope_kv_append_fp8`; extents validated, slots bounds-checked
    // on the device; the block is whole warps (rope_block rounds to 32).
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, block), &args) }
}

fn check_layer(layer: &Fp8KvLayer, layout: &PoolLayout) -> Result<(), CudaError> {
    let heads = layout.num_pages * layout.page_size * layout.num_kv_heads;
    check_len("fp8 k_pool", layout.pool_len(), layer.k.len())?;
    check_len("fp8 v_pool", layout.pool_len(), layer.v.len())?;
    check_len("fp8 k_scale", heads, layer.k_scale.len())?;
    check_len("fp8 v_scale", heads, layer.v_scale.len())
}

/// Every fp8 specialisation the launchers above can request (bf16 activations).
pub fn specializations() -> Result<Vec<KernelSpec>, CudaError> {
    let mut specs = Vec::new();
    for dtype in [DType::BF16] {
        specs.push(specialize_kv_append_fp8(dtype)?);
        for style in [RopeStyle::Interleaved, RopeStyle::Halves] {
            specs.push(specialize_rope_kv_append_fp8(dtype, style)?);
        }
        for &head_dim in PAGED_DECODE_HEAD_DIMS.iter() {
            if SUPPORTED_HEAD_DIMS.contains(&head_dim) {
                specs.push(specialize_prefill_fp8(dtype, head_dim)?);
            }
            for group in 1..=super::MAX_DECODE_GROUP {
                specs.push(specialize_paged_decode_fp8(dtype, head_dim, group)?);
            }
        }
    }
    Ok(specs)
}
