//! Inputs of the use cases, built from domain types only (parsed at the edge).

use crate::domain::{
    AccountId, Actor, Amount, Currency, FreeText, MerchantId, OrderNo, OutAuthNo, OutRefundNo, OutTradeNo, RequestId,
};

#[derive(Debug, Clone)]
pub struct OpenAccount {
    pub account_id: AccountId,
    pub currency: Currency,
}

#[derive(Debug, Clone)]
pub struct Deposit {
    pub request_id: RequestId,
    pub account_id: AccountId,
    pub amount: Amount,
    /// The authenticated caller, recorded as `created_by`.
    pub created_by: Actor,
}

/// A payout: the mirror of [`Deposit`], from the account to the currency's external
/// funding account.
#[derive(Debug, Clone)]
pub struct Withdraw {
    pub request_id: RequestId,
    pub account_id: AccountId,
    pub amount: Amount,
    /// The authenticated caller, recorded as `created_by`.
    pub created_by: Actor,
}

#[derive(Debug, Clone)]
pub struct ListEntries {
    pub account_id: AccountId,
    /// 1..=[`ListEntries::PAGE_SIZE_MAX`].
    pub page_size: u32,
    /// Only entries with a smaller entry_id (the previous page's last); `None` for the first.
    pub before_entry_id: Option<i64>,
}

impl ListEntries {
    pub const PAGE_SIZE_DEFAULT: u32 = 50;
    pub const PAGE_SIZE_MAX: u32 = 500;
}

#[derive(Debug, Clone)]
pub struct CreateOrder {
    pub merchant_id: MerchantId,
    pub order_no: OrderNo,
    pub payee_account_id: AccountId,
    pub amount: Amount,
    pub subject: FreeText,
    /// When the order stops being payable (microseconds since the Unix epoch), as the caller
    /// gave it; `None`: the server's default (`--order-ttl-seconds` from now, or never).
    pub expires_at: Option<i64>,
}

#[derive(Debug, Clone)]
pub struct Pay {
    pub merchant_id: MerchantId,
    pub out_trade_no: OutTradeNo,
    pub order_no: OrderNo,
    pub payer_account_id: AccountId,
    pub amount: Amount,
    /// The authenticated caller, recorded as `created_by`.
    pub created_by: Actor,
}

#[derive(Debug, Clone)]
pub struct Refund {
    pub merchant_id: MerchantId,
    pub out_trade_no: OutTradeNo,
    pub out_refund_no: OutRefundNo,
    pub amount: Amount,
    pub reason: FreeText,
    /// The authenticated caller, recorded as `created_by`.
    pub created_by: Actor,
}

/// Which business number a Query looks an order up by.
#[derive(Debug, Clone)]
pub enum QueryKey {
    OutTradeNo(OutTradeNo),
    OrderNo(OrderNo),
    OutRefundNo(OutRefundNo),
}

#[derive(Debug, Clone)]
pub struct Transfer {
    pub from_account_id: AccountId,
    /// Differs from `from_account_id` (checked at the edge).
    pub to_account_id: AccountId,
    pub amount: Amount,
    pub memo: FreeText,
    /// The authenticated caller, recorded as `created_by`.
    pub created_by: Actor,
}

/// An authorization hold of an order's amount on the payer's account.
#[derive(Debug, Clone)]
pub struct Authorize {
    pub merchant_id: MerchantId,
    pub out_auth_no: OutAuthNo,
    pub order_no: OrderNo,
    pub payer_account_id: AccountId,
    /// Equal to the order's amount (checked against the order).
    pub amount: Amount,
    /// The authenticated caller, recorded as `created_by`.
    pub created_by: Actor,
}

/// The capture of all or part of a hold, as a payment under `out_trade_no`.
#[derive(Debug, Clone)]
pub struct Capture {
    pub merchant_id: MerchantId,
    pub out_auth_no: OutAuthNo,
    pub out_trade_no: OutTradeNo,
    /// More than zero, at most the authorized amount (checked against the hold).
    pub amount: Amount,
    /// The authenticated caller, recorded as `created_by` of the payment.
    pub created_by: Actor,
}

/// The release of a hold.
#[derive(Debug, Clone)]
pub struct Void {
    pub merchant_id: MerchantId,
    pub out_auth_no: OutAuthNo,
}
