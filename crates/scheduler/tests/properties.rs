//! Property tests: random workloads (shared prefixes, random lengths, random aborts, tight
//! pools, small budgets, caching on and off) keep every invariant at every step, and every
//! request either finishes with exactly the tokens the fake model gives it alone, or was
//! aborted. Nothing is lost, nothing leaks. With speculation, random drafts (of random length,
//! right for a random prefix) change nothing either, and no page of the prefix cache ever
//! holds a rejected guess. Prefix-aware admission, on or off, changes nothing either.

mod common;

use std::collections::{HashMap, HashSet};

use common::{check_cache, check_pool, config, draft, reference_generation, ShadowKv};
use pagoda_kv::CacheEvent;
use pagoda_scheduler::{Request, Scheduler, SchedulerConfig, SchedulerError};
use proptest::prelude::*;

#[derive(Clone, Debug)]
struct Workload {
    page_size: usize,
    extra_pages: usize,
    budget: usize,
    caching: bool,
    stops: bool,
    prefixes: Vec<Vec<u32>>,
    /// (arrival step, prefix index, suffix, max_new_tokens)
    requests: Vec<(usize, usize, Vec<u32>, usize)>,
    /// (step, request index) aborts.
    aborts: Vec<(usize, usize)>,
    /// Speculation: per step, (draft length, how many guesses are right), used in turn by
    /// the decoding requests; empty for none.
    drafts: Vec<(usize, usize)>,
    /// Prefix-aware admission's threshold in tokens (0: off).
    prefix_wait: usize,
}

fn workload() -> impl Strategy<Value = Workload> {
    (
        1usize..5,
        0usize..6,
        1usize..12,
        any::<bool>(),
        any::<bool>(),
        proptest::collection::vec(proptest::collection::vec(0u32..5, 0..14), 1..4),
        proptest::collection::vec(
            (
                0usize..12,
                any::<usize>(),
                proptest::collection::vec(0u32..5, 0..6),
                1usize..9,
            ),
            1..10,
        ),
        proptest::collection::vec((0usize..30, any::<usize>()), 0..3),
        proptest::collection::vec((0usize..6, 0usize..6), 0..8),
        prop_oneof![Just(0usize), 1usize..9],
    )
        .prop_map(
            |(
                page_size,
                extra_pages,
                budget,
                caching,
                stops,
                prefixes,
                requests,
                aborts,
                drafts,
                prefix_wait,
            )| {
                let requests = requests
                    .into_iter()
                    .map(|(step, prefix, suffix, max_new)| {
                        (step, prefix % prefixes.len(), suffix, max_new)
                    })
                    .collect();
                Workload {
                    page_size,
                    extra_pages,
                    budget,
                    caching,
                    stops,
                    prefixes,
                    requests,
                    aborts,
                    drafts,
                    prefix_wait,
                }
            },
        )
}

fn run_workload(workload: &Workload) {
    let prompts: Vec<Vec<u32>> = workload
        .requests
        .iter()
        .map(|(_, prefix, suffix, _)| {
            let mut prompt = workload.prefixes[*prefix].clone();
            prompt.extend(suffix);
            if prompt.is_empty() {
                prompt.push(1);
            }
            prompt
        })
        .collect();
    // The pool fits the largest request alone plus a few pages: tight on purpose.
    let largest = prompts
        .iter()
        .zip(&workload.requests)
        .map(|(prompt, request)| (prompt.len() + request.3 - 1).div_ceil(workload.page_size))
        .max()
        .unwrap();
    let num_pages = largest + workload.extra_pages;
    let mut scheduler = Scheduler::new(SchedulerConfig {
        prefix_wait_tokens: workload.prefix_wait,
        ..config(
            workload.page_size,
            num_pages,
            workload.budget,
            workload.caching,
        )
    })
    .unwrap();
    scheduler.record_cache_events(true);
    // What a KV-aware router would know: the registered keys, rebuilt from the events alone.
    let mut mirror: HashSet<u64> = HashSet::new();
    let mut shadow = ShadowKv::default();
    let mut added = 0;
    let mut finished: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut aborted = Vec::new();
    let mut step = 0;
    while added < prompts.len() || scheduler.num_unfinished() > 0 {
        for (index, request) in workload.requests.iter().enumerate().skip(added) {
            if request.0 > step && index == added {
                break;
            }
            if index == added {
                scheduler
                    .add(Request {
                        id: index as u64,
                        prompt: prompts[index].clone(),
                        max_new_tokens: request.3,
                    })
                    .unwrap();
                added += 1;
            }
        }
        for &(abort_step, which) in &workload.aborts {
            let id = (which % prompts.len()) as u64;
            if abort_step == step && scheduler.contains(id) {
                assert_eq!(scheduler.abort(id), Ok(true));
                assert!(!scheduler.contains(id));
                aborted.push(id);
                check_pool(&scheduler);
            }
        }
        let decoding: Vec<u64> = scheduler
            .running_ids()
            .into_iter()
            .filter(|&id| scheduler.pending_tokens(id) == Some(1))
            .collect();
        for (turn, &id) in decoding.iter().enumerate() {
            if workload.drafts.is_empty() {
                break;
            }
            let (len, right) = workload.drafts[(step + turn) % workload.drafts.len()];
            let tokens = scheduler.tokens(id).unwrap().to_vec();
            let kept = scheduler.set_draft(id, draft(&tokens, len, right.min(len)));
            assert!(kept <= len);
        }
        let plan = scheduler.schedule().unwrap();
        for id in decoding {
            if !plan.preempted.contains(&id) {
                assert!(
                    plan.sequences.iter().any(|s| s.id == id),
                    "decode of {id} not batched"
                );
            }
        }
        check_pool(&scheduler);
        let sampled = shadow.run(&scheduler, &plan, workload.stops);
        for done in scheduler.postprocess(&sampled).unwrap() {
            assert!(
                finished.insert(done.id, done.generated).is_none(),
                "finished twice"
            );
        }
        check_pool(&scheduler);
        check_cache(&shadow, &scheduler);
        replay_events(&mut mirror, scheduler.take_cache_events());
        let keys: HashSet<u64> = scheduler.prefix_cache().keys().collect();
        assert_eq!(mirror, keys, "the events do not mirror the cache");
        step += 1;
        assert!(step < 5000, "no progress: {:?}", scheduler.stats());
    }
    for (index, prompt) in prompts.iter().enumerate() {
        let id = index as u64;
        match finished.get(&id) {
            Some(generated) => {
                assert!(!aborted.contains(&id));
                assert_eq!(
                    generated,
                    &reference_generation(prompt, workload.requests[index].3, workload.stops),
                    "request {id}"
                );
            }
            None => assert!(aborted.contains(&id), "request {id} lost"),
        }
    }
    let stats = scheduler.stats();
    assert_eq!(stats.pages_used, 0);
    assert_eq!(stats.pages_free + stats.pages_evictable, num_pages);
    if !workload.caching {
        assert_eq!(stats.pages_cached, 0);
        assert_eq!(stats.prefix_hit_tokens, 0);
    }
}

/// Applies cache events to a router's view: a stored page's parent is known and the page is
/// new; a removed page was known.
fn replay_events(mirror: &mut HashSet<u64>, events: Vec<CacheEvent>) {
    for event in events {
        match event {
            CacheEvent::Stored { key, parent, .. } => {
                if let Some(parent) = parent {
                    assert!(mirror.contains(&parent), "stored under an unknown parent");
                }
                assert!(mirror.insert(key), "stored twice");
            }
            CacheEvent::Removed { key } => assert!(mirror.remove(&key), "removed unknown"),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn random_workloads_keep_every_invariant(workload in workload()) {
        run_workload(&workload);
    }
}

#[test]
fn too_large_request_is_refused() {
    let mut scheduler = Scheduler::new(config(4, 2, 8, true)).unwrap();
    let error = scheduler
        .add(Request {
            id: 3,
            prompt: vec![1; 8],
            max_new_tokens: 2,
        })
        .unwrap_err();
    assert_eq!(
        error,
        SchedulerError::TooLargeForPool {
            id: 3,
            needed: 3,
            total: 2
        }
    );
    assert!(error.to_string().contains("request 3"));
}
