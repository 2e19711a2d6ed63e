//! Server metrics in the Prometheus text format (`GET /metrics`).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

use crate::worker::EngineSnapshot;

#[path = "metrics_cpu_kernels.rs"]
mod cpu_kernels;
#[path = "metrics_primitives.rs"]
mod primitives;
pub use primitives::{Counter, Histogram};

const TTFT_BOUNDS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const ITL_BOUNDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

/// Everything `/metrics` reports. Counters are updated by the handlers and the engine loop;
/// gauges are set by the loop after each step.
#[derive(Debug)]
pub struct Metrics {
    /// Finished HTTP requests by (endpoint, status code).
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: Counter,
    /// Tokens sampled.
    pub generated_tokens: Counter,
    /// Seconds from queueing to the first sampled token.
    pub time_to_first_token: Histogram,
    /// Seconds between consecutive tokens of one request.
    pub inter_token_latency: Histogram,
    /// Requests cancelled because the client went away (or a stop string ended them).
    pub cancelled: Counter,
    /// Engine steps that failed.
    pub engine_errors: Counter,
    /// Requests admitted with greedy sampling.
    pub sampling_greedy_requests: Counter,
    /// Requests admitted with random sampling.
    pub sampling_random_requests: Counter,
    queue_length: Counter,
    running: Counter,
    pages_used: Counter,
    pages_free: Counter,
    steps_split_kv: Counter,
    steps_gather: Counter,
    tokens_forwarded: Counter,
    prefix_hit_tokens: Counter,
    preemptions: Counter,
    steps_cuda: Counter,
    requests_split_kv: Counter,
    requests_gather: Counter,
    pages_cached: Counter,
    sampled_greedy: Counter,
    sampled_gumbel: Counter,
    sampled_rejection: Counter,
    sampled_reference: Counter,
    sampling_fallbacks: Counter,
    steps_cuda_graph: Counter,
    steps_cuda_eager: Counter,
    cuda_graphs_captured: Counter,
    steps_cuda_decode_gather: Counter,
    steps_cuda_decode_fused: Counter,
    steps_cuda_decode_fused_merged: Counter,
    steps_cuda_prefill_kernel: Counter,
    cuda_gpu_time_us: Counter,
    sampled_tokens_gpu: Counter,
    sampled_tokens_cpu: Counter,
    gpu_sampler_fallbacks: Counter,
    gpu_sampler_filtered_fast: Counter,
    gpu_sampler_filtered_exact: Counter,
    gpu_sampler_gumbel_max: Counter,
    gpu_sampler_list_rows: Counter,
    gpu_sampler_cluster_rows: Counter,
    gpu_sampler_prefetched_rows: Counter,
    steps_cpu_all_threads: Counter,
    steps_cpu_one_thread: Counter,
    cpu_pool_probes: Counter,
    cpu_pool_switches: Counter,
    batch_invariant: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::new(BTreeMap::new()),
            prompt_tokens: Counter::default(),
            generated_tokens: Counter::default(),
            time_to_first_token: Histogram::new(TTFT_BOUNDS),
            inter_token_latency: Histogram::new(ITL_BOUNDS),
            cancelled: Counter::default(),
            engine_errors: Counter::default(),
            sampling_greedy_requests: Counter::default(),
            sampling_random_requests: Counter::default(),
            queue_length: Counter::default(),
            running: Counter::default(),
            pages_used: Counter::default(),
            pages_free: Counter::default(),
            steps_split_kv: Counter::default(),
            steps_gather: Counter::default(),
            tokens_forwarded: Counter::default(),
            prefix_hit_tokens: Counter::default(),
            preemptions: Counter::default(),
            steps_cuda: Counter::default(),
            requests_split_kv: Counter::default(),
            requests_gather: Counter::default(),
            pages_cached: Counter::default(),
            sampled_greedy: Counter::default(),
            sampled_gumbel: Counter::default(),
            sampled_rejection: Counter::default(),
            sampled_reference: Counter::default(),
            sampling_fallbacks: Counter::default(),
            steps_cuda_graph: Counter::default(),
            steps_cuda_eager: Counter::default(),
            cuda_graphs_captured: Counter::default(),
            steps_cuda_decode_gather: Counter::default(),
            steps_cuda_decode_fused: Counter::default(),
            steps_cuda_decode_fused_merged: Counter::default(),
            steps_cuda_prefill_kernel: Counter::default(),
            cuda_gpu_time_us: Counter::default(),
            sampled_tokens_gpu: Counter::default(),
            sampled_tokens_cpu: Counter::default(),
            gpu_sampler_fallbacks: Counter::default(),
            gpu_sampler_filtered_fast: Counter::default(),
            gpu_sampler_filtered_exact: Counter::default(),
            gpu_sampler_gumbel_max: Counter::default(),
            gpu_sampler_list_rows: Counter::default(),
            gpu_sampler_cluster_rows: Counter::default(),
            gpu_sampler_prefetched_rows: Counter::default(),
            steps_cpu_all_threads: Counter::default(),
            steps_cpu_one_thread: Counter::default(),
            cpu_pool_probes: Counter::default(),
            cpu_pool_switches: Counter::default(),
            batch_invariant: Counter::default(),
        }
    }
}

impl Metrics {
    /// Counts one answered HTTP request.
    pub fn record_request(&self, endpoint: &str, status: u16) {
        let mut requests = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *requests.entry((endpoint.to_owned(), status)).or_default() += 1;
    }

    /// Sets the engine gauges and counters from a snapshot; `queue_length` requests wait.
    pub fn update_engine(&self, snapshot: &EngineSnapshot, queue_length: usize) {
        self.queue_length.set(queue_length as u64);
        self.running.set(snapshot.num_running as u64);
        self.pages_used.set(snapshot.pages_used as u64);
        self.pages_free
            .set(snapshot.pages_total.saturating_sub(snapshot.pages_used) as u64);
        self.steps_split_kv.set(snapshot.steps_split_kv);
        self.steps_gather.set(snapshot.steps_gather);
        self.tokens_forwarded.set(snapshot.tokens_forwarded);
        self.prefix_hit_tokens.set(snapshot.prefix_hit_tokens);
        self.preemptions.set(snapshot.preemptions);
        self.steps_cuda.set(snapshot.steps_cuda);
        self.requests_split_kv.set(snapshot.requests_split_kv);
        self.requests_gather.set(snapshot.requests_gather);
        self.pages_cached.set(snapshot.pages_cached as u64);
        self.sampled_greedy.set(snapshot.sampling.greedy_draws);
        self.sampled_gumbel.set(snapshot.sampling.gumbel_draws);
        self.sampled_rejection
            .set(snapshot.sampling.rejection_draws);
        self.sampled_reference
            .set(snapshot.sampling.reference_draws);
        self.sampling_fallbacks.set(snapshot.sampling.fallbacks);
        self.steps_cuda_graph.set(snapshot.steps_cuda_graph);
        self.steps_cuda_eager.set(snapshot.steps_cuda_eager);
        self.cuda_graphs_captured.set(snapshot.cuda_graphs_captured);
        self.steps_cuda_decode_gather
            .set(snapshot.steps_cuda_decode_gather);
        self.steps_cuda_decode_fused
            .set(snapshot.steps_cuda_decode_fused);
        self.steps_cuda_decode_fused_merged
            .set(snapshot.steps_cuda_decode_fused_merged);
        self.steps_cuda_prefill_kernel
            .set(snapshot.steps_cuda_prefill_kernel);
        self.cuda_gpu_time_us.set(snapshot.cuda_gpu_time_us);
        self.sampled_tokens_gpu.set(snapshot.sampled_tokens_gpu);
        self.sampled_tokens_cpu.set(snapshot.sampled_tokens_cpu);
        self.gpu_sampler_fallbacks
            .set(snapshot.gpu_sampler_fallbacks);
        self.gpu_sampler_filtered_fast
            .set(snapshot.gpu_sampler_filtered_fast);
        self.gpu_sampler_filtered_exact
            .set(snapshot.gpu_sampler_filtered_exact);
        self.gpu_sampler_gumbel_max
            .set(snapshot.gpu_sampler_gumbel_max);
        self.gpu_sampler_list_rows
            .set(snapshot.gpu_sampler_list_rows);
        self.gpu_sampler_cluster_rows
            .set(snapshot.gpu_sampler_cluster_rows);
        self.gpu_sampler_prefetched_rows
            .set(snapshot.gpu_sampler_prefetched_rows);
        self.steps_cpu_all_threads
            .set(snapshot.steps_cpu_all_threads);
        self.steps_cpu_one_thread.set(snapshot.steps_cpu_one_thread);
        self.cpu_pool_probes.set(snapshot.cpu_pool_probes);
        self.cpu_pool_switches.set(snapshot.cpu_pool_switches);
        self.batch_invariant
            .set(u64::from(!snapshot.batch_dependent));
    }

    /// KV pages in use at the last update.
    pub fn pages_used(&self) -> u64 {
        self.pages_used.get()
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP pagoda_requests_total HTTP requests answered, by endpoint and status.\n\
             # TYPE pagoda_requests_total counter"
        );
        let requests = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        for ((endpoint, status), count) in requests.iter() {
            let _ = writeln!(
                out,
                "pagoda_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {count}"
            );
        }
        drop(requests);
        let scalars: [(&str, &str, &str, &Counter); 34] = [
            (
                "pagoda_prompt_tokens_total",
                "counter",
                "Prompt tokens of admitted requests.",
                &self.prompt_tokens,
            ),
            (
                "pagoda_generated_tokens_total",
                "counter",
                "Tokens sampled.",
                &self.generated_tokens,
            ),
            (
                "pagoda_requests_cancelled_total",
                "counter",
                "Requests cancelled before the engine finished them (client gone or stop string).",
                &self.cancelled,
            ),
            (
                "pagoda_engine_errors_total",
                "counter",
                "Engine steps that failed.",
                &self.engine_errors,
            ),
            (
                "pagoda_queue_length",
                "gauge",
                "Requests waiting for admission.",
                &self.queue_length,
            ),
            (
                "pagoda_running_sequences",
                "gauge",
                "Sequences the engine is running.",
                &self.running,
            ),
            (
                "pagoda_kv_pages_used",
                "gauge",
                "KV-cache pages in use.",
                &self.pages_used,
            ),
            (
                "pagoda_kv_pages_free",
                "gauge",
                "KV-cache pages free.",
                &self.pages_free,
            ),
            (
                "pagoda_prefix_cache_hit_tokens_total",
                "counter",
                "Prompt tokens served from the prefix cache.",
                &self.prefix_hit_tokens,
            ),
            (
                "pagoda_preemptions_total",
                "counter",
                "Requests preempted for recompute when pages ran out.",
                &self.preemptions,
            ),
            (
                "pagoda_attention_split_kv_steps_total",
                "counter",
                "Forward passes whose attention ran split-KV decode.",
                &self.steps_split_kv,
            ),
            (
                "pagoda_attention_gather_steps_total",
                "counter",
                "Forward passes whose attention ran gather-then-attend.",
                &self.steps_gather,
            ),
            (
                "pagoda_attention_split_kv_requests_total",
                "counter",
                "Requests (per step) whose attention had split-KV rows.",
                &self.requests_split_kv,
            ),
            (
                "pagoda_attention_gather_requests_total",
                "counter",
                "Requests (per step) served by gather-then-attend only.",
                &self.requests_gather,
            ),
            (
                "pagoda_cuda_steps_total",
                "counter",
                "Forward passes run on the CUDA backend.",
                &self.steps_cuda,
            ),
            (
                "pagoda_cuda_graph_steps_total",
                "counter",
                "CUDA decode steps replayed from a captured graph.",
                &self.steps_cuda_graph,
            ),
            (
                "pagoda_cuda_eager_steps_total",
                "counter",
                "CUDA steps launched kernel by kernel from the host.",
                &self.steps_cuda_eager,
            ),
            (
                "pagoda_cuda_graphs_captured",
                "gauge",
                "CUDA graphs captured (one per decode batch bucket).",
                &self.cuda_graphs_captured,
            ),
            (
                "pagoda_cuda_decode_gather_steps_total",
                "counter",
                "CUDA steps whose attention ran the baseline decode (gather, then attend).",
                &self.steps_cuda_decode_gather,
            ),
            (
                "pagoda_cuda_decode_fused_steps_total",
                "counter",
                "CUDA steps whose attention ran the fused split-KV paged decode.",
                &self.steps_cuda_decode_fused,
            ),
            (
                "pagoda_cuda_decode_fused_merged_steps_total",
                "counter",
                "Fused decode steps whose plan split some request into chunks merged by log-sum-exp.",
                &self.steps_cuda_decode_fused_merged,
            ),
            (
                "pagoda_cuda_prefill_attention_steps_total",
                "counter",
                "CUDA steps whose attention ran the ragged prefill kernel.",
                &self.steps_cuda_prefill_kernel,
            ),
            (
                "pagoda_cuda_gpu_time_microseconds_total",
                "counter",
                "GPU time of the CUDA steps (CUDA events, inputs upload to logits ready).",
                &self.cuda_gpu_time_us,
            ),
            (
                "pagoda_batch_invariant",
                "gauge",
                "1 when a request's output does not depend on the requests sharing its steps.",
                &self.batch_invariant,
            ),
            (
                "pagoda_kv_pages_cached",
                "gauge",
                "KV pages kept only for prefix-cache hits (evictable).",
                &self.pages_cached,
            ),
            (
                "pagoda_sampled_tokens_greedy_total",
                "counter",
                "Tokens chosen by the fused sampler's greedy argmax.",
                &self.sampled_greedy,
            ),
            (
                "pagoda_sampled_tokens_gumbel_total",
                "counter",
                "Tokens drawn by the fused sampler's Gumbel-max path.",
                &self.sampled_gumbel,
            ),
            (
                "pagoda_sampled_tokens_rejection_total",
                "counter",
                "Tokens drawn by the fused sampler's sort-free rejection path.",
                &self.sampled_rejection,
            ),
            (
                "pagoda_sampled_tokens_reference_total",
                "counter",
                "Tokens drawn by the sort-based reference sampler.",
                &self.sampled_reference,
            ),
            (
                "pagoda_sampling_fallbacks_total",
                "counter",
                "Fused draws that fell back to the reference chain (bounded rounds or rounding).",
                &self.sampling_fallbacks,
            ),
            (
                "pagoda_gpu_sampling_fallbacks_total",
                "counter",
                "GPU-sampled tokens that took the GPU sampler's counted exact fallback.",
                &self.gpu_sampler_fallbacks,
            ),
            (
                "pagoda_tokens_forwarded_total",
                "counter",
                "Tokens run through the model.",
                &self.tokens_forwarded,
            ),
            (
                "pagoda_sampling_greedy_requests_total",
                "counter",
                "Requests sampled greedily (argmax path).",
                &self.sampling_greedy_requests,
            ),
            (
                "pagoda_sampling_random_requests_total",
                "counter",
                "Requests sampled through the random chain.",
                &self.sampling_random_requests,
            ),
        ];
        for (name, kind, help, counter) in scalars {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {}",
                counter.get()
            );
        }
        let _ = writeln!(
            out,
            "# HELP pagoda_sampled_tokens_total Tokens sampled, by where they were drawn \
             (gpu: the CUDA sampler kernels; cpu: the host samplers).\n\
             # TYPE pagoda_sampled_tokens_total counter\n\
             pagoda_sampled_tokens_total{{path=\"gpu\"}} {}\n\
             pagoda_sampled_tokens_total{{path=\"cpu\"}} {}",
            self.sampled_tokens_gpu.get(),
            self.sampled_tokens_cpu.get()
        );
        let _ = writeln!(
            out,
            "# HELP pagoda_gpu_sampling_filtered_rows_total GPU-sampled top-k/top-p/min-p rows, \
             by kernel path (fast: the multi-CTA pipeline; exact: the single-CTA kernel).\n\
             # TYPE pagoda_gpu_sampling_filtered_rows_total counter\n\
             pagoda_gpu_sampling_filtered_rows_total{{path=\"fast\"}} {}\n\
             pagoda_gpu_sampling_filtered_rows_total{{path=\"exact\"}} {}",
            self.gpu_sampler_filtered_fast.get(),
            self.gpu_sampler_filtered_exact.get()
        );
        let _ = writeln!(
            out,
            "# HELP pagoda_gpu_sampling_gumbel_max_rows_total GPU-sampled rows whose maximum the \
             Gumbel kernel found, with no row-maximum pass (launches without filtered rows; \
             PAGODA_GPU_SAMPLING_GUMBEL_MAX).\n\
             # TYPE pagoda_gpu_sampling_gumbel_max_rows_total counter\n\
             pagoda_gpu_sampling_gumbel_max_rows_total {}",
            self.gpu_sampler_gumbel_max.get()
        );
        let _ = writeln!(
            out,
            "# HELP pagoda_gpu_sampling_list_rows_total GPU-sampled filtered rows whose rounds ran \
             on the list of their proposal's ids (top-k rows with top-p; \
             PAGODA_GPU_SAMPLING_LIST_ROUNDS).\n\
             # TYPE pagoda_gpu_sampling_list_rows_total counter\n\
             pagoda_gpu_sampling_list_rows_total {}",
            self.gpu_sampler_list_rows.get()
        );
        let _ = writeln!(
            out,
            "# HELP pagoda_gpu_sampling_cluster_rows_total GPU-sampled filtered rows finished by \
             the cluster kernel, one thread-block cluster per row (PAGODA_GPU_SAMPLING_CLUSTER).\n\
             # TYPE pagoda_gpu_sampling_cluster_rows_total counter\n\
             pagoda_gpu_sampling_cluster_rows_total {}",
            self.gpu_sampler_cluster_rows.get()
        );
        let _ = writeln!(
            out,
            "# HELP pagoda_gpu_sampling_prefetched_rows_total Rows of the cluster kernel whose \
             logits a resident row asked L2 for, when the batch had more rows than clusters fit on \
             the GPU (PAGODA_GPU_SAMPLING_PREFETCH).\n\
             # TYPE pagoda_gpu_sampling_prefetched_rows_total counter\n\
             pagoda_gpu_sampling_prefetched_rows_total {}",
            self.gpu_sampler_prefetched_rows.get()
        );
        let _ = writeln!(
            out,
            "# HELP pagoda_cpu_steps_total CPU forward steps, by the pool that ran them \
             (all_threads: --threads; one_thread: the adaptive pool's, PAGODA_CPU_ADAPTIVE_THREADS).\n\
             # TYPE pagoda_cpu_steps_total counter\n\
             pagoda_cpu_steps_total{{pool=\"all_threads\"}} {}\n\
             pagoda_cpu_steps_total{{pool=\"one_thread\"}} {}\n\
             # HELP pagoda_cpu_pool_probes_total Probe bursts the adaptive CPU pool ran on the other pool.\n\
             # TYPE pagoda_cpu_pool_probes_total counter\n\
             pagoda_cpu_pool_probes_total {}\n\
             # HELP pagoda_cpu_pool_switches_total Times a kind of CPU step changed pool.\n\
             # TYPE pagoda_cpu_pool_switches_total counter\n\
             pagoda_cpu_pool_switches_total {}",
            self.steps_cpu_all_threads.get(),
            self.steps_cpu_one_thread.get(),
            self.cpu_pool_probes.get(),
            self.cpu_pool_switches.get()
        );
        cpu_kernels::render(&mut out);
        self.time_to_first_token.render(
            &mut out,
            "pagoda_time_to_first_token_seconds",
            "Seconds from queueing to the first token.",
        );
        self.inter_token_latency.render(
            &mut out,
            "pagoda_inter_token_latency_seconds",
            "Seconds between consecutive tokens of one request.",
        );
        out
    }
}

#[cfg(test)]
#[path = "metrics_tests.rs"]
mod tests;
