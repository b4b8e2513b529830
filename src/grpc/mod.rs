//! The gRPC transport: decode a request into a command, run the use case, encode the answer.

mod accounts;
pub mod codec;
mod decode;
mod payments;

use std::future::Future;

use tonic::metadata::MetadataValue;
use tonic::{Response, Status};
use tracing::{Instrument, Span};

pub use accounts::AccountApi;
pub use payments::PaymentApi;

use crate::error::Error;
use crate::ledger::{response, Replayable};

/// Response metadata headers: `idempotent-replayed: true` on an answer replayed from an
/// earlier call; `idempotency-expires-at`, until when the call's `idempotency-key` is kept
/// (RFC 3339). Defined once, in the client crate.
pub use payledger_client::{KEY_EXPIRES_HEADER, REPLAYED_HEADER};

/// The guard headers (`idempotency-key`, `idempotency-token`) as they arrived in the request's
/// HTTP/2 HEADERS frame. tonic merges request trailers into the metadata, where a trailer
/// replaces a header of the same name; this record, taken before that (by
/// [`capture_guard_headers`], a layer of the server), lets the decoder refuse a guard sent
/// in trailers instead of silently reading the trailer's value.
#[derive(Debug, Clone, Default)]
pub struct GuardHeaders {
    idempotency_key: Vec<http::HeaderValue>,
    idempotency_token: Vec<http::HeaderValue>,
}

/// Records the guard headers of `request` in its extensions (see [`GuardHeaders`]).
pub fn capture_guard_headers<B>(mut request: http::Request<B>) -> http::Request<B> {
    let values = |name: &str| request.headers().get_all(name).iter().cloned().collect();
    let captured = GuardHeaders {
        idempotency_key: values(crate::ledger::IDEMPOTENCY_KEY_HEADER),
        idempotency_token: values(crate::ledger::IDEMPOTENCY_TOKEN_HEADER),
    };
    request.extensions_mut().insert(captured);
    request
}

/// Runs a use case on its own task, so that a client that cancels or whose deadline passes
/// (tonic then drops the handler future) cannot cut a transaction in half: the task runs to
/// commit or rollback whatever happens to the call, and its connection returns to the pool
/// clean.
async fn run_detached<T, F>(span: Span, use_case: F) -> Result<T, Status>
where
    T: Send + 'static,
    F: Future<Output = Result<T, Error>> + Send + 'static,
{
    let task = tokio::spawn(
        async move {
            let outcome = use_case.await;
            if let Err(error) = &outcome {
                tracing::info!(%error, "call refused");
            }
            outcome
        }
        .instrument(span),
    );
    match task.await {
        Ok(outcome) => outcome.map_err(Status::from),
        Err(join_error) => Err(Error::Internal(format!("use case task failed: {join_error}")).into()),
    }
}

/// Wraps an answer, marking replays with `idempotent-replayed: true`.
fn reply<T>(message: T, replayed: bool) -> Response<T> {
    let mut response = Response::new(message);
    if replayed {
        response.metadata_mut().insert(REPLAYED_HEADER, MetadataValue::from_static("true"));
    }
    response
}

/// A use case's answer message, with the replay and key-expiry headers.
fn reply_replayable<M>(answer: Replayable<M>) -> Response<M> {
    let mut response = reply(answer.value, answer.replayed);
    if let Some(expires_at) = answer.key_expires_at {
        let text = response::timestamp(expires_at).map(|timestamp| timestamp.to_string()).unwrap_or_default();
        if let Ok(value) = MetadataValue::try_from(text) {
            response.metadata_mut().insert(KEY_EXPIRES_HEADER, value);
        }
    }
    response
}
