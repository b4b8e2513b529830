//! Answers as the caller receives them: stored records to the API's wire messages. The
//! idempotency driver stores the encoded response message of a keyed call from these, and the
//! transport encodes the answers of reads with them.

use prost_types::Timestamp;

use crate::domain::{format_minor, CloseReason, Currency, OrderStatus};
use crate::error::Error;
use crate::proto;
use crate::store::{AccountRow, EntryRow, HoldRow, OrderRow, PaymentRow, RefundRow, TransferRow};

/// Minor units of a stored currency code as a decimal string.
fn money(minor_units: i64, currency_code: &str) -> Result<String, Error> {
    let currency = Currency::parse("currency", currency_code)
        .map_err(|_| Error::Internal(format!("stored currency {currency_code:?} is not ISO 4217")))?;
    Ok(format_minor(minor_units, currency))
}

/// Microseconds since the Unix epoch as a protobuf Timestamp.
pub fn timestamp(micros: i64) -> Option<Timestamp> {
    let nanos = i32::try_from(micros.rem_euclid(1_000_000) * 1_000).unwrap_or(0);
    Some(Timestamp { seconds: micros.div_euclid(1_000_000), nanos })
}

pub fn account(row: AccountRow) -> Result<proto::Account, Error> {
    Ok(proto::Account {
        balance: money(row.balance, &row.currency)?,
        available_balance: money(row.balance - row.held, &row.currency)?,
        account_id: row.account_id,
        currency: row.currency,
        version: row.version,
        created_at: timestamp(row.created_at),
        updated_at: timestamp(row.updated_at),
    })
}

pub fn entry(row: EntryRow) -> Result<proto::Entry, Error> {
    let kind = match row.kind.as_str() {
        "DEPOSIT" => proto::EntryKind::Deposit,
        "PAY" => proto::EntryKind::Pay,
        "REFUND" => proto::EntryKind::Refund,
        "TRANSFER" => proto::EntryKind::Transfer,
        "WITHDRAWAL" => proto::EntryKind::Withdrawal,
        _ => proto::EntryKind::Unspecified,
    };
    Ok(proto::Entry {
        entry_id: row.entry_id,
        amount: money(row.amount, &row.currency)?,
        balance_after: money(row.balance_after, &row.currency)?,
        account_id: row.account_id,
        currency: row.currency,
        version_after: row.version_after,
        kind: kind.into(),
        reference: row.reference,
        posting_id: row.posting_id,
        counterparty_account_id: row.counterparty_account_id,
        created_at: timestamp(row.created_at),
        created_by: row.created_by,
    })
}

pub fn order(row: OrderRow) -> Result<proto::Order, Error> {
    let status = match OrderStatus::from_stored(&row.status) {
        Some(OrderStatus::Pending) => proto::OrderStatus::Pending,
        Some(OrderStatus::Authorized) => proto::OrderStatus::Authorized,
        Some(OrderStatus::Paid) => proto::OrderStatus::Paid,
        Some(OrderStatus::PartiallyRefunded) => proto::OrderStatus::PartiallyRefunded,
        Some(OrderStatus::Refunded) => proto::OrderStatus::Refunded,
        Some(OrderStatus::Closed) => proto::OrderStatus::Closed,
        None => proto::OrderStatus::Unspecified,
    };
    let close_reason = match row.close_reason.as_deref().and_then(CloseReason::from_stored) {
        Some(CloseReason::Merchant) => proto::OrderCloseReason::Merchant,
        Some(CloseReason::Expired) => proto::OrderCloseReason::Expired,
        Some(CloseReason::Voided) => proto::OrderCloseReason::Voided,
        Some(CloseReason::HoldExpired) => proto::OrderCloseReason::HoldExpired,
        None => proto::OrderCloseReason::Unspecified,
    };
    Ok(proto::Order {
        amount: money(row.amount, &row.currency)?,
        refunded_amount: money(row.refunded_amount, &row.currency)?,
        merchant_id: row.merchant_id,
        order_no: row.order_no,
        payee_account_id: row.payee_account_id,
        currency: row.currency,
        subject: row.subject,
        status: status.into(),
        out_trade_no: row.out_trade_no.unwrap_or_default(),
        created_at: timestamp(row.created_at),
        updated_at: timestamp(row.updated_at),
        expires_at: row.expires_at.and_then(timestamp),
        close_reason: close_reason.into(),
    })
}

pub fn payment(row: PaymentRow) -> Result<proto::Payment, Error> {
    Ok(proto::Payment {
        amount: money(row.amount, &row.currency)?,
        trade_no: row.trade_no,
        merchant_id: row.merchant_id,
        out_trade_no: row.out_trade_no,
        order_no: row.order_no,
        payer_account_id: row.payer_account_id,
        payee_account_id: row.payee_account_id,
        currency: row.currency,
        status: proto::PaymentStatus::Succeeded.into(),
        created_at: timestamp(row.created_at),
        created_by: row.created_by,
    })
}

pub fn hold(row: HoldRow) -> Result<proto::Hold, Error> {
    use super::holds::{HOLD_ACTIVE, HOLD_CAPTURED, HOLD_EXPIRED, HOLD_VOIDED};
    let status = match row.status.as_str() {
        HOLD_ACTIVE => proto::HoldStatus::Active,
        HOLD_CAPTURED => proto::HoldStatus::Captured,
        HOLD_VOIDED => proto::HoldStatus::Voided,
        HOLD_EXPIRED => proto::HoldStatus::Expired,
        _ => proto::HoldStatus::Unspecified,
    };
    Ok(proto::Hold {
        amount: money(row.amount, &row.currency)?,
        captured_amount: money(row.captured_amount, &row.currency)?,
        hold_no: row.hold_no,
        merchant_id: row.merchant_id,
        out_auth_no: row.out_auth_no,
        order_no: row.order_no,
        payer_account_id: row.payer_account_id,
        currency: row.currency,
        status: status.into(),
        out_trade_no: row.out_trade_no.unwrap_or_default(),
        expires_at: timestamp(row.expires_at),
        created_at: timestamp(row.created_at),
        updated_at: timestamp(row.updated_at),
        created_by: row.created_by,
    })
}

pub fn refund(row: RefundRow) -> Result<proto::Refund, Error> {
    Ok(proto::Refund {
        amount: money(row.amount, &row.currency)?,
        refund_no: row.refund_no,
        out_refund_no: row.out_refund_no,
        out_trade_no: row.out_trade_no,
        currency: row.currency,
        reason: row.reason,
        created_at: timestamp(row.created_at),
        merchant_id: row.merchant_id,
        order_no: row.order_no,
        created_by: row.created_by,
    })
}

pub fn transfer(row: TransferRow) -> Result<proto::Transfer, Error> {
    Ok(proto::Transfer {
        amount: money(row.amount, &row.currency)?,
        transfer_id: row.transfer_id,
        from_account_id: row.from_account_id,
        to_account_id: row.to_account_id,
        currency: row.currency,
        memo: row.memo,
        created_at: timestamp(row.created_at),
        created_by: row.created_by,
    })
}
