-- Order expiry: `expires_at` is when a PENDING order stops being payable (microseconds since
-- the Unix epoch; NULL: never), `close_reason` why a CLOSED order closed ('MERCHANT' for
-- CloseOrder, 'EXPIRED' for the sweeper; NULL while open and in rows older than this
-- migration). Adding nullable columns rewrites no table.
ALTER TABLE orders ADD COLUMN expires_at BIGINT;
ALTER TABLE orders ADD COLUMN close_reason VARCHAR(16);
-- The sweeper's lookup: only PENDING orders that can expire are in it, so it stays as small
-- as the set of open orders, and a Pay takes its order out of it.
CREATE INDEX orders_pending_by_expiry ON orders (expires_at) WHERE status = 'PENDING' AND expires_at IS NOT NULL;

-- Payouts: the mirror of deposits, keyed by the caller's request_id.
CREATE TABLE withdrawals (
    request_id    VARCHAR(64)  PRIMARY KEY,
    withdrawal_id VARCHAR(40)  NOT NULL UNIQUE,
    account_id    VARCHAR(80)  NOT NULL,
    amount        BIGINT       NOT NULL CHECK (amount > 0),
    currency      VARCHAR(3)   NOT NULL,
    created_at    BIGINT       NOT NULL,
    created_by    VARCHAR(128) NOT NULL
);
