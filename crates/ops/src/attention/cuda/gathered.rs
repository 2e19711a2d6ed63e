//! Attention over the paged KV cache: causal ragged prefill (flash-style, online softmax)
//! and the baseline decode (gather the pages into contiguous K/V, then attend).

use super::ATTENTION;
use crate::cuda_dtypes::check_float;
use pagoda_cuda::{
    check_len, check_min_len, ptr, to_u32, whole, CudaError, DType, DeviceRead, DeviceView,
    DeviceWrite, Element, Gpu, KernelArg, KernelSpec, LaunchDims,
};

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
    pub(crate) indptr: DeviceView<'a, u32>,
    pub(crate) indices: DeviceView<'a, u32>,
    pub(crate) last_page_len: DeviceView<'a, u32>,
    pub(crate) first_page_offset: DeviceView<'a, u32>,
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
            indptr: whole(indptr),
            indices: whole(indices),
            last_page_len: whole(last_page_len),
            first_page_offset: whole(first_page_offset),
        })
    }

    /// Number of requests `B`.
    pub fn num_requests(&self) -> usize {
        self.indptr.len() - 1
    }

    /// The table of requests `range` only (their rows of `indptr`, `last_page_len` and
    /// `first_page_offset`; `indptr`'s values index the same `indices`): a mixed step's decode
    /// rows and prefill chunks attend through their own parts of the step's table.
    pub fn requests(&self, range: std::ops::Range<usize>) -> Result<Self, CudaError> {
        Ok(DevicePageTable {
            indptr: self.indptr.slice(range.start..range.end + 1)?,
            indices: self.indices,
            last_page_len: self.last_page_len.slice(range.clone())?,
            first_page_offset: self.first_page_offset.slice(range)?,
        })
    }
}

/// The queries of an attention launch: rows `row_stride` elements apart in `data`, each
/// starting with `num_heads` heads of the pool's `head_dim` (a row of a fused QKV buffer
/// has `row_stride = (num_q_heads + 2 * num_kv_heads) * head_dim`).
#[derive(Clone, Copy, Debug)]
pub struct Queries<'a, T> {
    /// The query rows.
    pub data: DeviceView<'a, T>,
    /// Query heads per row.
    pub num_heads: usize,
    /// Elements from one row to the next.
    pub row_stride: usize,
}

impl<'a, T> Queries<'a, T> {
    /// Borrows all of `data` as query rows.
    pub fn new(data: &'a impl DeviceRead<T>, num_heads: usize, row_stride: usize) -> Self {
        Queries {
            data: whole(data),
            num_heads,
            row_stride,
        }
    }
}

/// One layer's paged KV cache as the attention launchers read it: the K and V pools, their
/// layout and the batch's page table.
#[derive(Clone, Copy, Debug)]
pub struct PagedKv<'a, T> {
    /// `[num_pages, page_size, num_kv_heads, head_dim]`.
    pub k_pool: DeviceView<'a, T>,
    /// Same layout as `k_pool`.
    pub v_pool: DeviceView<'a, T>,
    /// The pools' shape.
    pub layout: PoolLayout,
    /// Which pages each request reads.
    pub page_table: DevicePageTable<'a>,
}

impl<'a, T> PagedKv<'a, T> {
    /// Borrows the two pools (lengths are checked by each launcher against `layout`).
    pub fn new(
        k_pool: &'a impl DeviceRead<T>,
        v_pool: &'a impl DeviceRead<T>,
        layout: PoolLayout,
        page_table: DevicePageTable<'a>,
    ) -> Self {
        PagedKv {
            k_pool: whole(k_pool),
            v_pool: whole(v_pool),
            layout,
            page_table,
        }
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
    /// `merge_attention_states`: merges split partials by log-sum-exp.
    MergeStates,
}

/// The specialisation of `entry` for `dtype` and `head_dim` (one of [`SUPPORTED_HEAD_DIMS`]).
pub fn specialize_attention(
    entry: AttentionEntry,
    dtype: DType,
    head_dim: usize,
) -> Result<KernelSpec, CudaError> {
    // f16 serves the decode entries only (the reference of the fused decode's f16 KV).
    if dtype != DType::F16 || entry == AttentionEntry::Prefill {
        check_float("attention", dtype)?;
    }
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
            AttentionEntry::MergeStates => "merge_attention_states",
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

/// The extents of a decode launch: both pools hold `layout`, `out` is
/// `[num_requests, num_q_heads, head_dim]`, and `q` holds `num_requests` rows `q_row_stride`
/// apart.
pub(super) fn check_decode_io(
    layout: &PoolLayout,
    (k_len, v_len): (usize, usize),
    (q_len, num_q_heads, q_row_stride): (usize, usize, usize),
    num_requests: usize,
    out_len: usize,
) -> Result<(), CudaError> {
    check_len("k_pool", layout.pool_len(), k_len)?;
    check_len("v_pool", layout.pool_len(), v_len)?;
    check_len(
        "decode out [B, num_q_heads, head_dim]",
        num_requests * num_q_heads * layout.head_dim,
        out_len,
    )?;
    check_queries(
        "decode q",
        q_len,
        num_requests,
        q_row_stride,
        num_q_heads,
        layout.head_dim,
    )
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
    queries: &Queries<'_, T>,
    kv: &PagedKv<'_, T>,
    qo_indptr: &impl DeviceRead<u32>,
    scale: f32,
    out: &mut impl DeviceWrite<T>,
) -> Result<(), CudaError> {
    let (q, num_q_heads, q_row_stride) = (&queries.data, queries.num_heads, queries.row_stride);
    let PagedKv {
        k_pool,
        v_pool,
        layout,
        page_table,
    } = kv;
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

/// Most splits of one request's keys in the baseline decode (the merge reads all of them).
pub const MAX_DECODE_SPLITS: usize = 64;

/// Device memory of the baseline decode, allocated once at its largest size so a decode step
/// allocates nothing and can be replayed from a CUDA graph: the gathered K and V (one
/// page-sized block per page-table position, `capacity_pages` positions) and the split
/// partials (`[max_requests, num_q_heads, MAX_DECODE_SPLITS, head_dim]` f32 plus their
/// log-sum-exps).
pub struct DecodeWorkspace<T> {
    k: pagoda_cuda::DeviceBuffer<T>,
    v: pagoda_cuda::DeviceBuffer<T>,
    partial_out: pagoda_cuda::DeviceBuffer<f32>,
    partial_lse: pagoda_cuda::DeviceBuffer<f32>,
    capacity_pages: usize,
    max_requests: usize,
    num_q_heads: usize,
}

impl<T: Element> DecodeWorkspace<T> {
    /// Room for batches of at most `max_requests` requests whose page tables list at most
    /// `capacity_pages` pages in all, for `num_q_heads` query heads over `layout`.
    pub fn new(
        gpu: &Gpu,
        layout: &PoolLayout,
        num_q_heads: usize,
        max_requests: usize,
        capacity_pages: usize,
    ) -> Result<Self, CudaError> {
        layout.validate()?;
        let page = layout.page_size * layout.token_stride();
        let heads = max_requests.max(1) * num_q_heads;
        Ok(DecodeWorkspace {
            k: gpu.alloc(capacity_pages.max(1) * page)?,
            v: gpu.alloc(capacity_pages.max(1) * page)?,
            partial_out: gpu.alloc(heads * MAX_DECODE_SPLITS * layout.head_dim)?,
            partial_lse: gpu.alloc(heads * MAX_DECODE_SPLITS)?,
            capacity_pages,
            max_requests,
            num_q_heads,
        })
    }

    /// Page-table positions the gathered K/V can hold.
    pub fn capacity_pages(&self) -> usize {
        self.capacity_pages
    }

    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        (self.k.len() + self.v.len()) * std::mem::size_of::<T>()
            + (self.partial_out.len() + self.partial_lse.len()) * 4
    }
}

/// Splits per request for a decode batch of `num_requests` over `num_kv_heads` KV heads on a
/// GPU of `sm_count` SMs: enough CTAs for about two waves, at most [`MAX_DECODE_SPLITS`]
/// (the kernel never gives a split fewer than 32 keys, so short contexts use fewer).
pub fn decode_splits(num_requests: usize, num_kv_heads: usize, sm_count: usize) -> usize {
    let ctas = (num_requests * num_kv_heads).max(1);
    (2 * sm_count.max(1))
        .div_ceil(ctas)
        .clamp(1, MAX_DECODE_SPLITS)
}

/// Baseline decode: copies the pages of `page_table` (in table order) into the workspace,
/// then attends with one query per request (`q` row `r`, `q_row_stride` apart), each
/// request's keys cut into `num_splits` ranges merged by log-sum-exp (no merge when 1).
/// `out` is `[B, num_q_heads, head_dim]`, fully overwritten; a request with no visible token
/// gets zeros. Every count is read on the device, so the launches replay from a CUDA graph
/// with new inputs in the same buffers. The page table must list at most
/// `workspace.capacity_pages()` pages (the caller checks on the host; a request beyond the
/// capacity gets NaN rather than a wrong answer).
pub fn decode_attention_gathered<T: Element>(
    gpu: &Gpu,
    queries: &Queries<'_, T>,
    kv: &PagedKv<'_, T>,
    workspace: &mut DecodeWorkspace<T>,
    num_splits: usize,
    scale: f32,
    out: &mut impl DeviceWrite<T>,
) -> Result<(), CudaError> {
    let (q, num_q_heads, q_row_stride) = (&queries.data, queries.num_heads, queries.row_stride);
    let PagedKv {
        k_pool,
        v_pool,
        layout,
        page_table,
    } = kv;
    let gather = specialize_attention(AttentionEntry::PagedGather, T::DTYPE, layout.head_dim)?;
    let attend = specialize_attention(AttentionEntry::DecodeGathered, T::DTYPE, layout.head_dim)?;
    let merge = specialize_attention(AttentionEntry::MergeStates, T::DTYPE, layout.head_dim)?;
    let group = group_block(layout, num_q_heads)? / 32;
    let num_requests = page_table.num_requests();
    check_decode_io(
        layout,
        (k_pool.len(), v_pool.len()),
        (q.len(), num_q_heads, q_row_stride),
        num_requests,
        out.len(),
    )?;
    if num_requests > workspace.max_requests || num_q_heads != workspace.num_q_heads {
        return Err(CudaError::invalid(format!(
            "a decode of {num_requests} requests x {num_q_heads} heads exceeds its workspace \
             ({} x {})",
            workspace.max_requests, workspace.num_q_heads
        )));
    }
    if num_splits == 0 || num_splits > MAX_DECODE_SPLITS {
        return Err(CudaError::invalid(format!(
            "decode num_splits {num_splits} is outside 1..={MAX_DECODE_SPLITS}"
        )));
    }
    if num_requests > 65535 {
        return Err(CudaError::invalid(
            "decode supports at most 65535 requests per launch",
        ));
    }
    let page_elems = layout.page_size * layout.token_stride();
    let gather_args = [
        ptr(k_pool),
        ptr(v_pool),
        ptr(&page_table.indptr),
        ptr(&page_table.indices),
        ptr(&workspace.k),
        ptr(&workspace.v),
        KernelArg::U32(to_u32("num_requests", num_requests)?),
        KernelArg::U32(to_u32("page elements", page_elems)?),
        KernelArg::U32(to_u32("num_pages", layout.num_pages)?),
        KernelArg::U32(to_u32("capacity_pages", workspace.capacity_pages)?),
    ];
    // A fixed grid (the page count lives on the device): a few CTAs per SM.
    let gather_ctas = (gpu.info().sm_count.max(1) * 4).min(65535);
    // SAFETY: arguments match `paged_kv_gather`; the workspace holds capacity_pages pages.
    unsafe {
        gpu.launch(
            &gather,
            LaunchDims::new((gather_ctas, 1), 256),
            &gather_args,
        )?
    };
    let key_warps = (8 / group).max(1);
    let attend_args = [
        ptr(q),
        ptr(&workspace.k),
        ptr(&workspace.v),
        ptr(&page_table.indptr),
        ptr(&page_table.last_page_len),
        ptr(&page_table.first_page_offset),
        ptr(out),
        ptr(&workspace.partial_out),
        ptr(&workspace.partial_lse),
        KernelArg::U32(to_u32("num_q_heads", num_q_heads)?),
        KernelArg::U32(to_u32("num_kv_heads", layout.num_kv_heads)?),
        KernelArg::U32(to_u32("page_size", layout.page_size)?),
        KernelArg::U64((workspace.capacity_pages * layout.page_size) as u64),
        KernelArg::U32(to_u32("q_row_stride", q_row_stride)?),
        KernelArg::F32(scale * std::f32::consts::LOG2_E),
    ];
    let grid = (
        num_requests as u32,
        layout.num_kv_heads as u32,
        num_splits as u32,
    );
    let block = 32 * group * key_warps;
    // SAFETY: arguments match `decode_attention_gathered`; the partial buffers hold
    // max_requests x num_q_heads x MAX_DECODE_SPLITS rows.
    unsafe { gpu.launch(&attend, LaunchDims::new_3d(grid, block), &attend_args)? };
    if num_splits == 1 {
        return Ok(());
    }
    let merge_args = [
        ptr(&workspace.partial_out),
        ptr(&workspace.partial_lse),
        ptr(out),
        KernelArg::U32(num_splits as u32),
    ];
    let merge_grid = (num_requests as u32, to_u32("num_q_heads", num_q_heads)?);
    let merge_block = layout.head_dim.min(128) as u32;
    // SAFETY: arguments match `merge_attention_states`; extents validated above.
    unsafe {
        gpu.launch(
            &merge,
            LaunchDims::new(merge_grid, merge_block),
            &merge_args,
        )
    }
}
