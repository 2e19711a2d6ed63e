//! Parsing and validating OpenAI request bodies into what the engine needs.
//!
//! Bodies are parsed to a JSON object first (malformed JSON is a 400), then each known field
//! is read with its type checked, so an error names the field. Unknown fields are ignored
//! (clients send many).

use pagoda_grammar::GrammarSpec;
use pagoda_ops::sampling::SamplingParams;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::unsupported::refuse_unsupported;

/// The chat roles of the OpenAI API (`developer` is its newer name for `system`); any other
/// role is a 400, as OpenAI answers.
pub const ROLES: &[&str] = &[
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];

/// Most stop strings one request may give.
pub const MAX_STOP_STRINGS: usize = 16;
/// Most alternatives `top_logprobs` may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Most choices (`n`, and `best_of` candidates) one request may ask for: each is a sequence
/// in the engine.
pub const MAX_CHOICES: usize = 16;

/// The prompt of a completions request.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Text to tokenize (with the model's BOS).
    Text(String),
    /// Token ids, used as given.
    Tokens(Vec<u32>),
}

/// One chat message: role, text content (parts of type `text` joined), and an assistant's
/// tool calls or the call a tool message answers.
pub use pagoda_models::chat_template::ChatMessage as Message;

/// The options shared by both endpoints, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// The `model` field, when given.
    pub model: Option<String>,
    /// Stream server-sent events.
    pub stream: bool,
    /// Send a final usage chunk in the stream (`stream_options.include_usage`).
    pub include_usage: bool,
    /// `max_completion_tokens` or `max_tokens` (at least 1), when given.
    pub max_tokens: Option<usize>,
    /// Stop strings (non-empty).
    pub stop: Vec<String>,
    /// Validated sampling parameters (server defaults where a field is absent).
    pub sampling: SamplingParams,
    /// `Some(n)`: return log-probabilities with `n` alternatives per token.
    pub logprobs: Option<usize>,
    /// `ignore_eos` (a vLLM and llama.cpp extension): keep generating past end-of-generation
    /// tokens until `max_tokens` (benchmarks use it for fixed-length answers).
    pub ignore_eos: bool,
    /// `logit_bias`: `(token, bias)` added to the logits before each draw (-100 bans).
    pub logit_bias: Vec<(u32, f32)>,
    /// The text the answer starts with (completions' `echo`: the prompt's text).
    pub echo: Option<String>,
    /// `n`: choices to return (1..=[`MAX_CHOICES`]), each its own sequence sharing the
    /// prompt's pages; with a `seed`, choice `i` samples with `seed + i`.
    pub n: usize,
    /// Completions' `best_of`: candidates to generate (`n..=MAX_CHOICES`), of which the `n`
    /// with the highest log-probability per token are returned; `n` when not given.
    pub best_of: usize,
    /// Structured output: the grammar the answer must follow and the field that asked for it
    /// (`response_format`, `json_schema`, `grammar`, vLLM's fields; see `structured.rs`).
    pub grammar: Option<(GrammarSpec, &'static str)>,
    /// Read tool calls out of the answer in this format (chat requests with `tools`).
    pub tool_format: Option<crate::tools::ToolFormat>,
    /// `sparse_attention` as given (see `sparse.rs`; the handler fills the keys it leaves
    /// out from the server's setting).
    pub sparse_attention: crate::sparse::SparseRequest,
}

/// A parsed `POST /v1/chat/completions` body.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    /// The conversation (at least one message).
    pub messages: Vec<Message>,
    /// The tools the model may call (`tools`, `tool_choice`, `parallel_tool_calls`).
    pub tools: Option<crate::tools::Tools>,
    /// Everything else.
    pub options: Options,
}

/// A parsed `POST /v1/completions` body.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    /// The prompt.
    pub prompt: Prompt,
    /// `echo`: the answer's text starts with the prompt's.
    pub echo: bool,
    /// Everything else.
    pub options: Options,
}

/// Parses a chat request; `defaults` are the server's sampling defaults.
pub fn parse_chat(body: &[u8], defaults: &SamplingParams) -> Result<ChatRequest, ApiError> {
    let object = parse_object(body)?;
    refuse_unsupported(&object, true)?;
    let messages_value = object
        .get("messages")
        .ok_or_else(|| ApiError::invalid("`messages` is required", Some("messages")))?;
    let raw: Vec<RawMessage> = serde_path_to_error::deserialize(messages_value).map_err(|e| {
        let path = e.path().to_string();
        ApiError::invalid(
            format!("messages{}: {}", display_path(&path), e.inner()),
            Some("messages"),
        )
    })?;
    if raw.is_empty() {
        return Err(ApiError::invalid(
            "`messages` is empty; send at least one message",
            Some("messages"),
        ));
    }
    let messages = raw
        .into_iter()
        .enumerate()
        .map(|(index, message)| message.into_message(index))
        .collect::<Result<Vec<_>, _>>()?;
    let mut options = parse_options(&object, defaults)?;
    if let Some(true) = field::<bool>(&object, "logprobs")? {
        let top = field::<i64>(&object, "top_logprobs")?.unwrap_or(0);
        options.logprobs = Some(check_top_logprobs(top, "top_logprobs")?);
    } else if field::<i64>(&object, "top_logprobs")?.is_some_and(|n| n > 0) {
        return Err(ApiError::invalid(
            "`top_logprobs` needs `logprobs: true`",
            Some("top_logprobs"),
        ));
    }
    if let Some(n) = field::<i64>(&object, "max_completion_tokens")? {
        options.max_tokens = Some(check_max_tokens(n, "max_completion_tokens")?);
    }
    let tools = crate::tools::parse(&object)?;
    if let (Some(tools), Some((_, field))) = (&tools, &options.grammar) {
        if tools.parses() {
            return Err(ApiError::invalid(
                format!(
                    "`{field}` with `tools` is not supported: a tool call and a constrained \
                     answer need one grammar of both; drop one, or set `tool_choice: \"none\"`"
                ),
                Some(field),
            )
            .with_code("unsupported_field"));
        }
    }
    Ok(ChatRequest {
        messages,
        tools,
        options,
    })
}

/// Parses a completions request; `defaults` are the server's sampling defaults.
pub fn parse_completion(
    body: &[u8],
    defaults: &SamplingParams,
) -> Result<CompletionRequest, ApiError> {
    let object = parse_object(body)?;
    refuse_unsupported(&object, false)?;
    let prompt = match object.get("prompt") {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid("`prompt` is required", Some("prompt")))
        }
        Some(value) => parse_prompt(value)?,
    };
    let mut options = parse_options(&object, defaults)?;
    // Completions: `logprobs` is the number of alternatives (0..=5 at OpenAI).
    if let Some(n) = field::<i64>(&object, "logprobs")? {
        options.logprobs = Some(check_top_logprobs(n, "logprobs")?);
    }
    if let Some(best_of) = field::<i64>(&object, "best_of")? {
        let n = options.n;
        if best_of < n as i64 || best_of > MAX_CHOICES as i64 {
            return Err(ApiError::invalid(
                format!("`best_of` must be between `n` ({n}) and {MAX_CHOICES}, got {best_of}"),
                Some("best_of"),
            ));
        }
        options.best_of = best_of as usize;
        if options.stream && options.best_of > n {
            return Err(ApiError::invalid(
                "`best_of` above `n` cannot be streamed (the best are known only at the end); \
                 drop `stream` or `best_of`",
                Some("best_of"),
            ));
        }
    }
    let echo = field::<bool>(&object, "echo")?.unwrap_or(false);
    if echo && options.logprobs.is_some() {
        return Err(ApiError::invalid(
            "`echo` with `logprobs` would need the prompt's log-probabilities, which this \
             server does not compute; ask for one or the other",
            Some("echo"),
        )
        .with_code("unsupported_field"));
    }
    Ok(CompletionRequest {
        prompt,
        echo,
        options,
    })
}

pub(crate) fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}"), None))?;
    match value {
        Value::Object(object) => Ok(object),
        other => Err(ApiError::invalid(
            format!(
                "the request body must be a JSON object, got {}",
                json_kind(&other)
            ),
            None,
        )),
    }
}

fn parse_prompt(value: &Value) -> Result<Prompt, ApiError> {
    let invalid = |message: &str| ApiError::invalid(message, Some("prompt"));
    match value {
        Value::String(text) => Ok(Prompt::Text(text.clone())),
        Value::Array(items) if items.is_empty() => Err(invalid("`prompt` is an empty array")),
        Value::Array(items) => {
            if items.iter().all(Value::is_string) {
                if items.len() > 1 {
                    return Err(invalid(
                        "several prompts in one request are not supported; send one prompt per request",
                    ));
                }
                return Ok(Prompt::Text(
                    items[0].as_str().unwrap_or_default().to_owned(),
                ));
            }
            let tokens = items
                .iter()
                .map(|item| item.as_u64().and_then(|id| u32::try_from(id).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| {
                    invalid("`prompt` must be a string, an array of one string, or an array of token ids")
                })?;
            Ok(Prompt::Tokens(tokens))
        }
        other => Err(invalid(&format!(
            "`prompt` must be a string or an array, got {}",
            json_kind(other)
        ))),
    }
}

fn parse_options(
    object: &Map<String, Value>,
    defaults: &SamplingParams,
) -> Result<Options, ApiError> {
    let model = field::<String>(object, "model")?;
    let stream = field::<bool>(object, "stream")?.unwrap_or(false);
    let include_usage = match object.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(options)) => field::<bool>(options, "include_usage")
            .map_err(|e| ApiError {
                param: Some("stream_options.include_usage".into()),
                ..e
            })?
            .unwrap_or(false),
        Some(other) => {
            return Err(ApiError::invalid(
                format!(
                    "`stream_options` must be an object, got {}",
                    json_kind(other)
                ),
                Some("stream_options"),
            ))
        }
    };
    let ignore_eos = field::<bool>(object, "ignore_eos")?.unwrap_or(false);
    let max_tokens = field::<i64>(object, "max_tokens")?
        .map(|n| check_max_tokens(n, "max_tokens"))
        .transpose()?;
    let stop = match object.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(stop)) => vec![stop.clone()],
        Some(Value::Array(items)) => {
            let stops = items
                .iter()
                .map(|item| item.as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    ApiError::invalid(
                        "`stop` must be a string or an array of strings",
                        Some("stop"),
                    )
                })?;
            if stops.len() > MAX_STOP_STRINGS {
                return Err(ApiError::invalid(
                    format!(
                        "`stop` has {} strings; at most {MAX_STOP_STRINGS} are allowed",
                        stops.len()
                    ),
                    Some("stop"),
                ));
            }
            stops
        }
        Some(other) => {
            return Err(ApiError::invalid(
                format!(
                    "`stop` must be a string or an array of strings, got {}",
                    json_kind(other)
                ),
                Some("stop"),
            ))
        }
    };
    let n = match field::<i64>(object, "n")? {
        None => 1,
        Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => n as usize,
        Some(n) => {
            return Err(ApiError::invalid(
                format!("`n` must be between 1 and {MAX_CHOICES}, got {n}"),
                Some("n"),
            ))
        }
    };
    let mut sampling = *defaults;
    if let Some(value) = field::<f32>(object, "temperature")? {
        sampling.temperature = value;
    }
    if let Some(value) = field::<f32>(object, "top_p")? {
        sampling.top_p = value;
    }
    if let Some(value) = field::<i64>(object, "top_k")? {
        sampling.top_k = usize::try_from(value).map_err(|_| {
            ApiError::invalid(
                format!("`top_k` must be 0 (off) or more, got {value}"),
                Some("top_k"),
            )
        })?;
    }
    if let Some(value) = field::<f32>(object, "min_p")? {
        sampling.min_p = value;
    }
    if let Some(value) = field::<f32>(object, "frequency_penalty")? {
        sampling.frequency_penalty = value;
    }
    if let Some(value) = field::<f32>(object, "presence_penalty")? {
        sampling.presence_penalty = value;
    }
    if let Some(value) = field::<f32>(object, "repeat_penalty")? {
        sampling.repetition_penalty = value;
    }
    if let Some(value) = field::<i64>(object, "seed")? {
        // OpenAI seeds are signed; the bits are the seed.
        sampling.seed = Some(value as u64);
    }
    sampling.validate().map_err(|error| {
        let param = match error.field {
            "repetition_penalty" => "repeat_penalty",
            field => field,
        };
        ApiError::invalid(error.to_string(), Some(param))
    })?;
    let logit_bias = parse_logit_bias(object)?;
    let grammar = crate::structured::parse(object)?;
    let sparse_attention = crate::sparse::parse(object)?;
    Ok(Options {
        model,
        stream,
        include_usage,
        max_tokens,
        stop,
        sampling,
        logprobs: None,
        ignore_eos,
        logit_bias,
        echo: None,
        n,
        best_of: n,
        grammar,
        tool_format: None,
        sparse_attention,
    })
}

/// `logit_bias`: `{"token id": bias}`, biases in [-100, 100] (the engine checks the ids
/// against the vocabulary).
fn parse_logit_bias(object: &Map<String, Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(map) = field::<Map<String, Value>>(object, "logit_bias")? else {
        return Ok(Vec::new());
    };
    map.iter()
        .map(|(key, value)| {
            let token = key.trim().parse::<u32>().map_err(|_| {
                ApiError::invalid(
                    format!("`logit_bias` keys are token ids, got {key:?}"),
                    Some("logit_bias"),
                )
            })?;
            let bias = value
                .as_f64()
                .filter(|bias| bias.is_finite() && (-100.0..=100.0).contains(bias))
                .ok_or_else(|| {
                    ApiError::invalid(
                        format!(
                            "`logit_bias` values are numbers in [-100, 100], got {value} for \
                             token {token}"
                        ),
                        Some("logit_bias"),
                    )
                })?;
            Ok((token, bias as f32))
        })
        .collect()
}

/// Reads field `name` as a `T`; absent or null is `None`; a wrong type is a 400 naming it.
pub(crate) fn field<T: DeserializeOwned>(
    object: &Map<String, Value>,
    name: &str,
) -> Result<Option<T>, ApiError> {
    match object.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(value) => T::deserialize(value).map(Some).map_err(|e| {
            ApiError::invalid(
                format!(
                    "`{name}` has the wrong type or value ({}): {e}",
                    json_kind(value)
                ),
                Some(name),
            )
        }),
    }
}

fn check_max_tokens(n: i64, name: &str) -> Result<usize, ApiError> {
    if n < 1 {
        return Err(ApiError::invalid(
            format!("`{name}` must be at least 1, got {n}"),
            Some(name),
        ));
    }
    usize::try_from(n)
        .map_err(|_| ApiError::invalid(format!("`{name}` is too large: {n}"), Some(name)))
}

fn check_top_logprobs(n: i64, name: &str) -> Result<usize, ApiError> {
    if !(0..=MAX_TOP_LOGPROBS as i64).contains(&n) {
        return Err(ApiError::invalid(
            format!("`{name}` must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
            Some(name),
        ));
    }
    Ok(n as usize)
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn display_path(path: &str) -> String {
    if path == "." {
        String::new()
    } else if path.starts_with('[') {
        path.to_owned()
    } else {
        format!(".{path}")
    }
}

#[derive(Deserialize)]
struct RawMessage {
    role: String,
    #[serde(default)]
    content: Option<Content>,
    #[serde(default)]
    tool_calls: Option<Vec<RawToolCall>>,
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
}

/// An assistant message's tool call: `{id, type: "function", function: {name, arguments}}`,
/// the arguments a JSON string (OpenAI) or an object.
#[derive(Deserialize)]
struct RawToolCall {
    #[serde(default)]
    id: Option<String>,
    function: RawFunctionCall,
}

#[derive(Deserialize)]
struct RawFunctionCall {
    name: String,
    #[serde(default)]
    arguments: Option<Value>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

impl RawMessage {
    fn into_message(self, index: usize) -> Result<Message, ApiError> {
        if !ROLES.contains(&self.role.as_str()) {
            return Err(ApiError::invalid(
                format!(
                    "messages[{index}].role `{}` is not one of {}",
                    self.role,
                    ROLES.join(", ")
                ),
                Some("messages"),
            ));
        }
        let content = match self.content {
            None => String::new(),
            Some(Content::Text(text)) => text,
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for part in parts {
                    match (part.kind.as_str(), part.text) {
                        ("text", Some(piece)) => text.push_str(&piece),
                        (kind, _) => {
                            return Err(ApiError::invalid(
                                format!("messages[{index}].content: parts of type `{kind}` are not supported (only `text`)"),
                                Some("messages"),
                            ))
                        }
                    }
                }
                text
            }
        };
        let tool_calls = self
            .tool_calls
            .unwrap_or_default()
            .into_iter()
            .enumerate()
            .map(|(call, raw)| {
                // Templates write the arguments back with `tojson`: they get the JSON value
                // of OpenAI's string (a string that is not JSON stays a string).
                let arguments = match raw.function.arguments {
                    Some(Value::String(text)) => {
                        serde_json::from_str(&text).unwrap_or(Value::String(text))
                    }
                    Some(value) => value,
                    None => Value::Object(Map::new()),
                };
                pagoda_models::chat_template::ToolCall {
                    id: raw.id.unwrap_or_else(|| format!("call_{index}_{call}")),
                    name: raw.function.name,
                    arguments,
                }
            })
            .collect();
        Ok(Message {
            role: self.role,
            content,
            tool_calls,
            tool_call_id: self.tool_call_id,
            name: self.name,
        })
    }
}
