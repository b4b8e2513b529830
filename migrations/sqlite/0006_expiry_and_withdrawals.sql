-- Order expiry: `expires_at` is when a PENDING order stops being payable (microseconds since
-- the Unix epoch; NULL: never), `close_reason` why a CLOSED order closed ('MERCHANT' for
-- CloseOrder, 'EXPIRED' for the sweeper; NULL while open and in rows older than this
-- migration).
ALTER TABLE orders ADD COLUMN expires_at INTEGER;
ALTER TABLE orders ADD COLUMN close_reason TEXT;
-- The sweeper's lookup: `pending_deadline` is `expires_at` while the order is PENDING and NULL
-- once it leaves PENDING; only non-NULL values are indexed.
ALTER TABLE orders ADD COLUMN pending_deadline INTEGER;
CREATE INDEX orders_pending_by_deadline ON orders (pending_deadline) WHERE pending_deadline IS NOT NULL;

-- Payouts: the mirror of deposits, keyed by the caller's request_id.
CREATE TABLE withdrawals (
    request_id    TEXT    NOT NULL PRIMARY KEY,
    withdrawal_id TEXT    NOT NULL UNIQUE,
    account_id    TEXT    NOT NULL,
    amount        INTEGER NOT NULL CHECK (amount > 0),
    currency      TEXT    NOT NULL,
    created_at    INTEGER NOT NULL,
    created_by    TEXT    NOT NULL
) STRICT;
