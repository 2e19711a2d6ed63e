//! Batch-invariant attention for a whole step: every query row picks its path (gather or
//! split-KV) and, for split-KV, its chunking from its OWN visible length alone, so a
//! request's outputs are bit-identical whatever other requests share the step, whether they
//! prefill or decode, and however the engine cut the request's prompt into chunks.
//!
//! Why per row and not per request or per batch: a token's attention output feeds the K/V
//! that later layers write for it, so a prompt token computed in a prefill chunk, the same
//! token computed as a one-token chunk, a token recomputed after preemption and a decode
//! token must all take the same path at the same visible length. Here they do:
//!
//! - a row that sees `L` visible tokens runs split-KV iff `L >= min_split_kv_tokens`
//!   ([`StepAttentionConfig`]), else gather;
//! - a split-KV row is cut into chunks of [`SplitKvChunking::chunk_tokens`] visible tokens
//!   from its first one (fixed configuration), and its chunks are merged in order by
//!   [`merge_states_into`]. Consecutive rows of one request share a work item per chunk and
//!   KV head; each row's heads end at the row's own visible end, and the kernels
//!   ([`AttentionKernel`](crate::attention::AttentionKernel), fixed per process) give a head the same
//!   bits whatever other heads share its work item;
//! - a gather row runs the full causal softmax over its `L` tokens, exactly as
//!   [`gather_attention`](crate::attention::gather_attention) does.
//!
//! The routing ([`StepAttentionPlan`]) is built once per step from the page table and
//! `qo_indptr` and reused by every layer, with one [`StepWorkspace`].

use rayon::prelude::*;

use super::cascade::CascadePlan;
use super::chunk::{HeadTask, MAX_ITEM_HEADS};
use super::gather::attend_rows;
use super::kernel::{self, AttentionKernel};
use super::merge::merge_states_into;
use crate::attention::{validate, AttentionError, AttentionPath, PagedKv, QueryBatch};

/// Most partial-state elements (`chunks * num_q_heads * head_dim`) one block of split-KV
/// rows may hold; longer steps run several blocks, so the workspace stays bounded (16 MiB)
/// even for a long prefill on a many-thread machine. Block bounds never change a row's bits.
const MAX_BLOCK_ELEMENTS: usize = 4 << 20;

/// Tokens per split-KV chunk the model uses ([`SplitKvChunking::chunk_tokens`]), measured:
/// see `docs/benchmark_results/cpu-attention-row-tiles-epyc-h200host-2026-12-01.md`.
pub const DEFAULT_CHUNK_TOKENS: usize = 256;

/// How split-KV cuts ONE query row's visible tokens into chunks: spans of `chunk_tokens`
/// tokens from the first visible token, the last one shorter. A chunk's bounds are a function
/// of its position only, never of the rest of the batch, of the row's length or of the
/// thread count, so rows of one request share their chunks (the kernel reads each K/V tile
/// once for all of them) and a row's bits do not depend on the machine's parallelism.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitKvChunking {
    /// KV heads of the model (work items per chunk and group of rows).
    pub num_kv_heads: usize,
    /// Visible tokens per chunk (>= 1; 0 is read as 1).
    pub chunk_tokens: usize,
}

impl SplitKvChunking {
    /// Chunks of `chunk_tokens` tokens for a model with `num_kv_heads` KV heads.
    pub fn new(num_kv_heads: usize, chunk_tokens: usize) -> Self {
        Self {
            num_kv_heads,
            chunk_tokens,
        }
    }

    /// Chunks of a row that sees `visible` tokens (at least 1).
    pub fn num_chunks(&self, visible: usize) -> usize {
        visible.div_ceil(self.chunk_tokens.max(1)).max(1)
    }

    /// Visible-token range of chunk `index` of a row that sees `visible` tokens.
    pub fn chunk(&self, visible: usize, index: usize) -> std::ops::Range<usize> {
        let size = self.chunk_tokens.max(1);
        (index * size).min(visible)..((index + 1) * size).min(visible)
    }
}

/// What decides each row's path in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepAttentionConfig {
    /// Chunking of split-KV rows.
    pub chunking: SplitKvChunking,
    /// A query row that sees at least this many visible tokens runs split-KV; any other row
    /// runs gather. 0: every row split-KV; `usize::MAX`: every row gather.
    pub min_split_kv_tokens: usize,
}

/// Leading query rows of one request that run gather (a request's visible lengths grow with
/// its rows, so its gather rows always come first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GatherSegment {
    request: usize,
    /// First query row (index into `[T]`).
    first_row: usize,
    /// Rows in the segment.
    num_rows: usize,
    /// Visible tokens of the segment's last row.
    seq_len: usize,
}

/// One split-KV row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct SplitRow {
    pub(super) request: usize,
    /// Its query row (index into `[T]`).
    row: usize,
    /// Its visible tokens.
    seq_len: usize,
}

/// A step's routing: which query rows run gather, which run split-KV and how each split-KV
/// row is chunked. Built by [`plan_step`] once per step, reused by every layer.
#[derive(Clone, Debug, PartialEq)]
pub struct StepAttentionPlan {
    /// `[B + 1]`, the batch's `qo_indptr` the plan was made for.
    pub(super) qo_indptr: Vec<u32>,
    /// `[B]`, the page table's `seq_lens` the plan was made for.
    seq_lens: Vec<u32>,
    gather_segments: Vec<GatherSegment>,
    pub(super) split_rows: Vec<SplitRow>,
    /// `[num_split_rows + 1]`: chunks of split row `s` are `chunk_indptr[s]..[s + 1]`.
    pub(super) chunk_indptr: Vec<u32>,
    /// `[num_chunks]`: visible-token range of each chunk, in tile order per row.
    pub(super) chunk_tokens: Vec<(u32, u32)>,
    /// Split rows of each block: `block_rows[b]..block_rows[b + 1]`.
    pub(super) block_rows: Vec<usize>,
    pub(super) num_kv_heads: usize,
    /// Instruction set of the split-KV chunk kernel.
    kernel: AttentionKernel,
    /// Chunks shared by decode rows of several requests ([`StepAttentionPlan::with_cascade`];
    /// empty: none).
    pub(super) cascade: CascadePlan,
}

/// Routes every query row of the batch (`qo_indptr [B + 1]` over the page table `kv`) by
/// `config`; see the module docs. Errors on a malformed `qo_indptr`, a request with more
/// queries than visible tokens, zero KV heads or a page table that breaks the pool. Split-KV
/// rows run the process-wide [`AttentionKernel::selected`] (see
/// [`StepAttentionPlan::with_kernel`]).
pub fn plan_step(
    kv: &PagedKv<'_>,
    qo_indptr: &[u32],
    num_q_heads: usize,
    config: &StepAttentionConfig,
) -> Result<StepAttentionPlan, AttentionError> {
    validate::paged_kv(kv, num_q_heads)?;
    if config.chunking.num_kv_heads != kv.layout.num_kv_heads {
        return Err(AttentionError::Plan(format!(
            "chunking made for {} KV heads, the pool has {}",
            config.chunking.num_kv_heads, kv.layout.num_kv_heads
        )));
    }
    let table = kv.page_table;
    let num_tokens = qo_indptr.last().copied().unwrap_or(0) as usize;
    validate::query_indptr(qo_indptr, &table.seq_lens, num_tokens)?;
    let elements_per_chunk = num_q_heads * kv.layout.head_dim;
    let mut plan = StepAttentionPlan {
        qo_indptr: qo_indptr.to_vec(),
        seq_lens: table.seq_lens.clone(),
        gather_segments: Vec::new(),
        split_rows: Vec::new(),
        chunk_indptr: vec![0],
        chunk_tokens: Vec::new(),
        block_rows: vec![0],
        num_kv_heads: kv.layout.num_kv_heads,
        kernel: AttentionKernel::selected(),
        cascade: CascadePlan::default(),
    };
    let mut block_chunks = 0usize;
    for request in 0..table.num_requests() {
        let first_row = qo_indptr[request] as usize;
        let q_len = qo_indptr[request + 1] as usize - first_row;
        let seq_len = table.seq_lens[request] as usize;
        let mut gather_rows = 0;
        for query in 0..q_len {
            let visible = seq_len - q_len + query + 1;
            if visible < config.min_split_kv_tokens {
                gather_rows += 1;
                continue;
            }
            let num_chunks = config.chunking.num_chunks(visible);
            let over_budget = (block_chunks + num_chunks) * elements_per_chunk > MAX_BLOCK_ELEMENTS;
            if over_budget && block_chunks > 0 {
                plan.block_rows.push(plan.split_rows.len());
                block_chunks = 0;
            }
            block_chunks += num_chunks;
            for index in 0..num_chunks {
                let tokens = config.chunking.chunk(visible, index);
                plan.chunk_tokens
                    .push((tokens.start as u32, tokens.end as u32));
            }
            plan.chunk_indptr.push(plan.chunk_tokens.len() as u32);
            plan.split_rows.push(SplitRow {
                request,
                row: first_row + query,
                seq_len: visible,
            });
        }
        if gather_rows > 0 {
            plan.gather_segments.push(GatherSegment {
                request,
                first_row,
                num_rows: gather_rows,
                seq_len: seq_len - q_len + gather_rows,
            });
        }
    }
    if *plan.block_rows.last().unwrap_or(&0) != plan.split_rows.len() {
        plan.block_rows.push(plan.split_rows.len());
    }
    Ok(plan)
}

impl StepAttentionPlan {
    /// The same plan with its split-KV rows run on `kernel` (a kernel the CPU lacks, or whose
    /// lanes do not divide `head_dim`, falls back as described in [`AttentionKernel`]).
    pub fn with_kernel(self, kernel: AttentionKernel) -> Self {
        Self { kernel, ..self }
    }

    /// The kernel the split-KV rows run on.
    pub fn kernel(&self) -> AttentionKernel {
        self.kernel
    }

    /// Requests `B`.
    pub fn num_requests(&self) -> usize {
        self.seq_lens.len()
    }

    /// Query rows served by split-KV.
    pub fn num_split_kv_rows(&self) -> usize {
        self.split_rows.len()
    }

    /// Query rows served by gather.
    pub fn num_gather_rows(&self) -> usize {
        self.gather_segments.iter().map(|s| s.num_rows).sum()
    }

    /// Split-KV chunks per layer (one partial state each).
    pub fn num_chunks(&self) -> usize {
        self.chunk_tokens.len()
    }

    /// Requests with at least one query row served by split-KV.
    pub fn split_kv_requests(&self) -> usize {
        let mut count = 0;
        let mut last = None;
        for row in &self.split_rows {
            if last != Some(row.request) {
                count += 1;
                last = Some(row.request);
            }
        }
        count
    }

    /// Requests all of whose query rows are served by gather (including requests with no
    /// rows); `split_kv_requests() + gather_requests() == num_requests()`.
    pub fn gather_requests(&self) -> usize {
        self.num_requests() - self.split_kv_requests()
    }

    /// [`AttentionPath::SplitKv`] when any row runs split-KV, else [`AttentionPath::Gather`].
    pub fn path(&self) -> AttentionPath {
        if self.split_rows.is_empty() {
            AttentionPath::Gather
        } else {
            AttentionPath::SplitKv
        }
    }

    /// Chunk ranges `chunk_indptr[first]..chunk_indptr[last]` of split rows `first..last`.
    fn chunk_range(&self, rows: std::ops::Range<usize>) -> std::ops::Range<usize> {
        self.chunk_indptr[rows.start] as usize..self.chunk_indptr[rows.end] as usize
    }
}

/// Scratch of [`step_attention`]: partial states and merged rows of one block of split-KV
/// rows, f32. Reused across layers and steps ([`StepWorkspace::fit`] only grows it).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepWorkspace {
    /// `[block_chunks, num_q_heads, head_dim]` normalized partial outputs.
    pub partial_v: Vec<f32>,
    /// `[block_chunks, num_q_heads]` partial LSEs (log2).
    pub lse: Vec<f32>,
    /// `[block_rows, num_q_heads, head_dim]` merged rows.
    pub merged_v: Vec<f32>,
    /// `[block_rows, num_q_heads]` merged LSEs (log2).
    pub merged_lse: Vec<f32>,
}

impl StepWorkspace {
    /// Sizes the buffers for the largest block of `plan` (allocations are reused).
    pub fn fit(&mut self, plan: &StepAttentionPlan, num_q_heads: usize, head_dim: usize) {
        let (mut chunks, mut rows) = (0, 0);
        for block in plan.block_rows.windows(2) {
            rows = rows.max(block[1] - block[0]);
            chunks = chunks.max(plan.chunk_range(block[0]..block[1]).len());
        }
        let grow = |buffer: &mut Vec<f32>, len: usize| {
            if buffer.len() < len {
                buffer.resize(len, 0.0);
            }
        };
        grow(&mut self.partial_v, chunks * num_q_heads * head_dim);
        grow(&mut self.lse, chunks * num_q_heads);
        grow(&mut self.merged_v, rows * num_q_heads * head_dim);
        grow(&mut self.merged_lse, rows * num_q_heads);
    }
}

/// Runs the step's attention as routed by `plan` and writes `out [T, num_q_heads, head_dim]`
/// (fully overwritten). `queries` must be the batch `plan` was made for (same `qo_indptr`,
/// same page table `seq_lens`); `workspace` is fitted here. Row `i`'s output depends only on
/// row `i`'s query, its visible K/V and the fixed configuration in `plan`.
pub fn step_attention(
    kv: &PagedKv<'_>,
    queries: &QueryBatch<'_>,
    plan: &StepAttentionPlan,
    scale: f32,
    workspace: &mut StepWorkspace,
    out: &mut [f32],
) -> Result<(), AttentionError> {
    let n_rep = validate::paged_kv(kv, queries.num_q_heads)?;
    let table = kv.page_table;
    if plan.qo_indptr != queries.qo_indptr
        || plan.seq_lens != table.seq_lens
        || plan.num_kv_heads != kv.layout.num_kv_heads
    {
        return Err(AttentionError::Plan(
            "the step plan was made for another batch (qo_indptr, seq_lens or KV heads differ)"
                .into(),
        ));
    }
    let (num_q_heads, head_dim) = (queries.num_q_heads, kv.layout.head_dim);
    let row_len = num_q_heads * head_dim;
    let num_tokens = plan.qo_indptr.last().copied().unwrap_or(0) as usize;
    validate::length(
        "q [T, num_q_heads, head_dim]",
        num_tokens * row_len,
        queries.q.len(),
    )?;
    validate::length(
        "out [T, num_q_heads, head_dim]",
        num_tokens * row_len,
        out.len(),
    )?;
    workspace.fit(plan, num_q_heads, head_dim);

    for (index, block) in plan.block_rows.windows(2).enumerate() {
        let rows = block[0]..block[1];
        split_block(kv, queries, plan, index, rows, scale, workspace, out)?;
    }

    // Gather segments: disjoint row ranges of `out`, in row order.
    let mut segments = Vec::with_capacity(plan.gather_segments.len());
    let mut rest = &mut out[..];
    let mut consumed = 0;
    for segment in &plan.gather_segments {
        let (_, tail) = rest.split_at_mut((segment.first_row - consumed) * row_len);
        let (rows, tail) = tail.split_at_mut(segment.num_rows * row_len);
        segments.push((segment, rows));
        rest = tail;
        consumed = segment.first_row + segment.num_rows;
    }
    segments.into_par_iter().for_each(|(segment, out_rows)| {
        let first = segment.first_row * row_len;
        let q_rows = &queries.q[first..first + out_rows.len()];
        attend_rows(
            kv,
            segment.request,
            segment.seq_len,
            n_rep,
            scale,
            q_rows,
            out_rows,
        );
    });
    Ok(())
}

/// Per-row partial states written by the parallel work items. Each `(partial, head)` pair
/// belongs to exactly one work item (the one of its row's group, its chunk and its head's KV
/// head), so the items write disjoint elements.
struct SharedPartials {
    v: *mut f32,
    lse: *mut f32,
}

// SAFETY: the work items write disjoint elements (see the type's docs) and the buffers
// outlive the parallel pass that uses them.
unsafe impl Sync for SharedPartials {}

/// One work item of [`split_block`], for one KV head.
enum Item {
    /// Consecutive split rows of one request against their chunk `chunk`.
    Rows(std::ops::Range<usize>, usize),
    /// A cascade item: shared chunk `index` of the block (every member's heads).
    Shared(usize),
}

/// Split-KV rows `rows` (block `block`) of `plan`: the partial pass, the per-row merge in
/// chunk order, then a copy of each merged row into `out`. A work item is one `(group of
/// rows, chunk, kv_head)`: up to `MAX_ITEM_HEADS / n_rep` consecutive rows of one request
/// (prefill rows) against their shared chunk, each row's heads of that KV head ending at the
/// row's own visible end; or one cascade item, the decode rows of several requests against
/// a chunk of their shared pages.
#[allow(clippy::too_many_arguments)]
fn split_block(
    kv: &PagedKv<'_>,
    queries: &QueryBatch<'_>,
    plan: &StepAttentionPlan,
    block: usize,
    rows: std::ops::Range<usize>,
    scale: f32,
    workspace: &mut StepWorkspace,
    out: &mut [f32],
) -> Result<(), AttentionError> {
    let (num_q_heads, head_dim) = (queries.num_q_heads, kv.layout.head_dim);
    let num_kv_heads = kv.layout.num_kv_heads;
    let n_rep = num_q_heads / num_kv_heads;
    let row_len = num_q_heads * head_dim;
    let chunks = plan.chunk_range(rows.clone());
    let num_rows = rows.len();
    let partial_v = &mut workspace.partial_v[..chunks.len() * row_len];
    let lse = &mut workspace.lse[..chunks.len() * num_q_heads];

    // Groups of consecutive split rows of one request, then one item per (group, chunk,
    // KV head); a group's last row has the most chunks.
    let group_rows = (MAX_ITEM_HEADS / n_rep.max(1)).max(1);
    let mut items = Vec::new();
    let mut first = rows.start;
    while first < rows.end {
        let request = plan.split_rows[first].request;
        let mut last = first + 1;
        while last < rows.end
            && last - first < group_rows
            && plan.split_rows[last].request == request
        {
            last += 1;
        }
        let last_chunks = plan.chunk_range(last - 1..last);
        for chunk in 0..last_chunks.len() {
            // A cascade item computes it (only decode rows, groups of one row, are shared).
            if plan.cascade.is_shared(last_chunks.start + chunk) {
                continue;
            }
            items
                .extend((0..num_kv_heads).map(|kv_head| (Item::Rows(first..last, chunk), kv_head)));
        }
        first = last;
    }
    let shared = plan.cascade.block(block);
    for index in 0..shared.len() {
        items.extend((0..num_kv_heads).map(|kv_head| (Item::Shared(index), kv_head)));
    }

    let partials = SharedPartials {
        v: partial_v.as_mut_ptr(),
        lse: lse.as_mut_ptr(),
    };
    items.par_iter().for_each(|(item, kv_head)| {
        let kv_head = *kv_head;
        let partials = &partials;
        let rows: Vec<usize>;
        let (members, chunk, request) = match item {
            Item::Rows(group, chunk) => {
                rows = group.clone().collect();
                (&rows[..], *chunk, None)
            }
            Item::Shared(index) => {
                let shared = &shared[*index];
                (&shared.members[..], shared.chunk, Some(shared.request))
            }
        };
        let mut tasks: Vec<HeadTask<'_>> = Vec::with_capacity(members.len() * n_rep);
        let mut start = 0;
        for &split in members {
            let row_chunks = plan.chunk_range(split..split + 1);
            if chunk >= row_chunks.len() {
                continue;
            }
            let (begin, end) = plan.chunk_tokens[row_chunks.start + chunk];
            start = begin as usize;
            let partial = row_chunks.start + chunk - chunks.start;
            let row = plan.split_rows[split].row;
            for head in kv_head * n_rep..(kv_head + 1) * n_rep {
                let query = &queries.q[(row * num_q_heads + head) * head_dim..][..head_dim];
                let state = partial * num_q_heads + head;
                // SAFETY: `state` is inside the block's partials (`partial < chunks.len()`,
                // `head < num_q_heads`), and only this item writes it (see SharedPartials).
                let (v, lse) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(partials.v.add(state * head_dim), head_dim),
                        &mut *partials.lse.add(state),
                    )
                };
                tasks.push(HeadTask {
                    query,
                    end: end as usize,
                    v,
                    lse,
                });
            }
        }
        let request = request.unwrap_or(plan.split_rows[members[0]].request);
        kernel::attend_heads(plan.kernel, kv, request, kv_head, start, scale, &mut tasks);
    });
    let o_indptr: Vec<u32> = plan.chunk_indptr[rows.start..=rows.end]
        .iter()
        .map(|&c| c - chunks.start as u32)
        .collect();
    let merged_v = &mut workspace.merged_v[..num_rows * row_len];
    let merged_lse = &mut workspace.merged_lse[..num_rows * num_q_heads];
    merge_states_into(
        partial_v,
        lse,
        &o_indptr,
        num_q_heads,
        head_dim,
        merged_v,
        merged_lse,
    )?;
    for (split_row, merged) in plan.split_rows[rows].iter().zip(merged_v.chunks(row_len)) {
        out[split_row.row * row_len..(split_row.row + 1) * row_len].copy_from_slice(merged);
    }
    Ok(())
}
