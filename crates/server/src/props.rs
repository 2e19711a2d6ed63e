//! llama-server's introspection endpoints: `GET /props` (the served model's settings, which
//! web UIs and clients read at start), `GET /slots` (what each of the `--parallel` sequences
//! runs now) and `POST /apply-template` (messages rendered by the chat template, without
//! generating).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::request::{field, parse_chat, parse_object};
use crate::routes::{body_error, render_chat};
use crate::AppState;

/// `GET /slots`: one entry per `--parallel` slot, in llama-server's field names: `id`,
/// `n_ctx`, `is_processing`, `id_task` (the running request's engine id, -1 when idle),
/// `n_prompt_tokens`, `next_token.n_decoded` and `params.seed`.
pub async fn slots(State(state): State<Arc<AppState>>) -> Json<Value> {
    let n_ctx = state.config.context_size;
    let slots: Vec<Value> = state
        .worker
        .slots()
        .iter()
        .map(|slot| {
            json!({
                "id": slot.id,
                "id_task": slot.request.map_or(-1, |id| id as i64),
                "n_ctx": n_ctx,
                "is_processing": slot.request.is_some(),
                "n_prompt_tokens": slot.prompt_tokens,
                "next_token": { "n_decoded": slot.decoded },
                "params": { "seed": slot.seed },
            })
        })
        .collect();
    Json(Value::Array(slots))
}

/// `GET /props`: the request defaults (`default_generation_settings`, with the context size
/// as `n_ctx` and `params.n_predict` -1: no max_tokens), the sequences run at once (`total_slots`), the served name, the chat
/// template's source and its BOS/EOS texts, in llama-server's field names.
pub async fn props(State(state): State<Arc<AppState>>) -> Json<Value> {
    let config = &state.config;
    let defaults = &config.sampling_defaults;
    Json(json!({
        "default_generation_settings": {
            "n_ctx": config.context_size,
            "params": {
                "temperature": defaults.temperature,
                "top_k": defaults.top_k,
                "top_p": defaults.top_p,
                "min_p": defaults.min_p,
                "repeat_penalty": defaults.repetition_penalty,
                "repeat_last_n": defaults.penalty_last_n,
                "frequency_penalty": defaults.frequency_penalty,
                "presence_penalty": defaults.presence_penalty,
                "seed": defaults.seed,
                // llama-server's "until the context ends": a request without max_tokens
                // generates up to the rest of the context.
                "n_predict": -1,
            },
        },
        "total_slots": config.parallel,
        "model_alias": config.model_name,
        "chat_template": state.chat_template.source(),
        "bos_token": state.chat_template.bos_token(),
        "eos_token": state.chat_template.eos_token(),
        "build_info": concat!("pagoda ", env!("CARGO_PKG_VERSION")),
    }))
}

/// `POST /apply-template`: `{"messages": [...]}` rendered by the chat template, with the
/// assistant's opening unless `add_generation_prompt: false`, as `{"prompt": TEXT}` (the text
/// a chat request would tokenize).
pub async fn apply_template(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let body = body.map_err(body_error)?;
        let object = parse_object(&body)?;
        let request = parse_chat(&body, &state.config.sampling_defaults)?;
        let opening = field::<bool>(&object, "add_generation_prompt")?.unwrap_or(true);
        let prompt = render_chat(&state, &request.messages, request.tools.as_ref(), opening)?;
        Ok::<_, ApiError>(Json(json!({ "prompt": prompt })))
    }
    .await;
    result
        .map(IntoResponse::into_response)
        .unwrap_or_else(IntoResponse::into_response)
}
