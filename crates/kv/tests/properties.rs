//! Property tests: random sequences of allocate / append / fork / share / copy-on-write /
//! window / release keep the pool consistent with its owners, and every page table built
//! from the live block tables validates and addresses exactly the visible tokens.

use std::collections::HashMap;

use pagoda_kv::{AppendError, BlockPool, BlockTable, PageId, PageTable};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Operation {
    NewSequence { num_tokens: usize },
    Append { sequence: usize, num_tokens: usize },
    Fork { sequence: usize },
    SharePrefix { sequence: usize, fraction: u8 },
    MakeExclusive { sequence: usize },
    SlideWindow { sequence: usize, fraction: u8 },
    Release { sequence: usize },
}

fn operation() -> impl Strategy<Value = Operation> {
    prop_oneof![
        (0usize..40).prop_map(|num_tokens| Operation::NewSequence { num_tokens }),
        (any::<usize>(), 0usize..20).prop_map(|(sequence, num_tokens)| Operation::Append {
            sequence,
            num_tokens
        }),
        any::<usize>().prop_map(|sequence| Operation::Fork { sequence }),
        (any::<usize>(), any::<u8>())
            .prop_map(|(sequence, fraction)| Operation::SharePrefix { sequence, fraction }),
        any::<usize>().prop_map(|sequence| Operation::MakeExclusive { sequence }),
        (any::<usize>(), any::<u8>())
            .prop_map(|(sequence, fraction)| Operation::SlideWindow { sequence, fraction }),
        any::<usize>().prop_map(|sequence| Operation::Release { sequence }),
    ]
}

/// Applies one operation; failures that are legitimate outcomes (out of pages, shared last
/// page) must leave the state untouched, which the invariant check then verifies.
fn apply(pool: &mut BlockPool, tables: &mut Vec<BlockTable>, operation: &Operation) {
    let pick = |index: usize, tables: &Vec<BlockTable>| index % tables.len();
    match *operation {
        Operation::NewSequence { num_tokens } => {
            let mut table = BlockTable::new();
            if table.append_slots(pool, num_tokens).is_ok() {
                tables.push(table);
            }
        }
        _ if tables.is_empty() => {}
        Operation::Append {
            sequence,
            num_tokens,
        } => {
            let index = pick(sequence, tables);
            let before = tables[index].clone();
            match tables[index].append_slots(pool, num_tokens) {
                Ok(slots) => {
                    assert_eq!(slots.len(), num_tokens);
                    for (token, slot) in (before.num_tokens()..).zip(&slots) {
                        assert_eq!(tables[index].slot(token, pool.page_size()), Some(*slot));
                        assert_eq!(pool.refcount(slot.page), Ok(1), "new token in shared page");
                    }
                }
                Err(AppendError::OutOfPages { .. } | AppendError::SharedLastPage { .. }) => {
                    assert_eq!(tables[index], before);
                }
                Err(error) => panic!("unexpected append error: {error}"),
            }
        }
        Operation::Fork { sequence } => {
            let forked = tables[pick(sequence, tables)].fork(pool).unwrap();
            tables.push(forked);
        }
        Operation::SharePrefix { sequence, fraction } => {
            let source = &tables[pick(sequence, tables)];
            let num_tokens = source.num_tokens() * fraction as usize / 255;
            let shared = source.share_prefix(pool, num_tokens).unwrap();
            tables.push(shared);
        }
        Operation::MakeExclusive { sequence } => {
            let index = pick(sequence, tables);
            if let Ok(Some(copy)) = tables[index].make_last_page_exclusive(pool) {
                assert_ne!(copy.source, copy.destination);
                assert_eq!(pool.refcount(copy.destination), Ok(1));
            }
        }
        Operation::SlideWindow { sequence, fraction } => {
            let index = pick(sequence, tables);
            let table = &mut tables[index];
            let start = table.num_tokens() * fraction as usize / 255;
            table
                .set_logical_start(start.max(table.logical_start()))
                .unwrap();
        }
        Operation::Release { sequence } => {
            let mut table = tables.swap_remove(pick(sequence, tables));
            table.release(pool).unwrap();
        }
    }
}

fn check_invariants(pool: &BlockPool, tables: &[BlockTable]) {
    let mut owners: HashMap<PageId, u32> = HashMap::new();
    for table in tables {
        assert_eq!(
            table.pages().len(),
            table.num_tokens().div_ceil(pool.page_size())
        );
        for &page in table.pages() {
            *owners.entry(page).or_default() += 1;
        }
    }
    let mut seen_free = vec![false; pool.num_pages()];
    for &page in pool.free_pages() {
        assert!(!seen_free[page.index()], "{page} twice on the free list");
        seen_free[page.index()] = true;
        assert!(!owners.contains_key(&page), "{page} both free and owned");
    }
    for index in 0..pool.num_pages() {
        let page = PageId(index as u32);
        let owned = owners.get(&page).copied().unwrap_or(0);
        assert_eq!(
            pool.refcount(page),
            Ok(owned),
            "refcount of {page} != owners"
        );
        assert_eq!(seen_free[index], owned == 0, "{page} free-list membership");
    }
    assert_eq!(pool.num_free() + pool.num_used(), pool.num_pages());

    let refs: Vec<&BlockTable> = tables.iter().collect();
    let page_table = PageTable::from_block_tables(&refs, pool).unwrap();
    page_table
        .validate(pool.num_pages(), pool.page_size())
        .unwrap();
    // The CSR addressing reaches exactly the block table's slot of every visible token.
    let page_size = pool.page_size();
    for (request, table) in tables.iter().enumerate() {
        assert_eq!(
            page_table.seq_lens[request] as usize,
            table.num_visible_tokens()
        );
        let first = page_table.indptr[request] as usize;
        for visible in 0..table.num_visible_tokens() {
            let absolute = page_table.first_page_offset[request] as usize + visible;
            let page = page_table.indices[first + absolute / page_size];
            let slot = table
                .slot(table.logical_start() + visible, page_size)
                .unwrap();
            assert_eq!(
                (PageId(page), (absolute % page_size) as u32),
                (slot.page, slot.offset)
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn pool_and_tables_stay_consistent(
        num_pages in 1usize..24,
        page_size in 1usize..9,
        operations in proptest::collection::vec(operation(), 1..60),
    ) {
        let mut pool = BlockPool::new(num_pages, page_size).unwrap();
        let mut tables = Vec::new();
        for operation in &operations {
            apply(&mut pool, &mut tables, operation);
            check_invariants(&pool, &tables);
        }
        for mut table in tables.drain(..) {
            table.release(&mut pool).unwrap();
        }
        prop_assert_eq!(pool.num_free(), num_pages);
    }
}
