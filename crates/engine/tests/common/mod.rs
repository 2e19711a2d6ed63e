//! Shared helpers of the engine tests: the default model, a CPU engine configuration, the GPU.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use pagoda_engine::{load_model, EngineConfig, LoadOptions, LoadedModel, ModelSource};
use pagoda_models::llama::{AttentionPolicy, WeightPrecision};

/// The default model, loaded for the CPU with its weights as stored, or `None` with a line
/// saying so when the file is missing (`scripts/fetch-model.sh` fetches it).
pub fn default_model() -> Option<LoadedModel> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.is_file() {
        eprintln!(
            "skipping: {} is missing (run scripts/fetch-model.sh)",
            path.display()
        );
        return None;
    }
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
