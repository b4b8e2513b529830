-- payledger schema.
-- No foreign key points at accounts: a foreign-key check locks the parent row (KEY SHARE on
-- PostgreSQL, a shared record lock on InnoDB), and on a hot account those locks deadlock
-- with the balance updates of concurrent payments. Account existence is checked inside
-- the transaction instead, and `payledger audit` checks that every entry has its account.
-- For the same reason payment_flow has no foreign key to the order it pays, whose row the
-- payment updates in the same transaction. Amounts are integer minor units (BIGINT); timestamps are microseconds
-- since the Unix epoch (BIGINT), identical on every backend.

CREATE TABLE accounts (
    account_id  VARCHAR(80) PRIMARY KEY,
    currency    VARCHAR(3)  NOT NULL,
    kind        VARCHAR(16) NOT NULL CHECK (kind IN ('CUSTOMER', 'EXTERNAL')),
    balance     BIGINT      NOT NULL,
    version     BIGINT      NOT NULL,
    created_at  BIGINT      NOT NULL,
    updated_at  BIGINT      NOT NULL,
    CONSTRAINT accounts_customer_balance_not_negative CHECK (kind = 'EXTERNAL' OR balance >= 0)
);

CREATE TABLE journal_entries (
    entry_id                BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    account_id              VARCHAR(80) NOT NULL,
    currency                VARCHAR(3)  NOT NULL,
    amount                  BIGINT      NOT NULL CHECK (amount <> 0),
    balance_after           BIGINT      NOT NULL,
    version_after           BIGINT      NOT NULL,
    kind                    VARCHAR(16) NOT NULL,
    reference               VARCHAR(64) NOT NULL,
    posting_id              VARCHAR(40) NOT NULL,
    counterparty_account_id VARCHAR(80) NOT NULL,
    created_at              BIGINT      NOT NULL
);
CREATE INDEX journal_entries_by_account ON journal_entries (account_id, entry_id);
-- A posting touches each account once: a second leg for the same account is a bug.
CREATE UNIQUE INDEX journal_entries_one_leg_per_account ON journal_entries (posting_id, account_id);

CREATE TABLE orders (
    merchant_id      VARCHAR(64)  NOT NULL,
    order_no         VARCHAR(64)  NOT NULL,
    payee_account_id VARCHAR(80)  NOT NULL,
    amount           BIGINT       NOT NULL CHECK (amount > 0),
    currency         VARCHAR(3)   NOT NULL,
    subject          VARCHAR(256) NOT NULL,
    status           VARCHAR(24)  NOT NULL,
    out_trade_no     VARCHAR(64),
    refunded_amount  BIGINT       NOT NULL DEFAULT 0,
    created_at       BIGINT       NOT NULL,
    updated_at       BIGINT       NOT NULL,
    PRIMARY KEY (merchant_id, order_no),
    CONSTRAINT orders_refunds_within_amount CHECK (refunded_amount >= 0 AND refunded_amount <= amount)
);

CREATE TABLE payment_flow (
    trade_no         VARCHAR(40) PRIMARY KEY,
    merchant_id      VARCHAR(64) NOT NULL,
    out_trade_no     VARCHAR(64) NOT NULL,
    order_no         VARCHAR(64) NOT NULL,
    payer_account_id VARCHAR(80) NOT NULL,
    payee_account_id VARCHAR(80) NOT NULL,
    amount           BIGINT      NOT NULL CHECK (amount > 0),
    currency         VARCHAR(3)  NOT NULL,
    status           VARCHAR(16) NOT NULL,
    created_at       BIGINT      NOT NULL,
    CONSTRAINT payment_flow_out_trade_no UNIQUE (merchant_id, out_trade_no),
    -- One successful payment per order: a backstop behind the order state machine.
    CONSTRAINT payment_flow_one_per_order UNIQUE (merchant_id, order_no)
);

CREATE TABLE refunds (
    refund_no     VARCHAR(40)  PRIMARY KEY,
    merchant_id   VARCHAR(64)  NOT NULL,
    out_refund_no VARCHAR(64)  NOT NULL,
    out_trade_no  VARCHAR(64)  NOT NULL,
    order_no      VARCHAR(64)  NOT NULL,
    amount        BIGINT       NOT NULL CHECK (amount > 0),
    currency      VARCHAR(3)   NOT NULL,
    reason        VARCHAR(256) NOT NULL,
    created_at    BIGINT       NOT NULL,
    CONSTRAINT refunds_out_refund_no UNIQUE (merchant_id, out_refund_no),
    FOREIGN KEY (merchant_id, out_trade_no) REFERENCES payment_flow (merchant_id, out_trade_no)
);
CREATE INDEX refunds_by_order ON refunds (merchant_id, order_no);

CREATE TABLE deposits (
    request_id  VARCHAR(64) PRIMARY KEY,
    deposit_id  VARCHAR(40) NOT NULL UNIQUE,
    account_id  VARCHAR(80) NOT NULL,
    amount      BIGINT      NOT NULL CHECK (amount > 0),
    currency    VARCHAR(3)  NOT NULL,
    created_at  BIGINT      NOT NULL
);
