-- What the refund's order had refunded right after it (minor units, this refund included), so
-- that a Refund replayed by its out_refund_no answers its order as it stood then, not as later
-- refunds leave it. NULL in rows written before this column: their replays answer the order as
-- it is when replayed.
ALTER TABLE refunds ADD COLUMN order_refunded_after INTEGER;
