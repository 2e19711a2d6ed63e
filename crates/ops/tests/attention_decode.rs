//! Decode over the paged cache: gather and split-KV against the naive f64 reference and
//! against each other, over scattered pages, partial last pages, mid-page starts, GQA
//! groups, head dims, page sizes, forced merges and chunk sizes.

#[path = "attention_reference.rs"]
mod reference;

use pagoda_ops::attention::{
    decode_partial, gather_attention, paged_attention, plan_decode, split_kv_decode,
    AttentionError, AttentionPath, DecodePlan, DecodePlanConfig, DecodeWorkspace,
};
use reference::{assert_close, request, Fixture, PageOrder, RequestSpec};

const TOLERANCE: f64 = 2e-4;

fn decode_specs(page_size: usize) -> Vec<RequestSpec> {
    vec![
        request(1, 0, 1),
        request(5 * page_size + 3, 0, 1), // partial last page
        request(4 * page_size + 1, page_size / 2 + 1, 1), // mid-page start, window trimmed
        request(3 * page_size, 0, 1),     // exactly full pages
        request(2 * page_size + 2, 2 * page_size, 1), // retired pages, short window
    ]
}

fn gather(fixture: &Fixture) -> Vec<f32> {
    let mut out = vec![f32::NAN; fixture.output_len()];
    gather_attention(&fixture.kv(), &fixture.queries(), fixture.scale, &mut out).unwrap();
    out
}

fn split_kv(fixture: &Fixture, plan: &DecodePlan) -> Vec<f32> {
    let mut out = vec![f32::NAN; fixture.output_len()];
    split_kv_decode(
        &fixture.kv(),
        &fixture.q,
        fixture.num_q_heads,
        plan,
        fixture.scale,
        &mut out,
    )
    .unwrap();
    out
}

fn plan_for(fixture: &Fixture, target: usize, pages_per_chunk: Option<usize>) -> DecodePlan {
    let mut config = DecodePlanConfig::new(fixture.layout.num_kv_heads, target);
    config.pages_per_chunk = pages_per_chunk;
    plan_decode(&fixture.page_table.page_counts(), &config).unwrap()
}

#[test]
fn gather_and_split_kv_match_reference_across_geometries() {
    let mut seed = 0;
    for head_dim in [64, 128] {
        for n_rep in [1, 3, 4] {
            for page_size in [1, 4, 16, 32] {
                for order in [PageOrder::Reverse, PageOrder::Random] {
                    seed += 1;
                    let fixture = Fixture::new(
                        &decode_specs(page_size),
                        page_size,
                        2,
                        n_rep,
                        head_dim,
                        order,
                        seed,
                    );
                    let (expected, _) = fixture.reference();
                    let name = format!("D{head_dim} n_rep{n_rep} page{page_size} {order:?}");
                    let gathered = gather(&fixture);
                    assert_close(&format!("gather {name}"), &gathered, &expected, TOLERANCE);
                    let searched = plan_for(&fixture, 64, None);
                    let split = split_kv(&fixture, &searched);
                    assert_close(&format!("split_kv {name}"), &split, &expected, TOLERANCE);
                    let forced = plan_for(&fixture, 1, Some(1));
                    assert!(forced.needs_merge);
                    let merged = split_kv(&fixture, &forced);
                    assert_close(
                        &format!("split_kv forced merge {name}"),
                        &merged,
                        &expected,
                        TOLERANCE,
                    );
                    let gathered_f64: Vec<f64> = gathered.iter().map(|&x| x as f64).collect();
                    assert_close(
                        &format!("split_kv vs gather {name}"),
                        &merged,
                        &gathered_f64,
                        1e-5,
                    );
                }
            }
        }
    }
}

#[test]
fn output_is_invariant_to_chunk_size() {
    let specs = [
        request(700, 0, 1),
        request(333, 29, 1),
        request(16, 0, 1),
        request(0, 0, 0),
    ];
    let mut fixture = Fixture::new(&specs, 16, 2, 4, 64, PageOrder::Random, 99);
    // The empty request still needs its decode row (zeros): give it one query slot.
    fixture.qo_indptr = vec![0, 1, 2, 3, 4];
    fixture.q.extend(vec![0.5; fixture.num_q_heads * 64]);
    let single = plan_for(&fixture, 1, None);
    assert!(
        !single.needs_merge,
        "target 1 must give one chunk per request"
    );
    let baseline = split_kv(&fixture, &single);
    let baseline_f64: Vec<f64> = baseline.iter().map(|&x| x as f64).collect();
    for pages_per_chunk in [1, 2, 3, 4, 7, 16, 64] {
        let plan = plan_for(&fixture, 1, Some(pages_per_chunk));
        let out = split_kv(&fixture, &plan);
        assert_close(
            &format!("pages_per_chunk {pages_per_chunk}"),
            &out,
            &baseline_f64,
            1e-5,
        );
    }
    // The empty request reads as zeros, with no NaN anywhere.
    let row = fixture.num_q_heads * 64;
    assert!(baseline[3 * row..].iter().all(|&x| x == 0.0));
    assert!(baseline.iter().all(|x| x.is_finite()));
}

#[test]
fn empty_request_gives_zeros_without_leaking_nan_into_neighbours() {
    // Request 1 had its whole window trimmed: no visible tokens.
    let specs = [request(40, 0, 1), request(24, 24, 0), request(9, 3, 1)];
    let mut fixture = Fixture::new(&specs, 8, 1, 4, 64, PageOrder::Reverse, 5);
    let expected_neighbours = fixture.reference().0;
    let row = fixture.num_q_heads * 64;
    // Splice a query for the empty request (decode shape) between the other two.
    fixture.q.splice(row..row, vec![1.0; row]);
    fixture.qo_indptr = vec![0, 1, 2, 3];
    for pages_per_chunk in [1, 2, 100] {
        let out = split_kv(&fixture, &plan_for(&fixture, 1, Some(pages_per_chunk)));
        assert!(out[row..2 * row].iter().all(|&x| x == 0.0));
        let neighbours: Vec<f32> = out[..row].iter().chain(&out[2 * row..]).copied().collect();
        assert_close(
            "neighbours of the empty request",
            &neighbours,
            &expected_neighbours,
            TOLERANCE,
        );
    }
}

#[test]
fn partial_lse_is_the_base_two_log_sum_exp() {
    let fixture = Fixture::new(
        &[request(50, 3, 1), request(7, 0, 1)],
        4,
        2,
        3,
        64,
        PageOrder::Random,
        11,
    );
    let (_, natural_lse) = fixture.reference();
    let plan = plan_for(&fixture, 1, None);
    assert!(!plan.needs_merge);
    let mut workspace = DecodeWorkspace::for_plan(&plan, fixture.num_q_heads, 64);
    decode_partial(
        &fixture.kv(),
        &fixture.q,
        fixture.num_q_heads,
        &plan,
        fixture.scale,
        &mut workspace.partial_v,
        &mut workspace.lse,
    )
    .unwrap();
    for (lse, natural) in workspace.lse.iter().zip(&natural_lse) {
        let expected = natural * std::f64::consts::LOG2_E;
        assert!(
            (*lse as f64 - expected).abs() < 1e-4,
            "lse {lse} vs {expected}"
        );
    }
}

#[test]
fn paged_attention_dispatches_both_paths() {
    let fixture = Fixture::new(&decode_specs(16), 16, 2, 4, 64, PageOrder::Random, 21);
    let expected = fixture.reference().0;
    let plan = plan_for(&fixture, 32, None);
    for path in [AttentionPath::Gather, AttentionPath::SplitKv] {
        let mut out = vec![f32::NAN; fixture.output_len()];
        paged_attention(
            path,
            &fixture.kv(),
            &fixture.queries(),
            fixture.scale,
            Some(&plan),
            &mut out,
        )
        .unwrap();
        assert_close(path.name(), &out, &expected, TOLERANCE);
    }
}

#[test]
fn bad_inputs_are_errors() {
    let fixture = Fixture::new(
        &[request(20, 0, 1), request(9, 0, 1)],
        4,
        2,
        2,
        64,
        PageOrder::Reverse,
        3,
    );
    let plan = plan_for(&fixture, 8, None);
    let mut out = vec![0.0; fixture.output_len()];
    let kv = fixture.kv();

    let error = split_kv_decode(&kv, &fixture.q, 3, &plan, 1.0, &mut out).unwrap_err();
    assert!(matches!(error, AttentionError::Geometry(_)), "{error}");
    let error = split_kv_decode(&kv, &fixture.q[1..], 4, &plan, 1.0, &mut out).unwrap_err();
    assert!(matches!(error, AttentionError::Length { .. }), "{error}");
    let stale = plan_decode(
        &[1, 1],
        &DecodePlanConfig::new(2, 1).with_pages_per_chunk(1),
    )
    .unwrap();
    let error = split_kv_decode(&kv, &fixture.q, 4, &stale, 1.0, &mut out).unwrap_err();
    assert!(matches!(error, AttentionError::Plan(_)), "{error}");
    let error = paged_attention(
        AttentionPath::SplitKv,
        &kv,
        &fixture.queries(),
        1.0,
        None,
        &mut out,
    )
    .unwrap_err();
    assert!(matches!(error, AttentionError::Plan(_)), "{error}");

    let mut broken_table = fixture.page_table.clone();
    broken_table.seq_lens[1] += 1;
    let broken = pagoda_ops::attention::PagedKv {
        page_table: &broken_table,
        ..kv
    };
    let error = gather_attention(&broken, &fixture.queries(), 1.0, &mut out).unwrap_err();
    assert!(matches!(error, AttentionError::PageTable(_)), "{error}");
    let short_pool = pagoda_ops::attention::PagedKv {
        k_pool: (&fixture.k_pool[1..]).into(),
        ..kv
    };
    assert!(matches!(
        gather_attention(&short_pool, &fixture.queries(), 1.0, &mut out),
        Err(AttentionError::Length { .. })
    ));

    // A prefill-shaped batch on the split-KV path is declined, not mis-computed.
    let prefill = Fixture::new(
        &[request(6, 0, 2), request(3, 0, 1)],
        4,
        2,
        2,
        64,
        PageOrder::Reverse,
        4,
    );
    let prefill_plan = plan_for(&prefill, 1, None);
    let mut prefill_out = vec![0.0; prefill.output_len()];
    let error = paged_attention(
        AttentionPath::SplitKv,
        &prefill.kv(),
        &prefill.queries(),
        1.0,
        Some(&prefill_plan),
        &mut prefill_out,
    )
    .unwrap_err();
    assert_eq!(
        error,
        AttentionError::NotDecode {
            request: 0,
            num_queries: 2
        }
    );
    assert!(error.to_string().contains("exactly 1 query"));
}
