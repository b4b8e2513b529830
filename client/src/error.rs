//! [`CallError`]: a failed call decoded, so that a caller branches on payledger's ErrorInfo
//! reason ([`Reason`]) without decoding `google.rpc` details itself.

use std::collections::HashMap;
use std::time::Duration;

use tonic::{Code, Status};
use tonic_types::StatusExt as _;

/// The `ErrorInfo.domain` of payledger's errors.
pub const ERROR_DOMAIN: &str = "payledger";

macro_rules! reasons {
    ($($(#[$doc:meta])* $variant:ident = $text:literal,)*) => {
        /// The stable `google.rpc.ErrorInfo` reasons of payledger (domain [`ERROR_DOMAIN`]),
        /// one per way a call fails; the error table of the server's `docs/api.md` says which gRPC
        /// code carries each and when. A reason this version does not know (from a newer server) is
        /// [`Reason::Other`].
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum Reason {
            $($(#[$doc])* $variant,)*
            /// A reason this version of the client does not know.
            Other(String),
        }

        impl Reason {
            /// Every reason this version knows, as sent.
            pub const KNOWN: &'static [&'static str] = &[$($text),*];

            /// The reason named `text` (as sent, UPPER_SNAKE).
            pub fn parse(text: &str) -> Self {
                match text {
                    $($text => Reason::$variant,)*
                    other => Reason::Other(other.to_owned()),
                }
            }

            /// The reason as sent.
            pub fn as_str(&self) -> &str {
                match self {
                    $(Reason::$variant => $text,)*
                    Reason::Other(text) => text,
                }
            }
        }
    };
}

reasons! {
    /// UNAUTHENTICATED: no `authorization: Bearer <JWT>`.
    CredentialsMissing = "CREDENTIALS_MISSING",
    /// UNAUTHENTICATED: a credential that cannot be verified.
    CredentialsInvalid = "CREDENTIALS_INVALID",
    /// UNAUTHENTICATED: an expired credential.
    CredentialsExpired = "CREDENTIALS_EXPIRED",
    /// PERMISSION_DENIED: the token does not grant this merchant.
    MerchantNotAllowed = "MERCHANT_NOT_ALLOWED",
    /// PERMISSION_DENIED: the token lacks the RPC's scope (metadata `scope`).
    ScopeMissing = "SCOPE_MISSING",
    /// INVALID_ARGUMENT: not valid protobuf, or broken gRPC framing.
    MalformedRequest = "MALFORMED_REQUEST",
    /// INVALID_ARGUMENT: malformed fields (see [`CallError::field_violations`]).
    InvalidArgument = "INVALID_ARGUMENT",
    AccountNotFound = "ACCOUNT_NOT_FOUND",
    OrderNotFound = "ORDER_NOT_FOUND",
    PaymentNotFound = "PAYMENT_NOT_FOUND",
    RefundNotFound = "REFUND_NOT_FOUND",
    HoldNotFound = "HOLD_NOT_FOUND",
    /// ALREADY_EXISTS: the business key used before with other fields (metadata `key`,
    /// `fields`), as each of the `*_REUSED` reasons.
    AccountAlreadyExists = "ACCOUNT_ALREADY_EXISTS",
    RequestIdReused = "REQUEST_ID_REUSED",
    OrderNoReused = "ORDER_NO_REUSED",
    OutTradeNoReused = "OUT_TRADE_NO_REUSED",
    OutRefundNoReused = "OUT_REFUND_NO_REUSED",
    OutAuthNoReused = "OUT_AUTH_NO_REUSED",
    IdempotencyKeyReused = "IDEMPOTENCY_KEY_REUSED",
    TokenReused = "TOKEN_REUSED",
    /// FAILED_PRECONDITION: the payer's balance is short of the amount.
    InsufficientFunds = "INSUFFICIENT_FUNDS",
    OrderAlreadyPaid = "ORDER_ALREADY_PAID",
    OrderClosed = "ORDER_CLOSED",
    OrderExpired = "ORDER_EXPIRED",
    OrderNotExpired = "ORDER_NOT_EXPIRED",
    OrderNotPaid = "ORDER_NOT_PAID",
    OrderAuthorized = "ORDER_AUTHORIZED",
    OrderNotAuthorized = "ORDER_NOT_AUTHORIZED",
    HoldExpired = "HOLD_EXPIRED",
    HoldVoided = "HOLD_VOIDED",
    HoldNotExpired = "HOLD_NOT_EXPIRED",
    CaptureExceedsAuthorized = "CAPTURE_EXCEEDS_AUTHORIZED",
    RefundExceedsPaid = "REFUND_EXCEEDS_PAID",
    CurrencyMismatch = "CURRENCY_MISMATCH",
    AmountMismatch = "AMOUNT_MISMATCH",
    PayerIsPayee = "PAYER_IS_PAYEE",
    BalanceLimitExceeded = "BALANCE_LIMIT_EXCEEDED",
    TokenInvalid = "TOKEN_INVALID",
    /// ABORTED, retried: optimistic-lock (version CAS) retries ran out.
    Contention = "CONTENTION",
    /// ABORTED, retried: a lock wait passed the server's lock timeout.
    LockTimeout = "LOCK_TIMEOUT",
    /// ABORTED, retried: the committed original of a key is not visible yet.
    KeyNotYetVisible = "KEY_NOT_YET_VISIBLE",
    /// UNAVAILABLE, retried.
    DatabaseUnavailable = "DATABASE_UNAVAILABLE",
    /// UNAVAILABLE, retried.
    TokenStoreUnavailable = "TOKEN_STORE_UNAVAILABLE",
    /// RESOURCE_EXHAUSTED, retried: a bound was reached before any work (metadata `bound`).
    Overloaded = "OVERLOADED",
    /// RESOURCE_EXHAUSTED: the request message is over the server's limit.
    MessageTooLarge = "MESSAGE_TOO_LARGE",
    /// CANCELLED or DEADLINE_EXCEEDED: a queued call whose caller had gone was not started.
    CallerGone = "CALLER_GONE",
    /// DEADLINE_EXCEEDED, retried: the deadline passed while the call ran; it may have been
    /// written, and the same call again is answered once.
    DeadlinePassed = "DEADLINE_PASSED",
    /// INTERNAL: a bug; nothing a retry can fix.
    Internal = "INTERNAL",
}

/// One bad field of an INVALID_ARGUMENT (`google.rpc.BadRequest`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldViolation {
    pub field: String,
    pub description: String,
}

/// A failed call, decoded from its status: the code, payledger's ErrorInfo reason and
/// metadata, the wait the server asked for before a retry (RetryInfo), and the bad fields of
/// an INVALID_ARGUMENT. A status from elsewhere (the transport, the retry layer, a proxy)
/// has no reason.
///
/// ```
/// use payledger_client::{CallError, Reason};
/// # fn on_failure(status: payledger_client::tonic::Status) {
/// match CallError::from(status).reason() {
///     Some(Reason::InsufficientFunds) => { /* ask the payer for another card */ }
///     Some(Reason::OrderAlreadyPaid) => { /* show the order as paid */ }
///     _ => { /* report the failure */ }
/// }
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct CallError {
    status: Status,
    reason: Option<Reason>,
    metadata: HashMap<String, String>,
    retry_delay: Option<Duration>,
    field_violations: Vec<FieldViolation>,
}

impl From<Status> for CallError {
    fn from(status: Status) -> Self {
        let details = status.get_error_details();
        let (reason, metadata) = match details.error_info() {
            Some(info) if info.domain == ERROR_DOMAIN => (Some(Reason::parse(&info.reason)), info.metadata.clone()),
            _ => (None, HashMap::new()),
        };
        let retry_delay = details.retry_info().and_then(|info| info.retry_delay);
        let field_violations = details
            .bad_request()
            .map(|bad| {
                bad.field_violations
                    .iter()
                    .map(|violation| FieldViolation {
                        field: violation.field.clone(),
                        description: violation.description.clone(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        Self { status, reason, metadata, retry_delay, field_violations }
    }
}

impl CallError {
    pub fn code(&self) -> Code {
        self.status.code()
    }

    /// payledger's reason; `None` for a status without payledger's ErrorInfo.
    pub fn reason(&self) -> Option<&Reason> {
        self.reason.as_ref()
    }

    /// The ErrorInfo metadata (for example `fields` of a `*_REUSED`, `bound` of `OVERLOADED`).
    pub fn metadata(&self) -> &HashMap<String, String> {
        &self.metadata
    }

    /// The server's RetryInfo: how long to wait before the same call again.
    pub fn retry_delay(&self) -> Option<Duration> {
        self.retry_delay
    }

    /// The bad fields of an INVALID_ARGUMENT, as the server named them.
    pub fn field_violations(&self) -> &[FieldViolation] {
        &self.field_violations
    }

    /// The status as received.
    pub fn status(&self) -> &Status {
        &self.status
    }

    pub fn into_status(self) -> Status {
        self.status
    }
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.reason {
            Some(reason) => write!(f, "{:?} ({}): {}", self.code(), reason.as_str(), self.status.message()),
            None => write!(f, "{:?}: {}", self.code(), self.status.message()),
        }
    }
}

impl std::error::Error for CallError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.status)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic_types::ErrorDetails;

    #[test]
    fn every_known_reason_parses_to_itself_and_an_unknown_one_is_kept() {
        for text in Reason::KNOWN {
            let reason = Reason::parse(text);
            assert!(!matches!(reason, Reason::Other(_)), "{text}");
            assert_eq!(reason.as_str(), *text);
        }
        assert_eq!(Reason::parse("SOMETHING_NEW"), Reason::Other("SOMETHING_NEW".into()));
        assert_eq!(Reason::parse("SOMETHING_NEW").as_str(), "SOMETHING_NEW");
    }

    #[test]
    fn a_status_decodes_to_its_reason_metadata_retry_delay_and_bad_fields() {
        let mut details = ErrorDetails::new();
        let metadata = HashMap::from([("bound".to_owned(), "concurrency_limit".to_owned())]);
        details.set_error_info("OVERLOADED", ERROR_DOMAIN, metadata.clone());
        details.set_retry_info(Some(Duration::from_millis(100)));
        let error = CallError::from(Status::with_error_details(Code::ResourceExhausted, "busy", details));
        assert_eq!((error.code(), error.reason()), (Code::ResourceExhausted, Some(&Reason::Overloaded)));
        assert_eq!(error.metadata(), &metadata);
        assert_eq!(error.retry_delay(), Some(Duration::from_millis(100)));
        assert_eq!(error.to_string(), "ResourceExhausted (OVERLOADED): busy");

        let mut details = ErrorDetails::new();
        details.set_error_info("INVALID_ARGUMENT", ERROR_DOMAIN, HashMap::new());
        details.add_bad_request_violation("amount", "must be positive");
        let error = CallError::from(Status::with_error_details(Code::InvalidArgument, "bad", details));
        assert_eq!(
            error.field_violations(),
            [FieldViolation { field: "amount".into(), description: "must be positive".into() }]
        );

        // Another domain's ErrorInfo, or none, is no payledger reason.
        let mut details = ErrorDetails::new();
        details.set_error_info("INSUFFICIENT_FUNDS", "example.com", HashMap::new());
        assert_eq!(CallError::from(Status::with_error_details(Code::Unknown, "", details)).reason(), None);
        assert_eq!(CallError::from(Status::unavailable("transport")).reason(), None);
    }
}
