-- Generic idempotency keys, one-time tokens and transfers.
-- The column for the client's key is `idempotency_key` (`key` is reserved in MySQL).
-- request_fields and response are UTF-8 bytes (BLOB-like on every backend, so the MySQL
-- driver hands them over as bytes, which is how it hands over any TEXT column too).

CREATE TABLE idempotency_record (
    record_id           INTEGER PRIMARY KEY AUTOINCREMENT,
    scope               TEXT    NOT NULL,
    idempotency_key     TEXT    NOT NULL,
    method              TEXT    NOT NULL,
    request_fingerprint TEXT    NOT NULL,
    request_fields      BLOB        NOT NULL,
    response            BLOB,
    status              TEXT    NOT NULL,
    created_at          INTEGER NOT NULL,
    expires_at          INTEGER NOT NULL,
    UNIQUE (scope, idempotency_key)
) STRICT;
CREATE INDEX idempotency_record_by_expiry ON idempotency_record (expires_at);

CREATE TABLE idempotency_token (
    token       TEXT    NOT NULL PRIMARY KEY,
    merchant_id TEXT    NOT NULL,
    purpose     TEXT    NOT NULL,
    created_at  INTEGER NOT NULL,
    expires_at  INTEGER NOT NULL,
    consumed_at INTEGER
) STRICT;
CREATE INDEX idempotency_token_by_expiry ON idempotency_token (expires_at);

CREATE TABLE transfers (
    transfer_id     TEXT    NOT NULL PRIMARY KEY,
    from_account_id TEXT    NOT NULL,
    to_account_id   TEXT    NOT NULL,
    amount          INTEGER NOT NULL CHECK (amount > 0),
    currency        TEXT    NOT NULL,
    memo            TEXT    NOT NULL,
    created_at      INTEGER NOT NULL
) STRICT;
