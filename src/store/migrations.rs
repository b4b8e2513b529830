//! Applying the embedded migrations on MySQL/MariaDB, where DDL is not transactional: each
//! schema statement commits on its own (MySQL manual, 15.3.3 "Statements That Cause an
//! Implicit Commit"), so a start killed part way through a migration leaves it partly
//! applied. sqlx's migrator then refuses every later start ("migration N is partially
//! applied") until a person repairs the database. This runner completes such a migration
//! instead, and keeps sqlx's `_sqlx_migrations` history table exactly as sqlx writes it
//! (same columns, versions and checksums), so releases that migrate with sqlx read it too.
//!
//! A migration is applied as:
//! 1. its history row, `success = FALSE` (what sqlx writes too: "begun"), and its progress
//!    row in `payledger_migration_progress` (`statements_done` 0), in one transaction;
//! 2. its schema statements one by one (CREATE, ALTER, DROP): `attempting` set to the
//!    statement's number, the statement (committing on its own), then `statements_done` + 1
//!    and `attempting` cleared;
//! 3. its data statements (INSERT, UPDATE, DELETE, REPLACE), which must all come after the
//!    schema statements, in one transaction with the history row's `success = TRUE` and the
//!    progress row's deletion.
//!
//! A migration found begun is continued from statement `statements_done`. When `attempting`
//! names that statement, a start was running it and did not see it end (it died, or lost its
//! connection): it may have committed, so if it fails because its change is there (the
//! table, column or index exists, or what it drops is gone), it is taken as done. No other
//! statement is given that benefit: not one this start runs first, and not one that a start
//! saw the database refuse (`attempting` is cleared then): an operator's table in the way,
//! say, stops every start until a person looks, as it should.
//! A migration begun by an older release (a history row without a progress row) is refused
//! as sqlx refuses it. Each schema statement must therefore be one that, run a second time,
//! either changes nothing or fails with one of [`ALREADY_DONE`]'s errors (the unit tests
//! check the embedded migrations for it).
//!
//! On a Galera cluster MySQL's named lock (`GET_LOCK`) holds on one node only: one instance
//! migrates under a lease row that all nodes see ([`claim_lease`]), renewed while it
//! migrates. Each write to the progress (the mark of `attempting`, its clearing, the move
//! forward) and the closing transaction commit in one transaction with the lease's renewal,
//! so that a holder that lost its lease (paused for longer than [`LEASE_SECONDS`], or cut
//! off) stops instead of writing over the next holder's progress. No check can stop a holder
//! paused between its last such commit and the statement it sends next: that statement is
//! already marked `attempting`, so the next holder gives its own run of it the benefit of
//! "already there"; the stale holder's run fails or changes nothing (every statement can run
//! twice), its failure is put down to the lost lease, and its start waits like any other.

use std::time::{Duration, Instant};

use sqlx::migrate::{MigrateError, Migration, Migrator};
use sqlx::{AnyConnection, ConnectOptions, Connection, Executor};

use super::dialect::{self, Fault};

/// sqlx's history table, as sqlx-mysql 0.8 creates it.
const HISTORY_TABLE: &str = "CREATE TABLE IF NOT EXISTS _sqlx_migrations ( \
     version BIGINT PRIMARY KEY, \
     description TEXT NOT NULL, \
     installed_on TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP, \
     success BOOLEAN NOT NULL, \
     checksum BLOB NOT NULL, \
     execution_time BIGINT NOT NULL)";

/// How far each begun migration has come: a row while it is begun, none once it is applied.
const PROGRESS_TABLE: &str = "CREATE TABLE IF NOT EXISTS payledger_migration_progress ( \
     version BIGINT NOT NULL PRIMARY KEY, \
     statements_done INT NOT NULL, \
     attempting INT NULL) ENGINE = InnoDB";

/// The Galera migration lease: one row while an instance migrates.
const LEASE_TABLE: &str = "CREATE TABLE IF NOT EXISTS payledger_migration_lease \
     (id INT NOT NULL PRIMARY KEY, holder VARCHAR(64) NOT NULL, expires_at BIGINT NOT NULL) ENGINE = InnoDB";

/// MySQL/MariaDB error numbers of a schema statement whose change is already there (MySQL
/// manual, "Server Error Message Reference"), taken as done for the one statement a dead
/// start may have committed: ER_TABLE_EXISTS_ERROR (1050), ER_BAD_TABLE_ERROR (1051, a
/// dropped table), ER_DUP_FIELDNAME (1060), ER_DUP_KEYNAME (1061), ER_CANT_DROP_FIELD_OR_KEY
/// (1091).
pub(crate) const ALREADY_DONE: [u16; 5] = [1050, 1051, 1060, 1061, 1091];

/// ER_DUP_ENTRY.
const DUPLICATE_ENTRY: u16 = 1062;

/// Why [`apply_mysql`] stopped.
#[derive(Debug)]
pub(super) enum RunError {
    /// The Galera lease is no longer this instance's: another may be migrating.
    LeaseLost,
    Migrate(MigrateError),
}

impl From<MigrateError> for RunError {
    fn from(error: MigrateError) -> Self {
        RunError::Migrate(error)
    }
}

impl From<sqlx::Error> for RunError {
    fn from(error: sqlx::Error) -> Self {
        RunError::Migrate(error.into())
    }
}

/// What a statement of a migration is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StatementKind {
    /// DDL: commits on its own.
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
/// `` ` ``, with backslash escapes) and comments (`#`, `/* */`, and `--` followed by white
/// space or a control character, as MySQL reads them). Each statement is its text from its
/// first word; pieces with nothing but comments and white space are left out.
///
/// # Errors
/// A statement that does not begin with a schema or data statement's first word (among them
/// MySQL's executable comments `/*! */` and optimizer hints `/*+ */`, which this splitter
/// does not read), or a data statement followed by a schema statement (which could not share
/// its transaction).
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
            b'-' if is_dash_comment(&bytes[at..]) => {
                at = sql[at..].find('\n').map_or(bytes.len(), |end| at + end);
            }
            b'#' => at = sql[at..].find('\n').map_or(bytes.len(), |end| at + end),
            b'/' if bytes[at..].starts_with(b"/*")
                && !bytes[at..].starts_with(b"/*!")
                && !bytes[at..].starts_with(b"/*+") =>
            {
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
        let rest = &piece[from..];
        let word = rest.split(|c: char| !c.is_ascii_alphabetic()).next().unwrap_or_default();
        let kind = match word.to_ascii_uppercase().as_str() {
            "CREATE" | "ALTER" | "DROP" => StatementKind::Schema,
            "INSERT" | "UPDATE" | "DELETE" | "REPLACE" => StatementKind::Data,
            _ => {
                let shown: String = rest.chars().take(24).collect();
                return Err(format!("a statement beginning with {shown:?} is neither a schema nor a data statement"));
            }
        };
        if kind == StatementKind::Schema
            && statements.iter().any(|statement: &Statement| statement.kind == StatementKind::Data)
        {
            return Err("a schema statement follows a data statement".to_owned());
        }
        statements.push(Statement { sql: rest.trim_end(), kind });
    }
    Ok(statements)
}

/// `--` begins a comment when white space or a control character follows it (MySQL manual,
/// 11.7 "Comments"), or at the end of the text.
fn is_dash_comment(text: &[u8]) -> bool {
    text.starts_with(b"--") && text.get(2).is_none_or(|next| next.is_ascii_whitespace() || next.is_ascii_control())
}

/// Where the first word of `piece` begins, after white space and comments; `None` when it
/// has nothing else. A piece whose first text is neither (an executable comment, say) begins
/// there, and is refused by its caller.
fn first_word(piece: &str) -> Option<usize> {
    let mut rest = piece.trim_start();
    loop {
        if is_dash_comment(rest.as_bytes()) || rest.starts_with('#') {
            rest = rest.find('\n').map_or("", |end| &rest[end..]).trim_start();
        } else if rest.starts_with("/*") && !rest.starts_with("/*!") && !rest.starts_with("/*+") {
            rest = rest[2..].find("*/").map_or("", |end| &rest[2 + end + 2..]).trim_start();
        } else {
            break;
        }
    }
    (!rest.is_empty()).then(|| piece.len() - rest.len())
}

/// Applies `migrator`'s migrations that the database lacks, on `connection`, and continues
/// any this runner began and did not finish (see the module's documentation). The caller
/// holds the migration lock and, on Galera, the lease of holder `lease` (checked and renewed
/// before each statement). Migrations in the history that `migrator` does not know (a newer
/// release's) are ignored.
///
/// Returns how many migrations it applied or completed.
///
/// # Errors
/// [`MigrateError::VersionMismatch`] for a recorded migration whose checksum differs from
/// this release's; [`MigrateError::Dirty`] for one an older release began and did not finish;
/// [`MigrateError::ExecuteMigration`] for a statement that fails; the driver error of reading
/// or writing the history; [`RunError::LeaseLost`].
pub(super) async fn apply_mysql(
    connection: &mut AnyConnection,
    migrator: &Migrator,
    lease: Option<&str>,
) -> Result<usize, RunError> {
    let outcome = apply_missing(connection, migrator, lease).await;
    match (outcome, lease) {
        // A holder paused between a lease check and what it then ran (the check's answer
        // was on its way when it stopped) finds the next holder's work in its way: that
        // failure is the lost lease's, not the migration's.
        (Err(RunError::Migrate(error)), Some(holder)) => match hold_lease(&mut *connection, holder).await {
            Err(RunError::LeaseLost) => Err(RunError::LeaseLost),
            _ => Err(RunError::Migrate(error)),
        },
        (outcome, _) => outcome,
    }
}

/// [`apply_mysql`], before a failure is put down to a lost lease.
async fn apply_missing(
    connection: &mut AnyConnection,
    migrator: &Migrator,
    lease: Option<&str>,
) -> Result<usize, RunError> {
    ensure_table(connection, "_sqlx_migrations", HISTORY_TABLE).await?;
    ensure_table(connection, "payledger_migration_progress", PROGRESS_TABLE).await?;
    let recorded: Vec<(i64, Vec<u8>, i64)> =
        sqlx::query_as("SELECT version, checksum, CAST(success AS SIGNED) FROM _sqlx_migrations")
            .fetch_all(&mut *connection)
            .await?;
    let mut applied = 0;
    for migration in migrator.iter().filter(|migration| migration.migration_type.is_up_migration()) {
        let begun = match recorded.iter().find(|(version, ..)| *version == migration.version) {
            Some((_, checksum, _)) if *checksum != *migration.checksum => {
                return Err(MigrateError::VersionMismatch(migration.version).into());
            }
            Some((.., 1)) => continue,
            Some(_) => true,
            None => false,
        };
        // A holder paused past its lease finds out here, before it writes or reads what the
        // next holder may have done meanwhile.
        if let Some(holder) = lease {
            hold_lease(&mut *connection, holder).await?;
        }
        if !begun {
            record_begun(connection, migration).await?;
        }
        let Some(progress) = progress(connection, migration.version).await? else {
            if applied_meanwhile(connection, migration.version).await? {
                continue;
            }
            return Err(MigrateError::Dirty(migration.version).into());
        };
        if progress.statements_done > 0 || progress.attempting.is_some() {
            tracing::warn!(
                version = migration.version,
                statements_done = progress.statements_done,
                "continuing a migration that an earlier start began and did not finish"
            );
        }
        apply_one(connection, migration, progress, lease).await?;
        applied += 1;
    }
    Ok(applied)
}

/// Creates `table` with `ddl` unless it exists: asked first, because on Galera even a
/// `CREATE TABLE IF NOT EXISTS` of a table that exists is replicated as DDL, in total order.
async fn ensure_table(connection: &mut AnyConnection, table: &str, ddl: &str) -> Result<(), sqlx::Error> {
    let exists: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
    )
    .bind(table)
    .fetch_one(&mut *connection)
    .await?;
    if exists == 0 {
        connection.execute(ddl).await?;
    }
    Ok(())
}

/// A begun migration's progress row.
#[derive(Debug, Clone, Copy)]
struct Progress {
    /// Schema statements known to have committed.
    statements_done: usize,
    /// The schema statement a start was running and did not see end, if one was.
    attempting: Option<usize>,
}

async fn progress(connection: &mut AnyConnection, version: i64) -> Result<Option<Progress>, sqlx::Error> {
    let row: Option<(i64, i64)> = sqlx::query_as(
        "SELECT CAST(statements_done AS SIGNED), CAST(COALESCE(attempting, -1) AS SIGNED) \
         FROM payledger_migration_progress WHERE version = ?",
    )
    .bind(version)
    .fetch_optional(&mut *connection)
    .await?;
    Ok(row.map(|(done, attempting)| Progress {
        statements_done: usize::try_from(done).unwrap_or(0),
        attempting: usize::try_from(attempting).ok(),
    }))
}

/// Whether `version` is recorded as applied now: by another migrator, after this one read
/// the history.
async fn applied_meanwhile(connection: &mut AnyConnection, version: i64) -> Result<bool, sqlx::Error> {
    let applied: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM _sqlx_migrations WHERE version = ? AND success = TRUE")
        .bind(version)
        .fetch_one(&mut *connection)
        .await?;
    Ok(applied > 0)
}

/// Writes `migration`'s history row as begun and its progress row, in one transaction. When
/// the history row is there already (another migrator wrote it meanwhile) nothing is
/// written: the migration is then continued as a begun one.
async fn record_begun(connection: &mut AnyConnection, migration: &Migration) -> Result<(), RunError> {
    let mut transaction = connection.begin().await?;
    let written = sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (?, ?, FALSE, ?, -1)",
    )
    .bind(migration.version)
    .bind(&*migration.description)
    .bind(&*migration.checksum)
    .execute(&mut *transaction)
    .await;
    match written {
        Ok(_) => {}
        Err(error) if mysql_error_number(&error) == Some(DUPLICATE_ENTRY) => return Ok(()),
        Err(error) => return Err(error.into()),
    }
    sqlx::query("INSERT INTO payledger_migration_progress (version, statements_done) VALUES (?, 0)")
        .bind(migration.version)
        .execute(&mut *transaction)
        .await?;
    transaction.commit().await?;
    Ok(())
}

/// Runs `migration`'s statements from where `progress` says and marks it applied (steps 2 and
/// 3 of the module's documentation).
async fn apply_one(
    connection: &mut AnyConnection,
    migration: &Migration,
    progress: Progress,
    lease: Option<&str>,
) -> Result<(), RunError> {
    let started = Instant::now();
    let version = migration.version;
    let failed = |error| RunError::Migrate(MigrateError::ExecuteMigration(error, version));
    let statements = statements(&migration.sql).map_err(|why| {
        failed(sqlx::Error::Protocol(format!("migration {version} cannot be applied in steps: {why}")))
    })?;
    let schema: Vec<&Statement> =
        statements.iter().filter(|statement| statement.kind == StatementKind::Schema).collect();
    for (index, statement) in schema.iter().enumerate().skip(progress.statements_done) {
        let maybe_done = progress.attempting == Some(index);
        let number = i64::try_from(index).unwrap_or(i64::MAX);
        if maybe_done {
            if let Some(holder) = lease {
                hold_lease(&mut *connection, holder).await?;
            }
        } else {
            // Only where this statement is next: a row gone or moved on is another migrator's
            // work since this one read it.
            let mark = sqlx::query(
                "UPDATE payledger_migration_progress SET attempting = ? WHERE version = ? AND statements_done = ?",
            )
            .bind(number)
            .bind(version)
            .bind(number);
            if under_lease(connection, lease, mark).await? != 1 {
                return Err(superseded(version, lease));
            }
        }
        match connection.execute(statement.sql).await {
            Ok(_) => {}
            Err(error)
                if maybe_done && mysql_error_number(&error).is_some_and(|number| ALREADY_DONE.contains(&number)) =>
            {
                tracing::info!(version, %error, "the statement an earlier start was running had committed");
            }
            Err(error) => {
                // A refusal of the database's own (not a lost connection or a lock wait, after
                // which the statement may or may not have run) clears `attempting`, so that the
                // next start does not take its "already exists" for the statement's own work;
                // only while the lease is still this holder's, or it could be the next holder's
                // mark. The statement's own error is what the start reports (unless the lease
                // is gone: `apply_mysql`).
                if dialect::classify(&error) == Fault::Other {
                    let clear = sqlx::query(
                        "UPDATE payledger_migration_progress SET attempting = NULL WHERE version = ? AND attempting = ?",
                    )
                    .bind(version)
                    .bind(number);
                    if let Err(RunError::LeaseLost) = under_lease(connection, lease, clear).await {
                        return Err(RunError::LeaseLost);
                    }
                }
                return Err(failed(error));
            }
        }
        // Only forward from this statement, and only while the lease is still this holder's:
        // one that lost it while the statement ran leaves the progress to the next holder,
        // who gives the statement the benefit of `attempting`.
        let forward = sqlx::query(
            "UPDATE payledger_migration_progress SET statements_done = ?, attempting = NULL \
             WHERE version = ? AND statements_done = ?",
        )
        .bind(number + 1)
        .bind(version)
        .bind(number);
        if under_lease(connection, lease, forward).await? != 1 {
            return Err(superseded(version, lease));
        }
    }
    let mut transaction = connection.begin().await?;
    if let Some(holder) = lease {
        hold_lease(&mut *transaction, holder).await?;
    }
    for statement in statements.iter().filter(|statement| statement.kind == StatementKind::Data) {
        transaction.execute(statement.sql).await.map_err(failed)?;
    }
    let nanos = i64::try_from(started.elapsed().as_nanos()).unwrap_or(i64::MAX);
    sqlx::query("UPDATE _sqlx_migrations SET success = TRUE, execution_time = ? WHERE version = ?")
        .bind(nanos)
        .bind(version)
        .execute(&mut *transaction)
        .await?;
    sqlx::query("DELETE FROM payledger_migration_progress WHERE version = ?")
        .bind(version)
        .execute(&mut *transaction)
        .await?;
    transaction.commit().await?;
    Ok(())
}

/// Runs `update` (a write to the progress table) and returns the rows it matched; on Galera
/// (`lease` is `Some`) in one transaction with the lease's renewal, so that it commits only
/// while the lease is `lease`'s: a holder paused past its lease cannot then write over the
/// next holder's progress (the renewal fails, or the transaction fails Galera's
/// certification against the next holder's claim of the lease row).
///
/// # Errors
/// [`RunError::LeaseLost`]; the driver error.
async fn under_lease<'q>(
    connection: &mut AnyConnection,
    lease: Option<&str>,
    update: sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments<'q>>,
) -> Result<u64, RunError> {
    let Some(holder) = lease else {
        return Ok(update.execute(&mut *connection).await?.rows_affected());
    };
    let mut transaction = connection.begin().await?;
    hold_lease(&mut *transaction, holder).await?;
    let matched = update.execute(&mut *transaction).await?.rows_affected();
    transaction.commit().await?;
    Ok(matched)
}

/// What [`apply_one`] stops with when `version`'s progress row is gone or has moved on since
/// it read it: the work of another migrator, which only a Galera holder that lost its lease
/// meets (elsewhere the migration lock keeps one migrator per database).
fn superseded(version: i64, lease: Option<&str>) -> RunError {
    match lease {
        Some(_) => RunError::LeaseLost,
        None => RunError::Migrate(MigrateError::ExecuteMigration(
            sqlx::Error::Protocol(format!("the progress of migration {version} moved under this run")),
            version,
        )),
    }
}

/// The MySQL/MariaDB error number of a database error.
fn mysql_error_number(error: &sqlx::Error) -> Option<u16> {
    let sqlx::Error::Database(database_error) = error else { return None };
    database_error.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>().map(sqlx::mysql::MySqlDatabaseError::number)
}

/// How long a Galera migration lease lasts without renewal: a lease older than that is taken
/// to be an instance's that died migrating, and is claimed anew. In the clocks of the
/// cluster's nodes (`UNIX_TIMESTAMP()`), not the instances'.
pub(super) const LEASE_SECONDS: i64 = 20;

/// How often the holder renews its lease while a statement runs, well within
/// [`LEASE_SECONDS`].
const LEASE_RENEWAL: Duration = Duration::from_secs(4);

/// Renews the lease of `holder` if it is still theirs and has not lapsed.
///
/// # Errors
/// [`RunError::LeaseLost`] when it is not.
async fn hold_lease<'c, E>(executor: E, holder: &str) -> Result<(), RunError>
where
    E: Executor<'c, Database = sqlx::Any>,
{
    let held = sqlx::query(
        "UPDATE payledger_migration_lease SET expires_at = UNIX_TIMESTAMP() + ? \
         WHERE id = 1 AND holder = ? AND expires_at >= UNIX_TIMESTAMP()",
    )
    .bind(LEASE_SECONDS)
    .bind(holder)
    .execute(executor)
    .await?;
    if held.rows_affected() == 1 {
        Ok(())
    } else {
        Err(RunError::LeaseLost)
    }
}

/// A Galera migration lease held by this instance, renewed on a connection of its own until
/// released (or dropped, when the renewal stops and the lease runs out).
pub(super) struct Lease {
    holder: String,
    renewal: tokio::task::JoinHandle<()>,
}

impl Lease {
    /// The holder id to pass to [`apply_mysql`].
    pub(super) fn holder(&self) -> &str {
        &self.holder
    }

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
/// commits (the others fail Galera's certification, 1213, or find the row, 1062). A lease
/// not renewed for [`LEASE_SECONDS`] is cleared first. `Some` when the lease is ours,
/// renewed every [`LEASE_RENEWAL`] on a connection opened with `options` (opened again
/// after an error), `None` when another instance holds it.
///
/// # Errors
/// The driver error of creating the lease table or clearing a lapsed lease.
pub(super) async fn claim_lease(
    connection: &mut AnyConnection,
    options: &sqlx::any::AnyConnectOptions,
) -> Result<Option<Lease>, sqlx::Error> {
    ensure_table(connection, "payledger_migration_lease", LEASE_TABLE).await?;
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
    let (options, renewed) = (options.clone(), holder.clone());
    let renewal = tokio::spawn(async move {
        let mut renewing: Option<AnyConnection> = None;
        loop {
            tokio::time::sleep(LEASE_RENEWAL).await;
            let connection = match renewing.as_mut() {
                Some(connection) => connection,
                None => match options.connect().await {
                    Ok(connection) => renewing.insert(connection),
                    Err(error) => {
                        tracing::warn!(%error, "cannot renew the migration lease");
                        continue;
                    }
                },
            };
            match hold_lease(&mut *connection, &renewed).await {
                Ok(()) => {}
                // The holder finds out before its next statement, and stops.
                Err(RunError::LeaseLost) => return,
                Err(RunError::Migrate(error)) => {
                    tracing::warn!(%error, "cannot renew the migration lease");
                    renewing = None;
                }
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
                   --\ta tab comment's apostrophe; still a comment\n\
                   INSERT INTO t (a) VALUES ('it\\'s; fine'), (\"x;\"), ('a''b;');\n\
                   -- only a comment;\n";
        let split = statements(sql).unwrap();
        let kinds: Vec<StatementKind> = split.iter().map(|statement| statement.kind).collect();
        assert_eq!(kinds, [StatementKind::Schema, StatementKind::Schema, StatementKind::Data]);
        assert!(split[0].sql.ends_with("b INT /* ; */)"), "{:?}", split[0].sql);
        assert_eq!(split[1].sql, "ALTER TABLE t ADD COLUMN `c;d` INT");
        assert_eq!(split[2].sql, "INSERT INTO t (a) VALUES ('it\\'s; fine'), (\"x;\"), ('a''b;')");
    }

    #[test]
    fn what_the_splitter_does_not_read_is_refused_not_dropped() {
        assert!(statements("INSERT INTO t VALUES (1); CREATE TABLE u (a INT);").is_err());
        assert!(statements("SELECT 1;").is_err());
        assert!(statements("RENAME TABLE a TO b;").is_err());
        assert!(statements("/*!50001 CREATE TABLE f (a INT) */;").is_err());
        assert!(statements("(SELECT 1);").is_err());
        assert_eq!(statements("  \n-- nothing\n; ;").unwrap(), Vec::new());
    }

    /// Splits `text` at commas outside parentheses and quotes.
    fn clauses(text: &str) -> Vec<&str> {
        let (mut clauses, mut depth, mut quote, mut start) = (Vec::new(), 0_i32, None, 0);
        for (at, c) in text.char_indices() {
            match (quote, c) {
                (Some(open), _) if c == open => quote = None,
                (Some(_), _) => {}
                (None, '\'' | '"' | '`') => quote = Some(c),
                (None, '(') => depth += 1,
                (None, ')') => depth -= 1,
                (None, ',') if depth == 0 => {
                    clauses.push(text[start..at].trim());
                    start = at + 1;
                }
                _ => {}
            }
        }
        clauses.push(text[start..].trim());
        clauses
    }

    /// Whether `statement`, run a second time, changes nothing or fails with one of
    /// [`ALREADY_DONE`]'s errors: why not, when it is not.
    fn rerunnable(statement: &str) -> Result<(), String> {
        // Comments out (no migration has "-- " inside a string).
        let statement: String = statement
            .lines()
            .map(|line| line.find("-- ").map_or(line, |at| &line[..at]))
            .collect::<Vec<_>>()
            .join("\n");
        let statement = statement.as_str();
        let words: Vec<String> =
            statement.split_whitespace().filter(|word| !word.starts_with("--")).map(str::to_ascii_uppercase).collect();
        let words: Vec<&str> = words.iter().map(String::as_str).collect();
        match words.as_slice() {
            ["CREATE", "TABLE", name, ..] if *name != "IF" => Ok(()),
            ["CREATE", "INDEX", _, "ON", ..] | ["CREATE", "UNIQUE", "INDEX", _, "ON", ..] => Ok(()),
            ["DROP", "TABLE", name, ..] if *name != "IF" => Ok(()),
            ["DROP", "INDEX", _, "ON", ..] => Ok(()),
            ["ALTER", "TABLE", _, ..] => {
                let after_table = statement.split_whitespace().skip(3).collect::<Vec<_>>().join(" ");
                for clause in clauses(&after_table) {
                    let upper: Vec<String> = clause.split_whitespace().map(str::to_ascii_uppercase).collect();
                    let upper: Vec<&str> = upper.iter().map(String::as_str).collect();
                    let named = |name: &&str| !name.starts_with('(');
                    let fine = match upper.as_slice() {
                        ["ADD", "COLUMN", ..] | ["MODIFY", "COLUMN", ..] | ["DROP", "COLUMN", ..] => true,
                        ["ADD", "KEY" | "INDEX", name, ..] | ["ADD", "UNIQUE", "KEY" | "INDEX", name, ..] => {
                            named(name)
                        }
                        ["DROP", "KEY" | "INDEX", ..] => true,
                        _ => false,
                    };
                    if !fine {
                        return Err(format!("the clause {clause:?}"));
                    }
                }
                Ok(())
            }
            _ => Err("its kind".to_owned()),
        }
    }

    #[test]
    fn the_rerunnable_shapes_are_told_apart() {
        assert!(rerunnable("CREATE TABLE t (a INT, b INT)").is_ok());
        assert!(rerunnable("ALTER TABLE t ADD COLUMN a INT, ADD COLUMN b VARCHAR(3) DEFAULT 'x,y'").is_ok());
        assert!(rerunnable("ALTER TABLE t MODIFY COLUMN a VARCHAR(9), ADD UNIQUE KEY t_a (a)").is_ok());
        assert!(rerunnable("CREATE INDEX t_a ON t (a)").is_ok());
        for unsafe_to_repeat in [
            "CREATE TABLE IF NOT EXISTS t (a INT)",
            "ALTER TABLE t ADD INDEX (a)",
            "ALTER TABLE t ADD FOREIGN KEY (a) REFERENCES u (a)",
            "ALTER TABLE t RENAME COLUMN a TO b",
            "ALTER TABLE t ADD PRIMARY KEY (a)",
            "ALTER TABLE t CHANGE COLUMN a b INT",
            "DROP VIEW v",
        ] {
            assert!(rerunnable(unsafe_to_repeat).is_err(), "{unsafe_to_repeat}");
        }
    }

    /// Every MySQL migration of this release can be applied in steps and continued after a
    /// start died in it: each splits into statements of a known kind, data after schema, and
    /// each schema statement is one that a second run leaves as it is or refuses with an
    /// "already there" error (the integration tests compare the schema it builds in steps,
    /// cut after each statement, with the one sqlx's migrator builds).
    #[test]
    fn every_mysql_migration_applies_in_steps_and_each_step_can_run_twice() {
        for migration in super::super::MYSQL_MIGRATIONS.iter() {
            let split = statements(&migration.sql).unwrap_or_else(|why| panic!("{}: {why}", migration.version));
            assert!(!split.is_empty(), "{}", migration.version);
            for statement in split.iter().filter(|statement| statement.kind == StatementKind::Schema) {
                if let Err(why) = rerunnable(statement.sql) {
                    panic!("migration {}: cannot be run twice ({why}): {}", migration.version, statement.sql);
                }
            }
        }
    }
}
