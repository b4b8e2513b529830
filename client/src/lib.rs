//! The Rust client of payledger, for services that call it: the API's messages and client
//! stubs (`proto`), generated from `proto/payledger/v1/payledger.proto`, behind a tower
//! retry layer that retries the way payledger's guarantees allow. It carries no server code
//! and no database driver.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use payledger_client::{PayledgerClient, RetrySettings};
//! use payledger_client::proto::PayRequest;
//!
//! let client = PayledgerClient::connect_lazy("http://127.0.0.1:50051", RetrySettings::default())?;
//! let request = PayRequest {
//!     merchant_id: "m1".into(),
//!     out_trade_no: "pay-1".into(), // the business key: the same on every attempt
//!     order_no: "order-1".into(),
//!     payer_account_id: "alice".into(),
//!     amount: "30.00".into(),
//!     currency: "USD".into(),
//! };
//! let response = client.pay(request).await?;
//! println!("trade_no {}", response.get_ref().payment.as_ref().map_or("", |p| p.trade_no.as_str()));
//! # Ok(()) }
//! ```
//!
//! What is retried (gRPC status codes, see gRFC A6 "gRPC Retry Design"):
//! - UNAVAILABLE (connection refused or reset, database down), ABORTED (optimistic-lock
//!   contention, a duplicate in flight past the lock timeout), RESOURCE_EXHAUSTED, and
//!   DEADLINE_EXCEEDED of one attempt (the per-attempt timeout; the overall deadline is never
//!   extended). Every payledger mutation is idempotent, so a retry of a call that did commit is
//!   answered as a replay with the original result.
//! - An attempt that ended without a status: a connection broken before the answer's headers
//!   (UNAVAILABLE) or after them, before its trailers (each answer is read to its end, at most
//!   [`RESPONSE_BYTES_MAX`] bytes, and judged by the status it ends with, in its headers
//!   or its trailers; a caller reading the body itself would see UNKNOWN), or an answer that
//!   ended without one.
//! - Never INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION (a retry would get
//!   the same answer), nor anything else.
//!
//! How: exponential backoff with full jitter (the `retry-policies` crate), at most
//! `max_attempts` attempts within `overall_deadline`; a server's `grpc-retry-pushback-ms`
//! replaces the backoff (a negative or malformed value stops retrying, as A6 says); every retry
//! carries `grpc-previous-rpc-attempts`. Every attempt re-sends the identical request bytes and
//! headers, so the business keys and the `idempotency-key` are the same on every attempt.
//!
//! Retry throttling (gRFC A6, [`RetryThrottling`], on by default as `retryThrottling` in
//! `client/service_config.json`): each attempt answered with a retried code takes a token from
//! the client's 100, every other answer gives 0.1 back, and at 50 or fewer no call is
//! retried, so an outage does not multiply the load by `max_attempts`.
//!
//! Tracing (the `otel` feature, on by default): each call carries the caller's current
//! OpenTelemetry context, injected by the
//! global propagator (W3C `traceparent` once the application installs
//! `TraceContextPropagator`; nothing with the default no-op propagator).

mod connections;
mod error;
mod retry;

pub use connections::{Connections, CONNECTIONS_DEFAULT, CONNECTIONS_MAX};
pub use error::{CallError, FieldViolation, Reason, ERROR_DOMAIN};

/// The tonic this crate is built on, so a caller names its types (`Request`, `Response`,
/// `Status`, `Code`) without matching versions by hand.
pub use tonic;

/// The well-known protobuf types of the API's messages (`Timestamp` of `expires_at`,
/// `created_at`...), so a caller builds them without matching versions by hand.
pub use prost_types;

pub use retry::{
    endpoint, was_replayed, with_idempotency_key, BearerToken, ClientSettings, ClientStats, ClientTls, ConnectError,
    PayledgerClient, RetryLayer, RetryService, RetrySettings, RetryThrottling, AUTHORIZATION_HEADER,
    PREVIOUS_ATTEMPTS_HEADER, RESPONSE_BYTES_MAX, RETRYABLE_CODES, RETRY_PUSHBACK_HEADER,
};

/// Messages and client stubs of package `payledger.v1`.
pub mod proto {
    #![allow(clippy::all, clippy::pedantic, missing_docs)]
    tonic::include_proto!("payledger.v1");
}

/// Request header: the caller's idempotency key (1-128 printable ASCII characters, see the
/// server's docs/api.md for the exact alphabet).
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";
/// Request header: a one-time token from `IssueToken`.
pub const IDEMPOTENCY_TOKEN_HEADER: &str = "idempotency-token";
/// Response header, `true` on an answer replayed from an earlier call.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";
/// Response header: until when the call's `idempotency-key` is kept (RFC 3339).
pub const KEY_EXPIRES_HEADER: &str = "idempotency-expires-at";

/// The gRPC service config for callers in other languages (`client/service_config.json`):
/// retries UNAVAILABLE, ABORTED and RESOURCE_EXHAUSTED, with retry throttling.
pub const SERVICE_CONFIG_JSON: &str = include_str!("../service_config.json");
