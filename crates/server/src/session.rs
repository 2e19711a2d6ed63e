//! One request's text side: turns the loop's token events into text deltas (UTF-8 safe
//! detokenization, end-of-generation tokens hidden, stop strings held back and cut), counts
//! tokens and decides the finish reason.

use std::sync::Arc;

use pagoda_engine::FinishReason;
use pagoda_models::tokenizer::{StreamDecoder, Tokenizer};

use crate::error::ApiError;
use crate::stop::StopMatcher;
use crate::tools::parser::{Piece, ToolCallParser};
use crate::worker::{TokenLogprob, WorkerEvent};

/// A sampled token's log-probability in API terms.
#[derive(Debug, Clone, PartialEq)]
pub struct LogprobEntry {
    /// The token's text (lossy UTF-8 of its bytes).
    pub token: String,
    /// The token's raw bytes.
    pub bytes: Vec<u8>,
    /// Natural-log probability.
    pub logprob: f32,
    /// The most likely alternatives as (text, bytes, logprob), most likely first.
    pub top: Vec<(String, Vec<u8>, f32)>,
    /// Character offset of the token's text in the generated text.
    pub text_offset: usize,
}

/// What one event adds to the answer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Delta {
    /// Text safe to send (never part of a stop string).
    pub text: String,
    /// Log-probabilities of the tokens of this delta (when asked for).
    pub logprobs: Vec<LogprobEntry>,
    /// Tool-call pieces (call starts and argument text) of this delta, when the request
    /// has tools; never [`Piece::Content`] (content is `text`).
    pub tool_calls: Vec<Piece>,
    /// `"stop"`, `"length"` or `"tool_calls"` on the last delta.
    pub finish_reason: Option<&'static str>,
    /// Why the request ended early, on the last delta (a grammar's dead end): the choice's
    /// `stop_reason`.
    pub note: Option<String>,
}

/// The text state of one request.
pub struct Session {
    tokenizer: Arc<Tokenizer>,
    decoder: StreamDecoder,
    stop: StopMatcher,
    stop_tokens: Vec<u32>,
    /// Tokens sampled so far.
    pub completion_tokens: usize,
    /// Characters decoded so far (before stop-string cutting), for `text_offset`.
    decoded_chars: usize,
    /// Set once the request has ended.
    pub finish_reason: Option<&'static str>,
    /// The sampler's seed, once admitted.
    pub seed: Option<u64>,
    /// Reads tool calls out of the text (requests with tools).
    tools: Option<ToolCallParser>,
}

impl Session {
    /// A session that hides `stop_tokens` and ends at any of `stop_strings`.
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        stop_tokens: Vec<u32>,
        stop_strings: Vec<String>,
    ) -> Self {
        Session {
            decoder: tokenizer.stream_decoder(),
            tokenizer,
            stop: StopMatcher::new(stop_strings),
            stop_tokens,
            completion_tokens: 0,
            decoded_chars: 0,
            finish_reason: None,
            seed: None,
            tools: None,
        }
    }

    /// The session, reading tool calls out of the answer with `parser`: its text is then the
    /// content outside calls, and the answer finishes with `tool_calls` when it made one.
    pub fn with_tools(mut self, parser: ToolCallParser) -> Self {
        self.tools = Some(parser);
        self
    }

    /// Applies one event: `Ok(None)` when it adds nothing to the answer, an error when the
    /// request failed. Once finished, further events are ignored.
    pub fn on_event(&mut self, event: WorkerEvent) -> Result<Option<Delta>, ApiError> {
        if self.finish_reason.is_some() {
            return Ok(None);
        }
        match event {
            WorkerEvent::Started { seed } => {
                self.seed = seed;
                Ok(None)
            }
            WorkerEvent::Failed {
                message,
                client_error,
            } => Err(WorkerEvent::failure(&message, client_error)),
            WorkerEvent::Token {
                token,
                logprob,
                finished,
                note,
            } => {
                let mut delta = self.on_token(token, logprob, finished);
                if delta.finish_reason.is_some() {
                    delta.note = note;
                }
                Ok(Some(delta))
            }
        }
    }

    fn on_token(
        &mut self,
        token: u32,
        logprob: Option<TokenLogprob>,
        finished: Option<FinishReason>,
    ) -> Delta {
        self.completion_tokens += 1;
        let mut delta = Delta::default();
        let end_of_generation = self.stop_tokens.contains(&token);
        // Every counted token has its entry, the end-of-generation one too (its text is not
        // shown), so the list is as long as `completion_tokens`, as vLLM answers.
        if let Some(logprob) = logprob {
            delta.logprobs.push(self.entry(token, &logprob));
        }
        if !end_of_generation {
            let piece = self.decoder.push(token);
            self.decoded_chars += piece.chars().count();
            let out = self.stop.push(&piece);
            delta.text = out.text;
            if out.stopped {
                delta.finish_reason = Some("stop");
            }
        }
        if delta.finish_reason.is_none() && (finished.is_some() || end_of_generation) {
            // Flush what the decoder and the stop matcher still hold.
            let tail = self.decoder.finish();
            let out = self.stop.push(&tail);
            delta.text.push_str(&out.text);
            if !out.stopped {
                delta.text.push_str(&self.stop.finish());
            }
            delta.finish_reason = Some(match finished {
                Some(FinishReason::Length) if !out.stopped && !end_of_generation => "length",
                _ => "stop",
            });
        }
        if let Some(parser) = &mut self.tools {
            let mut pieces = parser.push(&std::mem::take(&mut delta.text));
            if delta.finish_reason.is_some() {
                pieces.extend(parser.finish());
                if delta.finish_reason == Some("stop") && parser.calls() > 0 {
                    delta.finish_reason = Some("tool_calls");
                }
            }
            for piece in pieces {
                match piece {
                    Piece::Content(text) => delta.text.push_str(&text),
                    call => delta.tool_calls.push(call),
                }
            }
        }
        self.finish_reason = delta.finish_reason;
        delta
    }

    fn entry(&self, token: u32, logprob: &TokenLogprob) -> LogprobEntry {
        let bytes = self.tokenizer.token_bytes(token);
        LogprobEntry {
            token: String::from_utf8_lossy(&bytes).into_owned(),
            bytes,
            logprob: logprob.logprob,
            top: logprob
                .top
                .iter()
                .map(|&(id, value)| {
                    let bytes = self.tokenizer.token_bytes(id);
                    (String::from_utf8_lossy(&bytes).into_owned(), bytes, value)
                })
                .collect(),
            text_offset: self.decoded_chars,
        }
    }
}
