//! Attention over the paged KV cache (CPU, f32).
//!
//! Pool layout, per layer and per side (K and V are separate slices):
//! `[num_pages, page_size, num_kv_heads, head_dim]` contiguous f32 ([`KvLayout`]). Token
//! rows are addressed through the CSR [`PageTable`] of `pagoda_kv`.
//!
//! - [`append_kv`]: write new tokens' K/V rows at their [`Slot`](pagoda_kv::Slot)s.
//! - [`gather_attention`]: the baseline ("gather then attend"), ragged causal attention for
//!   prefill and decode: each request's visible K/V is copied into a contiguous buffer,
//!   then softmax attention runs over it.
//! - Split-KV decode, the CPU twin of the GPU flash-decoding kernel: [`plan_decode`] (pure
//!   host plan), [`decode_partial`] (normalized partial outputs plus base-2 LSE per
//!   (chunk, head)), [`merge_states`] (generic, associative LSE merge), and
//!   [`split_kv_decode`] which runs the three.
//! - [`paged_attention`]: one entry that runs one [`AttentionPath`] for the whole batch.
//! - Batch-invariant steps, what the model runs: [`plan_step`] routes every query row to
//!   gather or split-KV by its OWN visible length and chunks each split-KV row by its own
//!   page count ([`SplitKvChunking`]), so a request's outputs are bit-identical whatever
//!   other requests (prefilling or decoding) share the step; [`step_attention`] runs the
//!   routed step with a reusable [`StepWorkspace`].
//! - [`AttentionKernel`]: the instruction set of the split-KV chunk kernel (AVX-512F,
//!   AVX2+FMA or the scalar oracle), selected once per process by `PAGODA_CPU_ATTENTION`. The batch-wide [`plan_decode`] picks one
//!   chunk size for the whole batch and is therefore NOT batch-invariant; it stays for the
//!   GPU twin and the kernel tests.
//!
//! Causality: queries are the newest tokens of their request, already appended. Request
//! `r` has `q_len = qo_indptr[r + 1] - qo_indptr[r]` queries and `seq_len = seq_lens[r]`
//! visible tokens; its query `j` sits at visible index `seq_len - q_len + j` and attends to
//! visible tokens `0..=seq_len - q_len + j` (decode: `q_len = 1`, every visible token).
//! GQA: query head `h` reads KV head `h / (num_q_heads / num_kv_heads)`.
//!
//! Softmax math everywhere is base 2: the scale is pre-multiplied by `log2(e)` and weights
//! are `exp2(s - m)`, exactly as the GPU kernel will do it. LSEs are in log2 units.

mod cpu;
pub mod cuda;
pub mod fp8;
mod kv_pool;
mod plan;
mod validate;

pub use cpu::append::{append_kv, append_kv_pool};
pub use cpu::cascade::{cascade_counts, record_cascade_step, CascadeRule, CascadeStats};
pub use cpu::decode::{decode_partial, split_kv_decode, split_kv_decode_into, DecodeWorkspace};
pub use cpu::gather::gather_attention;
pub use cpu::kernel::{AttentionKernel, ATTENTION_KERNEL_ENV_VAR};
pub use cpu::merge::{merge_states, merge_states_into, MergedStates};
pub use cpu::mla::{append_latent, mla_attention, AbsorbedQuery, LatentKv};
pub use cpu::mla_sparse::{
    index_scores, mla_attention_selected, select_tokens, sparse_selection_counts, top_k_tokens,
    IndexerQuery, SelectionStats, TokenSelection,
};
pub use cpu::sparse::{
    octet_order_bound, record_sparse_dense_past_limit, record_sparse_layers, select_pages,
    sparse_decode_counts, DecodeSelector, KeySummaries, QuestSelector, RequestPages,
    SparseAttention, SparseDecodeCounts, SparseStepStats,
};
pub use cpu::sparse_params::SPARSE_ATTENTION_MAX;
pub use cpu::step::{
    plan_step, step_attention, SplitKvChunking, StepAttentionConfig, StepAttentionPlan,
    StepWorkspace, DEFAULT_CHUNK_TOKENS,
};
pub use kv_pool::{BlockQ8_0, KvCacheTypes, KvPool, KvSlice, KvType, Q8_0_BLOCK};
pub use plan::{plan_decode, DecodePlan, DecodePlanConfig, MAX_CHUNKS};

use pagoda_kv::{PageTable, PageTableError};

/// Which attention implementation runs a step; the engine selects one and logs its
/// [`AttentionPath::name`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttentionPath {
    /// Gather each request's visible K/V into a contiguous buffer, then attend. Handles
    /// prefill and decode; the parity reference.
    Gather,
    /// Split-KV (flash-decoding) decode: chunked partial attention plus an LSE merge.
    /// Decode only (one query per request).
    SplitKv,
}

impl AttentionPath {
    /// Stable lowercase name for logs and metrics: `"gather"` or `"split_kv"`.
    pub fn name(self) -> &'static str {
        match self {
            AttentionPath::Gather => "gather",
            AttentionPath::SplitKv => "split_kv",
        }
    }
}

impl std::fmt::Display for AttentionPath {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(self.name())
    }
}

/// Bad input to an attention op. Every variant names what is wrong.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AttentionError {
    /// Head counts, head_dim or page_size that the op cannot serve.
    #[error("unsupported geometry: {0}")]
    Geometry(String),
    /// A buffer has the wrong number of elements.
    #[error("{what} has {actual} elements, expected {expected}")]
    Length {
        /// Which buffer (with its shape).
        what: &'static str,
        /// Elements required.
        expected: usize,
        /// Elements given.
        actual: usize,
    },
    /// The page table breaks an invariant for this pool.
    #[error("invalid page table: {0}")]
    PageTable(#[from] PageTableError),
    /// `qo_indptr` (or `o_indptr`) is malformed.
    #[error("invalid {what}: {reason}")]
    Indptr {
        /// Which array.
        what: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A request has more queries than visible tokens (queries must already be appended).
    #[error("request {request} has {num_queries} queries but only {seq_len} visible tokens")]
    QueriesExceedSequence {
        /// The request.
        request: usize,
        /// Its query count.
        num_queries: usize,
        /// Its visible length.
        seq_len: usize,
    },
    /// Split-KV decode got a request with a query count other than one.
    #[error(
        "split-KV decode needs exactly 1 query per request; request {request} has {num_queries}"
    )]
    NotDecode {
        /// The request.
        request: usize,
        /// Its query count.
        num_queries: usize,
    },
    /// The decode plan does not fit this page table or its own limits.
    #[error("decode plan: {0}")]
    Plan(String),
    /// A slot passed to `append_kv` is outside the pool.
    #[error("slot {index} (page {page}, offset {offset}) is outside the pool: {reason}")]
    SlotOutOfRange {
        /// Position in the slot list.
        index: usize,
        /// Its page.
        page: u32,
        /// Its offset.
        offset: u32,
        /// Which bound it breaks.
        reason: String,
    },
}

/// Shape of one layer's K (or V) pool: `[num_pages, page_size, num_kv_heads, head_dim]`,
/// contiguous f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Pages in the pool.
    pub num_pages: usize,
    /// Token rows per page.
    pub page_size: usize,
    /// KV heads per token row.
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

impl KvLayout {
    /// Elements of one token row (`num_kv_heads * head_dim`).
    pub fn token_stride(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Elements of the whole pool (`num_pages * page_size * num_kv_heads * head_dim`).
    pub fn pool_len(&self) -> usize {
        self.num_pages * self.page_size * self.token_stride()
    }

    /// Element offset of `(page, offset, kv_head, 0)`. No bounds check: callers validate.
    pub fn head_offset(&self, page: usize, offset: usize, kv_head: usize) -> usize {
        ((page * self.page_size + offset) * self.num_kv_heads + kv_head) * self.head_dim
    }
}

/// One layer's paged KV as this step's batch sees it.
#[derive(Clone, Copy, Debug)]
pub struct PagedKv<'a> {
    /// K pool, `[num_pages, page_size, num_kv_heads, head_dim]` values (f32, f16 or q8_0:
    /// [`KvSlice`]; `&[f32]` converts with `.into()`).
    pub k_pool: KvSlice<'a>,
    /// V pool, same layout as `k_pool` (its element type may differ).
    pub v_pool: KvSlice<'a>,
    /// The pools' shape.
    pub layout: KvLayout,
    /// The batch's CSR page table over this pool (`B` requests).
    pub page_table: &'a PageTable,
}

/// The batch's queries, ragged by request.
#[derive(Clone, Copy, Debug)]
pub struct QueryBatch<'a> {
    /// `[T, num_q_heads, head_dim]`, tokens of request `r` at rows
    /// `qo_indptr[r]..qo_indptr[r + 1]`.
    pub q: &'a [f32],
    /// `[B + 1]`, starts at 0, non-decreasing, ends at `T`.
    pub qo_indptr: &'a [u32],
    /// Query heads; a multiple of `num_kv_heads`.
    pub num_q_heads: usize,
}

/// Runs `path` over the batch and writes `out` `[T, num_q_heads, head_dim]` (fully
/// overwritten). [`AttentionPath::SplitKv`] needs `decode_plan` (from [`plan_decode`] on
/// this page table) and one query per request; [`AttentionPath::Gather`] ignores the plan.
pub fn paged_attention(
    path: AttentionPath,
    kv: &PagedKv<'_>,
    queries: &QueryBatch<'_>,
    scale: f32,
    decode_plan: Option<&DecodePlan>,
    out: &mut [f32],
) -> Result<(), AttentionError> {
    match path {
        AttentionPath::Gather => gather_attention(kv, queries, scale, out),
        AttentionPath::SplitKv => {
            let plan = decode_plan.ok_or_else(|| {
                AttentionError::Plan("the split_kv path needs a decode plan".into())
            })?;
            validate::decode_indptr(queries.qo_indptr, kv.page_table.num_requests())?;
            split_kv_decode(kv, queries.q, queries.num_q_heads, plan, scale, out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_names_are_stable() {
        assert_eq!(AttentionPath::Gather.name(), "gather");
        assert_eq!(AttentionPath::SplitKv.to_string(), "split_kv");
    }
}
