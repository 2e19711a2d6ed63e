//! `--spec draft`: loading the draft model, checking its vocabulary against the model's, and
//! giving the engine a draft-model proposer.

use std::path::Path;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use pagoda_engine::speculation::{
    check_vocabularies, DraftModel, SpeculationMode, SpeculationSettings,
};
use pagoda_engine::{load_model, Device, Engine, EngineSettings, LoadOptions};
use pagoda_models::llama::WeightPrecision;
use pagoda_models::llama_cuda::DType;
use pagoda_models::tokenizer::Tokenizer;

use crate::model_args::{model_source, ModelArgs};

/// Gives `engine` a draft-model proposer when `--spec draft` (or `--model-draft` alone) asks
/// for one: the draft model loads on the engine's device (weights as stored), into an engine
/// of its own with the same sizes and its prefix cache on. `tokenizer` is the model's (`None`
/// for random weights: then only the vocabulary sizes are compared).
pub fn attach_draft(
    engine: &mut Engine,
    args: &ModelArgs,
    tokenizer: Option<&Tokenizer>,
) -> Result<()> {
    let config = pagoda_config::global();
    let spec = SpeculationSettings::from_config(config);
    let path = config.text("PAGODA_MODEL_DRAFT");
    match (spec.mode, path) {
        (SpeculationMode::Draft, Some(_)) => {}
        (SpeculationMode::Draft, None) => bail!(
            "--spec draft needs a draft model: pass --model-draft FILE (-md), a .gguf file or a \
             Hugging Face directory whose vocabulary matches the model's"
        ),
        (_, Some(path)) => bail!(
            "--model-draft {path} is given but speculation is {}: drop --spec (a draft model \
             alone turns it on) or pass --spec draft",
            config.word("PAGODA_SPEC")
        ),
        (_, None) => return Ok(()),
    }
    let path = path.expect("matched above");
    let source = model_source(Path::new(path)).context("--model-draft")?;
    let device = if engine.is_cuda() {
        let dtype = match args.dtype.as_str() {
            "f32" => DType::F32,
            _ => DType::BF16,
        };
        Device::Cuda { dtype }
    } else {
        Device::Cpu
    };
    let options = LoadOptions {
        precision: WeightPrecision::AsStored,
        device,
    };
    let started = Instant::now();
    let draft =
        load_model(&source, options, &mut |_, _| {}).map_err(|e| anyhow!("--model-draft: {e}"))?;
    let target_vocab = engine.model_config().vocab_size;
    let draft_vocab = draft.model.config().vocab_size;
    match tokenizer {
        Some(tokenizer) => check_vocabularies(tokenizer, &draft.tokenizer)
            .map_err(|e| anyhow!("--model-draft {path}: {e}"))?,
        None if target_vocab.abs_diff(draft_vocab) > 128 => bail!(
            "--model-draft {path}: the draft model has {draft_vocab} logits and the model \
             {target_vocab}; they may differ by at most 128"
        ),
        None => {}
    }
    let settings = EngineSettings {
        prefix_caching: true,
        speculation: SpeculationSettings::default(),
        ..EngineSettings::from_config(config)
    };
    let mut draft_engine = Engine::with_settings(draft.model, engine.config().clone(), settings)
        .map_err(|e| anyhow!("--model-draft {path}: {e}"))?;
    draft_engine
        .warm_up(&mut |_| {})
        .map_err(|e| anyhow!("--model-draft {path}: {e}"))?;
    tracing::info!(
        "draft model: {path} on {} in {:.2}s ({:.1} MiB of KV)",
        if draft_engine.is_cuda() {
            "the GPU"
        } else {
            "the CPU"
        },
        started.elapsed().as_secs_f64(),
        draft_engine.kv_bytes() as f64 / (1 << 20) as f64
    );
    engine.set_proposer(Box::new(DraftModel::new(
        draft_engine,
        spec.rule,
        spec.draft_p_min,
        target_vocab,
    )));
    Ok(())
}
