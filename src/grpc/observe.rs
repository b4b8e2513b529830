//! The outermost layer of the gRPC services, around every one of them, and so around every
//! HTTP/JSON call too (the gateway calls the RPC through it, see [`crate::http`]): one span
//! per RPC (OpenTelemetry semantic conventions for RPC and gRPC, stable since v1.45.0; child of
//! the caller's W3C `traceparent`), the per-RPC metrics, one log line per call (a call the
//! client cancelled too), the caller's deadline and presence for the use case, and the
//! statuses tonic itself answers in its own words (a message over the size limit, a malformed
//! frame).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use opentelemetry::propagation::TextMapPropagator as _;
use opentelemetry::trace::TraceContextExt as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tonic::body::Body;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt as _};
use tower::{Layer, Service};
use tracing::field::Empty;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use crate::error::{ERROR_DOMAIN, RETRY_PUSHBACK_HEADER};
use crate::ledger::CallerPresence;
use crate::metrics::{CallLabels, MethodLabels, RpcMetrics};
use crate::telemetry::RpcConventions;

/// The log target of the per-call line: `--log-filter info,payledger::access=off` turns it
/// off.
pub const ACCESS_LOG_TARGET: &str = "payledger::access";

/// The outermost layer of the gRPC services (see the module docs).
#[derive(Clone)]
pub struct Observe {
    rpc: RpcMetrics,
    conventions: RpcConventions,
}

impl Observe {
    /// Starts the metrics of every RPC the server serves at 0; the spans follow the RPC
    /// conventions `OTEL_SEMCONV_STABILITY_OPT_IN` asks for ([`RpcConventions::from_env`]).
    pub fn new(rpc: RpcMetrics) -> Self {
        for method in KNOWN_METHODS {
            if is_platform(method) {
                rpc.know_platform(method);
            } else {
                rpc.know(method);
            }
        }
        Self { rpc, conventions: RpcConventions::from_env() }
    }
}

impl<S> Layer<S> for Observe {
    type Service = Observed<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Observed { inner, observe: self.clone() }
    }
}

/// The service made by [`Observe`].
#[derive(Clone)]
pub struct Observed<S> {
    inner: S,
    observe: Observe,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S> Service<http::Request<Body>> for Observed<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, context: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(context)
    }

    fn call(&mut self, mut request: http::Request<Body>) -> Self::Future {
        let started = Instant::now();
        let labels = method_labels(request.uri().path());
        let span = rpc_span(&request, labels, self.observe.conventions);
        let deadline = request.headers().get("grpc-timeout").and_then(grpc_timeout).map(|timeout| started + timeout);
        let (presence, call_guard) = CallerPresence::new(deadline);
        request.extensions_mut().insert(presence);
        let future = span.in_scope(|| self.inner.call(request));
        let mut call = Call::start(self.observe.rpc.clone(), span, labels, started, self.observe.conventions);
        Box::pin(async move {
            let _presence = call_guard;
            let answered = tracing::Instrument::instrument(future, call.span.clone());
            let result = match deadline {
                Some(deadline) => {
                    let expiry = deadline.checked_sub(DEADLINE_MARGIN).unwrap_or(deadline);
                    tokio::time::timeout_at(expiry.into(), answered).await.unwrap_or_else(|_| Ok(deadline_passed()))
                }
                None => answered.await,
            };
            result.map(|response| {
                let response = reword(response);
                call.finish(response_code(&response), is_replayed(&response));
                response
            })
        })
    }
}

/// How much before the caller's deadline (`grpc-timeout`) a call still unanswered is answered
/// DEADLINE_EXCEEDED: tonic's own timer for the same deadline, around this layer (started a
/// moment after this layer's call), answers CANCELLED ("Timeout expired"), which a gRPC client
/// does not retry (gRFC A6 retries the codes its service config lists; payledger's lists
/// DEADLINE_EXCEEDED). One timer tick (tokio's timers fire on whole milliseconds) before it,
/// this layer's answer comes first; in one tick tonic polls this layer before its own timer.
const DEADLINE_MARGIN: Duration = Duration::from_millis(1);

/// The answer to a call whose deadline passed before its use case answered: DEADLINE_EXCEEDED
/// (ErrorInfo `DEADLINE_PASSED`). Its write may or may not have committed, as with any call
/// without an answer: the same request (and key) again is answered once, by the original
/// when it committed.
fn deadline_passed() -> http::Response<Body> {
    let mut details = ErrorDetails::new();
    details.set_error_info("DEADLINE_PASSED", ERROR_DOMAIN, HashMap::new());
    let message = "the call's deadline (grpc-timeout) passed before its answer; it may have been written: \
                   send the same request (and key) again";
    Status::with_error_details(Code::DeadlineExceeded, message, details).into_http()
}

/// One call between its request's headers and its response's: in flight until then; counted
/// and logged once, with its code, or as CANCELLED when hyper drops it first (the client
/// cancelled, its deadline passed, or the connection closed).
struct Call {
    rpc: RpcMetrics,
    span: tracing::Span,
    labels: MethodLabels,
    started: Instant,
    conventions: RpcConventions,
    finished: bool,
}

impl Call {
    fn start(
        rpc: RpcMetrics,
        span: tracing::Span,
        labels: MethodLabels,
        started: Instant,
        conventions: RpcConventions,
    ) -> Self {
        if !is_platform(labels) {
            rpc.in_flight.get_or_create(&labels).inc();
        }
        Self { rpc, span, labels, started, conventions, finished: false }
    }

    /// Counts the call, records its code on its span and writes its log line.
    fn finish(&mut self, code: Code, replayed: bool) {
        self.finished = true;
        let elapsed = self.started.elapsed();
        let code_name = code_name(code);
        let labels = self.labels;
        let call = CallLabels::new(labels, code_name);
        if is_platform(labels) {
            self.rpc.platform_calls.get_or_create(&call).inc();
        } else {
            self.rpc.in_flight.get_or_create(&labels).dec();
            self.rpc.calls.get_or_create(&call).inc();
            self.rpc.duration.get_or_create(&labels).observe(elapsed.as_secs_f64());
        }
        self.span.record("rpc.status_code", code_name);
        if is_server_error(code) {
            // The conventions' error.type for a status that is an error: the status's name.
            self.span.record("error.type", code_name);
            self.span.record("otel.status_code", "ERROR");
        }
        if self.conventions == RpcConventions::StableAndOld {
            self.span.record("rpc.grpc.status_code", code as i32);
        }
        let duration_ms = elapsed.as_micros() as f64 / 1000.0;
        self.span.in_scope(|| {
            // Health and reflection at debug: a probe every few seconds would fill the log.
            if is_platform(labels) {
                tracing::debug!(target: ACCESS_LOG_TARGET, method = labels.grpc_method, code = code_name, duration_ms, "call");
            } else {
                tracing::info!(
                    target: ACCESS_LOG_TARGET,
                    method = labels.grpc_method,
                    code = code_name,
                    duration_ms,
                    replayed,
                    "call"
                );
            }
        });
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        if !self.finished {
            self.finish(Code::Cancelled, false);
        }
    }
}

fn is_replayed(response: &http::Response<Body>) -> bool {
    response.headers().get(payledger_client::REPLAYED_HEADER).is_some_and(|value| value == "true")
}

/// The labels of `/payledger.v1.PaymentService/Pay`: service `payledger.v1.PaymentService`,
/// method `Pay`, type `unary`. The names are interned: a label value is `&'static str`, and a
/// caller can send any path, so an unknown one is `unknown` rather than a new label value per
/// path.
fn method_labels(path: &str) -> MethodLabels {
    let mut parts = path.trim_start_matches('/').splitn(2, '/');
    let (service, method) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    KNOWN_METHODS
        .into_iter()
        .find(|known| known.grpc_service == service && known.grpc_method == method)
        .unwrap_or(UNKNOWN_METHOD)
}

/// Health and reflection: counted apart from the API (`payledger_rpc_platform_calls_total`).
fn is_platform(method: MethodLabels) -> bool {
    method.grpc_service.starts_with("grpc.")
}

const UNKNOWN_METHOD: MethodLabels =
    MethodLabels { grpc_service: "unknown", grpc_method: "unknown", grpc_type: "unknown" };

const fn rpc(grpc_service: &'static str, grpc_method: &'static str, grpc_type: &'static str) -> MethodLabels {
    MethodLabels { grpc_service, grpc_method, grpc_type }
}

const PAYMENTS: &str = "payledger.v1.PaymentService";
const ACCOUNTS: &str = "payledger.v1.AccountService";
const HEALTH: &str = "grpc.health.v1.Health";

/// Every RPC the server serves, with its streaming kind (a metric label takes one of these,
/// or `unknown`).
const KNOWN_METHODS: [MethodLabels; 20] = [
    rpc(PAYMENTS, "CreateOrder", "unary"),
    rpc(PAYMENTS, "CloseOrder", "unary"),
    rpc(PAYMENTS, "Pay", "unary"),
    rpc(PAYMENTS, "Refund", "unary"),
    rpc(PAYMENTS, "Query", "unary"),
    rpc(PAYMENTS, "IssueToken", "unary"),
    rpc(PAYMENTS, "Authorize", "unary"),
    rpc(PAYMENTS, "Capture", "unary"),
    rpc(PAYMENTS, "Void", "unary"),
    rpc(ACCOUNTS, "OpenAccount", "unary"),
    rpc(ACCOUNTS, "Deposit", "unary"),
    rpc(ACCOUNTS, "Withdraw", "unary"),
    rpc(ACCOUNTS, "Transfer", "unary"),
    rpc(ACCOUNTS, "GetAccount", "unary"),
    rpc(ACCOUNTS, "ListEntries", "unary"),
    rpc(HEALTH, "Check", "unary"),
    rpc(HEALTH, "Watch", "server_stream"),
    rpc(HEALTH, "List", "unary"),
    rpc("grpc.reflection.v1.ServerReflection", "ServerReflectionInfo", "bidi_stream"),
    rpc("grpc.reflection.v1alpha.ServerReflection", "ServerReflectionInfo", "bidi_stream"),
];

/// The most bytes of a path that is no RPC of the server kept in `rpc.method_original`: the
/// path is the caller's to choose.
const METHOD_ORIGINAL_BYTES_MAX: usize = 256;

/// The server span of one RPC, a child of the caller's `traceparent` when it sent one, with
/// the attributes of the OpenTelemetry semantic conventions for gRPC server spans (v1.45.0):
/// `rpc.system.name`, `rpc.method` (`payledger.v1.PaymentService/Pay`; `_OTHER` with
/// `rpc.method_original` for a path that is no RPC of the server), `server.address` and
/// `server.port` (from the request's `:authority`), `network.peer.address` and
/// `network.peer.port`; [`Call::finish`] adds `rpc.status_code` and `error.type`. With
/// [`RpcConventions::StableAndOld`], also the v1.37.0 ones: `rpc.system`, `rpc.service`
/// and `rpc.grpc.status_code`. The span is named after `rpc.method`. `merchant_id` and `sub`
/// are recorded by the handler once known.
fn rpc_span(request: &http::Request<Body>, labels: MethodLabels, conventions: RpcConventions) -> tracing::Span {
    let known = labels != UNKNOWN_METHOD;
    // From the known names only: the path is the caller's to choose.
    let method = if known { format!("{}/{}", labels.grpc_service, labels.grpc_method) } else { "_OTHER".to_owned() };
    // The ledger's RPCs at info (exported as traces); health probes, reflection and unknown
    // paths at debug, so that a load balancer's probe every few seconds is no trace.
    macro_rules! rpc_span {
        ($level:expr) => {
            tracing::span!(
                $level,
                "rpc",
                otel.name = method.as_str(),
                otel.kind = "server",
                otel.status_code = Empty,
                rpc.system.name = "grpc",
                rpc.method = method.as_str(),
                rpc.method_original = Empty,
                rpc.status_code = Empty,
                "error.type" = Empty,
                server.address = Empty,
                server.port = Empty,
                network.peer.address = Empty,
                network.peer.port = Empty,
                rpc.system = Empty,
                rpc.service = Empty,
                rpc.grpc.status_code = Empty,
                merchant_id = Empty,
                sub = Empty,
                trace_id = Empty,
            )
        };
    }
    let span = if labels.grpc_service.starts_with("payledger.") {
        rpc_span!(tracing::Level::INFO)
    } else {
        rpc_span!(tracing::Level::DEBUG)
    };
    if !known {
        let path = request.uri().path().trim_start_matches('/');
        let mut end = path.len().min(METHOD_ORIGINAL_BYTES_MAX);
        while !path.is_char_boundary(end) {
            end -= 1;
        }
        span.record("rpc.method_original", &path[..end]);
    }
    if let Some(authority) = request.uri().authority() {
        span.record("server.address", authority.host());
        if let Some(port) = authority.port_u16() {
            span.record("server.port", i64::from(port));
        }
    }
    if let Some(peer) = peer_address(request) {
        span.record("network.peer.address", tracing::field::display(peer.ip()));
        span.record("network.peer.port", i64::from(peer.port()));
    }
    if conventions == RpcConventions::StableAndOld {
        span.record("rpc.system", "grpc");
        span.record("rpc.service", labels.grpc_service);
    }
    let parent = TraceContextPropagator::new().extract(&HeaderExtractor(request.headers()));
    let remote = parent.span().span_context().clone();
    if remote.is_valid() {
        // Fails only without the OpenTelemetry layer (traces off): the trace id is still
        // logged below.
        let _ = span.set_parent(parent);
    }
    let own = span.context().span().span_context().trace_id();
    let trace_id = if own != opentelemetry::trace::TraceId::INVALID { own } else { remote.trace_id() };
    if trace_id != opentelemetry::trace::TraceId::INVALID {
        span.record("trace_id", tracing::field::display(trace_id));
    }
    span
}

/// The caller's end of the connection, as tonic records it on each request (over TCP, with
/// or without TLS).
fn peer_address(request: &http::Request<Body>) -> Option<std::net::SocketAddr> {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    let extensions = request.extensions();
    extensions
        .get::<TcpConnectInfo>()
        .and_then(TcpConnectInfo::remote_addr)
        .or_else(|| extensions.get::<TlsConnectInfo<TcpConnectInfo>>().and_then(|info| info.get_ref().remote_addr()))
}

/// Reads W3C trace context headers from an HTTP header map.
struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl opentelemetry::propagation::Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

/// The gRPC code of a response: its `grpc-status` header (a trailers-only response, which is
/// how every error is sent), else OK (a unary answer whose status follows in the trailers).
fn response_code(response: &http::Response<Body>) -> Code {
    response.headers().get("grpc-status").map_or(Code::Ok, |value| Code::from_bytes(value.as_bytes()))
}

/// The statuses tonic answers itself, before a handler runs, in gRPC's own terms:
/// - a request message over the size limit (tonic: OUT_OF_RANGE) is RESOURCE_EXHAUSTED,
///   ErrorInfo reason MESSAGE_TOO_LARGE, with `grpc-retry-pushback-ms: -1`: a negative
///   pushback asks the client not to retry at all (gRFC A6), since the same message would be
///   refused again, where a retry policy that goes by code would retry RESOURCE_EXHAUSTED;
/// - a request whose framing is broken (no message, a truncated frame, a compressed frame
///   without `grpc-encoding`; tonic: INTERNAL) is INVALID_ARGUMENT, MALFORMED_REQUEST.
///
/// payledger's own errors are never OUT_OF_RANGE, and every one carries its ErrorInfo in
/// `grpc-status-details-bin`: an INTERNAL without details is tonic's.
fn reword(response: http::Response<Body>) -> http::Response<Body> {
    let (code, reason) = match response_code(&response) {
        Code::OutOfRange => (Code::ResourceExhausted, "MESSAGE_TOO_LARGE"),
        Code::Internal if !response.headers().contains_key("grpc-status-details-bin") => {
            (Code::InvalidArgument, "MALFORMED_REQUEST")
        }
        _ => return response,
    };
    let mut details = ErrorDetails::new();
    details.set_error_info(reason, ERROR_DOMAIN, HashMap::new());
    let message = Status::from_header_map(response.headers()).map(|status| status.message().to_owned());
    let mut response =
        Status::with_error_details(code, message.unwrap_or_else(|| "the request cannot be read".to_owned()), details)
            .into_http();
    if code == Code::ResourceExhausted {
        response.headers_mut().insert(RETRY_PUSHBACK_HEADER, http::HeaderValue::from_static("-1"));
    }
    response
}

/// The codes the OpenTelemetry semantic conventions for gRPC (v1.45.0, `rpc.status_code` on
/// server spans) count as a server span's error, and so its status Error and its `error.type`
/// (the rest are the caller's: bad input, not found, refused...).
fn is_server_error(code: Code) -> bool {
    matches!(
        code,
        Code::Unknown
            | Code::DeadlineExceeded
            | Code::Unimplemented
            | Code::Internal
            | Code::Unavailable
            | Code::DataLoss
    )
}

/// The canonical name of a gRPC status code (gRPC's `doc/statuscodes.md`).
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// `grpc-timeout` (gRPC over HTTP/2: at most 8 digits and a unit, H M S m u n).
fn grpc_timeout(value: &http::HeaderValue) -> Option<Duration> {
    let text = value.to_str().ok()?;
    if text.len() < 2 || text.len() > 9 {
        return None;
    }
    let (digits, unit) = text.split_at(text.len() - 1);
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount.checked_mul(3600)?),
        "M" => Duration::from_secs(amount.checked_mul(60)?),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

/// Records the call's merchant on its span (and so on its log line and trace).
pub(super) fn record_merchant(merchant_id: &str) {
    tracing::Span::current().record("merchant_id", merchant_id);
}

/// Records the authenticated caller's `sub` on the call's span.
pub(super) fn record_caller(sub: &str) {
    tracing::Span::current().record("sub", sub);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_reads_every_unit_and_refuses_the_rest() {
        let parse = |text: &str| grpc_timeout(&http::HeaderValue::from_str(text).unwrap());
        assert_eq!(parse("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse("2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse("3S"), Some(Duration::from_secs(3)));
        assert_eq!(parse("2999m"), Some(Duration::from_millis(2999)));
        assert_eq!(parse("5u"), Some(Duration::from_micros(5)));
        assert_eq!(parse("99999999n"), Some(Duration::from_nanos(99_999_999)));
        for bad in ["", "m", "123456789m", "10x", "-1S", "1.5S", "S1"] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    /// The fields of every span closed while it is the thread's subscriber, by span.
    #[derive(Clone, Default)]
    struct Recorded(std::sync::Arc<std::sync::Mutex<Vec<HashMap<String, String>>>>);

    struct Fields(HashMap<String, String>);

    impl tracing::field::Visit for Fields {
        fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
            self.0.insert(field.name().to_owned(), value.to_owned());
        }

        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            self.0.insert(field.name().to_owned(), format!("{value:?}"));
        }
    }

    impl<S> tracing_subscriber::Layer<S> for Recorded
    where
        S: tracing::Subscriber + for<'lookup> tracing_subscriber::registry::LookupSpan<'lookup>,
    {
        fn on_new_span(
            &self,
            attributes: &tracing::span::Attributes<'_>,
            id: &tracing::span::Id,
            context: tracing_subscriber::layer::Context<'_, S>,
        ) {
            let mut fields = Fields(HashMap::new());
            attributes.record(&mut fields);
            context.span(id).unwrap().extensions_mut().insert(fields);
        }

        fn on_record(
            &self,
            id: &tracing::span::Id,
            values: &tracing::span::Record<'_>,
            context: tracing_subscriber::layer::Context<'_, S>,
        ) {
            if let Some(fields) = context.span(id).unwrap().extensions_mut().get_mut::<Fields>() {
                values.record(fields);
            }
        }

        fn on_close(&self, id: tracing::span::Id, context: tracing_subscriber::layer::Context<'_, S>) {
            if let Some(fields) = context.span(&id).unwrap().extensions_mut().remove::<Fields>() {
                self.0.lock().unwrap().push(fields.0);
            }
        }
    }

    /// The span fields of one call through [`Observe`] to a service that answers `code`.
    async fn call_fields(conventions: RpcConventions, uri: &str, code: Code) -> HashMap<String, String> {
        use tower::ServiceExt as _;
        use tracing_subscriber::layer::SubscriberExt as _;
        let recorded = Recorded::default();
        let _subscriber = tracing::subscriber::set_default(tracing_subscriber::registry().with(recorded.clone()));
        let answering = tower::service_fn(move |_: http::Request<Body>| async move {
            Ok::<_, std::convert::Infallible>(Status::new(code, "answered").into_http())
        });
        let observe = Observe { rpc: RpcMetrics::default(), conventions };
        let request = http::Request::builder().method("POST").uri(uri).body(Body::empty()).unwrap();
        observe.layer(answering).oneshot(request).await.unwrap();
        let spans = recorded.0.lock().unwrap().clone();
        spans.into_iter().find(|fields| fields.contains_key("rpc.method")).expect("the call's span")
    }

    #[tokio::test]
    async fn the_server_span_follows_the_grpc_conventions_and_rpc_dup_adds_the_old_attributes() {
        let pay = "http://ledger.example:50051/payledger.v1.PaymentService/Pay";
        let unavailable = call_fields(RpcConventions::Stable, pay, Code::Unavailable).await;
        let field = |fields: &HashMap<String, String>, name: &str| fields.get(name).cloned();
        assert_eq!(field(&unavailable, "rpc.system.name").as_deref(), Some("grpc"));
        assert_eq!(field(&unavailable, "rpc.method").as_deref(), Some("payledger.v1.PaymentService/Pay"));
        assert_eq!(field(&unavailable, "otel.name").as_deref(), Some("payledger.v1.PaymentService/Pay"));
        assert_eq!(field(&unavailable, "rpc.status_code").as_deref(), Some("UNAVAILABLE"));
        assert_eq!(field(&unavailable, "error.type").as_deref(), Some("UNAVAILABLE"), "a server error");
        assert_eq!(field(&unavailable, "otel.status_code").as_deref(), Some("ERROR"));
        assert_eq!(field(&unavailable, "server.address").as_deref(), Some("ledger.example"));
        assert_eq!(field(&unavailable, "server.port").as_deref(), Some("50051"));
        for old in ["rpc.system", "rpc.service", "rpc.grpc.status_code", "rpc.method_original"] {
            assert_eq!(field(&unavailable, old), None, "{old}");
        }

        let refused = call_fields(RpcConventions::StableAndOld, pay, Code::FailedPrecondition).await;
        assert_eq!(field(&refused, "rpc.status_code").as_deref(), Some("FAILED_PRECONDITION"));
        assert_eq!(field(&refused, "error.type"), None, "the caller's error");
        assert_eq!(field(&refused, "otel.status_code"), None);
        assert_eq!(field(&refused, "rpc.method").as_deref(), Some("payledger.v1.PaymentService/Pay"), "stable");
        assert_eq!(field(&refused, "rpc.system").as_deref(), Some("grpc"));
        assert_eq!(field(&refused, "rpc.service").as_deref(), Some("payledger.v1.PaymentService"));
        assert_eq!(field(&refused, "rpc.grpc.status_code").as_deref(), Some("9"));

        let unknown =
            call_fields(RpcConventions::Stable, "/payledger.v1.PaymentService/Nope", Code::Unimplemented).await;
        assert_eq!(field(&unknown, "rpc.method").as_deref(), Some("_OTHER"));
        assert_eq!(field(&unknown, "rpc.method_original").as_deref(), Some("payledger.v1.PaymentService/Nope"));
        assert_eq!(field(&unknown, "error.type").as_deref(), Some("UNIMPLEMENTED"));
        assert_eq!(field(&unknown, "server.address"), None, "no :authority");
    }

    #[test]
    fn exactly_the_server_errors_of_the_grpc_conventions_are_errors() {
        let errors: Vec<&str> = (0..=16).map(Code::from).filter(|code| is_server_error(*code)).map(code_name).collect();
        assert_eq!(errors, ["UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"]);
    }

    #[test]
    fn paths_become_bounded_label_values() {
        assert_eq!(method_labels("/payledger.v1.PaymentService/Pay"), rpc(PAYMENTS, "Pay", "unary"));
        assert_eq!(method_labels("/grpc.health.v1.Health/Watch"), rpc(HEALTH, "Watch", "server_stream"));
        assert_eq!(method_labels("/payledger.v1.PaymentService/Nope"), UNKNOWN_METHOD);
        assert_eq!(method_labels("/x/y/z"), UNKNOWN_METHOD);
        assert_eq!(method_labels(""), UNKNOWN_METHOD);
        assert!(is_platform(method_labels("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo")));
        assert!(!is_platform(UNKNOWN_METHOD));
    }
}
