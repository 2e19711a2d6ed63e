// Chat template environment: transformers' Jinja2 settings and helpers. Expected strings are
// what Jinja2 with trim_blocks/lstrip_blocks (transformers' apply_chat_template) produces for
// the same templates, worked out by hand.

use pagoda_models::chat_template::{ChatMessage, ChatTemplate};

fn conversation() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi"),
        ChatMessage::new("assistant", "Hello!"),
        ChatMessage::new("user", "Bye"),
    ]
}

#[test]
fn chatml_fallback() {
    let rendered = ChatTemplate::chatml()
        .render(&conversation()[..2], true)
        .unwrap();
    assert_eq!(
        rendered,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let rendered = ChatTemplate::chatml()
        .render(&conversation()[1..2], false)
        .unwrap();
    assert_eq!(rendered, "<|im_start|>user\nHi<|im_end|>\n");
}

#[test]
fn trim_and_lstrip_blocks_like_transformers() {
    // Block tags on their own indented lines leave no whitespace behind; the template's
    // final newline is dropped (keep_trailing_newline = False).
    let source = "{% for message in messages %}\n    {% if message.role == 'user' %}\nU: {{ message.content }}\n    {% else %}\nO: {{ message.content }}\n    {% endif %}\n{% endfor %}\n";
    let template = ChatTemplate::new(source, None, None).unwrap();
    let rendered = template.render(&conversation()[..2], false).unwrap();
    assert_eq!(rendered, "O: Be brief.\nU: Hi\n");
}

#[test]
fn loop_controls_namespace_and_python_methods() {
    let source = "{% set ns = namespace(count=0) %}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{% if loop.index > 3 %}{% break %}{% endif %}{% set ns.count = ns.count + 1 %}{{ m.role.upper() }}:{{ m.content.strip('!').lower() }}{{ '|' if m.content.startswith('H') else ';' }}{% endfor %}{{ ns.count }}";
    let template = ChatTemplate::new(source, None, None).unwrap();
    assert_eq!(
        template.render(&conversation(), false).unwrap(),
        "USER:hi|ASSISTANT:hello|2"
    );
}

#[test]
fn bos_eos_and_generation_prompt_variables() {
    let source = "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}>{% endif %}";
    let template = ChatTemplate::new(source, Some("<s>"), Some("</s>")).unwrap();
    assert_eq!(
        template.render(&conversation()[1..3], true).unwrap(),
        "<s>Hi</s>Hello!</s>>"
    );
    let template = ChatTemplate::new(source, None, None).unwrap();
    assert_eq!(template.render(&conversation()[1..2], false).unwrap(), "Hi");
}

#[test]
fn tojson_writes_python_json_dumps_style() {
    // Messages keep Python's key order (role, content); minijinja's own dict literals are
    // sorted, so the literal here asks for sort_keys.
    let source = "{{ messages[1] | tojson }}|{{ {'b': [1, 2.5, none, true], 'a': '<é>'} | tojson(sort_keys=true) }}|{{ [1, {'k': 'v'}] | tojson(indent=2) }}";
    let template = ChatTemplate::new(source, None, None).unwrap();
    let rendered = template.render(&conversation(), false).unwrap();
    let expected = concat!(
        r#"{"role": "user", "content": "Hi"}"#,
        "|",
        r#"{"a": "<é>", "b": [1, 2.5, null, true]}"#,
        "|[\n  1,\n  {\n    \"k\": \"v\"\n  }\n]"
    );
    assert_eq!(rendered, expected);
}

#[test]
fn raise_exception_becomes_an_error_with_its_message() {
    let source = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}ok";
    let template = ChatTemplate::new(source, None, None).unwrap();
    let error = template
        .render(&conversation(), false)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("Conversation roles must alternate"),
        "{error}"
    );
    assert_eq!(template.render(&conversation()[1..], false).unwrap(), "ok");
}

#[test]
fn strftime_now_formats_the_current_date() {
    let template = ChatTemplate::new("{{ strftime_now('%Y-%m-%d') }}", None, None).unwrap();
    let rendered = template.render(&[], false).unwrap();
    let bytes = rendered.as_bytes();
    assert_eq!(rendered.len(), 10, "{rendered}");
    assert!(
        rendered.starts_with("20") && bytes[4] == b'-' && bytes[7] == b'-',
        "{rendered}"
    );
}

#[test]
fn broken_templates_are_errors_not_panics() {
    let error = ChatTemplate::new("{% for m in messages %}{{ m.content }}", None, None)
        .unwrap_err()
        .to_string();
    assert!(error.contains("chat template"), "{error}");
    let template =
        ChatTemplate::new("{{ messages[0].content.nonexistent_method() }}", None, None).unwrap();
    assert!(template.render(&conversation(), false).is_err());
    let template = ChatTemplate::new("{{ 1 + messages }}", None, None).unwrap();
    assert!(template.render(&conversation(), false).is_err());
}

#[test]
fn tools_and_tool_calls_reach_the_template_as_transformers_passes_them() {
    use pagoda_models::chat_template::ToolCall;
    let source = "{% for t in tools %}{{ t | tojson }}\n{% endfor %}\
        {% for m in messages %}{{ m.role }}:{% if m.tool_calls %}\
        {% for c in m.tool_calls %}{{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}\
        {% endfor %}{% else %}{{ m.content }}{% if m.tool_call_id %} ({{ m.tool_call_id }}){% endif %}\
        {% endif %}\n{% endfor %}";
    let template = ChatTemplate::new(source, None, None).unwrap();
    assert!(template.reads_variable("tools"));
    assert!(!ChatTemplate::chatml().reads_variable("tools"));
    let tools = serde_json::json!([{"type": "function", "function": {"name": "f", "parameters": {"z": 1, "a": 2}}}]);
    let mut call = ChatMessage::new("assistant", "");
    call.tool_calls.push(ToolCall {
        id: "call_1".into(),
        name: "f".into(),
        arguments: serde_json::json!({"city": "Oslo", "days": 2}),
    });
    let mut result = ChatMessage::new("tool", "21C");
    result.tool_call_id = Some("call_1".into());
    let rendered = template
        .render_with_tools(
            &[ChatMessage::new("user", "hi"), call, result],
            Some(&tools),
            false,
        )
        .unwrap();
    // Keys keep the client's order (a Python dict's), as transformers renders them.
    assert_eq!(
        rendered,
        "{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"z\": 1, \"a\": 2}}}\n\
         user:hiassistant:call_1 f {\"city\": \"Oslo\", \"days\": 2}tool:21C (call_1)"
    );
    // Without tools, `tools` is none (transformers passes None).
    let plain = ChatTemplate::new("{{ tools is none }}", None, None).unwrap();
    assert_eq!(plain.render(&[], false).unwrap(), "True");
}
