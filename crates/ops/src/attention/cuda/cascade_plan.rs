//! The plan of cascade decode on CUDA: pure host code (tested on the CPU).
//!
//! A decode step's requests that share leading pages ([`ShareGroups`]: the prefix cache's
//! refcounted pages, nested at any depth) attend to them in two levels whose partial states
//! the fused decode's log-sum-exp merge combines, unchanged:
//!
//! - **shared level**: for each used group, its level's pages (from its parent's end to its
//!   own) are cut into key chunks, and each chunk is one work item per tile of members: the
//!   members' query heads are the rows of a prefill-shaped tensor-core tile
//!   (`cascade_shared_attention` in `prefill_stream.cu`), so the chunk's K/V is read once for
//!   the tile instead of once per member. Each (member, chunk) writes its partial into a
//!   slot reserved for it in the fused decode's partials;
//! - **unique level**: the fused decode over each request's own pages (a suffix page table:
//!   its pages after its deepest used group), whose plan reserves the shared slots first in
//!   each member's chunk range, as chunks the decode kernel skips (request index
//!   [`RESERVED_CHUNK`](super::decode_plan::RESERVED_CHUNK)). The separate merge then combines every slot of a request.
//!
//! A group is used when the [`CascadeRule`] says its level pays and every enclosing group is
//! used too (a request's used levels are a prefix of its path, so its suffix starts right
//! after them). Rows are one query per request (row `r` is request `r`).
//!
//! The plan is uploaded as `u32` words ([`CascadePlan::encode_into`]), as the kernel reads
//! them: `[num_items, 0]`, then `max_items` items `[page_begin, num_keys, member_begin,
//! members]` (`page_begin` indexes the step's full page-index array), then `max_members`
//! members `[q_row, slot]`.

use pagoda_cuda::CudaError;
use pagoda_kv::{PageTable, ShareGroups};

use super::decode_plan::{PagedDecodePlan, PlanCapacity, PlanPolicy};
use crate::attention::{CascadeRule, CascadeStats};

/// Words before the items.
const HEADER_WORDS: usize = 2;

/// The fixed sizes the shared level's plan is encoded for (a graph bucket's capacity).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CascadeCapacity {
    /// Most work items (the shared kernel's grid width).
    pub max_items: usize,
    /// Most (member, item) pairs.
    pub max_members: usize,
}

impl CascadeCapacity {
    /// The capacity of steps of up to `max_requests` requests whose shared level aims at
    /// `target_ctas` CTAs over `num_kv_heads` heads with at most `max_slots` shared slots a
    /// request ([`CascadeGeometry::max_slots`]): items for twice the target (a level has one
    /// chunk at least, so many small groups may pass it) or one a request, whichever is more.
    pub fn for_batch(
        max_requests: usize,
        num_kv_heads: usize,
        target_ctas: usize,
        max_slots: usize,
    ) -> Self {
        CascadeCapacity {
            max_items: (2 * target_ctas)
                .div_ceil(num_kv_heads.max(1))
                .max(max_requests),
            max_members: max_requests * max_slots.max(1),
        }
    }

    /// Length of the encoded plan in `u32` words.
    pub fn encoded_len(&self) -> usize {
        HEADER_WORDS + 4 * self.max_items + 2 * self.max_members
    }
}

/// The shape the shared level is planned for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CascadeGeometry {
    /// Tokens per page.
    pub page_size: usize,
    /// KV heads (the shared kernel's grid height).
    pub num_kv_heads: usize,
    /// Query heads per KV head.
    pub group: usize,
    /// Query rows of one shared tile (64 or 128): `rows / group` members a tile.
    pub rows: usize,
    /// CTAs the shared level aims for over all its items and KV heads.
    pub target_ctas: usize,
    /// The shortest key chunk, in tokens (a chunk's fixed cost: its pipeline fill and the
    /// partials its members write).
    pub min_chunk_tokens: usize,
    /// Most shared slots (key chunks over all its levels) of one request: each is a partial
    /// the request's merge reads.
    pub max_slots: usize,
}

/// A request's page list after its shared levels (a CSR page table of its own pages).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SuffixTable {
    pub indptr: Vec<u32>,
    pub indices: Vec<u32>,
    pub last_page_len: Vec<u32>,
    pub first_page_offset: Vec<u32>,
}

/// One step's cascade: the shared level's items, the unique level's suffix table and its
/// fused-decode plan with the shared slots reserved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CascadePlan {
    /// The fused decode's plan over [`Self::suffix`], shared slots first in each member's range.
    pub decode: PagedDecodePlan,
    /// Each request's own pages.
    pub suffix: SuffixTable,
    /// `[page_begin, num_keys, member_begin, members]` per work item.
    pub items: Vec<[u32; 4]>,
    /// `[q_row, slot]` per (member, item).
    pub members: Vec<[u32; 2]>,
    /// What the step shares.
    pub stats: CascadeStats,
}

/// A used group's level: its members, first page position and key chunks.
struct Level {
    group: usize,
    chunks: usize,
    chunk_pages: usize,
}

impl CascadePlan {
    /// The cascade of a decode step over `table` (one query row per request), or `None` when
    /// no group's level pays under `rule`. `policy` and `capacity` are the fused decode's (the
    /// reserved slots count against `capacity.max_chunks`); `shared` bounds the items.
    pub fn new(
        table: &PageTable,
        geometry: &CascadeGeometry,
        rule: &CascadeRule,
        sizes: (PlanPolicy, PlanCapacity),
        shared: CascadeCapacity,
    ) -> Result<Option<Self>, CudaError> {
        let groups = ShareGroups::build(table, geometry.page_size, |_| true);
        let rows = table.num_requests();
        Self::from_groups((table, &groups, rows), geometry, rule, sizes, shared)
    }

    /// [`Self::new`] with `table`'s share groups already built (`groups`, over pages of
    /// `geometry.page_size`), for a step of `rows` requests: those past the table's are
    /// padding, with no pages.
    pub fn from_groups(
        (table, groups, rows): (&PageTable, &ShareGroups, usize),
        geometry: &CascadeGeometry,
        rule: &CascadeRule,
        (policy, capacity): (PlanPolicy, PlanCapacity),
        shared: CascadeCapacity,
    ) -> Result<Option<Self>, CudaError> {
        let g = geometry;
        if g.rows == 0 || g.group == 0 || g.group > g.rows || g.page_size == 0 {
            return Err(CudaError::invalid(format!(
                "cascade plan: bad geometry {g:?}"
            )));
        }
        let used = Self::used_levels(groups, g.page_size, rule);
        let chosen: Vec<usize> = (0..used.len()).filter(|&i| used[i]).collect();
        if chosen.is_empty() {
            return Ok(None);
        }
        // Key chunks: enough items over all levels to reach the CTA target, no chunk shorter
        // than min_chunk_tokens (nor than a page).
        let tiles = |group: usize| {
            let per_tile = g.rows / g.group;
            groups.groups()[group].members.len().div_ceil(per_tile)
        };
        let base_ctas: usize = chosen.iter().map(|&i| tiles(i)).sum::<usize>() * g.num_kv_heads;
        let depth = (0..table.num_requests())
            .map(|r| groups.path(r).iter().filter(|&&group| used[group]).count())
            .max()
            .unwrap_or(1)
            .max(1);
        let wanted = g
            .target_ctas
            .div_ceil(base_ctas.max(1))
            .clamp(1, (g.max_slots / depth).max(1));
        let levels: Vec<Level> = chosen
            .iter()
            .map(|&group| {
                let pages = groups.groups()[group].pages.len();
                let min_pages = g.min_chunk_tokens.div_ceil(g.page_size).max(1);
                let most = pages.div_ceil(min_pages).max(1);
                let chunk_pages = pages.div_ceil(wanted.min(most));
                Level {
                    group,
                    chunks: pages.div_ceil(chunk_pages),
                    chunk_pages,
                }
            })
            .collect();
        // Each request's used levels (outermost first) and where its own pages start.
        let num_requests = rows.max(table.num_requests());
        let mut path_levels: Vec<Vec<usize>> = vec![Vec::new(); num_requests];
        let mut suffix_start = vec![0usize; table.num_requests()];
        for (request, levels_of) in path_levels
            .iter_mut()
            .enumerate()
            .take(table.num_requests())
        {
            for group in groups.path(request) {
                match levels.iter().position(|l| l.group == group) {
                    Some(level) => {
                        levels_of.push(level);
                        suffix_start[request] = groups.groups()[group].pages.end;
                    }
                    None => break,
                }
            }
        }
        let reserved: Vec<usize> = path_levels
            .iter()
            .map(|ls| ls.iter().map(|&l| levels[l].chunks).sum())
            .collect();
        let suffix = suffix_table(table, &suffix_start, num_requests);
        let total_reserved: usize = reserved.iter().sum();
        let unique_capacity = PlanCapacity {
            max_chunks: capacity.max_chunks.saturating_sub(total_reserved),
            ..capacity
        };
        if unique_capacity.max_chunks < num_requests {
            return Ok(None); // no room for the shared slots: plain decode
        }
        let decode = PagedDecodePlan::new(&suffix.indptr, g.num_kv_heads, policy, unique_capacity)?
            .with_reserved(&reserved)?;
        // Slot of (request, level, chunk): the request's reserved slots in level order.
        let slot = |request: usize, level: usize, chunk: usize| -> u32 {
            let before: usize = path_levels[request]
                .iter()
                .take_while(|&&l| l != level)
                .map(|&l| levels[l].chunks)
                .sum();
            decode.o_indptr[request] + (before + chunk) as u32
        };
        let mut plan = CascadePlan {
            decode: decode.clone(),
            suffix,
            items: Vec::new(),
            members: Vec::new(),
            stats: CascadeStats::default(),
        };
        let per_tile = g.rows / g.group;
        for (level_index, level) in levels.iter().enumerate() {
            let group = &groups.groups()[level.group];
            let first = group.members[0];
            let pages = group.pages.len();
            let level_tokens = pages * g.page_size;
            plan.stats.shared_tokens += level_tokens;
            plan.stats.saved_token_reads += (group.members.len() - 1) * level_tokens;
            // Balanced tiles of at most per_tile members.
            let pieces = group.members.len().div_ceil(per_tile);
            let size = group.members.len().div_ceil(pieces);
            for chunk in 0..level.chunks {
                let page0 = chunk * level.chunk_pages;
                let chunk_pages = level.chunk_pages.min(pages - page0);
                let page_begin = table.indptr[first] as usize + group.pages.start + page0;
                for piece in group.members.chunks(size) {
                    plan.items.push([
                        page_begin as u32,
                        (chunk_pages * g.page_size) as u32,
                        plan.members.len() as u32,
                        piece.len() as u32,
                    ]);
                    for &member in piece {
                        plan.members
                            .push([member as u32, slot(member, level_index, chunk)]);
                    }
                }
            }
        }
        plan.stats.groups = levels.len();
        if plan.items.len() > shared.max_items || plan.members.len() > shared.max_members {
            return Ok(None); // more than the bucket holds: plain decode
        }
        Ok(Some(plan))
    }

    /// Which of `groups`' levels cascade under `rule` (per group, in their order): the level
    /// pays, and so does every enclosing one. No `true`: no cascade (a cheap check before
    /// planning).
    pub fn used_levels(groups: &ShareGroups, page_size: usize, rule: &CascadeRule) -> Vec<bool> {
        let mut used = vec![false; groups.groups().len()];
        for (index, group) in groups.groups().iter().enumerate() {
            let (members, tokens) = (group.members.len(), group.pages.len() * page_size);
            let pays = members >= rule.min_members.max(2)
                && tokens >= rule.min_shared_tokens
                && (members - 1) * tokens >= rule.min_saved_tokens;
            // Parents come first.
            used[index] = pays && group.parent.is_none_or(|p| used[p]);
        }
        used
    }

    /// The shared level's words for `capacity` (see the module docs) into `words` (exactly
    /// `capacity.encoded_len()` long).
    pub fn encode_into(
        &self,
        capacity: CascadeCapacity,
        words: &mut [u32],
    ) -> Result<(), CudaError> {
        if words.len() != capacity.encoded_len()
            || self.items.len() > capacity.max_items
            || self.members.len() > capacity.max_members
        {
            return Err(CudaError::invalid(format!(
                "cascade plan of {} items / {} members does not fit {capacity:?} in {} words",
                self.items.len(),
                self.members.len(),
                words.len()
            )));
        }
        words.fill(0);
        words[0] = self.items.len() as u32;
        for (i, item) in self.items.iter().enumerate() {
            words[HEADER_WORDS + 4 * i..HEADER_WORDS + 4 * i + 4].copy_from_slice(item);
        }
        let members = HEADER_WORDS + 4 * capacity.max_items;
        for (i, member) in self.members.iter().enumerate() {
            words[members + 2 * i..members + 2 * i + 2].copy_from_slice(member);
        }
        Ok(())
    }

    /// The shared level's words for `capacity`.
    pub fn encode(&self, capacity: CascadeCapacity) -> Result<Vec<u32>, CudaError> {
        let mut words = vec![0; capacity.encoded_len()];
        self.encode_into(capacity, &mut words)?;
        Ok(words)
    }
}

/// `table` with request `r`'s first `start[r]` pages left out (they are whole, fully
/// visible pages, so the suffix starts at a page boundary: first offset 0), padded with
/// empty requests to `rows`.
fn suffix_table(table: &PageTable, start: &[usize], rows: usize) -> SuffixTable {
    let mut suffix = SuffixTable {
        indptr: vec![0],
        ..SuffixTable::default()
    };
    for (request, &skip) in start.iter().enumerate() {
        let begin = table.indptr[request] as usize;
        let end = table.indptr[request + 1] as usize;
        suffix
            .indices
            .extend_from_slice(&table.indices[begin + skip.min(end - begin)..end]);
        suffix.indptr.push(suffix.indices.len() as u32);
        let own = end - begin - skip.min(end - begin);
        suffix.last_page_len.push(if own == 0 {
            0
        } else {
            table.last_page_len[request]
        });
        suffix.first_page_offset.push(if skip == 0 {
            table.first_page_offset[request]
        } else {
            0
        });
    }
    let pages = suffix.indices.len() as u32;
    suffix.indptr.resize(rows + 1, pages);
    suffix.last_page_len.resize(rows, 0);
    suffix.first_page_offset.resize(rows, 0);
    suffix
}
