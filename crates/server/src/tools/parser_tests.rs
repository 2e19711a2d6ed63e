//! Tests of the tool-call parsers (`parser.rs`).

use super::*;

/// The pieces of `text` fed in `chunk`-character deltas, then finished.
fn parse(format: ToolFormat, text: &str, chunk: usize) -> Vec<Piece> {
    let mut parser = ToolCallParser::new(format, "x".into());
    let chars: Vec<char> = text.chars().collect();
    let mut pieces = Vec::new();
    for part in chars.chunks(chunk) {
        pieces.extend(parser.push(&part.iter().collect::<String>()));
    }
    pieces.extend(parser.finish());
    merge(pieces)
}

fn call(index: usize, name: &str, arguments: &str) -> [Piece; 2] {
    [
        Piece::CallStart {
            index,
            id: format!("call_x{index}"),
            name: name.into(),
        },
        Piece::Arguments {
            index,
            text: arguments.into(),
        },
    ]
}

#[test]
fn hermes_calls_at_any_split() {
    let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
                {\"city\": \"Paris}\", \"days\": [1, 2]}}\n</tool_call>\n<tool_call>\n\
                {\"name\": \"time\", \"arguments\": {}}\n</tool_call>";
    let mut expected = vec![Piece::Content("Let me check.\n".into())];
    expected.extend(call(
        0,
        "get_weather",
        r#"{"city": "Paris}", "days": [1, 2]}"#,
    ));
    expected.extend(call(1, "time", "{}"));
    for chunk in [1, 2, 3, 7, 1000] {
        assert_eq!(
            parse(ToolFormat::Hermes, text, chunk),
            expected,
            "chunk {chunk}"
        );
    }
}

#[test]
fn hermes_text_without_calls_is_content() {
    for text in ["Just text <tool", "a < b and <tool_cal", "plain"] {
        assert_eq!(
            parse(ToolFormat::Hermes, text, 1),
            vec![Piece::Content(text.into())]
        );
    }
    // An opened call that is not JSON stays text.
    let broken = "<tool_call>not json</tool_call> done";
    assert_eq!(
        parse(ToolFormat::Hermes, broken, 2),
        vec![Piece::Content(broken.into())]
    );
}

#[test]
fn hermes_keys_in_another_order_are_read_whole() {
    let text = "<tool_call>{\"arguments\": {\"a\": 1}, \"name\": \"f\"}</tool_call>";
    assert_eq!(
        parse(ToolFormat::Hermes, text, 3),
        call(0, "f", r#"{"a":1}"#).to_vec()
    );
}

#[test]
fn llama3_calls_and_content() {
    let text = "{\"name\": \"f\", \"parameters\": {\"q\": \"a;b\"}}; {\"name\": \"g\", \
                \"parameters\": {}}";
    let mut expected = call(0, "f", r#"{"q": "a;b"}"#).to_vec();
    expected.extend(call(1, "g", "{}"));
    for chunk in [1, 4, 1000] {
        assert_eq!(parse(ToolFormat::Llama3Json, text, chunk), expected);
    }
    let tagged = "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"x\": 1}}";
    assert_eq!(
        parse(ToolFormat::Llama3Json, tagged, 2),
        call(0, "f", r#"{"x": 1}"#).to_vec()
    );
    let prose = "The answer is {\"name\": 1}.";
    assert_eq!(
        parse(ToolFormat::Llama3Json, prose, 2),
        vec![Piece::Content(prose.into())]
    );
    // JSON that is not a call is content, at the end.
    let json = "{\"answer\": 42}";
    assert_eq!(
        parse(ToolFormat::Llama3Json, json, 3),
        vec![Piece::Content(json.into())]
    );
}

#[test]
fn streams_arguments_as_they_arrive() {
    let mut parser = ToolCallParser::new(ToolFormat::Hermes, "x".into());
    assert!(parser.push("<tool_").is_empty());
    assert!(parser.push("call>{\"name\": \"f\", ").is_empty());
    assert_eq!(parser.push("\"arguments\": {\"a\""), {
        let mut pieces = vec![Piece::CallStart {
            index: 0,
            id: "call_x0".into(),
            name: "f".into(),
        }];
        pieces.push(Piece::Arguments {
            index: 0,
            text: "{\"a\"".into(),
        });
        pieces
    });
    assert_eq!(
        parser.push(": 1}}</tool_call>"),
        vec![Piece::Arguments {
            index: 0,
            text: ": 1}".into()
        }]
    );
    assert_eq!(parser.calls(), 1);
    assert!(parser.finish().is_empty());
}

#[test]
fn partial_suffixes() {
    assert_eq!(partial_suffix("abc<tool", "<tool_call>"), 5);
    assert_eq!(partial_suffix("abc", "<tool_call>"), 0);
    assert_eq!(partial_suffix("<", "<tool_call>"), 1);
    assert_eq!(partial_suffix("é<", "<tool_call>"), 1);
}
