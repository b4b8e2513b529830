//! Pure types and rules of the ledger: money, business numbers and the order state machine.
//!
//! Nothing here does I/O. Raw strings from the wire become these types once, at the edge
//! (`crate::grpc`), and everything deeper speaks them.

mod actor;
mod keys;
mod money;
mod order;

pub use actor::{Actor, Subject, CREATED_BY_UNKNOWN};
pub use keys::{
    AccountId, FreeText, IdempotencyKey, MerchantId, OneTimeToken, OrderNo, OutAuthNo, OutRefundNo, OutTradeNo,
    RequestId, BUSINESS_NO_LEN_MAX,
};
pub use money::{format_minor, Amount, Currency, AMOUNT_MINOR_UNITS_MAX, BALANCE_MINOR_UNITS_MAX};
pub use order::{CloseReason, OrderEvent, OrderState, OrderStatus, Transition};

use std::fmt;

/// One rejected input field: which field (the proto field name) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldViolation {
    pub field: &'static str,
    pub description: String,
}

impl FieldViolation {
    pub fn new(field: &'static str, description: impl Into<String>) -> Self {
        Self { field, description: description.into() }
    }
}

impl fmt::Display for FieldViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.description)
    }
}

/// A business rule that refuses a well-formed request in the current state. Each maps to
/// gRPC FAILED_PRECONDITION with the reason given by [`Rejection::reason`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    #[error("insufficient funds")]
    InsufficientFunds,
    #[error("the order is already paid")]
    OrderAlreadyPaid,
    #[error("the order is closed")]
    OrderClosed,
    #[error("the order expired before it was paid")]
    OrderExpired,
    /// Only the sweeper sees this one: the order it meant to expire is not past its deadline.
    #[error("the order has not expired")]
    OrderNotExpired,
    #[error("the order is authorized: capture or void its hold")]
    OrderAuthorized,
    #[error("the order has no active authorization hold")]
    OrderNotAuthorized,
    #[error("the authorization hold expired before it was captured")]
    HoldExpired,
    #[error("the authorization hold was voided")]
    HoldVoided,
    /// Only the sweeper sees this one: the hold it meant to release is not past its deadline.
    #[error("the authorization hold has not expired")]
    HoldNotExpired,
    #[error("the capture would exceed the authorized amount")]
    CaptureExceedsAuthorized,
    #[error("the order is not paid")]
    OrderNotPaid,
    #[error("the refund would exceed the amount paid")]
    RefundExceedsPaid,
    #[error("currency does not match")]
    CurrencyMismatch,
    #[error("amount does not match the order's amount")]
    AmountMismatch,
    #[error("payer and payee must be different accounts")]
    PayerIsPayee,
    #[error("the balance would exceed the largest balance the ledger holds")]
    BalanceLimitExceeded,
    #[error("the idempotency token is unknown, expired or issued to another merchant or caller")]
    TokenInvalid,
}

impl Rejection {
    /// The stable `google.rpc.ErrorInfo` reason.
    pub fn reason(self) -> &'static str {
        match self {
            Rejection::InsufficientFunds => "INSUFFICIENT_FUNDS",
            Rejection::OrderAlreadyPaid => "ORDER_ALREADY_PAID",
            Rejection::OrderClosed => "ORDER_CLOSED",
            Rejection::OrderExpired => "ORDER_EXPIRED",
            Rejection::OrderNotExpired => "ORDER_NOT_EXPIRED",
            Rejection::OrderAuthorized => "ORDER_AUTHORIZED",
            Rejection::OrderNotAuthorized => "ORDER_NOT_AUTHORIZED",
            Rejection::HoldExpired => "HOLD_EXPIRED",
            Rejection::HoldVoided => "HOLD_VOIDED",
            Rejection::HoldNotExpired => "HOLD_NOT_EXPIRED",
            Rejection::CaptureExceedsAuthorized => "CAPTURE_EXCEEDS_AUTHORIZED",
            Rejection::OrderNotPaid => "ORDER_NOT_PAID",
            Rejection::RefundExceedsPaid => "REFUND_EXCEEDS_PAID",
            Rejection::CurrencyMismatch => "CURRENCY_MISMATCH",
            Rejection::AmountMismatch => "AMOUNT_MISMATCH",
            Rejection::PayerIsPayee => "PAYER_IS_PAYEE",
            Rejection::BalanceLimitExceeded => "BALANCE_LIMIT_EXCEEDED",
            Rejection::TokenInvalid => "TOKEN_INVALID",
        }
    }
}
