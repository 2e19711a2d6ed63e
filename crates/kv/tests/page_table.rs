//! The CSR page table: builder output checked by hand, and one test per validator invariant
//! showing a table that breaks exactly that invariant is rejected with its variant.

use pagoda_kv::{BlockPool, BlockTable, PageId, PageTable, PageTableError, PageTableRequest};

const PAGE_SIZE: usize = 4;
const NUM_PAGES: usize = 16;

/// Three requests: 6 tokens on pages [3, 1]; empty; 9 tokens with logical_start 5 on pages
/// [7, 2, 9] (page 7 fully retired, so only [2, 9] are emitted with first_page_offset 1).
fn valid_table() -> PageTable {
    let pages_a = [PageId(3), PageId(1)];
    let pages_c = [PageId(7), PageId(2), PageId(9)];
    let requests = [
        PageTableRequest {
            pages: &pages_a,
            num_tokens: 6,
            logical_start: 0,
        },
        PageTableRequest {
            pages: &[],
            num_tokens: 0,
            logical_start: 0,
        },
        PageTableRequest {
            pages: &pages_c,
            num_tokens: 9,
            logical_start: 5,
        },
    ];
    PageTable::build(&requests, NUM_PAGES, PAGE_SIZE).unwrap()
}

fn rejected(table: &PageTable) -> PageTableError {
    let error = table.validate(NUM_PAGES, PAGE_SIZE).unwrap_err();
    assert!(!error.to_string().is_empty());
    error
}

#[test]
fn builder_emits_only_visible_pages_with_offsets() {
    let table = valid_table();
    assert_eq!(table.indices, vec![3, 1, 2, 9]);
    assert_eq!(table.indptr, vec![0, 2, 2, 4]);
    assert_eq!(table.last_page_len, vec![2, 0, 1]);
    assert_eq!(table.first_page_offset, vec![0, 0, 1]);
    assert_eq!(table.seq_lens, vec![6, 0, 4]);
    assert_eq!(table.rope_offsets, vec![6, 0, 9]);
    assert_eq!(table.page_counts(), vec![2, 0, 2]);
}

#[test]
fn builder_from_block_tables_matches_pool() {
    let mut pool = BlockPool::new(NUM_PAGES, PAGE_SIZE).unwrap();
    let mut table = BlockTable::new();
    table.append_slots(&mut pool, 8).unwrap();
    table.set_logical_start(8).unwrap();
    let page_table = PageTable::from_block_tables(&[&table], &pool).unwrap();
    // Everything trimmed: the request is empty, not a page with zero visible tokens.
    assert_eq!(page_table.indptr, vec![0, 0]);
    assert_eq!(page_table.rope_offsets, vec![8]);
}

#[test]
fn builder_rejects_too_few_pages_and_bad_logical_start() {
    let pages = [PageId(0)];
    let short = [PageTableRequest {
        pages: &pages,
        num_tokens: 5,
        logical_start: 0,
    }];
    assert!(matches!(
        PageTable::build(&short, NUM_PAGES, PAGE_SIZE),
        Err(PageTableError::NotEnoughPages {
            needed: 2,
            retained: 1,
            ..
        })
    ));
    let late = [PageTableRequest {
        pages: &pages,
        num_tokens: 2,
        logical_start: 3,
    }];
    assert!(matches!(
        PageTable::build(&late, NUM_PAGES, PAGE_SIZE),
        Err(PageTableError::LogicalStartPastEnd { .. })
    ));
    let out_of_pool = [PageId(99)];
    let bad = [PageTableRequest {
        pages: &out_of_pool,
        num_tokens: 1,
        logical_start: 0,
    }];
    assert!(matches!(
        PageTable::build(&bad, NUM_PAGES, PAGE_SIZE),
        Err(PageTableError::PageOutOfRange { page: 99, .. })
    ));
}

#[test]
fn valid_table_validates() {
    valid_table().validate(NUM_PAGES, PAGE_SIZE).unwrap();
}

#[test]
fn rejects_zero_page_size() {
    assert_eq!(
        valid_table().validate(NUM_PAGES, 0),
        Err(PageTableError::ZeroPageSize)
    );
}

#[test]
fn rejects_indptr_of_wrong_length() {
    let mut table = valid_table();
    table.indptr.pop();
    assert!(matches!(
        rejected(&table),
        PageTableError::IndptrLength {
            len: 3,
            expected: 4
        }
    ));
}

#[test]
fn rejects_scalar_array_of_wrong_length() {
    let mut table = valid_table();
    table.seq_lens.push(0);
    assert!(matches!(
        rejected(&table),
        PageTableError::ScalarLength {
            array: "seq_lens",
            len: 4,
            num_requests: 3
        }
    ));
}

#[test]
fn rejects_indptr_not_starting_at_zero() {
    let mut table = valid_table();
    table.indptr[0] = 1;
    assert_eq!(rejected(&table), PageTableError::IndptrStart { first: 1 });
}

#[test]
fn rejects_decreasing_indptr() {
    let mut table = valid_table();
    table.indptr[2] = 1;
    assert_eq!(
        rejected(&table),
        PageTableError::IndptrDecreasing {
            request: 1,
            start: 2,
            end: 1
        }
    );
}

#[test]
fn rejects_indptr_not_ending_at_indices_len() {
    let mut table = valid_table();
    table.indices.push(0);
    assert_eq!(
        rejected(&table),
        PageTableError::IndptrEnd {
            last: 4,
            num_indices: 5
        }
    );
}

#[test]
fn rejects_page_index_out_of_pool() {
    let mut table = valid_table();
    table.indices[3] = NUM_PAGES as u32;
    assert_eq!(
        rejected(&table),
        PageTableError::PageOutOfRange {
            position: 3,
            page: 16,
            num_pages: NUM_PAGES
        }
    );
}

#[test]
fn rejects_first_page_offset_out_of_range() {
    let mut table = valid_table();
    table.first_page_offset[2] = PAGE_SIZE as u32;
    assert!(matches!(
        rejected(&table),
        PageTableError::FirstPageOffsetOutOfRange {
            request: 2,
            first_page_offset: 4,
            ..
        }
    ));
}

#[test]
fn rejects_last_page_len_zero_or_above_page_size() {
    let mut table = valid_table();
    table.last_page_len[0] = 0;
    assert!(matches!(
        rejected(&table),
        PageTableError::LastPageLenOutOfRange {
            request: 0,
            last_page_len: 0,
            ..
        }
    ));
    table.last_page_len[0] = PAGE_SIZE as u32 + 1;
    assert!(matches!(
        rejected(&table),
        PageTableError::LastPageLenOutOfRange {
            request: 0,
            last_page_len: 5,
            ..
        }
    ));
}

#[test]
fn rejects_empty_request_with_nonzero_scalars() {
    for field in 0..3 {
        let mut table = valid_table();
        match field {
            0 => table.last_page_len[1] = 1,
            1 => table.first_page_offset[1] = 1,
            _ => table.seq_lens[1] = 1,
        }
        assert!(matches!(
            rejected(&table),
            PageTableError::EmptyRequestNonZero { request: 1, .. }
        ));
    }
}

#[test]
fn rejects_visible_length_mismatch() {
    let mut table = valid_table();
    table.seq_lens[2] = 5;
    assert_eq!(
        rejected(&table),
        PageTableError::VisibleLengthMismatch {
            request: 2,
            expected: 4,
            seq_len: 5
        }
    );
}

#[test]
fn rejects_emitted_page_without_visible_tokens() {
    let mut table = valid_table();
    // One page whose only visible range is empty: last_page_len == first_page_offset.
    table.indices = vec![3];
    table.indptr = vec![0, 1];
    table.last_page_len = vec![2];
    table.first_page_offset = vec![2];
    table.seq_lens = vec![0];
    table.rope_offsets = vec![2];
    assert_eq!(
        rejected(&table),
        PageTableError::NoVisibleTokens { request: 0 }
    );
}

#[test]
fn rejects_rope_offset_below_seq_len() {
    let mut table = valid_table();
    table.rope_offsets[0] = 5;
    assert_eq!(
        rejected(&table),
        PageTableError::RopeOffsetBelowSeqLen {
            request: 0,
            rope_offset: 5,
            seq_len: 6
        }
    );
}
