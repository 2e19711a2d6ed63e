//! CUDA cascade decode (`PAGODA_CASCADE_ATTENTION`) in bf16 on the default model's shape
//! (SmolLM2-135M: 9 query heads over 3 KV heads, head_dim 64; random weights, so the test
//! runs wherever the GPU is, without the model file): the CPU cascade test's requests (behind
//! one system prompt ending mid-page, two groups nested under it behind a longer shared
//! branch, one request sharing nothing, joining while others decode and finishing at
//! different steps) give, with cascade on, the tokens and log-probabilities of the plain
//! fused decode within bf16 noise, and cascade did run with nested groups (its counters
//! moved). A second wave after the first has finished reuses the cached prefix in new
//! groups. On the GPU machine only: elsewhere the test shows as ignored.

mod common;

use pagoda_engine::cuda_runner::CudaModel;
use pagoda_engine::{Engine, EngineSettings};
use pagoda_models::config::ModelConfig;
use pagoda_models::llama::AttentionPolicy;
use pagoda_models::llama_cuda::{CudaKernels, DType};
use pagoda_models::random::{preset, RandomWeights};
use pagoda_ops::attention::CascadeRule;
use pagoda_ops::sampling::SamplingParams;

/// Per request: its tokens, each one's log-probability and the gap between the position's
/// two most likely tokens; and the cascade counters (steps, groups).
type Run = (Vec<(Vec<u32>, Vec<f32>, Vec<f32>)>, (u64, u64));

const VOCAB: usize = 32000;

fn config() -> ModelConfig {
    ModelConfig {
        num_layers: 8,
        vocab_size: VOCAB,
        ..preset("smollm2-135m").unwrap()
    }
}

fn run(cascade: Option<CascadeRule>, prompts: &[Vec<u32>]) -> Run {
    let gpu = common::gpu();
    let weights = RandomWeights::new(&config(), 36, 4 << 30).unwrap();
    let model = CudaModel::load(config(), &weights, gpu, DType::BF16, &mut |_, _| {}).unwrap();
    let global = EngineSettings::from_config(pagoda_config::global());
    let settings = EngineSettings {
        prefix_caching: true,
        cuda_kernels: CudaKernels {
            cascade,
            ..global.cuda_kernels
        },
        ..global
    };
    let config = common::engine_config(512, 256, 2048, AttentionPolicy::Auto);
    let mut engine = Engine::with_settings(model, config, settings).unwrap();
    let mut outputs = vec![(Vec::new(), Vec::new(), Vec::new()); prompts.len()];
    for wave in [
        0..prompts.len() / 2 + 1,
        prompts.len() / 2 + 1..prompts.len(),
    ] {
        let mut ids = Vec::new();
        let add = |engine: &mut Engine, index: usize, ids: &mut Vec<_>| {
            let params = SamplingParams::greedy();
            let id = engine
                .add_request(
                    prompts[index].clone(),
                    params,
                    8 + 3 * index,
                    Vec::new(),
                    true,
                )
                .unwrap();
            ids.push((id, index));
        };
        // The wave's first request prefills (or finds) the shared pages; the rest join
        // two steps later, the last one three steps after them.
        let (first, last) = (wave.start, wave.end - 1);
        add(&mut engine, first, &mut ids);
        let mut step = 0;
        while engine.num_running() + engine.num_waiting() > 0 || ids.len() < wave.len() {
            match step {
                2 => (first + 1..last).for_each(|i| add(&mut engine, i, &mut ids)),
                5 => add(&mut engine, last, &mut ids),
                _ => {}
            }
            for event in engine.step().unwrap() {
                let index = ids.iter().find(|(id, _)| *id == event.request).unwrap().1;
                outputs[index].0.push(event.token);
                let logprobs = event.logprobs.unwrap();
                outputs[index].1.push(logprobs[event.token as usize]);
                let (mut first, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                for &value in &logprobs {
                    if value > first {
                        (first, second) = (value, first);
                    } else if value > second {
                        second = value;
                    }
                }
                outputs[index].2.push(first - second);
            }
            step += 1;
        }
    }
    let counters = engine.counters();
    (
        outputs,
        (counters.steps_cuda_cascade, counters.cuda_cascade_groups),
    )
}

/// `len` token ids from `salt` (a text stand-in: the weights are random).
fn text(len: usize, salt: usize) -> Vec<u32> {
    (0..len)
        .map(|i| (1 + (i * 7919 + salt * 104_729) % (VOCAB - 1)) as u32)
        .collect()
}

#[test]
#[ignore = "needs a GPU"]
fn cascade_agrees_with_the_plain_fused_decode_on_the_default_models_shape() {
    // A 169-token system prompt (ends mid-page), a 60-token branch under it, questions.
    let system = text(169, 1);
    let branch = text(60, 2);
    let prompts: Vec<Vec<u32>> = (0..10)
        .map(|i| {
            let mut prompt = if i == 4 { Vec::new() } else { system.clone() };
            if [2, 3, 5, 8, 9].contains(&i) {
                prompt.extend(&branch);
            }
            prompt.extend(text(5 + i % 4, 10 + i));
            prompt
        })
        .collect();
    let (plain, (plain_steps, _)) = run(None, &prompts);
    assert_eq!(plain_steps, 0, "cascade off must not run");
    let (cascade, (steps, groups)) = run(Some(CascadeRule::ANY), &prompts);
    eprintln!("cascade steps {steps}, groups {groups}");
    assert!(
        steps > 0 && groups > steps,
        "cascade never ran or never nested: {steps} steps, {groups} groups"
    );
    // bf16 noise may flip a near tie and send a request down another path: compare each
    // request up to its first differing token, which must be a near tie of the plain run.
    let (mut same, mut total, mut worst) = (0, 0, 0f32);
    for (index, (a, b)) in plain.iter().zip(&cascade).enumerate() {
        assert_eq!(a.0.len(), b.0.len(), "request {index}: lengths differ");
        total += a.0.len();
        for position in 0..a.0.len() {
            if a.0[position] != b.0[position] {
                assert!(
                    a.2[position] <= 0.1,
                    "request {index} token {position}: {} against {}, not a near tie (gap {})",
                    b.0[position],
                    a.0[position],
                    a.2[position]
                );
                break;
            }
            let difference = (a.1[position] - b.1[position]).abs();
            worst = worst.max(difference);
            assert!(
                difference <= 0.1,
                "request {index} token {position}: log-probability {} against {}",
                b.1[position],
                a.1[position]
            );
            same += 1;
        }
    }
    eprintln!(
        "{same} of {total} tokens agree before a request's first difference; worst \
         log-probability difference {worst:.4}"
    );
    assert!(same * 2 >= total, "only {same} of {total} tokens agree");
}
