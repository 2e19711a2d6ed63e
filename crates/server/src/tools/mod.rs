//! Tool calling (OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`).
//!
//! The tools reach the model through its chat template (as transformers passes them: the
//! `tools` variable); what the model writes back is read by the [`ToolFormat`] of that
//! template's family into OpenAI `tool_calls`, as a stream of pieces ([`parser`]) so a
//! streamed answer carries argument deltas as they are sampled. A call the request forces
//! (`tool_choice: "required"` or a named function) is a grammar: the format's call syntax
//! around each function's JSON schema ([`Tools::grammar`]), so its arguments validate.
//!
//! Formats: [`ToolFormat::Hermes`] (Qwen2.5, Qwen3, Hermes, SmolLM3: `<tool_call>{"name":
//! ..., "arguments": {...}}</tool_call>` per call) and [`ToolFormat::Llama3Json`] (Llama
//! 3.1-3.3: the answer is `{"name": ..., "parameters": {...}}`, calls separated by `; `). The
//! server picks the format from the template's text unless `--tool-call-parser` names one.

pub mod parser;

use pagoda_grammar::GrammarSpec;
use serde_json::{json, Map, Value};

use crate::error::ApiError;

/// How a model family writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, one block per call
    /// (Qwen2.5/Qwen3, Hermes 2/3).
    Hermes,
    /// `{"name": "f", "parameters": {...}}` as the whole answer (after an optional
    /// `<|python_tag|>`), several calls separated by `; ` (Llama 3.1-3.3).
    Llama3Json,
}

impl ToolFormat {
    /// The names `--tool-call-parser` takes (vLLM's spellings).
    pub const NAMES: [&'static str; 2] = ["hermes", "llama3_json"];

    /// The format named `name` (one of [`ToolFormat::NAMES`]).
    pub fn from_name(name: &str) -> Option<ToolFormat> {
        match name {
            "hermes" => Some(ToolFormat::Hermes),
            "llama3_json" => Some(ToolFormat::Llama3Json),
            _ => None,
        }
    }

    /// The format's name.
    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::Llama3Json => "llama3_json",
        }
    }

    /// The format a chat template's text shows: the `<tool_call>` tag (Hermes), or Llama
    /// 3.1's `<|python_tag|>` / `ipython` role; `None` for a template without tool calls.
    pub fn detect(template: &str) -> Option<ToolFormat> {
        if template.contains("<tool_call>") {
            Some(ToolFormat::Hermes)
        } else if template.contains("<|python_tag|>") || template.contains("ipython") {
            Some(ToolFormat::Llama3Json)
        } else {
            None
        }
    }

    /// The key of the arguments object the format writes.
    fn arguments_key(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "arguments",
            ToolFormat::Llama3Json => "parameters",
        }
    }
}

/// The tool-call format of a server: `chosen` (`--tool-call-parser`) or the one `template`
/// shows; `None` when the template never reads `tools` (it could not show them).
pub fn resolve(
    chosen: Option<ToolFormat>,
    template: &pagoda_models::chat_template::ChatTemplate,
) -> Option<ToolFormat> {
    chosen
        .or_else(|| ToolFormat::detect(template.source()))
        .filter(|_| template.reads_variable("tools"))
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Never call a tool; the answer is text (tool syntax in it stays text).
    None,
    /// The model decides (the default with tools).
    Auto,
    /// At least one call, nothing else.
    Required,
    /// One call of this function.
    Named(String),
}

/// A function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Function {
    /// Its name (`[a-zA-Z0-9_-]{1,64}`, as OpenAI requires).
    pub name: String,
    /// The JSON schema of its arguments (an object schema).
    pub parameters: Value,
}

/// The tools of a request, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    /// The `tools` list as the client sent it (what the template renders).
    pub list: Value,
    /// The functions, in order.
    pub functions: Vec<Function>,
    /// `tool_choice` (`auto` when not given).
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (default true): more than one call per answer.
    pub parallel: bool,
}

/// The request's tools: `None` when it sends none (or an empty list); a 400 naming the
/// field for a malformed tool, an unknown `tool_choice`, or a choice without tools.
pub fn parse(object: &Map<String, Value>) -> Result<Option<Tools>, ApiError> {
    let list = match object.get("tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items.clone(),
        Some(_) => {
            return Err(ApiError::invalid_field(
                "tools",
                "`tools` must be an array of tools",
            ))
        }
    };
    let functions = list
        .iter()
        .enumerate()
        .map(|(index, tool)| function(index, tool))
        .collect::<Result<Vec<_>, _>>()?;
    for (index, function) in functions.iter().enumerate() {
        if functions[..index].iter().any(|f| f.name == function.name) {
            return Err(ApiError::invalid_field(
                "tools",
                format!(
                    "tools[{index}]: the function name `{}` is given twice",
                    function.name
                ),
            ));
        }
    }
    let choice = parse_choice(object.get("tool_choice"), &functions)?;
    let parallel = match object.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(parallel)) => *parallel,
        Some(_) => {
            return Err(ApiError::invalid_field(
                "parallel_tool_calls",
                "`parallel_tool_calls` must be a boolean",
            ))
        }
    };
    if functions.is_empty() {
        return match choice {
            ToolChoice::None | ToolChoice::Auto => Ok(None),
            _ => Err(ApiError::invalid_field(
                "tool_choice",
                "`tool_choice` asks for a tool call, but `tools` is empty; send the tools",
            )),
        };
    }
    Ok(Some(Tools {
        list: Value::Array(list),
        functions,
        choice,
        parallel,
    }))
}

/// `tools[index]`: `{"type": "function", "function": {"name", "description"?,
/// "parameters"?}}`.
fn function(index: usize, tool: &Value) -> Result<Function, ApiError> {
    let at = |message: &str| ApiError::invalid_field("tools", format!("tools[{index}]: {message}"));
    let kind = tool.get("type").and_then(Value::as_str);
    if kind != Some("function") {
        return Err(at("only tools of `type: \"function\"` are supported"));
    }
    let function = tool
        .get("function")
        .filter(|f| f.is_object())
        .ok_or_else(|| at("`function` must be an object with a `name`"))?;
    let name = function
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| at("`function.name` must be a string"))?;
    let valid_name = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !valid_name {
        return Err(at(&format!(
            "`function.name` {name:?} must be 1 to 64 letters, digits, `_` or `-`"
        )));
    }
    let parameters = match function.get("parameters") {
        // No parameters: the function takes none.
        None | Some(Value::Null) => {
            json!({ "type": "object", "properties": {}, "additionalProperties": false })
        }
        Some(schema @ Value::Object(_)) => schema.clone(),
        Some(_) => return Err(at("`function.parameters` must be a JSON schema object")),
    };
    Ok(Function {
        name: name.to_owned(),
        parameters,
    })
}

fn parse_choice(value: Option<&Value>, functions: &[Function]) -> Result<ToolChoice, ApiError> {
    const FIELD: &str = "tool_choice";
    let named = |name: &str| {
        if functions.iter().any(|f| f.name == name) {
            Ok(ToolChoice::Named(name.to_owned()))
        } else {
            Err(ApiError::invalid_field(
                FIELD,
                format!("`tool_choice` names the function `{name}`, which is not in `tools`"),
            ))
        }
    };
    match value {
        None | Some(Value::Null) => Ok(ToolChoice::Auto),
        Some(Value::String(choice)) => match choice.as_str() {
            "none" => Ok(ToolChoice::None),
            "auto" => Ok(ToolChoice::Auto),
            "required" => Ok(ToolChoice::Required),
            other => Err(ApiError::invalid_field(
                FIELD,
                format!(
                    "`tool_choice` must be \"none\", \"auto\", \"required\" or \
                     {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {other:?}"
                ),
            )),
        },
        Some(Value::Object(choice)) => {
            let name = choice
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::invalid_field(
                        FIELD,
                        "`tool_choice` as an object must be {\"type\": \"function\", \
                         \"function\": {\"name\": ...}}",
                    )
                })?;
            named(name)
        }
        Some(_) => Err(ApiError::invalid_field(
            FIELD,
            "`tool_choice` must be a string or an object",
        )),
    }
}

impl Tools {
    /// Whether the answer is read for tool calls (not with `tool_choice: "none"`).
    pub fn parses(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The grammar of a forced call in `format` (`required`: one call of any function, or
    /// several with `parallel_tool_calls`; a named function: one call of it), each call's
    /// arguments following its function's schema. `None` when the model may answer freely.
    pub fn grammar(&self, format: ToolFormat) -> Option<GrammarSpec> {
        let functions: Vec<&Function> = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Required => self.functions.iter().collect(),
            ToolChoice::Named(name) => self.functions.iter().filter(|f| &f.name == name).collect(),
        };
        let parallel = self.parallel && self.choice == ToolChoice::Required;
        let mut lark = String::new();
        let (call, separator) = match format {
            ToolFormat::Hermes => (r#""<tool_call>\n" object "\n</tool_call>""#, r#""\n""#),
            ToolFormat::Llama3Json => ("object", r#""; ""#),
        };
        if parallel {
            lark.push_str(&format!("start: call ({separator} call)*\n"));
        } else {
            lark.push_str("start: call\n");
        }
        lark.push_str(&format!("call: {call}\n"));
        let alternatives: Vec<String> = (0..functions.len()).map(|i| format!("f{i}")).collect();
        lark.push_str(&format!("object: {}\n", alternatives.join(" | ")));
        for (index, function) in functions.iter().enumerate() {
            let schema = json!({
                "type": "object",
                "properties": {
                    "name": { "const": function.name },
                    format.arguments_key(): function.parameters,
                },
                "required": ["name", format.arguments_key()],
                "additionalProperties": false,
                "x-guidance": {
                    "whitespace_flexible": false,
                    "item_separator": ", ",
                    "key_separator": ": ",
                },
            });
            lark.push_str(&format!("f{index}: %json {schema}\n"));
        }
        Some(GrammarSpec::Lark(lark))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(body: Value) -> Result<Option<Tools>, ApiError> {
        parse(body.as_object().unwrap())
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        }}})
    }

    #[test]
    fn parses_tools_and_choices() {
        let parsed = tools(json!({"tools": [weather()]})).unwrap().unwrap();
        assert_eq!(parsed.choice, ToolChoice::Auto);
        assert!(parsed.parallel && parsed.parses());
        assert_eq!(parsed.functions[0].name, "get_weather");
        let named = json!({"tools": [weather()], "parallel_tool_calls": false,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
        let parsed = tools(named).unwrap().unwrap();
        assert_eq!(parsed.choice, ToolChoice::Named("get_weather".into()));
        assert!(!parsed.parallel);
        assert!(tools(json!({"tools": [], "tool_choice": "auto"}))
            .unwrap()
            .is_none());
        let none = tools(json!({"tools": [weather()], "tool_choice": "none"}));
        assert!(!none.unwrap().unwrap().parses());
    }

    #[test]
    fn refuses_malformed_tools() {
        let cases = [
            json!({"tools": {"type": "function"}}),
            json!({"tools": [{"type": "retrieval"}]}),
            json!({"tools": [{"type": "function", "function": {"name": "has space"}}]}),
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}),
            json!({"tools": [weather(), weather()]}),
            json!({"tools": [weather()], "tool_choice": "sometimes"}),
            json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            json!({"tool_choice": "required"}),
            json!({"tools": [weather()], "parallel_tool_calls": "yes"}),
        ];
        for case in cases {
            let error = tools(case.clone()).expect_err(&case.to_string());
            assert_eq!(error.status, axum::http::StatusCode::BAD_REQUEST, "{case}");
        }
    }

    #[test]
    fn detects_formats() {
        assert_eq!(
            ToolFormat::detect("{{ '<tool_call>' }}"),
            Some(ToolFormat::Hermes)
        );
        assert_eq!(
            ToolFormat::detect("<|python_tag|>"),
            Some(ToolFormat::Llama3Json)
        );
        assert_eq!(ToolFormat::detect("{{ messages }}"), None);
    }

    #[test]
    fn forced_calls_are_grammars() {
        let free = tools(json!({"tools": [weather()]})).unwrap().unwrap();
        assert_eq!(free.grammar(ToolFormat::Hermes), None);
        let required = tools(json!({"tools": [weather()], "tool_choice": "required"}))
            .unwrap()
            .unwrap();
        let Some(GrammarSpec::Lark(lark)) = required.grammar(ToolFormat::Hermes) else {
            panic!("a Lark grammar");
        };
        assert!(lark.starts_with("start: call (\"\\n\" call)*"), "{lark}");
        assert!(lark.contains(r#""name":{"const":"get_weather"}"#), "{lark}");
        let Some(GrammarSpec::Lark(lark)) = required.grammar(ToolFormat::Llama3Json) else {
            panic!("a Lark grammar");
        };
        assert!(lark.contains(r#""parameters":"#), "{lark}");
    }
}
