//! Graceful shutdown. On SIGTERM or SIGINT the server drains: `/health` answers 503, new
//! generation requests get a 503 (OpenAI-style body, `Retry-After`), and the requests already
//! running finish, for up to `--shutdown-timeout` seconds. Then the streams still open end
//! with an error event and `[DONE]`, the answers still being collected fail with a 503, and
//! the process exits. A second signal during the drain skips the wait.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use crate::error::ApiError;

/// The drain state shared by the handlers and the shutdown task.
#[derive(Default)]
pub struct Drain {
    draining: AtomicBool,
    aborted: AtomicBool,
    in_flight: AtomicUsize,
    /// Signalled when the last in-flight request ends.
    idle: Notify,
    /// Signalled when the drain gives up on the requests still running.
    abort: Notify,
}

impl Drain {
    /// Whether the server is draining (no new work; `/health` 503).
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Generation requests running now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Admits a generation request (the guard marks it in flight until dropped), or refuses it
    /// with a 503 while draining.
    pub fn enter(self: &Arc<Self>) -> Result<InFlight, ApiError> {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let guard = InFlight(self.clone());
        if self.is_draining() {
            return Err(ApiError::unavailable(
                "the server is shutting down and takes no new requests",
            ));
        }
        Ok(guard)
    }

    /// Starts draining.
    pub fn begin(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Waits until no request is in flight, `timeout` passes or `interrupt` resolves; then
    /// aborts whatever still runs. Returns the requests it aborted.
    pub async fn finish(&self, timeout: Duration, interrupt: impl std::future::Future) -> usize {
        self.begin();
        let idle = async {
            loop {
                let notified = self.idle.notified();
                if self.in_flight() == 0 {
                    return;
                }
                notified.await;
            }
        };
        tokio::select! {
            _ = idle => {}
            _ = tokio::time::sleep(timeout) => {}
            _ = interrupt => {}
        }
        let left = self.in_flight();
        self.aborted.store(true, Ordering::SeqCst);
        self.abort.notify_waiters();
        left
    }

    /// Resolves once the drain has given up on the running requests.
    pub async fn aborted(&self) {
        loop {
            let notified = self.abort.notified();
            if self.aborted.load(Ordering::SeqCst) {
                return;
            }
            notified.await;
        }
    }
}

/// One generation request in flight (see [`Drain::enter`]).
pub struct InFlight(Arc<Drain>);

impl InFlight {
    /// The drain this request belongs to.
    pub fn drain(&self) -> &Drain {
        &self.0
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// Resolves on the first SIGINT (Ctrl-C) or SIGTERM.
pub async fn signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = terminate.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn finish_waits_for_the_last_request_and_refuses_new_ones() {
        let drain = Arc::new(Drain::default());
        let guard = drain.enter().unwrap();
        let waiter = {
            let drain = drain.clone();
            tokio::spawn(async move {
                drain
                    .finish(Duration::from_secs(30), std::future::pending::<()>())
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(drain.is_draining());
        assert!(drain.enter().is_err(), "a new request during the drain");
        assert!(
            !waiter.is_finished(),
            "the drain waits for the running request"
        );
        drop(guard);
        let aborted = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("the drain ends when the last request does")
            .unwrap();
        assert_eq!(aborted, 0);
        assert_eq!(drain.in_flight(), 0);
    }

    #[tokio::test]
    async fn finish_gives_up_after_the_timeout_and_aborts_the_rest() {
        let drain = Arc::new(Drain::default());
        let _guard = drain.enter().unwrap();
        let started = std::time::Instant::now();
        let aborted = drain
            .finish(Duration::from_millis(200), std::future::pending::<()>())
            .await;
        assert_eq!(aborted, 1);
        assert!(started.elapsed() >= Duration::from_millis(200));
        tokio::time::timeout(Duration::from_secs(1), drain.aborted())
            .await
            .expect("the running requests see the abort");
    }
}
