//! The host half of the device Quest selection ([`super::sparse`]): which requests of a step
//! are shortened and how many pages each keeps. The count never depends on the scores (the
//! middle pages all hold `page_size` tokens, so the budget admits the same number whichever
//! they are), so the selected table's row pointer, lengths and offsets are known on the host
//! before the device scores a page; the device writes only the page ids.

use crate::attention::{RequestPages, SparseAttention, SparseStepStats};
use pagoda_cuda::CudaError;
use pagoda_kv::PageTable;

/// Most pages of one shortened request the device selection handles (128K tokens at page
/// 16); [`SparseSelectPlan::new`] leaves a longer request dense.
pub const SPARSE_MAX_PAGES: usize = 8192;

/// Words per request in [`SparseSelectPlan::requests`].
pub const SPARSE_REQUEST_WORDS: usize = 4;

/// `requests[4r]` of a request the selection leaves dense.
pub const SPARSE_DENSE: u32 = u32::MAX;

/// A step's selection as far as the host knows it: the selected table without its page ids,
/// and per request what the device must do.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SparseSelectPlan {
    /// `[B + 1]`: the selected table's row pointer.
    pub indptr: Vec<u32>,
    /// `[B]`: unchanged from the full table (the last page is always kept).
    pub last_page_len: Vec<u32>,
    /// `[B]`: unchanged from the full table (page 0 is always kept).
    pub first_page_offset: Vec<u32>,
    /// `[B]`: visible tokens of the selected pages.
    pub seq_lens: Vec<u32>,
    /// `[B * 4]`: per request its query row ([`SPARSE_DENSE`] keeps every page), the first
    /// window position, the number of middle pages kept, and 0.
    pub requests: Vec<u32>,
    /// What the selection does to the step (the selector's counters).
    pub stats: SparseStepStats,
    /// Pages of the longest shortened request (0 when none is).
    pub max_sparse_pages: usize,
    /// Requests that asked to be shortened but hold more pages than the selection handles
    /// (`max_pages` of [`SparseSelectPlan::new`]): they decode densely.
    pub dense_past_limit: usize,
}

/// The window start and the middle pages kept of one shortened request, as
/// [`select_pages`](crate::attention::select_pages) chooses them.
fn quest_counts(pages: &RequestPages, params: &SparseAttention) -> (usize, usize) {
    let (window_start, fixed) = crate::attention::cpu::sparse::window_of(pages, params);
    let middle = window_start.saturating_sub(1);
    let room = params.budget.saturating_sub(fixed);
    (window_start, middle.min(room / pages.page_size))
}

impl SparseSelectPlan {
    /// The plan for the first `B` requests of `table` (the step's full host table; a mixed
    /// step's decode rows lead it), `qo_indptr` (`[B + 1]`, query rows per request) and
    /// `params` (`[B]`, or empty: every request dense). A request is shortened exactly where
    /// [`QuestSelector`](crate::attention::QuestSelector) shortens it: one query row, at least
    /// `min_context` visible tokens and more than `budget`; and at most `max_pages` pages
    /// (the selection's workspace, at most [`SPARSE_MAX_PAGES`]; a longer one decodes densely
    /// and is counted in [`Self::dense_past_limit`]).
    pub fn new(
        table: &PageTable,
        qo_indptr: &[u32],
        params: &[Option<SparseAttention>],
        page_size: usize,
        max_pages: usize,
    ) -> Result<SparseSelectPlan, CudaError> {
        let num_requests = qo_indptr.len().saturating_sub(1);
        if qo_indptr.is_empty() || table.num_requests() < num_requests {
            return Err(CudaError::invalid(format!(
                "sparse select: qo_indptr of {} entries for a table of {} requests",
                qo_indptr.len(),
                table.num_requests()
            )));
        }
        let max_pages = max_pages.min(SPARSE_MAX_PAGES);
        if !params.is_empty() && params.len() != num_requests {
            return Err(CudaError::invalid(format!(
                "sparse select: {} settings for {num_requests} requests",
                params.len()
            )));
        }
        if page_size == 0 {
            return Err(CudaError::invalid("sparse select: page_size must be >= 1"));
        }
        let mut plan = SparseSelectPlan {
            indptr: vec![0],
            last_page_len: table.last_page_len[..num_requests].to_vec(),
            first_page_offset: table.first_page_offset[..num_requests].to_vec(),
            seq_lens: table.seq_lens[..num_requests].to_vec(),
            ..SparseSelectPlan::default()
        };
        let mut total = 0usize;
        for request in 0..num_requests {
            let num_pages = table.num_pages_of(request);
            let queries = qo_indptr[request + 1].saturating_sub(qo_indptr[request]);
            let seq_len = table.seq_lens[request] as usize;
            let mut settings = params.get(request).copied().flatten().filter(|p| {
                queries == 1 && seq_len >= p.min_context && seq_len > p.budget && num_pages > 0
            });
            if settings.is_some() && num_pages > max_pages {
                settings = None;
                plan.dense_past_limit += 1;
            }
            let mut words = [SPARSE_DENSE, 0, 0, 0];
            let kept = match settings {
                Some(settings) => {
                    let pages = RequestPages {
                        num_pages,
                        page_size,
                        first_page_offset: table.first_page_offset[request] as usize,
                        last_page_len: table.last_page_len[request] as usize,
                    };
                    let (window_start, keep) = quest_counts(&pages, &settings);
                    let head = usize::from(window_start > 0);
                    let kept = head + keep + (num_pages - window_start);
                    let window: usize = (window_start..num_pages)
                        .map(|i| pages.page_tokens(i))
                        .sum();
                    let sink = if head == 1 { pages.page_tokens(0) } else { 0 };
                    plan.seq_lens[request] = (sink + keep * page_size + window) as u32;
                    words = [qo_indptr[request], window_start as u32, keep as u32, 0];
                    plan.stats.sparse_requests += 1;
                    plan.stats.pages_scanned += num_pages as u64;
                    plan.stats.pages_kept += kept as u64;
                    plan.max_sparse_pages = plan.max_sparse_pages.max(num_pages);
                    kept
                }
                None => num_pages,
            };
            plan.requests.extend_from_slice(&words);
            total += kept;
            plan.indptr.push(
                u32::try_from(total).map_err(|_| {
                    CudaError::invalid("sparse select: more than 2^32 selected pages")
                })?,
            );
        }
        Ok(plan)
    }

    /// Pads the plan to `rows` requests with empty dense ones (a graph bucket's padding
    /// rows, which hold no pages).
    pub fn pad_to(&mut self, rows: usize) {
        let total = self.selected_pages() as u32;
        while self.num_requests() < rows {
            self.indptr.push(total);
            self.last_page_len.push(0);
            self.first_page_offset.push(0);
            self.seq_lens.push(0);
            self.requests.extend_from_slice(&[SPARSE_DENSE, 0, 0, 0]);
        }
    }

    /// Requests `B`.
    pub fn num_requests(&self) -> usize {
        self.indptr.len() - 1
    }

    /// Page ids the selected table holds.
    pub fn selected_pages(&self) -> usize {
        *self.indptr.last().unwrap_or(&0) as usize
    }

    /// The selected host table with `indices` (read back from the device) and `full`'s
    /// `rope_offsets` of the plan's requests.
    pub fn table(&self, full: &PageTable, indices: Vec<u32>) -> PageTable {
        PageTable {
            indices,
            indptr: self.indptr.clone(),
            last_page_len: self.last_page_len.clone(),
            first_page_offset: self.first_page_offset.clone(),
            seq_lens: self.seq_lens.clone(),
            rope_offsets: full
                .rope_offsets
                .get(..self.num_requests())
                .map_or_else(Vec::new, <[u32]>::to_vec),
        }
    }
}
