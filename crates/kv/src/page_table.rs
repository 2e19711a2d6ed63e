//! The CSR [`PageTable`] (FlashInfer's shape) that attention kernels read, its builder from
//! block tables, and its validator.
//!
//! Visible token `i` of request `r` sits at `abs = first_page_offset[r] + i` inside the
//! request's page slice: page `indices[indptr[r] + abs / page_size]`, row
//! `abs % page_size`. Only pages holding visible tokens are emitted, so page counts equal
//! real work. Any broken invariant is a silent out-of-bounds read in a kernel, hence
//! [`PageTable::validate`] runs on every build.

use crate::block_table::BlockTable;
use crate::pool::{BlockPool, PageId};

/// One request's input to [`PageTable::build`]: its retained pages and token counters.
#[derive(Clone, Copy, Debug)]
pub struct PageTableRequest<'a> {
    /// The sequence's pages in token order (token `t` in `pages[t / page_size]`).
    pub pages: &'a [PageId],
    /// Tokens written (absolute position of the next token).
    pub num_tokens: usize,
    /// First visible token (`<= num_tokens`).
    pub logical_start: usize,
}

impl<'a> From<&'a BlockTable> for PageTableRequest<'a> {
    fn from(table: &'a BlockTable) -> Self {
        Self {
            pages: table.pages(),
            num_tokens: table.num_tokens(),
            logical_start: table.logical_start(),
        }
    }
}

/// A broken page-table invariant (or a block table that cannot be turned into one). Each
/// variant names the request or position and the offending values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PageTableError {
    /// `page_size` is zero.
    #[error("page_size must be >= 1, got 0")]
    ZeroPageSize,
    /// `indptr` must have `num_requests + 1` entries.
    #[error("indptr has {len} entries, expected num_requests + 1 = {expected}")]
    IndptrLength {
        /// Actual length.
        len: usize,
        /// `num_requests + 1`.
        expected: usize,
    },
    /// A per-request array has the wrong length.
    #[error("{array} has {len} entries, expected num_requests = {num_requests}")]
    ScalarLength {
        /// Which array.
        array: &'static str,
        /// Actual length.
        len: usize,
        /// `last_page_len.len()`, the batch size.
        num_requests: usize,
    },
    /// `indptr[0]` must be 0.
    #[error("indptr[0] is {first}, must be 0")]
    IndptrStart {
        /// The value found.
        first: u32,
    },
    /// `indptr` must be non-decreasing.
    #[error("indptr decreases at request {request}: {start} > {end}")]
    IndptrDecreasing {
        /// The request whose range is reversed.
        request: usize,
        /// `indptr[request]`.
        start: u32,
        /// `indptr[request + 1]`.
        end: u32,
    },
    /// `indptr[num_requests]` must equal `indices.len()`.
    #[error("indptr ends at {last}, but indices has {num_indices} entries")]
    IndptrEnd {
        /// The last indptr entry.
        last: u32,
        /// `indices.len()`.
        num_indices: usize,
    },
    /// A page index is not below `num_pages`.
    #[error("indices[{position}] = {page} is out of range: the pool has {num_pages} pages")]
    PageOutOfRange {
        /// Position in `indices`.
        position: usize,
        /// The page id found.
        page: u32,
        /// Pages in the pool.
        num_pages: usize,
    },
    /// `first_page_offset` must be in `[0, page_size)`.
    #[error("request {request}: first_page_offset {first_page_offset} not in [0, {page_size})")]
    FirstPageOffsetOutOfRange {
        /// The request.
        request: usize,
        /// The value found.
        first_page_offset: u32,
        /// Tokens per page.
        page_size: usize,
    },
    /// `last_page_len` of a request with pages must be in `[1, page_size]`.
    #[error("request {request}: last_page_len {last_page_len} not in [1, {page_size}]")]
    LastPageLenOutOfRange {
        /// The request.
        request: usize,
        /// The value found.
        last_page_len: u32,
        /// Tokens per page.
        page_size: usize,
    },
    /// A request without pages must have zero `last_page_len`, `first_page_offset` and
    /// `seq_len`.
    #[error(
        "request {request} has no pages but non-zero scalars: last_page_len \
         {last_page_len}, first_page_offset {first_page_offset}, seq_len {seq_len}"
    )]
    EmptyRequestNonZero {
        /// The request.
        request: usize,
        /// The value found.
        last_page_len: u32,
        /// The value found.
        first_page_offset: u32,
        /// The value found.
        seq_len: u32,
    },
    /// `(pages - 1) * page_size + last_page_len - first_page_offset` must equal `seq_len`.
    #[error(
        "request {request}: pages and offsets give {expected} visible tokens, seq_lens says {seq_len}"
    )]
    VisibleLengthMismatch {
        /// The request.
        request: usize,
        /// The visible length implied by pages and offsets (may be negative).
        expected: i64,
        /// `seq_lens[request]`.
        seq_len: u32,
    },
    /// A request emits a page but has no visible token (only visible pages may be emitted).
    #[error("request {request} emits pages but has 0 visible tokens")]
    NoVisibleTokens {
        /// The request.
        request: usize,
    },
    /// `rope_offsets` (tokens written) cannot be below `seq_lens` (tokens visible).
    #[error("request {request}: rope_offset {rope_offset} < seq_len {seq_len}")]
    RopeOffsetBelowSeqLen {
        /// The request.
        request: usize,
        /// The value found.
        rope_offset: u32,
        /// `seq_lens[request]`.
        seq_len: u32,
    },
    /// Builder: the block table retains fewer pages than its token count needs.
    #[error(
        "request {request}: {num_tokens} tokens need {needed} pages, only {retained} retained"
    )]
    NotEnoughPages {
        /// The request.
        request: usize,
        /// Its token count.
        num_tokens: usize,
        /// Pages needed.
        needed: usize,
        /// Pages retained.
        retained: usize,
    },
    /// Builder: `logical_start` past `num_tokens`.
    #[error("request {request}: logical_start {logical_start} > num_tokens {num_tokens}")]
    LogicalStartPastEnd {
        /// The request.
        request: usize,
        /// The value found.
        logical_start: usize,
        /// Its token count.
        num_tokens: usize,
    },
    /// Builder: a count does not fit the table's `u32` arrays.
    #[error("{what} {value} does not fit in u32")]
    Overflow {
        /// What overflowed.
        what: &'static str,
        /// Its value.
        value: usize,
    },
}

/// The batch's pages in CSR form, plus host-side extras. All arrays are `u32`; `B` is the
/// number of requests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PageTable {
    /// `[total_pages]`: physical page ids, requests concatenated.
    pub indices: Vec<u32>,
    /// `[B + 1]`: request `r` owns `indices[indptr[r]..indptr[r + 1]]`.
    pub indptr: Vec<u32>,
    /// `[B]`: valid rows in the request's final page (`1..=page_size`; 0 if empty).
    pub last_page_len: Vec<u32>,
    /// `[B]`: first visible row inside the first emitted page (`0..page_size`).
    pub first_page_offset: Vec<u32>,
    /// `[B]` (host extra): visible tokens per request.
    pub seq_lens: Vec<u32>,
    /// `[B]` (host extra): tokens written, the absolute position of the next token. Differs
    /// from `seq_lens` exactly when a window trimmed the front.
    pub rope_offsets: Vec<u32>,
}

fn to_u32(what: &'static str, value: usize) -> Result<u32, PageTableError> {
    u32::try_from(value).map_err(|_| PageTableError::Overflow { what, value })
}

impl PageTable {
    /// Builds the table for `requests` (one row each, in order) and validates it against a
    /// pool of `num_pages` pages of `page_size` tokens. Emits pages
    /// `logical_start / page_size ..= (num_tokens - 1) / page_size` of each request.
    pub fn build(
        requests: &[PageTableRequest<'_>],
        num_pages: usize,
        page_size: usize,
    ) -> Result<Self, PageTableError> {
        if page_size == 0 {
            return Err(PageTableError::ZeroPageSize);
        }
        let mut table = PageTable {
            indptr: vec![0],
            ..Self::default()
        };
        for (request, entry) in requests.iter().enumerate() {
            if entry.logical_start > entry.num_tokens {
                return Err(PageTableError::LogicalStartPastEnd {
                    request,
                    logical_start: entry.logical_start,
                    num_tokens: entry.num_tokens,
                });
            }
            let needed = entry.num_tokens.div_ceil(page_size);
            if needed > entry.pages.len() {
                return Err(PageTableError::NotEnoughPages {
                    request,
                    num_tokens: entry.num_tokens,
                    needed,
                    retained: entry.pages.len(),
                });
            }
            let visible = entry.num_tokens - entry.logical_start;
            let (last_page_len, first_page_offset) = if visible == 0 {
                (0, 0)
            } else {
                let first_page = entry.logical_start / page_size;
                let last_page = (entry.num_tokens - 1) / page_size;
                table.indices.extend(
                    entry.pages[first_page..=last_page]
                        .iter()
                        .map(|page| page.0),
                );
                (
                    (entry.num_tokens - 1) % page_size + 1,
                    entry.logical_start % page_size,
                )
            };
            table
                .indptr
                .push(to_u32("total pages", table.indices.len())?);
            table.last_page_len.push(last_page_len as u32);
            table.first_page_offset.push(first_page_offset as u32);
            table.seq_lens.push(to_u32("seq_len", visible)?);
            table
                .rope_offsets
                .push(to_u32("num_tokens", entry.num_tokens)?);
        }
        table.validate(num_pages, page_size)?;
        Ok(table)
    }

    /// Builds the table for `block_tables` over `pool` (see [`PageTable::build`]).
    pub fn from_block_tables(
        block_tables: &[&BlockTable],
        pool: &BlockPool,
    ) -> Result<Self, PageTableError> {
        let requests: Vec<PageTableRequest<'_>> =
            block_tables.iter().map(|&table| table.into()).collect();
        Self::build(&requests, pool.num_pages(), pool.page_size())
    }

    /// Number of requests `B`.
    pub fn num_requests(&self) -> usize {
        self.last_page_len.len()
    }

    /// Pages emitted for request `r` (`indptr[r + 1] - indptr[r]`). Assumes a valid table
    /// and `r < num_requests()`.
    pub fn num_pages_of(&self, request: usize) -> usize {
        (self.indptr[request + 1] - self.indptr[request]) as usize
    }

    /// Pages emitted per request, `[B]`: the input of the split-KV planner.
    pub fn page_counts(&self) -> Vec<u32> {
        self.indptr
            .windows(2)
            .map(|pair| pair[1] - pair[0])
            .collect()
    }

    /// Checks every invariant against a pool of `num_pages` pages of `page_size` tokens:
    /// array lengths; indptr starts at 0, is non-decreasing and ends at `indices.len()`;
    /// every index `< num_pages`; `first_page_offset < page_size`; for requests with pages
    /// `last_page_len` in `[1, page_size]`, at least one visible token and the identity
    /// `(pages - 1) * page_size + last_page_len - first_page_offset == seq_len`; requests
    /// without pages have all-zero scalars; `rope_offsets >= seq_lens`. O(B + total_pages).
    pub fn validate(&self, num_pages: usize, page_size: usize) -> Result<(), PageTableError> {
        if page_size == 0 {
            return Err(PageTableError::ZeroPageSize);
        }
        let num_requests = self.num_requests();
        if self.indptr.len() != num_requests + 1 {
            return Err(PageTableError::IndptrLength {
                len: self.indptr.len(),
                expected: num_requests + 1,
            });
        }
        for (array, len) in [
            ("first_page_offset", self.first_page_offset.len()),
            ("seq_lens", self.seq_lens.len()),
            ("rope_offsets", self.rope_offsets.len()),
        ] {
            if len != num_requests {
                return Err(PageTableError::ScalarLength {
                    array,
                    len,
                    num_requests,
                });
            }
        }
        if self.indptr[0] != 0 {
            return Err(PageTableError::IndptrStart {
                first: self.indptr[0],
            });
        }
        for request in 0..num_requests {
            let (start, end) = (self.indptr[request], self.indptr[request + 1]);
            if end < start {
                return Err(PageTableError::IndptrDecreasing {
                    request,
                    start,
                    end,
                });
            }
        }
        let last = self.indptr[num_requests];
        if last as usize != self.indices.len() {
            return Err(PageTableError::IndptrEnd {
                last,
                num_indices: self.indices.len(),
            });
        }
        if let Some((position, &page)) = self
            .indices
            .iter()
            .enumerate()
            .find(|(_, &page)| page as usize >= num_pages)
        {
            return Err(PageTableError::PageOutOfRange {
                position,
                page,
                num_pages,
            });
        }
        for request in 0..num_requests {
            self.validate_request(request, page_size)?;
        }
        Ok(())
    }

    fn validate_request(&self, request: usize, page_size: usize) -> Result<(), PageTableError> {
        let pages = self.num_pages_of(request);
        let last_page_len = self.last_page_len[request];
        let first_page_offset = self.first_page_offset[request];
        let seq_len = self.seq_lens[request];
        if first_page_offset as usize >= page_size {
            return Err(PageTableError::FirstPageOffsetOutOfRange {
                request,
                first_page_offset,
                page_size,
            });
        }
        if pages == 0 {
            if last_page_len != 0 || first_page_offset != 0 || seq_len != 0 {
                return Err(PageTableError::EmptyRequestNonZero {
                    request,
                    last_page_len,
                    first_page_offset,
                    seq_len,
                });
            }
        } else {
            if last_page_len == 0 || last_page_len as usize > page_size {
                return Err(PageTableError::LastPageLenOutOfRange {
                    request,
                    last_page_len,
                    page_size,
                });
            }
            let expected = (pages as i64 - 1) * page_size as i64 + last_page_len as i64
                - first_page_offset as i64;
            if expected != seq_len as i64 {
                return Err(PageTableError::VisibleLengthMismatch {
                    request,
                    expected,
                    seq_len,
                });
            }
            if seq_len == 0 {
                return Err(PageTableError::NoVisibleTokens { request });
            }
        }
        let rope_offset = self.rope_offsets[request];
        if rope_offset < seq_len {
            return Err(PageTableError::RopeOffsetBelowSeqLen {
                request,
                rope_offset,
                seq_len,
            });
        }
        Ok(())
    }
}
