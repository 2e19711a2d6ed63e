//! Speculative decoding on CUDA: with `--deterministic` (a row's logits do not depend on
//! what shares its step), `--spec ngram` gives plain decoding's tokens and log-probability
//! bits, bf16 and f32, for requests sampled on the host (log-probabilities asked) and beside
//! them requests whose unguessed rows sample on the device. On the GPU machine only:
//! elsewhere the test shows as ignored.

mod common;

use std::collections::BTreeMap;

use common::gpu;

use pagoda_engine::cuda_runner::{CudaModel, DType};
use pagoda_engine::speculation::{SpeculationMode, SpeculationSettings};
use pagoda_engine::{CpuThreadsMode, Engine, EngineSettings, RequestId};
use pagoda_models::config::ModelConfig;
use pagoda_models::llama::AttentionPolicy;
use pagoda_models::llama_cuda::CudaKernels;
use pagoda_models::random::{preset, RandomWeights};
use pagoda_ops::sampling::SamplingParams;

fn config() -> ModelConfig {
    ModelConfig {
        num_layers: 4,
        vocab_size: 4096,
        ..preset("smollm2-135m").unwrap()
    }
}

type Output = BTreeMap<RequestId, (Vec<u32>, Vec<Vec<u32>>)>;

fn run(engine: &mut Engine) -> Output {
    let mut output = Output::new();
    // Prompts that repeat themselves, so the n-gram proposer finds guesses.
    for (index, period) in [5u32, 7, 11].into_iter().enumerate() {
        let prompt: Vec<u32> = (0..60).map(|i| (i % period) * 37 + 3).collect();
        let params = match index {
            0 => SamplingParams::greedy(),
            _ => SamplingParams {
                temperature: 0.8,
                top_p: 0.95,
                seed: Some(index as u64),
                ..SamplingParams::greedy()
            },
        };
        let id = engine
            .add_request(prompt, params, 40, Vec::new(), index != 2)
            .unwrap();
        output.insert(id, (Vec::new(), Vec::new()));
    }
    while engine.num_running() + engine.num_waiting() > 0 {
        for event in engine.step().unwrap() {
            let entry = output.get_mut(&event.request).unwrap();
            entry.0.push(event.token);
            if let Some(values) = event.logprobs {
                entry.1.push(values.iter().map(|v| v.to_bits()).collect());
            }
        }
    }
    output
}

#[test]
#[ignore = "needs a GPU"]
fn speculation_on_cuda_gives_plain_decodings_bits_in_deterministic_mode() {
    let gpu = gpu();
    let weights = RandomWeights::new(&config(), 5, 4 << 30).unwrap();
    for dtype in [DType::BF16, DType::F32] {
        let mut outputs = Vec::new();
        let mut accepted = 0;
        for mode in [SpeculationMode::Off, SpeculationMode::Ngram] {
            let model =
                CudaModel::load(config(), &weights, gpu.clone(), dtype, &mut |_, _| {}).unwrap();
            let settings = EngineSettings {
                prefix_caching: true,
                cuda_warmup: false,
                cpu_threads: CpuThreadsMode::Auto,
                split_kv_chunk_tokens: 256,
                speculation: SpeculationSettings {
                    mode,
                    ..SpeculationSettings::default()
                },
                cuda_kernels: CudaKernels {
                    deterministic: true,
                    ..CudaKernels::default()
                },
            };
            let engine_config = common::engine_config(128, 256, 512, AttentionPolicy::Auto);
            let mut engine = Engine::with_settings(model, engine_config, settings).unwrap();
            outputs.push(run(&mut engine));
            let counters = engine.counters();
            println!(
                "{dtype:?} {mode:?}: drafted {} accepted {} in {} rows",
                counters.spec_drafted, counters.spec_accepted, counters.spec_rows
            );
            accepted = counters.spec_accepted;
            assert_eq!(engine.pages_used(), 0);
        }
        assert!(
            outputs[0] == outputs[1],
            "{dtype:?}: speculation changed the output"
        );
        assert!(accepted > 0, "{dtype:?}: no guess was accepted");
    }
}
