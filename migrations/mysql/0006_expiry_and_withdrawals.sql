-- Order expiry: `expires_at` is when a PENDING order stops being payable (microseconds since
-- the Unix epoch; NULL: never), `close_reason` why a CLOSED order closed ('MERCHANT' for
-- CloseOrder, 'EXPIRED' for the sweeper; NULL while open and in rows older than this
-- migration). MariaDB 10.3+ and MySQL 8.0.12+ add trailing nullable columns instantly.
ALTER TABLE orders
    ADD COLUMN expires_at BIGINT NULL,
    ADD COLUMN close_reason VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NULL,
    -- `expires_at` while the order is PENDING, NULL once it leaves PENDING: the sweeper's key.
    -- A Pay of an order without a deadline sets NULL to NULL and touches no secondary index.
    ADD COLUMN pending_deadline BIGINT NULL;
CREATE INDEX orders_pending_by_deadline ON orders (pending_deadline);

-- Payouts: the mirror of deposits, keyed by the caller's request_id.
CREATE TABLE withdrawals (
    request_id    VARCHAR(64)  CHARACTER SET ascii COLLATE ascii_bin PRIMARY KEY,
    withdrawal_id VARCHAR(40)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    account_id    VARCHAR(80)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    amount        BIGINT       NOT NULL,
    currency      VARCHAR(3)   CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    created_at    BIGINT       NOT NULL,
    created_by    VARCHAR(128) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    CONSTRAINT withdrawals_amount_positive CHECK (amount > 0),
    UNIQUE KEY withdrawals_withdrawal_id (withdrawal_id)
) ENGINE = InnoDB;
