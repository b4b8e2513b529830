-- A completed idempotency record keeps the response message as the caller received it
-- (encoded protobuf), so a replay never depends on how tables or structs look later.
-- `response` (JSON of rows) is still written beside it, so that instances of the previous
-- release can replay records written by this one during a rolling deploy; records that have
-- only `response` were written before this migration and are replayed from it.
ALTER TABLE idempotency_record ADD COLUMN response_message BLOB;

-- The scope of the caller that made the record (`merchant:<id>` or `account:<id>`). A
-- one-time token's record is keyed by the token alone (scope `token`), so this is what keeps
-- its stored response from being answered to another merchant. Empty in older records.
ALTER TABLE idempotency_record ADD COLUMN caller_scope TEXT;
