//! The access log: one INFO line per request under the `pagoda_access` target (on by default
//! in `pagoda serve`; `RUST_LOG` filters it). Generation requests log when they end, with
//! their id, tokens and outcome; every other request (and every refused one) when it is
//! answered.

use std::time::Instant;

/// Who sent the request (`-` when the server runs without socket information, as in tests),
/// put in the request's extensions by [`crate::routes::count_requests`].
#[derive(Clone, Debug)]
pub struct Client(pub String);

/// The log line of one generation request, written when it is dropped: with the stream's
/// end, the whole answer's return, or the client's disconnect.
pub struct AccessLog {
    client: String,
    endpoint: &'static str,
    id: String,
    started: Instant,
    prompt_tokens: usize,
    /// Tokens sampled (set as the request runs).
    pub completion_tokens: usize,
    /// `stop`, `length`, `error`, `shutdown` or (the default) `disconnected`.
    pub outcome: &'static str,
}

impl AccessLog {
    /// Starts the line of request `id` on `endpoint`.
    pub fn new(
        client: Option<&Client>,
        endpoint: &'static str,
        id: &str,
        prompt_tokens: usize,
    ) -> Self {
        AccessLog {
            client: client.map_or_else(|| "-".to_owned(), |client| client.0.clone()),
            endpoint,
            id: id.to_owned(),
            started: Instant::now(),
            prompt_tokens,
            completion_tokens: 0,
            outcome: "disconnected",
        }
    }
}

impl Drop for AccessLog {
    fn drop(&mut self) {
        tracing::info!(
            target: "pagoda_access",
            "{} POST {} {} {} prompt={} completion={} {:.0} ms",
            self.client,
            self.endpoint,
            self.id,
            self.outcome,
            self.prompt_tokens,
            self.completion_tokens,
            self.started.elapsed().as_secs_f64() * 1e3
        );
    }
}

/// The line of a request answered at once.
pub fn answered(client: &str, method: &str, path: &str, status: u16, started: Instant) {
    tracing::info!(
        target: "pagoda_access",
        "{client} {method} {path} {status} {:.0} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
}
