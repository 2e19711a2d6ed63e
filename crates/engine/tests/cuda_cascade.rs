//! CUDA cascade decode (`PAGODA_CASCADE_ATTENTION`) on the default model in bf16: the CPU
//! cascade test's requests (behind one system prompt ending mid-page, two groups nested
//! under it behind a longer shared branch, one request sharing nothing, joining while others
//! decode and finishing at different steps) give, with cascade on, the tokens and
//! log-probabilities of the plain fused decode within bf16 noise, and cascade did run with
//! nested groups (its counters moved). A second wave after the first has finished reuses
//! the cached prefix in new groups, with graphs captured for the first wave's buckets. On
//! the GPU machine only: elsewhere the test shows as ignored.

mod common;

use pagoda_engine::{load_model, Device, Engine, EngineSettings, LoadOptions, ModelSource};
use pagoda_models::llama::{AttentionPolicy, WeightPrecision};
use pagoda_models::llama_cuda::{CudaKernels, DType};
use pagoda_ops::attention::CascadeRule;
use pagoda_ops::sampling::SamplingParams;

/// Tokens and the chosen tokens' log-probabilities of each request, and the cascade
/// counters (steps, groups).
type Run = (Vec<(Vec<u32>, Vec<f32>)>, (u64, u64));

fn run(cascade: Option<CascadeRule>, prompts: &[Vec<u32>]) -> Option<Run> {
    let path = common::default_model_path()?;
    let options = LoadOptions {
        precision: WeightPrecision::AsStored,
        device: Device::Cuda { dtype: DType::BF16 },
    };
    let loaded = load_model(&ModelSource::Gguf(path), options, &mut |_, _| {}).unwrap();
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
    let mut engine = Engine::with_settings(loaded.model, config, settings).unwrap();
    let mut outputs = vec![(Vec::new(), Vec::new()); prompts.len()];
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
            }
            step += 1;
        }
    }
    let counters = engine.counters();
    Some((
        outputs,
        (counters.steps_cuda_cascade, counters.cuda_cascade_groups),
    ))
}

#[test]
#[ignore = "needs a GPU"]
fn cascade_agrees_with_the_plain_fused_decode_on_the_default_model() {
    let Some(loaded) = common::default_model() else {
        return;
    };
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
        "Once upon a time".to_string(),
        format!("{system}{branch}Q: Is clay soil good for roses?"),
        format!("{system}Q: Spell the word cat backwards."),
        format!("{system}Q: What colour is the sky at noon?"),
        format!("{system}{branch}Q: How deep should I plant garlic?"),
        format!("{system}{branch}Q: Does lavender need much water?"),
    ]
    .iter()
    .map(|p| tokenizer.encode(p, true).unwrap())
    .collect();
    let system_tokens = tokenizer.encode(&system, true).unwrap().len();
    assert!(
        system_tokens >= 128 && system_tokens % 16 != 0,
        "the system prompt ({system_tokens} tokens) must end mid-page"
    );
    let Some((plain, (plain_steps, _))) = run(None, &prompts) else {
        return;
    };
    assert_eq!(plain_steps, 0, "cascade off must not run");
    let (cascade, (steps, groups)) = run(Some(CascadeRule::ANY), &prompts).unwrap();
    eprintln!("cascade steps {steps}, groups {groups}");
    assert!(
        steps > 0 && groups > steps,
        "cascade never ran or never nested: {steps} steps, {groups} groups"
    );
    // bf16 noise may flip a near tie and send a request down another path: compare each
    // request up to its first differing token, and require most tokens to agree.
    let (mut same, mut total, mut worst) = (0, 0, 0f32);
    for (index, (a, b)) in plain.iter().zip(&cascade).enumerate() {
        assert_eq!(a.0.len(), b.0.len(), "request {index}: lengths differ");
        total += a.0.len();
        for position in 0..a.0.len() {
            let difference = (a.1[position] - b.1[position]).abs();
            worst = worst.max(difference);
            assert!(
                difference <= 0.15,
                "request {index} token {position}: log-probability {} against {}",
                b.1[position],
                a.1[position]
            );
            if a.0[position] != b.0[position] {
                break;
            }
            same += 1;
        }
    }
    eprintln!("{same} of {total} tokens agree before a request's first difference; worst log-probability difference {worst:.4}");
    assert!(
        same * 10 >= total * 8,
        "only {same} of {total} tokens agree"
    );
}
