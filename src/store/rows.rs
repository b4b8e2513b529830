//! Rows as stored: amounts in minor units, timestamps in microseconds since the Unix epoch.

use crate::domain::CREATED_BY_UNKNOWN;

fn created_by_unknown() -> String {
    CREATED_BY_UNKNOWN.to_owned()
}

/// `accounts`: one per account; `kind` is `CUSTOMER` or `EXTERNAL` (the per-currency funding
/// account, the only one allowed below zero).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, sqlx::FromRow)]
pub struct AccountRow {
    pub account_id: String,
    pub currency: String,
    pub kind: String,
    pub balance: i64,
    pub version: i64,
    pub created_at: i64,
    pub updated_at: i64,
    /// The sum of the account's ACTIVE authorization holds: `balance - held` is what it can
    /// spend. Changed by conditional UPDATEs of its own, never by the version CAS.
    #[serde(default)]
    pub held: i64,
    /// The `entry_hash` of its latest chained entry, 64 hex digits (see [`super::chain`]);
    /// `None` before its first.
    #[serde(default)]
    pub chain_hash: Option<String>,
}

/// `orders`, keyed by (merchant_id, order_no).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, sqlx::FromRow)]
pub struct OrderRow {
    pub merchant_id: String,
    pub order_no: String,
    pub payee_account_id: String,
    pub amount: i64,
    pub currency: String,
    pub subject: String,
    pub status: String,
    pub out_trade_no: Option<String>,
    pub refunded_amount: i64,
    pub created_at: i64,
    pub updated_at: i64,
    /// When a PENDING order stops being payable; `None`: never.
    #[serde(default)]
    pub expires_at: Option<i64>,
    /// Why a CLOSED order closed (`MERCHANT` or `EXPIRED`); `None` while it is open, and in
    /// orders closed before reasons were kept.
    #[serde(default)]
    pub close_reason: Option<String>,
}

/// `holds`: one authorization hold per order, unique on (merchant_id, out_auth_no); `status`
/// is `ACTIVE`, `CAPTURED`, `VOIDED` or `EXPIRED`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, sqlx::FromRow)]
pub struct HoldRow {
    pub hold_no: String,
    pub merchant_id: String,
    pub out_auth_no: String,
    pub order_no: String,
    pub payer_account_id: String,
    pub amount: i64,
    pub currency: String,
    pub status: String,
    pub captured_amount: i64,
    /// The capture's payment; `None` unless CAPTURED.
    pub out_trade_no: Option<String>,
    pub expires_at: i64,
    pub created_at: i64,
    pub updated_at: i64,
    pub created_by: String,
}

/// `payment_flow`: one row per successful payment, unique on (merchant_id, out_trade_no)
/// and on (merchant_id, order_no).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, sqlx::FromRow)]
pub struct PaymentRow {
    pub trade_no: String,
    pub merchant_id: String,
    pub out_trade_no: String,
    pub order_no: String,
    pub payer_account_id: String,
    pub payee_account_id: String,
    pub amount: i64,
    pub currency: String,
    pub status: String,
    pub created_at: i64,
    /// The `sub` of the caller that made it; `unknown` in rows older than the column.
    #[serde(default = "created_by_unknown")]
    pub created_by: String,
}

/// `refunds`: one row per successful refund, unique on (merchant_id, out_refund_no).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, sqlx::FromRow)]
pub struct RefundRow {
    pub refund_no: String,
    pub merchant_id: String,
    pub out_refund_no: String,
    pub out_trade_no: String,
    pub order_no: String,
    pub amount: i64,
    pub currency: String,
    pub reason: String,
    pub created_at: i64,
    /// The `sub` of the caller that made it; `unknown` in rows older than the column.
    #[serde(default = "created_by_unknown")]
    pub created_by: String,
    /// What its order had refunded right after it, this refund included (minor units);
    /// `None` in rows older than the column.
    #[serde(default)]
    pub order_refunded_after: Option<i64>,
}

/// `deposits` or `withdrawals`: one row per successful Deposit or Withdraw, keyed by
/// request_id; `funding_id` is the server-issued deposit_id or withdrawal_id (the posting_id
/// of its entries).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct FundingRow {
    pub request_id: String,
    pub funding_id: String,
    pub account_id: String,
    pub amount: i64,
    pub currency: String,
    pub created_at: i64,
    /// The `sub` of the caller that made it; `unknown` in rows older than the column.
    pub created_by: String,
    /// What the account's active holds reserved right after it (minor units); `None` in rows
    /// older than the column.
    pub held_after: Option<i64>,
}

/// `journal_entries`: one leg of a double-entry posting.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, sqlx::FromRow)]
pub struct EntryRow {
    pub entry_id: i64,
    pub account_id: String,
    pub currency: String,
    pub amount: i64,
    pub balance_after: i64,
    pub version_after: i64,
    pub kind: String,
    pub reference: String,
    pub posting_id: String,
    pub counterparty_account_id: String,
    pub created_at: i64,
    /// The `sub` of the caller that made it; `unknown` in rows older than the column.
    #[serde(default = "created_by_unknown")]
    pub created_by: String,
}

/// A journal entry about to be written (the database assigns `entry_id`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewEntry<'a> {
    pub account_id: &'a str,
    pub currency: &'a str,
    pub amount: i64,
    pub balance_after: i64,
    pub version_after: i64,
    pub kind: &'static str,
    pub reference: &'a str,
    pub posting_id: &'a str,
    pub counterparty_account_id: &'a str,
    pub created_at: i64,
    pub created_by: &'a str,
    /// Its hash chained to its account's entry before it, 64 hex digits (see [`super::chain`]),
    /// set by the write that chains it.
    pub entry_hash: String,
}

impl NewEntry<'_> {
    /// The fields its hash covers.
    #[must_use]
    pub fn chained(&self) -> super::chain::ChainedEntry<'_> {
        super::chain::ChainedEntry {
            account_id: self.account_id,
            currency: self.currency,
            amount: self.amount,
            balance_after: self.balance_after,
            version_after: self.version_after,
            kind: self.kind,
            reference: self.reference,
            posting_id: self.posting_id,
            counterparty_account_id: self.counterparty_account_id,
            created_at: self.created_at,
            created_by: self.created_by,
        }
    }
}

/// A new balance and held amount for one account (minor units), written by version CAS:
/// only if the stored version is still `expected_version` and the stored held amount still
/// `expected_held`, and then the version becomes `version` (unchanged when only `held` moves: a
/// hold reserved or released posts no entry, so the version alone would not show it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BalanceUpdate<'a> {
    pub account_id: &'a str,
    pub balance: i64,
    /// What the account's active holds reserve after the write.
    pub held: i64,
    pub expected_version: i64,
    pub version: i64,
    /// The held amount the write read (minor units).
    pub expected_held: i64,
    /// The account's chain hash after the write: the hash of its last new entry, or the one it
    /// had when it posts none.
    pub chain_hash: Option<&'a str>,
}

/// One audit check finished: which, its place among the checks the audit runs (1-based, of
/// `of`) and how many violations it found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AuditProgress {
    pub check: &'static str,
    pub done: usize,
    pub of: usize,
    pub violations: usize,
}

/// One broken ledger invariant found by the audit: which check, and the offending key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditViolation {
    pub check: &'static str,
    pub subject: String,
    pub detail: String,
}

/// `idempotency_record`: a client's idempotency key (or a consumed one-time token) and the
/// response of the call that used it, unique on (scope, idempotency_key).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct IdempotencyRecordRow {
    pub scope: String,
    pub idempotency_key: String,
    pub method: String,
    /// Hex SHA-256 of `request_fields`.
    pub request_fingerprint: String,
    /// The request's business fields, one `name=value` per line (UTF-8), for naming
    /// differences.
    pub request_fields: Vec<u8>,
    /// Not NULL once the record is answered (set in the same transaction as the business
    /// change): the answer as JSON of rows (UTF-8) in records written before the response
    /// message was stored (migration 0003), which replay from it; empty in later records,
    /// which replay from `response_message`. (Releases between migration 0003 and the one
    /// that stopped writing it stored both.)
    pub response: Option<Vec<u8>>,
    /// The response message as the caller received it (encoded protobuf); `None` in records
    /// written before it was stored.
    pub response_message: Option<Vec<u8>>,
    /// The scope of the caller that made the record (for a token's record, whose `scope` is
    /// the token's); `None` in records written before it was stored.
    pub caller_scope: Option<String>,
    pub status: String,
    pub created_at: i64,
    pub expires_at: i64,
}

/// `idempotency_token`: a one-time token of the database token store.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct TokenRow {
    pub token: String,
    pub merchant_id: String,
    pub purpose: String,
    pub created_at: i64,
    pub expires_at: i64,
    pub consumed_at: Option<i64>,
    /// The scope tag of the caller it was issued to (see `Actor::scope_tag`); `None` when
    /// issued without authentication.
    pub caller_tag: Option<String>,
}

/// `transfers`: one row per transfer between two accounts.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, sqlx::FromRow)]
pub struct TransferRow {
    pub transfer_id: String,
    pub from_account_id: String,
    pub to_account_id: String,
    pub amount: i64,
    pub currency: String,
    pub memo: String,
    pub created_at: i64,
    /// The `sub` of the caller that made it; `unknown` in rows older than the column.
    #[serde(default = "created_by_unknown")]
    pub created_by: String,
}
