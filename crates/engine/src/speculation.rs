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
//! rows beside it, bit for bit.

/// Guesses the continuation of a sequence.
pub trait Proposer: Send {
    /// Up to `max` tokens likely to follow `tokens` (prompt and generated so far); empty
    /// when there is no guess.
    fn propose(&mut self, tokens: &[u32], max: usize) -> Vec<u32>;
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
    fn propose(&mut self, tokens: &[u32], max: usize) -> Vec<u32> {
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

    fn name(&self) -> &'static str {
        "ngram"
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
}

/// Speculation's switches (`--spec`, `--draft-max`, `--draft-min`, `--spec-ngram-min`,
/// `--spec-ngram-max`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpeculationSettings {
    /// The proposer.
    pub mode: SpeculationMode,
    /// Most guesses per request and step. Default 4: on the 2-core Xeon, 4 beat 2 and 8 at
    /// batch 1 (each guessed row costs a matmul row, and most guesses past 4 were rejected).
    pub draft_max: usize,
    /// Fewest guesses worth a draft (shorter proposals are dropped).
    pub draft_min: usize,
    /// The n-gram proposer's suffix lengths.
    pub ngram_min: usize,
    pub ngram_max: usize,
    /// Speculation runs only in steps with at most this many decoding requests: verifying
    /// guesses costs rows in every batched matmul, which a batch already fills. Default 1:
    /// on the 2-core Xeon, 4 requests at once ran 0.85-0.99x with guesses
    /// (`docs/benchmark_results/spec-ngram-cpu-xeon-2026-12-03.md`).
    pub max_batch: usize,
}

impl Default for SpeculationSettings {
    fn default() -> Self {
        SpeculationSettings {
            mode: SpeculationMode::Off,
            draft_max: 4,
            draft_min: 1,
            ngram_min: 2,
            ngram_max: 4,
            max_batch: 1,
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
                _ => SpeculationMode::Off,
            },
            draft_max: number("PAGODA_DRAFT_MAX", defaults.draft_max),
            draft_min: number("PAGODA_DRAFT_MIN", defaults.draft_min),
            ngram_min: number("PAGODA_SPEC_NGRAM_MIN", defaults.ngram_min),
            ngram_max: number("PAGODA_SPEC_NGRAM_MAX", defaults.ngram_max),
            max_batch: number("PAGODA_SPEC_MAX_BATCH", defaults.max_batch),
        }
    }

    /// The proposer, if speculation is on.
    pub fn proposer(&self) -> Option<Box<dyn Proposer>> {
        match self.mode {
            SpeculationMode::Off => None,
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
            ("PAGODA_SPEC_NGRAM_MIN", 2),
            ("PAGODA_SPEC_NGRAM_MAX", 4),
            ("PAGODA_SPEC_MAX_BATCH", 1),
        ] {
            let setting = pagoda_config::setting(name).unwrap();
            assert_eq!(setting.default, value.to_string(), "{name}");
        }
    }

    #[test]
    fn ngram_takes_the_longest_latest_match() {
        let mut proposer = NgramProposer { min: 1, max: 3 };
        // "7 8 9" occurred at 0 and 5; the latest (5) continues with 4 5.
        let tokens = [7, 8, 9, 1, 2, 7, 8, 9, 4, 5, 6, 7, 8, 9];
        assert_eq!(proposer.propose(&tokens, 2), vec![4, 5]);
        assert_eq!(proposer.propose(&tokens, 10), vec![4, 5, 6, 7, 8, 9]);
        // Only a 1-token suffix matches: "3" after 2.
        assert_eq!(proposer.propose(&[3, 2, 1, 3], 4), vec![2, 1, 3]);
        assert!(proposer.propose(&[1, 2, 3], 4).is_empty(), "no repeat");
        assert!(proposer.propose(&tokens, 0).is_empty());
        let mut longer = NgramProposer { min: 2, max: 2 };
        assert!(
            longer.propose(&[3, 2, 1, 3], 4).is_empty(),
            "1-gram below min"
        );
    }
}
