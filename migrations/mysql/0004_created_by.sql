-- Who made each change: the `sub` of the authenticated caller (`anonymous` on a server run
-- without authentication). Rows written before this migration say 'unknown'. MariaDB 10.3+
-- and MySQL 8.0.12+ add a trailing column with a default instantly.
ALTER TABLE payment_flow ADD COLUMN created_by VARCHAR(128) CHARACTER SET ascii COLLATE ascii_bin NOT NULL DEFAULT 'unknown';
ALTER TABLE refunds ADD COLUMN created_by VARCHAR(128) CHARACTER SET ascii COLLATE ascii_bin NOT NULL DEFAULT 'unknown';
ALTER TABLE deposits ADD COLUMN created_by VARCHAR(128) CHARACTER SET ascii COLLATE ascii_bin NOT NULL DEFAULT 'unknown';
ALTER TABLE transfers ADD COLUMN created_by VARCHAR(128) CHARACTER SET ascii COLLATE ascii_bin NOT NULL DEFAULT 'unknown';
ALTER TABLE journal_entries ADD COLUMN created_by VARCHAR(128) CHARACTER SET ascii COLLATE ascii_bin NOT NULL DEFAULT 'unknown';

-- Idempotency keys and one-time tokens belong to the caller as well as the merchant or
-- account: a key's scope gains the caller's tag (`merchant:<id>/by:<32 hex>`), and a token
-- remembers the caller it was issued to (NULL: issued without authentication). A VARCHAR
-- widened within 255 bytes keeps its one length byte, so InnoDB changes it in place.
ALTER TABLE idempotency_record
    MODIFY COLUMN scope VARCHAR(160) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    MODIFY COLUMN caller_scope VARCHAR(160) CHARACTER SET ascii COLLATE ascii_bin NULL;
ALTER TABLE idempotency_token ADD COLUMN caller_tag VARCHAR(32) CHARACTER SET ascii COLLATE ascii_bin NULL;
