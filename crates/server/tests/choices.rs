//! `n` and `best_of` through the router: `n` choices indexed 0..n, whole and streamed (each
//! choice's chunks carry its index, one `[DONE]` after the last choice ends, usage counts every
//! choice's tokens); `best_of` returns `n` of its candidates; out-of-range values are 400s
//! naming the field. (Which candidate `best_of` keeps, and the per-choice seeds, are checked
//! against the real model in `tests/server/test_api.py`.)

mod common;

use std::collections::BTreeMap;

use axum::http::StatusCode;
use common::*;
use serde_json::{json, Value};

const SCRIPT: &str = "one two three";

async fn whole(h: &Harness, path: &str, body: Value) -> Value {
    let (status, answer) = call(&h.app, path, body.to_string(), None).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    serde_json::from_str(&answer).unwrap()
}

#[tokio::test]
async fn n_choices_whole_for_both_endpoints() {
    let Some(h) = harness(SCRIPT, Mode::Replay, |_| {}) else {
        return;
    };
    let one = whole(
        &h,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 8}),
    )
    .await;
    let text = one["choices"][0]["text"].as_str().unwrap();
    let single_tokens = one["usage"]["completion_tokens"].as_u64().unwrap();
    let three = whole(
        &h,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 8, "n": 3}),
    )
    .await;
    let choices = three["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{three}");
    for (index, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], index);
        assert_eq!(choice["text"], text, "the scripted engine answers alike");
        assert_eq!(choice["finish_reason"], "stop");
    }
    assert_eq!(three["usage"]["completion_tokens"], 3 * single_tokens);
    assert_eq!(
        three["usage"]["prompt_tokens"],
        one["usage"]["prompt_tokens"]
    );

    let messages = json!([{"role": "user", "content": "hi"}]);
    let chat = whole(
        &h,
        "/v1/chat/completions",
        json!({"messages": messages, "max_tokens": 8, "n": 2}),
    )
    .await;
    let choices = chat["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{chat}");
    assert_eq!(choices[1]["index"], 1);
    assert_eq!(choices[1]["message"]["content"], text);
}

#[tokio::test]
async fn n_choices_streamed_carry_their_index() {
    let Some(h) = harness(SCRIPT, Mode::Replay, |_| {}) else {
        return;
    };
    let messages = json!([{"role": "user", "content": "hi"}]);
    let body = json!({
        "messages": messages, "max_tokens": 8, "n": 3, "stream": true,
        "stream_options": {"include_usage": true},
    });
    let (status, text) = call(&h.app, "/v1/chat/completions", body.to_string(), None).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let events: Vec<&str> = text
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    assert_eq!(events.iter().filter(|e| **e == "[DONE]").count(), 1);
    let mut texts: BTreeMap<u64, String> = BTreeMap::new();
    let mut roles = 0;
    let mut finishes = 0;
    let mut usage = None;
    for event in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(event).unwrap();
        let Some(choice) = chunk["choices"].get(0) else {
            usage = Some(chunk["usage"].clone());
            continue;
        };
        let index = choice["index"].as_u64().unwrap();
        if choice["delta"]["role"] == "assistant" {
            roles += 1;
        }
        if !choice["finish_reason"].is_null() {
            finishes += 1;
        }
        let piece = choice["delta"]["content"].as_str().unwrap_or("");
        texts.entry(index).or_default().push_str(piece);
    }
    assert_eq!((roles, finishes), (3, 3));
    assert_eq!(texts.len(), 3);
    assert!(
        texts.values().all(|t| t == &texts[&0] && !t.is_empty()),
        "{texts:?}"
    );
    let usage = usage.expect("a usage chunk");
    let one = whole(
        &h,
        "/v1/chat/completions",
        json!({"messages": messages, "max_tokens": 8}),
    )
    .await;
    let single = one["usage"]["completion_tokens"].as_u64().unwrap();
    assert_eq!(usage["completion_tokens"], 3 * single);
}

#[tokio::test]
async fn best_of_returns_n_of_its_candidates() {
    let Some(h) = harness(SCRIPT, Mode::Replay, |_| {}) else {
        return;
    };
    let one = whole(
        &h,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 8}),
    )
    .await;
    let single = one["usage"]["completion_tokens"].as_u64().unwrap();
    let best = whole(
        &h,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 8, "best_of": 3}),
    )
    .await;
    assert_eq!(best["choices"].as_array().unwrap().len(), 1, "{best}");
    assert_eq!(best["choices"][0]["index"], 0);
    assert!(
        best["choices"][0]["logprobs"].is_null(),
        "not asked for: {best}"
    );
    assert_eq!(
        best["usage"]["completion_tokens"],
        3 * single,
        "every candidate counts"
    );
    let two = whole(
        &h,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 8, "best_of": 3, "n": 2, "logprobs": 0}),
    )
    .await;
    assert_eq!(two["choices"].as_array().unwrap().len(), 2);
    assert!(two["choices"][1]["logprobs"]["token_logprobs"].is_array());
}

#[tokio::test]
async fn out_of_range_n_and_best_of_are_400s() {
    let Some(h) = harness(SCRIPT, Mode::Replay, |_| {}) else {
        return;
    };
    let messages = json!([{"role": "user", "content": "hi"}]);
    for (path, body, field) in [
        ("/v1/completions", json!({"prompt": "x", "n": 0}), "n"),
        ("/v1/completions", json!({"prompt": "x", "n": 17}), "n"),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "n": -1}),
            "n",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "n": 3, "best_of": 2}),
            "best_of",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "best_of": 17}),
            "best_of",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "best_of": 2, "stream": true}),
            "best_of",
        ),
    ] {
        let (status, text) = call(&h.app, path, body.to_string(), None).await;
        let error = error_of(status, &text, StatusCode::BAD_REQUEST);
        assert_eq!(error["param"], field, "{body}: {error}");
    }
    // best_of equal to n streams (nothing to rank).
    let body = json!({"prompt": "x", "max_tokens": 2, "best_of": 2, "n": 2, "stream": true});
    let (status, _) = call(&h.app, "/v1/completions", body.to_string(), None).await;
    assert_eq!(status, StatusCode::OK);
}
