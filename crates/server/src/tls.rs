//! HTTPS: rustls (with the `ring` provider) in front of the same router.
//!
//! [`TlsListener`] accepts TCP connections on a task of its own and runs each handshake on a
//! task with a timeout, so a slow or silent client holds up nobody; finished handshakes are
//! handed to `axum::serve` as its connections. A plain-HTTP client on the HTTPS port fails its
//! handshake and is closed (logged at info with its address).

use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// Longest a client may take to finish the TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Handshakes finished but not yet taken by the server.
const ACCEPTED_BACKLOG: usize = 128;

/// The certificate chain and private key files (PEM) of `--ssl-cert-file` and
/// `--ssl-key-file`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM file with the server certificate first, then any intermediates.
    pub cert_file: std::path::PathBuf,
    /// PEM file with the private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: std::path::PathBuf,
}

impl TlsFiles {
    /// Reads and checks both files into a rustls server configuration (HTTP/1.1 over ALPN).
    /// Errors name the file and what is wrong with it.
    pub fn load(&self) -> Result<Arc<rustls::ServerConfig>, String> {
        let certs = read_certs(&self.cert_file)?;
        let key = read_key(&self.key_file)?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("setting up TLS: {e}"))?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .map_err(|e| {
                format!(
                    "--ssl-cert-file {} and --ssl-key-file {} do not make a usable pair: {e}",
                    self.cert_file.display(),
                    self.key_file.display()
                )
            })?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let shown = path.display();
    let bytes = std::fs::read(path).map_err(|e| format!("reading --ssl-cert-file {shown}: {e}"))?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("--ssl-cert-file {shown} is not valid PEM: {e}"))?;
    if certs.is_empty() {
        return Err(format!(
            "--ssl-cert-file {shown} holds no certificate (expected a PEM `BEGIN CERTIFICATE` block)"
        ));
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    let shown = path.display();
    let bytes = std::fs::read(path).map_err(|e| format!("reading --ssl-key-file {shown}: {e}"))?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| {
        format!(
            "--ssl-key-file {shown} holds no usable private key (PEM PKCS#8, PKCS#1 or SEC1): {e}"
        )
    })
}

/// A listener whose connections are TLS streams that finished their handshake.
pub struct TlsListener {
    accepted: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl TlsListener {
    /// Starts accepting on `tcp` (must run inside a tokio runtime).
    pub fn new(tcp: TcpListener, config: Arc<rustls::ServerConfig>) -> io::Result<TlsListener> {
        let local = tcp.local_addr()?;
        let (sender, accepted) = mpsc::channel(ACCEPTED_BACKLOG);
        let acceptor = TlsAcceptor::from(config);
        tokio::spawn(async move {
            while !sender.is_closed() {
                let (stream, client) = match tcp.accept().await {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of descriptors and the like: wait rather than spin.
                        tracing::warn!("accepting a connection: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let acceptor = acceptor.clone();
                let sender = sender.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            let _ = sender.send((tls, client)).await;
                        }
                        Ok(Err(e)) => tracing::info!(
                            "TLS handshake with {client} failed: {e} (plain HTTP on the HTTPS port?)"
                        ),
                        Err(_) => tracing::info!(
                            "TLS handshake with {client} took over {}s; closed",
                            HANDSHAKE_TIMEOUT.as_secs()
                        ),
                    }
                });
            }
        });
        Ok(TlsListener { accepted, local })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.accepted.recv().await {
            Some(connection) => connection,
            // The accept task ended (its runtime is shutting down): no more connections.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }
}
