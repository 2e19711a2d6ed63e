//! `pagoda bench`'s forward-step counts by path: the proof of which path each test measured.

use pagoda_engine::{Engine, EngineCounters};
use serde::Serialize;

/// Forward steps by path over a timed span: CPU attention split-KV / gather, CUDA steps
/// replayed from a graph / launched eagerly, CUDA attention baseline decode / prefill kernel.
#[derive(Serialize, Default, Clone, Copy)]
pub(super) struct StepCounts {
    split_kv: u64,
    gather: u64,
    cuda_graph: u64,
    cuda_eager: u64,
    cuda_decode_gather: u64,
    cuda_decode_fused: u64,
    cuda_decode_tuned: u64,
    /// Fused decode steps run as cascade (shared prefix pages read once per group).
    cuda_cascade: u64,
    /// Fused decode steps some of whose requests ran sparse decode.
    cuda_sparse: u64,
    cuda_prefill_kernel: u64,
    cuda_prefill_tuned: u64,
    /// CUDA steps that multiplied FP8 weights in place / decoded them for cuBLAS.
    cuda_fp8_in_place: u64,
    cuda_fp8_gemm: u64,
    cuda_fp8_decoded: u64,
    /// CUDA steps that multiplied GGUF blocks in place, on the tensor cores, or decoded them
    /// for cuBLAS.
    cuda_quant: [u64; 3],
    /// GPU time of the CUDA steps (CUDA events), microseconds.
    cuda_gpu_us: u64,
    /// Tokens drawn by the GPU sampler / on the CPU, and GPU sampler fallbacks.
    sampled_gpu: u64,
    sampled_cpu: u64,
    gpu_sampler_fallbacks: u64,
    /// Prompt tokens found in the prefix cache while the test set up (shared prefixes).
    pub(super) prefix_hit_tokens: u64,
    /// CPU steps the adaptive pool ran on one thread (`PAGODA_CPU_ADAPTIVE_THREADS`).
    cpu_one_thread: u64,
    /// Speculation: guesses run through the model, accepted, and the rows that carried them.
    spec_drafted: u64,
    spec_accepted: u64,
    spec_rows: u64,
}

impl std::ops::AddAssign for StepCounts {
    fn add_assign(&mut self, other: StepCounts) {
        self.split_kv += other.split_kv;
        self.gather += other.gather;
        self.cuda_graph += other.cuda_graph;
        self.cuda_eager += other.cuda_eager;
        self.cuda_decode_gather += other.cuda_decode_gather;
        self.cuda_decode_fused += other.cuda_decode_fused;
        self.cuda_decode_tuned += other.cuda_decode_tuned;
        self.cuda_cascade += other.cuda_cascade;
        self.cuda_sparse += other.cuda_sparse;
        self.cuda_prefill_kernel += other.cuda_prefill_kernel;
        self.cuda_prefill_tuned += other.cuda_prefill_tuned;
        self.cuda_fp8_in_place += other.cuda_fp8_in_place;
        self.cuda_fp8_gemm += other.cuda_fp8_gemm;
        self.cuda_fp8_decoded += other.cuda_fp8_decoded;
        for (sum, steps) in self.cuda_quant.iter_mut().zip(other.cuda_quant) {
            *sum += steps;
        }
        self.cuda_gpu_us += other.cuda_gpu_us;
        self.sampled_gpu += other.sampled_gpu;
        self.sampled_cpu += other.sampled_cpu;
        self.gpu_sampler_fallbacks += other.gpu_sampler_fallbacks;
        self.prefix_hit_tokens += other.prefix_hit_tokens;
        self.cpu_one_thread += other.cpu_one_thread;
        self.spec_drafted += other.spec_drafted;
        self.spec_accepted += other.spec_accepted;
        self.spec_rows += other.spec_rows;
    }
}

impl std::fmt::Display for StepCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.prefix_hit_tokens > 0 {
            write!(f, "prefix hits {} tokens; ", self.prefix_hit_tokens)?;
        }
        if self.spec_rows > 0 {
            write!(
                f,
                "spec: {} of {} guesses accepted in {} rows; ",
                self.spec_accepted, self.spec_drafted, self.spec_rows
            )?;
        }
        if self.cuda_graph + self.cuda_eager > 0 {
            let steps = self.cuda_graph + self.cuda_eager;
            write!(
                f,
                "cuda graph {} eager {} (decode fused {} [{} tuned, {} cascade, {} sparse] gather {} prefill \
                 {} [{} tuned]), gpu {:.3} ms/step",
                self.cuda_graph,
                self.cuda_eager,
                self.cuda_decode_fused,
                self.cuda_decode_tuned,
                self.cuda_cascade,
                self.cuda_sparse,
                self.cuda_decode_gather,
                self.cuda_prefill_kernel,
                self.cuda_prefill_tuned,
                self.cuda_gpu_us as f64 / 1e3 / steps as f64
            )?;
            if self.cuda_fp8_in_place + self.cuda_fp8_gemm + self.cuda_fp8_decoded > 0 {
                write!(
                    f,
                    ", fp8 weights in place {} fp8 gemm {} decoded {}",
                    self.cuda_fp8_in_place, self.cuda_fp8_gemm, self.cuda_fp8_decoded
                )?;
            }
            if self.cuda_quant.iter().sum::<u64>() > 0 {
                let [in_place, mma, decoded] = self.cuda_quant;
                write!(f, ", quant in place {in_place} mma {mma} decoded {decoded}")?;
            }
            write!(
                f,
                ", sampled gpu {} cpu {} (gpu fallbacks {})",
                self.sampled_gpu, self.sampled_cpu, self.gpu_sampler_fallbacks
            )
        } else {
            write!(f, "{}/{}", self.split_kv, self.gather)?;
            if self.cpu_one_thread > 0 {
                write!(f, " ({} on one thread)", self.cpu_one_thread)?;
            }
            Ok(())
        }
    }
}

/// Forward steps run per path since `before`.
pub(super) fn steps_since(engine: &Engine, before: &EngineCounters) -> StepCounts {
    let now = engine.counters();
    StepCounts {
        split_kv: now.steps_split_kv - before.steps_split_kv,
        gather: now.steps_gather - before.steps_gather,
        cuda_graph: now.steps_cuda_graph - before.steps_cuda_graph,
        cuda_eager: now.steps_cuda_eager - before.steps_cuda_eager,
        cuda_decode_gather: now.steps_cuda_decode_gather - before.steps_cuda_decode_gather,
        cuda_decode_fused: now.steps_cuda_decode_fused - before.steps_cuda_decode_fused,
        cuda_decode_tuned: now.steps_cuda_decode_tuned - before.steps_cuda_decode_tuned,
        cuda_cascade: now.steps_cuda_cascade - before.steps_cuda_cascade,
        cuda_sparse: now.steps_cuda_sparse - before.steps_cuda_sparse,
        cuda_prefill_kernel: now.steps_cuda_prefill_kernel - before.steps_cuda_prefill_kernel,
        cuda_prefill_tuned: now.steps_cuda_prefill_tuned - before.steps_cuda_prefill_tuned,
        cuda_fp8_in_place: now.steps_cuda_fp8_weights_in_place
            - before.steps_cuda_fp8_weights_in_place,
        cuda_fp8_gemm: now.steps_cuda_fp8_weights_gemm - before.steps_cuda_fp8_weights_gemm,
        cuda_fp8_decoded: now.steps_cuda_fp8_weights_decoded
            - before.steps_cuda_fp8_weights_decoded,
        cuda_quant: [
            now.steps_cuda_quant_in_place - before.steps_cuda_quant_in_place,
            now.steps_cuda_quant_mma - before.steps_cuda_quant_mma,
            now.steps_cuda_quant_decoded - before.steps_cuda_quant_decoded,
        ],
        cuda_gpu_us: now.cuda_gpu_time_us - before.cuda_gpu_time_us,
        sampled_gpu: now.sampled_tokens_gpu - before.sampled_tokens_gpu,
        sampled_cpu: now.sampled_tokens_cpu - before.sampled_tokens_cpu,
        gpu_sampler_fallbacks: now.gpu_sampler_fallbacks - before.gpu_sampler_fallbacks,
        prefix_hit_tokens: 0,
        cpu_one_thread: now.steps_cpu_one_thread - before.steps_cpu_one_thread,
        spec_drafted: now.spec_drafted - before.spec_drafted,
        spec_accepted: now.spec_accepted - before.spec_accepted,
        spec_rows: now.spec_rows - before.spec_rows,
    }
}
