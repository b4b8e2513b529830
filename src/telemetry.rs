//! Logs and traces. Tests do not call [`init`], so they stay silent.
//!
//! Logs go to stderr, filtered by `--log-filter`. Traces go to an OpenTelemetry collector
//! over OTLP, only when the standard variables ask for it (OpenTelemetry "Environment Variable
//! Specification" and "OTLP Exporter Configuration"): `docs/operations.md`, "Traces", lists
//! the variables read here and by opentelemetry-otlp. A certificate variable that names a
//! file which cannot be used is an error at start, never a quiet fallback.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _, WithTonicConfig as _};
use opentelemetry_sdk::trace::SdkTracerProvider;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _};

use crate::config::{LogFormat, LogSettings};

/// The instrumentation scope of payledger's spans.
const TRACER_NAME: &str = "payledger";

/// Flushes the traces still buffered when dropped (at the end of `main`).
pub struct Telemetry {
    tracer_provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.tracer_provider.take() {
            // The export runs on the runtime's other workers while this one waits.
            let multi_thread = tokio::runtime::Handle::try_current()
                .is_ok_and(|handle| handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
            let outcome =
                if multi_thread { tokio::task::block_in_place(|| provider.shutdown()) } else { provider.shutdown() };
            if let Err(error) = outcome {
                eprintln!("payledger: traces not flushed at exit: {error}");
            }
        }
    }
}

/// An environment variable's value, `None` when unset or empty (the Environment Variable
/// Specification: an empty value is the same as an unset one).
fn variable(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|value| !value.trim().is_empty())
}

/// The OTLP transport of traces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TraceProtocol {
    /// OTLP/gRPC (`grpc`), to a collector's port 4317.
    Grpc,
    /// OTLP/HTTP with protobuf bodies (`http/protobuf`), `POST {endpoint}/v1/traces` to a
    /// collector's port 4318.
    HttpProtobuf,
}

impl TraceProtocol {
    /// The protocol asked for by `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, else
    /// `OTEL_EXPORTER_OTLP_PROTOCOL` (values case-insensitive, as the specification's enums
    /// are), else `grpc`: the specification's default is `http/protobuf`, but payledger
    /// exported over gRPC alone before, and a deployment that sets only the endpoint of a
    /// collector's gRPC port must keep working.
    ///
    /// # Errors
    /// The variable and its value when that is another protocol (`http/json` is not built in).
    fn from_variables(read: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        for name in ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"] {
            if let Some(value) = read(name) {
                return match value.trim().to_ascii_lowercase().as_str() {
                    "grpc" => Ok(Self::Grpc),
                    "http/protobuf" => Ok(Self::HttpProtobuf),
                    _ => Err(format!(
                        "{name}={value:?}, and only `grpc` and `http/protobuf` are built in (no `http/json`)"
                    )),
                };
            }
        }
        Ok(Self::Grpc)
    }

    /// The name on the start-up line.
    fn as_str(self) -> &'static str {
        match self {
            Self::Grpc => "otlp/grpc",
            Self::HttpProtobuf => "otlp/http-protobuf",
        }
    }
}

/// The protocol traces are exported with when the environment asks for OTLP trace export:
/// an endpoint variable set, `OTEL_SDK_DISABLED` not `true`, and a protocol that is built in
/// (another one is reported on stderr and leaves traces off).
fn traces_requested() -> Option<TraceProtocol> {
    let disabled = variable("OTEL_SDK_DISABLED").is_some_and(|value| value.trim().eq_ignore_ascii_case("true"));
    let endpoint =
        variable("OTEL_EXPORTER_OTLP_ENDPOINT").is_some() || variable("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some();
    if disabled || !endpoint {
        return None;
    }
    TraceProtocol::from_variables(variable).map_err(|reason| eprintln!("payledger: traces off: {reason}")).ok()
}

/// How traces are exported, for the start-up line: `off`, `otlp/grpc` or `otlp/http-protobuf`.
pub fn traces_exported() -> &'static str {
    TRACES_EXPORTED.get().map_or("off", |protocol| protocol.as_str())
}

static TRACES_EXPORTED: std::sync::OnceLock<TraceProtocol> = std::sync::OnceLock::new();

/// A certificate variable, the traces one first: its name and the path it gives.
fn certificate_variable(
    read: &impl Fn(&str) -> Option<String>,
    traces: &str,
    general: &str,
) -> Option<(String, PathBuf)> {
    [traces, general].into_iter().find_map(|name| read(name).map(|path| (name.to_owned(), PathBuf::from(path.trim()))))
}

/// Reads the file a variable names.
///
/// # Errors
/// The variable, the path and the I/O error.
fn read_named(name: &str, path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|error| format!("{name}={}: cannot be read: {error}", path.display()))
}

/// The certificates of a PEM file (`CERTIFICATE` blocks; other blocks are skipped).
///
/// # Errors
/// The variable and the path when the file holds a malformed block or no certificate.
fn certificates(name: &str, path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let certificates = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| format!("{name}={}: not PEM certificates: {error}", path.display()))?;
    if certificates.is_empty() {
        return Err(format!("{name}={}: no PEM certificate (-----BEGIN CERTIFICATE-----) in the file", path.display()));
    }
    Ok(certificates)
}

/// TLS towards the trace collector, from the OTLP certificate variables (OTLP Exporter
/// Configuration: `OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE`, else `OTEL_EXPORTER_OTLP_CERTIFICATE`;
/// `..._CLIENT_CERTIFICATE` and `..._CLIENT_KEY` likewise). It applies to `https://`
/// endpoints, over either protocol; an `http://` endpoint is plaintext whatever is set.
struct CollectorTls {
    /// The CAs a collector's certificate must chain to: the certificate file's alone when
    /// one is set, else the public web roots (Mozilla's, from webpki-roots).
    roots: rustls::RootCertStore,
    /// The client certificate chain and key for mutual TLS, as PEM: tonic parses its own
    /// (the rustls configuration below holds them parsed, and checked).
    identity: Option<ClientIdentity>,
    /// The rustls configuration of OTLP/HTTP, built (and so checked) at start.
    http: Arc<rustls::ClientConfig>,
}

/// A client certificate chain and its private key, PEM, as read from their files.
struct ClientIdentity {
    certificate_pem: Vec<u8>,
    key_pem: Vec<u8>,
}

impl CollectorTls {
    /// Reads and checks the certificate variables' files with `read` giving the environment.
    ///
    /// # Errors
    /// A message naming the variable and the path: a file that cannot be read, holds no
    /// certificate or a malformed one, a key that is not a PKCS #1, SEC 1 or PKCS #8 PEM
    /// private key or does not match its certificate, or one of the client certificate and
    /// key without the other. Key material is never part of it.
    fn from_variables(read: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        let roots = match certificate_variable(
            &read,
            "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
            "OTEL_EXPORTER_OTLP_CERTIFICATE",
        ) {
            Some((name, path)) => crate::tls::trust_anchors(Some(&read_named(&name, &path)?))
                .map_err(|error| format!("{name}={}: {error}", path.display()))?,
            None => crate::tls::trust_anchors(None).map_err(|error| error.to_string())?,
        };
        let client_certificate = certificate_variable(
            &read,
            "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
            "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
        );
        let client_key =
            certificate_variable(&read, "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", "OTEL_EXPORTER_OTLP_CLIENT_KEY");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|error| format!("TLS towards the trace collector: {error}"))?
            .with_root_certificates(roots.clone());
        let (identity, http) = match (client_certificate, client_key) {
            (None, None) => (None, builder.with_no_client_auth()),
            (Some((certificate_name, certificate_path)), Some((key_name, key_path))) => {
                let certificate_pem = read_named(&certificate_name, &certificate_path)?;
                let chain = certificates(&certificate_name, &certificate_path, &certificate_pem)?;
                let key_pem = read_named(&key_name, &key_path)?;
                let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| {
                    format!(
                        "{key_name}={}: no PEM private key (PKCS #1, SEC 1 or PKCS #8) in the file",
                        key_path.display()
                    )
                })?;
                let http = builder.with_client_auth_cert(chain, key).map_err(|error| {
                    format!(
                        "{certificate_name}={} and {key_name}={}: not a usable certificate and key: {error}",
                        certificate_path.display(),
                        key_path.display()
                    )
                })?;
                (Some(ClientIdentity { certificate_pem, key_pem }), http)
            }
            (Some((name, _)), None) | (None, Some((name, _))) => {
                return Err(format!(
                    "{name} is set without its pair: mutual TLS needs OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE \
                     and OTEL_EXPORTER_OTLP_CLIENT_KEY (or both TRACES_ ones)"
                ));
            }
        };
        Ok(Self { roots, identity, http: Arc::new(http) })
    }

    /// The configuration of the OTLP/gRPC channel (tonic). Always given, since
    /// opentelemetry-otlp's own for an `https://` endpoint trusts no root at all.
    fn grpc(&self) -> opentelemetry_otlp::tonic_types::transport::ClientTlsConfig {
        use opentelemetry_otlp::tonic_types::transport::{ClientTlsConfig, Identity};
        let config = ClientTlsConfig::new().trust_anchors(self.roots.roots.iter().cloned());
        match &self.identity {
            Some(identity) => config.identity(Identity::from_pem(&identity.certificate_pem, &identity.key_pem)),
            None => config,
        }
    }

    /// The OTLP/HTTP client: hyper with rustls, HTTP/1.1, `http://` or `https://`, each
    /// request bounded by `timeout`.
    fn http_client(&self, timeout: Duration) -> impl opentelemetry_http::HttpClient + 'static {
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(rustls::ClientConfig::clone(&self.http))
            .https_or_http()
            .enable_http1()
            .build();
        opentelemetry_http::hyper::HyperClient::new(connector, timeout, None)
    }
}

/// The time one export may take: `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`, else
/// `OTEL_EXPORTER_OTLP_TIMEOUT`, in milliseconds, else 10 s (OTLP Exporter Configuration).
/// opentelemetry-otlp bounds an export and its retries by the same variables; this bounds
/// each HTTP request of it, which the HTTP client given to it must do itself.
fn export_timeout(read: impl Fn(&str) -> Option<String>) -> Duration {
    ["OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"]
        .into_iter()
        .find_map(|name| read(name)?.trim().parse::<u64>().ok())
        .map_or(Duration::from_secs(10), Duration::from_millis)
}

/// The tracer provider exporting over OTLP with `protocol` (batched, on the tokio runtime:
/// call it inside one). The endpoint, headers, compression and timeout are read from the
/// environment by opentelemetry-otlp.
///
/// # Errors
/// When the exporter cannot be built from the environment (a malformed endpoint, say).
fn otlp_provider(
    protocol: TraceProtocol,
    tls: &CollectorTls,
) -> Result<SdkTracerProvider, opentelemetry_otlp::ExporterBuildError> {
    let exporter = match protocol {
        TraceProtocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_protocol(opentelemetry_otlp::Protocol::Grpc)
            .with_tls_config(tls.grpc())
            .build()?,
        TraceProtocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_http_client(tls.http_client(export_timeout(variable)))
            .build()?,
    };
    let mut resource = opentelemetry_sdk::Resource::builder();
    if variable("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("payledger");
    }
    // The batch processor on the tokio runtime: both exporters need its reactor (the default
    // processor's own thread has none).
    let processor = opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
        exporter,
        opentelemetry_sdk::runtime::Tokio,
    )
    .build();
    Ok(SdkTracerProvider::builder().with_span_processor(processor).with_resource(resource.build()).build())
}

/// Which OpenTelemetry RPC conventions the server span of each call follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RpcConventions {
    /// The stable ones (semantic conventions v1.45.0): `rpc.system.name`, `rpc.method`
    /// fully qualified, `rpc.status_code` as a name, `error.type`.
    Stable,
    /// The stable ones and the attributes payledger emitted before them (v1.37.0 and
    /// earlier): `rpc.system`, `rpc.service`, `rpc.grpc.status_code` (a number). `rpc.method`
    /// has one value: the stable, fully qualified one.
    StableAndOld,
}

impl RpcConventions {
    /// `OTEL_SEMCONV_STABILITY_OPT_IN` (a comma-separated list): `rpc/dup` asks for both,
    /// anything else (`rpc`, unset) for the stable ones alone. The RPC conventions' migration
    /// guide keeps the old ones the default of an instrumentation that emitted them; payledger
    /// 0.x moves to the stable ones by default, with `rpc/dup` for dashboards that still read
    /// the old ones (see `docs/operations.md`, "Upgrade notes: span attributes").
    pub fn from_env() -> Self {
        Self::parse(variable("OTEL_SEMCONV_STABILITY_OPT_IN").as_deref())
    }

    fn parse(value: Option<&str>) -> Self {
        let duplicate = value.is_some_and(|list| list.split(',').any(|item| item.trim() == "rpc/dup"));
        if duplicate {
            Self::StableAndOld
        } else {
            Self::Stable
        }
    }
}

/// Directives added to every `--log-filter`: sqlx's URL parsers log each connect parameter
/// they do not know with its value (`sslpassword=...`), which may be a secret.
const SECRET_SAFE_DIRECTIVES: &str = "sqlx_postgres::options=off,sqlx_mysql::options=off";

/// The log filter of `settings`, with [`SECRET_SAFE_DIRECTIVES`].
///
/// # Errors
/// A message naming `--log-filter` when it is not EnvFilter syntax.
pub fn log_filter(settings: &LogSettings) -> Result<EnvFilter, String> {
    EnvFilter::try_new(format!("{},{SECRET_SAFE_DIRECTIVES}", settings.log_filter))
        .map_err(|error| format!("--log-filter {:?} is not a tracing filter: {error}", settings.log_filter))
}

/// Installs the global subscriber: the log lines on stderr and, when the environment asks
/// for it, OpenTelemetry traces. Does nothing if a subscriber is installed. W3C trace context
/// is the global propagator either way (what `payledger_client` injects).
///
/// # Errors
/// An invalid `--log-filter`, or traces asked for with a certificate variable whose file
/// cannot be used (the message names the variable and the path); nothing is installed then.
/// An exporter that cannot be built otherwise (a malformed endpoint, say) leaves traces off
/// with a line on stderr.
pub fn init(settings: &LogSettings) -> Result<Telemetry, String> {
    let filter = log_filter(settings)?;
    opentelemetry::global::set_text_map_propagator(opentelemetry_sdk::propagation::TraceContextPropagator::new());
    let tracer_provider = match traces_requested() {
        Some(protocol) => {
            let tls = CollectorTls::from_variables(variable).map_err(|reason| format!("traces: {reason}"))?;
            match otlp_provider(protocol, &tls) {
                Ok(provider) => Some((protocol, provider)),
                Err(error) => {
                    eprintln!("payledger: traces off, the OTLP exporter cannot be built: {error}");
                    None
                }
            }
        }
        None => None,
    };
    install(settings, filter, tracer_provider.as_ref().map(|(_, provider)| provider));
    if let Some((protocol, provider)) = &tracer_provider {
        opentelemetry::global::set_tracer_provider(provider.clone());
        let _ = TRACES_EXPORTED.set(*protocol);
    }
    Ok(Telemetry { tracer_provider: tracer_provider.map(|(_, provider)| provider) })
}

/// The subscriber: fmt filtered by `--log-filter`; the OpenTelemetry layer (when there is a
/// provider) sees every `info` span, whatever the log filter.
fn install(settings: &LogSettings, filter: EnvFilter, provider: Option<&SdkTracerProvider>) {
    // Colours only on a terminal: redirected logs stay greppable.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(ansi);
    let fmt = match settings.log_format {
        LogFormat::Text => fmt.boxed(),
        LogFormat::Json => fmt.json().with_current_span(true).boxed(),
    };
    let otel = provider.map(|provider| {
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer(TRACER_NAME))
            .with_filter(tracing_subscriber::filter::LevelFilter::INFO)
    });
    let _already_installed = tracing_subscriber::registry().with(fmt.with_filter(filter)).with(otel).try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(filter: &str) -> LogSettings {
        LogSettings { log_format: LogFormat::Text, log_filter: filter.to_owned() }
    }

    /// An environment of the given variables alone.
    fn environment(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> =
            pairs.iter().map(|(name, value)| ((*name).to_owned(), (*value).to_owned())).collect();
        move |name: &str| {
            pairs.iter().find(|(key, value)| key == name && !value.trim().is_empty()).map(|(_, value)| value.clone())
        }
    }

    #[test]
    fn the_traces_protocol_variable_wins_and_grpc_is_the_default() {
        let protocol = |pairs: &[(&str, &str)]| TraceProtocol::from_variables(environment(pairs));
        assert_eq!(protocol(&[]), Ok(TraceProtocol::Grpc));
        assert_eq!(protocol(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "")]), Ok(TraceProtocol::Grpc));
        assert_eq!(protocol(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")]), Ok(TraceProtocol::HttpProtobuf));
        assert_eq!(protocol(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "GRPC")]), Ok(TraceProtocol::Grpc));
        let both = [("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"), ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")];
        assert_eq!(protocol(&both), Ok(TraceProtocol::Grpc));
        let refused = protocol(&[("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")]).unwrap_err();
        assert!(refused.contains("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") && refused.contains("http/json"), "{refused}");
    }

    #[test]
    fn rpc_dup_in_the_opt_in_list_adds_the_old_rpc_attributes() {
        assert_eq!(RpcConventions::parse(None), RpcConventions::Stable);
        assert_eq!(RpcConventions::parse(Some("rpc")), RpcConventions::Stable);
        assert_eq!(RpcConventions::parse(Some("http, rpc/dup")), RpcConventions::StableAndOld);
        assert_eq!(RpcConventions::parse(Some("rpc,rpc/dup")), RpcConventions::StableAndOld);
        assert_eq!(RpcConventions::parse(Some("http/dup")), RpcConventions::Stable);
    }

    #[test]
    fn the_export_timeout_is_read_in_milliseconds_the_traces_variable_first() {
        assert_eq!(export_timeout(environment(&[])), Duration::from_secs(10));
        assert_eq!(export_timeout(environment(&[("OTEL_EXPORTER_OTLP_TIMEOUT", "2500")])), Duration::from_millis(2500));
        let both = [("OTEL_EXPORTER_OTLP_TIMEOUT", "2500"), ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "700")];
        assert_eq!(export_timeout(environment(&both)), Duration::from_millis(700));
    }

    /// A CA, and a client certificate and key it issued, as PEM.
    fn pki() -> (String, String, String) {
        use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let key = KeyPair::generate().unwrap();
        let client = CertificateParams::new(vec!["payledger".to_owned()]).unwrap().signed_by(&key, &ca).unwrap();
        (ca.pem(), client.pem(), key.serialize_pem())
    }

    #[test]
    fn certificate_files_that_cannot_be_used_are_refused_naming_the_variable_and_path() {
        let directory = tempfile::tempdir().unwrap();
        let (ca, client, key) = pki();
        let write = |name: &str, text: &str| {
            let path = directory.path().join(name);
            std::fs::write(&path, text).unwrap();
            path.display().to_string()
        };
        let (ca, client, key) = (write("ca.pem", &ca), write("client.pem", &client), write("client.key", &key));
        let (garbage, absent) = (write("garbage.pem", "not a certificate"), directory.path().join("absent.pem"));
        let absent = absent.display().to_string();
        let tls = |pairs: &[(&str, &str)]| CollectorTls::from_variables(environment(pairs));

        let private = tls(&[("OTEL_EXPORTER_OTLP_CERTIFICATE", ca.as_str())]).unwrap();
        assert_eq!(private.roots.len(), 1, "the file's CA alone, not the public roots too");
        assert!(tls(&[]).unwrap().roots.len() > 100, "without the variable: the public web roots");
        let mutual = [
            ("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", ca.as_str()),
            ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", client.as_str()),
            ("OTEL_EXPORTER_OTLP_CLIENT_KEY", key.as_str()),
        ];
        assert!(tls(&mutual).is_ok_and(|tls| tls.identity.is_some()));

        for (pairs, named) in [
            (vec![("OTEL_EXPORTER_OTLP_CERTIFICATE", absent.as_str())], "OTEL_EXPORTER_OTLP_CERTIFICATE"),
            (
                vec![
                    ("OTEL_EXPORTER_OTLP_CERTIFICATE", ca.as_str()),
                    ("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", garbage.as_str()),
                ],
                "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
            ),
            (vec![("OTEL_EXPORTER_OTLP_CERTIFICATE", key.as_str())], "OTEL_EXPORTER_OTLP_CERTIFICATE"),
            (
                vec![
                    ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", client.as_str()),
                    ("OTEL_EXPORTER_OTLP_CLIENT_KEY", ca.as_str()),
                ],
                "OTEL_EXPORTER_OTLP_CLIENT_KEY",
            ),
            (vec![("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", client.as_str())], "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"),
        ] {
            let refused = tls(&pairs).err().unwrap_or_else(|| panic!("{pairs:?} is accepted"));
            assert!(refused.contains(named), "{refused}");
            let key_text = std::fs::read_to_string(&key).unwrap();
            assert!(!refused.contains(key_text.lines().nth(1).unwrap()), "no key material: {refused}");
        }
        let refused = tls(&[("OTEL_EXPORTER_OTLP_CERTIFICATE", garbage.as_str())]).err().unwrap();
        assert!(refused.contains(&garbage), "the path: {refused}");
    }

    #[test]
    fn a_bad_filter_is_refused_and_url_parsers_never_log() {
        assert!(log_filter(&settings("info,payledger::access=offf")).unwrap_err().contains("--log-filter"));
        let filter = log_filter(&settings("trace")).unwrap().to_string();
        assert!(filter.contains("sqlx_postgres::options=off"), "{filter}");
        assert!(filter.contains("sqlx_mysql::options=off"), "{filter}");
    }
}
