//! Answering one request's choices (`n`, `best_of`): each choice is its own sequence in the
//! engine with its own event channel and text [`Session`]; their events are merged, tagged
//! by choice index, and either gathered into one whole response or streamed as SSE chunks
//! (`choices[0].index` says which). Dropping the merged events (the client went away, or an
//! error ended the answer) drops every receiver, which cancels every choice in the loop.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{BoxStream, SelectAll};
use futures::{Stream, StreamExt};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::access::AccessLog;
use crate::drain::InFlight;
use crate::error::ApiError;
use crate::format::{chunk, final_body, tool_call_chunk, usage, FinalChoice, Kind, Reply};
use crate::session::{LogprobEntry, Session};
use crate::worker::WorkerEvent;

/// The choices of one request: their merged, index-tagged events and their sessions.
pub(crate) struct Choices {
    events: SelectAll<BoxStream<'static, (usize, WorkerEvent)>>,
    sessions: Vec<Session>,
    /// Choices to return: the first `keep` in order, or with more candidates (`best_of`),
    /// the `keep` of highest log-probability per token.
    keep: usize,
}

impl Choices {
    /// No choices yet; `keep` of those added will be returned.
    pub(crate) fn new(keep: usize) -> Choices {
        Choices {
            events: SelectAll::new(),
            sessions: Vec::new(),
            keep,
        }
    }

    /// Adds the next choice: the receiver of its job's events, and its session.
    pub(crate) fn push(&mut self, receiver: UnboundedReceiver<WorkerEvent>, session: Session) {
        let index = self.sessions.len();
        let events = futures::stream::unfold(receiver, |mut receiver| async move {
            receiver.recv().await.map(|event| (event, receiver))
        });
        self.events
            .push(events.map(move |event| (index, event)).boxed());
        self.sessions.push(session);
    }

    /// Tokens sampled by every choice (the candidates `best_of` drops included, as OpenAI
    /// bills them).
    fn completion_tokens(&self) -> usize {
        self.sessions.iter().map(|s| s.completion_tokens).sum()
    }

    fn unfinished(&self) -> bool {
        self.sessions.iter().any(|s| s.finish_reason.is_none())
    }

    /// The next event of any choice; an error when the loop dropped a choice unfinished.
    async fn next(&mut self) -> Result<(usize, WorkerEvent), ApiError> {
        self.events.next().await.ok_or_else(|| {
            ApiError::internal("the engine loop stopped before the request finished")
        })
    }
}

/// What a request still running when the drain gives up gets.
pub(crate) fn shutdown_error() -> ApiError {
    ApiError::unavailable("the server shut down before the request finished")
}

/// Collects every choice and answers with the kept ones.
pub(crate) async fn whole(
    reply: Reply,
    mut choices: Choices,
    (in_flight, mut log): (InFlight, AccessLog),
) -> Result<Response, ApiError> {
    let count = choices.sessions.len();
    let mut finals: Vec<FinalChoice> = (0..count)
        .map(|_| FinalChoice {
            text: reply.echo.clone(),
            tool_calls: Vec::new(),
            logprobs: Vec::new(),
            finish_reason: "",
            note: None,
        })
        .collect();
    log.outcome = "error";
    while choices.unfinished() {
        let (index, event) = tokio::select! {
            event = choices.next() => event?,
            _ = in_flight.drain().aborted() => {
                log.outcome = "shutdown";
                return Err(shutdown_error());
            }
        };
        let delta = choices.sessions[index].on_event(event)?;
        log.completion_tokens = choices.completion_tokens();
        if let Some(delta) = delta {
            let choice = &mut finals[index];
            choice.text.push_str(&delta.text);
            for piece in delta.tool_calls {
                choice.push_tool_piece(piece);
            }
            choice.logprobs.extend(delta.logprobs);
            if let Some(reason) = delta.finish_reason {
                choice.finish_reason = reason;
                choice.note = delta.note;
            }
        }
    }
    if count > choices.keep {
        // OpenAI's `best_of`: the candidates of highest log-probability per token.
        let mean = |choice: &FinalChoice| mean_logprob(&choice.logprobs);
        finals.sort_by(|a, b| mean(b).total_cmp(&mean(a)));
        finals.truncate(choices.keep);
    }
    log.outcome = finals[0].finish_reason;
    let body = final_body(&reply, &finals, choices.completion_tokens());
    Ok(Json(body).into_response())
}

/// Mean log-probability per token of a choice (0 for an empty one).
fn mean_logprob(entries: &[LogprobEntry]) -> f64 {
    let sum: f64 = entries.iter().map(|e| e.logprob as f64).sum();
    sum / entries.len().max(1) as f64
}

struct StreamState {
    reply: Reply,
    choices: Choices,
    include_usage: bool,
    pending: VecDeque<Event>,
    done: bool,
    /// Held until the stream ends (a drain waits for it).
    in_flight: InFlight,
    /// Written when the stream ends or its client leaves.
    log: AccessLog,
}

impl Drop for StreamState {
    fn drop(&mut self) {
        self.log.completion_tokens = self.choices.completion_tokens();
        if let Some(reason) = self.choices.sessions.first().and_then(|s| s.finish_reason) {
            self.log.outcome = reason;
        }
    }
}

fn data(value: &Value) -> Event {
    Event::default().data(value.to_string())
}

/// The SSE stream: `data: {chunk}` events (each choice's own, by `index`), then `data:
/// [DONE]` once every choice has finished. Dropping it (the client went away) drops the
/// receivers, which cancels the choices in the engine loop.
pub(crate) fn event_stream(
    reply: Reply,
    choices: Choices,
    include_usage: bool,
    (in_flight, log): (InFlight, AccessLog),
) -> impl Stream<Item = Result<Event, Infallible>> {
    let mut pending = VecDeque::new();
    for index in 0..choices.sessions.len() {
        if !reply.echo.is_empty() {
            let echo = chunk(&reply, index, None, &reply.echo, &[], None, include_usage);
            pending.push_back(data(&echo));
        }
        if reply.kind == Kind::Chat {
            let role = chunk(
                &reply,
                index,
                Some("assistant"),
                "",
                &[],
                None,
                include_usage,
            );
            pending.push_back(data(&role));
        }
    }
    let state = StreamState {
        reply,
        choices,
        include_usage,
        pending,
        done: false,
        in_flight,
        log,
    };
    futures::stream::unfold(state, |mut state| async move {
        loop {
            if let Some(event) = state.pending.pop_front() {
                return Some((Ok(event), state));
            }
            if state.done {
                return None;
            }
            let event = tokio::select! {
                event = state.choices.next() => event,
                _ = state.in_flight.drain().aborted() => {
                    state.log.outcome = "shutdown";
                    state.end_with(shutdown_error());
                    continue;
                }
            };
            let outcome = event.and_then(|(index, event)| {
                let delta = state.choices.sessions[index].on_event(event)?;
                Ok(delta.map(|delta| (index, delta)))
            });
            match outcome {
                Ok(None) => {}
                Ok(Some((index, delta))) => {
                    let reply = &state.reply;
                    // Content first, then the tool calls' pieces, then the finish (on the
                    // content chunk when there are no pieces).
                    let calls = !delta.tool_calls.is_empty();
                    let finish_with_text = delta.finish_reason.filter(|_| !calls);
                    if !delta.text.is_empty()
                        || !delta.logprobs.is_empty()
                        || finish_with_text.is_some()
                    {
                        let mut value = chunk(
                            reply,
                            index,
                            None,
                            &delta.text,
                            &delta.logprobs,
                            finish_with_text,
                            state.include_usage,
                        );
                        if let (Some(note), Some(_)) = (&delta.note, finish_with_text) {
                            value["choices"][0]["stop_reason"] = json!(note);
                        }
                        state.pending.push_back(data(&value));
                    }
                    for piece in &delta.tool_calls {
                        let value = tool_call_chunk(reply, index, piece, state.include_usage);
                        state.pending.push_back(data(&value));
                    }
                    if calls && delta.finish_reason.is_some() {
                        let mut value = chunk(
                            reply,
                            index,
                            None,
                            "",
                            &[],
                            delta.finish_reason,
                            state.include_usage,
                        );
                        if let Some(note) = &delta.note {
                            value["choices"][0]["stop_reason"] = json!(note);
                        }
                        state.pending.push_back(data(&value));
                    }
                    if delta.finish_reason.is_some() && !state.choices.unfinished() {
                        if state.include_usage {
                            let mut last = chunk(reply, 0, None, "", &[], None, true);
                            last["choices"] = json!([]);
                            let tokens = state.choices.completion_tokens();
                            last["usage"] = usage(reply.prompt_tokens, tokens);
                            state.pending.push_back(data(&last));
                        }
                        state.pending.push_back(Event::default().data("[DONE]"));
                        state.done = true;
                    }
                }
                Err(error) => {
                    state.log.outcome = "error";
                    state.end_with(error);
                }
            }
        }
    })
}

impl StreamState {
    /// Ends the stream with `error`'s body and `[DONE]`.
    fn end_with(&mut self, error: ApiError) {
        self.pending.push_back(data(&error.body()));
        self.pending.push_back(Event::default().data("[DONE]"));
        self.done = true;
    }
}
