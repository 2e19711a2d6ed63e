//! `Engine::embed` on the GPU against the CPU engine (the oracle) on the same random weights,
//! in f32 (tight) and bf16 (loose), for a one-token input (which must not take the decode
//! graphs), a prompt in one chunk, and one over several prefill chunks. On the GPU machine
//! only: elsewhere the test shows as ignored.

mod common;

use common::gpu;

use pagoda_engine::cuda_runner::{CudaModel, DType};
use pagoda_engine::{Engine, EngineConfig};
use pagoda_models::config::ModelConfig;
use pagoda_models::llama::{AttentionPolicy, Model, WeightPrecision};
use pagoda_models::random::{preset, RandomWeights};

fn config() -> ModelConfig {
    ModelConfig {
        num_layers: 3,
        vocab_size: 4096,
        ..preset("smollm2-135m").unwrap()
    }
}

fn engine_config(max_batch_tokens: usize) -> EngineConfig {
    common::engine_config(64, max_batch_tokens, 1024, AttentionPolicy::Auto)
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_embeddings_match_the_cpu() {
    let gpu = gpu();
    let weights = RandomWeights::new(&config(), 41, 4 << 30).unwrap();
    let cpu_model = Model::load(config(), &weights, WeightPrecision::F32).unwrap();
    let mut cpu = Engine::with_prefix_caching(cpu_model, engine_config(512), false).unwrap();
    let inputs: Vec<Vec<u32>> = vec![
        vec![17],
        (0..37).map(|i| (i * 97 + 5) % 4096).collect(),
        (0..300).map(|i| (i * 31 + 11) % 4096).collect(),
    ];
    let expected: Vec<Vec<f32>> = inputs.iter().map(|t| cpu.embed(t).unwrap()).collect();
    for (dtype, bound) in [(DType::F32, 1e-4f32), (DType::BF16, 3e-2)] {
        for max_batch_tokens in [512, 64] {
            let model =
                CudaModel::load(config(), &weights, gpu.clone(), dtype, &mut |_, _| {}).unwrap();
            let mut engine =
                Engine::with_prefix_caching(model, engine_config(max_batch_tokens), true).unwrap();
            for (tokens, expected) in inputs.iter().zip(&expected) {
                let got = engine.embed(tokens).unwrap();
                let worst = got
                    .iter()
                    .zip(expected)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                let cosine: f32 = got.iter().zip(expected).map(|(a, b)| a * b).sum();
                println!(
                    "{dtype:?} chunk {max_batch_tokens} len {}: difference {worst:.2e}, 1 - cosine {:.2e}",
                    tokens.len(),
                    1.0 - cosine
                );
                assert!(
                    worst < bound,
                    "{dtype:?} len {}: difference {worst}",
                    tokens.len()
                );
            }
            assert_eq!(engine.pages_free(), 64, "the pages went back");
            assert_eq!(engine.counters().embeddings, inputs.len() as u64);
        }
    }
}
