//! A request's logits do not depend on the thread pool its steps run on (batch invariance
//! across pools): the same requests, run through the engine on rayon pools of 1, 2 and 3
//! threads, on the engine's own one-thread pool and under the adaptive controller, give the
//! same log-probabilities bit for bit at every step. Split-KV attention is forced so the
//! chunking of KV rows (which used to follow the pool's thread count) is exercised.
//!
//! The oracle is the engine itself on another pool: any op whose split of work followed the
//! pool's size into its arithmetic would make the bits differ.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use pagoda_engine::{
    load_model, CpuThreadsMode, Engine, EngineConfig, LoadOptions, ModelSource, RequestId,
};
use pagoda_models::llama::{AttentionPolicy, WeightPrecision};
use pagoda_ops::attention::AttentionPath;
use pagoda_ops::sampling::SamplingParams;

/// Log-probability bits of every step of every request, by request.
type Trace = BTreeMap<RequestId, Vec<Vec<u32>>>;

fn engine(model: &Path, page_size: usize, mode: CpuThreadsMode) -> Engine {
    let loaded = load_model(
        &ModelSource::from_path(model).unwrap(),
        LoadOptions::cpu(WeightPrecision::AsStored),
        &mut |_, _| {},
    )
    .unwrap();
    let config = EngineConfig {
        page_size,
        num_pages: 64,
        max_batch_tokens: 256,
        max_context: 512,
        attention: AttentionPolicy::Force(AttentionPath::SplitKv),
        sampler: pagoda_ops::sampling::SamplerKind::DEFAULT,
        cuda_graphs: false,
        paged_decode: Default::default(),
        kv_types: Default::default(),
    };
    let mut engine = Engine::with_prefix_caching(loaded.model, config, false).unwrap();
    engine.set_cpu_threads_mode(mode);
    assert_eq!(engine.cpu_threads_mode(), Some(mode));
    engine
}

/// Runs three greedy requests of different prompt lengths to the end on `threads` threads (the
/// caller's pool; `mode` decides whether the engine's steps use it).
fn trace(
    model: &Path,
    page_size: usize,
    vocab: u32,
    threads: usize,
    mode: CpuThreadsMode,
) -> (Trace, Engine) {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    pool.install(|| {
        let mut engine = engine(model, page_size, mode);
        let mut trace = Trace::new();
        for (len, seed) in [(5u32, 3u32), (41, 7), (131, 11)] {
            let prompt: Vec<u32> = (0..len).map(|i| (i * 37 + seed * 101) % vocab).collect();
            let id = engine
                .add_request(prompt, SamplingParams::greedy(), 8, Vec::new(), true)
                .unwrap();
            trace.insert(id, Vec::new());
        }
        while engine.num_running() > 0 {
            for event in engine.step().unwrap() {
                let logprobs = event.logprobs.expect("log-probabilities were asked for");
                trace
                    .get_mut(&event.request)
                    .unwrap()
                    .push(logprobs.iter().map(|v| v.to_bits()).collect());
            }
        }
        (trace, engine)
    })
}

fn assert_same_bits(model: &Path, page_size: usize, vocab: u32) {
    let (reference, engine) = trace(model, page_size, vocab, 2, CpuThreadsMode::Off);
    assert!(reference.values().all(|steps| steps.len() == 8));
    let counters = engine.counters();
    assert!(counters.steps_split_kv > 0, "split-KV did not run");
    assert_eq!(counters.steps_cpu_one_thread, 0);
    assert!(counters.steps_cpu_all_threads > 0);
    for (threads, mode) in [
        (1, CpuThreadsMode::Off),
        (3, CpuThreadsMode::Off),
        (2, CpuThreadsMode::One),
        (2, CpuThreadsMode::Auto),
    ] {
        let (other, engine) = trace(model, page_size, vocab, threads, mode);
        if mode == CpuThreadsMode::One {
            let counters = engine.counters();
            assert_eq!(counters.steps_cpu_all_threads, 0);
            assert!(counters.steps_cpu_one_thread > 0);
        }
        for (id, steps) in &reference {
            for (step, (want, got)) in steps.iter().zip(&other[id]).enumerate() {
                let differing = want.iter().zip(got).filter(|(a, b)| a != b).count();
                assert_eq!(
                    differing,
                    0,
                    "request {id} step {step}: {differing} log-probabilities differ between \
                     2 threads (off) and {threads} threads ({})",
                    mode.name()
                );
            }
        }
    }
}

#[test]
fn logits_do_not_depend_on_the_pool_tiny_llama() {
    let model =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tests/data/tiny/tiny-llama");
    // Pages of 4 tokens: the 131-token prompt spans 33 pages, cut into several chunks.
    assert_same_bits(&model, 4, 256);
}

#[test]
fn logits_do_not_depend_on_the_pool_smollm2() {
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !model.is_file() {
        eprintln!(
            "skipping: {} is missing (run scripts/fetch-model.sh)",
            model.display()
        );
        return;
    }
    assert_same_bits(&model, 16, 49152);
}

/// Re-runs this file's other tests under every CPU kernel configuration this machine can
/// run (the `amx` set on emulated tiles where it lacks them) and prints which ran.
#[test]
fn under_every_cpu_configuration() {
    pagoda_testkit::rerun_under_every_cpu_configuration("under_every_cpu_configuration");
}
