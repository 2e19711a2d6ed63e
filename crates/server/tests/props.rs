//! llama-server's `/props` and `/apply-template`, and CORS (`--cors`), through the router.

mod common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::*;
use pagoda_models::chat_template::{ChatMessage, ChatTemplate};
use pagoda_server::auth::ApiKeys;
use serde_json::{json, Value};
use tower::ServiceExt;

#[tokio::test]
async fn props_report_the_served_settings() {
    let Some(h) = harness("x", Mode::Replay, |config| {
        config.sampling_defaults.temperature = 0.6;
        config.sampling_defaults.top_k = 20;
    }) else {
        return;
    };
    let request = Request::get("/props").body(Body::empty()).unwrap();
    let (status, body) = answer(&h.app, request).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let props: Value = serde_json::from_str(&body).unwrap();
    let settings = &props["default_generation_settings"];
    assert_eq!(settings["n_ctx"], 64);
    assert!((settings["params"]["temperature"].as_f64().unwrap() - 0.6).abs() < 1e-6);
    assert_eq!(settings["params"]["top_k"], 20);
    assert_eq!(
        settings["params"]["n_predict"], -1,
        "no max_tokens by default"
    );
    assert_eq!(props["total_slots"], 2);
    assert_eq!(props["model_alias"], "test-model");
    assert_eq!(props["chat_template"], ChatTemplate::chatml().source());
}

#[tokio::test]
async fn apply_template_renders_what_a_chat_request_would() {
    let Some(h) = harness("x", Mode::Replay, |_| {}) else {
        return;
    };
    let messages = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]);
    let template = ChatTemplate::chatml();
    let chat = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi there"),
    ];
    for (opening, body) in [
        (true, json!({"messages": messages})),
        (
            false,
            json!({"messages": messages, "add_generation_prompt": false}),
        ),
    ] {
        let (status, answer) = call(&h.app, "/apply-template", body.to_string(), None).await;
        assert_eq!(status, StatusCode::OK, "{answer}");
        let value: Value = serde_json::from_str(&answer).unwrap();
        assert_eq!(value["prompt"], template.render(&chat, opening).unwrap());
    }
    let (status, answer) = call(&h.app, "/apply-template", "{}", None).await;
    let error = error_of(status, &answer, StatusCode::BAD_REQUEST);
    assert_eq!(error["param"], "messages", "{answer}");
    let (status, answer) = call(&h.app, "/apply-template", "not json", None).await;
    error_of(status, &answer, StatusCode::BAD_REQUEST);
}

fn preflight(origin: &str) -> Request<Body> {
    Request::options("/v1/chat/completions")
        .header("origin", origin)
        .header("access-control-request-method", "POST")
        .header(
            "access-control-request-headers",
            "authorization,content-type",
        )
        .body(Body::empty())
        .unwrap()
}

#[tokio::test]
async fn cors_answers_preflights_for_the_listed_origins_only() {
    let Some(h) = harness("x", Mode::Replay, |config| {
        config.cors_origins = vec!["http://localhost:3000".into()];
        config.api_keys = ApiKeys::new(["secret"]).unwrap();
    }) else {
        return;
    };
    // The preflight carries no key and is answered before authentication.
    let response = h
        .app
        .clone()
        .oneshot(preflight("http://localhost:3000"))
        .await
        .unwrap();
    assert!(response.status().is_success(), "{:?}", response.status());
    let headers = response.headers();
    assert_eq!(
        headers["access-control-allow-origin"],
        "http://localhost:3000"
    );
    let methods = headers["access-control-allow-methods"].to_str().unwrap();
    assert!(methods.contains("POST"), "{methods}");
    let allowed = headers["access-control-allow-headers"]
        .to_str()
        .unwrap()
        .to_ascii_lowercase();
    assert!(allowed.contains("authorization"), "{allowed}");

    // Another origin gets no grant.
    let response = h
        .app
        .clone()
        .oneshot(preflight("http://evil.example"))
        .await
        .unwrap();
    assert!(response
        .headers()
        .get("access-control-allow-origin")
        .is_none());

    // A real request from the listed origin still needs the key, and its answer carries the
    // grant.
    let request = Request::get("/v1/models")
        .header("origin", "http://localhost:3000")
        .header("authorization", "Bearer secret")
        .body(Body::empty())
        .unwrap();
    let response = h.app.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.headers()["access-control-allow-origin"],
        "http://localhost:3000"
    );
    let request = Request::get("/v1/models")
        .header("origin", "http://localhost:3000")
        .body(Body::empty())
        .unwrap();
    let (status, _) = answer(&h.app, request).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn without_cors_no_grant_is_given() {
    let Some(h) = harness("x", Mode::Replay, |_| {}) else {
        return;
    };
    let response = h
        .app
        .clone()
        .oneshot(preflight("http://localhost:3000"))
        .await
        .unwrap();
    assert!(response
        .headers()
        .get("access-control-allow-origin")
        .is_none());
}

#[test]
fn cors_origins_are_checked() {
    use pagoda_server::check_cors_origins;
    assert!(check_cors_origins(&["*".into()]).is_ok());
    assert!(check_cors_origins(&["https://app.example:8443".into()]).is_ok());
    for bad in ["localhost:3000", "http://x/", "ftp://x", "http://a b"] {
        let error = check_cors_origins(&[bad.into()]).unwrap_err();
        assert!(error.contains(bad), "{error}");
    }
}
