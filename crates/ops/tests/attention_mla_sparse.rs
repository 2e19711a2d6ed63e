//! DeepSeek-V3.2's sparse attention ops over a latent paged cache whose rows carry an
//! indexer key after the latent: `select_tokens` against a brute-force float64 top-k of the
//! index scores, `mla_attention_selected` against float64 softmax over each row's kept rows,
//! bit-for-bit the dense `mla_attention` where every row keeps everything, per-row results
//! independent of the batch, the tie rule, and the selection's validation.

use pagoda_kv::{PageId, PageTable, PageTableRequest, Slot};
use pagoda_ops::attention::{
    append_latent, mla_attention, mla_attention_selected, select_tokens, top_k_tokens,
    AbsorbedQuery, IndexerQuery, KvLayout, KvPool, KvType, LatentKv, TokenSelection,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const HEADS: usize = 4;
const LATENT: usize = 32;
const ROPE: usize = 8;
const WIDTH: usize = LATENT + ROPE;
const INDEX_HEADS: usize = 6;
const INDEX_DIM: usize = 16;
const ROW: usize = WIDTH + INDEX_DIM;
const TOP_K: usize = 5;
const PAGE_SIZE: usize = 4;
const NUM_PAGES: usize = 24;

fn random(len: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Requests of `lens` tokens (rows `[len, ROW]`) on shuffled pages, the last `q_lens` of each
/// being the step's queries, with random absorbed and index queries.
struct Case {
    pool: KvPool,
    layout: KvLayout,
    pages: Vec<Vec<PageId>>,
    lens: Vec<usize>,
    q_lens: Vec<usize>,
    rows: Vec<Vec<f32>>,
    q: Vec<f32>,
    index_q: Vec<f32>,
    index_w: Vec<f32>,
}

impl Case {
    fn new(lens: &[usize], q_lens: &[usize], seed: u64) -> Case {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let layout = KvLayout {
            num_pages: NUM_PAGES,
            page_size: PAGE_SIZE,
            num_kv_heads: 1,
            head_dim: ROW,
        };
        let mut free: Vec<u32> = (0..NUM_PAGES as u32).rev().collect();
        free.rotate_left(5);
        let mut pool = KvPool::zeros(KvType::F32, layout.pool_len());
        let (mut pages, mut rows) = (Vec::new(), Vec::new());
        for &len in lens {
            let request_pages: Vec<PageId> = (0..len.div_ceil(PAGE_SIZE))
                .map(|_| PageId(free.pop().unwrap()))
                .collect();
            let request_rows = random(len * ROW, &mut rng);
            let slots: Vec<Slot> = (0..len)
                .map(|t| Slot {
                    page: request_pages[t / PAGE_SIZE],
                    offset: (t % PAGE_SIZE) as u32,
                })
                .collect();
            append_latent(&mut pool, &layout, &slots, &request_rows).unwrap();
            pages.push(request_pages);
            rows.push(request_rows);
        }
        let queries: usize = q_lens.iter().sum();
        Case {
            pool,
            layout,
            pages,
            lens: lens.to_vec(),
            q_lens: q_lens.to_vec(),
            rows,
            q: random(queries * HEADS * WIDTH, &mut rng),
            index_q: random(queries * INDEX_HEADS * INDEX_DIM, &mut rng),
            index_w: random(queries * INDEX_HEADS, &mut rng),
        }
    }

    fn table(&self, requests: &[usize]) -> PageTable {
        let requests: Vec<PageTableRequest<'_>> = requests
            .iter()
            .map(|&r| PageTableRequest {
                pages: &self.pages[r],
                num_tokens: self.lens[r],
                logical_start: 0,
            })
            .collect();
        PageTable::build(&requests, NUM_PAGES, PAGE_SIZE).unwrap()
    }

    fn qo_indptr(&self, requests: &[usize]) -> Vec<u32> {
        let mut indptr = vec![0u32];
        for &r in requests {
            indptr.push(indptr.last().unwrap() + self.q_lens[r] as u32);
        }
        indptr
    }

    /// `values` `[queries, per_query]` of `requests`' queries, in that order.
    fn rows_of(&self, values: &[f32], per_query: usize, requests: &[usize]) -> Vec<f32> {
        let mut out = Vec::new();
        for &r in requests {
            let first: usize = self.q_lens[..r].iter().sum();
            out.extend_from_slice(&values[first * per_query..][..self.q_lens[r] * per_query]);
        }
        out
    }

    /// Selection and attention output of `requests` batched in that order.
    fn run(&self, requests: &[usize]) -> (TokenSelection, Vec<f32>) {
        let table = self.table(requests);
        let kv = LatentKv {
            pool: self.pool.as_slice(),
            layout: self.layout,
            page_table: &table,
        };
        let qo_indptr = self.qo_indptr(requests);
        let index_q = self.rows_of(&self.index_q, INDEX_HEADS * INDEX_DIM, requests);
        let index_w = self.rows_of(&self.index_w, INDEX_HEADS, requests);
        let query = IndexerQuery {
            q: &index_q,
            weights: &index_w,
            num_heads: INDEX_HEADS,
            head_dim: INDEX_DIM,
        };
        let mut selection = TokenSelection::default();
        select_tokens(&kv, WIDTH, &query, &qo_indptr, TOP_K, &mut selection).unwrap();
        let q = self.rows_of(&self.q, HEADS * WIDTH, requests);
        let absorbed = AbsorbedQuery {
            q: &q,
            num_heads: HEADS,
            latent_dim: LATENT,
            width: WIDTH,
        };
        let mut out = vec![0f32; q.len() / WIDTH * LATENT];
        mla_attention_selected(&kv, &absorbed, &qo_indptr, 0.3, Some(&selection), &mut out)
            .unwrap();
        (selection, out)
    }
}

/// The float64 top-`TOP_K` of query `t`'s index scores over `keys` rows (ties: lower index),
/// and the relative gap between the kept k-th and the dropped (k+1)-th score.
fn brute_force_selection(case: &Case, t: usize, rows: &[f32], visible: usize) -> (Vec<u32>, f64) {
    let scores: Vec<f64> = (0..visible)
        .map(|s| {
            let key = &rows[s * ROW + WIDTH..][..INDEX_DIM];
            (0..INDEX_HEADS)
                .map(|h| {
                    let q = &case.index_q[(t * INDEX_HEADS + h) * INDEX_DIM..][..INDEX_DIM];
                    let dot: f64 = q.iter().zip(key).map(|(a, b)| *a as f64 * *b as f64).sum();
                    case.index_w[t * INDEX_HEADS + h] as f64 * dot.max(0.0)
                })
                .sum()
        })
        .collect();
    let mut order: Vec<usize> = (0..visible).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let max = scores.iter().fold(0f64, |m, s| m.max(s.abs())).max(1e-30);
    let gap = (scores[order[TOP_K - 1]] - scores[order[TOP_K]]) / max;
    let mut kept: Vec<u32> = order[..TOP_K].iter().map(|&s| s as u32).collect();
    kept.sort_unstable();
    (kept, gap)
}

#[test]
fn selection_and_sparse_attention_match_brute_force() {
    // A prefill of 9 rows over 3 cached tokens (rows see 4..=12), a decode at 17, a request
    // whose every row sees at most TOP_K tokens, and a decode at exactly TOP_K + 1.
    let case = Case::new(&[12, 17, 5, 6], &[9, 1, 3, 1], 31);
    let requests = [0, 1, 2, 3];
    let (selection, out) = case.run(&requests);
    let mut t = 0;
    let mut sparse_rows = 0;
    for &r in &requests {
        for j in 0..case.q_lens[r] {
            let visible = case.lens[r] - case.q_lens[r] + j + 1;
            let kept = selection.row(t);
            let tokens: Vec<usize> = if visible <= TOP_K {
                assert!(kept.is_empty(), "row {t} sees {visible}: dense");
                (0..visible).collect()
            } else {
                sparse_rows += 1;
                let (expected, gap) = brute_force_selection(&case, t, &case.rows[r], visible);
                assert!(gap > 1e-4, "row {t}: a near-tie at the boundary ({gap:e})");
                assert_eq!(kept, expected, "row {t}");
                kept.iter().map(|&s| s as usize).collect()
            };
            // Softmax over the kept rows only, in float64.
            for h in 0..HEADS {
                let q = &case.q[(t * HEADS + h) * WIDTH..][..WIDTH];
                let row = |s: usize| &case.rows[r][s * ROW..][..ROW];
                let scores: Vec<f64> = tokens
                    .iter()
                    .map(|&s| {
                        let dot: f64 = q
                            .iter()
                            .zip(row(s))
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum();
                        0.3 * dot
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for l in 0..LATENT {
                    let expected: f64 = tokens
                        .iter()
                        .zip(&weights)
                        .map(|(&s, w)| w * row(s)[l] as f64)
                        .sum::<f64>()
                        / total;
                    let got = out[(t * HEADS + h) * LATENT + l] as f64;
                    assert!(
                        (got - expected).abs() < 1e-5,
                        "row {t} head {h}: {got} vs {expected}"
                    );
                }
            }
            t += 1;
        }
    }
    assert_eq!(sparse_rows, 9 - 2 + 1 + 1);
}

#[test]
fn a_rows_selection_and_output_do_not_depend_on_its_batch() {
    let case = Case::new(&[12, 17, 5, 6], &[9, 1, 3, 1], 32);
    let (batched_selection, batched_out) = case.run(&[3, 0, 2, 1]);
    let order = [3, 0, 2, 1];
    let mut t = 0;
    for &r in &order {
        let (alone_selection, alone_out) = case.run(&[r]);
        for j in 0..case.q_lens[r] {
            assert_eq!(
                batched_selection.row(t),
                alone_selection.row(j),
                "request {r}"
            );
            let width = HEADS * LATENT;
            let (a, b) = (
                &alone_out[j * width..][..width],
                &batched_out[t * width..][..width],
            );
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "request {r} row {j}"
            );
            t += 1;
        }
    }
}

#[test]
fn keeping_every_token_is_the_dense_op_bit_for_bit() {
    let case = Case::new(&[12, 17], &[9, 1], 33);
    let table = case.table(&[0, 1]);
    let kv = LatentKv {
        pool: case.pool.as_slice(),
        layout: case.layout,
        page_table: &table,
    };
    let qo_indptr = case.qo_indptr(&[0, 1]);
    let absorbed = AbsorbedQuery {
        q: &case.q,
        num_heads: HEADS,
        latent_dim: LATENT,
        width: WIDTH,
    };
    let len = case.q.len() / WIDTH * LATENT;
    let mut dense = vec![0f32; len];
    mla_attention_selected(&kv, &absorbed, &qo_indptr, 0.3, None, &mut dense).unwrap();
    // Every visible token listed explicitly.
    let mut all = TokenSelection {
        indptr: vec![0],
        tokens: Vec::new(),
    };
    for r in 0..2 {
        for j in 0..case.q_lens[r] {
            let visible = case.lens[r] - case.q_lens[r] + j + 1;
            all.tokens.extend(0..visible as u32);
            all.indptr.push(all.tokens.len() as u32);
        }
    }
    let mut listed = vec![0f32; len];
    mla_attention_selected(&kv, &absorbed, &qo_indptr, 0.3, Some(&all), &mut listed).unwrap();
    assert!(dense
        .iter()
        .zip(&listed)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    // A cache without index keys, read by the dense op of V2/V3: the same bits.
    let layout = KvLayout {
        head_dim: WIDTH,
        ..case.layout
    };
    let mut narrow = KvPool::zeros(KvType::F32, layout.pool_len());
    for (r, rows) in case.rows.iter().enumerate() {
        let slots: Vec<Slot> = (0..case.lens[r])
            .map(|t| Slot {
                page: case.pages[r][t / PAGE_SIZE],
                offset: (t % PAGE_SIZE) as u32,
            })
            .collect();
        let latent: Vec<f32> = rows
            .chunks_exact(ROW)
            .flat_map(|row| row[..WIDTH].to_vec())
            .collect();
        append_latent(&mut narrow, &layout, &slots, &latent).unwrap();
    }
    let narrow_kv = LatentKv {
        pool: narrow.as_slice(),
        layout,
        page_table: &table,
    };
    let mut v3 = vec![0f32; len];
    mla_attention(&narrow_kv, &case.q, &qo_indptr, HEADS, LATENT, 0.3, &mut v3).unwrap();
    assert!(dense
        .iter()
        .zip(&v3)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn top_k_keeps_the_best_scores_ties_to_the_lower_position() {
    let scores = [0.5, 2.0, 0.5, 0.0, 2.0, 0.5, 0.0];
    assert_eq!(top_k_tokens(&scores, 2), [1, 4]);
    // Three tie at 0.5 for two places: the lower positions.
    assert_eq!(top_k_tokens(&scores, 4), [0, 1, 2, 4]);
    assert_eq!(top_k_tokens(&scores, 6), [0, 1, 2, 3, 4, 5]);
    assert_eq!(top_k_tokens(&scores, 7), [0, 1, 2, 3, 4, 5, 6]);
    assert_eq!(top_k_tokens(&scores, 70), [0, 1, 2, 3, 4, 5, 6]);
}

#[test]
fn malformed_selections_are_refused() {
    let case = Case::new(&[12], &[2], 34);
    let table = case.table(&[0]);
    let kv = LatentKv {
        pool: case.pool.as_slice(),
        layout: case.layout,
        page_table: &table,
    };
    let absorbed = AbsorbedQuery {
        q: &case.q,
        num_heads: HEADS,
        latent_dim: LATENT,
        width: WIDTH,
    };
    let mut out = vec![0f32; 2 * HEADS * LATENT];
    // Row 0 sees 11 tokens, row 1 sees 12.
    for (indptr, tokens) in [
        (vec![0, 2, 3], vec![3, 1, 4]), // not ascending
        (vec![0, 1, 2], vec![11, 2]),   // token 11 is not visible to row 0
        (vec![0, 1], vec![2]),          // one row short
        (vec![0, 2, 1], vec![1, 2, 3]), // indptr decreasing
    ] {
        let selection = TokenSelection { indptr, tokens };
        let error =
            mla_attention_selected(&kv, &absorbed, &[0, 2], 0.3, Some(&selection), &mut out)
                .unwrap_err()
                .to_string();
        assert!(error.contains("token selection"), "{error}");
    }
    // top_k 0, and index keys past the row, are refused.
    let query = IndexerQuery {
        q: &case.index_q,
        weights: &case.index_w,
        num_heads: INDEX_HEADS,
        head_dim: INDEX_DIM,
    };
    let mut selection = TokenSelection::default();
    assert!(select_tokens(&kv, WIDTH, &query, &[0, 2], 0, &mut selection).is_err());
    assert!(select_tokens(&kv, WIDTH + 1, &query, &[0, 2], 5, &mut selection).is_err());
}
