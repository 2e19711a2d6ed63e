//! The cascade decode plan (host code of the CUDA cascade) against an oracle on random
//! shared-prefix batches: for every request, the pages its shared items read (in slot order)
//! followed by its suffix pages are exactly its page list; every reserved slot of the fused
//! decode's plan is written by exactly one (item, member) and no other chunk is reserved;
//! tiles hold at most `rows / group` members; the savings are the share groups'. Plus the
//! rule (nested levels used only under used parents) and the encoding.

mod cascade_common;

use cascade_common::{shared_batch, SharedBatch};
use pagoda_kv::{PageTable, ShareGroups};
use pagoda_ops::attention::CascadeRule;
use pagoda_ops::cuda::{
    CascadeCapacity, CascadeGeometry, CascadePlan, PlanCapacity, PlanPolicy, RESERVED_CHUNK,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

const PAGE: usize = 16;
const KV_HEADS: usize = 8;

fn geometry(rows: usize, group: usize) -> CascadeGeometry {
    CascadeGeometry {
        page_size: PAGE,
        num_kv_heads: KV_HEADS,
        group,
        rows,
        target_ctas: 264,
        min_chunk_tokens: 64,
        max_slots: 16,
    }
}

fn plan_of(
    table: &PageTable,
    geometry: &CascadeGeometry,
    rule: &CascadeRule,
) -> Option<CascadePlan> {
    let b = table.num_requests();
    let policy = PlanPolicy {
        target_ctas: 264,
        pages_per_chunk: None,
        min_pages_per_chunk: 4,
        resident_ctas: None,
    };
    let mut capacity = PlanCapacity::for_batch(b, KV_HEADS, 264);
    capacity.max_chunks += b * 64;
    let shared = CascadeCapacity {
        max_items: 1 << 14,
        max_members: 1 << 16,
    };
    CascadePlan::new(table, geometry, rule, (policy, capacity), shared).unwrap()
}

/// The oracle checks of one plan (see the module docs).
fn check(batch: &SharedBatch, table: &PageTable, plan: &CascadePlan, geometry: &CascadeGeometry) {
    let b = table.num_requests();
    let decode = &plan.decode;
    assert_eq!(decode.o_indptr.len(), b + 1);
    // slot -> (request, pages read), from the items.
    let mut written = vec![None; decode.num_chunks()];
    for item in &plan.items {
        let [page_begin, num_keys, member_begin, members] = item.map(|w| w as usize);
        assert_eq!(num_keys % PAGE, 0, "items hold whole pages");
        assert!(members >= 1 && members <= geometry.rows / geometry.group);
        let pages = &table.indices[page_begin..page_begin + num_keys / PAGE];
        for &[q_row, slot] in &plan.members[member_begin..member_begin + members] {
            let (request, slot) = (q_row as usize, slot as usize);
            assert!(written[slot].is_none(), "slot {slot} written twice");
            written[slot] = Some((request, pages.to_vec()));
        }
    }
    for r in 0..b {
        let range = decode.o_indptr[r] as usize..decode.o_indptr[r + 1] as usize;
        let reserved = range
            .clone()
            .filter(|&c| decode.request_indices[c] == RESERVED_CHUNK)
            .count();
        assert!(
            reserved <= geometry.max_slots,
            "request {r}: {reserved} shared slots"
        );
        let mut read = Vec::new();
        for chunk in range.clone() {
            if decode.request_indices[chunk] == RESERVED_CHUNK {
                let (request, pages) = written[chunk]
                    .take()
                    .unwrap_or_else(|| panic!("reserved slot {chunk} of request {r} unwritten"));
                assert_eq!(request, r, "slot {chunk} belongs to request {r}");
                read.extend(pages);
            } else {
                assert_eq!(decode.request_indices[chunk] as usize, r);
                assert!(
                    written[chunk].is_none(),
                    "a decode chunk was written by an item"
                );
            }
        }
        let suffix = &plan.suffix;
        let own = &suffix.indices[suffix.indptr[r] as usize..suffix.indptr[r + 1] as usize];
        read.extend_from_slice(own);
        assert_eq!(
            read, batch.lists[r],
            "request {r}: shared items + suffix != its pages"
        );
        let shared_tokens = (batch.lists[r].len() - own.len()) * PAGE;
        let own_tokens = if own.is_empty() {
            0
        } else {
            (own.len() - 1) * PAGE + suffix.last_page_len[r] as usize
        };
        assert_eq!(
            shared_tokens + own_tokens,
            batch.seq_lens[r],
            "request {r}: tokens"
        );
        assert_eq!(suffix.first_page_offset[r], 0);
    }
    assert!(
        written.iter().all(Option::is_none),
        "an item wrote outside reserved slots"
    );
}

#[test]
fn random_shared_batches_cover_every_page_once() {
    let mut rng = ChaCha8Rng::seed_from_u64(36);
    let mut planned = 0;
    for case in 0..300 {
        let batch_size = 2 + case % 40;
        let twins = case % 3 == 0;
        let batch = shared_batch(&mut rng, batch_size, (40, 20), (PAGE, 1_000_003), twins);
        let table = batch.table(PAGE);
        table.validate(1_000_003, PAGE).unwrap();
        let (rows, group) = [(64, 4), (128, 4), (64, 8), (128, 1), (64, 64)][case % 5];
        let g = geometry(rows, group);
        let Some(plan) = plan_of(&table, &g, &CascadeRule::ANY) else {
            assert!(ShareGroups::build(&table, PAGE, |_| true)
                .groups()
                .is_empty());
            continue;
        };
        planned += 1;
        check(&batch, &table, &plan, &g);
        // Under the rule that takes every group, the savings are the share groups'.
        let groups = ShareGroups::build(&table, PAGE, |_| true);
        assert_eq!(plan.stats.groups, groups.groups().len());
        assert_eq!(plan.stats.saved_token_reads, groups.pages_saved() * PAGE);
    }
    assert!(planned > 200, "only {planned} cases shared pages");
}

#[test]
fn a_level_is_used_only_under_used_parents() {
    // Requests 0-3 share 2 pages; 0-1 share 20 more. A rule wanting 10+ shared pages per
    // level takes neither the outer level (2 pages) nor, under it, the inner one.
    let own = |id: u32| vec![1000 + id];
    let outer = vec![1, 2];
    let inner: Vec<u32> = (10..30).collect();
    let mut lists = Vec::new();
    for r in 0..4u32 {
        let mut list = outer.clone();
        if r < 2 {
            list.extend(&inner);
        }
        list.extend(own(r));
        lists.push(list);
    }
    let seq_lens = lists.iter().map(|l| l.len() * PAGE - 3).collect();
    let batch = SharedBatch { lists, seq_lens };
    let table = batch.table(PAGE);
    let rule = |min_shared_tokens| CascadeRule {
        min_members: 2,
        min_shared_tokens,
        min_saved_tokens: 0,
    };
    let g = geometry(64, 4);
    assert!(plan_of(&table, &g, &rule(10 * PAGE)).is_none());
    // Both levels pay at 2 pages: outer 3 x 2 pages, inner 1 x 20 pages saved.
    let plan = plan_of(&table, &g, &rule(2 * PAGE)).unwrap();
    check(&batch, &table, &plan, &g);
    assert_eq!(plan.stats.groups, 2);
    assert_eq!(plan.stats.saved_token_reads, (3 * 2 + 20) * PAGE);
    // A request outside every group keeps its whole list.
    assert_eq!(plan.suffix.indptr[4] - plan.suffix.indptr[3], 1);
}

#[test]
fn the_encoding_holds_items_then_members() {
    let batch = SharedBatch {
        lists: vec![vec![7, 8, 9], vec![7, 8, 4]],
        seq_lens: vec![3 * PAGE - 1, 3 * PAGE - 5],
    };
    let table = batch.table(PAGE);
    let plan = plan_of(&table, &geometry(64, 4), &CascadeRule::ANY).unwrap();
    assert_eq!(plan.items.len(), 1);
    let capacity = CascadeCapacity {
        max_items: 3,
        max_members: 4,
    };
    let words = plan.encode(capacity).unwrap();
    assert_eq!(words.len(), 2 + 4 * 3 + 2 * 4);
    assert_eq!(words[0], 1);
    // One item: pages 7, 8 from index 0, two members.
    assert_eq!(&words[2..6], &[0, 2 * PAGE as u32, 0, 2]);
    let members = &words[2 + 4 * 3..];
    assert_eq!([members[0], members[2]], [0, 1]);
    let slots = [members[1], members[3]];
    assert_eq!(slots, [plan.decode.o_indptr[0], plan.decode.o_indptr[1]]);
    let small = CascadeCapacity {
        max_items: 0,
        max_members: 4,
    };
    assert!(plan.encode(small).is_err());
}

#[test]
fn padding_requests_get_no_pages_and_no_shared_slots() {
    let mut rng = ChaCha8Rng::seed_from_u64(38);
    let batch = shared_batch(&mut rng, 12, (40, 20), (PAGE, 1_000_003), true);
    let table = batch.table(PAGE);
    let b = table.num_requests();
    let g = geometry(64, 4);
    let unpadded = plan_of(&table, &g, &CascadeRule::ANY).unwrap();
    let groups = ShareGroups::build(&table, PAGE, |_| true);
    let policy = PlanPolicy {
        target_ctas: 264,
        pages_per_chunk: None,
        min_pages_per_chunk: 4,
        resident_ctas: None,
    };
    let mut capacity = PlanCapacity::for_batch(b + 4, KV_HEADS, 264);
    capacity.max_chunks += (b + 4) * 64;
    let shared = CascadeCapacity {
        max_items: 1 << 14,
        max_members: 1 << 16,
    };
    let step = (&table, &groups, b + 4);
    let padded = CascadePlan::from_groups(step, &g, &CascadeRule::ANY, (policy, capacity), shared)
        .unwrap()
        .unwrap();
    // The real requests as planned without padding; four empty requests after them.
    assert_eq!(padded.items, unpadded.items);
    assert_eq!(padded.suffix.indptr.len(), b + 5);
    assert_eq!(padded.suffix.indptr[b..], [padded.suffix.indptr[b]; 5]);
    assert_eq!(padded.suffix.last_page_len[b..], [0; 4]);
    assert_eq!(padded.decode.o_indptr.len(), b + 5);
    for r in b..b + 4 {
        let range = padded.decode.o_indptr[r] as usize..padded.decode.o_indptr[r + 1] as usize;
        assert_eq!(range.len(), 1, "padding request {r}: one empty chunk");
        assert_eq!(padded.decode.request_indices[range.start] as usize, r);
    }
}
