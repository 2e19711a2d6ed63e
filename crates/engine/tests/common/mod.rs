//! Shared helpers of the engine tests: the default model, a CPU engine configuration, the GPU.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use pagoda_engine::{
    load_model, Engine, EngineConfig, LoadOptions, LoadedModel, ModelSource, RequestId,
};
use pagoda_models::llama::{AttentionPolicy, WeightPrecision};

/// The default model's file, or `None` with a line saying so when it is missing
/// (`scripts/fetch-model.sh` fetches it).
pub fn default_model_path() -> Option<PathBuf> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.is_file() {
        eprintln!(
            "skipping: {} is missing (run scripts/fetch-model.sh)",
            path.display()
        );
        return None;
    }
    Some(path)
}

/// The default model, loaded for the CPU with its weights as stored (`None` when missing).
pub fn default_model() -> Option<LoadedModel> {
    let path = default_model_path()?;
    let options = LoadOptions::cpu(WeightPrecision::AsStored);
    Some(load_model(&ModelSource::Gguf(path), options, &mut |_, _| {}).unwrap())
}

/// An engine configuration with 16-token pages, the default sampler and f32 KV.
pub fn engine_config(
    num_pages: usize,
    max_batch_tokens: usize,
    max_context: usize,
    attention: AttentionPolicy,
) -> EngineConfig {
    EngineConfig {
        page_size: 16,
        num_pages,
        max_batch_tokens,
        max_context,
        attention,
        sampler: pagoda_ops::sampling::SamplerKind::DEFAULT,
        cuda_graphs: true,
        paged_decode: Default::default(),
        kv_types: Default::default(),
    }
}

/// Per request: its tokens and the bits of its log-probabilities at every position (when
/// it asked for them).
pub type Output = BTreeMap<RequestId, (Vec<u32>, Vec<Vec<u32>>)>;

/// Steps `engine` until every request has finished, recording each event in `output`
/// (which holds an entry per request).
pub fn run_to_end(engine: &mut Engine, output: &mut Output) {
    while engine.num_running() + engine.num_waiting() > 0 {
        for event in engine.step().unwrap() {
            let entry = output.get_mut(&event.request).unwrap();
            entry.0.push(event.token);
            if let Some(values) = event.logprobs {
                entry.1.push(values.iter().map(|v| v.to_bits()).collect());
            }
        }
    }
}

use pagoda_cuda::Gpu;

/// The GPU. The tests that call it are `#[ignore = "needs a GPU"]`: `cargo test` lists them
/// as ignored on a machine without one; the GPU machine runs them with `--include-ignored`
/// (a build with `--features cuda`), where a missing GPU fails them.
pub fn gpu() -> Arc<Gpu> {
    match pagoda_cuda::available() {
        Ok(info) => eprintln!("GPU: {info}"),
        Err(e) => panic!("this test needs a GPU and a build with --features cuda: {e}"),
    }
    Arc::new(Gpu::new(0).expect("CUDA context"))
}
