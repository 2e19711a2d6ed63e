//! RoPE and the KV append into the paged pool, apart or in one launch (`rope_kv_append`),
//! into a model-dtype pool or an e4m3 one ([`Fp8KvLayer`]: `kv_append_fp8`,
//! `rope_kv_append_fp8`, the codec of `crate::attention::fp8`).

use crate::attention::cuda::{Fp8KvLayer, PoolLayout};
use crate::cuda_dtypes::{check_float, FLOAT_DTYPES};
use pagoda_cuda::{
    check_len, check_min_len, ptr, to_u32, CudaError, DType, DeviceRead, DeviceView, DeviceWrite,
    Element, Gpu, KernelArg, KernelSource, KernelSpec, LaunchDims,
};

/// The CUDA source of this op's `rope.cu` kernels.
pub(crate) static ROPE: KernelSource = KernelSource::new("rope.cu", include_str!("cuda/rope.cu"));

/// The CUDA source of this op's `kv_append.cu` kernels.
pub(crate) static KV_APPEND: KernelSource = KernelSource::new(
    "kv_append.cu",
    concat!(
        include_str!("../attention/cuda/kv_fp8.cu"),
        include_str!("cuda/kv_append.cu")
    ),
);

/// The CUDA source of this op's `rope_kv_append.cu` kernel (the two above in one launch).
pub(crate) static ROPE_KV_APPEND: KernelSource = KernelSource::new(
    "rope_kv_append.cu",
    concat!(
        include_str!("../attention/cuda/kv_fp8.cu"),
        include_str!("cuda/rope_kv_append.cu")
    ),
);

/// Which dims of a head rotate together.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeStyle {
    /// `(2i, 2i + 1)`: GGUF llama-family weights.
    Interleaved,
    /// `(i, i + rope_dim / 2)`: GPT-NeoX / Hugging Face rotate-half, Qwen.
    Halves,
}

/// The `rope` specialisation for `dtype` and `style` (a template constant).
pub fn specialize_rope(dtype: DType, style: RopeStyle) -> Result<KernelSpec, CudaError> {
    check_float("rope", dtype)?;
    Ok(KernelSpec {
        source: &ROPE,
        entry: "rope",
        params: vec![("ROPE_HALVES", (style == RopeStyle::Halves) as i64)],
        dtypes: vec![
            ("T", dtype),
            ("POSITIONS_T", DType::U32),
            ("INV_FREQ_T", DType::F32),
        ],
    })
}

/// Rotates `x` in place: `num_tokens = positions.len()` token rows, each `row_stride`
/// elements apart, holding `num_heads` heads of `head_dim` (the first `rope_dim =
/// 2 * inv_freq.len()` dims of each head rotate). Pair `i` of token `t` turns by
/// `positions[t] * inv_freq[i]` radians; llama3 scaling is folded into `inv_freq` by the host.
pub fn rope<T: Element>(
    gpu: &Gpu,
    x: &mut impl DeviceWrite<T>,
    positions: &impl DeviceRead<u32>,
    inv_freq: &impl DeviceRead<f32>,
    (num_heads, head_dim, row_stride): (usize, usize, usize),
    style: RopeStyle,
) -> Result<(), CudaError> {
    let spec = specialize_rope(T::DTYPE, style)?;
    let rope_dim = 2 * inv_freq.len();
    if num_heads == 0 || rope_dim == 0 || rope_dim > head_dim || num_heads * head_dim > row_stride {
        return Err(CudaError::invalid(format!(
            "rope geometry: num_heads {num_heads}, head_dim {head_dim}, rope_dim {rope_dim} (2 * inv_freq), \
             row_stride {row_stride}: need 0 < rope_dim <= head_dim and num_heads * head_dim <= row_stride"
        )));
    }
    let num_tokens = positions.len();
    if num_tokens > 0 {
        check_min_len(
            "rope x",
            (num_tokens - 1) * row_stride + num_heads * head_dim,
            x.len(),
        )?;
    }
    let args = [
        ptr(x),
        ptr(positions),
        ptr(inv_freq),
        KernelArg::U32(to_u32("num_heads", num_heads)?),
        KernelArg::U32(to_u32("head_dim", head_dim)?),
        KernelArg::U32(to_u32("rope_dim", rope_dim)?),
        KernelArg::U32(to_u32("row_stride", row_stride)?),
    ];
    let block = rope_block(rope_dim, num_heads)?;
    // SAFETY: arguments match `rope`; extents validated.
    unsafe {
        gpu.launch(
            &spec,
            LaunchDims::new((to_u32("num_tokens", num_tokens)?, 1), block),
            &args,
        )
    }
}

/// Threads of a RoPE block: whole groups of `rope_dim / 2` threads (one per pair), up to 256
/// threads, rounded up to whole warps.
pub(crate) fn rope_block(rope_dim: usize, num_heads: usize) -> Result<u32, CudaError> {
    let half = rope_dim / 2;
    if half > 1024 {
        return Err(CudaError::invalid(format!(
            "rope_dim {rope_dim} is above 2048"
        )));
    }
    let groups = (256 / half).clamp(1, num_heads);
    to_u32("rope block", (groups * half).next_multiple_of(32).min(1024))
}

/// The `kv_append` specialisation for pool/new-row dtype `dtype`.
pub fn specialize_kv_append(dtype: DType) -> Result<KernelSpec, CudaError> {
    check_float("kv_append", dtype)?;
    Ok(KernelSpec {
        source: &KV_APPEND,
        entry: "kv_append",
        params: vec![],
        dtypes: vec![("T", dtype), ("SLOTS_T", DType::I32)],
    })
}

/// The K and V rows of a step's new tokens and where they go: token `t`'s rows
/// (`num_kv_heads * head_dim` elements at `t * row_strides.0` of `k`, `t * row_strides.1` of
/// `v`) belong in pool row `slots[t]` (`page * page_size + offset`); `num_tokens =
/// slots.len()`.
#[derive(Clone, Copy, Debug)]
pub struct NewKv<'a, T> {
    /// New K rows.
    pub k: DeviceView<'a, T>,
    /// New V rows.
    pub v: DeviceView<'a, T>,
    /// Elements from one row to the next in `k` and in `v`.
    pub row_strides: (usize, usize),
    /// Pool row per token; negative or out-of-pool slots are skipped (padding rows).
    pub slots: DeviceView<'a, i32>,
}

/// Writes the rows of `new` into `k_pool`/`v_pool` (`[num_pages, page_size, num_kv_heads,
/// head_dim]`, shaped by `layout`).
pub fn kv_append<T: Element>(
    gpu: &Gpu,
    new: &NewKv<'_, T>,
    k_pool: &mut impl DeviceWrite<T>,
    v_pool: &mut impl DeviceWrite<T>,
    layout: &PoolLayout,
) -> Result<(), CudaError> {
    let NewKv {
        k: k_new,
        v: v_new,
        row_strides: (k_row_stride, v_row_stride),
        slots,
    } = new;
    let (k_row_stride, v_row_stride) = (*k_row_stride, *v_row_stride);
    let spec = specialize_kv_append(T::DTYPE)?;
    layout.validate()?;
    check_len(
        "k_pool [num_pages, page_size, num_kv_heads, head_dim]",
        layout.pool_len(),
        k_pool.len(),
    )?;
    check_len(
        "v_pool [num_pages, page_size, num_kv_heads, head_dim]",
        layout.pool_len(),
        v_pool.len(),
    )?;
    let token_stride = layout.token_stride();
    if k_row_stride < token_stride || v_row_stride < token_stride {
        return Err(CudaError::invalid(format!(
            "kv_append row strides ({k_row_stride}, {v_row_stride}) must be >= num_kv_heads * head_dim {token_stride}"
        )));
    }
    let num_tokens = slots.len();
    if num_tokens > 0 {
        check_min_len(
            "kv_append k_new",
            (num_tokens - 1) * k_row_stride + token_stride,
            k_new.len(),
        )?;
        check_min_len(
            "kv_append v_new",
            (num_tokens - 1) * v_row_stride + token_stride,
            v_new.len(),
        )?;
    }
    let args = [
        ptr(k_pool),
        ptr(v_pool),
        ptr(k_new),
        ptr(v_new),
        ptr(slots),
        KernelArg::U32(to_u32("token_stride", token_stride)?),
        KernelArg::U32(to_u32("k_row_stride", k_row_stride)?),
        KernelArg::U32(to_u32("v_row_stride", v_row_stride)?),
        KernelArg::I64((layout.num_pages * layout.page_size) as i64),
    ];
    // SAFETY: arguments match `kv_append`; extents validated, slots bounds-checked on device.
    unsafe {
        gpu.launch(
            &spec,
            LaunchDims::new((to_u32("num_tokens", num_tokens)?, 1), 128),
            &args,
        )
    }
}

/// The `rope_kv_append` specialisation for `dtype` and `style`.
pub fn specialize_rope_kv_append(dtype: DType, style: RopeStyle) -> Result<KernelSpec, CudaError> {
    check_float("rope_kv_append", dtype)?;
    Ok(KernelSpec {
        source: &ROPE_KV_APPEND,
        entry: "rope_kv_append",
        params: vec![("ROPE_HALVES", (style == RopeStyle::Halves) as i64)],
        dtypes: vec![
            ("T", dtype),
            ("POSITIONS_T", DType::U32),
            ("INV_FREQ_T", DType::F32),
            ("SLOTS_T", DType::I32),
        ],
    })
}

/// [`rope`] over the q and k heads of a fused QKV buffer (at `positions`, with `inv_freq` and
/// `style`), then [`kv_append`] of its k and v rows, in one launch with the same results:
/// `qkv` holds `num_tokens = positions.len()`
/// rows `row_stride` apart of `num_q_heads` q heads, `num_kv_heads` k heads and
/// `num_kv_heads` v heads of `layout.head_dim`; token `t`'s rotated k and its v go to pool
/// row `slots[t]` (negative or out-of-pool slots skipped).
pub fn rope_kv_append<T: Element>(
    gpu: &Gpu,
    qkv: &mut impl DeviceWrite<T>,
    (positions, inv_freq, style): (&impl DeviceRead<u32>, &impl DeviceRead<f32>, RopeStyle),
    (num_q_heads, row_stride): (usize, usize),
    (slots, k_pool, v_pool): (
        &impl DeviceRead<i32>,
        &mut impl DeviceWrite<T>,
        &mut impl DeviceWrite<T>,
    ),
    layout: &PoolLayout,
) -> Result<(), CudaError> {
    let spec = specialize_rope_kv_append(T::DTYPE, style)?;
    layout.validate()?;
    let (num_kv_heads, head_dim) = (layout.num_kv_heads, layout.head_dim);
    let rope_dim = 2 * inv_freq.len();
    let width = (num_q_heads + 2 * num_kv_heads) * head_dim;
    if num_q_heads == 0 || rope_dim == 0 || rope_dim > head_dim || width > row_stride {
        return Err(CudaError::invalid(format!(
            "rope_kv_append geometry: {num_q_heads} q heads, {num_kv_heads} kv heads, head_dim \
             {head_dim}, rope_dim {rope_dim} (2 * inv_freq), row_stride {row_stride}: need 0 < \
             rope_dim <= head_dim and (q + 2 kv heads) * head_dim <= row_stride"
        )));
    }
    for (name, pool) in [("k_pool", k_pool.len()), ("v_pool", v_pool.len())] {
        check_len(
            &format!("rope_kv_append {name} [num_pages, page_size, num_kv_heads, head_dim]"),
            layout.pool_len(),
            pool,
        )?;
    }
    let num_tokens = positions.len();
    check_len(
        "rope_kv_append slots (one per token)",
        num_tokens,
        slots.len(),
    )?;
    if num_tokens > 0 {
        check_min_len(
            "rope_kv_append qkv",
            (num_tokens - 1) * row_stride + width,
            qkv.len(),
        )?;
    }
    let args = [
        ptr(qkv),
        ptr(positions),
        ptr(inv_freq),
        ptr(slots),
        ptr(k_pool),
        ptr(v_pool),
        KernelArg::U32(to_u32("num_q_heads", num_q_heads)?),
        KernelArg::U32(to_u32("num_kv_heads", num_kv_heads)?),
        KernelArg::U32(to_u32("head_dim", head_dim)?),
        KernelArg::U32(to_u32("rope_dim", rope_dim)?),
        KernelArg::U32(to_u32("row_stride", row_stride)?),
        KernelArg::I64((layout.num_pages * layout.page_size) as i64),
    ];
    let block = rope_block(rope_dim, num_q_heads + num_kv_heads)?;
    // SAFETY: arguments match `rope_kv_append`; extents validated, slots bounds-checked on
    // the device.
    unsafe {
        gpu.launch(
            &spec,
            LaunchDims::new((to_u32("num_tokens", num_tokens)?, 1), block),
            &args,
        )
    }
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
    let mut spec = specialize_rope_kv_append(dtype, style)?;
    debug_assert!(std::ptr::eq(spec.source, &ROPE_KV_APPEND));
    spec.entry = "rope_kv_append_fp8";
    spec.params.push(("KV_FP8", 1));
    Ok(spec)
}

/// Block size of the fp8 appends without RoPE: one warp per head, K and V heads together.
const APPEND_THREADS: u32 = 256;

/// [`kv_append`] into an e4m3 cache: token `t`'s heads are quantized
/// (the codec of [`crate::attention::fp8`]) into pool row `slots[t]`, bytes and scales.
pub fn kv_append_fp8<T: Element>(
    gpu: &Gpu,
    new: &NewKv<'_, T>,
    layer: &mut Fp8KvLayer,
    layout: &PoolLayout,
) -> Result<(), CudaError> {
    let spec = specialize_kv_append_fp8(T::DTYPE)?;
    layout.validate()?;
    layer.check(layout)?;
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

/// [`rope_kv_append`] into an e4m3 cache: the q and k heads of `qkv`
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
    layer.check(layout)?;
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

/// Every specialisation the RoPE and KV-append launchers can request.
pub fn specializations() -> Result<Vec<KernelSpec>, CudaError> {
    let mut specs = Vec::new();
    for &dtype in &FLOAT_DTYPES {
        for style in [RopeStyle::Interleaved, RopeStyle::Halves] {
            specs.push(specialize_rope(dtype, style)?);
            specs.push(specialize_rope_kv_append(dtype, style)?);
        }
        specs.push(specialize_kv_append(dtype)?);
    }
    specs.push(specialize_kv_append_fp8(DType::BF16)?);
    for style in [RopeStyle::Interleaved, RopeStyle::Halves] {
        specs.push(specialize_rope_kv_append_fp8(DType::BF16, style)?);
    }
    Ok(specs)
}
