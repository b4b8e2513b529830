-- payledger schema.
-- No foreign key points at accounts: a foreign-key check locks the parent row (KEY SHARE on
-- PostgreSQL, a shared record lock on InnoDB), and on a hot account those locks deadlock
-- with the balance updates of concurrent payments. Account existence is checked inside
-- the transaction instead, and `payledger audit` checks that every entry has its account.
-- For the same reason payment_flow has no foreign key to the order it pays, whose row the
-- payment updates in the same transaction. Amounts are integer minor units; timestamps are microseconds since the
-- Unix epoch, identical on every backend. STRICT tables reject values of the wrong type.

CREATE TABLE accounts (
    account_id  TEXT    NOT NULL PRIMARY KEY CHECK (length(account_id) <= 80),
    currency    TEXT    NOT NULL,
    kind        TEXT    NOT NULL CHECK (kind IN ('CUSTOMER', 'EXTERNAL')),
    balance     INTEGER NOT NULL,
    version     INTEGER NOT NULL,
    created_at  INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL,
    CHECK (kind = 'EXTERNAL' OR balance >= 0)
) STRICT;

CREATE TABLE journal_entries (
    entry_id                INTEGER PRIMARY KEY AUTOINCREMENT,
    account_id              TEXT    NOT NULL,
    currency                TEXT    NOT NULL,
    amount                  INTEGER NOT NULL CHECK (amount <> 0),
    balance_after           INTEGER NOT NULL,
    version_after           INTEGER NOT NULL,
    kind                    TEXT    NOT NULL,
    reference               TEXT    NOT NULL,
    posting_id              TEXT    NOT NULL,
    counterparty_account_id TEXT    NOT NULL,
    created_at              INTEGER NOT NULL
) STRICT;
CREATE INDEX journal_entries_by_account ON journal_entries (account_id, entry_id);
-- A posting touches each account once: a second leg for the same account is a bug.
CREATE UNIQUE INDEX journal_entries_one_leg_per_account ON journal_entries (posting_id, account_id);

CREATE TABLE orders (
    merchant_id      TEXT    NOT NULL,
    order_no         TEXT    NOT NULL,
    payee_account_id TEXT    NOT NULL,
    amount           INTEGER NOT NULL CHECK (amount > 0),
    currency         TEXT    NOT NULL,
    subject          TEXT    NOT NULL,
    status           TEXT    NOT NULL,
    out_trade_no     TEXT,
    refunded_amount  INTEGER NOT NULL DEFAULT 0,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    PRIMARY KEY (merchant_id, order_no),
    CHECK (refunded_amount >= 0 AND refunded_amount <= amount)
) STRICT;

CREATE TABLE payment_flow (
    trade_no         TEXT    NOT NULL PRIMARY KEY,
    merchant_id      TEXT    NOT NULL,
    out_trade_no     TEXT    NOT NULL,
    order_no         TEXT    NOT NULL,
    payer_account_id TEXT    NOT NULL,
    payee_account_id TEXT    NOT NULL,
    amount           INTEGER NOT NULL CHECK (amount > 0),
    currency         TEXT    NOT NULL,
    status           TEXT    NOT NULL,
    created_at       INTEGER NOT NULL,
    UNIQUE (merchant_id, out_trade_no),
    -- One successful payment per order: a backstop behind the order state machine.
    UNIQUE (merchant_id, order_no)
) STRICT;

CREATE TABLE refunds (
    refund_no     TEXT    NOT NULL PRIMARY KEY,
    merchant_id   TEXT    NOT NULL,
    out_refund_no TEXT    NOT NULL,
    out_trade_no  TEXT    NOT NULL,
    order_no      TEXT    NOT NULL,
    amount        INTEGER NOT NULL CHECK (amount > 0),
    currency      TEXT    NOT NULL,
    reason        TEXT    NOT NULL,
    created_at    INTEGER NOT NULL,
    UNIQUE (merchant_id, out_refund_no),
    FOREIGN KEY (merchant_id, out_trade_no) REFERENCES payment_flow (merchant_id, out_trade_no)
) STRICT;
CREATE INDEX refunds_by_order ON refunds (merchant_id, order_no);

CREATE TABLE deposits (
    request_id  TEXT    NOT NULL PRIMARY KEY,
    deposit_id  TEXT    NOT NULL UNIQUE,
    account_id  TEXT    NOT NULL,
    amount      INTEGER NOT NULL CHECK (amount > 0),
    currency    TEXT    NOT NULL,
    created_at  INTEGER NOT NULL
) STRICT;
