//! Where a model runs: the CPU (the reference, with its KV cache in host memory) or an NVIDIA
//! GPU (weights, KV cache and step buffers in device memory).

use crate::counters::EngineCounters;
use crate::cuda_runner::{CudaCacheOptions, CudaModel, CudaRunner, SampledRow, SamplingRowParams};
use pagoda_cuda::CudaError;
use pagoda_models::config::ModelConfig;
use pagoda_models::llama::{AttentionPolicy, ForwardBatch, KvCache, Model};
use pagoda_ops::attention::{AttentionPath, CascadeRule, KvCacheTypes, DEFAULT_CHUNK_TOKENS};
use pagoda_ops::sampling::AnySampler;

use crate::cpu_pool::{CpuPoolCounters, CpuPools, CpuThreadsMode, StepShape};

/// A loaded model on its device.
// One value per engine, moved once: the size difference between variants does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Backend {
    /// The CPU forward pass.
    Cpu(Model),
    /// The CUDA forward pass (boxed: it holds its buffers and is much larger than the CPU model).
    Cuda(Box<CudaModel>),
}

impl From<Model> for Backend {
    fn from(model: Model) -> Self {
        Backend::Cpu(model)
    }
}

impl From<CudaModel> for Backend {
    fn from(model: CudaModel) -> Self {
        Backend::Cuda(Box::new(model))
    }
}

impl Backend {
    /// The CPU model, when the backend is the CPU (tests use it as the oracle).
    pub fn as_cpu(&self) -> Option<&Model> {
        match self {
            Backend::Cpu(model) => Some(model),
            Backend::Cuda(_) => None,
        }
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        match self {
            Backend::Cpu(model) => model.config(),
            Backend::Cuda(model) => model.config(),
        }
    }

    /// Bytes held by the weights (host memory on the CPU, device memory on the GPU).
    pub fn weight_bytes(&self) -> usize {
        match self {
            Backend::Cpu(model) => model.weight_bytes(),
            Backend::Cuda(model) => model.weight_bytes(),
        }
    }

    /// Bytes of the FP8 (e4m3) codes the GPU keeps and multiplies in place
    /// (`PAGODA_CUDA_FP8_WEIGHTS`); 0 on the CPU, which dequantizes them at load.
    pub fn fp8_weight_bytes(&self) -> usize {
        match self {
            Backend::Cpu(_) => 0,
            Backend::Cuda(model) => model.fp8_bytes(),
        }
    }

    /// Weight bytes a decode step of `rows` rows reads (a mixture-of-experts model's idle
    /// experts left out, under uniform routing: [`Model::step_weight_bytes`],
    /// `CudaModel::step_weight_bytes`).
    pub fn step_weight_bytes(&self, rows: usize) -> f64 {
        match self {
            Backend::Cpu(model) => model.step_weight_bytes(rows),
            Backend::Cuda(model) => model.step_weight_bytes(rows),
        }
    }

    /// Memory free now where the KV cache would live, in bytes: the host's available memory
    /// (`MemAvailable` of /proc/meminfo) for the CPU, the device's for CUDA; `None` when it
    /// cannot be read.
    pub fn free_memory_bytes(&self) -> Option<u64> {
        match self {
            Backend::Cpu(_) => host_available_bytes(),
            Backend::Cuda(model) => model.gpu().free_memory_bytes().ok(),
        }
    }

    /// `cpu`, or `cuda (bf16)` / `cuda (f32)`.
    pub fn device_name(&self) -> String {
        match self {
            Backend::Cpu(_) => "cpu".to_string(),
            Backend::Cuda(model) => format!("cuda ({})", model.dtype()),
        }
    }

    /// The KV cache's element types as this backend stores them, for logs and reports: the
    /// CPU's pools of `types` (`K f32, V q8_0`), the GPU's in the model's dtype (`K bf16,
    /// V bf16`) or `K fp8, V fp8`; `latent ...` for a one-pool-per-layer cache (MLA).
    pub fn kv_cache_name(&self, types: KvCacheTypes) -> String {
        let latent = self.config().mla.is_some();
        match self {
            Backend::Cuda(model) if !types.is_fp8() && latent => {
                format!("latent {}", model.dtype())
            }
            Backend::Cuda(model) if !types.is_fp8() => {
                format!("K {0}, V {0}", model.dtype())
            }
            _ if latent => format!("latent {}", types.k),
            _ => types.to_string(),
        }
    }

    /// Bytes of one KV page over all layers (K and V), with the CPU pools of `types` (the GPU
    /// cache is in the model's dtype, or e4m3 bytes plus one f32 scale per token and KV head
    /// with fp8; [`Backend::check_kv_types`] refuses other types there).
    pub fn kv_page_bytes(&self, page_size: usize, types: KvCacheTypes) -> usize {
        let c = self.config();
        let row = page_size * c.num_kv_heads * c.head_dim;
        match self {
            // A latent cache (DeepSeek) holds one pool per layer, of the K type.
            Backend::Cpu(_) if c.mla.is_some() => c.num_layers * types.k.bytes(row),
            Backend::Cpu(_) => c.num_layers * types.row_bytes(row),
            // A latent cache on the GPU: one pool per layer as well, in the model's dtype.
            Backend::Cuda(model) if c.mla.is_some() => {
                c.num_layers * row * model.dtype().size_bytes()
            }
            Backend::Cuda(_) if types.is_fp8() => {
                let heads = page_size * c.num_kv_heads;
                2 * c.num_layers * pagoda_ops::attention::KvType::Fp8.head_bytes(heads, c.head_dim)
            }
            Backend::Cuda(model) => 2 * c.num_layers * row * model.dtype().size_bytes(),
        }
    }

    /// Whether this backend can hold a KV cache of `types`: on the CPU, any host type whose
    /// blocks divide the model's `head_dim` (not fp8); on the GPU the default (the model's
    /// dtype) or fp8 for both K and V on a bf16 grouped-query model. The error is one line
    /// naming the flags.
    pub fn check_kv_types(&self, types: KvCacheTypes) -> Result<(), String> {
        match self {
            Backend::Cpu(_) => types
                .check_head_dim(self.config().head_dim)
                .map_err(|e| format!("-ctk/-ctv ({types}): {e}")),
            Backend::Cuda(model) if types.is_fp8() => {
                let fp8 = pagoda_ops::attention::KvType::Fp8;
                let reason = if types.k != fp8 || types.v != fp8 {
                    Some("fp8 for one of K and V only (give both -ctk fp8 -ctv fp8)".to_string())
                } else if model.dtype() != pagoda_models::llama_cuda::DType::BF16 {
                    Some(format!("--dtype {} (fp8 needs bf16)", model.dtype()))
                } else if self.config().mla.is_some() {
                    Some("a latent (MLA) cache".to_string())
                } else {
                    None
                };
                match reason {
                    Some(reason) => Err(format!(
                        "-ctk/-ctv ({types}): the CUDA fp8 KV cache does not support {reason}"
                    )),
                    None => Ok(()),
                }
            }
            Backend::Cuda(model) if !types.is_f32() => Err(format!(
                "-ctk/-ctv ({types}): the CUDA KV cache is stored in the model's dtype ({}); \
                 f16 and q8_0 KV caches run on the CPU only: drop -ctk/-ctv, use fp8 (both) or \
                 --device cpu",
                model.dtype()
            )),
            Backend::Cuda(_) => Ok(()),
        }
    }
}

/// A backend with its KV cache allocated, ready to run steps.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Runner {
    Cpu {
        model: Model,
        kv: KvCache,
        pools: CpuPools,
    },
    Cuda {
        model: Box<CudaRunner>,
    },
}

/// What one forward returned.
pub(crate) struct StepOutput {
    /// `[num_logits, vocab]` f32 logits; empty when `sampled` is set.
    pub logits: Vec<f32>,
    /// With device sampling ([`Runner::forward`] given rows): one entry per logits row, the
    /// device-drawn token or the row's downloaded logits.
    pub sampled: Option<Vec<SampledRow>>,
    /// The CPU attention path; `None` on the GPU (its decode attention is the baseline
    /// paged kernel until the fused decode lands).
    pub attention_path: Option<AttentionPath>,
    /// Requests of the step with at least one split-KV row / served by gather only (CPU).
    pub split_kv_requests: usize,
    pub gather_requests: usize,
}

impl Runner {
    /// Allocates the KV cache (`cache.num_pages` pages of `cache.page_size` tokens) and, on
    /// the GPU, the step buffers for the rest of `cache`'s sizes and paths. On the
    /// CPU, the pool of each step follows `cpu_threads` and split-KV rows are cut into
    /// chunks of `split_kv_chunk_tokens` visible tokens.
    pub(crate) fn new(
        backend: Backend,
        cache: CudaCacheOptions,
        kv_types: KvCacheTypes,
        cpu_threads: CpuThreadsMode,
        split_kv_chunk_tokens: usize,
        cascade: Option<CascadeRule>,
    ) -> Result<Runner, CudaError> {
        match backend {
            Backend::Cpu(mut model) => {
                let tokens = split_kv_chunk_tokens;
                if tokens != DEFAULT_CHUNK_TOKENS {
                    static LOGGED: std::sync::Once = std::sync::Once::new();
                    LOGGED.call_once(|| {
                        tracing::info!(
                            "split-KV chunks of {tokens} tokens (PAGODA_SPLIT_KV_CHUNK_TOKENS)"
                        )
                    });
                }
                model.set_split_kv_chunk_tokens(tokens);
                static LOGGED_CASCADE: std::sync::Once = std::sync::Once::new();
                LOGGED_CASCADE.call_once(|| match cascade {
                    Some(rule) => tracing::info!(
                        "CPU cascade attention: on (decode rows of {}+ requests sharing {}+ \
                         prompt tokens, saving {}+ token reads, read each shared chunk once; \
                         same bits as off)",
                        rule.min_members.max(2),
                        rule.min_shared_tokens,
                        rule.min_saved_tokens
                    ),
                    None => tracing::info!("CPU cascade attention: off"),
                });
                model.set_cascade(cascade);
                let pools = CpuPools::new(cpu_threads);
                let kv = model
                    .new_kv_cache(cache.num_pages, cache.page_size, kv_types.k, kv_types.v)
                    .expect("the engine checked the KV types (Backend::check_kv_types)");
                Ok(Runner::Cpu { model, kv, pools })
            }
            Backend::Cuda(model) => Ok(Runner::Cuda {
                model: Box::new(CudaRunner::new(*model, cache)?),
            }),
        }
    }

    /// Keeps the key summaries of sparse decode (the CPU KV cache's, or those the CUDA step
    /// buffers hold when started with sparse decode); their bytes, or why this runner cannot
    /// run sparse decode.
    pub(crate) fn enable_key_summaries(&mut self) -> Result<usize, String> {
        match self {
            Runner::Cpu { kv, .. } => {
                let before = kv.size_bytes();
                kv.enable_key_summaries();
                Ok(kv.size_bytes() - before)
            }
            Runner::Cuda { model } => model.sparse_summaries(),
        }
    }

    /// Logs the KV cache's types and size once per process (INFO).
    pub(crate) fn log_kv_cache_once(&self, types: KvCacheTypes, pages: usize, page_size: usize) {
        static LOGGED: std::sync::Once = std::sync::Once::new();
        LOGGED.call_once(|| {
            let mib = self.kv_bytes() as f64 / (1u64 << 20) as f64;
            let types = match self.config().mla {
                Some(_) => format!("latent {}", types.k),
                None => types.to_string(),
            };
            tracing::info!("KV cache: {types} ({mib:.1} MiB, {pages} pages of {page_size} tokens)")
        });
    }

    pub(crate) fn config(&self) -> &ModelConfig {
        match self {
            Runner::Cpu { model, .. } => model.config(),
            Runner::Cuda { model } => model.config(),
        }
    }

    pub(crate) fn kv_bytes(&self) -> usize {
        match self {
            Runner::Cpu { kv, .. } => kv.size_bytes(),
            Runner::Cuda { model } => model.kv_bytes(),
        }
    }

    /// The CPU pools' counters (None on the GPU).
    pub(crate) fn cpu_pool_counters(&self) -> Option<CpuPoolCounters> {
        match self {
            Runner::Cpu { pools, .. } => Some(pools.counters()),
            Runner::Cuda { .. } => None,
        }
    }

    /// How CPU steps pick their pool (None on the GPU).
    pub(crate) fn cpu_threads_mode(&self) -> Option<CpuThreadsMode> {
        match self {
            Runner::Cpu { pools, .. } => Some(pools.mode()),
            Runner::Cuda { .. } => None,
        }
    }

    /// Sets how CPU steps pick their pool (ignored on the GPU).
    pub(crate) fn set_cpu_threads_mode(&mut self, mode: CpuThreadsMode) {
        if let Runner::Cpu { pools, .. } = self {
            pools.set_mode(mode);
        }
    }

    /// The CUDA model's step counters (None on the CPU).
    pub(crate) fn cuda_counters(&self) -> Option<&EngineCounters> {
        match self {
            Runner::Cpu { .. } => None,
            Runner::Cuda { model } => Some(model.counters()),
        }
    }

    pub(crate) fn is_cuda(&self) -> bool {
        matches!(self, Runner::Cuda { .. })
    }

    /// Runs `batch`. With `device_rows` (CUDA only: one entry per `logits_for` row, see
    /// [`CudaRunner::forward_sampled`]) the rows are sampled on the GPU and
    /// [`StepOutput::sampled`] is set, `masks` giving the token masks of constrained rows
    /// once the forward is enqueued; otherwise the logits come back whole.
    pub(crate) fn forward(
        &mut self,
        batch: &ForwardBatch<'_>,
        policy: AttentionPolicy,
        device_rows: Option<&[Option<SamplingRowParams>]>,
        masks: Option<crate::cuda_runner::MaskSource<'_>>,
    ) -> Result<StepOutput, String> {
        match self {
            Runner::Cpu { model, kv, pools } => {
                if device_rows.is_some() {
                    return Err("device sampling requested on the CPU backend".to_string());
                }
                let shape = cpu_step_shape(batch);
                let model = &*model;
                let output = pools
                    .run(shape, || model.forward(batch, kv, policy))
                    .map_err(|e| e.to_string())?;
                Ok(StepOutput {
                    logits: output.logits,
                    sampled: None,
                    attention_path: Some(output.attention_path),
                    split_kv_requests: output.split_kv_requests,
                    gather_requests: output.gather_requests,
                })
            }
            Runner::Cuda { model } => {
                let (logits, sampled) = match device_rows {
                    Some(rows) => (
                        Vec::new(),
                        Some(
                            model
                                .forward_sampled_masked(batch, rows, masks)
                                .map_err(|e| e.to_string())?,
                        ),
                    ),
                    None => (model.forward(batch).map_err(|e| e.to_string())?, None),
                };
                Ok(StepOutput {
                    logits,
                    sampled,
                    attention_path: None,
                    split_kv_requests: 0,
                    gather_requests: 0,
                })
            }
        }
    }
}

impl Runner {
    /// The final-normed hidden states of `batch.logits_for`'s rows, `[rows, hidden_size]`
    /// (what embeddings pool), on the backend's device.
    pub(crate) fn final_hidden(
        &mut self,
        batch: &ForwardBatch<'_>,
        policy: AttentionPolicy,
    ) -> Result<Vec<f32>, String> {
        match self {
            Runner::Cpu { model, kv, pools } => {
                let shape = cpu_step_shape(batch);
                let model = &*model;
                pools
                    .run(shape, || model.final_hidden(batch, kv, policy))
                    .map_err(|e| e.to_string())
            }
            Runner::Cuda { model } => model.final_hidden(batch).map_err(|e| e.to_string()),
        }
    }
}

/// The CPU pool's view of `batch` (which pool runs it).
fn cpu_step_shape(batch: &ForwardBatch<'_>) -> StepShape {
    StepShape {
        num_tokens: batch.tokens.len(),
        num_requests: batch.qo_indptr.len().saturating_sub(1),
    }
}

/// The GPU sampler's record for a request's next token, or `None` when the request must be
/// sampled on the host: a reference sampler, active penalties (they read the history on the
/// host), log-probabilities wanted (they need the logits row), or parameters outside the GPU
/// sampler's ranges. The record's step is the fused sampler's step (device draws are recorded
/// on it with `record_external_draw`), i.e. exactly the step `FusedSampler::sample` would use
/// for this token, so both paths draw the same stream.
pub(crate) fn device_row_params(
    sampler: &AnySampler,
    want_logprobs: bool,
) -> Option<SamplingRowParams> {
    let AnySampler::Fused(fused) = sampler else {
        return None;
    };
    let params = fused.params();
    if want_logprobs || params.has_penalties() {
        return None;
    }
    // top_k beyond u32 keeps the whole vocabulary, as 0 (off) does.
    let top_k = u32::try_from(params.top_k).unwrap_or(0);
    SamplingRowParams::new(
        params.temperature,
        top_k,
        params.top_p,
        params.min_p,
        fused.seed(),
        fused.step(),
    )
    .ok()
}

/// `MemAvailable` of /proc/meminfo in bytes (`None` off Linux or when unreadable).
pub fn host_available_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemAvailable:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse::<u64>().ok())
        .map(|kib| kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagoda_ops::sampling::{FusedSampler, SamplerKind, SamplingParams};

    fn sampler(params: SamplingParams, kind: SamplerKind) -> AnySampler {
        AnySampler::new(params, kind).unwrap()
    }

    #[test]
    fn device_rows_carry_the_fused_step_and_seed() {
        let params = SamplingParams {
            temperature: 0.7,
            top_k: 50,
            top_p: 0.9,
            min_p: 0.05,
            seed: Some(0x1234_5678_9abc_def0),
            ..SamplingParams::greedy()
        };
        let mut fused = sampler(params, SamplerKind::Fused);
        let record = device_row_params(&fused, false).unwrap();
        assert_eq!(
            record,
            SamplingRowParams::new(0.7, 50, 0.9, 0.05, 0x1234_5678_9abc_def0, 0).unwrap()
        );
        // Two host draws, then three device draws: the next step is 5.
        fused.sample(&[0.0, 1.0, 2.0], &[]);
        fused.sample(&[0.0, 1.0, 2.0], &[]);
        if let AnySampler::Fused(inner) = &mut fused {
            for _ in 0..3 {
                inner.record_external_draw();
            }
        }
        assert_eq!(device_row_params(&fused, false).unwrap().step(), 5);
        let huge_k = SamplingParams {
            top_k: usize::MAX,
            ..params
        };
        let record = device_row_params(&sampler(huge_k, SamplerKind::Fused), false).unwrap();
        assert_eq!(record.top_k, 0);
    }

    /// Device draws are recorded by advancing the fused sampler's step: its stream depends on
    /// the step only, so after the same number of steps (drawn on any rows, or recorded), the
    /// next token of a row is the same.
    #[test]
    fn fused_stream_depends_on_the_call_count_only() {
        let row: Vec<f32> = (0..500).map(|i| ((i * 37) % 101) as f32 / 20.0).collect();
        for params in [
            SamplingParams::unfiltered(1.0),
            SamplingParams {
                top_p: 0.9,
                top_k: 50,
                ..SamplingParams::unfiltered(0.8)
            },
        ] {
            let params = SamplingParams {
                seed: Some(42),
                ..params
            };
            for draws in [1, 3, 8] {
                let mut real = FusedSampler::new(params).unwrap();
                let mut replayed = FusedSampler::new(params).unwrap();
                for _ in 0..draws {
                    real.sample(&row, &[]);
                    replayed.record_external_draw();
                }
                assert_eq!(replayed.step(), draws);
                let tokens: Vec<(u32, u32)> = (0..20)
                    .map(|_| (real.sample(&row, &[]), replayed.sample(&row, &[])))
                    .collect();
                assert!(tokens.iter().all(|(a, b)| a == b), "{params:?}: {tokens:?}");
            }
        }
    }

    #[test]
    fn host_only_requests_stay_on_the_host() {
        let plain = SamplingParams {
            seed: Some(1),
            ..SamplingParams::unfiltered(1.0)
        };
        assert!(device_row_params(&sampler(plain, SamplerKind::Fused), false).is_some());
        assert!(device_row_params(&sampler(plain, SamplerKind::Fused), true).is_none());
        assert!(device_row_params(&sampler(plain, SamplerKind::Reference), false).is_none());
        for penalised in [
            SamplingParams {
                repetition_penalty: 1.1,
                ..plain
            },
            SamplingParams {
                frequency_penalty: 0.5,
                ..plain
            },
            SamplingParams {
                presence_penalty: -0.5,
                ..plain
            },
        ] {
            let fused = sampler(penalised, SamplerKind::Fused);
            assert!(device_row_params(&fused, false).is_none(), "{penalised:?}");
        }
        // A zero penalty window disables the penalties: the device may sample.
        let windowless = SamplingParams {
            repetition_penalty: 1.1,
            penalty_last_n: 0,
            ..plain
        };
        assert!(device_row_params(&sampler(windowless, SamplerKind::Fused), false).is_some());
    }
}
