-- The rows bench/floor.sh's scripts pay with, in payledger's own tables (the server's
-- migrations made them): :n PENDING orders o1..o<n> of merchants fm0..fm99, each with a payer
-- account fp<i> and a payee account fs<i> of its own (so no two clients ever wait on a row),
-- and the sequence that hands each transaction its order.
CREATE SEQUENCE IF NOT EXISTS floor_seq;
INSERT INTO accounts (account_id, currency, kind, balance, version, created_at, updated_at, held)
SELECT 'fp' || i, 'USD', 'CUSTOMER', 100000000000, 1, 1, 1, 0 FROM generate_series(1, :n) AS i;
INSERT INTO accounts (account_id, currency, kind, balance, version, created_at, updated_at, held)
SELECT 'fs' || i, 'USD', 'CUSTOMER', 0, 1, 1, 1, 0 FROM generate_series(1, :n) AS i;
INSERT INTO orders (merchant_id, order_no, payee_account_id, amount, currency, subject, status, created_at, updated_at)
SELECT 'fm' || (i % 100), 'o' || i, 'fs' || i, 100, 'USD', 'bench', 'PENDING', 1, 1 FROM generate_series(1, :n) AS i;
ANALYZE;
