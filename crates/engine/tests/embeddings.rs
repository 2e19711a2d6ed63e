//! `Engine::embed` on the default model: the vector does not depend on how the prompt is
//! chunked, on what else holds pages, or on the prefix cache; it has unit length; its pages go
//! back to the pool; a prompt larger than the pool is refused with the numbers. Its values
//! match an independent numpy float64 forward (`data/embeddings_numpy.json`, written by
//! `scripts/fixtures/embedding_reference.py`): to 1e-5 in exact mode (f32 weights), within
//! the quantized path's error as stored.

mod common;

use std::path::PathBuf;

use pagoda_engine::{load_model, Backend, Engine, EngineError, LoadOptions, ModelSource};
use pagoda_models::llama::{AttentionPolicy, WeightPrecision};
use pagoda_models::tokenizer::Tokenizer;
use pagoda_ops::sampling::SamplingParams;

fn load() -> Option<(Backend, Tokenizer)> {
    load_as(WeightPrecision::AsStored)
}

fn load_as(precision: WeightPrecision) -> Option<(Backend, Tokenizer)> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.is_file() {
        eprintln!("skipping: {} is missing", path.display());
        return None;
    }
    let loaded = load_model(
        &ModelSource::Gguf(path),
        LoadOptions::cpu(precision),
        &mut |_, _| {},
    )
    .unwrap();
    Some((loaded.model, loaded.tokenizer))
}

fn engine(model: Backend, num_pages: usize, max_batch_tokens: usize) -> Engine {
    let config = common::engine_config(num_pages, max_batch_tokens, 1024, AttentionPolicy::Auto);
    Engine::with_prefix_caching(model, config, true).unwrap()
}

#[test]
fn embeddings_do_not_depend_on_chunks_pages_or_load() {
    let Some((model, tokenizer)) = load() else {
        return;
    };
    let text = "Paged attention keeps the KV cache in fixed-size pages. ".repeat(4);
    let tokens = tokenizer.encode(&text, true).unwrap();
    assert!(tokens.len() > 40, "{} tokens", tokens.len());
    let mut whole = engine(model, 32, 512);
    let reference = whole.embed(&tokens).unwrap();
    assert_eq!(reference.len(), whole.model_config().hidden_size);
    let norm: f64 = reference.iter().map(|&v| v as f64 * v as f64).sum();
    assert!((norm.sqrt() - 1.0).abs() < 1e-5, "norm {}", norm.sqrt());
    assert_eq!(
        whole.pages_free(),
        32,
        "the embedding's pages went back to the pool"
    );
    assert_eq!(whole.counters().embeddings, 1);

    // Again, with a request holding pages and the prefix cache warm from it.
    let id = whole
        .add_request(
            tokens.clone(),
            SamplingParams::greedy(),
            4,
            Vec::new(),
            false,
        )
        .unwrap();
    whole.step().unwrap();
    let used = whole.pages_used();
    assert!(used > 0);
    assert_eq!(whole.embed(&tokens).unwrap(), reference, "under load");
    assert_eq!(whole.pages_used(), used);
    whole.cancel(id);

    // Chunked prefill gives the same vector (chunks of 7 tokens).
    let Some((model, _)) = load() else { return };
    let mut chunked = engine(model, 32, 7);
    let again = chunked.embed(&tokens).unwrap();
    let close = again
        .iter()
        .zip(&reference)
        .all(|(a, b)| (a - b).abs() <= 1e-5);
    assert!(close, "chunked prefill changed the embedding");

    // A different text gives a different vector.
    let other = tokenizer
        .encode("Rust has no garbage collector.", true)
        .unwrap();
    let dot: f32 = whole
        .embed(&other)
        .unwrap()
        .iter()
        .zip(&reference)
        .map(|(a, b)| a * b)
        .sum();
    assert!(dot < 0.999, "two different texts have cosine {dot}");
}

#[test]
fn embeddings_refuse_what_cannot_fit() {
    let Some((model, _)) = load() else {
        return;
    };
    let mut small = engine(model, 2, 64);
    let tokens = vec![100u32; 40]; // 3 pages of 16, the pool has 2
    match small.embed(&tokens) {
        Err(EngineError::TooLargeForPool {
            needed: 3,
            total: 2,
            ..
        }) => {}
        other => panic!("expected TooLargeForPool, got {other:?}"),
    }
    assert!(matches!(small.embed(&[]), Err(EngineError::EmptyPrompt)));
    assert!(matches!(
        small.embed(&[u32::MAX]),
        Err(EngineError::TokenOutOfRange { .. })
    ));
    // While a request holds both pages, the embedding has to wait.
    let id = small
        .add_request(vec![5; 20], SamplingParams::greedy(), 4, Vec::new(), false)
        .unwrap();
    small.step().unwrap();
    assert!(matches!(
        small.embed(&[7; 20]),
        Err(EngineError::OutOfPages { needed: 2, .. })
    ));
    small.cancel(id);
    assert!(small.embed(&[7; 20]).is_ok());
}

#[test]
fn embeddings_match_the_numpy_forward() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/embeddings_numpy.json");
    let cases: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    for (precision, cosine_bound, difference_bound) in [
        (WeightPrecision::F32, 1e-6, 1e-5),
        (WeightPrecision::AsStored, 1e-3, 2e-2),
    ] {
        let Some((model, _)) = load_as(precision) else {
            return;
        };
        let mut engine = engine(model, 32, 512);
        for case in cases.as_array().unwrap() {
            let ids: Vec<u32> = case["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            let expected: Vec<f64> = case["embedding"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect();
            let got = engine.embed(&ids).unwrap();
            let cosine: f64 = got.iter().zip(&expected).map(|(&a, b)| a as f64 * b).sum();
            let worst = got
                .iter()
                .zip(&expected)
                .map(|(&a, b)| (a as f64 - b).abs())
                .fold(0.0, f64::max);
            let name = &case["name"];
            println!(
                "{precision:?} {name}: 1 - cosine {:.2e}, largest difference {worst:.2e}",
                1.0 - cosine
            );
            assert!(
                1.0 - cosine < cosine_bound,
                "{precision:?} {name}: cosine {cosine}"
            );
            assert!(
                worst < difference_bound,
                "{precision:?} {name}: difference {worst}"
            );
        }
    }
}
