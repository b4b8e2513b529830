-- The fewest statements a Pay's rows need, one at a time in a transaction: the order moved
-- PENDING -> PAID by its conditional UPDATE (which also hands out the order), both balances
-- and versions moved, the payment and its two journal entries inserted. Seven round trips, as
-- pgbench's tpcb-like; no read before writing, so nothing for the caller to decide on.
BEGIN;
UPDATE orders SET status = 'PAID', out_trade_no = 't' || order_no, updated_at = 2 WHERE (merchant_id, order_no) = (SELECT 'fm' || (n % 100), 'o' || n FROM (SELECT nextval('floor_seq') AS n) AS s) AND status = 'PENDING' RETURNING substr(order_no, 2) AS i, merchant_id AS m \gset
UPDATE accounts SET balance = balance - 100, version = version + 1, updated_at = 2 WHERE account_id = 'fp' || :i;
UPDATE accounts SET balance = balance + 100, version = version + 1, updated_at = 2 WHERE account_id = 'fs' || :i;
INSERT INTO payment_flow (trade_no, merchant_id, out_trade_no, order_no, payer_account_id, payee_account_id, amount, currency, status, created_at, created_by) VALUES ('T' || :i, :m, 't' || :i, 'o' || :i, 'fp' || :i, 'fs' || :i, 100, 'USD', 'SUCCEEDED', 2, 'anonymous');
INSERT INTO journal_entries (account_id, currency, amount, balance_after, version_after, kind, reference, posting_id, counterparty_account_id, created_at, created_by) VALUES ('fp' || :i, 'USD', -100, 99999999900, 2, 'PAY', 't' || :i, 'T' || :i, 'fs' || :i, 2, 'anonymous'), ('fs' || :i, 'USD', 100, 100, 2, 'PAY', 't' || :i, 'T' || :i, 'fp' || :i, 2, 'anonymous');
END;
