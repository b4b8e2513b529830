-- Authorization holds (two-phase payments): an amount reserved on a payer's account for one
-- order, then captured (all or part, as a payment), voided or expired. `held` is the sum of
-- the account's ACTIVE holds (minor units); what the account can spend is balance - held.
-- Adding a column with a constant default rewrites no table.
ALTER TABLE accounts ADD COLUMN held BIGINT NOT NULL DEFAULT 0;

CREATE TABLE holds (
    hold_no          VARCHAR(40)  PRIMARY KEY,
    merchant_id      VARCHAR(64)  NOT NULL,
    out_auth_no      VARCHAR(64)  NOT NULL,
    order_no         VARCHAR(64)  NOT NULL,
    payer_account_id VARCHAR(80)  NOT NULL,
    amount           BIGINT       NOT NULL CHECK (amount > 0),
    currency         VARCHAR(3)   NOT NULL,
    status           VARCHAR(16)  NOT NULL,
    captured_amount  BIGINT       NOT NULL DEFAULT 0,
    out_trade_no     VARCHAR(64),
    expires_at       BIGINT       NOT NULL,
    created_at       BIGINT       NOT NULL,
    updated_at       BIGINT       NOT NULL,
    created_by       VARCHAR(128) NOT NULL,
    CONSTRAINT holds_out_auth_no UNIQUE (merchant_id, out_auth_no),
    -- One hold per order: a backstop behind the order state machine.
    CONSTRAINT holds_one_per_order UNIQUE (merchant_id, order_no),
    CONSTRAINT holds_capture_within_amount CHECK (captured_amount >= 0 AND captured_amount <= amount)
);
-- The sweeper's lookup: only ACTIVE holds, by deadline.
CREATE INDEX holds_active_by_expiry ON holds (expires_at) WHERE status = 'ACTIVE';
-- The audit's sum of active holds per account.
CREATE INDEX holds_by_payer ON holds (payer_account_id);
