//! Resolving a model argument (a GGUF file or a Hugging Face directory) into a runnable model,
//! its tokenizer, chat template and generation defaults.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use pagoda_cuda::{CudaError, Gpu};

use pagoda_models::chat_template::{ChatTemplate, ChatTemplateError};
use pagoda_models::config::ModelConfig;
use pagoda_models::formats::gguf::{GgufError, GgufFile};
use pagoda_models::gguf_model::config_from_gguf;
use pagoda_models::hf::{GenerationDefaults, HfError, HfModelDir};
use pagoda_models::llama::{LoadError, Model, WeightPrecision};
use pagoda_models::llama_cuda::{CudaModel, DType};
use pagoda_models::random::{random_config, random_format, RandomFormat, RandomWeights};
use pagoda_models::tokenizer::{Tokenizer, TokenizerError};

use crate::backend::Backend;

/// Why a model could not be loaded; the message names the file and what to do.
#[derive(Debug, thiserror::Error)]
pub enum ModelLoadError {
    #[error("model path {0} does not exist (pass a .gguf file or a Hugging Face model directory)")]
    NoSuchPath(PathBuf),
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Hf(#[from] HfError),
    #[error("{}: tokenizer.json is missing", .0.display())]
    NoTokenizer(PathBuf),
    #[error("{}: {source}", path.display())]
    Tokenizer {
        path: PathBuf,
        source: TokenizerError,
    },
    #[error("{}: the tokenizer has {tokenizer} tokens but the model only {model} embeddings", path.display())]
    VocabularyMismatch {
        path: PathBuf,
        tokenizer: usize,
        model: usize,
    },
    #[error("the model's chat template: {0}")]
    ChatTemplate(ChatTemplateError),
    /// The weights or the configuration (a missing tensor, a bad shape, an unsupported
    /// architecture or type).
    #[error("{}: {source}", path.display())]
    Weights { path: PathBuf, source: LoadError },
    #[error("CUDA: {0}")]
    Cuda(#[from] CudaError),
    /// Building the model from tensors of no file (see [`load_backend`]).
    #[error(transparent)]
    Build(LoadError),
    #[error("random weights for {spec}: {source}")]
    Random { spec: String, source: LoadError },
}

/// Where a model comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A `.gguf` file.
    Gguf(PathBuf),
    /// A Hugging Face directory (config.json, *.safetensors, tokenizer.json).
    HfDir(PathBuf),
}

impl ModelSource {
    /// Classifies a path: a directory is an HF model, a file is GGUF. Errors say what to pass.
    pub fn from_path(path: &Path) -> Result<ModelSource, ModelLoadError> {
        if path.is_dir() {
            Ok(ModelSource::HfDir(path.to_path_buf()))
        } else if path.is_file() {
            Ok(ModelSource::Gguf(path.to_path_buf()))
        } else {
            Err(ModelLoadError::NoSuchPath(path.to_path_buf()))
        }
    }

    /// The path.
    pub fn path(&self) -> &Path {
        match self {
            ModelSource::Gguf(p) | ModelSource::HfDir(p) => p,
        }
    }
}

/// Where to load a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// The CPU (weights as `precision` says).
    #[default]
    Cpu,
    /// CUDA device 0, weights and activations in `dtype`.
    Cuda { dtype: DType },
}

/// How to load.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    /// CPU weight precision (ignored on the GPU, whose dtype is in `device`).
    pub precision: WeightPrecision,
    /// Where the model runs.
    pub device: Device,
}

impl LoadOptions {
    /// CPU loading with `precision`.
    pub fn cpu(precision: WeightPrecision) -> Self {
        LoadOptions {
            precision,
            device: Device::Cpu,
        }
    }
}

/// Everything needed to run a model.
pub struct LoadedModel {
    /// The model on its device.
    pub model: Backend,
    pub tokenizer: Tokenizer,
    pub chat_template: ChatTemplate,
    /// Whether `chat_template` came from the model (false: the ChatML fallback).
    pub chat_template_from_model: bool,
    pub generation: GenerationDefaults,
    pub source: ModelSource,
}

/// The error of a tokenizer read from `path`.
fn tokenizer_error(path: &Path) -> impl FnOnce(TokenizerError) -> ModelLoadError {
    let path = path.to_path_buf();
    move |source| ModelLoadError::Tokenizer { path, source }
}

/// Loads a model. `progress(done, total)` is called as layers load.
pub fn load_model(
    source: &ModelSource,
    options: LoadOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<LoadedModel, ModelLoadError> {
    let (model, tokenizer, generation) = match source {
        ModelSource::Gguf(path) => {
            let file = GgufFile::open(path)?;
            let config = config_from_gguf(&file).map_err(|source| ModelLoadError::Weights {
                path: path.clone(),
                source,
            })?;
            let tokenizer = Tokenizer::from_gguf(&file).map_err(tokenizer_error(path))?;
            let model = load_weights(config, &file, options, progress, path)?;
            (model, tokenizer, GenerationDefaults::default())
        }
        ModelSource::HfDir(dir) => {
            let hf = HfModelDir::open(dir)?;
            if hf.tokenizer_path.is_none() {
                return Err(ModelLoadError::NoTokenizer(dir.clone()));
            }
            let tokenizer = Tokenizer::from_hf_dir(dir).map_err(tokenizer_error(dir))?;
            let model = load_weights(hf.config.clone(), &hf.weights, options, progress, dir)?;
            (model, tokenizer, hf.generation)
        }
    };
    if tokenizer.vocab_size() > model.config().vocab_size {
        return Err(ModelLoadError::VocabularyMismatch {
            path: source.path().to_path_buf(),
            tokenizer: tokenizer.vocab_size(),
            model: model.config().vocab_size,
        });
    }
    with_tokenizer(model, tokenizer, generation, source)
}

/// A loaded model with its tokenizer, and the tokenizer's chat template (the ChatML fallback
/// when it has none).
fn with_tokenizer(
    model: Backend,
    tokenizer: Tokenizer,
    generation: GenerationDefaults,
    source: &ModelSource,
) -> Result<LoadedModel, ModelLoadError> {
    let bos = tokenizer.bos_token();
    let eos = tokenizer.eos_token();
    let (chat_template, chat_template_from_model) = match tokenizer.chat_template() {
        Some(source_text) => (
            ChatTemplate::new(source_text, bos.as_deref(), eos.as_deref())
                .map_err(ModelLoadError::ChatTemplate)?,
            true,
        ),
        None => (ChatTemplate::chatml(), false),
    };
    Ok(LoadedModel {
        model,
        tokenizer,
        chat_template,
        chat_template_from_model,
        generation,
        source: source.clone(),
    })
}

fn load_weights(
    config: ModelConfig,
    tensors: &dyn pagoda_models::weights::TensorSource,
    options: LoadOptions,
    progress: &mut dyn FnMut(usize, usize),
    path: &Path,
) -> Result<Backend, ModelLoadError> {
    load_backend(config, tensors, options, progress).map_err(|error| match error {
        ModelLoadError::Build(source) => ModelLoadError::Weights {
            path: path.to_path_buf(),
            source,
        },
        other => other,
    })
}

/// Loads weights from any tensor source (a model file, or [`RandomWeights`]) onto the device
/// `options` names.
pub fn load_backend(
    config: ModelConfig,
    tensors: &dyn pagoda_models::weights::TensorSource,
    options: LoadOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Backend, ModelLoadError> {
    match options.device {
        Device::Cpu => {
            // `-tp N`: the ranks as threads of this process (`Model::load_tensor_parallel`).
            let ranks = pagoda_config::global()
                .number("PAGODA_TENSOR_PARALLEL_SIZE")
                .map_or(1, |ranks| ranks as usize);
            let model = if ranks > 1 {
                tracing::info!("tensor parallelism: {ranks} CPU ranks in this process");
                Model::load_tensor_parallel(config, tensors, options.precision, ranks)
            } else {
                Model::load_with_progress(config, tensors, options.precision, progress)
            };
            model.map(Backend::Cpu).map_err(ModelLoadError::Build)
        }
        Device::Cuda { dtype } => {
            // Declined before the device is opened, so the reason is the same on any machine.
            if let Some(reason) = CudaModel::unsupported(&config) {
                return Err(ModelLoadError::Build(LoadError(reason)));
            }
            let gpu = Gpu::new(0)?;
            let settings = pagoda_config::global();
            let keep = pagoda_models::llama_cuda::KeepOnDevice {
                gguf_blocks: settings.on("PAGODA_CUDA_QUANT_WEIGHTS"),
                fp8: settings.on("PAGODA_CUDA_FP8_WEIGHTS"),
                moe_experts: settings.on("PAGODA_CUDA_MOE_QUANT"),
            };
            CudaModel::load_keeping(config, tensors, Arc::new(gpu), dtype, keep, progress)
                .map(Backend::from)
                .map_err(ModelLoadError::Build)
        }
    }
}

/// A model of a built-in architecture (`llama-3.1-8b`, ...) or a `config.json`, with random
/// weights: for benchmarks of shapes whose weights are not on the machine (no tokenizer). A
/// `:fp8` suffix (`llama-3.1-8b:fp8`) makes the dense projections FP8 (e4m3) with a factor
/// per row ([`RandomFormat::Fp8`]), kept so on CUDA with `PAGODA_CUDA_FP8_WEIGHTS=on`.
pub fn load_random(
    spec: &str,
    seed: u64,
    options: LoadOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Backend, ModelLoadError> {
    let config = random_config(spec).map_err(|source| ModelLoadError::Random {
        spec: spec.to_owned(),
        source,
    })?;
    load_random_config(spec, config, seed, options, progress)
}

/// [`load_random`] of `spec`'s shapes served with the tokenizer, chat template and generation
/// defaults of `tokenizer_source` (its weights are not read) and the tokenizer's vocabulary
/// in place of the architecture's: serving measured at shapes whose weights are not on the
/// machine (vLLM's `--load-format dummy`). The text it writes is noise.
pub fn load_random_served(
    spec: &str,
    seed: u64,
    tokenizer_source: &ModelSource,
    options: LoadOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<LoadedModel, ModelLoadError> {
    let (tokenizer, generation) = match tokenizer_source {
        ModelSource::Gguf(path) => {
            let file = GgufFile::open(path)?;
            let tokenizer = Tokenizer::from_gguf(&file).map_err(tokenizer_error(path))?;
            (tokenizer, GenerationDefaults::default())
        }
        ModelSource::HfDir(dir) => {
            let hf = HfModelDir::open(dir)?;
            if hf.tokenizer_path.is_none() {
                return Err(ModelLoadError::NoTokenizer(dir.clone()));
            }
            let tokenizer = Tokenizer::from_hf_dir(dir).map_err(tokenizer_error(dir))?;
            (tokenizer, hf.generation)
        }
    };
    let mut config = random_config(spec).map_err(|source| ModelLoadError::Random {
        spec: spec.to_owned(),
        source,
    })?;
    config.vocab_size = tokenizer.vocab_size();
    let model = load_random_config(spec, config, seed, options, progress)?;
    with_tokenizer(model, tokenizer, generation, tokenizer_source)
}

fn load_random_config(
    spec: &str,
    config: ModelConfig,
    seed: u64,
    options: LoadOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Backend, ModelLoadError> {
    let random = |source| ModelLoadError::Random {
        spec: spec.to_owned(),
        source,
    };
    // The CPU keeps every weight in f32; the GPU converts one tensor at a time.
    let limit = match options.device {
        Device::Cpu => 16usize << 30,
        Device::Cuda { .. } => usize::MAX,
    };
    let format = random_format(spec).map_err(random)?;
    let weights = RandomWeights::new(&config, seed, limit)
        .map_err(random)?
        .with_format(format);
    if format == RandomFormat::Fp8 {
        let (matrices, bytes) = weights.fp8_matrices();
        tracing::info!(
            "random weights: {matrices} projections FP8 (e4m3) with a factor per row, {:.2} GiB \
             of codes (the rest f32)",
            bytes as f64 / (1u64 << 30) as f64
        );
    }
    load_backend(config, &weights, options, progress).map_err(|error| match error {
        ModelLoadError::Build(source) => random(source),
        other => other,
    })
}
