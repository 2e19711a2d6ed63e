//! `ShareGroups` against hand-made cases and, on random page tables, a brute-force oracle:
//! position `k` of request `r` is shared with exactly the eligible requests whose whole
//! visible pages agree with `r`'s on `0..=k`.

use pagoda_kv::{BlockPool, BlockTable, PageTable, ShareGroups};
use proptest::prelude::*;

const PAGE: usize = 4;

/// A table over explicit page lists; `seq_lens[r]` visible tokens from offset 0.
fn table(lists: &[Vec<u32>], seq_lens: &[usize]) -> PageTable {
    let mut t = PageTable {
        indptr: vec![0],
        ..PageTable::default()
    };
    for (pages, &len) in lists.iter().zip(seq_lens) {
        assert_eq!(pages.len(), len.div_ceil(PAGE));
        t.indices.extend(pages);
        t.indptr.push(t.indices.len() as u32);
        t.last_page_len.push(if len == 0 {
            0
        } else {
            ((len - 1) % PAGE + 1) as u32
        });
        t.first_page_offset.push(0);
        t.seq_lens.push(len as u32);
        t.rope_offsets.push(len as u32);
    }
    t.validate(1024, PAGE).unwrap();
    t
}

/// `(pages, members)` of every group, by level.
fn summary(groups: &ShareGroups) -> Vec<(usize, std::ops::Range<usize>, Vec<usize>)> {
    groups
        .groups()
        .iter()
        .map(|g| (g.level, g.pages.clone(), g.members.clone()))
        .collect()
}

#[test]
fn no_sharing_gives_no_group() {
    let t = table(&[vec![0, 1], vec![2, 3], vec![4]], &[8, 7, 4]);
    let groups = ShareGroups::build(&t, PAGE, |_| true);
    assert!(groups.groups().is_empty());
    assert_eq!(groups.num_levels(), 0);
    assert_eq!(groups.tail(0), 0..2);
    assert_eq!(groups.tail(2), 0..1);
    assert!(groups.path(1).is_empty());
    assert_eq!(groups.pages_saved(), 0);
}

#[test]
fn a_group_of_one_is_no_group() {
    // Request 1 alone holds pages 0-2 (its own long prefix): nothing is shared.
    let t = table(&[vec![0, 1, 2, 9], vec![5, 6]], &[16, 8]);
    assert!(ShareGroups::build(&t, PAGE, |_| true).groups().is_empty());
}

#[test]
fn one_system_prompt_then_private_tails() {
    // Three requests behind pages 0, 1; their own pages after.
    let t = table(
        &[vec![0, 1, 10], vec![0, 1, 11, 12], vec![0, 1, 13]],
        &[9, 14, 12],
    );
    let groups = ShareGroups::build(&t, PAGE, |_| true);
    assert_eq!(summary(&groups), vec![(0, 0..2, vec![0, 1, 2])]);
    assert_eq!(groups.tail(0), 2..3);
    assert_eq!(groups.tail(1), 2..4);
    assert_eq!(groups.path(2), vec![0]);
    assert_eq!(groups.pages_saved(), 4);
}

#[test]
fn nested_groups_follow_the_trie() {
    // 0,1,2,3 share page 0; 0,1 also pages 1,2; 2,3 also page 4; 1 and 0 part at page 3.
    // Request 4 shares nothing; request 5 shares page 7 with nobody in the batch.
    let t = table(
        &[
            vec![0, 1, 2, 20],
            vec![0, 1, 2, 21, 22],
            vec![0, 4, 30],
            vec![0, 4, 31],
            vec![40, 41],
            vec![7],
        ],
        &[16, 20, 12, 9, 5, 3],
    );
    let groups = ShareGroups::build(&t, PAGE, |_| true);
    assert_eq!(
        summary(&groups),
        vec![
            (0, 0..1, vec![0, 1, 2, 3]),
            (1, 1..3, vec![0, 1]),
            (1, 1..2, vec![2, 3]),
        ]
    );
    assert_eq!(groups.num_levels(), 2);
    assert_eq!(groups.level(1).count(), 2);
    assert_eq!(groups.path(1), vec![0, 1]);
    assert_eq!(groups.path(3), vec![0, 2]);
    assert_eq!(groups.groups()[1].parent, Some(0));
    assert_eq!(groups.tail(0), 3..4);
    assert_eq!(groups.tail(3), 2..3);
    assert_eq!(groups.tail(4), 0..2);
    assert_eq!(groups.tail(5), 0..1);
    // Group 0: 1 page x 3 extra members; group 1: 2 pages x 1; group 2: 1 page x 1.
    assert_eq!(groups.pages_saved(), 3 + 2 + 1);
}

#[test]
fn only_whole_visible_pages_are_shared() {
    // Requests 0 and 1 both list page 5 second, but request 1 sees 2 of its rows only (a
    // forked partial page): page 5 is not shared. Page 0 is.
    let t = table(&[vec![0, 5, 6], vec![0, 5]], &[9, 6]);
    let groups = ShareGroups::build(&t, PAGE, |_| true);
    assert_eq!(summary(&groups), vec![(0, 0..1, vec![0, 1])]);
    assert_eq!(groups.tail(1), 1..2);
    // The same lists with page 5 full for both: shared, and request 1's tail is empty.
    let t = table(&[vec![0, 5, 6], vec![0, 5]], &[9, 8]);
    let groups = ShareGroups::build(&t, PAGE, |_| true);
    assert_eq!(summary(&groups), vec![(0, 0..2, vec![0, 1])]);
    assert!(groups.tail(1).is_empty());
}

#[test]
fn ineligible_requests_and_offsets_share_nothing() {
    let mut t = table(
        &[vec![0, 1, 2], vec![0, 1, 3], vec![0, 1, 4]],
        &[10, 10, 10],
    );
    let groups = ShareGroups::build(&t, PAGE, |r| r != 1);
    assert_eq!(summary(&groups), vec![(0, 0..2, vec![0, 2])]);
    assert_eq!(groups.tail(1), 0..3);
    // A window that starts mid-page shifts every row: request 2 shares nothing.
    t.first_page_offset[2] = 1;
    t.seq_lens[2] = 9;
    let groups = ShareGroups::build(&t, PAGE, |_| true);
    assert_eq!(summary(&groups), vec![(0, 0..2, vec![0, 1])]);
}

#[test]
fn prefix_shared_through_block_tables() {
    // A 10-token prompt (2 full pages and 2 rows) forked: the partial page is one page id
    // in both lists but not whole, so only the full pages are shared; after copy-on-write
    // each request owns its own third page.
    let mut pool = BlockPool::new(16, PAGE).unwrap();
    let mut first = BlockTable::new();
    first.append_slots(&mut pool, 10).unwrap();
    let mut second = first.fork(&mut pool).unwrap();
    let t = PageTable::from_block_tables(&[&first, &second], &pool).unwrap();
    assert_eq!(
        t.indices[2], t.indices[5],
        "the fork shares the partial page"
    );
    let groups = ShareGroups::build(&t, PAGE, |_| true);
    assert_eq!(summary(&groups), vec![(0, 0..2, vec![0, 1])]);
    assert_eq!(groups.tail(1), 2..3);
    for table in [&mut second, &mut first] {
        table.make_last_page_exclusive(&mut pool).unwrap();
        table.append_slots(&mut pool, 1).unwrap();
    }
    let t = PageTable::from_block_tables(&[&first, &second], &pool).unwrap();
    assert_ne!(
        t.indices[2], t.indices[5],
        "copy-on-write gave each its own page"
    );
    let groups = ShareGroups::build(&t, PAGE, |_| true);
    assert_eq!(summary(&groups), vec![(0, 0..2, vec![0, 1])]);
}

/// Brute force: whole visible pages request `r` shares with `other` from the start.
fn common_pages(t: &PageTable, r: usize, other: usize) -> usize {
    let full = |x: usize| t.seq_lens[x] as usize / PAGE;
    let pages = |x: usize| &t.indices[t.indptr[x] as usize..t.indptr[x + 1] as usize];
    let limit = full(r).min(full(other));
    (0..limit)
        .take_while(|&k| pages(r)[k] == pages(other)[k])
        .count()
}

proptest! {
    #[test]
    fn groups_match_the_brute_force_oracle(
        // Requests as (branch choices, private pages, rows in the last page).
        requests in prop::collection::vec(
            (prop::collection::vec(0u32..3, 0..5), 0usize..3, 1usize..=PAGE),
            1..9,
        ),
        eligible_mask in any::<u16>(),
    ) {
        // Page ids from a trie: the id at depth d is a function of the branch path so far,
        // so equal ids mean equal prefixes, as in the prefix cache.
        let mut ids = std::collections::HashMap::new();
        let mut next_private = 500u32;
        let mut lists = Vec::new();
        let mut lens = Vec::new();
        for (path, private, last_rows) in &requests {
            let mut pages = Vec::new();
            for depth in 0..path.len() {
                let len = ids.len() as u32;
                pages.push(*ids.entry(path[..=depth].to_vec()).or_insert(len));
            }
            for _ in 0..*private {
                pages.push(next_private);
                next_private += 1;
            }
            if pages.is_empty() {
                pages.push(next_private);
                next_private += 1;
            }
            let len = (pages.len() - 1) * PAGE + last_rows;
            lists.push(pages);
            lens.push(len);
        }
        let t = table(&lists, &lens);
        let eligible = |r: usize| eligible_mask & (1 << r) != 0;
        let groups = ShareGroups::build(&t, PAGE, eligible);
        for r in 0..t.num_requests() {
            let path = groups.path(r);
            prop_assert!(eligible(r) || path.is_empty());
            // Positions covered by the path are contiguous from 0 and end at the tail.
            let mut next = 0;
            for &g in &path {
                let group = &groups.groups()[g];
                prop_assert_eq!(group.pages.start, next);
                prop_assert!(group.members.len() >= 2 && group.members.contains(&r));
                next = group.pages.end;
                // Members are exactly the eligible requests agreeing on 0..pages.end.
                let expected: Vec<usize> = (0..t.num_requests())
                    .filter(|&o| eligible(o) && common_pages(&t, r, o) >= group.pages.end)
                    .collect();
                prop_assert_eq!(&group.members, &expected);
            }
            prop_assert_eq!(groups.tail(r).start, next);
            prop_assert_eq!(groups.tail(r).end, t.num_pages_of(r));
            // Nobody else shares the tail's first page (else the group would go on).
            if eligible(r) {
                let sharers = (0..t.num_requests())
                    .filter(|&o| o != r && eligible(o) && common_pages(&t, r, o) > next)
                    .count();
                prop_assert_eq!(sharers, 0);
            }
        }
        for group in groups.groups() {
            prop_assert!(!group.pages.is_empty());
            if let Some(parent) = group.parent {
                let parent = &groups.groups()[parent];
                prop_assert_eq!(parent.level + 1, group.level);
                prop_assert_eq!(parent.pages.end, group.pages.start);
                prop_assert!(group.members.iter().all(|m| parent.members.contains(m)));
            } else {
                prop_assert_eq!(group.level, 0);
            }
        }
    }
}
