//! Sparse decode through page indirection (Quest): the key summaries against min/max
//! recomputed from the pool, the upper bound against every key's exact `q·k`, the selection
//! against a brute-force oracle (sink, window, budget), and the decode over the selected
//! table against the dense decode (bit for bit where every page is kept; equal to the dense
//! decode over the oracle's pages, and different from the full dense output, where not).
//!
//! Keys and queries are multiples of 1/8 in [-2, 2], so every bound and score is exact in f32
//! and the oracle's f64 ranking cannot disagree by rounding.

use pagoda_kv::{PageId, PageTable, PageTableRequest, Slot};
use pagoda_ops::attention::{
    append_kv_pool, octet_order_bound, plan_step, step_attention, DecodeSelector, KeySummaries,
    KvLayout, KvPool, KvType, PagedKv, QueryBatch, QuestSelector, SparseAttention, SplitKvChunking,
    StepAttentionConfig, StepWorkspace,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const PAGE_SIZE: usize = 16;
const NUM_KV_HEADS: usize = 2;
const N_REP: usize = 3;
const HEAD_DIM: usize = 32;
const NUM_Q_HEADS: usize = NUM_KV_HEADS * N_REP;
const NUM_PAGES: usize = 160;

fn layout() -> KvLayout {
    KvLayout {
        num_pages: NUM_PAGES,
        page_size: PAGE_SIZE,
        num_kv_heads: NUM_KV_HEADS,
        head_dim: HEAD_DIM,
    }
}

fn eighths(rng: &mut ChaCha8Rng, len: usize) -> Vec<f32> {
    (0..len)
        .map(|_| rng.random_range(-16i32..=16) as f32 / 8.0)
        .collect()
}

/// Two requests over shuffled pages, written in random chunks (crossing page boundaries),
/// the summaries updated after every chunk.
struct Fixture {
    k: KvPool,
    v: KvPool,
    summaries: KeySummaries,
    pages: Vec<Vec<PageId>>,
    lens: Vec<usize>,
    starts: Vec<usize>,
    /// Rows written per page (for the recomputed summaries).
    written: Vec<usize>,
}

fn fixture(kv_type: KvType, lens: &[usize], starts: &[usize], seed: u64) -> Fixture {
    let layout = layout();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut free: Vec<u32> = (0..NUM_PAGES as u32).collect();
    for i in (1..free.len()).rev() {
        free.swap(i, rng.random_range(0..=i));
    }
    let mut fixture = Fixture {
        k: KvPool::zeros(kv_type, layout.pool_len()),
        v: KvPool::zeros(kv_type, layout.pool_len()),
        summaries: KeySummaries::new(&layout),
        pages: Vec::new(),
        lens: lens.to_vec(),
        starts: starts.to_vec(),
        written: vec![0; NUM_PAGES],
    };
    for &len in lens {
        let pages: Vec<PageId> = (0..len.div_ceil(PAGE_SIZE))
            .map(|_| PageId(free.pop().unwrap()))
            .collect();
        let mut done = 0;
        while done < len {
            let chunk = rng.random_range(1..=40).min(len - done);
            let slots: Vec<Slot> = (done..done + chunk)
                .map(|t| Slot {
                    page: pages[t / PAGE_SIZE],
                    offset: (t % PAGE_SIZE) as u32,
                })
                .collect();
            let stride = layout.token_stride();
            let mut k_new = eighths(&mut rng, chunk * stride);
            // A few hot pages: keys aligned with the all-positive part of the queries.
            for (i, slot) in slots.iter().enumerate() {
                if slot.page.0 % 7 == 3 {
                    k_new[i * stride..(i + 1) * stride]
                        .iter_mut()
                        .for_each(|x| *x = x.abs());
                }
            }
            let v_new: Vec<f32> = (0..chunk * stride)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            fixture.append(&slots, &k_new, &v_new);
            for slot in &slots {
                fixture.written[slot.page.index()] = slot.offset as usize + 1;
            }
            done += chunk;
        }
        fixture.pages.push(pages);
    }
    fixture
}

impl Fixture {
    /// Appends rows at `slots` to the pools and the key summaries.
    fn append(&mut self, slots: &[Slot], k_new: &[f32], v_new: &[f32]) {
        let layout = layout();
        append_kv_pool(&mut self.k, &mut self.v, &layout, slots, k_new, v_new).unwrap();
        self.summaries
            .update(self.k.as_slice(), &layout, slots)
            .unwrap();
    }

    fn table(&self) -> PageTable {
        let requests: Vec<PageTableRequest<'_>> = self
            .pages
            .iter()
            .zip(&self.lens)
            .zip(&self.starts)
            .map(|((pages, &num_tokens), &logical_start)| PageTableRequest {
                pages,
                num_tokens,
                logical_start,
            })
            .collect();
        PageTable::build(&requests, NUM_PAGES, PAGE_SIZE).unwrap()
    }

    fn key(&self, page: usize, row: usize, kv_head: usize) -> Vec<f32> {
        let mut out = vec![0.0; HEAD_DIM];
        self.k
            .as_slice()
            .read(layout().head_offset(page, row, kv_head), &mut out);
        out
    }

    /// Recomputed from the pool: `(min, max)` of the rows written to `page`.
    fn recomputed(&self, page: usize, kv_head: usize) -> (Vec<f64>, Vec<f64>) {
        let mut min = vec![f64::INFINITY; HEAD_DIM];
        let mut max = vec![f64::NEG_INFINITY; HEAD_DIM];
        for row in 0..self.written[page] {
            for (d, &x) in self.key(page, row, kv_head).iter().enumerate() {
                min[d] = min[d].min(x as f64);
                max[d] = max[d].max(x as f64);
            }
        }
        (min, max)
    }

    fn decode(&self, table: &PageTable, q: &[f32]) -> Vec<f32> {
        let kv = PagedKv {
            k_pool: self.k.as_slice(),
            v_pool: self.v.as_slice(),
            layout: layout(),
            page_table: table,
        };
        let qo_indptr: Vec<u32> = (0..=table.num_requests() as u32).collect();
        let config = StepAttentionConfig {
            chunking: SplitKvChunking::new(NUM_KV_HEADS, 64),
            min_split_kv_tokens: 16,
        };
        let plan = plan_step(&kv, &qo_indptr, NUM_Q_HEADS, &config).unwrap();
        let queries = QueryBatch {
            q,
            qo_indptr: &qo_indptr,
            num_q_heads: NUM_Q_HEADS,
        };
        let mut out = vec![0.0; q.len()];
        let mut workspace = StepWorkspace::default();
        step_attention(&kv, &queries, &plan, 0.2, &mut workspace, &mut out).unwrap();
        out
    }

    fn select(&self, q: &[f32], params: &[Option<SparseAttention>]) -> PageTable {
        let table = self.table();
        let kv = PagedKv {
            k_pool: self.k.as_slice(),
            v_pool: self.v.as_slice(),
            layout: layout(),
            page_table: &table,
        };
        let qo_indptr: Vec<u32> = (0..=table.num_requests() as u32).collect();
        let queries = QueryBatch {
            q,
            qo_indptr: &qo_indptr,
            num_q_heads: NUM_Q_HEADS,
        };
        let selector = QuestSelector {
            summaries: &self.summaries,
            params,
        };
        let mut out = PageTable::default();
        selector.select(&kv, &queries, &mut out).unwrap();
        out.validate(NUM_PAGES, PAGE_SIZE).unwrap();
        out
    }

    /// The oracle: f64 bounds from recomputed min/max, sink + window pages, then the best
    /// middle pages picked one at a time (highest score, earliest on ties) while they fit.
    fn oracle(&self, request: usize, q: &[f32], params: &SparseAttention) -> Vec<u32> {
        let table = self.table();
        let pages =
            &table.indices[table.indptr[request] as usize..table.indptr[request + 1] as usize];
        let n = pages.len();
        let offset = table.first_page_offset[request] as usize;
        let last_len = table.last_page_len[request] as usize;
        let tokens = |i: usize| {
            let end = if i + 1 == n { last_len } else { PAGE_SIZE };
            end - if i == 0 { offset } else { 0 }
        };
        let row = &q[request * NUM_Q_HEADS * HEAD_DIM..(request + 1) * NUM_Q_HEADS * HEAD_DIM];
        let score = |page: usize| -> f64 {
            let mut total = 0.0;
            for h in 0..NUM_Q_HEADS {
                let (min, max) = self.recomputed(page, h / N_REP);
                for d in 0..HEAD_DIM {
                    let x = row[h * HEAD_DIM + d] as f64;
                    total += (x * min[d]).max(x * max[d]);
                }
            }
            total
        };
        let mut window: Vec<usize> = vec![n - 1];
        let mut covered = tokens(n - 1);
        while covered < params.window && *window.last().unwrap() >= 2 {
            let next = window.last().unwrap() - 1;
            covered += tokens(next);
            window.push(next);
        }
        let mut kept: Vec<usize> = window.clone();
        let first_window = *window.last().unwrap();
        if first_window > 0 {
            kept.push(0);
        }
        let mut used: usize = kept.iter().map(|&i| tokens(i)).sum();
        let mut candidates: Vec<(usize, f64)> = (1..first_window)
            .map(|i| (i, score(pages[i] as usize)))
            .collect();
        while !candidates.is_empty() {
            let best = (0..candidates.len())
                .max_by(|&a, &b| {
                    candidates[a]
                        .1
                        .partial_cmp(&candidates[b].1)
                        .unwrap()
                        .then(candidates[b].0.cmp(&candidates[a].0))
                })
                .unwrap();
            let (index, _) = candidates.remove(best);
            if used + tokens(index) > params.budget {
                break;
            }
            used += tokens(index);
            kept.push(index);
        }
        kept.sort_unstable();
        kept.iter().map(|&i| pages[i]).collect()
    }
}

fn queries(seed: u64, rows: usize) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut q = eighths(&mut rng, rows * NUM_Q_HEADS * HEAD_DIM);
    // Mostly positive queries, so the hot pages score high.
    q.iter_mut().for_each(|x| *x = x.abs() - 0.25);
    q
}

#[test]
fn summaries_equal_min_max_recomputed_from_the_pool() {
    for kv_type in [KvType::F32, KvType::F16, KvType::Q8_0] {
        let fixture = fixture(kv_type, &[700, 333, 17], &[0, 5, 0], 11);
        let mut checked = 0;
        for pages in &fixture.pages {
            for page in pages {
                for kv_head in 0..NUM_KV_HEADS {
                    let (min, max) = fixture.recomputed(page.index(), kv_head);
                    let as_f64 = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<_>>();
                    assert_eq!(as_f64(fixture.summaries.min(page.index(), kv_head)), min);
                    assert_eq!(as_f64(fixture.summaries.max(page.index(), kv_head)), max);
                    checked += 1;
                }
            }
        }
        assert!(checked > 2 * 60, "{checked}");
    }
}

#[test]
fn a_reused_page_forgets_its_old_keys() {
    let layout = layout();
    let mut fixture = fixture(KvType::F32, &[64], &[0], 3);
    let page = fixture.pages[0][1];
    // Hand the page to a new owner: three new rows from row 0, small keys.
    let slots: Vec<Slot> = (0..3).map(|offset| Slot { page, offset }).collect();
    let k_new = vec![0.125f32; 3 * layout.token_stride()];
    let v_new = k_new.clone();
    fixture.append(&slots, &k_new, &v_new);
    assert!(fixture
        .summaries
        .min(page.index(), 1)
        .iter()
        .all(|&x| x == 0.125));
    assert!(fixture
        .summaries
        .max(page.index(), 0)
        .iter()
        .all(|&x| x == 0.125));
}

#[test]
fn the_bound_bounds_every_key_of_the_page() {
    let fixture = fixture(KvType::F16, &[500], &[0], 5);
    let q = queries(9, 1);
    for page in &fixture.pages[0] {
        for kv_head in 0..NUM_KV_HEADS {
            let group = &q[kv_head * N_REP * HEAD_DIM..(kv_head + 1) * N_REP * HEAD_DIM];
            let bound = fixture.summaries.group_bound(page.index(), kv_head, group) as f64;
            let mut tight = f64::NEG_INFINITY;
            for row in 0..fixture.written[page.index()] {
                let key = fixture.key(page.index(), row, kv_head);
                let exact: f64 = group
                    .chunks(HEAD_DIM)
                    .map(|q| {
                        q.iter()
                            .zip(&key)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>()
                    })
                    .sum();
                assert!(exact <= bound + 1e-9, "page {page:?}: {exact} > {bound}");
                tight = tight.max(exact);
            }
            assert!(tight.is_finite());
        }
    }
}

/// The bound sums as the device's octet does: slices of ceil(head_dim / 8) dimensions, then the
/// xor butterfly. Values chosen so that another order gives another answer: 1e8 (slice 0) and
/// -1e8 (slice 4) cancel first in the butterfly, keeping slice 1's 1; a sum in dimension
/// order would lose the 1 against 1e8.
#[test]
fn the_bound_sums_in_the_octet_order() {
    let mut terms = [0.0f32; 16];
    terms[0] = 1e8;
    terms[2] = 1.0;
    terms[8] = -1e8;
    let q = [1.0f32; 16];
    assert_eq!(octet_order_bound(&q, &terms, &terms), 1.0);
    let in_order = terms.iter().fold(-0.0f32, |sum, &t| sum + t);
    assert_eq!(
        in_order, 0.0,
        "the oracle's case must tell the orders apart"
    );
    // max(q * min, q * max) per dimension: a negative q takes the min.
    let (low, high) = ([-1.0f32, 2.0, 0.5], [3.0f32, 4.0, 0.5]);
    assert_eq!(
        octet_order_bound(&[-2.0, 1.0, 4.0], &low, &high),
        2.0 + 4.0 + 2.0
    );
    // A slice past head_dim (3 dimensions: slices of 1) adds nothing.
    let bound = octet_order_bound(&[1.0; 3], &[1.0, 2.0, 3.0], &[1.0, 2.0, 3.0]);
    assert_eq!(bound, 6.0);
}

#[test]
fn selection_matches_the_brute_force_oracle() {
    let fixture = fixture(KvType::F32, &[1000, 600, 90], &[0, 21, 0], 17);
    let table = fixture.table();
    for (budget, window) in [(256, 64), (400, 0), (128, 128), (700, 200)] {
        let params = SparseAttention::new(budget, window, 100).unwrap();
        let q = queries(budget as u64, 3);
        let selected = fixture.select(&q, &[Some(params); 3]);
        for request in 0..3 {
            let got = &selected.indices
                [selected.indptr[request] as usize..selected.indptr[request + 1] as usize];
            let all =
                &table.indices[table.indptr[request] as usize..table.indptr[request + 1] as usize];
            if table.seq_lens[request] as usize <= budget {
                assert_eq!(got, all, "request {request} stays dense");
                continue;
            }
            assert_eq!(got, fixture.oracle(request, &q, &params), "budget {budget}");
            assert_eq!(got[0], all[0], "the sink page");
            assert_eq!(got.last(), all.last(), "the last page");
            let seq_len = selected.seq_lens[request] as usize;
            let window_pages = window.div_ceil(PAGE_SIZE).max(1);
            assert!(
                seq_len <= budget.max(PAGE_SIZE * (window_pages + 2)),
                "{seq_len}"
            );
            assert!(seq_len + PAGE_SIZE > budget.min(table.seq_lens[request] as usize));
            assert!(got.len() < all.len());
        }
    }
}

#[test]
fn dense_when_the_budget_covers_the_context_or_below_min_context() {
    let fixture = fixture(KvType::F32, &[800, 300], &[0, 9], 23);
    let table = fixture.table();
    let q = queries(4, 2);
    let dense = fixture.decode(&table, &q);
    for params in [
        SparseAttention::new(800, 64, 0).unwrap(),
        SparseAttention::new(256, 64, 801).unwrap(),
    ] {
        let selected = fixture.select(&q, &[Some(params), Some(params)]);
        assert_eq!(selected, table);
        let out = fixture.decode(&selected, &q);
        assert!(out
            .iter()
            .zip(&dense)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
    assert_eq!(fixture.select(&q, &[]), table);
    assert_eq!(fixture.select(&q, &[None, None]), table);
}

#[test]
fn the_sparse_decode_is_the_dense_decode_over_the_kept_pages() {
    let fixture = fixture(KvType::F32, &[1200, 500], &[0, 0], 29);
    let table = fixture.table();
    let q = queries(31, 2);
    let params = SparseAttention::new(256, 32, 0).unwrap();
    // Request 1 stays dense: its row, too, must not change.
    let selected = fixture.select(&q, &[Some(params), None]);
    let sparse = fixture.decode(&selected, &q);
    let dense = fixture.decode(&table, &q);
    let row = NUM_Q_HEADS * HEAD_DIM;
    // The oracle's pages as a table of their own (request 0 alone).
    let kept: Vec<PageId> = fixture
        .oracle(0, &q, &params)
        .into_iter()
        .map(PageId)
        .collect();
    let last_len = table.last_page_len[0] as usize;
    let only = PageTable::build(
        &[PageTableRequest {
            pages: &kept,
            num_tokens: (kept.len() - 1) * PAGE_SIZE + last_len,
            logical_start: 0,
        }],
        NUM_PAGES,
        PAGE_SIZE,
    )
    .unwrap();
    let reference = fixture.decode(&only, &q[..row]);
    assert!(sparse[..row]
        .iter()
        .zip(&reference)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    assert!(sparse[row..]
        .iter()
        .zip(&dense[row..])
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    let differs = sparse[..row].iter().zip(&dense[..row]).any(|(a, b)| a != b);
    assert!(differs, "keeping 256 of 1200 tokens must change the output");
}

#[test]
fn bad_settings_are_errors() {
    let fixture = fixture(KvType::F32, &[100], &[0], 1);
    let table = fixture.table();
    let q = queries(1, 1);
    let kv = PagedKv {
        k_pool: fixture.k.as_slice(),
        v_pool: fixture.v.as_slice(),
        layout: layout(),
        page_table: &table,
    };
    let selector = QuestSelector {
        summaries: &fixture.summaries,
        params: &[None, None],
    };
    let queries = QueryBatch {
        q: &q,
        qo_indptr: &[0, 1],
        num_q_heads: NUM_Q_HEADS,
    };
    assert!(selector
        .select(&kv, &queries, &mut PageTable::default())
        .is_err());
    let other = KvLayout {
        num_pages: 8,
        ..layout()
    };
    assert!(KeySummaries::new(&other)
        .update(fixture.k.as_slice(), &layout(), &[])
        .is_err());
    assert!(SparseAttention::new(0, 0, 0).is_err());
}
