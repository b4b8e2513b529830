//! The retrying client: [`RetryLayer`] (a tower layer usable on any tonic `Channel`) and
//! [`PayledgerClient`], the generated clients behind it. What is retried and how: see the
//! crate documentation.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue};
use http_body_util::{BodyExt, Full};
use retry_policies::policies::ExponentialBackoffTimed;
use retry_policies::{Jitter, RetryDecision, RetryPolicy};
use tonic::body::Body;
#[cfg(feature = "tls")]
use tonic::transport::{Certificate, ClientTlsConfig, Identity};
use tonic::transport::{Channel, Endpoint};

use crate::connections::{Connections, CONNECTIONS_DEFAULT};
use tonic::{Code, Request, Response, Status};
use tower::{Layer, Service, ServiceExt};

use crate::proto;
use crate::proto::account_service_client::AccountServiceClient;
use crate::proto::payment_service_client::PaymentServiceClient;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Request header: how many attempts of this call came before (gRFC A6).
pub const PREVIOUS_ATTEMPTS_HEADER: &str = "grpc-previous-rpc-attempts";
/// Response header: the server asks to wait this many ms before retrying (gRFC A6).
pub const RETRY_PUSHBACK_HEADER: &str = "grpc-retry-pushback-ms";

/// The codes the client retries.
pub const RETRYABLE_CODES: [Code; 4] =
    [Code::Unavailable, Code::Aborted, Code::ResourceExhausted, Code::DeadlineExceeded];

/// How the client retries.
#[derive(Debug, Clone)]
pub struct RetrySettings {
    /// Attempts of one call, the first included.
    pub max_attempts: u32,
    /// Ceiling of the first backoff; each retry doubles it, up to `max_backoff` (full jitter:
    /// the wait is uniform between zero and the ceiling).
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    /// Deadline of one attempt; when it passes, the attempt counts as DEADLINE_EXCEEDED.
    pub per_attempt_timeout: Duration,
    /// Deadline of the whole call, across attempts and backoffs.
    pub overall_deadline: Duration,
    /// Retry throttling (gRFC A6) across every call of one client; `None`: off.
    pub throttling: Option<RetryThrottling>,
}

/// gRFC A6 retry throttling, as `retryThrottling` in `client/service_config.json`: the
/// client keeps `max_tokens` tokens; each attempt answered with a retried code takes one,
/// each other answer gives `token_ratio` back (up to `max_tokens`); while `max_tokens / 2`
/// or fewer remain, no call is retried. During an outage every caller then sends about one
/// attempt per call instead of `max_attempts`, so retries cannot multiply the load.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryThrottling {
    /// Tokens when full (1 to 1000 in A6).
    pub max_tokens: u32,
    /// Tokens given back per answer that is not retried (A6 keeps 3 decimals).
    pub token_ratio: f64,
}

impl Default for RetryThrottling {
    /// `client/service_config.json`'s `retryThrottling`: 100 tokens, ratio 0.1.
    fn default() -> Self {
        Self { max_tokens: 100, token_ratio: 0.1 }
    }
}

/// The token bucket of [`RetryThrottling`], shared by every call of one layer.
#[derive(Debug)]
struct Throttle {
    settings: RetryThrottling,
    /// Thousandths of a token, so that the arithmetic is exact (A6's 3 decimals).
    milli_tokens: Mutex<u64>,
}

impl Throttle {
    fn new(settings: RetryThrottling) -> Self {
        let full = u64::from(settings.max_tokens) * 1000;
        Self { settings, milli_tokens: Mutex::new(full) }
    }

    fn tokens(&self) -> std::sync::MutexGuard<'_, u64> {
        self.milli_tokens.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// An answer with a retried code: one token less. Returns whether a retry is allowed.
    fn failed(&self) -> bool {
        let mut tokens = self.tokens();
        *tokens = tokens.saturating_sub(1000);
        *tokens > u64::from(self.settings.max_tokens) * 1000 / 2
    }

    /// Any other answer: `token_ratio` back.
    fn succeeded(&self) {
        let full = u64::from(self.settings.max_tokens) * 1000;
        let ratio = (self.settings.token_ratio.clamp(0.0, 1000.0) * 1000.0).round() as u64;
        let mut tokens = self.tokens();
        *tokens = (*tokens + ratio).min(full);
    }
}

impl Default for RetrySettings {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(2),
            per_attempt_timeout: Duration::from_secs(3),
            overall_deadline: Duration::from_secs(15),
            throttling: Some(RetryThrottling::default()),
        }
    }
}

/// Attempts and retries made by one client, for callers' metrics.
#[derive(Debug, Default)]
pub struct ClientStats {
    /// Attempts sent, first attempts included (read with `load(Ordering::Relaxed)`).
    pub attempts: AtomicU64,
    /// Attempts that were retries.
    pub retries: AtomicU64,
    /// Retries not made because retry throttling was holding them back.
    pub throttled: AtomicU64,
}

/// The request header of the caller's credential (RFC 6750).
pub const AUTHORIZATION_HEADER: &str = "authorization";

/// A caller's JWT, sent as `authorization: Bearer <JWT>` on every attempt of every call
/// that does not carry its own `authorization`. Clones share one token: replace it before
/// it expires with [`BearerToken::set`]. `Debug` never shows it.
#[derive(Clone, Default)]
pub struct BearerToken(Arc<RwLock<Option<HeaderValue>>>);

impl BearerToken {
    /// # Errors
    /// When `token` holds characters a header value cannot (a JWT never does).
    pub fn new(token: &str) -> Result<Self, http::header::InvalidHeaderValue> {
        let bearer = Self::default();
        bearer.set(token)?;
        Ok(bearer)
    }

    /// Replaces the token for every call from now on.
    ///
    /// # Errors
    /// As [`BearerToken::new`]; the previous token stays.
    pub fn set(&self, token: &str) -> Result<(), http::header::InvalidHeaderValue> {
        let mut value = HeaderValue::try_from(format!("Bearer {token}"))?;
        value.set_sensitive(true);
        *self.0.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(value);
        Ok(())
    }

    fn header(&self) -> Option<HeaderValue> {
        self.0.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

/// As a tonic interceptor, for clients built on a plain `Channel`: adds the token to every
/// request without an `authorization` of its own (nothing when no token is set).
impl tonic::service::Interceptor for BearerToken {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(value) = self.header() {
            if !request.metadata().contains_key(AUTHORIZATION_HEADER) {
                if let Ok(value) = tonic::metadata::MetadataValue::try_from(value.as_bytes()) {
                    request.metadata_mut().insert(AUTHORIZATION_HEADER, value);
                }
            }
        }
        Ok(request)
    }
}

impl std::fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BearerToken(..)")
    }
}

/// The tower layer that retries calls per [`RetrySettings`] (and sends a [`BearerToken`]).
#[derive(Debug, Clone)]
pub struct RetryLayer {
    settings: Arc<RetrySettings>,
    stats: Arc<ClientStats>,
    bearer: Option<BearerToken>,
    throttle: Option<Arc<Throttle>>,
}

impl RetryLayer {
    pub fn new(settings: RetrySettings) -> Self {
        let throttle = settings.throttling.map(|throttling| Arc::new(Throttle::new(throttling)));
        Self { settings: Arc::new(settings), stats: Arc::default(), bearer: None, throttle }
    }

    /// Sends `bearer` on every call.
    pub fn with_bearer_token(mut self, bearer: BearerToken) -> Self {
        self.bearer = Some(bearer);
        self
    }

    pub fn stats(&self) -> Arc<ClientStats> {
        self.stats.clone()
    }
}

impl<S> Layer<S> for RetryLayer {
    type Service = RetryService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RetryService {
            inner,
            settings: self.settings.clone(),
            stats: self.stats.clone(),
            bearer: self.bearer.clone(),
            throttle: self.throttle.clone(),
        }
    }
}

/// The service made by [`RetryLayer`].
#[derive(Debug, Clone)]
pub struct RetryService<S> {
    inner: S,
    settings: Arc<RetrySettings>,
    stats: Arc<ClientStats>,
    bearer: Option<BearerToken>,
    throttle: Option<Arc<Throttle>>,
}

/// What the server (or the transport) said about one attempt.
enum AttemptOutcome {
    /// Done: success, or a status that is not retried.
    Final(http::Response<Body>),
    /// A retried code, or no answer (`result` is then the error, as a [`Status`]).
    Retryable { result: Result<http::Response<Body>, BoxError>, code: Code, pushback: Pushback },
}

impl AttemptOutcome {
    /// An attempt that ended without an answer.
    fn failed(status: Status) -> Self {
        AttemptOutcome::Retryable { code: status.code(), result: Err(Box::new(status)), pushback: Pushback::None }
    }
}

/// The server's `grpc-retry-pushback-ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pushback {
    None,
    Wait(Duration),
    Stop,
}

fn pushback(headers: &HeaderMap) -> Pushback {
    match headers.get(RETRY_PUSHBACK_HEADER).map(|value| value.to_str().ok().and_then(|text| text.parse::<i64>().ok()))
    {
        None => Pushback::None,
        Some(Some(ms)) if ms >= 0 => Pushback::Wait(Duration::from_millis(ms.unsigned_abs())),
        Some(_) => Pushback::Stop,
    }
}

fn grpc_code(headers: &HeaderMap) -> Option<Code> {
    let value = headers.get("grpc-status")?.to_str().ok()?.parse::<i32>().ok()?;
    Some(Code::from_i32(value))
}

/// Full-jitter exponential backoff between `initial` and `max`, bounded by attempts and time.
fn backoff_policy(settings: &RetrySettings) -> ExponentialBackoffTimed {
    retry_policies::policies::ExponentialBackoff::builder()
        .retry_bounds(settings.initial_backoff, settings.max_backoff.max(settings.initial_backoff))
        .jitter(Jitter::Full)
        .base(2)
        .build_with_total_retry_duration_and_max_retries(
            settings.overall_deadline,
            settings.max_attempts.saturating_sub(1),
        )
}

impl<S> Service<http::Request<Body>> for RetryService<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
{
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, context: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(context).map_err(Into::into)
    }

    fn call(&mut self, mut request: http::Request<Body>) -> Self::Future {
        if let Some(value) = self.bearer.as_ref().and_then(BearerToken::header) {
            if !request.headers().contains_key(AUTHORIZATION_HEADER) {
                request.headers_mut().insert(AUTHORIZATION_HEADER, value);
            }
        }
        inject_trace_context(request.headers_mut());
        // The ready service goes with this call; a clone stays for the next (tower's pattern).
        let ready = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, ready);
        let (settings, stats, throttle) = (self.settings.clone(), self.stats.clone(), self.throttle.clone());
        Box::pin(retry_call(inner, settings, stats, throttle, request))
    }
}

async fn retry_call<S>(
    mut inner: S,
    settings: Arc<RetrySettings>,
    stats: Arc<ClientStats>,
    throttle: Option<Arc<Throttle>>,
    request: http::Request<Body>,
) -> Result<http::Response<Body>, BoxError>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>> + Send,
    S::Future: Send,
    S::Error: Into<BoxError>,
{
    let started_at = SystemTime::now();
    let (parts, body) = request.into_parts();
    // The caller's own deadline for this call (`Request::set_timeout`, sent as `grpc-timeout`)
    // bounds every attempt and backoff, when it is shorter than `overall_deadline`.
    let overall = match parts.headers.get(GRPC_TIMEOUT_HEADER).and_then(parse_grpc_timeout) {
        Some(callers) => callers.min(settings.overall_deadline),
        None => settings.overall_deadline,
    };
    // A deadline too far to represent (`Duration::MAX`) is a year away: no call lasts that long.
    let now = Instant::now();
    let deadline = now.checked_add(overall).unwrap_or(now + Duration::from_secs(365 * 24 * 3600));
    let policy = backoff_policy(&settings);
    // Buffered once, so every attempt sends the identical bytes.
    let payload: Bytes = body.collect().await.map_err(|status| Box::new(status) as BoxError)?.to_bytes();
    let mut previous_attempts: u32 = 0;
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining < Duration::from_millis(1) {
            // No time for an attempt (a deadline already spent, or a backoff that overshot).
            return Err(Box::new(Status::deadline_exceeded("the call's deadline passed before its next attempt")));
        }
        let attempt_timeout = settings.per_attempt_timeout.min(remaining);
        let mut attempt = http::Request::new(Body::new(Full::new(payload.clone())));
        *attempt.method_mut() = parts.method.clone();
        *attempt.uri_mut() = parts.uri.clone();
        *attempt.version_mut() = parts.version;
        *attempt.headers_mut() = parts.headers.clone();
        if let Ok(timeout) = HeaderValue::try_from(format!("{}m", attempt_timeout.as_millis().max(1))) {
            attempt.headers_mut().insert(GRPC_TIMEOUT_HEADER, timeout);
        }
        if previous_attempts > 0 {
            attempt.headers_mut().insert(PREVIOUS_ATTEMPTS_HEADER, HeaderValue::from(previous_attempts));
        }
        stats.attempts.fetch_add(1, Ordering::Relaxed);
        let outcome = match tokio::time::timeout(attempt_timeout, async {
            inner.ready().await.map_err(Into::into)?;
            let response = inner.call(attempt).await.map_err(Into::into)?;
            read_whole(response).await
        })
        .await
        {
            Ok(Ok(Answer::Whole { response, status })) => match status.code {
                Some(code) if RETRYABLE_CODES.contains(&code) => {
                    AttemptOutcome::Retryable { result: Ok(response), code, pushback: status.pushback }
                }
                Some(_) => AttemptOutcome::Final(response),
                // An HTTP answer ended without a gRPC status: cut short (200), or a proxy's
                // refusal that the gRPC HTTP mapping makes UNAVAILABLE (429, 502, 503, 504) is
                // retried; any other (a proxy's 401, 404, an error page) is the answer, which
                // tonic maps by its HTTP status (doc/http-grpc-status-mapping.md).
                None if retried_without_status(response.status()) => {
                    AttemptOutcome::failed(Status::unavailable("the answer ended without a gRPC status"))
                }
                None => AttemptOutcome::Final(response),
            },
            Ok(Ok(Answer::TooLarge)) => {
                return Err(Box::new(Status::out_of_range(format!(
                    "the answer is larger than {RESPONSE_BYTES_MAX} bytes"
                ))));
            }
            Ok(Err(error)) => AttemptOutcome::failed(attempt_error(error.as_ref())),
            Err(_) => AttemptOutcome::failed(Status::deadline_exceeded("the attempt's deadline passed")),
        };
        let (result, code, pushback) = match outcome {
            AttemptOutcome::Final(response) => {
                if let Some(throttle) = &throttle {
                    throttle.succeeded();
                }
                return Ok(response);
            }
            AttemptOutcome::Retryable { result, code, pushback } => (result, code, pushback),
        };
        if throttle.as_ref().is_some_and(|throttle| !throttle.failed()) {
            stats.throttled.fetch_add(1, Ordering::Relaxed);
            return result;
        }
        let delay = match pushback {
            Pushback::Stop => return result,
            Pushback::Wait(delay) if previous_attempts + 1 < settings.max_attempts => delay,
            _ => match policy.should_retry(started_at, previous_attempts) {
                RetryDecision::Retry { execute_after } => {
                    execute_after.duration_since(SystemTime::now()).unwrap_or_default()
                }
                RetryDecision::DoNotRetry => return result,
            },
        };
        if previous_attempts + 1 >= settings.max_attempts {
            return result;
        }
        if Instant::now() + delay + ATTEMPT_TIME_MIN >= deadline {
            // The call's deadline leaves no room for another attempt. An answer of the server
            // is the call's (with its ErrorInfo and RetryInfo); an attempt that got no answer
            // ends the call as its deadline says, DEADLINE_EXCEEDED (gRFC A6).
            return match result {
                Ok(response) => Ok(response),
                Err(error) => Err(Box::new(deadline_passed(error.as_ref(), code))),
            };
        }
        stats.retries.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(delay).await;
        previous_attempts += 1;
    }
}

/// The least time worth an attempt: no retry is made with less left of the call's deadline.
const ATTEMPT_TIME_MIN: Duration = Duration::from_millis(10);

/// Request header: the time left for a call (gRPC over HTTP/2: at most 8 digits and a unit,
/// `H`, `M`, `S`, `m`, `u` or `n`).
pub(crate) const GRPC_TIMEOUT_HEADER: &str = "grpc-timeout";

/// A `grpc-timeout` value as a duration; `None` when it is malformed.
pub(crate) fn parse_grpc_timeout(value: &HeaderValue) -> Option<Duration> {
    let text = value.to_str().ok()?;
    let unit_at = text.len().checked_sub(1)?;
    let (digits, unit) = text.split_at(unit_at);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|byte| byte.is_ascii_digit()) {
        return None;
    }
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount * 3600),
        "M" => Duration::from_secs(amount * 60),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

/// DEADLINE_EXCEEDED for a call whose deadline ended its retries after an attempt that got no
/// answer, naming what that attempt met.
fn deadline_passed(last: &(dyn std::error::Error + Send + Sync + 'static), code: Code) -> Status {
    let message = match last.downcast_ref::<Status>() {
        Some(status) => status.message().to_owned(),
        None => last.to_string(),
    };
    Status::deadline_exceeded(format!("the call's deadline passed; its last attempt: {code:?}, {message}"))
}

/// The most bytes of one answer the client reads (tonic's default limit of a decoded message,
/// 4 MiB, and its frame header): a larger one fails the call OUT_OF_RANGE, not retried.
pub const RESPONSE_BYTES_MAX: usize = 4 * 1024 * 1024 + 5;

/// The status of an attempt that ended in a transport error: DEADLINE_EXCEEDED when the
/// channel's own timer for the attempt's `grpc-timeout` fired (tonic's `TimeoutExpired`,
/// which tonic itself reports as CANCELLED), UNAVAILABLE otherwise (a connection refused,
/// reset or broken), its message the chain of causes ("transport error: ... Connection
/// refused"). Both are retried.
fn attempt_error(error: &(dyn std::error::Error + Send + Sync + 'static)) -> Status {
    let mut causes = Vec::new();
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(current) = cause {
        if current.is::<tonic::TimeoutExpired>() {
            return Status::deadline_exceeded("the attempt's deadline passed");
        }
        let text = current.to_string();
        if causes.last() != Some(&text) {
            causes.push(text);
        }
        cause = current.source();
    }
    Status::unavailable(causes.join(": "))
}

/// Whether an answer without a `grpc-status` is retried, by its HTTP status: 200 (the answer
/// was cut short) and the statuses gRPC maps to UNAVAILABLE (429, 502, 503, 504).
fn retried_without_status(status: http::StatusCode) -> bool {
    matches!(status.as_u16(), 200 | 429 | 502 | 503 | 504)
}

/// An attempt's answer read to its end.
enum Answer {
    /// Its headers, message and trailers, and the status they carry.
    Whole { response: http::Response<Body>, status: AnswerStatus },
    /// Over [`RESPONSE_BYTES_MAX`].
    TooLarge,
}

/// The `grpc-status` of an answer (`None`: it carried none) and its pushback.
struct AnswerStatus {
    code: Option<Code>,
    pushback: Pushback,
}

/// Reads an attempt's answer to its end (a unary answer: one message, then the trailers), so
/// that it is judged by the status it ends with, wherever that comes: in the headers of a
/// trailers-only answer, or in the trailers after the message. A connection that breaks after
/// the headers, before the trailers, is an error of the attempt (retried, as one that broke
/// before them), where a caller reading the body itself would see UNKNOWN.
async fn read_whole(response: http::Response<Body>) -> Result<Answer, BoxError> {
    if let Some(code) = grpc_code(response.headers()) {
        let pushback = pushback(response.headers());
        return Ok(Answer::Whole { response, status: AnswerStatus { code: Some(code), pushback } });
    }
    let (parts, body) = response.into_parts();
    let whole = match http_body_util::Limited::new(body, RESPONSE_BYTES_MAX).collect().await {
        Ok(whole) => whole,
        Err(error) if error.downcast_ref::<http_body_util::LengthLimitError>().is_some() => {
            return Ok(Answer::TooLarge);
        }
        Err(error) => return Err(format!("the connection broke after the answer's headers: {error}").into()),
    };
    let (code, pushback) = match whole.trailers() {
        Some(trailers) => (grpc_code(trailers), pushback(trailers)),
        None => (None, Pushback::None),
    };
    let response = http::Response::from_parts(parts, Body::new(whole));
    Ok(Answer::Whole { response, status: AnswerStatus { code, pushback } })
}

/// Adds the caller's current OpenTelemetry context to a request that carries none, with the
/// global propagator (W3C `traceparent` once the application installs
/// `TraceContextPropagator`, as payledger's tools do; nothing with the default no-op one).
#[cfg(feature = "otel")]
fn inject_trace_context(headers: &mut HeaderMap) {
    if headers.contains_key("traceparent") {
        return;
    }
    let context = opentelemetry::Context::current();
    opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.inject_context(&context, &mut HeaderInjector(headers));
    });
}

/// Without the `otel` feature: nothing to add.
#[cfg(not(feature = "otel"))]
fn inject_trace_context(_: &mut HeaderMap) {}

#[cfg(feature = "otel")]
struct HeaderInjector<'a>(&'a mut HeaderMap);

#[cfg(feature = "otel")]
impl opentelemetry::propagation::Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (http::HeaderName::try_from(key), HeaderValue::try_from(value)) {
            self.0.insert(name, value);
        }
    }
}

/// Both payledger services over one set of [`Connections`], with retries.
#[derive(Debug, Clone)]
pub struct PayledgerClient {
    accounts: AccountServiceClient<RetryService<Connections>>,
    payments: PaymentServiceClient<RetryService<Connections>>,
    stats: Arc<ClientStats>,
    connections: Connections,
}

/// How long a connection attempt may take before the attempt fails (and is retried).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// HTTP/2 keepalive while calls are in flight (none while idle): a PING after this long
/// without a frame from the server. gRFC A8 "Client-side Keepalive" has clients send none
/// more often than every 10 s (and servers enforcing its defaults refuse more).
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// How long a keepalive PING may go unanswered before the connection is closed.
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(2);

/// TLS for an `https://` target. The server's certificate must verify against
/// `ca_certificate_pem` (or, without it, the Mozilla root programme's CAs, as bundled by
/// `webpki-roots`) and name the target's host (or `domain_name`); a server that cannot be
/// verified fails the handshake, and the call fails UNAVAILABLE. Nothing falls back to
/// plaintext.
#[derive(Clone, Default)]
pub struct ClientTls {
    /// CA certificate(s), PEM, that the server's certificate must chain to.
    pub ca_certificate_pem: Option<Vec<u8>>,
    /// This client's certificate chain and private key, PEM, for a server that requires
    /// mutual TLS.
    pub identity_pem: Option<(Vec<u8>, Vec<u8>)>,
    /// The name the server's certificate must carry, when it differs from the target's host.
    pub domain_name: Option<String>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("ca_certificate_pem", &self.ca_certificate_pem.as_ref().map(Vec::len))
            .field("identity_pem", &self.identity_pem.as_ref().map(|_| ".."))
            .field("domain_name", &self.domain_name)
            .finish()
    }
}

/// How [`PayledgerClient::connect`] reaches and authenticates to payledger.
#[derive(Debug, Clone)]
pub struct ClientSettings {
    pub retry: RetrySettings,
    /// For `https://` targets; refused for `http://` ones.
    pub tls: Option<ClientTls>,
    /// Sent on every call; required by a server run with `--auth-jwks`.
    pub bearer_token: Option<BearerToken>,
    /// HTTP/2 connections to the endpoint, used in turn (1 to
    /// [`crate::CONNECTIONS_MAX`]; default [`crate::CONNECTIONS_DEFAULT`], 2): a connection
    /// that goes silent holds up only the calls on it, and is replaced when one of them times
    /// out (see [`Connections`]).
    pub connections: usize,
}

impl Default for ClientSettings {
    fn default() -> Self {
        Self { retry: RetrySettings::default(), tls: None, bearer_token: None, connections: CONNECTIONS_DEFAULT }
    }
}

/// Why [`PayledgerClient::connect`] could not build a client.
#[derive(Debug)]
#[non_exhaustive]
pub enum ConnectError {
    /// The endpoint is not a valid URI, or its TLS settings are unusable.
    Endpoint(tonic::transport::Error),
    /// TLS settings for an `http://` target: say `https://` to use TLS.
    TlsForPlaintextTarget,
    /// The target's scheme is neither `http` nor `https`.
    UnsupportedScheme,
    /// An `https://` target with the crate built without its `tls` feature.
    TlsNotBuilt,
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectError::Endpoint(error) => write!(f, "invalid endpoint: {error}"),
            ConnectError::TlsForPlaintextTarget => {
                f.write_str("TLS settings were given for an http:// target; use https:// for TLS")
            }
            ConnectError::UnsupportedScheme => f.write_str("the target must start with http:// or https://"),
            ConnectError::TlsNotBuilt => f.write_str("https:// needs payledger-client's `tls` feature"),
        }
    }
}

impl std::error::Error for ConnectError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ConnectError::Endpoint(error) => Some(error),
            _ => None,
        }
    }
}

impl From<tonic::transport::Error> for ConnectError {
    fn from(error: tonic::transport::Error) -> Self {
        ConnectError::Endpoint(error)
    }
}

/// A tonic `Endpoint` for `target`: `https://` always with TLS (`tls`, or the defaults of
/// [`ClientTls`]), `http://` plaintext and only without TLS settings. For callers that build
/// their own stubs on a `Channel` (with [`BearerToken`] as their interceptor).
///
/// # Errors
/// [`ConnectError`].
pub fn endpoint(target: &str, tls: Option<&ClientTls>) -> Result<Endpoint, ConnectError> {
    let builder = Endpoint::from_shared(target.to_owned())?;
    match (builder.uri().scheme_str(), tls) {
        #[cfg(not(feature = "tls"))]
        (Some("https"), _) => Err(ConnectError::TlsNotBuilt),
        #[cfg(feature = "tls")]
        (Some("https"), tls) => {
            let tls = tls.cloned().unwrap_or_default();
            let mut config = ClientTlsConfig::new();
            config = match &tls.ca_certificate_pem {
                Some(ca) => config.ca_certificate(Certificate::from_pem(ca)),
                None => config.with_webpki_roots(),
            };
            if let Some((cert, key)) = &tls.identity_pem {
                config = config.identity(Identity::from_pem(cert, key));
            }
            if let Some(domain_name) = &tls.domain_name {
                config = config.domain_name(domain_name.clone());
            }
            Ok(builder.tls_config(config)?)
        }
        (Some("http"), None) => Ok(builder),
        (Some("http"), Some(_)) => Err(ConnectError::TlsForPlaintextTarget),
        _ => Err(ConnectError::UnsupportedScheme),
    }
}

impl PayledgerClient {
    /// A client for `endpoint` (e.g. `http://127.0.0.1:50051`) that connects on first use,
    /// so a server that is not up yet is simply retried. An `https://` endpoint gets TLS
    /// verified against the bundled public roots (see [`ClientTls`]; for a private CA, a
    /// client certificate or a bearer token, use [`PayledgerClient::connect`]).
    ///
    /// # Errors
    /// When `endpoint` is not a valid `http://` or `https://` URI.
    pub fn connect_lazy(endpoint: &str, settings: RetrySettings) -> Result<Self, ConnectError> {
        Self::connect(endpoint, ClientSettings { retry: settings, ..ClientSettings::default() })
    }

    /// A client for `endpoint` per `settings`, connecting on first use. `https://` targets
    /// always speak TLS (with `settings.tls`, or the defaults of [`ClientTls`]); `http://`
    /// targets speak plaintext and refuse TLS settings.
    ///
    /// # Errors
    /// [`ConnectError`].
    pub fn connect(endpoint: &str, settings: ClientSettings) -> Result<Self, ConnectError> {
        let endpoint = self::endpoint(endpoint, settings.tls.as_ref())?
            .connect_timeout(CONNECT_TIMEOUT)
            // A connection whose peer stopped answering while calls wait on it is closed
            // within KEEPALIVE_INTERVAL + KEEPALIVE_TIMEOUT; one that an attempt timed out on
            // is replaced at once (`Connections`).
            .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(false);
        let mut layer = RetryLayer::new(settings.retry);
        if let Some(bearer) = settings.bearer_token {
            layer = layer.with_bearer_token(bearer);
        }
        Ok(Self::with_layer(Connections::new(endpoint, settings.connections), layer))
    }

    /// A client over an existing channel (its connections are the channel's own affair).
    pub fn with_channel(channel: Channel, settings: RetrySettings) -> Self {
        Self::with_layer(Connections::from_channel(channel), RetryLayer::new(settings))
    }

    fn with_layer(connections: Connections, layer: RetryLayer) -> Self {
        let stats = layer.stats();
        let service = layer.layer(connections.clone());
        Self {
            accounts: AccountServiceClient::new(service.clone()),
            payments: PaymentServiceClient::new(service),
            stats,
            connections,
        }
    }

    /// Attempts and retries so far.
    pub fn stats(&self) -> &ClientStats {
        &self.stats
    }

    /// How many connections were replaced after an attempt timed out on them.
    pub fn connections_replaced(&self) -> u64 {
        self.connections.replaced()
    }

    /// Opens an account in one currency; the same `account_id` and currency again replays.
    pub async fn open_account(
        &self,
        request: proto::OpenAccountRequest,
    ) -> Result<Response<proto::OpenAccountResponse>, Status> {
        self.accounts.clone().open_account(request).await
    }

    /// `request_id` is the key: keep it the same when you call again.
    pub async fn deposit(&self, request: proto::DepositRequest) -> Result<Response<proto::DepositResponse>, Status> {
        self.accounts.clone().deposit(request).await
    }

    /// A payout; `request_id` is its business key (the same on every attempt).
    pub async fn withdraw(&self, request: proto::WithdrawRequest) -> Result<Response<proto::WithdrawResponse>, Status> {
        self.accounts.clone().withdraw(request).await
    }

    /// The account's balance and version.
    pub async fn get_account(
        &self,
        request: proto::GetAccountRequest,
    ) -> Result<Response<proto::GetAccountResponse>, Status> {
        self.accounts.clone().get_account(request).await
    }

    /// The account's journal entries, newest first, a page at a time.
    pub async fn list_entries(
        &self,
        request: proto::ListEntriesRequest,
    ) -> Result<Response<proto::ListEntriesResponse>, Status> {
        self.accounts.clone().list_entries(request).await
    }

    /// A transfer has no natural key: a fresh `idempotency-key` is generated for this logical
    /// call and sent, unchanged, on every attempt. Use [`PayledgerClient::transfer_with_key`]
    /// to choose it (and to retry the same logical transfer later).
    pub async fn transfer(&self, request: proto::TransferRequest) -> Result<Response<proto::TransferResponse>, Status> {
        self.transfer_with_key(request, &uuid::Uuid::new_v4().to_string()).await
    }

    pub async fn transfer_with_key(
        &self,
        request: proto::TransferRequest,
        idempotency_key: &str,
    ) -> Result<Response<proto::TransferResponse>, Status> {
        self.accounts.clone().transfer(with_idempotency_key(request, idempotency_key)?).await
    }

    /// A PENDING order; `(merchant_id, order_no)` is its key.
    pub async fn create_order(
        &self,
        request: proto::CreateOrderRequest,
    ) -> Result<Response<proto::CreateOrderResponse>, Status> {
        self.payments.clone().create_order(request).await
    }

    /// Closes a PENDING order (a PAID one is refused).
    pub async fn close_order(
        &self,
        request: proto::CloseOrderRequest,
    ) -> Result<Response<proto::CloseOrderResponse>, Status> {
        self.payments.clone().close_order(request).await
    }

    /// `(merchant_id, out_trade_no)` is the key: keep it the same when you call again.
    pub async fn pay(&self, request: proto::PayRequest) -> Result<Response<proto::PayResponse>, Status> {
        self.payments.clone().pay(request).await
    }

    /// `(merchant_id, out_refund_no)` is the key: keep it the same when you call again.
    pub async fn refund(&self, request: proto::RefundRequest) -> Result<Response<proto::RefundResponse>, Status> {
        self.payments.clone().refund(request).await
    }

    /// An order and its payments and refunds, by one of its business numbers
    /// (`proto::query_request::Key`).
    pub async fn query(&self, request: proto::QueryRequest) -> Result<Response<proto::QueryResponse>, Status> {
        self.payments.clone().query(request).await
    }

    /// `out_auth_no` is the hold's business key: keep it the same when you call again.
    pub async fn authorize(
        &self,
        request: proto::AuthorizeRequest,
    ) -> Result<Response<proto::AuthorizeResponse>, Status> {
        self.payments.clone().authorize(request).await
    }

    /// `out_trade_no` is the capture's business key, as a Pay's: keep it the same when you
    /// call again.
    pub async fn capture(&self, request: proto::CaptureRequest) -> Result<Response<proto::CaptureResponse>, Status> {
        self.payments.clone().capture(request).await
    }

    /// Voiding a released hold answers it as it stands (replayed).
    pub async fn void(&self, request: proto::VoidRequest) -> Result<Response<proto::VoidResponse>, Status> {
        self.payments.clone().void(request).await
    }

    /// A one-time `idempotency-token`, accepted only for the request's `merchant_id`.
    pub async fn issue_token(
        &self,
        request: proto::IssueTokenRequest,
    ) -> Result<Response<proto::IssueTokenResponse>, Status> {
        self.payments.clone().issue_token(request).await
    }

    /// The payment stubs, for a call with your own metadata (`idempotency-key`,
    /// `idempotency-token`) or deadline (`Request::set_timeout`), kept across retries.
    pub fn payments(&self) -> PaymentServiceClient<RetryService<Connections>> {
        self.payments.clone()
    }

    /// The account stubs, as [`PayledgerClient::payments`].
    pub fn accounts(&self) -> AccountServiceClient<RetryService<Connections>> {
        self.accounts.clone()
    }
}

/// A request carrying an `idempotency-key` header.
///
/// # Errors
/// INVALID_ARGUMENT when the key is not printable ASCII.
pub fn with_idempotency_key<T>(message: T, idempotency_key: &str) -> Result<Request<T>, Status> {
    let mut request = Request::new(message);
    let value =
        idempotency_key.parse().map_err(|_| Status::invalid_argument("idempotency-key must be printable ASCII"))?;
    request.metadata_mut().insert(crate::IDEMPOTENCY_KEY_HEADER, value);
    Ok(request)
}

/// The answer was replayed from an earlier call (`idempotent-replayed: true`).
pub fn was_replayed<T>(response: &Response<T>) -> bool {
    response.metadata().get(crate::REPLAYED_HEADER).and_then(|value| value.to_str().ok()) == Some("true")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pushback_reads_a_wait_a_stop_or_nothing() {
        let mut headers = HeaderMap::new();
        assert_eq!(pushback(&headers), Pushback::None);
        headers.insert(RETRY_PUSHBACK_HEADER, HeaderValue::from_static("250"));
        assert_eq!(pushback(&headers), Pushback::Wait(Duration::from_millis(250)));
        headers.insert(RETRY_PUSHBACK_HEADER, HeaderValue::from_static("-1"));
        assert_eq!(pushback(&headers), Pushback::Stop);
        headers.insert(RETRY_PUSHBACK_HEADER, HeaderValue::from_static("soon"));
        assert_eq!(pushback(&headers), Pushback::Stop);
    }

    #[test]
    fn an_attempt_the_channel_timed_out_is_deadline_exceeded_and_a_broken_one_unavailable() {
        /// A transport error caused by `.0`.
        #[derive(Debug)]
        struct Transport<E>(E);
        impl<E> std::fmt::Display for Transport<E> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("transport error")
            }
        }
        impl<E: std::error::Error + 'static> std::error::Error for Transport<E> {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        assert_eq!(attempt_error(&Transport(tonic::TimeoutExpired(()))).code(), Code::DeadlineExceeded);
        assert_eq!(attempt_error(&tonic::TimeoutExpired(())).code(), Code::DeadlineExceeded);
        let reset = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert_eq!(attempt_error(&reset).code(), Code::Unavailable);
        let refused = Transport(std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused"));
        assert_eq!(attempt_error(&refused).message(), "transport error: Connection refused", "the cause is named");
        assert!(RETRYABLE_CODES.contains(&Code::DeadlineExceeded) && RETRYABLE_CODES.contains(&Code::Unavailable));
    }

    #[test]
    fn only_transient_codes_are_retried() {
        for code in
            [Code::InvalidArgument, Code::NotFound, Code::AlreadyExists, Code::FailedPrecondition, Code::Internal]
        {
            assert!(!RETRYABLE_CODES.contains(&code), "{code:?}");
        }
    }

    #[test]
    fn backoff_stays_within_its_ceiling_and_stops_after_the_attempts() {
        let settings = RetrySettings { max_attempts: 3, ..RetrySettings::default() };
        let policy = backoff_policy(&settings);
        let started_at = SystemTime::now();
        for previous in 0..2 {
            match policy.should_retry(started_at, previous) {
                RetryDecision::Retry { execute_after } => {
                    let wait = execute_after.duration_since(SystemTime::now()).unwrap_or_default();
                    assert!(
                        wait <= settings.initial_backoff * 2u32.pow(previous) + Duration::from_millis(5),
                        "{wait:?}"
                    );
                }
                RetryDecision::DoNotRetry => panic!("retry {previous} was refused"),
            }
        }
        assert!(matches!(policy.should_retry(started_at, 2), RetryDecision::DoNotRetry));
    }

    #[test]
    fn the_default_throttling_is_the_service_configs() {
        let config: serde_json::Value = serde_json::from_str(crate::SERVICE_CONFIG_JSON).unwrap();
        let throttling = &config["retryThrottling"];
        let default = RetryThrottling::default();
        assert_eq!(throttling["maxTokens"].as_u64(), Some(u64::from(default.max_tokens)));
        assert_eq!(throttling["tokenRatio"].as_f64(), Some(default.token_ratio));
        assert_eq!(RetrySettings::default().throttling, Some(default));
    }

    #[test]
    fn throttling_stops_retries_at_half_the_tokens_and_successes_earn_them_back() {
        let throttle = Throttle::new(RetryThrottling { max_tokens: 10, token_ratio: 0.5 });
        // 10 tokens: failures take them down to 6 with retries allowed, the 5th leaves 5.
        for failure in 1..=4 {
            assert!(throttle.failed(), "failure {failure}");
        }
        assert!(!throttle.failed(), "5 tokens of 10 is the threshold: no retry");
        assert!(!throttle.failed());
        // 4 tokens; four successes give 2 back (6), the next failure takes 1 (5).
        for _ in 0..4 {
            throttle.succeeded();
        }
        assert!(!throttle.failed(), "6 - 1 = 5 tokens: still held back");
        for _ in 0..4 {
            throttle.succeeded();
        }
        assert!(throttle.failed(), "5 + 2 - 1 = 6 tokens: retries again");
        for _ in 0..100 {
            throttle.succeeded();
        }
        assert_eq!(*throttle.tokens(), 10_000, "never above max_tokens");
    }

    /// A channel stand-in that answers each attempt with what its function makes, and counts
    /// the attempts.
    #[derive(Clone)]
    #[allow(clippy::type_complexity)]
    struct Stub(Arc<dyn Fn(&HeaderMap) -> http::Response<Body> + Send + Sync>, Arc<AtomicU64>);

    impl Stub {
        fn new(
            answer: impl Fn(&HeaderMap) -> http::Response<Body> + Send + Sync + 'static,
            attempts: &Arc<AtomicU64>,
        ) -> Self {
            Self(Arc::new(answer), attempts.clone())
        }
    }

    impl Service<http::Request<Body>> for Stub {
        type Response = http::Response<Body>;
        type Error = BoxError;
        type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: http::Request<Body>) -> Self::Future {
            self.1.fetch_add(1, Ordering::Relaxed);
            let response = (self.0)(request.headers());
            Box::pin(async move { Ok(response) })
        }
    }

    #[tokio::test]
    async fn during_an_outage_throttling_caps_the_attempts_near_one_per_call() {
        let quick = RetrySettings {
            max_attempts: 5,
            initial_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(1),
            ..RetrySettings::default()
        };
        let calls = 100;
        let mut attempts = Vec::new();
        for throttling in [None, Some(RetryThrottling::default())] {
            let counter = Arc::new(AtomicU64::new(0));
            let layer = RetryLayer::new(RetrySettings { throttling, ..quick.clone() });
            let mut service = layer.layer(Stub::new(|_| Status::unavailable("down").into_http(), &counter));
            for _ in 0..calls {
                let request = http::Request::new(Body::empty());
                let response = service.ready().await.unwrap().call(request).await.unwrap();
                assert_eq!(grpc_code(response.headers()), Some(Code::Unavailable));
            }
            attempts.push(counter.load(Ordering::Relaxed));
        }
        assert_eq!(attempts[0], calls * 5, "without throttling every call makes all its attempts");
        // 100 tokens: 50 failures reach the threshold; every later call is tried once.
        assert_eq!(attempts[1], 50 + (calls - 10), "{attempts:?}");
    }

    /// A body that sends `data`, then fails (a connection broken after the headers) or ends
    /// with `trailers`.
    struct Scripted {
        data: Option<Bytes>,
        end: End,
    }

    impl http_body::Body for Scripted {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
            if let Some(data) = self.data.take() {
                return Poll::Ready(Some(Ok(http_body::Frame::data(data))));
            }
            Poll::Ready(match self.end.take() {
                Some(Ok(trailers)) => Some(Ok(http_body::Frame::trailers(trailers))),
                Some(Err(())) => Some(Err("stream reset by peer".into())),
                None => None,
            })
        }
    }

    /// How a [`Scripted`] body ends: trailers, a broken connection (`Err`), or nothing.
    type End = Option<Result<HeaderMap, ()>>;

    /// A [`Stub`] answering each attempt with the next of `script`: headers without a status,
    /// then the message and the [`Scripted`] end.
    fn scripted(script: Vec<End>, attempts: &Arc<AtomicU64>) -> Stub {
        let script = Mutex::new(script);
        Stub::new(
            move |_| {
                let end = script.lock().unwrap().remove(0);
                let body = Scripted { data: Some(Bytes::from_static(b"\0\0\0\0\0")), end };
                http::Response::new(Body::new(body))
            },
            attempts,
        )
    }

    fn trailers(code: Code) -> HeaderMap {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from(code as i32));
        trailers
    }

    #[tokio::test]
    async fn an_answer_broken_after_its_headers_or_ending_in_a_retried_code_is_retried() {
        let quick = RetrySettings {
            initial_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(1),
            throttling: None,
            ..RetrySettings::default()
        };
        // Broken after the headers; a status in the trailers that is retried; none at all;
        // then the answer, whole.
        let script = vec![Some(Err(())), Some(Ok(trailers(Code::Unavailable))), None, Some(Ok(trailers(Code::Ok)))];
        let attempts = Arc::new(AtomicU64::new(0));
        let mut service = RetryLayer::new(quick).layer(scripted(script, &attempts));
        let response = service.ready().await.unwrap().call(http::Request::new(Body::empty())).await.unwrap();
        assert_eq!(attempts.load(Ordering::Relaxed), 4);
        let whole = response.into_body().collect().await.unwrap();
        assert_eq!(whole.trailers().and_then(grpc_code), Some(Code::Ok), "the trailers reach the caller");
        assert_eq!(whole.to_bytes().as_ref(), b"\0\0\0\0\0", "and so does the message");

        assert!(!retried_without_status(http::StatusCode::NOT_FOUND), "a proxy's 404 is the answer");
        assert!(retried_without_status(http::StatusCode::BAD_GATEWAY));

        // A status in the trailers that is not retried is the answer.
        let script = vec![Some(Ok(trailers(Code::FailedPrecondition))), Some(Ok(trailers(Code::Ok)))];
        let attempts = Arc::new(AtomicU64::new(0));
        let mut service = RetryLayer::new(RetrySettings::default()).layer(scripted(script, &attempts));
        let response = service.ready().await.unwrap().call(http::Request::new(Body::empty())).await.unwrap();
        assert_eq!(attempts.load(Ordering::Relaxed), 1);
        let whole = response.into_body().collect().await.unwrap();
        assert_eq!(whole.trailers().and_then(grpc_code), Some(Code::FailedPrecondition));
    }

    #[test]
    fn grpc_timeout_values_parse_in_every_unit_and_malformed_ones_do_not() {
        let parse = |text: &'static str| parse_grpc_timeout(&HeaderValue::from_static(text));
        assert_eq!(parse("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse("2S"), Some(Duration::from_secs(2)));
        assert_eq!(parse("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse("3M"), Some(Duration::from_secs(180)));
        assert_eq!(parse("7u"), Some(Duration::from_micros(7)));
        assert_eq!(parse("99999999n"), Some(Duration::from_nanos(99_999_999)));
        for malformed in ["", "m", "123456789m", "12", "1.5S", "-1S", "10x", "1 S"] {
            assert_eq!(parse(malformed), None, "{malformed:?}");
        }
    }

    /// Retries bounded by the call's deadline alone: attempts without count, 5 ms backoffs.
    fn bounded_by_time_alone() -> RetrySettings {
        RetrySettings {
            max_attempts: 1000,
            initial_backoff: Duration::from_millis(5),
            max_backoff: Duration::from_millis(5),
            throttling: None,
            ..RetrySettings::default()
        }
    }

    #[tokio::test]
    async fn a_callers_deadline_shorter_than_the_default_bounds_every_attempt_and_ends_the_call() {
        let quick = bounded_by_time_alone();
        let sent = Arc::new(Mutex::new(Vec::new()));
        let seen = sent.clone();
        let attempts = Arc::new(AtomicU64::new(0));
        let stub = Stub::new(
            move |headers| {
                seen.lock().unwrap().push(headers.get(GRPC_TIMEOUT_HEADER).and_then(parse_grpc_timeout));
                Status::unavailable("down").into_http()
            },
            &attempts,
        );
        let mut service = RetryLayer::new(quick).layer(stub);
        let mut request = http::Request::new(Body::empty());
        request.headers_mut().insert(GRPC_TIMEOUT_HEADER, HeaderValue::from_static("300m"));
        let started = Instant::now();
        let answer = service.ready().await.unwrap().call(request).await;
        let took = started.elapsed();
        let response = answer.expect("the server's last answer");
        assert_eq!(grpc_code(response.headers()), Some(Code::Unavailable), "the server's answer is the call's");
        // (the timer's granularity aside: a 15 s overall deadline would run far longer)
        assert!(took < Duration::from_millis(350), "the call ends by the caller's deadline: {took:?}");
        let sent = sent.lock().unwrap();
        assert!(sent.len() > 3, "it was retried within the deadline: {} attempts", sent.len());
        let mut previous = Duration::from_millis(300);
        for timeout in sent.iter() {
            let timeout = timeout.expect("every attempt carries grpc-timeout");
            assert!(timeout <= previous, "each attempt gets what is left: {sent:?}");
            previous = timeout;
        }
    }

    #[tokio::test]
    async fn a_call_whose_attempts_get_no_answer_ends_deadline_exceeded_by_the_callers_deadline() {
        let quick = bounded_by_time_alone();
        // Every answer breaks after its headers.
        let attempts = Arc::new(AtomicU64::new(0));
        let mut service = RetryLayer::new(quick).layer(scripted(vec![Some(Err(())); 1000], &attempts));
        let mut request = http::Request::new(Body::empty());
        request.headers_mut().insert(GRPC_TIMEOUT_HEADER, HeaderValue::from_static("200m"));
        let error = service.ready().await.unwrap().call(request).await.unwrap_err();
        let status = error.downcast_ref::<Status>().expect("a status");
        assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
        assert!(status.message().contains("Unavailable"), "it names what the last attempt met: {status:?}");
        assert!(attempts.load(Ordering::Relaxed) > 3, "retried until the deadline");

        // A deadline already spent sends nothing.
        let attempts = Arc::new(AtomicU64::new(0));
        let mut service = RetryLayer::new(RetrySettings::default()).layer(scripted(vec![], &attempts));
        let mut request = http::Request::new(Body::empty());
        request.headers_mut().insert(GRPC_TIMEOUT_HEADER, HeaderValue::from_static("0n"));
        let error = service.ready().await.unwrap().call(request).await.unwrap_err();
        assert_eq!(error.downcast_ref::<Status>().map(Status::code), Some(Code::DeadlineExceeded));
        assert_eq!(attempts.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn an_overall_deadline_too_far_to_represent_is_no_panic() {
        let endless = RetrySettings {
            overall_deadline: Duration::MAX,
            max_attempts: 2,
            initial_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(1),
            ..RetrySettings::default()
        };
        let attempts = Arc::new(AtomicU64::new(0));
        let stub = Stub::new(|_| Status::unavailable("down").into_http(), &attempts);
        let mut service = RetryLayer::new(endless).layer(stub);
        let response = service.ready().await.unwrap().call(http::Request::new(Body::empty())).await.unwrap();
        assert_eq!(grpc_code(response.headers()), Some(Code::Unavailable));
        assert_eq!(attempts.load(Ordering::Relaxed), 2, "retried, then out of attempts");
    }
}
