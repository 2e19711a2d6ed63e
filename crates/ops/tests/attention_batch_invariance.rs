//! Batch invariance of the step attention (`plan_step` + `step_attention`): a request's output
//! rows are bit-identical alone and inside batches of any composition (long and short decodes,
//! prefill chunks, any order), under every routing (all gather, all split-KV, auto threshold),
//! and whatever chunks its prompt was cut into. Oracle for the values themselves: the naive f64
//! reference of `attention_reference.rs`. A control test shows the batch-wide `plan_decode` is
//! NOT invariant on the same fixture, so the comparison can fail.

#[path = "attention_reference.rs"]
mod reference;

use pagoda_kv::{PageId, PageTable, PageTableRequest};
use pagoda_ops::attention::{
    plan_decode, plan_step, split_kv_decode, step_attention, AttentionPath, DecodePlanConfig,
    PagedKv, QueryBatch, SplitKvChunking, StepAttentionConfig, StepWorkspace,
};
use reference::{assert_close, request, Fixture, PageOrder};

const PAGE_SIZE: usize = 16;
const NUM_KV_HEADS: usize = 2;
const N_REP: usize = 3;
const HEAD_DIM: usize = 64;
const NUM_Q_HEADS: usize = NUM_KV_HEADS * N_REP;
const ROW: usize = NUM_Q_HEADS * HEAD_DIM;
const AUTO_THRESHOLD: usize = 512;

/// The requests every batch is drawn from: index -> (tokens, logical_start, queries).
fn universe() -> Fixture {
    Fixture::new(
        &[
            request(1500, 0, 1),  // 0: long decode, splits into several chunks
            request(40, 0, 1),    // 1: short decode
            request(700, 0, 300), // 2: prefill chunk crossing the auto threshold
            request(900, 37, 1),  // 3: long decode, window starting mid-page
            request(20, 0, 20),   // 4: whole short prefill
            request(1200, 0, 1),  // 5: another long decode
            request(530, 0, 1),   // 6: decode just past the threshold
        ],
        PAGE_SIZE,
        NUM_KV_HEADS,
        N_REP,
        HEAD_DIM,
        PageOrder::Random,
        7,
    )
}

/// One member of a test batch: universe request, its visible length and its query rows
/// (the newest `num_queries` of the universe's rows for it, or fewer / a prefix of them).
#[derive(Clone, Copy, Debug)]
struct Member {
    request: usize,
    /// Universe query rows `first_query..first_query + num_queries` of the request.
    first_query: usize,
    num_queries: usize,
}

fn whole(fixture: &Fixture, request: usize) -> Member {
    let num_queries = (fixture.qo_indptr[request + 1] - fixture.qo_indptr[request]) as usize;
    Member {
        request,
        first_query: 0,
        num_queries,
    }
}

/// The page table, queries and universe row indices of a batch of `members`, in order, over
/// the universe's pools. A member whose rows stop early sees only the tokens up to its last row.
fn batch(fixture: &Fixture, members: &[Member]) -> (PageTable, Vec<u32>, Vec<f32>, Vec<usize>) {
    let table = &fixture.page_table;
    let pages: Vec<Vec<PageId>> = members
        .iter()
        .map(|member| {
            let r = member.request;
            table.indices[table.indptr[r] as usize..table.indptr[r + 1] as usize]
                .iter()
                .map(|&page| PageId(page))
                .collect()
        })
        .collect();
    let mut requests = Vec::new();
    let (mut qo_indptr, mut q, mut rows) = (vec![0u32], Vec::new(), Vec::new());
    for (member, pages) in members.iter().zip(&pages) {
        let r = member.request;
        let universe_queries = (fixture.qo_indptr[r + 1] - fixture.qo_indptr[r]) as usize;
        let seq_len =
            table.seq_lens[r] as usize - universe_queries + member.first_query + member.num_queries;
        let offset = table.first_page_offset[r] as usize;
        requests.push(PageTableRequest {
            pages,
            num_tokens: offset + seq_len,
            logical_start: offset,
        });
        for query in member.first_query..member.first_query + member.num_queries {
            let row = fixture.qo_indptr[r] as usize + query;
            rows.push(row);
            q.extend_from_slice(&fixture.q[row * ROW..(row + 1) * ROW]);
        }
        qo_indptr.push(rows.len() as u32);
    }
    let page_table = PageTable::build(&requests, fixture.layout.num_pages, PAGE_SIZE).unwrap();
    (page_table, qo_indptr, q, rows)
}

/// Output rows keyed by universe row.
type KeyedRows = Vec<(usize, Vec<f32>)>;

/// Runs the step attention of `members`; returns the output rows keyed by universe row and
/// the plan's (split rows, chunks, gather rows).
fn run(
    fixture: &Fixture,
    members: &[Member],
    config: &StepAttentionConfig,
) -> (KeyedRows, (usize, usize, usize)) {
    let (page_table, qo_indptr, q, rows) = batch(fixture, members);
    let kv = PagedKv {
        k_pool: (&fixture.k_pool).into(),
        v_pool: (&fixture.v_pool).into(),
        layout: fixture.layout,
        page_table: &page_table,
    };
    let plan = plan_step(&kv, &qo_indptr, NUM_Q_HEADS, config).unwrap();
    let queries = QueryBatch {
        q: &q,
        qo_indptr: &qo_indptr,
        num_q_heads: NUM_Q_HEADS,
    };
    let mut out = vec![f32::NAN; q.len()];
    // A dirty, oversized workspace must not matter.
    let mut workspace = StepWorkspace {
        partial_v: vec![f32::NAN; 7],
        lse: vec![1e9; 1 << 16],
        ..StepWorkspace::default()
    };
    step_attention(
        &kv,
        &queries,
        &plan,
        fixture.scale,
        &mut workspace,
        &mut out,
    )
    .unwrap();
    assert_eq!(
        plan.split_kv_requests() + plan.gather_requests(),
        members.len()
    );
    let counts = (
        plan.num_split_kv_rows(),
        plan.num_chunks(),
        plan.num_gather_rows(),
    );
    let keyed = rows
        .into_iter()
        .zip(out.chunks(ROW).map(<[f32]>::to_vec))
        .collect();
    (keyed, counts)
}

fn configs() -> Vec<(&'static str, StepAttentionConfig)> {
    let chunking = SplitKvChunking::new(NUM_KV_HEADS, 8);
    let long_chunks = SplitKvChunking::new(NUM_KV_HEADS, 128);
    vec![
        (
            "gather",
            StepAttentionConfig {
                chunking,
                min_split_kv_tokens: usize::MAX,
            },
        ),
        (
            "split-kv",
            StepAttentionConfig {
                chunking,
                min_split_kv_tokens: 0,
            },
        ),
        (
            "auto",
            StepAttentionConfig {
                chunking,
                min_split_kv_tokens: AUTO_THRESHOLD,
            },
        ),
        (
            "auto, 128-token chunks",
            StepAttentionConfig {
                chunking: long_chunks,
                min_split_kv_tokens: AUTO_THRESHOLD,
            },
        ),
    ]
}

fn assert_bits_equal(expected: &[f32], actual: &[f32], context: &str) {
    let differing = expected
        .iter()
        .zip(actual)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(
        differing, 0,
        "{context}: {differing} elements differ in bits"
    );
}

#[test]
fn every_request_is_bit_identical_alone_and_in_any_batch() {
    let fixture = universe();
    let all: Vec<Member> = (0..7).map(|r| whole(&fixture, r)).collect();
    let pick = |ids: &[usize]| ids.iter().map(|&r| all[r]).collect::<Vec<_>>();
    let batches = [
        pick(&[0, 1, 2, 3, 4, 5, 6]),
        pick(&[5, 2, 0, 4, 1, 3, 6]),
        pick(&[0, 1]),
        pick(&[0, 5]),
        pick(&[2, 4]),
        pick(&[1, 2, 6]),
        pick(&[3, 0, 4]),
    ];
    let (reference, _) = fixture.reference();
    for (name, config) in configs() {
        let alone: Vec<(usize, Vec<f32>)> = (0..7)
            .flat_map(|r| run(&fixture, &[all[r]], &config).0)
            .collect();
        let alone_row = |row: usize| &alone.iter().find(|(r, _)| *r == row).unwrap().1;
        for (row, values) in &alone {
            let expected = &reference[row * ROW..(row + 1) * ROW];
            assert_close(&format!("{name}: row {row} alone"), values, expected, 2e-4);
        }
        for members in &batches {
            let (rows, (split_rows, chunks, gather_rows)) = run(&fixture, members, &config);
            for (row, values) in &rows {
                let context = format!("{name}: row {row} in batch {members:?}");
                assert_bits_equal(alone_row(*row), values, &context);
            }
            match name {
                "gather" => assert_eq!(split_rows, 0),
                "split-kv" => assert_eq!(gather_rows, 0),
                _ => {}
            }
            // Long rows really split into several chunks under split-KV routing.
            if split_rows > 0 && members.iter().any(|m| m.request == 0) {
                assert!(chunks > split_rows, "{name}: no row was split");
            }
        }
    }
}

#[test]
fn auto_mixes_gather_and_split_kv_rows_by_visible_length() {
    let fixture = universe();
    let config = configs()[2].1;
    // Request 2: rows see 401..=700 tokens; 111 of them are below the threshold of 512.
    let (_, (split_rows, _, gather_rows)) = run(&fixture, &[whole(&fixture, 2)], &config);
    assert_eq!((gather_rows, split_rows), (111, 189));
    let (_, (split_rows, chunks, gather_rows)) = run(
        &fixture,
        &[whole(&fixture, 1), whole(&fixture, 0), whole(&fixture, 6)],
        &config,
    );
    assert_eq!((gather_rows, split_rows), (1, 2));
    // Chunks of 8 tokens: 1500 tokens -> 188 chunks, 530 tokens -> 67.
    assert_eq!(chunks, 188 + 67);
}

#[test]
fn prompt_rows_do_not_depend_on_how_the_prompt_was_chunked() {
    let fixture = universe();
    let request = 2;
    for (name, config) in configs() {
        let (whole_rows, _) = run(&fixture, &[whole(&fixture, request)], &config);
        // The same 300 rows as chunks of 100, 110, 89 and a single-row (decode-shaped) chunk,
        // each next to a long decode.
        for (first_query, num_queries) in [(0, 100), (100, 110), (210, 89), (299, 1), (111, 1)] {
            let member = Member {
                request,
                first_query,
                num_queries,
            };
            let (rows, _) = run(&fixture, &[whole(&fixture, 0), member], &config);
            for (row, values) in rows.iter().filter(|(row, _)| {
                (fixture.qo_indptr[request] as usize..fixture.qo_indptr[request + 1] as usize)
                    .contains(row)
            }) {
                let expected = &whole_rows.iter().find(|(r, _)| r == row).unwrap().1;
                assert_bits_equal(
                    expected,
                    values,
                    &format!("{name}: row {row}, chunk at {first_query}"),
                );
            }
        }
    }
}

#[test]
fn chunking_depends_only_on_the_position() {
    let chunking = SplitKvChunking::new(3, 256);
    assert_eq!(chunking.num_chunks(0), 1);
    assert_eq!(chunking.num_chunks(1), 1);
    assert_eq!(chunking.num_chunks(256), 1);
    assert_eq!(chunking.num_chunks(257), 2);
    assert_eq!(chunking.chunk(600, 0), 0..256);
    assert_eq!(chunking.chunk(600, 2), 512..600);
    // A longer row keeps the shorter row's full chunks.
    assert_eq!(chunking.chunk(300, 0), chunking.chunk(5000, 0));
    assert_eq!(chunking.chunk(0, 0), 0..0);
    assert_eq!(SplitKvChunking::new(3, 0).num_chunks(5), 5);
}

#[test]
fn plan_rejects_a_mismatched_batch() {
    let fixture = universe();
    let (page_table, qo_indptr, q, _) = batch(&fixture, &[whole(&fixture, 0), whole(&fixture, 1)]);
    let kv = PagedKv {
        k_pool: (&fixture.k_pool).into(),
        v_pool: (&fixture.v_pool).into(),
        layout: fixture.layout,
        page_table: &page_table,
    };
    let config = configs()[1].1;
    assert!(plan_step(&kv, &[0, 1], NUM_Q_HEADS, &config).is_err());
    assert!(plan_step(&kv, &[0, 1, 42], NUM_Q_HEADS, &config).is_err());
    let wrong_heads = StepAttentionConfig {
        chunking: SplitKvChunking::new(NUM_KV_HEADS + 1, 8),
        ..config
    };
    assert!(plan_step(&kv, &qo_indptr, NUM_Q_HEADS, &wrong_heads).is_err());
    let plan = plan_step(&kv, &qo_indptr, NUM_Q_HEADS, &config).unwrap();
    assert_eq!(plan.path(), AttentionPath::SplitKv);
    let other_indptr = [0u32, 2, 2];
    let queries = QueryBatch {
        q: &q,
        qo_indptr: &other_indptr,
        num_q_heads: NUM_Q_HEADS,
    };
    let mut out = vec![0.0; q.len()];
    let mut workspace = StepWorkspace::default();
    let error = step_attention(&kv, &queries, &plan, 1.0, &mut workspace, &mut out).unwrap_err();
    assert!(error.to_string().contains("another batch"), "{error}");
    let queries = QueryBatch {
        q: &q,
        qo_indptr: &qo_indptr,
        num_q_heads: NUM_Q_HEADS,
    };
    let mut short = vec![0.0; q.len() - 1];
    assert!(step_attention(&kv, &queries, &plan, 1.0, &mut workspace, &mut short).is_err());
}

/// Control: the batch-wide decode plan picks one chunk size from the whole batch, so request
/// 0's bits change when other decodes join. This is what `plan_step` fixes, and it shows the
/// bitwise comparison above can fail.
#[test]
fn batch_wide_plan_is_not_batch_invariant() {
    let fixture = universe();
    let split = |members: &[Member]| {
        let (page_table, _, q, rows) = batch(&fixture, members);
        let kv = PagedKv {
            k_pool: (&fixture.k_pool).into(),
            v_pool: (&fixture.v_pool).into(),
            layout: fixture.layout,
            page_table: &page_table,
        };
        let plan = plan_decode(
            &page_table.page_counts(),
            &DecodePlanConfig::new(NUM_KV_HEADS, 8),
        )
        .unwrap();
        let mut out = vec![0.0; q.len()];
        split_kv_decode(&kv, &q, NUM_Q_HEADS, &plan, fixture.scale, &mut out).unwrap();
        assert_eq!(rows[0], fixture.qo_indptr[0] as usize);
        out[..ROW].to_vec()
    };
    let alone = split(&[whole(&fixture, 0)]);
    let batched = split(&[whole(&fixture, 0), whole(&fixture, 5), whole(&fixture, 3)]);
    assert!(
        alone
            .iter()
            .zip(&batched)
            .any(|(a, b)| a.to_bits() != b.to_bits()),
        "expected the batch-wide plan to change request 0's bits"
    );
}
