//! TLS and mutual TLS between the Rust client and a real server, with certificates made by
//! the test (rcgen); and the start-up rules of an unauthenticated server.

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use payledger::auth::dev::{SigningKey, TokenClaims};
use payledger::auth::Authenticator;
use payledger::client::{BearerToken, ClientSettings, ClientTls, ConnectError, PayledgerClient, RetrySettings};
use payledger::proto;
use payledger::startup::Application;
use payledger::tls::ServerTls;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls::pki_types::pem::PemObject as _;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::Code;

/// A CA and the PEMs of a certificate it signed for `names`.
pub(crate) struct Pki {
    ca: CertifiedIssuer<'static, KeyPair>,
}

pub(crate) struct Issued {
    pub(crate) cert_pem: String,
    pub(crate) key_pem: String,
}

impl Pki {
    pub(crate) fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        Self { ca: CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap() }
    }

    pub(crate) fn ca_pem(&self) -> String {
        self.ca.pem()
    }

    /// A certificate whose validity period ended in 2021.
    pub(crate) fn issue_expired(&self, names: &[&str]) -> Issued {
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(names.iter().map(|name| (*name).to_owned()).collect::<Vec<_>>()).unwrap();
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        let cert = params.signed_by(&key, &self.ca).unwrap();
        Issued { cert_pem: cert.pem(), key_pem: key.serialize_pem() }
    }

    pub(crate) fn issue(&self, names: &[&str]) -> Issued {
        let key = KeyPair::generate().unwrap();
        let params = CertificateParams::new(names.iter().map(|name| (*name).to_owned()).collect::<Vec<_>>()).unwrap();
        let cert = params.signed_by(&key, &self.ca).unwrap();
        Issued { cert_pem: cert.pem(), key_pem: key.serialize_pem() }
    }
}

/// A server with TLS (mutual when `client_ca` is given) and, when `authenticator` is
/// given, JWT authentication, over a fresh SQLite ledger.
struct Server {
    address: SocketAddr,
    /// Its Prometheus listener.
    metrics: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
    _directory: tempfile::TempDir,
}

impl Server {
    async fn start(identity: &Issued, client_ca: Option<&str>, authenticator: Option<Authenticator>) -> Self {
        let directory = tempfile::tempdir().unwrap();
        let ledger = common::sqlite_ledger(directory.path()).await;
        let tls = ServerTls::from_pem(
            identity.cert_pem.as_bytes(),
            identity.key_pem.as_bytes(),
            client_ca.map(str::as_bytes),
        )
        .unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let metrics_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let metrics = metrics_listener.local_addr().unwrap();
        let application = Application::with_listener(listener, ledger, Duration::from_secs(2))
            .with_tls(tls, None)
            .with_authenticator(authenticator.map(Arc::new))
            .with_metrics_listener(Some(metrics_listener));
        let address = application.local_addr();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            application
                .run_until(async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        });
        Self { address, metrics, stop: Some(stop), task, _directory: directory }
    }

    async fn stop(mut self) {
        let _ = self.stop.take().map(|stop| stop.send(()));
        let _ = self.task.await;
    }

    /// `payledger_tls_connections_refused_total` of `reason`, as `/metrics` shows it now.
    async fn refused(&self, reason: &str) -> u64 {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut stream = tokio::net::TcpStream::connect(self.metrics).await.unwrap();
        stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").await.unwrap();
        let mut text = String::new();
        stream.read_to_string(&mut text).await.unwrap();
        let series = format!("payledger_tls_connections_refused_total{{reason=\"{reason}\"}} ");
        let line = text.lines().find_map(|line| line.strip_prefix(series.as_str()));
        line.unwrap_or_else(|| panic!("no {series} in {text}")).trim().parse().unwrap()
    }

    /// Waits (up to 10 s) until `reason`'s count is at least `count`; the count as last seen.
    async fn refused_reaches(&self, reason: &str, count: u64) -> u64 {
        let mut seen = self.refused(reason).await;
        for _ in 0..200 {
            if seen >= count {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            seen = self.refused(reason).await;
        }
        seen
    }
}

/// Retries that give up fast: a refused handshake is UNAVAILABLE on every attempt.
fn quick() -> RetrySettings {
    RetrySettings { max_attempts: 2, overall_deadline: Duration::from_secs(5), ..RetrySettings::default() }
}

fn trusting(pki: &Pki) -> ClientTls {
    ClientTls { ca_certificate_pem: Some(pki.ca_pem().into_bytes()), ..ClientTls::default() }
}

async fn open(client: &PayledgerClient, account_id: &str) -> Result<(), tonic::Status> {
    let request = proto::OpenAccountRequest { account_id: account_id.into(), currency: "USD".into() };
    client.open_account(request).await.map(drop)
}

#[tokio::test]
async fn the_client_speaks_tls_to_a_tls_server_and_refuses_one_it_cannot_verify() {
    let pki = Pki::new("payledger test CA");
    let server = Server::start(&pki.issue(&["localhost"]), None, None).await;
    let target = format!("https://localhost:{}", server.address.port());

    let settings = ClientSettings { retry: quick(), tls: Some(trusting(&pki)), ..ClientSettings::default() };
    let client = PayledgerClient::connect(&target, settings).unwrap();
    open(&client, "alice").await.expect("a verified TLS server answers");

    // Not signed by a CA the client trusts: the public roots by default, or another CA.
    for tls in [None, Some(trusting(&Pki::new("another CA")))] {
        let settings = ClientSettings { retry: quick(), tls, ..ClientSettings::default() };
        let client = PayledgerClient::connect(&target, settings).unwrap();
        let status = open(&client, "bob").await.unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    }
    // A certificate for another name.
    let settings = ClientSettings {
        retry: quick(),
        tls: Some(ClientTls { domain_name: Some("payledger.example".into()), ..trusting(&pki) }),
        ..ClientSettings::default()
    };
    let status = open(&PayledgerClient::connect(&target, settings).unwrap(), "bob").await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    // Plaintext to the TLS port gets nowhere, and TLS settings never go with http://.
    let plaintext = PayledgerClient::connect_lazy(&format!("http://localhost:{}", server.address.port()), quick());
    assert!(open(&plaintext.unwrap(), "bob").await.is_err());
    let settings = ClientSettings { tls: Some(trusting(&pki)), ..ClientSettings::default() };
    let mixed = PayledgerClient::connect(&format!("http://localhost:{}", server.address.port()), settings);
    assert!(matches!(mixed, Err(ConnectError::TlsForPlaintextTarget)));
    server.stop().await;
}

/// Each connection refused at the TLS handshake is counted by its reason, starting from 0:
/// plaintext sent to the TLS port, and (mutual TLS) a client certificate of another CA and
/// none at all, as `handshake_failed`; a TCP probe (connect, close) as `closed_early`; a
/// connection that completes its handshake not at all.
#[tokio::test]
async fn connections_refused_at_the_handshake_are_counted_by_reason() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let (server_pki, client_pki, stranger_pki) = (Pki::new("server CA"), Pki::new("client CA"), Pki::new("other"));
    let server = Server::start(&server_pki.issue(&["localhost"]), Some(&client_pki.ca_pem()), None).await;
    for reason in payledger::metrics::TLS_REFUSALS {
        assert_eq!(server.refused(reason).await, 0, "{reason} starts at 0");
    }

    let mut plaintext = tokio::net::TcpStream::connect(server.address).await.unwrap();
    plaintext.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.unwrap();
    let mut answer = Vec::new();
    let _ = plaintext.read_to_end(&mut answer).await;
    assert_eq!(server.refused_reaches("handshake_failed", 1).await, 1, "plaintext to the TLS port");
    // A TCP probe: connected, then closed without a byte.
    drop(tokio::net::TcpStream::connect(server.address).await.unwrap());
    assert_eq!(server.refused_reaches("closed_early", 1).await, 1, "a TCP probe");
    assert_eq!(server.refused("handshake_failed").await, 1, "a TCP probe is not a failed handshake");

    let target = format!("https://localhost:{}", server.address.port());
    let client_with = |identity: Option<Issued>| {
        let tls = ClientTls {
            identity_pem: identity.map(|issued| (issued.cert_pem.into_bytes(), issued.key_pem.into_bytes())),
            ..trusting(&server_pki)
        };
        let settings = ClientSettings {
            retry: RetrySettings { max_attempts: 1, ..quick() },
            tls: Some(tls),
            ..ClientSettings::default()
        };
        PayledgerClient::connect(&target, settings).unwrap()
    };
    open(&client_with(Some(client_pki.issue(&["checkout"]))), "alice").await.expect("a client certificate of the CA");
    assert_eq!(server.refused("handshake_failed").await, 1, "a completed handshake is not counted");
    for identity in [Some(stranger_pki.issue(&["checkout"])), None] {
        let before = server.refused("handshake_failed").await;
        assert!(open(&client_with(identity), "bob").await.is_err());
        assert!(server.refused_reaches("handshake_failed", before + 1).await > before, "a refused client certificate");
    }
    assert_eq!(server.refused("handshakes_at_bound").await, 0);
    assert_eq!(server.refused("peer_at_bound").await, 0);
    server.stop().await;
}

#[tokio::test]
async fn a_mutual_tls_server_refuses_a_client_without_a_certificate_from_its_ca() {
    let (server_pki, client_pki, stranger_pki) = (Pki::new("server CA"), Pki::new("client CA"), Pki::new("other"));
    let server = Server::start(&server_pki.issue(&["localhost"]), Some(&client_pki.ca_pem()), None).await;
    let target = format!("https://localhost:{}", server.address.port());
    let client_with = |identity: Option<Issued>| {
        let tls = ClientTls {
            identity_pem: identity.map(|issued| (issued.cert_pem.into_bytes(), issued.key_pem.into_bytes())),
            ..trusting(&server_pki)
        };
        PayledgerClient::connect(
            &target,
            ClientSettings { retry: quick(), tls: Some(tls), ..ClientSettings::default() },
        )
        .unwrap()
    };

    open(&client_with(Some(client_pki.issue(&["checkout"]))), "alice").await.expect("a client certificate of the CA");
    for identity in [None, Some(stranger_pki.issue(&["checkout"]))] {
        let status = open(&client_with(identity), "bob").await.unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "refused at the handshake: {status:?}");
    }
    server.stop().await;
}

#[tokio::test]
async fn the_client_sends_its_bearer_token_on_every_call_and_can_replace_it() {
    let pki = Pki::new("payledger test CA");
    let key = SigningKey::generate(jsonwebtoken::Algorithm::EdDSA).unwrap();
    let authenticator = Authenticator::from_jwks(&SigningKey::jwks([&key]), "iss", "aud", 5).unwrap();
    let server = Server::start(&pki.issue(&["localhost"]), None, Some(authenticator)).await;
    let mint = |scope: &str| {
        let claims = TokenClaims {
            issuer: "iss".into(),
            audience: "aud".into(),
            subject: "ops".into(),
            merchants: vec!["*".into()],
            scope: scope.into(),
            ttl_seconds: 60,
        };
        key.sign(&claims.to_json()).unwrap()
    };
    let target = format!("https://localhost:{}", server.address.port());

    let anonymous = PayledgerClient::connect(
        &target,
        ClientSettings { retry: quick(), tls: Some(trusting(&pki)), ..ClientSettings::default() },
    )
    .unwrap();
    assert_eq!(open(&anonymous, "alice").await.unwrap_err().code(), Code::Unauthenticated);

    let bearer = BearerToken::new(&mint("accounts:read")).unwrap();
    assert_eq!(format!("{bearer:?}"), "BearerToken(..)", "Debug never shows the token");
    let settings = ClientSettings {
        retry: quick(),
        tls: Some(trusting(&pki)),
        bearer_token: Some(bearer.clone()),
        ..ClientSettings::default()
    };
    let client = PayledgerClient::connect(&target, settings).unwrap();
    assert_eq!(open(&client, "alice").await.unwrap_err().code(), Code::PermissionDenied);
    bearer.set(&mint("accounts:admin accounts:read")).unwrap();
    open(&client, "alice").await.expect("the replaced token is sent");
    server.stop().await;
}

/// `serve` with no auth settings: one command on loopback, refused anywhere else.
#[tokio::test]
async fn serve_without_auth_starts_only_on_loopback_unless_told_otherwise() {
    use payledger::config::AuthSettings;
    use payledger::startup::authenticator;
    let loopback: SocketAddr = "127.0.0.1:50051".parse().unwrap();
    let any: SocketAddr = "0.0.0.0:50051".parse().unwrap();
    let v6_loopback: SocketAddr = "[::1]:50051".parse().unwrap();
    assert!(authenticator(loopback, &AuthSettings::default()).await.unwrap().is_none());
    assert!(authenticator(v6_loopback, &AuthSettings::default()).await.unwrap().is_none());
    let refused = authenticator(any, &AuthSettings::default()).await.unwrap_err().to_string();
    assert!(refused.contains("not a loopback address") && refused.contains("--auth-jwks"), "{refused}");
    let insecure = AuthSettings { insecure_allow_unauthenticated: true, ..AuthSettings::default() };
    assert!(authenticator(any, &insecure).await.unwrap().is_none());
}

/// The binary itself: a non-loopback listen without auth exits at once with the reason,
/// before touching the database.
#[test]
fn the_serve_command_refuses_a_non_loopback_listener_without_auth() {
    let directory = tempfile::tempdir().unwrap();
    let database = directory.path().join("ledger.db");
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_payledger"))
        .args(["serve", "--listen", "0.0.0.0:0", "--database-url"])
        .arg(format!("sqlite:{}", database.display()))
        .env_remove("PAYLEDGER_AUTH_JWKS")
        .env_remove("PAYLEDGER_INSECURE_ALLOW_UNAUTHENTICATED")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("refusing to serve unauthenticated calls on 0.0.0.0:0"), "{stderr}");
    assert!(!database.exists(), "no database file is created");
}

/// The zero-setup `serve` (no auth settings, a loopback address) starts, and its start-up
/// line says that it serves unauthenticated calls on loopback only.
#[test]
fn the_serve_command_starts_without_auth_on_loopback_and_says_so() {
    use std::io::{BufRead, BufReader};
    let directory = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_payledger"))
        .args(["serve", "--listen", "127.0.0.1:0", "--database-url"])
        .arg(format!("sqlite:{}", directory.path().join("ledger.db").display()))
        .env_remove("PAYLEDGER_AUTH_JWKS")
        .env_remove("PAYLEDGER_INSECURE_ALLOW_UNAUTHENTICATED")
        .env_remove("PAYLEDGER_LISTEN")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let line = stderr.lines().map_while(Result::ok).find(|line| line.contains("payledger serving"));
    let _ = child.kill();
    let _ = child.wait();
    let line = line.expect("a start-up line");
    assert!(line.contains(r#"authentication="none (loopback only)""#), "{line}");
    assert!(line.contains(r#"transport="plaintext""#), "{line}");
}

/// A certificate and key that rustls cannot use stop the start with the reason, before the
/// server says it is serving.
#[test]
fn unusable_tls_files_are_refused_at_start() {
    use payledger::config::TlsSettings;
    use payledger::startup::{server_tls, StartupError};
    let directory = tempfile::tempdir().unwrap();
    let issued = Pki::new("CA").issue(&["localhost"]);
    let (cert, key) = (directory.path().join("cert.pem"), directory.path().join("key.pem"));
    std::fs::write(&cert, &issued.cert_pem).unwrap();
    std::fs::write(&key, &issued.key_pem).unwrap();
    let settings = |cert: &std::path::Path, key: &std::path::Path| TlsSettings {
        tls_cert: Some(cert.to_owned()),
        tls_key: Some(key.to_owned()),
        tls_client_ca: None,
        tls_reload_interval_seconds: 30,
    };
    assert!(server_tls(&settings(&cert, &key)).unwrap().is_some());
    let swapped = server_tls(&settings(&key, &cert)).unwrap_err();
    assert!(matches!(swapped, StartupError::Tls(_)), "{swapped}");
    let missing = server_tls(&settings(&cert, &directory.path().join("absent.pem"))).unwrap_err();
    assert!(missing.to_string().contains("absent.pem"), "{missing}");
}

/// The test tools refuse TLS settings for an `http://` target instead of dropping them.
#[tokio::test]
async fn the_tools_refuse_tls_settings_for_a_plaintext_target() {
    let directory = tempfile::tempdir().unwrap();
    std::fs::write(directory.path().join("ca.pem"), Pki::new("CA").ca_pem()).unwrap();
    let access = payledger_tools::TargetAccess { tls_ca: Some(directory.path().join("ca.pem")), ..Default::default() };
    let error = access.connect("http://127.0.0.1:1").await.unwrap_err();
    assert!(error.to_string().contains("http://"), "{error}");
}

/// Reads one byte of `stream`, giving up after `wait`.
async fn read_within(
    stream: &mut tokio::net::TcpStream,
    wait: Duration,
) -> Result<std::io::Result<usize>, tokio::time::error::Elapsed> {
    let mut byte = [0u8; 1];
    tokio::time::timeout(wait, tokio::io::AsyncReadExt::read(stream, &mut byte)).await
}

/// Connections that open TCP and never handshake, many from one address, neither make the
/// server close its listener nor keep a handshake from another address waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_from_one_address_do_not_hold_up_handshakes_from_another() {
    let pki = Pki::new("payledger test CA");
    let server = Server::start(&pki.issue(&["localhost"]), None, None).await;
    let mut idle = Vec::new();
    for _ in 0..(payledger::tls::HANDSHAKES_PER_PEER_MAX + 8) {
        idle.push(tokio::net::TcpStream::connect(server.address).await.unwrap());
    }
    // Past the per-address bound, a connection is closed at once (long before the 5 s a
    // handshake may take); those within it are held.
    let (within, past) = idle.split_at_mut(payledger::tls::HANDSHAKES_PER_PEER_MAX);
    for stream in past.iter_mut() {
        let read = read_within(stream, Duration::from_secs(1)).await;
        assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "a connection past the bound is closed at once: {read:?}");
    }
    assert!(read_within(&mut within[0], Duration::from_millis(300)).await.is_err(), "one within the bound is held");
    // Another address (127.0.0.2 is loopback too) is served at once.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    let tcp = socket.connect(server.address).await.unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(rustls::pki_types::CertificateDer::from_pem_slice(pki.ca_pem().as_bytes()).unwrap()).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    tokio::time::timeout(Duration::from_secs(2), connector.connect(name, tcp))
        .await
        .expect("a handshake from another address is not kept waiting")
        .expect("and succeeds");
    drop(idle);
    server.stop().await;
}
