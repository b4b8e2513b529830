//! The statements of a group commit, each one fixed text per backend whatever the number of
//! rows: the rows travel as bound values, never as SQL. A server therefore prepares the same
//! few statements for a batch of 1 and one of 1,000 (MariaDB refuses new statements past
//! `max_prepared_stmt_count` with error 1461; PostgreSQL keeps each prepared statement in the
//! session's memory), and the number of bound values is fixed too (PostgreSQL takes at most
//! 65,535 a statement).
//!
//! - PostgreSQL: one array a column, bound as its text form (`$n::text[]`, `$n::bigint[]`;
//!   PostgreSQL manual, 8.15.6 "Array Value Input": sqlx's `Any` driver binds no arrays) and read
//!   by `UNNEST` or `= ANY`. A custom plan knows each array's length, so the planner estimates
//!   exactly as many rows as the batch holds.
//! - MySQL/MariaDB: one JSON array of rows, read by `JSON_TABLE` (MariaDB 10.6, MySQL 8.0.4).
//!   Key columns are read as `ascii_bin`, the tables' own, and the primary key is forced (MariaDB
//!   guesses 40 rows for a JSON_TABLE and would scan, and lock, a table of five rows), so that
//!   each key is one index lookup (keys reach the store validated at the edge: business
//!   numbers and account ids at most 64 characters of `[A-Za-z0-9._:-]`, idempotency keys at
//!   most 128 printable ASCII characters, record scopes at most 160, so reading them as
//!   `VARCHAR(255) ascii` loses nothing; JSON_TABLE would convert anything else silently, with
//!   a warning only);
//!   written columns as wide `utf8mb4` strings, so that the table's column (under strict mode)
//!   still refuses a value too long or not ASCII, as a one-row INSERT does. Rows that lock are
//!   joined with `STRAIGHT_JOIN` from the JSON rows, whose order the caller chose (key order):
//!   InnoDB locks rows in the order the join reads them.
//! - SQLite: one JSON array of rows, read by `json_each`; `?NNN` placeholders name the values.
//!
//! Every value is a string or a 64-bit integer (see `crate::store`): JSON numbers written from
//! an `i64` are read back exactly by all three.
//!
//! Why: `docs/decisions/004-one-statement-text-per-shape.md`.

use serde::ser::{Serialize, Serializer};

use super::dialect::{Dialect, Sql};

/// One step of a group commit's write on MySQL and SQLite; PostgreSQL writes the whole batch
/// in one statement, [`write_batch_postgres`].
pub(super) struct StepSql {
    mysql: &'static str,
    sqlite: &'static str,
}

impl StepSql {
    pub(super) fn text(&self, dialect: Dialect) -> &'static str {
        match dialect {
            Dialect::MySql => self.mysql,
            Dialect::Sqlite => self.sqlite,
            Dialect::Postgres => unreachable!("PostgreSQL writes a group commit with write_batch_postgres"),
        }
    }
}

/// One value of a batch row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Value<'a> {
    Text(&'a str),
    Int(i64),
    Null,
}

impl Serialize for Value<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Value::Text(text) => serializer.serialize_str(text),
            Value::Int(int) => serializer.serialize_i64(*int),
            Value::Null => serializer.serialize_none(),
        }
    }
}

/// The values that bind `rows` (each of `N` columns) to a [`Sql`], in order: on
/// PostgreSQL one array literal a column, elsewhere one JSON document of rows.
pub(super) fn bind_rows<const N: usize>(dialect: Dialect, rows: &[[Value<'_>; N]]) -> Vec<String> {
    match dialect {
        Dialect::Postgres => (0..N).map(|column| postgres_array(rows.iter().map(|row| row[column]))).collect(),
        Dialect::MySql | Dialect::Sqlite => {
            let rows: Vec<&[Value<'_>]> = rows.iter().map(|row| row.as_slice()).collect();
            vec![serde_json::to_string(&rows).expect("strings and integers always serialize")]
        }
    }
}

/// The text form of a one-dimensional PostgreSQL array: integers as they are, every string
/// double-quoted with `"` and `\` escaped by a backslash, so that no string is read as NULL,
/// split at a comma or trimmed (PostgreSQL manual, 8.15.6).
fn postgres_array<'a>(values: impl Iterator<Item = Value<'a>>) -> String {
    let mut text = String::from("{");
    for (index, value) in values.enumerate() {
        if index > 0 {
            text.push(',');
        }
        match value {
            Value::Int(int) => text.push_str(&int.to_string()),
            Value::Null => text.push_str("NULL"),
            Value::Text(string) => {
                text.push('"');
                for c in string.chars() {
                    if matches!(c, '"' | '\\') {
                        text.push('\\');
                    }
                    text.push(c);
                }
                text.push('"');
            }
        }
    }
    text.push('}');
    text
}

/// The key columns of a MySQL JSON row `[first, second]`.
macro_rules! mysql_key_pair {
    ($first:literal, $second:literal) => {
        concat!(
            "JSON_TABLE(?, '$[*]' COLUMNS (",
            $first,
            " VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin PATH '$[0]', ",
            $second,
            " VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin PATH '$[1]')) AS k"
        )
    };
}

/// The payments (with their orders) of rows `[merchant_id, out_trade_no]`; a read.
pub(super) static FIND_PAYMENTS_AND_ORDERS: Sql = Sql {
    postgres: concat!(
        super::queries::payment_and_order_select!(),
        " WHERE (p.merchant_id, p.out_trade_no) IN (SELECT * FROM UNNEST($1::text[], $2::text[]))"
    ),
    mysql: concat!(
        super::queries::payment_and_order_select!(),
        " WHERE (p.merchant_id, p.out_trade_no) IN (SELECT k.k_merchant_id, k.k_out_trade_no FROM ",
        mysql_key_pair!("k_merchant_id", "k_out_trade_no"),
        ")"
    ),
    sqlite: concat!(
        super::queries::payment_and_order_select!(),
        " WHERE (p.merchant_id, p.out_trade_no) IN \
         (SELECT json_extract(k.value, '$[0]'), json_extract(k.value, '$[1]') FROM json_each(?1) AS k)"
    ),
};

/// PostgreSQL's one read before a batch of one is decided without row locks: the payments of
/// `$1`, `$2` (merchant_id, out_trade_no); the orders of `$3`, `$4` (merchant_id, order_no) and
/// those of the payments found; the accounts of `$5` (account_id) and the payees of the orders
/// found and the payers of the payments found; the answered records of `$6`, `$7` (scope,
/// idempotency_key), as [`FIND_ANSWERED_RECORDS`] reads them. One statement, so one snapshot,
/// one round trip instead of up to four. Each row as `(kind, row)`: `kind` `p`, `o`, `a` or
/// `c`, `row` the row as a JSON object (`row_to_json`, PostgreSQL manual 9.16) whose names are
/// the row type's fields, a record's byte columns as hexadecimal text (`encode(..., 'hex')`).
/// Each key is looked up by its unique index in a `LATERAL` subquery with `LIMIT 1` (see
/// [`FIND_REFUNDS`]). (The keys a write finds taken, an out_refund_no or a request_id, stay a
/// read of their own: folded in here, they cost every call the statement's larger start-up and
/// bought the Refunds and Deposits nothing measurable, docs/benchmarks-history.md.)
pub(super) static READ_AT_ONCE_POSTGRES: &str = concat!(
    "WITH p AS (SELECT r.* FROM UNNEST($1::text[], $2::text[]) AS k(merchant_id, out_trade_no) CROSS JOIN LATERAL \
     (SELECT trade_no, merchant_id, out_trade_no, order_no, payer_account_id, payee_account_id, amount, currency, \
     status, created_at, created_by FROM payment_flow WHERE payment_flow.merchant_id = k.merchant_id \
     AND payment_flow.out_trade_no = k.out_trade_no LIMIT 1) AS r), \
     o AS (SELECT r.* FROM (SELECT * FROM UNNEST($3::text[], $4::text[]) UNION SELECT merchant_id, order_no FROM p) \
     AS k(merchant_id, order_no) CROSS JOIN LATERAL (SELECT ",
    super::queries::order_columns!(),
    " FROM orders WHERE orders.merchant_id = k.merchant_id AND orders.order_no = k.order_no LIMIT 1) AS r), \
     a AS (SELECT r.* FROM (SELECT * FROM UNNEST($5::text[]) UNION SELECT payee_account_id FROM o UNION SELECT payer_account_id FROM p) \
     AS k(account_id) CROSS JOIN LATERAL (SELECT ",
    super::queries::account_columns!(),
    " FROM accounts WHERE accounts.account_id = k.account_id LIMIT 1) AS r), \
     c AS (SELECT r.* FROM UNNEST($6::text[], $7::text[]) AS k(scope, idempotency_key) CROSS JOIN LATERAL \
     (SELECT scope, idempotency_key, method, request_fingerprint, encode(request_fields, 'hex') AS request_fields, \
     encode(response, 'hex') AS response, encode(response_message, 'hex') AS response_message, caller_scope, status, \
     created_at, expires_at FROM idempotency_record WHERE idempotency_record.scope = k.scope \
     AND idempotency_record.idempotency_key = k.idempotency_key AND idempotency_record.response IS NOT NULL \
     LIMIT 1) AS r) \
     SELECT 'p' AS kind, row_to_json(p)::text AS row FROM p UNION ALL SELECT 'o', row_to_json(o)::text FROM o \
     UNION ALL SELECT 'a', row_to_json(a)::text FROM a UNION ALL SELECT 'c', row_to_json(c)::text FROM c"
);

/// The refunds of rows `[merchant_id, out_refund_no]`; a read.
///
/// PostgreSQL's form, like every batch statement of it that finds rows by key under a filter
/// the table's statistics may misjudge (a status, a version, a response), looks each key up in
/// a `LATERAL` subquery with `LIMIT 1`: such a subquery is never merged into the join, so the
/// plan, generic or not, is the keys then one index lookup a key, whatever the statistics say
/// of the table; an UPDATE then updates the rows by the `ctid` those lookups found (a TID scan).
/// docs/decisions/001-generic-plans.md.
pub(super) static FIND_REFUNDS: Sql = Sql {
    postgres: concat!(
        "SELECT r.* FROM UNNEST($1::text[], $2::text[]) AS k(merchant_id, out_refund_no) CROSS JOIN LATERAL (SELECT ",
        super::queries::refund_columns!(),
        " FROM refunds WHERE refunds.merchant_id = k.merchant_id AND refunds.out_refund_no = k.out_refund_no \
         LIMIT 1) AS r"
    ),
    mysql: concat!(
        "SELECT ",
        super::queries::refund_columns!(),
        " FROM ",
        mysql_key_pair!("k_merchant_id", "k_out_refund_no"),
        " STRAIGHT_JOIN refunds FORCE INDEX (refunds_out_refund_no) ON refunds.merchant_id = k.k_merchant_id \
         AND refunds.out_refund_no = k.k_out_refund_no"
    ),
    // CROSS JOIN fixes the join order in SQLite (its manual, "The SQLite Query Optimizer
    // Overview", manual control of query plans using CROSS JOIN): one
    // index lookup a key, whatever the statistics say of a young refunds table.
    sqlite: concat!(
        "SELECT ",
        super::queries::refund_columns!(),
        " FROM json_each(?1) AS k CROSS JOIN refunds ON refunds.merchant_id = json_extract(k.value, '$[0]') \
         AND refunds.out_refund_no = json_extract(k.value, '$[1]')"
    ),
};

/// The records of rows `[scope, idempotency_key]` that hold a response (committed ones: a
/// transaction writes the response with the business change), whole, as a replay answers
/// from them; a read, without locks, by the records' unique key.
pub(super) static FIND_ANSWERED_RECORDS: Sql = Sql {
    postgres: concat!(
        "SELECT r.* FROM UNNEST($1::text[], $2::text[]) AS k(scope, idempotency_key) CROSS JOIN LATERAL (SELECT ",
        super::queries::record_columns!(),
        " FROM idempotency_record WHERE idempotency_record.scope = k.scope \
         AND idempotency_record.idempotency_key = k.idempotency_key AND idempotency_record.response IS NOT NULL \
         LIMIT 1) AS r"
    ),
    mysql: concat!(
        "SELECT ",
        super::queries::record_columns!(),
        " FROM ",
        mysql_key_pair!("k_scope", "k_idempotency_key"),
        " STRAIGHT_JOIN idempotency_record FORCE INDEX (idempotency_record_scope_key) \
         ON idempotency_record.scope = k.k_scope AND idempotency_record.idempotency_key = k.k_idempotency_key \
         WHERE idempotency_record.response IS NOT NULL"
    ),
    sqlite: concat!(
        "SELECT ",
        super::queries::record_columns!(),
        " FROM json_each(?1) AS k CROSS JOIN idempotency_record \
         ON idempotency_record.scope = json_extract(k.value, '$[0]') \
         AND idempotency_record.idempotency_key = json_extract(k.value, '$[1]') \
         WHERE idempotency_record.response IS NOT NULL"
    ),
};

/// The orders of rows `[merchant_id, order_no]`, sorted as the caller sorted them, each
/// backend's text ending in `$postgres_lock` and `$mysql_lock` (SQLite has no row locks: a
/// write transaction, BEGIN IMMEDIATE, holds the database).
macro_rules! orders_by_key {
    ($postgres_lock:literal, $mysql_lock:literal) => {
        Sql {
            postgres: concat!(
                "SELECT ",
                super::queries::order_columns!(),
                " FROM orders WHERE (merchant_id, order_no) IN (SELECT * FROM UNNEST($1::text[], $2::text[])) \
                 ORDER BY merchant_id COLLATE \"C\", order_no COLLATE \"C\"",
                $postgres_lock
            ),
            mysql: concat!(
                "SELECT ",
                super::queries::order_columns!(),
                " FROM ",
                mysql_key_pair!("k_merchant_id", "k_order_no"),
                " STRAIGHT_JOIN orders FORCE INDEX (PRIMARY) ON orders.merchant_id = k.k_merchant_id AND orders.order_no = k.k_order_no",
                $mysql_lock
            ),
            sqlite: concat!(
                "SELECT ",
                super::queries::order_columns!(),
                " FROM orders WHERE (merchant_id, order_no) IN \
                 (SELECT json_extract(k.value, '$[0]'), json_extract(k.value, '$[1]') FROM json_each(?1) AS k)"
            ),
        }
    };
}

/// The accounts of rows `[account_id]`, sorted as the caller sorted them, each backend's text
/// ending in `$postgres_lock` and `$mysql_lock`.
macro_rules! accounts_by_id {
    ($postgres_lock:literal, $mysql_lock:literal) => {
        Sql {
            postgres: concat!(
                "SELECT ",
                super::queries::account_columns!(),
                " FROM accounts WHERE account_id = ANY($1::text[]) ORDER BY account_id COLLATE \"C\"",
                $postgres_lock
            ),
            mysql: concat!(
                "SELECT ",
                super::queries::account_columns!(),
                " FROM JSON_TABLE(?, '$[*]' COLUMNS (k_account_id VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin \
                 PATH '$[0]')) AS k STRAIGHT_JOIN accounts FORCE INDEX (PRIMARY) ON accounts.account_id = k.k_account_id",
                $mysql_lock
            ),
            sqlite: concat!(
                "SELECT ",
                super::queries::account_columns!(),
                " FROM accounts WHERE account_id IN (SELECT json_extract(k.value, '$[0]') FROM json_each(?1) AS k)"
            ),
        }
    };
}

/// The orders of rows `[merchant_id, order_no]` (sorted by the caller), row-locked in that
/// order. PostgreSQL locks after its sort, so its ORDER BY sets the order; MySQL's locks follow
/// the join from the JSON rows.
pub(super) static LOCK_ORDERS: Sql = orders_by_key!(" FOR NO KEY UPDATE", " FOR UPDATE");

/// The orders of rows `[merchant_id, order_no]`, read without locks (each as last committed).
pub(super) static READ_ORDERS: Sql = orders_by_key!("", "");

/// The accounts of rows `[account_id]` (sorted by the caller, in byte order), row-locked in that
/// order: the order in which single postings take their row locks too.
pub(super) static LOCK_ACCOUNTS: Sql = accounts_by_id!(" FOR NO KEY UPDATE", " FOR UPDATE");

/// The accounts of rows `[account_id]`, read without locks (each as last committed).
pub(super) static READ_ACCOUNTS: Sql = accounts_by_id!("", "");

/// The journal entries of rows `[posting_id, account_id]` (one leg each, by the entries'
/// unique key: PostgreSQL knows each pair gives at most one row, where `posting_id` alone,
/// without statistics, is guessed at 0.5% of the table a value and scanned); a read, inside
/// the batch's transaction after [`INSERT_ENTRIES`], for the entry ids a Transfer's answer
/// gives.
pub(super) static FIND_ENTRIES: Sql = Sql {
    postgres: concat!(
        "SELECT ",
        super::queries::entry_columns!(),
        " FROM journal_entries WHERE (posting_id, account_id) IN (SELECT * FROM UNNEST($1::text[], $2::text[]))"
    ),
    mysql: concat!(
        "SELECT ",
        super::queries::entry_columns!(),
        " FROM ",
        mysql_key_pair!("k_posting_id", "k_account_id"),
        " STRAIGHT_JOIN journal_entries FORCE INDEX (journal_entries_one_leg_per_account) \
         ON journal_entries.posting_id = k.k_posting_id AND journal_entries.account_id = k.k_account_id"
    ),
    sqlite: concat!(
        "SELECT ",
        super::queries::entry_columns!(),
        " FROM json_each(?1) AS k CROSS JOIN journal_entries ON journal_entries.posting_id = json_extract(k.value, '$[0]') \
         AND journal_entries.account_id = json_extract(k.value, '$[1]')"
    ),
};

/// The request_ids taken in `deposits` (rows `[request_id]` of the first value) and in
/// `withdrawals` (of the second), each as `('D' or 'W', request_id)`; a read, inside the batch's
/// transaction once the funding accounts are locked (every Deposit or Withdraw of a request_id
/// moves money against the same funding account, so none of them can commit after this read
/// while the batch holds that account's lock).
pub(super) static FIND_FUNDINGS: Sql = Sql {
    postgres: "SELECT 'D'::text, request_id::text FROM deposits WHERE request_id = ANY($1::text[]) \
               UNION ALL SELECT 'W'::text, request_id::text FROM withdrawals WHERE request_id = ANY($2::text[])",
    mysql: "SELECT 'D', deposits.request_id FROM JSON_TABLE(?, '$[*]' COLUMNS (\
            k_request_id VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin PATH '$[0]')) AS k \
            STRAIGHT_JOIN deposits FORCE INDEX (PRIMARY) ON deposits.request_id = k.k_request_id \
            UNION ALL SELECT 'W', withdrawals.request_id FROM JSON_TABLE(?, '$[*]' COLUMNS (\
            k_request_id VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin PATH '$[0]')) AS k \
            STRAIGHT_JOIN withdrawals FORCE INDEX (PRIMARY) ON withdrawals.request_id = k.k_request_id",
    sqlite: "SELECT 'D', request_id FROM deposits WHERE request_id IN \
             (SELECT json_extract(k.value, '$[0]') FROM json_each(?1) AS k) \
             UNION ALL SELECT 'W', request_id FROM withdrawals WHERE request_id IN \
             (SELECT json_extract(k.value, '$[0]') FROM json_each(?2) AS k)",
};

/// A batch statement of the database servers only: SQLite runs its one-row statement once a
/// row instead (in process, no round trip to save), where its planner, trusting statistics
/// taken of a small table, would scan the table being updated for every row of the batch.
pub(super) struct ServerSql {
    postgres: &'static str,
    mysql: &'static str,
}

impl ServerSql {
    pub(super) fn text(&self, dialect: Dialect) -> &'static str {
        match dialect {
            Dialect::Postgres => self.postgres,
            Dialect::MySql => self.mysql,
            Dialect::Sqlite => unreachable!("SQLite runs the one-row statement once a row"),
        }
    }
}

/// Completes claimed records, for rows `[scope, idempotency_key, response, response_message]`,
/// the two bodies as hexadecimal text (JSON_TABLE carries no bytes; PostgreSQL's
/// `decode(.., 'hex')` and MySQL's `UNHEX` turn them back): IN_PROGRESS -> COMPLETED, as the
/// one-record statement does.
pub(super) static COMPLETE_RECORDS: ServerSql = ServerSql {
    postgres: "UPDATE idempotency_record SET response = decode(k.response, 'hex'), \
               response_message = decode(k.response_message, 'hex'), status = 'COMPLETED' \
               FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[]) AS k(scope, idempotency_key, response, response_message) \
               CROSS JOIN LATERAL (SELECT ctid AS row_id FROM idempotency_record AS claimed \
               WHERE claimed.scope = k.scope AND claimed.idempotency_key = k.idempotency_key \
               AND claimed.status = 'IN_PROGRESS' LIMIT 1) AS found \
               WHERE idempotency_record.ctid = found.row_id",
    mysql: "UPDATE JSON_TABLE(?, '$[*]' COLUMNS (\
            k_scope VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin PATH '$[0]', \
            k_idempotency_key VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin PATH '$[1]', \
            k_response LONGTEXT CHARACTER SET ascii PATH '$[2]', \
            k_response_message LONGTEXT CHARACTER SET ascii PATH '$[3]')) AS k \
            STRAIGHT_JOIN idempotency_record FORCE INDEX (idempotency_record_scope_key) \
            ON idempotency_record.scope = k.k_scope AND idempotency_record.idempotency_key = k.k_idempotency_key \
            SET idempotency_record.response = UNHEX(k.k_response), \
            idempotency_record.response_message = UNHEX(k.k_response_message), idempotency_record.status = 'COMPLETED' \
            WHERE idempotency_record.status = 'IN_PROGRESS'",
};

/// PostgreSQL's insert of idempotency records from twelve arrays (`$arrays`, the columns of
/// [`CLAIM_RECORDS`]'s rows in order), in key order, skipping a key taken; `RETURNING` follows.
/// [`CLAIM_RECORDS`] and the records' part of [`WRITE_PARTS_POSTGRES`] differ by their
/// placeholders and what they return.
macro_rules! claim_records_postgres {
    ($arrays:literal) => {
        concat!(
            "INSERT INTO idempotency_record (scope, idempotency_key, method, request_fingerprint, request_fields, \
             response, response_message, caller_scope, status, created_at, expires_at) \
             SELECT k.scope, k.idempotency_key, k.method, k.request_fingerprint, decode(k.request_fields, 'hex'), \
             CASE WHEN k.nulls & 1 = 0 THEN decode(k.response, 'hex') END, \
             CASE WHEN k.nulls & 2 = 0 THEN decode(k.response_message, 'hex') END, \
             CASE WHEN k.nulls & 4 = 0 THEN k.caller_scope END, k.status, k.created_at, k.expires_at \
             FROM UNNEST(",
            $arrays,
            ") AS k(scope, idempotency_key, method, request_fingerprint, request_fields, response, response_message, \
             caller_scope, status, created_at, expires_at, nulls) \
             ORDER BY k.scope, k.idempotency_key ON CONFLICT DO NOTHING RETURNING"
        )
    };
}

/// The columns a record row of [`CLAIM_RECORDS`] gives, in order.
pub(super) const RECORD_COLUMNS: usize = 12;

/// Claims idempotency records, all or none, for rows `[scope, idempotency_key, method,
/// request_fingerprint, request_fields, response, response_message, caller_scope, status,
/// created_at, expires_at, nulls]`: the three byte columns as hexadecimal text (see
/// [`COMPLETE_RECORDS`]), and `nulls` the bits of the columns that are NULL (1 `response`, 2
/// `response_message`, 4 `caller_scope`), which the rows' values cannot carry. Rows go in key
/// order (a total one: binary on MySQL, where JSON_TABLE's strings would compare without case),
/// so that two batches that claim the same keys wait for each other rather than deadlock.
///
/// - PostgreSQL: `ON CONFLICT DO NOTHING RETURNING` the keys it inserted; fewer than the rows
///   means a key was taken, and the caller deletes what went in ([`UNCLAIM_RECORDS_POSTGRES`]).
/// - MySQL: a taken key fails the whole statement with a duplicate-key error, which undoes the
///   statement and leaves the transaction usable (MySQL manual, "InnoDB Error Handling").
pub(super) static CLAIM_RECORDS: ServerSql = ServerSql {
    postgres: concat!(
        claim_records_postgres!(
            "$1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[], \
             $9::text[], $10::bigint[], $11::bigint[], $12::bigint[]"
        ),
        " scope, idempotency_key"
    ),
    mysql: "INSERT INTO idempotency_record (scope, idempotency_key, method, request_fingerprint, request_fields, \
            response, response_message, caller_scope, status, created_at, expires_at) \
            SELECT scope, idempotency_key, method, request_fingerprint, UNHEX(request_fields), \
            CASE WHEN nulls & 1 = 0 THEN UNHEX(response) END, CASE WHEN nulls & 2 = 0 THEN UNHEX(response_message) END, \
            CASE WHEN nulls & 4 = 0 THEN caller_scope END, status, created_at, expires_at \
            FROM JSON_TABLE(?, '$[*]' COLUMNS (\
            scope VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[0]', \
            idempotency_key VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[1]', \
            method VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[2]', \
            request_fingerprint VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[3]', \
            request_fields LONGTEXT CHARACTER SET ascii PATH '$[4]', \
            response LONGTEXT CHARACTER SET ascii PATH '$[5]', \
            response_message LONGTEXT CHARACTER SET ascii PATH '$[6]', \
            caller_scope VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[7]', \
            status VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[8]', \
            created_at BIGINT PATH '$[9]', \
            expires_at BIGINT PATH '$[10]', \
            nulls BIGINT PATH '$[11]')) AS k \
            ORDER BY scope COLLATE utf8mb4_bin, idempotency_key COLLATE utf8mb4_bin",
};

/// Deletes the records of `[scope, idempotency_key]` rows that [`CLAIM_RECORDS`] inserted on
/// PostgreSQL when it could not insert them all (rows of this transaction, which nobody else
/// has seen).
pub(super) const UNCLAIM_RECORDS_POSTGRES: &str =
    "DELETE FROM idempotency_record USING UNNEST($1::text[], $2::text[]) \
     AS k(scope, idempotency_key) \
     WHERE idempotency_record.scope = k.scope AND idempotency_record.idempotency_key = k.idempotency_key";

/// The columns a payment row of [`INSERT_PAYMENTS`] and [`WRITE_PARTS_POSTGRES`] gives, in order.
pub(super) const PAYMENT_COLUMNS: usize = 11;
/// The columns a journal entry row gives, in order.
pub(super) const ENTRY_COLUMNS: usize = 12;

/// Rows `[trade_no, merchant_id, out_trade_no, order_no, payer_account_id, payee_account_id,
/// amount, currency, status, created_at, created_by]`; a taken key fails the statement on MySQL
/// (duplicate key) and inserts fewer rows elsewhere.
pub(super) static INSERT_PAYMENTS: StepSql = StepSql {
    mysql: concat!(
        super::queries::insert_payment_into!(),
        " SELECT trade_no, merchant_id, out_trade_no, order_no, payer_account_id, payee_account_id, amount, currency, \
         status, created_at, created_by FROM JSON_TABLE(?, '$[*]' COLUMNS (\
         trade_no VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[0]', \
         merchant_id VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[1]', \
         out_trade_no VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[2]', \
         order_no VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[3]', \
         payer_account_id VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[4]', \
         payee_account_id VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[5]', \
         amount BIGINT PATH '$[6]', \
         currency VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[7]', \
         status VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[8]', \
         created_at BIGINT PATH '$[9]', \
         created_by VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[10]')) AS k"
    ),
    // WHERE true: an INSERT ... SELECT with an upsert clause needs a WHERE (SQLite manual,
    // "UPSERT", parsing ambiguity).
    sqlite: concat!(
        super::queries::insert_payment_into!(),
        " SELECT json_extract(k.value, '$[0]'), json_extract(k.value, '$[1]'), json_extract(k.value, '$[2]'), \
         json_extract(k.value, '$[3]'), json_extract(k.value, '$[4]'), json_extract(k.value, '$[5]'), \
         json_extract(k.value, '$[6]'), json_extract(k.value, '$[7]'), json_extract(k.value, '$[8]'), \
         json_extract(k.value, '$[9]'), json_extract(k.value, '$[10]') FROM json_each(?1) AS k WHERE true \
         ON CONFLICT DO NOTHING"
    ),
};

/// PENDING -> PAID for rows `[merchant_id, order_no, out_trade_no]`, then `updated_at`.
pub(super) static MARK_ORDERS_PAID: StepSql = StepSql {
    mysql: "UPDATE JSON_TABLE(?, '$[*]' COLUMNS (\
            k_merchant_id VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin PATH '$[0]', \
            k_order_no VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin PATH '$[1]', \
            k_out_trade_no VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[2]')) AS k \
            STRAIGHT_JOIN orders FORCE INDEX (PRIMARY) ON orders.merchant_id = k.k_merchant_id AND orders.order_no = k.k_order_no \
            SET orders.status = 'PAID', orders.updated_at = ?, orders.pending_deadline = NULL, \
            orders.out_trade_no = k.k_out_trade_no WHERE orders.status = 'PENDING'",
    sqlite: "UPDATE orders SET status = 'PAID', updated_at = ?2, pending_deadline = NULL, \
             out_trade_no = json_extract(k.value, '$[2]') FROM json_each(?1) AS k \
             WHERE orders.merchant_id = json_extract(k.value, '$[0]') AND orders.order_no = json_extract(k.value, '$[1]') \
             AND orders.status = 'PENDING'",
};

/// One version CAS an account, for rows `[account_id, balance, expected_version, version,
/// held, chain_hash, expected_held]`, then `updated_at`: the held amount is compared too, as a
/// hold reserved or released moves it without a version (no entry is posted).
pub(super) static CAS_BALANCES: StepSql = StepSql {
    mysql: "UPDATE JSON_TABLE(?, '$[*]' COLUMNS (\
            k_account_id VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin PATH '$[0]', \
            k_balance BIGINT PATH '$[1]', k_expected_version BIGINT PATH '$[2]', k_version BIGINT PATH '$[3]', \
            k_held BIGINT PATH '$[4]', \
            k_chain_hash VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin PATH '$[5]', \
            k_expected_held BIGINT PATH '$[6]')) AS k \
            STRAIGHT_JOIN accounts FORCE INDEX (PRIMARY) ON accounts.account_id = k.k_account_id AND accounts.version = k.k_expected_version \
            AND accounts.held = k.k_expected_held \
            SET accounts.balance = k.k_balance, accounts.version = k.k_version, accounts.held = k.k_held, \
            accounts.chain_hash = k.k_chain_hash, accounts.updated_at = ?",
    sqlite: "UPDATE accounts SET balance = json_extract(k.value, '$[1]'), version = json_extract(k.value, '$[3]'), \
             held = json_extract(k.value, '$[4]'), chain_hash = json_extract(k.value, '$[5]'), updated_at = ?2 \
             FROM json_each(?1) AS k \
             WHERE accounts.account_id = json_extract(k.value, '$[0]') AND accounts.version = json_extract(k.value, '$[2]') \
             AND accounts.held = json_extract(k.value, '$[6]')",
};

/// Rows `[account_id, currency, amount, balance_after, version_after, kind, reference,
/// posting_id, counterparty_account_id, created_at, created_by, entry_hash]`, given entry ids in
/// row order.
pub(super) static INSERT_ENTRIES: StepSql = StepSql {
    mysql: concat!(
        super::queries::insert_entry_into!(),
        " SELECT account_id, currency, amount, balance_after, version_after, kind, reference, posting_id, \
         counterparty_account_id, created_at, created_by, entry_hash FROM JSON_TABLE(?, '$[*]' COLUMNS (\
         n FOR ORDINALITY, \
         account_id VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[0]', \
         currency VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[1]', \
         amount BIGINT PATH '$[2]', \
         balance_after BIGINT PATH '$[3]', \
         version_after BIGINT PATH '$[4]', \
         kind VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[5]', \
         reference VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[6]', \
         posting_id VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[7]', \
         counterparty_account_id VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[8]', \
         created_at BIGINT PATH '$[9]', \
         created_by VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[10]', \
         entry_hash VARCHAR(64) CHARACTER SET ascii PATH '$[11]')) AS k ORDER BY k.n"
    ),
    sqlite: concat!(
        super::queries::insert_entry_into!(),
        " SELECT json_extract(k.value, '$[0]'), json_extract(k.value, '$[1]'), json_extract(k.value, '$[2]'), \
         json_extract(k.value, '$[3]'), json_extract(k.value, '$[4]'), json_extract(k.value, '$[5]'), \
         json_extract(k.value, '$[6]'), json_extract(k.value, '$[7]'), json_extract(k.value, '$[8]'), \
         json_extract(k.value, '$[9]'), json_extract(k.value, '$[10]'), json_extract(k.value, '$[11]') \
         FROM json_each(?1) AS k ORDER BY k.key"
    ),
};

/// The columns a refund row of [`INSERT_REFUNDS`] and [`WRITE_PARTS_POSTGRES`] gives, in order.
pub(super) const REFUND_COLUMNS: usize = 11;

/// Rows `[refund_no, merchant_id, out_refund_no, out_trade_no, order_no, amount, currency,
/// reason, created_at, created_by, order_refunded_after]`; a taken key fails the statement on MySQL (duplicate key)
/// and inserts fewer rows elsewhere.
pub(super) static INSERT_REFUNDS: StepSql = StepSql {
    mysql: concat!(
        super::queries::insert_refund_into!(),
        " SELECT refund_no, merchant_id, out_refund_no, out_trade_no, order_no, amount, currency, reason, created_at, \
         created_by, order_refunded_after FROM JSON_TABLE(?, '$[*]' COLUMNS (\
         refund_no VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[0]', \
         merchant_id VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[1]', \
         out_refund_no VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[2]', \
         out_trade_no VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[3]', \
         order_no VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[4]', \
         amount BIGINT PATH '$[5]', \
         currency VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[6]', \
         reason VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[7]', \
         created_at BIGINT PATH '$[8]', \
         created_by VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[9]', \
         order_refunded_after BIGINT PATH '$[10]')) AS k"
    ),
    sqlite: concat!(
        super::queries::insert_refund_into!(),
        " SELECT json_extract(k.value, '$[0]'), json_extract(k.value, '$[1]'), json_extract(k.value, '$[2]'), \
         json_extract(k.value, '$[3]'), json_extract(k.value, '$[4]'), json_extract(k.value, '$[5]'), \
         json_extract(k.value, '$[6]'), json_extract(k.value, '$[7]'), json_extract(k.value, '$[8]'), \
         json_extract(k.value, '$[9]'), json_extract(k.value, '$[10]') FROM json_each(?1) AS k WHERE true \
         ON CONFLICT DO NOTHING"
    ),
};

/// The refund CAS of each order, for rows `[merchant_id, order_no, from_status,
/// from_refunded, to_status, to_refunded]`, then `updated_at`: an order moves only from the
/// state read, and only to a refunded amount within its amount (as the one-refund
/// statement).
pub(super) static REFUND_ORDERS: StepSql = StepSql {
    mysql: "UPDATE JSON_TABLE(?, '$[*]' COLUMNS (\
            k_merchant_id VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin PATH '$[0]', \
            k_order_no VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin PATH '$[1]', \
            k_from_status VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin PATH '$[2]', \
            k_from_refunded BIGINT PATH '$[3]', \
            k_to_status VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[4]', \
            k_to_refunded BIGINT PATH '$[5]')) AS k \
            STRAIGHT_JOIN orders FORCE INDEX (PRIMARY) ON orders.merchant_id = k.k_merchant_id AND orders.order_no = k.k_order_no \
            SET orders.status = k.k_to_status, orders.refunded_amount = k.k_to_refunded, orders.updated_at = ? \
            WHERE orders.status = k.k_from_status AND orders.refunded_amount = k.k_from_refunded \
            AND k.k_to_refunded <= orders.amount",
    sqlite: "UPDATE orders SET status = json_extract(k.value, '$[4]'), refunded_amount = json_extract(k.value, '$[5]'), \
             updated_at = ?2 FROM json_each(?1) AS k \
             WHERE orders.merchant_id = json_extract(k.value, '$[0]') AND orders.order_no = json_extract(k.value, '$[1]') \
             AND orders.status = json_extract(k.value, '$[2]') AND orders.refunded_amount = json_extract(k.value, '$[3]') \
             AND json_extract(k.value, '$[5]') <= orders.amount",
};

/// The columns a transfer row of [`INSERT_TRANSFERS`] and [`WRITE_PARTS_POSTGRES`] gives, in order.
pub(super) const TRANSFER_COLUMNS: usize = 8;

/// Rows `[transfer_id, from_account_id, to_account_id, amount, currency, memo, created_at,
/// created_by]`; a taken transfer_id fails the statement on MySQL (duplicate key) and inserts
/// fewer rows elsewhere.
pub(super) static INSERT_TRANSFERS: StepSql = StepSql {
    mysql: concat!(
        super::queries::insert_transfer_into!(),
        " SELECT transfer_id, from_account_id, to_account_id, amount, currency, memo, created_at, created_by \
         FROM JSON_TABLE(?, '$[*]' COLUMNS (\
         transfer_id VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[0]', \
         from_account_id VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[1]', \
         to_account_id VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[2]', \
         amount BIGINT PATH '$[3]', \
         currency VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[4]', \
         memo VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[5]', \
         created_at BIGINT PATH '$[6]', \
         created_by VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[7]')) AS k"
    ),
    sqlite: concat!(
        super::queries::insert_transfer_into!(),
        " SELECT json_extract(k.value, '$[0]'), json_extract(k.value, '$[1]'), json_extract(k.value, '$[2]'), \
         json_extract(k.value, '$[3]'), json_extract(k.value, '$[4]'), json_extract(k.value, '$[5]'), \
         json_extract(k.value, '$[6]'), json_extract(k.value, '$[7]') FROM json_each(?1) AS k WHERE true \
         ON CONFLICT DO NOTHING"
    ),
};

/// The columns a deposit or withdrawal row of [`INSERT_DEPOSITS`], [`INSERT_WITHDRAWALS`] and
/// [`WRITE_PARTS_POSTGRES`] gives, in order.
pub(super) const FUNDING_COLUMNS: usize = 8;

/// The MySQL rows of a deposit or withdrawal, `[request_id, funding_id, account_id, amount,
/// currency, created_at, created_by, held_after]`.
macro_rules! mysql_funding_rows {
    () => {
        " SELECT request_id, funding_id, account_id, amount, currency, created_at, created_by, held_after \
         FROM JSON_TABLE(?, '$[*]' COLUMNS (\
         request_id VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[0]', \
         funding_id VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[1]', \
         account_id VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[2]', \
         amount BIGINT PATH '$[3]', \
         currency VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[4]', \
         created_at BIGINT PATH '$[5]', \
         created_by VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[6]', \
         held_after BIGINT PATH '$[7]')) AS k"
    };
}

/// The SQLite rows of a deposit or withdrawal, as [`mysql_funding_rows`].
macro_rules! sqlite_funding_rows {
    () => {
        " SELECT json_extract(k.value, '$[0]'), json_extract(k.value, '$[1]'), json_extract(k.value, '$[2]'), \
         json_extract(k.value, '$[3]'), json_extract(k.value, '$[4]'), json_extract(k.value, '$[5]'), \
         json_extract(k.value, '$[6]'), json_extract(k.value, '$[7]') FROM json_each(?1) AS k WHERE true \
         ON CONFLICT DO NOTHING"
    };
}

/// Deposit rows `[request_id, deposit_id, account_id, amount, currency, created_at,
/// created_by, held_after]`; a taken request_id fails the statement on MySQL (duplicate key) and inserts
/// fewer rows elsewhere.
pub(super) static INSERT_DEPOSITS: StepSql = StepSql {
    mysql: concat!(super::queries::insert_deposit_into!(), mysql_funding_rows!()),
    sqlite: concat!(super::queries::insert_deposit_into!(), sqlite_funding_rows!()),
};

/// Withdrawal rows `[request_id, withdrawal_id, account_id, amount, currency, created_at,
/// created_by, held_after]`, as [`INSERT_DEPOSITS`].
pub(super) static INSERT_WITHDRAWALS: StepSql = StepSql {
    mysql: concat!(super::queries::insert_withdrawal_into!(), mysql_funding_rows!()),
    sqlite: concat!(super::queries::insert_withdrawal_into!(), sqlite_funding_rows!()),
};

/// The columns an order row of [`INSERT_ORDERS`] and [`WRITE_PARTS_POSTGRES`] gives, in order.
pub(super) const ORDER_COLUMNS: usize = 9;

/// New PENDING orders, rows `[merchant_id, order_no, payee_account_id, amount, currency,
/// subject, status, created_at, expires_at]`, `expires_at` 0 for none (an order's expiry is
/// always later than its creation, so 0 is never one; `NULLIF` turns it into NULL, which the
/// rows' values cannot carry): `updated_at` is `created_at`, `pending_deadline` is
/// `expires_at`, as the one-order INSERT writes them. A taken key fails the statement on MySQL
/// (duplicate key) and inserts fewer rows elsewhere.
pub(super) static INSERT_ORDERS: StepSql = StepSql {
    mysql: concat!(
        super::queries::insert_order_into!(),
        " SELECT merchant_id, order_no, payee_account_id, amount, currency, subject, status, NULL, 0, created_at, \
         created_at, NULLIF(expires_at, 0), NULL, NULLIF(expires_at, 0) FROM JSON_TABLE(?, '$[*]' COLUMNS (\
         merchant_id VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[0]', \
         order_no VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[1]', \
         payee_account_id VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[2]', \
         amount BIGINT PATH '$[3]', \
         currency VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[4]', \
         subject VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[5]', \
         status VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$[6]', \
         created_at BIGINT PATH '$[7]', \
         expires_at BIGINT PATH '$[8]')) AS k"
    ),
    sqlite: concat!(
        super::queries::insert_order_into!(),
        " SELECT json_extract(k.value, '$[0]'), json_extract(k.value, '$[1]'), json_extract(k.value, '$[2]'), \
         json_extract(k.value, '$[3]'), json_extract(k.value, '$[4]'), json_extract(k.value, '$[5]'), \
         json_extract(k.value, '$[6]'), NULL, 0, json_extract(k.value, '$[7]'), json_extract(k.value, '$[7]'), \
         NULLIF(json_extract(k.value, '$[8]'), 0), NULL, NULLIF(json_extract(k.value, '$[8]'), 0) \
         FROM json_each(?1) AS k WHERE true ON CONFLICT DO NOTHING"
    ),
};

/// The parts of PostgreSQL's group-commit statement (data-modifying CTEs, each run exactly
/// once), in the order their arrays are bound: the payments, PENDING -> PAID, the version CAS,
/// the journal entries (given entry ids in array order), the refunds, the orders' refund CAS,
/// the transfers, the deposits, the withdrawals, the new orders and the idempotency records
/// claimed with the write (only a call written without row locks has them: a locked batch
/// claims its records before it writes, [`CLAIM_RECORDS`]). Each part's `{k}` is its
/// k-th array, `{now}` the `updated_at` of the UPDATEs. A batch never pays and refunds one
/// order, nor creates one it pays or refunds, so no order row is written twice.
///
/// Each UPDATE finds its row, and locks it, by a lookup with its condition (the order's state,
/// the account's version and held amount) in a LATERAL subquery (`LIMIT 1 FOR NO KEY UPDATE`,
/// whose generic plan is an index lookup), then updates the row by its ctid. A row another
/// transaction moved after the statement's snapshot is waited for and its condition checked
/// again on its latest version by PostgreSQL's EvalPlanQual of the lookup (an index scan, which
/// rechecks its quals; a TID scan did so only from the fix "Fix missing EvalPlanQual recheck for
/// TID scans", 2025): a row that no longer meets it is not found, and one that does is not
/// visible to the UPDATE's snapshot, so either way the part writes fewer rows than it was given
/// and the statement fails whole. A write without row locks relies on it. The lookups run one
/// an element of the arrays, in their order, since each depends on its element: so the rows are
/// locked in that order (the orders' and accounts' in key order, as a locked batch locks them)
/// whatever join PostgreSQL plans between them and the rows they update. A condition restated
/// on the updated row, in the WHERE, would let a planner that sees a small table (one never
/// analyzed) join that table's rows to the arrays by it first, and lock them in the table's
/// order: a write without row locks of several rows could then deadlock with a locked batch.
pub(super) const WRITE_PARTS_POSTGRES: [WritePart; 11] = [
    WritePart {
        name: "p",
        arrays: 11,
        text: concat!(
            super::queries::insert_payment_into!(),
            " SELECT * FROM UNNEST({1}::text[], {2}::text[], {3}::text[], {4}::text[], {5}::text[], {6}::text[], \
             {7}::bigint[], {8}::text[], {9}::text[], {10}::bigint[], {11}::text[]) ON CONFLICT DO NOTHING RETURNING 1"
        ),
    },
    WritePart {
        name: "o",
        arrays: 3,
        text: "UPDATE orders SET status = 'PAID', updated_at = {now}, pending_deadline = NULL, \
               out_trade_no = k.out_trade_no FROM UNNEST({1}::text[], {2}::text[], {3}::text[]) \
               AS k(merchant_id, order_no, out_trade_no) \
               CROSS JOIN LATERAL (SELECT ctid AS row_id FROM orders AS paid WHERE paid.merchant_id = k.merchant_id \
               AND paid.order_no = k.order_no AND paid.status = 'PENDING' LIMIT 1 FOR NO KEY UPDATE) AS found \
               WHERE orders.ctid = found.row_id AND orders.status = 'PENDING' RETURNING 1",
    },
    WritePart {
        name: "a",
        arrays: 7,
        text: "UPDATE accounts SET balance = k.balance, version = k.version, held = k.held, \
               chain_hash = k.chain_hash, updated_at = {now} \
               FROM UNNEST({1}::text[], {2}::bigint[], {3}::bigint[], {4}::bigint[], {5}::bigint[], {6}::text[], \
               {7}::bigint[]) AS k(account_id, balance, expected_version, version, held, chain_hash, expected_held) \
               CROSS JOIN LATERAL (SELECT ctid AS row_id FROM accounts AS moved WHERE moved.account_id = k.account_id \
               AND moved.version = k.expected_version AND moved.held = k.expected_held LIMIT 1 FOR NO KEY UPDATE) \
               AS found WHERE accounts.ctid = found.row_id RETURNING 1",
    },
    WritePart {
        name: "e",
        arrays: 12,
        text: concat!(
            super::queries::insert_entry_into!(),
            " SELECT account_id, currency, amount, balance_after, version_after, kind, reference, posting_id, \
             counterparty_account_id, created_at, created_by, entry_hash FROM UNNEST({1}::text[], {2}::text[], \
             {3}::bigint[], {4}::bigint[], {5}::bigint[], {6}::text[], {7}::text[], {8}::text[], {9}::text[], \
             {10}::bigint[], {11}::text[], {12}::text[]) WITH ORDINALITY AS k(account_id, currency, amount, \
             balance_after, version_after, kind, reference, posting_id, counterparty_account_id, created_at, \
             created_by, entry_hash, n) ORDER BY k.n RETURNING 1"
        ),
    },
    WritePart {
        name: "r",
        arrays: 11,
        text: concat!(
            super::queries::insert_refund_into!(),
            " SELECT * FROM UNNEST({1}::text[], {2}::text[], {3}::text[], {4}::text[], {5}::text[], {6}::bigint[], \
             {7}::text[], {8}::text[], {9}::bigint[], {10}::text[], {11}::bigint[]) ON CONFLICT DO NOTHING RETURNING 1"
        ),
    },
    WritePart {
        name: "t",
        arrays: 6,
        text: "UPDATE orders SET status = k.to_status, refunded_amount = k.to_refunded, updated_at = {now} \
               FROM UNNEST({1}::text[], {2}::text[], {3}::text[], {4}::bigint[], {5}::text[], {6}::bigint[]) \
               AS k(merchant_id, order_no, from_status, from_refunded, to_status, to_refunded) \
               CROSS JOIN LATERAL (SELECT ctid AS row_id FROM orders AS refunded \
               WHERE refunded.merchant_id = k.merchant_id AND refunded.order_no = k.order_no \
               AND refunded.status = k.from_status AND refunded.refunded_amount = k.from_refunded \
               AND k.to_refunded <= refunded.amount LIMIT 1 FOR NO KEY UPDATE) AS found \
               WHERE orders.ctid = found.row_id RETURNING 1",
    },
    WritePart {
        name: "x",
        arrays: 8,
        text: concat!(
            super::queries::insert_transfer_into!(),
            " SELECT * FROM UNNEST({1}::text[], {2}::text[], {3}::text[], {4}::bigint[], {5}::text[], {6}::text[], \
             {7}::bigint[], {8}::text[]) ON CONFLICT DO NOTHING RETURNING 1"
        ),
    },
    WritePart {
        name: "d",
        arrays: 8,
        text: concat!(
            super::queries::insert_deposit_into!(),
            " SELECT * FROM UNNEST({1}::text[], {2}::text[], {3}::text[], {4}::bigint[], {5}::text[], {6}::bigint[], \
             {7}::text[], {8}::bigint[]) ON CONFLICT DO NOTHING RETURNING 1"
        ),
    },
    WritePart {
        name: "w",
        arrays: 8,
        text: concat!(
            super::queries::insert_withdrawal_into!(),
            " SELECT * FROM UNNEST({1}::text[], {2}::text[], {3}::text[], {4}::bigint[], {5}::text[], {6}::bigint[], \
             {7}::text[], {8}::bigint[]) ON CONFLICT DO NOTHING RETURNING 1"
        ),
    },
    WritePart {
        name: "n",
        arrays: 9,
        text: concat!(
            super::queries::insert_order_into!(),
            " SELECT k.merchant_id, k.order_no, k.payee_account_id, k.amount, k.currency, k.subject, k.status, NULL, 0, \
             k.created_at, k.created_at, NULLIF(k.expires_at, 0), NULL, NULLIF(k.expires_at, 0) \
             FROM UNNEST({1}::text[], {2}::text[], {3}::text[], {4}::bigint[], {5}::text[], {6}::text[], {7}::text[], \
             {8}::bigint[], {9}::bigint[]) AS k(merchant_id, order_no, payee_account_id, amount, currency, subject, \
             status, created_at, expires_at) ON CONFLICT DO NOTHING RETURNING 1"
        ),
    },
    WritePart {
        name: "c",
        arrays: RECORD_COLUMNS,
        text: concat!(
            claim_records_postgres!(
                "{1}::text[], {2}::text[], {3}::text[], {4}::text[], {5}::text[], {6}::text[], {7}::text[], \
                 {8}::text[], {9}::text[], {10}::bigint[], {11}::bigint[], {12}::bigint[]"
            ),
            " 1"
        ),
    },
];

/// One part of PostgreSQL's group-commit statement (see [`WRITE_PARTS_POSTGRES`]).
pub(super) struct WritePart {
    name: &'static str,
    /// How many arrays it binds.
    pub(super) arrays: usize,
    text: &'static str,
}

/// The shape of PostgreSQL's group-commit statement for a batch that writes `rows` rows of each
/// part of [`WRITE_PARTS_POSTGRES`] (in its order): bit i set when part i is in the statement.
/// A batch of one kind of call (Pays only, Refunds only, Transfers, Deposits, Withdraws or
/// CreateOrders only) runs just the parts its rows need (a batch of Pays four: payments, PAID,
/// the version CAS and the entries), and the records' part when it claims records with the
/// write (a Pay, Refund or CreateOrder with an idempotency key, written without row locks); a
/// batch that mixes kinds runs every part but the records', the empty ones on empty arrays. So
/// at most ten statement texts exist, whatever the batches hold (records come only with one
/// call of one kind; a write set of records alone, or of records and several kinds, which only
/// tests make, runs every part); they differ by the kind of call a batch holds and whether it
/// claims records, never by how many.
pub(super) fn postgres_write_shape(rows: &[u64; WRITE_PARTS_POSTGRES.len()]) -> u16 {
    // The parts of each kind of call, those of the money it moves (the version CAS and the
    // entries), which every kind but CreateOrder writes, and the records'.
    const KINDS: [u16; 6] = [0b11, 0b11_0000, 1 << 6, 1 << 7, 1 << 8, 1 << 9];
    const MONEY: u16 = 0b1100;
    const RECORDS: u16 = 1 << 10;
    const EVERY_KIND: u16 = (1 << 10) - 1;
    let present =
        rows.iter().enumerate().filter(|(_, count)| **count > 0).fold(0_u16, |shape, (part, _)| shape | (1 << part));
    let kinds: Vec<u16> = KINDS.iter().copied().filter(|kind| present & kind != 0).collect();
    match kinds.as_slice() {
        // Nothing to write.
        [] if present == 0 => 0,
        [kind] => kind | (present & (MONEY | RECORDS)),
        // Several kinds; or balances and entries without a row of any kind (a Capture's
        // posting, whose payment is written apart); or records alone: every part of a kind, so
        // that nothing given is left out, and no text beyond the ten.
        _ => EVERY_KIND | (present & RECORDS),
    }
}

/// Every text PostgreSQL's group-commit statement can take (every shape
/// [`postgres_write_shape`] gives), each with how many parts it writes and how many
/// parameters it binds.
pub(super) fn postgres_write_statements() -> Vec<(usize, usize, &'static str)> {
    let mut shapes: Vec<u16> = (1_u16..1 << WRITE_PARTS_POSTGRES.len())
        .map(|present| {
            let rows: [u64; WRITE_PARTS_POSTGRES.len()] = std::array::from_fn(|part| u64::from(present >> part & 1));
            postgres_write_shape(&rows)
        })
        .collect();
    shapes.sort_unstable();
    shapes.dedup();
    shapes
        .into_iter()
        .map(|shape| {
            let parts = WRITE_PARTS_POSTGRES.iter().enumerate().filter(|(bit, _)| shape & (1 << bit) != 0);
            let arrays: usize = parts.clone().map(|(_, part)| part.arrays).sum();
            (parts.count(), arrays + 2, write_batch_postgres(shape))
        })
        .collect()
}

/// What PostgreSQL's group-commit statement fails with when a part wrote fewer rows than
/// given (a key taken, an order's state or a version moved): the text of a cast to integer that
/// cannot succeed, so the statement, its data-modifying CTEs with it, has no effect. The error
/// is SQLSTATE 22P02 (invalid_text_representation), its message quoting this text, and the
/// server logs it as such.
const WRITE_MISSED: &str = "payledger: a row of the write set was taken or moved under it";

/// Whether `error` is the statement's refusal of a write set with a row missing
/// ([`WRITE_MISSED`]).
pub(super) fn is_write_missed(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(database)
        if database.code().as_deref() == Some("22P02") && database.message().contains(WRITE_MISSED))
}

/// The group-commit statement of PostgreSQL with the parts whose bits `shape` sets (bit i:
/// part i of [`WRITE_PARTS_POSTGRES`]; see [`postgres_write_shape`]): `updated_at` as $1,
/// then each part's arrays in order, then the row count each part must write, in order, as
/// one `bigint[]`; it returns each part's row count, in order, or fails whole
/// ([`WRITE_MISSED`]) when one differs, so that, sent outside a transaction, it commits all of
/// the write set or nothing. Each text is made once per process and prepared once per
/// connection.
pub(super) fn write_batch_postgres(shape: u16) -> &'static str {
    static TEXTS: [std::sync::OnceLock<String>; 1 << WRITE_PARTS_POSTGRES.len()] =
        [const { std::sync::OnceLock::new() }; 1 << WRITE_PARTS_POSTGRES.len()];
    assert!(shape != 0 && usize::from(shape) < TEXTS.len(), "a group commit writes some rows");
    TEXTS[usize::from(shape)].get_or_init(|| {
        let present: Vec<&WritePart> = WRITE_PARTS_POSTGRES
            .iter()
            .enumerate()
            .filter(|(bit, _)| shape & (1 << bit) != 0)
            .map(|(_, part)| part)
            .collect();
        let mut next = 2;
        let parts: Vec<String> = present
            .iter()
            .map(|part| {
                let mut text = part.text.replace("{now}", "$1");
                // From the highest, so that {1} is not read inside {11}.
                for k in (1..=part.arrays).rev() {
                    text = text.replace(&format!("{{{k}}}"), &format!("${}", next + k - 1));
                }
                next += part.arrays;
                format!("{} AS ({text})", part.name)
            })
            .collect();
        // PostgreSQL runs each part when the query first reads it, so in the order of `counts`:
        // the UPDATEs of orders, then of accounts, then the INSERTs (the records' first), as a
        // locked batch takes its row locks (orders, accounts), then claims its records, then
        // inserts. A write without row locks whose INSERT took a key first would wait for a
        // locked batch's order while that batch waits for the key: a deadlock, broken only
        // after `deadlock_timeout`.
        let mut run_order: Vec<usize> = (0..present.len()).collect();
        run_order.sort_by_key(|index| match present[*index].name {
            "o" | "t" => 0,
            "a" => 1,
            "c" => 2,
            _ => 3,
        });
        let counts: Vec<String> =
            run_order.iter().map(|index| format!("(SELECT COUNT(*) FROM {})", present[*index].name)).collect();
        // Each part's count, in part order.
        let columns: Vec<String> = (0..present.len())
            .map(|index| {
                let position = run_order.iter().position(|run| *run == index).expect("every part runs") + 1;
                format!("written.counts[{position}]")
            })
            .collect();
        // The check reads the parts' results, so it is run, never folded away as a constant.
        // `written` is MATERIALIZED: referenced once, PostgreSQL would otherwise inline it into
        // every `written.counts[i]` below, and each inlined copy runs one subquery a part: for a
        // Pay's four parts 32 subplans, each an aggregate over a CTE scan set up at every
        // execution, instead of four.
        format!(
            "WITH {}, written AS MATERIALIZED (SELECT ARRAY[{}] AS counts) SELECT {}, \
             CAST(CASE WHEN ARRAY[{}] = ${next}::bigint[] THEN '0' ELSE '{WRITE_MISSED}' END AS integer) \
             FROM written",
            parts.join(", "),
            counts.join(", "),
            columns.join(", "),
            columns.join(", "),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn postgres_arrays_quote_every_string_and_escape_quotes_and_backslashes() {
        let rows = [
            [Value::Text("a"), Value::Int(-5)],
            [Value::Text("NULL"), Value::Int(7)],
            [Value::Text("x,\"y\"\\ {z}"), Value::Int(i64::MAX)],
        ];
        assert_eq!(
            bind_rows(Dialect::Postgres, &rows),
            [r#"{"a","NULL","x,\"y\"\\ {z}"}"#.to_owned(), format!("{{-5,7,{}}}", i64::MAX)]
        );
    }

    #[test]
    fn json_rows_keep_integers_exact_and_strings_escaped() {
        let rows = [[Value::Text("m\"1"), Value::Int(i64::MIN)]];
        let expected = format!(r#"[["m\"1",{}]]"#, i64::MIN);
        assert_eq!(bind_rows(Dialect::MySql, &rows), bind_rows(Dialect::Sqlite, &rows));
        assert_eq!(bind_rows(Dialect::MySql, &rows), [expected]);
    }

    #[test]
    fn a_batch_of_one_kind_runs_its_parts_and_a_mixed_batch_all_of_them() {
        // p o a e r t x d w n c
        let pays = [2, 2, 4, 4, 0, 0, 0, 0, 0, 0, 0];
        assert_eq!(postgres_write_shape(&pays), 0b1111);
        let keyed_pay = [1, 1, 2, 2, 0, 0, 0, 0, 0, 0, 1];
        assert_eq!(postgres_write_shape(&keyed_pay), 0b100_0000_1111);
        let refunds = [0, 0, 2, 2, 1, 1, 0, 0, 0, 0, 0];
        assert_eq!(postgres_write_shape(&refunds), 0b11_1100);
        let orders = [0, 0, 0, 0, 0, 0, 0, 0, 0, 3, 0];
        assert_eq!(postgres_write_shape(&orders), 1 << 9);
        let mixed = [1, 1, 3, 4, 0, 0, 1, 0, 0, 0, 0];
        assert_eq!(postgres_write_shape(&mixed), (1 << 10) - 1);
        assert_eq!(postgres_write_shape(&[0; 11]), 0);
        let postings_alone = [0, 0, 2, 2, 0, 0, 0, 0, 0, 0, 0];
        assert_eq!(postgres_write_shape(&postings_alone), (1 << 10) - 1);
        let records_alone = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];
        assert_eq!(postgres_write_shape(&records_alone), (1 << 11) - 1, "nothing given is left out");
        let keyed = write_batch_postgres(0b100_0000_1111);
        assert!(keyed.contains("c AS (INSERT INTO idempotency_record") && keyed.contains("$47::bigint[]"), "{keyed}");
        // The records claimed after the locks' UPDATEs and before the other INSERTs.
        assert!(keyed.contains("ARRAY[(SELECT COUNT(*) FROM o), (SELECT COUNT(*) FROM a), (SELECT COUNT(*) FROM c), (SELECT COUNT(*) FROM p), (SELECT COUNT(*) FROM e)]"), "{keyed}");
        let text = write_batch_postgres(0b1111);
        assert!(text.contains("written AS MATERIALIZED (SELECT ARRAY["), "counted once: {text}");
        assert!(text.starts_with("WITH p AS (") && text.contains("e AS (") && !text.contains("r AS ("));
        assert!(text.contains("$35::bigint[]") && !text.contains("$36") && !text.contains('{'), "{text}");
        // Run in lock order: the order's UPDATE, the accounts', then the INSERTs; answered in
        // part order.
        assert!(text.contains("ARRAY[(SELECT COUNT(*) FROM o), (SELECT COUNT(*) FROM a), (SELECT COUNT(*) FROM p), (SELECT COUNT(*) FROM e)]"), "{text}");
        assert!(
            text.contains("SELECT written.counts[3], written.counts[1], written.counts[2], written.counts[4], "),
            "{text}"
        );
    }

    #[test]
    fn no_statement_has_more_placeholders_than_its_backend_binds() {
        // MySQL: one JSON document, plus `updated_at` for the UPDATEs.
        let reads = [
            &FIND_PAYMENTS_AND_ORDERS,
            &FIND_REFUNDS,
            &FIND_ANSWERED_RECORDS,
            &LOCK_ORDERS,
            &LOCK_ACCOUNTS,
            &READ_ORDERS,
            &READ_ACCOUNTS,
            &FIND_ENTRIES,
        ]
        .map(|sql| (sql.mysql, sql.sqlite, 1))
        .into_iter()
        .chain([(FIND_FUNDINGS.mysql, FIND_FUNDINGS.sqlite, 2)]);
        let steps = [
            (&INSERT_PAYMENTS, 1),
            (&MARK_ORDERS_PAID, 2),
            (&CAS_BALANCES, 2),
            (&INSERT_ENTRIES, 1),
            (&INSERT_REFUNDS, 1),
            (&REFUND_ORDERS, 2),
            (&INSERT_TRANSFERS, 1),
            (&INSERT_DEPOSITS, 1),
            (&INSERT_WITHDRAWALS, 1),
            (&INSERT_ORDERS, 1),
        ]
        .map(|(sql, values)| (sql.mysql, sql.sqlite, values));
        for (mysql, sqlite, values) in reads.chain(steps) {
            assert_eq!(mysql.matches('?').count(), values, "{mysql}");
            assert!(
                sqlite.contains(&format!("?{values}")) && !sqlite.contains(&format!("?{}", values + 1)),
                "{sqlite}"
            );
        }
        assert_eq!(COMPLETE_RECORDS.mysql.matches('?').count(), 1);
        assert!(COMPLETE_RECORDS.postgres.contains("$4") && !COMPLETE_RECORDS.postgres.contains("$5"));
        let every_part = write_batch_postgres((1 << WRITE_PARTS_POSTGRES.len()) - 1);
        assert!(every_part.contains("$97::bigint[]") && !every_part.contains("$98") && !every_part.contains('{'));
        assert!(CLAIM_RECORDS.postgres.contains("$12::bigint[]") && !CLAIM_RECORDS.postgres.contains("$13"));
        assert!(CLAIM_RECORDS.postgres.ends_with("RETURNING scope, idempotency_key"));
        assert!(FIND_FUNDINGS.postgres.contains("$2") && !FIND_FUNDINGS.postgres.contains("$3"));
    }
}
