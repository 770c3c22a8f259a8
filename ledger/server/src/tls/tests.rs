use std::sync::Arc;

use axum::routing::get;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

/// A CA of the test's own and what it signs.
struct TestCa {
    cert: rcgen::Certificate,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

impl TestCa {
    fn new() -> Self {
        let key = rcgen::KeyPair::generate().expect("CA key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let cert = params.self_signed(&key).expect("CA certificate");
        TestCa {
            cert,
            issuer: rcgen::Issuer::new(params, key),
        }
    }

    /// (certificate PEM, key PEM) for `name`.
    fn issue(&self, name: &str) -> (String, String) {
        let key = rcgen::KeyPair::generate().expect("leaf key");
        let cert = rcgen::CertificateParams::new(vec![name.to_string()])
            .expect("leaf params")
            .signed_by(&key, &self.issuer)
            .expect("leaf certificate");
        (cert.pem(), key.serialize_pem())
    }

    fn roots(&self) -> rustls::RootCertStore {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.cert.der().clone()).expect("CA root");
        roots
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

struct PairOnDisk {
    _dir: tempfile::TempDir,
    files: TlsFiles,
}

impl PairOnDisk {
    fn new(cert_pem: &str, key_pem: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = TlsFiles {
            cert: dir.path().join("tls.crt"),
            key: dir.path().join("tls.key"),
        };
        std::fs::write(&files.cert, cert_pem).expect("write cert");
        std::fs::write(&files.key, key_pem).expect("write key");
        PairOnDisk { _dir: dir, files }
    }

    /// Replaces both files with new ones (new inodes), as a Secret volume update or
    /// cert-manager's renewal does.
    fn replace(&self, cert_pem: &str, key_pem: &str) {
        for (path, text) in [(&self.files.cert, cert_pem), (&self.files.key, key_pem)] {
            let next = path.with_extension("next");
            std::fs::write(&next, text).expect("write next");
            std::fs::rename(&next, path).expect("rename");
        }
    }
}

fn served_leaf(resolver: &ReloadingCertResolver) -> CertificateDer<'static> {
    resolver.current().cert[0].clone()
}

fn leaf_der(pem: &str) -> CertificateDer<'static> {
    use rustls_pki_types::pem::PemObject;
    CertificateDer::from_pem_slice(pem.as_bytes()).expect("PEM certificate")
}

#[test]
fn a_pair_loads_and_a_key_of_another_certificate_is_refused() {
    let ca = TestCa::new();
    let (cert, key) = ca.issue("atmost-ledger");
    let (_, other_key) = ca.issue("atmost-ledger");
    let good = PairOnDisk::new(&cert, &key);
    let loaded = load_certified_key(&good.files, &provider()).expect("a matching pair loads");
    assert_eq!(loaded.cert[0], leaf_der(&cert));

    let mismatched = PairOnDisk::new(&cert, &other_key);
    assert!(matches!(
        load_certified_key(&mismatched.files, &provider()),
        Err(TlsError::Mismatch { .. })
    ));
    let no_cert = PairOnDisk::new("not a certificate\n", &key);
    assert!(matches!(
        load_certified_key(&no_cert.files, &provider()),
        Err(TlsError::Certificate { .. })
    ));
    let no_key = PairOnDisk::new(&cert, "not a key\n");
    assert!(matches!(
        load_certified_key(&no_key.files, &provider()),
        Err(TlsError::Key { .. })
    ));
}

#[test]
fn a_ledger_told_to_serve_tls_does_not_start_without_a_pair() {
    let ca = TestCa::new();
    let (cert, _) = ca.issue("atmost-ledger");
    let broken = PairOnDisk::new(&cert, "");
    assert!(CertReloader::load(broken.files.clone(), provider()).is_err());
    let missing = TlsFiles {
        cert: broken.files.cert.with_file_name("absent.crt"),
        key: broken.files.key.clone(),
    };
    assert!(CertReloader::load(missing, provider()).is_err());
}

#[test]
fn a_changed_pair_is_served_and_a_broken_one_leaves_the_previous_served() {
    let ca = TestCa::new();
    let (first_cert, first_key) = ca.issue("atmost-ledger");
    let pair = PairOnDisk::new(&first_cert, &first_key);
    let mut reloader = CertReloader::load(pair.files.clone(), provider()).expect("load");
    let resolver = reloader.resolver();
    assert_eq!(served_leaf(&resolver), leaf_der(&first_cert));
    assert!(matches!(reloader.check(), ReloadCheck::Unchanged));

    let (second_cert, second_key) = ca.issue("atmost-ledger");
    pair.replace(&second_cert, &second_key);
    assert!(matches!(reloader.check(), ReloadCheck::Reloaded));
    assert_eq!(served_leaf(&resolver), leaf_der(&second_cert));

    // A certificate written without its key yet: refused once, the pair before is still served.
    let (third_cert, third_key) = ca.issue("atmost-ledger");
    pair.replace(&third_cert, &second_key);
    assert!(matches!(
        reloader.check(),
        ReloadCheck::Failed(TlsError::Mismatch { .. })
    ));
    assert_eq!(served_leaf(&resolver), leaf_der(&second_cert));
    assert!(matches!(reloader.check(), ReloadCheck::Unchanged));

    // Its key arrives: the new pair is served.
    pair.replace(&third_cert, &third_key);
    assert!(matches!(reloader.check(), ReloadCheck::Reloaded));
    assert_eq!(served_leaf(&resolver), leaf_der(&third_cert));

    // Files gone for a while: one failure, then quiet; back, and served again.
    std::fs::remove_file(&pair.files.cert).expect("remove");
    assert!(matches!(reloader.check(), ReloadCheck::Failed(_)));
    assert!(matches!(reloader.check(), ReloadCheck::Unchanged));
    assert_eq!(served_leaf(&resolver), leaf_der(&third_cert));
    let (fourth_cert, fourth_key) = ca.issue("atmost-ledger");
    pair.replace(&fourth_cert, &fourth_key);
    assert!(matches!(reloader.check(), ReloadCheck::Reloaded));
    assert_eq!(served_leaf(&resolver), leaf_der(&fourth_cert));
}

/// What a client saw of one connection: the negotiated ALPN protocol, the server's
/// certificate, and the answer to `GET /hello` in HTTP/1.1.
struct Seen {
    alpn: Option<Vec<u8>>,
    leaf: CertificateDer<'static>,
    answer: String,
}

async fn connect(addr: SocketAddr, ca: &TestCa, alpn: &[&[u8]]) -> Seen {
    let mut config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(ca.roots())
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let name = ServerName::try_from("atmost-ledger").expect("name");
    let mut tls = connector.connect(name, tcp).await.expect("handshake");
    let (_, session) = tls.get_ref();
    let alpn = session.alpn_protocol().map(<[u8]>::to_vec);
    let leaf = session.peer_certificates().expect("server certificate")[0].clone();
    let mut answer = String::new();
    if alpn.as_deref() != Some(b"h2") {
        tls.write_all(b"GET /hello HTTP/1.1\r\nhost: atmost-ledger\r\nconnection: close\r\n\r\n")
            .await
            .expect("write");
        tls.read_to_string(&mut answer).await.expect("read");
    }
    Seen { alpn, leaf, answer }
}

#[tokio::test]
async fn the_listener_serves_tls_with_alpn_and_new_connections_get_a_reloaded_certificate() {
    let ca = TestCa::new();
    let (first_cert, first_key) = ca.issue("atmost-ledger");
    let pair = PairOnDisk::new(&first_cert, &first_key);
    let mut reloader = CertReloader::load(pair.files.clone(), provider()).expect("load");
    let config = server_config(provider(), reloader.resolver()).expect("config");
    let metrics = Arc::new(Metrics::new().expect("metrics"));
    let tcp = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let listener = TlsListener::new(tcp, Arc::new(config), metrics.clone()).expect("listener");
    let addr = axum::serve::Listener::local_addr(&listener).expect("addr");
    let app = axum::Router::new().route("/hello", get(|| async { "hello over tls" }));
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let h1 = connect(addr, &ca, &[b"http/1.1"]).await;
    assert_eq!(h1.alpn.as_deref(), Some(&b"http/1.1"[..]));
    assert!(h1.answer.starts_with("HTTP/1.1 200"), "{}", h1.answer);
    assert!(h1.answer.ends_with("hello over tls"), "{}", h1.answer);
    assert_eq!(h1.leaf, leaf_der(&first_cert));
    let h2 = connect(addr, &ca, &[b"h2", b"http/1.1"]).await;
    assert_eq!(h2.alpn.as_deref(), Some(&b"h2"[..]));

    let (second_cert, second_key) = ca.issue("atmost-ledger");
    pair.replace(&second_cert, &second_key);
    assert!(matches!(reloader.check(), ReloadCheck::Reloaded));
    let after = connect(addr, &ca, &[b"http/1.1"]).await;
    assert_eq!(after.leaf, leaf_der(&second_cert));
    assert!(after.answer.ends_with("hello over tls"), "{}", after.answer);

    // Plain HTTP on the TLS port gets no answer and is counted.
    let mut plain = TcpStream::connect(addr).await.expect("connect");
    plain
        .write_all(b"GET /hello HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .expect("write");
    let mut rest = Vec::new();
    let _ = plain.read_to_end(&mut rest).await;
    assert!(!String::from_utf8_lossy(&rest).contains("hello over tls"));
    for _ in 0..200 {
        if metrics.tls_handshake_failures.get() >= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(metrics.tls_handshake_failures.get(), 1);
    server.abort();
}
