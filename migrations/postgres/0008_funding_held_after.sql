-- What the account's active holds reserved right after each Deposit or Withdraw (minor units),
-- so that a replay by request_id answers the account's available balance as it stood then,
-- not as today's holds leave it. NULL in rows written before this column: their replays use
-- the account's holds as they are when replayed.
ALTER TABLE deposits ADD COLUMN held_after BIGINT;
ALTER TABLE withdrawals ADD COLUMN held_after BIGINT;
