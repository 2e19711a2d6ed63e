//! Speculative decoding (`--spec ngram`) gives exactly plain decoding's output: the same
//! tokens and the same log-probability bits for greedy, seeded-sampled and penalised
//! requests, alone and batched, while the proposer's guesses are accepted (counted) and
//! rejected ones leave nothing behind. The oracle is the same engine without speculation.

mod common;

use common::{default_model, engine_config};
use pagoda_engine::speculation::{SpeculationMode, SpeculationSettings};
use pagoda_engine::{Engine, EngineSettings};
use pagoda_models::llama::AttentionPolicy;
use pagoda_ops::sampling::SamplingParams;

fn engine(speculation: SpeculationMode, max_batch: usize) -> Option<(Engine, Vec<Vec<u32>>)> {
    let loaded = default_model()?;
    let config = engine_config(256, 256, 1024, AttentionPolicy::Auto);
    let settings = EngineSettings {
        prefix_caching: true,
        speculation: SpeculationSettings {
            mode: speculation,
            max_batch,
            // The policy is timing-dependent; these tests count acceptances.
            cost_policy: false,
            ..SpeculationSettings::default()
        },
        ..EngineSettings::from_config(
            &pagoda_config::Config::resolve(|_| None, Vec::new(), &[]).unwrap(),
        )
    };
    let prompts = [
        "Repeat this list exactly twice: apple, banana, cherry, date, elderberry, fig, grape.\nList:",
        "def area(width, height):\n    return width * height\n\n# The same function, renamed to surface:\n",
        "The quick brown fox jumps over the lazy dog. The quick brown fox",
    ]
    .iter()
    .map(|p| loaded.tokenizer.encode(p, true).unwrap())
    .collect();
    Some((
        Engine::with_settings(loaded.model, config, settings).unwrap(),
        prompts,
    ))
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

/// Runs `copies` of every prompt at once, each with its own sampling parameters.
fn run(engine: &mut Engine, prompts: &[Vec<u32>], copies: usize) -> Output {
    let mut output = Output::new();
    for copy in 0..copies {
        for (index, prompt) in prompts.iter().enumerate() {
            let id = engine
                .add_request(
                    prompt.clone(),
                    params(index + copy),
                    48 / (copy + 1),
                    Vec::new(),
                    true,
                )
                .unwrap();
            output.insert(id, (Vec::new(), Vec::new()));
        }
    }
    common::run_to_end(engine, &mut output);
    output
}

#[test]
fn speculation_gives_plain_decodings_bits() {
    let Some((mut plain, prompts)) = engine(SpeculationMode::Off, 4) else {
        return;
    };
    let expected = run(&mut plain, &prompts, 1);
    let (mut speculative, _) = engine(SpeculationMode::Ngram, 4).unwrap();
    let got = run(&mut speculative, &prompts, 1);
    assert_eq!(got.len(), expected.len());
    for ((id, (tokens, logprobs)), (_, (want_tokens, want_logprobs))) in got.iter().zip(&expected) {
        assert_eq!(tokens, want_tokens, "request {id}: tokens");
        assert!(
            logprobs == want_logprobs,
            "request {id}: log-probability bits"
        );
    }
    let counters = speculative.counters();
    println!(
        "drafted {} accepted {} emitted {} in {} rows; {} steps against {} without",
        counters.spec_drafted,
        counters.spec_accepted,
        counters.spec_emitted,
        counters.spec_rows,
        counters.steps_split_kv + counters.steps_gather,
        plain.counters().steps_split_kv + plain.counters().steps_gather,
    );
    assert!(
        counters.spec_accepted > 0,
        "no guess was accepted on repetitive prompts"
    );
    assert!(
        counters.spec_drafted > counters.spec_accepted,
        "every guess was accepted"
    );
    let drafted_by_position = counters.spec_drafted_at_1
        + counters.spec_drafted_at_2
        + counters.spec_drafted_at_3
        + counters.spec_drafted_at_4;
    let accepted_by_position = counters.spec_accepted_at_1
        + counters.spec_accepted_at_2
        + counters.spec_accepted_at_3
        + counters.spec_accepted_at_4;
    assert_eq!(drafted_by_position, counters.spec_drafted);
    assert_eq!(accepted_by_position, counters.spec_accepted);
    assert_eq!(
        counters.spec_drafted_at_1, counters.spec_rows,
        "every draft has a first guess"
    );
    assert!(counters.spec_accepted_at_1 >= counters.spec_accepted_at_2);
    assert_eq!(speculative.pages_used(), 0, "pages leaked");
}

#[test]
fn the_policy_turns_speculation_off_in_large_batches_without_changing_outputs() {
    let Some((mut plain, prompts)) = engine(SpeculationMode::Off, 3) else {
        return;
    };
    let expected = run(&mut plain, &prompts, 2);
    let (mut speculative, _) = engine(SpeculationMode::Ngram, 3).unwrap();
    let got = run(&mut speculative, &prompts, 2);
    assert!(got == expected, "outputs differ");
    let counters = speculative.counters();
    assert!(
        counters.spec_steps_off > 0,
        "six decoding requests are over the policy's 3"
    );
    assert!(
        counters.spec_rows > 0,
        "the batch shrank to 3 and speculation came back"
    );
}

/// Constrained requests speculate: the n-gram guesses are cut at the first token the grammar
/// refuses, the rest verified by the request's own masked draws, so the output is plain
/// constrained decoding's, token for token, and still follows the schema.
#[test]
fn constrained_requests_speculate_within_their_grammar() {
    use pagoda_grammar::{GrammarSpec, Grammars};
    let Some(loaded) = common::default_model() else {
        return;
    };
    let vocabulary = pagoda_engine::grammar_vocabulary(&loaded.tokenizer).unwrap();
    let grammars = Grammars::new(vocabulary).unwrap();
    let schema = serde_json::json!({
        "type": "array",
        "items": {"enum": ["apple", "banana", "cherry", "date"]},
        "minItems": 6,
        "maxItems": 10,
    });
    let prompt = loaded
        .tokenizer
        .encode(
            "Repeat as JSON: [\"apple\", \"banana\", \"cherry\", \"date\", \"apple\", \
             \"banana\", \"cherry\", \"date\"]\nJSON: ",
            true,
        )
        .unwrap();
    let run = |mode| {
        let (mut engine, _) = engine(mode, 4).unwrap();
        let mut output = Output::new();
        for kind in 0..3 {
            let id = engine
                .add_request(prompt.clone(), params(kind), 96, Vec::new(), true)
                .unwrap();
            let constraint = grammars
                .constraint(&GrammarSpec::JsonSchema(schema.clone()))
                .unwrap();
            engine.set_constraint(id, constraint).unwrap();
            output.insert(id, (Vec::new(), Vec::new()));
        }
        common::run_to_end(&mut engine, &mut output);
        (output, engine.counters().clone())
    };
    let (plain, plain_counters) = run(SpeculationMode::Off);
    // The masks' host time is counted (masks beside the forward, then the draw stage).
    assert!(
        plain_counters.structured_mask_compute_us > 0
            && plain_counters.structured_mask_accept_us > 0,
        "{plain_counters:?}"
    );
    let (speculative, counters) = run(SpeculationMode::Ngram);
    assert!(
        speculative == plain,
        "speculation changed a constrained output"
    );
    assert!(
        counters.spec_rows > 0 && counters.spec_accepted > 0,
        "constrained requests did not speculate: {} rows, {} accepted",
        counters.spec_rows,
        counters.spec_accepted
    );
    for (tokens, _) in speculative.values() {
        let text = loaded.tokenizer.decode(tokens);
        let value: serde_json::Value = serde_json::from_str(text.trim_end_matches("<|im_end|>"))
            .unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let items = value.as_array().expect("an array");
        assert!((6..=10).contains(&items.len()), "{text}");
    }
    println!(
        "constrained: drafted {} accepted {} cut by the grammar {}",
        counters.spec_drafted, counters.spec_accepted, counters.spec_grammar_cut
    );
}
