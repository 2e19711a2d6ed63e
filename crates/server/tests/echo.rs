//! Completions' `echo` through the router: the answer's text starts with the prompt's, whole
//! and streamed, for text and token-id prompts; with `logprobs` it is a 400.

mod common;

use axum::http::StatusCode;
use common::*;
use serde_json::{json, Value};

const SCRIPT: &str = "Hello world, the end";

async fn whole_text(h: &Harness, body: Value) -> String {
    let (status, answer) = call(&h.app, "/v1/completions", body.to_string(), None).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let value: Value = serde_json::from_str(&answer).unwrap();
    value["choices"][0]["text"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn echo_prepends_the_prompt_whole_and_streamed() {
    let Some(h) = harness(SCRIPT, Mode::Replay, |_| {}) else {
        return;
    };
    let plain = whole_text(&h, json!({"prompt": "Say hi:", "max_tokens": 3})).await;
    let echoed = whole_text(
        &h,
        json!({"prompt": "Say hi:", "max_tokens": 3, "echo": true}),
    )
    .await;
    assert_eq!(echoed, format!("Say hi:{plain}"));

    // Token ids echo as their text.
    let ids = h.tokenizer.encode("Count: one two", false).unwrap();
    let echoed = whole_text(&h, json!({"prompt": ids, "max_tokens": 3, "echo": true})).await;
    assert_eq!(echoed, format!("{}{plain}", h.tokenizer.decode(&ids)));

    // Streamed: the first chunk is the prompt, then the same pieces as without echo.
    let body = json!({"prompt": "Say hi:", "max_tokens": 3, "echo": true, "stream": true});
    let (status, text) = call(&h.app, "/v1/completions", body.to_string(), None).await;
    assert_eq!(status, StatusCode::OK);
    let pieces: Vec<String> = text
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter(|line| *line != "[DONE]")
        .map(|line| {
            let chunk: Value = serde_json::from_str(line).unwrap();
            chunk["choices"][0]["text"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(pieces[0], "Say hi:");
    assert_eq!(pieces.concat(), format!("Say hi:{plain}"));
}

#[tokio::test]
async fn echo_false_changes_nothing_and_echo_with_logprobs_is_refused() {
    let Some(h) = harness(SCRIPT, Mode::Replay, |_| {}) else {
        return;
    };
    let plain = whole_text(&h, json!({"prompt": "x", "max_tokens": 2})).await;
    let off = whole_text(&h, json!({"prompt": "x", "max_tokens": 2, "echo": false})).await;
    assert_eq!(plain, off);
    let body = json!({"prompt": "x", "max_tokens": 2, "echo": true, "logprobs": 1});
    let (status, answer) = call(&h.app, "/v1/completions", body.to_string(), None).await;
    let error = error_of(status, &answer, StatusCode::BAD_REQUEST);
    assert_eq!(error["param"], "echo");
    let body = json!({"prompt": "x", "echo": "yes"});
    let (status, answer) = call(&h.app, "/v1/completions", body.to_string(), None).await;
    error_of(status, &answer, StatusCode::BAD_REQUEST);
}
