//! Server metrics in the Prometheus text format (`GET /metrics`).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

use pagoda_engine::{CounterInfo, EngineCounters};

/// Gauges and counters read from the engine after each step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineSnapshot {
    /// KV pages in use.
    pub pages_used: usize,
    /// KV pages in the pool.
    pub pages_total: usize,
    /// Requests the engine holds.
    pub num_running: usize,
    /// What the engine ran (every counter of [`EngineCounters`]).
    pub counters: EngineCounters,
    /// Cached KV pages no request holds (kept for prefix hits, evicted LRU).
    pub pages_cached: usize,
    /// Tokens drawn per sampler path (process-wide).
    pub sampling: pagoda_ops::sampling::SamplingCounters,
    /// Outputs may depend on which requests share a step (the CUDA backend: cuBLAS picks
    /// kernels per batch shape; the CPU with prefills on the AMX-BF16 tiles). Otherwise on
    /// the CPU every request gets its one-at-a-time output.
    pub batch_dependent: bool,
}

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
    pages_cached: Counter,
    sampled_greedy: Counter,
    sampled_gumbel: Counter,
    sampled_rejection: Counter,
    sampled_reference: Counter,
    sampling_fallbacks: Counter,
    batch_invariant: Counter,
    /// The engine's counters at the last update.
    engine: Mutex<EngineCounters>,
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
            pages_cached: Counter::default(),
            sampled_greedy: Counter::default(),
            sampled_gumbel: Counter::default(),
            sampled_rejection: Counter::default(),
            sampled_reference: Counter::default(),
            sampling_fallbacks: Counter::default(),
            batch_invariant: Counter::default(),
            engine: Mutex::new(EngineCounters::default()),
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
        self.pages_cached.set(snapshot.pages_cached as u64);
        self.sampled_greedy.set(snapshot.sampling.greedy_draws);
        self.sampled_gumbel.set(snapshot.sampling.gumbel_draws);
        self.sampled_rejection
            .set(snapshot.sampling.rejection_draws);
        self.sampled_reference
            .set(snapshot.sampling.reference_draws);
        self.sampling_fallbacks.set(snapshot.sampling.fallbacks);
        self.batch_invariant
            .set(u64::from(!snapshot.batch_dependent));
        *self.engine.lock().unwrap_or_else(|e| e.into_inner()) = snapshot.counters.clone();
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
        let scalars = [
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
        let engine = self
            .engine
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        render_counters(&mut out, &engine.values());
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

/// Renders declared counters: one `# HELP`/`# TYPE` per metric family, a line per member.
fn render_counters(out: &mut String, values: &[(&CounterInfo, u64)]) {
    let mut family = "";
    for (info, value) in values {
        if info.metric != family {
            family = info.metric;
            let _ = writeln!(
                out,
                "# HELP {} {}\n# TYPE {} {}",
                info.metric,
                info.help,
                info.metric,
                info.kind.name()
            );
        }
        match info.label {
            Some((key, label)) => {
                let _ = writeln!(out, "{}{{{key}=\"{label}\"}} {value}", info.metric);
            }
            None => {
                let _ = writeln!(out, "{} {value}", info.metric);
            }
        }
    }
}

#[cfg(test)]
#[path = "metrics_tests.rs"]
mod tests;
