//! What differs between the three backends, kept in one place: connection set-up, the
//! isolation level, how a write transaction begins, the form of a statement each one takes
//! ([`Sql`]), and which driver errors are transient.

use std::time::Duration;

use sqlx::error::DatabaseError;

/// The database behind a `DATABASE_URL`, picked by its scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dialect {
    Postgres,
    MySql,
    Sqlite,
}

impl Dialect {
    /// Picks the backend from the URL scheme: `postgres://` or `postgresql://`,
    /// `mysql://` or `mariadb://`, `sqlite:`.
    pub fn from_url(url: &str) -> Option<Self> {
        let scheme = url.split(':').next()?;
        match scheme {
            "postgres" | "postgresql" => Some(Dialect::Postgres),
            "mysql" | "mariadb" => Some(Dialect::MySql),
            "sqlite" => Some(Dialect::Sqlite),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dialect::Postgres => "postgres",
            Dialect::MySql => "mysql",
            Dialect::Sqlite => "sqlite",
        }
    }

    /// The URL handed to sqlx: `mariadb://` becomes `mysql://`; a SQLite file is created
    /// when `create` (on `serve`'s first start) unless the URL chooses a `mode` itself, and
    /// never otherwise (`audit`), whatever mode the URL asks for.
    pub fn driver_url(self, url: &str, create: bool) -> String {
        match self {
            Dialect::MySql => match url.strip_prefix("mariadb:") {
                Some(rest) => format!("mysql:{rest}"),
                None => url.to_owned(),
            },
            // Never create: the URL's own options are dropped and the file opened read-write.
            Dialect::Sqlite if !create => {
                let path = url.split_once('?').map_or(url, |(path, _)| path);
                format!("{path}?mode=rw")
            }
            Dialect::Sqlite if !url.contains("mode=") => {
                let separator = if url.contains('?') { '&' } else { '?' };
                let mode = if create { "rwc" } else { "rw" };
                format!("{url}{separator}mode={mode}")
            }
            _ => url.to_owned(),
        }
    }

    /// Statements run on every new connection; `lock_timeout` bounds every row-lock wait
    /// (including a request waiting for an in-flight duplicate of its key).
    ///
    /// - PostgreSQL: READ COMMITTED, set explicitly: each statement sees what committed before
    ///   it, so a key read after a row-lock wait sees what the lock's holder committed. A
    ///   session left idle inside a transaction is ended by the server
    ///   (`idle_in_transaction_session_timeout`).
    /// - MySQL/MariaDB default to REPEATABLE READ, where a plain read inside the transaction
    ///   returns the snapshot of its first read, from before any row-lock wait; we choose READ
    ///   COMMITTED (MySQL manual, "Transaction Isolation Levels").
    ///   Strict mode turns data errors into errors instead of warnings. InnoDB's lock wait
    ///   timeout has whole seconds.
    /// - On a MariaDB Galera node (`galera`), `wsrep_sync_wait = 0`, whatever the server's
    ///   default: the causal wait is made once per transaction or read, when its connection
    ///   is taken from the pool ([`GALERA_CAUSAL_WAIT`]), never by a statement inside a write
    ///   transaction. And the session is READ ONLY outside its write transactions (which
    ///   begin as [`GALERA_BEGIN`] says), so that a write sent outside them by mistake is
    ///   refused rather than committed alone.
    /// - SQLite: WAL so readers never block the writer, a busy timeout for writers in other
    ///   processes, foreign keys on, and full fsync at commit (WAL + synchronous=FULL is
    ///   durable).
    ///
    /// Why READ COMMITTED with row locks, not SERIALIZABLE: `docs/decisions/002-read-committed-with-row-locks.md`.
    pub(super) fn session_setup(self, lock_timeout: Duration, galera: bool) -> Vec<String> {
        let millis = lock_timeout.as_millis().max(1);
        let mut statements = self.plain_session_setup(millis);
        if galera {
            statements.push("SET SESSION wsrep_sync_wait = 0".to_owned());
            statements.push("SET SESSION TRANSACTION READ ONLY".to_owned());
        }
        statements
    }

    fn plain_session_setup(self, millis: u128) -> Vec<String> {
        match self {
            Dialect::Postgres => vec![
                // Set, not assumed: a database default of SERIALIZABLE would turn lock waits
                // into serialization failures.
                "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED".to_owned(),
                "SET idle_in_transaction_session_timeout = '60s'".to_owned(),
                format!("SET lock_timeout = '{millis}ms'"),
                // Every hot statement finds its rows by a primary or unique key: planning it
                // again at each execution (custom plans) cost more than running it. Each
                // connection makes one generic plan per statement and keeps it; the pool
                // replaces its connections after `PoolSettings::plan_lifetime`, so a plan made
                // while a table was small does not outlive the table's growth for long
                // (docs/decisions/001-generic-plans.md).
                "SET plan_cache_mode = force_generic_plan".to_owned(),
            ],
            Dialect::MySql => vec![
                "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED".to_owned(),
                format!("SET SESSION innodb_lock_wait_timeout = {}", millis.div_ceil(1000)),
                // Table, metadata and backup locks (LOCK TABLES, DDL, FLUSH TABLES WITH READ
                // LOCK) wait under lock_wait_timeout, a day by default: bound them alike.
                format!("SET SESSION lock_wait_timeout = {}", millis.div_ceil(1000)),
                "SET SESSION sql_mode = CONCAT(@@sql_mode, ',STRICT_ALL_TABLES')".to_owned(),
            ],
            Dialect::Sqlite => vec![
                "PRAGMA journal_mode = WAL".to_owned(),
                format!("PRAGMA busy_timeout = {millis}"),
                "PRAGMA foreign_keys = ON".to_owned(),
                "PRAGMA synchronous = FULL".to_owned(),
            ],
        }
    }

    /// The health check's write (see `Store::check_health`), `None` on SQLite: an UPDATE of
    /// no row, which the database refuses exactly when it refuses writes, after a bound of
    /// `lock_wait` (whole seconds on MySQL) on its wait for the table's lock. Each statement
    /// runs on a session of its own, discarded after the check, so the bound is set for the
    /// session.
    ///
    /// - The table is sqlx's migration history, which every instance reads at start: no call
    ///   touches it, and no migration takes a lock on it that conflicts (a migration altering
    ///   `accounts` would hold up an UPDATE of `accounts` until it commits).
    /// - `WHERE 1 = 0` is false before any row is read: no row is locked, no transaction id is
    ///   assigned and nothing reaches the WAL (PostgreSQL), no InnoDB transaction starts, the
    ///   binary log gets no event, whatever `binlog_format`, and Galera no write set (an
    ///   UPDATE that matches a row and changes nothing is still logged under
    ///   `binlog_format=STATEMENT`).
    /// - PostgreSQL refuses it with SQLSTATE 25006 (read_only_sql_transaction) at executor
    ///   start in a read-only transaction: `default_transaction_read_only` on, and every
    ///   transaction of a standby in recovery (PostgreSQL manual, "Hot Standby").
    /// - MySQL and MariaDB refuse it with error 1290 (ER_OPTION_PREVENTS_STATEMENT) under
    ///   `read_only` (and MySQL's `super_read_only`) unless the user is exempt (SUPER, or
    ///   MariaDB's READ_ONLY ADMIN), whose writes then do succeed; MariaDB refuses it before
    ///   taking any lock.
    ///
    /// SQLite runs none: an UPDATE there takes the database's write lock, so it would wait
    /// behind every write transaction, and a file opened read-write stays writable.
    pub(super) fn write_check(self, lock_wait: Duration) -> Option<String> {
        const WRITE: &str = "UPDATE _sqlx_migrations SET version = version WHERE 1 = 0";
        let millis = lock_wait.as_millis().max(1);
        match self {
            Dialect::Postgres => Some(format!("SET lock_timeout = '{millis}ms'; {WRITE}")),
            Dialect::MySql => Some(format!("SET SESSION lock_wait_timeout = {}; {WRITE}", millis.div_ceil(1000))),
            Dialect::Sqlite => None,
        }
    }

    /// The OpenTelemetry `db.system.name` of the backend.
    pub fn system_name(self) -> &'static str {
        match self {
            Dialect::Postgres => "postgresql",
            Dialect::MySql => "mysql",
            Dialect::Sqlite => "sqlite",
        }
    }

    /// How a write transaction begins. SQLite's plain BEGIN is deferred: a transaction
    /// that reads first and writes later must upgrade its lock, and two such writers fail
    /// with SQLITE_BUSY instead of waiting. BEGIN IMMEDIATE takes the write lock up front.
    pub(super) fn begin_statement(self) -> &'static str {
        match self {
            Dialect::Sqlite => "BEGIN IMMEDIATE",
            Dialect::Postgres | Dialect::MySql => "BEGIN",
        }
    }

    /// How a read of several rows at one moment begins: the statement to run first, if any,
    /// and the one that begins a read-only transaction whose every read sees one snapshot.
    /// - PostgreSQL: REPEATABLE READ, READ ONLY: one snapshot from the transaction's first
    ///   statement to its end; a read-only transaction never fails to serialize (PostgreSQL
    ///   manual, 13.2.2).
    /// - MySQL/MariaDB: the session's READ COMMITTED gives each statement a read view of its
    ///   own, so this transaction alone is REPEATABLE READ (`SET TRANSACTION` applies to the
    ///   next transaction only), begun `WITH CONSISTENT SNAPSHOT`: InnoDB's read view is taken
    ///   at START TRANSACTION (MariaDB manual, "START TRANSACTION").
    /// - SQLite: a deferred BEGIN; in WAL mode a read transaction's first read fixes the
    ///   snapshot it sees until it ends (SQLite manual, "Write-Ahead Logging", 2.2).
    pub(super) fn snapshot_statements(self) -> (Option<&'static str>, &'static str) {
        match self {
            Dialect::Postgres => (None, "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY"),
            Dialect::MySql => (
                Some("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"),
                "START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY",
            ),
            Dialect::Sqlite => (None, "BEGIN"),
        }
    }
}

/// The causal wait of a Galera node, run on a connection when it is taken from the pool for
/// a write transaction or a read (after `autocommit` is set back to 1, which a write
/// transaction turns off, see [`GALERA_BEGIN`]): it returns once the node has applied every write set the
/// cluster had committed when it was sent (a causality check through group communication),
/// so what follows sees every write acknowledged through any node: a Query through one node
/// sees a Pay acknowledged through another, a Pay finds the order created through another,
/// and a key found taken is readable (MariaDB manual, "wsrep_sync_wait").
///
/// Once, before the transaction holds any lock, rather than `wsrep_sync_wait` on every read,
/// which costs a round among the nodes per read and, inside a write transaction, widens the
/// window in which the cluster can abort it (see [`GALERA_BEGIN`]). Writes inside the
/// transaction need no wait: one that raced a write applied elsewhere fails certification at
/// commit (error 1213) and the whole transaction runs again; reads inside it see what
/// committed before they began on this node, as on a single server under READ COMMITTED.
pub const GALERA_CAUSAL_WAIT: &str = "SET SESSION autocommit = 1; SET STATEMENT wsrep_sync_wait = 1 FOR SELECT 1";

/// How a write transaction begins on a Galera node: with `autocommit` off, then a
/// [`GALERA_TRANSACTION_MARK`] savepoint, which only this transaction has.
///
/// A node that applies a conflicting write set aborts the local transaction that holds the
/// rows ("brute force" abort) and reports it as a deadlock (1213) on the transaction's next
/// statement; but a statement running at that moment can report success with its effect
/// already rolled back (seen here on MariaDB 10.11 and galera-4 26.4 under Deposits through
/// three nodes: the transaction's own journal entries were gone and `@@in_transaction` was
/// 0, with no error). Statements after the abort run outside the transaction; with
/// `autocommit` on, each write among them would commit alone (and a READ ONLY session does
/// not stop them until the next COMMIT or ROLLBACK). With it off, they open a new implicit
/// transaction that nothing commits: before every COMMIT, and before any other outcome of the
/// body is believed, `crate::store::Tx::still_open` releases the savepoint, which exists only
/// in the transaction that began here; if it is gone, the whole transaction (and whatever
/// the implicit one holds) rolls back and runs again.
pub const GALERA_BEGIN: &str =
    "SET SESSION autocommit = 0; START TRANSACTION READ WRITE; SAVEPOINT payledger_transaction";

/// The savepoint that [`GALERA_BEGIN`] sets, released just before COMMIT.
pub const GALERA_TRANSACTION_MARK: &str = "RELEASE SAVEPOINT payledger_transaction";

/// MySQL's ER_SP_DOES_NOT_EXIST: no such savepoint in this transaction.
pub const SAVEPOINT_DOES_NOT_EXIST: u16 = 1305;

/// The fault class of a database error, which decides retry and status code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The database cannot be reached or the pool is exhausted: UNAVAILABLE.
    Unavailable,
    /// A deadlock or serialization failure: the whole transaction was (or must be) rolled
    /// back and can run again from BEGIN.
    Transient,
    /// A lock wait ran out of time (another transaction holds the row or key for long):
    /// not retried here, the caller gets ABORTED and may retry with the same key.
    LockTimeout,
    /// Anything else: a bug or a broken schema. INTERNAL.
    Other,
}

/// Classifies a sqlx error by driver error code, never by message text, and by kind: every
/// state of the database that can pass without the caller changing its request (a lost or
/// refused connection, read-only mode, a full disk, a server shutting down, a cluster node
/// not ready or without quorum, a lock wait or statement timeout, a deadlock or
/// serialization failure) is retryable; only what no retry can fix (a bug, a broken schema,
/// corrupted data) is [`Fault::Other`], answered INTERNAL.
/// Whether `error` says a table does not exist: PostgreSQL's SQLSTATE 42P01
/// (undefined_table), MySQL/MariaDB's 42S02 (ER_NO_SUCH_TABLE, 1146), SQLite's "no such
/// table" (its result code 1 carries no finer one).
pub fn is_missing_table(error: &sqlx::Error) -> bool {
    let sqlx::Error::Database(database_error) = error else { return false };
    matches!(database_error.code().as_deref(), Some("42P01" | "42S02"))
        || database_error.message().starts_with("no such table")
}

pub fn classify(error: &sqlx::Error) -> Fault {
    match error {
        sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::WorkerCrashed => Fault::Unavailable,
        sqlx::Error::Database(database_error) => classify_database_error(database_error.as_ref()),
        _ => Fault::Other,
    }
}

fn classify_database_error(error: &dyn DatabaseError) -> Fault {
    if let Some(mysql) = error.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        return classify_mysql(mysql.number(), mysql.code());
    }
    let code = error.code().unwrap_or_default();
    if error.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
        return code.parse().map_or(Fault::Other, classify_sqlite);
    }
    classify_postgres(&code)
}

/// The kind of a transient conflict ([`Fault::Transient`]), for metrics: `deadlock`,
/// `serialization`, `busy` (SQLite), `interrupted` (MySQL) or `other`.
pub fn conflict_cause(error: &sqlx::Error) -> &'static str {
    let sqlx::Error::Database(database_error) = error else { return "other" };
    if let Some(mysql) = database_error.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        return match mysql.number() {
            1213 | 1467 => "deadlock",
            1317 => "interrupted",
            _ if mysql.code() == Some("40001") => "serialization",
            _ => "other",
        };
    }
    let code = database_error.code().unwrap_or_default();
    if database_error.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
        return "busy";
    }
    match code.as_ref() {
        "40P01" => "deadlock",
        "40001" | "72000" => "serialization",
        _ => "other",
    }
}

/// PostgreSQL, by SQLSTATE (PostgreSQL manual, Appendix A "PostgreSQL Error Codes").
fn classify_postgres(sqlstate: &str) -> Fault {
    match sqlstate {
        // serialization_failure, deadlock_detected, snapshot_too_old: run the transaction again.
        "40001" | "40P01" | "72000" => Fault::Transient,
        // lock_not_available (lock_timeout), query_canceled (statement_timeout or a cancel).
        "55P03" | "57014" => Fault::LockTimeout,
        // object_not_in_prerequisite_state: what a database closed to connections answers
        // (ALTER DATABASE ... ALLOW_CONNECTIONS false); payledger's statements raise it for
        // nothing else.
        "55000" => Fault::Unavailable,
        // read_only_sql_transaction (default_transaction_read_only, a hot standby, a failover
        // under way), idle_in_transaction_session_timeout, statement_completion_unknown (the
        // commit's outcome is unknown: the retry replays it or runs it).
        "25006" | "25P03" | "40003" => Fault::Unavailable,
        // Classes 08 connection exception, 28 invalid authorization, 3D unknown database,
        // 53 insufficient resources (disk full, out of memory, too many connections),
        // 57 operator intervention (admin or crash shutdown, cannot connect now), 58 system
        // error (I/O).
        sqlstate if ["08", "28", "3D", "53", "57", "58"].iter().any(|class| sqlstate.starts_with(class)) => {
            Fault::Unavailable
        }
        _ => Fault::Other,
    }
}

/// MySQL and MariaDB, by error number (MySQL "Server Error Message Reference", MariaDB
/// "Error Codes"), then by SQLSTATE class for numbers not listed.
fn classify_mysql(number: u16, sqlstate: Option<&str>) -> Fault {
    match number {
        // ER_LOCK_DEADLOCK (also a Galera certification conflict), ER_QUERY_INTERRUPTED, and
        // ER_AUTOINC_READ_FAILED: InnoDB's answer when taking a table's AUTO-INC lock ended in
        // a deadlock or a lock wait timeout (an `INSERT ... SELECT` holds that lock to its end
        // under the default `innodb_autoinc_lock_mode = 1`, and may wait on a duplicate key
        // there); InnoDB rolls the transaction back (MariaDB MDEV-33593).
        1213 | 1317 | 1467 => Fault::Transient,
        // ER_LOCK_WAIT_TIMEOUT (it rolls back only the statement, so the whole transaction is
        // rolled back), MariaDB max_statement_time, MySQL max_execution_time.
        1205 | 1969 | 3024 => Fault::LockTimeout,
        // Read-only: ER_OPTION_PREVENTS_STATEMENT (read_only), ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION,
        // ER_READ_ONLY_MODE.
        1290 | 1792 | 1836
        // Out of space or memory: ER_DISK_FULL, ER_RECORD_FILE_FULL, ER_OUT_OF_RESOURCES,
        // ER_OUTOFMEMORY, ER_OUT_OF_SORTMEMORY, ER_MAX_PREPARED_STMT_COUNT_REACHED.
        | 1021 | 1114 | 1041 | 1037 | 1038 | 1461
        // Galera: a node not ready or without quorum ("WSREP has not yet prepared node for
        // application use", ER_UNKNOWN_COM_ERROR), a commit refused (ER_ERROR_DURING_COMMIT).
        | 1047 | 1180
        // The connection or the server: ER_CONNECTION_KILLED, ER_SERVER_SHUTDOWN,
        // ER_CON_COUNT_ERROR, ER_USER_LIMIT_REACHED, ER_ACCESS_DENIED_ERROR, ER_BAD_DB_ERROR,
        // ER_CLIENT_INTERACTION_TIMEOUT, ER_NET_READ_ERROR and kin.
        | 1927 | 1053 | 1040 | 1226 | 1045 | 1049 | 4031 | 1158..=1161 => Fault::Unavailable,
        // SQLSTATE class 08, connection exception, is always transient; 40001 is serialization.
        _ if sqlstate.is_some_and(|sqlstate| sqlstate.starts_with("08")) => Fault::Unavailable,
        _ if sqlstate == Some("40001") => Fault::Transient,
        _ => Fault::Other,
    }
}

/// SQLite, by (extended) result code (SQLite documentation, "Result and Error Codes").
fn classify_sqlite(code: i32) -> Fault {
    match code {
        // SQLITE_BUSY_RECOVERY, SQLITE_BUSY_SNAPSHOT, SQLITE_LOCKED: run the transaction again.
        261 | 517 | 6 => Fault::Transient,
        // SQLITE_BUSY once the busy timeout ran out.
        5 => Fault::LockTimeout,
        // By primary code: SQLITE_NOMEM, SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL,
        // SQLITE_CANTOPEN, SQLITE_PROTOCOL.
        code if matches!(code & 0xff, 7 | 8 | 10 | 13 | 14 | 15) => Fault::Unavailable,
        _ => Fault::Other,
    }
}

/// One SQL statement as each backend takes it, written out for each: nothing rewrites SQL
/// text. The forms differ where the databases do:
/// - placeholders: `$1, $2, ...` on PostgreSQL, `?` on MySQL and SQLite;
/// - a row lock (`FOR UPDATE`): `FOR NO KEY UPDATE` on PostgreSQL, the lock a plain UPDATE
///   takes, enough to order writers without blocking foreign-key checks (PostgreSQL manual,
///   "Row-Level Locks"); none on SQLite, whose write transactions already exclude each other
///   (`BEGIN IMMEDIATE`); `SKIP LOCKED` needs MySQL 8.0.1 or MariaDB 10.6;
/// - an insert that may find its key taken: `ON CONFLICT DO NOTHING` on PostgreSQL and SQLite;
///   MySQL has no `ON CONFLICT` (and `INSERT IGNORE` would also hide data errors), so there
///   the insert fails with a duplicate-key error that [`super::Queries`] reads as "the key is
///   taken" (MySQL does not abort the transaction on it).
pub(super) struct Sql {
    pub(super) postgres: &'static str,
    pub(super) mysql: &'static str,
    pub(super) sqlite: &'static str,
}

impl Sql {
    /// A statement every backend takes as it is (no placeholders, nothing backend-specific).
    pub(super) const fn same(text: &'static str) -> Self {
        Self { postgres: text, mysql: text, sqlite: text }
    }

    /// A statement whose PostgreSQL form differs only in its numbered placeholders from the
    /// one MySQL and SQLite share.
    pub(super) const fn pair(postgres: &'static str, mysql_and_sqlite: &'static str) -> Self {
        Self { postgres, mysql: mysql_and_sqlite, sqlite: mysql_and_sqlite }
    }

    /// How many values a caller binds: the `?` placeholders of the MySQL form, which every
    /// form takes in the same order.
    pub(super) fn placeholders(&self) -> usize {
        self.mysql.matches('?').count()
    }

    pub(super) fn text(&self, dialect: Dialect) -> &'static str {
        match dialect {
            Dialect::Postgres => self.postgres,
            Dialect::MySql => self.mysql,
            Dialect::Sqlite => self.sqlite,
        }
    }
}

/// The URL without its secrets, for messages and logs: the userinfo's password, and every
/// query parameter whose name holds `password` (`password`, libpq's `sslpassword`, any case).
/// The authority ends at the first `/`, `?` or `#` after the scheme, and the userinfo at its
/// last `@` (as the WHATWG URL standard parses it), so a password holding `@` is hidden
/// whole.
pub fn redacted(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|index| index + 3) else { return redact_query(url) };
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let authority = match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _password)) => format!("{user}:***@{host}"),
            None => authority.to_owned(),
        },
        None => authority.to_owned(),
    };
    redact_query(&format!("{}{authority}{tail}", &url[..scheme_end]))
}

fn redact_query(url: &str) -> String {
    let Some((base, query)) = url.split_once('?') else { return url.to_owned() };
    let (query, fragment) = match query.split_once('#') {
        Some((query, fragment)) => (query, Some(fragment)),
        None => (query, None),
    };
    let parameters: Vec<String> = query
        .split('&')
        .map(|parameter| match parameter.split_once('=') {
            Some((name, _)) if name.to_ascii_lowercase().contains("password") => format!("{name}=***"),
            _ => parameter.to_owned(),
        })
        .collect();
    let fragment = fragment.map(|fragment| format!("#{fragment}")).unwrap_or_default();
    format!("{base}?{}{fragment}", parameters.join("&"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn postgres_states_that_pass_are_retryable_and_bugs_are_not() {
        for sqlstate in
            ["08006", "08001", "25006", "25P03", "40003", "53100", "53300", "55000", "57P01", "57P03", "58030", "28P01"]
        {
            assert_eq!(classify_postgres(sqlstate), Fault::Unavailable, "{sqlstate}");
        }
        for sqlstate in ["40001", "40P01", "72000"] {
            assert_eq!(classify_postgres(sqlstate), Fault::Transient, "{sqlstate}");
        }
        for sqlstate in ["55P03", "57014"] {
            assert_eq!(classify_postgres(sqlstate), Fault::LockTimeout, "{sqlstate}");
        }
        for sqlstate in ["42P01", "42703", "23502", "22003", "XX000", "XX001", ""] {
            assert_eq!(classify_postgres(sqlstate), Fault::Other, "{sqlstate}");
        }
    }

    #[test]
    fn mysql_states_that_pass_are_retryable_by_number_or_by_sqlstate_class() {
        for number in [1290, 1792, 1836, 1021, 1114, 1041, 1461, 1047, 1180, 1927, 1053, 1040, 1045, 1049, 4031, 1159] {
            assert_eq!(classify_mysql(number, Some("HY000")), Fault::Unavailable, "{number}");
        }
        assert_eq!(classify_mysql(1213, Some("40001")), Fault::Transient);
        assert_eq!(classify_mysql(1317, Some("70100")), Fault::Transient);
        assert_eq!(classify_mysql(1467, Some("HY000")), Fault::Transient, "a deadlock on the AUTO-INC lock");
        for number in [1205, 1969, 3024] {
            assert_eq!(classify_mysql(number, Some("HY000")), Fault::LockTimeout, "{number}");
        }
        assert_eq!(classify_mysql(9999, Some("08S01")), Fault::Unavailable, "class 08, whatever the number");
        assert_eq!(classify_mysql(9998, Some("40001")), Fault::Transient);
        for number in [1146, 1054, 1064, 1062, 1406, 1105] {
            assert_eq!(classify_mysql(number, Some("42S02")), Fault::Other, "{number}");
        }
    }

    #[test]
    fn sqlite_states_that_pass_are_retryable_by_primary_code() {
        assert_eq!(classify_sqlite(5), Fault::LockTimeout);
        for code in [6, 261, 517] {
            assert_eq!(classify_sqlite(code), Fault::Transient, "{code}");
        }
        // SQLITE_FULL, SQLITE_READONLY, SQLITE_READONLY_DBMOVED (1032), SQLITE_IOERR_WRITE (778),
        // SQLITE_IOERR_FSYNC (1034), SQLITE_CANTOPEN, SQLITE_NOMEM.
        for code in [13, 8, 1032, 778, 1034, 14, 7] {
            assert_eq!(classify_sqlite(code), Fault::Unavailable, "{code}");
        }
        // SQLITE_ERROR, SQLITE_CORRUPT, SQLITE_CONSTRAINT_UNIQUE (2067), SQLITE_NOTADB.
        for code in [1, 11, 2067, 26] {
            assert_eq!(classify_sqlite(code), Fault::Other, "{code}");
        }
    }

    #[test]
    fn passwords_are_left_out_of_messages() {
        assert_eq!(redacted("postgres://app:secret@db:5432/ledger"), "postgres://app:***@db:5432/ledger");
        assert_eq!(redacted("mysql://root@db/test"), "mysql://root@db/test");
        assert_eq!(redacted("sqlite:payledger.db"), "sqlite:payledger.db");
        assert_eq!(
            redacted("postgres://db/ledger?sslmode=require&password=secret"),
            "postgres://db/ledger?sslmode=require&password=***"
        );
        assert_eq!(redacted("redis://:secret@cache:6379"), "redis://:***@cache:6379");
        assert_eq!(redacted("postgres://app:SEC@RET@db:5432/x"), "postgres://app:***@db:5432/x");
        assert_eq!(
            redacted("postgres://db/x?sslmode=disable&PASSWORD=secret&sslpassword=secret#f"),
            "postgres://db/x?sslmode=disable&PASSWORD=***&sslpassword=***#f"
        );
        assert_eq!(redacted("mysql://root@db/test?ssl-mode=required"), "mysql://root@db/test?ssl-mode=required");
        for url in ["postgres://a:SEC@RET@h/x?password=SEC@RET", "postgres://a:S%40C@h/x?sslpassword=SECRET"] {
            assert!(!redacted(url).contains("SEC"), "{url} -> {}", redacted(url));
        }
    }

    #[test]
    fn url_scheme_picks_the_backend() {
        assert_eq!(Dialect::from_url("postgres://u@h/db"), Some(Dialect::Postgres));
        assert_eq!(Dialect::from_url("postgresql://u@h/db"), Some(Dialect::Postgres));
        assert_eq!(Dialect::from_url("mysql://root@h/test"), Some(Dialect::MySql));
        assert_eq!(Dialect::from_url("mariadb://root@h/test"), Some(Dialect::MySql));
        assert_eq!(Dialect::from_url("sqlite:payledger.db"), Some(Dialect::Sqlite));
        assert_eq!(Dialect::from_url("redis://h"), None);
    }

    #[test]
    fn sqlite_file_is_created_unless_a_mode_is_given() {
        assert_eq!(Dialect::Sqlite.driver_url("sqlite:payledger.db", true), "sqlite:payledger.db?mode=rwc");
        assert_eq!(Dialect::Sqlite.driver_url("sqlite:payledger.db", false), "sqlite:payledger.db?mode=rw");
        assert_eq!(Dialect::Sqlite.driver_url("sqlite:x.db?mode=ro", true), "sqlite:x.db?mode=ro");
        assert_eq!(Dialect::Sqlite.driver_url("sqlite:x.db?mode=rwc", false), "sqlite:x.db?mode=rw");
        assert_eq!(Dialect::Sqlite.driver_url("sqlite:x.db?m%6Fde=rwc", false), "sqlite:x.db?mode=rw");
        assert_eq!(Dialect::Sqlite.driver_url("sqlite:/d/mode=rwc", false), "sqlite:/d/mode=rwc?mode=rw");
        assert_eq!(Dialect::MySql.driver_url("mariadb://root@h/test", true), "mysql://root@h/test");
    }
}
