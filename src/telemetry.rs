//! Logs and traces. Tests do not call [`init`], so they stay silent.
//!
//! Logs go to stderr, filtered by `--log-filter`. Traces go to an OpenTelemetry collector
//! over OTLP/gRPC, and only when the standard variables ask for it (OpenTelemetry
//! "Environment Variable Specification"): `OTEL_EXPORTER_OTLP_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` turns them on; `OTEL_SERVICE_NAME` (default
//! `payledger`), `OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG` are honoured; `OTEL_SDK_DISABLED=true`
//! turns them off again.

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

/// True when the environment asks for OTLP trace export.
fn traces_requested() -> bool {
    let set = |name: &str| std::env::var(name).is_ok_and(|value| !value.trim().is_empty());
    let disabled = std::env::var("OTEL_SDK_DISABLED").is_ok_and(|value| value.eq_ignore_ascii_case("true"));
    !disabled && (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
}

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

/// Installs the global subscriber: the log lines on stderr and, when the environment asks
/// for it, OpenTelemetry traces. Does nothing if a subscriber is installed. W3C trace context
/// is the global propagator either way (what `payledger_client` injects).
pub fn init(settings: &LogSettings) -> Telemetry {
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
    install(settings, tracer_provider.as_ref());
    if let Some(provider) = &tracer_provider {
        opentelemetry::global::set_tracer_provider(provider.clone());
    }
    Telemetry { tracer_provider }
}

/// The subscriber: fmt filtered by `--log-filter`; the OpenTelemetry layer (when there is a
/// provider) sees every `info` span, whatever the log filter.
fn install(settings: &LogSettings, provider: Option<&SdkTracerProvider>) {
    let filter = EnvFilter::try_new(&settings.log_filter).unwrap_or_else(|_| EnvFilter::new("info"));
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
