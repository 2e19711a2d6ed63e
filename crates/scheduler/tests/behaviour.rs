//! One test per scheduling behaviour, with hand-computed expectations.

mod common;

use common::{check_cache, check_pool, config, draft, next_token, reference_generation, ShadowKv};
use pagoda_scheduler::{FinishReason, Request, SampledToken, Scheduler, SchedulerError, StepPlan};

fn request(id: u64, prompt: Vec<u32>, max_new_tokens: usize) -> Request {
    Request {
        id,
        prompt,
        max_new_tokens,
    }
}

/// Runs one step with the fake model; returns the plan and the finished ids.
fn step(scheduler: &mut Scheduler, shadow: &mut ShadowKv) -> (StepPlan, Vec<u64>) {
    let plan = scheduler.schedule().unwrap();
    check_pool(scheduler);
    let sampled = shadow.run(scheduler, &plan, false);
    let done = scheduler.postprocess(&sampled).unwrap();
    check_pool(scheduler);
    (plan, done.into_iter().map(|f| f.id).collect())
}

#[test]
fn chunked_prefill_under_budget_then_batched_decodes() {
    let mut scheduler = Scheduler::new(config(4, 16, 5, false)).unwrap();
    let mut shadow = ShadowKv::default();
    scheduler.add(request(0, (0..7).collect(), 3)).unwrap();
    scheduler.add(request(1, vec![9, 9], 3)).unwrap();
    let (plan, _) = step(&mut scheduler, &mut shadow);
    // FIFO: request 0 takes the whole budget of 5 (chunk 0..5), request 1 waits.
    assert_eq!(plan.sequences.len(), 1);
    assert_eq!(plan.sequences[0].positions, 0..5);
    assert!(!plan.sequences[0].samples);
    let (plan, _) = step(&mut scheduler, &mut shadow);
    // Request 0's last chunk (2 tokens, samples) and request 1's prompt (2 tokens).
    let rows: Vec<_> = plan
        .sequences
        .iter()
        .map(|s| (s.id, s.positions.clone(), s.samples))
        .collect();
    assert_eq!(rows, vec![(0, 5..7, true), (1, 0..2, true)]);
    assert_eq!(plan.qo_indptr(), vec![0, 2, 4]);
    assert_eq!(plan.logits_for(), vec![1, 3]);
    let (plan, _) = step(&mut scheduler, &mut shadow);
    assert!(plan.sequences.iter().all(|s| s.is_decode()));
    assert_eq!(plan.sampling_ids(), vec![0, 1]);
}

#[test]
fn length_and_stop_finish_and_free_pages() {
    let mut scheduler = Scheduler::new(config(4, 8, 16, false)).unwrap();
    scheduler.add(request(0, vec![1, 2, 3], 2)).unwrap();
    scheduler.add(request(1, vec![4, 5], 5)).unwrap();
    scheduler.schedule().unwrap();
    let sampled = [
        SampledToken {
            id: 0,
            token: 7,
            stop: false,
            accepted: 0,
        },
        SampledToken {
            id: 1,
            token: 8,
            stop: true,
            accepted: 0,
        },
    ];
    let done = scheduler.postprocess(&sampled).unwrap();
    assert_eq!(done.len(), 1);
    assert_eq!(
        (done[0].id, done[0].reason, done[0].generated.clone()),
        (1, FinishReason::Stop, vec![8])
    );
    scheduler.schedule().unwrap();
    let done = scheduler
        .postprocess(&[SampledToken {
            id: 0,
            token: 6,
            stop: false,
            accepted: 0,
        }])
        .unwrap();
    assert_eq!(
        (done[0].reason, done[0].generated.clone()),
        (FinishReason::Length, vec![7, 6])
    );
    assert_eq!(scheduler.stats().pages_used, 0);
    assert_eq!(scheduler.stats().pages_free, 8);
}

#[test]
fn misuse_is_reported() {
    let mut scheduler = Scheduler::new(config(4, 8, 16, true)).unwrap();
    assert!(Scheduler::new(config(4, 8, 0, true)).is_err());
    assert_eq!(
        scheduler.add(request(0, vec![], 2)),
        Err(SchedulerError::EmptyPrompt { id: 0 })
    );
    assert_eq!(
        scheduler.add(request(0, vec![1], 0)),
        Err(SchedulerError::NoNewTokens { id: 0 })
    );
    scheduler.add(request(0, vec![1], 2)).unwrap();
    assert_eq!(
        scheduler.add(request(0, vec![1], 2)),
        Err(SchedulerError::DuplicateId { id: 0 })
    );
    assert_eq!(
        scheduler.postprocess(&[]),
        Err(SchedulerError::NoStepInFlight)
    );
    scheduler.schedule().unwrap();
    assert_eq!(
        scheduler.schedule().unwrap_err(),
        SchedulerError::StepInFlight
    );
    assert_eq!(
        scheduler.postprocess(&[]),
        Err(SchedulerError::MissingSample { id: 0 })
    );
    let wrong = [SampledToken {
        id: 0,
        token: 1,
        stop: false,
        accepted: 0,
    }; 2];
    assert_eq!(
        scheduler.postprocess(&wrong),
        Err(SchedulerError::UnexpectedSample { id: 0 })
    );
    assert!(scheduler.postprocess(&wrong[..1]).is_ok());
}

#[test]
fn abort_frees_pages_at_once_and_mid_flight() {
    let mut scheduler = Scheduler::new(config(2, 8, 16, false)).unwrap();
    scheduler.add(request(0, vec![1, 2, 3, 4, 5], 4)).unwrap();
    scheduler.add(request(1, vec![1, 2], 4)).unwrap();
    scheduler.schedule().unwrap();
    assert_eq!(scheduler.stats().pages_used, 4);
    // Aborted while its plan is in flight: pages back now, its sample is ignored.
    assert_eq!(scheduler.abort(0), Ok(true));
    assert_eq!(scheduler.stats().pages_used, 1);
    check_pool(&scheduler);
    let sampled = [
        SampledToken {
            id: 0,
            token: 1,
            stop: false,
            accepted: 0,
        },
        SampledToken {
            id: 1,
            token: 1,
            stop: false,
            accepted: 0,
        },
    ];
    assert!(scheduler.postprocess(&sampled).unwrap().is_empty());
    assert_eq!(scheduler.abort(0), Ok(false));
    scheduler.add(request(2, vec![3], 4)).unwrap();
    assert_eq!(scheduler.abort(2), Ok(true));
    assert_eq!(scheduler.stats().num_waiting, 0);
    assert_eq!(scheduler.abort(1), Ok(true));
    assert_eq!(scheduler.stats().pages_free, 8);
}

#[test]
fn youngest_is_preempted_requeued_at_front_and_resumes_identically() {
    // 3 pages of 2 tokens. Two 2-token prompts fill a page each; both need a new page at the
    // same decode. The older one (0) takes the last free page, then next time preempts 1.
    let mut scheduler = Scheduler::new(config(2, 3, 8, false)).unwrap();
    let mut shadow = ShadowKv::default();
    scheduler.add(request(0, vec![1, 2], 4)).unwrap();
    scheduler.add(request(1, vec![3, 4], 4)).unwrap();
    scheduler.add(request(2, vec![5], 1)).unwrap();
    let mut finished = Vec::new();
    let mut preempted = Vec::new();
    let mut steps = 0;
    while scheduler.num_unfinished() > 0 {
        let (plan, done) = step(&mut scheduler, &mut shadow);
        if !plan.preempted.is_empty() {
            preempted.extend(plan.preempted.clone());
            // Back at the FRONT of the queue, ahead of request 2.
            assert_eq!(scheduler.waiting_ids().first(), plan.preempted.last());
        }
        finished.extend(done);
        steps += 1;
        assert!(steps < 50);
    }
    assert!(
        preempted.contains(&1),
        "request 1 was never preempted: {preempted:?}"
    );
    assert!(!preempted.contains(&0), "the oldest must not be preempted");
    assert_eq!(scheduler.stats().preemptions as usize, preempted.len());
    assert_eq!(finished.len(), 3);
    assert_eq!(scheduler.stats().pages_free, 3);
}

#[test]
fn preempted_sequence_recomputes_prompt_plus_generated() {
    let mut scheduler = Scheduler::new(config(2, 3, 8, false)).unwrap();
    let mut shadow = ShadowKv::default();
    scheduler.add(request(0, vec![1, 2], 4)).unwrap();
    scheduler.add(request(1, vec![3, 4], 4)).unwrap();
    let mut generated_before = None;
    loop {
        let (plan, _) = step(&mut scheduler, &mut shadow);
        if plan.preempted.contains(&1) {
            generated_before = Some(scheduler.tokens(1).unwrap().to_vec());
        }
        if let Some(tokens) = &generated_before {
            if let Some(row) = plan.sequences.iter().find(|s| s.id == 1) {
                // Its first chunk after resuming starts at 0 and recomputes prompt +
                // generated tokens (possibly in chunks, as pages allow).
                assert_eq!(row.positions.start, 0);
                assert_eq!(row.tokens[..], tokens[..row.positions.end]);
                assert!(row.positions.end >= 2);
                break;
            }
        }
        assert!(scheduler.num_unfinished() > 0);
    }
    assert!(generated_before.unwrap().len() > 2);
}

#[test]
fn prefix_hit_shares_full_pages_only_and_recomputes_the_last_token() {
    let mut scheduler = Scheduler::new(config(4, 16, 64, true)).unwrap();
    let mut shadow = ShadowKv::default();
    let prompt: Vec<u32> = (10..22).collect(); // 12 tokens = 3 full pages
    scheduler.add(request(0, prompt.clone(), 1)).unwrap();
    step(&mut scheduler, &mut shadow);
    assert_eq!(scheduler.stats().pages_cached, 3);
    assert_eq!(scheduler.stats().pages_evictable, 3);
    assert_eq!(scheduler.stats().pages_used, 0);
    // Same 12 tokens: capped at 11 -> 2 full pages (8 tokens) shared, 4 recomputed.
    scheduler.add(request(1, prompt.clone(), 1)).unwrap();
    // 10 tokens sharing the first 9: 2 pages shared.
    let mut other = prompt[..9].to_vec();
    other.push(99);
    scheduler.add(request(2, other, 1)).unwrap();
    // Differs in the first page: no hit.
    scheduler
        .add(request(3, vec![10, 11, 12, 0, 14], 1))
        .unwrap();
    let (plan, _) = step(&mut scheduler, &mut shadow);
    let hits: Vec<_> = plan
        .sequences
        .iter()
        .map(|s| (s.id, s.prefix_hit_tokens, s.positions.clone()))
        .collect();
    assert_eq!(hits, vec![(1, 8, 8..12), (2, 8, 8..10), (3, 0, 0..5)]);
    assert_eq!(scheduler.stats().prefix_hit_tokens, 16);
    // Request 1 and 2 shared the same two pages.
    assert_eq!(plan.sequences[0].pages[..2], plan.sequences[1].pages[..2]);
}

#[test]
fn caching_off_never_hits_and_frees_everything() {
    let mut scheduler = Scheduler::new(config(4, 16, 64, false)).unwrap();
    let mut shadow = ShadowKv::default();
    for id in 0..2 {
        scheduler.add(request(id, (0..9).collect(), 1)).unwrap();
        let (plan, _) = step(&mut scheduler, &mut shadow);
        assert_eq!(plan.sequences[0].prefix_hit_tokens, 0);
    }
    assert_eq!(scheduler.stats().pages_cached, 0);
    assert_eq!(scheduler.stats().pages_free, 16);
}

#[test]
fn cached_pages_are_evicted_lru_only_when_the_free_list_is_empty() {
    let mut scheduler = Scheduler::new(config(2, 4, 64, true)).unwrap();
    let mut shadow = ShadowKv::default();
    scheduler.add(request(0, vec![1, 2, 3], 1)).unwrap(); // page [1,2] cached
    step(&mut scheduler, &mut shadow);
    scheduler.add(request(1, vec![5, 6, 7], 1)).unwrap(); // page [5,6] cached
    step(&mut scheduler, &mut shadow);
    assert_eq!(scheduler.stats().pages_evictable, 2);
    assert_eq!(scheduler.stats().pages_free, 2);
    // Needs 3 pages: 2 free + evicts the least recently released ([1,2]).
    scheduler.add(request(2, vec![8; 5], 1)).unwrap();
    step(&mut scheduler, &mut shadow);
    assert!(scheduler
        .prefix_cache()
        .find(&[1, 2, 3], 1)
        .pages
        .is_empty());
    assert_eq!(scheduler.prefix_cache().find(&[5, 6, 7], 1).pages.len(), 1);
}

#[test]
fn generated_tokens_equal_the_oracle_under_pressure() {
    // Many requests with a shared prefix through a tight pool and small budget.
    let mut scheduler = Scheduler::new(config(2, 7, 3, true)).unwrap();
    let mut shadow = ShadowKv::default();
    let prompts: Vec<Vec<u32>> = (0..6u32).map(|i| vec![7, 7, 7, 7, i, i + 1]).collect();
    for (id, prompt) in prompts.iter().enumerate() {
        scheduler
            .add(request(id as u64, prompt.clone(), 6))
            .unwrap();
    }
    let mut outputs = std::collections::HashMap::new();
    let mut steps = 0;
    while scheduler.num_unfinished() > 0 {
        let plan = scheduler.schedule().unwrap();
        let sampled = shadow.run(&scheduler, &plan, false);
        for done in scheduler.postprocess(&sampled).unwrap() {
            outputs.insert(done.id, done.generated);
        }
        check_pool(&scheduler);
        steps += 1;
        assert!(steps < 500);
    }
    for (id, prompt) in prompts.iter().enumerate() {
        assert_eq!(
            outputs[&(id as u64)],
            reference_generation(prompt, 6, false)
        );
    }
    let stats = scheduler.stats();
    assert!(stats.preemptions > 0, "{stats:?}");
    assert!(stats.prefix_hit_tokens > 0, "{stats:?}");
    assert_eq!(next_token(&[1]), next_token(&[1]));
}

#[test]
fn a_draft_rides_behind_a_decode_and_rejected_guesses_leave_no_trace() {
    let mut scheduler = Scheduler::new(config(4, 8, 16, true)).unwrap();
    let mut shadow = ShadowKv::default();
    let prompt = vec![5, 6];
    scheduler.add(request(0, prompt.clone(), 10)).unwrap();
    // A prefilling request takes no draft.
    assert_eq!(scheduler.set_draft(0, vec![1, 2]), 0);
    step(&mut scheduler, &mut shadow);
    // Three guesses, all wrong: rows 2..6 run, one token comes out, the table goes back to
    // three tokens and page 0 (full once the fourth token is computed) holds no guess.
    let tokens = scheduler.tokens(0).unwrap().to_vec();
    assert_eq!(scheduler.set_draft(0, draft(&tokens, 3, 0)), 3);
    let (plan, _) = step(&mut scheduler, &mut shadow);
    assert_eq!(
        (plan.sequences[0].positions.clone(), plan.sequences[0].draft),
        (2..6, 3)
    );
    assert_eq!(plan.logits_for(), vec![0, 1, 2, 3]);
    assert_eq!(scheduler.tokens(0).unwrap().len(), 4);
    assert_eq!(
        scheduler.pages_of(0).unwrap().len(),
        1,
        "the guesses' page went back"
    );
    check_cache(&shadow, &scheduler);
    // Two right guesses of three: three tokens come out in one step.
    let tokens = scheduler.tokens(0).unwrap().to_vec();
    scheduler.set_draft(0, draft(&tokens, 3, 2));
    step(&mut scheduler, &mut shadow);
    assert_eq!(scheduler.tokens(0).unwrap().len(), 7);
    check_cache(&shadow, &scheduler);
    assert_eq!(scheduler.prefix_cache().cached_pages().count(), 1);
    // The draft is cut to what max_new_tokens leaves (5 generated of 10: at most 4 guesses).
    let tokens = scheduler.tokens(0).unwrap().to_vec();
    assert_eq!(scheduler.set_draft(0, draft(&tokens, 9, 9)), 4);
    let (_, done) = step(&mut scheduler, &mut shadow);
    assert_eq!(done, vec![0]);
    check_cache(&shadow, &scheduler);
    assert_eq!(scheduler.stats().pages_used, 0);
}

#[test]
fn drafts_never_crowd_out_another_decode() {
    // Budget 3: two decodes need 2; the first one's draft of 5 gets 1 row.
    let mut scheduler = Scheduler::new(config(4, 16, 3, false)).unwrap();
    let mut shadow = ShadowKv::default();
    scheduler.add(request(0, vec![1], 20)).unwrap();
    scheduler.add(request(1, vec![2], 20)).unwrap();
    step(&mut scheduler, &mut shadow);
    let tokens = scheduler.tokens(0).unwrap().to_vec();
    assert_eq!(scheduler.set_draft(0, draft(&tokens, 5, 5)), 5);
    let (plan, _) = step(&mut scheduler, &mut shadow);
    let rows: Vec<(u64, usize)> = plan.sequences.iter().map(|s| (s.id, s.draft)).collect();
    assert_eq!(rows, vec![(0, 1), (1, 0)]);
}
