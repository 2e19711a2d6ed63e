//! Connection limits on a real socket (issue 43): a client that sends nothing, or stalls in
//! its headers or body, is disconnected after `--timeout`; beyond `--max-connections`, a new
//! connection waits until one closes.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use pagoda_models::chat_template::ChatTemplate;
use pagoda_server::{ConnectionLimits, TextModel};

/// Starts a server with `limits` whose engine answers `words` words (2 ms a token) and runs
/// one request at a time; returns its port. It runs until the test process ends.
fn start(limits: ConnectionLimits, words: usize) -> Option<u16> {
    let tokenizer = tokenizer()?;
    let word = tokenizer.encode(" hello", false).unwrap();
    let mut script: Vec<u32> = word.iter().copied().cycle().take(words).collect();
    script.push(EOS);
    let backend = Scripted::new(script, Mode::Replay);
    let config = pagoda_server::ServerConfig {
        limits,
        parallel: 1,
        context_size: 4096,
        ..test_config()
    };
    let text = TextModel {
        tokenizer,
        chat_template: ChatTemplate::chatml(),
        stop_tokens: vec![EOS],
    };
    let (url_sender, url_receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let never = || std::future::pending::<()>();
        pagoda_server::serve_until(
            config,
            text,
            backend,
            |url| url_sender.send(url.to_owned()).unwrap(),
            never,
        )
    });
    let url = url_receiver.recv_timeout(Duration::from_secs(30)).unwrap();
    Some(url.rsplit(':').next().unwrap().parse().unwrap())
}

fn connect(port: u16) -> TcpStream {
    let stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream
}

/// Reads until the server closes the connection; the bytes read and how long it took.
fn read_to_close(stream: &mut TcpStream) -> (String, Duration) {
    let started = Instant::now();
    let mut text = Vec::new();
    let _ = stream.read_to_end(&mut text);
    (
        String::from_utf8_lossy(&text).into_owned(),
        started.elapsed(),
    )
}

const HEALTH: &[u8] = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";

#[test]
fn silent_and_stalled_clients_are_disconnected_after_the_timeout() {
    let limits = ConnectionLimits {
        max_connections: 16,
        timeout: Duration::from_millis(800),
    };
    let Some(port) = start(limits, 1) else {
        return;
    };
    // Sends nothing.
    let mut idle = connect(port);
    // Stops in the middle of its headers.
    let mut slow_headers = connect(port);
    slow_headers
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    // Sends its headers, then a tenth of its body.
    let mut slow_body = connect(port);
    slow_body
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              Content-Length: 100\r\n\r\n{\"prompt\":",
        )
        .unwrap();
    for (what, stream) in [
        ("idle", &mut idle),
        ("slow headers", &mut slow_headers),
        ("slow body", &mut slow_body),
    ] {
        let (text, waited) = read_to_close(stream);
        assert!(
            waited < Duration::from_secs(5),
            "{what}: open after {waited:?}"
        );
        if what == "slow body" {
            // The request was read up to its headers, so it gets an answer: a 4xx.
            assert!(text.starts_with("HTTP/1.1 4"), "{what}: {text}");
        }
    }
    // A prompt client is served as before.
    let mut quick = connect(port);
    quick.write_all(HEALTH).unwrap();
    let (text, _) = read_to_close(&mut quick);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
}

#[test]
fn connections_beyond_the_limit_wait_for_one_to_close() {
    let limits = ConnectionLimits {
        max_connections: 2,
        timeout: Duration::from_secs(30),
    };
    let Some(port) = start(limits, 1) else {
        return;
    };
    let first = connect(port);
    let _second = connect(port);
    // Let the server accept both before the third arrives.
    std::thread::sleep(Duration::from_millis(300));
    let mut third = connect(port);
    third.write_all(HEALTH).unwrap();
    third
        .set_read_timeout(Some(Duration::from_millis(700)))
        .unwrap();
    let mut byte = [0u8; 1];
    let early = third.read(&mut byte);
    assert!(
        early.is_err(),
        "the third connection was served while two were open: {early:?}"
    );
    drop(first);
    third
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let (text, waited) = read_to_close(&mut third);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(waited < Duration::from_secs(5), "{waited:?}");
}

#[test]
fn long_answers_and_queued_streams_outlive_the_timeout() {
    let limits = ConnectionLimits {
        max_connections: 16,
        timeout: Duration::from_millis(400),
    };
    // 400 tokens at 2 ms: each answer takes about 0.8 s, twice the timeout, and the second
    // request waits that long in the queue with nothing on its connection.
    let Some(port) = start(limits, 400) else {
        return;
    };
    let request = |stream: bool| {
        let body = format!(r#"{{"prompt": "x", "max_tokens": 400, "stream": {stream}}}"#);
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    let mut whole = connect(port);
    whole.write_all(request(false).as_bytes()).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let mut streamed = connect(port);
    streamed.write_all(request(true).as_bytes()).unwrap();
    let (whole_text, waited) = read_to_close(&mut whole);
    assert!(whole_text.starts_with("HTTP/1.1 200"), "{whole_text}");
    assert!(
        whole_text.contains("\"finish_reason\":\"length\""),
        "{whole_text}"
    );
    assert!(waited > limits.timeout, "the answer took {waited:?}");
    let (stream_text, _) = read_to_close(&mut streamed);
    assert!(stream_text.starts_with("HTTP/1.1 200"), "{stream_text}");
    assert!(stream_text.contains("data: [DONE]"), "{stream_text}");
    assert!(
        stream_text.contains(r#""finish_reason":"length""#),
        "{stream_text}"
    );
}
