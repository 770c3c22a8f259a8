//! TLS (rustls, ring) for `sslmode=require`.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};
use tokio_postgres::Socket;

use crate::error::LedgerError;

/// Makes verified TLS connections: the system's roots (or `--pg-ca-file`) and the host name.
#[derive(Clone)]
pub(super) struct RustlsMakeTls {
    config: Option<Arc<rustls::ClientConfig>>,
}

impl RustlsMakeTls {
    /// For `sslmode=disable`: never asked to connect.
    pub(super) fn disabled() -> Self {
        RustlsMakeTls { config: None }
    }

    pub(super) fn new(ca_file: Option<&std::path::Path>) -> Result<Self, LedgerError> {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::CertificateDer;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| LedgerError::Invalid(format!("TLS: {e}")))?;
        let config = match ca_file {
            Some(path) => {
                let mut roots = rustls::RootCertStore::empty();
                let certs = CertificateDer::pem_file_iter(path).map_err(|e| {
                    LedgerError::Invalid(format!("CA file {}: {e}", path.display()))
                })?;
                for cert in certs {
                    let cert = cert.map_err(|e| {
                        LedgerError::Invalid(format!("CA file {}: {e}", path.display()))
                    })?;
                    roots.add(cert).map_err(|e| {
                        LedgerError::Invalid(format!("CA file {}: {e}", path.display()))
                    })?;
                }
                if roots.is_empty() {
                    return Err(LedgerError::Invalid(format!(
                        "CA file {} holds no certificate",
                        path.display()
                    )));
                }
                builder.with_root_certificates(roots).with_no_client_auth()
            }
            None => {
                use rustls_platform_verifier::BuilderVerifierExt;
                builder
                    .with_platform_verifier()
                    .map_err(|e| LedgerError::Invalid(format!("TLS: {e}")))?
                    .with_no_client_auth()
            }
        };
        Ok(RustlsMakeTls {
            config: Some(Arc::new(config)),
        })
    }
}

pub(super) struct RustlsConnect {
    config: Option<Arc<rustls::ClientConfig>>,
    name: rustls_pki_types::ServerName<'static>,
}

impl MakeTlsConnect<Socket> for RustlsMakeTls {
    type Stream = RustlsStream;
    type TlsConnect = RustlsConnect;
    type Error = io::Error;

    fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsConnect, io::Error> {
        let name = rustls_pki_types::ServerName::try_from(domain.to_string())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        Ok(RustlsConnect {
            config: self.config.clone(),
            name,
        })
    }
}

impl TlsConnect<Socket> for RustlsConnect {
    type Stream = RustlsStream;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<RustlsStream>> + Send>>;

    fn connect(self, stream: Socket) -> Self::Future {
        Box::pin(async move {
            let config = self.config.ok_or_else(|| {
                io::Error::other("TLS requested but the store was opened with sslmode=disable")
            })?;
            let tls = tokio_rustls::TlsConnector::from(config)
                .connect(self.name, stream)
                .await?;
            Ok(RustlsStream(Box::new(tls)))
        })
    }
}

pub(super) struct RustlsStream(Box<tokio_rustls::client::TlsStream<Socket>>);

impl AsyncRead for RustlsStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for RustlsStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_shutdown(cx)
    }
}

impl tokio_postgres::tls::TlsStream for RustlsStream {
    fn channel_binding(&self) -> ChannelBinding {
        // SCRAM without channel binding (`channel_binding=prefer`, the default).
        ChannelBinding::none()
    }
}
