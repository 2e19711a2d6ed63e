//! Speculative decoding's proposers and settings.
//!
//! A [`Proposer`] guesses the tokens that follow a sequence; the engine puts the guesses
//! behind the sequence's pending token in one step (`Scheduler::set_draft`), the model scores
//! every row, and verification keeps each guess while it equals the token the request's own
//! sampler draws at that position (with the request's seed, filters and penalties), emitting
//! that token at the first mismatch and a bonus token after the last guess. The sampler's
//! noise depends only on the request's seed and position, so the output is token for token
//! what plain decoding gives, whatever the proposer guessed (drafter-invariant speculation:
//! Daliri, Musco and Suresh 2024); on the CPU, where a row's logits do not depend on the
//! rows beside it, bit for bit. The other rule, [`VerifyRule::Leviathan`], keeps the
//! distribution but not the tokens.

mod draft_model;
mod policy;
mod vocabulary;

pub use draft_model::DraftModel;
pub use policy::{SpeculationPolicy, PROBE_EVERY};
pub use vocabulary::check_vocabularies;

use pagoda_ops::sampling::AnySampler;
#[cfg(doc)]
use pagoda_ops::sampling::FusedSampler;

/// What a proposer sees of one decoding request.
#[derive(Debug, Clone, Copy)]
pub struct DraftRequest<'a> {
    /// The sequence so far: prompt and generated tokens (the last one not yet in the KV).
    pub tokens: &'a [u32],
    /// The request's sampler at the step of its next draw: a drafter that samples clones it
    /// (the invariant rule) or its [`FusedSampler::drafter`] (the Leviathan rule).
    pub sampler: &'a AnySampler,
    /// The generated tokens (the penalty history).
    pub history: &'a [u32],
    /// Tokens that end the request: drafting stops after one.
    pub stop_tokens: &'a [u32],
    /// Most guesses.
    pub max: usize,
}

/// One request's guesses.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Draft {
    /// The guessed tokens, in order.
    pub tokens: Vec<u32>,
    /// The distribution each guess was drawn from (one row of the target's vocabulary size
    /// per guess), when the drafter samples and keeps them; `None`: the guesses are
    /// deterministic (`q` one-hot).
    pub q: Option<Vec<Vec<f32>>>,
}

/// Guesses the continuation of sequences.
pub trait Proposer: Send {
    /// A draft per request (empty when there is no guess), in order.
    fn propose(&mut self, requests: &[DraftRequest<'_>]) -> Vec<Draft>;
    /// Name for logs and reports.
    fn name(&self) -> &'static str;
}

/// Prompt lookup: the longest suffix of `min..=max` tokens that occurred before in the
/// sequence (the latest occurrence), and the tokens that followed it there. No second model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramProposer {
    /// Shortest suffix matched.
    pub min: usize,
    /// Longest suffix matched (tried first).
    pub max: usize,
}

impl Proposer for NgramProposer {
    fn propose(&mut self, requests: &[DraftRequest<'_>]) -> Vec<Draft> {
        requests
            .iter()
            .map(|request| Draft {
                tokens: self.guess(request.tokens, request.max),
                q: None,
            })
            .collect()
    }

    fn name(&self) -> &'static str {
        "ngram"
    }
}

impl NgramProposer {
    /// Up to `max` tokens that followed the latest earlier occurrence of the longest suffix.
    pub fn guess(&self, tokens: &[u32], max: usize) -> Vec<u32> {
        let len = tokens.len();
        if max == 0 {
            return Vec::new();
        }
        for n in (self.min.max(1)..=self.max).rev() {
            if n >= len {
                continue;
            }
            let suffix = &tokens[len - n..];
            // The latest earlier occurrence whose continuation is non-empty.
            let found = (0..len - n)
                .rev()
                .find(|&start| &tokens[start..start + n] == suffix);
            if let Some(start) = found {
                let from = start + n;
                let to = (from + max).min(len);
                return tokens[from..to].to_vec();
            }
        }
        Vec::new()
    }
}

/// Guesses that verification rejects: `max` tokens counting up from the last one (for
/// `pagoda bench --verify K`, which times verification steps against plain ones).
#[derive(Debug, Clone, Copy, Default)]
pub struct FixedProposer {
    /// The vocabulary size (guesses wrap below it).
    pub vocab: usize,
}

impl Proposer for FixedProposer {
    fn propose(&mut self, requests: &[DraftRequest<'_>]) -> Vec<Draft> {
        let vocab = self.vocab.max(1) as u32;
        requests
            .iter()
            .map(|request| {
                let last = request.tokens.last().copied().unwrap_or(0);
                Draft {
                    tokens: (1..=request.max as u32)
                        .map(|i| (last + i) % vocab)
                        .collect(),
                    q: None,
                }
            })
            .collect()
    }

    fn name(&self) -> &'static str {
        "fixed"
    }
}

/// Which proposer speculation uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SpeculationMode {
    /// No speculation.
    #[default]
    Off,
    /// Prompt lookup ([`NgramProposer`]).
    Ngram,
    /// A draft model ([`DraftModel`], given to the engine with `Engine::set_proposer`).
    Draft,
}

/// How verification decides on a guess.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum VerifyRule {
    /// Keep a guess while it equals the token the request's own sampler draws at that
    /// position (a drafter that samples uses the same noise): the output is plain
    /// decoding's, token for token, whatever was guessed.
    #[default]
    Invariant,
    /// Leviathan et al.: accept a guess drawn from `q` with probability `min(1, p/q)`, else
    /// draw from `max(0, p - q)`: the same distribution as plain decoding (not the same
    /// tokens), at least as many acceptances. Requests on the reference sampler, and greedy
    /// ones, verify by the invariant rule.
    Leviathan,
}

/// Speculation's switches (`--spec`, `--spec-rule`, `--draft-max`, `--draft-min`,
/// `--draft-p-min`, `--spec-ngram-min`, `--spec-ngram-max`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpeculationSettings {
    /// The proposer.
    pub mode: SpeculationMode,
    /// How guesses are verified.
    pub rule: VerifyRule,
    /// Most guesses per request and step. Default 4: on the 2-core Xeon, 4 beat 2 and 8 at
    /// batch 1 (each guessed row costs a matmul row, and most guesses past 4 were rejected).
    pub draft_max: usize,
    /// Fewest guesses worth a draft (shorter proposals are dropped).
    pub draft_min: usize,
    /// A draft model stops drafting at a token it drew with a probability below this.
    pub draft_p_min: f32,
    /// The n-gram proposer's suffix lengths.
    pub ngram_min: usize,
    pub ngram_max: usize,
    /// Speculation runs only in steps with at most this many decoding requests; below it the
    /// cost policy decides. Default 16: on the H200 (8B) a verification step of 16 requests
    /// with 8 guesses each costs 1.25x a plain one and 64 with 4 guesses 1.82x
    /// (`docs/benchmark_results/spec-draft-cpu-h200-2026-12-04.md`), past what guesses win
    /// back at the acceptance rates measured.
    pub max_batch: usize,
    /// Whether the measured costs decide per step (`PAGODA_SPEC_POLICY=cost`, the default)
    /// or every step under `max_batch` speculates (`always`).
    pub cost_policy: bool,
}

impl Default for SpeculationSettings {
    fn default() -> Self {
        SpeculationSettings {
            mode: SpeculationMode::Off,
            rule: VerifyRule::Invariant,
            draft_max: 4,
            draft_min: 1,
            draft_p_min: 0.0,
            ngram_min: 2,
            ngram_max: 4,
            max_batch: 16,
            cost_policy: true,
        }
    }
}

impl SpeculationSettings {
    /// The settings `config` resolved.
    pub fn from_config(config: &pagoda_config::Config) -> Self {
        let number = |name, default: usize| config.number(name).map_or(default, |n| n as usize);
        let defaults = SpeculationSettings::default();
        SpeculationSettings {
            mode: match config.word("PAGODA_SPEC") {
                "ngram" => SpeculationMode::Ngram,
                "draft" => SpeculationMode::Draft,
                // A draft model alone turns speculation on, as in llama-server.
                _ if matches!(config.source("PAGODA_SPEC"), pagoda_config::Source::Default)
                    && config.text("PAGODA_MODEL_DRAFT").is_some() =>
                {
                    SpeculationMode::Draft
                }
                _ => SpeculationMode::Off,
            },
            rule: match config.word("PAGODA_SPEC_RULE") {
                "leviathan" => VerifyRule::Leviathan,
                _ => VerifyRule::Invariant,
            },
            draft_max: number("PAGODA_DRAFT_MAX", defaults.draft_max),
            draft_min: number("PAGODA_DRAFT_MIN", defaults.draft_min),
            draft_p_min: config.fraction("PAGODA_DRAFT_P_MIN") as f32,
            ngram_min: number("PAGODA_SPEC_NGRAM_MIN", defaults.ngram_min),
            ngram_max: number("PAGODA_SPEC_NGRAM_MAX", defaults.ngram_max),
            max_batch: number("PAGODA_SPEC_MAX_BATCH", defaults.max_batch),
            cost_policy: config.word("PAGODA_SPEC_POLICY") != "always",
        }
    }

    /// The proposer the settings make by themselves: the n-gram one when chosen (a draft
    /// model is loaded by the caller and given with `Engine::set_proposer`).
    pub fn proposer(&self) -> Option<Box<dyn Proposer>> {
        match self.mode {
            SpeculationMode::Off | SpeculationMode::Draft => None,
            SpeculationMode::Ngram => Some(Box::new(NgramProposer {
                min: self.ngram_min.max(1),
                max: self.ngram_max.max(self.ngram_min.max(1)),
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_the_registry_defaults() {
        let config = pagoda_config::Config::resolve(|_| None, Vec::new(), &[]).unwrap();
        assert_eq!(
            SpeculationSettings::from_config(&config),
            SpeculationSettings::default()
        );
        for (name, value) in [
            ("PAGODA_DRAFT_MAX", 4),
            ("PAGODA_DRAFT_MIN", 1),
            ("PAGODA_DRAFT_P_MIN", 0),
            ("PAGODA_SPEC_NGRAM_MIN", 2),
            ("PAGODA_SPEC_NGRAM_MAX", 4),
            ("PAGODA_SPEC_MAX_BATCH", 16),
        ] {
            let setting = pagoda_config::setting(name).unwrap();
            assert_eq!(setting.default, value.to_string(), "{name}");
        }
    }

    #[test]
    fn ngram_takes_the_longest_latest_match() {
        let proposer = NgramProposer { min: 1, max: 3 };
        // "7 8 9" occurred at 0 and 5; the latest (5) continues with 4 5.
        let tokens = [7, 8, 9, 1, 2, 7, 8, 9, 4, 5, 6, 7, 8, 9];
        assert_eq!(proposer.guess(&tokens, 2), vec![4, 5]);
        assert_eq!(proposer.guess(&tokens, 10), vec![4, 5, 6, 7, 8, 9]);
        // Only a 1-token suffix matches: "3" after 2.
        assert_eq!(proposer.guess(&[3, 2, 1, 3], 4), vec![2, 1, 3]);
        assert!(proposer.guess(&[1, 2, 3], 4).is_empty(), "no repeat");
        assert!(proposer.guess(&tokens, 0).is_empty());
        let longer = NgramProposer { min: 2, max: 2 };
        assert!(
            longer.guess(&[3, 2, 1, 3], 4).is_empty(),
            "1-gram below min"
        );
    }
}
