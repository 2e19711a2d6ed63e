//! One request's grammar state: the mask of allowed tokens, and the tokens taken.

use llguidance::Matcher;
use toktrie::SimpleVob;

use crate::GrammarError;

/// The grammar state of one request. Call [`Constraint::allowed`] (or
/// [`Constraint::apply`]) before sampling each token and [`Constraint::accept`] with the
/// token sampled; stop the request when [`Constraint::is_finished`] says so or when an
/// end token was sampled.
///
/// The end-of-generation tokens are allowed exactly when the output so far is complete
/// (the grammar is accepting); once the grammar can take nothing more, they are the only
/// tokens allowed and `is_finished` is true.
pub struct Constraint {
    matcher: Matcher,
    vocab_size: usize,
    eos: Vec<u32>,
    /// The mask for the next token, computed once per position.
    mask: Option<SimpleVob>,
    /// Tokens the matcher consumed.
    consumed: usize,
    /// End tokens accepted after the grammar had finished (the matcher does not see them).
    after_finish: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("tokens", &self.num_tokens())
            .field("finished", &self.is_finished())
            .field("error", &self.matcher.get_error())
            .finish()
    }
}

impl Constraint {
    pub(crate) fn new(matcher: Matcher, vocab_size: usize, eos: Vec<u32>) -> Constraint {
        Constraint {
            matcher,
            vocab_size,
            eos,
            mask: None,
            consumed: 0,
            after_finish: 0,
        }
    }

    /// The packed bitmask of the token ids allowed next: id `i` is bit `i % 32` of word
    /// `i / 32`, over `ceil(vocab_size / 32)` words (bits past the vocabulary are 0).
    /// Computed once per position (the costly step, about the time of one mask walk over
    /// the token trie); later calls return the same words.
    ///
    /// An error means the grammar cannot go on: [`GrammarError::DeadEnd`] when no token
    /// can continue the output, [`GrammarError::Matcher`] when the matcher failed.
    pub fn allowed(&mut self) -> Result<&[u32], GrammarError> {
        let words = self.vocab_size.div_ceil(32);
        let mask = self.mask()?.as_slice();
        Ok(&mask[..words.min(mask.len())])
    }

    /// Sets the logits of every token that the grammar does not allow to `-inf`. `logits`
    /// may be longer than the vocabulary (a padded output layer): ids past it are
    /// disallowed too.
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        let words = self.allowed()?;
        for (chunk, &word) in logits.chunks_mut(32).zip(words) {
            if word == u32::MAX {
                continue;
            }
            for (bit, logit) in chunk.iter_mut().enumerate() {
                if word & (1 << bit) == 0 {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
        let covered = (words.len() * 32).min(logits.len());
        logits[covered..].fill(f32::NEG_INFINITY);
        Ok(())
    }

    /// Whether token `token` is allowed next (computing the mask if needed).
    pub fn is_allowed(&mut self, token: u32) -> Result<bool, GrammarError> {
        let vocab_size = self.vocab_size;
        Ok((token as usize) < vocab_size && self.mask()?.is_allowed(token))
    }

    /// Advances the grammar by the sampled `token`. A token outside the current mask is a
    /// [`GrammarError::TokenNotAllowed`] and leaves the state as it was. An end token is
    /// accepted only where the output is complete.
    pub fn accept(&mut self, token: u32) -> Result<(), GrammarError> {
        if !self.is_allowed(token)? {
            return Err(GrammarError::TokenNotAllowed { token });
        }
        if self.matcher.is_stopped() {
            // Only an end token gets here (the mask of a finished grammar): nothing to
            // advance.
            self.after_finish += 1;
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(matcher_error)?;
        self.consumed += 1;
        self.mask = None;
        Ok(())
    }

    /// Whether the output is complete and the grammar allows nothing more: the only
    /// tokens allowed are the end tokens, and the request should stop (finish reason
    /// `stop`). Also true once an end token was accepted.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped() && !self.matcher.is_error()
    }

    /// Whether the output so far is a complete sentence of the grammar (an end token is
    /// allowed now), though the grammar may allow more.
    pub fn is_accepting(&mut self) -> bool {
        self.is_finished() || self.matcher.is_accepting().unwrap_or(false)
    }

    /// Takes back the last `n` accepted tokens (for speculative decoding: drafted tokens
    /// that verification refused).
    pub fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        if n > self.num_tokens() {
            return Err(GrammarError::Matcher(format!(
                "cannot roll back {n} tokens: only {} were accepted",
                self.num_tokens()
            )));
        }
        let from_finish = n.min(self.after_finish);
        self.after_finish -= from_finish;
        let rest = n - from_finish;
        if rest > 0 {
            self.matcher.rollback(rest).map_err(matcher_error)?;
            self.consumed -= rest;
        }
        self.mask = None;
        Ok(())
    }

    /// Number of tokens accepted so far.
    pub fn num_tokens(&self) -> usize {
        self.consumed + self.after_finish
    }

    /// The end-of-generation ids of the vocabulary.
    pub fn eos(&self) -> &[u32] {
        &self.eos
    }

    fn mask(&mut self) -> Result<&SimpleVob, GrammarError> {
        if self.mask.is_none() {
            if let Some(error) = self.matcher.get_error() {
                return Err(matcher_error(error));
            }
            let mask = self.matcher.compute_mask_or_eos().map_err(matcher_error)?;
            if mask.is_zero() {
                return Err(GrammarError::DeadEnd);
            }
            self.mask = Some(mask);
        }
        Ok(self.mask.as_ref().expect("computed above"))
    }
}

/// A matcher error: [`GrammarError::DeadEnd`] where llguidance found no token to go on
/// with, else the first line of its message (the rest is a dump of the parser state).
fn matcher_error(error: impl std::fmt::Display) -> GrammarError {
    let message = error.to_string();
    if message.starts_with("NoExtensionBias") {
        return GrammarError::DeadEnd;
    }
    GrammarError::Matcher(message.lines().next().unwrap_or_default().to_string())
}
