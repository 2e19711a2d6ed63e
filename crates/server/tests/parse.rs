//! Request parsing and validation: every bad field is a 400 naming it.

use pagoda_ops::sampling::SamplingParams;
use pagoda_server::request::{parse_chat, parse_completion, Prompt};

fn chat(body: &str) -> Result<pagoda_server::request::ChatRequest, pagoda_server::error::ApiError> {
    parse_chat(body.as_bytes(), &SamplingParams::default())
}

#[test]
fn a_full_chat_request_is_read() {
    let request = chat(
        r#"{"model":"m","messages":[{"role":"system","content":"be brief"},
            {"role":"user","content":[{"type":"text","text":"hi "},{"type":"text","text":"there"}]}],
            "stream":true,"stream_options":{"include_usage":true},"max_tokens":5,
            "max_completion_tokens":7,"stop":"x","temperature":0.5,"top_p":0.9,"top_k":3,
            "min_p":0.1,"seed":-1,"frequency_penalty":0.5,"presence_penalty":-0.5,
            "repeat_penalty":1.1,"logprobs":true,"top_logprobs":2,"n":1,"user":"ignored"}"#,
    )
    .unwrap();
    assert_eq!(request.messages.len(), 2);
    assert_eq!(request.messages[1].content, "hi there");
    let options = request.options;
    assert!(options.stream && options.include_usage);
    assert_eq!(options.max_tokens, Some(7), "max_completion_tokens wins");
    assert_eq!(options.stop, vec!["x".to_owned()]);
    assert_eq!(options.logprobs, Some(2));
    let s = options.sampling;
    assert_eq!(
        (s.temperature, s.top_p, s.top_k, s.min_p),
        (0.5, 0.9, 3, 0.1)
    );
    assert_eq!(
        (
            s.frequency_penalty,
            s.presence_penalty,
            s.repetition_penalty
        ),
        (0.5, -0.5, 1.1)
    );
    assert_eq!(s.seed, Some(u64::MAX));
}

#[test]
fn absent_fields_take_the_server_defaults() {
    let defaults = SamplingParams {
        temperature: 0.3,
        ..SamplingParams::default()
    };
    let request = parse_chat(
        br#"{"messages":[{"role":"user","content":"a"}]}"#,
        &defaults,
    )
    .unwrap();
    assert_eq!(request.options.sampling, defaults);
    assert_eq!(request.options.max_tokens, None);
    assert!(!request.options.stream);
}

#[test]
fn bad_fields_are_named() {
    let cases: &[(&str, Option<&str>)] = &[
        ("{", None),
        ("[1]", None),
        (r#"{"messages":[]}"#, Some("messages")),
        (r#"{}"#, Some("messages")),
        (r#"{"messages":[{"content":"a"}]}"#, Some("messages")),
        (
            r#"{"messages":[{"role":"user","content":"a"}],"temperature":"hot"}"#,
            Some("temperature"),
        ),
        (
            r#"{"messages":[{"role":"user","content":"a"}],"temperature":-1}"#,
            Some("temperature"),
        ),
        (
            r#"{"messages":[{"role":"user","content":"a"}],"top_p":0}"#,
            Some("top_p"),
        ),
        (
            r#"{"messages":[{"role":"user","content":"a"}],"top_k":-2}"#,
            Some("top_k"),
        ),
        (
            r#"{"messages":[{"role":"user","content":"a"}],"max_tokens":0}"#,
            Some("max_tokens"),
        ),
        (
            r#"{"messages":[{"role":"user","content":"a"}],"max_tokens":1.5}"#,
            Some("max_tokens"),
        ),
        (
            r#"{"messages":[{"role":"user","content":"a"}],"n":17}"#,
            Some("n"),
        ),
        (
            r#"{"messages":[{"role":"user","content":"a"}],"stop":[1]}"#,
            Some("stop"),
        ),
        (
            r#"{"messages":[{"role":"user","content":"a"}],"repeat_penalty":0}"#,
            Some("repeat_penalty"),
        ),
        (
            r#"{"messages":[{"role":"user","content":"a"}],"logprobs":true,"top_logprobs":21}"#,
            Some("top_logprobs"),
        ),
        (
            r#"{"messages":[{"role":"user","content":"a"}],"stream":"yes"}"#,
            Some("stream"),
        ),
        (
            r#"{"messages":[{"role":"user","content":"a"}],"stream_options":{"include_usage":1}}"#,
            Some("stream_options.include_usage"),
        ),
    ];
    for (body, param) in cases {
        let error = chat(body).unwrap_err();
        assert_eq!(error.status.as_u16(), 400, "{body}");
        assert_eq!(error.param.as_deref(), *param, "{body}: {}", error.message);
        assert!(!error.message.is_empty());
    }
}

#[test]
fn completion_prompts_and_logprobs() {
    let parse = |body: &str| parse_completion(body.as_bytes(), &SamplingParams::default());
    assert_eq!(
        parse(r#"{"prompt":"hi"}"#).unwrap().prompt,
        Prompt::Text("hi".into())
    );
    assert_eq!(
        parse(r#"{"prompt":["hi"]}"#).unwrap().prompt,
        Prompt::Text("hi".into())
    );
    assert_eq!(
        parse(r#"{"prompt":[1,2,3]}"#).unwrap().prompt,
        Prompt::Tokens(vec![1, 2, 3])
    );
    assert_eq!(
        parse(r#"{"prompt":"a","logprobs":3}"#)
            .unwrap()
            .options
            .logprobs,
        Some(3)
    );
    for bad in [
        r#"{}"#,
        r#"{"prompt":5}"#,
        r#"{"prompt":["a","b"]}"#,
        r#"{"prompt":[-1]}"#,
        r#"{"prompt":[]}"#,
    ] {
        assert_eq!(
            parse(bad).unwrap_err().param.as_deref(),
            Some("prompt"),
            "{bad}"
        );
    }
    assert_eq!(
        parse(r#"{"prompt":"a","logprobs":-1}"#)
            .unwrap_err()
            .param
            .as_deref(),
        Some("logprobs")
    );
}
