//! [`ShareGroups`]: which requests of a step share leading KV pages, found from the CSR
//! [`PageTable`] alone: the input of cascade attention (the shared pages attended once per
//! group, each request's own pages apart).
//!
//! Within one page table a page id names one physical page, and the prefix cache shares a
//! prompt's full pages by refcount, so two requests whose lists hold the same id at the same
//! position read the same K/V there (the cache keys a page by its whole prefix, so equal ids
//! also mean equal earlier pages). The groups form a trie over the requests' leading page
//! ids, compressed: a group is a trie node with two or more requests, its pages run from
//! where its parent group's pages end to where its members' lists first differ, and a
//! request that diverges from its siblings starts a nested group (or its own tail) there.
//!
//! Only whole pages count: position `k` of request `r` may be shared only when the request
//! sees every row of that page (`first_page_offset` 0 and `(k + 1) * page_size <= seq_len`).
//! A prompt prefix that ends mid-page therefore shares its full pages only; the page holding
//! its end (each request's own copy, or a shared page still being filled) stays in the
//! request's tail. A request that is not `eligible`, or that shares no page with another,
//! belongs to no group: its whole list is its tail.

use crate::page_table::PageTable;

/// One share group: requests whose page lists hold the same ids at positions `pages`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShareGroup {
    /// Nesting depth: 0 for a group of the trie's root, `parent's level + 1` otherwise.
    pub level: usize,
    /// The enclosing group (its members are a superset, its pages end where these start).
    pub parent: Option<usize>,
    /// Page positions (within each member's list) shared at this level: from the parent's
    /// end (0 at level 0) to the first position where the members differ. Never empty.
    pub pages: std::ops::Range<usize>,
    /// Member requests (rows of the page table), ascending, at least two.
    pub members: Vec<usize>,
}

/// The share groups of one page table ([`ShareGroups::build`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShareGroups {
    /// Every group, parents before children.
    groups: Vec<ShareGroup>,
    /// `[B]`: the deepest group of each request (`None`: no group).
    leaf: Vec<Option<usize>>,
    /// `[B]`: the first page position of each request that no group shares.
    tail_start: Vec<usize>,
    /// `[B]`: pages per request.
    num_pages: Vec<usize>,
}

impl ShareGroups {
    /// The groups of `table` over pages of `page_size` tokens, among the requests for which
    /// `eligible` is true. Pure; O(total pages) comparisons.
    pub fn build(table: &PageTable, page_size: usize, eligible: impl Fn(usize) -> bool) -> Self {
        let num_requests = table.num_requests();
        let mut groups = ShareGroups {
            groups: Vec::new(),
            leaf: vec![None; num_requests],
            tail_start: vec![0; num_requests],
            num_pages: (0..num_requests).map(|r| table.num_pages_of(r)).collect(),
        };
        // Whole visible pages of each request (0 for an ineligible one).
        let full: Vec<usize> = (0..num_requests)
            .map(|r| {
                if !eligible(r) || table.first_page_offset[r] != 0 {
                    0
                } else {
                    (table.seq_lens[r] as usize / page_size.max(1)).min(groups.num_pages[r])
                }
            })
            .collect();
        let page = |r: usize, k: usize| table.indices[table.indptr[r] as usize + k];
        let roots: Vec<usize> = (0..num_requests).filter(|&r| full[r] > 0).collect();
        // Work list of (members, first position, parent): every member holds a full page at
        // `start`; members are split by that page's id.
        let mut pending = vec![(roots, 0usize, None::<usize>)];
        while let Some((members, start, parent)) = pending.pop() {
            for part in partition(&members, |r| page(r, start)) {
                if part.len() < 2 {
                    groups.tail_start[part[0]] = start;
                    continue;
                }
                let mut end = start + 1;
                while part.iter().all(|&r| end < full[r])
                    && part.iter().all(|&r| page(r, end) == page(part[0], end))
                {
                    end += 1;
                }
                let index = groups.groups.len();
                let level = parent.map_or(0, |p: usize| groups.groups[p].level + 1);
                for &r in &part {
                    groups.leaf[r] = Some(index);
                    groups.tail_start[r] = end;
                }
                let (ongoing, _): (Vec<usize>, Vec<usize>) =
                    part.iter().partition(|&&r| end < full[r]);
                groups.groups.push(ShareGroup {
                    level,
                    parent,
                    pages: start..end,
                    members: part,
                });
                if ongoing.len() >= 2 {
                    pending.push((ongoing, end, Some(index)));
                }
            }
        }
        // Parents before children already hold (a child is pushed after its parent); sort
        // by (level, first member) for a stable order that does not depend on the work list.
        groups.sort();
        groups
    }

    /// Orders the groups by (level, first member), remapping parents and leaves.
    fn sort(&mut self) {
        let mut order: Vec<usize> = (0..self.groups.len()).collect();
        order.sort_by_key(|&g| (self.groups[g].level, self.groups[g].members[0]));
        let mut new_index = vec![0; order.len()];
        for (new, &old) in order.iter().enumerate() {
            new_index[old] = new;
        }
        let mut sorted: Vec<ShareGroup> = order.iter().map(|&g| self.groups[g].clone()).collect();
        for group in &mut sorted {
            group.parent = group.parent.map(|p| new_index[p]);
        }
        self.groups = sorted;
        for leaf in self.leaf.iter_mut().flatten() {
            *leaf = new_index[*leaf];
        }
    }

    /// Every group, by level then first member (parents before children).
    pub fn groups(&self) -> &[ShareGroup] {
        &self.groups
    }

    /// Nesting levels (0 when there is no group).
    pub fn num_levels(&self) -> usize {
        self.groups.iter().map(|g| g.level + 1).max().unwrap_or(0)
    }

    /// The groups of nesting level `level`.
    pub fn level(&self, level: usize) -> impl Iterator<Item = &ShareGroup> {
        self.groups.iter().filter(move |g| g.level == level)
    }

    /// The groups request `request` belongs to, outermost first (empty: none).
    pub fn path(&self, request: usize) -> Vec<usize> {
        let mut path = Vec::new();
        let mut group = self.leaf[request];
        while let Some(g) = group {
            path.push(g);
            group = self.groups[g].parent;
        }
        path.reverse();
        path
    }

    /// Page positions of `request` that no group shares: its own tail (may be empty when
    /// all its pages are shared, which needs a page-aligned end).
    pub fn tail(&self, request: usize) -> std::ops::Range<usize> {
        self.tail_start[request]..self.num_pages[request]
    }

    /// Page reads a cascade saves per layer: each group's pages once instead of once per
    /// member, `Σ (members - 1) * pages`.
    pub fn pages_saved(&self) -> usize {
        self.groups
            .iter()
            .map(|g| (g.members.len() - 1) * g.pages.len())
            .sum()
    }
}

/// `members` split by `key`, each part in ascending order, parts ordered by first member.
fn partition(members: &[usize], key: impl Fn(usize) -> u32) -> Vec<Vec<usize>> {
    let mut parts: Vec<(u32, Vec<usize>)> = Vec::new();
    for &member in members {
        let id = key(member);
        match parts.iter_mut().find(|(k, _)| *k == id) {
            Some((_, part)) => part.push(member),
            None => parts.push((id, vec![member])),
        }
    }
    parts.into_iter().map(|(_, part)| part).collect()
}
