//! The HTTP handlers: chat and text completions (streamed and not), models, health, metrics;
//! the API-key and request-counting middleware.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::connect_info::ConnectInfo;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::sse::Sse;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use axum::Json;
use serde_json::{json, Value};

use crate::access::{self, AccessLog, Client};
use crate::answer::{event_stream, whole, Choices};
use crate::auth::ClientAddr;
use crate::error::ApiError;
use crate::format::{Kind, Reply};
use crate::request::{parse_chat, parse_completion, Message, Options, Prompt};
use crate::session::Session;
use crate::tools::parser::ToolCallParser;
use crate::tools::{ToolFormat, Tools};
use crate::worker::Job;
use crate::AppState;

type Shared = State<Arc<AppState>>;

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(state): Shared,
    client: Option<Extension<Client>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let body = body.map_err(body_error)?;
        let mut request = parse_chat(&body, &state.config.sampling_defaults)?;
        if let Some(tools) = &request.tools {
            let format = tool_format(&state)?;
            if tools.parses() {
                request.options.tool_format = Some(format);
            }
            if let Some(grammar) = tools.grammar(format) {
                request.options.grammar = Some((grammar, "tool_choice"));
            }
        }
        let prompt = chat_prompt(&state, &request.messages, request.tools.as_ref(), true)?;
        let client = client.as_ref().map(|c| &c.0);
        generate(&state, (Kind::Chat, client), prompt, request.options).await
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

/// How the served model writes tool calls; a 400 saying how to give it tools when its chat
/// template shows none.
fn tool_format(state: &AppState) -> Result<ToolFormat, ApiError> {
    state.tool_format.ok_or_else(|| {
        let why = if state.chat_template.reads_variable("tools") {
            "its tool-call format is not known; start the server with `--tool-call-parser \
             hermes` or `llama3_json`"
        } else {
            "its chat template does not show tools to the model; start the server with \
             `--chat-template-file` of a tool-capable template"
        };
        ApiError::invalid(
            format!("this model cannot take `tools`: {why}"),
            Some("tools"),
        )
        .with_code("unsupported_field")
    })
}

/// The prompt tokens of `messages`: rendered by the chat template with the request's tools
/// (and the assistant's opening when `opening`), then encoded as a chat prompt.
pub(crate) fn chat_prompt(
    state: &AppState,
    messages: &[Message],
    tools: Option<&Tools>,
    opening: bool,
) -> Result<Vec<u32>, ApiError> {
    let rendered = render_chat(state, messages, tools, opening)?;
    state
        .tokenizer
        .encode_chat(&rendered)
        .map_err(|e| ApiError::invalid(format!("tokenizing the messages: {e}"), Some("messages")))
}

/// `messages` rendered by the chat template with the request's tools (with the assistant's
/// opening when `opening`).
pub(crate) fn render_chat(
    state: &AppState,
    messages: &[Message],
    tools: Option<&Tools>,
    opening: bool,
) -> Result<String, ApiError> {
    state
        .chat_template
        .render_with_tools(messages, tools.map(|tools| &tools.list), opening)
        .map_err(|e| ApiError::invalid(format!("the chat template failed: {e}"), Some("messages")))
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): Shared,
    client: Option<Extension<Client>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let body = body.map_err(body_error)?;
        let mut request = parse_completion(&body, &state.config.sampling_defaults)?;
        let prompt = match &request.prompt {
            Prompt::Text(text) => state.tokenizer.encode(text, true).map_err(|e| {
                ApiError::invalid(format!("tokenizing the prompt: {e}"), Some("prompt"))
            })?,
            Prompt::Tokens(tokens) => {
                let vocab_size = state.tokenizer.vocab_size();
                if let Some(&token) = tokens.iter().find(|&&t| t as usize >= vocab_size) {
                    return Err(ApiError::invalid(
                        format!(
                            "prompt token id {token} is outside the vocabulary (size {vocab_size})"
                        ),
                        Some("prompt"),
                    ));
                }
                tokens.clone()
            }
        };
        if request.echo {
            request.options.echo = Some(match request.prompt {
                Prompt::Text(text) => text,
                Prompt::Tokens(tokens) => state.tokenizer.decode(&tokens),
            });
        }
        let client = client.as_ref().map(|c| &c.0);
        generate(&state, (Kind::Completion, client), prompt, request.options).await
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

/// `GET /v1/models`.
pub async fn models(State(state): Shared) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.config.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "pagoda",
            "meta": { "n_ctx": state.config.context_size },
        }],
    }))
}

/// `GET /v1/models/{id}`: the served model under any of its names, else a 404.
pub async fn model(State(state): Shared, Path(id): Path<String>) -> Response {
    if !state.config.accepts_model(&id) {
        return ApiError::model_not_found(&id, &state.config.model_name).into_response();
    }
    Json(json!({
        "id": state.config.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "pagoda",
        "meta": { "n_ctx": state.config.context_size },
    }))
    .into_response()
}

/// `GET /health`: 200 `{"status": "ok"}` when ready; 503 with `draining`, or with
/// `loading` and the warm-up's stage as `reason`, or `error` and why the warm-up failed.
pub async fn health(State(state): Shared) -> Response {
    if state.drain.is_draining() {
        let body = Json(json!({ "status": "draining" }));
        return (StatusCode::SERVICE_UNAVAILABLE, body).into_response();
    }
    if let Err(not_ready) = state.worker.readiness().check() {
        let body = Json(json!({ "status": not_ready.status, "reason": not_ready.reason }));
        return (StatusCode::SERVICE_UNAVAILABLE, body).into_response();
    }
    Json(json!({ "status": "ok" })).into_response()
}

/// `GET /metrics`.
pub async fn metrics(State(state): Shared) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}

/// A 405 in the OpenAI format for a known path asked with the wrong method.
pub async fn method_not_allowed(request: Request) -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        ..ApiError::invalid(
            format!(
                "{} does not take {} requests",
                request.uri().path(),
                request.method()
            ),
            None,
        )
    }
}

/// A 404 in the OpenAI format for unknown paths.
pub async fn not_found(request: Request) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        ..ApiError::invalid(
            format!("no route for {} {}", request.method(), request.uri().path()),
            None,
        )
    }
}

/// Counts answered requests by path and status.
pub async fn count_requests(State(state): Shared, mut request: Request, next: Next) -> Response {
    let started = std::time::Instant::now();
    let path = request.uri().path().to_owned();
    let method = request.method().clone();
    let client = request
        .extensions()
        .get::<ConnectInfo<ClientAddr>>()
        .map_or_else(|| "-".to_owned(), |info| info.0.to_string());
    request.extensions_mut().insert(Client(client.clone()));
    let response = next.run(request).await;
    let status = response.status();
    // Generation requests answered 200 log when they end (with their tokens); probes of
    // /health and /metrics that succeed are not logged.
    let quiet = status == StatusCode::OK
        && matches!(
            path.as_str(),
            "/v1/chat/completions" | "/v1/completions" | "/health" | "/metrics"
        );
    if !quiet {
        access::answered(&client, method.as_str(), &path, status.as_u16(), started);
    }
    let endpoint = match path.as_str() {
        "/v1/chat/completions"
        | "/v1/completions"
        | "/v1/models"
        | "/health"
        | "/metrics"
        | "/tokenize"
        | "/detokenize" => path.as_str(),
        models if models.starts_with("/v1/models/") => "/v1/models/{id}",
        _ => "other",
    };
    state
        .metrics
        .record_request(endpoint, response.status().as_u16());
    response
}

pub(crate) fn body_error(rejection: BytesRejection) -> ApiError {
    let status = rejection.status();
    let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
        "the request body is too large".to_owned()
    } else {
        format!("reading the request body: {}", rejection.body_text())
    };
    ApiError {
        status,
        ..ApiError::invalid(message, None)
    }
}

/// Checks the model and the context, queues the request, answers streamed or whole.
async fn generate(
    state: &Arc<AppState>,
    (kind, client): (Kind, Option<&Client>),
    prompt: Vec<u32>,
    options: Options,
) -> Result<Response, ApiError> {
    if let Some(model) = &options.model {
        if !state.config.accepts_model(model) {
            return Err(ApiError::model_not_found(model, &state.config.model_name));
        }
    }
    let sparse_attention =
        crate::sparse::resolve(&options.sparse_attention, state.sparse_attention)?;
    let in_flight = state.drain.enter()?;
    let prompt_tokens = prompt.len();
    if prompt_tokens == 0 {
        return Err(ApiError::invalid(
            "the prompt is empty (it encodes to no tokens)",
            Some("prompt"),
        ));
    }
    let context = state.config.context_size;
    let max_tokens = match options.max_tokens {
        Some(max_tokens) if prompt_tokens + max_tokens > context => {
            return Err(ApiError::invalid(
                format!(
                    "this model's context is {context} tokens, but the prompt has {prompt_tokens} tokens \
                     and max_tokens asks for {max_tokens} more ({} in all); shorten the prompt or lower max_tokens",
                    prompt_tokens + max_tokens
                ),
                Some("max_tokens"),
            )
            .with_code("context_length_exceeded"))
        }
        Some(max_tokens) => max_tokens,
        None if prompt_tokens >= context => {
            return Err(ApiError::invalid(
                format!(
                    "the prompt has {prompt_tokens} tokens, which leaves no room in this model's context of {context} tokens"
                ),
                Some("messages"),
            )
            .with_code("context_length_exceeded"))
        }
        None => context - prompt_tokens,
    };
    // Each choice is a job of its own; they share the prompt's pages through the prefix
    // cache. With a seed, choice `i` samples with `seed + i`. `best_of` ranks candidates by
    // their tokens' log-probabilities, so it asks for them even when the answer does not.
    let count = options.best_of.max(options.n);
    let top_logprobs = match options.logprobs {
        None if count > options.n => Some(0),
        asked => asked,
    };
    let stop_tokens = if options.ignore_eos {
        Vec::new()
    } else {
        state.stop_tokens.clone()
    };
    // One constraint per choice, compiled (or cloned from the cache) before anything runs,
    // so a bad schema is a 400.
    let grammars = match &options.grammar {
        Some(_) => Some(state.grammars.get(&state.tokenizer)?),
        None => None,
    };
    let mut choices = Choices::new(options.n);
    for index in 0..count {
        let constraint = match (&grammars, &options.grammar) {
            (Some(grammars), Some((spec, field))) => Some(Box::new(
                grammars
                    .constraint(spec)
                    .map_err(|e| crate::structured::compile_error(field, e))?,
            )),
            _ => None,
        };
        let (sender, receiver) = tokio::sync::mpsc::unbounded_channel();
        let mut params = options.sampling;
        params.seed = params.seed.map(|seed| seed.wrapping_add(index as u64));
        state.worker.submit(Job {
            prompt: prompt.clone(),
            params,
            max_new_tokens: max_tokens,
            stop_tokens: stop_tokens.clone(),
            top_logprobs,
            logit_bias: options.logit_bias.clone(),
            constraint,
            sparse_attention,
            events: sender,
        })?;
        let mut session = Session::new(
            state.tokenizer.clone(),
            stop_tokens.clone(),
            options.stop.clone(),
        );
        if let Some(format) = options.tool_format {
            session = session.with_tools(ToolCallParser::new(format, call_id_prefix(index)));
        }
        choices.push(receiver, session);
    }
    state.metrics.prompt_tokens.add(prompt_tokens as u64);
    let reply = Reply {
        kind,
        id: state.next_id(kind),
        created: now_seconds(),
        model: state.config.model_name.clone(),
        prompt_tokens,
        want_logprobs: options.logprobs.is_some(),
        echo: options.echo.clone().unwrap_or_default(),
    };
    let endpoint = match kind {
        Kind::Chat => "/v1/chat/completions",
        Kind::Completion => "/v1/completions",
    };
    let log = AccessLog::new(client, endpoint, &reply.id, prompt_tokens);
    if options.stream {
        let stream = event_stream(reply, choices, options.include_usage, (in_flight, log));
        Ok(Sse::new(stream).into_response())
    } else {
        whole(reply, choices, (in_flight, log)).await
    }
}

/// The prefix of the tool-call ids of choice `index`: random (ids must not repeat across
/// requests; they name calls in the conversation), then the choice.
fn call_id_prefix(index: usize) -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_usize(index);
    format!("{:012x}{index}", hasher.finish() & 0xffff_ffff_ffff)
}

fn now_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
