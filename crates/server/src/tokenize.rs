//! The tokenizer over HTTP, as llama-server and vLLM offer it: `POST /tokenize` (a text, or
//! chat messages through the model's template) and `POST /detokenize`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::request::{field, parse_chat, parse_object};
use crate::routes::{body_error, chat_prompt};
use crate::AppState;

/// `POST /tokenize`. The text is llama-server's `content` (special tokens added only with
/// `add_special: true`) or vLLM's `prompt` (added unless `add_special_tokens: false`); or
/// `messages`, rendered by the chat template (with the assistant's opening unless
/// `add_generation_prompt: false`) and encoded as a chat request would be. `with_pieces:
/// true` gives `{"id", "piece"}` per token (the piece as text, or as its bytes when they are
/// not UTF-8). The answer: `tokens`, `count` and `max_model_len`.
pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let body = body.map_err(body_error)?;
        let object = parse_object(&body)?;
        let tokens = if object.contains_key("messages") {
            let request = parse_chat(&body, &state.config.sampling_defaults)?;
            let opening = field::<bool>(&object, "add_generation_prompt")?.unwrap_or(true);
            chat_prompt(&state, &request.messages, request.tools.as_ref(), opening)?
        } else {
            let (text, add_special) = match (
                field::<String>(&object, "content")?,
                field::<String>(&object, "prompt")?,
            ) {
                (Some(text), None) => (
                    text,
                    field::<bool>(&object, "add_special")?.unwrap_or(false),
                ),
                (None, Some(text)) => (
                    text,
                    field::<bool>(&object, "add_special_tokens")?.unwrap_or(true),
                ),
                _ => {
                    return Err(ApiError::invalid(
                        "give exactly one of `content` (a string), `prompt` (a string) or \
                         `messages`",
                        Some("content"),
                    ))
                }
            };
            state.tokenizer.encode(&text, add_special).map_err(|e| {
                ApiError::invalid(format!("tokenizing the text: {e}"), Some("content"))
            })?
        };
        let with_pieces = field::<bool>(&object, "with_pieces")?.unwrap_or(false);
        let listed: Vec<Value> = if with_pieces {
            tokens
                .iter()
                .map(|&id| {
                    let bytes = state.tokenizer.token_bytes(id);
                    let piece = match String::from_utf8(bytes) {
                        Ok(text) => json!(text),
                        Err(error) => json!(error.into_bytes()),
                    };
                    json!({ "id": id, "piece": piece })
                })
                .collect()
        } else {
            tokens.iter().map(|&id| json!(id)).collect()
        };
        Ok::<_, ApiError>(Json(json!({
            "tokens": listed,
            "count": tokens.len(),
            "max_model_len": state.config.context_size,
        })))
    }
    .await;
    result.map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}

/// `POST /detokenize`: `{"tokens": [ids]}` to `{"content": text}` (llama-server's key; vLLM's
/// `prompt` holds the same text). An id outside the vocabulary is a 400.
pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let body = body.map_err(body_error)?;
        let object = parse_object(&body)?;
        let tokens = field::<Vec<u64>>(&object, "tokens")?.ok_or_else(|| {
            ApiError::invalid(
                "`tokens` (an array of token ids) is required",
                Some("tokens"),
            )
        })?;
        let vocab = state.tokenizer.vocab_size();
        let ids = tokens
            .iter()
            .map(|&id| u32::try_from(id).ok().filter(|&id| (id as usize) < vocab))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| {
                ApiError::invalid(
                    format!("`tokens` holds an id outside the vocabulary (0..{vocab})"),
                    Some("tokens"),
                )
            })?;
        let text = state.tokenizer.decode(&ids);
        Ok::<_, ApiError>(Json(json!({ "content": text, "prompt": text })))
    }
    .await;
    result.map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}
