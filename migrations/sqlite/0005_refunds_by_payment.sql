-- The child key of refunds' foreign key to payment_flow. SQLite looks for child rows of each
-- parent row a multi-row INSERT adds (orphans the new parent would adopt), and without an
-- index on the child key that is a scan of every refund for every payment a group commit
-- writes. PostgreSQL needs no such index for inserts into the parent, and InnoDB created one
-- with the foreign key.
CREATE INDEX refunds_by_payment ON refunds (merchant_id, out_trade_no);
