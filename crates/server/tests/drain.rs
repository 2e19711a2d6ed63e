//! Graceful shutdown on a real socket: the server over the scripted engine, its shutdown
//! signal driven by the test. While it drains, `/health` is 503 and new requests get 503;
//! running streams finish (or, past `--shutdown-timeout`, end with an error event); then the
//! server returns.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use pagoda_models::chat_template::ChatTemplate;
use pagoda_server::auth::ApiKeys;
use pagoda_server::{ServerConfig, TextModel};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A running server and the test's hand on its shutdown signal.
struct Server {
    port: u16,
    /// Signals sent so far (the server's n-th wait for a signal ends at the n-th).
    signals: Arc<AtomicUsize>,
    finished: std::sync::mpsc::Receiver<Result<(), String>>,
}

impl Server {
    fn signal(&self) {
        self.signals.fetch_add(1, Ordering::SeqCst);
    }

    /// Waits for `serve_until` to return.
    fn wait(&self, limit: Duration) -> Result<(), String> {
        self.finished
            .recv_timeout(limit)
            .expect("the server did not shut down")
    }
}

/// Starts a server whose scripted answers run `tokens` steps (2 ms each).
fn start(tokens: usize, shutdown_timeout: Duration) -> Option<Server> {
    let tokenizer = tokenizer()?;
    let word = tokenizer.encode(" word", false).unwrap();
    let mut script: Vec<u32> = word.iter().copied().cycle().take(tokens).collect();
    script.push(EOS);
    let backend = Scripted::new(script, Mode::Replay);
    let config = ServerConfig {
        host: "127.0.0.1".into(),
        port: 0,
        model_name: "test-model".into(),
        model_aliases: vec![],
        context_size: 8192,
        parallel: 4,
        max_queue: 8,
        api_keys: ApiKeys::default(),
        metrics_public: false,
        tls: None,
        max_body_bytes: 4096,
        sampling_defaults: Default::default(),
        shutdown_timeout,
        cors_origins: Vec::new(),
        limits: Default::default(),
        tool_call_parser: None,
        webui: true,
    };
    let text = TextModel {
        tokenizer,
        chat_template: ChatTemplate::chatml(),
        stop_tokens: vec![EOS],
    };
    let signals = Arc::new(AtomicUsize::new(0));
    let calls = Arc::new(AtomicUsize::new(0));
    let shutdown = {
        let signals = signals.clone();
        move || {
            let which = calls.fetch_add(1, Ordering::SeqCst) + 1;
            let signals = signals.clone();
            async move {
                while signals.load(Ordering::SeqCst) < which {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        }
    };
    let (url_sender, url_receiver) = std::sync::mpsc::channel();
    let (done_sender, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let result = pagoda_server::serve_until(
            config,
            text,
            backend,
            |url| url_sender.send(url.to_owned()).unwrap(),
            shutdown,
        );
        let _ = done_sender.send(result);
    });
    let url = url_receiver.recv_timeout(Duration::from_secs(30)).unwrap();
    let port = url.rsplit(':').next().unwrap().parse().unwrap();
    Some(Server {
        port,
        signals,
        finished,
    })
}

fn post(body: &str) -> String {
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

const HEALTH: &str = "GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";

/// One request; the whole answer as text.
async fn exchange(port: u16, request: &str) -> String {
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    tcp.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), tcp.read_to_end(&mut answer))
        .await
        .expect("the answer did not end")
        .unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

/// Opens a streaming completion and reads until its first event has arrived.
async fn open_stream(port: u16) -> (TcpStream, Vec<u8>) {
    let body = r#"{"prompt": "hi", "max_tokens": 4000, "stream": true}"#;
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    tcp.write_all(post(body).as_bytes()).await.unwrap();
    let mut seen = Vec::new();
    let mut buffer = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: ") {
        let read = tokio::time::timeout(Duration::from_secs(10), tcp.read(&mut buffer))
            .await
            .unwrap()
            .unwrap();
        assert!(read > 0, "the stream closed early");
        seen.extend_from_slice(&buffer[..read]);
    }
    (tcp, seen)
}

/// The last event of an SSE answer is `[DONE]`.
fn ends_with_done(answer: &str) -> bool {
    answer
        .rsplit("data: ")
        .next()
        .is_some_and(|last| last.starts_with("[DONE]"))
}

async fn read_rest(mut tcp: TcpStream, mut seen: Vec<u8>) -> String {
    tokio::time::timeout(Duration::from_secs(20), tcp.read_to_end(&mut seen))
        .await
        .expect("the stream did not end")
        .unwrap();
    String::from_utf8_lossy(&seen).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_finishes_running_streams_and_refuses_new_work() {
    // 500 tokens at 2 ms a step: about a second of streaming.
    let Some(server) = start(500, Duration::from_secs(30)) else {
        return;
    };
    let (stream, seen) = open_stream(server.port).await;
    server.signal();
    tokio::time::sleep(Duration::from_millis(100)).await;

    let health = exchange(server.port, HEALTH).await;
    assert!(health.starts_with("HTTP/1.1 503"), "{health}");
    assert!(health.contains("draining"), "{health}");
    let refused = exchange(server.port, &post(r#"{"prompt": "hi", "max_tokens": 2}"#)).await;
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    assert!(refused.contains("\"shutting_down\""), "{refused}");
    assert!(
        refused.to_ascii_lowercase().contains("retry-after: 1"),
        "{refused}"
    );

    let answer = read_rest(stream, seen).await;
    assert!(
        answer.contains("\"finish_reason\":\"stop\""),
        "the running stream was not allowed to finish: {answer}"
    );
    assert!(ends_with_done(&answer), "{answer}");
    assert!(!answer.contains("shutting_down"), "{answer}");
    server.wait(Duration::from_secs(10)).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_timeout_running_streams_end_with_an_error_event() {
    // 3000 tokens: about 6 s, far past the 300 ms drain.
    let Some(server) = start(3000, Duration::from_millis(300)) else {
        return;
    };
    let (stream, seen) = open_stream(server.port).await;
    let started = Instant::now();
    server.signal();
    let answer = read_rest(stream, seen).await;
    assert!(answer.contains("\"shutting_down\""), "{answer}");
    assert!(ends_with_done(&answer), "{answer}");
    assert!(!answer.contains("\"finish_reason\":\"stop\""), "{answer}");
    server.wait(Duration::from_secs(10)).unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "the shutdown waited {:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_stops_at_once_and_an_idle_server_exits_at_once() {
    let Some(server) = start(3000, Duration::from_secs(60)) else {
        return;
    };
    let (stream, seen) = open_stream(server.port).await;
    let started = Instant::now();
    server.signal();
    tokio::time::sleep(Duration::from_millis(100)).await;
    server.signal();
    let answer = read_rest(stream, seen).await;
    assert!(answer.contains("\"shutting_down\""), "{answer}");
    server.wait(Duration::from_secs(10)).unwrap();
    assert!(started.elapsed() < Duration::from_secs(4));

    let Some(idle) = start(10, Duration::from_secs(60)) else {
        return;
    };
    let started = Instant::now();
    idle.signal();
    idle.wait(Duration::from_secs(10)).unwrap();
    assert!(started.elapsed() < Duration::from_secs(2));
}
