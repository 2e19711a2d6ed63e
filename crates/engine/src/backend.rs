//! Where a model runs: the CPU (the reference, with its KV cache in host memory) or an NVIDIA
//! GPU (weights, KV cache and step buffers in device memory).

use pagoda_models::config::ModelConfig;
use pagoda_models::llama::{AttentionPolicy, ForwardBatch, KvCache, Model};
use pagoda_models::llama_cuda::{CudaCacheOptions, CudaModel, CudaStepCounters, PagedDecodeMode};
use pagoda_ops::attention::AttentionPath;

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

    /// `cpu`, or `cuda (bf16)` / `cuda (f32)`.
    pub fn device_name(&self) -> String {
        match self {
            Backend::Cpu(_) => "cpu".to_string(),
            Backend::Cuda(model) => format!("cuda ({})", model.dtype()),
        }
    }

    /// Bytes of one KV page over all layers (K and V).
    pub fn kv_page_bytes(&self, page_size: usize) -> usize {
        let c = self.config();
        let element = match self {
            Backend::Cpu(_) => 4,
            Backend::Cuda(model) => model.dtype().element_bytes(),
        };
        2 * c.num_layers * page_size * c.num_kv_heads * c.head_dim * element
    }
}

/// A backend with its KV cache allocated, ready to run steps.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Runner {
    Cpu { model: Model, kv: KvCache },
    Cuda { model: Box<CudaModel> },
}

/// What one forward returned.
pub(crate) struct StepOutput {
    pub logits: Vec<f32>,
    /// The CPU attention path; `None` on the GPU (its decode attention is the baseline
    /// paged kernel until the fused decode lands).
    pub attention_path: Option<AttentionPath>,
    /// Requests of the step with at least one split-KV row / served by gather only (CPU).
    pub split_kv_requests: usize,
    pub gather_requests: usize,
}

impl Runner {
    /// Allocates the KV cache (`num_pages` pages of `page_size` tokens) and, on the GPU, the
    /// step buffers for up to `max_batch_tokens` tokens of `max_requests` requests.
    pub(crate) fn new(
        backend: Backend,
        num_pages: usize,
        page_size: usize,
        max_batch_tokens: usize,
        max_requests: usize,
        max_context: usize,
        cuda_graphs: bool,
        paged_decode: PagedDecodeMode,
    ) -> Result<Runner, String> {
        match backend {
            Backend::Cpu(model) => {
                let kv = KvCache::new(
                    model.config().num_layers,
                    model.kv_layout(num_pages, page_size),
                );
                Ok(Runner::Cpu { model, kv })
            }
            Backend::Cuda(mut model) => {
                model.prepare(CudaCacheOptions {
                    num_pages,
                    page_size,
                    max_batch_tokens,
                    max_batch_requests: max_requests,
                    max_context,
                    cuda_graphs,
                    paged_decode,
                })?;
                Ok(Runner::Cuda { model })
            }
        }
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

    /// The CUDA model's step counters (None on the CPU).
    pub(crate) fn cuda_counters(&self) -> Option<CudaStepCounters> {
        match self {
            Runner::Cpu { .. } => None,
            Runner::Cuda { model } => Some(model.counters()),
        }
    }

    pub(crate) fn is_cuda(&self) -> bool {
        matches!(self, Runner::Cuda { .. })
    }

    pub(crate) fn forward(
        &mut self,
        batch: &ForwardBatch<'_>,
        policy: AttentionPolicy,
    ) -> Result<StepOutput, String> {
        match self {
            Runner::Cpu { model, kv } => {
                // Run the whole forward on a pool worker: the ops' parallel loops then start
                // from inside the pool instead of handing every one of them across threads.
                let output = rayon::scope(|_| model.forward(batch, kv, policy))
                    .map_err(|e| e.to_string())?;
                Ok(StepOutput {
                    logits: output.logits,
                    attention_path: Some(output.attention_path),
                    split_kv_requests: output.split_kv_requests,
                    gather_requests: output.gather_requests,
                })
            }
            Runner::Cuda { model } => Ok(StepOutput {
                logits: model.forward(batch)?,
                attention_path: None,
                split_kv_requests: 0,
                gather_requests: 0,
            }),
        }
    }
}
