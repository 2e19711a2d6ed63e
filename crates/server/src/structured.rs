//! Structured output: the request fields that constrain an answer to a grammar, in the
//! spellings clients already send, read into one [`GrammarSpec`]:
//!
//! - OpenAI's `response_format`: `{"type": "json_object"}`, or `{"type": "json_schema",
//!   "json_schema": {"name", "schema", "strict"}}` (`{"type": "text"}` constrains nothing);
//! - llama-server's `json_schema` (a schema) and `grammar` (GBNF);
//! - vLLM's `structured_outputs` (`{"json" | "regex" | "choice" | "grammar": ...}`) and its
//!   older `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`.
//!
//! At most one may be set. The spec is compiled into a constraint per choice by the model's
//! [`Grammars`] (built from the tokenizer's vocabulary at the first constrained request,
//! caching compiled grammars by spec); a spec that does not compile is a 400 naming the
//! field and the error.

use std::sync::{Arc, OnceLock};

use pagoda_grammar::{GrammarError, GrammarSpec, Grammars};
use pagoda_models::tokenizer::Tokenizer;
use serde_json::{Map, Value};

use crate::error::ApiError;

/// The fields read here, for the "at most one" check.
const FIELDS: [&str; 8] = [
    "response_format",
    "json_schema",
    "grammar",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
];

/// The grammar a request asks for, with the field that asked (for errors), or `None`.
pub fn parse(object: &Map<String, Value>) -> Result<Option<(GrammarSpec, &'static str)>, ApiError> {
    let mut found = None;
    for field in FIELDS {
        let Some(value) = object.get(field).filter(|v| !v.is_null()) else {
            continue;
        };
        let Some(spec) = spec_of(field, value)? else {
            continue;
        };
        if let Some((_, first)) = &found {
            return Err(ApiError::invalid(
                format!("`{first}` and `{field}` both constrain the output: set one of them"),
                Some(field),
            ));
        }
        found = Some((spec, field));
    }
    Ok(found)
}

/// A non-empty string field's text.
fn text(field: &str, value: &Value) -> Result<String, ApiError> {
    match value.as_str() {
        Some(text) if !text.is_empty() => Ok(text.to_owned()),
        _ => Err(ApiError::invalid_field(
            field,
            format!("`{field}` must be a non-empty string"),
        )),
    }
}

/// A schema given as an object (or as a JSON string holding one, as vLLM accepts).
fn schema(field: &str, value: &Value) -> Result<Value, ApiError> {
    match value {
        Value::Object(_) | Value::Bool(_) => Ok(value.clone()),
        Value::String(text) => serde_json::from_str(text).map_err(|e| {
            ApiError::invalid_field(field, format!("`{field}` is not valid JSON: {e}"))
        }),
        _ => Err(ApiError::invalid_field(
            field,
            format!("`{field}` must be a JSON schema object"),
        )),
    }
}

fn choices(field: &str, value: &Value) -> Result<Vec<String>, ApiError> {
    let items = value
        .as_array()
        .filter(|items| !items.is_empty())
        .ok_or_else(|| {
            ApiError::invalid_field(
                field,
                format!("`{field}` must be a non-empty array of strings"),
            )
        })?;
    items
        .iter()
        .map(|item| {
            item.as_str().map(str::to_owned).ok_or_else(|| {
                ApiError::invalid_field(field, format!("`{field}` must hold strings only"))
            })
        })
        .collect()
}

fn spec_of(field: &'static str, value: &Value) -> Result<Option<GrammarSpec>, ApiError> {
    Ok(Some(match field {
        "response_format" => return response_format(value),
        "json_schema" | "guided_json" => GrammarSpec::JsonSchema(schema(field, value)?),
        "grammar" | "guided_grammar" => GrammarSpec::Gbnf(text(field, value)?),
        "guided_regex" => GrammarSpec::Regex(text(field, value)?),
        "guided_choice" => GrammarSpec::Choice(choices(field, value)?),
        "structured_outputs" => return structured_outputs(value),
        _ => return Ok(None),
    }))
}

/// OpenAI's `response_format`.
fn response_format(value: &Value) -> Result<Option<GrammarSpec>, ApiError> {
    const FIELD: &str = "response_format";
    let kind = value
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::invalid_field(FIELD, "`response_format` needs a `type`"))?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(GrammarSpec::JsonObject)),
        "json_schema" => {
            let described = value.get("json_schema").ok_or_else(|| {
                ApiError::invalid_field(
                    FIELD,
                    "`response_format` of type `json_schema` needs a `json_schema` object",
                )
            })?;
            let schema_value = described.get("schema").ok_or_else(|| {
                ApiError::invalid_field(FIELD, "`response_format.json_schema` needs a `schema`")
            })?;
            Ok(Some(GrammarSpec::JsonSchema(schema(FIELD, schema_value)?)))
        }
        other => Err(ApiError::invalid_field(
            FIELD,
            format!(
                "`response_format.type` must be `text`, `json_object` or `json_schema`, got `{other}`"
            ),
        )),
    }
}

/// vLLM's `structured_outputs`: exactly one of `json`, `regex`, `choice`, `grammar`.
fn structured_outputs(value: &Value) -> Result<Option<GrammarSpec>, ApiError> {
    const FIELD: &str = "structured_outputs";
    let object = value
        .as_object()
        .ok_or_else(|| ApiError::invalid_field(FIELD, "`structured_outputs` must be an object"))?;
    let mut specs = Vec::new();
    for (key, item) in object.iter().filter(|(_, v)| !v.is_null()) {
        let spec = match key.as_str() {
            "json" => GrammarSpec::JsonSchema(schema(FIELD, item)?),
            "regex" => GrammarSpec::Regex(text(FIELD, item)?),
            "choice" => GrammarSpec::Choice(choices(FIELD, item)?),
            "grammar" => GrammarSpec::Gbnf(text(FIELD, item)?),
            "json_object" if item.as_bool() == Some(true) => GrammarSpec::JsonObject,
            "json_object" => continue,
            other => {
                return Err(ApiError::invalid_field(
                    FIELD,
                    format!(
                        "`structured_outputs.{other}` is not supported (json, regex, choice, grammar, json_object)"
                    ),
                ))
            }
        };
        specs.push(spec);
    }
    match specs.len() {
        0 => Ok(None),
        1 => Ok(specs.pop()),
        _ => Err(ApiError::invalid_field(
            FIELD,
            "`structured_outputs` must set one of json, regex, choice, grammar",
        )),
    }
}

/// The model's grammar engine, built from its tokenizer at the first constrained request.
#[derive(Default)]
pub struct LazyGrammars {
    built: OnceLock<Result<Arc<Grammars>, String>>,
}

impl std::fmt::Debug for LazyGrammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyGrammars")
            .field("built", &self.built.get().map(|b| b.is_ok()))
            .finish()
    }
}

impl LazyGrammars {
    /// The engine over `tokenizer`'s vocabulary (built once).
    pub fn get(&self, tokenizer: &Tokenizer) -> Result<Arc<Grammars>, ApiError> {
        self.built
            .get_or_init(|| {
                let started = std::time::Instant::now();
                let built = pagoda_engine::grammar_vocabulary(tokenizer)
                    .and_then(Grammars::new)
                    .map(Arc::new)
                    .map_err(|e| e.to_string());
                tracing::info!(
                    "structured output: token trie of {} tokens built in {:.0} ms (llguidance)",
                    tokenizer.vocab_size(),
                    started.elapsed().as_secs_f64() * 1e3
                );
                built
            })
            .clone()
            .map_err(|message| {
                ApiError::internal(format!(
                    "structured output is unavailable for this model's vocabulary: {message}"
                ))
            })
    }
}

/// A compile error of `field`'s spec as the 400 it is.
pub fn compile_error(field: &'static str, error: GrammarError) -> ApiError {
    ApiError::invalid(format!("`{field}`: {error}"), Some(field))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(body: Value) -> Result<Option<GrammarSpec>, ApiError> {
        let object = body.as_object().unwrap().clone();
        parse(&object).map(|found| found.map(|(spec, _)| spec))
    }

    #[test]
    fn every_spelling_reads_into_its_spec() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let openai = json!({"response_format": {"type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": true}}});
        assert_eq!(
            spec(openai).unwrap(),
            Some(GrammarSpec::JsonSchema(schema.clone()))
        );
        let json_mode = json!({"response_format": {"type": "json_object"}});
        assert_eq!(spec(json_mode).unwrap(), Some(GrammarSpec::JsonObject));
        assert_eq!(
            spec(json!({"response_format": {"type": "text"}})).unwrap(),
            None
        );
        assert_eq!(
            spec(json!({"json_schema": schema})).unwrap(),
            Some(GrammarSpec::JsonSchema(schema.clone()))
        );
        assert_eq!(
            spec(json!({"grammar": "root ::= \"a\""})).unwrap(),
            Some(GrammarSpec::Gbnf("root ::= \"a\"".into()))
        );
        let text_schema = serde_json::to_string(&schema).unwrap();
        assert_eq!(
            spec(json!({"guided_json": text_schema})).unwrap(),
            Some(GrammarSpec::JsonSchema(schema.clone()))
        );
        assert_eq!(
            spec(json!({"guided_regex": "[0-9]+"})).unwrap(),
            Some(GrammarSpec::Regex("[0-9]+".into()))
        );
        assert_eq!(
            spec(json!({"structured_outputs": {"choice": ["yes", "no"]}})).unwrap(),
            Some(GrammarSpec::Choice(vec!["yes".into(), "no".into()]))
        );
        assert_eq!(spec(json!({"temperature": 1})).unwrap(), None);
    }

    #[test]
    fn bad_specs_are_400s_naming_the_field() {
        let cases = [
            (
                json!({"response_format": {"type": "xml"}}),
                "response_format",
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format",
            ),
            (json!({"guided_choice": []}), "guided_choice"),
            (json!({"guided_regex": 5}), "guided_regex"),
            (
                json!({"structured_outputs": {"yaml": "x"}}),
                "structured_outputs",
            ),
            (
                json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}),
                "structured_outputs",
            ),
            (
                json!({"json_schema": {"type": "object"}, "grammar": "root ::= \"a\""}),
                "grammar",
            ),
        ];
        for (body, field) in cases {
            let error = spec(body.clone()).expect_err(&body.to_string());
            assert_eq!(error.param.as_deref(), Some(field), "{body}");
        }
    }
}
