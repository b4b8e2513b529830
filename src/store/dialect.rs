//! What differs between the three backends, kept in one place: connection set-up, the
//! isolation level, how a write transaction begins, how SQL text is rendered, and which
//! driver errors are transient.

use std::sync::OnceLock;
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
    /// when `create` (on `serve`'s first start) unless the URL chooses a `mode` itself.
    pub(super) fn driver_url(self, url: &str, create: bool) -> String {
        match self {
            Dialect::MySql => match url.strip_prefix("mariadb:") {
                Some(rest) => format!("mysql:{rest}"),
                None => url.to_owned(),
            },
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
    ///   it, so a version CAS that lost re-reads the winner's row. A session left idle
    ///   inside a transaction is ended by the server (`idle_in_transaction_session_timeout`).
    /// - MySQL/MariaDB default to REPEATABLE READ, where a plain re-read inside the
    ///   transaction returns the old snapshot and a CAS retry loop would spin on a stale
    ///   version; we choose READ COMMITTED (MySQL manual, "Transaction Isolation Levels").
    ///   Strict mode turns data errors into errors instead of warnings. InnoDB's lock wait
    ///   timeout has whole seconds.
    /// - SQLite: WAL so readers never block the writer, a busy timeout for writers in other
    ///   processes, foreign keys on, and full fsync at commit (WAL + synchronous=FULL is
    ///   durable).
    pub(super) fn session_setup(self, lock_timeout: Duration) -> Vec<String> {
        let millis = lock_timeout.as_millis().max(1);
        match self {
            Dialect::Postgres => vec![
                // Set, not assumed: a database default of SERIALIZABLE would turn lock waits
                // into serialization failures.
                "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED".to_owned(),
                "SET idle_in_transaction_session_timeout = '60s'".to_owned(),
                format!("SET lock_timeout = '{millis}ms'"),
            ],
            Dialect::MySql => vec![
                "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED".to_owned(),
                format!("SET SESSION innodb_lock_wait_timeout = {}", millis.div_ceil(1000)),
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

    /// How a write transaction begins. SQLite's plain BEGIN is deferred: a transaction
    /// that reads first and writes later must upgrade its lock, and two such writers fail
    /// with SQLITE_BUSY instead of waiting. BEGIN IMMEDIATE takes the write lock up front.
    pub(super) fn begin_statement(self) -> &'static str {
        match self {
            Dialect::Sqlite => "BEGIN IMMEDIATE",
            Dialect::Postgres | Dialect::MySql => "BEGIN",
        }
    }
}

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

/// Classifies a sqlx error by driver error code, never by message text.
///
/// Sources: PostgreSQL Appendix A (40P01 deadlock_detected, 40001 serialization_failure,
/// 55P03 lock_not_available; classes 08, 28, 3D, 53 and 57 at connection time or by an
/// operator);
/// MySQL server error reference (1213 ER_LOCK_DEADLOCK; 1205 ER_LOCK_WAIT_TIMEOUT, which
/// rolls back only the statement, so the whole transaction is rolled back; 1927
/// ER_CONNECTION_KILLED, 1053 ER_SERVER_SHUTDOWN); SQLite result codes (5 BUSY once the busy
/// timeout ran out, 6 LOCKED, 261 BUSY_RECOVERY, 517 BUSY_SNAPSHOT).
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
        return match mysql.number() {
            // Deadlock; a statement interrupted by KILL QUERY.
            1213 | 1317 => Fault::Transient,
            1205 => Fault::LockTimeout,
            // Connection killed, server shutting down, too many connections (server-wide or
            // for the user), access denied, unknown database: the database cannot serve now.
            1927 | 1053 | 1040 | 1226 | 1045 | 1049 => Fault::Unavailable,
            _ => Fault::Other,
        };
    }
    let code = error.code().unwrap_or_default();
    if error.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
        return match code.as_ref() {
            "5" => Fault::LockTimeout,
            "6" | "261" | "517" => Fault::Transient,
            _ => Fault::Other,
        };
    }
    match code.as_ref() {
        "40P01" | "40001" => Fault::Transient,
        "55P03" => Fault::LockTimeout,
        // Classes 08 connection exception, 57 operator intervention, 53 insufficient resources
        // (too many connections), 28 invalid authorization, 3D unknown database.
        code if ["08", "57", "53", "28", "3D"].iter().any(|class| code.starts_with(class)) => Fault::Unavailable,
        _ => Fault::Other,
    }
}

/// One SQL statement written once in portable text and rendered per backend on first use:
/// `?` placeholders become `$1, $2, ...` on PostgreSQL; a trailing `ON CONFLICT DO NOTHING`
/// is dropped on MySQL, where the insert instead fails with a duplicate-key error that
/// [`super::Queries`] reads as "the key is taken" (MySQL does not abort the transaction on
/// it, and has no `ON CONFLICT`; `INSERT IGNORE` would also hide data errors); and
/// `CAST(... AS BIGINT)` is spelled `AS SIGNED` on MySQL; a trailing `FOR UPDATE` is dropped
/// on SQLite, whose write transactions already exclude each other.
pub struct Sql {
    portable: &'static str,
    /// Replaces the portable text on MySQL where its grammar differs.
    mysql: Option<&'static str>,
    rendered: [OnceLock<String>; 3],
}

impl Sql {
    pub const fn new(portable: &'static str) -> Self {
        Self { portable, mysql: None, rendered: [OnceLock::new(), OnceLock::new(), OnceLock::new()] }
    }

    /// A statement whose MySQL form is written out separately.
    pub const fn with_mysql(portable: &'static str, mysql: &'static str) -> Self {
        Self { portable, mysql: Some(mysql), rendered: [OnceLock::new(), OnceLock::new(), OnceLock::new()] }
    }

    pub fn text(&self, dialect: Dialect) -> &str {
        let slot = match dialect {
            Dialect::Postgres => 0,
            Dialect::MySql => 1,
            Dialect::Sqlite => 2,
        };
        let source = match (dialect, self.mysql) {
            (Dialect::MySql, Some(mysql)) => mysql,
            _ => self.portable,
        };
        self.rendered[slot].get_or_init(|| render(source, dialect))
    }
}

/// Renders portable SQL text for `dialect` (see [`Sql`]); for statements built at run time.
pub(super) fn render(portable: &str, dialect: Dialect) -> String {
    match dialect {
        // SQLite has no row locks: a write transaction (BEGIN IMMEDIATE) holds the database.
        Dialect::Sqlite => portable.trim_end().trim_end_matches("FOR UPDATE").trim_end().to_owned(),
        Dialect::MySql => portable
            .trim_end()
            .trim_end_matches("ON CONFLICT DO NOTHING")
            .trim_end()
            .replace("AS BIGINT)", "AS SIGNED)"),
        Dialect::Postgres => {
            // FOR NO KEY UPDATE is the row lock a plain UPDATE takes: enough to order writers,
            // and it does not block foreign-key checks (PostgreSQL manual, "Row-Level Locks").
            let portable = portable.replace("FOR UPDATE", "FOR NO KEY UPDATE");
            let mut text = String::with_capacity(portable.len() + 16);
            let mut number = 0;
            for c in portable.chars() {
                if c == '?' {
                    number += 1;
                    text.push('$');
                    text.push_str(&number.to_string());
                } else {
                    text.push(c);
                }
            }
            text
        }
    }
}

/// The URL without its password, for messages and logs.
pub fn redacted(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else { return url.to_owned() };
    let rest = &url[scheme_end..];
    match (rest.find('@'), rest.find(':')) {
        (Some(at), Some(colon)) if colon < at => format!("{}{}:***{}", &url[..scheme_end], &rest[..colon], &rest[at..]),
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_left_out_of_messages() {
        assert_eq!(redacted("postgres://app:secret@db:5432/ledger"), "postgres://app:***@db:5432/ledger");
        assert_eq!(redacted("mysql://root@db/test"), "mysql://root@db/test");
        assert_eq!(redacted("sqlite:payledger.db"), "sqlite:payledger.db");
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
    fn postgres_gets_numbered_placeholders() {
        let sql = Sql::new("UPDATE t SET a = ? WHERE b = ? AND c = ?");
        assert_eq!(sql.text(Dialect::Postgres), "UPDATE t SET a = $1 WHERE b = $2 AND c = $3");
        assert_eq!(sql.text(Dialect::Sqlite), "UPDATE t SET a = ? WHERE b = ? AND c = ?");
    }

    #[test]
    fn mysql_drops_on_conflict_and_casts_to_signed() {
        let insert = Sql::new("INSERT INTO t (a) VALUES (?) ON CONFLICT DO NOTHING");
        assert_eq!(insert.text(Dialect::MySql), "INSERT INTO t (a) VALUES (?)");
        assert_eq!(insert.text(Dialect::Postgres), "INSERT INTO t (a) VALUES ($1) ON CONFLICT DO NOTHING");
        let sum = Sql::new("SELECT CAST(SUM(a) AS BIGINT) FROM t");
        assert_eq!(sum.text(Dialect::MySql), "SELECT CAST(SUM(a) AS SIGNED) FROM t");
    }

    #[test]
    fn row_locks_are_dropped_on_sqlite_and_weakened_on_postgres() {
        let sql = Sql::new("SELECT a FROM t WHERE b = ? FOR UPDATE");
        assert_eq!(sql.text(Dialect::Sqlite), "SELECT a FROM t WHERE b = ?");
        assert_eq!(sql.text(Dialect::MySql), "SELECT a FROM t WHERE b = ? FOR UPDATE");
        assert_eq!(sql.text(Dialect::Postgres), "SELECT a FROM t WHERE b = $1 FOR NO KEY UPDATE");
    }

    #[test]
    fn sqlite_file_is_created_unless_a_mode_is_given() {
        assert_eq!(Dialect::Sqlite.driver_url("sqlite:payledger.db", true), "sqlite:payledger.db?mode=rwc");
        assert_eq!(Dialect::Sqlite.driver_url("sqlite:payledger.db", false), "sqlite:payledger.db?mode=rw");
        assert_eq!(Dialect::Sqlite.driver_url("sqlite:x.db?mode=ro", true), "sqlite:x.db?mode=ro");
        assert_eq!(Dialect::MySql.driver_url("mariadb://root@h/test", true), "mysql://root@h/test");
    }
}
