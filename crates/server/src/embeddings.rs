//! `POST /v1/embeddings` (and llama-server's `/embeddings`): each input's vector is the
//! served model's last hidden states after the final norm, mean-pooled over the input's tokens
//! and L2-normalised, as llama-server's `--embedding` with mean pooling. Inputs are a string,
//! an array of strings, an array of token ids or an array of such arrays (the OpenAI forms;
//! strings and id arrays may mix, as llama-server allows);
//! `encoding_format` is `float` or `base64` (little-endian f32 bytes, what the official
//! Python client asks for by default).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::request::{field, parse_object};
use crate::routes::body_error;
use crate::worker::EmbedJob;
use crate::AppState;

/// Most inputs one request may hold (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;

/// How the vectors are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Encoding {
    Float,
    Base64,
}

/// `POST /v1/embeddings`.
pub async fn embeddings(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let body = body.map_err(body_error)?;
        let object = parse_object(&body)?;
        if let Some(model) = field::<String>(&object, "model")? {
            if !state.config.accepts_model(&model) {
                return Err(ApiError::model_not_found(&model, &state.config.model_name));
            }
        }
        let encoding = match field::<String>(&object, "encoding_format")?.as_deref() {
            None | Some("float") => Encoding::Float,
            Some("base64") => Encoding::Base64,
            Some(other) => {
                return Err(ApiError::invalid(
                    format!("`encoding_format` must be \"float\" or \"base64\", not {other:?}"),
                    Some("encoding_format"),
                ))
            }
        };
        if object.get("dimensions").is_some_and(|v| !v.is_null()) {
            return Err(ApiError::invalid(
                "`dimensions` is not supported: the vectors have the model's hidden size",
                Some("dimensions"),
            ));
        }
        let inputs = inputs(&state, &object)?;
        let prompt_tokens: usize = inputs.iter().map(Vec::len).sum();
        let _in_flight = state.drain.enter()?;
        let (sender, receiver) = tokio::sync::oneshot::channel();
        state.worker.submit_embedding(EmbedJob {
            inputs,
            reply: sender,
        })?;
        let vectors = receiver
            .await
            .map_err(|_| ApiError::internal("the engine loop stopped before answering"))??;
        state.metrics.prompt_tokens.add(prompt_tokens as u64);
        let data: Vec<Value> = vectors
            .iter()
            .enumerate()
            .map(|(index, vector)| {
                json!({
                    "object": "embedding",
                    "index": index,
                    "embedding": encode(vector, encoding),
                })
            })
            .collect();
        Ok::<_, ApiError>(Json(json!({
            "object": "list",
            "data": data,
            "model": state.config.model_name,
            "usage": { "prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens },
        })))
    }
    .await;
    result.map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}

fn encode(vector: &[f32], encoding: Encoding) -> Value {
    match encoding {
        Encoding::Float => json!(vector),
        Encoding::Base64 => {
            let bytes: Vec<u8> = vector.iter().flat_map(|v| v.to_le_bytes()).collect();
            json!(base64::engine::general_purpose::STANDARD.encode(bytes))
        }
    }
}

/// The token ids of every input, checked: none empty, each inside the vocabulary and the
/// context, at most [`MAX_INPUTS`] of them.
fn inputs(state: &AppState, object: &Map<String, Value>) -> Result<Vec<Vec<u32>>, ApiError> {
    let bad = |message: String| ApiError::invalid(message, Some("input"));
    let shape = "`input` must be a string, an array of strings, an array of token ids or an \
                 array of arrays of token ids";
    let encode = |text: &str| {
        state
            .tokenizer
            .encode(text, true)
            .map_err(|e| bad(format!("tokenizing the input: {e}")))
    };
    let ids = |values: &[Value]| -> Option<Vec<u64>> { values.iter().map(Value::as_u64).collect() };
    let inputs: Vec<Vec<u64>> = match object.get("input") {
        None | Some(Value::Null) => return Err(bad("`input` is required".into())),
        Some(Value::String(text)) => vec![widen(encode(text)?)],
        Some(Value::Array(items)) if items.is_empty() => {
            return Err(bad("`input` is an empty array".into()))
        }
        Some(Value::Array(items)) if items.iter().all(Value::is_number) => {
            vec![ids(items)
                .ok_or_else(|| bad(format!("{shape}; a token id is not a whole number")))?]
        }
        // Strings and arrays of ids may mix, as llama-server takes them.
        Some(Value::Array(items)) if items.iter().all(|i| i.is_string() || i.is_array()) => items
            .iter()
            .map(|item| match item {
                Value::String(text) => encode(text).map(widen),
                list => ids(list.as_array().map(Vec::as_slice).unwrap_or_default())
                    .ok_or_else(|| bad(format!("{shape}; a token id is not a whole number"))),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(bad(shape.into())),
    };
    if inputs.len() > MAX_INPUTS {
        return Err(bad(format!(
            "`input` holds {} inputs; at most {MAX_INPUTS} per request",
            inputs.len()
        )));
    }
    let vocab = state.tokenizer.vocab_size();
    let context = state.config.context_size;
    inputs
        .into_iter()
        .enumerate()
        .map(|(index, tokens)| {
            if tokens.is_empty() {
                return Err(bad(format!(
                    "input {index} is empty (it encodes to no tokens)"
                )));
            }
            if tokens.len() > context {
                return Err(bad(format!(
                    "input {index} has {} tokens, more than this model's context of {context} \
                     tokens; shorten it",
                    tokens.len()
                ))
                .with_code("context_length_exceeded"));
            }
            tokens
                .iter()
                .map(|&id| u32::try_from(id).ok().filter(|&id| (id as usize) < vocab))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| {
                    bad(format!(
                        "input {index} holds a token id outside the vocabulary (0..{vocab})"
                    ))
                })
        })
        .collect()
}

fn widen(tokens: Vec<u32>) -> Vec<u64> {
    tokens.into_iter().map(u64::from).collect()
}
