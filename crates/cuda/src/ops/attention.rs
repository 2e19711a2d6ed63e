//! Attention over the paged KV cache: causal ragged prefill (flash-style, online softmax)
//! and the baseline decode (gather the pages into contiguous K/V, then attend).

use super::{check_float, ATTENTION};
use crate::error::{check_len, check_min_len, to_u32, CudaError};
use crate::key::{DType, KernelSpec};
use crate::memory::{ptr, DeviceRead, DeviceView, DeviceWrite, KernelArg, LaunchDims};
use crate::{view, Element, Gpu};

/// Head sizes the attention kernels are instantiated for (multiples of 32, at most 256).
pub const SUPPORTED_HEAD_DIMS: [usize; 5] = [32, 64, 96, 128, 256];

/// Shape of one layer's K (or V) pool: `[num_pages, page_size, num_kv_heads, head_dim]`,
/// contiguous (the CPU `KvLayout` of pagoda-ops, same order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolLayout {
    /// Pages in the pool.
    pub num_pages: usize,
    /// Token rows per page.
    pub page_size: usize,
    /// KV heads per token row.
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

impl PoolLayout {
    /// Elements of one token row (`num_kv_heads * head_dim`).
    pub fn token_stride(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Elements of the whole pool.
    pub fn pool_len(&self) -> usize {
        self.num_pages * self.page_size * self.token_stride()
    }

    /// Every dimension is at least 1.
    pub fn validate(&self) -> Result<(), CudaError> {
        if self.num_pages == 0
            || self.page_size == 0
            || self.num_kv_heads == 0
            || self.head_dim == 0
        {
            return Err(CudaError::invalid(format!(
                "pool layout {self:?}: every dimension must be >= 1"
            )));
        }
        Ok(())
    }
}

/// The batch's CSR page table in device memory (FlashInfer's layout, as built by
/// `pagoda_kv::PageTable`): `indptr [B + 1]`, `indices [total_pages]`,
/// `last_page_len [B]`, `first_page_offset [B]`. Contents are not checked on the host
/// (they live on the device); kernels skip page ids `>= num_pages`.
#[derive(Clone, Copy, Debug)]
pub struct DevicePageTable<'a> {
    indptr: DeviceView<'a, u32>,
    indices: DeviceView<'a, u32>,
    last_page_len: DeviceView<'a, u32>,
    first_page_offset: DeviceView<'a, u32>,
}

impl<'a> DevicePageTable<'a> {
    /// Borrows the four arrays; checks that their lengths agree (`B = indptr.len() - 1`).
    pub fn new(
        indptr: &'a impl DeviceRead<u32>,
        indices: &'a impl DeviceRead<u32>,
        last_page_len: &'a impl DeviceRead<u32>,
        first_page_offset: &'a impl DeviceRead<u32>,
    ) -> Result<Self, CudaError> {
        if indptr.is_empty() {
            return Err(CudaError::invalid(
                "page table indptr must have B + 1 >= 1 entries",
            ));
        }
        let num_requests = indptr.len() - 1;
        check_len(
            "page table last_page_len [B]",
            num_requests,
            last_page_len.len(),
        )?;
        check_len(
            "page table first_page_offset [B]",
            num_requests,
            first_page_offset.len(),
        )?;
        Ok(DevicePageTable {
            indptr: view(indptr, 0..indptr.len())?,
            indices: view(indices, 0..indices.len())?,
            last_page_len: view(last_page_len, 0..last_page_len.len())?,
            first_page_offset: view(first_page_offset, 0..first_page_offset.len())?,
        })
    }

    /// Number of requests `B`.
    pub fn num_requests(&self) -> usize {
        self.indptr.len() - 1
    }
}

/// The entry points of `attention.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionEntry {
    /// `prefill_attention`: causal ragged attention over the paged cache.
    Prefill,
    /// `paged_kv_gather`: baseline decode step 1.
    PagedGather,
    /// `decode_attention_gathered`: baseline decode step 2.
    DecodeGathered,
}

/// The specialisation of `entry` for `dtype` and `head_dim` (one of [`SUPPORTED_HEAD_DIMS`]).
pub fn specialize_attention(
    entry: AttentionEntry,
    dtype: DType,
    head_dim: usize,
) -> Result<KernelSpec, CudaError> {
    check_float("attention", dtype)?;
    if !SUPPORTED_HEAD_DIMS.contains(&head_dim) {
        return Err(CudaError::invalid(format!(
            "attention head_dim {head_dim} is not supported (one of {SUPPORTED_HEAD_DIMS:?})"
        )));
    }
    Ok(KernelSpec {
        source: &ATTENTION,
        entry: match entry {
            AttentionEntry::Prefill => "prefill_attention",
            AttentionEntry::PagedGather => "paged_kv_gather",
            AttentionEntry::DecodeGathered => "decode_attention_gathered",
        },
        params: vec![("HEAD_DIM", head_dim as i64)],
        dtypes: vec![("T", dtype), ("INDEX_T", DType::U32)],
    })
}

/// Checks the head geometry and returns the block size `32 * n_rep`.
fn group_block(layout: &PoolLayout, num_q_heads: usize) -> Result<u32, CudaError> {
    layout.validate()?;
    let n_rep = num_q_heads / layout.num_kv_heads;
    if n_rep == 0 || n_rep * layout.num_kv_heads != num_q_heads || n_rep > 32 {
        return Err(CudaError::invalid(format!(
            "num_q_heads {num_q_heads} must be a multiple (at most 32x) of num_kv_heads {}",
            layout.num_kv_heads
        )));
    }
    if layout.num_kv_heads > 65535 {
        return Err(CudaError::invalid("num_kv_heads must be <= 65535"));
    }
    to_u32("block", 32 * n_rep)
}

/// Query rows as the kernels read them: row `t`, head `h` at `t * row_stride + h * head_dim`.
fn check_queries(
    what: &str,
    q_len: usize,
    rows: usize,
    row_stride: usize,
    num_q_heads: usize,
    head_dim: usize,
) -> Result<(), CudaError> {
    if row_stride < num_q_heads * head_dim {
        return Err(CudaError::invalid(format!(
            "{what} row_stride {row_stride} < num_q_heads * head_dim {}",
            num_q_heads * head_dim
        )));
    }
    if rows > 0 {
        check_min_len(
            what,
            (rows - 1) * row_stride + num_q_heads * head_dim,
            q_len,
        )?;
    }
    Ok(())
}

/// Causal ragged attention over the paged cache (queries already appended to it).
/// `q`: `num_tokens` rows, `q_row_stride` apart, `num_q_heads` heads each; `qo_indptr
/// [B + 1]` splits the rows by request; `out` is `[num_tokens, num_q_heads, head_dim]`
/// (fully overwritten; `num_tokens = out.len() / (num_q_heads * head_dim)`). Query `j` of
/// request `r` attends to visible tokens `0 ..= seq_len - q_len + j`. `scale` is the softmax
/// scale (e.g. `1 / sqrt(head_dim)`). Rows outside `qo_indptr` get zeros; a request with
/// more queries than visible tokens gets NaN.
pub fn prefill_attention<T: Element>(
    gpu: &Gpu,
    q: &impl DeviceRead<T>,
    (num_q_heads, q_row_stride): (usize, usize),
    k_pool: &impl DeviceRead<T>,
    v_pool: &impl DeviceRead<T>,
    layout: &PoolLayout,
    page_table: &DevicePageTable<'_>,
    qo_indptr: &impl DeviceRead<u32>,
    scale: f32,
    out: &mut impl DeviceWrite<T>,
) -> Result<(), CudaError> {
    let spec = specialize_attention(AttentionEntry::Prefill, T::DTYPE, layout.head_dim)?;
    let block = group_block(layout, num_q_heads)?;
    check_len("k_pool", layout.pool_len(), k_pool.len())?;
    check_len("v_pool", layout.pool_len(), v_pool.len())?;
    check_len(
        "qo_indptr [B + 1]",
        page_table.num_requests() + 1,
        qo_indptr.len(),
    )?;
    let row = num_q_heads * layout.head_dim;
    if out.len() % row != 0 {
        return Err(CudaError::invalid(format!(
            "prefill out has {} elements, not [T, {num_q_heads}, {}]",
            out.len(),
            layout.head_dim
        )));
    }
    let num_tokens = out.len() / row;
    check_queries(
        "prefill q",
        q.len(),
        num_tokens,
        q_row_stride,
        num_q_heads,
        layout.head_dim,
    )?;
    let args = [
        ptr(q),
        ptr(k_pool),
        ptr(v_pool),
        ptr(qo_indptr),
        ptr(&page_table.indptr),
        ptr(&page_table.indices),
        ptr(&page_table.last_page_len),
        ptr(&page_table.first_page_offset),
        ptr(out),
        KernelArg::U32(to_u32("num_requests", page_table.num_requests())?),
        KernelArg::U32(to_u32("num_q_heads", num_q_heads)?),
        KernelArg::U32(to_u32("num_kv_heads", layout.num_kv_heads)?),
        KernelArg::U32(to_u32("page_size", layout.page_size)?),
        KernelArg::U32(to_u32("num_pages", layout.num_pages)?),
        KernelArg::U32(to_u32("q_row_stride", q_row_stride)?),
        KernelArg::F32(scale * std::f32::consts::LOG2_E),
    ];
    let grid = (
        to_u32("num_tokens", num_tokens)?,
        layout.num_kv_heads as u32,
    );
    // SAFETY: arguments match `prefill_attention`; extents validated.
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, block), &args) }
}

/// Baseline decode: gathers each request's visible K/V into `k_scratch`/`v_scratch`
/// (each at least `B * max_seq_len * num_kv_heads * head_dim`), then attends with one query
/// per request (`q` row `r`, `q_row_stride` apart). `out` is `[B, num_q_heads, head_dim]`.
/// `max_seq_len` must bound every request's visible length (a longer one yields NaN).
pub fn decode_attention_gathered<T: Element>(
    gpu: &Gpu,
    q: &impl DeviceRead<T>,
    (num_q_heads, q_row_stride): (usize, usize),
    k_pool: &impl DeviceRead<T>,
    v_pool: &impl DeviceRead<T>,
    layout: &PoolLayout,
    page_table: &DevicePageTable<'_>,
    (k_scratch, v_scratch, max_seq_len): (
        &mut impl DeviceWrite<T>,
        &mut impl DeviceWrite<T>,
        usize,
    ),
    scale: f32,
    out: &mut impl DeviceWrite<T>,
) -> Result<(), CudaError> {
    let gather = specialize_attention(AttentionEntry::PagedGather, T::DTYPE, layout.head_dim)?;
    let attend = specialize_attention(AttentionEntry::DecodeGathered, T::DTYPE, layout.head_dim)?;
    let block = group_block(layout, num_q_heads)?;
    let num_requests = page_table.num_requests();
    check_len("k_pool", layout.pool_len(), k_pool.len())?;
    check_len("v_pool", layout.pool_len(), v_pool.len())?;
    check_len(
        "decode out [B, num_q_heads, head_dim]",
        num_requests * num_q_heads * layout.head_dim,
        out.len(),
    )?;
    check_queries(
        "decode q",
        q.len(),
        num_requests,
        q_row_stride,
        num_q_heads,
        layout.head_dim,
    )?;
    let scratch = num_requests * max_seq_len * layout.token_stride();
    check_min_len(
        "decode k_scratch [B, max_seq_len, num_kv_heads, head_dim]",
        scratch,
        k_scratch.len(),
    )?;
    check_min_len(
        "decode v_scratch [B, max_seq_len, num_kv_heads, head_dim]",
        scratch,
        v_scratch.len(),
    )?;
    if num_requests > 65535 {
        return Err(CudaError::invalid(
            "decode supports at most 65535 requests per launch",
        ));
    }
    let table = [
        ptr(&page_table.indptr),
        ptr(&page_table.indices),
        ptr(&page_table.last_page_len),
        ptr(&page_table.first_page_offset),
    ];
    let gather_args = [
        ptr(k_pool),
        ptr(v_pool),
        table[0],
        table[1],
        table[2],
        table[3],
        ptr(k_scratch),
        ptr(v_scratch),
        KernelArg::U32(to_u32("num_kv_heads", layout.num_kv_heads)?),
        KernelArg::U32(to_u32("page_size", layout.page_size)?),
        KernelArg::U32(to_u32("num_pages", layout.num_pages)?),
        KernelArg::U32(to_u32("max_seq_len", max_seq_len)?),
    ];
    let gather_grid = (to_u32("max_seq_len", max_seq_len)?, num_requests as u32);
    // SAFETY: arguments match `paged_kv_gather`; scratch extents validated.
    unsafe { gpu.launch(&gather, LaunchDims::new(gather_grid, 128), &gather_args)? };
    let attend_args = [
        ptr(q),
        ptr(k_scratch),
        ptr(v_scratch),
        table[0],
        table[2],
        table[3],
        ptr(out),
        KernelArg::U32(to_u32("num_q_heads", num_q_heads)?),
        KernelArg::U32(to_u32("num_kv_heads", layout.num_kv_heads)?),
        KernelArg::U32(to_u32("page_size", layout.page_size)?),
        KernelArg::U32(to_u32("max_seq_len", max_seq_len)?),
        KernelArg::U32(to_u32("q_row_stride", q_row_stride)?),
        KernelArg::F32(scale * std::f32::consts::LOG2_E),
    ];
    let attend_grid = (num_requests as u32, layout.num_kv_heads as u32);
    // SAFETY: arguments match `decode_attention_gathered`; extents validated.
    unsafe { gpu.launch(&attend, LaunchDims::new(attend_grid, block), &attend_args) }
}
