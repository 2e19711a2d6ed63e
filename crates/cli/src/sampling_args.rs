//! The sampling flags every generating command shares (llama.cpp's spellings), resolved
//! against the model's generation defaults.

use anyhow::{bail, Result};
use clap::Args;
use pagoda_models::hf::GenerationDefaults;
use pagoda_ops::sampling::SamplingParams;

/// Sampling flags (llama.cpp spellings). A flag that is not given takes the model's
/// `generation_config.json` value when it has one, else the built-in default shown.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Temperature; 0 = greedy [default: 0.8].
    #[arg(long = "temp", allow_negative_numbers = true)]
    pub temperature: Option<f32>,
    /// Keep the k most likely tokens (0 = off) [default: 40].
    #[arg(long, allow_negative_numbers = true)]
    pub top_k: Option<usize>,
    /// Keep the smallest set of tokens whose probability reaches p (1 = off) [default: 0.95].
    #[arg(long, allow_negative_numbers = true)]
    pub top_p: Option<f32>,
    /// Drop tokens less likely than min_p times the most likely (0 = off) [default: 0.05].
    #[arg(long, allow_negative_numbers = true)]
    pub min_p: Option<f32>,
    /// Repetition penalty (1 = off) [default: 1].
    #[arg(long = "repeat-penalty", allow_negative_numbers = true)]
    pub repeat_penalty: Option<f32>,
    /// OpenAI-style frequency penalty.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// OpenAI-style presence penalty.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Random seed (default, or -1 as llama.cpp spells it: random, printed with -v).
    #[arg(short = 's', long, allow_negative_numbers = true, value_parser = parse_seed)]
    pub seed: Option<SeedFlag>,
}

impl SamplingArgs {
    /// The validated sampling parameters with the built-in defaults (checked before loading
    /// a model, so bad flags fail fast).
    pub fn params(&self) -> Result<SamplingParams> {
        self.resolve(&GenerationDefaults::default())
    }

    /// The validated sampling parameters: flags first, then the model's generation defaults
    /// (`do_sample: false` means greedy), then the built-in defaults.
    pub fn resolve(&self, model: &GenerationDefaults) -> Result<SamplingParams> {
        let builtin = SamplingParams::default();
        let model_temperature = match model.do_sample {
            Some(false) => Some(0.0),
            _ => model.temperature,
        };
        let params = SamplingParams {
            temperature: self
                .temperature
                .or(model_temperature)
                .unwrap_or(builtin.temperature),
            top_k: self.top_k.or(model.top_k).unwrap_or(builtin.top_k),
            top_p: self.top_p.or(model.top_p).unwrap_or(builtin.top_p),
            min_p: self.min_p.or(model.min_p).unwrap_or(builtin.min_p),
            repetition_penalty: self
                .repeat_penalty
                .or(model.repetition_penalty)
                .unwrap_or(builtin.repetition_penalty),
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            seed: self.seed.and_then(|seed| seed.0),
            ..builtin
        };
        if let Err(message) = params.validate() {
            bail!("invalid sampling flags: {message}");
        }
        Ok(params)
    }
}

/// A `-s` value: `None` for -1 (a random seed, llama.cpp's spelling).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeedFlag(pub Option<u64>);

/// Parses `-s`: -1 (random) or a seed in `0..=2^64-1`.
pub fn parse_seed(text: &str) -> std::result::Result<SeedFlag, String> {
    let text = text.trim();
    if text == "-1" {
        return Ok(SeedFlag(None));
    }
    text.parse::<u64>()
        .map(|seed| SeedFlag(Some(seed)))
        .map_err(|_| {
            format!(
                "{text:?} is not a seed: give -1 (random) or a whole number from 0 to {}",
                u64::MAX
            )
        })
}
