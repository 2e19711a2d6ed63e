//! The accept loop, with limits (issue 43): at most `max_connections` connections are open
//! at once (more wait in the listen backlog until one closes); a connection with no request
//! running that moves no byte for `timeout` is closed (a client that connects and sends
//! nothing, or leaves a kept-alive connection idle); a client has `timeout` to finish a
//! request's headers once it starts them (hyper's header-read timer) and to send its body
//! (tower-http's body timeout); and a shutdown stops accepting, asks every connection to
//! close after its response, and waits for them. (axum's own `serve` has neither a
//! connection limit nor timeouts.)

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::extract::connect_info::ConnectInfo;
use axum::extract::Request;
use axum::serve::Listener;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Semaphore;
use tower::ServiceExt;

use crate::auth::ClientAddr;

/// Connection limits (`--max-connections`, `--timeout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections open at once; more wait in the listen backlog.
    pub max_connections: usize,
    /// Longest a client may take to send a request's headers (or to start the next request
    /// on a kept-alive connection) and its body.
    pub timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max_connections: 512,
            timeout: Duration::from_secs(60),
        }
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, then waits for the open connections
/// to finish their responses and close.
pub async fn serve_connections<L>(
    mut listener: L,
    app: Router,
    limits: ConnectionLimits,
    shutdown: impl std::future::Future<Output = ()>,
) where
    L: Listener<Addr = SocketAddr>,
{
    let app = app.layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
        limits.timeout,
    ));
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut shutdown = pin!(shutdown);
    loop {
        let permit = tokio::select! {
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
            _ = &mut shutdown => break,
        };
        let (io, address) = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = &mut shutdown => break,
        };
        let app = app.clone();
        let activity = Arc::new(Activity::new());
        let watched = activity.clone();
        let service = tower::service_fn(move |request: Request<Incoming>| {
            let mut request = request.map(axum::body::Body::new);
            request
                .extensions_mut()
                .insert(ConnectInfo(ClientAddr(address)));
            let answer = app.clone().oneshot(request);
            let running = Running::new(&watched);
            async move {
                let response = answer.await.unwrap_or_else(|e| match e {});
                // The request runs until its body is sent (a stream may wait in the queue).
                let response = response.map(|inner| {
                    axum::body::Body::new(GuardedBody {
                        inner,
                        _running: running,
                    })
                });
                Ok::<_, Infallible>(response)
            }
        });
        let mut builder = Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.timeout);
        let io = TokioIo::new(Watched {
            io,
            activity: activity.clone(),
        });
        let connection = builder
            .serve_connection_with_upgrades(io, TowerToHyperService::new(service))
            .into_owned();
        let connection = graceful.watch(connection);
        let timeout = limits.timeout;
        tokio::spawn(async move {
            let mut connection = pin!(connection);
            loop {
                tokio::select! {
                    result = connection.as_mut() => {
                        if let Err(error) = result {
                            tracing::debug!("connection from {address}: {error}");
                        }
                        break;
                    }
                    _ = tokio::time::sleep(timeout / 4) => {
                        if activity.idle_for() >= timeout {
                            tracing::debug!("connection from {address}: idle, closed");
                            break;
                        }
                    }
                }
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// When a connection last moved a byte, and its requests running now.
struct Activity {
    started: Instant,
    /// Milliseconds after `started` of the last byte read or written.
    last: AtomicU64,
    running: AtomicUsize,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            started: Instant::now(),
            last: AtomicU64::new(0),
            running: AtomicUsize::new(0),
        }
    }

    fn touch(&self) {
        let now = self.started.elapsed().as_millis() as u64;
        self.last.store(now, Ordering::Relaxed);
    }

    /// How long the connection has been idle: zero while a request runs (a long answer
    /// computed before its first byte is not idleness), else the time since the last byte.
    fn idle_for(&self) -> Duration {
        if self.running.load(Ordering::Relaxed) > 0 {
            return Duration::ZERO;
        }
        let now = self.started.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.last.load(Ordering::Relaxed)))
    }
}

/// A request running on a connection, from its headers to the end of its response's body.
struct Running(Arc<Activity>);

impl Running {
    fn new(activity: &Arc<Activity>) -> Running {
        activity.running.fetch_add(1, Ordering::Relaxed);
        Running(activity.clone())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.touch();
        self.0.running.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A response body that keeps its request counted as running until it is sent or dropped.
struct GuardedBody {
    inner: axum::body::Body,
    _running: Running,
}

impl http_body::Body for GuardedBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(context)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A connection's stream that records each byte moved in [`Activity`].
struct Watched<T> {
    io: T,
    activity: Arc<Activity>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffer: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buffer.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(context, buffer);
        if buffer.filled().len() > before {
            self.activity.touch();
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        bytes: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(context, bytes);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(context)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(context)
    }
}
