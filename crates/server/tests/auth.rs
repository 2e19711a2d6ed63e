//! The API-key rules, endpoint by endpoint, through the router (no socket).

mod common;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use common::*;
use pagoda_server::auth::ApiKeys;
use serde_json::json;

const KEYS: [&str; 2] = ["key-number-one", "key-number-two"];

/// Every route the router has, with a body it accepts.
fn endpoints() -> Vec<(Method, &'static str, String)> {
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let completion = json!({"prompt": "hi", "max_tokens": 2});
    vec![
        (Method::POST, "/v1/chat/completions", chat.to_string()),
        (Method::POST, "/v1/completions", completion.to_string()),
        (Method::GET, "/v1/models", String::new()),
        (Method::GET, "/metrics", String::new()),
        (Method::GET, "/slots", String::new()),
        (
            Method::POST,
            "/v1/embeddings",
            json!({"input": "hi"}).to_string(),
        ),
    ]
}

async fn send(
    app: &axum::Router,
    method: Method,
    path: &str,
    body: String,
    authorization: Option<&str>,
) -> (StatusCode, String) {
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json");
    if let Some(value) = authorization {
        request = request.header("authorization", value);
    }
    answer(app, request.body(Body::from(body)).unwrap()).await
}

#[tokio::test]
async fn every_endpoint_needs_a_key_and_takes_any_of_them() {
    let Some(h) = harness("Hello", Mode::Replay, |c| {
        c.api_keys = ApiKeys::new(KEYS).unwrap()
    }) else {
        return;
    };
    for (method, path, body) in endpoints() {
        let (status, text) = send(&h.app, method.clone(), path, body.clone(), None).await;
        let error = error_of(status, &text, StatusCode::UNAUTHORIZED);
        assert_eq!(error["type"], "authentication_error", "{path}");
        for key in KEYS {
            for scheme in ["Bearer", "bearer", "BEARER"] {
                let header = format!("{scheme} {key}");
                let (status, text) =
                    send(&h.app, method.clone(), path, body.clone(), Some(&header)).await;
                assert_eq!(
                    status,
                    StatusCode::OK,
                    "{method} {path} with {scheme}: {text}"
                );
            }
        }
    }
    // Unknown paths are refused before they are looked up: no key, no map of the routes.
    let (status, text) = send(&h.app, Method::GET, "/nowhere", String::new(), None).await;
    error_of(status, &text, StatusCode::UNAUTHORIZED);
    let header = format!("Bearer {}", KEYS[0]);
    let (status, _) = send(
        &h.app,
        Method::GET,
        "/nowhere",
        String::new(),
        Some(&header),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn health_and_preflight_stay_open_and_metrics_when_public() {
    let Some(h) = harness("Hello", Mode::Replay, |c| {
        c.api_keys = ApiKeys::new(KEYS).unwrap();
        c.metrics_public = true;
    }) else {
        return;
    };
    let (status, _) = send(&h.app, Method::GET, "/health", String::new(), None).await;
    assert_eq!(status, StatusCode::OK);
    let (status, text) = send(&h.app, Method::GET, "/metrics", String::new(), None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(text.contains("pagoda_requests_total"), "{text}");
    // A preflight is not refused for want of a key (what it answers is CORS's business).
    let (status, _) = send(&h.app, Method::OPTIONS, "/v1/models", String::new(), None).await;
    assert_ne!(status, StatusCode::UNAUTHORIZED);
    // The rest still needs the key.
    let (status, text) = send(&h.app, Method::GET, "/v1/models", String::new(), None).await;
    error_of(status, &text, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn wrong_keys_of_any_length_are_refused_alike() {
    let Some(h) = harness("Hello", Mode::Replay, |c| {
        c.api_keys = ApiKeys::new(KEYS).unwrap()
    }) else {
        return;
    };
    let same_length = "key-number-six";
    assert_eq!(same_length.len(), KEYS[0].len());
    let mut answers = Vec::new();
    for wrong in [
        same_length,
        "key",
        "key-number-one-and-more",
        "key-number-on",
        "KEY-NUMBER-ONE",
    ] {
        let header = format!("Bearer {wrong}");
        answers.push(
            send(
                &h.app,
                Method::GET,
                "/v1/models",
                String::new(),
                Some(&header),
            )
            .await,
        );
    }
    let (status, text) = &answers[0];
    error_of(*status, text, StatusCode::UNAUTHORIZED);
    for answer in &answers {
        assert_eq!(
            answer, &answers[0],
            "refusals must not differ by how close the key was"
        );
    }
    // Another scheme, or a bare key, is not a key.
    for header in ["Basic a2V5LW51bWJlci1vbmU=", "key-number-one", "Bearer"] {
        let (status, text) = send(
            &h.app,
            Method::GET,
            "/v1/models",
            String::new(),
            Some(header),
        )
        .await;
        error_of(status, &text, StatusCode::UNAUTHORIZED);
    }
}

#[tokio::test]
async fn without_keys_everything_is_open() {
    let Some(h) = harness("Hello", Mode::Replay, |_| {}) else {
        return;
    };
    for (method, path, body) in endpoints() {
        let (status, text) = send(&h.app, method.clone(), path, body, None).await;
        assert_eq!(status, StatusCode::OK, "{method} {path}: {text}");
    }
}
