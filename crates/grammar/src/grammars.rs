//! Compiling specs into parsers, with a cache keyed by the spec.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory, TokenParser};
use serde_json::{json, Value};

use crate::lru::Lru;
use crate::{gbnf, Constraint, GrammarError, GrammarSpec, Vocabulary};

/// Compiled grammars kept by [`Grammars`]: a repeated spec within the last this many
/// distinct ones costs no compilation.
pub const DEFAULT_CACHE_CAPACITY: usize = 64;

/// Whitespace a JSON spec allows between two JSON tokens, unless its schema sets
/// llguidance's own `x-guidance` options: at most 16 characters of space, tab or newline,
/// so a model cannot loop on whitespace forever (llguidance's default is unbounded).
pub const JSON_WHITESPACE: &str = r"[\x20\x0A\x0D\x09]{1,16}";

/// Hit and miss counts of the compiled-grammar cache, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    /// `constraint` calls served from the cache (no compilation).
    pub hits: u64,
    /// `constraint` calls that compiled (successfully or not).
    pub misses: u64,
    /// Compiled grammars held now.
    pub entries: usize,
}

/// The grammar engine of one model: llguidance's parser factory over the model's
/// vocabulary and a bounded LRU cache of compiled grammars keyed by the spec. Shareable
/// between threads (`&self` everywhere).
pub struct Grammars {
    factory: ParserFactory,
    vocabulary: Vocabulary,
    cache: Mutex<Lru<String, TokenParser>>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("vocabulary", &self.vocabulary)
            .field("cache", &self.cache_stats())
            .finish()
    }
}

impl Grammars {
    /// The factory for `vocabulary`, with a cache of [`DEFAULT_CACHE_CAPACITY`] grammars.
    pub fn new(vocabulary: Vocabulary) -> Result<Grammars, GrammarError> {
        Grammars::with_cache_capacity(vocabulary, DEFAULT_CACHE_CAPACITY)
    }

    /// As [`Grammars::new`], keeping at most `capacity` compiled grammars (at least 1).
    pub fn with_cache_capacity(
        vocabulary: Vocabulary,
        capacity: usize,
    ) -> Result<Grammars, GrammarError> {
        let mut factory = ParserFactory::new_simple(vocabulary.env())
            .map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
        // Errors come back as values; nothing goes to stderr.
        factory.quiet();
        Ok(Grammars {
            factory,
            vocabulary,
            cache: Mutex::new(Lru::new(capacity)),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        })
    }

    /// The vocabulary the grammars are compiled for.
    pub fn vocabulary(&self) -> &Vocabulary {
        &self.vocabulary
    }

    /// A fresh constraint for one request following `spec`. Compiles the spec unless the
    /// cache holds it (then the compiled parser is cloned: no compilation). An invalid or
    /// unsupported spec is an error naming the problem; errors are not cached.
    pub fn constraint(&self, spec: &GrammarSpec) -> Result<Constraint, GrammarError> {
        let key = serde_json::to_string(spec).expect("a GrammarSpec serializes");
        let cached = self.lock_cache().get(&key).cloned();
        let parser = match cached {
            Some(parser) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                parser
            }
            None => {
                self.misses.fetch_add(1, Ordering::Relaxed);
                // Compiled outside the lock: other requests go on meanwhile.
                let parser = self.compile(spec)?;
                self.lock_cache().insert(key, parser.clone());
                parser
            }
        };
        let matcher = Matcher::new(Ok(parser));
        if let Some(error) = matcher.get_error() {
            return Err(GrammarError::compile(spec.kind(), error));
        }
        Ok(Constraint::new(
            matcher,
            self.vocabulary.size(),
            self.vocabulary.eos().to_vec(),
        ))
    }

    /// Cache hits and misses so far, and the entries held.
    pub fn cache_stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            entries: self.lock_cache().len(),
        }
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, Lru<String, TokenParser>> {
        // A panic while holding the lock leaves a consistent map: keep using it.
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn compile(&self, spec: &GrammarSpec) -> Result<TokenParser, GrammarError> {
        let grammar = top_level(spec)?;
        self.factory
            .create_parser(grammar)
            .map_err(|e| GrammarError::compile(spec.kind(), format!("{e:#}")))
    }
}

/// The llguidance grammar for `spec`.
fn top_level(spec: &GrammarSpec) -> Result<TopLevelGrammar, GrammarError> {
    Ok(match spec {
        GrammarSpec::JsonObject => json_grammar(json!({"type": "object"})),
        GrammarSpec::JsonSchema(schema) => {
            if !(schema.is_object() || schema.is_boolean()) {
                return Err(GrammarError::Invalid {
                    kind: spec.kind(),
                    message: format!("a JSON schema is an object or a boolean, not {schema}"),
                });
            }
            json_grammar(schema.clone())
        }
        GrammarSpec::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        GrammarSpec::Gbnf(source) => TopLevelGrammar::from_lark(gbnf::gbnf_to_lark(source)?),
        GrammarSpec::Regex(regex) => TopLevelGrammar::from_regex(regex),
        GrammarSpec::Choice(choices) => {
            if choices.is_empty() {
                return Err(GrammarError::Invalid {
                    kind: spec.kind(),
                    message: "no choices given".into(),
                });
            }
            let alternatives: Vec<String> = choices.iter().map(|c| escape_regex(c)).collect();
            TopLevelGrammar::from_regex(&format!("(?:{})", alternatives.join("|")))
        }
    })
}

/// A JSON-schema grammar with [`JSON_WHITESPACE`] unless the schema sets `x-guidance`.
fn json_grammar(mut schema: Value) -> TopLevelGrammar {
    if let Value::Object(map) = &mut schema {
        map.entry("x-guidance")
            .or_insert_with(|| json!({ "whitespace_pattern": JSON_WHITESPACE }));
    }
    TopLevelGrammar::from_json_schema(schema)
}

/// `text` as a regex matching exactly it: every character but ASCII letters and digits
/// written as `\x{..}`.
fn escape_regex(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 2);
    for c in text.chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c);
        } else {
            out.push_str(&format!("\\x{{{:x}}}", c as u32));
        }
    }
    out
}
