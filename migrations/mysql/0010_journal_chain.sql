-- The journal's hash chain (docs/audit.md, "The hash chain"): each entry's entry_hash is the
-- SHA-256 of its fields and of the entry_hash of its account's chained entry before it (32 zero
-- bytes before the first), as 64 lowercase hex digits; each account's chain_hash is the
-- entry_hash of its latest chained entry. Entries written outside the chain (every entry
-- before this migration; the rows `payledger-tools seed` writes) carry none, and
-- unchained_entries names their id ranges: the audit reports any other entry without a hash.
ALTER TABLE journal_entries ADD COLUMN entry_hash VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin;
ALTER TABLE accounts ADD COLUMN chain_hash VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin;
CREATE TABLE unchained_entries (
    first_entry_id BIGINT PRIMARY KEY,
    last_entry_id  BIGINT NOT NULL,
    written_by     VARCHAR(64) CHARACTER SET utf8mb4 NOT NULL
);
INSERT INTO unchained_entries (first_entry_id, last_entry_id, written_by)
SELECT r.first_id, r.last_id, 'before the hash chain'
FROM (SELECT MIN(entry_id) AS first_id, MAX(entry_id) AS last_id FROM journal_entries) r WHERE r.first_id IS NOT NULL;
