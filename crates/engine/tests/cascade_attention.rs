//! CPU cascade attention (`PAGODA_CASCADE_ATTENTION`) on the default model: requests behind
//! one system prompt (and two behind a longer shared branch of it: nested groups), whose
//! prompts end mid-page, joining while others decode and finishing at different steps, give
//! the same tokens and the same log-probability bits with cascade on as with it off, and
//! the cascade did run (its step counter moved); also under a pool so tight that the shared
//! prefix is evicted and recomputed between steps.

mod common;

use pagoda_engine::{Engine, EngineSettings};
use pagoda_models::llama::AttentionPolicy;
use pagoda_ops::attention::{cascade_counts, CascadeRule};
use pagoda_ops::sampling::SamplingParams;

/// The cascade counters are process-wide: the two tests run one at a time, so that one's
/// cascade steps never land between the other's "before" and "after" (a race CI hit).
static COUNTERS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Tokens and log-probability bits of each request.
type Outputs = Vec<(Vec<u32>, Vec<Vec<u32>>)>;

/// What a run did to the pool: preemptions and cached pages evicted.
type Pressure = (u64, usize);

fn run(
    cascade: Option<CascadeRule>,
    prompts: &[Vec<u32>],
    num_pages: usize,
) -> Option<(Outputs, Pressure)> {
    let loaded = common::default_model()?;
    let settings = EngineSettings {
        cascade,
        // 64-token chunks: a ~200-token system prompt shares three of them.
        split_kv_chunk_tokens: 64,
        prefix_caching: true,
        ..EngineSettings::from_config(pagoda_config::global())
    };
    let config = common::engine_config(num_pages, 256, 2048, AttentionPolicy::Auto);
    let mut engine = Engine::with_settings(loaded.model, config, settings).unwrap();
    engine.record_kv_events(true);
    let mut evicted = 0;
    let mut outputs: Outputs = vec![(Vec::new(), Vec::new()); prompts.len()];
    let mut ids = Vec::new();
    let add = |engine: &mut Engine, index: usize, ids: &mut Vec<_>| {
        let id = engine
            .add_request(
                prompts[index].clone(),
                SamplingParams::greedy(),
                6 + 3 * index,
                Vec::new(),
                true,
            )
            .unwrap();
        ids.push((id, index));
    };
    // The first request prefills the shared pages; the rest join once they are cached,
    // two of them a few steps later than the others.
    add(&mut engine, 0, &mut ids);
    let mut step = 0;
    while engine.num_running() + engine.num_waiting() > 0 || ids.len() < prompts.len() {
        match step {
            2 => (1..prompts.len() - 2).for_each(|i| add(&mut engine, i, &mut ids)),
            5 => (prompts.len() - 2..prompts.len()).for_each(|i| add(&mut engine, i, &mut ids)),
            _ => {}
        }
        for event in engine.step().unwrap() {
            let index = ids.iter().find(|(id, _)| *id == event.request).unwrap().1;
            outputs[index].0.push(event.token);
            let bits = event
                .logprobs
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect();
            outputs[index].1.push(bits);
        }
        evicted += engine
            .take_kv_events()
            .iter()
            .filter(|e| matches!(e, pagoda_kv::CacheEvent::Removed { .. }))
            .count();
        step += 1;
    }
    Some((outputs, (engine.counters().preemptions, evicted)))
}

/// The prompts: a system prompt of 8 sentences ending mid-page, a longer branch of it shared
/// by three, and one that shares nothing.
fn prompts() -> Option<Vec<Vec<u32>>> {
    let loaded = common::default_model()?;
    let tokenizer = loaded.tokenizer;
    let system = "You are a careful assistant. Answer briefly and truthfully, cite no sources, \
                  and never invent facts. "
        .repeat(8);
    let branch = "The user is a gardener in a dry climate who asks about plants, soil, water \
                  and the seasons; keep answers practical. "
        .repeat(3);
    let prompts: Vec<Vec<u32>> = [
        format!("{system}Q: What is the capital of France?"),
        format!("{system}Q: Name a prime number above ten."),
        format!("{system}{branch}Q: When should I water tomatoes?"),
        format!("{system}{branch}Q: Which mulch keeps soil cool?"),
        format!("{system}Q: Spell the word cat backwards."),
        "Once upon a time".to_string(),
        format!("{system}{branch}Q: Is clay soil good for roses?"),
    ]
    .iter()
    .map(|p| tokenizer.encode(p, true).unwrap())
    .collect();
    let system_tokens = tokenizer.encode(&system, true).unwrap().len();
    assert!(
        system_tokens >= 128 && system_tokens % 16 != 0,
        "the system prompt ({system_tokens} tokens) must cover two chunks and end mid-page"
    );
    Some(prompts)
}

#[test]
fn cascade_gives_the_plain_steps_bits_on_the_default_model() {
    let _counters = COUNTERS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let Some(prompts) = prompts() else {
        return;
    };
    let before = cascade_counts();
    let (plain, _) = run(None, &prompts, 512).unwrap();
    assert_eq!(cascade_counts(), before, "cascade off must not run");
    let (cascade, _) = run(Some(CascadeRule::ANY), &prompts, 512).unwrap();
    let after = cascade_counts();
    assert!(
        after.0 > before.0 && after.1 > after.0 && after.3 > 0,
        "the cascade never ran or never nested: {before:?} -> {after:?}"
    );
    for (index, (a, b)) in plain.iter().zip(&cascade).enumerate() {
        assert_eq!(a.0, b.0, "request {index}: tokens differ");
        assert_eq!(a.1, b.1, "request {index}: log-probability bits differ");
    }
}

/// A pool too small for every request at once: requests are preempted and the cached pages
/// of the shared prefix are evicted and computed again between steps, so the groups change
/// from step to step; cascade still gives the plain steps' bits.
#[test]
fn cascade_gives_the_plain_steps_bits_when_the_prefix_is_evicted_between_steps() {
    let _counters = COUNTERS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let Some(prompts) = prompts() else {
        return;
    };
    let pages = 20;
    let before = cascade_counts();
    let (plain, (preempted, evicted)) = run(None, &prompts, pages).unwrap();
    assert!(
        preempted > 0 && evicted > 0,
        "the pool must be tight: {preempted} preemptions, {evicted} pages evicted"
    );
    let (cascade, pressure) = run(Some(CascadeRule::ANY), &prompts, pages).unwrap();
    assert!(cascade_counts().0 > before.0, "the cascade never ran");
    assert_eq!(pressure, (preempted, evicted), "the same schedule");
    for (index, (a, b)) in plain.iter().zip(&cascade).enumerate() {
        assert_eq!(a.0, b.0, "request {index}: tokens differ");
        assert_eq!(a.1, b.1, "request {index}: log-probability bits differ");
    }
}
