//! HTTPS end to end on a real socket: a self-signed certificate made here (rcgen), the server
//! on it over the scripted engine, a rustls client that trusts only that certificate.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use pagoda_models::chat_template::ChatTemplate;
use pagoda_server::auth::ApiKeys;
use pagoda_server::tls::TlsFiles;
use pagoda_server::{ServerConfig, TextModel};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

struct Certificate {
    files: TlsFiles,
    der: rustls::pki_types::CertificateDer<'static>,
}

fn certificate(dir: &std::path::Path) -> Certificate {
    let made =
        rcgen::generate_simple_self_signed(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
    std::fs::create_dir_all(dir).unwrap();
    let files = TlsFiles {
        cert_file: dir.join("cert.pem"),
        key_file: dir.join("key.pem"),
    };
    std::fs::write(&files.cert_file, made.cert.pem()).unwrap();
    std::fs::write(&files.key_file, made.signing_key.serialize_pem()).unwrap();
    Certificate {
        files,
        der: made.cert.der().clone(),
    }
}

fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("pagoda-tls-test-{}-{name}", std::process::id()))
}

/// Starts the server with TLS on a free port; returns its `https://` URL's port.
fn start(files: &TlsFiles) -> Option<u16> {
    let tokenizer = tokenizer()?;
    let mut script = tokenizer.encode("Hello there", false).unwrap();
    script.push(EOS);
    let backend = Scripted::new(script, Mode::Replay);
    let config = ServerConfig {
        host: "127.0.0.1".into(),
        port: 0,
        model_name: "test-model".into(),
        model_aliases: vec![],
        context_size: 64,
        parallel: 2,
        max_queue: 8,
        api_keys: ApiKeys::new(["tls-key"]).unwrap(),
        metrics_public: false,
        tls: Some(files.load().unwrap()),
        max_body_bytes: 4096,
        sampling_defaults: Default::default(),
        shutdown_timeout: std::time::Duration::from_secs(30),
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
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        pagoda_server::serve(config, text, backend, |url| {
            sender.send(url.to_owned()).unwrap()
        })
        .unwrap()
    });
    let url = receiver.recv_timeout(Duration::from_secs(30)).unwrap();
    assert!(url.starts_with("https://127.0.0.1:"), "{url}");
    Some(url.rsplit(':').next().unwrap().parse().unwrap())
}

/// One HTTP/1.1 request over TLS (trusting only `der`); the whole answer as text.
async fn https(
    port: u16,
    der: &rustls::pki_types::CertificateDer<'static>,
    request: &str,
) -> String {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(der.clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let name = ServerName::try_from("localhost").unwrap();
    let mut tls = connector.connect(name, tcp).await.unwrap();
    tls.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut answer))
        .await
        .unwrap()
        .ok();
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_serves_and_plain_http_on_the_port_fails_cleanly() {
    let dir = scratch("serve");
    let cert = certificate(&dir);
    let Some(port) = start(&cert.files) else {
        return;
    };
    let health = "GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    let answer = https(port, &cert.der, health).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    let body = r#"{"prompt": "hi", "max_tokens": 2}"#;
    let completion = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Authorization: Bearer tls-key\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let answer = https(port, &cert.der, &completion).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("\"text_completion\""), "{answer}");

    // Plain HTTP: no HTTP answer, the connection closed promptly.
    let mut plain = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    plain.write_all(health.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "the server kept a plain-HTTP connection open");
    assert!(!answer.starts_with(b"HTTP/"), "{answer:?}");

    // The server still serves HTTPS afterwards.
    let answer = https(port, &cert.der, health).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bad_certificate_files_are_named_in_the_error() {
    let dir = scratch("bad");
    let cert = certificate(&dir);
    let missing = TlsFiles {
        cert_file: dir.join("absent.pem"),
        key_file: cert.files.key_file.clone(),
    };
    let error = missing.load().unwrap_err();
    assert!(
        error.contains("--ssl-cert-file") && error.contains("absent.pem"),
        "{error}"
    );

    let swapped = TlsFiles {
        cert_file: cert.files.key_file.clone(),
        key_file: cert.files.cert_file.clone(),
    };
    let error = swapped.load().unwrap_err();
    assert!(error.contains("holds no certificate"), "{error}");

    std::fs::write(dir.join("garbage.pem"), "not a key").unwrap();
    let garbage = TlsFiles {
        cert_file: cert.files.cert_file.clone(),
        key_file: dir.join("garbage.pem"),
    };
    let error = garbage.load().unwrap_err();
    assert!(error.contains("--ssl-key-file"), "{error}");

    // A key that is not the certificate's.
    let other = certificate(&dir.join("other"));
    let mismatched = TlsFiles {
        cert_file: cert.files.cert_file.clone(),
        key_file: other.files.key_file.clone(),
    };
    let error = mismatched.load().unwrap_err();
    assert!(error.contains("do not make a usable pair"), "{error}");
    let _ = std::fs::remove_dir_all(dir);
}
