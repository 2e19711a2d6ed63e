//! Speculative decoding on CUDA: with `--deterministic` (a row's logits do not depend on
//! what shares its step), `--spec ngram` gives plain decoding's tokens and log-probability
//! bits, bf16 and f32, for requests sampled on the host (log-probabilities asked) and beside
//! them a request whose rows, guessed ones included, sample on the device; with the n-gram
//! proposer and with a draft model (the same weights in bf16). The Leviathan rule keeps
//! greedy tokens. On the GPU machine only: elsewhere the test shows as ignored.

mod common;

use std::sync::Arc;

use common::gpu;

use pagoda_cuda::Gpu;
use pagoda_engine::cuda_runner::{CudaModel, DType};
use pagoda_engine::speculation::{DraftModel, SpeculationMode, SpeculationSettings, VerifyRule};
use pagoda_engine::{CpuThreadsMode, Engine, EngineSettings};
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

use common::Output;

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
    common::run_to_end(engine, &mut output);
    output
}

/// The engine of `mode` over `weights` on the GPU; a draft-model engine drafts with the same
/// weights in bf16 (a near but not equal model for the f32 target).
fn engine(
    gpu: &Arc<Gpu>,
    weights: &RandomWeights,
    dtype: DType,
    mode: SpeculationMode,
    rule: VerifyRule,
) -> Engine {
    let settings = |mode| EngineSettings {
        prefix_caching: true,
        prefix_wait_tokens: 0,
        cuda_warmup: false,
        cpu_threads: CpuThreadsMode::Auto,
        split_kv_chunk_tokens: 256,
        cascade: None,
        speculation: SpeculationSettings {
            mode,
            rule,
            max_batch: 4,
            // The policy is timing-dependent; these tests count acceptances.
            cost_policy: false,
            ..SpeculationSettings::default()
        },
        cuda_kernels: CudaKernels {
            deterministic: true,
            ..CudaKernels::default()
        },
        masks_beside: true,
        device_masks: true,
        tensor_parallel_size: 1,
        sparse_attention: None,
    };
    let load =
        |dtype| CudaModel::load(config(), weights, gpu.clone(), dtype, &mut |_, _| {}).unwrap();
    let engine_config = common::engine_config(128, 256, 512, AttentionPolicy::Auto);
    let mut engine =
        Engine::with_settings(load(dtype), engine_config.clone(), settings(mode)).unwrap();
    if mode == SpeculationMode::Draft {
        let draft = Engine::with_settings(
            load(DType::BF16),
            engine_config,
            settings(SpeculationMode::Off),
        )
        .unwrap();
        let vocab = config().vocab_size;
        engine.set_proposer(Box::new(DraftModel::new(draft, rule, 0.0, vocab)));
    }
    engine
}

#[test]
#[ignore = "needs a GPU"]
fn speculation_on_cuda_gives_plain_decodings_bits_in_deterministic_mode() {
    let gpu = gpu();
    let weights = RandomWeights::new(&config(), 5, 4 << 30).unwrap();
    for dtype in [DType::BF16, DType::F32] {
        let mut plain = engine(
            &gpu,
            &weights,
            dtype,
            SpeculationMode::Off,
            VerifyRule::Invariant,
        );
        let expected = run(&mut plain);
        for mode in [SpeculationMode::Ngram, SpeculationMode::Draft] {
            let mut speculative = engine(&gpu, &weights, dtype, mode, VerifyRule::Invariant);
            let got = run(&mut speculative);
            let counters = speculative.counters();
            println!(
                "{dtype:?} {mode:?}: drafted {} accepted {} in {} rows ({} on the GPU), {} tokens \
                 sampled on the GPU, {} verification steps from graphs",
                counters.spec_drafted,
                counters.spec_accepted,
                counters.spec_rows,
                counters.spec_rows_gpu,
                counters.sampled_tokens_gpu,
                counters.steps_cuda_verify_graph
            );
            assert!(
                got == expected,
                "{dtype:?} {mode:?}: speculation changed the output"
            );
            assert!(
                counters.spec_accepted > 0,
                "{dtype:?} {mode:?}: no guess was accepted"
            );
            // Request 2 asks no log-probabilities: its guessed rows were drawn on the GPU.
            assert_eq!(counters.sampled_tokens_gpu, 40, "{dtype:?} {mode:?}");
            if mode == SpeculationMode::Draft {
                assert!(counters.spec_rows_gpu > 0, "{dtype:?}: device verification");
            }
            assert!(
                counters.steps_cuda_verify_graph > 0,
                "{dtype:?} {mode:?}: verify graphs"
            );
            assert_eq!(speculative.pages_used(), 0);
        }
        // The Leviathan rule: greedy request 0 keeps its tokens; every request ends.
        let mut leviathan = engine(
            &gpu,
            &weights,
            dtype,
            SpeculationMode::Draft,
            VerifyRule::Leviathan,
        );
        let got = run(&mut leviathan);
        let first = |output: &Output| output.values().next().unwrap().0.clone();
        assert_eq!(
            first(&got),
            first(&expected),
            "{dtype:?}: greedy under Leviathan"
        );
        assert!(got.values().all(|(tokens, _)| tokens.len() == 40));
        assert_eq!(leviathan.pages_used(), 0);
    }
}
