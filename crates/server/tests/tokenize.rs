//! `/tokenize`, `/detokenize` and `/v1/models/{id}` through the router, against the
//! tokenizer and the chat template themselves.

mod common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::*;
use pagoda_models::chat_template::{ChatMessage, ChatTemplate};
use serde_json::{json, Value};

fn ids(value: &Value) -> Vec<u32> {
    value["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|id| id.as_u64().unwrap() as u32)
        .collect()
}

#[tokio::test]
async fn tokenize_matches_the_tokenizer_and_detokenize_inverts_it() {
    let Some(h) = harness("x", Mode::Replay, |_| {}) else {
        return;
    };
    let text = "Hello, world! Ünïcödé and 12345.";
    let (status, body) = call(
        &h.app,
        "/tokenize",
        json!({"content": text}).to_string(),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    let expected = h.tokenizer.encode(text, false).unwrap();
    assert_eq!(ids(&answer), expected);
    assert_eq!(answer["count"], expected.len());
    assert_eq!(answer["max_model_len"], 64);

    // vLLM's spelling adds the special tokens by default, as encode(.., true) does.
    let (_, body) = call(
        &h.app,
        "/tokenize",
        json!({"prompt": text}).to_string(),
        None,
    )
    .await;
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(ids(&answer), h.tokenizer.encode(text, true).unwrap());

    let (status, body) = call(
        &h.app,
        "/detokenize",
        json!({"tokens": expected}).to_string(),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["content"], text);
    assert_eq!(answer["prompt"], text);

    // Pieces: one per token, concatenating to the text.
    let body = json!({"content": text, "with_pieces": true}).to_string();
    let (_, body) = call(&h.app, "/tokenize", body, None).await;
    let answer: Value = serde_json::from_str(&body).unwrap();
    let pieces = answer["tokens"].as_array().unwrap();
    assert_eq!(pieces.len(), expected.len());
    let joined: String = pieces
        .iter()
        .map(|p| p["piece"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert!(
        text.starts_with("Hello") && joined.starts_with("Hello"),
        "{joined}"
    );
    assert_eq!(pieces[0]["id"], expected[0]);
}

#[tokio::test]
async fn tokenize_renders_messages_like_a_chat_request() {
    let Some(h) = harness("x", Mode::Replay, |_| {}) else {
        return;
    };
    let messages = json!([{"role": "user", "content": "Hi there"}]);
    let body = json!({"messages": messages}).to_string();
    let (status, body) = call(&h.app, "/tokenize", body, None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let rendered = ChatTemplate::chatml()
        .render(&[ChatMessage::new("user", "Hi there")], true)
        .unwrap();
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(ids(&answer), h.tokenizer.encode_chat(&rendered).unwrap());
}

#[tokio::test]
async fn bad_tokenize_and_detokenize_bodies_are_400s() {
    let Some(h) = harness("x", Mode::Replay, |_| {}) else {
        return;
    };
    let vocab = h.tokenizer.vocab_size();
    for (path, body, param) in [
        ("/tokenize", json!({}), "content"),
        (
            "/tokenize",
            json!({"content": "a", "prompt": "b"}),
            "content",
        ),
        ("/tokenize", json!({"content": 5}), "content"),
        ("/detokenize", json!({}), "tokens"),
        ("/detokenize", json!({"tokens": [vocab]}), "tokens"),
        ("/detokenize", json!({"tokens": [-1]}), "tokens"),
    ] {
        let (status, answer) = call(&h.app, path, body.to_string(), None).await;
        let error = error_of(status, &answer, StatusCode::BAD_REQUEST);
        assert_eq!(error["param"], param, "{path} {body}: {answer}");
    }
}

#[tokio::test]
async fn one_model_is_found_by_any_of_its_names() {
    let Some(h) = harness("x", Mode::Replay, |_| {}) else {
        return;
    };
    let get = |path: &str| Request::get(path).body(Body::empty()).unwrap();
    for name in ["test-model", "test-model.gguf"] {
        let (status, body) = answer(&h.app, get(&format!("/v1/models/{name}"))).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let model: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(model["id"], "test-model");
        assert_eq!(model["object"], "model");
    }
    let (status, body) = answer(&h.app, get("/v1/models/gpt-4")).await;
    let error = error_of(status, &body, StatusCode::NOT_FOUND);
    assert_eq!(error["code"], "model_not_found");
}
