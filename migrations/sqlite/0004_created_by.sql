-- Who made each change: the `sub` of the authenticated caller (`anonymous` on a server run
-- without authentication). Rows written before this migration say 'unknown'.
ALTER TABLE payment_flow ADD COLUMN created_by TEXT NOT NULL DEFAULT 'unknown';
ALTER TABLE refunds ADD COLUMN created_by TEXT NOT NULL DEFAULT 'unknown';
ALTER TABLE deposits ADD COLUMN created_by TEXT NOT NULL DEFAULT 'unknown';
ALTER TABLE transfers ADD COLUMN created_by TEXT NOT NULL DEFAULT 'unknown';
ALTER TABLE journal_entries ADD COLUMN created_by TEXT NOT NULL DEFAULT 'unknown';

-- Idempotency keys and one-time tokens belong to the caller as well as the merchant or
-- account: a key's scope gains the caller's tag (`merchant:<id>/by:<32 hex>`; SQLite does not
-- bound TEXT), and a token remembers the caller it was issued to (NULL: issued without
-- authentication).
ALTER TABLE idempotency_token ADD COLUMN caller_tag TEXT;
