//! Paged KV-cache bookkeeping: pure logic over integers, no tensors, no device.
//!
//! - [`BlockPool`]: the pages, a free list and per-page refcounts.
//! - [`BlockTable`]: one sequence's pages and token counters; hands out [`Slot`]s for new
//!   tokens, forks and shares prefixes by refcount, copy-on-write for a shared partial page.
//! - [`PageTable`]: the batch's CSR view (`indices`, `indptr`, `last_page_len`,
//!   `first_page_offset`, plus `seq_lens`/`rope_offsets`) that attention reads, with a
//!   validator for every invariant.
//! - [`ShareGroups`]: which requests of a step share leading pages (a trie over the page
//!   table's ids), the plan of cascade attention.
//! - [`PrefixCache`]: full pages keyed by a chained token hash, shared by refcount, evicted
//!   least-recently-used when the pool runs dry.

pub mod block_table;
pub mod cascade;
pub mod page_table;
pub mod pool;
pub mod prefix_cache;

pub use block_table::{AppendError, BlockTable, BlockTableError, PageCopy, Slot};
pub use cascade::{ShareGroup, ShareGroups};
pub use page_table::{PageTable, PageTableError, PageTableRequest};
pub use pool::{BlockPool, PageId, PoolError, DEFAULT_PAGE_SIZE};
pub use prefix_cache::{hash_page, CacheEvent, PrefixCache, PrefixMatch, ROOT_HASH};
