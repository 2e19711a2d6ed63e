//! The chat page at `/`: served as HTML under a strict content security policy, without a
//! key when the server has keys, and absent with `--no-webui`.

mod common;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use common::*;
use pagoda_server::auth::ApiKeys;
use tower::ServiceExt;

async fn get(app: &axum::Router, path: &str) -> (StatusCode, axum::http::HeaderMap, String) {
    let request = Request::get(path).body(Body::empty()).unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    (
        parts.status,
        parts.headers,
        String::from_utf8(bytes.to_vec()).unwrap(),
    )
}

fn assert_is_the_page(status: StatusCode, headers: &axum::http::HeaderMap, body: &str) {
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(headers[header::CONTENT_TYPE], "text/html; charset=utf-8");
    assert_eq!(headers[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
    let policy = headers[header::CONTENT_SECURITY_POLICY].to_str().unwrap();
    assert!(policy.contains("default-src 'none'"), "{policy}");
    assert!(policy.contains("connect-src 'self'"), "{policy}");
    assert!(body.starts_with("<!DOCTYPE html>"), "{}", &body[..80]);
    assert!(body.contains("/v1/chat/completions"));
}

#[tokio::test]
async fn the_page_is_served_at_the_root() {
    let Some(h) = harness("x", Mode::Replay, |_| {}) else {
        return;
    };
    let (status, headers, body) = get(&h.app, "/").await;
    assert_is_the_page(status, &headers, &body);
    // Self-contained: no script, style or font fetched from elsewhere.
    for external in ["src=\"http", "href=\"http", "@import", "url(http"] {
        assert!(!body.contains(external), "the page loads {external}...");
    }
}

#[tokio::test]
async fn the_page_needs_no_key_but_the_api_still_does() {
    let Some(h) = harness("x", Mode::Replay, |config| {
        config.api_keys = ApiKeys::new(["page-test-key"]).unwrap();
    }) else {
        return;
    };
    let (status, headers, body) = get(&h.app, "/").await;
    assert_is_the_page(status, &headers, &body);
    let (status, _, body) = get(&h.app, "/props").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    let (status, _, body) = get(&h.app, "/index.html").await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "only `/` itself is public: {body}"
    );
}

#[tokio::test]
async fn no_webui_leaves_the_root_a_404() {
    let Some(h) = harness("x", Mode::Replay, |config| config.webui = false) else {
        return;
    };
    let (status, _, body) = get(&h.app, "/").await;
    error_of(status, &body, StatusCode::NOT_FOUND);
}
