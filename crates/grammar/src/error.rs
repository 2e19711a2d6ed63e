//! The one error type of the crate.

/// Why a vocabulary, a grammar or a token was refused.
///
/// The message names the problem: the error llguidance gave (with its position where it
/// gives one), the unsupported feature, or the token that the grammar does not allow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    /// The token table given to [`crate::Vocabulary::new`] is unusable.
    #[error("invalid vocabulary: {0}")]
    Vocabulary(String),
    /// The schema, grammar or regex does not compile (its message names the error and,
    /// where the compiler gives one, its position).
    #[error("invalid {kind}: {message}")]
    Invalid {
        /// What was compiled: `JSON schema`, `Lark grammar`, `GBNF grammar`, `regex`, `choice`.
        kind: &'static str,
        /// The compiler's message.
        message: String,
    },
    /// The schema or grammar uses a feature that the grammar engine does not support.
    #[error("unsupported {kind} feature: {message}")]
    Unsupported {
        /// What was compiled, as in [`GrammarError::Invalid`].
        kind: &'static str,
        /// Which feature, in the compiler's words.
        message: String,
    },
    /// [`crate::Constraint::accept`] was given a token outside the current mask.
    #[error("token {token} is not allowed by the grammar at this point")]
    TokenNotAllowed {
        /// The refused token id.
        token: u32,
    },
    /// No token of the vocabulary can continue the output: the grammar reached a dead end
    /// (it needs bytes that no token spells, or a parser limit was hit).
    #[error("the grammar reached a dead end: no token is allowed next")]
    DeadEnd,
    /// The matcher failed while running (a parser limit, or an internal error); the
    /// constraint cannot be used any more.
    #[error("grammar matcher error: {0}")]
    Matcher(String),
}

impl GrammarError {
    /// Sorts a compile error of llguidance into [`GrammarError::Unsupported`] (a known
    /// not-implemented feature) or [`GrammarError::Invalid`].
    pub(crate) fn compile(kind: &'static str, message: String) -> GrammarError {
        const UNSUPPORTED: [&str; 7] = [
            "Unimplemented keys",
            "Unknown format",
            "not supported",
            "Unknown applicator",
            "Unknown specification",
            "unsupported",
            "not implemented",
        ];
        if UNSUPPORTED.iter().any(|marker| message.contains(marker)) {
            GrammarError::Unsupported { kind, message }
        } else {
            GrammarError::Invalid { kind, message }
        }
    }
}
