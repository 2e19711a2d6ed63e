//! The OpenAI API fields this server does not implement yet, in one place: a request that
//! sets one of them (to anything but its neutral value) gets a 400 naming it, rather than an
//! answer that silently ignores it. Fields no API defines stay ignored (clients send many).
//! `docs/api.md` lists the same fields (a test keeps the two equal).

use serde_json::{Map, Value};

use crate::error::ApiError;

/// Where a field belongs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions` only.
    Chat,
    /// `/v1/completions` only.
    Completion,
    /// Both.
    Both,
}

/// A refused field: its name, where it applies, when it counts as set and what to say.
pub struct Unsupported {
    /// The JSON field.
    pub name: &'static str,
    /// The endpoints that refuse it.
    pub endpoint: Endpoint,
    /// True when the value asks for the behaviour (null and neutral values pass).
    pub is_set: fn(&Value) -> bool,
    /// Why, or what to do instead.
    pub note: &'static str,
}

fn not_null(value: &Value) -> bool {
    !value.is_null()
}

fn non_empty(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::String(text) => !text.is_empty(),
        Value::Array(items) => !items.is_empty(),
        Value::Object(map) => !map.is_empty(),
        _ => true,
    }
}

fn not_none_choice(value: &Value) -> bool {
    !value.is_null() && value.as_str() != Some("none")
}

fn not_text_modalities(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Array(items) => items.iter().any(|item| item.as_str() != Some("text")),
        _ => true,
    }
}

/// Every refused field.
pub const UNSUPPORTED: &[Unsupported] = &[
    Unsupported {
        name: "suffix",
        endpoint: Endpoint::Completion,
        is_set: non_empty,
        note: "insertion (a suffix after the completion) is not implemented",
    },
    Unsupported {
        name: "functions",
        endpoint: Endpoint::Chat,
        is_set: non_empty,
        note: "the deprecated `functions` API is not supported; send them as `tools`",
    },
    Unsupported {
        name: "function_call",
        endpoint: Endpoint::Chat,
        is_set: not_none_choice,
        note: "the deprecated `function_call` is not supported; use `tool_choice`",
    },
    Unsupported {
        name: "modalities",
        endpoint: Endpoint::Chat,
        is_set: not_text_modalities,
        note: "only text output is supported",
    },
    Unsupported {
        name: "audio",
        endpoint: Endpoint::Chat,
        is_set: not_null,
        note: "audio output is not supported",
    },
    Unsupported {
        name: "prediction",
        endpoint: Endpoint::Chat,
        is_set: not_null,
        note: "predicted outputs are not supported",
    },
];

/// A 400 for the first refused field `object` sets on an endpoint of kind `chat`.
pub fn refuse_unsupported(object: &Map<String, Value>, chat: bool) -> Result<(), ApiError> {
    for field in UNSUPPORTED {
        let applies = match field.endpoint {
            Endpoint::Both => true,
            Endpoint::Chat => chat,
            Endpoint::Completion => !chat,
        };
        if !applies {
            continue;
        }
        if let Some(value) = object.get(field.name) {
            if (field.is_set)(value) {
                return Err(ApiError::invalid(
                    format!(
                        "`{}` is not supported by this server: {}; remove the field",
                        field.name, field.note
                    ),
                    Some(field.name),
                )
                .with_code("unsupported_field"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(body: Value, chat: bool) -> Result<(), ApiError> {
        refuse_unsupported(body.as_object().unwrap(), chat)
    }

    #[test]
    fn set_fields_are_refused_and_neutral_values_pass() {
        assert!(check(json!({"logit_bias": {"50256": -100}}), true).is_ok());
        // Structured output is read by `structured.rs`, not refused.
        assert!(check(json!({"response_format": {"type": "json_object"}}), true).is_ok());
        // Tools are read by `tools/`; the deprecated `functions` API is refused.
        assert!(check(json!({"tools": [{"type": "function"}]}), true).is_ok());
        assert!(check(json!({"functions": [{"name": "f"}]}), true).is_err());
        assert!(check(json!({"function_call": "none"}), true).is_ok());
        assert!(check(json!({"modalities": ["text"]}), true).is_ok());
        assert!(check(json!({"modalities": ["text", "audio"]}), true).is_err());
        assert!(check(json!({"grammar": "root ::= \"a\""}), false).is_ok());
        // Endpoint-specific fields are only refused where they mean something.
        assert!(check(json!({"echo": true}), true).is_ok());
        assert!(check(json!({"functions": [{"name": "f"}]}), false).is_ok());
        // Fields no API defines stay ignored.
        assert!(check(json!({"x_client_trace": "abc"}), true).is_ok());
    }

    #[test]
    fn the_docs_list_every_refused_field() {
        let docs = include_str!("../../../docs/api.md");
        for field in UNSUPPORTED {
            assert!(
                docs.contains(&format!("`{}`", field.name)),
                "docs/api.md does not list `{}`",
                field.name
            );
        }
    }
}
