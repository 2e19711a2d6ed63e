//! What the engine ran, counted for benchmarks and `/metrics`.

use pagoda_models::llama_cuda::CudaStepCounters;
use pagoda_ops::attention::AttentionPath;

use crate::cpu_pool::CpuPoolCounters;

/// Counters of what the engine ran, for benchmarks and metrics: a harness reads these to prove
/// which path served a run.
#[derive(Debug, Clone, Default)]
pub struct EngineCounters {
    /// Forward passes whose attention ran split-KV decode.
    pub steps_split_kv: u64,
    /// Forward passes whose attention ran gather-then-attend.
    pub steps_gather: u64,
    /// Tokens run through the model.
    pub tokens_forwarded: u64,
    /// Prompt (and recompute) tokens served from the prefix cache instead of computed.
    pub prefix_hit_tokens: u64,
    /// Requests preempted by recompute because the KV pool ran out of pages.
    pub preemptions: u64,
    /// Forward passes that ran on the CUDA backend.
    pub steps_cuda: u64,
    /// CUDA steps replayed from a captured graph, and graphs captured.
    pub steps_cuda_graph: u64,
    pub cuda_graphs_captured: u64,
    /// CUDA steps launched kernel by kernel from the host.
    pub steps_cuda_eager: u64,
    /// CUDA steps whose attention ran the baseline decode (gather, then attend) and the
    /// ragged prefill kernel.
    pub steps_cuda_decode_gather: u64,
    pub steps_cuda_prefill_kernel: u64,
    /// CUDA steps whose attention ran the fused split-KV paged decode, and those of them
    /// whose plan merged chunks.
    pub steps_cuda_decode_fused: u64,
    pub steps_cuda_decode_fused_merged: u64,
    /// GPU time of the CUDA steps (CUDA events, upload to logits ready), microseconds.
    pub cuda_gpu_time_us: u64,
    /// Per-request attention work on the CPU: requests with at least one split-KV row, and
    /// requests served by gather only (summed over steps).
    pub requests_split_kv: u64,
    pub requests_gather: u64,
    /// Tokens drawn by the GPU sampler (CUDA backend, fused sampler, requests without
    /// penalties or log-probabilities).
    pub sampled_tokens_gpu: u64,
    /// Tokens drawn on the CPU (every token on the CPU backend).
    pub sampled_tokens_cpu: u64,
    /// GPU-sampled tokens that took the GPU sampler's counted exact fallback.
    pub gpu_sampler_fallbacks: u64,
    /// GPU-sampled filtered rows finished by the multi-CTA fast path / drawn by the
    /// single-CTA exact kernel.
    pub gpu_sampler_filtered_fast: u64,
    pub gpu_sampler_filtered_exact: u64,
    /// GPU-sampled rows whose maximum the Gumbel kernel found (no row-maximum pass).
    pub gpu_sampler_gumbel_max: u64,
    /// GPU-sampled filtered rows whose rounds ran on their id list.
    pub gpu_sampler_list_rows: u64,
    /// GPU-sampled filtered rows finished by the cluster kernel.
    pub gpu_sampler_cluster_rows: u64,
    /// Rows of the cluster kernel whose logits were prefetched into L2 by a resident row.
    pub gpu_sampler_prefetched_rows: u64,
    /// CPU forward passes run on all configured threads / on one thread (the adaptive pool,
    /// `PAGODA_CPU_ADAPTIVE_THREADS`), probe bursts of the other pool started, and times a
    /// kind of step changed pool.
    pub steps_cpu_all_threads: u64,
    pub steps_cpu_one_thread: u64,
    pub cpu_pool_probes: u64,
    pub cpu_pool_switches: u64,
}

impl EngineCounters {
    /// Counts a CPU forward of `num_tokens` tokens whose attention took `path` (one INFO line
    /// per path on first use).
    pub(crate) fn record(&mut self, path: AttentionPath, num_tokens: usize) {
        static LOGGED_SPLIT_KV: std::sync::Once = std::sync::Once::new();
        static LOGGED_GATHER: std::sync::Once = std::sync::Once::new();
        match path {
            AttentionPath::SplitKv => {
                LOGGED_SPLIT_KV.call_once(|| {
                    tracing::info!(
                        "attention path taken: split_kv (CPU split-KV decode + LSE merge)"
                    )
                });
                self.steps_split_kv += 1;
            }
            AttentionPath::Gather => {
                LOGGED_GATHER.call_once(|| {
                    tracing::info!("attention path taken: gather (gather-then-attend)")
                });
                self.steps_gather += 1;
            }
        }
        self.tokens_forwarded += num_tokens as u64;
    }
}

impl EngineCounters {
    /// Takes the adaptive CPU pool's running totals.
    pub(crate) fn copy_cpu_pools(&mut self, pools: &CpuPoolCounters) {
        self.steps_cpu_all_threads = pools.steps_all_threads;
        self.steps_cpu_one_thread = pools.steps_one_thread;
        self.cpu_pool_probes = pools.probes;
        self.cpu_pool_switches = pools.switches;
    }

    /// Takes the CUDA model's running totals.
    pub(crate) fn copy_cuda(&mut self, cuda: &CudaStepCounters) {
        self.steps_cuda_graph = cuda.graph_steps;
        self.cuda_graphs_captured = cuda.graphs_captured;
        self.steps_cuda_eager = cuda.eager_steps;
        self.steps_cuda_decode_gather = cuda.decode_gather_steps;
        self.steps_cuda_decode_fused = cuda.decode_fused_steps;
        self.steps_cuda_decode_fused_merged = cuda.decode_fused_merged_steps;
        self.steps_cuda_prefill_kernel = cuda.prefill_kernel_steps;
        self.cuda_gpu_time_us = cuda.gpu_time_us;
        self.gpu_sampler_fallbacks = cuda.sampler_fallback_rows;
        self.gpu_sampler_filtered_fast = cuda.sampler_filtered_fast_rows;
        self.gpu_sampler_filtered_exact = cuda.sampler_filtered_exact_rows;
        self.gpu_sampler_gumbel_max = cuda.sampler_gumbel_max_rows;
        self.gpu_sampler_list_rows = cuda.sampler_list_rows;
        self.gpu_sampler_cluster_rows = cuda.sampler_cluster_rows;
        self.gpu_sampler_prefetched_rows = cuda.sampler_prefetched_rows;
    }
}
