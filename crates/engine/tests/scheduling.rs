//! The engine on the scheduler: prefix caching does not change what the model computes (same
//! greedy tokens and logprobs with caching on and off) and reports its hits; preemption by
//! recompute under a tight pool reproduces exactly the tokens of an unpressured run, also for
//! seeded random sampling (the sampler state survives preemption).

mod common;

use common::{default_model, engine_config};
use pagoda_engine::Engine;
use pagoda_models::llama::AttentionPolicy;
use pagoda_models::tokenizer::Tokenizer;
use pagoda_ops::attention::AttentionPath;
use pagoda_ops::sampling::SamplingParams;

fn engine(
    path: AttentionPath,
    num_pages: usize,
    max_batch_tokens: usize,
    prefix_caching: bool,
) -> Option<(Engine, Tokenizer)> {
    let loaded = default_model()?;
    let config = engine_config(
        num_pages,
        max_batch_tokens,
        1024,
        AttentionPolicy::Force(path),
    );
    let engine = Engine::with_prefix_caching(loaded.model, config, prefix_caching).unwrap();
    Some((engine, loaded.tokenizer))
}

/// Runs all prompts concurrently to completion; returns (tokens, logprobs) per prompt.
fn run_all(
    engine: &mut Engine,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
    max_new_tokens: usize,
) -> Vec<(Vec<u32>, Vec<Vec<f32>>)> {
    let ids: Vec<u64> = prompts
        .iter()
        .map(|prompt| {
            engine
                .add_request(prompt.clone(), *params, max_new_tokens, Vec::new(), true)
                .unwrap()
        })
        .collect();
    let mut results = vec![(Vec::new(), Vec::new()); prompts.len()];
    let mut steps = 0;
    while engine.num_running() > 0 {
        for event in engine.step().unwrap() {
            let index = ids.iter().position(|&id| id == event.request).unwrap();
            results[index].0.push(event.token);
            results[index].1.push(event.logprobs.unwrap());
        }
        steps += 1;
        assert!(steps < 2000, "no progress");
    }
    results
}

const SYSTEM: &str = "You are a careful assistant. Answer briefly and precisely, cite facts, \
    and never invent numbers. The user is a student of European history who asks about ";

fn shared_prefix_prompts(tokenizer: &Tokenizer) -> Vec<Vec<u32>> {
    [
        "the printing press.",
        "the Hanseatic League and its trade.",
        "Charlemagne.",
    ]
    .iter()
    .map(|topic| tokenizer.encode(&format!("{SYSTEM}{topic}"), true).unwrap())
    .collect()
}

fn worst_difference(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f32::max)
}

#[test]
fn prefix_caching_on_and_off_give_the_same_tokens_and_report_hits() {
    let Some((mut cached, tokenizer)) = engine(AttentionPath::SplitKv, 128, 512, true) else {
        return;
    };
    let Some((mut uncached, _)) = engine(AttentionPath::SplitKv, 128, 512, false) else {
        return;
    };
    let prompts = shared_prefix_prompts(&tokenizer);
    assert!(
        prompts[0].len() > 32,
        "the shared prefix must span full pages"
    );
    let greedy = SamplingParams::greedy();
    // Warm the cache with the first prompt alone, then run all: the others hit its pages.
    let warm_on = run_all(&mut cached, &prompts[..1], &greedy, 4);
    let warm_off = run_all(&mut uncached, &prompts[..1], &greedy, 4);
    assert_eq!(warm_on, warm_off);
    let on = run_all(&mut cached, &prompts, &greedy, 8);
    let off = run_all(&mut uncached, &prompts, &greedy, 8);
    let mut worst = 0f32;
    for (i, (a, b)) in on.iter().zip(&off).enumerate() {
        assert_eq!(
            a.0, b.0,
            "prompt {i}: prefix caching changed the greedy tokens"
        );
        worst = worst.max(worst_difference(&a.1, &b.1));
    }
    eprintln!("worst logprob difference cached vs uncached: {worst:.2e}");
    assert!(worst < 1e-3, "logprobs differ by {worst}");
    assert!(
        cached.counters().prefix_hit_tokens >= 2 * 32,
        "{:?}",
        cached.counters()
    );
    assert_eq!(uncached.counters().prefix_hit_tokens, 0);
    assert_eq!(uncached.pages_cached(), 0);
    assert!(cached.pages_cached() > 0);
    assert_eq!(cached.pages_used(), 0, "finished requests hold no pages");
    assert_eq!(
        cached.pages_free() + cached.scheduler_stats().pages_evictable,
        128
    );
}

#[test]
fn a_repeated_long_prompt_reports_its_full_pages_as_hits() {
    let Some((mut engine, tokenizer)) = engine(AttentionPath::SplitKv, 64, 512, true) else {
        return;
    };
    let prompt = tokenizer
        .encode(
            &format!("{SYSTEM}the long history of movable type in Asia."),
            true,
        )
        .unwrap();
    let first = run_all(
        &mut engine,
        std::slice::from_ref(&prompt),
        &SamplingParams::greedy(),
        3,
    );
    assert_eq!(engine.counters().prefix_hit_tokens, 0);
    let second = run_all(
        &mut engine,
        std::slice::from_ref(&prompt),
        &SamplingParams::greedy(),
        3,
    );
    assert_eq!(first[0].0, second[0].0);
    // Every full page except one holding the last prompt token is shared.
    let expected = (prompt.len() - 1) / 16 * 16;
    assert_eq!(engine.counters().prefix_hit_tokens, expected as u64);
}

/// The KV events a router outside the engine mirrors (NVIDIA Dynamo's): a prompt's full pages
/// are reported stored in order, each chained to its parent with its tokens; pages evicted to
/// make room are reported removed; replaying the events gives as many pages as the cache holds.
#[test]
fn kv_events_report_a_prompts_pages_and_their_eviction() {
    use pagoda_engine::CacheEvent;
    use pagoda_kv::{hash_page, ROOT_HASH};
    use std::collections::HashSet;

    // 12 pages of 16 tokens: the second prompt cannot fit beside the first one's cached pages.
    let Some((mut engine, tokenizer)) = engine(AttentionPath::SplitKv, 12, 512, true) else {
        return;
    };
    engine.record_kv_events(true);
    let first = tokenizer
        .encode(&format!("{SYSTEM}the history of printing."), true)
        .unwrap();
    run_all(
        &mut engine,
        std::slice::from_ref(&first),
        &SamplingParams::greedy(),
        2,
    );
    let events = engine.take_kv_events();
    let full_pages = first.len() / 16;
    assert!(full_pages >= 2, "prompt of {} tokens", first.len());
    let mut parent = ROOT_HASH;
    let mut mirror = HashSet::new();
    for (page, event) in first.chunks_exact(16).zip(&events) {
        let key = hash_page(parent, page);
        let expected = CacheEvent::Stored {
            key,
            parent: (parent != ROOT_HASH).then_some(parent),
            tokens: page.to_vec(),
        };
        assert_eq!(event, &expected);
        mirror.insert(key);
        parent = key;
    }
    assert_eq!(events.len(), full_pages, "{events:?}");
    assert_eq!(mirror.len(), engine.pages_cached());

    // A longer, different prompt needs the pool: the first prompt's pages are evicted.
    let second = tokenizer
        .encode(
            &"a completely different request about ships and harbours. ".repeat(16),
            true,
        )
        .unwrap();
    assert!(
        (second.len() + 2).div_ceil(16) + full_pages > 12,
        "prompt of {} tokens",
        second.len()
    );
    run_all(
        &mut engine,
        std::slice::from_ref(&second),
        &SamplingParams::greedy(),
        2,
    );
    let mut removed = 0;
    for event in engine.take_kv_events() {
        match event {
            CacheEvent::Stored { key, .. } => assert!(mirror.insert(key), "stored twice"),
            CacheEvent::Removed { key } => {
                assert!(mirror.remove(&key), "removed an unknown page");
                removed += 1;
            }
        }
    }
    assert!(
        removed > 0,
        "nothing evicted: {} + {} tokens, {} cached",
        first.len(),
        second.len(),
        engine.pages_cached()
    );
    assert_eq!(mirror.len(), engine.pages_cached());
}

fn check_preemption(path: AttentionPath) {
    // 7 pages of 16 tokens for three 24-token prompts generating 12 tokens each: all three
    // are admitted with two pages each, then all need a third page at their ninth token
    // while one is free, so the youngest are preempted and recomputed. Seeded random
    // sampling checks the sampler state survives preemption. Prefilled together, the 72
    // prompt rows take the `amx` set's tiles; recomputed alone, they do not.
    let Some((mut tight, tokenizer)) = engine(path, 7, 512, true) else {
        return;
    };
    let Some((mut roomy, _)) = engine(path, 64, 512, false) else {
        return;
    };
    let text = "The history of the printing press is often told as the story of a single \
                inventor, but the movable type had a long history before Gutenberg in Korea.";
    let base = tokenizer.encode(text, true).unwrap();
    assert!(base.len() >= 26, "{} tokens", base.len());
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| base[i..i + 24].to_vec()).collect();
    let params = SamplingParams {
        temperature: 0.9,
        seed: Some(7),
        ..SamplingParams::default()
    };
    let squeezed = run_all(&mut tight, &prompts, &params, 12);
    let alone = run_all(&mut roomy, &prompts, &params, 12);
    assert!(
        tight.counters().preemptions > 0,
        "the test must force preemption: {:?}",
        tight.scheduler_stats()
    );
    for (i, (a, b)) in alone.iter().zip(&squeezed).enumerate() {
        let worst = worst_difference(&a.1, &b.1);
        eprintln!("{path:?} prompt {i}: worst logprob difference {worst:.2e}");
        assert_eq!(
            a.0, b.0,
            "prompt {i}: preemption changed the tokens ({path:?})"
        );
        assert!(worst < 1e-3, "{worst}");
    }
    assert_eq!(tight.pages_used(), 0);
    assert_eq!(tight.num_waiting(), 0);
}

#[test]
fn preempted_requests_produce_the_tokens_of_an_unpressured_run_on_gather() {
    check_preemption(AttentionPath::Gather);
}

#[test]
fn preempted_requests_produce_the_tokens_of_an_unpressured_run_on_split_kv() {
    check_preemption(AttentionPath::SplitKv);
}

/// Re-runs this file's other tests under every CPU kernel configuration this machine can
/// run (the `amx` set on emulated tiles where it lacks them) and prints which ran.
#[test]
fn under_every_cpu_configuration() {
    pagoda_testkit::rerun_under_every_cpu_configuration("under_every_cpu_configuration");
}

#[test]
fn a_request_larger_than_the_whole_pool_is_refused_with_what_to_change() {
    let Some((mut engine, tokenizer)) = engine(AttentionPath::Gather, 8, 256, true) else {
        return;
    };
    let prompt = tokenizer.encode("Hello there", true).unwrap();
    // 8 pages of 16 tokens hold 128; the prompt plus 500 new tokens cannot fit however long
    // it waits.
    let error = engine
        .add_request(
            prompt.clone(),
            SamplingParams::greedy(),
            500,
            Vec::new(),
            false,
        )
        .unwrap_err();
    assert!(
        matches!(
            error,
            pagoda_engine::EngineError::TooLargeForPool {
                total: 8,
                max_new_tokens: 500,
                ..
            }
        ),
        "{error:?}"
    );
    let message = error.to_string();
    assert!(
        message.contains("max_tokens") && message.contains("--kv-pages"),
        "{message}"
    );
    // What fits is admitted.
    engine
        .add_request(prompt, SamplingParams::greedy(), 16, Vec::new(), false)
        .unwrap();
}

/// Prefix-aware admission: a cold burst behind one system prompt computes the prompt once
/// (the others wait for its pages), with the same tokens and log-probabilities as plain FIFO
/// admission, which computes it per request.
#[test]
fn a_cold_burst_behind_one_prompt_computes_it_once_with_the_same_tokens() {
    let Some(loaded) = default_model() else {
        return;
    };
    // The system prompt twice: 60+ shared tokens, 3 full pages.
    let prompts: Vec<Vec<u32>> = ["the printing press.", "Charlemagne.", "the Hansa."]
        .iter()
        .map(|topic| {
            let text = format!("{SYSTEM}{SYSTEM}{topic}");
            loaded.tokenizer.encode(&text, true).unwrap()
        })
        .collect();
    let common = prompts[0]
        .iter()
        .zip(&prompts[1])
        .take_while(|(a, b)| a == b);
    assert!(common.count() >= 48, "the prompts must share 3 pages");
    let mut runs = Vec::new();
    for wait in [0, 32] {
        let loaded = default_model().unwrap();
        let config = engine_config(
            128,
            512,
            1024,
            AttentionPolicy::Force(AttentionPath::SplitKv),
        );
        let settings = pagoda_engine::EngineSettings {
            prefix_wait_tokens: wait,
            ..pagoda_engine::EngineSettings::from_config(pagoda_config::global())
        };
        let mut engine = Engine::with_settings(loaded.model, config, settings).unwrap();
        let results = run_all(&mut engine, &prompts, &SamplingParams::greedy(), 6);
        runs.push((results, engine.counters().clone()));
    }
    let ((plain, plain_counters), (waited, waited_counters)) = (&runs[0], &runs[1]);
    for (i, (a, b)) in plain.iter().zip(waited).enumerate() {
        assert_eq!(a.0, b.0, "prompt {i}: waiting changed the tokens");
        assert!(worst_difference(&a.1, &b.1) < 1e-3, "prompt {i}: logprobs");
    }
    assert_eq!(plain_counters.prefix_waits, 0);
    assert_eq!(
        plain_counters.prefix_hit_tokens, 0,
        "a cold burst shares nothing"
    );
    assert!(waited_counters.prefix_waits >= 2, "{waited_counters:?}");
    // The two later prompts start on the first one's cached pages.
    assert!(
        waited_counters.prefix_hit_tokens >= 2 * 48,
        "{waited_counters:?}"
    );
    assert_eq!(
        plain_counters.tokens_forwarded - waited_counters.tokens_forwarded,
        waited_counters.prefix_hit_tokens
    );
}
