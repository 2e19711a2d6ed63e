//! Per-request sampling parameters: defaults, the greedy preset and validation.

/// Largest accepted temperature. Anything above it flattens the distribution to near-uniform
/// and is almost certainly a unit or client error.
pub const MAX_TEMPERATURE: f32 = 100.0;

/// Largest accepted repetition penalty (llama.cpp and Hugging Face use values around 1.0-1.5).
pub const MAX_REPETITION_PENALTY: f32 = 100.0;

/// Largest accepted magnitude of the frequency and presence penalties, in logits
/// (OpenAI documents [-2, 2]; we accept a wider, still sane, range).
pub const MAX_ABS_ADDITIVE_PENALTY: f32 = 100.0;

/// Default number of most recent history tokens the penalties look at (llama.cpp's
/// `repeat_last_n` default).
pub const DEFAULT_PENALTY_LAST_N: usize = 64;

/// How one sequence turns a logit row into a token. Semantics of every field are those of the
/// canonical chain documented in [`crate::sampling`]; "off" values disable a stage exactly.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// Divisor applied to the surviving logits just before the draw. `0.0` means greedy
    /// (argmax, no randomness consumed). Must be finite and in `[0, MAX_TEMPERATURE]`.
    pub temperature: f32,
    /// Keep the `top_k` most probable tokens (ties at the boundary are all kept). `0` = off;
    /// `1` = greedy; values `>=` the vocabulary size keep everything.
    pub top_k: usize,
    /// Nucleus filter: keep the smallest most-probable set whose mass is `>= top_p` (measured
    /// after top-k renormalisation). Must be in `(0, 1]`; `1.0` = off.
    pub top_p: f32,
    /// Keep tokens with `p >= min_p * p_max`. Must be in `[0, 1]`; `0.0` = off.
    pub min_p: f32,
    /// llama.cpp / Hugging Face repetition penalty on tokens seen in the window: positive
    /// logits are divided by it, non-positive logits multiplied. Must be in
    /// `(0, MAX_REPETITION_PENALTY]`; `1.0` = off.
    pub repetition_penalty: f32,
    /// OpenAI frequency penalty: `logit -= count * frequency_penalty`. `0.0` = off.
    pub frequency_penalty: f32,
    /// OpenAI presence penalty: `logit -= presence_penalty` if the token occurs. `0.0` = off.
    pub presence_penalty: f32,
    /// How many of the most recent history tokens the three penalties look at
    /// (default [`DEFAULT_PENALTY_LAST_N`]); `0` disables penalties, `usize::MAX` = all.
    pub penalty_last_n: usize,
    /// Seed of the per-sequence RNG; `None` draws one from OS entropy (the `Sampler` records
    /// it so it can be reported and the run replayed).
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    /// llama.cpp-like defaults: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, all
    /// penalties off (repetition 1.0, frequency 0.0, presence 0.0) with a 64-token window,
    /// unseeded.
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            penalty_last_n: DEFAULT_PENALTY_LAST_N,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding: temperature 0, every filter and penalty off. Consumes no randomness.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            penalty_last_n: DEFAULT_PENALTY_LAST_N,
            seed: None,
        }
    }

    /// Plain sampling from `softmax(logits / temperature)`: every filter and penalty off.
    pub fn unfiltered(temperature: f32) -> Self {
        SamplingParams {
            temperature,
            ..SamplingParams::greedy()
        }
    }

    /// True when the chain takes the greedy branch (`temperature == 0` or `top_k == 1`).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// True when any of the three penalties can change a logit.
    pub fn has_penalties(&self) -> bool {
        self.penalty_last_n > 0
            && (self.repetition_penalty != 1.0
                || self.frequency_penalty != 0.0
                || self.presence_penalty != 0.0)
    }

    /// Checks every field against its documented range. The error names the offending field
    /// and its value. The chain itself assumes validated parameters.
    pub fn validate(&self) -> Result<(), InvalidSamplingParam> {
        let check = |field: &'static str, value: f32, ok: bool, range: String| {
            if ok {
                Ok(())
            } else {
                Err(InvalidSamplingParam {
                    field,
                    value,
                    range,
                })
            }
        };
        let temperature = self.temperature;
        check(
            "temperature",
            temperature,
            temperature.is_finite() && (0.0..=MAX_TEMPERATURE).contains(&temperature),
            format!("finite and in [0, {MAX_TEMPERATURE}]"),
        )?;
        let top_p = self.top_p;
        check(
            "top_p",
            top_p,
            top_p.is_finite() && top_p > 0.0 && top_p <= 1.0,
            "in (0, 1] (1 disables it)".to_string(),
        )?;
        let min_p = self.min_p;
        check(
            "min_p",
            min_p,
            min_p.is_finite() && (0.0..=1.0).contains(&min_p),
            "in [0, 1] (0 disables it)".to_string(),
        )?;
        let repetition_penalty = self.repetition_penalty;
        check(
            "repetition_penalty",
            repetition_penalty,
            repetition_penalty.is_finite()
                && repetition_penalty > 0.0
                && repetition_penalty <= MAX_REPETITION_PENALTY,
            format!("in (0, {MAX_REPETITION_PENALTY}] (1 disables it)"),
        )?;
        for (field, value) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            check(
                field,
                value,
                value.is_finite() && value.abs() <= MAX_ABS_ADDITIVE_PENALTY,
                format!("finite and in [-{MAX_ABS_ADDITIVE_PENALTY}, {MAX_ABS_ADDITIVE_PENALTY}]"),
            )?;
        }
        Ok(())
    }
}

/// A sampling parameter outside its documented range ([`SamplingParams::validate`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field} must be {range}, got {value}")]
pub struct InvalidSamplingParam {
    /// The field of [`SamplingParams`], e.g. `top_p`.
    pub field: &'static str,
    /// The value given.
    pub value: f32,
    /// The range it must be in, in words.
    pub range: String,
}
