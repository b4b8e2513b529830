//! The real trace exporter, end to end: `payledger serve` (the built binary, as deployed) sends
//! the server spans of a few calls to an OTLP receiver run by the test, over OTLP/HTTP and
//! OTLP/gRPC, plaintext and TLS behind a private CA, and flushes them when SIGTERM stops it.
//! The attributes seen by the receiver are the OpenTelemetry semantic conventions for gRPC
//! (v1.45.0), with the old ones too under `OTEL_SEMCONV_STABILITY_OPT_IN=rpc/dup`.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::BodyExt as _;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use opentelemetry_proto::tonic::trace::v1::Span;
use payledger::client::{PayledgerClient, RetrySettings};
use payledger::proto;
use prost::Message as _;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use tokio::io::AsyncBufReadExt as _;
use tokio::net::TcpListener;

/// How long a step that should take well under a second may take before the test gives up
/// (a guard against a hang, not a measure).
const STEP_LIMIT: Duration = Duration::from_secs(60);

/// What an OTLP receiver got: each decoded export request, and every request or connection
/// it refused (so that a failure shows what arrived instead).
#[derive(Default)]
struct Received {
    exports: Mutex<Vec<ExportTraceServiceRequest>>,
    refused: Mutex<Vec<String>>,
}

impl Received {
    /// Every span received, with its resource's `service.name`.
    fn spans(&self) -> Vec<(Option<String>, Span)> {
        let exports = self.exports.lock().unwrap();
        let mut spans = Vec::new();
        for resource_spans in exports.iter().flat_map(|export| &export.resource_spans) {
            let service_name = resource_spans
                .resource
                .as_ref()
                .and_then(|resource| attributes(&resource.attributes).remove("service.name"));
            for scope_spans in &resource_spans.scope_spans {
                spans.extend(scope_spans.spans.iter().map(|span| (service_name.clone(), span.clone())));
            }
        }
        spans
    }

    fn refused(&self) -> Vec<String> {
        self.refused.lock().unwrap().clone()
    }
}

/// Attributes by key: a string or integer value as text, another kind in its debug form.
fn attributes(attributes: &[KeyValue]) -> HashMap<String, String> {
    attributes
        .iter()
        .map(|attribute| {
            let value = match attribute.value.as_ref().and_then(|value| value.value.as_ref()) {
                Some(Value::StringValue(text)) => text.clone(),
                Some(Value::IntValue(number)) => number.to_string(),
                other => format!("{other:?}"),
            };
            (attribute.key.clone(), value)
        })
        .collect()
}

/// A CA made for one test, and certificates it issues.
struct Pki {
    ca: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate and its key, as PEM.
struct Issued {
    cert_pem: String,
    key_pem: String,
}

impl Pki {
    fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        Self { ca: CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap() }
    }

    fn ca_pem(&self) -> String {
        self.ca.pem()
    }

    /// A certificate for `names` (DNS names or IP addresses).
    fn issue(&self, names: &[&str]) -> Issued {
        let key = KeyPair::generate().unwrap();
        let params = CertificateParams::new(names.iter().map(|name| (*name).to_owned()).collect::<Vec<_>>()).unwrap();
        let cert = params.signed_by(&key, &self.ca).unwrap();
        Issued { cert_pem: cert.pem(), key_pem: key.serialize_pem() }
    }
}

/// The rustls configuration of a receiver presenting `identity`.
fn server_tls(identity: &Issued) -> Arc<tokio_rustls::rustls::ServerConfig> {
    use tokio_rustls::rustls::pki_types::pem::PemObject as _;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain = CertificateDer::pem_slice_iter(identity.cert_pem.as_bytes()).collect::<Result<Vec<_>, _>>().unwrap();
    let key = PrivateKeyDer::from_pem_slice(identity.key_pem.as_bytes()).unwrap();
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let config = tokio_rustls::rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    Arc::new(config)
}

/// An OTLP/HTTP receiver on a port of its own (HTTP/1.1; TLS with `tls`): `POST /v1/traces`
/// with a protobuf body is decoded and answered 200 with an empty protobuf response, as a
/// collector answers; anything else is refused and recorded.
async fn http_receiver(tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>) -> (SocketAddr, Arc<Received>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let received = Arc::new(Received::default());
    let accepting = received.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { return };
            let received = accepting.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                let exports = received.clone();
                let service = hyper::service::service_fn(move |request| export(exports.clone(), request));
                let http = hyper::server::conn::http1::Builder::new();
                match tls {
                    Some(config) => match tokio_rustls::TlsAcceptor::from(config).accept(stream).await {
                        Ok(stream) => {
                            let _ = http.serve_connection(hyper_util::rt::TokioIo::new(stream), service).await;
                        }
                        Err(error) => received.refused.lock().unwrap().push(format!("TLS handshake: {error}")),
                    },
                    None => {
                        let _ = http.serve_connection(hyper_util::rt::TokioIo::new(stream), service).await;
                    }
                }
            });
        }
    });
    (address, received)
}

/// One OTLP/HTTP request (see [`http_receiver`]).
async fn export(
    received: Arc<Received>,
    request: hyper::Request<hyper::body::Incoming>,
) -> Result<hyper::Response<http_body_util::Full<bytes::Bytes>>, Infallible> {
    let (parts, body) = request.into_parts();
    let content_type = parts.headers.get(hyper::header::CONTENT_TYPE).and_then(|value| value.to_str().ok());
    let body = body.collect().await.map(|collected| collected.to_bytes()).unwrap_or_default();
    let decoded = (parts.method == hyper::Method::POST
        && parts.uri.path() == "/v1/traces"
        && content_type == Some("application/x-protobuf"))
    .then(|| ExportTraceServiceRequest::decode(body))
    .and_then(Result::ok);
    let Some(decoded) = decoded else {
        received.refused.lock().unwrap().push(format!("{} {} ({content_type:?})", parts.method, parts.uri));
        let mut refused = hyper::Response::new(http_body_util::Full::default());
        *refused.status_mut() = hyper::StatusCode::BAD_REQUEST;
        return Ok(refused);
    };
    received.exports.lock().unwrap().push(decoded);
    let answer = ExportTraceServiceResponse::default().encode_to_vec();
    Ok(hyper::Response::builder()
        .header(hyper::header::CONTENT_TYPE, "application/x-protobuf")
        .body(http_body_util::Full::from(answer))
        .unwrap())
}

/// An OTLP/gRPC receiver (the collector's TraceService).
struct GrpcReceiver(Arc<Received>);

#[tonic::async_trait]
impl TraceService for GrpcReceiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.exports.lock().unwrap().push(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// An OTLP/gRPC receiver on a port of its own, with TLS when `tls` is given.
async fn grpc_receiver(tls: Option<tonic::transport::ServerTlsConfig>) -> (SocketAddr, Arc<Received>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let received = Arc::new(Received::default());
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        server = server.tls_config(tls).unwrap();
    }
    let router = server.add_service(TraceServiceServer::new(GrpcReceiver(received.clone())));
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tokio::spawn(router.serve_with_incoming(incoming));
    (address, received)
}

/// `payledger serve` (the built binary) on a fresh SQLite file and a port of its own, with the
/// OpenTelemetry variables `otel` and none inherited from the test's environment.
struct Served {
    child: tokio::process::Child,
    address: SocketAddr,
    /// The start-up line (`payledger serving ...`).
    started: String,
    stderr: Arc<Mutex<Vec<String>>>,
    _directory: tempfile::TempDir,
}

/// Starts `payledger serve` with `otel` and returns once it says it is serving, or, when it
/// exits first, its exit status and stderr.
async fn serve(otel: &[(&str, &str)]) -> Result<Served, (std::process::ExitStatus, Vec<String>)> {
    let directory = tempfile::tempdir().unwrap();
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_payledger"));
    command
        .args(["serve", "--listen", "127.0.0.1:0", "--database-url"])
        .arg(format!("sqlite:{}", directory.path().join("ledger.db").display()))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    for (name, _) in std::env::vars() {
        if name.starts_with("OTEL_") || name.starts_with("PAYLEDGER_") || name == "DATABASE_URL" {
            command.env_remove(name);
        }
    }
    command.envs(otel.iter().copied());
    let mut child = command.spawn().expect("payledger serve starts");
    let stderr = Arc::new(Mutex::new(Vec::new()));
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let (serving_tx, serving_rx) = tokio::sync::oneshot::channel::<String>();
    let collected = stderr.clone();
    tokio::spawn(async move {
        let mut serving = Some(serving_tx);
        while let Ok(Some(line)) = lines.next_line().await {
            if line.contains("payledger serving") {
                if let Some(serving) = serving.take() {
                    let _ = serving.send(line.clone());
                }
            }
            collected.lock().unwrap().push(line);
        }
    });
    let line = tokio::select! {
        line = serving_rx => line.ok(),
        _ = tokio::time::sleep(STEP_LIMIT) => panic!("no start-up line in {STEP_LIMIT:?}: {:?}", stderr.lock().unwrap()),
    };
    let Some(line) = line else {
        let status = tokio::time::timeout(STEP_LIMIT, child.wait()).await.expect("serve exits").unwrap();
        // The reader may still hold the last lines: give it the end of the pipe.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let lines = stderr.lock().unwrap().clone();
        return Err((status, lines));
    };
    let address = line
        .split_whitespace()
        .find_map(|field| field.strip_prefix("listen="))
        .and_then(|listen| listen.trim_matches('"').parse().ok())
        .unwrap_or_else(|| panic!("no listen address in {line}"));
    Ok(Served { child, address, started: line, stderr, _directory: directory })
}

impl Served {
    /// A few calls: OpenAccount twice (the second a replay), a Deposit, and a Deposit into a
    /// missing account (NOT_FOUND, the caller's error: no error on the server span).
    async fn make_calls(&self) {
        let client =
            PayledgerClient::connect_lazy(&format!("http://{}", self.address), RetrySettings::default()).unwrap();
        let open = || proto::OpenAccountRequest { account_id: "alice".into(), currency: "USD".into() };
        client.open_account(open()).await.unwrap();
        client.open_account(open()).await.unwrap();
        let deposit = |request_id: &str, account_id: &str| proto::DepositRequest {
            request_id: request_id.into(),
            account_id: account_id.into(),
            amount: "10.00".into(),
            currency: "USD".into(),
        };
        client.deposit(deposit("d1", "alice")).await.unwrap();
        let missing = client.deposit(deposit("d2", "nobody")).await.unwrap_err();
        assert_eq!(missing.code(), tonic::Code::NotFound, "{missing:?}");
    }

    /// SIGTERM, as an orchestrator stops it; waits for the exit (the batch of spans is flushed
    /// before it) and returns stderr. Call it once a call was answered: `serve` handles
    /// SIGTERM from its first moment of serving on, a moment after its start-up line.
    async fn stop(mut self) -> Vec<String> {
        let pid = self.child.id().expect("still running").to_string();
        let sent = std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(sent.success(), "kill -TERM {pid}");
        let status =
            tokio::time::timeout(STEP_LIMIT, self.child.wait()).await.expect("serve exits on SIGTERM").unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let stderr = self.stderr.lock().unwrap().clone();
        assert!(status.success(), "serve exits 0 on SIGTERM: {status}, {stderr:#?}");
        stderr
    }
}

/// The server spans of `method` (fully qualified) among `spans`.
fn server_spans<'a>(spans: &'a [(Option<String>, Span)], method: &str) -> Vec<&'a (Option<String>, Span)> {
    spans.iter().filter(|(_, span)| span.name == method && span.kind == SpanKind::Server as i32).collect()
}

/// The assertions every export makes, whatever its transport: the OpenAccount and Deposit
/// server spans with the stable gRPC attributes, from a resource named `payledger`. Returns
/// the attributes of the first OpenAccount span.
fn assert_stable_spans(received: &Received, address: SocketAddr, stderr: &[String]) -> HashMap<String, String> {
    let spans = received.spans();
    let names: Vec<&str> = spans.iter().map(|(_, span)| span.name.as_str()).collect();
    let context = format!("spans {names:?}, refused {:?}, stderr {stderr:#?}", received.refused());
    let opened = server_spans(&spans, "payledger.v1.AccountService/OpenAccount");
    assert_eq!(opened.len(), 2, "{context}");
    let (service_name, span) = opened[0];
    assert_eq!(service_name.as_deref(), Some("payledger"), "{context}");
    let found = attributes(&span.attributes);
    assert_eq!(found.get("rpc.system.name").map(String::as_str), Some("grpc"), "{found:?}");
    assert_eq!(
        found.get("rpc.method").map(String::as_str),
        Some("payledger.v1.AccountService/OpenAccount"),
        "{found:?}"
    );
    assert_eq!(found.get("rpc.status_code").map(String::as_str), Some("OK"), "{found:?}");
    assert_eq!(found.get("server.address").map(String::as_str), Some("127.0.0.1"), "{found:?}");
    assert_eq!(found.get("server.port"), Some(&address.port().to_string()), "{found:?}");
    assert_eq!(found.get("network.peer.address").map(String::as_str), Some("127.0.0.1"), "{found:?}");
    for absent in ["error.type", "rpc.method_original"] {
        assert!(!found.contains_key(absent), "{absent} on a call that succeeded: {found:?}");
    }
    assert_ne!(span.status.as_ref().map(|status| status.code), Some(StatusCode::Error as i32), "{span:?}");

    let deposits = server_spans(&spans, "payledger.v1.AccountService/Deposit");
    let codes: Vec<String> =
        deposits.iter().filter_map(|(_, span)| attributes(&span.attributes).remove("rpc.status_code")).collect();
    assert_eq!(codes.len(), 2, "{context}");
    assert!(codes.contains(&"OK".to_owned()) && codes.contains(&"NOT_FOUND".to_owned()), "{codes:?}");
    for (_, span) in deposits {
        // NOT_FOUND is the caller's error: not one of the server's (no status Error, no
        // error.type), as the gRPC conventions say for server spans.
        assert!(!attributes(&span.attributes).contains_key("error.type"), "{span:?}");
        assert_ne!(span.status.as_ref().map(|status| status.code), Some(StatusCode::Error as i32), "{span:?}");
    }
    found
}

/// Writes `text` into `directory` and returns the path as a string.
fn write(directory: &std::path::Path, name: &str, text: &str) -> String {
    let path = directory.join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_an_otlp_http_receiver_with_the_stable_rpc_attributes() {
    let (receiver, received) = http_receiver(None).await;
    let endpoint = format!("http://{receiver}");
    let served = serve(&[("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint), ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")])
        .await
        .unwrap_or_else(|(status, stderr)| panic!("serve exited {status}: {stderr:#?}"));
    let address = served.address;
    assert!(served.started.contains(r#"traces="otlp/http-protobuf""#), "{}", served.started);

    served.make_calls().await;
    let stderr = served.stop().await;

    let found = assert_stable_spans(&received, address, &stderr);
    for old in ["rpc.system", "rpc.service", "rpc.grpc.status_code"] {
        assert!(!found.contains_key(old), "{old} without rpc/dup: {found:?}");
    }
    assert!(received.refused().is_empty(), "{:?}", received.refused());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_an_otlp_https_receiver_that_only_the_private_ca_vouches_for() {
    let directory = tempfile::tempdir().unwrap();
    let pki = Pki::new("payledger test collector CA");
    let (receiver, received) = http_receiver(Some(server_tls(&pki.issue(&["127.0.0.1"])))).await;
    let ca = write(directory.path(), "collector-ca.pem", &pki.ca_pem());
    // The general endpoint is a base URL: the exporter appends /v1/traces.
    let endpoint = format!("https://127.0.0.1:{}", receiver.port());
    let served = serve(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
        ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", &ca),
    ])
    .await
    .unwrap_or_else(|(status, stderr)| panic!("serve exited {status}: {stderr:#?}"));
    let address = served.address;

    served.make_calls().await;
    let stderr = served.stop().await;

    assert_stable_spans(&received, address, &stderr);
    assert!(received.refused().is_empty(), "{:?}", received.refused());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_private_ca_an_https_export_fails_and_falls_back_to_nothing() {
    let pki = Pki::new("payledger test collector CA");
    let (receiver, received) = http_receiver(Some(server_tls(&pki.issue(&["127.0.0.1"])))).await;
    let endpoint = format!("https://127.0.0.1:{}/v1/traces", receiver.port());
    let served = serve(&[
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", &endpoint),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        // A short export timeout, so that the retries of the refused batch end soon after
        // SIGTERM.
        ("OTEL_EXPORTER_OTLP_TIMEOUT", "2000"),
    ])
    .await
    .unwrap_or_else(|(status, stderr)| panic!("serve exited {status}: {stderr:#?}"));

    served.make_calls().await;
    let stderr = served.stop().await;

    assert!(received.spans().is_empty(), "spans arrived without the CA: {:?}", received.spans());
    let refused = received.refused();
    assert!(!refused.is_empty(), "the exporter tried the collector: {stderr:#?}");
    assert!(
        refused.iter().all(|reason| reason.starts_with("TLS handshake") && reason.contains("UnknownCA")),
        "every attempt was a TLS handshake the exporter broke off, its CA unknown (no plaintext retry): {refused:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_an_otlp_grpc_receiver_over_mutual_tls_and_rpc_dup_adds_the_old_attributes() {
    let directory = tempfile::tempdir().unwrap();
    let collector_pki = Pki::new("payledger test collector CA");
    let client_pki = Pki::new("payledger test client CA");
    let identity = collector_pki.issue(&["127.0.0.1"]);
    let tls = tonic::transport::ServerTlsConfig::new()
        .identity(tonic::transport::Identity::from_pem(&identity.cert_pem, &identity.key_pem))
        .client_ca_root(tonic::transport::Certificate::from_pem(client_pki.ca_pem()));
    let (receiver, received) = grpc_receiver(Some(tls)).await;
    let client = client_pki.issue(&["payledger"]);
    let ca = write(directory.path(), "collector-ca.pem", &collector_pki.ca_pem());
    let client_certificate = write(directory.path(), "client.pem", &client.cert_pem);
    let client_key = write(directory.path(), "client.key", &client.key_pem);
    let endpoint = format!("https://127.0.0.1:{}", receiver.port());
    // No protocol variable: gRPC, as before OTLP/HTTP was built in.
    let served = serve(&[
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", &endpoint),
        ("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", &ca),
        ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", &client_certificate),
        ("OTEL_EXPORTER_OTLP_CLIENT_KEY", &client_key),
        ("OTEL_SEMCONV_STABILITY_OPT_IN", "http,rpc/dup"),
    ])
    .await
    .unwrap_or_else(|(status, stderr)| panic!("serve exited {status}: {stderr:#?}"));
    let address = served.address;
    assert!(served.started.contains(r#"traces="otlp/grpc""#), "{}", served.started);

    served.make_calls().await;
    let stderr = served.stop().await;

    let found = assert_stable_spans(&received, address, &stderr);
    assert_eq!(found.get("rpc.system").map(String::as_str), Some("grpc"), "{found:?}");
    assert_eq!(found.get("rpc.service").map(String::as_str), Some("payledger.v1.AccountService"), "{found:?}");
    assert_eq!(found.get("rpc.grpc.status_code").map(String::as_str), Some("0"), "{found:?}");
    assert!(!stderr.iter().any(|line| line.contains("client.key") && line.contains("BEGIN")), "{stderr:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_file_that_cannot_be_used_stops_serve_at_start_naming_the_variable_and_path() {
    let directory = tempfile::tempdir().unwrap();
    let not_pem = write(directory.path(), "collector-ca.pem", "not a certificate");
    let absent = directory.path().join("absent.pem").display().to_string();
    for (variable, path) in
        [("OTEL_EXPORTER_OTLP_CERTIFICATE", &not_pem), ("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", &absent)]
    {
        let refused = serve(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://127.0.0.1:4318"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            (variable, path),
        ])
        .await;
        let Err((status, stderr)) = refused else { panic!("serve started with {variable}={path}") };
        assert!(!status.success());
        let said = stderr.join("\n");
        assert!(said.contains(&format!("{variable}={path}")), "{said}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protocol_that_is_not_built_in_leaves_traces_off_and_says_so() {
    let served = serve(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
    ])
    .await
    .unwrap_or_else(|(status, stderr)| panic!("serve exited {status}: {stderr:#?}"));
    served.make_calls().await;
    let stderr = served.stop().await;
    let said = stderr.join("\n");
    assert!(said.contains(r#"traces off: OTEL_EXPORTER_OTLP_PROTOCOL="http/json""#), "{said}");
    assert!(said.contains(r#"traces="off""#), "{said}");
}
