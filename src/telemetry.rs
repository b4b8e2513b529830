//! Logs and traces. Tests do not call [`init`], so they stay silent.
//!
//! Logs go to stderr, filtered by `--log-filter`. Traces go to an OpenTelemetry collector
//! over OTLP/gRPC (`http://`, or `https://` verified against the public web roots), and only
//! when the standard variables ask for it (OpenTelemetry "Environment Variable
//! Specification"): `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`
//! turns them on; `OTEL_SERVICE_NAME` (default `payledger`), `OTEL_TRACES_SAMPLER` and
//! `OTEL_TRACES_SAMPLER_ARG` are honoured; `OTEL_SDK_DISABLED=true` turns them off again. An
//! `OTEL_EXPORTER_OTLP_PROTOCOL` other than `grpc` leaves them off, and says so.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
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

/// True when the environment asks for OTLP trace export (over gRPC, the one protocol built
/// in: another `OTEL_EXPORTER_OTLP_*PROTOCOL` is reported and leaves traces off).
fn traces_requested() -> bool {
    let set = |name: &str| std::env::var(name).is_ok_and(|value| !value.trim().is_empty());
    let disabled = std::env::var("OTEL_SDK_DISABLED").is_ok_and(|value| value.eq_ignore_ascii_case("true"));
    if disabled || !(set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")) {
        return false;
    }
    for variable in ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"] {
        if let Ok(protocol) = std::env::var(variable) {
            if protocol.trim() != "grpc" {
                eprintln!(
                    "payledger: traces off: {variable}={protocol:?}, and only OTLP over gRPC (`grpc`) is built in"
                );
                return false;
            }
            break;
        }
    }
    true
}

/// Whether traces are exported, for the start-up line.
pub fn traces_on() -> bool {
    TRACES_ON.load(std::sync::atomic::Ordering::Relaxed)
}

static TRACES_ON: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The tracer provider exporting over OTLP/gRPC (batched, on the tokio runtime: call it
/// inside one).
///
/// # Errors
/// When the exporter cannot be built from the environment (a malformed endpoint, say).
fn otlp_provider() -> Result<SdkTracerProvider, opentelemetry_otlp::ExporterBuildError> {
    let exporter = opentelemetry_otlp::SpanExporter::builder().with_tonic().build()?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var("OTEL_SERVICE_NAME").is_err() {
        resource = resource.with_service_name("payledger");
    }
    // The batch processor on the tokio runtime: the tonic exporter needs its reactor (the
    // default processor's own thread has none).
    let processor = opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
        exporter,
        opentelemetry_sdk::runtime::Tokio,
    )
    .build();
    Ok(SdkTracerProvider::builder().with_span_processor(processor).with_resource(resource.build()).build())
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
/// An invalid `--log-filter` (nothing is installed then).
pub fn init(settings: &LogSettings) -> Result<Telemetry, String> {
    let filter = log_filter(settings)?;
    opentelemetry::global::set_text_map_propagator(opentelemetry_sdk::propagation::TraceContextPropagator::new());
    let tracer_provider = if traces_requested() {
        match otlp_provider() {
            Ok(provider) => Some(provider),
            Err(error) => {
                eprintln!("payledger: traces off, the OTLP exporter cannot be built: {error}");
                None
            }
        }
    } else {
        None
    };
    install(settings, filter, tracer_provider.as_ref());
    if let Some(provider) = &tracer_provider {
        opentelemetry::global::set_tracer_provider(provider.clone());
        TRACES_ON.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    Ok(Telemetry { tracer_provider })
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

    #[test]
    fn a_bad_filter_is_refused_and_url_parsers_never_log() {
        assert!(log_filter(&settings("info,payledger::access=offf")).unwrap_err().contains("--log-filter"));
        let filter = log_filter(&settings("trace")).unwrap().to_string();
        assert!(filter.contains("sqlx_postgres::options=off"), "{filter}");
        assert!(filter.contains("sqlx_mysql::options=off"), "{filter}");
    }
}
