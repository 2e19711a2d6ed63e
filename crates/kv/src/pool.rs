//! [`BlockPool`]: the fixed set of KV pages, a free list and per-page reference counts.
//!
//! A page holds `page_size` consecutive token slots of every layer's K and V pool. The pool
//! never sees tensors: it only decides which page ids are in use and by how many owners.

use std::fmt;

/// Page size used when none is configured (tokens per page).
pub const DEFAULT_PAGE_SIZE: usize = 16;

/// Identifier of one physical page: the row `page` of every layer's
/// `[num_pages, page_size, num_kv_heads, head_dim]` pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PageId(pub u32);

impl PageId {
    /// The page id as an index into the pool's first dimension.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for PageId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "page {}", self.0)
    }
}

/// Misuse of the pool: every variant names the page and what was wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// `page_size` must be at least one token.
    #[error("page_size must be >= 1, got 0")]
    ZeroPageSize,
    /// Page ids are stored as `u32`; the pool cannot be larger.
    #[error("num_pages {num_pages} does not fit in a u32 page id")]
    TooManyPages {
        /// The requested page count.
        num_pages: usize,
    },
    /// The page id is not below `num_pages`.
    #[error("{page} is out of range: the pool has {num_pages} pages")]
    PageOutOfRange {
        /// The offending page.
        page: PageId,
        /// Pages in the pool.
        num_pages: usize,
    },
    /// `decref`/`free` of a page whose refcount is already zero (a double free).
    #[error("{page} is already free (refcount 0): double free")]
    PageAlreadyFree {
        /// The offending page.
        page: PageId,
    },
    /// `incref` of a page nobody owns: sharing must start from an allocated page.
    #[error("{page} is free (refcount 0): incref needs an allocated page")]
    PageNotAllocated {
        /// The offending page.
        page: PageId,
    },
}

/// The page allocator: `num_pages` pages of `page_size` tokens, a free list, and a reference
/// count per page (0 = free; `n` = owned by `n` block tables).
///
/// Invariants (checked by the property tests): a page is on the free list exactly when its
/// refcount is 0, the free list has no duplicates, and `num_free + num_used == num_pages`.
#[derive(Debug, Clone)]
pub struct BlockPool {
    page_size: usize,
    refcounts: Vec<u32>,
    /// Free pages; `allocate` pops from the back, so the initial order hands out page 0 first.
    free_list: Vec<PageId>,
}

impl BlockPool {
    /// A pool of `num_pages` free pages of `page_size` tokens each.
    ///
    /// Errors if `page_size` is 0 or `num_pages` does not fit a `u32` page id.
    pub fn new(num_pages: usize, page_size: usize) -> Result<Self, PoolError> {
        if page_size == 0 {
            return Err(PoolError::ZeroPageSize);
        }
        if u32::try_from(num_pages).is_err() {
            return Err(PoolError::TooManyPages { num_pages });
        }
        let free_list = (0..num_pages as u32).rev().map(PageId).collect();
        Ok(Self {
            page_size,
            refcounts: vec![0; num_pages],
            free_list,
        })
    }

    /// A pool of `num_pages` pages of [`DEFAULT_PAGE_SIZE`] tokens.
    pub fn with_default_page_size(num_pages: usize) -> Result<Self, PoolError> {
        Self::new(num_pages, DEFAULT_PAGE_SIZE)
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Total pages, free or used.
    pub fn num_pages(&self) -> usize {
        self.refcounts.len()
    }

    /// Pages on the free list.
    pub fn num_free(&self) -> usize {
        self.free_list.len()
    }

    /// Pages with refcount >= 1.
    pub fn num_used(&self) -> usize {
        self.num_pages() - self.num_free()
    }

    /// Takes one free page and sets its refcount to 1; `None` when the pool is exhausted.
    pub fn allocate(&mut self) -> Option<PageId> {
        let page = self.free_list.pop()?;
        self.refcounts[page.index()] = 1;
        Some(page)
    }

    /// Takes `count` free pages (each with refcount 1), all or nothing: `None` (and the pool
    /// unchanged) when fewer than `count` are free.
    pub fn allocate_n(&mut self, count: usize) -> Option<Vec<PageId>> {
        if count > self.free_list.len() {
            return None;
        }
        Some((0..count).filter_map(|_| self.allocate()).collect())
    }

    /// Adds one owner to an allocated page (prefix sharing, fork). Errors on a free or
    /// out-of-range page.
    pub fn incref(&mut self, page: PageId) -> Result<(), PoolError> {
        let count = self.refcount_mut(page)?;
        if *count == 0 {
            return Err(PoolError::PageNotAllocated { page });
        }
        *count += 1;
        Ok(())
    }

    /// Removes one owner; at refcount 0 the page returns to the free list. Returns the new
    /// refcount. Errors on a free (double free) or out-of-range page.
    pub fn decref(&mut self, page: PageId) -> Result<u32, PoolError> {
        let count = self.refcount_mut(page)?;
        if *count == 0 {
            return Err(PoolError::PageAlreadyFree { page });
        }
        *count -= 1;
        let remaining = *count;
        if remaining == 0 {
            self.free_list.push(page);
        }
        Ok(remaining)
    }

    /// Same as [`BlockPool::decref`]: drops this owner's reference (the page is only freed
    /// when it was the last owner).
    pub fn free(&mut self, page: PageId) -> Result<u32, PoolError> {
        self.decref(page)
    }

    /// Number of owners of `page` (0 = free). Errors on an out-of-range page.
    pub fn refcount(&self, page: PageId) -> Result<u32, PoolError> {
        self.refcounts
            .get(page.index())
            .copied()
            .ok_or(PoolError::PageOutOfRange {
                page,
                num_pages: self.num_pages(),
            })
    }

    /// Whether `page` is on the free list (refcount 0). Out-of-range pages are not free.
    pub fn is_free(&self, page: PageId) -> bool {
        self.refcounts.get(page.index()) == Some(&0)
    }

    /// The free pages, in the order `allocate` will hand them out last-to-first.
    pub fn free_pages(&self) -> &[PageId] {
        &self.free_list
    }

    fn refcount_mut(&mut self, page: PageId) -> Result<&mut u32, PoolError> {
        let num_pages = self.num_pages();
        self.refcounts
            .get_mut(page.index())
            .ok_or(PoolError::PageOutOfRange { page, num_pages })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_until_exhausted_then_free_returns_page() {
        let mut pool = BlockPool::new(3, 4).unwrap();
        let pages = pool.allocate_n(3).unwrap();
        assert_eq!(pages, vec![PageId(0), PageId(1), PageId(2)]);
        assert_eq!(pool.allocate(), None);
        assert_eq!(pool.allocate_n(1), None);
        assert_eq!(pool.num_used(), 3);
        assert_eq!(pool.decref(PageId(1)), Ok(0));
        assert_eq!(pool.num_free(), 1);
        assert_eq!(pool.allocate(), Some(PageId(1)));
    }

    #[test]
    fn allocate_n_is_all_or_nothing() {
        let mut pool = BlockPool::new(2, 16).unwrap();
        assert_eq!(pool.allocate_n(3), None);
        assert_eq!(pool.num_free(), 2);
    }

    #[test]
    fn shared_page_is_freed_by_its_last_owner() {
        let mut pool = BlockPool::with_default_page_size(2).unwrap();
        assert_eq!(pool.page_size(), DEFAULT_PAGE_SIZE);
        let page = pool.allocate().unwrap();
        pool.incref(page).unwrap();
        assert_eq!(pool.refcount(page), Ok(2));
        assert_eq!(pool.free(page), Ok(1));
        assert!(!pool.is_free(page));
        assert_eq!(pool.free(page), Ok(0));
        assert!(pool.is_free(page));
    }

    #[test]
    fn misuse_is_an_error_not_a_panic() {
        let mut pool = BlockPool::new(2, 16).unwrap();
        assert_eq!(BlockPool::new(2, 0).unwrap_err(), PoolError::ZeroPageSize);
        assert_eq!(
            pool.decref(PageId(0)),
            Err(PoolError::PageAlreadyFree { page: PageId(0) })
        );
        assert_eq!(
            pool.incref(PageId(1)),
            Err(PoolError::PageNotAllocated { page: PageId(1) })
        );
        let error = pool.incref(PageId(9)).unwrap_err();
        assert_eq!(
            error,
            PoolError::PageOutOfRange {
                page: PageId(9),
                num_pages: 2
            }
        );
        assert!(error.to_string().contains("page 9"));
        assert!(pool.refcount(PageId(2)).is_err());
    }
}
