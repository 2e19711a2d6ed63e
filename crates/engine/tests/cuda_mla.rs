//! DeepSeek's latent attention (MLA) on CUDA against the CPU model, on the GPU machine only
//! (elsewhere every test shows as ignored; run there with `--include-ignored` and a binary
//! built with `--features cuda`).
//!
//! The model is the `deepseek-mla-dense-tiny` preset: the MLA kernels' latent row (512 + 64)
//! and one head tile (16 heads), YaRN with a rope scale other than 1 and the softmax scale
//! correction, every MLP dense; with and without the query
//! compression (`q_lora_rank`); and the same attention with DeepSeek's expert layers (the
//! first layer dense, group-limited routing: V2's softmax with groups by their best expert,
//! V3's sigmoid plus selection bias with groups by their top-two sum; shared experts; bf16
//! top-10 log-probabilities within 0.5, as cuda_moe.rs, a near-tied router row may route
//! otherwise in bf16). Covered: ragged prefill chunks, mixed steps and batched
//! decode steps over scattered pages, f32 (relative logit error < 2e-3, the bound of the
//! llama geometries) and bf16 (top-10 log-probability error < 0.15), greedy ids; in
//! deterministic mode as well (every row on the MLA prefill kernel); and through the engine:
//! a greedy request alone, beside others, and with its prompt's pages from the prefix cache
//! gives the same tokens.
//!
//! With CUDA graphs on (as every run here but the eager baselines), decode steps replay from a
//! graph per batch bucket (3 requests pad to the bucket of 4) and the other steps run eagerly:
//! graphs on and off give the same logits (bitwise in deterministic mode; within f32 and bf16
//! noise otherwise: a padded step plans its chunks and picks its GEMMs for the bucket) and,
//! through the engine, the same greedy tokens.

mod common;
#[path = "common/schedule.rs"]
mod schedule;

use std::sync::Arc;

use common::gpu;
use schedule::{measure, run_schedule, Schedule, NUM_PAGES, PAGE_SIZE};

use pagoda_cuda::Gpu;
use pagoda_engine::cuda_runner::{CudaCacheOptions, CudaModel, CudaRunner, DType};
use pagoda_engine::{CpuThreadsMode, Engine, EngineSettings};
use pagoda_models::config::{
    ExpertGroupLimit, ExpertScoring, GroupScoring, MlaConfig, ModelConfig, MoeConfig, TopKWeights,
};
use pagoda_models::llama::{AttentionPolicy, Model, WeightPrecision};
use pagoda_models::llama_cuda::CudaKernels;
use pagoda_models::random::{preset, RandomWeights};
use pagoda_ops::attention::KvType;
use pagoda_ops::sampling::SamplingParams;

/// The preset, its query compressed (`Some(64)`) or projected directly (`None`).
fn config(q_lora_rank: Option<usize>) -> ModelConfig {
    let base = preset("deepseek-mla-dense-tiny").unwrap();
    let mla = MlaConfig {
        q_lora_rank,
        ..base.mla.clone().unwrap()
    };
    ModelConfig {
        mla: Some(mla),
        ..base
    }
}

/// The preset's attention with DeepSeek's expert layers: 3 layers, the first dense, 16
/// experts of width 64 in 4 groups, a row keeping the best 2 groups. `v3`: query compression,
/// sigmoid scores plus the selection bias, groups by their top-two sum, top-4 normalised then
/// scaled by 2.5, one shared expert. Else V2's: the query projected directly, softmax,
/// groups by their best expert, top-3 unnormalised scaled by 1.5, two shared experts.
fn moe_config(v3: bool) -> ModelConfig {
    let base = config(if v3 { Some(64) } else { None });
    let moe = MoeConfig {
        num_experts: 16,
        experts_per_token: if v3 { 4 } else { 3 },
        expert_intermediate_size: 64,
        top_k_weights: if v3 {
            TopKWeights::Normalized
        } else {
            TopKWeights::Softmax
        },
        dense_layers: vec![0],
        scoring: if v3 {
            ExpertScoring::Sigmoid
        } else {
            ExpertScoring::Softmax
        },
        routed_scaling_factor: if v3 { 2.5 } else { 1.5 },
        group_limit: Some(ExpertGroupLimit {
            num_groups: 4,
            groups_per_token: 2,
            score: if v3 {
                GroupScoring::TopTwoSum
            } else {
                GroupScoring::Max
            },
        }),
        selection_bias: v3,
        num_shared_experts: if v3 { 1 } else { 2 },
    };
    ModelConfig {
        num_layers: 3,
        moe: Some(moe),
        ..base
    }
}

/// Three prompts; ragged prefill chunks, mixed steps (one-token rows first), then batched
/// decode of 3, 2 and 1 rows.
fn workload(vocab: usize) -> (Vec<Vec<u32>>, Schedule) {
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|r| {
            (0..80)
                .map(|i| ((i * 31 + r * 7 + 3) % vocab) as u32)
                .collect()
        })
        .collect();
    let mut schedule: Schedule = vec![
        vec![37, 5, 0],
        vec![1, 20, 19],
        vec![1, 1, 30],
        vec![1, 1, 18],
    ];
    schedule.extend((0..6).map(|_| vec![1, 1, 1]));
    schedule.extend([vec![1, 0, 1], vec![0, 1, 0], vec![1, 1, 1]]);
    (prompts, schedule)
}

fn cpu_logits(config: &ModelConfig, weights: &RandomWeights) -> Vec<Vec<f32>> {
    let cpu = Model::load(config.clone(), weights, WeightPrecision::F32).unwrap();
    let mut kv = cpu
        .new_kv_cache(NUM_PAGES, PAGE_SIZE, KvType::F32, KvType::F32)
        .unwrap();
    let (prompts, schedule) = workload(config.vocab_size);
    run_schedule(&prompts, &schedule, &mut |batch| {
        cpu.forward(batch, &mut kv, AttentionPolicy::Auto)
            .unwrap()
            .logits
    })
}

fn gpu_logits(
    gpu: &Arc<Gpu>,
    config: &ModelConfig,
    weights: &RandomWeights,
    dtype: DType,
    deterministic: bool,
    graphs: bool,
) -> Vec<Vec<f32>> {
    let loaded =
        CudaModel::load(config.clone(), weights, gpu.clone(), dtype, &mut |_, _| {}).unwrap();
    let options = CudaCacheOptions {
        num_pages: NUM_PAGES,
        page_size: PAGE_SIZE,
        max_batch_tokens: 256,
        max_batch_requests: 8,
        max_context: NUM_PAGES * PAGE_SIZE,
        cuda_graphs: graphs,
        paged_decode: Default::default(),
        kernels: CudaKernels {
            deterministic,
            ..CudaKernels::default()
        },
    };
    let mut model = CudaRunner::new(loaded, options).unwrap();
    let (prompts, schedule) = workload(config.vocab_size);
    let logits = run_schedule(&prompts, &schedule, &mut |batch| {
        model.forward(batch).unwrap()
    });
    let counters = model.counters();
    // With graphs, the decode steps (every active request one token) replay from their
    // bucket's graph; prefill and mixed steps run eagerly.
    let decode_steps = schedule
        .iter()
        .filter(|step| step.iter().all(|&count| count <= 1))
        .count() as u64;
    let graph_steps = if graphs { decode_steps } else { 0 };
    assert!(decode_steps > 0);
    assert_eq!(counters.steps_cuda_graph, graph_steps, "{counters:?}");
    assert_eq!(
        counters.steps_cuda_eager,
        schedule.len() as u64 - graph_steps,
        "{counters:?}"
    );
    // Decode steps on the split-KV MLA decode (counted as fused decode steps), graphs or
    // not; none in deterministic mode (every row on the prefill kernel).
    let latent_decodes = if deterministic { 0 } else { decode_steps };
    assert_eq!(
        counters.steps_cuda_decode_fused, latent_decodes,
        "{counters:?}"
    );
    logits
}

/// `config`'s logits on the GPU (f32 and bf16, normal and deterministic) against the CPU's:
/// f32 within 2e-3 relative with the same greedy ids, bf16's top-10 log-probabilities within
/// `bf16_bound`.
fn assert_matches_cpu(
    gpu: &Arc<Gpu>,
    label: &str,
    config: &ModelConfig,
    seed: u64,
    bf16_bound: f64,
) {
    let weights = RandomWeights::new(config, seed, 1 << 30).unwrap();
    let expected = cpu_logits(config, &weights);
    for (dtype, deterministic) in [
        (DType::F32, false),
        (DType::F32, true),
        (DType::BF16, false),
        (DType::BF16, true),
    ] {
        let got = gpu_logits(gpu, config, &weights, dtype, deterministic, true);
        let e = measure(&expected, &got, config.vocab_size);
        eprintln!(
            "{label} {dtype} deterministic {deterministic}: max relative logit error {:.2e}, \
             max top-10 logprob error {:.4}, greedy mismatches {}",
            e.relative, e.logprob, e.clear_greedy_mismatches
        );
        if dtype == DType::F32 {
            assert!(e.relative < 2e-3, "f32 relative logit error {}", e.relative);
            assert_eq!(e.clear_greedy_mismatches, 0, "f32 greedy ids differ");
        } else {
            assert!(
                e.logprob < bf16_bound,
                "bf16 top-10 logprob error {}",
                e.logprob
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_mla_forward_matches_cpu() {
    let gpu = gpu();
    for q_lora_rank in [Some(64), None] {
        let label = format!("q_lora_rank {q_lora_rank:?}");
        assert_matches_cpu(&gpu, &label, &config(q_lora_rank), 13, 0.15);
    }
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_mla_with_experts_matches_cpu() {
    let gpu = gpu();
    for v3 in [true, false] {
        let config = moe_config(v3);
        assert!(config.has_expert_layers() && !config.is_moe_layer(0));
        // As cuda_moe.rs: a near-tied router row may pick other experts in bf16.
        assert_matches_cpu(&gpu, &format!("experts v3 {v3}"), &config, 19, 0.5);
    }
}

/// Graphs on and off (decode steps of 3, 2 and 1 requests: buckets 4, 2 and 1): bitwise the
/// same logits in deterministic mode (batch-invariant GEMMs, every row on the prefill
/// kernel, padding rows apart), else within the f32 bound with the same greedy ids, and
/// within the bf16 bounds against the CPU (the bucket's plan and GEMMs differ from the
/// unpadded step's).
#[test]
#[ignore = "needs a GPU"]
fn gpu_mla_decode_graphs_match_eager_steps() {
    let gpu = gpu();
    let models = [
        ("dense", config(Some(64)), 0.15),
        ("experts v3", moe_config(true), 0.5),
        ("experts v2", moe_config(false), 0.5),
    ];
    for (name, config, bf16_bound) in models {
        let weights = RandomWeights::new(&config, 29, 1 << 30).unwrap();
        let vocab = config.vocab_size;
        for (dtype, deterministic) in [
            (DType::F32, false),
            (DType::F32, true),
            (DType::BF16, false),
            (DType::BF16, true),
        ] {
            let eager = gpu_logits(&gpu, &config, &weights, dtype, deterministic, false);
            let graphs = gpu_logits(&gpu, &config, &weights, dtype, deterministic, true);
            let e = measure(&eager, &graphs, vocab);
            eprintln!(
                "{name} {dtype} deterministic {deterministic}, graphs against eager: max \
                 relative logit error {:.2e}, max top-10 logprob error {:.4}, greedy \
                 mismatches {}",
                e.relative, e.logprob, e.clear_greedy_mismatches
            );
            if deterministic {
                assert!(
                    eager == graphs,
                    "{name} {dtype}: deterministic logits differ with graphs"
                );
            } else if dtype == DType::F32 {
                // The bound against the CPU: a wrong plan or padding is off by far more.
                assert!(
                    e.relative < 2e-3,
                    "{name}: f32 relative error {}",
                    e.relative
                );
                assert_eq!(
                    e.clear_greedy_mismatches, 0,
                    "{name}: f32 greedy ids differ"
                );
            } else {
                assert!(e.logprob < bf16_bound, "{name}: bf16 error {}", e.logprob);
            }
        }
    }
}

const VOCAB: usize = 512;

fn prompt(len: usize, salt: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 7919 + salt * 104_729) % VOCAB) as u32)
        .collect()
}

fn engine(
    gpu: &Arc<Gpu>,
    config: &ModelConfig,
    weights: &RandomWeights,
    dtype: DType,
    deterministic: bool,
    prefix_caching: bool,
    graphs: bool,
) -> Engine {
    let model =
        CudaModel::load(config.clone(), weights, gpu.clone(), dtype, &mut |_, _| {}).unwrap();
    let config = pagoda_engine::EngineConfig {
        cuda_graphs: graphs,
        ..common::engine_config(128, 96, 1024, AttentionPolicy::Auto)
    };
    let settings = EngineSettings {
        prefix_caching,
        prefix_wait_tokens: 0,
        cuda_warmup: true,
        cpu_threads: CpuThreadsMode::Auto,
        split_kv_chunk_tokens: 256,
        cascade: None,
        speculation: Default::default(),
        cuda_kernels: CudaKernels {
            deterministic,
            ..CudaKernels::default()
        },
        masks_beside: true,
        device_masks: true,
        tensor_parallel_size: 1,
        sparse_attention: None,
    };
    Engine::with_settings(model, config, settings).unwrap()
}

const TARGET_TOKENS: usize = 20;

/// Adds a greedy request of `prompt(45, 1)` after `others` and runs the engine until every
/// request finishes; returns the target's tokens.
fn greedy_tokens(engine: &mut Engine, others: &[(usize, usize, usize)]) -> Vec<u32> {
    for &(len, salt, tokens) in others {
        engine
            .add_request(
                prompt(len, salt),
                SamplingParams::greedy(),
                tokens,
                vec![],
                false,
            )
            .unwrap();
    }
    let target = engine
        .add_request(
            prompt(45, 1),
            SamplingParams::greedy(),
            TARGET_TOKENS,
            vec![],
            false,
        )
        .unwrap();
    let mut tokens = Vec::new();
    let mut steps = 0;
    while engine.num_running() + engine.num_waiting() > 0 {
        for event in engine.step().unwrap() {
            if event.request == target {
                tokens.push(event.token);
            }
        }
        steps += 1;
        assert!(steps < 10_000, "the engine did not finish");
    }
    assert_eq!(tokens.len(), TARGET_TOKENS);
    tokens
}

/// A greedy request of `config` (weights of `seed`) alone, beside others and from a warm prefix
/// cache gives the same tokens, with graphs (its decode steps replayed: counted) and without.
fn check_alone_batched_cached(config: &ModelConfig, seed: u64) {
    let gpu = gpu();
    let weights = RandomWeights::new(config, seed, 1 << 30).unwrap();
    // Chunked prompts beside running decodes (a 96-token budget), batches growing and
    // shrinking.
    let others = [
        (3, 2, 30),
        (17, 3, 12),
        (64, 4, 25),
        (129, 5, 8),
        (31, 7, 16),
    ];
    for (dtype, deterministic) in [(DType::F32, true), (DType::BF16, true), (DType::F32, false)] {
        let start = |prefix_caching| {
            engine(
                &gpu,
                config,
                &weights,
                dtype,
                deterministic,
                prefix_caching,
                true,
            )
        };
        let alone = greedy_tokens(&mut start(false), &[]);
        let mut with_others = start(false);
        let batched = greedy_tokens(&mut with_others, &others);
        assert_eq!(
            batched, alone,
            "{dtype} deterministic {deterministic}: batched"
        );
        let counters = with_others.counters();
        assert!(counters.steps_cuda_graph > 0, "{counters:?}");
        // The same batch without graphs: every step eager, the same tokens.
        let mut eager = engine(&gpu, config, &weights, dtype, deterministic, false, false);
        let eager_batched = greedy_tokens(&mut eager, &others);
        assert_eq!(eager.counters().steps_cuda_graph, 0);
        assert_eq!(
            eager_batched, alone,
            "{dtype} deterministic {deterministic}: batched without graphs"
        );
        // The same prompt again on a warm prefix cache: its full pages are reused.
        let mut cached = start(true);
        greedy_tokens(&mut cached, &[]);
        let warm = greedy_tokens(&mut cached, &[]);
        assert!(
            cached.counters().prefix_hit_tokens > 0,
            "the prompt did not hit the prefix cache"
        );
        assert_eq!(
            warm, alone,
            "{dtype} deterministic {deterministic}: prefix cache"
        );
        eprintln!("{dtype} deterministic {deterministic}: alone, batched and cached agree");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_mla_request_gives_the_same_tokens_alone_batched_and_from_the_prefix_cache() {
    check_alone_batched_cached(&config(Some(64)), 17);
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_mla_with_experts_request_gives_the_same_tokens_alone_batched_and_cached() {
    for v3 in [true, false] {
        check_alone_batched_cached(&moe_config(v3), 23);
    }
}
