//! The host plan of the device Quest selection (`SparseSelectPlan`, no GPU needed) against
//! the CPU selector (`QuestSelector`): on random batches (page sizes 16 and 32, trimmed
//! fronts, multi-row prefill requests, requests without settings, contexts around
//! `min_context` and the budget, windows longer than the context), the selected table's row
//! pointer, lengths, offsets and counters are the CPU's, and the words the device reads name
//! the pages the CPU keeps around the scored middle.

use pagoda_kv::{PageId, PageTable, PageTableRequest};
use pagoda_ops::attention::{
    DecodeSelector, KeySummaries, KvLayout, KvPool, KvType, PagedKv, QueryBatch, QuestSelector,
    SparseAttention,
};
use pagoda_ops::cuda::{SparseSelectPlan, SPARSE_DENSE, SPARSE_MAX_PAGES, SPARSE_REQUEST_WORDS};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const NUM_PAGES: usize = 1 << 13;
const HEAD_DIM: usize = 4;

struct Batch {
    table: PageTable,
    qo_indptr: Vec<u32>,
    params: Vec<Option<SparseAttention>>,
}

fn random_batch(rng: &mut ChaCha8Rng, page_size: usize) -> Batch {
    let num_requests = rng.random_range(1..=6);
    let mut free: Vec<u32> = (0..NUM_PAGES as u32).collect();
    for i in (1..free.len()).rev() {
        free.swap(i, rng.random_range(0..=i));
    }
    let mut owned = Vec::new();
    let mut lens = Vec::new();
    let mut qo_indptr = vec![0u32];
    let mut params = Vec::new();
    for _ in 0..num_requests {
        let num_tokens = match rng.random_range(0..4) {
            0 => rng.random_range(1..=3 * page_size),
            1 => rng.random_range(1..=600),
            _ => rng.random_range(200..=4000),
        };
        let logical_start = if rng.random_bool(0.3) {
            rng.random_range(0..num_tokens)
        } else {
            0
        };
        let pages: Vec<PageId> = (0..num_tokens.div_ceil(page_size))
            .map(|_| PageId(free.pop().unwrap()))
            .collect();
        owned.push(pages);
        lens.push((num_tokens, logical_start));
        let rows = if rng.random_bool(0.15) {
            rng.random_range(2..=4)
        } else {
            1
        };
        qo_indptr.push(qo_indptr.last().unwrap() + rows);
        params.push(if rng.random_bool(0.15) {
            None
        } else {
            let budget = rng.random_range(1..=2048);
            let window = rng.random_range(0..=budget);
            let min_context = rng.random_range(0..=3000);
            Some(SparseAttention::new(budget, window, min_context).unwrap())
        });
    }
    let requests: Vec<PageTableRequest<'_>> = owned
        .iter()
        .zip(&lens)
        .map(|(pages, &(num_tokens, logical_start))| PageTableRequest {
            pages,
            num_tokens,
            logical_start,
        })
        .collect();
    let table = PageTable::build(&requests, NUM_PAGES, page_size).unwrap();
    Batch {
        table,
        qo_indptr,
        params,
    }
}

/// The CPU selector's table for `batch` (random summaries: the counts do not depend on them).
fn cpu_select(batch: &Batch, page_size: usize, rng: &mut ChaCha8Rng) -> PageTable {
    let layout = KvLayout {
        num_pages: NUM_PAGES,
        page_size,
        num_kv_heads: 1,
        head_dim: HEAD_DIM,
    };
    let pool = KvPool::zeros(KvType::F32, layout.pool_len());
    let summaries = KeySummaries::new(&layout);
    let kv = PagedKv {
        k_pool: pool.as_slice(),
        v_pool: pool.as_slice(),
        layout,
        page_table: &batch.table,
    };
    let rows = *batch.qo_indptr.last().unwrap() as usize;
    let q: Vec<f32> = (0..rows * HEAD_DIM)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let queries = QueryBatch {
        q: &q,
        qo_indptr: &batch.qo_indptr,
        num_q_heads: 1,
    };
    let selector = QuestSelector {
        summaries: &summaries,
        params: &batch.params,
    };
    let mut out = PageTable::default();
    selector.select(&kv, &queries, &mut out).unwrap();
    out
}

#[test]
fn plan_matches_the_cpu_selector_counts() {
    let mut rng = ChaCha8Rng::seed_from_u64(38);
    let mut sparse_seen = 0;
    for case in 0..400 {
        let page_size = if case % 2 == 0 { 16 } else { 32 };
        let batch = random_batch(&mut rng, page_size);
        let cpu = cpu_select(&batch, page_size, &mut rng);
        let plan = SparseSelectPlan::new(
            &batch.table,
            &batch.qo_indptr,
            &batch.params,
            page_size,
            SPARSE_MAX_PAGES,
        )
        .unwrap();
        assert_eq!(plan.indptr, cpu.indptr, "case {case}: indptr");
        assert_eq!(plan.seq_lens, cpu.seq_lens, "case {case}: seq_lens");
        assert_eq!(plan.last_page_len, cpu.last_page_len, "case {case}");
        assert_eq!(plan.first_page_offset, cpu.first_page_offset, "case {case}");
        let selected = plan.table(&batch.table, cpu.indices.clone());
        assert_eq!(selected, cpu, "case {case}: the whole selected table");
        let full = &batch.table;
        for r in 0..full.num_requests() {
            let words = &plan.requests[r * SPARSE_REQUEST_WORDS..(r + 1) * SPARSE_REQUEST_WORDS];
            let pages = &full.indices[full.indptr[r] as usize..full.indptr[r + 1] as usize];
            let kept = &cpu.indices[cpu.indptr[r] as usize..cpu.indptr[r + 1] as usize];
            if words[0] == SPARSE_DENSE {
                assert_eq!(kept, pages, "case {case} request {r}: dense");
                continue;
            }
            sparse_seen += 1;
            assert_eq!(
                words[0], batch.qo_indptr[r],
                "case {case} request {r}: query row"
            );
            let (window_start, keep) = (words[1] as usize, words[2] as usize);
            let head = usize::from(window_start > 0);
            assert_eq!(kept.len(), head + keep + pages.len() - window_start);
            if head == 1 {
                assert_eq!(kept[0], pages[0], "case {case} request {r}: sink");
            }
            assert_eq!(
                &kept[head + keep..],
                &pages[window_start..],
                "case {case} request {r}: window"
            );
            // The middle the device picks from: pages 1 .. window_start.
            assert!(kept[head..head + keep]
                .iter()
                .all(|page| pages[1..window_start.max(1)].contains(page)));
        }
        let stats = (
            plan.stats.sparse_requests,
            plan.stats.pages_scanned,
            plan.stats.pages_kept,
        );
        let scanned: u64 = (0..full.num_requests())
            .filter(|&r| plan.requests[r * SPARSE_REQUEST_WORDS] != SPARSE_DENSE)
            .map(|r| full.num_pages_of(r) as u64)
            .sum();
        assert_eq!(stats.1, scanned, "case {case}: pages scanned");
    }
    assert!(sparse_seen > 200, "only {sparse_seen} shortened requests");
}

#[test]
fn a_request_past_the_device_limit_decodes_densely() {
    let page_size = 16;
    let num_tokens = (SPARSE_MAX_PAGES + 1) * page_size;
    let pages: Vec<PageId> = (0..SPARSE_MAX_PAGES as u32 + 1).map(PageId).collect();
    let request = PageTableRequest {
        pages: &pages,
        num_tokens,
        logical_start: 0,
    };
    let table = PageTable::build(&[request], SPARSE_MAX_PAGES + 1, page_size).unwrap();
    let params = [Some(SparseAttention::new(1024, 128, 0).unwrap())];
    let max = SPARSE_MAX_PAGES;
    // Past the device's limit (a larger `max_pages` is clamped to it): dense, and counted.
    for limit in [max, 4 * max] {
        let plan = SparseSelectPlan::new(&table, &[0, 1], &params, page_size, limit).unwrap();
        assert_eq!(plan.selected_pages(), max + 1);
        assert_eq!((plan.stats.sparse_requests, plan.dense_past_limit), (0, 1));
        assert_eq!(plan.requests[0], SPARSE_DENSE);
    }
    // Within a smaller workspace's limit the same holds from its size on.
    let plan = SparseSelectPlan::new(&table, &[0, 1], &params, page_size, 1024).unwrap();
    assert_eq!(plan.dense_past_limit, 1);
    // Dense by its settings, the request is not counted.
    let plan = SparseSelectPlan::new(&table, &[0, 1], &[None], page_size, max).unwrap();
    assert_eq!((plan.selected_pages(), plan.dense_past_limit), (max + 1, 0));
    // Bad shapes are errors, not panics.
    assert!(SparseSelectPlan::new(&table, &[0], &params, page_size, max).is_err());
    assert!(SparseSelectPlan::new(&table, &[0, 1], &[None, None], page_size, max).is_err());
    assert!(SparseSelectPlan::new(&table, &[0, 1, 2], &[None, None], page_size, max).is_err());
    assert!(SparseSelectPlan::new(&table, &[], &[], page_size, max).is_err());
}

/// A mixed step plans its decode rows, which lead its table: the plan over the first `d`
/// requests equals the plan over a table of only those requests.
#[test]
fn a_plan_over_the_leading_requests_equals_one_over_their_table() {
    let mut rng = ChaCha8Rng::seed_from_u64(3838);
    for case in 0..100 {
        let page_size = 16;
        let batch = random_batch(&mut rng, page_size);
        let n = batch.table.num_requests();
        let d = rng.random_range(1..=n);
        let t = &batch.table;
        let pages = t.indptr[d] as usize;
        let leading = PageTable {
            indices: t.indices[..pages].to_vec(),
            indptr: t.indptr[..=d].to_vec(),
            last_page_len: t.last_page_len[..d].to_vec(),
            first_page_offset: t.first_page_offset[..d].to_vec(),
            seq_lens: t.seq_lens[..d].to_vec(),
            rope_offsets: t
                .rope_offsets
                .get(..d)
                .map_or_else(Vec::new, <[u32]>::to_vec),
        };
        let (qo, params) = (&batch.qo_indptr[..=d], &batch.params[..d]);
        let max = SPARSE_MAX_PAGES;
        let whole = SparseSelectPlan::new(&leading, qo, params, page_size, max).unwrap();
        let part = SparseSelectPlan::new(t, qo, params, page_size, max).unwrap();
        assert_eq!(part, whole, "case {case}: {d} of {n} requests");
    }
}

/// The looped scores' CTA size: within its shared limits (512 pairs, 64 pages), whole rounds
/// of 64 pairs, one wave where the limits allow, and the unlooped kernel's round unchanged.
#[test]
fn the_looped_scores_fill_one_wave_within_their_shared_limits() {
    use pagoda_ops::cuda::{score_pages_per_cta, SparseEntry};
    // Random Llama-3.1-8B on an H100 (132 SMs, 3 CTAs each): 8 pages a round.
    let slots = 396;
    let one = |b, pages| score_pages_per_cta(SparseEntry::ScoresAhead, 8, (b, pages), slots);
    assert_eq!(one(1, 2048), 8, "256 CTAs fit one wave");
    assert_eq!(one(2, 2048), 16, "512 CTAs in two rounds");
    assert_eq!(one(4, 2048), 24, "1024 CTAs in three rounds (342 CTAs)");
    assert_eq!(one(4, 8192), 64, "capped at 64 pages");
    for heads in [1, 2, 3, 8, 20, 64] {
        let round = (64 / heads).max(1);
        let plain = score_pages_per_cta(SparseEntry::Scores, heads, (4, 8192), slots);
        assert_eq!(plain, round, "{heads} heads: the plain kernel's one round");
        for (b, pages, slots) in [(1, 10, 396), (4, 8192, 396), (64, 8192, 1), (3, 700, 7)] {
            let n = score_pages_per_cta(SparseEntry::ScoresAhead, heads, (b, pages), slots);
            assert!(
                n.is_multiple_of(round) && n * heads <= 512 && n <= 64,
                "{heads}: {n}"
            );
            let ctas = pages.div_ceil(n) * b;
            assert!(ctas <= slots || n * heads + round * heads > 512 || n + round > 64);
        }
    }
}
