//! Chat templates rendered with minijinja, configured like transformers'
//! `apply_chat_template` environment.
//!
//! transformers renders with Jinja2 (`trim_blocks`, `lstrip_blocks`, loop controls, a
//! `raise_exception` function, a `strftime_now` function, a `tojson` filter that writes
//! Python `json.dumps` style). Here the same: minijinja with those settings, Python string /
//! dict / list methods (`.strip()`, `.items()`, `.startswith()`) from
//! `minijinja_contrib::pycompat`, and our own `tojson` / `strftime_now`.

use std::sync::Arc;

use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, Serde, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

/// One chat message: `role` ("system", "user", "assistant", "tool", ...), its text, and
/// for tool use, the calls an assistant message made or the call a tool message answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant message's tool calls (empty: none; templates see no `tool_calls` key).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A tool message's answer to the call of this id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The name of the tool (tool messages) or of the speaker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// A tool call of an assistant message, as templates see it: `{id, type: "function",
/// function: {name, arguments}}` with the arguments as JSON (an object, as transformers
/// passes them), so `arguments | tojson` writes them back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: serde_json::Value,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }

    /// The message as a template value: a map with `role` and `content` first, in that
    /// order (as a Python dict would iterate, which `tojson` and `.items()` show), then the
    /// tool fields it has.
    fn to_value(&self) -> Value {
        Value::from_object(self.clone())
    }
}

impl Object for ChatMessage {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        match key.as_str()? {
            "role" => Some(Value::from(self.role.as_str())),
            "content" => Some(Value::from(self.content.as_str())),
            "tool_calls" if !self.tool_calls.is_empty() => {
                let calls: Vec<serde_json::Value> = self
                    .tool_calls
                    .iter()
                    .map(|call| {
                        serde_json::json!({
                            "id": call.id,
                            "type": "function",
                            "function": { "name": call.name, "arguments": call.arguments },
                        })
                    })
                    .collect();
                Some(Value::from(Serde(calls)))
            }
            "tool_call_id" => self.tool_call_id.as_deref().map(Value::from),
            "name" => self.name.as_deref().map(Value::from),
            _ => None,
        }
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        let mut keys = vec![Value::from("role"), Value::from("content")];
        if !self.tool_calls.is_empty() {
            keys.push(Value::from("tool_calls"));
        }
        if self.tool_call_id.is_some() {
            keys.push(Value::from("tool_call_id"));
        }
        if self.name.is_some() {
            keys.push(Value::from("name"));
        }
        Enumerator::Values(keys)
    }
}

/// Why a template could not be compiled or rendered; the message includes minijinja's
/// location and, for `raise_exception`, the template's own message.
#[derive(Debug, thiserror::Error)]
#[error("chat template: {message}")]
pub struct ChatTemplateError {
    pub message: String,
}

impl From<Error> for ChatTemplateError {
    fn from(error: Error) -> Self {
        let mut message = match error.kind() {
            ErrorKind::InvalidOperation if error.detail().is_some() => {
                error.detail().unwrap_or_default().to_owned()
            }
            _ => error.to_string(),
        };
        if let Some(line) = error.line() {
            message.push_str(&format!(" (template line {line})"));
        }
        ChatTemplateError { message }
    }
}

/// The ChatML template used when a model ships none.
const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

const TEMPLATE_NAME: &str = "chat";

/// A compiled chat template with the BOS/EOS texts it may refer to (`bos_token`,
/// `eos_token`).
pub struct ChatTemplate {
    environment: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`. `bos_token` / `eos_token` are the texts the template sees (empty
    /// when `None`). A syntax error is reported here, with its line.
    pub fn new(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<ChatTemplate, ChatTemplateError> {
        let mut environment = Environment::new();
        // transformers: Jinja2 with trim_blocks and lstrip_blocks; a single trailing newline
        // of the template is dropped (Jinja2's keep_trailing_newline=False, also minijinja's
        // default).
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?;
        environment.set_syntax(syntax);
        environment
            .set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        environment.add_function("raise_exception", raise_exception);
        environment.add_function("strftime_now", strftime_now);
        environment.add_filter("tojson", tojson);
        environment.add_template_owned(TEMPLATE_NAME, source.to_owned())?;
        Ok(ChatTemplate {
            environment,
            source: source.to_owned(),
            bos_token: bos_token.unwrap_or_default().to_owned(),
            eos_token: eos_token.unwrap_or_default().to_owned(),
        })
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The BOS text the template sees (empty when the model has none).
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    /// The EOS text the template sees (empty when the model has none).
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// The fallback ChatML template (`<|im_start|>role\ncontent<|im_end|>\n`).
    pub fn chatml() -> ChatTemplate {
        ChatTemplate::new(CHATML_TEMPLATE, None, None)
            .expect("the built-in ChatML template compiles")
    }

    /// Renders `messages`; with `add_generation_prompt` the template appends the opening of
    /// the assistant's turn. Template variables: `messages`, `add_generation_prompt`,
    /// `bos_token`, `eos_token`, and `tools` (none).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// [`render`](Self::render) with the request's `tools` (the OpenAI list of `{type:
    /// "function", function: {name, description, parameters}}`, keys in the client's order),
    /// as transformers passes them to the template.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        let template = self.environment.get_template(TEMPLATE_NAME)?;
        let context = minijinja::context! {
            messages => messages.iter().map(ChatMessage::to_value).collect::<Vec<_>>(),
            tools => tools.map(|tools| Value::from(Serde(tools))),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        };
        Ok(template.render(context)?)
    }

    /// Whether the template reads the top-level variable `name`, e.g. `tools`: a
    /// template that never reads `tools` cannot show the model its tools.
    pub fn reads_variable(&self, name: &str) -> bool {
        self.environment
            .get_template(TEMPLATE_NAME)
            .is_ok_and(|template| template.undeclared_variables(false).contains(name))
    }
}

/// `raise_exception(message)`: aborts rendering with the template's message.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current UTC time formatted with `%Y %m %d %H %M %S %y %j
/// %B %b %A %a %p %I %%` (the specifiers chat templates use).
fn strftime_now(format: String) -> Result<String, Error> {
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(&format, seconds)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Formats `unix_seconds` (UTC).
pub(crate) fn strftime(format: &str, unix_seconds: i64) -> Result<String, Error> {
    let days = unix_seconds.div_euclid(86_400);
    let seconds_of_day = unix_seconds.rem_euclid(86_400);
    let (hour, minute, second) = (
        seconds_of_day / 3600,
        seconds_of_day / 60 % 60,
        seconds_of_day % 60,
    );
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let shifted = days + 719_468;
    let era = shifted.div_euclid(146_097);
    let day_of_era = shifted.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year_march = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year_march + 2) / 153;
    let day = day_of_year_march - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    let is_leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let day_of_year = cumulative[(month - 1) as usize] + day + i64::from(is_leap && month > 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let spec = chars.next().unwrap_or('%');
        match spec {
            'Y' => out.push_str(&year.to_string()),
            'y' => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            'm' => out.push_str(&format!("{month:02}")),
            'd' => out.push_str(&format!("{day:02}")),
            '-' => match chars.next() {
                Some('d') => out.push_str(&day.to_string()),
                Some('m') => out.push_str(&month.to_string()),
                other => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        format!(
                            "strftime_now: unsupported specifier %-{}",
                            other.unwrap_or(' ')
                        ),
                    ))
                }
            },
            'H' => out.push_str(&format!("{hour:02}")),
            'I' => out.push_str(&format!(
                "{:02}",
                if hour % 12 == 0 { 12 } else { hour % 12 }
            )),
            'p' => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            'M' => out.push_str(&format!("{minute:02}")),
            'S' => out.push_str(&format!("{second:02}")),
            'j' => out.push_str(&format!("{day_of_year:03}")),
            'B' => out.push_str(MONTHS[(month - 1) as usize]),
            'b' => out.push_str(&MONTHS[(month - 1) as usize][..3]),
            'A' => out.push_str(WEEKDAYS[weekday]),
            'a' => out.push_str(&WEEKDAYS[weekday][..3]),
            '%' => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: unsupported specifier %{other}"),
                ))
            }
        }
    }
    Ok(out)
}

/// `tojson(indent=None)`: Python `json.dumps(value, ensure_ascii=False, indent=indent)`
/// formatting (`", "` and `": "` separators, no HTML escaping).
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&value, indent, sort_keys.unwrap_or(false), 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn write_json_string(text: &str, out: &mut String) {
    out.push_str(&serde_json::to_string(text).unwrap_or_default());
}

fn newline_indent(indent: Option<usize>, depth: usize, out: &mut String) {
    if let Some(width) = indent {
        out.push('\n');
        out.push_str(&" ".repeat(width * depth));
    }
}

fn write_json(
    value: &Value,
    indent: Option<usize>,
    sort_keys: bool,
    depth: usize,
    out: &mut String,
) -> Result<(), Error> {
    if depth > 128 {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value nested too deeply",
        ));
    }
    let separator = if indent.is_some() { "," } else { ", " };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(integer) = value.as_i64() {
                out.push_str(&integer.to_string());
            } else {
                let float = f64::try_from(value.clone()).unwrap_or(f64::NAN);
                out.push_str(&if float.is_finite() {
                    format!("{float:?}")
                } else {
                    "NaN".into()
                });
            }
        }
        ValueKind::String => write_json_string(value.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (index, item) in items.iter().enumerate() {
                if index > 0 {
                    out.push_str(separator);
                }
                newline_indent(indent, depth + 1, out);
                write_json(item, indent, sort_keys, depth + 1, out)?;
            }
            newline_indent(indent, depth, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (index, key) in keys.iter().enumerate() {
                if index > 0 {
                    out.push_str(separator);
                }
                newline_indent(indent, depth + 1, out);
                write_json_string(&key.to_string(), out);
                out.push_str(": ");
                write_json(&value.get_item(key)?, indent, sort_keys, depth + 1, out)?;
            }
            newline_indent(indent, depth, out);
            out.push('}');
        }
        _ => write_json_string(&value.to_string(), out),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S", t).unwrap(),
            "2024-02-29 13:05:09"
        );
        assert_eq!(
            strftime("%d %B %Y, %A (%a %b) %j %I%p %%", t).unwrap(),
            "29 February 2024, Thursday (Thu Feb) 060 01PM %"
        );
        assert_eq!(strftime("%Y-%m-%d %A", 0).unwrap(), "1970-01-01 Thursday");
        assert_eq!(strftime("%Y-%m-%d", 951_782_400).unwrap(), "2000-02-29");
        assert!(strftime("%Q", 0).is_err());
    }
}
