//! Query plans on a grown ledger whose statistics are stale: no hot-path statement may scan a
//! hot table (`orders`, `payment_flow`, `refunds`, `accounts`, `journal_entries`,
//! `idempotency_record`) however the tables grew since the statistics were taken.
//!
//! Each backend's test:
//! 1. seeds a small ledger and analyzes it, so the statistics say every table is small (a
//!    second PostgreSQL test never analyzes it: no statistics at all, as after a restore);
//! 2. starts a server over a pool of one connection (on PostgreSQL, one replaced after a plan
//!    lifetime of 2 s) and runs every bench scenario (Pay, keyed
//!    Pay, keyed Transfer, replay, hot account, Refund, hot Refund, Query, and the mix with
//!    Deposit, holds and Withdraw), so that connection has prepared, and PostgreSQL has
//!    planned, every hot statement;
//! 3. grows the tables in bulk (`payledger-tools seed`), without analyzing them;
//! 4. runs the same scenarios again (on MariaDB and SQLite on the same connection; on
//!    PostgreSQL once the plan lifetime has passed) and reads the database's own counters of
//!    what those statements did:
//!    - PostgreSQL: `pg_stat_user_tables.seq_scan` of each hot table, and the rows read from it
//!      by scans and through its indexes (fewer than half its rows unless a statement read a
//!      whole table or index), after the server's session has flushed its statistics
//!      (`pg_stat_force_next_flush()`);
//!    - MariaDB: the rows each hot table gave (`information_schema.TABLE_STATISTICS`, with
//!      `userstat` on), fewer than half its rows unless a statement scanned it (the session's
//!      `Handler_read_rnd_next` also counts the rows of the batch statements' `JSON_TABLE`);
//!    - SQLite (plans are fixed when a statement is prepared, from `sqlite_stat1`): `EXPLAIN
//!      QUERY PLAN` of every statement the server ran, taken from sqlx's statement log.
//!
//! Beside them, PostgreSQL's group-commit write statement, in each of its shapes, is planned
//! as the server's sessions plan it (generic), and its plan must set up one subplan a part.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use payledger::store::Dialect;
use payledger_tools::seed::{seed, SeedSettings};
use sqlx::{AnyPool, Connection, Row};

/// How long the server's PostgreSQL connection keeps its plans (`--plan-lifetime-seconds`).
const PLAN_LIFETIME: Duration = Duration::from_secs(2);

const HOT_TABLES: [&str; 7] =
    ["orders", "payment_flow", "refunds", "accounts", "journal_entries", "idempotency_record", "deposits"];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_hot_paths_never_scan_a_grown_ledger_with_stale_statistics() {
    postgres_hot_paths_never_scan(Statistics::Stale).await;
}

/// As a database just restored, or one whose autovacuum is off, holds: no statistics at all,
/// so that PostgreSQL guesses the selectivity of every condition on a column (0.5% of the
/// rows a value for equality) and a lookup by a column that is not unique on its own, of a
/// dozen values, looks like a large share of the table. The scenarios run at 16 callers, so
/// that batches hold up to 16 calls, on a ledger grown to 30,000 rows or more a hot table.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_hot_paths_never_scan_a_grown_ledger_never_analyzed() {
    postgres_hot_paths_never_scan(Statistics::None).await;
}

/// PostgreSQL's group-commit write statement, in every shape it takes, counts each part's rows
/// once: its plan sets up one subplan a part (the counts the statement checks), not one a
/// reference to them, which PostgreSQL would make of an inlined CTE (32 for a Pay's four
/// parts, each set up at every execution). Planned generic, as the server's sessions plan it.
#[tokio::test]
async fn postgres_write_statements_set_up_one_subplan_a_part() {
    let Some(admin) = common::admin_url("PAYLEDGER_TEST_POSTGRES_URL") else { return };
    let database = common::ServerDatabase::create(&admin, "writeplan").await;
    let store =
        payledger::store::Store::connect(&database.url, &common::small_pool(Duration::from_secs(5))).await.unwrap();
    store.migrate().await.unwrap();
    store.close().await;
    let mut connection = sqlx::AnyConnection::connect(&database.url).await.unwrap();
    sqlx::raw_sql("SET plan_cache_mode = force_generic_plan").execute(&mut connection).await.unwrap();
    let statements = payledger::store::Store::postgres_write_statements();
    assert!(statements.len() >= 7, "each kind alone, keyed or not, and the mixed batch: {}", statements.len());
    for (index, (parts, parameters, text)) in statements.into_iter().enumerate() {
        sqlx::raw_sql(&format!("PREPARE write_{index}(bigint) AS {text}")).execute(&mut connection).await.unwrap();
        // `updated_at` (unused by the INSERTs alone) typed as the server binds it; empty
        // arrays: EXPLAIN plans the statement without running it.
        let arguments = std::iter::once("0").chain(std::iter::repeat_n("'{}'", parameters - 1)).collect::<Vec<_>>();
        let plan: Vec<String> = sqlx::raw_sql(&format!("EXPLAIN EXECUTE write_{index}({})", arguments.join(", ")))
            .fetch_all(&mut connection)
            .await
            .unwrap()
            .iter()
            .map(|row| row.get::<String, _>(0))
            .collect();
        let subplans = plan.iter().filter(|line| line.contains("InitPlan") || line.contains("SubPlan")).count();
        assert_eq!(subplans, parts, "{parts} parts, {subplans} subplans: {}\n{}", text, plan.join("\n"));
    }
    connection.close().await.unwrap();
    drop(database);
}

async fn postgres_hot_paths_never_scan(statistics: Statistics) {
    let Some(admin) = common::admin_url("PAYLEDGER_TEST_POSTGRES_URL") else { return };
    let database = common::ServerDatabase::create(&admin, "plans").await;
    let served = prepared_server(&database.url, statistics).await;
    let raw = AnyPool::connect(&database.url).await.unwrap();

    let flush =
        || async { served.ledger.store().on_pooled_session("SELECT 1 FROM pg_stat_force_next_flush()").await.unwrap() };
    let counters = || async {
        // Rows read: by sequential scans, and fetched through indexes (a plan that reads a
        // whole index, as a hash join over a full index scan would, counts no sequential scan).
        let rows = sqlx::query(
            "SELECT CAST(relname AS TEXT), seq_scan, COALESCE(idx_scan, 0), \
             seq_tup_read + COALESCE(idx_tup_fetch, 0) FROM pg_stat_user_tables",
        )
        .fetch_all(&raw)
        .await
        .unwrap();
        rows.iter()
            .map(|row| (row.get::<String, _>(0), (row.get::<i64, _>(1), row.get::<i64, _>(2), row.get::<i64, _>(3))))
            .collect::<BTreeMap<_, _>>()
    };
    flush().await;
    let before = counters().await;
    match statistics {
        Statistics::Stale => common::run_every_scenario(&served).await,
        // Batches of up to 16 calls: a batch statement's keys are then a large share of what
        // a guess without statistics makes of a table (16 values of a column not unique on
        // its own, guessed at 0.5% each, are 8% of the table). Not many more: a statement
        // that finds one row a key by a unique key (a nested loop of index lookups) costs, to
        // the planner, more than a hash join over a scan of a table of 30,000 rows once it
        // holds about 80 keys, the right choice at that size, not a guess.
        Statistics::None => common::run_every_scenario_at(&served, 16, 160).await,
    }
    flush().await;
    let after = counters().await;

    let mut scanned = Vec::new();
    for table in HOT_TABLES {
        let (seq_before, _, read_before) = before[table];
        let (seq_after, _, read_after) = after[table];
        let rows: i64 = sqlx::query(&format!("SELECT COUNT(*) FROM {table}")).fetch_one(&raw).await.unwrap().get(0);
        if seq_after != seq_before {
            scanned.push(format!("{table}: {} sequential scans of {rows} rows", seq_after - seq_before));
        }
        // The scenarios look up a few hundred rows a table; a plan that read a whole table (or
        // index) once would read more than half of its rows.
        if read_after - read_before >= rows / 2 {
            scanned.push(format!("{table}: {} rows read of {rows}", read_after - read_before));
        }
    }
    // The counters moved: these are the server session's statistics, flushed.
    assert!(after["orders"].1 > before["orders"].1, "no index scans of orders counted: {before:?} {after:?}");
    assert!(scanned.is_empty(), "hot statements scanned grown tables: {scanned:?}");
    raw.close().await;
    served.finish().await;
    drop(database);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_hot_paths_never_scan_a_grown_ledger_with_stale_statistics() {
    let Some(admin) = common::admin_url("PAYLEDGER_TEST_MYSQL_URL") else { return };
    let database = common::ServerDatabase::create(&admin, "plans").await;
    let served = prepared_server(&database.url, Statistics::Stale).await;

    // The batch statements read their rows from JSON_TABLE, and those reads count in the
    // session's Handler_read_rnd_next as a table scan's would; so the rows each hot table
    // gave are taken from the server's per-table statistics (MariaDB's `userstat`), and a
    // table gave fewer than half its rows unless a statement scanned it.
    let raw = AnyPool::connect(&database.url).await.unwrap();
    let rows_read = || async {
        let rows = sqlx::query(
            "SELECT CAST(TABLE_NAME AS CHAR), CAST(ROWS_READ AS SIGNED) FROM information_schema.TABLE_STATISTICS \
             WHERE TABLE_SCHEMA = DATABASE()",
        )
        .fetch_all(&raw)
        .await
        .unwrap();
        rows.iter().map(|row| (row.get::<String, _>(0), row.get::<i64, _>(1))).collect::<BTreeMap<_, _>>()
    };
    sqlx::query("SET GLOBAL userstat = 1").execute(&raw).await.unwrap();
    let before = rows_read().await;
    common::run_every_scenario(&served).await;
    let after = rows_read().await;
    let mut scanned = Vec::new();
    for table in HOT_TABLES {
        let read = after.get(table).copied().unwrap_or(0) - before.get(table).copied().unwrap_or(0);
        let count: i64 = sqlx::query(&format!("SELECT COUNT(*) FROM {table}")).fetch_one(&raw).await.unwrap().get(0);
        if read >= count / 2 {
            scanned.push(format!("{table}: {read} rows read of {count}"));
        }
    }
    assert!(after.get("orders").copied().unwrap_or(0) > before.get("orders").copied().unwrap_or(0), "{after:?}");
    assert!(scanned.is_empty(), "hot statements scanned grown tables: {scanned:?}");
    sqlx::query("SET GLOBAL userstat = 0").execute(&raw).await.unwrap();
    raw.close().await;
    served.finish().await;
    drop(database);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_hot_paths_never_scan_a_grown_ledger_with_stale_statistics() {
    let directory = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", directory.path().join("ledger.db").display());
    let log = statement_log();
    let served = prepared_server(&url, Statistics::Stale).await;

    log.statements.lock().unwrap().clear();
    log.capturing.store(true, Ordering::SeqCst);
    common::run_every_scenario(&served).await;
    log.capturing.store(false, Ordering::SeqCst);
    let statements = std::mem::take(&mut *log.statements.lock().unwrap());

    let mut connection = sqlx::AnyConnection::connect(&format!("{url}?mode=ro")).await.unwrap();
    let mut scans = Vec::new();
    let mut searched = BTreeSet::new();
    for statement in &statements {
        let plan = sqlx::raw_sql(&format!("EXPLAIN QUERY PLAN {statement}")).fetch_all(&mut connection).await.unwrap();
        for row in plan {
            let detail: String = row.get(3);
            let mut words = detail.split_whitespace();
            match (words.next(), words.next()) {
                (Some("SCAN"), Some(table)) if HOT_TABLES.contains(&table) => {
                    scans.push(format!("{detail}: {statement}"))
                }
                (Some("SEARCH"), Some(table)) => {
                    searched.insert(table.to_owned());
                }
                _ => {}
            }
        }
    }
    connection.close().await.unwrap();
    assert!(
        ["orders", "payment_flow", "refunds", "accounts"].iter().all(|table| searched.contains(*table)),
        "the log holds the workload's lookups ({} statements, searched {searched:?})",
        statements.len()
    );
    assert!(scans.is_empty(), "hot statements scan hot tables: {scans:#?}");
    served.finish().await;
}

/// What the database knows of its tables when they grow.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Statistics {
    /// Taken of the small ledger, before it grew.
    Stale,
    /// Never taken.
    None,
}

/// Steps 1 to 3 of the module docs: a small ledger (analyzed, unless `statistics` says
/// none), a server over one connection that has run every statement on it, then the tables
/// grown behind that server's back.
async fn prepared_server(url: &str, statistics: Statistics) -> common::Served {
    seed_ledger(url, 200).await;
    let dialect = Dialect::from_url(url).unwrap();
    let mut connection = sqlx::AnyConnection::connect(url).await.unwrap();
    match (dialect, statistics) {
        (Dialect::Postgres, Statistics::None) => {
            // Not even autovacuum's: whatever the server's setting, these tables keep none.
            for table in HOT_TABLES {
                let off = format!("ALTER TABLE {table} SET (autovacuum_enabled = false)");
                sqlx::raw_sql(&off).execute(&mut connection).await.unwrap();
            }
        }
        (_, Statistics::None) => {}
        (Dialect::Postgres | Dialect::Sqlite, Statistics::Stale) => {
            sqlx::raw_sql("ANALYZE").execute(&mut connection).await.unwrap();
        }
        (Dialect::MySql, Statistics::Stale) => {
            let tables = HOT_TABLES.join(", ");
            sqlx::raw_sql(&format!("ANALYZE TABLE {tables}")).fetch_all(&mut connection).await.unwrap();
        }
    }
    connection.close().await.unwrap();

    let served = common::serve_planned_for(url, 1, PLAN_LIFETIME).await;
    common::run_every_scenario(&served).await;
    match statistics {
        Statistics::Stale => seed_ledger(url, 30_000).await,
        // Every hot table tens of thousands of rows: refunds and records too, so that a scan of
        // any of them is one of a large table (a hash join over a scan of a few thousand rows
        // can be the planner's right choice for a batch of a dozen keys).
        Statistics::None => grow_every_hot_table(url).await,
    }
    if dialect == Dialect::Postgres {
        // The plans made on the small ledger outlive its growth by one plan lifetime at most.
        tokio::time::sleep(PLAN_LIFETIME + Duration::from_millis(500)).await;
    }
    served
}

/// Adds `orders` paid orders (a tenth refunded), each by a payer of its own, and as many
/// idempotency records as refunds. Grown this way, `accounts` is as big as `orders`: a scan
/// of a table of a few thousand rows can be the planner's right choice for a statement that
/// locks a dozen of them.
async fn seed_ledger(url: &str, orders: u64) {
    let settings = SeedSettings {
        database_url: url.to_owned(),
        allow_test_data: true,
        orders,
        payers: orders,
        merchants: 20,
        refunded_percent: 10,
        idempotency_records: None,
        batch_rows: 10_000,
        progress: payledger::config::Progress::Never,
    };
    seed(&settings).await.unwrap();
}

/// As [`seed_ledger`] of 30,000 orders, every one of them refunded, and 30,000 idempotency
/// records: every hot table then holds 30,000 rows or more.
async fn grow_every_hot_table(url: &str) {
    let settings = SeedSettings {
        database_url: url.to_owned(),
        allow_test_data: true,
        orders: 30_000,
        payers: 30_000,
        merchants: 20,
        refunded_percent: 100,
        idempotency_records: Some(30_000),
        batch_rows: 10_000,
        progress: payledger::config::Progress::Never,
    };
    seed(&settings).await.unwrap();
}

/// The statements SQLite ran while `capturing`: sqlx logs each one (target `sqlx::query`)
/// on the SQLite worker thread of its connection.
struct StatementLog {
    capturing: AtomicBool,
    statements: Mutex<BTreeSet<String>>,
}

fn statement_log() -> &'static StatementLog {
    static LOG: OnceLock<&'static StatementLog> = OnceLock::new();
    LOG.get_or_init(|| {
        use tracing_subscriber::layer::SubscriberExt;
        let log: &'static StatementLog =
            Box::leak(Box::new(StatementLog { capturing: AtomicBool::new(false), statements: Mutex::default() }));
        let subscriber = tracing_subscriber::registry().with(StatementLayer(log));
        tracing::subscriber::set_global_default(subscriber).expect("no other subscriber in this test binary");
        log
    })
}

struct StatementLayer(&'static StatementLog);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for StatementLayer {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let on_sqlite_worker = std::thread::current().name().is_some_and(|name| name.starts_with("sqlx-sqlite-worker"));
        if event.metadata().target() != "sqlx::query" || !on_sqlite_worker || !self.0.capturing.load(Ordering::SeqCst) {
            return;
        }
        let mut fields = StatementFields::default();
        event.record(&mut fields);
        // sqlx logs the whole statement as `db.statement` unless `summary` already is all of it.
        let statement = if fields.statement.trim().is_empty() { fields.summary } else { fields.statement };
        let statement = statement.trim().to_owned();
        if !statement.is_empty() {
            self.0.statements.lock().unwrap().insert(statement);
        }
    }
}

#[derive(Default)]
struct StatementFields {
    summary: String,
    statement: String,
}

impl tracing::field::Visit for StatementFields {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        match field.name() {
            "summary" => self.summary = value.to_owned(),
            "db.statement" => self.statement = value.to_owned(),
            _ => {}
        }
    }

    fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
}
