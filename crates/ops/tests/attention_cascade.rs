//! Cascade attention on the CPU (`StepAttentionPlan::with_cascade`): decode rows whose page
//! lists share leading pages attend to the shared chunks in one work item. Checked against
//! (a) the plain step, bit for bit (the cascade keeps the chunk grid and the kernels give a
//! head the same bits whatever shares its item), and (b) a naive f64 attention over each
//! request's own page list. Cases: one shared prompt, nested groups, prompts ending
//! mid-page, groups of one, prefill rows beside shared decodes, several blocks, f16 pools, a
//! prefix re-placed between steps; a control shows a plan that shares pages that differ is
//! caught.

use pagoda_kv::{PageId, PageTable, PageTableRequest};
use pagoda_ops::attention::{
    plan_step, step_attention, CascadeRule, KvLayout, KvPool, KvType, PagedKv, QueryBatch,
    SplitKvChunking, StepAttentionConfig, StepAttentionPlan, StepWorkspace,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Shapes of one case.
#[derive(Clone, Copy, Debug)]
struct Shape {
    page_size: usize,
    num_kv_heads: usize,
    n_rep: usize,
    head_dim: usize,
    chunk_tokens: usize,
}

/// One request: its page list (ids into the pool), visible tokens and query rows.
#[derive(Clone, Debug)]
struct Request {
    pages: Vec<u32>,
    tokens: usize,
    queries: usize,
}

struct Case {
    shape: Shape,
    layout: KvLayout,
    k: Vec<f32>,
    v: Vec<f32>,
    requests: Vec<Request>,
    q: Vec<f32>,
    qo_indptr: Vec<u32>,
}

impl Case {
    fn new(shape: Shape, num_pages: usize, requests: Vec<Request>, seed: u64) -> Case {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let layout = KvLayout {
            num_pages,
            page_size: shape.page_size,
            num_kv_heads: shape.num_kv_heads,
            head_dim: shape.head_dim,
        };
        let mut values =
            |len: usize| -> Vec<f32> { (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect() };
        let (k, v) = (values(layout.pool_len()), values(layout.pool_len()));
        let mut qo_indptr = vec![0u32];
        for request in &requests {
            assert_eq!(
                request.pages.len(),
                request.tokens.div_ceil(shape.page_size)
            );
            qo_indptr.push(qo_indptr.last().unwrap() + request.queries as u32);
        }
        let row = shape.num_kv_heads * shape.n_rep * shape.head_dim;
        let q = values(*qo_indptr.last().unwrap() as usize * row);
        Case {
            shape,
            layout,
            k,
            v,
            requests,
            q,
            qo_indptr,
        }
    }

    fn num_q_heads(&self) -> usize {
        self.shape.num_kv_heads * self.shape.n_rep
    }

    fn table(&self) -> PageTable {
        let lists: Vec<Vec<PageId>> = self
            .requests
            .iter()
            .map(|r| r.pages.iter().map(|&p| PageId(p)).collect())
            .collect();
        let entries: Vec<PageTableRequest<'_>> = self
            .requests
            .iter()
            .zip(&lists)
            .map(|(r, pages)| PageTableRequest {
                pages,
                num_tokens: r.tokens,
                logical_start: 0,
            })
            .collect();
        PageTable::build(&entries, self.layout.num_pages, self.shape.page_size).unwrap()
    }

    fn plan(&self, table: &PageTable, cascade: Option<&PageTable>) -> StepAttentionPlan {
        self.plan_with(table, cascade, &CascadeRule::ANY)
    }

    fn plan_with(
        &self,
        table: &PageTable,
        cascade: Option<&PageTable>,
        rule: &CascadeRule,
    ) -> StepAttentionPlan {
        let (k, v) = (&self.k, &self.v);
        let kv = PagedKv {
            k_pool: k.into(),
            v_pool: v.into(),
            layout: self.layout,
            page_table: table,
        };
        let config = StepAttentionConfig {
            chunking: SplitKvChunking::new(self.shape.num_kv_heads, self.shape.chunk_tokens),
            min_split_kv_tokens: 0,
        };
        let plan = plan_step(&kv, &self.qo_indptr, self.num_q_heads(), &config).unwrap();
        match cascade {
            Some(groups_of) => {
                plan.with_cascade(groups_of, self.shape.page_size, self.num_q_heads(), rule)
            }
            None => plan,
        }
    }

    fn run(&self, table: &PageTable, plan: &StepAttentionPlan, kv_type: KvType) -> Vec<f32> {
        let pool = |values: &[f32]| {
            let mut pool = KvPool::zeros(kv_type, values.len());
            pool.write(0, values);
            pool
        };
        let (k, v) = (pool(&self.k), pool(&self.v));
        let kv = PagedKv {
            k_pool: k.as_slice(),
            v_pool: v.as_slice(),
            layout: self.layout,
            page_table: table,
        };
        let queries = QueryBatch {
            q: &self.q,
            qo_indptr: &self.qo_indptr,
            num_q_heads: self.num_q_heads(),
        };
        let mut out = vec![f32::NAN; self.q.len()];
        let scale = 1.0 / (self.shape.head_dim as f32).sqrt();
        let mut workspace = StepWorkspace::default();
        step_attention(&kv, &queries, plan, scale, &mut workspace, &mut out).unwrap();
        out
    }

    /// Naive causal attention in f64 over each request's own page list.
    fn reference(&self) -> Vec<f64> {
        let Shape {
            page_size,
            num_kv_heads,
            n_rep,
            head_dim,
            ..
        } = self.shape;
        let num_q_heads = self.num_q_heads();
        let scale = 1.0 / (head_dim as f64).sqrt();
        let mut out = vec![0.0; self.q.len()];
        for (r, request) in self.requests.iter().enumerate() {
            let first = self.qo_indptr[r] as usize;
            for query in 0..request.queries {
                let row = first + query;
                let visible = request.tokens - request.queries + query + 1;
                for head in 0..num_q_heads {
                    let q = &self.q[(row * num_q_heads + head) * head_dim..][..head_dim];
                    let at = |t: usize| {
                        let page = request.pages[t / page_size] as usize;
                        self.layout.head_offset(page, t % page_size, head / n_rep)
                    };
                    let scores: Vec<f64> = (0..visible)
                        .map(|t| {
                            let k = &self.k[at(t)..at(t) + head_dim];
                            q.iter()
                                .zip(k)
                                .map(|(&a, &b)| a as f64 * b as f64)
                                .sum::<f64>()
                                * scale
                        })
                        .collect();
                    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let total: f64 = weights.iter().sum();
                    let target = &mut out[(row * num_q_heads + head) * head_dim..][..head_dim];
                    for (t, w) in weights.iter().enumerate() {
                        for (o, &x) in target.iter_mut().zip(&self.v[at(t)..at(t) + head_dim]) {
                            *o += w / total * x as f64;
                        }
                    }
                }
            }
        }
        let _ = num_kv_heads;
        out
    }
}

fn max_error(actual: &[f32], expected: &[f64]) -> f64 {
    actual
        .iter()
        .zip(expected)
        .map(|(&a, &e)| {
            if a.is_finite() {
                (a as f64 - e).abs()
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0, f64::max)
}

/// Runs `case` plain and with cascade: same bits, close to f64; returns the cascade's
/// (groups, saved token reads).
fn check(name: &str, case: &Case, kv_type: KvType) -> (usize, usize) {
    let table = case.table();
    let plain = case.run(&table, &case.plan(&table, None), kv_type);
    let plan = case.plan(&table, Some(&table));
    let cascade = case.run(&table, &plan, kv_type);
    let mismatches = plain
        .iter()
        .zip(&cascade)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(mismatches, 0, "{name}: cascade differs from the plain step");
    let bound = if kv_type == KvType::F32 { 2e-5 } else { 2e-3 };
    let error = max_error(&cascade, &case.reference());
    assert!(error < bound, "{name}: error {error:e} against f64");
    let stats = plan.cascade_stats();
    (stats.groups, stats.saved_token_reads)
}

/// `count` fresh page ids from `next`.
fn fresh(next: &mut u32, count: usize) -> Vec<u32> {
    let pages = (*next..*next + count as u32).collect();
    *next += count as u32;
    pages
}

/// A request behind `prefix` pages with `own` tokens of its own (pages after the prefix).
fn behind(prefix: &[u32], next: &mut u32, page_size: usize, own: usize, queries: usize) -> Request {
    let tokens = prefix.len() * page_size + own;
    let mut pages = prefix.to_vec();
    pages.extend(fresh(next, tokens.div_ceil(page_size) - prefix.len()));
    Request {
        pages,
        tokens,
        queries,
    }
}

const SHAPES: [Shape; 4] = [
    Shape {
        page_size: 16,
        num_kv_heads: 2,
        n_rep: 3,
        head_dim: 64,
        chunk_tokens: 64,
    },
    Shape {
        page_size: 5,
        num_kv_heads: 1,
        n_rep: 8,
        head_dim: 128,
        chunk_tokens: 32,
    },
    Shape {
        page_size: 16,
        num_kv_heads: 3,
        n_rep: 1,
        head_dim: 32,
        chunk_tokens: 256,
    },
    Shape {
        page_size: 7,
        num_kv_heads: 2,
        n_rep: 4,
        head_dim: 16,
        chunk_tokens: 21,
    },
];

#[test]
fn one_shared_prompt_nested_groups_and_loners_match_the_plain_step() {
    for (index, &shape) in SHAPES.iter().enumerate() {
        let ps = shape.page_size;
        let mut next = 0;
        let system = fresh(&mut next, 300 / ps);
        let mut branch_a = system.clone();
        branch_a.extend(fresh(&mut next, 100 / ps));
        let mut branch_b = system.clone();
        branch_b.extend(fresh(&mut next, 70 / ps));
        let mut requests = vec![
            // Behind the system prompt only, tails ending mid-page and on a page end.
            behind(&system, &mut next, ps, 1, 1),
            behind(&system, &mut next, ps, 3 * ps, 1),
            behind(&system, &mut next, ps, 2 * ps + 3, 1),
            // Nested groups under it.
            behind(&branch_a, &mut next, ps, 5, 1),
            behind(&branch_a, &mut next, ps, 90, 1),
            behind(&branch_b, &mut next, ps, 33, 1),
            behind(&branch_b, &mut next, ps, 2, 1),
            // A loner with a long context (a group of one) and a prefill behind the prompt.
            behind(&fresh(&mut next, 200 / ps), &mut next, ps, 9, 1),
            behind(&system, &mut next, ps, 40, 12),
        ];
        // Many members (more than one work item's heads): twenty more behind the system.
        for own in 0..20 {
            requests.push(behind(&system, &mut next, ps, 1 + own * 3, 1));
        }
        let case = Case::new(shape, next as usize + 2, requests, index as u64);
        let (groups, saved) = check(&format!("shape {index}"), &case, KvType::F32);
        // Chunks of 256 tokens fit the system prompt only; smaller ones the nested groups.
        let nested = shape.chunk_tokens < 256;
        assert!(
            groups > nested as usize && saved > 0,
            "shape {index}: {groups} groups"
        );
    }
}

#[test]
fn prompts_ending_mid_page_share_their_full_pages_only() {
    let shape = SHAPES[0];
    let ps = shape.page_size;
    let mut next = 0;
    // A 200-token prompt: 12 full pages, the 13th page each request's own copy (a prefix
    // cache shares whole pages only), holding the prompt's last 8 tokens and more.
    let full = fresh(&mut next, 200 / ps);
    let requests = (0..5)
        .map(|own| behind(&full, &mut next, ps, 8 + own * 10, 1))
        .collect();
    let case = Case::new(shape, next as usize, requests, 11);
    let (groups, saved) = check("mid-page", &case, KvType::F32);
    // Chunks of 64 tokens: 192 shared tokens (3 chunks) of 5 rows, 4 extra reads each.
    assert_eq!((groups, saved), (1, 3 * 64 * 4));
}

#[test]
fn groups_of_one_and_no_sharing_plan_no_cascade() {
    let shape = SHAPES[0];
    let ps = shape.page_size;
    let mut next = 0;
    let mut requests = vec![
        behind(&fresh(&mut next, 30), &mut next, ps, 3, 1),
        behind(&fresh(&mut next, 30), &mut next, ps, 3, 1),
    ];
    // A prefill over request 0's first pages: it never cascades, so request 0 is alone.
    requests.push(Request {
        pages: requests[0].pages[..8].to_vec(),
        tokens: 8 * ps,
        queries: 16,
    });
    let case = Case::new(shape, next as usize, requests, 12);
    assert_eq!(check("loners", &case, KvType::F32), (0, 0));
}

#[test]
fn random_tries_several_blocks_and_f16_pools_match() {
    let mut rng = ChaCha8Rng::seed_from_u64(99);
    for round in 0..6 {
        let shape = SHAPES[round % SHAPES.len()];
        let ps = shape.page_size;
        let mut next = 0;
        // A random trie: each request extends a random earlier prefix.
        let mut prefixes: Vec<Vec<u32>> = vec![Vec::new()];
        let mut requests = Vec::new();
        for _ in 0..rng.random_range(2..24) {
            let base = prefixes[rng.random_range(0..prefixes.len())].clone();
            let mut prefix = base;
            prefix.extend(fresh(&mut next, rng.random_range(0..40)));
            prefixes.push(prefix.clone());
            let own = rng.random_range(1..3 * ps);
            requests.push(behind(&prefix, &mut next, ps, own, 1));
        }
        let case = Case::new(shape, next as usize, requests, round as u64);
        check(&format!("trie {round}"), &case, KvType::F32);
        check(&format!("trie {round} f16"), &case, KvType::F16);
    }
    // Chunks of 2 tokens: a block holds 4M elements / (600 chunks x 1024) = 6 rows of
    // 1200 tokens, so 14 rows behind one prompt fall in three blocks.
    let shape = Shape {
        page_size: 16,
        num_kv_heads: 1,
        n_rep: 8,
        head_dim: 128,
        chunk_tokens: 2,
    };
    let mut next = 0;
    let system = fresh(&mut next, 70);
    let requests = (0..14)
        .map(|own| behind(&system, &mut next, 16, 80 + own, 1))
        .collect();
    let case = Case::new(shape, next as usize, requests, 5);
    let (groups, _) = check("blocks", &case, KvType::F32);
    assert_eq!(groups, 1);
}

#[test]
fn a_prefix_re_placed_between_steps_is_planned_afresh() {
    // Step 1: three requests share a prompt. Step 2: the prompt's pages were evicted and
    // request 1 recomputed them into other pages (same values): it shares nothing now.
    let shape = SHAPES[0];
    let ps = shape.page_size;
    let mut next = 0;
    let system = fresh(&mut next, 20);
    let requests: Vec<Request> = (0..3)
        .map(|own| behind(&system, &mut next, ps, 7 + own, 1))
        .collect();
    let mut case = Case::new(shape, next as usize + 20, requests, 21);
    assert_eq!(check("step 1", &case, KvType::F32).0, 1);
    let copy = fresh(&mut next, 20);
    let stride = ps * case.layout.token_stride();
    for (&from, &to) in system.iter().zip(&copy) {
        let (from, to) = (from as usize * stride, to as usize * stride);
        case.k.copy_within(from..from + stride, to);
        case.v.copy_within(from..from + stride, to);
    }
    case.requests[1].pages[..20].copy_from_slice(&copy);
    let (groups, saved) = check("step 2", &case, KvType::F32);
    assert_eq!(groups, 1);
    // Two members left: 320 shared tokens = 5 chunks of 64, one extra read each.
    assert_eq!(saved, 5 * 64);
}

#[test]
fn a_plan_that_shares_differing_pages_is_caught() {
    // Control: the cascade is planned on a table where request 1 seems to share request 0's
    // pages, but it runs on the real one (other pages, other values): the shared items read
    // request 0's K/V for request 1, and both oracles see it.
    let shape = SHAPES[0];
    let ps = shape.page_size;
    let mut next = 0;
    let system = fresh(&mut next, 20);
    let requests = vec![
        behind(&system, &mut next, ps, 9, 1),
        behind(&fresh(&mut next, 20), &mut next, ps, 9, 1),
    ];
    let case = Case::new(shape, next as usize, requests, 31);
    let table = case.table();
    let mut wrong = table.clone();
    let second = wrong.indptr[1] as usize;
    wrong.indices[second..second + 20].copy_from_slice(&system);
    let plan = case.plan(&table, Some(&wrong));
    assert_eq!(plan.cascade_stats().groups, 1);
    let out = case.run(&table, &plan, KvType::F32);
    let plain = case.run(&table, &case.plan(&table, None), KvType::F32);
    assert_ne!(out, plain);
    assert!(max_error(&out, &case.reference()) > 1e-2);
}

#[test]
fn the_rule_keeps_groups_that_save_enough_reads() {
    // Two rows behind 20 pages (320 tokens, 5 chunks of 64: 320 reads saved) and five
    // behind 10 others (160 tokens, 2 chunks: 4 x 160 = 640 saved).
    let shape = SHAPES[0];
    let ps = shape.page_size;
    let mut next = 0;
    let (long, short) = (fresh(&mut next, 20), fresh(&mut next, 10));
    let mut requests: Vec<Request> = (0..2)
        .map(|own| behind(&long, &mut next, ps, 3 + own, 1))
        .collect();
    requests.extend((0..5).map(|own| behind(&short, &mut next, ps, 9 + own, 1)));
    let case = Case::new(shape, next as usize, requests, 41);
    let table = case.table();
    let groups = |rule: CascadeRule| {
        let stats = case.plan_with(&table, Some(&table), &rule).cascade_stats();
        (stats.groups, stats.saved_token_reads)
    };
    let rule = |min_members, min_shared_tokens, min_saved_tokens| CascadeRule {
        min_members,
        min_shared_tokens,
        min_saved_tokens,
    };
    assert_eq!(groups(CascadeRule::ANY), (2, 5 * 64 + 2 * 64 * 4));
    assert_eq!(groups(rule(2, 0, 500)), (1, 2 * 64 * 4));
    assert_eq!(groups(rule(3, 0, 0)), (1, 2 * 64 * 4));
    assert_eq!(groups(rule(2, 200, 0)), (1, 5 * 64));
    assert_eq!(groups(rule(2, 0, 1000)), (0, 0));
}
