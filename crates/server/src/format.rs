//! JSON shapes of the answers: whole responses and stream chunks for chat and text
//! completions, usage, and the two log-probability formats.

use serde_json::{json, Value};

use crate::session::LogprobEntry;
use crate::tools::parser::Piece;

/// Which endpoint an answer is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completion,
}

/// What every chunk and response of one request repeats.
#[derive(Debug, Clone)]
pub struct Reply {
    /// Which endpoint.
    pub kind: Kind,
    /// `chatcmpl-N` / `cmpl-N`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model name.
    pub model: String,
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Whether log-probabilities were asked for.
    pub want_logprobs: bool,
    /// Text the answer starts with (completions' `echo`), empty otherwise.
    pub echo: String,
}

/// The `usage` object.
pub fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

/// JSON cannot hold -inf; OpenAI reports impossible tokens as -9999.
fn finite(logprob: f32) -> f32 {
    if logprob.is_finite() {
        logprob
    } else {
        -9999.0
    }
}

/// Chat format: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`.
pub fn chat_logprobs(entries: &[LogprobEntry]) -> Value {
    let content: Vec<Value> = entries
        .iter()
        .map(|entry| {
            json!({
                "token": entry.token,
                "logprob": finite(entry.logprob),
                "bytes": entry.bytes,
                "top_logprobs": entry.top.iter().map(|(token, bytes, logprob)| json!({
                    "token": token,
                    "logprob": finite(*logprob),
                    "bytes": bytes,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({ "content": content })
}

/// Completions format: `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`.
pub fn completion_logprobs(entries: &[LogprobEntry]) -> Value {
    json!({
        "tokens": entries.iter().map(|e| e.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": entries.iter().map(|e| finite(e.logprob)).collect::<Vec<_>>(),
        "top_logprobs": entries.iter().map(|e| {
            let mut map = serde_json::Map::new();
            for (token, _, logprob) in &e.top {
                map.entry(token.clone()).or_insert(json!(finite(*logprob)));
            }
            Value::Object(map)
        }).collect::<Vec<_>>(),
        "text_offset": entries.iter().map(|e| e.text_offset).collect::<Vec<_>>(),
    })
}

fn logprobs_value(reply: &Reply, entries: &[LogprobEntry]) -> Value {
    if !reply.want_logprobs {
        return Value::Null;
    }
    match reply.kind {
        Kind::Chat => chat_logprobs(entries),
        Kind::Completion => completion_logprobs(entries),
    }
}

/// One stream chunk of choice `index`. `role` is set on the first chat chunk; with
/// `include_usage` every chunk carries `"usage": null` (the usage chunk itself is built by
/// the caller).
pub fn chunk(
    reply: &Reply,
    index: usize,
    role: Option<&str>,
    text: &str,
    logprobs: &[LogprobEntry],
    finish_reason: Option<&str>,
    include_usage: bool,
) -> Value {
    let logprobs = if logprobs.is_empty() && reply.kind == Kind::Chat {
        Value::Null
    } else {
        logprobs_value(reply, logprobs)
    };
    let choice = match reply.kind {
        Kind::Chat => {
            let mut delta = serde_json::Map::new();
            if let Some(role) = role {
                delta.insert("role".into(), json!(role));
            }
            if role.is_some() || !text.is_empty() {
                delta.insert("content".into(), json!(text));
            }
            json!({
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            })
        }
        Kind::Completion => json!({
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }),
    };
    let object = match reply.kind {
        Kind::Chat => "chat.completion.chunk",
        Kind::Completion => "text_completion",
    };
    let mut value = json!({
        "id": reply.id,
        "object": object,
        "created": reply.created,
        "model": reply.model,
        "system_fingerprint": "pagoda",
        "choices": [choice],
    });
    if include_usage {
        value["usage"] = Value::Null;
    }
    value
}

/// A stream chunk of choice `index` carrying one tool-call piece as OpenAI streams them: a
/// call's start is `{index, id, type: "function", function: {name, arguments: ""}}`, its
/// arguments follow as `{index, function: {arguments: TEXT}}` deltas.
pub fn tool_call_chunk(reply: &Reply, index: usize, piece: &Piece, include_usage: bool) -> Value {
    let call = match piece {
        Piece::CallStart { index, id, name } => json!({
            "index": index,
            "id": id,
            "type": "function",
            "function": { "name": name, "arguments": "" },
        }),
        Piece::Arguments { index, text } => json!({
            "index": index,
            "function": { "arguments": text },
        }),
        Piece::Content(text) => return chunk(reply, index, None, text, &[], None, include_usage),
    };
    let mut value = chunk(reply, index, None, "", &[], None, include_usage);
    value["choices"][0]["delta"] = json!({ "tool_calls": [call] });
    value
}

/// A tool call of a whole answer.
#[derive(Debug, Clone, PartialEq)]
pub struct FinalToolCall {
    /// `call_...`.
    pub id: String,
    /// The function's name.
    pub name: String,
    /// The arguments' JSON text, as the model wrote it.
    pub arguments: String,
}

/// One finished choice of a whole answer.
#[derive(Debug, Clone, PartialEq)]
pub struct FinalChoice {
    /// The text (after `echo`'s prompt text, when asked).
    pub text: String,
    /// The tool calls the answer made (chat requests with tools).
    pub tool_calls: Vec<FinalToolCall>,
    /// The tokens' log-probabilities (shown when asked for).
    pub logprobs: Vec<LogprobEntry>,
    /// `stop`, `length` or `tool_calls`.
    pub finish_reason: &'static str,
    /// Why the answer ended early (a grammar's dead end), shown as `stop_reason`.
    pub note: Option<String>,
}

impl FinalChoice {
    /// Adds a tool-call piece of the answer.
    pub fn push_tool_piece(&mut self, piece: Piece) {
        match piece {
            Piece::CallStart { id, name, .. } => self.tool_calls.push(FinalToolCall {
                id,
                name,
                arguments: String::new(),
            }),
            Piece::Arguments { index, text } => {
                if let Some(call) = self.tool_calls.get_mut(index) {
                    call.arguments.push_str(&text);
                }
            }
            Piece::Content(text) => self.text.push_str(&text),
        }
    }

    /// The chat `message`: `content` (null when the answer is only tool calls) and its
    /// `tool_calls` when it made any.
    fn message(&self) -> Value {
        if self.tool_calls.is_empty() {
            return json!({ "role": "assistant", "content": self.text });
        }
        let calls: Vec<Value> = self
            .tool_calls
            .iter()
            .map(|call| {
                json!({
                    "id": call.id,
                    "type": "function",
                    "function": { "name": call.name, "arguments": call.arguments },
                })
            })
            .collect();
        let content = match self.text.trim() {
            "" => Value::Null,
            _ => json!(self.text),
        };
        json!({ "role": "assistant", "content": content, "tool_calls": calls })
    }
}

/// The whole (non-streamed) response: `choices` in order, indexed from 0.
pub fn final_body(reply: &Reply, choices: &[FinalChoice], completion_tokens: usize) -> Value {
    let choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(index, choice)| {
            let logprobs = logprobs_value(reply, &choice.logprobs);
            match reply.kind {
                Kind::Chat => json!({
                    "index": index,
                    "message": choice.message(),
                    "logprobs": logprobs,
                    "finish_reason": choice.finish_reason,
                }),
                Kind::Completion => json!({
                    "index": index,
                    "text": choice.text,
                    "logprobs": logprobs,
                    "finish_reason": choice.finish_reason,
                }),
            }
        })
        .zip(choices)
        .map(|(mut value, choice)| {
            if let Some(note) = &choice.note {
                value["stop_reason"] = json!(note);
            }
            value
        })
        .collect();
    let object = match reply.kind {
        Kind::Chat => "chat.completion",
        Kind::Completion => "text_completion",
    };
    json!({
        "id": reply.id,
        "object": object,
        "created": reply.created,
        "model": reply.model,
        "system_fingerprint": "pagoda",
        "choices": choices,
        "usage": usage(reply.prompt_tokens, completion_tokens),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply() -> Reply {
        Reply {
            kind: Kind::Chat,
            id: "chatcmpl-1".into(),
            created: 0,
            model: "m".into(),
            prompt_tokens: 3,
            want_logprobs: false,
            echo: String::new(),
        }
    }

    #[test]
    fn tool_calls_and_dead_ends_shape_the_message() {
        let mut choice = FinalChoice {
            text: "\n".into(),
            tool_calls: Vec::new(),
            logprobs: Vec::new(),
            finish_reason: "tool_calls",
            note: None,
        };
        choice.push_tool_piece(Piece::CallStart {
            index: 0,
            id: "call_a0".into(),
            name: "f".into(),
        });
        for text in ["{\"x\"", ": 1}"] {
            choice.push_tool_piece(Piece::Arguments {
                index: 0,
                text: text.into(),
            });
        }
        let body = final_body(&reply(), std::slice::from_ref(&choice), 9);
        let message = &body["choices"][0]["message"];
        assert_eq!(message["content"], Value::Null);
        assert_eq!(message["tool_calls"][0]["id"], "call_a0");
        assert_eq!(
            message["tool_calls"][0]["function"]["arguments"],
            "{\"x\": 1}"
        );
        assert!(body["choices"][0].get("stop_reason").is_none());
        let ended = FinalChoice {
            text: "{\"a\":".into(),
            tool_calls: Vec::new(),
            finish_reason: "stop",
            note: Some("the grammar allows no token".into()),
            ..choice
        };
        let body = final_body(&reply(), &[ended], 9);
        assert_eq!(
            body["choices"][0]["stop_reason"],
            "the grammar allows no token"
        );
        assert_eq!(body["choices"][0]["message"]["content"], "{\"a\":");
        let streamed = tool_call_chunk(
            &reply(),
            0,
            &Piece::Arguments {
                index: 0,
                text: "1}".into(),
            },
            false,
        );
        assert_eq!(
            streamed["choices"][0]["delta"],
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]})
        );
    }
}
