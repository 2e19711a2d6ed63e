//! Resolving a model argument (a GGUF file or a Hugging Face directory) into a runnable model,
//! its tokenizer, chat template and generation defaults.

use std::path::{Path, PathBuf};

use pagoda_models::chat_template::ChatTemplate;
use pagoda_models::config::ModelConfig;
use pagoda_models::formats::gguf::GgufFile;
use pagoda_models::gguf_model::config_from_gguf;
use pagoda_models::hf::{GenerationDefaults, HfModelDir};
use pagoda_models::llama::{Model, WeightPrecision};
use pagoda_models::tokenizer::Tokenizer;

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
    pub fn from_path(path: &Path) -> Result<ModelSource, String> {
        if path.is_dir() {
            Ok(ModelSource::HfDir(path.to_path_buf()))
        } else if path.is_file() {
            Ok(ModelSource::Gguf(path.to_path_buf()))
        } else {
            Err(format!(
                "model path {} does not exist (pass a .gguf file or a Hugging Face model directory)",
                path.display()
            ))
        }
    }

    /// The path.
    pub fn path(&self) -> &Path {
        match self {
            ModelSource::Gguf(p) | ModelSource::HfDir(p) => p,
        }
    }
}

/// How to load.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    pub precision: WeightPrecision,
}

/// Everything needed to run a model.
pub struct LoadedModel {
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub chat_template: ChatTemplate,
    /// Whether `chat_template` came from the model (false: the ChatML fallback).
    pub chat_template_from_model: bool,
    pub generation: GenerationDefaults,
    pub source: ModelSource,
}

/// Loads a model. `progress(done, total)` is called as layers load.
pub fn load_model(
    source: &ModelSource,
    options: LoadOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<LoadedModel, String> {
    let (model, tokenizer, generation) = match source {
        ModelSource::Gguf(path) => {
            let file = GgufFile::open(path).map_err(|e| e.to_string())?;
            let config = config_from_gguf(&file)?;
            let tokenizer =
                Tokenizer::from_gguf(&file).map_err(|e| format!("{}: {e}", path.display()))?;
            let model = load_weights(config, &file, options, progress, path)?;
            (model, tokenizer, GenerationDefaults::default())
        }
        ModelSource::HfDir(dir) => {
            let hf = HfModelDir::open(dir).map_err(|e| e.to_string())?;
            if hf.tokenizer_path.is_none() {
                return Err(format!("{}: tokenizer.json is missing", dir.display()));
            }
            let tokenizer =
                Tokenizer::from_hf_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            let model = load_weights(hf.config.clone(), &hf.weights, options, progress, dir)?;
            (model, tokenizer, hf.generation)
        }
    };
    if tokenizer.vocab_size() > model.config().vocab_size {
        return Err(format!(
            "{}: the tokenizer has {} tokens but the model only {} embeddings",
            source.path().display(),
            tokenizer.vocab_size(),
            model.config().vocab_size
        ));
    }
    let bos = tokenizer.bos_token();
    let eos = tokenizer.eos_token();
    let (chat_template, chat_template_from_model) = match tokenizer.chat_template() {
        Some(source_text) => (
            ChatTemplate::new(source_text, bos.as_deref(), eos.as_deref())
                .map_err(|e| format!("the model's chat template: {e}"))?,
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
) -> Result<Model, String> {
    Model::load_with_progress(config, tensors, options.precision, progress)
        .map_err(|e| format!("{}: {e}", path.display()))
}
