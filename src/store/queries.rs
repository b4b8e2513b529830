//! The statements of one call's transaction and of the audit, each in the form every backend
//! takes (see [`Sql`]), and the store's operations over them.

use sqlx::any::{AnyArguments, AnyRow};
use sqlx::query::{Query, QueryAs};
use sqlx::AnyConnection;
use sqlx::{Any, FromRow, Row};

use super::batch::{self, Value};
use super::chain::{self, ChainedEntry, Hash};
use super::dialect::{Dialect, Sql};
use super::rows::{
    AccountRow, AuditProgress, AuditViolation, BalanceUpdate, EntryRow, FundingRow, HoldRow, IdempotencyRecordRow,
    NewEntry, OrderRow, PaymentRow, RefundRow, TokenRow, TransferRow,
};

/// The column lists of the rows in `rows.rs`, written once for every SELECT of that row.
macro_rules! account_columns {
    () => {
        "account_id, currency, kind, balance, version, created_at, updated_at, held, chain_hash"
    };
}
pub(super) use account_columns;
macro_rules! entry_columns {
    () => {
        "entry_id, account_id, currency, amount, balance_after, version_after, kind, reference, posting_id, \
         counterparty_account_id, created_at, created_by"
    };
}
pub(super) use entry_columns;
macro_rules! order_columns {
    () => {
        "merchant_id, order_no, payee_account_id, amount, currency, subject, status, out_trade_no, refunded_amount, \
         created_at, updated_at, expires_at, close_reason"
    };
}
pub(super) use order_columns;
/// The start of the INSERTs that write these rows, written once for the one-row statements and
/// the batch statements of `batch`.
macro_rules! insert_payment_into {
    () => {
        "INSERT INTO payment_flow (trade_no, merchant_id, out_trade_no, order_no, payer_account_id, \
         payee_account_id, amount, currency, status, created_at, created_by)"
    };
}
pub(super) use insert_payment_into;
macro_rules! insert_entry_into {
    () => {
        "INSERT INTO journal_entries (account_id, currency, amount, balance_after, version_after, kind, reference, \
         posting_id, counterparty_account_id, created_at, created_by, entry_hash)"
    };
}
pub(super) use insert_entry_into;
macro_rules! insert_refund_into {
    () => {
        "INSERT INTO refunds (refund_no, merchant_id, out_refund_no, out_trade_no, order_no, amount, currency, reason, \
         created_at, created_by, order_refunded_after)"
    };
}
pub(super) use insert_refund_into;
macro_rules! refund_columns {
    () => {
        "refund_no, merchant_id, out_refund_no, out_trade_no, order_no, amount, currency, reason, created_at, created_by, \
         order_refunded_after"
    };
}
pub(super) use refund_columns;
macro_rules! insert_transfer_into {
    () => {
        "INSERT INTO transfers (transfer_id, from_account_id, to_account_id, amount, currency, memo, created_at, \
         created_by)"
    };
}
pub(super) use insert_transfer_into;
macro_rules! insert_deposit_into {
    () => {
        "INSERT INTO deposits (request_id, deposit_id, account_id, amount, currency, created_at, created_by, held_after)"
    };
}
pub(super) use insert_deposit_into;
macro_rules! insert_withdrawal_into {
    () => {
        "INSERT INTO withdrawals (request_id, withdrawal_id, account_id, amount, currency, created_at, created_by, \
         held_after)"
    };
}
pub(super) use insert_withdrawal_into;
macro_rules! insert_order_into {
    () => {
        "INSERT INTO orders (merchant_id, order_no, payee_account_id, amount, currency, subject, status, out_trade_no, \
         refunded_amount, created_at, updated_at, expires_at, close_reason, pending_deadline)"
    };
}
pub(super) use insert_order_into;

static FIND_ACCOUNT: Sql = Sql::pair(
    concat!("SELECT ", account_columns!(), " FROM accounts WHERE account_id = $1"),
    concat!("SELECT ", account_columns!(), " FROM accounts WHERE account_id = ?"),
);
static FIND_TWO_ACCOUNTS: Sql = Sql::pair(
    concat!("SELECT ", account_columns!(), " FROM accounts WHERE account_id IN ($1, $2)"),
    concat!("SELECT ", account_columns!(), " FROM accounts WHERE account_id IN (?, ?)"),
);
static INSERT_ACCOUNT: Sql = Sql {
    postgres: "INSERT INTO accounts (account_id, currency, kind, balance, version, created_at, updated_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT DO NOTHING",
    mysql: "INSERT INTO accounts (account_id, currency, kind, balance, version, created_at, updated_at) \
     VALUES (?, ?, ?, ?, ?, ?, ?)",
    sqlite: "INSERT INTO accounts (account_id, currency, kind, balance, version, created_at, updated_at) \
     VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
};
static FIND_ENTRY: Sql = Sql::pair(
    concat!("SELECT ", entry_columns!(), " FROM journal_entries WHERE posting_id = $1 AND account_id = $2"),
    concat!("SELECT ", entry_columns!(), " FROM journal_entries WHERE posting_id = ? AND account_id = ?"),
);
static LIST_ENTRIES: Sql = Sql::pair(
    concat!(
        "SELECT ",
        entry_columns!(),
        " FROM journal_entries WHERE account_id = $1 AND entry_id < $2 ORDER BY entry_id DESC LIMIT $3"
    ),
    concat!(
        "SELECT ",
        entry_columns!(),
        " FROM journal_entries WHERE account_id = ? AND entry_id < ? ORDER BY entry_id DESC LIMIT ?"
    ),
);

static FIND_ORDER: Sql = Sql::pair(
    concat!("SELECT ", order_columns!(), " FROM orders WHERE merchant_id = $1 AND order_no = $2"),
    concat!("SELECT ", order_columns!(), " FROM orders WHERE merchant_id = ? AND order_no = ?"),
);
static FIND_ORDER_FOR_UPDATE: Sql = Sql {
    postgres: concat!(
        "SELECT ",
        order_columns!(),
        " FROM orders WHERE merchant_id = $1 AND order_no = $2 FOR NO KEY UPDATE"
    ),
    mysql: concat!("SELECT ", order_columns!(), " FROM orders WHERE merchant_id = ? AND order_no = ? FOR UPDATE"),
    sqlite: concat!("SELECT ", order_columns!(), " FROM orders WHERE merchant_id = ? AND order_no = ?"),
};
/// The sweepers' lock: an order that another transaction holds is skipped, not waited for.
static TRY_LOCK_ORDER: Sql = Sql {
    postgres: concat!(
        "SELECT ",
        order_columns!(),
        " FROM orders WHERE merchant_id = $1 AND order_no = $2 FOR NO KEY UPDATE SKIP LOCKED"
    ),
    mysql: concat!(
        "SELECT ",
        order_columns!(),
        " FROM orders WHERE merchant_id = ? AND order_no = ? FOR UPDATE SKIP LOCKED"
    ),
    sqlite: concat!("SELECT ", order_columns!(), " FROM orders WHERE merchant_id = ? AND order_no = ?"),
};
static INSERT_ORDER: Sql = Sql {
    postgres: concat!(
        insert_order_into!(),
        " VALUES ($1, $2, $3, $4, $5, $6, $7, NULL, 0, $8, $9, $10, NULL, $11) ON CONFLICT DO NOTHING"
    ),
    mysql: concat!(insert_order_into!(), " VALUES (?, ?, ?, ?, ?, ?, ?, NULL, 0, ?, ?, ?, NULL, ?)"),
    sqlite: concat!(
        insert_order_into!(),
        " VALUES (?, ?, ?, ?, ?, ?, ?, NULL, 0, ?, ?, ?, NULL, ?) ON CONFLICT DO NOTHING"
    ),
};
/// PENDING -> CLOSED by CloseOrder (reason MERCHANT). Every transition from PENDING also
/// clears `pending_deadline`, the sweeper's key.
static CLOSE_ORDER: Sql = Sql::pair(
    "UPDATE orders SET status = 'CLOSED', close_reason = $1, updated_at = $2, pending_deadline = NULL \
     WHERE merchant_id = $3 AND order_no = $4 AND status = 'PENDING'",
    "UPDATE orders SET status = 'CLOSED', close_reason = ?, updated_at = ?, pending_deadline = NULL \
     WHERE merchant_id = ? AND order_no = ? AND status = 'PENDING'",
);
/// PENDING -> CLOSED by the sweeper (reason EXPIRED): the same conditional UPDATE, and only
/// once the order's expires_at has passed.
static EXPIRE_ORDER: Sql = Sql::pair(
    "UPDATE orders SET status = 'CLOSED', close_reason = $1, updated_at = $2, pending_deadline = NULL \
     WHERE merchant_id = $3 AND order_no = $4 AND status = 'PENDING' AND expires_at <= $5",
    "UPDATE orders SET status = 'CLOSED', close_reason = ?, updated_at = ?, pending_deadline = NULL \
     WHERE merchant_id = ? AND order_no = ? AND status = 'PENDING' AND expires_at <= ?",
);
/// The PENDING orders whose expires_at has passed, oldest deadline first, at most `?`.
/// Why a column of its own: `docs/decisions/010-sweeper-pending-deadline.md`.
static FIND_EXPIRED_ORDERS: Sql = Sql::pair(
    "SELECT merchant_id, order_no FROM orders WHERE pending_deadline <= $1 ORDER BY pending_deadline LIMIT $2",
    "SELECT merchant_id, order_no FROM orders WHERE pending_deadline <= ? ORDER BY pending_deadline LIMIT ?",
);
static MARK_ORDER_PAID: Sql = Sql::pair(
    "UPDATE orders SET status = 'PAID', out_trade_no = $1, updated_at = $2, pending_deadline = NULL \
     WHERE merchant_id = $3 AND order_no = $4 AND status = 'PENDING'",
    "UPDATE orders SET status = 'PAID', out_trade_no = ?, updated_at = ?, pending_deadline = NULL \
     WHERE merchant_id = ? AND order_no = ? AND status = 'PENDING'",
);
static TRANSITION_ORDER: Sql = Sql::pair(
    "UPDATE orders SET status = $1, refunded_amount = $2, updated_at = $3 \
     WHERE merchant_id = $4 AND order_no = $5 AND status = $6 AND refunded_amount = $7 AND $8 <= amount",
    "UPDATE orders SET status = ?, refunded_amount = ?, updated_at = ? \
     WHERE merchant_id = ? AND order_no = ? AND status = ? AND refunded_amount = ? AND ? <= amount",
);

macro_rules! hold_columns {
    () => {
        "hold_no, merchant_id, out_auth_no, order_no, payer_account_id, amount, currency, status, captured_amount, \
         out_trade_no, expires_at, created_at, updated_at, created_by"
    };
}
/// An order and its hold (if any), for Query: one round trip.
macro_rules! order_and_hold_select {
    () => {
        "SELECT o.merchant_id, o.order_no, o.payee_account_id, o.amount, o.currency, o.subject, o.status, \
         o.out_trade_no, o.refunded_amount, o.created_at, o.updated_at, o.expires_at, o.close_reason, \
         h.hold_no AS h_hold_no, h.out_auth_no AS h_out_auth_no, h.payer_account_id AS h_payer_account_id, \
         h.amount AS h_amount, h.currency AS h_currency, h.status AS h_status, h.captured_amount AS h_captured_amount, \
         h.out_trade_no AS h_out_trade_no, h.expires_at AS h_expires_at, h.created_at AS h_created_at, \
         h.updated_at AS h_updated_at, h.created_by AS h_created_by \
         FROM orders o LEFT JOIN holds h ON h.merchant_id = o.merchant_id AND h.order_no = o.order_no"
    };
}
static FIND_ORDER_AND_HOLD: Sql = Sql::pair(
    concat!(order_and_hold_select!(), " WHERE o.merchant_id = $1 AND o.order_no = $2"),
    concat!(order_and_hold_select!(), " WHERE o.merchant_id = ? AND o.order_no = ?"),
);
static INSERT_HOLD: Sql = Sql {
    postgres: concat!(
        "INSERT INTO holds (",
        hold_columns!(),
        ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14) ON CONFLICT DO NOTHING"
    ),
    mysql: concat!("INSERT INTO holds (", hold_columns!(), ") VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"),
    sqlite: concat!(
        "INSERT INTO holds (",
        hold_columns!(),
        ") VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
    ),
};
static FIND_HOLD: Sql = Sql::pair(
    concat!("SELECT ", hold_columns!(), " FROM holds WHERE merchant_id = $1 AND out_auth_no = $2"),
    concat!("SELECT ", hold_columns!(), " FROM holds WHERE merchant_id = ? AND out_auth_no = ?"),
);
static FIND_HOLD_OF_ORDER: Sql = Sql::pair(
    concat!("SELECT ", hold_columns!(), " FROM holds WHERE merchant_id = $1 AND order_no = $2"),
    concat!("SELECT ", hold_columns!(), " FROM holds WHERE merchant_id = ? AND order_no = ?"),
);
/// ACTIVE -> CAPTURED, VOIDED or EXPIRED, only while ACTIVE.
static SETTLE_HOLD: Sql = Sql::pair(
    "UPDATE holds SET status = $1, captured_amount = $2, out_trade_no = $3, updated_at = $4 WHERE hold_no = $5 AND status = 'ACTIVE'",
    "UPDATE holds SET status = ?, captured_amount = ?, out_trade_no = ?, updated_at = ? WHERE hold_no = ? AND status = 'ACTIVE'",
);
/// ACTIVE holds whose expires_at is at or before `?`, earliest first, at most `?`.
static FIND_EXPIRED_HOLDS: Sql = Sql::pair(
    "SELECT merchant_id, order_no FROM holds WHERE status = 'ACTIVE' AND expires_at <= $1 ORDER BY expires_at LIMIT $2",
    "SELECT merchant_id, order_no FROM holds WHERE status = 'ACTIVE' AND expires_at <= ? ORDER BY expires_at LIMIT ?",
);
/// PENDING -> AUTHORIZED.
static AUTHORIZE_ORDER: Sql = Sql::pair(
    "UPDATE orders SET status = 'AUTHORIZED', updated_at = $1, pending_deadline = NULL \
     WHERE merchant_id = $2 AND order_no = $3 AND status = 'PENDING'",
    "UPDATE orders SET status = 'AUTHORIZED', updated_at = ?, pending_deadline = NULL \
     WHERE merchant_id = ? AND order_no = ? AND status = 'PENDING'",
);
/// AUTHORIZED -> PAID by a capture: the order's amount becomes the captured amount.
static CAPTURE_ORDER: Sql = Sql::pair(
    "UPDATE orders SET status = 'PAID', out_trade_no = $1, amount = $2, updated_at = $3 \
     WHERE merchant_id = $4 AND order_no = $5 AND status = 'AUTHORIZED' AND $6 <= amount",
    "UPDATE orders SET status = 'PAID', out_trade_no = ?, amount = ?, updated_at = ? \
     WHERE merchant_id = ? AND order_no = ? AND status = 'AUTHORIZED' AND ? <= amount",
);
/// AUTHORIZED -> CLOSED (the hold voided, expired or the order closed by the merchant).
static CLOSE_AUTHORIZED_ORDER: Sql = Sql::pair(
    "UPDATE orders SET status = 'CLOSED', close_reason = $1, updated_at = $2 \
     WHERE merchant_id = $3 AND order_no = $4 AND status = 'AUTHORIZED'",
    "UPDATE orders SET status = 'CLOSED', close_reason = ?, updated_at = ? \
     WHERE merchant_id = ? AND order_no = ? AND status = 'AUTHORIZED'",
);

static FIND_PAYMENT: Sql = Sql::pair(
    "SELECT trade_no, merchant_id, out_trade_no, order_no, payer_account_id, payee_account_id, amount, currency, status, created_at, \
     created_by FROM payment_flow WHERE merchant_id = $1 AND out_trade_no = $2",
    "SELECT trade_no, merchant_id, out_trade_no, order_no, payer_account_id, payee_account_id, amount, currency, status, created_at, \
     created_by FROM payment_flow WHERE merchant_id = ? AND out_trade_no = ?",
);
macro_rules! payment_and_order_select {
    () => {
        "SELECT p.trade_no, p.merchant_id, p.out_trade_no, p.order_no, p.payer_account_id, p.payee_account_id, \
         p.amount, p.currency, p.status, p.created_at, p.created_by, o.payee_account_id AS o_payee_account_id, o.amount AS o_amount, \
         o.currency AS o_currency, o.subject AS o_subject, o.status AS o_status, o.out_trade_no AS o_out_trade_no, \
         o.refunded_amount AS o_refunded_amount, o.created_at AS o_created_at, o.updated_at AS o_updated_at, \
         o.expires_at AS o_expires_at, o.close_reason AS o_close_reason \
         FROM payment_flow p JOIN orders o ON o.merchant_id = p.merchant_id AND o.order_no = p.order_no"
    };
}
pub(super) use payment_and_order_select;
static FIND_PAYMENT_AND_ORDER: Sql = Sql::pair(
    concat!(payment_and_order_select!(), " WHERE p.merchant_id = $1 AND p.out_trade_no = $2"),
    concat!(payment_and_order_select!(), " WHERE p.merchant_id = ? AND p.out_trade_no = ?"),
);
static INSERT_PAYMENT: Sql = Sql {
    postgres: concat!(
        insert_payment_into!(),
        " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) ON CONFLICT DO NOTHING"
    ),
    mysql: concat!(insert_payment_into!(), " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"),
    sqlite: concat!(insert_payment_into!(), " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"),
};

static FIND_REFUND: Sql = Sql::pair(
    concat!("SELECT ", refund_columns!(), " FROM refunds WHERE merchant_id = $1 AND out_refund_no = $2"),
    concat!("SELECT ", refund_columns!(), " FROM refunds WHERE merchant_id = ? AND out_refund_no = ?"),
);
static LIST_REFUNDS: Sql = Sql::pair(
    concat!(
        "SELECT ",
        refund_columns!(),
        " FROM refunds WHERE merchant_id = $1 AND order_no = $2 ORDER BY created_at, refund_no"
    ),
    concat!(
        "SELECT ",
        refund_columns!(),
        " FROM refunds WHERE merchant_id = ? AND order_no = ? ORDER BY created_at, refund_no"
    ),
);
static INSERT_REFUND: Sql = Sql {
    postgres: concat!(
        insert_refund_into!(),
        " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) ON CONFLICT DO NOTHING"
    ),
    mysql: concat!(insert_refund_into!(), " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"),
    sqlite: concat!(insert_refund_into!(), " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"),
};

static FIND_DEPOSIT: Sql = Sql::pair(
    "SELECT request_id, deposit_id AS funding_id, account_id, amount, currency, created_at, created_by, held_after \
     FROM deposits WHERE request_id = $1",
    "SELECT request_id, deposit_id AS funding_id, account_id, amount, currency, created_at, created_by, held_after \
     FROM deposits WHERE request_id = ?",
);
static INSERT_DEPOSIT: Sql = Sql {
    postgres: concat!(insert_deposit_into!(), " VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING"),
    mysql: concat!(insert_deposit_into!(), " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"),
    sqlite: concat!(insert_deposit_into!(), " VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"),
};
static FIND_WITHDRAWAL: Sql = Sql::pair(
    "SELECT request_id, withdrawal_id AS funding_id, account_id, amount, currency, created_at, created_by, held_after \
     FROM withdrawals WHERE request_id = $1",
    "SELECT request_id, withdrawal_id AS funding_id, account_id, amount, currency, created_at, created_by, held_after \
     FROM withdrawals WHERE request_id = ?",
);
static INSERT_WITHDRAWAL: Sql = Sql {
    postgres: concat!(insert_withdrawal_into!(), " VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING"),
    mysql: concat!(insert_withdrawal_into!(), " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"),
    sqlite: concat!(insert_withdrawal_into!(), " VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"),
};

/// The columns of an idempotency record, as `IdempotencyRecordRow` reads them.
macro_rules! record_columns {
    () => {
        "idempotency_record.scope, idempotency_record.idempotency_key, idempotency_record.method, \
         idempotency_record.request_fingerprint, idempotency_record.request_fields, idempotency_record.response, \
         idempotency_record.response_message, idempotency_record.caller_scope, idempotency_record.status, \
         idempotency_record.created_at, idempotency_record.expires_at"
    };
}
pub(super) use record_columns;
static FIND_RECORD: Sql = Sql::pair(
    concat!("SELECT ", record_columns!(), " FROM idempotency_record WHERE scope = $1 AND idempotency_key = $2"),
    concat!("SELECT ", record_columns!(), " FROM idempotency_record WHERE scope = ? AND idempotency_key = ?"),
);
static INSERT_RECORD: Sql = Sql {
    postgres: "INSERT INTO idempotency_record \
     (scope, idempotency_key, method, request_fingerprint, request_fields, response, response_message, caller_scope, \
     status, created_at, expires_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) ON CONFLICT DO NOTHING",
    mysql: "INSERT INTO idempotency_record \
     (scope, idempotency_key, method, request_fingerprint, request_fields, response, response_message, caller_scope, \
     status, created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    sqlite: "INSERT INTO idempotency_record \
     (scope, idempotency_key, method, request_fingerprint, request_fields, response, response_message, caller_scope, \
     status, created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
};
static DELETE_EXPIRED_RECORD: Sql = Sql::pair(
    "DELETE FROM idempotency_record WHERE scope = $1 AND idempotency_key = $2 AND expires_at <= $3",
    "DELETE FROM idempotency_record WHERE scope = ? AND idempotency_key = ? AND expires_at <= ?",
);
static COMPLETE_RECORD: Sql = Sql::pair(
    "UPDATE idempotency_record SET response = $1, response_message = $2, status = 'COMPLETED' \
     WHERE scope = $3 AND idempotency_key = $4 AND status = 'IN_PROGRESS'",
    "UPDATE idempotency_record SET response = ?, response_message = ?, status = 'COMPLETED' \
     WHERE scope = ? AND idempotency_key = ? AND status = 'IN_PROGRESS'",
);
static REAP_RECORDS: Sql = Sql {
    postgres: "DELETE FROM idempotency_record WHERE record_id IN \
     (SELECT record_id FROM idempotency_record WHERE expires_at <= $1 ORDER BY expires_at LIMIT $2)",
    // MySQL refuses LIMIT inside an IN subquery, and allows it on DELETE itself.
    mysql: "DELETE FROM idempotency_record WHERE expires_at <= ? ORDER BY expires_at LIMIT ?",
    sqlite: "DELETE FROM idempotency_record WHERE record_id IN \
     (SELECT record_id FROM idempotency_record WHERE expires_at <= ? ORDER BY expires_at LIMIT ?)",
};

static INSERT_TOKEN: Sql = Sql::pair(
    "INSERT INTO idempotency_token (token, merchant_id, purpose, created_at, expires_at, consumed_at, caller_tag) \
     VALUES ($1, $2, $3, $4, $5, NULL, $6)",
    "INSERT INTO idempotency_token (token, merchant_id, purpose, created_at, expires_at, consumed_at, caller_tag) \
     VALUES (?, ?, ?, ?, ?, NULL, ?)",
);
static FIND_TOKEN: Sql = Sql::pair(
    "SELECT token, merchant_id, purpose, created_at, expires_at, consumed_at, caller_tag FROM idempotency_token \
     WHERE token = $1",
    "SELECT token, merchant_id, purpose, created_at, expires_at, consumed_at, caller_tag FROM idempotency_token \
     WHERE token = ?",
);
static CONSUME_TOKEN: Sql = Sql::pair(
    "UPDATE idempotency_token SET consumed_at = $1 WHERE token = $2 AND consumed_at IS NULL AND expires_at > $3",
    "UPDATE idempotency_token SET consumed_at = ? WHERE token = ? AND consumed_at IS NULL AND expires_at > ?",
);
static REAP_TOKENS: Sql = Sql {
    postgres: "DELETE FROM idempotency_token WHERE token IN \
     (SELECT token FROM idempotency_token WHERE expires_at <= $1 ORDER BY expires_at LIMIT $2)",
    mysql: "DELETE FROM idempotency_token WHERE expires_at <= ? ORDER BY expires_at LIMIT ?",
    sqlite: "DELETE FROM idempotency_token WHERE token IN \
     (SELECT token FROM idempotency_token WHERE expires_at <= ? ORDER BY expires_at LIMIT ?)",
};

static INSERT_TRANSFER: Sql = Sql::pair(
    concat!(insert_transfer_into!(), " VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"),
    concat!(insert_transfer_into!(), " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"),
);

/// The position in [`AUDIT_CHECKS`] of the check that each currency's balances sum to zero.
const CURRENCY_SUMS: usize = 3;

/// The journal entries that no business row accounts for: an entry whose posting is not the
/// payment, refund, transfer, deposit or withdrawal its kind names, or whose account, amount
/// (sign: the money's direction) or counterparty is not that row's leg: a payment's and a
/// capture's from payer to payee, a refund's back from its payment's payee to its payer, a
/// transfer's from `from_account_id` to `to_account_id`, a deposit's from an EXTERNAL (funding)
/// account to its account, a withdrawal's the other way. `$filter` narrows the entries read
/// (and ends in AND), or is empty.
macro_rules! unaccounted_entries {
    ($filter:literal) => {
        concat!(
            "SELECT e.posting_id AS subject, CONCAT_WS('', 'entry ', TRIM(CAST(e.entry_id AS CHAR(24))), ' ', e.kind, ' ', \
               e.account_id, ' ', TRIM(CAST(e.amount AS CHAR(24)))) AS detail FROM journal_entries e WHERE ",
            $filter,
            " NOT ( \
             (e.kind = 'PAY' AND EXISTS (SELECT 1 FROM payment_flow p WHERE p.trade_no = e.posting_id \
               AND p.currency = e.currency AND ( \
               (e.account_id = p.payer_account_id AND e.counterparty_account_id = p.payee_account_id AND e.amount = -p.amount) \
               OR (e.account_id = p.payee_account_id AND e.counterparty_account_id = p.payer_account_id AND e.amount = p.amount)))) \
             OR (e.kind = 'REFUND' AND EXISTS (SELECT 1 FROM refunds r JOIN payment_flow p \
               ON p.merchant_id = r.merchant_id AND p.out_trade_no = r.out_trade_no WHERE r.refund_no = e.posting_id \
               AND r.currency = e.currency AND ( \
               (e.account_id = p.payee_account_id AND e.counterparty_account_id = p.payer_account_id AND e.amount = -r.amount) \
               OR (e.account_id = p.payer_account_id AND e.counterparty_account_id = p.payee_account_id AND e.amount = r.amount)))) \
             OR (e.kind = 'TRANSFER' AND EXISTS (SELECT 1 FROM transfers t WHERE t.transfer_id = e.posting_id \
               AND t.currency = e.currency AND ( \
               (e.account_id = t.from_account_id AND e.counterparty_account_id = t.to_account_id AND e.amount = -t.amount) \
               OR (e.account_id = t.to_account_id AND e.counterparty_account_id = t.from_account_id AND e.amount = t.amount)))) \
             OR (e.kind = 'DEPOSIT' AND EXISTS (SELECT 1 FROM deposits d WHERE d.deposit_id = e.posting_id \
               AND d.currency = e.currency AND ( \
               (e.account_id = d.account_id AND e.amount = d.amount AND EXISTS (SELECT 1 FROM accounts f \
                 WHERE f.account_id = e.counterparty_account_id AND f.kind = 'EXTERNAL')) \
               OR (e.counterparty_account_id = d.account_id AND e.amount = -d.amount AND EXISTS (SELECT 1 FROM accounts f \
                 WHERE f.account_id = e.account_id AND f.kind = 'EXTERNAL'))))) \
             OR (e.kind = 'WITHDRAWAL' AND EXISTS (SELECT 1 FROM withdrawals w WHERE w.withdrawal_id = e.posting_id \
               AND w.currency = e.currency AND ( \
               (e.account_id = w.account_id AND e.amount = -w.amount AND EXISTS (SELECT 1 FROM accounts f \
                 WHERE f.account_id = e.counterparty_account_id AND f.kind = 'EXTERNAL')) \
               OR (e.counterparty_account_id = w.account_id AND e.amount = w.amount AND EXISTS (SELECT 1 FROM accounts f \
                 WHERE f.account_id = e.account_id AND f.kind = 'EXTERNAL'))))))"
        )
    };
}

/// Each audit query returns (subject, detail) rows, one per violation.
static AUDIT_CHECKS: [(&str, Sql); 13] = [
    (
        "every entry, payment, order and deposit names an existing account and order",
        Sql::same(
            "SELECT e.account_id AS subject, CONCAT_WS('', 'entry ', TRIM(CAST(e.entry_id AS CHAR(24)))) AS detail FROM journal_entries e \
             WHERE NOT EXISTS (SELECT 1 FROM accounts a WHERE a.account_id = e.account_id) \
             UNION ALL SELECT p.trade_no, 'payment account missing' FROM payment_flow p \
             WHERE NOT EXISTS (SELECT 1 FROM accounts a WHERE a.account_id = p.payer_account_id) \
             OR NOT EXISTS (SELECT 1 FROM accounts a WHERE a.account_id = p.payee_account_id) \
             UNION ALL SELECT p.trade_no, 'order missing' FROM payment_flow p \
             WHERE NOT EXISTS (SELECT 1 FROM orders o WHERE o.merchant_id = p.merchant_id AND o.order_no = p.order_no) \
             UNION ALL SELECT o.order_no, 'payee missing' FROM orders o \
             WHERE NOT EXISTS (SELECT 1 FROM accounts a WHERE a.account_id = o.payee_account_id) \
             UNION ALL SELECT d.deposit_id, 'deposit account missing' FROM deposits d \
             WHERE NOT EXISTS (SELECT 1 FROM accounts a WHERE a.account_id = d.account_id) \
             UNION ALL SELECT w.withdrawal_id, 'withdrawal account missing' FROM withdrawals w \
             WHERE NOT EXISTS (SELECT 1 FROM accounts a WHERE a.account_id = w.account_id)",
        ),
    ),
    (
        "balance equals the sum of the account's entries, version their count",
        Sql::same(
            "SELECT a.account_id AS subject, \
             CONCAT_WS('', 'balance ', TRIM(CAST(a.balance AS CHAR(24))), ' version ', TRIM(CAST(a.version AS CHAR(24))), ' entries sum ', \
               TRIM(CAST(COALESCE(SUM(e.amount), 0) AS CHAR(24))), ' count ', TRIM(CAST(COUNT(e.entry_id) AS CHAR(24)))) AS detail \
             FROM accounts a LEFT JOIN journal_entries e ON e.account_id = a.account_id \
             GROUP BY a.account_id, a.balance, a.version \
             HAVING a.balance <> COALESCE(SUM(e.amount), 0) OR a.version <> COUNT(e.entry_id)",
        ),
    ),
    (ACCOUNT_HEADS_CHECK, Sql::same(ACCOUNT_HEADS)),
    (
        "balances of each currency sum to zero",
        Sql::same(
            "SELECT currency AS subject, CONCAT_WS('', 'sum ', TRIM(CAST(SUM(balance) AS CHAR(24)))) AS detail \
             FROM accounts GROUP BY currency HAVING SUM(balance) <> 0",
        ),
    ),
    (
        "every posting has two entries that sum to zero",
        Sql::same(
            "SELECT posting_id AS subject, CONCAT_WS('', 'entries ', TRIM(CAST(COUNT(*) AS CHAR(24)))) AS detail \
             FROM journal_entries GROUP BY posting_id HAVING SUM(amount) <> 0 OR COUNT(*) <> 2",
        ),
    ),
    (
        "refunds of an order sum to its refunded amount, at most what was paid",
        Sql::same(
            "SELECT CONCAT_WS('', o.merchant_id, '/', o.order_no) AS subject, \
             CONCAT_WS('', 'refunded ', TRIM(CAST(o.refunded_amount AS CHAR(24)))) AS detail FROM orders o \
             WHERE o.refunded_amount > o.amount OR o.refunded_amount <> \
             (SELECT COALESCE(SUM(r.amount), 0) FROM refunds r WHERE r.merchant_id = o.merchant_id AND r.order_no = o.order_no)",
        ),
    ),
    (
        "an order is paid exactly when it has a payment, made before the order's expires_at",
        Sql::same(
            "SELECT CONCAT_WS('', o.merchant_id, '/', o.order_no) AS subject, o.status AS detail FROM orders o \
             LEFT JOIN payment_flow p ON p.merchant_id = o.merchant_id AND p.order_no = o.order_no \
             WHERE (p.trade_no IS NULL AND o.status IN ('PAID', 'PARTIALLY_REFUNDED', 'REFUNDED')) \
             OR (p.trade_no IS NOT NULL AND (o.status NOT IN ('PAID', 'PARTIALLY_REFUNDED', 'REFUNDED') \
                 OR p.amount <> o.amount OR p.out_trade_no <> o.out_trade_no)) \
             OR (p.created_at >= o.expires_at AND NOT EXISTS \
               (SELECT 1 FROM holds h WHERE h.merchant_id = o.merchant_id AND h.order_no = o.order_no))",
        ),
    ),
    (
        "every payment, refund, deposit, withdrawal and transfer has its posting",
        Sql::same(
            "SELECT p.trade_no AS subject, 'payment without entries' AS detail FROM payment_flow p \
             WHERE NOT EXISTS (SELECT 1 FROM journal_entries e WHERE e.posting_id = p.trade_no AND e.amount = p.amount) \
             UNION ALL SELECT r.refund_no, 'refund without entries' FROM refunds r \
             WHERE NOT EXISTS (SELECT 1 FROM journal_entries e WHERE e.posting_id = r.refund_no AND e.amount = r.amount) \
             UNION ALL SELECT d.deposit_id, 'deposit without entries' FROM deposits d \
             WHERE NOT EXISTS (SELECT 1 FROM journal_entries e WHERE e.posting_id = d.deposit_id AND e.amount = d.amount) \
             UNION ALL SELECT w.withdrawal_id, 'withdrawal without entries' FROM withdrawals w \
             WHERE NOT EXISTS (SELECT 1 FROM journal_entries e WHERE e.posting_id = w.withdrawal_id AND e.amount = w.amount) \
             UNION ALL SELECT t.transfer_id, 'transfer without entries' FROM transfers t \
             WHERE NOT EXISTS (SELECT 1 FROM journal_entries e WHERE e.posting_id = t.transfer_id AND e.amount = t.amount)",
        ),
    ),
    (
        "an account's held amount is the sum of its active holds, and its balance covers it",
        Sql::same(
            "SELECT a.account_id AS subject, CONCAT_WS('', 'held ', TRIM(CAST(a.held AS CHAR(24))), ' active holds ', \
               TRIM(CAST(COALESCE(h.total, 0) AS CHAR(24))), ' balance ', TRIM(CAST(a.balance AS CHAR(24)))) AS detail \
             FROM accounts a LEFT JOIN (SELECT payer_account_id, SUM(amount) AS total FROM holds \
               WHERE status = 'ACTIVE' GROUP BY payer_account_id) h ON h.payer_account_id = a.account_id \
             WHERE a.held <> COALESCE(h.total, 0) OR (a.kind = 'CUSTOMER' AND a.balance < a.held)",
        ),
    ),
    (
        "an order is authorized exactly when it has an active hold of its amount, a captured hold has its payment, \
         only a closed order has a close reason, one its history explains (a voided or expired hold, a passed \
         expires_at), and the sweeper's key is the deadline of exactly the open orders",
        Sql::same(
            "SELECT CONCAT_WS('', o.merchant_id, '/', o.order_no) AS subject, o.status AS detail FROM orders o \
             LEFT JOIN holds h ON h.merchant_id = o.merchant_id AND h.order_no = o.order_no \
             WHERE (o.status = 'AUTHORIZED' AND (h.hold_no IS NULL OR h.status <> 'ACTIVE' OR h.amount <> o.amount)) \
             OR (o.status <> 'AUTHORIZED' AND h.status = 'ACTIVE') \
             OR (h.status = 'CAPTURED' AND (o.out_trade_no IS NULL OR h.out_trade_no IS NULL \
               OR o.out_trade_no <> h.out_trade_no OR h.captured_amount <> o.amount)) \
             OR (o.close_reason IS NOT NULL AND o.status <> 'CLOSED') \
             OR (o.close_reason IS NOT NULL AND o.close_reason NOT IN ('MERCHANT', 'EXPIRED', 'VOIDED', 'HOLD_EXPIRED')) \
             OR (h.status IN ('VOIDED', 'EXPIRED') AND o.status <> 'CLOSED') \
             OR (o.close_reason IN ('VOIDED', 'HOLD_EXPIRED') AND (h.hold_no IS NULL OR h.status NOT IN ('VOIDED', 'EXPIRED'))) \
             OR (o.close_reason = 'EXPIRED' AND (o.expires_at IS NULL OR o.updated_at < o.expires_at)) \
             OR (o.status = 'PENDING' AND o.expires_at IS NOT NULL AND (o.pending_deadline IS NULL OR o.pending_deadline <> o.expires_at)) \
             OR (o.status <> 'PENDING' AND o.pending_deadline IS NOT NULL)",
        ),
    ),
    (
        "every entry is a leg of the payment, refund, transfer, deposit or withdrawal its posting names: its accounts, \
         amount and direction",
        Sql::same(unaccounted_entries!("")),
    ),
    (
        "an order's status says how much of it was refunded: PAID none, PARTIALLY_REFUNDED some, REFUNDED all",
        Sql::same(
            "SELECT CONCAT_WS('', o.merchant_id, '/', o.order_no) AS subject, \
             CONCAT_WS('', o.status, ' refunded ', TRIM(CAST(o.refunded_amount AS CHAR(24)))) AS detail FROM orders o \
             WHERE (o.status = 'PARTIALLY_REFUNDED' AND (o.refunded_amount = 0 OR o.refunded_amount >= o.amount)) \
             OR (o.status = 'REFUNDED' AND o.refunded_amount <> o.amount) \
             OR (o.status NOT IN ('PARTIALLY_REFUNDED', 'REFUNDED') AND o.refunded_amount <> 0)",
        ),
    ),
    (
        "every entry continues its account: the balance and version of the entry before (0 before the first), plus \
         its amount and one",
        Sql::same(
            "SELECT c.account_id AS subject, CONCAT_WS('', 'entry ', TRIM(CAST(c.entry_id AS CHAR(24)))) AS detail FROM \
             (SELECT entry_id, account_id, amount, balance_after, version_after, \
               COALESCE(LAG(balance_after) OVER (PARTITION BY account_id ORDER BY entry_id), 0) AS balance_before, \
               COALESCE(LAG(version_after) OVER (PARTITION BY account_id ORDER BY entry_id), 0) AS version_before \
             FROM journal_entries) c \
             WHERE c.balance_after <> c.balance_before + c.amount OR c.version_after <> c.version_before + 1",
        ),
    ),
];

/// The name of the check that every account holds its latest entry's balance, version and
/// chain hash.
const ACCOUNT_HEADS_CHECK: &str =
    "every account holds its latest entry's balance, version and chain hash (nothing, version 0 and none without entries)";

/// Every account against its latest entry (one backward probe of the journal's account index
/// per account): a full audit and one from a checkpoint both run it, so that a posting deleted
/// whole after the checkpoint, which leaves no entry in the range, still shows on its accounts.
const ACCOUNT_HEADS: &str =
    "SELECT a.account_id AS subject, CONCAT_WS('', 'balance ', TRIM(CAST(a.balance AS CHAR(24))), \
     ' version ', TRIM(CAST(a.version AS CHAR(24))), ' latest entry ', \
     COALESCE(TRIM(CAST(e.entry_id AS CHAR(24))), 'none')) AS detail \
     FROM accounts a LEFT JOIN journal_entries e ON e.entry_id = (SELECT x.entry_id FROM journal_entries x \
       WHERE x.account_id = a.account_id ORDER BY x.entry_id DESC LIMIT 1) \
     WHERE COALESCE(e.balance_after, 0) <> a.balance OR COALESCE(e.version_after, 0) <> a.version \
     OR COALESCE(e.entry_hash, '') <> COALESCE(a.chain_hash, '')";

/// The checks of an audit from a checkpoint (see [`Queries::audit_entries`]): what was
/// written in an entry-id range `(after, upto]`, read through the journal's primary key and the
/// indexes a lookup uses, so that the time grows with the range, not with the ledger. Each `?`
/// pair is bound `after`, then `upto`.
static AUDIT_ENTRY_CHECKS: [(&str, Sql); 7] = [
    (
        "every entry is a leg of the payment, refund, transfer, deposit or withdrawal its posting names: its accounts, \
         amount and direction",
        Sql::pair(
            unaccounted_entries!("e.entry_id > $1 AND e.entry_id <= $2 AND"),
            unaccounted_entries!("e.entry_id > ? AND e.entry_id <= ? AND"),
        ),
    ),
    (
        "every entry continues its account: the balance and version of the entry before, plus its amount and one",
        Sql::pair(entry_continuity!("$1", "$2", "$3", "$4"), entry_continuity!("?", "?", "?", "?")),
    ),
    (
        "every posting has two entries that sum to zero",
        Sql::pair(range_postings_balance!("$1", "$2"), range_postings_balance!("?", "?")),
    ),
    (
        "the account of each entry exists and holds its latest entry's balance and version",
        Sql::pair(range_accounts_match!("$1", "$2"), range_accounts_match!("?", "?")),
    ),
    (
        "every posting is a payment, refund, deposit, withdrawal or transfer of its amount",
        Sql::pair(range_postings_have_rows!("$1", "$2"), range_postings_have_rows!("?", "?")),
    ),
    (
        "the order of each payment and refund is paid for its amount, and its refunds sum to its refunded amount",
        Sql::pair(range_orders_match!("$1", "$2", "$3", "$4"), range_orders_match!("?", "?", "?", "?")),
    ),
    (ACCOUNT_HEADS_CHECK, Sql::same(ACCOUNT_HEADS)),
];

// The texts of `AUDIT_ENTRY_CHECKS`, each given its placeholders: `(after, upto)` pairs.

/// Each entry's predecessor by LAG over the range's entries and, per account, the one entry
/// before the account's first in the range (one backward index probe per account). A probe per
/// entry instead (`MAX(entry_id) ... < e.entry_id`) made MariaDB read the account's whole
/// history for every entry.
macro_rules! entry_continuity {
    ($after:literal, $upto:literal, $after_again:literal, $upto_again:literal) => {
        concat!(
            "SELECT c.account_id AS subject, CONCAT_WS('', 'entry ', TRIM(CAST(c.entry_id AS CHAR(24)))) AS detail FROM ( \
               SELECT s.in_range, s.entry_id, s.account_id, s.amount, s.balance_after, s.version_after, \
                 LAG(s.entry_id) OVER w AS prev_id, LAG(s.balance_after) OVER w AS prev_balance, \
                 LAG(s.version_after) OVER w AS prev_version \
               FROM ( \
                 SELECT 1 AS in_range, e.entry_id, e.account_id, e.amount, e.balance_after, e.version_after \
                 FROM journal_entries e WHERE e.entry_id > ",
            $after,
            " AND e.entry_id <= ",
            $upto,
            " UNION ALL SELECT 0, p.entry_id, p.account_id, p.amount, p.balance_after, p.version_after \
                 FROM (SELECT f.account_id, MIN(f.entry_id) AS first_id FROM journal_entries f \
                   WHERE f.entry_id > ",
            $after_again,
            " AND f.entry_id <= ",
            $upto_again,
            " GROUP BY f.account_id) a \
                 JOIN journal_entries p ON p.entry_id = (SELECT x.entry_id FROM journal_entries x \
                   WHERE x.account_id = a.account_id AND x.entry_id < a.first_id ORDER BY x.entry_id DESC LIMIT 1) \
               ) s WINDOW w AS (PARTITION BY s.account_id ORDER BY s.entry_id) \
             ) c WHERE c.in_range = 1 \
             AND ((c.prev_id IS NULL AND (c.balance_after <> c.amount OR c.version_after <> 1)) \
               OR (c.prev_id IS NOT NULL AND (c.balance_after <> c.prev_balance + c.amount \
                 OR c.version_after <> c.prev_version + 1)))"
        )
    };
}
use entry_continuity;

/// The range's postings first (read along the primary key), then their legs by the posting
/// index: written as `IN (subquery)`, MariaDB read the whole posting index.
macro_rules! range_postings_balance {
    ($after:literal, $upto:literal) => {
        concat!(
            "SELECT j.posting_id AS subject, CONCAT_WS('', 'entries ', TRIM(CAST(COUNT(*) AS CHAR(24)))) AS detail \
             FROM (SELECT DISTINCT n.posting_id FROM journal_entries n WHERE n.entry_id > ",
            $after,
            " AND n.entry_id <= ",
            $upto,
            ") r JOIN journal_entries j ON j.posting_id = r.posting_id \
             GROUP BY j.posting_id HAVING SUM(j.amount) <> 0 OR COUNT(*) <> 2"
        )
    };
}
use range_postings_balance;

macro_rules! range_accounts_match {
    ($after:literal, $upto:literal) => {
        concat!(
            "SELECT e.account_id AS subject, CONCAT_WS('', 'entry ', TRIM(CAST(e.entry_id AS CHAR(24)))) AS detail \
             FROM journal_entries e LEFT JOIN accounts a ON a.account_id = e.account_id \
             WHERE e.entry_id > ",
            $after,
            " AND e.entry_id <= ",
            $upto,
            " AND e.entry_id = (SELECT x.entry_id FROM journal_entries x WHERE x.account_id = e.account_id \
               ORDER BY x.entry_id DESC LIMIT 1) \
             AND (a.account_id IS NULL OR e.balance_after <> a.balance OR e.version_after <> a.version)"
        )
    };
}
use range_accounts_match;

macro_rules! range_postings_have_rows {
    ($after:literal, $upto:literal) => {
        concat!(
            "SELECT e.posting_id AS subject, CONCAT_WS('', e.kind, ' without its row') AS detail FROM journal_entries e \
             WHERE e.entry_id > ",
            $after,
            " AND e.entry_id <= ",
            $upto,
            " AND e.amount > 0 AND NOT ( \
               (e.kind = 'PAY' AND EXISTS (SELECT 1 FROM payment_flow p WHERE p.trade_no = e.posting_id AND p.amount = e.amount)) \
               OR (e.kind = 'REFUND' AND EXISTS (SELECT 1 FROM refunds r WHERE r.refund_no = e.posting_id AND r.amount = e.amount)) \
               OR (e.kind = 'DEPOSIT' AND EXISTS (SELECT 1 FROM deposits d WHERE d.deposit_id = e.posting_id AND d.amount = e.amount)) \
               OR (e.kind = 'WITHDRAWAL' AND EXISTS \
                 (SELECT 1 FROM withdrawals w WHERE w.withdrawal_id = e.posting_id AND w.amount = e.amount)) \
               OR (e.kind = 'TRANSFER' AND EXISTS \
                 (SELECT 1 FROM transfers t WHERE t.transfer_id = e.posting_id AND t.amount = e.amount)))"
        )
    };
}
use range_postings_have_rows;

/// A LEFT JOIN: an order whose row is gone is reported, not left out.
macro_rules! range_orders_match {
    ($after:literal, $upto:literal, $after_again:literal, $upto_again:literal) => {
        concat!(
            "SELECT CONCAT_WS('', p.merchant_id, '/', p.order_no) AS subject, COALESCE(o.status, 'no order') AS detail \
             FROM journal_entries e \
             JOIN payment_flow p ON p.trade_no = e.posting_id \
             LEFT JOIN orders o ON o.merchant_id = p.merchant_id AND o.order_no = p.order_no \
             WHERE e.entry_id > ",
            $after,
            " AND e.entry_id <= ",
            $upto,
            " AND e.amount > 0 AND e.kind = 'PAY' \
             AND (o.order_no IS NULL OR o.status NOT IN ('PAID', 'PARTIALLY_REFUNDED', 'REFUNDED') OR p.amount <> o.amount \
               OR o.out_trade_no IS NULL OR p.out_trade_no <> o.out_trade_no) \
             UNION ALL SELECT CONCAT_WS('', r.merchant_id, '/', r.order_no), \
               CASE WHEN o.order_no IS NULL THEN 'no order' \
                 ELSE CONCAT_WS('', 'refunded ', TRIM(CAST(o.refunded_amount AS CHAR(24)))) END FROM journal_entries e \
             JOIN refunds r ON r.refund_no = e.posting_id \
             LEFT JOIN orders o ON o.merchant_id = r.merchant_id AND o.order_no = r.order_no \
             WHERE e.entry_id > ",
            $after_again,
            " AND e.entry_id <= ",
            $upto_again,
            " AND e.amount > 0 AND e.kind = 'REFUND' \
             AND (o.order_no IS NULL OR o.refunded_amount > o.amount \
               OR o.refunded_amount <> (SELECT COALESCE(SUM(x.amount), 0) \
               FROM refunds x WHERE x.merchant_id = o.merchant_id AND x.order_no = o.order_no))"
        )
    };
}
use range_orders_match;

/// The name of the hash chain check (see [`Queries::audit_chain`]).
pub const CHAIN_CHECK: &str = "every entry's hash chains it to its account's entry before it; only entries written \
     outside the chain have none";

/// The id ranges of the entries written outside the chain.
static UNCHAINED_RANGES: Sql = Sql::same("SELECT first_entry_id, last_entry_id FROM unchained_entries");

/// The columns of an entry its hash covers, then its id and hash, as [`Queries::audit_chain`]
/// reads them.
macro_rules! chained_columns {
    () => {
        "e.account_id, e.currency, e.amount, e.balance_after, e.version_after, e.kind, e.reference, e.posting_id, \
         e.counterparty_account_id, e.created_at, e.created_by, e.entry_id, e.entry_hash"
    };
}

/// Every entry, each account's in id order.
static CHAIN_ENTRIES: Sql = Sql::same(CHAIN_ENTRIES_TEXT);
const CHAIN_ENTRIES_TEXT: &str =
    concat!("SELECT ", chained_columns!(), " FROM journal_entries e ORDER BY e.account_id, e.entry_id");

/// The entries with ids in `(after, upto]` and, per account, the one entry before its first in
/// the range (as [`entry_continuity`] reads it), each account's in id order.
macro_rules! range_chain {
    ($after:literal, $upto:literal, $after_again:literal, $upto_again:literal) => {
        concat!(
            "SELECT s.* FROM (SELECT ",
            chained_columns!(),
            " FROM journal_entries e WHERE e.entry_id > ",
            $after,
            " AND e.entry_id <= ",
            $upto,
            " UNION ALL SELECT ",
            chained_columns!(),
            " FROM (SELECT f.account_id, MIN(f.entry_id) AS first_id FROM journal_entries f WHERE f.entry_id > ",
            $after_again,
            " AND f.entry_id <= ",
            $upto_again,
            " GROUP BY f.account_id) a JOIN journal_entries e ON e.entry_id = (SELECT x.entry_id FROM journal_entries x \
               WHERE x.account_id = a.account_id AND x.entry_id < a.first_id ORDER BY x.entry_id DESC LIMIT 1) \
             ) s ORDER BY s.account_id, s.entry_id"
        )
    };
}
static RANGE_CHAIN: Sql = Sql::pair(range_chain!("$1", "$2", "$3", "$4"), range_chain!("?", "?", "?", "?"));

/// Each account's first entry id, and its latest entry hash at or before an entry id (two
/// probes of the journal's account index per account).
static CHAIN_HEADS: Sql = Sql::pair(
    "SELECT a.account_id, (SELECT x.entry_hash FROM journal_entries x WHERE x.account_id = a.account_id \
     AND x.entry_id <= $1 AND x.entry_hash IS NOT NULL ORDER BY x.entry_id DESC LIMIT 1) AS head, \
     (SELECT MIN(y.entry_id) FROM journal_entries y WHERE y.account_id = a.account_id) AS first_id FROM accounts a",
    "SELECT a.account_id, (SELECT x.entry_hash FROM journal_entries x WHERE x.account_id = a.account_id \
     AND x.entry_id <= ? AND x.entry_hash IS NOT NULL ORDER BY x.entry_id DESC LIMIT 1) AS head, \
     (SELECT MIN(y.entry_id) FROM journal_entries y WHERE y.account_id = a.account_id) AS first_id FROM accounts a",
);
/// How many entries have ids up to one (a count along the primary key).
static ENTRIES_UPTO: Sql = Sql::pair(
    "SELECT COUNT(*) FROM journal_entries WHERE entry_id <= $1",
    "SELECT COUNT(*) FROM journal_entries WHERE entry_id <= ?",
);

/// One account's chain as [`Queries::audit_chain`] walks it.
struct ChainWalk {
    account_id: String,
    /// The stored hash of its latest chained entry so far; `None` before its first.
    previous: Option<Hash>,
}

/// The newest journal entry written at or before a time (microseconds since the epoch): read
/// backwards along the primary key from the newest.
static SETTLED_ENTRY: Sql = Sql::pair(
    "SELECT entry_id FROM journal_entries WHERE created_at <= $1 ORDER BY entry_id DESC LIMIT 1",
    "SELECT entry_id FROM journal_entries WHERE created_at <= ? ORDER BY entry_id DESC LIMIT 1",
);

/// The table of money moved between an account and its currency's external funding account.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FundingTable {
    /// `deposits`: in from outside the ledger.
    Deposits,
    /// `withdrawals`: out of the ledger (payouts).
    Withdrawals,
}

/// Whether a read of rows a write moves locks them until its transaction ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowLocks {
    /// Locked (`FOR NO KEY UPDATE` on PostgreSQL, `FOR UPDATE` on MySQL; SQLite's write
    /// transaction holds the whole database).
    Taken,
    /// Read as last committed, unlocked: the write then guards each row it read by its version
    /// CAS or its state's conditional UPDATE.
    None,
}

/// The rows of [`Queries::read_at_once`], each as last committed, all of one snapshot, each
/// list in no particular order.
#[derive(Debug, Default)]
pub struct ReadAtOnce {
    /// The payments found by (merchant_id, out_trade_no), each with its order.
    pub payments: Vec<(PaymentRow, OrderRow)>,
    /// The orders found by (merchant_id, order_no), and those of the payments found.
    pub orders: Vec<OrderRow>,
    /// The accounts found by account_id, and the payees of the orders found and the payers of
    /// the payments found.
    pub accounts: Vec<AccountRow>,
    /// The answered records found by (scope, idempotency_key).
    pub records: Vec<IdempotencyRecordRow>,
}

/// The keys [`Queries::read_at_once`] looks up, each kind by its unique key.
#[derive(Debug, Default)]
pub struct KeysAtOnce<'a> {
    /// Payments by (merchant_id, out_trade_no).
    pub payments: Vec<(&'a str, &'a str)>,
    /// Orders by (merchant_id, order_no).
    pub orders: Vec<(&'a str, &'a str)>,
    /// Accounts by account_id.
    pub accounts: Vec<&'a str>,
    /// Answered idempotency records by (scope, idempotency_key).
    pub records: Vec<(&'a str, &'a str)>,
}

/// An idempotency record as [`batch::READ_AT_ONCE_POSTGRES`] gives it: its byte columns as
/// hexadecimal text.
#[derive(serde::Deserialize)]
struct RecordAsJson {
    scope: String,
    idempotency_key: String,
    method: String,
    request_fingerprint: String,
    request_fields: String,
    response: Option<String>,
    response_message: Option<String>,
    caller_scope: Option<String>,
    status: String,
    created_at: i64,
    expires_at: i64,
}

impl TryFrom<RecordAsJson> for IdempotencyRecordRow {
    type Error = hex::FromHexError;

    fn try_from(record: RecordAsJson) -> Result<Self, Self::Error> {
        let bytes = |text: Option<String>| text.map(hex::decode).transpose();
        Ok(IdempotencyRecordRow {
            scope: record.scope,
            idempotency_key: record.idempotency_key,
            method: record.method,
            request_fingerprint: record.request_fingerprint,
            request_fields: hex::decode(record.request_fields)?,
            response: bytes(record.response)?,
            response_message: bytes(record.response_message)?,
            caller_scope: record.caller_scope,
            status: record.status,
            created_at: record.created_at,
            expires_at: record.expires_at,
        })
    }
}

/// Statements over one connection: a write transaction's or a reader's.
pub struct Queries<'c> {
    connection: &'c mut AnyConnection,
    dialect: Dialect,
    cas_retries: Option<&'c mut u32>,
}

type AnyQuery<'q> = Query<'q, Any, AnyArguments<'q>>;

/// A step of [`Queries::savepoint`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Savepoint {
    /// `SAVEPOINT`: what follows can be undone alone.
    Set,
    /// `ROLLBACK TO SAVEPOINT`: undoes what followed it (row locks taken since stay held).
    RollBack,
    /// `RELEASE SAVEPOINT`: keeps what followed it, as part of the transaction.
    Release,
}

impl<'c> Queries<'c> {
    pub(super) fn new(connection: &'c mut AnyConnection, dialect: Dialect) -> Self {
        Self { connection, dialect, cas_retries: None }
    }

    /// Counts [`Queries::count_cas_retry`] calls into `retries`.
    pub(super) fn counting(mut self, retries: &'c mut u32) -> Self {
        self.cas_retries = Some(retries);
        self
    }

    /// Records that a version CAS or conditional UPDATE lost and is tried again (the
    /// transaction's count becomes the `payledger_cas_retries_total` metric).
    pub fn count_cas_retry(&mut self) {
        if let Some(retries) = self.cas_retries.as_deref_mut() {
            *retries += 1;
        }
    }

    fn query(&self, sql: &'static Sql) -> AnyQuery<'static> {
        sqlx::query(sql.text(self.dialect))
    }

    /// Runs an `INSERT ... ON CONFLICT DO NOTHING`: true when the row was inserted, false
    /// when a unique key was already taken (by a committed row; a concurrent uncommitted
    /// insert of the same key makes the database wait for its outcome first).
    ///
    /// PostgreSQL and SQLite report the conflict as zero rows. MySQL has no ON CONFLICT:
    /// the insert fails with a duplicate-key error, which leaves the transaction usable
    /// there, and is recognised by `is_unique_violation()`, never by SQLSTATE 23000 (MySQL
    /// uses it for foreign-key and NOT NULL errors too).
    async fn insert_if_absent(&mut self, query: AnyQuery<'_>) -> Result<bool, sqlx::Error> {
        match query.execute(&mut *self.connection).await {
            Ok(result) => Ok(result.rows_affected() == 1),
            Err(sqlx::Error::Database(error)) if self.dialect == Dialect::MySql && error.is_unique_violation() => {
                Ok(false)
            }
            Err(error) => Err(error),
        }
    }

    /// Runs a conditional UPDATE that must change exactly one row when its predicate holds:
    /// true when it did, false when the predicate no longer held. (MySQL reports matched
    /// rows, so the predicate itself, never "nothing changed", carries the meaning.)
    async fn update_one(&mut self, query: AnyQuery<'_>) -> Result<bool, sqlx::Error> {
        let rows = query.execute(&mut *self.connection).await?.rows_affected();
        assert!(rows <= 1, "a conditional update by primary key changed {rows} rows");
        Ok(rows == 1)
    }

    pub async fn find_account(&mut self, account_id: &str) -> Result<Option<AccountRow>, sqlx::Error> {
        sqlx::query_as(FIND_ACCOUNT.text(self.dialect)).bind(account_id).fetch_optional(&mut *self.connection).await
    }

    /// Reads two accounts in one round trip (those that exist).
    pub async fn find_two_accounts(&mut self, first: &str, second: &str) -> Result<Vec<AccountRow>, sqlx::Error> {
        sqlx::query_as(FIND_TWO_ACCOUNTS.text(self.dialect))
            .bind(first)
            .bind(second)
            .fetch_all(&mut *self.connection)
            .await
    }

    pub async fn insert_account(&mut self, row: &AccountRow) -> Result<bool, sqlx::Error> {
        let query = self
            .query(&INSERT_ACCOUNT)
            .bind(row.account_id.clone())
            .bind(row.currency.clone())
            .bind(row.kind.clone())
            .bind(row.balance)
            .bind(row.version)
            .bind(row.created_at)
            .bind(row.updated_at);
        self.insert_if_absent(query).await
    }

    pub async fn find_entry(&mut self, posting_id: &str, account_id: &str) -> Result<Option<EntryRow>, sqlx::Error> {
        sqlx::query_as(FIND_ENTRY.text(self.dialect))
            .bind(posting_id)
            .bind(account_id)
            .fetch_optional(&mut *self.connection)
            .await
    }

    /// Entries of an account with `entry_id < before`, newest first, at most `limit`.
    pub async fn list_entries(
        &mut self,
        account_id: &str,
        before: i64,
        limit: i64,
    ) -> Result<Vec<EntryRow>, sqlx::Error> {
        sqlx::query_as(LIST_ENTRIES.text(self.dialect))
            .bind(account_id)
            .bind(before)
            .bind(limit)
            .fetch_all(&mut *self.connection)
            .await
    }

    pub async fn find_order(&mut self, merchant_id: &str, order_no: &str) -> Result<Option<OrderRow>, sqlx::Error> {
        sqlx::query_as(FIND_ORDER.text(self.dialect))
            .bind(merchant_id)
            .bind(order_no)
            .fetch_optional(&mut *self.connection)
            .await
    }

    /// An order and its authorization hold (if it ever had one), in one round trip.
    pub async fn find_order_and_hold(
        &mut self,
        merchant_id: &str,
        order_no: &str,
    ) -> Result<Option<(OrderRow, Option<HoldRow>)>, sqlx::Error> {
        let row: Option<AnyRow> = sqlx::query(FIND_ORDER_AND_HOLD.text(self.dialect))
            .bind(merchant_id)
            .bind(order_no)
            .fetch_optional(&mut *self.connection)
            .await?;
        let Some(row) = row else { return Ok(None) };
        let order = OrderRow::from_row(&row)?;
        let hold_no: Option<String> = row.try_get("h_hold_no")?;
        let hold = match hold_no {
            None => None,
            Some(hold_no) => Some(HoldRow {
                hold_no,
                merchant_id: order.merchant_id.clone(),
                out_auth_no: row.try_get("h_out_auth_no")?,
                order_no: order.order_no.clone(),
                payer_account_id: row.try_get("h_payer_account_id")?,
                amount: row.try_get("h_amount")?,
                currency: row.try_get("h_currency")?,
                status: row.try_get("h_status")?,
                captured_amount: row.try_get("h_captured_amount")?,
                out_trade_no: row.try_get("h_out_trade_no")?,
                expires_at: row.try_get("h_expires_at")?,
                created_at: row.try_get("h_created_at")?,
                updated_at: row.try_get("h_updated_at")?,
                created_by: row.try_get("h_created_by")?,
            }),
        };
        Ok(Some((order, hold)))
    }

    /// Reads an order and locks its row until the transaction ends, unless another
    /// transaction holds it: then `None` at once (`FOR UPDATE SKIP LOCKED`), as for a
    /// missing order.
    pub async fn try_lock_order(&mut self, merchant_id: &str, order_no: &str) -> Result<Option<OrderRow>, sqlx::Error> {
        sqlx::query_as(TRY_LOCK_ORDER.text(self.dialect))
            .bind(merchant_id)
            .bind(order_no)
            .fetch_optional(&mut *self.connection)
            .await
    }

    /// Reads an order and locks its row until the transaction ends (`FOR UPDATE`).
    pub async fn find_order_for_update(
        &mut self,
        merchant_id: &str,
        order_no: &str,
    ) -> Result<Option<OrderRow>, sqlx::Error> {
        sqlx::query_as(FIND_ORDER_FOR_UPDATE.text(self.dialect))
            .bind(merchant_id)
            .bind(order_no)
            .fetch_optional(&mut *self.connection)
            .await
    }

    pub async fn insert_order(&mut self, row: &OrderRow) -> Result<bool, sqlx::Error> {
        let query = self
            .query(&INSERT_ORDER)
            .bind(row.merchant_id.clone())
            .bind(row.order_no.clone())
            .bind(row.payee_account_id.clone())
            .bind(row.amount)
            .bind(row.currency.clone())
            .bind(row.subject.clone())
            .bind(row.status.clone())
            .bind(row.created_at)
            .bind(row.updated_at)
            .bind(row.expires_at)
            .bind(row.expires_at);
        self.insert_if_absent(query).await
    }

    /// PENDING -> CLOSED with `reason`, only if the order is still PENDING and, when
    /// `expired_by` is given (the sweeper), its expires_at is at or before that time.
    pub async fn close_order(
        &mut self,
        merchant_id: &str,
        order_no: &str,
        reason: &'static str,
        now: i64,
        expired_by: Option<i64>,
    ) -> Result<bool, sqlx::Error> {
        let statement = if expired_by.is_some() { &EXPIRE_ORDER } else { &CLOSE_ORDER };
        let mut query =
            self.query(statement).bind(reason).bind(now).bind(merchant_id.to_owned()).bind(order_no.to_owned());
        if let Some(expired_by) = expired_by {
            query = query.bind(expired_by);
        }
        self.update_one(query).await
    }

    /// Records a hold; false when its out_auth_no, or its order's one hold, is taken.
    pub async fn insert_hold(&mut self, row: &HoldRow) -> Result<bool, sqlx::Error> {
        let query = self
            .query(&INSERT_HOLD)
            .bind(row.hold_no.clone())
            .bind(row.merchant_id.clone())
            .bind(row.out_auth_no.clone())
            .bind(row.order_no.clone())
            .bind(row.payer_account_id.clone())
            .bind(row.amount)
            .bind(row.currency.clone())
            .bind(row.status.clone())
            .bind(row.captured_amount)
            .bind(row.out_trade_no.clone())
            .bind(row.expires_at)
            .bind(row.created_at)
            .bind(row.updated_at)
            .bind(row.created_by.clone());
        self.insert_if_absent(query).await
    }

    pub async fn find_hold(&mut self, merchant_id: &str, out_auth_no: &str) -> Result<Option<HoldRow>, sqlx::Error> {
        sqlx::query_as(FIND_HOLD.text(self.dialect))
            .bind(merchant_id)
            .bind(out_auth_no)
            .fetch_optional(&mut *self.connection)
            .await
    }

    pub async fn find_hold_of_order(
        &mut self,
        merchant_id: &str,
        order_no: &str,
    ) -> Result<Option<HoldRow>, sqlx::Error> {
        sqlx::query_as(FIND_HOLD_OF_ORDER.text(self.dialect))
            .bind(merchant_id)
            .bind(order_no)
            .fetch_optional(&mut *self.connection)
            .await
    }

    /// Moves an ACTIVE hold to `status` (`CAPTURED` with its captured amount and payment,
    /// `VOIDED` or `EXPIRED`); false when it is no longer ACTIVE.
    pub async fn settle_hold(
        &mut self,
        hold_no: &str,
        status: &'static str,
        captured_amount: i64,
        out_trade_no: Option<&str>,
        now: i64,
    ) -> Result<bool, sqlx::Error> {
        let query = self
            .query(&SETTLE_HOLD)
            .bind(status)
            .bind(captured_amount)
            .bind(out_trade_no.map(str::to_owned))
            .bind(now)
            .bind(hold_no.to_owned());
        self.update_one(query).await
    }

    /// Keys (merchant_id, order_no) of at most `limit` ACTIVE holds whose expires_at is at or
    /// before `now`, earliest first.
    pub async fn find_expired_holds(&mut self, now: i64, limit: i64) -> Result<Vec<(String, String)>, sqlx::Error> {
        sqlx::query_as(FIND_EXPIRED_HOLDS.text(self.dialect))
            .bind(now)
            .bind(limit)
            .fetch_all(&mut *self.connection)
            .await
    }

    /// PENDING -> AUTHORIZED; false when the order is no longer PENDING.
    pub async fn authorize_order(&mut self, merchant_id: &str, order_no: &str, now: i64) -> Result<bool, sqlx::Error> {
        let query = self.query(&AUTHORIZE_ORDER).bind(now).bind(merchant_id.to_owned()).bind(order_no.to_owned());
        self.update_one(query).await
    }

    /// AUTHORIZED -> PAID by the capture's payment of `amount` (at most the order's amount,
    /// which becomes `amount`); false when the order is no longer AUTHORIZED.
    pub async fn capture_order(
        &mut self,
        merchant_id: &str,
        order_no: &str,
        out_trade_no: &str,
        amount: i64,
        now: i64,
    ) -> Result<bool, sqlx::Error> {
        let query = self
            .query(&CAPTURE_ORDER)
            .bind(out_trade_no.to_owned())
            .bind(amount)
            .bind(now)
            .bind(merchant_id.to_owned())
            .bind(order_no.to_owned())
            .bind(amount);
        self.update_one(query).await
    }

    /// AUTHORIZED -> CLOSED with `reason`; false when the order is no longer AUTHORIZED.
    pub async fn close_authorized_order(
        &mut self,
        merchant_id: &str,
        order_no: &str,
        reason: &'static str,
        now: i64,
    ) -> Result<bool, sqlx::Error> {
        let query = self
            .query(&CLOSE_AUTHORIZED_ORDER)
            .bind(reason)
            .bind(now)
            .bind(merchant_id.to_owned())
            .bind(order_no.to_owned());
        self.update_one(query).await
    }

    /// Keys (merchant_id, order_no) of at most `limit` PENDING orders whose expires_at is at
    /// or before `now`, earliest deadline first.
    pub async fn find_expired_orders(&mut self, now: i64, limit: i64) -> Result<Vec<(String, String)>, sqlx::Error> {
        sqlx::query_as(FIND_EXPIRED_ORDERS.text(self.dialect))
            .bind(now)
            .bind(limit)
            .fetch_all(&mut *self.connection)
            .await
    }

    /// PENDING -> PAID by `out_trade_no`, only if the order is still PENDING.
    pub async fn mark_order_paid(
        &mut self,
        merchant_id: &str,
        order_no: &str,
        out_trade_no: &str,
        now: i64,
    ) -> Result<bool, sqlx::Error> {
        let query = self
            .query(&MARK_ORDER_PAID)
            .bind(out_trade_no.to_owned())
            .bind(now)
            .bind(merchant_id.to_owned())
            .bind(order_no.to_owned());
        self.update_one(query).await
    }

    /// Moves an order from (`from_status`, `from_refunded`) to (`to_status`, `to_refunded`),
    /// only if it is still in the `from` state and `to_refunded` is within the order amount:
    /// the refund bound is part of the same conditional statement.
    #[allow(clippy::too_many_arguments)]
    pub async fn transition_order(
        &mut self,
        merchant_id: &str,
        order_no: &str,
        from_status: &str,
        from_refunded: i64,
        to_status: &str,
        to_refunded: i64,
        now: i64,
    ) -> Result<bool, sqlx::Error> {
        let query = self
            .query(&TRANSITION_ORDER)
            .bind(to_status.to_owned())
            .bind(to_refunded)
            .bind(now)
            .bind(merchant_id.to_owned())
            .bind(order_no.to_owned())
            .bind(from_status.to_owned())
            .bind(from_refunded)
            .bind(to_refunded);
        self.update_one(query).await
    }

    pub async fn find_payment(
        &mut self,
        merchant_id: &str,
        out_trade_no: &str,
    ) -> Result<Option<PaymentRow>, sqlx::Error> {
        sqlx::query_as(FIND_PAYMENT.text(self.dialect))
            .bind(merchant_id)
            .bind(out_trade_no)
            .fetch_optional(&mut *self.connection)
            .await
    }

    /// A payment and its order, in one round trip (the read-only replay path of Pay).
    pub async fn find_payment_and_order(
        &mut self,
        merchant_id: &str,
        out_trade_no: &str,
    ) -> Result<Option<(PaymentRow, OrderRow)>, sqlx::Error> {
        let row: Option<AnyRow> = sqlx::query(FIND_PAYMENT_AND_ORDER.text(self.dialect))
            .bind(merchant_id)
            .bind(out_trade_no)
            .fetch_optional(&mut *self.connection)
            .await?;
        row.as_ref().map(payment_and_order).transpose()
    }

    /// The payments of the given (merchant_id, out_trade_no) keys that exist, each with its
    /// order, in one round trip.
    pub async fn find_payments_and_orders(
        &mut self,
        keys: &[(&str, &str)],
    ) -> Result<Vec<(PaymentRow, OrderRow)>, sqlx::Error> {
        self.read_by_pairs(&batch::FIND_PAYMENTS_AND_ORDERS, keys).await?.iter().map(payment_and_order).collect()
    }

    pub async fn insert_payment(&mut self, row: &PaymentRow) -> Result<bool, sqlx::Error> {
        let query = bind_payment(sqlx::query(INSERT_PAYMENT.text(self.dialect)), row);
        self.insert_if_absent(query).await
    }

    pub async fn find_refund(
        &mut self,
        merchant_id: &str,
        out_refund_no: &str,
    ) -> Result<Option<RefundRow>, sqlx::Error> {
        sqlx::query_as(FIND_REFUND.text(self.dialect))
            .bind(merchant_id)
            .bind(out_refund_no)
            .fetch_optional(&mut *self.connection)
            .await
    }

    /// PostgreSQL only: in one statement without locks ([`batch::READ_AT_ONCE_POSTGRES`]), the
    /// payments of `keys.payments` with their orders, the orders of `keys.orders`, the accounts
    /// of `keys.accounts` with the payees of those orders and the payers of those payments, the
    /// answered records of `keys.records` (as [`Queries::find_answered_records`]). Another
    /// backend is refused (a `sqlx::Error::Configuration`); a row that does not decode is a
    /// `sqlx::Error::Decode`.
    pub async fn read_at_once(&mut self, keys: &KeysAtOnce<'_>) -> Result<ReadAtOnce, sqlx::Error> {
        if self.dialect != Dialect::Postgres {
            return Err(sqlx::Error::Configuration("read_at_once is PostgreSQL's only".into()));
        }
        let ids: Vec<[Value<'_>; 1]> = keys.accounts.iter().map(|id| [Value::Text(id)]).collect();
        let query = sqlx::query(batch::READ_AT_ONCE_POSTGRES)
            .bind_rows(self.dialect, &pair_rows(&keys.payments))
            .bind_rows(self.dialect, &pair_rows(&keys.orders))
            .bind_rows(self.dialect, &ids)
            .bind_rows(self.dialect, &pair_rows(&keys.records));
        let mut read = ReadAtOnce::default();
        let mut payments = Vec::new();
        for row in query.fetch_all(&mut *self.connection).await? {
            let kind: String = row.try_get("kind")?;
            let json: String = row.try_get("row")?;
            let decode = |error: serde_json::Error| sqlx::Error::Decode(Box::new(error));
            match kind.as_str() {
                "p" => payments.push(serde_json::from_str::<PaymentRow>(&json).map_err(decode)?),
                "o" => read.orders.push(serde_json::from_str(&json).map_err(decode)?),
                "a" => read.accounts.push(serde_json::from_str(&json).map_err(decode)?),
                "c" => {
                    let record = serde_json::from_str::<RecordAsJson>(&json).map_err(decode)?;
                    read.records.push(record.try_into().map_err(|error| sqlx::Error::Decode(Box::new(error)))?);
                }
                other => return Err(sqlx::Error::Decode(format!("a row of unknown kind {other:?}").into())),
            }
        }
        for payment in payments {
            let order = read
                .orders
                .iter()
                .find(|order| order.merchant_id == payment.merchant_id && order.order_no == payment.order_no)
                .cloned()
                .ok_or_else(|| sqlx::Error::Decode("a payment without its order".into()))?;
            read.payments.push((payment, order));
        }
        Ok(read)
    }

    /// The refunds of the given (merchant_id, out_refund_no) keys that exist, in one round
    /// trip, in no particular order.
    pub async fn find_refunds(&mut self, keys: &[(&str, &str)]) -> Result<Vec<RefundRow>, sqlx::Error> {
        self.read_by_pairs(&batch::FIND_REFUNDS, keys).await?.iter().map(RefundRow::from_row).collect()
    }

    /// The records of the given (scope, idempotency_key) keys that hold a response, in one
    /// round trip, in no particular order (a key without one is absent).
    pub async fn find_answered_records(
        &mut self,
        keys: &[(&str, &str)],
    ) -> Result<Vec<IdempotencyRecordRow>, sqlx::Error> {
        self.read_by_pairs(&batch::FIND_ANSWERED_RECORDS, keys)
            .await?
            .iter()
            .map(IdempotencyRecordRow::from_row)
            .collect()
    }

    /// The request_ids of `deposits` and of `withdrawals` that are taken already, out of the
    /// given ones of each table (by primary key; in no particular order).
    pub async fn find_fundings(
        &mut self,
        deposits: &[&str],
        withdrawals: &[&str],
    ) -> Result<Vec<(FundingTable, String)>, sqlx::Error> {
        let deposits: Vec<[Value<'_>; 1]> = deposits.iter().map(|request_id| [Value::Text(request_id)]).collect();
        let withdrawals: Vec<[Value<'_>; 1]> = withdrawals.iter().map(|request_id| [Value::Text(request_id)]).collect();
        let found: Vec<(String, String)> = sqlx::query_as(batch::FIND_FUNDINGS.text(self.dialect))
            .bind_rows(self.dialect, &deposits)
            .bind_rows(self.dialect, &withdrawals)
            .fetch_all(&mut *self.connection)
            .await?;
        Ok(found
            .into_iter()
            .map(|(table, request_id)| {
                (if table == "D" { FundingTable::Deposits } else { FundingTable::Withdrawals }, request_id)
            })
            .collect())
    }

    /// The journal entries of the given (posting_id, account_id) legs, in no particular order;
    /// a leg that is not there is absent.
    pub async fn find_entries(&mut self, legs: &[(&str, &str)]) -> Result<Vec<EntryRow>, sqlx::Error> {
        self.read_by_pairs(&batch::FIND_ENTRIES, legs).await?.iter().map(EntryRow::from_row).collect()
    }

    /// The rows a batch read (one of `batch`'s statements that take one list of two-text
    /// keys) returns for `keys`, in one round trip.
    async fn read_by_pairs(&mut self, sql: &Sql, keys: &[(&str, &str)]) -> Result<Vec<AnyRow>, sqlx::Error> {
        let rows = pair_rows(keys);
        sqlx::query(sql.text(self.dialect)).bind_rows(self.dialect, &rows).fetch_all(&mut *self.connection).await
    }

    /// Completes the given IN_PROGRESS records of this transaction, each with its `response`
    /// and response message, in one statement (SQLite: one a record, see
    /// [`batch::ServerSql`]): how many it completed.
    pub async fn complete_records(&mut self, records: &[RecordCompletion<'_>]) -> Result<u64, sqlx::Error> {
        if self.dialect == Dialect::Sqlite {
            let mut completed = 0;
            for record in records {
                let (scope, key) = (record.scope, record.idempotency_key);
                completed +=
                    u64::from(self.complete_record(scope, key, record.response, record.response_message).await?);
            }
            return Ok(completed);
        }
        let hex: Vec<[String; 2]> =
            records.iter().map(|record| [hex::encode(record.response), hex::encode(record.response_message)]).collect();
        let rows: Vec<[Value<'_>; 4]> = records
            .iter()
            .zip(&hex)
            .map(|(record, [response, message])| {
                [
                    Value::Text(record.scope),
                    Value::Text(record.idempotency_key),
                    Value::Text(response),
                    Value::Text(message),
                ]
            })
            .collect();
        let query = sqlx::query(batch::COMPLETE_RECORDS.text(self.dialect)).bind_rows(self.dialect, &rows);
        Ok(query.execute(&mut *self.connection).await?.rows_affected())
    }

    /// Claims the idempotency records of several calls of a group commit in one statement,
    /// all or none: true when every row went in; false when none did, because a key was taken
    /// (by a committed record, or one that committed while this statement waited for it) or
    /// because the backend is SQLite, which claims one record at a time in process. The
    /// caller then claims them one at a time ([`Queries::insert_record`]), where an expired
    /// record is replaced and each taken key is named.
    ///
    /// # Errors
    /// The driver error (the batch then fails as a whole).
    pub async fn claim_records(&mut self, records: &[&IdempotencyRecordRow]) -> Result<bool, sqlx::Error> {
        let dialect = self.dialect;
        if dialect == Dialect::Sqlite || records.is_empty() {
            return Ok(dialect != Dialect::Sqlite);
        }
        let hex: Vec<[String; 3]> = records.iter().map(|record| record_hex(record)).collect();
        let rows: Vec<[Value<'_>; batch::RECORD_COLUMNS]> =
            records.iter().zip(&hex).map(|(record, hex)| record_values(record, hex)).collect();
        if dialect == Dialect::MySql {
            return self.insert_rows_text(batch::CLAIM_RECORDS.text(dialect), &rows, records.len() as u64).await;
        }
        let inserted: Vec<(String, String)> = sqlx::query_as(batch::CLAIM_RECORDS.text(dialect))
            .bind_rows(dialect, &rows)
            .fetch_all(&mut *self.connection)
            .await?;
        if inserted.len() == records.len() {
            return Ok(true);
        }
        if !inserted.is_empty() {
            let keys: Vec<[Value<'_>; 2]> =
                inserted.iter().map(|(scope, key)| [Value::Text(scope), Value::Text(key)]).collect();
            sqlx::query(batch::UNCLAIM_RECORDS_POSTGRES)
                .bind_rows(dialect, &keys)
                .execute(&mut *self.connection)
                .await?;
        }
        Ok(false)
    }

    /// Refunds of one order, oldest first.
    pub async fn list_refunds(&mut self, merchant_id: &str, order_no: &str) -> Result<Vec<RefundRow>, sqlx::Error> {
        sqlx::query_as(LIST_REFUNDS.text(self.dialect))
            .bind(merchant_id)
            .bind(order_no)
            .fetch_all(&mut *self.connection)
            .await
    }

    pub async fn insert_refund(&mut self, row: &RefundRow) -> Result<bool, sqlx::Error> {
        let query = self
            .query(&INSERT_REFUND)
            .bind(row.refund_no.clone())
            .bind(row.merchant_id.clone())
            .bind(row.out_refund_no.clone())
            .bind(row.out_trade_no.clone())
            .bind(row.order_no.clone())
            .bind(row.amount)
            .bind(row.currency.clone())
            .bind(row.reason.clone())
            .bind(row.created_at)
            .bind(row.created_by.clone())
            .bind(row.order_refunded_after);
        self.insert_if_absent(query).await
    }

    /// The Deposit or Withdraw of a request_id.
    pub async fn find_funding(
        &mut self,
        table: FundingTable,
        request_id: &str,
    ) -> Result<Option<FundingRow>, sqlx::Error> {
        let statement = match table {
            FundingTable::Deposits => &FIND_DEPOSIT,
            FundingTable::Withdrawals => &FIND_WITHDRAWAL,
        };
        sqlx::query_as(statement.text(self.dialect)).bind(request_id).fetch_optional(&mut *self.connection).await
    }

    /// Records a Deposit or Withdraw; false when its request_id is taken.
    pub async fn insert_funding(&mut self, table: FundingTable, row: &FundingRow) -> Result<bool, sqlx::Error> {
        let statement = match table {
            FundingTable::Deposits => &INSERT_DEPOSIT,
            FundingTable::Withdrawals => &INSERT_WITHDRAWAL,
        };
        let query = self
            .query(statement)
            .bind(row.request_id.clone())
            .bind(row.funding_id.clone())
            .bind(row.account_id.clone())
            .bind(row.amount)
            .bind(row.currency.clone())
            .bind(row.created_at)
            .bind(row.created_by.clone())
            .bind(row.held_after);
        self.insert_if_absent(query).await
    }

    pub async fn find_record(&mut self, scope: &str, key: &str) -> Result<Option<IdempotencyRecordRow>, sqlx::Error> {
        sqlx::query_as(FIND_RECORD.text(self.dialect)).bind(scope).bind(key).fetch_optional(&mut *self.connection).await
    }

    /// Claims (scope, key) with a record (IN_PROGRESS, or already COMPLETED with its
    /// response when the transaction knows it): false when it is taken. A concurrent claim of
    /// the same key waits here, bounded by the lock timeout, for the first transaction's
    /// outcome.
    pub async fn insert_record(&mut self, row: &IdempotencyRecordRow) -> Result<bool, sqlx::Error> {
        let query = self
            .query(&INSERT_RECORD)
            .bind(row.scope.clone())
            .bind(row.idempotency_key.clone())
            .bind(row.method.clone())
            .bind(row.request_fingerprint.clone())
            .bind(row.request_fields.clone())
            .bind(row.response.clone())
            .bind(row.response_message.clone())
            .bind(row.caller_scope.clone())
            .bind(row.status.clone())
            .bind(row.created_at)
            .bind(row.expires_at);
        self.insert_if_absent(query).await
    }

    /// Deletes the record of (scope, key) if it expired by `now`: true when it did.
    pub async fn delete_expired_record(&mut self, scope: &str, key: &str, now: i64) -> Result<bool, sqlx::Error> {
        let query = self.query(&DELETE_EXPIRED_RECORD).bind(scope.to_owned()).bind(key.to_owned()).bind(now);
        self.update_one(query).await
    }

    /// Stores `response` (see [`IdempotencyRecordRow::response`]) and the response message
    /// (encoded protobuf) in a record claimed by this transaction.
    pub async fn complete_record(
        &mut self,
        scope: &str,
        key: &str,
        response: &[u8],
        response_message: &[u8],
    ) -> Result<bool, sqlx::Error> {
        let query = self
            .query(&COMPLETE_RECORD)
            .bind(response.to_vec())
            .bind(response_message.to_vec())
            .bind(scope.to_owned())
            .bind(key.to_owned());
        self.update_one(query).await
    }

    /// Deletes at most `limit` records that expired by `now`; returns how many.
    pub async fn reap_records(&mut self, now: i64, limit: i64) -> Result<u64, sqlx::Error> {
        Ok(self.query(&REAP_RECORDS).bind(now).bind(limit).execute(&mut *self.connection).await?.rows_affected())
    }

    pub async fn insert_token(&mut self, row: &TokenRow) -> Result<(), sqlx::Error> {
        let query = self
            .query(&INSERT_TOKEN)
            .bind(row.token.clone())
            .bind(row.merchant_id.clone())
            .bind(row.purpose.clone())
            .bind(row.created_at)
            .bind(row.expires_at)
            .bind(row.caller_tag.clone());
        query.execute(&mut *self.connection).await?;
        Ok(())
    }

    pub async fn find_token(&mut self, token: &str) -> Result<Option<TokenRow>, sqlx::Error> {
        sqlx::query_as(FIND_TOKEN.text(self.dialect)).bind(token).fetch_optional(&mut *self.connection).await
    }

    /// Sets, rolls back to or releases the one savepoint a transaction's body uses at a time
    /// (`guard_claim`; the same text on all three backends). Sent as plain text, never
    /// prepared: MySQL prepares no savepoint statements, and they need no values.
    pub async fn savepoint(&mut self, step: Savepoint) -> Result<(), sqlx::Error> {
        let text = match step {
            Savepoint::Set => "SAVEPOINT guard_claim",
            Savepoint::RollBack => "ROLLBACK TO SAVEPOINT guard_claim",
            Savepoint::Release => "RELEASE SAVEPOINT guard_claim",
        };
        sqlx::Executor::execute(&mut *self.connection, text).await?;
        Ok(())
    }

    /// Consumes an unexpired, unconsumed token: true when this transaction consumed it. A
    /// concurrent consumer waits on the row lock for this one's outcome.
    pub async fn consume_token(&mut self, token: &str, now: i64) -> Result<bool, sqlx::Error> {
        let query = self.query(&CONSUME_TOKEN).bind(now).bind(token.to_owned()).bind(now);
        self.update_one(query).await
    }

    /// Deletes at most `limit` tokens that expired by `now`; returns how many.
    pub async fn reap_tokens(&mut self, now: i64, limit: i64) -> Result<u64, sqlx::Error> {
        Ok(self.query(&REAP_TOKENS).bind(now).bind(limit).execute(&mut *self.connection).await?.rows_affected())
    }

    pub async fn insert_transfer(&mut self, row: &TransferRow) -> Result<(), sqlx::Error> {
        let query = self
            .query(&INSERT_TRANSFER)
            .bind(row.transfer_id.clone())
            .bind(row.from_account_id.clone())
            .bind(row.to_account_id.clone())
            .bind(row.amount)
            .bind(row.currency.clone())
            .bind(row.memo.clone())
            .bind(row.created_at)
            .bind(row.created_by.clone());
        query.execute(&mut *self.connection).await?;
        Ok(())
    }

    /// Reads the given orders and, when `locks` is [`RowLocks::Taken`], locks their rows until
    /// the transaction ends, in the order given, which must be key order (byte order of
    /// merchant_id, then order_no: so two transactions locking overlapping sets cannot deadlock
    /// on them). Missing keys are simply absent from the result, which comes in no particular
    /// order.
    pub async fn lock_orders(&mut self, keys: &[(&str, &str)], locks: RowLocks) -> Result<Vec<OrderRow>, sqlx::Error> {
        let rows = pair_rows(keys);
        let sql = match locks {
            RowLocks::Taken => &batch::LOCK_ORDERS,
            RowLocks::None => &batch::READ_ORDERS,
        };
        sqlx::query_as(sql.text(self.dialect)).bind_rows(self.dialect, &rows).fetch_all(&mut *self.connection).await
    }

    /// Reads the given accounts and, when `locks` is [`RowLocks::Taken`], locks their rows until
    /// the transaction ends, in the order given, which must be ascending byte order of
    /// account_id: the order in which single postings take their row locks too. Missing ids are
    /// absent from the result, which comes in no particular order.
    pub async fn lock_accounts(
        &mut self,
        account_ids: &[&str],
        locks: RowLocks,
    ) -> Result<Vec<AccountRow>, sqlx::Error> {
        let rows: Vec<[Value<'_>; 1]> = account_ids.iter().map(|account_id| [Value::Text(account_id)]).collect();
        let sql = match locks {
            RowLocks::Taken => &batch::LOCK_ACCOUNTS,
            RowLocks::None => &batch::READ_ACCOUNTS,
        };
        sqlx::query_as(sql.text(self.dialect)).bind_rows(self.dialect, &rows).fetch_all(&mut *self.connection).await
    }

    /// Writes what a group commit accepted, all or nothing: the new orders (one INSERT of all
    /// rows), the payments (one INSERT), PENDING -> PAID for their orders (one conditional
    /// UPDATE), the refunds (one INSERT) and the refund CAS of their orders (one conditional
    /// UPDATE), the transfers, deposits and withdrawals (one INSERT each), the new balances
    /// (one version CAS per account, all in one UPDATE) and the journal entries in the order
    /// given (one INSERT; entry ids follow that order). True when every row was written; false
    /// when a key (an order's (merchant_id, order_no), out_trade_no, an order's one payment,
    /// out_refund_no, a request_id), an order's state or an account's version was taken under
    /// the batch: the caller must roll back. On PostgreSQL this is one statement
    /// (data-modifying CTEs, each run exactly once) that fails whole when a row is missing (see
    /// `batch::write_batch_postgres`), so it can also commit itself, outside a transaction;
    /// elsewhere one a kind of row the batch has; each has one text whatever the batch holds
    /// (see `batch`).
    pub async fn write_batch(&mut self, written: &BatchWrite<'_>) -> Result<bool, sqlx::Error> {
        let dialect = self.dialect;
        let payments: Vec<[Value<'_>; batch::PAYMENT_COLUMNS]> = written.payments.iter().map(payment_values).collect();
        // The orders' UPDATEs in key order, as a locked batch locks them, so that a write
        // without row locks of several orders cannot deadlock with one (docs/write-engine.md).
        let mut paid: Vec<&PaymentRow> = written.payments.iter().collect();
        paid.sort_by(|a, b| (&a.merchant_id, &a.order_no).cmp(&(&b.merchant_id, &b.order_no)));
        let orders: Vec<[Value<'_>; 3]> = paid
            .into_iter()
            .map(|row| [Value::Text(&row.merchant_id), Value::Text(&row.order_no), Value::Text(&row.out_trade_no)])
            .collect();
        let balances: Vec<[Value<'_>; 7]> = written
            .balances
            .iter()
            .map(|update| {
                [
                    Value::Text(update.account_id),
                    Value::Int(update.balance),
                    Value::Int(update.expected_version),
                    Value::Int(update.version),
                    Value::Int(update.held),
                    update.chain_hash.map_or(Value::Null, Value::Text),
                    Value::Int(update.expected_held),
                ]
            })
            .collect();
        let entries: Vec<[Value<'_>; batch::ENTRY_COLUMNS]> = written.entries.iter().map(entry_values).collect();
        let refunds: Vec<[Value<'_>; batch::REFUND_COLUMNS]> = written.refunds.iter().map(refund_values).collect();
        let mut refunded_orders: Vec<&OrderRefund<'_>> = written.refunded_orders.iter().collect();
        refunded_orders.sort_by(|a, b| (a.merchant_id, a.order_no).cmp(&(b.merchant_id, b.order_no)));
        let refunded: Vec<[Value<'_>; 6]> = refunded_orders
            .into_iter()
            .map(|order| {
                [
                    Value::Text(order.merchant_id),
                    Value::Text(order.order_no),
                    Value::Text(order.from_status),
                    Value::Int(order.from_refunded),
                    Value::Text(order.to_status),
                    Value::Int(order.to_refunded),
                ]
            })
            .collect();
        let transfers: Vec<[Value<'_>; batch::TRANSFER_COLUMNS]> =
            written.transfers.iter().map(transfer_values).collect();
        let deposits: Vec<[Value<'_>; batch::FUNDING_COLUMNS]> = written.deposits.iter().map(funding_values).collect();
        let withdrawals: Vec<[Value<'_>; batch::FUNDING_COLUMNS]> =
            written.withdrawals.iter().map(funding_values).collect();
        let created: Vec<[Value<'_>; batch::ORDER_COLUMNS]> = written.orders.iter().map(order_values).collect();
        let records_hex: Vec<[String; 3]> = written.records.iter().map(record_hex).collect();
        let records: Vec<[Value<'_>; batch::RECORD_COLUMNS]> =
            written.records.iter().zip(&records_hex).map(|(record, hex)| record_values(record, hex)).collect();
        let expected = [
            payments.len(),
            orders.len(),
            balances.len(),
            entries.len(),
            refunds.len(),
            refunded.len(),
            transfers.len(),
            deposits.len(),
            withdrawals.len(),
            created.len(),
            records.len(),
        ]
        .map(|count| count as u64);
        if dialect == Dialect::Postgres {
            // The statement's shape (see `batch::write_batch_postgres`), its parts bound in order.
            let shape = batch::postgres_write_shape(&expected);
            if shape == 0 {
                return Ok(true);
            }
            let has = |part: usize| shape & (1 << part) != 0;
            let mut query = sqlx::query(batch::write_batch_postgres(shape)).bind(written.now);
            if has(0) {
                query = query.bind_rows(dialect, &payments);
            }
            if has(1) {
                query = query.bind_rows(dialect, &orders);
            }
            if has(2) {
                query = query.bind_rows(dialect, &balances);
            }
            if has(3) {
                query = query.bind_rows(dialect, &entries);
            }
            if has(4) {
                query = query.bind_rows(dialect, &refunds);
            }
            if has(5) {
                query = query.bind_rows(dialect, &refunded);
            }
            if has(6) {
                query = query.bind_rows(dialect, &transfers);
            }
            if has(7) {
                query = query.bind_rows(dialect, &deposits);
            }
            if has(8) {
                query = query.bind_rows(dialect, &withdrawals);
            }
            if has(9) {
                query = query.bind_rows(dialect, &created);
            }
            if has(10) {
                query = query.bind_rows(dialect, &records);
            }
            let counts: Vec<i64> =
                expected.iter().enumerate().filter(|(part, _)| has(*part)).map(|(_, count)| *count as i64).collect();
            let array: Vec<String> = counts.iter().map(i64::to_string).collect();
            query = query.bind(format!("{{{}}}", array.join(",")));
            // Read to its end, not to its first row (sqlx's Any driver stops there in
            // `fetch_one`, leaving the rest for the connection's next user): an error raised at
            // the statement's end (an AFTER trigger's check) or by its implicit commit comes
            // after the row, and `Ok(true)` must mean committed.
            let row = match query.fetch_all(&mut *self.connection).await {
                Ok(rows) => rows.into_iter().next().ok_or(sqlx::Error::RowNotFound)?,
                Err(error) if batch::is_write_missed(&error) => return Ok(false),
                Err(error) => return Err(error),
            };
            for (column, expected) in counts.iter().enumerate() {
                if row.try_get::<i64, _>(column)? != *expected {
                    return Ok(false);
                }
            }
            return Ok(true);
        }
        // The records first, as a locked batch claims them before it writes.
        if dialect == Dialect::MySql {
            if !records.is_empty()
                && !self.insert_rows_text(batch::CLAIM_RECORDS.text(dialect), &records, expected[10]).await?
            {
                return Ok(false);
            }
        } else {
            for record in written.records {
                if !self.insert_record(record).await? {
                    return Ok(false);
                }
            }
        }
        // Each step runs only when the batch has rows of its kind: a batch of Refunds sends
        // no payment statements, and the other way round.
        if !created.is_empty() && !self.insert_rows(&batch::INSERT_ORDERS, &created, expected[9]).await? {
            return Ok(false);
        }
        if !payments.is_empty() && !self.insert_rows(&batch::INSERT_PAYMENTS, &payments, expected[0]).await? {
            return Ok(false);
        }
        if !orders.is_empty() && !self.update_rows(&batch::MARK_ORDERS_PAID, &orders, written.now, expected[1]).await? {
            return Ok(false);
        }
        if !refunds.is_empty() && !self.insert_rows(&batch::INSERT_REFUNDS, &refunds, expected[4]).await? {
            return Ok(false);
        }
        if !refunded.is_empty() && !self.update_rows(&batch::REFUND_ORDERS, &refunded, written.now, expected[5]).await?
        {
            return Ok(false);
        }
        if !transfers.is_empty() && !self.insert_rows(&batch::INSERT_TRANSFERS, &transfers, expected[6]).await? {
            return Ok(false);
        }
        if !deposits.is_empty() && !self.insert_rows(&batch::INSERT_DEPOSITS, &deposits, expected[7]).await? {
            return Ok(false);
        }
        if !withdrawals.is_empty() && !self.insert_rows(&batch::INSERT_WITHDRAWALS, &withdrawals, expected[8]).await? {
            return Ok(false);
        }
        if !balances.is_empty() && !self.update_rows(&batch::CAS_BALANCES, &balances, written.now, expected[2]).await? {
            return Ok(false);
        }
        if entries.is_empty() {
            return Ok(true);
        }
        self.insert_rows(&batch::INSERT_ENTRIES, &entries, expected[3]).await
    }

    /// One multi-row INSERT step of [`Queries::write_batch`] (MySQL, SQLite): false when fewer
    /// than `expected` rows went in (a key taken: a duplicate-key error on MySQL, a row
    /// skipped by `ON CONFLICT DO NOTHING` on SQLite).
    async fn insert_rows<const N: usize>(
        &mut self,
        sql: &batch::StepSql,
        rows: &[[Value<'_>; N]],
        expected: u64,
    ) -> Result<bool, sqlx::Error> {
        self.insert_rows_text(sql.text(self.dialect), rows, expected).await
    }

    /// [`Queries::insert_rows`] for a statement given as its text (on MySQL, a duplicate-key
    /// error undoes the whole statement: nothing of it went in).
    async fn insert_rows_text<const N: usize>(
        &mut self,
        text: &'static str,
        rows: &[[Value<'_>; N]],
        expected: u64,
    ) -> Result<bool, sqlx::Error> {
        let dialect = self.dialect;
        match sqlx::query(text).bind_rows(dialect, rows).execute(&mut *self.connection).await {
            Ok(result) => Ok(result.rows_affected() == expected),
            Err(sqlx::Error::Database(error)) if dialect == Dialect::MySql && error.is_unique_violation() => Ok(false),
            Err(error) => Err(error),
        }
    }

    /// One conditional multi-row UPDATE step of [`Queries::write_batch`] (MySQL, SQLite), with
    /// `updated_at = now`: false when fewer than `expected` rows moved.
    async fn update_rows<const N: usize>(
        &mut self,
        sql: &batch::StepSql,
        rows: &[[Value<'_>; N]],
        now: i64,
        expected: u64,
    ) -> Result<bool, sqlx::Error> {
        let dialect = self.dialect;
        let query = sqlx::query(sql.text(dialect)).bind_rows(dialect, rows).bind(now);
        Ok(query.execute(&mut *self.connection).await?.rows_affected() == expected)
    }

    /// Accounts in the ledger (also: whether the schema is there at all).
    pub async fn count_accounts(&mut self) -> Result<i64, sqlx::Error> {
        sqlx::query("SELECT COUNT(*) FROM accounts").fetch_one(&mut *self.connection).await?.try_get(0)
    }

    /// Runs every ledger invariant check and returns what breaks them (empty when sound);
    /// `progress` hears of each check as it finishes.
    pub async fn audit(
        &mut self,
        progress: &mut (dyn FnMut(AuditProgress) + Send),
    ) -> Result<Vec<AuditViolation>, sqlx::Error> {
        let mut violations = Vec::new();
        let of = AUDIT_CHECKS.len() + 1;
        for (index, (check, sql)) in AUDIT_CHECKS.iter().enumerate() {
            let rows: Vec<AnyRow> = self.query(sql).fetch_all(&mut *self.connection).await?;
            violations.extend(audit_violations(check, &rows)?);
            progress(AuditProgress { check, done: index + 1, of, violations: rows.len() });
        }
        let broken = self.audit_chain(None).await?;
        progress(AuditProgress { check: CHAIN_CHECK, done: of, of, violations: broken.len() });
        violations.extend(broken);
        Ok(violations)
    }

    /// Checks what the journal entries with ids in `(after, upto]` wrote: each entry continues
    /// its account's chain of balances, versions and hashes, each posting has two legs summing
    /// to zero, each posting has its payment, refund, deposit or transfer row, and the orders of
    /// those payments and refunds agree with them; then that every account holds its latest
    /// entry's balance, version and hash, and that the balances of each currency sum to zero
    /// (two reads of `accounts`, whose time grows with the accounts, not the journal). Together with a full [`Queries::audit`] that passed up to `after`, this
    /// proves every balance still equals the sum of its entries.
    pub async fn audit_entries(
        &mut self,
        after: i64,
        upto: i64,
        progress: &mut (dyn FnMut(AuditProgress) + Send),
    ) -> Result<Vec<AuditViolation>, sqlx::Error> {
        let mut violations = Vec::new();
        let of = AUDIT_ENTRY_CHECKS.len() + 2;
        for (index, (check, sql)) in AUDIT_ENTRY_CHECKS.iter().enumerate() {
            let mut query = sqlx::query(sql.text(self.dialect));
            for _ in 0..sql.placeholders() / 2 {
                query = query.bind(after).bind(upto);
            }
            let rows: Vec<AnyRow> = query.fetch_all(&mut *self.connection).await?;
            violations.extend(audit_violations(check, &rows)?);
            progress(AuditProgress { check, done: index + 1, of, violations: rows.len() });
        }
        let broken = self.audit_chain(Some((after, upto))).await?;
        progress(AuditProgress { check: CHAIN_CHECK, done: of - 1, of, violations: broken.len() });
        violations.extend(broken);
        let (check, currencies) = &AUDIT_CHECKS[CURRENCY_SUMS];
        let rows: Vec<AnyRow> = self.query(currencies).fetch_all(&mut *self.connection).await?;
        violations.extend(audit_violations(check, &rows)?);
        progress(AuditProgress { check, done: of, of, violations: rows.len() });
        Ok(violations)
    }

    /// Walks every account's chain of entry hashes (see [`super::chain`]), or only the entries
    /// with ids in `range` `(after, upto]`, each chained from its account's entry before the
    /// range as stored: each entry must carry the hash of its fields and of its account's
    /// chained entry before it, except those in a range of `unchained_entries` (written before
    /// the chain, or by the seed), which carry none and come before its account's first. Each
    /// account's head is checked by [`ACCOUNT_HEADS`]. Reads the journal as a stream, so memory
    /// does not grow with it.
    pub async fn audit_chain(&mut self, range: Option<(i64, i64)>) -> Result<Vec<AuditViolation>, sqlx::Error> {
        use futures_util::TryStreamExt;
        let mut violations = Vec::new();
        let mut unchained: Vec<(i64, i64)> = Vec::new();
        for row in self.query(&UNCHAINED_RANGES).fetch_all(&mut *self.connection).await? {
            unchained.push((row.try_get(0)?, row.try_get(1)?));
        }
        let outside_chain = |entry_id: i64| unchained.iter().any(|(first, last)| (*first..=*last).contains(&entry_id));
        let after = range.map_or(i64::MIN, |(after, _)| after);
        let query = match range {
            None => self.query(&CHAIN_ENTRIES),
            Some((after, upto)) => self.query(&RANGE_CHAIN).bind(after).bind(upto).bind(after).bind(upto),
        };
        let mut rows = query.fetch(&mut *self.connection);
        let mut walk: Option<ChainWalk> = None;
        while let Some(row) = rows.try_next().await? {
            let account_id: String = row.try_get(0)?;
            let walking = match &mut walk {
                Some(walking) if walking.account_id == account_id => walking,
                _ => walk.insert(ChainWalk { account_id, previous: None }),
            };
            let entry_id: i64 = row.try_get(11)?;
            let stored: Option<String> = row.try_get(12)?;
            if entry_id <= after {
                // The entry before the range, checked by an earlier audit.
                walking.previous = stored.as_deref().map(chain::stored);
                continue;
            }
            let broken = |detail: String| AuditViolation {
                check: CHAIN_CHECK,
                subject: walking.account_id.clone(),
                detail: format!("entry {entry_id}: {detail}"),
            };
            if entry_id < 1 {
                violations.push(broken("an id below 1, which the journal never assigns".to_owned()));
            }
            let Some(stored) = stored else {
                if !outside_chain(entry_id) {
                    violations.push(broken("no hash, and no range of unchained_entries holds it".to_owned()));
                } else if walking.previous.is_some() {
                    violations.push(broken("no hash, after an entry of its account with one".to_owned()));
                }
                continue;
            };
            if outside_chain(entry_id) {
                violations.push(broken("a hash, though a range of unchained_entries holds it".to_owned()));
            }
            let entry = ChainedEntry {
                account_id: &walking.account_id,
                currency: &row.try_get::<String, _>(1)?,
                amount: row.try_get(2)?,
                balance_after: row.try_get(3)?,
                version_after: row.try_get(4)?,
                kind: &row.try_get::<String, _>(5)?,
                reference: &row.try_get::<String, _>(6)?,
                posting_id: &row.try_get::<String, _>(7)?,
                counterparty_account_id: &row.try_get::<String, _>(8)?,
                created_at: row.try_get(9)?,
                created_by: &row.try_get::<String, _>(10)?,
            };
            let expected = chain::entry_hash(&walking.previous.unwrap_or(chain::GENESIS), &entry);
            if chain::from_hex(&stored) != Some(expected) {
                violations
                    .push(broken("its hash is not that of its fields and of its account's entry before it".to_owned()));
            }
            // On from the hash as stored: one edited entry is reported once, not with every
            // entry after it.
            walking.previous = Some(chain::stored(&stored));
        }
        Ok(violations)
    }

    /// The leaves of a [`chain::JournalDigest`] at entry `upto`, sorted by name (byte order):
    /// each account with an entry at or before `upto`, with its latest chained hash there
    /// ([`chain::GENESIS`] when none is chained); how many entries there are up to `upto`; and
    /// the ranges of `unchained_entries` up to `upto`.
    pub async fn digest_leaves(&mut self, upto: i64) -> Result<Vec<(String, Hash)>, sqlx::Error> {
        let rows = self.query(&CHAIN_HEADS).bind(upto).fetch_all(&mut *self.connection).await?;
        let mut leaves = Vec::with_capacity(rows.len() + 2);
        for row in rows {
            let first: Option<i64> = row.try_get(2)?;
            if first.is_some_and(|first| first <= upto) {
                let head: Option<String> = row.try_get(1)?;
                leaves.push((row.try_get::<String, _>(0)?, head.as_deref().map_or(chain::GENESIS, chain::stored)));
            }
        }
        let entries: i64 = self.query(&ENTRIES_UPTO).bind(upto).fetch_one(&mut *self.connection).await?.try_get(0)?;
        leaves.push(chain::count_leaf(entries));
        let mut ranges = Vec::new();
        for row in self.query(&UNCHAINED_RANGES).fetch_all(&mut *self.connection).await? {
            let (first, last): (i64, i64) = (row.try_get(0)?, row.try_get(1)?);
            if first <= upto {
                ranges.push((first, last.min(upto)));
            }
        }
        ranges.sort_unstable();
        leaves.push(chain::ranges_leaf(&ranges));
        leaves.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        Ok(leaves)
    }

    /// The id of the newest journal entry written at or before `time` (microseconds since the
    /// epoch); 0 when there is none.
    pub async fn settled_entry(&mut self, time: i64) -> Result<i64, sqlx::Error> {
        let row: Option<AnyRow> = self.query(&SETTLED_ENTRY).bind(time).fetch_optional(&mut *self.connection).await?;
        row.map_or(Ok(0), |row| row.try_get(0))
    }
}

/// One violation per row of an audit check's (subject, detail) rows.
fn audit_violations(check: &'static str, rows: &[AnyRow]) -> Result<Vec<AuditViolation>, sqlx::Error> {
    rows.iter().map(|row| Ok(AuditViolation { check, subject: row.try_get(0)?, detail: row.try_get(1)? })).collect()
}

/// What one group commit writes (see [`Queries::write_batch`]).
pub struct BatchWrite<'a> {
    pub payments: &'a [PaymentRow],
    pub refunds: &'a [RefundRow],
    pub transfers: &'a [TransferRow],
    /// The rows of the Deposits, and of the Withdraws.
    pub deposits: &'a [FundingRow],
    pub withdrawals: &'a [FundingRow],
    /// New PENDING orders (CreateOrder), none of them paid or refunded by the same batch.
    pub orders: &'a [OrderRow],
    /// One refund CAS an order the batch refunds (from its state read under the lock to its
    /// state after the batch's last refund of it).
    pub refunded_orders: &'a [OrderRefund<'a>],
    pub balances: &'a [BalanceUpdate<'a>],
    /// Two legs per payment, refund and transfer, in the order the balances moved.
    pub entries: &'a [NewEntry<'a>],
    /// Idempotency records claimed with the write, COMPLETED (a call written without row
    /// locks, whose guards no transaction claimed before); a key taken misses the write.
    pub records: &'a [IdempotencyRecordRow],
    pub now: i64,
}

/// One claimed record's answer for [`Queries::complete_records`].
pub struct RecordCompletion<'a> {
    pub scope: &'a str,
    pub idempotency_key: &'a str,
    /// What the record's `response` holds (see [`IdempotencyRecordRow::response`]).
    pub response: &'a [u8],
    /// The response message as the caller receives it (encoded protobuf).
    pub response_message: &'a [u8],
}

/// An order's refund CAS in a group commit: from (`from_status`, `from_refunded`) to
/// (`to_status`, `to_refunded`), refunded amounts in minor units.
pub struct OrderRefund<'a> {
    pub merchant_id: &'a str,
    pub order_no: &'a str,
    pub from_status: &'a str,
    pub from_refunded: i64,
    pub to_status: &'a str,
    pub to_refunded: i64,
}

/// Key pairs as rows of a batch statement's two text columns.
fn pair_rows<'a>(keys: &[(&'a str, &'a str)]) -> Vec<[Value<'a>; 2]> {
    keys.iter().map(|(first, second)| [Value::Text(first), Value::Text(second)]).collect()
}

/// Binds the rows of a batch statement (see [`batch::bind_rows`]), to a query with or without
/// a row type.
trait BindRows: Sized {
    fn bind_rows<const N: usize>(self, dialect: Dialect, rows: &[[Value<'_>; N]]) -> Self;
}

impl BindRows for AnyQuery<'_> {
    fn bind_rows<const N: usize>(self, dialect: Dialect, rows: &[[Value<'_>; N]]) -> Self {
        batch::bind_rows(dialect, rows).into_iter().fold(self, |query, value| query.bind(value))
    }
}

impl<'q, O> BindRows for QueryAs<'q, Any, O, AnyArguments<'q>> {
    fn bind_rows<const N: usize>(self, dialect: Dialect, rows: &[[Value<'_>; N]]) -> Self {
        batch::bind_rows(dialect, rows).into_iter().fold(self, |query, value| query.bind(value))
    }
}

/// The three byte columns of an idempotency record as hexadecimal text, for
/// [`record_values`]: request_fields, response, response_message (an absent one empty).
fn record_hex(record: &IdempotencyRecordRow) -> [String; 3] {
    let bytes = |value: &Option<Vec<u8>>| value.as_deref().map(hex::encode).unwrap_or_default();
    [hex::encode(&record.request_fields), bytes(&record.response), bytes(&record.response_message)]
}

/// An idempotency record as a row of [`batch::CLAIM_RECORDS`] (and of the records' part of
/// PostgreSQL's write statement), its byte columns given as `hex` ([`record_hex`]).
fn record_values<'a>(record: &'a IdempotencyRecordRow, hex: &'a [String; 3]) -> [Value<'a>; batch::RECORD_COLUMNS] {
    let [fields, response, message] = hex;
    let nulls = i64::from(record.response.is_none())
        | i64::from(record.response_message.is_none()) << 1
        | i64::from(record.caller_scope.is_none()) << 2;
    [
        Value::Text(&record.scope),
        Value::Text(&record.idempotency_key),
        Value::Text(&record.method),
        Value::Text(&record.request_fingerprint),
        Value::Text(fields),
        Value::Text(response),
        Value::Text(message),
        Value::Text(record.caller_scope.as_deref().unwrap_or_default()),
        Value::Text(&record.status),
        Value::Int(record.created_at),
        Value::Int(record.expires_at),
        Value::Int(nulls),
    ]
}

/// A payment as a row of [`batch::INSERT_PAYMENTS`], in `insert_payment_into!`'s column order.
fn payment_values(row: &PaymentRow) -> [Value<'_>; batch::PAYMENT_COLUMNS] {
    [
        Value::Text(&row.trade_no),
        Value::Text(&row.merchant_id),
        Value::Text(&row.out_trade_no),
        Value::Text(&row.order_no),
        Value::Text(&row.payer_account_id),
        Value::Text(&row.payee_account_id),
        Value::Int(row.amount),
        Value::Text(&row.currency),
        Value::Text(&row.status),
        Value::Int(row.created_at),
        Value::Text(&row.created_by),
    ]
}

/// A refund as a row of [`batch::INSERT_REFUNDS`], in `insert_refund_into!`'s column order.
fn refund_values(row: &RefundRow) -> [Value<'_>; batch::REFUND_COLUMNS] {
    [
        Value::Text(&row.refund_no),
        Value::Text(&row.merchant_id),
        Value::Text(&row.out_refund_no),
        Value::Text(&row.out_trade_no),
        Value::Text(&row.order_no),
        Value::Int(row.amount),
        Value::Text(&row.currency),
        Value::Text(&row.reason),
        Value::Int(row.created_at),
        Value::Text(&row.created_by),
        row.order_refunded_after.map_or(Value::Null, Value::Int),
    ]
}

/// A transfer as a row of [`batch::INSERT_TRANSFERS`], in `insert_transfer_into!`'s column order.
fn transfer_values(row: &TransferRow) -> [Value<'_>; batch::TRANSFER_COLUMNS] {
    [
        Value::Text(&row.transfer_id),
        Value::Text(&row.from_account_id),
        Value::Text(&row.to_account_id),
        Value::Int(row.amount),
        Value::Text(&row.currency),
        Value::Text(&row.memo),
        Value::Int(row.created_at),
        Value::Text(&row.created_by),
    ]
}

/// A new order as a row of [`batch::INSERT_ORDERS`] (`expires_at` 0 for none).
fn order_values(row: &OrderRow) -> [Value<'_>; batch::ORDER_COLUMNS] {
    [
        Value::Text(&row.merchant_id),
        Value::Text(&row.order_no),
        Value::Text(&row.payee_account_id),
        Value::Int(row.amount),
        Value::Text(&row.currency),
        Value::Text(&row.subject),
        Value::Text(&row.status),
        Value::Int(row.created_at),
        Value::Int(row.expires_at.unwrap_or(0)),
    ]
}

/// A Deposit or Withdraw as a row of [`batch::INSERT_DEPOSITS`] or
/// [`batch::INSERT_WITHDRAWALS`], in `insert_deposit_into!`'s column order.
fn funding_values(row: &FundingRow) -> [Value<'_>; batch::FUNDING_COLUMNS] {
    [
        Value::Text(&row.request_id),
        Value::Text(&row.funding_id),
        Value::Text(&row.account_id),
        Value::Int(row.amount),
        Value::Text(&row.currency),
        Value::Int(row.created_at),
        Value::Text(&row.created_by),
        row.held_after.map_or(Value::Null, Value::Int),
    ]
}

/// An entry as a row of [`batch::INSERT_ENTRIES`], in `insert_entry_into!`'s column order.
fn entry_values<'a>(entry: &'a NewEntry<'a>) -> [Value<'a>; batch::ENTRY_COLUMNS] {
    [
        Value::Text(entry.account_id),
        Value::Text(entry.currency),
        Value::Int(entry.amount),
        Value::Int(entry.balance_after),
        Value::Int(entry.version_after),
        Value::Text(entry.kind),
        Value::Text(entry.reference),
        Value::Text(entry.posting_id),
        Value::Text(entry.counterparty_account_id),
        Value::Int(entry.created_at),
        Value::Text(entry.created_by),
        Value::Text(&entry.entry_hash),
    ]
}

fn bind_payment<'q>(query: AnyQuery<'q>, row: &'q PaymentRow) -> AnyQuery<'q> {
    query
        .bind(row.trade_no.as_str())
        .bind(row.merchant_id.as_str())
        .bind(row.out_trade_no.as_str())
        .bind(row.order_no.as_str())
        .bind(row.payer_account_id.as_str())
        .bind(row.payee_account_id.as_str())
        .bind(row.amount)
        .bind(row.currency.as_str())
        .bind(row.status.as_str())
        .bind(row.created_at)
        .bind(row.created_by.as_str())
}

/// A row of `payment_and_order_select!`.
fn payment_and_order(row: &AnyRow) -> Result<(PaymentRow, OrderRow), sqlx::Error> {
    let payment = PaymentRow::from_row(row)?;
    let order = OrderRow {
        merchant_id: payment.merchant_id.clone(),
        order_no: payment.order_no.clone(),
        payee_account_id: row.try_get("o_payee_account_id")?,
        amount: row.try_get("o_amount")?,
        currency: row.try_get("o_currency")?,
        subject: row.try_get("o_subject")?,
        status: row.try_get("o_status")?,
        out_trade_no: row.try_get("o_out_trade_no")?,
        refunded_amount: row.try_get("o_refunded_amount")?,
        created_at: row.try_get("o_created_at")?,
        updated_at: row.try_get("o_updated_at")?,
        expires_at: row.try_get("o_expires_at")?,
        close_reason: row.try_get("o_close_reason")?,
    };
    Ok((payment, order))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every statement of this file, by name.
    fn statements() -> Vec<(&'static str, &'static Sql)> {
        let mut statements: Vec<(&'static str, &'static Sql)> = vec![
            ("FIND_ACCOUNT", &FIND_ACCOUNT),
            ("FIND_TWO_ACCOUNTS", &FIND_TWO_ACCOUNTS),
            ("INSERT_ACCOUNT", &INSERT_ACCOUNT),
            ("FIND_ENTRY", &FIND_ENTRY),
            ("LIST_ENTRIES", &LIST_ENTRIES),
            ("FIND_ORDER", &FIND_ORDER),
            ("FIND_ORDER_FOR_UPDATE", &FIND_ORDER_FOR_UPDATE),
            ("TRY_LOCK_ORDER", &TRY_LOCK_ORDER),
            ("INSERT_ORDER", &INSERT_ORDER),
            ("CLOSE_ORDER", &CLOSE_ORDER),
            ("EXPIRE_ORDER", &EXPIRE_ORDER),
            ("FIND_EXPIRED_ORDERS", &FIND_EXPIRED_ORDERS),
            ("MARK_ORDER_PAID", &MARK_ORDER_PAID),
            ("TRANSITION_ORDER", &TRANSITION_ORDER),
            ("FIND_ORDER_AND_HOLD", &FIND_ORDER_AND_HOLD),
            ("INSERT_HOLD", &INSERT_HOLD),
            ("FIND_HOLD", &FIND_HOLD),
            ("FIND_HOLD_OF_ORDER", &FIND_HOLD_OF_ORDER),
            ("SETTLE_HOLD", &SETTLE_HOLD),
            ("FIND_EXPIRED_HOLDS", &FIND_EXPIRED_HOLDS),
            ("AUTHORIZE_ORDER", &AUTHORIZE_ORDER),
            ("CAPTURE_ORDER", &CAPTURE_ORDER),
            ("CLOSE_AUTHORIZED_ORDER", &CLOSE_AUTHORIZED_ORDER),
            ("FIND_PAYMENT", &FIND_PAYMENT),
            ("FIND_PAYMENT_AND_ORDER", &FIND_PAYMENT_AND_ORDER),
            ("INSERT_PAYMENT", &INSERT_PAYMENT),
            ("FIND_REFUND", &FIND_REFUND),
            ("LIST_REFUNDS", &LIST_REFUNDS),
            ("INSERT_REFUND", &INSERT_REFUND),
            ("FIND_DEPOSIT", &FIND_DEPOSIT),
            ("INSERT_DEPOSIT", &INSERT_DEPOSIT),
            ("FIND_WITHDRAWAL", &FIND_WITHDRAWAL),
            ("INSERT_WITHDRAWAL", &INSERT_WITHDRAWAL),
            ("FIND_RECORD", &FIND_RECORD),
            ("INSERT_RECORD", &INSERT_RECORD),
            ("DELETE_EXPIRED_RECORD", &DELETE_EXPIRED_RECORD),
            ("COMPLETE_RECORD", &COMPLETE_RECORD),
            ("REAP_RECORDS", &REAP_RECORDS),
            ("INSERT_TOKEN", &INSERT_TOKEN),
            ("FIND_TOKEN", &FIND_TOKEN),
            ("CONSUME_TOKEN", &CONSUME_TOKEN),
            ("REAP_TOKENS", &REAP_TOKENS),
            ("INSERT_TRANSFER", &INSERT_TRANSFER),
            ("SETTLED_ENTRY", &SETTLED_ENTRY),
            ("UNCHAINED_RANGES", &UNCHAINED_RANGES),
            ("CHAIN_ENTRIES", &CHAIN_ENTRIES),
            ("RANGE_CHAIN", &RANGE_CHAIN),
            ("CHAIN_HEADS", &CHAIN_HEADS),
            ("ENTRIES_UPTO", &ENTRIES_UPTO),
        ];
        statements.extend(AUDIT_CHECKS.iter().chain(&AUDIT_ENTRY_CHECKS).map(|(check, sql)| (*check, sql)));
        statements
    }

    #[test]
    fn every_statement_takes_the_same_values_in_each_form_and_locks_as_its_backend_does() {
        let declared = include_str!("queries.rs").matches(concat!(": ", "Sql = ")).count();
        let listed = statements().len() - AUDIT_CHECKS.len() - AUDIT_ENTRY_CHECKS.len();
        assert_eq!(listed, declared, "a statement of this file is missing from `statements()`");
        for (name, sql) in statements() {
            let values = sql.placeholders();
            assert_eq!(sql.sqlite.matches('?').count(), values, "{name}: SQLite takes what MySQL takes");
            assert!(!sql.postgres.contains('?'), "{name}: PostgreSQL numbers its placeholders");
            for number in 1..=values {
                assert!(sql.postgres.contains(&format!("${number}")), "{name}: ${number} missing");
            }
            assert!(!sql.postgres.contains(&format!("${}", values + 1)), "{name}: more values on PostgreSQL");
            assert_eq!(sql.mysql.contains("FOR UPDATE"), sql.postgres.contains("FOR NO KEY UPDATE"), "{name}");
            assert!(!sql.sqlite.contains("FOR UPDATE"), "{name}: SQLite has no row locks");
            assert!(!sql.mysql.contains("ON CONFLICT"), "{name}: MySQL has no ON CONFLICT");
            assert_eq!(sql.postgres.contains("ON CONFLICT"), sql.sqlite.contains("ON CONFLICT"), "{name}");
        }
    }

    #[test]
    fn the_currency_check_is_where_the_audit_from_a_checkpoint_looks_for_it() {
        assert_eq!(AUDIT_CHECKS[CURRENCY_SUMS].0, "balances of each currency sum to zero");
    }

    #[test]
    fn every_audit_from_a_checkpoint_binds_its_range_in_pairs() {
        // The account heads are checked whole: they have no range.
        for (check, sql) in AUDIT_ENTRY_CHECKS.iter().filter(|(check, _)| *check != ACCOUNT_HEADS_CHECK) {
            let text = sql.text(Dialect::Sqlite);
            let ranges = text.matches("entry_id > ? AND").count();
            assert!(ranges > 0 && sql.placeholders() == 2 * ranges, "{check}: {text}");
            assert!(sql.text(Dialect::Postgres).contains(&format!("${}", 2 * ranges)), "{check}");
        }
    }
}
