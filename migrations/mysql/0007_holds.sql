-- Authorization holds (two-phase payments): an amount reserved on a payer's account for one
-- order, then captured (all or part, as a payment), voided or expired. `held` is the sum of
-- the account's ACTIVE holds (minor units); what the account can spend is balance - held.
-- MariaDB 10.3+ and MySQL 8.0.12+ add a trailing column with a default instantly.
ALTER TABLE accounts ADD COLUMN held BIGINT NOT NULL DEFAULT 0;

CREATE TABLE holds (
    hold_no          VARCHAR(40)  CHARACTER SET ascii COLLATE ascii_bin PRIMARY KEY,
    merchant_id      VARCHAR(64)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    out_auth_no      VARCHAR(64)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    order_no         VARCHAR(64)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    payer_account_id VARCHAR(80)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    amount           BIGINT       NOT NULL,
    currency         VARCHAR(3)   CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    status           VARCHAR(16)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    captured_amount  BIGINT       NOT NULL DEFAULT 0,
    out_trade_no     VARCHAR(64)  CHARACTER SET ascii COLLATE ascii_bin NULL,
    expires_at       BIGINT       NOT NULL,
    created_at       BIGINT       NOT NULL,
    updated_at       BIGINT       NOT NULL,
    created_by       VARCHAR(128) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    CONSTRAINT holds_amount_positive CHECK (amount > 0),
    CONSTRAINT holds_capture_within_amount CHECK (captured_amount >= 0 AND captured_amount <= amount),
    UNIQUE KEY holds_out_auth_no (merchant_id, out_auth_no),
    -- One hold per order: a backstop behind the order state machine.
    UNIQUE KEY holds_one_per_order (merchant_id, order_no),
    -- The sweeper's lookup (no partial indexes: status leads).
    KEY holds_active_by_expiry (status, expires_at),
    -- The audit's sum of active holds per account.
    KEY holds_by_payer (payer_account_id)
) ENGINE = InnoDB;
