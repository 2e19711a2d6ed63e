//! Who may call the server: API keys compared in constant time, and the few paths left open.
//!
//! When the server has keys, every request needs `Authorization: Bearer <key>` (the scheme in
//! any case) except [`PUBLIC_PATHS`], CORS preflights (`OPTIONS`) and, with
//! `--metrics-public`, `/metrics`. Keys are kept only as SHA-256 digests; a given key is
//! hashed and compared with every digest with `subtle`, so neither the answer's timing nor
//! its body tells which bytes, which key or what length was close. A refusal is logged with
//! the client's address and never with key material.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::connect_info::Connected;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::serve::IncomingStream;
use sha2::{Digest, Sha256};
use subtle::{Choice, ConstantTimeEq};

use crate::error::ApiError;
use crate::AppState;

/// Paths answered without a key: the load balancer's health probe and the chat page (it
/// holds no data; its API calls send the key the user types in).
pub const PUBLIC_PATHS: &[&str] = &["/health", "/"];

/// The accepted API keys, as SHA-256 digests.
#[derive(Clone, Default)]
pub struct ApiKeys {
    digests: Vec<[u8; 32]>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} keys)", self.digests.len())
    }
}

/// Why a request was refused (never holds key material).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No `Authorization` header.
    Missing,
    /// A header that is not `Bearer <key>`.
    Malformed,
    /// A key that matches none of the server's.
    Wrong,
}

impl Refusal {
    fn message(self) -> &'static str {
        match self {
            Refusal::Missing => "no API key: send `Authorization: Bearer <key>`",
            Refusal::Malformed => {
                "the Authorization header is not `Bearer <key>`: send `Authorization: Bearer <key>`"
            }
            Refusal::Wrong => "the API key is wrong",
        }
    }
}

impl ApiKeys {
    /// Keys from `keys` (surrounding whitespace trimmed). Empty keys are an error: an empty
    /// key would turn authentication off without saying so.
    pub fn new<S: AsRef<str>>(keys: impl IntoIterator<Item = S>) -> Result<ApiKeys, String> {
        let mut digests = Vec::new();
        for key in keys {
            let key = key.as_ref().trim();
            if key.is_empty() {
                return Err("an API key is empty".to_owned());
            }
            digests.push(digest(key.as_bytes()));
        }
        Ok(ApiKeys { digests })
    }

    /// Keys of a key file: one per line; blank lines and lines starting with `#` are skipped.
    pub fn parse_file_text(text: &str) -> Vec<String> {
        text.lines()
            .map(str::trim)
            .filter(|line| !line.is_empty() && !line.starts_with('#'))
            .map(str::to_owned)
            .collect()
    }

    /// How many keys are accepted.
    pub fn len(&self) -> usize {
        self.digests.len()
    }

    /// Whether no key is set.
    pub fn is_empty(&self) -> bool {
        self.digests.is_empty()
    }

    /// Checks an `Authorization` header value: `Bearer <key>`, the scheme case-insensitive.
    pub fn check(&self, authorization: Option<&HeaderValue>) -> Result<(), Refusal> {
        let value = authorization.ok_or(Refusal::Missing)?;
        let given = bearer_token(value.as_bytes()).ok_or(Refusal::Malformed)?;
        let given = digest(given);
        // Compare with every key, without stopping at a match.
        let mut matched = Choice::from(0);
        for key in &self.digests {
            matched |= key.ct_eq(&given);
        }
        if bool::from(matched) {
            Ok(())
        } else {
            Err(Refusal::Wrong)
        }
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// The token of `Bearer <token>` (scheme case-insensitive, whitespace around the token
/// trimmed), or `None` for another scheme or an empty token.
pub fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let value = value.trim_ascii();
    let split = value.iter().position(|b| b.is_ascii_whitespace())?;
    let (scheme, rest) = value.split_at(split);
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    let token = rest.trim_ascii();
    (!token.is_empty()).then_some(token)
}

/// Whether `request` may skip the key check.
fn is_public(request: &Request, metrics_public: bool) -> bool {
    let path = request.uri().path();
    request.method() == Method::OPTIONS
        || PUBLIC_PATHS.contains(&path)
        || (metrics_public && path == "/metrics")
}

/// The client's address, for logs (set by the listener; absent in in-process tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientAddr(pub SocketAddr);

impl std::fmt::Display for ClientAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl Connected<IncomingStream<'_, tokio::net::TcpListener>> for ClientAddr {
    fn connect_info(stream: IncomingStream<'_, tokio::net::TcpListener>) -> ClientAddr {
        ClientAddr(*stream.remote_addr())
    }
}

impl Connected<IncomingStream<'_, crate::tls::TlsListener>> for ClientAddr {
    fn connect_info(stream: IncomingStream<'_, crate::tls::TlsListener>) -> ClientAddr {
        ClientAddr(*stream.remote_addr())
    }
}

/// Refuses requests without a right key when the server has keys (401, OpenAI body).
pub async fn require_api_key(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let keys = &state.config.api_keys;
    if !keys.is_empty() && !is_public(&request, state.config.metrics_public) {
        if let Err(refusal) = keys.check(request.headers().get(header::AUTHORIZATION)) {
            // The access-log middleware (outside this one) named the client.
            let client = request
                .extensions()
                .get::<crate::access::Client>()
                .map_or_else(
                    || "an unknown address".to_owned(),
                    |client| client.0.clone(),
                );
            tracing::warn!(
                "refused {} {} from {client}: {refusal:?} API key",
                request.method(),
                request.uri().path()
            );
            return ApiError::unauthorized(refusal.message()).into_response();
        }
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(text: &str) -> HeaderValue {
        HeaderValue::from_str(text).unwrap()
    }

    #[test]
    fn bearer_scheme_is_case_insensitive_and_the_token_trimmed() {
        assert_eq!(bearer_token(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"BEARER   abc  "), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"Bearer"), None);
        assert_eq!(bearer_token(b"Bearer   "), None);
        assert_eq!(bearer_token(b"Basic abc"), None);
        assert_eq!(bearer_token(b"Bearerabc"), None);
    }

    #[test]
    fn any_of_several_keys_is_accepted_and_others_refused_alike() {
        let keys = ApiKeys::new(["first-key", " second-key "]).unwrap();
        assert_eq!(keys.len(), 2);
        assert_eq!(keys.check(Some(&header("Bearer first-key"))), Ok(()));
        assert_eq!(keys.check(Some(&header("bearer second-key"))), Ok(()));
        // Same length, another length, a prefix: the same refusal.
        for wrong in [
            "Bearer first-kez",
            "Bearer first",
            "Bearer first-key-and-more",
        ] {
            assert_eq!(keys.check(Some(&header(wrong))), Err(Refusal::Wrong));
        }
        assert_eq!(keys.check(None), Err(Refusal::Missing));
        assert_eq!(
            keys.check(Some(&header("Basic Zmlyc3Qta2V5"))),
            Err(Refusal::Malformed)
        );
        assert!(format!("{keys:?}").contains("2 keys"));
        assert!(!format!("{keys:?}").contains("first"));
    }

    #[test]
    fn empty_keys_are_refused_and_key_files_skip_comments() {
        assert!(ApiKeys::new(["ok", "  "]).is_err());
        assert!(ApiKeys::new(Vec::<String>::new()).unwrap().is_empty());
        let text = "# keys of the team\n\nalpha\n  beta  \n#gamma\n";
        assert_eq!(ApiKeys::parse_file_text(text), ["alpha", "beta"]);
    }
}
