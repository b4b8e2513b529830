-- Generic idempotency keys, one-time tokens and transfers.
-- The column for the client's key is `idempotency_key` (`key` is reserved in MySQL).
-- request_fields and response are UTF-8 bytes (BLOB-like on every backend, so the MySQL
-- driver hands them over as bytes, which is how it hands over any TEXT column too).

CREATE TABLE idempotency_record (
    record_id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    scope               VARCHAR(80)  NOT NULL,
    idempotency_key     VARCHAR(128) NOT NULL,
    method              VARCHAR(32)  NOT NULL,
    request_fingerprint VARCHAR(64)  NOT NULL,
    request_fields      BYTEA       NOT NULL,
    response            BYTEA,
    status              VARCHAR(16)  NOT NULL,
    created_at          BIGINT       NOT NULL,
    expires_at          BIGINT       NOT NULL,
    CONSTRAINT idempotency_record_scope_key UNIQUE (scope, idempotency_key)
);
CREATE INDEX idempotency_record_by_expiry ON idempotency_record (expires_at);

CREATE TABLE idempotency_token (
    token       VARCHAR(64)  PRIMARY KEY,
    merchant_id VARCHAR(64)  NOT NULL,
    purpose     VARCHAR(256) NOT NULL,
    created_at  BIGINT       NOT NULL,
    expires_at  BIGINT       NOT NULL,
    consumed_at BIGINT
);
CREATE INDEX idempotency_token_by_expiry ON idempotency_token (expires_at);

CREATE TABLE transfers (
    transfer_id     VARCHAR(40)  PRIMARY KEY,
    from_account_id VARCHAR(80)  NOT NULL,
    to_account_id   VARCHAR(80)  NOT NULL,
    amount          BIGINT       NOT NULL CHECK (amount > 0),
    currency        VARCHAR(3)   NOT NULL,
    memo            VARCHAR(256) NOT NULL,
    created_at      BIGINT       NOT NULL
);
