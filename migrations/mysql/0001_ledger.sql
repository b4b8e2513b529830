-- payledger schema.
-- No foreign key points at accounts: a foreign-key check locks the parent row (KEY SHARE on
-- PostgreSQL, a shared record lock on InnoDB), and on a hot account those locks deadlock
-- with the balance updates of concurrent payments. Account existence is checked inside
-- the transaction instead, and `payledger audit` checks that every entry has its account.
-- For the same reason payment_flow has no foreign key to the order it pays, whose row the
-- payment updates in the same transaction. Amounts are integer minor units (BIGINT); timestamps are microseconds
-- since the Unix epoch (BIGINT), identical on every backend.
-- Keys use ascii_bin: business numbers are ASCII and compare case-sensitively, as on
-- PostgreSQL and SQLite (the default utf8mb4 collations would make 'A-1' equal 'a-1').

CREATE TABLE accounts (
    account_id  VARCHAR(80) CHARACTER SET ascii COLLATE ascii_bin PRIMARY KEY,
    currency    VARCHAR(3)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    kind        VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    balance     BIGINT      NOT NULL,
    version     BIGINT      NOT NULL,
    created_at  BIGINT      NOT NULL,
    updated_at  BIGINT      NOT NULL,
    CONSTRAINT accounts_kind CHECK (kind IN ('CUSTOMER', 'EXTERNAL')),
    CONSTRAINT accounts_customer_balance_not_negative CHECK (kind = 'EXTERNAL' OR balance >= 0)
) ENGINE = InnoDB;

CREATE TABLE journal_entries (
    entry_id                BIGINT AUTO_INCREMENT PRIMARY KEY,
    account_id              VARCHAR(80) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    currency                VARCHAR(3)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    amount                  BIGINT      NOT NULL,
    balance_after           BIGINT      NOT NULL,
    version_after           BIGINT      NOT NULL,
    kind                    VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    reference               VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    posting_id              VARCHAR(40) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    counterparty_account_id VARCHAR(80) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    created_at              BIGINT      NOT NULL,
    CONSTRAINT journal_entries_amount_not_zero CHECK (amount <> 0),
    KEY journal_entries_by_account (account_id, entry_id),
    UNIQUE KEY journal_entries_one_leg_per_account (posting_id, account_id)
) ENGINE = InnoDB;

CREATE TABLE orders (
    merchant_id      VARCHAR(64)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    order_no         VARCHAR(64)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    payee_account_id VARCHAR(80)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    amount           BIGINT       NOT NULL,
    currency         VARCHAR(3)   CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    subject          VARCHAR(256) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    status           VARCHAR(24)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    out_trade_no     VARCHAR(64)  CHARACTER SET ascii COLLATE ascii_bin NULL,
    refunded_amount  BIGINT       NOT NULL DEFAULT 0,
    created_at       BIGINT       NOT NULL,
    updated_at       BIGINT       NOT NULL,
    PRIMARY KEY (merchant_id, order_no),
    CONSTRAINT orders_amount_positive CHECK (amount > 0),
    CONSTRAINT orders_refunds_within_amount CHECK (refunded_amount >= 0 AND refunded_amount <= amount)
) ENGINE = InnoDB;

CREATE TABLE payment_flow (
    trade_no         VARCHAR(40) CHARACTER SET ascii COLLATE ascii_bin PRIMARY KEY,
    merchant_id      VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    out_trade_no     VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    order_no         VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    payer_account_id VARCHAR(80) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    payee_account_id VARCHAR(80) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    amount           BIGINT      NOT NULL,
    currency         VARCHAR(3)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    status           VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    created_at       BIGINT      NOT NULL,
    CONSTRAINT payment_flow_amount_positive CHECK (amount > 0),
    UNIQUE KEY payment_flow_out_trade_no (merchant_id, out_trade_no),
    -- One successful payment per order: a backstop behind the order state machine.
    UNIQUE KEY payment_flow_one_per_order (merchant_id, order_no)
) ENGINE = InnoDB;

CREATE TABLE refunds (
    refund_no     VARCHAR(40)  CHARACTER SET ascii COLLATE ascii_bin PRIMARY KEY,
    merchant_id   VARCHAR(64)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    out_refund_no VARCHAR(64)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    out_trade_no  VARCHAR(64)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    order_no      VARCHAR(64)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    amount        BIGINT       NOT NULL,
    currency      VARCHAR(3)   CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    reason        VARCHAR(256) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    created_at    BIGINT       NOT NULL,
    CONSTRAINT refunds_amount_positive CHECK (amount > 0),
    UNIQUE KEY refunds_out_refund_no (merchant_id, out_refund_no),
    KEY refunds_by_order (merchant_id, order_no),
    FOREIGN KEY (merchant_id, out_trade_no) REFERENCES payment_flow (merchant_id, out_trade_no)
) ENGINE = InnoDB;

CREATE TABLE deposits (
    request_id  VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin PRIMARY KEY,
    deposit_id  VARCHAR(40) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    account_id  VARCHAR(80) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    amount      BIGINT      NOT NULL,
    currency    VARCHAR(3)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    created_at  BIGINT      NOT NULL,
    CONSTRAINT deposits_amount_positive CHECK (amount > 0),
    UNIQUE KEY deposits_deposit_id (deposit_id)
) ENGINE = InnoDB;
