//! pagoda's structured output: grammars that constrain which token may come next.
//!
//! Built on [llguidance](https://crates.io/crates/llguidance) (the grammar engine vLLM,
//! SGLang and llama.cpp use) and its token trie. The engine gives the model's vocabulary
//! ([`Vocabulary`]: the bytes of every token id, special tokens and end tokens marked) to a
//! [`Grammars`], which compiles a [`GrammarSpec`] (a JSON schema, any JSON object, a Lark
//! or GBNF grammar, a regex, a list of choices) into a [`Constraint`] per request, caching
//! compiled grammars by spec. Before each token the engine asks the constraint for the
//! packed bitmask of allowed ids ([`Constraint::allowed`]) or masks the logits
//! ([`Constraint::apply`]); after sampling it hands the token back
//! ([`Constraint::accept`]), and stops the request when [`Constraint::is_finished`].
//!
//! ```
//! use pagoda_grammar::{GrammarSpec, Grammars, Vocabulary};
//!
//! // A toy vocabulary: the 256 bytes, then an end token.
//! let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
//! tokens.push(b"</s>".to_vec());
//! let mut special = vec![false; 256];
//! special.push(true);
//! let vocabulary = Vocabulary::new(tokens, &special, &[256]).unwrap();
//! let grammars = Grammars::new(vocabulary).unwrap();
//!
//! let mut constraint = grammars
//!     .constraint(&GrammarSpec::Choice(vec!["yes".into(), "no".into()]))
//!     .unwrap();
//! let mut logits = vec![0.0f32; 257];
//! constraint.apply(&mut logits).unwrap();
//! assert!(logits[b'y' as usize] == 0.0 && logits[b'x' as usize] == f32::NEG_INFINITY);
//! for &byte in b"no" {
//!     constraint.accept(byte as u32).unwrap();
//! }
//! assert!(constraint.is_finished());
//! assert_eq!(constraint.allowed().unwrap()[256 / 32], 1); // only the end token
//! ```

mod constraint;
mod error;
mod gbnf;
mod grammars;
mod lru;
mod vocab;

use serde::{Deserialize, Serialize};

pub use constraint::Constraint;
pub use error::GrammarError;
pub use gbnf::gbnf_to_lark;
pub use grammars::{CacheStats, Grammars, DEFAULT_CACHE_CAPACITY, JSON_WHITESPACE};
pub use vocab::Vocabulary;

/// What the output must follow. Serializes as `{"type": "json_schema", "value": {...}}`
/// (`type` in snake case; `json_object` has no `value`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "value", rename_all = "snake_case")]
pub enum GrammarSpec {
    /// Any JSON object (OpenAI's `{"type": "json_object"}`).
    JsonObject,
    /// JSON valid against this JSON schema (llguidance's subset: `type`, `properties`,
    /// `required`, `additionalProperties`, `items`, `prefixItems`, `enum`, `const`,
    /// `anyOf`, `allOf`, `oneOf` (where llguidance proves its branches disjoint), `$ref`,
    /// `pattern`, `format`, string, number, array and object bounds). Other keywords
    /// (`not`, `uniqueItems`, ...) are a [`GrammarError::Unsupported`] error naming them.
    JsonSchema(serde_json::Value),
    /// A grammar in llguidance's Lark syntax (start rule `start`).
    Lark(String),
    /// A grammar in llama.cpp's GBNF (start rule `root`), see [`gbnf_to_lark`].
    Gbnf(String),
    /// Text matching this regex in full (Rust `regex` syntax).
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
}

impl GrammarSpec {
    /// What the spec is, in words, for error messages: `JSON schema`, `Lark grammar`...
    pub fn kind(&self) -> &'static str {
        match self {
            GrammarSpec::JsonObject | GrammarSpec::JsonSchema(_) => "JSON schema",
            GrammarSpec::Lark(_) => "Lark grammar",
            GrammarSpec::Gbnf(_) => "GBNF grammar",
            GrammarSpec::Regex(_) => "regex",
            GrammarSpec::Choice(_) => "choice",
        }
    }
}
