//! Applying the embedded migrations on MySQL/MariaDB, where DDL is not transactional: each
//! schema statement commits on its own (MySQL manual, 15.3.3 "Statements That Cause an
//! Implicit Commit"), so a start killed part way through a migration leaves it partly
//! applied. sqlx's migrator then refuses every later start ("migration N is partially
//! applied") until a person repairs the database. This runner completes such a migration
//! instead, and keeps sqlx's `_sqlx_migrations` history table exactly as sqlx writes it
//! (same columns, versions and checksums), so releases that migrate with sqlx read it too.
//!
//! A migration is applied as:
//! 1. its history row, `success = FALSE`, committed first (what sqlx writes too: a row left
//!    so means "begun, maybe partly applied");
//! 2. its schema statements one by one (CREATE, ALTER, DROP, RENAME, TRUNCATE), each
//!    committing on its own;
//! 3. its data statements (INSERT, UPDATE, DELETE, REPLACE), which must all come after the
//!    schema statements, in one transaction with the row's `success = TRUE`.
//!
//! A migration found begun (`success = FALSE`, the same checksum) is applied again from its
//! first statement: a schema statement that fails because its change is already there
//! (the table, column or index exists, or what it drops is gone) is taken as done. Its data
//! statements never committed if this runner began it; sqlx's migrator (releases before this
//! runner) committed each on its own, so an INSERT that finds its rows there (a duplicate
//! key) is taken as done too. A data statement must therefore be one that a second run
//! either repeats harmlessly or refuses with a duplicate key.
//!
//! On a Galera cluster MySQL's named lock (`GET_LOCK`) holds on one node only: one instance
//! migrates under a lease row that all nodes see ([`claim_lease`]), renewed while it
//! migrates, so that a lease of an instance that died is free again within
//! [`LEASE_SECONDS`].

use std::time::{Duration, Instant};

use sqlx::migrate::{MigrateError, Migration, Migrator};
use sqlx::{AnyConnection, ConnectOptions, Connection, Executor};

/// sqlx's history table, as sqlx-mysql 0.8 creates it.
const HISTORY_TABLE: &str = "CREATE TABLE IF NOT EXISTS _sqlx_migrations ( \
     version BIGINT PRIMARY KEY, \
     description TEXT NOT NULL, \
     installed_on TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP, \
     success BOOLEAN NOT NULL, \
     checksum BLOB NOT NULL, \
     execution_time BIGINT NOT NULL)";

/// MySQL/MariaDB error numbers of a schema statement whose change is already there, taken as
/// done when a begun migration is applied again (MySQL manual, "Server Error Message
/// Reference"): ER_TABLE_EXISTS_ERROR (1050), ER_DUP_FIELDNAME (1060), ER_DUP_KEYNAME
/// (1061), ER_CANT_DROP_FIELD_OR_KEY (1091), ER_BAD_TABLE_ERROR (1051, a dropped table),
/// ER_FK_DUP_NAME (1826).
const ALREADY_DONE: [u16; 6] = [1050, 1051, 1060, 1061, 1091, 1826];

/// ER_DUP_ENTRY: a data statement of a begun migration that inserts rows already there.
const DUPLICATE_ENTRY: u16 = 1062;

/// What a statement of a migration is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StatementKind {
    /// DDL: commits on its own; applied again, it fails if its change is there already.
    Schema,
    /// DML: runs in the migration's closing transaction.
    Data,
}

/// One statement of a migration's SQL text, and its kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Statement<'a> {
    pub(crate) sql: &'a str,
    pub(crate) kind: StatementKind,
}

/// Splits a migration's SQL text into its statements at each `;` outside quotes (`'`, `"`,
/// `` ` ``, with backslash escapes) and comments (`-- `, `#`, `/* */`). Each statement is
/// its text from its first word; pieces with nothing but comments and white space are left
/// out.
///
/// # Errors
/// The first word of a statement that is neither a schema nor a data statement, or a data
/// statement followed by a schema statement (which could not share its transaction).
pub(crate) fn statements(sql: &str) -> Result<Vec<Statement<'_>>, String> {
    let mut pieces = Vec::new();
    let bytes = sql.as_bytes();
    let (mut start, mut at) = (0, 0);
    while at < bytes.len() {
        match bytes[at] {
            quote @ (b'\'' | b'"' | b'`') => {
                at += 1;
                while at < bytes.len() && bytes[at] != quote {
                    at += if bytes[at] == b'\\' && quote != b'`' { 2 } else { 1 };
                }
            }
            b'-' if bytes[at..].starts_with(b"-- ") || bytes[at..].starts_with(b"--\n") => {
                at = sql[at..].find('\n').map_or(bytes.len(), |end| at + end);
            }
            b'#' => at = sql[at..].find('\n').map_or(bytes.len(), |end| at + end),
            b'/' if bytes[at..].starts_with(b"/*") => {
                at = sql[at + 2..].find("*/").map_or(bytes.len(), |end| at + 2 + end + 1);
            }
            b';' => {
                pieces.push(&sql[start..at]);
                start = at + 1;
            }
            _ => {}
        }
        at += 1;
    }
    pieces.push(&sql[start.min(sql.len())..]);

    let mut statements = Vec::new();
    for piece in pieces {
        let Some(from) = first_word(piece) else { continue };
        let word =
            &piece[from..from + piece[from..].find(|c: char| !c.is_ascii_alphabetic()).unwrap_or(piece.len() - from)];
        let kind = match word.to_ascii_uppercase().as_str() {
            "CREATE" | "ALTER" | "DROP" | "RENAME" | "TRUNCATE" => StatementKind::Schema,
            "INSERT" | "UPDATE" | "DELETE" | "REPLACE" => StatementKind::Data,
            _ => return Err(format!("a statement beginning with {word:?} is neither a schema nor a data statement")),
        };
        if kind == StatementKind::Schema
            && statements.iter().any(|statement: &Statement| statement.kind == StatementKind::Data)
        {
            return Err("a schema statement follows a data statement".to_owned());
        }
        statements.push(Statement { sql: piece[from..].trim_end(), kind });
    }
    Ok(statements)
}

/// Where the first word of `piece` begins, after white space and comments; `None` when it
/// has none.
fn first_word(piece: &str) -> Option<usize> {
    let mut rest = piece.trim_start();
    loop {
        if rest.starts_with("--") || rest.starts_with('#') {
            rest = rest.find('\n').map_or("", |end| &rest[end..]).trim_start();
        } else if let Some(after) = rest.strip_prefix("/*") {
            rest = after.find("*/").map_or("", |end| &after[end + 2..]).trim_start();
        } else {
            break;
        }
    }
    rest.starts_with(|c: char| c.is_ascii_alphabetic()).then(|| piece.len() - rest.len())
}

/// Applies `migrator`'s migrations that the database lacks, on `connection`, and completes
/// any it finds begun (see the module's documentation). The caller holds the migration lock.
/// Migrations in the history that `migrator` does not know (a newer release's) are ignored.
///
/// Returns how many migrations it applied or completed.
///
/// # Errors
/// [`MigrateError::VersionMismatch`] for a recorded migration whose checksum differs from
/// this release's; [`MigrateError::ExecuteMigration`] for a statement that fails; the driver
/// error of reading or writing the history.
pub(super) async fn apply_mysql(connection: &mut AnyConnection, migrator: &Migrator) -> Result<usize, MigrateError> {
    connection.execute(HISTORY_TABLE).await?;
    let recorded: Vec<(i64, Vec<u8>, i64)> =
        sqlx::query_as("SELECT version, checksum, CAST(success AS SIGNED) FROM _sqlx_migrations")
            .fetch_all(&mut *connection)
            .await?;
    let mut applied = 0;
    for migration in migrator.iter().filter(|migration| migration.migration_type.is_up_migration()) {
        let begun = match recorded.iter().find(|(version, ..)| *version == migration.version) {
            Some((_, checksum, _)) if *checksum != *migration.checksum => {
                return Err(MigrateError::VersionMismatch(migration.version));
            }
            Some((.., 1)) => continue,
            Some(_) => true,
            None => !record_begun(connection, migration).await?,
        };
        if begun {
            tracing::warn!(
                version = migration.version,
                "completing a migration that an earlier start began and did not finish"
            );
        }
        apply_one(connection, migration, begun).await?;
        applied += 1;
    }
    Ok(applied)
}

/// Writes `migration`'s history row as begun. False when the row was there already (another
/// migrator wrote it meanwhile): the migration is then applied as a begun one.
async fn record_begun(connection: &mut AnyConnection, migration: &Migration) -> Result<bool, MigrateError> {
    let written = sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (?, ?, FALSE, ?, -1)",
    )
    .bind(migration.version)
    .bind(&*migration.description)
    .bind(&*migration.checksum)
    .execute(&mut *connection)
    .await;
    match written {
        Ok(_) => Ok(true),
        Err(error) if mysql_error_number(&error) == Some(DUPLICATE_ENTRY) => Ok(false),
        Err(error) => Err(error.into()),
    }
}

/// Runs `migration`'s statements and marks it applied (steps 2 and 3 of the module's
/// documentation). `begun`: its change may be partly there already.
async fn apply_one(connection: &mut AnyConnection, migration: &Migration, begun: bool) -> Result<(), MigrateError> {
    let started = Instant::now();
    let failed = |error| MigrateError::ExecuteMigration(error, migration.version);
    let statements = statements(&migration.sql).map_err(|why| {
        failed(sqlx::Error::Protocol(format!("migration {} cannot be applied in steps: {why}", migration.version)))
    })?;
    for statement in statements.iter().filter(|statement| statement.kind == StatementKind::Schema) {
        match connection.execute(statement.sql).await {
            Ok(_) => {}
            Err(error) if begun && mysql_error_number(&error).is_some_and(|number| ALREADY_DONE.contains(&number)) => {
                tracing::info!(version = migration.version, %error, "a statement of the begun migration was applied before");
            }
            Err(error) => return Err(failed(error)),
        }
    }
    let mut transaction = connection.begin().await?;
    for statement in statements.iter().filter(|statement| statement.kind == StatementKind::Data) {
        match transaction.execute(statement.sql).await {
            Ok(_) => {}
            // An INSERT committed by a start of an older release, whose migrator (sqlx's)
            // committed each statement on its own: its rows are there. A failed statement
            // leaves the transaction open (InnoDB rolls back the statement only).
            Err(error) if begun && mysql_error_number(&error) == Some(DUPLICATE_ENTRY) => {
                tracing::info!(version = migration.version, %error, "a data statement of the begun migration was applied before");
            }
            Err(error) => return Err(failed(error)),
        }
    }
    let nanos = i64::try_from(started.elapsed().as_nanos()).unwrap_or(i64::MAX);
    sqlx::query("UPDATE _sqlx_migrations SET success = TRUE, execution_time = ? WHERE version = ?")
        .bind(nanos)
        .bind(migration.version)
        .execute(&mut *transaction)
        .await?;
    transaction.commit().await?;
    Ok(())
}

/// The MySQL/MariaDB error number of a database error.
fn mysql_error_number(error: &sqlx::Error) -> Option<u16> {
    let sqlx::Error::Database(database_error) = error else { return None };
    database_error.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>().map(sqlx::mysql::MySqlDatabaseError::number)
}

/// How long a Galera migration lease lasts without renewal: a lease older than that is taken
/// to be an instance's that died migrating, and is claimed anew. In the database's clock
/// (`UNIX_TIMESTAMP()`), so that the instances' clocks do not matter.
pub(super) const LEASE_SECONDS: i64 = 20;

/// How often the holder renews its lease while it migrates, well within [`LEASE_SECONDS`].
const LEASE_RENEWAL: Duration = Duration::from_secs(4);

/// A Galera migration lease held by this instance, renewed on a connection of its own until
/// released (or dropped, when the renewal stops and the lease runs out).
pub(super) struct Lease {
    holder: String,
    renewal: tokio::task::JoinHandle<()>,
}

impl Lease {
    /// Stops renewing and gives the lease up, so that no other instance waits for it to run
    /// out.
    pub(super) async fn release(self, connection: &mut AnyConnection) {
        self.renewal.abort();
        let _ = sqlx::query("DELETE FROM payledger_migration_lease WHERE id = 1 AND holder = ?")
            .bind(&self.holder)
            .execute(&mut *connection)
            .await;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.renewal.abort();
    }
}

/// Claims the cluster-wide migration lease of a Galera cluster: one row, inserted with
/// autocommit, so that of instances claiming it at once through several nodes exactly one
/// commits (the others fail Galera's certification, 1213, or find the row, 1062). A lease not
/// renewed for [`LEASE_SECONDS`] is cleared first. `Some` when the lease is ours (renewed
/// every [`LEASE_RENEWAL`] on a connection opened with `options`), `None` when another
/// instance holds it.
///
/// # Errors
/// The driver error of creating the lease table, clearing a lapsed lease or opening the
/// renewal's connection.
pub(super) async fn claim_lease(
    connection: &mut AnyConnection,
    options: &sqlx::any::AnyConnectOptions,
) -> Result<Option<Lease>, sqlx::Error> {
    connection
        .execute(
            "CREATE TABLE IF NOT EXISTS payledger_migration_lease \
             (id INT NOT NULL PRIMARY KEY, holder VARCHAR(64) NOT NULL, expires_at BIGINT NOT NULL)",
        )
        .await?;
    connection.execute("DELETE FROM payledger_migration_lease WHERE id = 1 AND expires_at < UNIX_TIMESTAMP()").await?;
    let holder = uuid::Uuid::new_v4().simple().to_string();
    let claimed = sqlx::query(
        "INSERT INTO payledger_migration_lease (id, holder, expires_at) VALUES (1, ?, UNIX_TIMESTAMP() + ?)",
    )
    .bind(&holder)
    .bind(LEASE_SECONDS)
    .execute(&mut *connection)
    .await;
    match claimed {
        Ok(_) => {}
        Err(sqlx::Error::Database(error)) if matches!(error.code().as_deref(), Some("23000" | "40001")) => {
            return Ok(None)
        }
        Err(error) => return Err(error),
    }
    let mut renewing = match options.connect().await {
        Ok(renewing) => renewing,
        Err(error) => {
            let _ = sqlx::query("DELETE FROM payledger_migration_lease WHERE id = 1 AND holder = ?")
                .bind(&holder)
                .execute(&mut *connection)
                .await;
            return Err(error);
        }
    };
    let renewed = holder.clone();
    let renewal = tokio::spawn(async move {
        loop {
            tokio::time::sleep(LEASE_RENEWAL).await;
            let renewal = sqlx::query(
                "UPDATE payledger_migration_lease SET expires_at = UNIX_TIMESTAMP() + ? WHERE id = 1 AND holder = ?",
            )
            .bind(LEASE_SECONDS)
            .bind(&renewed)
            .execute(&mut renewing)
            .await;
            if let Err(error) = renewal {
                tracing::warn!(%error, "cannot renew the migration lease");
            }
        }
    });
    Ok(Some(Lease { holder, renewal }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_split_at_semicolons_outside_quotes_and_comments() {
        let sql = "-- a comment; with a semicolon\n\
                   CREATE TABLE t (a VARCHAR(3) DEFAULT ';', b INT /* ; */); # trailing; comment\n\
                   ALTER TABLE t ADD COLUMN `c;d` INT;\n\
                   INSERT INTO t (a) VALUES ('it\\'s; fine'), (\"x;\");\n\
                   -- only a comment;\n";
        let split = statements(sql).unwrap();
        let kinds: Vec<StatementKind> = split.iter().map(|statement| statement.kind).collect();
        assert_eq!(kinds, [StatementKind::Schema, StatementKind::Schema, StatementKind::Data]);
        assert!(split[0].sql.ends_with("b INT /* ; */)"), "{:?}", split[0].sql);
        assert_eq!(split[1].sql, "ALTER TABLE t ADD COLUMN `c;d` INT");
        assert_eq!(split[2].sql, "INSERT INTO t (a) VALUES ('it\\'s; fine'), (\"x;\")");
    }

    #[test]
    fn a_schema_statement_after_a_data_statement_is_refused() {
        assert!(statements("INSERT INTO t VALUES (1); CREATE TABLE u (a INT);").is_err());
        assert!(statements("SELECT 1;").is_err());
        assert_eq!(statements("  \n-- nothing\n; ;").unwrap(), Vec::new());
    }

    /// Every MySQL migration of this release can be applied in steps: each splits into
    /// statements of a known kind, data after schema (the integration tests compare the
    /// schema it builds in steps with the one sqlx's migrator builds).
    #[test]
    fn every_mysql_migration_applies_in_steps() {
        for migration in super::super::MYSQL_MIGRATIONS.iter() {
            let split = statements(&migration.sql).unwrap_or_else(|why| panic!("{}: {why}", migration.version));
            assert!(!split.is_empty(), "{}", migration.version);
        }
    }
}
