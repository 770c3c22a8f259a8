//! The ledger serving TLS itself (`--tls-cert-file`, `--tls-key-file`): every route of its one
//! listener, with ALPN `h2` and `http/1.1`, from a certificate chain and key read from files
//! and read again when they change, so a renewed certificate is served without a restart.
//!
//! Without TLS, anything that shares the ledger's network namespace and may open a raw socket
//! (`CAP_NET_RAW`) reads the service token and each round's capability off the filter's
//! callouts, and can then report a call that was sent as `released`.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use thiserror::Error;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use crate::file_watch::{spawn_looks, Swapped, WatchedFiles};
use crate::metrics::Metrics;

pub use crate::file_watch::RELOAD_CHECK_INTERVAL;

/// A client that connects and never finishes its handshake holds a task this long at most.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Handshaken connections waiting for the server to take them: past this many, handshakes
/// wait, as connections wait in the kernel's backlog for a plain listener.
const ACCEPTED_QUEUE: usize = 128;

/// What the ledger offers in ALPN: Envoy's callouts use h2, the admin CLI and people's
/// browsers either.
pub const ALPN_PROTOCOLS: [&[u8]; 2] = [b"h2", b"http/1.1"];

/// The certificate chain and key files of `--tls-cert-file` and `--tls-key-file`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug, Error)]
pub enum TlsError {
    #[error("TLS certificate file {path}: {reason}")]
    Certificate { path: PathBuf, reason: String },
    #[error("TLS key file {path}: {reason}")]
    Key { path: PathBuf, reason: String },
    #[error("TLS certificate {cert} and key {key} do not belong together: {reason}")]
    Mismatch {
        cert: PathBuf,
        key: PathBuf,
        reason: String,
    },
    #[error("TLS: {0}")]
    Config(String),
}

/// Reads and checks the pair: a chain of at least one certificate, a private key rustls can
/// sign with, and the key being the first certificate's.
pub fn load_certified_key(
    files: &TlsFiles,
    provider: &CryptoProvider,
) -> Result<CertifiedKey, TlsError> {
    let cert_error = |reason: String| TlsError::Certificate {
        path: files.cert.clone(),
        reason,
    };
    let chain = CertificateDer::pem_file_iter(&files.cert)
        .map_err(|e| cert_error(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| cert_error(e.to_string()))?;
    if chain.is_empty() {
        return Err(cert_error("holds no PEM certificate".into()));
    }
    let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|e| TlsError::Key {
        path: files.key.clone(),
        reason: e.to_string(),
    })?;
    CertifiedKey::from_der(chain, key, provider).map_err(|e| TlsError::Mismatch {
        cert: files.cert.clone(),
        key: files.key.clone(),
        reason: e.to_string(),
    })
}

/// Hands every handshake the pair loaded last; the reloader swaps it.
#[derive(Debug)]
pub struct ReloadingCertResolver {
    current: Swapped<CertifiedKey>,
}

impl ReloadingCertResolver {
    fn new(key: CertifiedKey) -> Self {
        ReloadingCertResolver {
            current: Swapped::new(key),
        }
    }

    /// The pair served now.
    pub fn current(&self) -> Arc<CertifiedKey> {
        self.current.current()
    }

    fn replace(&self, key: CertifiedKey) {
        self.current.replace(key);
    }
}

impl ResolvesServerCert for ReloadingCertResolver {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

/// What one look at the certificate and key came to.
pub type ReloadCheck = crate::file_watch::ReloadCheck<TlsError>;

/// Loads the pair at start and again whenever the files change.
pub struct CertReloader {
    files: TlsFiles,
    provider: Arc<CryptoProvider>,
    resolver: Arc<ReloadingCertResolver>,
    /// The files as they were when last looked at (loaded, or failed to load).
    watched: WatchedFiles,
}

impl CertReloader {
    /// Loads the pair once: a ledger told to serve TLS does not start without a pair that loads.
    pub fn load(files: TlsFiles, provider: Arc<CryptoProvider>) -> Result<Self, TlsError> {
        let watched = WatchedFiles::new(vec![files.cert.clone(), files.key.clone()]);
        let key = load_certified_key(&files, &provider)?;
        Ok(CertReloader {
            files,
            provider,
            resolver: Arc::new(ReloadingCertResolver::new(key)),
            watched,
        })
    }

    pub fn resolver(&self) -> Arc<ReloadingCertResolver> {
        self.resolver.clone()
    }

    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// Looks at the files once and loads them if they changed.
    pub fn check(&mut self) -> ReloadCheck {
        // A file missing for a moment (being replaced) is a failure once, then quiet until it
        // comes back.
        let (files, provider, resolver) = (&self.files, &self.provider, &self.resolver);
        self.watched.reload(
            |e| TlsError::Certificate {
                path: files.cert.clone(),
                reason: format!("cannot read the certificate or key file: {e}"),
            },
            || load_certified_key(files, provider),
            |key| resolver.replace(key),
        )
    }
}

/// Checks the files every [`RELOAD_CHECK_INTERVAL`] for as long as the ledger runs; each
/// reload and each failed one is logged and counted.
pub fn spawn_reloader(mut reloader: CertReloader, metrics: Arc<Metrics>) -> JoinHandle<()> {
    spawn_looks(move || match reloader.check() {
        ReloadCheck::Unchanged => {}
        ReloadCheck::Reloaded => {
            metrics.tls_reloads.with_label_values(&["ok"]).inc();
            metrics.tls_reload_failing.set(0);
            tracing::info!(cert = %reloader.files().cert.display(), key = %reloader.files().key.display(),
                "TLS certificate reloaded: new connections get the new one");
        }
        ReloadCheck::Failed(e) => {
            metrics.tls_reloads.with_label_values(&["error"]).inc();
            metrics.tls_reload_failing.set(1);
            tracing::error!(error = %e,
                "TLS certificate not reloaded: the previous certificate is still served");
        }
    })
}

/// The server side of the ledger's TLS: the reloading resolver, ALPN h2 and http/1.1, the
/// provider's safe default protocol versions (TLS 1.2 and 1.3).
pub fn server_config(
    provider: Arc<CryptoProvider>,
    resolver: Arc<ReloadingCertResolver>,
) -> Result<rustls::ServerConfig, TlsError> {
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    config.alpn_protocols = ALPN_PROTOCOLS.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// A listener whose connections have finished their TLS handshake. Handshakes run in tasks of
/// their own, so a client that is slow to finish one delays no other connection.
pub struct TlsListener {
    accepted: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local_addr: SocketAddr,
    acceptor: JoinHandle<()>,
}

impl TlsListener {
    pub fn new(
        tcp: TcpListener,
        config: Arc<rustls::ServerConfig>,
        metrics: Arc<Metrics>,
    ) -> io::Result<Self> {
        let local_addr = tcp.local_addr()?;
        let (sender, accepted) = mpsc::channel(ACCEPTED_QUEUE);
        let acceptor = tokio::spawn(accept_loop(tcp, TlsAcceptor::from(config), sender, metrics));
        Ok(TlsListener {
            accepted,
            local_addr,
            acceptor,
        })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        // The listening socket closes with the task: a stopped server accepts nothing more.
        self.acceptor.abort();
    }
}

async fn accept_loop(
    tcp: TcpListener,
    acceptor: TlsAcceptor,
    sender: mpsc::Sender<(TlsStream<TcpStream>, SocketAddr)>,
    metrics: Arc<Metrics>,
) {
    loop {
        let (stream, peer) = match tcp.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors, say: accepting again at once would spin.
                tracing::warn!(error = %e, "could not accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Callouts are small request/response pairs on long-lived connections: without
        // TCP_NODELAY, Nagle's algorithm holds a reply back until the previous one is acked.
        if let Err(e) = stream.set_nodelay(true) {
            tracing::warn!(error = %e, "could not set TCP_NODELAY on an accepted connection");
        }
        let acceptor = acceptor.clone();
        let sender = sender.clone();
        let metrics = metrics.clone();
        tokio::spawn(async move {
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => {
                    // Only fails once the server has stopped taking connections.
                    let _ = sender.send((tls, peer)).await;
                }
                Ok(Err(e)) => {
                    metrics.tls_handshake_failures.inc();
                    tracing::debug!(peer = %peer, error = %e, "TLS handshake failed");
                }
                Err(_) => {
                    metrics.tls_handshake_failures.inc();
                    tracing::debug!(peer = %peer, "TLS handshake timed out");
                }
            }
        });
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.accepted.recv().await {
            Some(accepted) => accepted,
            // The accept loop never ends while the listener lives; should it, wait for the
            // shutdown rather than spin.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.local_addr)
    }
}

#[cfg(test)]
mod tests;
