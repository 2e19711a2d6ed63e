//! The engine: admits requests, plans each step (prefill chunks and decode tokens under a token
//! budget), runs one batched forward over the CSR page table, samples, and reports tokens.
//!
//! This is the foundation's runner for the CLI. The server's scheduler (continuous batching with
//! preemption and prefix caching) builds on the same pieces: `pagoda_kv` for pages and the
//! page table, [`pagoda_models::llama::Model::forward`] for the step.

mod backend;
mod counters;
mod cpu_pool;
pub mod cuda_runner;
mod engine;
mod load;
mod logit_bias;
pub mod speculation;
mod structured;

pub use backend::Backend;
pub use counters::{CounterInfo, EngineCounters, MetricKind};
pub use cpu_pool::{
    ControllerSettings, CpuPoolCounters, CpuThreadsMode, PoolChoice, PoolController, StepShape,
    Verdict, CPU_ADAPTIVE_THREADS_ENV,
};
pub use engine::{
    check_sparse_attention_setup, Engine, EngineConfig, EngineError, EngineSettings, FinishReason,
    RequestId, StepEvent,
};
pub use load::{
    load_backend, load_model, load_random, load_random_served, Device, LoadOptions, LoadedModel,
    ModelLoadError, ModelSource,
};
pub use pagoda_kv::CacheEvent;
pub use structured::grammar_vocabulary;
