//! The split-KV plan of the fused paged decode: pure host code (tested on the CPU).
//!
//! A request's pages are cut into chunks of `pages_per_chunk` pages; one CTA serves one
//! (chunk, KV head) pair. The plan picks the largest chunk size whose CTA count still reaches
//! a target (enough CTAs to fill the GPU), so that the work is spread over the SMs with the
//! fewest partial results to merge. Every request owns at least one chunk (an empty request
//! gets one empty chunk, which writes zeros), and the number of chunks never exceeds a fixed
//! capacity, so a CUDA graph captured with a grid of `max_chunks` CTAs replays any plan of
//! the same capacity.
//!
//! The plan is uploaded as one `u32` array ([`PagedDecodePlan::encode`]) whose layout the
//! kernel reads: `[num_chunks, pages_per_chunk, num_requests, flags]`, then
//! `request_indices [max_chunks]`, `kv_tile_indices [max_chunks]` and
//! `o_indptr [max_requests + 1]` (request `r` owns chunks `o_indptr[r] .. o_indptr[r + 1]`).

use pagoda_cuda::CudaError;

/// Words before the per-chunk arrays in the encoded plan.
pub const PLAN_HEADER_WORDS: usize = 4;

/// The fixed sizes a plan is encoded for (a CUDA graph bucket's capacity).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PlanCapacity {
    /// Most chunks (the partial kernel's grid width).
    pub max_chunks: usize,
    /// Most requests.
    pub max_requests: usize,
}

impl PlanCapacity {
    /// The capacity for batches of up to `max_requests` requests aiming at `target_ctas` CTAs
    /// over `num_kv_heads` heads: room for one chunk per request plus the target's chunks,
    /// which bounds every plan [`PagedDecodePlan::new`] makes for such a batch (the search
    /// stops at the largest chunk reaching the target: `sum ceil(p / c) <= B + sum p / c`).
    pub fn for_batch(max_requests: usize, num_kv_heads: usize, target_ctas: usize) -> Self {
        let target_chunks = target_ctas.div_ceil(num_kv_heads.max(1));
        PlanCapacity {
            max_chunks: (max_requests.max(1) + 2 * target_chunks).min(MAX_CHUNKS),
            max_requests: max_requests.max(1),
        }
    }

    /// Length of the encoded plan in `u32` words.
    pub fn encoded_len(&self) -> usize {
        PLAN_HEADER_WORDS + 2 * self.max_chunks + self.max_requests + 1
    }

    /// Offset of `o_indptr` in the encoded plan.
    pub fn o_indptr_offset(&self) -> usize {
        PLAN_HEADER_WORDS + 2 * self.max_chunks
    }
}

/// The request index of a reserved chunk: a slot of the partials that another kernel fills
/// (cascade's shared level), which the partial kernel skips (`load_chunk` exits on a request
/// index past the batch) and the merge combines like any other.
pub const RESERVED_CHUNK: u32 = u32::MAX;

/// Most chunks of one launch (CUDA's grid x limit is far larger; this bounds the workspace).
pub const MAX_CHUNKS: usize = 1 << 16;

/// How the chunk size is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanPolicy {
    /// CTAs to aim for (e.g. a multiple of the SM count).
    pub target_ctas: usize,
    /// A fixed chunk size in pages (the autotuner hook and the forced-merge test mode:
    /// `Some(1)` gives one chunk per page); `None` searches.
    pub pages_per_chunk: Option<usize>,
    /// The smallest chunk the search may choose, in pages (e.g. one kernel tile of keys:
    /// smaller chunks only add merge work). At least 1.
    pub min_pages_per_chunk: usize,
    /// CTAs the GPU holds at once (SMs x the kernel's CTAs per SM). When set, the search
    /// minimises the estimated time instead of reaching `target_ctas`: the waves of CTAs
    /// (`ceil(CTAs / resident)`) times the pages of a chunk plus `min_pages_per_chunk` (a
    /// chunk's fixed cost: its pipeline's fill and its partial), so a plan never spills a
    /// few CTAs into a second wave; ties go to the larger chunk (fewer merges).
    /// `target_ctas` then only sizes the capacity.
    pub resident_ctas: Option<usize>,
}

/// The split of one batch: which chunk serves which pages of which request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PagedDecodePlan {
    /// Pages per chunk (`>= 1`).
    pub pages_per_chunk: usize,
    /// Request of each chunk.
    pub request_indices: Vec<u32>,
    /// Chunk index within its request (the chunk covers pages
    /// `tile * pages_per_chunk .. (tile + 1) * pages_per_chunk` of the request).
    pub kv_tile_indices: Vec<u32>,
    /// `[B + 1]`: request `r` owns chunks `o_indptr[r] .. o_indptr[r + 1]`.
    pub o_indptr: Vec<u32>,
}

/// Chunks of a request of `pages` pages at `pages_per_chunk` (an empty request has one).
fn chunks_of(pages: usize, pages_per_chunk: usize) -> usize {
    pages.div_ceil(pages_per_chunk).max(1)
}

impl PagedDecodePlan {
    /// Plans a batch whose page table has the CSR row pointer `indptr` (`[B + 1]`, request
    /// `r` owns `indptr[r + 1] - indptr[r]` pages) over `num_kv_heads` KV heads, within
    /// `capacity`. Errors on a malformed `indptr`, a batch over the capacity, or a fixed
    /// chunk size whose chunks do not fit.
    pub fn new(
        indptr: &[u32],
        num_kv_heads: usize,
        policy: PlanPolicy,
        capacity: PlanCapacity,
    ) -> Result<Self, CudaError> {
        let pages = page_counts(indptr)?;
        let num_requests = pages.len();
        if num_requests > capacity.max_requests {
            return Err(CudaError::invalid(format!(
                "decode plan: {num_requests} requests exceed the capacity of {}",
                capacity.max_requests
            )));
        }
        let total = |ppc: usize| pages.iter().map(|&p| chunks_of(p, ppc)).sum::<usize>();
        let largest = pages.iter().copied().max().unwrap_or(0).max(1);
        let pages_per_chunk = match policy.pages_per_chunk {
            Some(0) => {
                return Err(CudaError::invalid(
                    "decode plan: pages_per_chunk must be >= 1",
                ))
            }
            Some(fixed) => fixed,
            None => {
                // Smallest chunk size that fits the capacity: `total` is non-increasing in
                // the chunk size, and at `largest` every request has one chunk.
                let (mut low, mut high) = (1, largest);
                while low < high {
                    let mid = low + (high - low) / 2;
                    if total(mid) <= capacity.max_chunks {
                        high = mid;
                    } else {
                        low = mid + 1;
                    }
                }
                let floor = low.max(policy.min_pages_per_chunk.clamp(1, largest));
                match policy.resident_ctas {
                    Some(resident) => fitted_chunk(
                        &total,
                        largest,
                        floor,
                        num_kv_heads.max(1),
                        resident.max(1),
                        policy.min_pages_per_chunk.max(1),
                    ),
                    None => {
                        // Largest chunk size in floor..=largest still reaching the target.
                        let reaches =
                            |ppc: usize| total(ppc) * num_kv_heads.max(1) >= policy.target_ctas;
                        if !reaches(floor) {
                            floor
                        } else {
                            let (mut low, mut high) = (floor, largest);
                            while low < high {
                                let mid = low + (high - low).div_ceil(2);
                                if reaches(mid) {
                                    low = mid;
                                } else {
                                    high = mid - 1;
                                }
                            }
                            low
                        }
                    }
                }
            }
        };
        let num_chunks = total(pages_per_chunk);
        if num_chunks > capacity.max_chunks {
            return Err(CudaError::invalid(format!(
                "decode plan: {num_chunks} chunks of {pages_per_chunk} pages exceed the \
                 capacity of {} (use a larger chunk)",
                capacity.max_chunks
            )));
        }
        let mut plan = PagedDecodePlan {
            pages_per_chunk,
            request_indices: Vec::with_capacity(num_chunks),
            kv_tile_indices: Vec::with_capacity(num_chunks),
            o_indptr: Vec::with_capacity(num_requests + 1),
        };
        plan.o_indptr.push(0);
        for (request, &count) in pages.iter().enumerate() {
            for tile in 0..chunks_of(count, pages_per_chunk) {
                plan.request_indices.push(request as u32);
                plan.kv_tile_indices.push(tile as u32);
            }
            plan.o_indptr.push(plan.request_indices.len() as u32);
        }
        Ok(plan)
    }

    /// The same plan with `reserved[r]` [`RESERVED_CHUNK`] slots before request `r`'s
    /// chunks (`reserved` has one count per request). Errors past [`MAX_CHUNKS`].
    pub fn with_reserved(self, reserved: &[usize]) -> Result<Self, CudaError> {
        if reserved.len() != self.num_requests() {
            return Err(CudaError::invalid(format!(
                "decode plan: {} reserved counts for {} requests",
                reserved.len(),
                self.num_requests()
            )));
        }
        let total = self.num_chunks() + reserved.iter().sum::<usize>();
        if total > MAX_CHUNKS {
            return Err(CudaError::invalid(format!(
                "decode plan: {total} chunks with the reserved slots exceed {MAX_CHUNKS}"
            )));
        }
        let mut plan = PagedDecodePlan {
            pages_per_chunk: self.pages_per_chunk,
            request_indices: Vec::with_capacity(total),
            kv_tile_indices: Vec::with_capacity(total),
            o_indptr: vec![0],
        };
        for (request, &count) in reserved.iter().enumerate() {
            plan.request_indices
                .extend(std::iter::repeat_n(RESERVED_CHUNK, count));
            plan.kv_tile_indices.extend(std::iter::repeat_n(0, count));
            let own = self.o_indptr[request] as usize..self.o_indptr[request + 1] as usize;
            plan.request_indices
                .extend_from_slice(&self.request_indices[own.clone()]);
            plan.kv_tile_indices
                .extend_from_slice(&self.kv_tile_indices[own]);
            plan.o_indptr.push(plan.request_indices.len() as u32);
        }
        Ok(plan)
    }

    /// Chunks in the plan.
    pub fn num_chunks(&self) -> usize {
        self.request_indices.len()
    }

    /// Requests in the plan.
    pub fn num_requests(&self) -> usize {
        self.o_indptr.len() - 1
    }

    /// CTAs of the partial kernel for `num_kv_heads` heads (chunks beyond the plan exit).
    pub fn ctas(&self, num_kv_heads: usize) -> usize {
        self.num_chunks() * num_kv_heads
    }

    /// Whether some request has more than one chunk (otherwise every chunk writes its
    /// request's output directly and no merge is needed).
    pub fn needs_merge(&self) -> bool {
        self.num_chunks() > self.num_requests()
    }

    /// The plan as the kernel reads it, padded to `capacity` (see the module docs). Rows
    /// beyond the plan's requests get empty chunk ranges.
    pub fn encode(&self, capacity: PlanCapacity) -> Result<Vec<u32>, CudaError> {
        let mut words = vec![0u32; capacity.encoded_len()];
        self.encode_into(capacity, &mut words)?;
        Ok(words)
    }

    /// [`Self::encode`] into `words` (exactly `capacity.encoded_len()` long).
    pub fn encode_into(&self, capacity: PlanCapacity, words: &mut [u32]) -> Result<(), CudaError> {
        if words.len() != capacity.encoded_len()
            || self.num_chunks() > capacity.max_chunks
            || self.num_requests() > capacity.max_requests
        {
            return Err(CudaError::invalid(format!(
                "decode plan of {} chunks / {} requests does not fit {capacity:?} in {} words",
                self.num_chunks(),
                self.num_requests(),
                words.len()
            )));
        }
        let chunks = self.num_chunks();
        words[0] = chunks as u32;
        words[1] = self.pages_per_chunk as u32;
        words[2] = self.num_requests() as u32;
        words[3] = 0;
        let requests = PLAN_HEADER_WORDS;
        let tiles = requests + capacity.max_chunks;
        words[requests..requests + chunks].copy_from_slice(&self.request_indices);
        words[requests + chunks..tiles].fill(0);
        words[tiles..tiles + chunks].copy_from_slice(&self.kv_tile_indices);
        words[tiles + chunks..capacity.o_indptr_offset()].fill(0);
        let o = capacity.o_indptr_offset();
        words[o..o + self.o_indptr.len()].copy_from_slice(&self.o_indptr);
        words[o + self.o_indptr.len()..].fill(chunks as u32);
        Ok(())
    }

    /// Bytes of the partial results for `capacity` (`[max_chunks, num_q_heads, head_dim]`
    /// f32 outputs plus `[max_chunks, num_q_heads]` f32 log-sum-exps), known before any plan.
    pub fn workspace_bytes(capacity: PlanCapacity, num_q_heads: usize, head_dim: usize) -> usize {
        capacity.max_chunks * num_q_heads * (head_dim + 1) * 4
    }
}

/// The chunk size (in `floor..=largest`) with the smallest estimated time, `waves x (pages
/// + overhead)`, trying the sizes at which the longest request's chunk count changes (at
/// most 256 of them); ties go to the larger chunk. `total(ppc)` is the plan's chunk count.
fn fitted_chunk(
    total: &impl Fn(usize) -> usize,
    largest: usize,
    floor: usize,
    heads: usize,
    resident: usize,
    overhead: usize,
) -> usize {
    let mut best = (usize::MAX, largest);
    for chunks in 1..=largest.min(256) {
        let ppc = largest.div_ceil(chunks).max(floor);
        let waves = (total(ppc) * heads).div_ceil(resident);
        let cost = waves.saturating_mul(ppc + overhead);
        if cost < best.0 {
            best = (cost, ppc);
        }
        if ppc == floor {
            break;
        }
    }
    best.1
}

/// Pages per request from a CSR row pointer, checked: starts at 0, never decreases.
fn page_counts(indptr: &[u32]) -> Result<Vec<usize>, CudaError> {
    if indptr.first() != Some(&0) {
        return Err(CudaError::invalid(
            "decode plan: indptr must have B + 1 >= 1 entries starting at 0",
        ));
    }
    indptr
        .windows(2)
        .map(|pair| {
            pair[1]
                .checked_sub(pair[0])
                .map(|p| p as usize)
                .ok_or_else(|| {
                    CudaError::invalid(format!("decode plan: indptr decreases ({pair:?})"))
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn indptr(pages: &[u32]) -> Vec<u32> {
        let mut out = vec![0];
        for &p in pages {
            out.push(out.last().unwrap() + p);
        }
        out
    }

    fn plan(pages: &[u32], heads: usize, target: usize, capacity: PlanCapacity) -> PagedDecodePlan {
        let policy = PlanPolicy {
            target_ctas: target,
            pages_per_chunk: None,
            min_pages_per_chunk: 1,
            resident_ctas: None,
        };
        PagedDecodePlan::new(&indptr(pages), heads, policy, capacity).unwrap()
    }

    /// A xorshift stream: `next(n)` is uniform-ish in `0..n`.
    fn xorshift(mut state: u64) -> impl FnMut(u64) -> u64 {
        move |n| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        }
    }

    /// Brute force: the largest chunk size in 1..=max pages whose chunks fit the capacity
    /// and reach the target; if none reaches it, the smallest that fits.
    fn oracle(pages: &[u32], heads: usize, target: usize, max_chunks: usize) -> usize {
        let largest = pages.iter().copied().max().unwrap_or(0).max(1) as usize;
        let total = |c: usize| {
            pages
                .iter()
                .map(|&p| chunks_of(p as usize, c))
                .sum::<usize>()
        };
        let fitting: Vec<usize> = (1..=largest).filter(|&c| total(c) <= max_chunks).collect();
        fitting
            .iter()
            .copied()
            .filter(|&c| total(c) * heads >= target)
            .max()
            .unwrap_or(fitting[0])
    }

    #[test]
    fn search_matches_brute_force() {
        let mut next = xorshift(0x2545_f491_4f6c_dd1d);
        for _ in 0..500 {
            let b = 1 + next(12) as usize;
            let pages: Vec<u32> = (0..b).map(|_| next(300) as u32).collect();
            let heads = 1 + next(8) as usize;
            let target = 1 + next(2000) as usize;
            let capacity = PlanCapacity::for_batch(b + next(4) as usize, heads, target);
            let got = plan(&pages, heads, target, capacity);
            assert_eq!(
                got.pages_per_chunk,
                oracle(&pages, heads, target, capacity.max_chunks),
                "{pages:?} heads {heads} target {target}"
            );
            assert!(got.num_chunks() <= capacity.max_chunks);
        }
    }

    #[test]
    fn chunks_cover_every_page_once_in_request_order() {
        let pages = [5u32, 0, 17, 1];
        let p = plan(&pages, 8, 64, PlanCapacity::for_batch(4, 8, 64));
        assert_eq!(p.o_indptr.len(), 5);
        for (r, &count) in pages.iter().enumerate() {
            let (lo, hi) = (p.o_indptr[r] as usize, p.o_indptr[r + 1] as usize);
            assert!(hi > lo, "request {r} owns at least one chunk");
            let mut covered = 0;
            for c in lo..hi {
                assert_eq!(p.request_indices[c], r as u32);
                assert_eq!(p.kv_tile_indices[c], (c - lo) as u32);
                let begin = (c - lo) * p.pages_per_chunk;
                covered += (count as usize)
                    .saturating_sub(begin)
                    .min(p.pages_per_chunk);
            }
            assert_eq!(covered, count as usize);
        }
    }

    #[test]
    fn target_reached_with_the_fewest_chunks() {
        // One request of 64 pages (1K tokens at page 16), 8 KV heads, 132 target CTAs:
        // 22 chunks (176 CTAs) at 3 pages per chunk; 4 pages would give 16 x 8 = 128.
        let p = plan(&[64], 8, 132, PlanCapacity::for_batch(1, 8, 132));
        assert_eq!(p.pages_per_chunk, 3);
        assert_eq!(p.num_chunks(), 22);
        assert!(p.needs_merge());
        // A large batch already saturates: one chunk per request, no merge.
        let p = plan(&[64; 64], 8, 132, PlanCapacity::for_batch(64, 8, 132));
        assert_eq!(p.num_chunks(), 64);
        assert!(!p.needs_merge());
    }

    #[test]
    fn the_search_never_goes_below_the_smallest_chunk() {
        let capacity = PlanCapacity::for_batch(1, 8, 264);
        let policy = PlanPolicy {
            target_ctas: 264,
            pages_per_chunk: None,
            min_pages_per_chunk: 4,
            resident_ctas: None,
        };
        // 264 CTAs would want one page per chunk; the floor keeps 4 (16 chunks).
        let p = PagedDecodePlan::new(&indptr(&[64]), 8, policy, capacity).unwrap();
        assert_eq!((p.pages_per_chunk, p.num_chunks()), (4, 16));
        // Above the floor the search is unchanged; a floor above the request is clamped.
        let p = PagedDecodePlan::new(&indptr(&[1024]), 8, policy, capacity).unwrap();
        assert_eq!(p.pages_per_chunk, 31);
        let p = PagedDecodePlan::new(&indptr(&[2]), 8, policy, capacity).unwrap();
        assert_eq!((p.pages_per_chunk, p.num_chunks()), (2, 1));
    }

    #[test]
    fn fitted_plans_fill_whole_waves() {
        let capacity = PlanCapacity::for_batch(64, 8, 1056);
        let fitted = |pages: &[u32], resident| {
            let policy = PlanPolicy {
                target_ctas: 1056,
                pages_per_chunk: None,
                min_pages_per_chunk: 4,
                resident_ctas: Some(resident),
            };
            PagedDecodePlan::new(&indptr(pages), 8, policy, capacity).unwrap()
        };
        // 16 requests of 256 pages, 8 heads, 264 resident CTAs: 2 chunks each (256 CTAs, one
        // wave of 128 pages) beat 3 (384 CTAs: two waves of 86) and 4 (two waves of 64).
        let p = fitted(&[256; 16], 264);
        assert_eq!((p.pages_per_chunk, p.num_chunks()), (128, 32));
        // One request of 64 pages: the floor (4 pages, 16 chunks: one wave).
        let p = fitted(&[64], 264);
        assert_eq!((p.pages_per_chunk, p.num_chunks()), (4, 16));
        // 64 requests of 2048 pages already fill two waves: one chunk each, no merge.
        let p = fitted(&[2048; 64], 264);
        assert_eq!(p.num_chunks(), 64);
        assert!(!p.needs_merge());
        // Against brute force over the chunk sizes at which the longest request's chunk count
        // changes (waves x (pages + 4)); equal requests have their optimum among them.
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
        for round in 0..300 {
            let b = 1 + next(16) as usize;
            let pages: Vec<u32> = (0..b).map(|_| next(600) as u32).collect();
            if round % 3 == 0 {
                // Equal requests: the candidates hold the optimum over every chunk size.
                let all = vec![pages[0]; b];
                let p = fitted(&all, 264);
                let cost =
                    |c: usize| (b * chunks_of(all[0] as usize, c) * 8).div_ceil(264) * (c + 4);
                let largest = (all[0] as usize).max(1);
                let best = (4.min(largest)..=largest).map(cost).min().unwrap();
                assert_eq!(cost(p.pages_per_chunk), best, "{b} x {}", all[0]);
            }
            let resident = 1 + next(600) as usize;
            let p = fitted(&pages, resident);
            let largest = pages.iter().copied().max().unwrap_or(0).max(1) as usize;
            let cost = |c: usize| {
                let chunks: usize = pages.iter().map(|&q| chunks_of(q as usize, c)).sum();
                (chunks * 8).div_ceil(resident) * (c + 4)
            };
            let floor = 4.min(largest);
            let best = (1..=largest.min(256))
                .map(|chunks| cost(largest.div_ceil(chunks).max(floor)))
                .min()
                .unwrap();
            assert_eq!(
                cost(p.pages_per_chunk),
                best,
                "{pages:?} resident {resident}"
            );
        }
    }

    #[test]
    fn fixed_chunk_size_forces_the_merge_or_fails_cleanly() {
        let capacity = PlanCapacity {
            max_chunks: 8,
            max_requests: 2,
        };
        let policy = |c| PlanPolicy {
            target_ctas: 1,
            pages_per_chunk: Some(c),
            min_pages_per_chunk: 1,
            resident_ctas: None,
        };
        let p = PagedDecodePlan::new(&indptr(&[3, 4]), 1, policy(1), capacity).unwrap();
        assert_eq!(p.num_chunks(), 7);
        let err = PagedDecodePlan::new(&indptr(&[3, 6]), 1, policy(1), capacity).unwrap_err();
        assert!(err.to_string().contains("exceed the capacity"), "{err}");
        assert!(PagedDecodePlan::new(&indptr(&[3]), 1, policy(0), capacity).is_err());
    }

    #[test]
    fn malformed_input_is_an_error() {
        let capacity = PlanCapacity::for_batch(2, 1, 1);
        let policy = PlanPolicy {
            target_ctas: 1,
            pages_per_chunk: None,
            min_pages_per_chunk: 1,
            resident_ctas: None,
        };
        assert!(PagedDecodePlan::new(&[], 1, policy, capacity).is_err());
        assert!(PagedDecodePlan::new(&[1, 2], 1, policy, capacity).is_err());
        assert!(PagedDecodePlan::new(&[0, 5, 3], 1, policy, capacity).is_err());
        assert!(PagedDecodePlan::new(&[0, 1, 2, 3], 1, policy, capacity).is_err());
    }

    #[test]
    fn encoding_pads_to_the_capacity() {
        let capacity = PlanCapacity {
            max_chunks: 6,
            max_requests: 3,
        };
        let policy = PlanPolicy {
            target_ctas: 1,
            pages_per_chunk: Some(2),
            min_pages_per_chunk: 1,
            resident_ctas: None,
        };
        let p = PagedDecodePlan::new(&indptr(&[3, 1]), 1, policy, capacity).unwrap();
        let words = p.encode(capacity).unwrap();
        assert_eq!(words.len(), capacity.encoded_len());
        assert_eq!(&words[..4], &[3, 2, 2, 0]);
        assert_eq!(&words[4..10], &[0, 0, 1, 0, 0, 0]);
        assert_eq!(&words[10..16], &[0, 1, 0, 0, 0, 0]);
        assert_eq!(&words[16..20], &[0, 2, 3, 3]);
        assert_eq!(
            PagedDecodePlan::workspace_bytes(capacity, 4, 128),
            6 * 4 * 129 * 4
        );
    }
}
