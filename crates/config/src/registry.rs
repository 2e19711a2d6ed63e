//! The registry: every setting pagoda reads, in one list.

/// What a setting is for (the sections of `docs/configuration.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Group {
    /// The model and the server.
    Serving,
    /// The engine, on every device.
    Engine,
    /// CPU kernels.
    Cpu,
    /// CUDA kernels and the GPU runner.
    Cuda,
    /// Knobs for measurements (the default is the measured best).
    Tuning,
    /// Where CUDA headers and compiled kernels live.
    Paths,
    /// Read by tests and scripts, never by the binary.
    Testing,
}

impl Group {
    /// Every group, in the order of the docs.
    pub const ALL: [Group; 7] = [
        Group::Serving,
        Group::Engine,
        Group::Cpu,
        Group::Cuda,
        Group::Tuning,
        Group::Paths,
        Group::Testing,
    ];

    /// The section title.
    pub fn title(self) -> &'static str {
        match self {
            Group::Serving => "Model and server",
            Group::Engine => "Engine",
            Group::Cpu => "CPU kernels",
            Group::Cuda => "CUDA",
            Group::Tuning => "Measurement knobs",
            Group::Paths => "Paths",
            Group::Testing => "Tests and scripts (not read by `pagoda`)",
        }
    }
}

/// The values a setting takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Values {
    /// One of these words (matched without regard to case, `_` and `-` alike).
    Choice(&'static [&'static str]),
    /// `on` or `off` (also `1`/`0`, `true`/`false`, `yes`/`no`).
    OnOff,
    /// A whole number in `min..=max`, or one of `words`.
    Number {
        /// Smallest number.
        min: u64,
        /// Largest number.
        max: u64,
        /// Words also accepted (`auto`, `off`).
        words: &'static [&'static str],
    },
    /// A decimal number from 0 to 1.
    Fraction,
    /// `WORD` or `WORD+SUFFIX`.
    Composite {
        /// The words.
        words: &'static [&'static str],
        /// The suffixes.
        suffixes: &'static [&'static str],
    },
    /// Free text (a path, a key); a `secret` never shows in `pagoda config`.
    Text {
        /// Hidden in listings.
        secret: bool,
    },
}

/// One setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Setting {
    /// The environment variable.
    pub name: &'static str,
    /// The command-line flag that sets it too (it wins over the variable), if any.
    pub flag: Option<&'static str>,
    /// The values it takes.
    pub values: Values,
    /// The value when unset, as a user would write it (or what unset means, in parentheses).
    pub default: &'static str,
    /// What it does, in one line.
    pub doc: &'static str,
    /// The code that reads it.
    pub read_by: &'static str,
    /// Its section.
    pub group: Group,
}

/// The setting named `name`, if it is one.
pub fn setting(name: &str) -> Option<&'static Setting> {
    SETTINGS.iter().find(|s| s.name == name)
}

const AUTO: &[&str] = &["auto"];
const ON_OFF: Values = Values::OnOff;
const TEXT: Values = Values::Text { secret: false };

macro_rules! settings {
    ($($name:literal, $flag:expr, $values:expr, $default:literal, $group:ident, $read_by:literal, $doc:literal;)*) => {
        /// Every setting, grouped as in the docs.
        pub static SETTINGS: &[Setting] = &[$(Setting {
            name: $name,
            flag: $flag,
            values: $values,
            default: $default,
            doc: $doc,
            read_by: $read_by,
            group: Group::$group,
        }),*];
    };
}

settings! {
    "PAGODA_MODEL", Some("-m/--model"), TEXT, "(models/SmolLM2-135M-Instruct.Q4_1.gguf)", Serving,
        "cli common::resolve_model",
        "The model: a .gguf file or a Hugging Face directory.";
    "PAGODA_API_KEY", Some("--api-key"), Values::Text { secret: true }, "(none: open)", Serving,
        "cli serve, bench serve",
        "The key `pagoda serve` requires on every endpoint but /health, and `pagoda bench serve` sends.";

    "PAGODA_ATTENTION", Some("--attention"), Values::Choice(&["auto", "split-kv", "gather"]), "auto", Engine,
        "cli common::attention_policy",
        "CPU attention per query row: auto is split-KV for rows that see 16+ tokens, gather below.";
    "PAGODA_CASCADE_ATTENTION", None, Values::Choice(&["off", "on", "auto"]), "auto", Engine,
        "engine EngineSettings (models llama::cascade_rule); models llama_cuda::CudaKernels::cascade",
        "Cascade attention: decode rows whose requests share a prompt's KV pages (prefix cache) read them once per group. CPU: each shared 256-token chunk in one work item; auto where a group saves 1024+ token reads per layer (1.3-2.6x decode behind shared prompts of 256-4096 tokens); same bits as off (reproducible). CUDA: the shared level on tensor cores beside the fused decode of each request's own pages, merged; auto where a level of 1024+ tokens saves 32768+ reads and the step's saved reads reach its own tokens (1.03-6.5x at the op level on the H100, 1.47x end to end at 64 requests behind 4096 tokens); not batch-invariant, off in deterministic mode and with the fp8 KV cache. on: any 2 requests sharing a page.";
    "PAGODA_TENSOR_PARALLEL_SIZE", Some("-tp/--tensor-parallel-size"), Values::Number { min: 1, max: 64, words: &[] }, "1", Engine,
        "engine load_backend, EngineSettings::tensor_parallel_size; cli common::resolve_device",
        "Ranks one model is split over (tensor parallelism, issue 40): on the CPU, threads of this process (Model::load_tensor_parallel); CUDA refuses more than 1 until the NCCL increment.";
    "PAGODA_CACHE_TYPE_K", Some("-ctk/--cache-type-k"), Values::Choice(&["f32", "f16", "q8_0", "fp8"]), "f32", Engine,
        "cli common::kv_cache_types",
        "KV cache type of K: on the CPU f32, f16 (half the bytes) or q8_0 (llama.cpp's blocks, 34 bytes per 32 values); on CUDA the default (the model's dtype) or fp8 (e4m3 with one f32 scale per token and KV head, about half of bf16's bytes; with -ctv fp8, bf16 models).";
    "PAGODA_CACHE_TYPE_V", Some("-ctv/--cache-type-v"), Values::Choice(&["f32", "f16", "q8_0", "fp8"]), "f32", Engine,
        "cli common::kv_cache_types",
        "KV cache type of V: as for K (fp8 on CUDA only, together with -ctk fp8).";
    "PAGODA_KV_CACHE_DTYPE", Some("--kv-cache-dtype"), Values::Choice(&["auto", "fp8", "fp8_e4m3"]), "auto", Engine,
        "cli common::kv_cache_types",
        "vLLM's spelling: fp8 (or fp8_e4m3) sets both -ctk and -ctv to fp8 (CUDA); auto leaves them as they are.";
    "PAGODA_SAMPLER", Some("--sampler"), Values::Choice(&["fused", "reference"]), "fused", Engine,
        "ops sampling::SamplerKind",
        "Token sampler: fused (sort-free; on the GPU where it can) or reference (the sorting oracle).";
    "PAGODA_PREFIX_CACHING", None, ON_OFF, "on", Engine,
        "engine EngineSettings",
        "Reuse the KV pages of a prompt prefix seen before.";
    "PAGODA_PREFIX_WAIT_TOKENS", None, Values::Number { min: 0, max: 1 << 20, words: &[] }, "64", Engine,
        "scheduler SchedulerConfig (prefix_wait_tokens) via engine EngineSettings",
        "Prefix-aware admission: a waiting request that shares at least this many prompt tokens (whole pages) not yet in the prefix cache with a running request still computing them waits for them, keeping its place while requests behind it that share nothing are admitted; a burst behind one system prompt computes it once. 0: plain FIFO admission. Needs PAGODA_PREFIX_CACHING.";
    "PAGODA_STRUCTURED_MASKS_BESIDE", None, ON_OFF, "on", Engine,
        "engine EngineSettings",
        "Structured output: compute the token masks of a step's constrained requests on a thread beside the forward (off: each when its row is sampled).";
    "PAGODA_SPEC", Some("--spec"), Values::Choice(&["off", "ngram", "draft"]), "off", Engine,
        "engine EngineSettings (speculation)",
        "Speculative decoding: off, ngram (prompt lookup) or draft (a draft model, --model-draft).";
    "PAGODA_MODEL_DRAFT", Some("-md/--model-draft"), TEXT, "(none)", Engine,
        "cli load_draft",
        "The draft model of --spec draft (a .gguf file or a Hugging Face directory); its vocabulary must match the model's.";
    "PAGODA_SPEC_RULE", Some("--spec-rule"), Values::Choice(&["invariant", "leviathan"]), "invariant", Engine,
        "engine EngineSettings (speculation)",
        "How guesses are verified: invariant (accept while a guess equals the target's own seeded draw: outputs equal plain decoding's) or leviathan (accept with probability min(1, p/q): the same distribution, more acceptances, other tokens).";
    "PAGODA_DRAFT_P_MIN", Some("--draft-p-min"), Values::Fraction, "0", Engine,
        "engine EngineSettings (speculation)",
        "The draft model stops drafting at a token it drew with probability below this.";
    "PAGODA_DRAFT_MAX", Some("--draft-max"), Values::Number { min: 1, max: 64, words: &[] }, "4", Engine,
        "engine EngineSettings (speculation)",
        "Most guessed tokens per request and step.";
    "PAGODA_DRAFT_MIN", Some("--draft-min"), Values::Number { min: 1, max: 64, words: &[] }, "1", Engine,
        "engine EngineSettings (speculation)",
        "Fewest guessed tokens worth a draft (shorter proposals are dropped).";
    "PAGODA_SPEC_NGRAM_MIN", Some("--spec-ngram-min"), Values::Number { min: 1, max: 16, words: &[] }, "2", Engine,
        "engine EngineSettings (speculation)",
        "Shortest suffix the n-gram proposer matches.";
    "PAGODA_SPEC_NGRAM_MAX", Some("--spec-ngram-max"), Values::Number { min: 1, max: 16, words: &[] }, "4", Engine,
        "engine EngineSettings (speculation)",
        "Longest suffix the n-gram proposer matches (tried first).";
    "PAGODA_SPEC_MAX_BATCH", None, Values::Number { min: 1, max: 1024, words: &[] }, "16", Tuning,
        "engine EngineSettings (speculation)",
        "Speculation runs only in steps with at most this many decoding requests (below it the cost policy decides).";
    "PAGODA_SPEC_POLICY", None, Values::Choice(&["cost", "always"]), "cost", Tuning,
        "engine EngineSettings (speculation)",
        "cost: speculate where the measured step costs and acceptance say it pays (probing now and then where it does not); always: in every step under the batch limit.";
    "PAGODA_SPARSE_ATTENTION", Some("--sparse-attention"), TEXT, "off", Engine,
        "engine EngineSettings (sparse); cli common::configure and resolve_device check it",
        "Sparse decode (Quest page selection, CPU and CUDA): `budget=N,window=W,min-context=C` (any subset; defaults 1024, min(128, budget), 2048; `on` for all defaults). Decode rows of at least min-context and more than budget visible tokens attend to the first page, the pages of the last `window` tokens and the pages whose key summaries (per page and KV head, min and max) bound q.k highest, within `budget` tokens; keeps the summaries (2/page_size of an f32 K pool). Requests may override it (`sparse_attention` in the body; keys a request leaves out take these values). On CUDA the summaries follow the KV append on the device and each layer selects the pages on the device before the fused decode (decode and mixed steps, replayed from graphs); refused at start with tensor parallelism, a latent-attention (MLA) model, and on CUDA with the fp8 KV cache, --deterministic or --paged-decode gather. Off until measured for quality.";
    "PAGODA_CPU_ADAPTIVE_THREADS", None, Values::Choice(&["auto", "off", "one"]), "auto", Engine,
        "engine EngineSettings (cpu_pool)",
        "CPU thread pool per step: auto picks all threads or one per kind of step; off: all; one: one.";

    "PAGODA_CPU_KERNELS", None,
        Values::Composite {
            words: &["auto", "amx", "vnni8", "vnni", "avx2", "neon_dotprod", "neon", "scalar", "f32"],
            suffixes: &["q15_ffn_down", "f32_ffn_down"],
        },
        "auto", Cpu,
        "ops linear::CpuKernelPolicy",
        "CPU matmul kernel set; `+q15_ffn_down` / `+f32_ffn_down` pick ffn_down's activations.";
    "PAGODA_CPU_ATTENTION", None, Values::Choice(&["auto", "simd", "avx512", "avx2", "neon", "scalar"]), "auto", Cpu,
        "ops attention::AttentionKernel",
        "Instruction set of the CPU attention kernel (auto and simd: the widest the CPU has).";
    "PAGODA_CPU_F32_DECODE", None, Values::Choice(&["auto", "avx512", "avx2", "tile"]), "auto", Cpu,
        "ops linear::cpu::f32_decode",
        "Kernel of 1-8-token matmuls on f32 activations (tile: the two-row oracle; same bits).";
    "PAGODA_CPU_INT_DECODE", None, Values::Choice(&["auto", "avx512", "avx2"]), "auto", Cpu,
        "ops linear::cpu::interleaved::width",
        "Register width of one-token vnni8 matmuls (auto: avx512 on Intel, avx2 elsewhere; same bits).";
    "PAGODA_CPU_INT_PREFILL", None, Values::Choice(&["auto", "avx512", "avx2"]), "auto", Cpu,
        "ops linear::cpu::interleaved::width",
        "Register width of vnni8 prefills (auto: avx512; same bits).";
    "PAGODA_CPU_HIGH_BITS", None, Values::Choice(&["auto", "planes", "bytes"]), "auto", Cpu,
        "ops linear::cpu::interleaved::planes",
        "Layout of 5- and 6-bit weights in vnni8 records (auto: planes; same bits).";
    "PAGODA_CPU_SILU", None, Values::Choice(&["auto", "polynomial", "libm"]), "auto", Cpu,
        "ops activation::silu",
        "How SiLU computes exp (auto: polynomial; libm is the reference).";
    "PAGODA_CPU_AMX_TILES", None, Values::Choice(&["auto", "hardware", "emulated"]), "auto", Cpu,
        "ops linear::cpu::amx::backend",
        "Where the amx set's tiles run: hardware, or emulated on any AVX-512 VNNI CPU (for tests).";
    "PAGODA_CPU_AMX_PREFILL", None, Values::Choice(&["auto", "int8", "bf16"]), "auto", Cpu,
        "ops linear::cpu::amx::bf16",
        "AMX tiles of prefills (auto: int8, reproducible; bf16: faster, not batch-invariant).";
    "PAGODA_CPU_AMX_BF16_Q15", None, Values::Choice(&["auto", "split", "int8"]), "auto", Cpu,
        "ops linear::cpu::amx::bf16::split_q15",
        "With bf16 prefill, Q15 weights (ffn_down) on two-term bf16 activations (split) or INT8 tiles.";
    "PAGODA_CPU_PREFETCH", None, Values::Number { min: 0, max: 1 << 20, words: &["auto", "off"] }, "auto", Cpu,
        "ops linear::cpu::prefetch",
        "Software-prefetch distance of the integer kernels in bytes (auto: 8192; off or 0: none).";

    "PAGODA_CUDA_WARMUP", Some("--no-warmup (off)"), ON_OFF, "on", Cuda,
        "engine EngineSettings (Engine::warm_up)",
        "Before ready: compile every kernel the model can launch, capture the decode graphs, run a warm-up step.";
    "PAGODA_KERNEL_FORMAT", None, Values::Choice(&["cubin", "ptx"]), "cubin", Cuda,
        "cuda registry::Registry",
        "Compile kernels to a cubin for this GPU (cached per GPU and driver) or to PTX (JIT at load).";
    "PAGODA_DETERMINISTIC", Some("--deterministic (on)"), ON_OFF, "off", Cuda,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "CUDA: a request's tokens and log-probabilities do not depend on the batch (fixed-algorithm GEMMs, one attention kernel).";
    "PAGODA_CUDA_GRAPHS", Some("--enforce-eager (off)"), ON_OFF, "on", Cuda,
        "cli common::cuda_graphs",
        "Replay decode steps from CUDA graphs.";
    "PAGODA_PAGED_DECODE", Some("--paged-decode"), Values::Choice(&["auto", "fused", "gather"]), "auto", Cuda,
        "models llama_cuda::decode_path",
        "CUDA decode attention: fused split-KV over the page table, or gather-then-attend.";
    "PAGODA_PAGED_DECODE_KERNEL", None, Values::Choice(&["auto", "stream", "mma", "cuda-core"]), "auto", Cuda,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "Partial kernel of the fused decode (auto: the tuning table's, else streaming tensor cores where bf16 and head_dim 64/128/256).";
    "PAGODA_PAGED_DECODE_MERGE", None, Values::Choice(&["auto", "separate", "kernel"]), "auto", Cuda,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "Merge the fused decode's chunks in a second launch (separate) or in the kernel (auto: the tuning table's, else separate).";
    "PAGODA_CUDA_PREFILL", None, Values::Choice(&["stream", "mma", "tiled", "reference"]), "stream", Cuda,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "CUDA prefill attention kernel (stream falls back to mma, mma to tiled, where they do not apply).";
    "PAGODA_CUDA_PREFILL_TILING", None, Values::Choice(&["auto", "128x64x2", "128x32x2", "64x64x2", "64x64x3", "64x32x2"]), "auto", Cuda,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "Streaming prefill tiling, rows x keys x stages (auto: the tuning table's for the step's bucket, else 64x64x2 up to 2048 tokens, 128x64x2 above).";
    "PAGODA_CUDA_FUSED_ROPE_APPEND", None, ON_OFF, "on", Cuda,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "RoPE of q and k and the KV append into the paged pool in one launch per layer (the same bits as two).";
    "PAGODA_CUDA_MIXED_STEPS", None, Values::Choice(&["split", "prefill"]), "split", Cuda,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "Steps holding decode rows and prefill chunks: split (decode rows on the fused paged decode, chunks on the prefill kernel) or prefill (every row on the prefill kernel, as before).";
    "PAGODA_CUDA_PIECEWISE_TOKENS", None, Values::Number { min: 0, max: 1048576, words: &[] }, "256", Tuning,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "Prefill and mixed steps of up to this many tokens run everything but attention and the LM head from CUDA graphs captured per 16-token bucket (piecewise graphs; with CUDA graphs on, not in deterministic mode); 0: launched from the host.";
    "PAGODA_CUDA_DEVICE_MASKS", None, ON_OFF, "on", Cuda,
        "engine EngineSettings",
        "Structured output on CUDA: constrained rows sample on the GPU, their token masks uploaded and applied to the logits on the device (on: a JSON schema costs 5.6% of decode tok/s at 16 clients and 11% at 64 on the H200, against 15% and 26% when off, where their logits are downloaded and sampled on the host).";
    "PAGODA_CUDA_SPARSE_SELECT", None, Values::Choice(&["bitwise", "radix"]), "radix", Cuda,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "Sparse decode's page scores and selection on CUDA: radix (the summary loads issued before the query staging at three CTAs an SM where a lane's slice is one or two 16-byte vectors, the scores launched beside the step's summaries update, and a byte-at-a-time radix select; 1.3-1.5x faster sparse attention than bitwise on the H100 at 32K) or bitwise (round 3: the query staged first, the keep-th best page found bit by bit). The same pages either way.";
    "PAGODA_CUDA_GEMV", None, ON_OFF, "off", Cuda,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "Linear layers of 1-8 bf16 rows on the small-batch CUDA-core kernel instead of cuBLAS (off: measured level with cuBLAS at 1 row and slower from 2 in 8B decode; never in deterministic mode).";
    "PAGODA_CUDA_QUANT_WEIGHTS", None, ON_OFF, "on", Cuda,
        "engine load_backend (models llama_cuda::CudaModel::load_with)",
        "GGUF matrices in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K stay in their blocks on the GPU (device memory the file's size); off: dequantized to the --dtype at load.";
    "PAGODA_CUDA_FP8_WEIGHTS", None, ON_OFF, "on", Cuda,
        "engine load_backend (models llama_cuda::CudaModel::load_keeping)",
        "FP8 (e4m3) safetensors matrices with one factor per row (compressed-tensors float-quantized per channel or per tensor, vLLM's per-tensor fp8) stay in their bytes on the GPU (device memory the file's size): steps of a few bf16 rows multiply them in place (gemv_fp8, PAGODA_CUDA_FP8_GEMV_ROWS), more on the FP8 GEMM (PAGODA_CUDA_FP8_GEMM); off: dequantized to the --dtype at load. On: on the H100 (random Llama-3.1-8B:fp8) 1.50x the bf16 path at batch 1, 1.11x at 16, 1.09x at 64 and 1.12x in prefill (docs/benchmark_results/fp8-gemm-cuda-h100-2026-12-07.md; compiled for sm_90a and sm_80).";
    "PAGODA_CUDA_FP8_GEMM", None, ON_OFF, "on", Cuda,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "With PAGODA_CUDA_FP8_WEIGHTS, steps of more than PAGODA_CUDA_FP8_GEMV_ROWS rows multiply the FP8 matrices on cuBLASLt's FP8 GEMM (compute capability 8.9+): each activation row quantized to e4m3 with its own factor (amax / 448, dynamic per token, as vLLM runs these checkpoints), both factors applied in the GEMM's epilogue; a shape cuBLASLt refuses falls back with one warning. Off: up to 16 rows in place, more decoding each matrix into a bf16 scratch for cuBLAS (bf16 activations; 0.53x the FP8 GEMM at batch 64 and in prefill on the H100). Never in deterministic mode.";
    "PAGODA_CUDA_FP8_GEMV_ROWS", None, Values::Number { min: 0, max: 16, words: &[] }, "2", Tuning,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "With the FP8 GEMM on, steps of up to this many rows multiply FP8 matrices in place (gemv_fp8), more on the FP8 GEMM (2: on the H100, 8B, in place took 4.31/5.09/6.72 ms a step at 1/2/4 rows, the GEMM 6.03/6.17/6.28). Without the GEMM, in place up to 16 rows.";
    "PAGODA_CUDA_QUANT_GEMV_ROWS", None, Values::Number { min: 0, max: 256, words: &[] }, "8", Tuning,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "Steps of up to this many rows multiply quantized matrices in place (activations quantized to 8 bits, integer dots); more rows decode each matrix for cuBLAS (8: measured faster than 16 at 16 rows, 8B Q4_K_M on the H200); 0: always decode (as deterministic mode does).";
    "PAGODA_CUDA_QUANT_MMA_ROWS", None, Values::Number { min: 0, max: 256, words: &[] }, "32", Tuning,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "Steps of more than PAGODA_CUDA_QUANT_GEMV_ROWS and up to this many rows multiply quantized matrices on the tensor cores in place (gemm_quant_mma: the blocks decoded to bytes in registers, the q8 activations, s8 mma products of one 32-value group, the groups of a matrix of few rows split over CTAs), 64 rows a launch; more rows decode each matrix for cuBLAS; 0: off. 32: on the H100 (random 8B Q4_K_M at 1K context, 2026-12-08) 9.35 ms a step at 16 rows against 14.1 decoded, 12.5 against 14.9 at 32, but 20.9 against 16.6 at 64 and 7.7 against 6.3 in place at 8 (docs/benchmark_results/quant-mma-cuda-h100-2026-12-08.md). Never in deterministic mode.";
    "PAGODA_CUDA_QUANT_GEMV_KERNEL", None, Values::Choice(&["groups", "units", "units1", "units2", "units4"]), "groups", Tuning,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "Layout of the in-place quantized kernel: units (a warp per 2-4 weight rows sharing each activation load, four from 4 activation rows on except Q6_K; units1/2/4: that many rows a warp; a K-quant lane takes 64 values, both nibbles of the bytes it loads and the header once, a lane of Q4_0-Q8_0 one block) or groups (a CTA per 1-2 rows, a thread per 32-value group: the kernel of 2026-12-04; the default: units measured 1% slower at batch 1 and 10-14% at 4-8 rows, 8B Q4_K_M on the H100, docs/benchmark_results/quant-moe-h100-2026-12-05.md).";
    "PAGODA_CUDA_QUANT_FUSED_Q8", None, ON_OFF, "on", Cuda,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "Steps multiplying quantized matrices in place: the RMSNorm before QKV, gate/up and the LM head and the SiLU x up before the down projection write the q8 activations those read in the same launch (the same bytes as the separate quantize launch, one launch fewer each: three a layer); off: a quantize launch before each. On: random Q4_K_M 8B batch 1 1.7% faster with _PAIR (3.24-3.26 -> 3.19-3.20 ms a step), batch 16 level, the same logits bit for bit as off (H100, 2026-12-06; docs/benchmark_results/moe-mma-fp8-stream-h100-2026-12-06.md).";
    "PAGODA_CUDA_QUANT_PAIR", None, ON_OFF, "on", Cuda,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "Steps multiplying quantized matrices in place (groups layout): a stacked matrix of two formats, Q4_K or Q5_K then Q6_K (the QKV of a Q4_K_M or Q5_K_M file whose v is Q6_K), in one launch instead of one a part (the same bits; measured with PAGODA_CUDA_QUANT_FUSED_Q8, above).";
    "PAGODA_CUDA_MOE_MMA", None, ON_OFF, "on", Cuda,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "MoE steps of 32+ bf16 rows run the expert matmuls on tensor cores (mma.sync, up to 32 routed entries of an expert a CTA); off: the CUDA-core tiles (the reference; always in deterministic mode). Same sums in another f32 order, the same bits run to run. On: Qwen3-30B-A3B's block 1.14x faster at 32 rows to 4.92x at 1024, pp512 4.82x end to end (H100, docs/benchmark_results/moe-mma-fp8-stream-h100-2026-12-06.md).";
    "PAGODA_CUDA_MOE_QUANT", None, ON_OFF, "off", Cuda,
        "engine load_backend, EngineSettings (models llama_cuda::CudaModel::load_keeping, CudaKernels)",
        "A GGUF mixture-of-experts model's stacked experts (ffn_{gate,up,down}_exps in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K, each projection in its own format) stay in their blocks on the GPU (device memory their file bytes) and run as grouped quantized GEMVs over q8 activations per routing tile (bf16 with PAGODA_CUDA_QUANT_WEIGHTS on; no atomics, so deterministic mode runs it too); off: dequantized to the --dtype at load (the reference). Other formats fall back to the dequantized experts with an INFO line. Off until it has run and been measured on a GPU (compiled for sm_90a and sm_80, not yet run there).";
    "PAGODA_CUDA_MOE_QUANT_DENSE_ROWS", None, Values::Number { min: 0, max: 65536, words: &[] }, "256", Tuning,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "With PAGODA_CUDA_MOE_QUANT on: steps of at least this many rows (prefill) decode each layer's experts from their blocks into bf16 stacks (two of [experts, expert width, hidden] in device memory) and run the dense expert kernels (tensor cores) instead of the quantized GEMVs; 0: never. Never in deterministic mode. 256: Qwen3-30B-A3B's block took 1410 us quantized at 256 rows against 561 us from bf16 on the H100 (docs/benchmark_results/moe-quant-fp8kv-h100-2026-12-06.md).";
    "PAGODA_GPU_SAMPLING_FILTERED", None, Values::Choice(&["fast", "exact"]), "fast", Cuda,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "Filtered rows on the GPU: fast, or exact (f64, the oracle).";
    "PAGODA_GPU_SAMPLING_GUMBEL_MAX", None, ON_OFF, "on", Cuda,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "Row maxima inside the Gumbel kernel.";
    "PAGODA_GPU_SAMPLING_LIST_ROUNDS", None, ON_OFF, "on", Cuda,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "Top-k rows' filter rounds on their id list.";
    "PAGODA_GPU_SAMPLING_CLUSTER", None, ON_OFF, "on", Cuda,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "Top-p-only rows in one cluster kernel per row (compute capability 9.0+).";
    "PAGODA_GPU_SAMPLING_PREFETCH", None, ON_OFF, "on", Cuda,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "L2 prefetch of waiting rows in cluster launches.";

    "PAGODA_SPLIT_KV_CHUNK_TOKENS", None, Values::Number { min: 1, max: 1 << 20, words: AUTO }, "auto", Tuning,
        "engine EngineSettings (models llama::Model)",
        "Tokens per CPU split-KV chunk (auto: 256; outputs depend on it).";
    "PAGODA_PAGED_DECODE_TARGET_CTAS", None, Values::Number { min: 1, max: 1 << 20, words: AUTO }, "auto", Tuning,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "CTAs the fused decode plan aims for (auto: the tuning table's, else twice the SM count).";
    "PAGODA_PAGED_DECODE_CHUNK", None, Values::Number { min: 1, max: 1 << 20, words: AUTO }, "auto", Tuning,
        "engine EngineSettings (models llama_cuda::CudaKernels)",
        "Pages per fused decode chunk (auto: the plan searches).";
    "PAGODA_PAGED_DECODE_STAGES", None, Values::Choice(&["auto", "2", "3"]), "auto", Tuning,
        "cuda ops::paged_decode",
        "Pipeline stages of the tensor-core decode kernel (auto: 3 for head_dim 64 or less, else 2).";
    "PAGODA_PROFILE", None, ON_OFF, "off", Tuning,
        "ops profile",
        "Time each op of the forward pass; `pagoda bench` prints the table.";

    "PAGODA_KERNEL_CACHE", None, TEXT, "(~/.cache/pagoda/kernels)", Paths,
        "cuda key::kernel_cache_dir",
        "Folder of compiled CUDA kernels (off: no cache on disk).";
    "PAGODA_TUNING_TABLE", None, TEXT, "(~/.cache/pagoda/tuning-<gpu>.json)", Paths,
        "cuda key::tuning_table_path",
        "The autotuner's table (`pagoda tune` writes it, CUDA decode reads it; off: none).";
    "PAGODA_CUDA_INCLUDE", None, TEXT, "(searched)", Paths,
        "cuda key::cuda_include_dirs",
        "Folder with cuda_bf16.h for NVRTC, searched first.";
    "PAGODA_CUDA_WHEEL", None, TEXT, "(searched)", Paths,
        "cuda key::cuda_include_dirs",
        "A CUDA pip wheel's root; its include/ folder is searched for NVRTC headers.";

    "PAGODA_TEST_CPU_CONFIGURATION", None, TEXT, "(unset)", Testing,
        "testkit", "Set by pagoda-testkit in the child test run of one CPU kernel configuration.";
    "PAGODA_TEST_SLOW_CPU_CONFIGURATIONS", None, TEXT, "(unset)", Testing,
        "testkit", "1: re-run the invariance tests under every CPU configuration (the forced kernel sets and scalar too, not only auto's), every test of each binary.";
    "PAGODA_PARITY_MODEL", None, TEXT, "(the default model)", Testing,
        "models parity test, scripts/llamacpp-top5.py", "Model of the llama.cpp parity test.";
    "PAGODA_PARITY_REFERENCE", None, TEXT, "(the committed reference)", Testing,
        "models parity test, scripts/llamacpp-top5.py", "llama.cpp top-5 reference of the parity test.";
    "PAGODA_HF_PARITY_DIR", None, TEXT, "(unset: skip)", Testing,
        "engine hf_cuda_parity test", "Folder of random Hugging Face checkpoints and transformers outputs.";
    "PAGODA_HF_PARITY_CPU_ONLY", None, TEXT, "(unset)", Testing,
        "engine hf_cuda_parity test", "1: compare only the CPU model with transformers.";
    "PAGODA_SAMPLING_DRAWS", None, TEXT, "1000000", Testing,
        "cuda sampling tests", "Draws per goodness-of-fit test.";
    "PAGODA_DECODE_MATRIX", None, TEXT, "(full)", Testing,
        "cuda paged decode test", "quick: a subset of the decode matrix.";
    "PAGODA_NVRTC_CHECK", None, TEXT, "(unset: skip)", Testing,
        "cuda nvrtc_check test, scripts/nvrtc-check.sh", "1: compile every kernel with NVRTC.";
    "PAGODA_NVRTC_ONLY", None, TEXT, "(all)", Testing,
        "cuda nvrtc_check test", "Compile only the entries whose name holds this text.";
    "PAGODA_NVRTC_ALL_ARCHS", None, TEXT, "(unset)", Testing,
        "cuda nvrtc_check test", "1: compile every specialisation for compute_80 too (unset: those of the sources with arch conditionals and the first of each other entry; compute_90a compiles all either way).";
    "PAGODA_NVRTC_DUMP", None, TEXT, "(unset)", Testing,
        "cuda nvrtc_check test", "Folder for each kernel's PTX.";
    "PAGODA_NVRTC_VENV", None, TEXT, "(target/nvrtc-venv)", Testing,
        "scripts/nvrtc-check.sh", "Python environment holding the NVRTC wheel.";
    "PAGODA_BIN", None, TEXT, "(target/debug/pagoda)", Testing,
        "scripts/test-server.sh", "The binary the live-server suite starts.";
    "PAGODA_TEST_VENV", None, TEXT, "(target/server-test-venv)", Testing,
        "scripts/test-server.sh", "Python environment of the live-server suite.";
    "PAGODA_WHEELS", None, TEXT, "(PyPI)", Testing,
        "scripts/test-server.sh", "Install the Python clients offline from this folder of wheels.";
    "PAGODA_SERVE_ARGS", None, TEXT, "(none)", Testing,
        "scripts/test-server.sh", "Extra `pagoda serve` flags of the live-server suite.";
    "PAGODA_SERVER_LOG", None, TEXT, "(not kept)", Testing,
        "scripts/test-server.sh", "Keep the live server's log at this path.";
    "PAGODA_URL", None, TEXT, "(set by the script)", Testing,
        "tests/server", "The live server under test.";
    "PAGODA_API_KEY_FILE", None, TEXT, "(set by the script)", Testing,
        "tests/server", "The live server's key file.";
    "PAGODA_SERVER_LOG_FILE", None, TEXT, "(set by the script)", Testing,
        "tests/server", "The live server's log, read by the tests.";
    "PAGODA_TLS_URL", None, TEXT, "(set by the script)", Testing,
        "tests/server", "The live HTTPS server under test.";
    "PAGODA_TLS_CA", None, TEXT, "(set by the script)", Testing,
        "tests/server", "The HTTPS server's self-signed certificate.";
    "PAGODA_FUZZ_SEEDS", None, TEXT, "(unset)", Testing,
        "tests/server, scripts/fuzz.sh", "Save every request body the live-server suite sends here.";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_defaults_are_values() {
        for (i, s) in SETTINGS.iter().enumerate() {
            assert!(s.name.starts_with("PAGODA_"), "{}", s.name);
            assert!(
                SETTINGS[..i].iter().all(|other| other.name != s.name),
                "{} is declared twice",
                s.name
            );
            assert!(!s.doc.is_empty() && s.doc.ends_with('.'), "{}", s.name);
            if !s.default.starts_with('(') {
                assert!(
                    crate::resolve::canonical(s, s.default).is_ok(),
                    "{}'s default {} is not one of its values",
                    s.name,
                    s.default
                );
            }
        }
    }
}
