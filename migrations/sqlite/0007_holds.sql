-- Authorization holds (two-phase payments): an amount reserved on a payer's account for one
-- order, then captured (all or part, as a payment), voided or expired. `held` is the sum of
-- the account's ACTIVE holds (minor units); what the account can spend is balance - held.
ALTER TABLE accounts ADD COLUMN held INTEGER NOT NULL DEFAULT 0;

CREATE TABLE holds (
    hold_no          TEXT    NOT NULL PRIMARY KEY,
    merchant_id      TEXT    NOT NULL,
    out_auth_no      TEXT    NOT NULL,
    order_no         TEXT    NOT NULL,
    payer_account_id TEXT    NOT NULL,
    amount           INTEGER NOT NULL CHECK (amount > 0),
    currency         TEXT    NOT NULL,
    status           TEXT    NOT NULL,
    captured_amount  INTEGER NOT NULL DEFAULT 0,
    out_trade_no     TEXT,
    expires_at       INTEGER NOT NULL,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    created_by       TEXT    NOT NULL,
    UNIQUE (merchant_id, out_auth_no),
    UNIQUE (merchant_id, order_no),
    CHECK (captured_amount >= 0 AND captured_amount <= amount)
) STRICT;
CREATE INDEX holds_active_by_expiry ON holds (expires_at) WHERE status = 'ACTIVE';
CREATE INDEX holds_by_payer ON holds (payer_account_id);
