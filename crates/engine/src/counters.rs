//! What the engine ran, counted for benchmarks and `/metrics`.

use pagoda_ops::attention::AttentionPath;

use crate::cpu_pool::CpuPoolCounters;

/// How a counter is exposed in `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// Only grows.
    Counter,
    /// Goes up and down.
    Gauge,
}

impl MetricKind {
    /// The Prometheus `# TYPE` word.
    pub fn name(self) -> &'static str {
        match self {
            MetricKind::Counter => "counter",
            MetricKind::Gauge => "gauge",
        }
    }
}

/// One counter's declaration: the field, and how `/metrics` shows it. Counters sharing a
/// metric name are one Prometheus family told apart by their label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterInfo {
    /// The field of [`EngineCounters`].
    pub field: &'static str,
    /// The Prometheus metric name.
    pub metric: &'static str,
    /// `(label, value)` within the family, if the metric has several members.
    pub label: Option<(&'static str, &'static str)>,
    /// Counter or gauge.
    pub kind: MetricKind,
    /// The `# HELP` line (the family's, on its first member).
    pub help: &'static str,
}

macro_rules! engine_counters {
    ($($(#[doc = $doc:literal])* $field:ident: $metric:literal $([$key:literal = $value:literal])?, $kind:ident, $help:literal;)*) => {
        /// Counters of what the engine ran, for benchmarks and metrics: a harness reads these
        /// to prove which path served a run. Each is declared once, with its metric
        /// ([`EngineCounters::INFO`]); `/metrics` renders every one from the declaration.
        #[derive(Debug, Clone, Default, PartialEq, Eq)]
        pub struct EngineCounters {
            $($(#[doc = $doc])* pub $field: u64,)*
        }

        impl EngineCounters {
            /// Every counter's declaration, in field order.
            pub const INFO: &'static [CounterInfo] = &[$(CounterInfo {
                field: stringify!($field),
                metric: $metric,
                label: engine_counters!(@label $($key, $value)?),
                kind: MetricKind::$kind,
                help: $help,
            }),*];

            /// Each counter's declaration with its value.
            pub fn values(&self) -> Vec<(&'static CounterInfo, u64)> {
                Self::INFO.iter().zip([$(self.$field),*]).collect()
            }

            /// Adds what `now` counted beyond `before`, every field (a runner's running
            /// totals into the engine's, without listing them).
            pub fn add_difference(&mut self, now: &EngineCounters, before: &EngineCounters) {
                $(self.$field += now.$field.saturating_sub(before.$field);)*
            }
        }
    };
    (@label) => { None };
    (@label $key:literal, $value:literal) => { Some(($key, $value)) };
}

engine_counters! {
    /// Forward passes whose attention ran split-KV decode.
    steps_split_kv: "pagoda_attention_split_kv_steps_total", Counter,
        "Forward passes whose attention ran split-KV decode.";
    /// Forward passes whose attention ran gather-then-attend.
    steps_gather: "pagoda_attention_gather_steps_total", Counter,
        "Forward passes whose attention ran gather-then-attend.";
    /// Inputs embedded (`/v1/embeddings`).
    embeddings: "pagoda_embeddings_total", Counter, "Inputs embedded (/v1/embeddings).";
    /// Tokens run through the model.
    tokens_forwarded: "pagoda_tokens_forwarded_total", Counter, "Tokens run through the model.";
    /// Prompt (and recompute) tokens served from the prefix cache instead of computed.
    prefix_hit_tokens: "pagoda_prefix_cache_hit_tokens_total", Counter,
        "Prompt tokens served from the prefix cache.";
    /// Admissions passed over to wait for a running request's prefix pages.
    prefix_waits: "pagoda_prefix_waits_total", Counter,
        "Admissions passed over (per request and step) to wait for a running request's prompt pages instead of computing them again.";
    /// Requests preempted by recompute because the KV pool ran out of pages.
    preemptions: "pagoda_preemptions_total", Counter,
        "Requests preempted for recompute when pages ran out.";
    /// Speculation: tokens guessed by the proposer and run through the model.
    spec_drafted: "pagoda_spec_tokens_total" ["kind" = "drafted"], Counter,
        "Speculative decoding: tokens guessed and verified, guesses accepted, tokens emitted by verifying rows.";
    /// Speculation: guesses accepted (each one a token without a step of its own).
    spec_accepted: "pagoda_spec_tokens_total" ["kind" = "accepted"], Counter, "";
    /// Speculation: tokens emitted by rows that carried guesses (accepted ones plus the last).
    spec_emitted: "pagoda_spec_tokens_total" ["kind" = "emitted"], Counter, "";
    /// Speculation: request rows that carried guesses.
    spec_rows: "pagoda_spec_rows_total", Counter, "Request rows of a step that carried guesses.";
    /// Speculation: verified rows whose tokens the GPU sampler drew.
    spec_rows_gpu: "pagoda_spec_rows_gpu_total", Counter,
        "Rows with guesses verified on the GPU (their rows drawn by the device sampler, only the tokens downloaded).";
    /// Speculation by guess position (1st, 2nd, 3rd, 4th and later): guesses verified there.
    spec_drafted_at_1: "pagoda_spec_drafted_by_position_total" ["position" = "1"], Counter,
        "Speculative decoding: guesses verified at each position of a draft (4: the 4th and later).";
    spec_drafted_at_2: "pagoda_spec_drafted_by_position_total" ["position" = "2"], Counter, "";
    spec_drafted_at_3: "pagoda_spec_drafted_by_position_total" ["position" = "3"], Counter, "";
    spec_drafted_at_4: "pagoda_spec_drafted_by_position_total" ["position" = "4+"], Counter, "";
    /// Speculation by guess position: guesses accepted there.
    spec_accepted_at_1: "pagoda_spec_accepted_by_position_total" ["position" = "1"], Counter,
        "Speculative decoding: guesses accepted at each position of a draft (4: the 4th and later).";
    spec_accepted_at_2: "pagoda_spec_accepted_by_position_total" ["position" = "2"], Counter, "";
    spec_accepted_at_3: "pagoda_spec_accepted_by_position_total" ["position" = "3"], Counter, "";
    spec_accepted_at_4: "pagoda_spec_accepted_by_position_total" ["position" = "4+"], Counter, "";
    /// Speculation: steps in which the policy drafted nothing (more decoding requests than
    /// `PAGODA_SPEC_MAX_BATCH`).
    spec_steps_off: "pagoda_spec_steps_off_total", Counter,
        "Steps in which the speculation policy drafted nothing (batch too large).";
    /// Forward passes that ran on the CUDA backend.
    steps_cuda: "pagoda_cuda_steps_total", Counter, "Forward passes run on the CUDA backend.";
    /// CUDA steps replayed from a captured graph.
    steps_cuda_graph: "pagoda_cuda_graph_steps_total", Counter,
        "CUDA decode steps replayed from a captured graph.";
    /// CUDA verification steps (speculative decoding) replayed from a captured graph.
    steps_cuda_verify_graph: "pagoda_cuda_verify_graph_steps_total", Counter,
        "CUDA verification steps of speculative decoding replayed from a graph per (batch, guesses) bucket.";
    /// CUDA graphs captured.
    cuda_graphs_captured: "pagoda_cuda_graphs_captured", Gauge,
        "CUDA graphs captured (one per decode batch bucket).";
    /// CUDA kernels compiled by NVRTC in this process.
    cuda_kernels_compiled: "pagoda_cuda_kernels_loaded_total" ["source" = "compiled"], Counter,
        "CUDA kernels loaded, by where their code came from (compiled: NVRTC in this process; cache: the disk cache). After the warm-up, neither should move.";
    /// CUDA kernels read from the disk cache in this process.
    cuda_kernels_from_cache: "pagoda_cuda_kernels_loaded_total" ["source" = "cache"], Counter, "";
    /// CUDA steps launched kernel by kernel from the host.
    steps_cuda_eager: "pagoda_cuda_eager_steps_total", Counter,
        "CUDA steps launched kernel by kernel from the host.";
    /// CUDA steps whose attention ran the baseline decode (gather, then attend).
    steps_cuda_decode_gather: "pagoda_cuda_decode_gather_steps_total", Counter,
        "CUDA steps whose attention ran the baseline decode (gather, then attend).";
    /// CUDA steps whose attention ran the ragged prefill kernel.
    steps_cuda_prefill_kernel: "pagoda_cuda_prefill_attention_steps_total", Counter,
        "CUDA steps whose attention ran the ragged prefill kernel.";
    /// CUDA steps run in deterministic mode (batch-invariant GEMMs, per-token attention).
    steps_cuda_deterministic: "pagoda_cuda_deterministic_steps_total", Counter,
        "CUDA steps run in deterministic mode (batch-invariant GEMMs, per-token attention).";
    /// CUDA steps whose attention ran the fused split-KV paged decode (a latent attention
    /// model's decode steps: the split-KV MLA decode).
    steps_cuda_decode_fused: "pagoda_cuda_decode_fused_steps_total", Counter,
        "CUDA steps whose attention ran the fused split-KV paged decode (DeepSeek's latent attention: the split-KV MLA decode).";
    /// Fused decode steps whose variant came from the tuning table (`pagoda tune`).
    steps_cuda_decode_tuned: "pagoda_cuda_decode_variant_steps_total" ["source" = "tuned"], Counter,
        "Fused decode steps by where their variant (kernel, merge, CTA target) came from (tuned: the tuning table's row for the step's bucket; heuristic: no row, the built-in choice).";
    /// Fused decode steps whose bucket has no table row (the built-in heuristic ran).
    steps_cuda_decode_heuristic: "pagoda_cuda_decode_variant_steps_total" ["source" = "heuristic"], Counter, "";
    /// Requests constrained by a grammar (structured output).
    constrained_requests: "pagoda_constrained_requests_total", Counter,
        "Requests whose tokens were constrained by a grammar (JSON schema, JSON object, Lark, GBNF, regex or choice), sampled on the host.";
    /// Guesses of constrained requests dropped because the grammar refused them (or one
    /// before them) before verification.
    spec_grammar_cut: "pagoda_spec_grammar_cut_tokens_total", Counter,
        "Drafted tokens of constrained requests cut before verification because the grammar refused them or a guess before them.";
    /// Constrained rows whose token mask was applied on the device (sampled there).
    cuda_masked_rows: "pagoda_cuda_masked_rows_total", Counter,
        "Rows of constrained requests (structured output) sampled on the GPU: the grammar's packed token mask, computed on the host during the forward, applied to the row's logits on the device.";
    /// Host time computing the steps' token masks (structured output), in microseconds.
    structured_mask_compute_us: "pagoda_structured_mask_microseconds_total" ["phase" = "compute"], Counter,
        "Host time of structured output's token masks, in microseconds, by phase (compute: the step's masks computed beside the forward, wall time; wait: the CUDA sampler blocked for them after the forward was enqueued; accept: the draw stage of steps holding constrained rows, whose tokens are fed to their grammars there).";
    /// Time the CUDA sampler blocked for the step's masks, in microseconds.
    structured_mask_wait_us: "pagoda_structured_mask_microseconds_total" ["phase" = "wait"], Counter, "";
    /// Wall time of the draw stage (tokens drawn, verified and fed to the grammars) of steps
    /// holding constrained rows, in microseconds.
    structured_mask_accept_us: "pagoda_structured_mask_microseconds_total" ["phase" = "accept"], Counter, "";
    /// Wall time of the draw stage (tokens drawn or verified, fed to grammars) of steps
    /// without constrained rows, in microseconds.
    draw_free_us: "pagoda_draw_stage_microseconds_total" ["step" = "free"], Counter,
        "Wall time of the steps' draw stage (tokens drawn on the host or downloaded from the device, verified, and fed to their grammars), in microseconds, by whether the step held constrained rows (structured output); with pagoda_engine_step_microseconds_total it shows what constraining costs a step.";
    /// The same for steps holding constrained rows.
    draw_constrained_us: "pagoda_draw_stage_microseconds_total" ["step" = "constrained"], Counter, "";
    /// Wall time of whole engine steps without constrained rows, in microseconds.
    step_free_us: "pagoda_engine_step_microseconds_total" ["step" = "free"], Counter,
        "Wall time of the engine's steps (schedule, forward, draw, postprocess), in microseconds, by whether the step held constrained rows; pagoda_engine_steps_total counts them.";
    /// The same for steps holding constrained rows.
    step_constrained_us: "pagoda_engine_step_microseconds_total" ["step" = "constrained"], Counter, "";
    /// Engine steps without constrained rows.
    steps_free: "pagoda_engine_steps_total" ["step" = "free"], Counter,
        "Engine steps that ran a forward, by whether they held constrained rows (structured output).";
    /// Engine steps holding constrained rows.
    steps_constrained: "pagoda_engine_steps_total" ["step" = "constrained"], Counter, "";
    /// Prefill and mixed CUDA steps replayed (or captured) as piecewise graphs.
    steps_cuda_piecewise: "pagoda_cuda_piecewise_steps_total", Counter,
        "CUDA prefill and mixed steps whose kernels between attentions ran from piecewise graphs per token bucket (PAGODA_CUDA_PIECEWISE_TOKENS).";
    /// Piecewise graphs captured (pieces, over every token bucket).
    cuda_piece_graphs_captured: "pagoda_cuda_piece_graphs_captured_total", Counter,
        "Piecewise graphs captured (one per piece of a token bucket's steps: layers + 1).";
    /// Piecewise captures that failed (the bucket then runs eagerly).
    cuda_piece_capture_failures: "pagoda_cuda_piece_capture_failures_total", Counter,
        "Piecewise graph captures that failed; the step reran eagerly and its token bucket stays eager (the warning names the error).";
    /// CUDA decode steps run as cascade (shared pages attended once per group).
    steps_cuda_cascade: "pagoda_cuda_cascade_steps_total", Counter,
        "CUDA decode steps run as cascade attention: requests sharing a prefix's pages (prefix cache) attend to them once per group on tensor cores, their own pages through the fused decode (PAGODA_CASCADE_ATTENTION).";
    /// CUDA decode steps some of whose requests ran sparse decode.
    steps_cuda_sparse: "pagoda_cuda_sparse_steps_total", Counter,
        "CUDA decode steps in which sparse decode (--sparse-attention) shortened at least one request's page list: every layer selects its pages on the device before the fused decode (the pages are counted by pagoda_sparse_decode_*).";
    /// Share groups (levels) of cascade steps.
    cuda_cascade_groups: "pagoda_cuda_cascade_groups_total", Counter,
        "Share groups (nested levels count apart) whose pages CUDA cascade steps read once per group.";
    /// Tokens cascade steps read once per group (per layer).
    cuda_cascade_shared_tokens: "pagoda_cuda_cascade_shared_tokens_total", Counter,
        "KV tokens CUDA cascade steps read once for their whole group, per layer.";
    /// Token reads cascade steps saved (per layer).
    cuda_cascade_saved_token_reads: "pagoda_cuda_cascade_saved_token_reads_total", Counter,
        "KV token reads CUDA cascade steps saved against the plain fused decode, per layer: (members - 1) x shared tokens.";
    /// Mixed CUDA steps whose decode rows ran the fused decode and chunks the prefill kernel.
    steps_cuda_mixed_split: "pagoda_cuda_mixed_steps_total" ["path" = "split"], Counter,
        "CUDA steps holding decode rows and prefill chunks, by their attention (split: decode rows on the fused decode, chunks on the prefill kernel; prefill: every row on the prefill kernel, PAGODA_CUDA_MIXED_STEPS).";
    /// Mixed CUDA steps whose rows all ran the prefill kernel.
    steps_cuda_mixed_prefill: "pagoda_cuda_mixed_steps_total" ["path" = "prefill"], Counter, "";
    /// Decode rows of mixed CUDA steps.
    cuda_mixed_decode_rows: "pagoda_cuda_mixed_step_tokens_total" ["kind" = "decode"], Counter,
        "Tokens of mixed CUDA steps, by kind (decode: one-token rows; prefill: the chunks' tokens).";
    /// Prefill tokens of mixed CUDA steps.
    cuda_mixed_prefill_tokens: "pagoda_cuda_mixed_step_tokens_total" ["kind" = "prefill"], Counter, "";
    /// CUDA steps whose layers ran RoPE and the KV append in one launch.
    steps_cuda_fused_rope_append: "pagoda_cuda_fused_rope_append_steps_total", Counter,
        "CUDA steps whose layers ran RoPE and the KV append in one launch (PAGODA_CUDA_FUSED_ROPE_APPEND).";
    /// CUDA steps over an fp8 (e4m3) KV cache.
    steps_cuda_fp8_kv: "pagoda_cuda_fp8_kv_steps_total", Counter,
        "CUDA steps over an fp8 KV cache (-ctk fp8 -ctv fp8: e4m3 with per-head scales, read by the CUDA-core fused decode and the tiled prefill).";
    /// CUDA steps whose linear layers ran the small-batch kernel (at most 8 rows).
    steps_cuda_gemv: "pagoda_cuda_gemv_steps_total", Counter,
        "CUDA steps whose linear layers ran the small-batch kernel instead of cuBLAS (PAGODA_CUDA_GEMV, steps of at most 8 rows).";
    /// CUDA steps that multiplied quantized matrices in place (q8 activations, integer dots).
    steps_cuda_quant_in_place: "pagoda_cuda_quant_linear_steps_total" ["path" = "in_place"], Counter,
        "CUDA steps of a model with GGUF blocks on the device, by how its quantized matrices ran: in place (at most PAGODA_CUDA_QUANT_GEMV_ROWS rows), on the tensor cores in place (at most PAGODA_CUDA_QUANT_MMA_ROWS) or decoded for cuBLAS.";
    /// CUDA steps that multiplied quantized matrices on the tensor cores (`gemm_quant_mma`).
    steps_cuda_quant_mma: "pagoda_cuda_quant_linear_steps_total" ["path" = "mma"], Counter,
        "";
    /// CUDA steps that decoded quantized matrices into a scratch for cuBLAS.
    steps_cuda_quant_decoded: "pagoda_cuda_quant_linear_steps_total" ["path" = "decoded"], Counter,
        "";
    /// CUDA steps that multiplied FP8 matrices in place (`gemv_fp8`).
    steps_cuda_fp8_weights_in_place: "pagoda_cuda_fp8_weight_steps_total" ["path" = "in_place"], Counter,
        "CUDA steps of a model with FP8 (e4m3) matrices kept on the device (PAGODA_CUDA_FP8_WEIGHTS), by how they ran: in place (gemv_fp8, at most 16 rows), on cuBLASLt's FP8 GEMM (PAGODA_CUDA_FP8_GEMM) or decoded into a bf16 scratch for cuBLAS.";
    /// CUDA steps that ran FP8 matrices on cuBLASLt's FP8 GEMM.
    steps_cuda_fp8_weights_gemm: "pagoda_cuda_fp8_weight_steps_total" ["path" = "fp8_gemm"], Counter,
        "";
    /// CUDA steps that decoded FP8 matrices into a scratch for cuBLAS.
    steps_cuda_fp8_weights_decoded: "pagoda_cuda_fp8_weight_steps_total" ["path" = "decoded"], Counter,
        "";
    /// In-place (or tensor-core) quantized CUDA steps whose norms and SiLU x up wrote the q8
    /// activations.
    steps_cuda_quant_fused_q8: "pagoda_cuda_quant_fused_q8_steps_total", Counter,
        "CUDA steps multiplying quantized matrices in place (gemv_quant or gemm_quant_mma) whose RMSNorms and SiLU x up wrote the q8 activations of the next linear layer in their own launch (PAGODA_CUDA_QUANT_FUSED_Q8).";
    /// In-place quantized CUDA steps whose two-format matrices ran in one launch each.
    steps_cuda_quant_pair: "pagoda_cuda_quant_pair_steps_total", Counter,
        "CUDA steps multiplying quantized matrices in place whose matrices of two formats (a Q4_K_M QKV with a Q6_K v) ran in one launch each (PAGODA_CUDA_QUANT_PAIR).";
    /// Streaming prefill steps whose tiling came from the tuning table (`pagoda tune`).
    steps_cuda_prefill_tuned: "pagoda_cuda_prefill_tiling_steps_total" ["source" = "tuned"], Counter,
        "Streaming prefill steps by where their tiling came from (tuned: the tuning table's row for the step's bucket; heuristic: no row, the built-in choice).";
    /// Streaming prefill steps whose bucket has no table row (the built-in heuristic ran).
    steps_cuda_prefill_heuristic: "pagoda_cuda_prefill_tiling_steps_total" ["source" = "heuristic"], Counter, "";
    /// Fused decode steps whose plan merged chunks.
    steps_cuda_decode_fused_merged: "pagoda_cuda_decode_fused_merged_steps_total", Counter,
        "Fused decode steps whose plan split some request into chunks merged by log-sum-exp.";
    /// GPU time of the CUDA steps (CUDA events, upload to logits ready), microseconds.
    cuda_gpu_time_us: "pagoda_cuda_gpu_time_microseconds_total", Counter,
        "GPU time of the CUDA steps (CUDA events, inputs upload to logits ready).";
    /// CUDA steps followed by the device sampler.
    steps_cuda_sampled: "pagoda_cuda_sampled_steps_total", Counter,
        "CUDA steps followed by the device sampler (some rows drawn on the GPU).";
    /// Rows of device-sampled steps whose token the GPU drew.
    cuda_sampled_rows_device: "pagoda_cuda_sampled_step_rows_total" ["where" = "device"], Counter,
        "Logits rows of device-sampled CUDA steps, by where their token was drawn (device: the GPU sampler; host: the row's logits downloaded for the CPU samplers).";
    /// Rows of device-sampled steps left to the host.
    cuda_sampled_rows_host: "pagoda_cuda_sampled_step_rows_total" ["where" = "host"], Counter, "";
    /// Requests (per step) with at least one split-KV row on the CPU.
    requests_split_kv: "pagoda_attention_split_kv_requests_total", Counter,
        "Requests (per step) whose attention had split-KV rows.";
    /// Requests (per step) served by gather only on the CPU.
    requests_gather: "pagoda_attention_gather_requests_total", Counter,
        "Requests (per step) served by gather-then-attend only.";
    /// Tokens drawn by the GPU sampler (CUDA backend, fused sampler, requests without
    /// penalties or log-probabilities).
    sampled_tokens_gpu: "pagoda_sampled_tokens_total" ["path" = "gpu"], Counter,
        "Tokens sampled, by where they were drawn (gpu: the CUDA sampler kernels; cpu: the host samplers).";
    /// Tokens drawn on the CPU (every token on the CPU backend).
    sampled_tokens_cpu: "pagoda_sampled_tokens_total" ["path" = "cpu"], Counter, "";
    /// GPU-sampled tokens that took the GPU sampler's counted exact fallback.
    gpu_sampler_fallbacks: "pagoda_gpu_sampling_fallbacks_total", Counter,
        "GPU-sampled tokens that took the GPU sampler's counted exact fallback.";
    /// GPU-sampled rows that took the greedy argmax.
    gpu_sampler_greedy: "pagoda_gpu_sampling_rows_total" ["method" = "greedy"], Counter,
        "GPU-sampled rows by method (greedy: argmax; gumbel: Gumbel-max, no filter; rejection: filtered rows accepted by dual-pivot rejection).";
    /// GPU-sampled rows drawn by Gumbel-max (no filter active).
    gpu_sampler_gumbel: "pagoda_gpu_sampling_rows_total" ["method" = "gumbel"], Counter, "";
    /// GPU-sampled filtered rows accepted by dual-pivot rejection.
    gpu_sampler_rejection: "pagoda_gpu_sampling_rows_total" ["method" = "rejection"], Counter, "";
    /// Dual-pivot rejection rounds of the GPU-sampled filtered rows.
    gpu_sampler_rejection_rounds: "pagoda_gpu_sampling_rejection_rounds_total", Counter,
        "Dual-pivot rejection rounds of the GPU-sampled filtered rows.";
    /// GPU-sampled filtered rows finished by the multi-CTA fast path.
    gpu_sampler_filtered_fast: "pagoda_gpu_sampling_filtered_rows_total" ["path" = "fast"], Counter,
        "GPU-sampled top-k/top-p/min-p rows, by kernel path (fast: the multi-CTA pipeline; exact: the single-CTA kernel).";
    /// GPU-sampled filtered rows drawn by the single-CTA exact kernel.
    gpu_sampler_filtered_exact: "pagoda_gpu_sampling_filtered_rows_total" ["path" = "exact"], Counter, "";
    /// GPU-sampled rows whose maximum the Gumbel kernel found (no row-maximum pass).
    gpu_sampler_gumbel_max: "pagoda_gpu_sampling_gumbel_max_rows_total", Counter,
        "GPU-sampled rows whose maximum the Gumbel kernel found, with no row-maximum pass (launches without filtered rows; PAGODA_GPU_SAMPLING_GUMBEL_MAX).";
    /// GPU-sampled filtered rows whose rounds ran on their id list.
    gpu_sampler_list_rows: "pagoda_gpu_sampling_list_rows_total", Counter,
        "GPU-sampled filtered rows whose rounds ran on the list of their proposal's ids (top-k rows with top-p; PAGODA_GPU_SAMPLING_LIST_ROUNDS).";
    /// GPU-sampled filtered rows finished by the cluster kernel.
    gpu_sampler_cluster_rows: "pagoda_gpu_sampling_cluster_rows_total", Counter,
        "GPU-sampled filtered rows finished by the cluster kernel, one thread-block cluster per row (PAGODA_GPU_SAMPLING_CLUSTER).";
    /// Rows of the cluster kernel whose logits were prefetched into L2 by a resident row.
    gpu_sampler_prefetched_rows: "pagoda_gpu_sampling_prefetched_rows_total", Counter,
        "Rows of the cluster kernel whose logits a resident row asked L2 for, when the batch had more rows than clusters fit on the GPU (PAGODA_GPU_SAMPLING_PREFETCH).";
    /// GPU sampler launches whose split counts came from the tuning table.
    gpu_sampler_splits_tuned: "pagoda_gpu_sampling_split_launches_total" ["source" = "tuned"], Counter,
        "GPU sampler launches (runs of device-sampled rows) by where their CTAs-per-row counts came from: the tuning table (`pagoda tune --kernels sampling`) or the built-in rules. The tokens do not depend on it.";
    /// GPU sampler launches on the built-in split rules.
    gpu_sampler_splits_rules: "pagoda_gpu_sampling_split_launches_total" ["source" = "heuristic"], Counter, "";
    /// CPU forward passes run on all configured threads (the adaptive pool,
    /// `PAGODA_CPU_ADAPTIVE_THREADS`).
    steps_cpu_all_threads: "pagoda_cpu_steps_total" ["pool" = "all_threads"], Counter,
        "CPU forward steps, by the pool that ran them (all_threads: --threads; one_thread: the adaptive pool's, PAGODA_CPU_ADAPTIVE_THREADS).";
    /// CPU forward passes run on one thread.
    steps_cpu_one_thread: "pagoda_cpu_steps_total" ["pool" = "one_thread"], Counter, "";
    /// Probe bursts of the other pool started.
    cpu_pool_probes: "pagoda_cpu_pool_probes_total", Counter,
        "Probe bursts the adaptive CPU pool ran on the other pool.";
    /// Times a kind of step changed pool.
    cpu_pool_switches: "pagoda_cpu_pool_switches_total", Counter,
        "Times a kind of CPU step changed pool.";
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runners_totals_are_added_once_whatever_the_number_of_calls() {
        let mut engine = EngineCounters {
            steps_cuda: 2,
            ..EngineCounters::default()
        };
        let mut seen = EngineCounters::default();
        let mut runner = EngineCounters {
            steps_cuda_graph: 1,
            cuda_graphs_captured: 4,
            ..EngineCounters::default()
        };
        for _ in 0..2 {
            engine.add_difference(&runner, &seen);
            seen = runner.clone();
        }
        runner.steps_cuda_graph += 2;
        runner.gpu_sampler_greedy += 3;
        engine.add_difference(&runner, &seen);
        assert_eq!(engine.steps_cuda, 2, "the engine's own counters stay");
        assert_eq!(engine.steps_cuda_graph, 3);
        assert_eq!(engine.cuda_graphs_captured, 4);
        assert_eq!(engine.gpu_sampler_greedy, 3);
    }

    #[test]
    fn every_counter_is_declared_once_and_families_are_whole() {
        let info = EngineCounters::INFO;
        for (i, c) in info.iter().enumerate() {
            assert!(c.metric.starts_with("pagoda_"), "{}", c.field);
            assert!(
                info[..i]
                    .iter()
                    .all(|o| (o.metric, o.label) != (c.metric, c.label) && o.field != c.field),
                "{} is declared twice",
                c.field
            );
            let first = info.iter().position(|o| o.metric == c.metric).unwrap();
            // A family's members are adjacent, share a kind, and only the first has the help.
            assert!(
                info[first..=i].iter().all(|o| o.metric == c.metric),
                "{}",
                c.metric
            );
            assert_eq!(info[first].kind, c.kind, "{}", c.metric);
            assert_eq!(i == first, !c.help.is_empty(), "{}", c.field);
            assert_eq!(
                c.label.is_some(),
                info.iter().filter(|o| o.metric == c.metric).count() > 1
            );
            if c.kind == MetricKind::Counter {
                assert!(c.metric.ends_with("_total"), "{}", c.metric);
            }
        }
        let counters = EngineCounters {
            cpu_pool_switches: 7,
            steps_split_kv: 3,
            ..EngineCounters::default()
        };
        let values = counters.values();
        assert_eq!(values.len(), info.len());
        assert_eq!(values[0], (&info[0], 3));
        assert_eq!(values.last().unwrap().1, 7);
    }
}
