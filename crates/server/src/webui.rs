//! `GET /`: the chat page, one HTML file with its CSS and JavaScript inline
//! (`crates/server/webui/index.html`), compiled into the binary so the server needs no files
//! and the browser no network beyond this server. The page calls `/props`, `/v1/models` and
//! `/v1/chat/completions` (streamed) of the origin it came from, with the API key the user
//! types in when the server answers 401.

use axum::http::header;
use axum::response::{IntoResponse, Response};

/// The page's HTML.
pub const PAGE: &str = include_str!("../webui/index.html");

/// What the page may load and call: its own inline script and style, `fetch` to this origin,
/// and nothing else (no CDN, no images but `data:` URLs, no frames, no forms elsewhere).
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'unsafe-inline'; \
     style-src 'unsafe-inline'; connect-src 'self'; img-src data:; base-uri 'none'; \
     form-action 'none'; frame-ancestors 'none'";

/// `GET /`: [`PAGE`] as HTML, under [`CONTENT_SECURITY_POLICY`].
pub async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        PAGE,
    )
        .into_response()
}
