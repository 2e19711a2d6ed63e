//! Prefix-aware admission (`prefix_wait_tokens`): a burst behind one prompt prefix computes
//! it once, requests that share nothing are admitted past a waiting one, the wait ends when
//! the pages are cached or the request holding them back is gone, and every request still
//! gets the tokens the fake model gives it alone.

mod common;

use std::collections::HashMap;

use common::{check_cache, check_pool, config, reference_generation, ShadowKv};
use pagoda_scheduler::{Request, Scheduler, SchedulerConfig, StepPlan};

const PAGE: usize = 4;

fn scheduler(wait: usize, budget: usize) -> Scheduler {
    Scheduler::new(SchedulerConfig {
        prefix_wait_tokens: wait,
        ..config(PAGE, 64, budget, true)
    })
    .unwrap()
}

/// `shared` tokens of a common prefix, then `own` tokens of request `id`'s own.
fn prompt(shared: usize, own: usize, id: u32) -> Vec<u32> {
    let mut tokens: Vec<u32> = (0..shared as u32).map(|t| 1 + t % 7).collect();
    tokens.extend((0..own as u32).map(|t| 100 + 10 * id + t));
    tokens
}

fn add(scheduler: &mut Scheduler, id: u64, prompt: Vec<u32>) {
    scheduler
        .add(Request {
            id,
            prompt,
            max_new_tokens: 3,
        })
        .unwrap();
}

/// Runs steps until every request finishes; returns each step's plan and each request's
/// generated tokens.
fn run(scheduler: &mut Scheduler) -> (Vec<StepPlan>, HashMap<u64, Vec<u32>>) {
    let mut shadow = ShadowKv::default();
    let (mut plans, mut generated) = (Vec::new(), HashMap::new());
    while scheduler.num_unfinished() > 0 {
        let plan = scheduler.schedule().unwrap();
        let sampled = shadow.run(scheduler, &plan, false);
        for finished in scheduler.postprocess(&sampled).unwrap() {
            generated.insert(finished.id, finished.generated);
        }
        check_pool(scheduler);
        check_cache(&shadow, scheduler);
        plans.push(plan);
        assert!(plans.len() < 100, "no progress");
    }
    (plans, generated)
}

/// Prompt tokens computed (not served from the cache) over all steps.
fn computed(plans: &[StepPlan], prompts: &HashMap<u64, usize>) -> usize {
    plans
        .iter()
        .flat_map(|p| &p.sequences)
        .map(|s| {
            s.positions
                .end
                .min(prompts[&s.id])
                .saturating_sub(s.positions.start)
        })
        .sum()
}

#[test]
fn a_burst_behind_one_prefix_computes_it_once() {
    let prompts: Vec<Vec<u32>> = (0..4).map(|id| prompt(32, 3, id)).collect();
    let lens: HashMap<u64, usize> = (0..4).map(|id| (id, prompts[id as usize].len())).collect();
    let mut results = Vec::new();
    for wait in [0, 8] {
        let mut s = scheduler(wait, 200);
        for (id, p) in prompts.iter().enumerate() {
            add(&mut s, id as u64, p.clone());
        }
        let (plans, generated) = run(&mut s);
        for (id, p) in prompts.iter().enumerate() {
            assert_eq!(generated[&(id as u64)], reference_generation(p, 3, false));
        }
        let first: Vec<u64> = plans[0].sequences.iter().map(|s| s.id).collect();
        results.push((first, computed(&plans, &lens), s.stats()));
    }
    let (off, on) = (&results[0], &results[1]);
    // Off: all four admitted at once, each computing the 32-token prefix.
    assert_eq!(off.0, vec![0, 1, 2, 3]);
    assert_eq!(off.1, 4 * 35);
    assert_eq!(off.2.prefix_waits, 0);
    // On: the first alone, then the others on its cached pages (all but the last token's
    // page of the prefix: 8 pages of 4).
    assert_eq!(on.0, vec![0]);
    assert_eq!(on.1, 35 + 3 * 3);
    assert_eq!(on.2.prefix_hit_tokens, 3 * 32);
    assert_eq!(on.2.prefix_waits, 3);
}

#[test]
fn requests_that_share_nothing_pass_a_waiting_one() {
    let mut s = scheduler(8, 200);
    add(&mut s, 0, prompt(32, 3, 0));
    add(&mut s, 1, prompt(32, 3, 1));
    add(&mut s, 2, (200..230).collect());
    let plan = s.schedule().unwrap();
    let ids: Vec<u64> = plan.sequences.iter().map(|s| s.id).collect();
    assert_eq!(ids, vec![0, 2]);
    assert_eq!(s.waiting_ids(), vec![1]);
    assert_eq!(s.stats().prefix_waits, 1);
}

#[test]
fn a_chunked_prefix_is_waited_for_until_cached() {
    // A budget of 40 tokens a step: request 0's 67-token prompt takes two steps. In the
    // second, 13 tokens of budget are left: without the wait request 1 starts on the 40
    // cached tokens and computes 13 of the 24 shared ones again; with it, it starts a step
    // later on all 64.
    let lens = HashMap::from([(0, 67), (1, 67)]);
    for (wait, hit, total) in [(0, 40, 67 + 27), (8, 64, 67 + 3)] {
        let mut s = scheduler(wait, 40);
        add(&mut s, 0, prompt(64, 3, 0));
        add(&mut s, 1, prompt(64, 3, 1));
        let (plans, generated) = run(&mut s);
        assert_eq!(
            generated[&1],
            reference_generation(&prompt(64, 3, 1), 3, false)
        );
        let admitted = plans
            .iter()
            .flat_map(|p| &p.sequences)
            .find(|row| row.id == 1)
            .unwrap();
        assert_eq!(admitted.prefix_hit_tokens, hit, "wait {wait}");
        assert_eq!(computed(&plans, &lens), total, "wait {wait}");
    }
}

#[test]
fn below_the_threshold_or_with_caching_off_nothing_waits() {
    for (wait, caching) in [(40, true), (8, false)] {
        let mut s = Scheduler::new(SchedulerConfig {
            prefix_wait_tokens: wait,
            ..config(PAGE, 64, 200, caching)
        })
        .unwrap();
        add(&mut s, 0, prompt(32, 3, 0));
        add(&mut s, 1, prompt(32, 3, 1));
        let plan = s.schedule().unwrap();
        assert_eq!(plan.sequences.len(), 2, "wait {wait}, caching {caching}");
        assert_eq!(s.stats().prefix_waits, 0);
    }
}

#[test]
fn the_wait_ends_when_the_request_holding_it_back_is_aborted() {
    let mut s = scheduler(8, 200);
    add(&mut s, 0, prompt(32, 3, 0));
    add(&mut s, 1, prompt(32, 3, 1));
    let mut shadow = ShadowKv::default();
    let plan = s.schedule().unwrap();
    assert_eq!(plan.sequences.len(), 1);
    assert_eq!(s.stats().prefix_waits, 1);
    let sampled = shadow.run(&s, &plan, false);
    // Request 0 ends before its step completes: its pages are never registered.
    assert!(s.abort(0).unwrap());
    s.postprocess(&sampled).unwrap();
    let plan = s.schedule().unwrap();
    let rows: Vec<_> = plan
        .sequences
        .iter()
        .map(|r| (r.id, r.prefix_hit_tokens, r.positions.clone()))
        .collect();
    assert_eq!(rows, vec![(1, 0, 0..35)]);
    assert_eq!(s.stats().prefix_waits, 1);
}
