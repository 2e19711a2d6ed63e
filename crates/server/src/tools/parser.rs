//! Reading tool calls out of an answer as it is generated.
//!
//! [`ToolCallParser::push`] takes the answer's text delta by delta and returns
//! [`Piece`]s: content, the start of a call (its id and function name, once the name is
//! read), and its arguments' JSON text as it arrives, which a stream forwards as OpenAI's
//! argument deltas. Text that may still turn out to open a call (a prefix of `<tool_call>`)
//! is held back until it is decided. A call whose head is not `{"name": ..., "arguments":`
//! (keys in another order) is read whole at its end; a call that is not JSON stays content.

use serde_json::Value;

use super::ToolFormat;

/// A part of the answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// Text of the message's `content`.
    Content(String),
    /// Call `index` begins: its id and function name.
    CallStart {
        index: usize,
        id: String,
        name: String,
    },
    /// More of call `index`'s arguments (JSON text; the pieces of a call concatenate to its
    /// arguments).
    Arguments { index: usize, text: String },
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Outside calls (Hermes), or at the answer's start (Llama 3: not yet decided).
    Text,
    /// Llama 3: the answer is text.
    Content,
    /// Inside a call, before its arguments' value.
    Head,
    /// Streaming the arguments' value.
    Arguments(Scan),
    /// After the arguments, until the call ends.
    Tail,
    /// A call read whole at its end (its head was not the expected one).
    Opaque,
}

/// Where the scan of a JSON value stands.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct Scan {
    depth: usize,
    in_string: bool,
    escaped: bool,
    started: bool,
}

/// The tool-call reader of one answer.
#[derive(Debug)]
pub struct ToolCallParser {
    format: ToolFormat,
    state: State,
    /// Text read but not yet returned.
    buffer: String,
    /// Calls started.
    calls: usize,
    /// Prefix of the calls' ids (`call_<prefix>_<index>`).
    id_prefix: String,
    /// A call just ended: whitespace after it is held back (dropped before the next call or
    /// the end, content before other text).
    after_call: bool,
}

impl ToolCallParser {
    /// A reader of `format`; call ids are `call_{id_prefix}{index}`.
    pub fn new(format: ToolFormat, id_prefix: String) -> ToolCallParser {
        ToolCallParser {
            format,
            state: State::Text,
            buffer: String::new(),
            calls: 0,
            id_prefix,
            after_call: false,
        }
    }

    /// Calls started so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Reads the next text delta.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buffer.push_str(text);
        let mut pieces = Vec::new();
        while self.step(&mut pieces) {}
        merge(pieces)
    }

    /// The answer ended: what is still held back (an unfinished call's text, when it never
    /// got a name, is content).
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut pieces = Vec::new();
        let rest = std::mem::take(&mut self.buffer);
        match self.state {
            State::Text if self.after_call && rest.trim().is_empty() => {}
            State::Text | State::Content => pieces.push(Piece::Content(rest)),
            State::Head => pieces.push(Piece::Content(self.reopen(&rest))),
            State::Opaque => match self.format {
                // Llama 3's whole answer is the call list: it ends with the answer.
                ToolFormat::Llama3Json => match self.opaque_calls(&rest) {
                    Some(calls) => pieces.extend(calls),
                    None => pieces.push(Piece::Content(rest)),
                },
                ToolFormat::Hermes => pieces.push(Piece::Content(self.reopen(&rest))),
            },
            State::Arguments(_) | State::Tail => {}
        }
        self.state = State::Content;
        merge(pieces)
    }

    /// The text a call was opened with, before `rest` (for a call that turns out text).
    fn reopen(&self, rest: &str) -> String {
        match self.format {
            ToolFormat::Hermes => format!("{HERMES_OPEN}{rest}"),
            ToolFormat::Llama3Json => rest.to_owned(),
        }
    }

    /// Advances once over the buffer; false when it needs more text.
    fn step(&mut self, pieces: &mut Vec<Piece>) -> bool {
        match self.state {
            State::Text => self.text(pieces),
            State::Content => {
                if !self.buffer.is_empty() {
                    pieces.push(Piece::Content(std::mem::take(&mut self.buffer)));
                }
                false
            }
            State::Head => self.head(pieces),
            State::Arguments(scan) => self.arguments(scan, pieces),
            State::Tail => self.tail(),
            State::Opaque => self.opaque(pieces),
        }
    }

    fn text(&mut self, pieces: &mut Vec<Piece>) -> bool {
        match self.format {
            ToolFormat::Hermes => {
                if let Some(at) = self.buffer.find(HERMES_OPEN) {
                    let before: String = self.buffer.drain(..at + HERMES_OPEN.len()).collect();
                    if !(self.after_call && before[..at].trim().is_empty()) {
                        pieces.push(Piece::Content(before[..at].to_owned()));
                    }
                    self.after_call = false;
                    self.state = State::Head;
                    return true;
                }
                if self.after_call {
                    if self.buffer.trim().is_empty() {
                        return false;
                    }
                    // Text (or a tag's start) after the call's whitespace.
                    let trimmed = self.buffer.trim_start();
                    if HERMES_OPEN.starts_with(trimmed) {
                        return false;
                    }
                    self.after_call = false;
                }
                // Hold back a suffix that may be the tag's beginning.
                let keep = partial_suffix(&self.buffer, HERMES_OPEN);
                let send = self.buffer.len() - keep;
                pieces.push(Piece::Content(self.buffer.drain(..send).collect()));
                false
            }
            ToolFormat::Llama3Json => {
                let trimmed = self.buffer.trim_start();
                if trimmed.is_empty() {
                    return false;
                }
                if let Some(rest) = trimmed.strip_prefix(PYTHON_TAG) {
                    self.buffer = rest.to_owned();
                    self.state = State::Head;
                } else if PYTHON_TAG.starts_with(trimmed) {
                    return false;
                } else if trimmed.starts_with('{') {
                    self.buffer = trimmed.to_owned();
                    self.state = State::Head;
                } else {
                    self.state = State::Content;
                }
                true
            }
        }
    }

    fn head(&mut self, pieces: &mut Vec<Piece>) -> bool {
        match read_head(&self.buffer) {
            Head::Incomplete => false,
            Head::Mismatch => {
                self.state = State::Opaque;
                true
            }
            Head::Matched { name, consumed } => {
                self.buffer.drain(..consumed);
                pieces.push(Piece::CallStart {
                    index: self.calls,
                    id: format!("call_{}{}", self.id_prefix, self.calls),
                    name,
                });
                self.calls += 1;
                self.state = State::Arguments(Scan::default());
                true
            }
        }
    }

    fn arguments(&mut self, mut scan: Scan, pieces: &mut Vec<Piece>) -> bool {
        let mut end = None;
        let mut skip = 0;
        for (at, c) in self.buffer.char_indices() {
            if !scan.started {
                if c.is_whitespace() {
                    skip = at + c.len_utf8();
                    continue;
                }
                scan.started = true;
            }
            if scan.in_string {
                match (scan.escaped, c) {
                    (true, _) => scan.escaped = false,
                    (false, '\\') => scan.escaped = true,
                    (false, '"') => {
                        scan.in_string = false;
                        if scan.depth == 0 {
                            end = Some(at + 1);
                            break;
                        }
                    }
                    _ => {}
                }
                continue;
            }
            match c {
                '"' => scan.in_string = true,
                '{' | '[' => scan.depth += 1,
                '}' | ']' if scan.depth > 0 => {
                    scan.depth -= 1;
                    if scan.depth == 0 {
                        end = Some(at + 1);
                        break;
                    }
                }
                // A bare value (number, literal) ends at the object's next delimiter.
                ',' | '}' if scan.depth == 0 => {
                    end = Some(at);
                    break;
                }
                _ => {}
            }
        }
        let index = self.calls - 1;
        match end {
            Some(end) => {
                let text = self.buffer[skip..end].to_owned();
                self.buffer.drain(..end);
                pieces.push(Piece::Arguments { index, text });
                self.state = State::Tail;
                true
            }
            None => {
                let text = self.buffer[skip..].to_owned();
                self.buffer.clear();
                if !text.is_empty() {
                    pieces.push(Piece::Arguments { index, text });
                }
                self.state = State::Arguments(scan);
                false
            }
        }
    }

    fn tail(&mut self) -> bool {
        match self.format {
            ToolFormat::Hermes => match self.buffer.find(HERMES_CLOSE) {
                Some(at) => {
                    self.buffer.drain(..at + HERMES_CLOSE.len());
                    self.after_call = true;
                    self.state = State::Text;
                    true
                }
                None => false,
            },
            ToolFormat::Llama3Json => {
                // `}` closes the call; `;` opens the next one; other text is content.
                let trimmed = self.buffer.trim_start();
                let Some(first) = trimmed.chars().next() else {
                    return false;
                };
                match first {
                    '}' => {
                        self.buffer = trimmed[1..].to_owned();
                        true
                    }
                    ';' => {
                        self.buffer = trimmed[1..].trim_start().to_owned();
                        self.state = State::Head;
                        true
                    }
                    _ => {
                        self.buffer = trimmed.to_owned();
                        self.state = State::Content;
                        true
                    }
                }
            }
        }
    }

    fn opaque(&mut self, pieces: &mut Vec<Piece>) -> bool {
        if self.format == ToolFormat::Llama3Json {
            return false;
        }
        let Some(at) = self.buffer.find(HERMES_CLOSE) else {
            return false;
        };
        let call: String = self.buffer.drain(..at + HERMES_CLOSE.len()).collect();
        match self.opaque_calls(&call[..at]) {
            Some(calls) => {
                pieces.extend(calls);
                self.after_call = true;
            }
            None => pieces.push(Piece::Content(format!("{HERMES_OPEN}{call}"))),
        }
        self.state = State::Text;
        true
    }

    /// Calls read whole from `text` (one JSON object, or Llama 3's `; `-separated list);
    /// `None` when it is not that (then it is content).
    fn opaque_calls(&mut self, text: &str) -> Option<Vec<Piece>> {
        let objects: Vec<&str> = match self.format {
            ToolFormat::Hermes => vec![text],
            ToolFormat::Llama3Json => text.split(';').collect(),
        };
        let mut calls = Vec::new();
        for object in objects {
            let Ok(Value::Object(map)) = serde_json::from_str::<Value>(object.trim()) else {
                return None;
            };
            let name = map.get("name").and_then(Value::as_str)?;
            let arguments = map.get("arguments").or_else(|| map.get("parameters"))?;
            calls.push((name.to_owned(), arguments.clone()));
        }
        let mut pieces = Vec::new();
        for (name, arguments) in calls {
            let index = self.calls;
            self.calls += 1;
            pieces.push(Piece::CallStart {
                index,
                id: format!("call_{}{}", self.id_prefix, index),
                name,
            });
            let text = match arguments {
                Value::String(text) => text,
                other => other.to_string(),
            };
            pieces.push(Piece::Arguments { index, text });
        }
        Some(pieces)
    }
}

/// The length of the longest suffix of `text` that is a proper prefix of `tag`.
fn partial_suffix(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && text.ends_with(&tag[..n]))
        .unwrap_or(0)
}

/// Content pieces merged, empty ones dropped.
fn merge(pieces: Vec<Piece>) -> Vec<Piece> {
    let mut out: Vec<Piece> = Vec::with_capacity(pieces.len());
    for piece in pieces {
        match (out.last_mut(), piece) {
            (_, Piece::Content(text)) if text.is_empty() => {}
            (Some(Piece::Content(last)), Piece::Content(text)) => last.push_str(&text),
            (
                Some(Piece::Arguments { index, text: last }),
                Piece::Arguments { index: next, text },
            ) if *index == next => last.push_str(&text),
            (_, piece) => out.push(piece),
        }
    }
    out
}

/// What the start of a call holds.
#[derive(Debug, PartialEq)]
enum Head {
    /// Not enough text yet.
    Incomplete,
    /// Not `{"name": "...", "arguments"|"parameters":`.
    Mismatch,
    /// The head, and the bytes it took (the arguments' value follows).
    Matched { name: String, consumed: usize },
}

/// Reads `{ "name" : "<name>" , "arguments" :` (or `"parameters"`) with any whitespace.
fn read_head(text: &str) -> Head {
    let mut cursor = Cursor { text, at: 0 };
    let steps = (|| {
        cursor.literal("{")?;
        cursor.literal("\"name\"")?;
        cursor.literal(":")?;
        let name = cursor.string()?;
        cursor.literal(",")?;
        let key = cursor.string()?;
        if key != "arguments" && key != "parameters" {
            return Err(Head::Mismatch);
        }
        cursor.literal(":")?;
        Ok(name)
    })();
    match steps {
        Ok(name) => Head::Matched {
            name,
            consumed: cursor.at,
        },
        Err(head) => head,
    }
}

struct Cursor<'a> {
    text: &'a str,
    at: usize,
}

impl Cursor<'_> {
    fn skip_whitespace(&mut self) {
        let rest = &self.text[self.at..];
        self.at += rest.len() - rest.trim_start().len();
    }

    /// `token` after optional whitespace.
    fn literal(&mut self, token: &str) -> Result<(), Head> {
        self.skip_whitespace();
        let rest = &self.text[self.at..];
        if rest.starts_with(token) {
            self.at += token.len();
            Ok(())
        } else if token.starts_with(rest) {
            Err(Head::Incomplete)
        } else {
            Err(Head::Mismatch)
        }
    }

    /// A JSON string after optional whitespace, unescaped.
    fn string(&mut self) -> Result<String, Head> {
        self.skip_whitespace();
        let rest = &self.text[self.at..];
        if rest.is_empty() {
            return Err(Head::Incomplete);
        }
        if !rest.starts_with('"') {
            return Err(Head::Mismatch);
        }
        let mut escaped = false;
        for (at, c) in rest.char_indices().skip(1) {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => {
                    let literal = &rest[..=at];
                    self.at += at + 1;
                    return serde_json::from_str(literal).map_err(|_| Head::Mismatch);
                }
                _ => {}
            }
        }
        Err(Head::Incomplete)
    }
}

#[cfg(test)]
#[path = "parser_tests.rs"]
mod tests;
