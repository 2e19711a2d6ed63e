//! The split-KV decode plan: pure host data, computed once per step from page counts and
//! reused by every layer.
//!
//! Each request's emitted pages are cut into chunks of `pages_per_chunk` pages; one work
//! item is one `(chunk, kv_head)` pair. The chunk size is the largest one whose work-item
//! count still reaches the target parallelism (fewest chunks among those that saturate the
//! machine = least merge work).
//!
//! NOT batch-invariant: the chunk size is chosen from the whole batch's page counts, so a
//! request's split (and hence its floating-point summation order) changes with its
//! neighbours. The model runs [`plan_step`](super::plan_step) instead, which chunks every row
//! by its own page count ([`SplitKvChunking`](super::SplitKvChunking)); this plan remains for
//! the GPU flash-decoding twin and the kernel tests.

use super::AttentionError;

/// Most chunks a plan may have (CUDA's `gridDim.z` limit, enforced on every backend so the
/// CPU and GPU plans agree).
pub const MAX_CHUNKS: usize = 65535;

/// Inputs of [`plan_decode`] besides the page counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodePlanConfig {
    /// KV heads of the model (work items per chunk).
    pub num_kv_heads: usize,
    /// Work items (`num_chunks * num_kv_heads`) wanted to fill the machine, e.g. a few per
    /// CPU thread or per GPU SM.
    pub target_work_items: usize,
    /// Pins the pages per chunk (autotuner or test override); `None` = search.
    pub pages_per_chunk: Option<usize>,
    /// Upper bound on chunks ([`MAX_CHUNKS`] by default).
    pub max_chunks: usize,
}

impl DecodePlanConfig {
    /// Searched chunk size, [`MAX_CHUNKS`] cap.
    pub fn new(num_kv_heads: usize, target_work_items: usize) -> Self {
        Self {
            num_kv_heads,
            target_work_items,
            pages_per_chunk: None,
            max_chunks: MAX_CHUNKS,
        }
    }

    /// The same config with pages per chunk pinned to `pages_per_chunk`.
    pub fn with_pages_per_chunk(self, pages_per_chunk: usize) -> Self {
        Self {
            pages_per_chunk: Some(pages_per_chunk),
            ..self
        }
    }
}

/// How a decode batch is split into chunks. Chunks are in request order; request `r` owns
/// chunks `o_indptr[r]..o_indptr[r + 1]` (at least one, even with no pages: its partial is
/// `-inf` and merges to zeros). Chunk `c` covers pages
/// `[kv_tile_indices[c] * pages_per_chunk, (kv_tile_indices[c] + 1) * pages_per_chunk)` of
/// request `request_indices[c]`'s page slice, clamped to its page count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodePlan {
    /// Pages per chunk, >= 1.
    pub pages_per_chunk: usize,
    /// KV heads the plan was made for.
    pub num_kv_heads: usize,
    /// `[num_chunks]`: the request of each chunk.
    pub request_indices: Vec<u32>,
    /// `[num_chunks]`: the chunk's tile index within its request.
    pub kv_tile_indices: Vec<u32>,
    /// `[B + 1]`: merge groups, chunk ranges per request.
    pub o_indptr: Vec<u32>,
    /// False when every request has exactly one chunk: the partial output already is the
    /// final `[B, num_q_heads, head_dim]` output and the merge is skipped.
    pub needs_merge: bool,
}

fn chunks_of(num_pages: u32, pages_per_chunk: usize) -> usize {
    (num_pages as usize).div_ceil(pages_per_chunk).max(1)
}

fn count_chunks(page_counts: &[u32], pages_per_chunk: usize) -> usize {
    page_counts
        .iter()
        .map(|&pages| chunks_of(pages, pages_per_chunk))
        .sum()
}

/// Largest value in `[low, high]` where `predicate` holds, for a predicate that is true up
/// to some point and false after; `None` if it fails at `low`.
fn largest_true(low: usize, high: usize, predicate: impl Fn(usize) -> bool) -> Option<usize> {
    if !predicate(low) {
        return None;
    }
    let (mut good, mut bad) = (low, high + 1);
    while bad - good > 1 {
        let middle = good + (bad - good) / 2;
        if predicate(middle) {
            good = middle;
        } else {
            bad = middle;
        }
    }
    Some(good)
}

/// Plans split-KV decode for requests with `page_counts [B]` emitted pages each (see
/// `PageTable::page_counts`).
///
/// Without an override: the lower bound is the smallest chunk size keeping
/// `num_chunks <= max_chunks`, the upper bound the largest page count; binary search picks
/// the largest chunk size whose `num_chunks * num_kv_heads >= target_work_items`, or the
/// lower bound when none reaches the target. Errors on zero KV heads, a zero override, or
/// more chunks than `max_chunks` (including a batch larger than it).
pub fn plan_decode(
    page_counts: &[u32],
    config: &DecodePlanConfig,
) -> Result<DecodePlan, AttentionError> {
    if config.num_kv_heads == 0 {
        return Err(AttentionError::Geometry("num_kv_heads must be >= 1".into()));
    }
    let max_pages = page_counts.iter().copied().max().unwrap_or(0).max(1) as usize;
    let too_many = |pages_per_chunk: usize| {
        AttentionError::Plan(format!(
            "{} chunks at {pages_per_chunk} pages per chunk exceed max_chunks {}",
            count_chunks(page_counts, pages_per_chunk),
            config.max_chunks
        ))
    };
    let pages_per_chunk = match config.pages_per_chunk {
        Some(0) => return Err(AttentionError::Plan("pages_per_chunk override is 0".into())),
        Some(pinned) if count_chunks(page_counts, pinned) > config.max_chunks => {
            return Err(too_many(pinned))
        }
        Some(pinned) => pinned,
        None => {
            if count_chunks(page_counts, max_pages) > config.max_chunks {
                return Err(too_many(max_pages));
            }
            // Chunk counts fall as the chunk size grows: find the smallest size within the
            // cap, then the largest size that still reaches the target.
            let within_cap = |size: usize| count_chunks(page_counts, size) <= config.max_chunks;
            let lower = 1 + largest_true(1, max_pages, |size| !within_cap(size)).unwrap_or(0);
            let reaches_target = |size: usize| {
                count_chunks(page_counts, size) * config.num_kv_heads >= config.target_work_items
            };
            largest_true(lower, max_pages, reaches_target).unwrap_or(lower)
        }
    };
    let mut plan = DecodePlan {
        pages_per_chunk,
        num_kv_heads: config.num_kv_heads,
        request_indices: Vec::new(),
        kv_tile_indices: Vec::new(),
        o_indptr: vec![0],
        needs_merge: false,
    };
    for (request, &pages) in page_counts.iter().enumerate() {
        for tile in 0..chunks_of(pages, pages_per_chunk) {
            plan.request_indices.push(request as u32);
            plan.kv_tile_indices.push(tile as u32);
        }
        plan.o_indptr.push(plan.request_indices.len() as u32);
    }
    plan.needs_merge = plan.num_chunks() != page_counts.len();
    Ok(plan)
}

impl DecodePlan {
    /// Chunks (partial rows) in the plan.
    pub fn num_chunks(&self) -> usize {
        self.request_indices.len()
    }

    /// Requests `B`.
    pub fn num_requests(&self) -> usize {
        self.o_indptr.len().saturating_sub(1)
    }

    /// Parallel work items: `num_chunks * num_kv_heads`.
    pub fn num_work_items(&self) -> usize {
        self.num_chunks() * self.num_kv_heads
    }

    /// Workspace element counts `(partial_v, lse)`: `[num_chunks, num_q_heads, head_dim]`
    /// and `[num_chunks, num_q_heads]` f32.
    pub fn workspace_len(&self, num_q_heads: usize, head_dim: usize) -> (usize, usize) {
        let rows = self.num_chunks() * num_q_heads;
        (rows * head_dim, rows)
    }

    /// Workspace bytes, known before running: `(partial_v + lse elements) * 4`.
    pub fn workspace_bytes(&self, num_q_heads: usize, head_dim: usize) -> usize {
        let (partial, lse) = self.workspace_len(num_q_heads, head_dim);
        (partial + lse) * std::mem::size_of::<f32>()
    }

    /// Whether the plan can be reused for requests with `page_counts`: same batch size and
    /// the same chunk count per request.
    pub fn matches(&self, page_counts: &[u32]) -> bool {
        page_counts.len() == self.num_requests()
            && page_counts.iter().enumerate().all(|(request, &pages)| {
                let chunks = (self.o_indptr[request + 1] - self.o_indptr[request]) as usize;
                self.pages_per_chunk > 0 && chunks == chunks_of(pages, self.pages_per_chunk)
            })
    }

    /// Checks the plan is internally consistent and fits `page_counts` and
    /// `num_kv_heads`; errors name the first mismatch.
    pub fn validate(&self, page_counts: &[u32], num_kv_heads: usize) -> Result<(), AttentionError> {
        let fail = |reason: String| Err(AttentionError::Plan(reason));
        if self.num_kv_heads != num_kv_heads {
            return fail(format!(
                "made for {} KV heads, the pool has {num_kv_heads}",
                self.num_kv_heads
            ));
        }
        if self.o_indptr.first() != Some(&0) || !self.matches(page_counts) {
            return fail(format!(
                "chunk groups {:?} (pages_per_chunk {}) do not fit page counts {:?}",
                self.o_indptr, self.pages_per_chunk, page_counts
            ));
        }
        let num_chunks = self.o_indptr[page_counts.len()] as usize;
        if self.request_indices.len() != num_chunks || self.kv_tile_indices.len() != num_chunks {
            return fail(format!(
                "request_indices ({}) and kv_tile_indices ({}) must both have {num_chunks} entries",
                self.request_indices.len(),
                self.kv_tile_indices.len()
            ));
        }
        for request in 0..page_counts.len() {
            let first = self.o_indptr[request] as usize;
            for chunk in first..self.o_indptr[request + 1] as usize {
                if self.request_indices[chunk] as usize != request
                    || self.kv_tile_indices[chunk] as usize != chunk - first
                {
                    return fail(format!(
                        "chunk {chunk} is not tile {} of request {request}",
                        chunk - first
                    ));
                }
            }
        }
        if self.needs_merge != (num_chunks != page_counts.len()) {
            return fail("needs_merge disagrees with the chunk count".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_picks_largest_chunk_reaching_target() {
        // One request of 100 pages, 2 KV heads, target 16 work items -> 8 chunks needed:
        // ceil(100 / 13) = 8 and ceil(100 / 14) = 8 and ceil(100 / 15) = 7 -> 14.
        let plan = plan_decode(&[100], &DecodePlanConfig::new(2, 16)).unwrap();
        assert_eq!(plan.pages_per_chunk, 14);
        assert_eq!(plan.num_chunks(), 8);
        assert!(plan.needs_merge);
        assert_eq!(plan.o_indptr, vec![0, 8]);
        assert_eq!(plan.kv_tile_indices, (0..8).collect::<Vec<u32>>());
        plan.validate(&[100], 2).unwrap();
    }

    #[test]
    fn unreachable_target_uses_smallest_chunk_and_every_request_gets_a_chunk() {
        let plan = plan_decode(&[2, 0, 1], &DecodePlanConfig::new(1, 1000)).unwrap();
        assert_eq!(plan.pages_per_chunk, 1);
        assert_eq!(plan.o_indptr, vec![0, 2, 3, 4]);
        assert_eq!(plan.request_indices, vec![0, 0, 1, 2]);
    }

    #[test]
    fn saturated_batch_skips_the_merge() {
        let plan = plan_decode(&[5, 9, 3], &DecodePlanConfig::new(4, 8)).unwrap();
        assert_eq!(plan.pages_per_chunk, 9);
        assert!(!plan.needs_merge);
        assert_eq!(plan.workspace_len(8, 64), (3 * 8 * 64, 3 * 8));
        assert_eq!(plan.workspace_bytes(8, 64), (3 * 8 * 64 + 3 * 8) * 4);
    }

    #[test]
    fn cap_and_override_are_enforced() {
        let capped = DecodePlanConfig {
            max_chunks: 10,
            ..DecodePlanConfig::new(1, 1000)
        };
        let plan = plan_decode(&[40], &capped).unwrap();
        assert_eq!(plan.pages_per_chunk, 4);
        assert!(plan_decode(&[0; 11], &capped).is_err());
        assert!(plan_decode(&[40], &capped.with_pages_per_chunk(3)).is_err());
        assert!(plan_decode(&[40], &capped.with_pages_per_chunk(0)).is_err());
        let pinned =
            plan_decode(&[40], &DecodePlanConfig::new(1, 1).with_pages_per_chunk(7)).unwrap();
        assert_eq!(pinned.num_chunks(), 6);
    }

    #[test]
    fn reuse_and_validation() {
        let plan = plan_decode(
            &[10, 3],
            &DecodePlanConfig::new(2, 1).with_pages_per_chunk(4),
        )
        .unwrap();
        assert!(plan.matches(&[12, 4]));
        assert!(!plan.matches(&[13, 4]));
        assert!(plan.validate(&[10, 3], 3).is_err());
        let mut broken = plan.clone();
        broken.kv_tile_indices[1] = 0;
        assert!(broken.validate(&[10, 3], 2).is_err());
        let mut broken = plan;
        broken.needs_merge = false;
        assert!(broken.validate(&[10, 3], 2).is_err());
    }
}
