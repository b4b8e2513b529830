-- Generic idempotency keys, one-time tokens and transfers.
-- The column for the client's key is `idempotency_key` (`key` is reserved in MySQL).
-- request_fields and response are UTF-8 bytes (BLOB-like on every backend, so the MySQL
-- driver hands them over as bytes, which is how it hands over any TEXT column too).

CREATE TABLE idempotency_record (
    record_id           BIGINT AUTO_INCREMENT PRIMARY KEY,
    scope               VARCHAR(80)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    idempotency_key     VARCHAR(128) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    method              VARCHAR(32)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    request_fingerprint VARCHAR(64)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    request_fields      BLOB        NOT NULL,
    response            MEDIUMBLOB NULL,
    status              VARCHAR(16)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    created_at          BIGINT       NOT NULL,
    expires_at          BIGINT       NOT NULL,
    UNIQUE KEY idempotency_record_scope_key (scope, idempotency_key),
    KEY idempotency_record_by_expiry (expires_at)
) ENGINE = InnoDB;

CREATE TABLE idempotency_token (
    token       VARCHAR(64)  CHARACTER SET ascii COLLATE ascii_bin PRIMARY KEY,
    merchant_id VARCHAR(64)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    purpose     VARCHAR(256) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    created_at  BIGINT       NOT NULL,
    expires_at  BIGINT       NOT NULL,
    consumed_at BIGINT       NULL,
    KEY idempotency_token_by_expiry (expires_at)
) ENGINE = InnoDB;

CREATE TABLE transfers (
    transfer_id     VARCHAR(40)  CHARACTER SET ascii COLLATE ascii_bin PRIMARY KEY,
    from_account_id VARCHAR(80)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    to_account_id   VARCHAR(80)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    amount          BIGINT       NOT NULL,
    currency        VARCHAR(3)   CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    memo            VARCHAR(256) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    created_at      BIGINT       NOT NULL,
    CONSTRAINT transfers_amount_positive CHECK (amount > 0)
) ENGINE = InnoDB;
