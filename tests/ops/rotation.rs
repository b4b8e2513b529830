//! Rotation without restarts, under a running server: the JWK set behind an `https://`
//! `--auth-jwks` (a new signing key, the old one removed) and the server's TLS certificate on
//! disk (renewed).

use crate::common;
use crate::tls::Pki;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use payledger::auth::dev::{SigningKey, TokenClaims};
use payledger::client::{BearerToken, ClientSettings, PayledgerClient, RetrySettings};
use payledger::config::AuthSettings;
use payledger::proto;
use payledger::proto::account_service_client::AccountServiceClient;
use payledger::startup::{authenticator, Application};
use payledger::tls::ServerTls;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tonic::Code;

/// The longest a test waits for a rotation to show: a bound on the test, not a timing
/// assertion.
const WAIT_MAX: Duration = Duration::from_secs(15);

/// What the JWKS server answers: the set's text, or an error status.
#[derive(Clone)]
enum Answer {
    Jwks(String),
    Status(u16),
}

/// An HTTPS server of one JWK set (`GET /jwks.json`), which the test replaces at will.
struct JwksServer {
    url: String,
    answer: Arc<Mutex<Answer>>,
    fetches: Arc<AtomicUsize>,
}

/// TLS connections of a listener, for axum (ALPN http/1.1).
struct TlsListener {
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((stream, address)) = self.listener.accept().await else { continue };
            if let Ok(stream) = self.acceptor.accept(stream).await {
                return (stream, address);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.listener.local_addr()
    }
}

impl JwksServer {
    async fn start(pki: &Pki, jwks: String) -> Self {
        let issued = pki.issue(&["localhost"]);
        let certs = CertificateDer::pem_slice_iter(issued.cert_pem.as_bytes()).collect::<Result<Vec<_>, _>>().unwrap();
        let key = PrivateKeyDer::from_pem_slice(issued.key_pem.as_bytes()).unwrap();
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://localhost:{}/jwks.json", listener.local_addr().unwrap().port());
        let answer = Arc::new(Mutex::new(Answer::Jwks(jwks)));
        let fetches = Arc::new(AtomicUsize::new(0));
        let (served, counted) = (answer.clone(), fetches.clone());
        let app = axum::Router::new().route(
            "/jwks.json",
            axum::routing::get(move || {
                let answer = served.lock().unwrap().clone();
                counted.fetch_add(1, Ordering::SeqCst);
                async move {
                    match answer {
                        Answer::Jwks(text) => (http::StatusCode::OK, text),
                        Answer::Status(code) => (http::StatusCode::from_u16(code).unwrap(), String::new()),
                    }
                }
            }),
        );
        let tls = TlsListener { listener, acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)) };
        tokio::spawn(async move { axum::serve(tls, app).await.unwrap() });
        Self { url, answer, fetches }
    }

    fn answer(&self, answer: Answer) {
        *self.answer.lock().unwrap() = answer;
    }
}

fn token(key: &SigningKey) -> String {
    let claims = TokenClaims {
        issuer: "https://idp.example".into(),
        audience: "payledger".into(),
        subject: "rotation".into(),
        merchants: vec!["*".into()],
        scope: "accounts:admin accounts:read".into(),
        ttl_seconds: 600,
    };
    key.sign(&claims.to_json()).unwrap()
}

/// One attempt, so that a refusal is seen as it is.
fn client_with(target: &str, bearer: &BearerToken) -> PayledgerClient {
    let retry = RetrySettings { max_attempts: 1, ..RetrySettings::default() };
    let settings = ClientSettings { retry, bearer_token: Some(bearer.clone()), ..ClientSettings::default() };
    PayledgerClient::connect(target, settings).unwrap()
}

async fn get_account(client: &PayledgerClient) -> Result<(), tonic::Status> {
    client.get_account(proto::GetAccountRequest { account_id: "nobody".into() }).await.map(drop).or_else(|status| {
        // Authenticated and allowed: the account simply does not exist.
        if status.code() == Code::NotFound {
            Ok(())
        } else {
            Err(status)
        }
    })
}

async fn eventually(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT_MAX;
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "never within {WAIT_MAX:?}: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jwks_rotated_behind_its_https_url_is_followed_without_a_restart() {
    let pki = Pki::new("identity provider CA");
    let (old_key, new_key) = (
        SigningKey::generate(jsonwebtoken::Algorithm::EdDSA).unwrap(),
        SigningKey::generate(jsonwebtoken::Algorithm::ES256).unwrap(),
    );
    let jwks_server = JwksServer::start(&pki, SigningKey::jwks([&old_key])).await;
    let directory = tempfile::tempdir().unwrap();
    let ca = directory.path().join("idp-ca.pem");
    std::fs::write(&ca, pki.ca_pem()).unwrap();
    let settings = AuthSettings {
        auth_jwks: Some(jwks_server.url.clone()),
        auth_jwks_ca: Some(ca.clone()),
        auth_issuer: "https://idp.example".into(),
        auth_audience: "payledger".into(),
        auth_leeway_seconds: 5,
        // Only a token with an unknown kid makes the server read the set again here.
        auth_jwks_refresh_seconds: 3_600,
        auth_jwks_min_refresh_seconds: 1,
        insecure_allow_unauthenticated: false,
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let jwks = authenticator(listener.local_addr().unwrap(), &settings).await.expect("the JWKS fetched at start");
    assert_eq!(jwks_server.fetches.load(Ordering::SeqCst), 1);
    let ledger = common::sqlite_ledger(directory.path()).await;
    let application = Application::with_listener(listener, ledger, Duration::from_secs(1)).with_jwks(jwks);
    let target = format!("http://{}", application.local_addr());
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(application.run_until(async {
        let _ = stopped.await;
    }));

    let old = client_with(&target, &BearerToken::new(&token(&old_key)).unwrap());
    let new = client_with(&target, &BearerToken::new(&token(&new_key)).unwrap());
    get_account(&old).await.expect("the old key verifies before the rotation");
    assert_eq!(get_account(&new).await.unwrap_err().code(), Code::Unauthenticated, "not yet published");

    // The identity provider rotates: the new key in, the old one out.
    jwks_server.answer(Answer::Jwks(SigningKey::jwks([&new_key])));
    eventually("the new key verifies", async || get_account(&new).await.is_ok()).await;
    let refused = get_account(&old).await.expect_err("the old key is refused after the rotation");
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");

    // The identity provider fails: the last good set stays in force, and a token with an
    // unknown kid asks for a read that fails.
    jwks_server.answer(Answer::Status(503));
    let fetched = jwks_server.fetches.load(Ordering::SeqCst);
    let stranger = SigningKey::generate(jsonwebtoken::Algorithm::EdDSA).unwrap();
    let unknown = client_with(&target, &BearerToken::new(&token(&stranger)).unwrap());
    assert_eq!(get_account(&unknown).await.unwrap_err().code(), Code::Unauthenticated);
    eventually("the failing provider asked again", async || jwks_server.fetches.load(Ordering::SeqCst) > fetched).await;
    get_account(&new).await.expect("the last good set stays while the provider fails");
    assert_eq!(get_account(&old).await.unwrap_err().code(), Code::Unauthenticated);

    // Unknown kids do not turn into a fetch each: at most one a --auth-jwks-min-refresh-seconds.
    let before = jwks_server.fetches.load(Ordering::SeqCst);
    for _ in 0..20 {
        let _ = get_account(&unknown).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(jwks_server.fetches.load(Ordering::SeqCst) <= before + 1, "fetches are rate-limited");

    let _ = stop.send(());
    server.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_jwks_url_that_cannot_be_fetched_or_is_not_https_stops_the_start() {
    let listen: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let unreachable = AuthSettings {
        auth_jwks: Some("https://127.0.0.1:1/jwks.json".into()),
        auth_issuer: "iss".into(),
        auth_audience: "aud".into(),
        ..AuthSettings::default()
    };
    let error = authenticator(listen, &unreachable).await.unwrap_err().to_string();
    assert!(error.contains("cannot fetch the JWKS https://127.0.0.1:1/jwks.json"), "{error}");
    let plaintext = AuthSettings { auth_jwks: Some("http://idp.example/jwks.json".into()), ..unreachable.clone() };
    let error = authenticator(listen, &plaintext).await.unwrap_err().to_string();
    assert!(error.contains("https://"), "{error}");

    // A server whose certificate the given CA does not sign is not trusted.
    let pki = Pki::new("identity provider CA");
    let key = SigningKey::generate(jsonwebtoken::Algorithm::EdDSA).unwrap();
    let jwks_server = JwksServer::start(&pki, SigningKey::jwks([&key])).await;
    let directory = tempfile::tempdir().unwrap();
    let other_ca = directory.path().join("other-ca.pem");
    std::fs::write(&other_ca, Pki::new("another CA").ca_pem()).unwrap();
    let untrusted =
        AuthSettings { auth_jwks: Some(jwks_server.url.clone()), auth_jwks_ca: Some(other_ca), ..unreachable };
    let error = authenticator(listen, &untrusted).await.unwrap_err().to_string();
    assert!(error.contains("cannot fetch the JWKS"), "{error}");
    assert_eq!(jwks_server.fetches.load(Ordering::SeqCst), 0);
}

/// The certificate a new TLS connection to `address` is shown, verified against `ca_pem`.
async fn served_certificate(address: SocketAddr, ca_pem: &str) -> CertificateDer<'static> {
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(ca.unwrap()).unwrap();
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let stream = TcpStream::connect(address).await.unwrap();
    let stream = connector.connect(ServerName::try_from("localhost").unwrap(), stream).await.expect("a handshake");
    stream.get_ref().1.peer_certificates().expect("a server certificate")[0].clone().into_owned()
}

fn der(pem: &str) -> CertificateDer<'static> {
    CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_renewed_on_disk_is_served_to_new_connections_and_open_ones_keep_working() {
    let pki = Pki::new("payledger test CA");
    let (first, renewed) = (pki.issue(&["localhost"]), pki.issue(&["localhost"]));
    let directory = tempfile::tempdir().unwrap();
    let (cert, key) = (directory.path().join("cert.pem"), directory.path().join("key.pem"));
    std::fs::write(&cert, &first.cert_pem).unwrap();
    std::fs::write(&key, &first.key_pem).unwrap();
    let ledger = common::sqlite_ledger(directory.path()).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let application = Application::with_listener(listener, ledger, Duration::from_secs(1))
        .with_tls(ServerTls::from_files(&cert, &key, None).unwrap(), Some(Duration::from_millis(100)));
    let address = application.local_addr();
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(application.run_until(async {
        let _ = stopped.await;
    }));
    assert_eq!(served_certificate(address, &pki.ca_pem()).await, der(&first.cert_pem));

    // One HTTP/2 connection, opened before the renewal, calling throughout.
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(pki.ca_pem()))
        .domain_name("localhost");
    let channel = tonic::transport::Channel::from_shared(format!("https://localhost:{}", address.port()))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut accounts = AccountServiceClient::new(channel);
    let open = |number: usize| proto::OpenAccountRequest { account_id: format!("a-{number}"), currency: "USD".into() };
    accounts.open_account(open(0)).await.expect("a call before the renewal");

    // Renewed the way a certificate manager writes: the key, then the certificate. Between
    // the two writes the pair does not match and is not taken.
    std::fs::write(&key, &renewed.key_pem).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(served_certificate(address, &pki.ca_pem()).await, der(&first.cert_pem), "a half-written pair");
    std::fs::write(&cert, &renewed.cert_pem).unwrap();
    let mut calls = 1;
    let deadline = tokio::time::Instant::now() + WAIT_MAX;
    while served_certificate(address, &pki.ca_pem()).await != der(&renewed.cert_pem) {
        assert!(tokio::time::Instant::now() < deadline, "the renewed certificate never served");
        accounts.open_account(open(calls)).await.expect("no call on the open connection fails");
        calls += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for _ in 0..5 {
        accounts.open_account(open(calls)).await.expect("the open connection still serves after the renewal");
        calls += 1;
    }

    // A certificate outside its validity period (with its own key) is not taken either.
    let expired = pki.issue_expired(&["localhost"]);
    std::fs::write(&key, &expired.key_pem).unwrap();
    std::fs::write(&cert, &expired.cert_pem).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(served_certificate(address, &pki.ca_pem()).await, der(&renewed.cert_pem), "an expired certificate");

    // Files that cannot be used leave the renewed configuration in force.
    std::fs::write(&key, "not a key").unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(served_certificate(address, &pki.ca_pem()).await, der(&renewed.cert_pem));
    accounts.open_account(open(calls)).await.expect("still serving");

    let _ = stop.send(());
    server.await.unwrap().unwrap();
}
