//! The gRPC transport: decode a request into a command, run the use case, encode the answer.

mod accounts;
mod decode;
mod encode;
mod payments;

use std::future::Future;

use tonic::metadata::MetadataValue;
use tonic::{Response, Status};
use tracing::{Instrument, Span};

pub use accounts::AccountApi;
pub use payments::PaymentApi;

use crate::error::Error;
use crate::ledger::Replayable;

/// Response metadata header set to `true` on an answer replayed from an earlier call.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

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
        Err(join_error) => {
            Err(Error::Internal(format!("use case task failed: {join_error}")).into())
        }
    }
}

/// Wraps an answer, marking replays with `idempotent-replayed: true`.
fn reply<T>(message: T, replayed: bool) -> Response<T> {
    let mut response = Response::new(message);
    if replayed {
        response
            .metadata_mut()
            .insert(REPLAYED_HEADER, MetadataValue::from_static("true"));
    }
    response
}

/// Encodes a replayable use-case answer.
fn reply_replayable<T, M>(
    answer: Replayable<T>,
    encode: impl FnOnce(T) -> Result<M, Error>,
) -> Result<Response<M>, Status> {
    Ok(reply(encode(answer.value)?, answer.replayed))
}
