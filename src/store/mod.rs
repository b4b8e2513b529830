//! SQL only. One small interface ([`Store`], [`Tx`], [`Queries`]) over PostgreSQL,
//! MySQL/MariaDB and SQLite. Every statement is written out in the form each backend takes
//! (`dialect::Sql`; nothing rewrites SQL text): one call's statements and the audit's in
//! `queries`, the group commit's, which take any number of rows in one fixed text, in `batch`;
//! what else differs between the backends (session set-up, how a write transaction begins,
//! which driver errors are transient) lives in [`dialect`].
//!
//! Every column is a BIGINT or a string: amounts are integer minor units and timestamps are
//! microseconds since the Unix epoch, so all three backends store exactly the same values.
//! The idempotency algorithm (what to insert first, what zero rows means, what to replay) is
//! not here: it is written once in `crate::ledger`.

mod batch;
pub mod chain;
mod dialect;
mod migrations;
mod queries;
mod rows;
mod warm;

use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use sqlx::any::AnyPoolOptions;
use sqlx::migrate::Migrator;
use sqlx::pool::PoolConnection;
use sqlx::{Any, AnyConnection, AnyPool, ConnectOptions, Connection, Executor, Transaction};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub use dialect::{classify, conflict_cause, redacted, Dialect, Fault};
pub use queries::{
    BatchWrite, FundingTable, KeysAtOnce, OrderRefund, Queries, ReadAtOnce, RecordCompletion, RowLocks, Savepoint,
};
pub use rows::{
    AccountRow, AuditProgress, AuditViolation, BalanceUpdate, EntryRow, FundingRow, HoldRow, IdempotencyRecordRow,
    NewEntry, OrderRow, PaymentRow, RefundRow, TokenRow, TransferRow,
};

// A migration applied by a newer release is ignored, not refused: during a rolling deploy an
// instance of the previous release may (re)start after a newer one has migrated, and every
// migration only adds to the schema.
static POSTGRES_MIGRATIONS: Migrator = Migrator { ignore_missing: true, ..sqlx::migrate!("migrations/postgres") };
static MYSQL_MIGRATIONS: Migrator = Migrator { ignore_missing: true, ..sqlx::migrate!("migrations/mysql") };
static SQLITE_MIGRATIONS: Migrator = Migrator { ignore_missing: true, ..sqlx::migrate!("migrations/sqlite") };
/// Waits up to the bound seconds for the migration lock of the connection's database (1:
/// held, 0: timed out). A named lock holds across the whole server, so its name carries the
/// database's (hashed: a lock name has at most 64 characters).
const MYSQL_MIGRATION_LOCK: &str = "SELECT CAST(GET_LOCK(CONCAT('payledger_migrate_', MD5(DATABASE())), ?) AS SIGNED)";

/// Releases [`MYSQL_MIGRATION_LOCK`].
const MYSQL_MIGRATION_UNLOCK: &str = "SELECT RELEASE_LOCK(CONCAT('payledger_migrate_', MD5(DATABASE())))";

/// How long one attempt waits for MySQL's migration lock before it says so and tries again.
const MYSQL_MIGRATION_LOCK_WAIT: u64 = 5;

/// Pool settings.
#[derive(Debug, Clone)]
pub struct PoolSettings {
    /// Most connections the pool opens.
    pub max_connections: u32,
    /// How long a request waits for a free connection before UNAVAILABLE.
    pub acquire_timeout: Duration,
    /// How long a statement waits for a row lock (or SQLite's write lock) before the call
    /// fails with ABORTED.
    pub lock_timeout: Duration,
    /// PostgreSQL only: how long a pooled connection, and with it every plan it keeps, is
    /// used before it is closed and replaced. Its statements keep one generic plan each
    /// (`plan_cache_mode = force_generic_plan`, see [`Dialect::session_setup`]), made from the
    /// tables' sizes when the connection first ran them; a new connection plans again from
    /// the sizes of that moment, so a plan made while a table was small (a sequential scan of a
    /// table of one page) lasts at most this long after the table grew
    /// (docs/decisions/001-generic-plans.md).
    pub plan_lifetime: Duration,
}

impl PoolSettings {
    /// The default [`PoolSettings::plan_lifetime`] (`--plan-lifetime-seconds`): 30 s.
    pub const PLAN_LIFETIME_DEFAULT: Duration = Duration::from_secs(30);
}

/// How long a pooled connection may sit idle before it is closed rather than used (a server
/// may have dropped it meanwhile: MySQL's `wait_timeout`, a proxy's idle timeout): 10 min,
/// sqlx's own default.
const IDLE_TIMEOUT: Duration = Duration::from_secs(600);

/// A pool's options with sqlx's background reaper off: it is spawned only when the pool has an
/// idle timeout or a maximum lifetime, and sqlx 0.8 can wedge it in a busy loop, the process at
/// 100% of a core and the pool's connections stranded (sqlx issue #3645: a race in the pool's
/// idle count; fixed upstream by pull request #4289). The same bounds are kept where no task is
/// needed: a connection idle longer than [`IDLE_TIMEOUT`], or older than `max_age` (when
/// given), is closed when it is next taken, and one older than `max_age` when it is released.
fn without_reaper(options: AnyPoolOptions, max_age: Option<Duration>) -> AnyPoolOptions {
    options
        .idle_timeout(None)
        .max_lifetime(None)
        .before_acquire(move |_, meta| {
            let usable = meta.idle_for <= IDLE_TIMEOUT && max_age.is_none_or(|max_age| meta.age <= max_age);
            Box::pin(async move { Ok(usable) })
        })
        .after_release(move |_, meta| {
            let usable = max_age.is_none_or(|max_age| meta.age <= max_age);
            Box::pin(async move { Ok(usable) })
        })
}

/// A connection pool to one database, and the rules of its dialect.
#[derive(Clone)]
pub struct Store {
    /// Taken from directly only at start (migrations, the schema check): a taker there waits
    /// uncounted by `warm`, which may then keep a connection it could have had.
    pool: AnyPool,
    /// Connections of the pool released last by readers, handed out first (see [`warm`]).
    warm: Arc<warm::WarmSet>,
    dialect: Dialect,
    /// SQLite has one writer at a time. Write transactions of this process queue here, in
    /// FIFO order, instead of polling SQLite's busy handler; the busy timeout still covers
    /// writers in other processes.
    write_gate: Option<Arc<Semaphore>>,
    lock_timeout: Duration,
    /// Health checks have connections of their own, so that a check never waits behind the
    /// load for a pooled connection, nor takes one from it: on SQLite this pool's one
    /// connection, kept; on PostgreSQL and MySQL a new session at every check, made with
    /// `probe_options` and closed after it (see [`Store::check_health`]).
    probe: AnyPool,
    /// How the health check connects on PostgreSQL and MySQL/MariaDB: directly, a new
    /// connection each check.
    probe_options: sqlx::any::AnyConnectOptions,
    max_connections: u32,
    /// Seconds each transaction and read waited for a pooled connection.
    acquire_duration: Histogram,
    /// 1 after a health check that passed, 0 after one that did not (see
    /// [`Store::check_health`]).
    up: Gauge,
    /// True on a MariaDB Galera cluster node (`wsrep_on` with a provider loaded).
    galera: bool,
    /// The SQLite database's file (`None` in memory and on the other backends), beside which
    /// migrating takes its lock.
    sqlite_file: Option<std::path::PathBuf>,
}

/// The driver's options for `url`. sqlx warns of every statement slower than 1 s; the audit
/// (`create` false: an existing ledger, read whole) runs nothing else, so it is not told.
fn connect_options(url: &str, create: bool) -> Result<sqlx::any::AnyConnectOptions, ConnectError> {
    let options: sqlx::any::AnyConnectOptions =
        url.parse().map_err(|error| ConnectError::Connect(dialect::redacted(url), error))?;
    Ok(if create { options } else { options.log_slow_statements(log::LevelFilter::Off, Duration::MAX) })
}

/// How long a start waits in all for migrations that another instance is applying (see
/// [`Store::migrate`]).
const MIGRATION_WAIT: Duration = Duration::from_secs(120);

/// Why one attempt to migrate did not complete the schema.
enum Attempt {
    /// Another instance holds the migration lock or lease.
    Busy(String),
    Failed(sqlx::migrate::MigrateError),
}

/// The fault class of the database error behind a failed migration, if one is.
fn migration_fault(error: &sqlx::migrate::MigrateError) -> Option<Fault> {
    match error {
        sqlx::migrate::MigrateError::Execute(error) | sqlx::migrate::MigrateError::ExecuteMigration(error, _) => {
            Some(dialect::classify(error))
        }
        _ => None,
    }
}

/// How long a health check may take, its connection included; longer is unhealthy.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long the health check's write waits for a lock on its table (held by an operator's
/// `LOCK TABLE(S)`, say; nothing of payledger's takes one that conflicts) before the database
/// refuses it: 1 s, within [`PROBE_TIMEOUT`], so that the database ends the wait itself rather
/// than keep a session waiting after the check has given up. Whole seconds: MySQL's
/// `lock_wait_timeout` has no finer unit.
const PROBE_LOCK_WAIT: Duration = Duration::from_secs(1);

/// Why a health check failed (see [`Store::check_health`]).
#[derive(Debug, thiserror::Error)]
pub enum Unhealthy {
    /// No connection could be had, or it broke during the check.
    #[error("the database is unreachable")]
    Unreachable(#[source] sqlx::Error),
    /// The check took longer than [`PROBE_TIMEOUT`] (2 s), its connection included.
    #[error("the database did not answer the health check within 2 s")]
    TimedOut,
    /// A Galera node not ready for queries, or not Synced with its cluster.
    #[error("the Galera node is not ready and Synced (wsrep_ready, wsrep_local_state)")]
    NotSynced,
    /// The database answers but refused the check's write, which changes nothing: read-only
    /// (PostgreSQL's SQLSTATE 25006, MySQL's error 1290), or another refusal the source says.
    #[error("the database refuses writes")]
    RefusesWrites(#[source] sqlx::Error),
    /// The check's write waited [`PROBE_LOCK_WAIT`] (1 s) for a lock on its table and gave up
    /// (PostgreSQL's 55P03, MySQL's 1205): a `LOCK TABLE(S)` or DDL held by an operator. The
    /// database may take writes to the ledger's tables meanwhile, but the check cannot tell.
    #[error("the health check's write waited 1 s for a table lock")]
    LockWait(#[source] sqlx::Error),
}

impl Unhealthy {
    /// The reason in one word, for logs: `unreachable`, `timed_out`, `not_synced`,
    /// `refuses_writes` or `lock_wait`.
    pub fn reason(&self) -> &'static str {
        match self {
            Unhealthy::Unreachable(_) => "unreachable",
            Unhealthy::TimedOut => "timed_out",
            Unhealthy::NotSynced => "not_synced",
            Unhealthy::RefusesWrites(_) => "refuses_writes",
            Unhealthy::LockWait(_) => "lock_wait",
        }
    }
}

/// Errors of [`Store::connect`].
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("DATABASE_URL must start with postgres://, mysql://, mariadb:// or sqlite:")]
    UnknownScheme,
    #[error("cannot connect to the database at {0}")]
    Connect(String, #[source] sqlx::Error),
    #[error("no payledger ledger at {0} (run `payledger serve` on it first)")]
    NoLedger(String, #[source] sqlx::Error),
    #[error("cannot apply the {0} migrations")]
    Migrate(&'static str, #[source] sqlx::migrate::MigrateError),
    #[error("the database at {0} lacks migrations of this release ({1}): run `payledger migrate` on it first")]
    SchemaBehind(String, String),
    #[error("the database at {0} records migrations {1} with other contents than this release's (applied by another build of it): `payledger migrate` does not change an applied migration; see docs/operations.md, Databases")]
    SchemaDiffers(String, String),
    #[error("cannot read the migration history (_sqlx_migrations) of the database at {0}: payledger's user needs SELECT on it")]
    History(String, #[source] sqlx::Error),
    #[error("gave up after 120 s waiting for another instance to finish migrating the {0} database (or for the database to take writes): {1}")]
    MigrationWait(&'static str, String),
}

impl Store {
    /// Opens a pool to `url` (the scheme picks the backend) and prepares every connection
    /// as its dialect requires. Does not run migrations: see [`Store::migrate`].
    ///
    /// # Errors
    /// [`ConnectError`] for an unknown scheme or an unreachable database.
    pub async fn connect(url: &str, settings: &PoolSettings) -> Result<Self, ConnectError> {
        Self::open(url, settings, true).await
    }

    /// Opens an existing ledger without changing anything: no migrations, and a SQLite file
    /// must already exist. For `payledger audit`.
    ///
    /// One plain connection comes first, without the pool's retries and without the session
    /// setup (which would turn an empty SQLite file into a WAL database): a database that is
    /// down, a file that is not a database or one without a ledger is named at once, and
    /// nothing is written to it.
    ///
    /// # Errors
    /// [`ConnectError::Connect`] when the database cannot be reached; [`ConnectError::NoLedger`]
    /// when it has no payledger schema.
    pub async fn connect_existing(url: &str, settings: &PoolSettings) -> Result<Self, ConnectError> {
        sqlx::any::install_default_drivers();
        let dialect = Dialect::from_url(url).ok_or(ConnectError::UnknownScheme)?;
        let options = connect_options(&dialect.driver_url(url, false), false)?;
        let mut first = AnyConnection::connect_with(&options)
            .await
            .map_err(|error| ConnectError::Connect(dialect::redacted(url), error))?;
        let ledger = Queries::new(&mut first, dialect).count_accounts().await;
        let _ = first.close().await;
        // A database that cannot serve now (a Galera node without quorum answers 1047) is
        // not one without a ledger: saying so would send an operator to migrate it.
        ledger.map_err(|error| match dialect::classify(&error) {
            Fault::Unavailable => ConnectError::Connect(dialect::redacted(url), error),
            _ => ConnectError::NoLedger(dialect::redacted(url), error),
        })?;
        // The pool connects its first connection before it returns.
        Self::open(url, settings, false).await
    }

    async fn open(url: &str, settings: &PoolSettings, create: bool) -> Result<Self, ConnectError> {
        sqlx::any::install_default_drivers();
        let dialect = Dialect::from_url(url).ok_or(ConnectError::UnknownScheme)?;
        // SQLite says only "unable to open database file" for a file in a missing directory.
        let directory = sqlite_file(url).and_then(|file| file.parent().map(std::path::Path::to_owned));
        if let Some(directory) = directory.filter(|directory| !directory.as_os_str().is_empty() && !directory.is_dir())
        {
            let missing = format!("the directory {} does not exist", directory.display());
            return Err(ConnectError::Connect(dialect::redacted(url), sqlx::Error::Configuration(missing.into())));
        }
        let galera = match dialect {
            Dialect::Sqlite => false,
            Dialect::Postgres | Dialect::MySql => {
                let mut first = first_connection(dialect, url, settings.acquire_timeout).await?;
                let galera = match dialect {
                    Dialect::MySql => tokio::time::timeout(settings.acquire_timeout, is_galera_node(&mut first))
                        .await
                        .unwrap_or_else(|_| Err(timed_out("no answer", settings.acquire_timeout))),
                    _ => Ok(false),
                };
                let _ = first.close().await;
                galera.map_err(|error| ConnectError::Connect(dialect::redacted(url), error))?
            }
        };
        let session_setup = Arc::new(dialect.session_setup(settings.lock_timeout, galera));
        // PostgreSQL: the age of the generic plans a connection keeps is bounded (see
        // `PoolSettings::plan_lifetime`); an older connection is closed when it is released or
        // next taken. The other backends plan at each execution (MariaDB, MySQL) or from fixed
        // estimates (SQLite), and keep their connections.
        // A connection kept warm is handed out at most a tenth of that age (and at most 5 s)
        // after it last left the pool (`warm`), so the pool's own bound is the rest: none is
        // used past the plan lifetime.
        let max_age = (dialect == Dialect::Postgres).then_some(settings.plan_lifetime);
        let warm_hold = max_age.map_or(warm::WARM_HOLD, |max_age| (max_age / 10).min(warm::WARM_HOLD));
        let pool = without_reaper(AnyPoolOptions::new(), max_age.map(|max_age| max_age - warm_hold))
            .max_connections(settings.max_connections)
            .acquire_timeout(settings.acquire_timeout)
            // No ping on every checkout: it costs a round trip per request. A connection that
            // died fails its first statement instead, the call is UNAVAILABLE (retried by the
            // client) and the pool drops the connection.
            .test_before_acquire(false)
            .after_connect(move |connection, _| {
                let session_setup = session_setup.clone();
                Box::pin(async move {
                    for statement in session_setup.iter() {
                        connection.execute(statement.as_str()).await?;
                    }
                    Ok(())
                })
            })
            .connect_with(connect_options(&dialect.driver_url(url, create), create)?)
            .await
            .map_err(|error| ConnectError::Connect(dialect::redacted(url), error))?;
        let probe_options = connect_options(&dialect.driver_url(url, false), false)?;
        let probe = without_reaper(AnyPoolOptions::new(), None)
            .max_connections(1)
            .acquire_timeout(PROBE_TIMEOUT)
            // A connection the database dropped is found out here, and replaced.
            .test_before_acquire(true)
            .connect_lazy_with(probe_options.clone());
        let write_gate = (dialect == Dialect::Sqlite).then(|| Arc::new(Semaphore::new(1)));
        let up = Gauge::default();
        up.set(1);
        Ok(Self {
            pool,
            // None kept on MySQL/MariaDB (see `warm`).
            warm: Arc::new(warm::WarmSet::new(warm_hold, dialect != Dialect::MySql)),
            dialect,
            write_gate,
            lock_timeout: settings.lock_timeout,
            probe,
            probe_options,
            max_connections: settings.max_connections,
            acquire_duration: crate::metrics::duration_buckets(),
            up,
            galera,
            sqlite_file: sqlite_file(url),
        })
    }

    /// True when the database is a MariaDB Galera cluster node: a causal wait then precedes
    /// each transaction and read, write transactions guard against silent aborts (see
    /// [`Dialect::session_setup`]), and health is the node's state.
    pub fn is_galera(&self) -> bool {
        self.galera
    }

    /// Applies the embedded migrations of this backend (`migrations/<backend>`), and
    /// completes one that an earlier start began and did not finish. Safe to run from
    /// several instances at once, on every backend and on a Galera cluster:
    /// - PostgreSQL applies each migration in a transaction, under sqlx's
    ///   `pg_advisory_lock` (on a connection of its own, closed if migrating fails, so that the
    ///   lock never stays behind in the pool); SQLite each in a transaction, under an
    ///   exclusive lock of the file `<database>-migrate.lock` beside it (sqlx takes none on
    ///   SQLite). A start killed part way leaves nothing of the migration it was applying.
    /// - MySQL/MariaDB apply them statement by statement (`store::migrations`), under a named
    ///   lock (`GET_LOCK`, freed when its session ends), and on a Galera cluster also under a
    ///   lease all nodes see, which lapses 20 s after its holder died.
    ///
    /// An instance that finds another migrating (its lock or lease held) or the database
    /// busy or closed to writes (a lock wait that timed out, a deadlock, a lost connection,
    /// read-only) tries again each second, up to 120 s in all: it succeeds as soon as the
    /// history shows every migration applied, or takes over what a dead instance left.
    ///
    /// # Errors
    /// [`ConnectError::Migrate`] at once when a migration fails for another reason or the
    /// history does not match this release; [`ConnectError::MigrationWait`] when another
    /// instance still holds the lock or lease, or the database is still busy or read-only,
    /// after 120 s.
    pub async fn migrate(&self) -> Result<(), ConnectError> {
        let deadline = Instant::now() + MIGRATION_WAIT;
        loop {
            let error = match self.migrate_once(deadline).await {
                Ok(()) => return Ok(()),
                Err(Attempt::Failed(error)) if !migration_fault(&error).is_some_and(|fault| fault != Fault::Other) => {
                    return Err(ConnectError::Migrate(self.dialect.name(), error));
                }
                Err(error) => error,
            };
            if Instant::now() >= deadline {
                let why = match error {
                    Attempt::Busy(why) => why,
                    Attempt::Failed(error) => error.to_string(),
                };
                return Err(ConnectError::MigrationWait(self.dialect.name(), why));
            }
            if self.has_every_migration(self.migrator()).await {
                return Ok(());
            }
            match &error {
                Attempt::Busy(why) => {
                    tracing::info!(why = %why, "another instance is migrating the database; trying again in 1 s")
                }
                Attempt::Failed(error) => tracing::info!(
                    %error,
                    "another instance is migrating the database, or the database is busy or refuses writes; trying again in 1 s"
                ),
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// One attempt of [`Store::migrate`]; lock waits end by `deadline`.
    async fn migrate_once(&self, deadline: Instant) -> Result<(), Attempt> {
        let migrator = self.migrator();
        let failed = |error: sqlx::Error| Attempt::Failed(error.into());
        // sqlx's migrator writes before it reads (it creates its table if it is missing),
        // which a read-only database refuses; a ledger that has every migration of this
        // release needs none of that, and so starts on a read-only database too.
        if self.has_every_migration(migrator).await {
            return Ok(());
        }
        match self.dialect {
            Dialect::Postgres => {
                let mut connection = self.pool.acquire().await.map_err(failed)?;
                let outcome = migrator.run_direct(&mut *connection).await;
                if outcome.is_err() {
                    // sqlx returns without pg_advisory_unlock when a migration fails.
                    connection.close_on_drop();
                }
                return outcome.map_err(Attempt::Failed);
            }
            Dialect::Sqlite => {
                let _lock = match &self.sqlite_file {
                    Some(file) => Some(lock_file(file, deadline).await?),
                    None => None,
                };
                return migrator.run(&self.pool).await.map_err(Attempt::Failed);
            }
            Dialect::MySql => {}
        }
        // sqlx takes MySQL's lock with GET_LOCK(name, -1); MariaDB answers NULL at once to a
        // negative timeout instead of waiting. Take the named lock with a real timeout, on
        // the connection that then migrates.
        let mut connection = self.pool.acquire().await.map_err(failed)?;
        let wait = deadline.saturating_duration_since(Instant::now()).as_secs().clamp(1, MYSQL_MIGRATION_LOCK_WAIT);
        let locked: Option<i64> = sqlx::query_scalar(MYSQL_MIGRATION_LOCK)
            .bind(i64::try_from(wait).unwrap_or(1))
            .fetch_one(&mut *connection)
            .await
            .map_err(failed)?;
        if locked != Some(1) {
            return Err(Attempt::Busy("another instance holds the migration lock (GET_LOCK)".to_owned()));
        }
        // A Galera session is READ ONLY outside its transactions, and may have autocommit off
        // since its last write transaction; migrating writes outside transactions.
        if self.galera {
            connection
                .execute("SET SESSION autocommit = 1; SET SESSION TRANSACTION READ WRITE")
                .await
                .map_err(failed)?;
        }
        let outcome = if !self.galera {
            migrations::apply_mysql(&mut connection, migrator, None).await
        } else {
            // GET_LOCK holds on one node only: on Galera the instance that also claims the
            // cluster-wide lease migrates, and the others wait for it (`migrate`).
            match migrations::claim_lease(&mut connection, &self.pool.connect_options()).await {
                Ok(Some(lease)) => {
                    let outcome = migrations::apply_mysql(&mut connection, migrator, Some(lease.holder())).await;
                    lease.release(&mut connection).await;
                    outcome
                }
                Ok(None) => Err(migrations::RunError::LeaseLost),
                Err(error) => Err(error.into()),
            }
        };
        let _ = sqlx::query(MYSQL_MIGRATION_UNLOCK).execute(&mut *connection).await;
        if self.galera {
            // Or the connection leaves the pool, rather than go back to it writable.
            if connection.execute("SET SESSION TRANSACTION READ ONLY").await.is_err() {
                connection.close_on_drop();
            }
        }
        match outcome {
            Ok(_) => Ok(()),
            Err(migrations::RunError::LeaseLost) => {
                Err(Attempt::Busy("another instance holds the cluster's migration lease".to_owned()))
            }
            Err(migrations::RunError::Migrate(error)) => Err(Attempt::Failed(error)),
        }
    }

    pub fn dialect(&self) -> Dialect {
        self.dialect
    }

    /// Begins a write transaction.
    ///
    /// # Errors
    /// The driver error when no connection is free in time or BEGIN fails; on SQLite,
    /// [`sqlx::Error::PoolTimedOut`] when this process's write lock was not had within the
    /// lock timeout.
    pub async fn begin(&self) -> Result<Tx, sqlx::Error> {
        let write_permit = match &self.write_gate {
            // Waiting for the write lock is bounded like any lock wait.
            Some(gate) => Some(
                tokio::time::timeout(self.lock_timeout, gate.clone().acquire_owned())
                    .await
                    .map_err(|_| sqlx::Error::PoolTimedOut)?
                    .map_err(|_| sqlx::Error::PoolClosed)?,
            ),
            None => None,
        };
        // A transaction's connection goes back through sqlx's pool (see `warm`).
        let connection = self.acquire().await?.into_pool_connection();
        let begin = if self.galera { dialect::GALERA_BEGIN } else { self.dialect.begin_statement() };
        // What `Pool::begin_with` does, after the acquire is timed.
        let transaction = Transaction::begin(connection, Some(begin.into())).await?;
        Ok(Tx {
            transaction,
            dialect: self.dialect,
            _write_permit: write_permit,
            cas_retries: 0,
            galera: self.galera,
            checked: false,
        })
    }

    /// Takes a pooled connection for reads outside a write transaction (each statement sees
    /// what committed before it).
    ///
    /// # Errors
    /// The driver error when no connection is free in time.
    pub async fn reader(&self) -> Result<Reader, sqlx::Error> {
        Ok(Reader { connection: self.acquire().await?, dialect: self.dialect })
    }

    /// Takes a pooled connection for reads that must reflect one moment: every read through
    /// the [`Snapshot`] sees the same committed state, whatever commits meanwhile (see
    /// [`Dialect::snapshot_statements`] for how each backend begins it). End it with
    /// [`Snapshot::finish`], whatever the reads found; one dropped unfinished (a driver error,
    /// a cancelled future) closes its connection instead of pooling it.
    ///
    /// # Errors
    /// The driver error when no connection is free in time or the transaction cannot begin.
    pub async fn snapshot(&self) -> Result<Snapshot, sqlx::Error> {
        // The guard first: a future dropped while a statement below is in flight closes the
        // connection rather than pooling it inside the transaction (or, on MySQL, with the
        // next transaction's isolation level set).
        let connection = self.acquire().await?.into_pool_connection();
        let mut snapshot = Snapshot { connection: Some(connection), dialect: self.dialect };
        let (before, begin) = self.dialect.snapshot_statements();
        let connection = snapshot.connection.as_mut().expect("just taken");
        for statement in before.into_iter().chain([begin]) {
            connection.execute(statement).await?;
        }
        Ok(snapshot)
    }

    async fn acquire(&self) -> Result<warm::Pooled, sqlx::Error> {
        let started = Instant::now();
        let connection = self.warm.take(&self.pool).await;
        self.acquire_duration.observe(started.elapsed().as_secs_f64());
        let mut connection = connection?;
        if self.galera {
            // A node that cannot answer a causal read (behind past Galera's
            // repl.causal_read_timeout, or without quorum, where it fails with 1205 at once)
            // cannot serve this call: UNAVAILABLE, not a lock timeout.
            if let Err(error) = connection.execute(dialect::GALERA_CAUSAL_WAIT).await {
                return Err(match dialect::classify(&error) {
                    Fault::Unavailable => error,
                    _ => sqlx::Error::Io(std::io::Error::other(format!(
                        "the Galera node cannot serve a causal read: {error}"
                    ))),
                });
            }
        }
        Ok(connection)
    }

    /// Seconds each transaction and read waited for a pooled connection.
    pub fn acquire_duration(&self) -> &Histogram {
        &self.acquire_duration
    }

    /// 1 while the last health check passed: the database answered and accepted a write (see
    /// [`Store::check_health`]); 0 after one that failed.
    pub fn up(&self) -> &Gauge {
        &self.up
    }

    /// The pool now: connections open, of those idle, and the most it opens.
    pub fn pool_state(&self) -> (u32, u32, u32) {
        let idle = u32::try_from(self.pool.num_idle() + self.warm.len()).unwrap_or(u32::MAX);
        (self.pool.size(), idle, self.max_connections)
    }

    /// Whether the database holds every migration of this release, as `serve --migrations
    /// check` requires (it writes nothing: a read-only database passes too). Versions the
    /// database records that this release does not know (a newer release's) are ignored.
    ///
    /// # Errors
    /// [`ConnectError::History`] when the history cannot be read (not for a database that has
    /// none: then every migration is missing); [`ConnectError::SchemaDiffers`] naming the
    /// versions recorded with other contents than this release's; [`ConnectError::SchemaBehind`]
    /// naming the versions missing.
    pub async fn check_schema(&self, url: &str) -> Result<(), ConnectError> {
        let migrator = self.migrator();
        let recorded = match self.recorded_migrations().await {
            Ok(recorded) => recorded,
            Err(error) if dialect::is_missing_table(&error) => Vec::new(),
            Err(error) => return Err(ConnectError::History(dialect::redacted(url), error)),
        };
        let versions = |wanted: &dyn Fn(&sqlx::migrate::Migration) -> bool| -> Vec<String> {
            migrator
                .iter()
                .filter(|migration| wanted(migration))
                .map(|migration| migration.version.to_string())
                .collect()
        };
        let changed = versions(&|migration| {
            recorded.iter().any(|(version, checksum)| *version == migration.version && *checksum != *migration.checksum)
        });
        if !changed.is_empty() {
            return Err(ConnectError::SchemaDiffers(dialect::redacted(url), changed.join(", ")));
        }
        let missing = versions(&|migration| !recorded.iter().any(|(version, _)| *version == migration.version));
        if missing.is_empty() {
            Ok(())
        } else {
            Err(ConnectError::SchemaBehind(dialect::redacted(url), missing.join(", ")))
        }
    }

    /// The version and checksum of each migration the history records as applied.
    async fn recorded_migrations(&self) -> Result<Vec<(i64, Vec<u8>)>, sqlx::Error> {
        sqlx::query_as("SELECT version, checksum FROM _sqlx_migrations WHERE success = TRUE")
            .fetch_all(&self.pool)
            .await
    }

    /// The versions of the migrations applied to the database (none when it has no history).
    pub async fn applied_migrations(&self) -> Vec<i64> {
        sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success = TRUE ORDER BY version")
            .fetch_all(&self.pool)
            .await
            .unwrap_or_default()
    }

    /// The migrations of this release for the store's backend.
    fn migrator(&self) -> &'static Migrator {
        match self.dialect {
            Dialect::Postgres => &POSTGRES_MIGRATIONS,
            Dialect::MySql => &MYSQL_MIGRATIONS,
            Dialect::Sqlite => &SQLITE_MIGRATIONS,
        }
    }

    /// True when the database records every migration of `migrator` as applied, with the
    /// same checksum. False when it cannot tell (no history table yet, say): the migrator
    /// then runs and says what is wrong.
    async fn has_every_migration(&self, migrator: &Migrator) -> bool {
        let Ok(applied) = self.recorded_migrations().await else { return false };
        migrator.iter().all(|migration| {
            applied.iter().any(|(version, checksum)| *version == migration.version && *checksum == *migration.checksum)
        })
    }

    /// Runs `sql` on one pooled connection and returns its rows. For tests and diagnosis of
    /// what lives in a database session (MariaDB's session status counters, PostgreSQL's
    /// not yet flushed statistics): with a pool of one connection it is the pool's session.
    /// The service never calls it.
    ///
    /// # Errors
    /// The driver error.
    #[doc(hidden)]
    pub async fn on_pooled_session(&self, sql: &str) -> Result<Vec<sqlx::any::AnyRow>, sqlx::Error> {
        let mut connection = self.acquire().await?;
        sqlx::query(sql).fetch_all(&mut *connection).await
    }

    /// Every text of PostgreSQL's group-commit write statement, each with how many parts it
    /// writes and how many parameters it binds: for tests of their plans. The service never
    /// calls it.
    #[doc(hidden)]
    pub fn postgres_write_statements() -> Vec<(usize, usize, &'static str)> {
        batch::postgres_write_statements()
    }

    /// Closes the pool, waiting for connections in use to come back.
    pub async fn close(&self) {
        self.warm.close();
        self.pool.close().await;
        self.probe.close().await;
    }

    /// Whether the database can serve writes now: it answers, on a Galera node the node is
    /// ready and Synced, and it accepts a write. Sets [`Store::up`] to the outcome. Bounded by
    /// [`PROBE_TIMEOUT`] (2 s), its connection included.
    ///
    /// On PostgreSQL and MySQL each check opens a new session and closes it after: a session
    /// keeps some settings from its start (PostgreSQL's `default_transaction_read_only`, set
    /// per database or role), so the check sees what a new pooled connection would get. SQLite
    /// keeps its connection: a file opened read-write stays writable, and it runs no write
    /// (below).
    ///
    /// A Galera node answers a ping, and even `SELECT 1`, while it is joining, donating a
    /// state transfer or cut off from the cluster's quorum, though it then refuses or stalls
    /// every write; so on Galera the check also asks that the node be ready (`wsrep_ready`)
    /// and Synced (`wsrep_local_state` 4; Galera manual, "Node State Changes").
    ///
    /// The write is `Dialect::write_check`: an UPDATE that matches no row, which the
    /// database refuses exactly when it refuses writes, and which writes nothing otherwise.
    ///
    /// # Errors
    /// [`Unhealthy`]: why the check failed.
    pub async fn check_health(&self) -> Result<(), Unhealthy> {
        let outcome =
            tokio::time::timeout(PROBE_TIMEOUT, self.probe_database()).await.unwrap_or(Err(Unhealthy::TimedOut));
        self.up.set(i64::from(outcome.is_ok()));
        outcome
    }

    async fn probe_database(&self) -> Result<(), Unhealthy> {
        if self.dialect == Dialect::Sqlite {
            // A connection SQLite dropped is found out here, and replaced: the pool pings the
            // connection it keeps.
            let mut connection = self.probe.acquire().await.map_err(Unhealthy::Unreachable)?;
            return self.probe_on(&mut connection).await;
        }
        // A new connection each time, made directly rather than through a pool, so that a
        // refusal is told in the database's words ("too many clients already", "the database
        // system is starting up") rather than as a pool's timeout. Closed when dropped, also
        // when the check is cancelled by its timeout.
        let mut connection = AnyConnection::connect_with(&self.probe_options).await.map_err(Unhealthy::Unreachable)?;
        let outcome = self.probe_on(&mut connection).await;
        let _ = connection.close().await;
        outcome
    }

    /// The health check's statements on `connection`.
    async fn probe_on(&self, connection: &mut AnyConnection) -> Result<(), Unhealthy> {
        if self.galera {
            let synced: i64 =
                sqlx::query_scalar(GALERA_SYNCED).fetch_one(&mut *connection).await.map_err(Unhealthy::Unreachable)?;
            if synced != 2 {
                return Err(Unhealthy::NotSynced);
            }
        }
        if let Some(write) = self.dialect.write_check(PROBE_LOCK_WAIT) {
            connection.execute(write.as_str()).await.map_err(|error| match error {
                sqlx::Error::Database(_) if dialect::classify(&error) == Fault::LockTimeout => {
                    Unhealthy::LockWait(error)
                }
                sqlx::Error::Database(_) => Unhealthy::RefusesWrites(error),
                error => Unhealthy::Unreachable(error),
            })?;
        }
        Ok(())
    }
}

/// Whether `url` names a SQLite file that does not exist (an in-memory database, or another
/// backend's URL, is never missing).
pub fn sqlite_file_missing(url: &str) -> bool {
    sqlite_file(url).is_some_and(|file| !file.exists())
}

/// The file of the SQLite database at `url`, or `None` (in memory, or another backend).
fn sqlite_file(url: &str) -> Option<std::path::PathBuf> {
    use std::str::FromStr as _;
    if Dialect::from_url(url) != Some(Dialect::Sqlite) {
        return None;
    }
    let in_memory = url.split_once('?').is_some_and(|(_, query)| query.split('&').any(|pair| pair == "mode=memory"));
    let options = sqlx::sqlite::SqliteConnectOptions::from_str(url).ok()?;
    let file = options.get_filename();
    let name = file.to_string_lossy();
    // sqlx names an in-memory database `:memory:`, or `file:sqlx-in-memory-<n>` when shared.
    let in_memory = in_memory || name.is_empty() || name == ":memory:" || name.starts_with("file:sqlx-in-memory-");
    (!in_memory).then(|| file.to_owned())
}

/// Takes an exclusive lock (`flock`) of `<file>-migrate.lock`, trying every 100 ms until
/// `deadline`. Never a lock of the database file itself: closing any descriptor of that file
/// would drop this process's SQLite (POSIX) locks on it (SQLite manual, "How To Corrupt An
/// SQLite Database File", 2.2).
async fn lock_file(file: &std::path::Path, deadline: Instant) -> Result<std::fs::File, Attempt> {
    let mut name = file.as_os_str().to_owned();
    name.push("-migrate.lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&name)
        // Not a wait: a directory that refuses the file refuses it at the next try too.
        .map_err(|error| {
            let why =
                format!("cannot open the SQLite migration lock {}: {error}", std::path::Path::new(&name).display());
            Attempt::Failed(sqlx::migrate::MigrateError::Execute(sqlx::Error::Configuration(why.into())))
        })?;
    let mut said = false;
    loop {
        match lock.try_lock() {
            Ok(()) => return Ok(lock),
            Err(std::fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                if !said {
                    let lock = std::path::Path::new(&name).display();
                    tracing::info!(%lock, "another instance is migrating the database; waiting for its lock");
                    said = true;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                let lock = std::path::Path::new(&name).display();
                return Err(Attempt::Busy(format!("another process holds the SQLite migration lock {lock}")));
            }
            Err(std::fs::TryLockError::Error(error)) => {
                let why = format!("cannot lock {}: {error}", std::path::Path::new(&name).display());
                return Err(Attempt::Failed(sqlx::migrate::MigrateError::Execute(sqlx::Error::Configuration(
                    why.into(),
                ))));
            }
        }
    }
}

/// 2 when a Galera node is ready for queries and Synced with its cluster, less otherwise.
const GALERA_SYNCED: &str = "SELECT CAST(COUNT(*) AS SIGNED) FROM information_schema.GLOBAL_STATUS \
     WHERE (VARIABLE_NAME = 'WSREP_READY' AND VARIABLE_VALUE = 'ON') \
        OR (VARIABLE_NAME = 'WSREP_LOCAL_STATE' AND VARIABLE_VALUE = '4')";

/// Whether the MySQL/MariaDB server behind `url` is a Galera cluster node: `wsrep_on` is ON
/// and a provider is loaded. MySQL has neither variable (no rows: false); MariaDB without a
/// cluster has `wsrep_on` OFF. Asked once at start, on [`first_connection`].
async fn is_galera_node(connection: &mut AnyConnection) -> Result<bool, sqlx::Error> {
    let variables: Vec<(String, String)> = sqlx::query_as(
        // SHOW, not information_schema.GLOBAL_VARIABLES, which MySQL 8 no longer has.
        "SHOW GLOBAL VARIABLES WHERE Variable_name IN ('wsrep_on', 'wsrep_provider')",
    )
    .fetch_all(&mut *connection)
    .await?;
    let value =
        |name: &str| variables.iter().find(|(key, _)| key.eq_ignore_ascii_case(name)).map(|(_, value)| value.as_str());
    Ok(value("wsrep_on") == Some("ON") && value("wsrep_provider").is_some_and(|provider| provider != "none"))
}

/// One plain connection to a database server before its pool is opened (no session setup,
/// no retries), within `timeout` (and, on MySQL, the Galera question asked on it within
/// another): a server that refuses the connection, or a login it rejects, is named at once
/// with the driver's own error ("Connection refused", "role ... does not exist"), where the
/// pool would say only "pool timed out" after its acquire timeout.
///
/// # Errors
/// [`ConnectError::Connect`] with the driver's error, or an I/O `TimedOut` error when
/// `timeout` passed first.
async fn first_connection(dialect: Dialect, url: &str, timeout: Duration) -> Result<AnyConnection, ConnectError> {
    let failed = |error| ConnectError::Connect(dialect::redacted(url), error);
    let options = connect_options(&dialect.driver_url(url, false), false)?;
    match tokio::time::timeout(timeout, AnyConnection::connect_with(&options)).await {
        Ok(connected) => connected.map_err(failed),
        Err(_) => Err(failed(timed_out("no connection", timeout))),
    }
}

/// An I/O `TimedOut` error: `what` within the pool's acquire timeout `timeout`.
fn timed_out(what: &str, timeout: Duration) -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("{what} within the pool's acquire timeout ({} ms)", timeout.as_millis()),
    ))
}

/// A write transaction. Dropping it without [`Tx::commit`] rolls it back.
pub struct Tx {
    transaction: Transaction<'static, Any>,
    dialect: Dialect,
    _write_permit: Option<OwnedSemaphorePermit>,
    /// Version CAS or conditional UPDATEs of this transaction that lost and were tried again.
    cas_retries: u32,
    /// On a Galera node, see [`Tx::still_open`].
    galera: bool,
    /// True once [`Tx::still_open`] has released the savepoint.
    checked: bool,
}

impl Tx {
    pub fn queries(&mut self) -> Queries<'_> {
        Queries::new(&mut self.transaction, self.dialect).counting(&mut self.cas_retries)
    }

    /// How many times [`Queries::count_cas_retry`] was called in this transaction.
    pub fn cas_retries(&self) -> u32 {
        self.cas_retries
    }

    /// On a Galera node, whether this is still the transaction that began: `Ok(false)` when
    /// the cluster aborted it without the database saying so (its savepoint is gone, see
    /// [`dialect::GALERA_BEGIN`]); the error when the database says so now (the deadlock 1213
    /// it reports on the statement after an abort: that error must not be lost, or the
    /// COMMIT that follows would succeed with nothing of the transaction in it). Always
    /// `Ok(true)` elsewhere. Asked once, before COMMIT or before any other outcome of the body
    /// is believed (it releases the savepoint).
    ///
    /// # Errors
    /// The driver error of the check.
    pub async fn still_open(&mut self) -> Result<bool, sqlx::Error> {
        if !self.galera || self.checked {
            return Ok(true);
        }
        self.checked = true;
        let connection: &mut AnyConnection = &mut self.transaction;
        match connection.execute(dialect::GALERA_TRANSACTION_MARK).await {
            Ok(_) => Ok(true),
            Err(sqlx::Error::Database(error))
                if error
                    .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                    .is_some_and(|mysql| mysql.number() == dialect::SAVEPOINT_DOES_NOT_EXIST) =>
            {
                Ok(false)
            }
            Err(error) => Err(error),
        }
    }

    /// Runs `sql` (text, no parameters) in this transaction. For tests of what the database
    /// does to a transaction under it; the service never calls it.
    ///
    /// # Errors
    /// The driver error.
    #[doc(hidden)]
    pub async fn on_session(&mut self, sql: &str) -> Result<u64, sqlx::Error> {
        let connection: &mut AnyConnection = &mut self.transaction;
        Ok(connection.execute(sql).await?.rows_affected())
    }

    /// Commits; on a Galera node, only the transaction that began ([`Tx::still_open`],
    /// unless the caller asked already): one the cluster aborted under it rolls back instead.
    ///
    /// # Errors
    /// The driver error, the transaction then rolled back by the database; on a Galera node
    /// whose cluster aborted the transaction, an I/O error (UNAVAILABLE: retry with the same
    /// key), after a rollback.
    pub async fn commit(mut self) -> Result<(), sqlx::Error> {
        if !self.still_open().await? {
            let _ = self.transaction.rollback().await;
            return Err(sqlx::Error::Io(std::io::Error::other("the Galera cluster aborted the transaction under it")));
        }
        self.transaction.commit().await
    }

    /// # Errors
    /// The driver error; the connection is then closed rather than returned to the pool.
    pub async fn rollback(self) -> Result<(), sqlx::Error> {
        self.transaction.rollback().await
    }
}

/// A read-only transaction whose reads all see one moment (see [`Store::snapshot`]). Dropped
/// before [`Snapshot::finish`] (a driver error, a cancelled future), its connection is closed
/// (gracefully) instead of going back to the pool inside the transaction.
pub struct Snapshot {
    /// Taken by `finish` or `drop`.
    connection: Option<PoolConnection<Any>>,
    dialect: Dialect,
}

impl Snapshot {
    pub fn queries(&mut self) -> Queries<'_> {
        let connection: &mut AnyConnection = self.connection.as_mut().expect("open until finished");
        Queries::new(connection, self.dialect)
    }

    /// Ends the read (it wrote nothing); the connection goes back to the pool.
    ///
    /// # Errors
    /// The driver error (the connection is then closed).
    pub async fn finish(mut self) -> Result<(), sqlx::Error> {
        let connection = self.connection.as_mut().expect("open until finished");
        connection.execute("COMMIT").await?;
        // Committed: the connection goes back to the pool.
        drop(self.connection.take());
        Ok(())
    }
}

impl Drop for Snapshot {
    fn drop(&mut self) {
        if let Some(mut connection) = self.connection.take() {
            connection.close_on_drop();
        }
    }
}

/// A pooled connection for reads.
pub struct Reader {
    connection: warm::Pooled,
    dialect: Dialect,
}

impl Reader {
    pub fn queries(&mut self) -> Queries<'_> {
        let connection: &mut AnyConnection = &mut self.connection;
        Queries::new(connection, self.dialect)
    }

    /// Checks that the database answers.
    ///
    /// # Errors
    /// The driver error.
    pub async fn ping(&mut self) -> Result<(), sqlx::Error> {
        self.connection.ping().await
    }

    /// Ends the reads, each of which succeeded (a statement that commits itself included): on
    /// PostgreSQL and SQLite the connection is kept warm, handed out first (see [`warm`]). A
    /// reader dropped without it (after an error, say) goes back through sqlx's pool, whose
    /// release ping closes a broken connection.
    pub fn release(mut self) {
        self.connection.released_clean();
    }
}
