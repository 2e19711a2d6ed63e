//! [`BlockTable`]: the ordered pages of one sequence and how many tokens they hold.
//!
//! Token `t` (0-based, counted from the start of the sequence) lives in page
//! `pages[t / page_size]` at offset `t % page_size`. `logical_start` is the first token still
//! visible to attention (sliding windows trim from the front); tokens before it stay stored
//! until [`BlockTable::release`].

use crate::pool::{BlockPool, PageId, PoolError};

/// Where one token's K/V row lives: page `page`, row `offset` inside it
/// (`offset < page_size`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Slot {
    /// The physical page.
    pub page: PageId,
    /// Row inside the page, in `[0, page_size)`.
    pub offset: u32,
}

impl Slot {
    /// Flat token row in a `[num_pages * page_size, ...]` view of the pool:
    /// `page * page_size + offset`.
    pub fn physical_index(self, page_size: usize) -> usize {
        self.page.index() * page_size + self.offset as usize
    }
}

/// A copy the caller must perform in every layer's K and V pool before writing new tokens:
/// rows `[0, num_tokens)` of page `source` into the same rows of page `destination`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageCopy {
    /// The shared page being left.
    pub source: PageId,
    /// The fresh page now owned exclusively by this sequence.
    pub destination: PageId,
    /// Rows to copy (the tokens already stored in the partial page).
    pub num_tokens: usize,
}

/// Why tokens could not be appended to a block table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AppendError {
    /// The pool has too few free pages; nothing was allocated or changed.
    #[error("out of KV pages: need {needed} new pages, {available} free")]
    OutOfPages {
        /// Pages the append needs.
        needed: usize,
        /// Free pages in the pool.
        available: usize,
    },
    /// The partially filled last page is shared with another sequence, so writing into it
    /// would corrupt the other owner; call `BlockTable::make_last_page_exclusive` first.
    #[error(
        "last {page} is partially filled and shared (refcount {refcount}); \
         call make_last_page_exclusive before appending"
    )]
    SharedLastPage {
        /// The shared page.
        page: PageId,
        /// Its refcount.
        refcount: u32,
    },
    /// The pool reported an inconsistent page (a bookkeeping bug upstream).
    #[error(transparent)]
    Pool(#[from] PoolError),
}

/// Misuse of a block table's token counters.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockTableError {
    /// `logical_start` (or a prefix length) is past the end of the sequence.
    #[error("{what} {value} exceeds num_tokens {num_tokens}")]
    PastEnd {
        /// Which argument.
        what: &'static str,
        /// Its value.
        value: usize,
        /// Tokens in the sequence.
        num_tokens: usize,
    },
    /// The pool rejected an incref (a page of this table is not allocated).
    #[error(transparent)]
    Pool(#[from] PoolError),
}

/// The pages of one sequence, in token order, plus its token counters.
///
/// Invariant: `pages.len() == ceil(num_tokens / page_size)` and
/// `logical_start <= num_tokens`. Every page in `pages` holds one reference in the pool.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    pages: Vec<PageId>,
    num_tokens: usize,
    logical_start: usize,
}

impl BlockTable {
    /// An empty sequence (no pages, no tokens).
    pub fn new() -> Self {
        Self::default()
    }

    /// A table over pages whose references the caller already holds (e.g. a prefix-cache hit
    /// acquired for this sequence): `num_tokens` tokens, `logical_start` 0. The table takes
    /// over those references (its `release` drops them). Errors when `pages` is not exactly
    /// `ceil(num_tokens / page_size)` pages.
    pub fn from_owned_pages(
        pages: Vec<PageId>,
        num_tokens: usize,
        page_size: usize,
    ) -> Result<BlockTable, BlockTableError> {
        if page_size == 0 || pages.len() != num_tokens.div_ceil(page_size) {
            return Err(BlockTableError::PastEnd {
                what: "token count for the given pages",
                value: num_tokens,
                num_tokens: pages.len() * page_size,
            });
        }
        Ok(BlockTable {
            pages,
            num_tokens,
            logical_start: 0,
        })
    }

    /// The pages in token order.
    pub fn pages(&self) -> &[PageId] {
        &self.pages
    }

    /// Tokens written so far (also the absolute position of the next token).
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// First token visible to attention.
    pub fn logical_start(&self) -> usize {
        self.logical_start
    }

    /// Tokens visible to attention: `num_tokens - logical_start`.
    pub fn num_visible_tokens(&self) -> usize {
        self.num_tokens - self.logical_start
    }

    /// Slot of token `token_index`, or `None` if it is not stored.
    pub fn slot(&self, token_index: usize, page_size: usize) -> Option<Slot> {
        if token_index >= self.num_tokens || page_size == 0 {
            return None;
        }
        let page = *self.pages.get(token_index / page_size)?;
        Some(Slot {
            page,
            offset: (token_index % page_size) as u32,
        })
    }

    /// Moves the first visible token to `logical_start` (sliding window). Pages before it
    /// stay owned until `release`. Errors if `logical_start > num_tokens`.
    pub fn set_logical_start(&mut self, logical_start: usize) -> Result<(), BlockTableError> {
        if logical_start > self.num_tokens {
            return Err(BlockTableError::PastEnd {
                what: "logical_start",
                value: logical_start,
                num_tokens: self.num_tokens,
            });
        }
        self.logical_start = logical_start;
        Ok(())
    }

    /// Reserves `count` new tokens at the end of the sequence, allocating pages as needed,
    /// and returns each new token's slot in order. All or nothing: on error the table and
    /// the pool are unchanged.
    ///
    /// Errors: [`AppendError::OutOfPages`] when the pool cannot supply the pages,
    /// [`AppendError::SharedLastPage`] when the first new token would land in a partially
    /// filled page that another sequence also owns.
    pub fn append_slots(
        &mut self,
        pool: &mut BlockPool,
        count: usize,
    ) -> Result<Vec<Slot>, AppendError> {
        let page_size = pool.page_size();
        if count == 0 {
            return Ok(Vec::new());
        }
        let filled_in_last_page = self.num_tokens % page_size;
        if filled_in_last_page != 0 {
            if let Some(&last) = self.pages.last() {
                let refcount = pool.refcount(last)?;
                if refcount > 1 {
                    return Err(AppendError::SharedLastPage {
                        page: last,
                        refcount,
                    });
                }
            }
        }
        let new_num_tokens = self.num_tokens + count;
        let needed = new_num_tokens.div_ceil(page_size) - self.pages.len();
        let new_pages = pool.allocate_n(needed).ok_or(AppendError::OutOfPages {
            needed,
            available: pool.num_free(),
        })?;
        self.pages.extend(new_pages);
        let first = self.num_tokens;
        self.num_tokens = new_num_tokens;
        Ok((first..new_num_tokens)
            .map(|token| Slot {
                page: self.pages[token / page_size],
                offset: (token % page_size) as u32,
            })
            .collect())
    }

    /// Copy-on-write for the partially filled last page: if it is shared, allocates a fresh
    /// page, drops this table's reference to the shared one and returns the copy the caller
    /// must perform on the KV pools. `Ok(None)` when nothing needs copying.
    pub fn make_last_page_exclusive(
        &mut self,
        pool: &mut BlockPool,
    ) -> Result<Option<PageCopy>, AppendError> {
        let page_size = pool.page_size();
        let filled = self.num_tokens % page_size;
        let Some(&last) = self.pages.last() else {
            return Ok(None);
        };
        if filled == 0 || pool.refcount(last)? <= 1 {
            return Ok(None);
        }
        let fresh = pool.allocate().ok_or(AppendError::OutOfPages {
            needed: 1,
            available: 0,
        })?;
        pool.decref(last)?;
        *self.pages.last_mut().expect("checked non-empty above") = fresh;
        Ok(Some(PageCopy {
            source: last,
            destination: fresh,
            num_tokens: filled,
        }))
    }

    /// A new table sharing the pages of this table's first `num_tokens` tokens (one incref
    /// per shared page). The new table's `logical_start` is `min(self.logical_start,
    /// num_tokens)`. All or nothing: on error no refcount changes.
    pub fn share_prefix(
        &self,
        pool: &mut BlockPool,
        num_tokens: usize,
    ) -> Result<BlockTable, BlockTableError> {
        if num_tokens > self.num_tokens {
            return Err(BlockTableError::PastEnd {
                what: "prefix length",
                value: num_tokens,
                num_tokens: self.num_tokens,
            });
        }
        let shared = &self.pages[..num_tokens.div_ceil(pool.page_size())];
        for (done, &page) in shared.iter().enumerate() {
            if let Err(error) = pool.incref(page) {
                for &undo in &shared[..done] {
                    // These increfs just succeeded, so the decrefs cannot fail.
                    let _ = pool.decref(undo);
                }
                return Err(error.into());
            }
        }
        Ok(BlockTable {
            pages: shared.to_vec(),
            num_tokens,
            logical_start: self.logical_start.min(num_tokens),
        })
    }

    /// A new table sharing every page of this one (parallel sampling, beam search).
    pub fn fork(&self, pool: &mut BlockPool) -> Result<BlockTable, BlockTableError> {
        self.share_prefix(pool, self.num_tokens)
    }

    /// Drops this table's reference to every page and empties it. Pages whose refcount
    /// reaches 0 return to the free list.
    /// Forgets the tokens from `num_tokens` on (speculative tokens that were rejected): the
    /// pages past the last one still needed drop their reference (in reverse order). The
    /// rows of the removed tokens in the last kept page stay as they are until overwritten.
    /// Errors if `num_tokens` is past the end or before `logical_start`.
    pub fn truncate(
        &mut self,
        pool: &mut BlockPool,
        num_tokens: usize,
    ) -> Result<(), BlockTableError> {
        if num_tokens > self.num_tokens || num_tokens < self.logical_start {
            return Err(BlockTableError::PastEnd {
                what: "truncate to",
                value: num_tokens,
                num_tokens: self.num_tokens,
            });
        }
        let keep = num_tokens.div_ceil(pool.page_size());
        while self.pages.len() > keep {
            let page = self.pages.pop().expect("more pages than kept");
            pool.decref(page)?;
        }
        self.num_tokens = num_tokens;
        Ok(())
    }

    pub fn release(&mut self, pool: &mut BlockPool) -> Result<(), PoolError> {
        let pages = std::mem::take(&mut self.pages);
        self.num_tokens = 0;
        self.logical_start = 0;
        let mut first_error = None;
        for page in pages {
            if let Err(error) = pool.decref(page) {
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncate_drops_the_pages_past_the_kept_tokens() {
        let mut pool = BlockPool::new(4, 4).unwrap();
        let mut table = BlockTable::new();
        table.append_slots(&mut pool, 9).unwrap();
        assert_eq!(pool.num_free(), 1);
        table.truncate(&mut pool, 5).unwrap();
        assert_eq!((table.num_tokens(), table.pages().len()), (5, 2));
        assert_eq!(pool.num_free(), 2);
        table.truncate(&mut pool, 4).unwrap();
        assert_eq!((table.num_tokens(), table.pages().len()), (4, 1));
        assert!(table.truncate(&mut pool, 5).is_err(), "past the end");
        let slots = table.append_slots(&mut pool, 1).unwrap();
        assert_eq!(slots[0].offset, 0, "the next token starts the next page");
    }

    #[test]
    fn append_allocates_pages_on_demand_and_returns_slots_in_order() {
        let mut pool = BlockPool::new(4, 4).unwrap();
        let mut table = BlockTable::new();
        let slots = table.append_slots(&mut pool, 5).unwrap();
        assert_eq!(table.pages(), &[PageId(0), PageId(1)]);
        assert_eq!(
            slots[4],
            Slot {
                page: PageId(1),
                offset: 0
            }
        );
        assert_eq!(slots[4].physical_index(4), 4);
        let slots = table.append_slots(&mut pool, 3).unwrap();
        assert_eq!(table.pages().len(), 2);
        assert_eq!(
            slots[2],
            Slot {
                page: PageId(1),
                offset: 3
            }
        );
        assert_eq!(table.slot(7, 4), Some(slots[2]));
        assert_eq!(table.slot(8, 4), None);
    }

    #[test]
    fn out_of_pages_leaves_everything_unchanged() {
        let mut pool = BlockPool::new(2, 4).unwrap();
        let mut table = BlockTable::new();
        table.append_slots(&mut pool, 3).unwrap();
        let error = table.append_slots(&mut pool, 10).unwrap_err();
        assert_eq!(
            error,
            AppendError::OutOfPages {
                needed: 3,
                available: 1
            }
        );
        assert_eq!(table.num_tokens(), 3);
        assert_eq!(pool.num_free(), 1);
    }

    #[test]
    fn fork_shares_pages_and_copy_on_write_splits_the_partial_page() {
        let mut pool = BlockPool::new(8, 4).unwrap();
        let mut parent = BlockTable::new();
        parent.append_slots(&mut pool, 6).unwrap();
        let mut child = parent.fork(&mut pool).unwrap();
        assert_eq!(pool.refcount(PageId(1)), Ok(2));
        assert!(matches!(
            child.append_slots(&mut pool, 1),
            Err(AppendError::SharedLastPage { .. })
        ));
        let copy = child.make_last_page_exclusive(&mut pool).unwrap().unwrap();
        assert_eq!(copy.source, PageId(1));
        assert_eq!(copy.num_tokens, 2);
        assert_eq!(pool.refcount(PageId(1)), Ok(1));
        assert_eq!(
            child.append_slots(&mut pool, 1).unwrap()[0].page,
            copy.destination
        );
        assert_eq!(pool.refcount(PageId(0)), Ok(2));
        parent.release(&mut pool).unwrap();
        child.release(&mut pool).unwrap();
        assert_eq!(pool.num_free(), 8);
    }

    #[test]
    fn share_prefix_and_logical_start_bounds() {
        let mut pool = BlockPool::new(8, 4).unwrap();
        let mut table = BlockTable::new();
        table.append_slots(&mut pool, 9).unwrap();
        table.set_logical_start(5).unwrap();
        assert_eq!(table.num_visible_tokens(), 4);
        assert!(table.set_logical_start(10).is_err());
        let prefix = table.share_prefix(&mut pool, 4).unwrap();
        assert_eq!(prefix.pages(), &[PageId(0)]);
        assert_eq!(prefix.logical_start(), 4);
        assert!(table.share_prefix(&mut pool, 10).is_err());
    }
}
