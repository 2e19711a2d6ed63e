//! A draft model as proposer (`--spec draft`): the default model as stored (Q4_1) drafts for
//! itself in exact mode (f32 weights), the pairing of the benchmark. Under the invariant rule
//! the output is plain decoding's, token for token and log-probability bit for bit, for
//! greedy, seeded-sampled and penalised requests, alone and batched, while most guesses are
//! accepted; under the Leviathan rule greedy requests still give plain decoding's tokens and
//! every request ends with its pages (the target's and the draft's) back in the pools.

mod common;

use common::engine_config;
use pagoda_engine::speculation::{
    check_vocabularies, DraftModel, SpeculationMode, SpeculationSettings, VerifyRule,
};
use pagoda_engine::{load_model, Engine, EngineSettings, LoadOptions, ModelSource};
use pagoda_models::llama::{AttentionPolicy, WeightPrecision};
use pagoda_models::tokenizer::Tokenizer;
use pagoda_ops::sampling::SamplingParams;

fn settings(mode: SpeculationMode, rule: VerifyRule) -> EngineSettings {
    EngineSettings {
        prefix_caching: true,
        speculation: SpeculationSettings {
            mode,
            rule,
            max_batch: 4,
            // The policy is timing-dependent; these tests count acceptances.
            cost_policy: false,
            ..SpeculationSettings::default()
        },
        ..EngineSettings::from_config(
            &pagoda_config::Config::resolve(|_| None, Vec::new(), &[]).unwrap(),
        )
    }
}

/// The exact-mode target, with the as-stored model drafting for it under `rule` (`None`:
/// no speculation), and the tokenizer.
fn engine(rule: Option<VerifyRule>) -> Option<(Engine, Tokenizer)> {
    let path = common::default_model_path()?;
    let load = |precision| {
        load_model(
            &ModelSource::Gguf(path.clone()),
            LoadOptions::cpu(precision),
            &mut |_, _| {},
        )
        .unwrap()
    };
    let target = load(WeightPrecision::F32);
    let config = engine_config(256, 256, 1024, AttentionPolicy::Auto);
    let mode = rule.map_or(SpeculationMode::Off, |_| SpeculationMode::Draft);
    let rule_or_default = rule.unwrap_or_default();
    let mut engine = Engine::with_settings(
        target.model,
        config.clone(),
        settings(mode, rule_or_default),
    )
    .unwrap();
    if rule.is_some() {
        let draft = load(WeightPrecision::AsStored);
        check_vocabularies(&target.tokenizer, &draft.tokenizer).unwrap();
        let draft_engine = Engine::with_settings(
            draft.model,
            config,
            settings(SpeculationMode::Off, VerifyRule::Invariant),
        )
        .unwrap();
        let vocab = engine.model_config().vocab_size;
        engine.set_proposer(Box::new(DraftModel::new(
            draft_engine,
            rule_or_default,
            0.0,
            vocab,
        )));
    }
    Some((engine, target.tokenizer))
}

use common::Output;

fn params(kind: usize) -> SamplingParams {
    match kind % 3 {
        0 => SamplingParams::greedy(),
        1 => SamplingParams {
            temperature: 0.7,
            top_p: 0.9,
            seed: Some(11),
            ..SamplingParams::greedy()
        },
        _ => SamplingParams {
            temperature: 1.0,
            top_k: 40,
            repetition_penalty: 1.15,
            seed: Some(5),
            ..SamplingParams::greedy()
        },
    }
}

fn prompts(tokenizer: &Tokenizer) -> Vec<Vec<u32>> {
    [
        "Write a short story about a lighthouse keeper.",
        "def fibonacci(n):",
        "The capital of France is",
    ]
    .iter()
    .map(|p| tokenizer.encode(p, true).unwrap())
    .collect()
}

/// Runs every prompt with kinds `kinds(index)`, all at once.
fn run(engine: &mut Engine, prompts: &[Vec<u32>], kinds: impl Fn(usize) -> usize) -> Output {
    let mut output = Output::new();
    for (index, prompt) in prompts.iter().enumerate() {
        let id = engine
            .add_request(prompt.clone(), params(kinds(index)), 40, Vec::new(), true)
            .unwrap();
        output.insert(id, (Vec::new(), Vec::new()));
    }
    common::run_to_end(engine, &mut output);
    output
}

#[test]
fn a_draft_model_gives_plain_decodings_bits() {
    let Some((mut plain, tokenizer)) = engine(None) else {
        return;
    };
    let prompts = prompts(&tokenizer);
    let (mut speculative, _) = engine(Some(VerifyRule::Invariant)).unwrap();
    for kinds in [|i: usize| i, |i: usize| i + 1] {
        let expected = run(&mut plain, &prompts, kinds);
        let got = run(&mut speculative, &prompts, kinds);
        for ((id, (tokens, bits)), (_, (want_tokens, want_bits))) in got.iter().zip(&expected) {
            assert_eq!(tokens, want_tokens, "request {id}: tokens");
            assert!(bits == want_bits, "request {id}: log-probability bits");
        }
    }
    // Alone, one request at a time (the batch of 1 is where speculation pays).
    for kind in 0..3 {
        let one = [prompts[kind].clone()];
        let expected = run(&mut plain, &one, |_| kind);
        let got = run(&mut speculative, &one, |_| kind);
        assert!(
            got.values().eq(expected.values()),
            "kind {kind} alone differs"
        );
    }
    let counters = speculative.counters();
    let rate = counters.spec_accepted as f64 / counters.spec_drafted.max(1) as f64;
    println!(
        "drafted {} accepted {} ({rate:.2}) emitted {} in {} rows",
        counters.spec_drafted, counters.spec_accepted, counters.spec_emitted, counters.spec_rows
    );
    // The quantized model agrees with its f32 self on most tokens.
    assert!(rate > 0.5, "acceptance {rate:.2}");
    assert!(counters.spec_drafted > counters.spec_accepted);
    assert_eq!(speculative.pages_used(), 0, "target pages leaked");
}

#[test]
fn the_leviathan_rule_keeps_greedy_tokens_and_returns_every_page() {
    let Some((mut plain, tokenizer)) = engine(None) else {
        return;
    };
    let prompts = prompts(&tokenizer);
    let (mut speculative, _) = engine(Some(VerifyRule::Leviathan)).unwrap();
    let greedy = |_: usize| 0;
    let expected = run(&mut plain, &prompts, greedy);
    let got = run(&mut speculative, &prompts, greedy);
    for ((id, (tokens, _)), (_, (want, _))) in got.iter().zip(&expected) {
        assert_eq!(tokens, want, "greedy request {id}");
    }
    // Sampled requests: the right number of tokens, guesses accepted, nothing leaked.
    let sampled = run(&mut speculative, &prompts, |i| 1 + i % 2);
    for (id, (tokens, _)) in &sampled {
        assert_eq!(tokens.len(), 40, "request {id}");
    }
    let counters = speculative.counters();
    assert!(counters.spec_accepted > 0);
    assert_eq!(speculative.pages_used(), 0, "target pages leaked");
}
