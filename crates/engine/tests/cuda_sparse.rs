//! CUDA sparse decode (`--sparse-attention`: Quest page selection on the device) against the
//! CPU's, in f32 on the default model's shape (SmolLM2-135M: 9 query heads over 3 KV heads,
//! head_dim 64; random weights, 4 layers). Two long prompts and one short one, the second long
//! one joining while the first decodes (its prefill chunks share steps with decode rows: the
//! mixed steps' decode rows select too), greedy with log-probabilities:
//! - CUDA sparse gives the CPU sparse engine's tokens (up to a near tie) and log-probabilities
//!   within f32 noise, and the two made the same selections: the process-wide counters moved
//!   by the same steps, pages scanned and pages kept;
//! - it is not dense decode: the log-probabilities differ from the CUDA dense run's.
//!
//! On the GPU machine only: elsewhere the test shows as ignored.

mod common;

use pagoda_engine::cuda_runner::CudaModel;
use pagoda_engine::{Engine, EngineSettings};
use pagoda_models::config::ModelConfig;
use pagoda_models::llama::{AttentionPolicy, Model, WeightPrecision};
use pagoda_models::llama_cuda::DType;
use pagoda_models::random::{preset, RandomWeights};
use pagoda_ops::attention::{sparse_decode_counts, SparseAttention, SparseDecodeCounts};
use pagoda_ops::sampling::SamplingParams;

const VOCAB: usize = 32000;
const NEW_TOKENS: usize = 12;

/// Per request its tokens, each position's log-softmax row; the CUDA sparse steps.
type Run = (Vec<(Vec<u32>, Vec<Vec<f32>>)>, u64);

fn config() -> ModelConfig {
    ModelConfig {
        num_layers: 4,
        vocab_size: VOCAB,
        ..preset("smollm2-135m").unwrap()
    }
}

/// `len` token ids from `salt` (a text stand-in: the weights are random).
fn text(len: usize, salt: usize) -> Vec<u32> {
    (0..len)
        .map(|i| (1 + (i * 7919 + salt * 104_729) % (VOCAB - 1)) as u32)
        .collect()
}

fn run(cuda: bool, sparse: Option<SparseAttention>, prompts: &[Vec<u32>]) -> Run {
    let weights = RandomWeights::new(&config(), 41, 4 << 30).unwrap();
    let settings = EngineSettings {
        sparse_attention: sparse,
        ..EngineSettings::from_config(pagoda_config::global())
    };
    let engine_config = common::engine_config(400, 512, 2048, AttentionPolicy::Auto);
    let mut engine = if cuda {
        let gpu = common::gpu();
        let model = CudaModel::load(config(), &weights, gpu, DType::F32, &mut |_, _| {}).unwrap();
        Engine::with_settings(model, engine_config, settings).unwrap()
    } else {
        let model = Model::load(config(), &weights, WeightPrecision::F32).unwrap();
        Engine::with_settings(model, engine_config, settings).unwrap()
    };
    let mut outputs = vec![(Vec::new(), Vec::new()); prompts.len()];
    let mut ids = Vec::new();
    let mut step = 0;
    while engine.num_running() + engine.num_waiting() > 0 || ids.len() < prompts.len() {
        // Requests 0 and 2 at once; request 1 once request 0 decodes.
        let joining: &[usize] = match step {
            0 => &[0, 2],
            4 => &[1],
            _ => &[],
        };
        for &index in joining {
            let params = SamplingParams::greedy();
            let id = engine
                .add_request(prompts[index].clone(), params, NEW_TOKENS, Vec::new(), true)
                .unwrap();
            ids.push((id, index));
        }
        for event in engine.step().unwrap() {
            let index = ids.iter().find(|(id, _)| *id == event.request).unwrap().1;
            outputs[index].0.push(event.token);
            outputs[index].1.push(event.logprobs.unwrap());
        }
        step += 1;
    }
    (outputs, engine.counters().steps_cuda_sparse)
}

fn counts_of(before: SparseDecodeCounts) -> SparseDecodeCounts {
    let now = sparse_decode_counts();
    SparseDecodeCounts {
        steps: now.steps - before.steps,
        pages_scanned: now.pages_scanned - before.pages_scanned,
        pages_kept: now.pages_kept - before.pages_kept,
        dense_past_limit: now.dense_past_limit - before.dense_past_limit,
    }
}

/// The largest log-probability difference over the positions both runs share up to their
/// first differing token (included), which must be a near tie of `a` (gap between its two
/// best below `tie`); and the tokens that agree before it.
fn compare(a: &Run, b: &Run, tie: f32, what: &str) -> (f32, usize) {
    let (mut worst, mut same) = (0f32, 0);
    for (index, (x, y)) in a.0.iter().zip(&b.0).enumerate() {
        assert_eq!(x.0.len(), y.0.len(), "{what}: request {index} lengths");
        for position in 0..x.0.len() {
            let row = &x.1[position];
            // The first differing token's row counts too: it is where the runs part.
            for (p, q) in row.iter().zip(&y.1[position]) {
                worst = worst.max((p - q).abs());
            }
            if x.0[position] != y.0[position] {
                let mut sorted = row.clone();
                sorted.sort_by(|p, q| q.total_cmp(p));
                assert!(
                    sorted[0] - sorted[1] <= tie,
                    "{what}: request {index} token {position}: {} against {}, not a near tie",
                    y.0[position],
                    x.0[position]
                );
                break;
            }
            same += 1;
        }
    }
    (worst, same)
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_sparse_decode_selects_as_the_cpu_does() {
    let prompts = vec![text(1400, 1), text(900, 2), text(200, 3)];
    let quest = SparseAttention::new(256, 64, 512).unwrap();
    let before = sparse_decode_counts();
    let cpu = run(false, Some(quest), &prompts);
    let cpu_counts = counts_of(before);
    let before = sparse_decode_counts();
    let sparse = run(true, Some(quest), &prompts);
    let cuda_counts = counts_of(before);
    let dense = run(true, None, &prompts);
    eprintln!(
        "CPU {cpu_counts:?}, CUDA {cuda_counts:?}; CUDA sparse steps {}",
        sparse.1
    );
    assert!(cpu_counts.steps > 0 && cpu_counts.pages_kept < cpu_counts.pages_scanned);
    assert_eq!(cuda_counts, cpu_counts, "the device selected other pages");
    assert!(sparse.1 > 0, "CUDA sparse steps never ran");
    assert_eq!(dense.1, 0);

    let (worst, same) = compare(&cpu, &sparse, 1e-3, "CPU against CUDA sparse");
    eprintln!(
        "CPU against CUDA sparse: {same} tokens agree, worst log-prob difference {worst:.2e}"
    );
    assert!(worst <= 2e-3, "CUDA sparse strays from the CPU's: {worst}");
    assert!(same * 4 >= 3 * 3 * NEW_TOKENS, "only {same} tokens agree");

    let (moved, _) = compare(&dense, &sparse, f32::INFINITY, "dense against sparse");
    eprintln!("dense against sparse: worst log-prob difference {moved:.2e}");
    assert!(
        moved > 10.0 * worst.max(1e-3),
        "sparse decode looks dense: {moved}"
    );
}
