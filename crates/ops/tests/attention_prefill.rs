//! Ragged causal prefill (and mixed prefill/decode batches) through the gather path against
//! the naive f64 reference, plus `append_kv` placement and its errors.

#[path = "attention_reference.rs"]
mod reference;

use pagoda_kv::{PageId, Slot};
use pagoda_ops::attention::{append_kv, gather_attention, AttentionError, KvLayout};
use reference::{assert_close, request, Fixture, PageOrder};

#[test]
fn ragged_causal_prefill_matches_reference() {
    let mut seed = 100;
    for (head_dim, n_rep, page_size) in [(64, 1, 4), (64, 3, 16), (128, 4, 8), (128, 1, 32)] {
        for order in [PageOrder::Reverse, PageOrder::Random] {
            seed += 1;
            let specs = [
                request(37, 0, 37),               // full prefill
                request(50, 0, 13),               // chunked prefill: last 13 of 50
                request(page_size * 3 + 1, 0, 1), // decode in the same batch
                request(20, 0, 0),                // no queries this step
                request(45, page_size + 2, 9),    // windowed, mid-page start
            ];
            let fixture = Fixture::new(&specs, page_size, 2, n_rep, head_dim, order, seed);
            let (expected, _) = fixture.reference();
            let mut out = vec![f32::NAN; fixture.output_len()];
            gather_attention(&fixture.kv(), &fixture.queries(), fixture.scale, &mut out).unwrap();
            let name = format!("prefill D{head_dim} n_rep{n_rep} page{page_size} {order:?}");
            assert_close(&name, &out, &expected, 2e-4);
        }
    }
}

#[test]
fn causal_mask_hides_future_tokens() {
    // Changing the last token's K/V must not change the output of any earlier query.
    let fixture = Fixture::new(&[request(12, 0, 12)], 4, 1, 2, 64, PageOrder::Random, 8);
    let mut before = vec![0.0; fixture.output_len()];
    gather_attention(
        &fixture.kv(),
        &fixture.queries(),
        fixture.scale,
        &mut before,
    )
    .unwrap();
    let mut changed_k = fixture.k_pool.clone();
    let last_page = fixture.page_table.indices[2] as usize;
    let row = (last_page * 4 + 3) * 64;
    changed_k[row..row + 64]
        .iter_mut()
        .for_each(|value| *value += 3.0);
    let kv = pagoda_ops::attention::PagedKv {
        k_pool: (&changed_k).into(),
        ..fixture.kv()
    };
    let mut after = vec![0.0; fixture.output_len()];
    gather_attention(&kv, &fixture.queries(), fixture.scale, &mut after).unwrap();
    let query_row = fixture.num_q_heads * 64;
    assert_eq!(before[..11 * query_row], after[..11 * query_row]);
    assert_ne!(before[11 * query_row..], after[11 * query_row..]);
}

#[test]
fn queries_beyond_the_sequence_are_rejected() {
    let mut fixture = Fixture::new(&[request(3, 0, 3)], 4, 1, 1, 64, PageOrder::Reverse, 9);
    fixture.qo_indptr = vec![0, 4];
    fixture.q.extend(vec![0.0; 64]);
    let mut out = vec![0.0; fixture.output_len()];
    let error = gather_attention(&fixture.kv(), &fixture.queries(), 1.0, &mut out).unwrap_err();
    assert_eq!(
        error,
        AttentionError::QueriesExceedSequence {
            request: 0,
            num_queries: 4,
            seq_len: 3
        }
    );
    fixture.qo_indptr = vec![1, 4];
    let error = gather_attention(&fixture.kv(), &fixture.queries(), 1.0, &mut out).unwrap_err();
    assert!(
        matches!(
            error,
            AttentionError::Indptr {
                what: "qo_indptr",
                ..
            }
        ),
        "{error}"
    );
}

#[test]
fn append_kv_writes_each_token_at_its_slot_and_rejects_bad_slots() {
    let layout = KvLayout {
        num_pages: 3,
        page_size: 2,
        num_kv_heads: 2,
        head_dim: 4,
    };
    let mut k_pool = vec![0.0; layout.pool_len()];
    let mut v_pool = vec![0.0; layout.pool_len()];
    let slots = [
        Slot {
            page: PageId(2),
            offset: 1,
        },
        Slot {
            page: PageId(0),
            offset: 0,
        },
    ];
    let k_new: Vec<f32> = (1..=16).map(|x| x as f32).collect();
    let v_new: Vec<f32> = k_new.iter().map(|x| -x).collect();
    append_kv(&mut k_pool, &mut v_pool, &layout, &slots, &k_new, &v_new).unwrap();
    // Token 0 -> flat row 2 * 2 + 1 = 5; token 1 -> row 0; 8 elements per row.
    assert_eq!(k_pool[40..48], k_new[..8]);
    assert_eq!(v_pool[0..8], v_new[8..]);
    assert_eq!(k_pool.iter().filter(|&&x| x != 0.0).count(), 16);

    let outside = [Slot {
        page: PageId(3),
        offset: 0,
    }];
    let error = append_kv(
        &mut k_pool,
        &mut v_pool,
        &layout,
        &outside,
        &k_new[..8],
        &v_new[..8],
    )
    .unwrap_err();
    assert!(
        matches!(
            error,
            AttentionError::SlotOutOfRange {
                index: 0,
                page: 3,
                ..
            }
        ),
        "{error}"
    );
    let bad_offset = [
        slots[0],
        Slot {
            page: PageId(1),
            offset: 2,
        },
    ];
    let snapshot = k_pool.clone();
    let error = append_kv(
        &mut k_pool,
        &mut v_pool,
        &layout,
        &bad_offset,
        &k_new,
        &v_new,
    )
    .unwrap_err();
    assert!(
        error.to_string().contains("offset >= page_size 2"),
        "{error}"
    );
    assert_eq!(k_pool, snapshot, "nothing written on error");
    let error = append_kv(
        &mut k_pool,
        &mut v_pool,
        &layout,
        &slots,
        &k_new[..15],
        &v_new,
    )
    .unwrap_err();
    assert!(matches!(error, AttentionError::Length { .. }), "{error}");
}
