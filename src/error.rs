//! The one error type of the service and its one mapping to a gRPC status.
//!
//! Every status carries a `google.rpc.ErrorInfo` with domain [`ERROR_DOMAIN`] and a stable
//! UPPER_SNAKE reason; bad input also carries a `google.rpc.BadRequest` with one field
//! violation per bad field. Database details are logged, never sent.

use std::collections::HashMap;
use std::time::Duration;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::auth::{Denied, Unauthenticated};
use crate::domain::{FieldViolation, Rejection};
use crate::store::{classify, Fault};

/// The `ErrorInfo.domain` of every error payledger returns.
pub const ERROR_DOMAIN: &str = "payledger";

/// What a caller asked for that does not exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource {
    Account,
    Order,
    Payment,
    Refund,
    Hold,
}

impl Resource {
    fn reason(self) -> &'static str {
        match self {
            Resource::Account => "ACCOUNT_NOT_FOUND",
            Resource::Order => "ORDER_NOT_FOUND",
            Resource::Payment => "PAYMENT_NOT_FOUND",
            Resource::Refund => "REFUND_NOT_FOUND",
            Resource::Hold => "HOLD_NOT_FOUND",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Resource::Account => "account",
            Resource::Order => "order",
            Resource::Payment => "payment",
            Resource::Refund => "refund",
            Resource::Hold => "hold",
        }
    }
}

/// A key that was used before with different parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReusedKey {
    AccountId,
    RequestId,
    OrderNo,
    OutTradeNo,
    OutRefundNo,
    OutAuthNo,
}

impl ReusedKey {
    pub(crate) fn reason(self) -> &'static str {
        match self {
            ReusedKey::AccountId => "ACCOUNT_ALREADY_EXISTS",
            ReusedKey::RequestId => "REQUEST_ID_REUSED",
            ReusedKey::OrderNo => "ORDER_NO_REUSED",
            ReusedKey::OutTradeNo => "OUT_TRADE_NO_REUSED",
            ReusedKey::OutRefundNo => "OUT_REFUND_NO_REUSED",
            ReusedKey::OutAuthNo => "OUT_AUTH_NO_REUSED",
        }
    }

    fn field(self) -> &'static str {
        match self {
            ReusedKey::AccountId => "account_id",
            ReusedKey::RequestId => "request_id",
            ReusedKey::OrderNo => "order_no",
            ReusedKey::OutTradeNo => "out_trade_no",
            ReusedKey::OutRefundNo => "out_refund_no",
            ReusedKey::OutAuthNo => "out_auth_no",
        }
    }
}

/// Everything that can go wrong, named by what the caller can do about it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Bad input: fix the request. INVALID_ARGUMENT.
    #[error("invalid argument: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    InvalidArgument(Vec<FieldViolation>),
    /// No usable credential: UNAUTHENTICATED (CREDENTIALS_MISSING, CREDENTIALS_INVALID,
    /// CREDENTIALS_EXPIRED). The message never echoes the credential.
    #[error(transparent)]
    Unauthenticated(#[from] Unauthenticated),
    /// An authenticated caller outside its grant: PERMISSION_DENIED (MERCHANT_NOT_ALLOWED, or
    /// SCOPE_MISSING with the scope in the ErrorInfo metadata).
    #[error(transparent)]
    PermissionDenied(#[from] Denied),
    /// NOT_FOUND.
    #[error("{} not found", .0.name())]
    NotFound(Resource),
    /// The key was used before with other parameters (`fields` lists the ones that differ).
    /// ALREADY_EXISTS.
    #[error("{} was already used with a different {}", .key.field(), .fields.join(", "))]
    KeyReused { key: ReusedKey, fields: Vec<&'static str> },
    /// The `idempotency-key` was used before for another request (`fields` lists what
    /// differs, or `method`). ALREADY_EXISTS.
    #[error("idempotency-key was already used with a different {}", .fields.join(", "))]
    IdempotencyKeyReused { fields: Vec<String> },
    /// The `idempotency-token` was consumed by another request. ALREADY_EXISTS.
    #[error("idempotency-token was already used with a different {}", .fields.join(", "))]
    TokenReused { fields: Vec<String> },
    /// A business rule refuses the request in the current state. FAILED_PRECONDITION.
    #[error(transparent)]
    Rejected(#[from] Rejection),
    /// Optimistic-lock retries ran out under contention. ABORTED: retry with the same key.
    #[error("too much contention on the same accounts or order; retry with the same key")]
    Contention,
    /// The transaction found its key taken, but the committed original could not be read
    /// yet (a replica or cluster node behind the one that committed it): ABORTED, retryable.
    #[error("the original of this call committed but is not visible here yet; retry with the same key")]
    NotYetVisible,
    /// A Galera node aborted the transaction under it without an error (its session found
    /// itself in no transaction): run again from BEGIN, then ABORTED (CONTENTION), retryable.
    #[error("the cluster aborted the transaction; retry with the same key")]
    ClusterAborted,
    /// The database failed; `classify` tells whether it is unreachable, transient or a bug.
    #[error("database error")]
    Database(#[from] sqlx::Error),
    /// A bound was reached (the concurrency limit, a full group-commit queue): refused before
    /// any work, RESOURCE_EXHAUSTED (OVERLOADED, ErrorInfo metadata `bound`), with pushback.
    #[error("overloaded ({0}); retry later with the same key")]
    Overloaded(&'static str),
    /// The caller had gone (cancelled, or past its deadline) before its queued call started:
    /// nothing was done. DEADLINE_EXCEEDED or CANCELLED (CALLER_GONE); nobody reads it.
    #[error("the caller had gone before the call started; nothing was done")]
    CallerGone { deadline_passed: bool },
    /// The Redis token store failed. UNAVAILABLE.
    #[error("token store error")]
    TokenStore(#[from] redis::RedisError),
    /// A bug or an impossible state. INTERNAL.
    #[error("internal error: {0}")]
    Internal(String),
    /// A write set broke a money invariant (a bug; see `ledger::invariants`): its transaction
    /// was rolled back and nothing of it written. INTERNAL; the log names the invariant.
    #[error("money invariant broken: {0}")]
    InvariantBroken(&'static str),
}

impl From<FieldViolation> for Error {
    fn from(violation: FieldViolation) -> Self {
        Error::InvalidArgument(vec![violation])
    }
}

/// The wait asked of a call refused OVERLOADED: long enough for the queue in front of it to
/// drain a batch or two.
const OVERLOADED_PUSHBACK: Duration = Duration::from_millis(100);

/// Response header of gRFC A6 retry pushback.
pub(crate) const RETRY_PUSHBACK_HEADER: &str = "grpc-retry-pushback-ms";

/// The wait the server asks of a retry (in RetryInfo and the pushback header alike), where it
/// knows better than the client's backoff: a lost optimistic lock clears fast; a lock held
/// past the timeout (a duplicate in flight) and an unreachable database need longer.
fn retry_pushback(reason: &str) -> Option<Duration> {
    match reason {
        "CONTENTION" | "KEY_NOT_YET_VISIBLE" => Some(Duration::from_millis(20)),
        "LOCK_TIMEOUT" => Some(Duration::from_millis(200)),
        "DATABASE_UNAVAILABLE" | "TOKEN_STORE_UNAVAILABLE" => Some(Duration::from_millis(250)),
        "OVERLOADED" => Some(OVERLOADED_PUSHBACK),
        _ => None,
    }
}

impl From<Error> for Status {
    fn from(error: Error) -> Self {
        let mut details = ErrorDetails::new();
        let (code, reason, message) = match &error {
            Error::InvalidArgument(violations) => {
                for violation in violations {
                    details.add_bad_request_violation(violation.field, violation.description.clone());
                }
                (Code::InvalidArgument, "INVALID_ARGUMENT", error.to_string())
            }
            Error::Unauthenticated(failure) => (Code::Unauthenticated, failure.reason(), error.to_string()),
            Error::PermissionDenied(denied) => {
                if let Denied::ScopeMissing(scope) = denied {
                    let metadata = HashMap::from([("scope".to_owned(), scope.as_str().to_owned())]);
                    details.set_error_info(denied.reason(), ERROR_DOMAIN, metadata);
                }
                (Code::PermissionDenied, denied.reason(), error.to_string())
            }
            Error::NotFound(resource) => (Code::NotFound, resource.reason(), error.to_string()),
            Error::KeyReused { key, fields } => {
                let metadata = HashMap::from([
                    ("key".to_owned(), key.field().to_owned()),
                    ("fields".to_owned(), fields.join(",")),
                ]);
                details.set_error_info(key.reason(), ERROR_DOMAIN, metadata);
                (Code::AlreadyExists, key.reason(), error.to_string())
            }
            Error::IdempotencyKeyReused { fields } | Error::TokenReused { fields } => {
                let reason =
                    if matches!(error, Error::TokenReused { .. }) { "TOKEN_REUSED" } else { "IDEMPOTENCY_KEY_REUSED" };
                let metadata = HashMap::from([("fields".to_owned(), fields.join(","))]);
                details.set_error_info(reason, ERROR_DOMAIN, metadata);
                (Code::AlreadyExists, reason, error.to_string())
            }
            Error::TokenStore(redis_error) => {
                tracing::warn!(error = %redis_error, "token store unavailable");
                (Code::Unavailable, "TOKEN_STORE_UNAVAILABLE", "token store unavailable; retry".to_owned())
            }
            Error::Rejected(rejection) => (Code::FailedPrecondition, rejection.reason(), error.to_string()),
            Error::Contention => (Code::Aborted, "CONTENTION", error.to_string()),
            Error::Overloaded(bound) => {
                let metadata = HashMap::from([("bound".to_owned(), (*bound).to_owned())]);
                details.set_error_info("OVERLOADED", ERROR_DOMAIN, metadata);
                (Code::ResourceExhausted, "OVERLOADED", error.to_string())
            }
            Error::CallerGone { deadline_passed } => {
                let code = if *deadline_passed { Code::DeadlineExceeded } else { Code::Cancelled };
                (code, "CALLER_GONE", error.to_string())
            }
            Error::NotYetVisible => {
                tracing::info!("a taken key's original is not visible yet after re-reads");
                (Code::Aborted, "KEY_NOT_YET_VISIBLE", error.to_string())
            }
            Error::ClusterAborted => {
                tracing::info!("transaction aborted by the cluster, after retries");
                (Code::Aborted, "CONTENTION", "transaction conflict; retry with the same key".to_owned())
            }
            Error::Database(db_error) => match classify(db_error) {
                Fault::Unavailable => {
                    tracing::warn!(error = %db_error, "database unavailable");
                    (
                        Code::Unavailable,
                        "DATABASE_UNAVAILABLE",
                        "database unavailable; retry with the same key".to_owned(),
                    )
                }
                Fault::LockTimeout => {
                    tracing::info!(error = %db_error, "lock wait timed out");
                    (
                        Code::Aborted,
                        "LOCK_TIMEOUT",
                        "timed out waiting for a concurrent request with the same key or account; retry with the same key".to_owned(),
                    )
                }
                Fault::Transient => {
                    tracing::info!(error = %db_error, "transient database conflict after retries");
                    (Code::Aborted, "CONTENTION", "transaction conflict; retry with the same key".to_owned())
                }
                Fault::Other => {
                    tracing::error!(error = ?db_error, "database error");
                    (Code::Internal, "INTERNAL", "internal error".to_owned())
                }
            },
            Error::Internal(cause) => {
                tracing::error!(%cause, "internal error");
                (Code::Internal, "INTERNAL", "internal error".to_owned())
            }
            Error::InvariantBroken(invariant) => {
                tracing::error!(invariant, "money invariant broken; the write was rolled back");
                (Code::Internal, "INTERNAL", "internal error".to_owned())
            }
        };
        if details.error_info().is_none() {
            details.set_error_info(reason, ERROR_DOMAIN, HashMap::new());
        }
        // One wait, said twice: RetryInfo for clients that read details, the gRFC A6 pushback
        // header for those that retry by service config; the server knows better than the
        // client's backoff here.
        let pushback = retry_pushback(reason);
        if pushback.is_some() {
            details.set_retry_info(pushback);
        }
        let mut status = Status::with_error_details(code, message, details);
        if let Some(value) = pushback.and_then(|wait| wait.as_millis().to_string().parse().ok()) {
            status.metadata_mut().insert(RETRY_PUSHBACK_HEADER, value);
        }
        status
    }
}
