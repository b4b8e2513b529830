//! Schema changes a platform can run safely: several instances starting at once over one
//! empty database all come up, on every backend, round after round, also right after a
//! `payledger migrate` killed part way; a MySQL migration interrupted at any of its
//! statements is completed by the next start; an older release starts on a newer schema;
//! `serve --migrations check` waits for `payledger migrate`.

use crate::common;

use std::time::Duration;

use common::{admin_url, database_url, history, instances_start_together_and_serve, migrate_killed_after, small_pool};

use payledger::ledger::Ledger;
use payledger::store::Store;
use sqlx::migrate::Migrator;
use sqlx::{AnyPool, Row};

/// Per round: a fresh database, `payledger migrate` killed in every other round once it has
/// applied a random number of the migrations (so part way through the next one, or between
/// two), then four instances at once
/// ([`instances_start_together_and_serve`]). Says how the kills left the history.
async fn rounds_of_starts(admin_url: &str) {
    sqlx::any::install_default_drivers();
    let rounds = common::start_rounds();
    let total = common::migration_count(admin_url);
    let mut left = Vec::new();
    for round in 0..rounds {
        let database = common::ServerDatabase::create(admin_url, "starts").await;
        if round % 2 == 1 {
            migrate_killed_after(&database.url, rand::random_range(0..total)).await;
            left.push(history(&database.url).await);
        }
        instances_start_together_and_serve(std::slice::from_ref(&database.url), 4).await;
    }
    let part_way = left.iter().filter(|(applied, begun)| *begun > 0 || (*applied > 0 && *applied < total)).count();
    eprintln!(
        "{rounds} rounds of four starts at once; {} after a killed `payledger migrate`, which left \
         (applied, begun) of {total} migrations: {left:?}, {part_way} of them part way",
        left.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn instances_starting_together_on_postgres_all_come_up_round_after_round() {
    if let Some(url) = admin_url("PAYLEDGER_TEST_POSTGRES_URL") {
        rounds_of_starts(&url).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn instances_starting_together_on_mysql_all_come_up_round_after_round() {
    if let Some(url) = admin_url("PAYLEDGER_TEST_MYSQL_URL") {
        rounds_of_starts(&url).await;
    }
}

/// During a rolling deploy an instance of an older release may start after a newer one has
/// migrated: a migration it does not know is ignored, not refused.
#[tokio::test]
async fn an_instance_starts_on_a_database_migrated_by_a_newer_release() {
    sqlx::any::install_default_drivers();
    let directory = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", directory.path().join("ledger.db").display());
    let settings = small_pool(Duration::from_secs(5));
    let store = Store::connect(&url, &settings).await.unwrap();
    store.migrate().await.unwrap();
    let raw = AnyPool::connect(&url).await.unwrap();
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (99990101000000, 'of a newer release', 1, X'00', 1)",
    )
    .execute(&raw)
    .await
    .unwrap();

    let again = store.migrate().await;

    raw.close().await;
    store.close().await;
    again.expect("a migration of a newer release is ignored");
}

/// A ledger as the release before `created_by` wrote it: a deposit, a transfer, and a paid,
/// partly refunded order, with their journal entries.
const LEGACY_ROWS: [&str; 7] = [
    "INSERT INTO accounts (account_id, currency, kind, balance, version, created_at, updated_at) VALUES \
     ('@external:USD', 'USD', 'EXTERNAL', -500, 1, 1, 1), ('alice', 'USD', 'CUSTOMER', 360, 4, 1, 4), \
     ('bob', 'USD', 'CUSTOMER', 140, 3, 1, 4)",
    "INSERT INTO deposits (request_id, deposit_id, account_id, amount, currency, created_at) \
     VALUES ('d-1', 'D1', 'alice', 500, 'USD', 1)",
    "INSERT INTO transfers (transfer_id, from_account_id, to_account_id, amount, currency, memo, created_at) \
     VALUES ('X1', 'alice', 'bob', 100, 'USD', 'rent', 2)",
    "INSERT INTO orders (merchant_id, order_no, payee_account_id, amount, currency, subject, status, out_trade_no, \
     refunded_amount, created_at, updated_at) VALUES ('m1', 'o-1', 'bob', 50, 'USD', 'tea', 'PARTIALLY_REFUNDED', \
     't-1', 10, 3, 4)",
    "INSERT INTO payment_flow (trade_no, merchant_id, out_trade_no, order_no, payer_account_id, payee_account_id, \
     amount, currency, status, created_at) VALUES ('T1', 'm1', 't-1', 'o-1', 'alice', 'bob', 50, 'USD', 'SUCCEEDED', 3)",
    "INSERT INTO refunds (refund_no, merchant_id, out_refund_no, out_trade_no, order_no, amount, currency, reason, \
     created_at) VALUES ('R1', 'm1', 'r-1', 't-1', 'o-1', 10, 'USD', 'late', 4)",
    "INSERT INTO journal_entries (account_id, currency, amount, balance_after, version_after, kind, reference, \
     posting_id, counterparty_account_id, created_at) VALUES \
     ('@external:USD', 'USD', -500, -500, 1, 'DEPOSIT', 'd-1', 'D1', 'alice', 1), \
     ('alice', 'USD', 500, 500, 1, 'DEPOSIT', 'd-1', 'D1', '@external:USD', 1), \
     ('alice', 'USD', -100, 400, 2, 'TRANSFER', 'X1', 'X1', 'bob', 2), \
     ('bob', 'USD', 100, 100, 1, 'TRANSFER', 'X1', 'X1', 'alice', 2), \
     ('alice', 'USD', -50, 350, 3, 'PAY', 't-1', 'T1', 'bob', 3), \
     ('bob', 'USD', 50, 150, 2, 'PAY', 't-1', 'T1', 'alice', 3), \
     ('bob', 'USD', -10, 140, 3, 'REFUND', 'r-1', 'R1', 'alice', 4), \
     ('alice', 'USD', 10, 360, 4, 'REFUND', 'r-1', 'R1', 'bob', 4)",
];

/// The tables that gained `created_by`, with their row counts in [`LEGACY_ROWS`].
const CREATED_BY_TABLES: [(&str, i64); 5] =
    [("payment_flow", 1), ("refunds", 1), ("deposits", 1), ("transfers", 1), ("journal_entries", 8)];

/// Migrates a database written by the release before `created_by` (schema up to 0003, with
/// rows) to this release's schema: nothing is lost, older rows say `unknown`, and the audit
/// still holds.
async fn upgrade_keeps_rows_and_marks_their_creator_unknown(url: &str, directory: &str) {
    sqlx::any::install_default_drivers();
    let settings = small_pool(Duration::from_secs(10));
    let raw = AnyPool::connect(url).await.unwrap();
    let mut previous = Migrator::new(std::path::Path::new(directory)).await.unwrap();
    previous.migrations = previous.migrations.iter().filter(|migration| migration.version <= 3).cloned().collect();
    assert_eq!(previous.migrations.len(), 3);
    previous.run(&raw).await.unwrap();
    for statement in LEGACY_ROWS {
        sqlx::query(statement).execute(&raw).await.unwrap_or_else(|error| panic!("{statement}: {error}"));
    }

    let store = Store::connect(url, &settings).await.unwrap();
    store.migrate().await.expect("the release with created_by migrates the older database");

    for (table, rows) in CREATED_BY_TABLES {
        let count = |filter: &str| {
            let sql = format!("SELECT COUNT(*) FROM {table}{filter}");
            let raw = raw.clone();
            async move { sqlx::query(&sql).fetch_one(&raw).await.unwrap().get::<i64, _>(0) }
        };
        let (all, unknown) = (count("").await, count(" WHERE created_by = 'unknown'").await);
        assert_eq!((all, unknown), (rows, rows), "{table}");
    }
    let ledger = Ledger::new(store);
    assert_eq!(ledger.audit().await.unwrap(), Vec::new(), "the upgraded ledger is consistent");
    ledger.store().close().await;
    raw.close().await;
}

#[tokio::test]
async fn an_upgrade_to_created_by_keeps_every_row_on_sqlite() {
    let directory = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}?mode=rwc", directory.path().join("ledger.db").display());
    upgrade_keeps_rows_and_marks_their_creator_unknown(&url, "migrations/sqlite").await;
}

async fn on_server(variable: &str, directory: &'static str) {
    let Some(admin_url) = admin_url(variable) else { return };
    sqlx::any::install_default_drivers();
    let name = format!("payledger_upgrade_{}", uuid::Uuid::new_v4().simple());
    let admin = AnyPool::connect(&admin_url).await.unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await.unwrap();
    let url = database_url(&admin_url, &name);
    let outcome =
        tokio::spawn(async move { upgrade_keeps_rows_and_marks_their_creator_unknown(&url, directory).await }).await;
    let force = if variable.contains("POSTGRES") { " WITH (FORCE)" } else { "" };
    let _ = sqlx::query(&format!("DROP DATABASE {name}{force}")).execute(&admin).await;
    admin.close().await;
    outcome.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_to_created_by_keeps_every_row_on_postgres() {
    on_server("PAYLEDGER_TEST_POSTGRES_URL", "migrations/postgres").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_to_created_by_keeps_every_row_on_mysql() {
    on_server("PAYLEDGER_TEST_MYSQL_URL", "migrations/mysql").await;
}

/// A ledger that has every migration of this release starts on a read-only PostgreSQL
/// database (a standby, or one closed to writes during an incident) and serves reads; sqlx's
/// migrator alone would first try to create its history table, which read-only refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migrated_ledger_starts_on_a_read_only_postgres_database() {
    let Some(admin_url) = admin_url("PAYLEDGER_TEST_POSTGRES_URL") else { return };
    sqlx::any::install_default_drivers();
    let name = format!("payledger_readonly_{}", uuid::Uuid::new_v4().simple());
    let admin = AnyPool::connect(&admin_url).await.unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await.unwrap();
    let url = database_url(&admin_url, &name);
    let settings = small_pool(Duration::from_secs(10));
    let migrated = Store::connect(&url, &settings).await.unwrap();
    migrated.migrate().await.unwrap();
    migrated.close().await;
    sqlx::query(&format!("ALTER DATABASE {name} SET default_transaction_read_only = on"))
        .execute(&admin)
        .await
        .unwrap();

    let started = async {
        let store = Store::connect(&url, &settings).await?;
        store.migrate().await?;
        let ledger = Ledger::new(store);
        let audit = ledger.audit().await;
        ledger.store().close().await;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(audit?)
    }
    .await;
    let _ = sqlx::query(&format!("DROP DATABASE {name} WITH (FORCE)")).execute(&admin).await;
    admin.close().await;
    let audit = started.expect("a migrated ledger starts on a read-only database");
    assert_eq!(audit, Vec::new(), "and serves reads");
}

/// `serve` as its command line sets it up.
fn serve_settings(args: &[&str]) -> payledger::config::ServeSettings {
    #[derive(clap::Parser)]
    struct Serve {
        #[command(flatten)]
        settings: payledger::config::ServeSettings,
    }
    use clap::Parser as _;
    Serve::try_parse_from(std::iter::once("serve").chain(args.iter().copied())).unwrap().settings
}

/// `payledger migrate`, then `serve --migrations check`: a server told to check refuses a
/// database that lacks a migration, naming the command that applies them, and starts once
/// `migrate` has run.
async fn migrate_then_serve_checking(url: &str) {
    let settings = serve_settings(&["--listen", "127.0.0.1:0", "--database-url", url, "--migrations", "check"]);
    let refused = payledger::startup::Application::build(&settings).await.err().expect("an empty schema is refused");
    let refused = payledger::startup::error_chain(&refused);
    assert!(refused.contains("lacks migrations") && refused.contains("payledger migrate"), "{refused}");
    if let Some(path) = url.strip_prefix("sqlite:") {
        assert!(!std::path::Path::new(path).exists(), "checking a missing SQLite file leaves none behind");
    }

    let migrate = tokio::process::Command::new(env!("CARGO_BIN_EXE_payledger"))
        .args(["migrate", "--database-url", url, "--database-wait-seconds", "0"])
        .output()
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&migrate.stderr);
    assert!(migrate.status.success(), "{said}");
    assert!(said.contains("migrations 1, ") && said.contains("is complete"), "{said}");
    let again = tokio::process::Command::new(env!("CARGO_BIN_EXE_payledger"))
        .args(["migrate", "--database-url", url, "--database-wait-seconds", "0"])
        .output()
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&again.stderr);
    assert!(again.status.success() && said.contains("nothing to apply"), "migrate twice: {said}");

    let application = payledger::startup::Application::build(&settings).await.expect("a complete schema is served");
    drop(application);

    // A migration recorded with other contents (another build's) is named as such, not as
    // missing: `payledger migrate` cannot mend it.
    let pool = AnyPool::connect(url).await.unwrap();
    let last: i64 = sqlx::query_scalar("SELECT MAX(version) FROM _sqlx_migrations").fetch_one(&pool).await.unwrap();
    let checksum: Vec<u8> =
        sqlx::query_scalar(&format!("SELECT checksum FROM _sqlx_migrations WHERE version = {last}"))
            .fetch_one(&pool)
            .await
            .unwrap();
    let placeholder = if url.starts_with("postgres") { "$1" } else { "?" };
    let set_checksum = format!("UPDATE _sqlx_migrations SET checksum = {placeholder} WHERE version = {last}");
    sqlx::query(&set_checksum).bind(vec![0_u8; checksum.len()]).execute(&pool).await.unwrap();
    let refused =
        payledger::startup::Application::build(&settings).await.err().expect("a changed migration is refused");
    let refused = payledger::startup::error_chain(&refused);
    assert!(refused.contains(&format!("records migrations {last} with other contents")), "{refused}");
    sqlx::query(&set_checksum).bind(checksum).execute(&pool).await.unwrap();
    pool.close().await;
}

/// A SQLite database in a directory that does not exist is refused naming the directory
/// (SQLite itself says only "unable to open database file"), and nothing is created.
#[tokio::test]
async fn a_sqlite_file_in_a_missing_directory_names_the_directory() {
    let directory = tempfile::tempdir().unwrap();
    let missing = directory.path().join("not-made");
    let url = format!("sqlite:{}", missing.join("ledger.db").display());
    let refused = Store::connect(&url, &small_pool(Duration::from_secs(1))).await.err().expect("no such directory");
    let said = payledger::startup::error_chain(&refused);
    assert!(said.contains(&format!("the directory {} does not exist", missing.display())), "{said}");
    assert!(!missing.exists());
}

/// `serve --migrations check` as a role that may not read the migration history says so,
/// rather than that the (complete) schema lacks every migration. PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_that_cannot_read_the_history_says_so() {
    let Some(admin_url) = admin_url("PAYLEDGER_TEST_POSTGRES_URL") else { return };
    sqlx::any::install_default_drivers();
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let (name, role) = (format!("payledger_grants_{suffix}"), format!("payledger_reader_{}", &suffix[..12]));
    let admin = AnyPool::connect(&admin_url).await.unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await.unwrap();
    sqlx::query(&format!("CREATE ROLE {role} LOGIN")).execute(&admin).await.unwrap();
    let owner_url = database_url(&admin_url, &name);
    let migrated = tokio::process::Command::new(env!("CARGO_BIN_EXE_payledger"))
        .args(["migrate", "--database-url", &owner_url, "--database-wait-seconds", "0"])
        .output()
        .await
        .unwrap();
    assert!(migrated.status.success(), "{}", String::from_utf8_lossy(&migrated.stderr));
    let (before, rest) = owner_url.split_once("://").unwrap();
    let host = rest.split_once('@').map_or(rest, |(_, host)| host);
    let role_url = format!("{before}://{role}@{host}");
    let settings = serve_settings(&["--listen", "127.0.0.1:0", "--database-url", &role_url, "--migrations", "check"]);
    let refused = payledger::startup::Application::build(&settings).await.err().expect("the history is not readable");
    let refused = payledger::startup::error_chain(&refused);
    assert!(
        refused.contains("cannot read the migration history") && refused.contains("permission denied"),
        "{refused}"
    );
    assert!(!refused.contains("lacks migrations"), "{refused}");
    let _ = sqlx::query(&format!("DROP DATABASE {name} WITH (FORCE)")).execute(&admin).await;
    let _ = sqlx::query(&format!("DROP ROLE {role}")).execute(&admin).await;
    admin.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_then_serve_checking_the_schema_on_every_backend() {
    sqlx::any::install_default_drivers();
    let directory = tempfile::tempdir().unwrap();
    migrate_then_serve_checking(&format!("sqlite:{}", directory.path().join("ledger.db").display())).await;
    for variable in ["PAYLEDGER_TEST_POSTGRES_URL", "PAYLEDGER_TEST_MYSQL_URL"] {
        let Some(admin_url) = admin_url(variable) else { continue };
        let name = format!("payledger_check_{}", uuid::Uuid::new_v4().simple());
        let admin = AnyPool::connect(&admin_url).await.unwrap();
        sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await.unwrap();
        migrate_then_serve_checking(&database_url(&admin_url, &name)).await;
        let _ = sqlx::query(&format!("DROP DATABASE {name}")).execute(&admin).await;
        admin.close().await;
    }
}

/// The statements of a MySQL migration file as its author wrote them: each ends at a line,
/// not a comment, that ends with `;` (split here independently of payledger's own splitter),
/// with whether it is a data statement.
fn written_statements(sql: &str) -> Vec<(String, bool)> {
    let (mut statements, mut current) = (Vec::new(), String::new());
    for line in sql.lines() {
        if line.trim_start().starts_with("--") {
            continue;
        }
        current.push_str(line);
        current.push('\n');
        if line.trim_end().ends_with(';') {
            let statement = std::mem::take(&mut current);
            let first = statement.split_whitespace().next().unwrap_or_default().to_ascii_uppercase();
            let data = matches!(first.as_str(), "INSERT" | "UPDATE" | "DELETE" | "REPLACE");
            statements.push((statement, data));
        }
    }
    assert!(current.trim().is_empty(), "a migration ends with a statement");
    statements
}

/// What a MySQL database holds, for comparison: every column (type, nullability, default,
/// position, character set and collation), index column, constraint (with its CHECK clause
/// or the key it references), and the row count of every table but payledger's own
/// migration bookkeeping.
async fn mysql_contents(pool: &AnyPool) -> Vec<String> {
    // Long text from information_schema reaches the Any driver as bytes.
    let contents: Vec<Vec<u8>> = sqlx::query_scalar(
        "SELECT CAST(CONCAT_WS('|', 'column', TABLE_NAME, COLUMN_NAME, COLUMN_TYPE, IS_NULLABLE, \
                COALESCE(COLUMN_DEFAULT, 'none'), CAST(ORDINAL_POSITION AS CHAR), \
                COALESCE(CHARACTER_SET_NAME, 'none'), COALESCE(COLLATION_NAME, 'none')) AS CHAR) \
         FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() \
         UNION ALL SELECT CAST(CONCAT_WS('|', 'index', TABLE_NAME, INDEX_NAME, CAST(SEQ_IN_INDEX AS CHAR), COLUMN_NAME, \
                CAST(NON_UNIQUE AS CHAR)) AS CHAR) \
         FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = DATABASE() \
         UNION ALL SELECT CAST(CONCAT_WS('|', 'constraint', TABLE_NAME, CONSTRAINT_NAME, CONSTRAINT_TYPE) AS CHAR) \
         FROM information_schema.TABLE_CONSTRAINTS WHERE TABLE_SCHEMA = DATABASE() \
         UNION ALL SELECT CAST(CONCAT_WS('|', 'check', TABLE_NAME, CONSTRAINT_NAME, CHECK_CLAUSE) AS CHAR) \
         FROM information_schema.CHECK_CONSTRAINTS WHERE CONSTRAINT_SCHEMA = DATABASE() \
         UNION ALL SELECT CAST(CONCAT_WS('|', 'reference', TABLE_NAME, CONSTRAINT_NAME, REFERENCED_TABLE_NAME, \
                UPDATE_RULE, DELETE_RULE) AS CHAR) \
         FROM information_schema.REFERENTIAL_CONSTRAINTS WHERE CONSTRAINT_SCHEMA = DATABASE()",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let mut contents: Vec<String> = contents
        .into_iter()
        .map(|line| String::from_utf8(line).unwrap())
        .filter(|line| !line.contains("|payledger_migration_"))
        .collect();
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT CAST(TABLE_NAME AS CHAR) FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() \
         AND TABLE_NAME NOT IN ('_sqlx_migrations', 'payledger_migration_progress', 'payledger_migration_lease')",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    for table in tables {
        let rows: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {table}")).fetch_one(pool).await.unwrap();
        contents.push(format!("rows|{table}|{rows}"));
    }
    contents.sort();
    contents
}

/// A database on the MySQL server of `admin_url` with the migrations before `version`
/// applied by sqlx's own migrator, holding [`LEGACY_ROWS`] from migration 3 on.
async fn migrated_before(admin_url: &str, version: i64) -> common::ServerDatabase {
    let database = common::ServerDatabase::create(admin_url, "cut").await;
    let raw = AnyPool::connect(&database.url).await.unwrap();
    for (upto, rows) in [((version - 1).min(3), true), (version - 1, false)] {
        let mut previous = Migrator::new(std::path::Path::new("migrations/mysql")).await.unwrap();
        previous.ignore_missing = true;
        previous.migrations =
            previous.migrations.iter().filter(|migration| migration.version <= upto).cloned().collect();
        previous.run(&raw).await.unwrap();
        if rows && version > 3 {
            for statement in LEGACY_ROWS {
                sqlx::query(statement).execute(&raw).await.unwrap();
            }
        }
    }
    raw.close().await;
    database
}

/// Writes `migration`'s history row as begun (`success = FALSE`), as sqlx's migrator and
/// payledger's both write it first.
async fn record_begun(pool: &AnyPool, migration: &sqlx::migrate::Migration) {
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (?, ?, FALSE, ?, -1)",
    )
    .bind(migration.version)
    .bind(&*migration.description)
    .bind(&*migration.checksum)
    .execute(pool)
    .await
    .unwrap();
}

/// [`migrated_before`] `version`, then `version` as a start of this release that died in it
/// leaves it: its history row begun, its first `applied` schema statements committed, and
/// its progress row saying `done` of them and, with `attempting`, that statement `done` was
/// being run (`applied` is `done`, or `done + 1` when the start died between a statement's
/// commit and its progress write).
async fn killed_at(
    admin_url: &str,
    version: i64,
    applied: usize,
    done: usize,
    attempting: bool,
) -> common::ServerDatabase {
    let database = migrated_before(admin_url, version).await;
    let raw = AnyPool::connect(&database.url).await.unwrap();
    let all = Migrator::new(std::path::Path::new("migrations/mysql")).await.unwrap();
    let migration = all.iter().find(|migration| migration.version == version).unwrap();
    // The progress table as the runner creates it.
    sqlx::query(
        "CREATE TABLE payledger_migration_progress (version BIGINT NOT NULL PRIMARY KEY, \
         statements_done INT NOT NULL, attempting INT NULL) ENGINE = InnoDB",
    )
    .execute(&raw)
    .await
    .unwrap();
    record_begun(&raw, migration).await;
    sqlx::query("INSERT INTO payledger_migration_progress (version, statements_done, attempting) VALUES (?, ?, ?)")
        .bind(version)
        .bind(i64::try_from(done).unwrap())
        .bind(attempting.then(|| i64::try_from(done).unwrap()))
        .execute(&raw)
        .await
        .unwrap();
    let schema: Vec<String> =
        written_statements(&migration.sql).into_iter().filter(|(_, data)| !data).map(|(sql, _)| sql).collect();
    for statement in schema.iter().take(applied) {
        sqlx::query(statement).execute(&raw).await.unwrap();
    }
    raw.close().await;
    database
}

/// The contents of a database migrated by sqlx's own migrator from start to end, with
/// [`LEGACY_ROWS`] written after migration 3.
async fn migrated_by_sqlx(admin_url: &str) -> Vec<String> {
    let database = migrated_before(admin_url, i64::MAX).await;
    let pool = AnyPool::connect(&database.url).await.unwrap();
    let contents = mysql_contents(&pool).await;
    pool.close().await;
    contents
}

/// Every MySQL migration interrupted at each of its statements (before it was begun, while it
/// ran, right after its commit and before its progress was written) and after the last one is
/// completed by the next start: the database then holds exactly what sqlx's migrator builds
/// without interruption, rows included.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_mysql_migration_interrupted_at_any_statement_is_completed_by_the_next_start() {
    use futures::StreamExt as _;
    let Some(admin_url) = admin_url("PAYLEDGER_TEST_MYSQL_URL") else { return };
    sqlx::any::install_default_drivers();
    let all = Migrator::new(std::path::Path::new("migrations/mysql")).await.unwrap();
    let count = i64::try_from(all.iter().count()).unwrap();
    let expected = migrated_by_sqlx(&admin_url).await;
    let mut cases: Vec<(i64, usize, usize, bool)> = Vec::new();
    for migration in all.iter() {
        let schema = written_statements(&migration.sql).iter().filter(|(_, data)| !data).count();
        for done in 0..=schema {
            cases.push((migration.version, done, done, false));
            if done < schema {
                cases.push((migration.version, done, done, true));
                cases.push((migration.version, done + 1, done, true));
            }
        }
    }
    let outcomes: Vec<Result<(), String>> = futures::stream::iter(cases.iter().copied())
        .map(|(version, applied, done, attempting)| {
            let (admin_url, expected) = (admin_url.clone(), &expected);
            async move {
                let case = format!(
                    "migration {version}, {applied} statements applied, {done} recorded, attempting {attempting}"
                );
                let database = killed_at(&admin_url, version, applied, done, attempting).await;
                let store = Store::connect(&database.url, &small_pool(Duration::from_secs(10))).await.unwrap();
                let migrated = store.migrate().await;
                store.close().await;
                migrated.map_err(|error| format!("{case}: {}", payledger::startup::error_chain(&error)))?;
                assert_eq!(history(&database.url).await, (count, 0), "{case}");
                let pool = AnyPool::connect(&database.url).await.unwrap();
                let mut contents = mysql_contents(&pool).await;
                pool.close().await;
                let mut expected = expected.clone();
                if version <= 3 {
                    // Rows are written from migration 3 on.
                    contents.retain(|line| !line.starts_with("rows|"));
                    expected.retain(|line| !line.starts_with("rows|"));
                }
                if contents != expected {
                    let differ: Vec<_> = contents.iter().filter(|line| !expected.contains(line)).collect();
                    let lacks: Vec<_> = expected.iter().filter(|line| !contents.contains(line)).collect();
                    return Err(format!("{case}: has {differ:?}, lacks {lacks:?}"));
                }
                Ok(())
            }
        })
        .buffer_unordered(4)
        .collect()
        .await;
    let failures: Vec<String> = outcomes.into_iter().filter_map(Result::err).collect();
    assert!(failures.is_empty(), "{} of {} cuts: {failures:#?}", failures.len(), cases.len());
    eprintln!("{} cuts completed", cases.len());
}

/// "Already there" is taken as done only for the statement a dead start may have committed:
/// an operator's table in the way of a migration stops every start, with the database's
/// error, until it is moved; then the next start completes the migration. And a migration
/// an older release began and did not finish (sqlx's migrator, no progress row) is refused
/// as sqlx refuses it, not guessed at.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mysql_migration_refused_by_the_database_is_not_taken_as_done() {
    let Some(admin_url) = admin_url("PAYLEDGER_TEST_MYSQL_URL") else { return };
    sqlx::any::install_default_drivers();
    let database = migrated_before(&admin_url, 7).await;
    let raw = AnyPool::connect(&database.url).await.unwrap();
    sqlx::query("CREATE TABLE holds (id INT PRIMARY KEY, note TEXT)").execute(&raw).await.unwrap();
    let start = || async {
        let store = Store::connect(&database.url, &small_pool(Duration::from_secs(10))).await.unwrap();
        let migrated = store.migrate().await.map_err(|error| payledger::startup::error_chain(&error));
        store.close().await;
        migrated
    };
    for attempt in 0..2 {
        let refused = start().await.expect_err("the operator's table is in the way");
        assert!(refused.contains("1050") && refused.contains("holds"), "attempt {attempt}: {refused}");
    }
    let check = Store::connect(&database.url, &small_pool(Duration::from_secs(10))).await.unwrap();
    assert!(check.check_schema(&database.url).await.is_err(), "migration 7 is not recorded as applied");
    check.close().await;
    sqlx::query("DROP TABLE holds").execute(&raw).await.unwrap();
    start().await.expect("with the table moved, the next start completes the migration");
    let count =
        i64::try_from(Migrator::new(std::path::Path::new("migrations/mysql")).await.unwrap().iter().count()).unwrap();
    assert_eq!(history(&database.url).await, (count, 0));

    // In the way of a migration's first statement (which no start has run yet): an
    // operator's `accounts` on an empty schema, and a column added ahead of migration 10.
    for (version, ahead, error) in [
        (1, "CREATE TABLE accounts (operator_col INT)", "1050"),
        (10, "ALTER TABLE journal_entries ADD COLUMN entry_hash INT", "1060"),
    ] {
        let database = migrated_before(&admin_url, version).await;
        let raw = AnyPool::connect(&database.url).await.unwrap();
        sqlx::query(ahead).execute(&raw).await.unwrap();
        raw.close().await;
        for attempt in 0..2 {
            let store = Store::connect(&database.url, &small_pool(Duration::from_secs(10))).await.unwrap();
            let refused = store.migrate().await.map_err(|error| payledger::startup::error_chain(&error));
            store.close().await;
            let refused = refused.expect_err("the object in the way is not taken for the migration's own");
            assert!(refused.contains(error), "{ahead}, attempt {attempt}: {refused}");
        }
        assert_eq!(history(&database.url).await.0, version - 1 - i64::from(version > 5), "{ahead}");
    }

    let legacy = migrated_before(&admin_url, 7).await;
    let all = Migrator::new(std::path::Path::new("migrations/mysql")).await.unwrap();
    let seven = all.iter().find(|migration| migration.version == 7).unwrap();
    let legacy_raw = AnyPool::connect(&legacy.url).await.unwrap();
    record_begun(&legacy_raw, seven).await;
    legacy_raw.close().await;
    let store = Store::connect(&legacy.url, &small_pool(Duration::from_secs(10))).await.unwrap();
    let refused = store.migrate().await.map_err(|error| payledger::startup::error_chain(&error));
    store.close().await;
    let refused = refused.expect_err("a migration an older release left begun is refused");
    assert!(refused.contains("partially applied"), "{refused}");
    raw.close().await;
}

/// Several instances starting at once on one new SQLite file all come up (sqlx takes no lock
/// on SQLite: payledger locks a file beside the database while it migrates).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn instances_starting_together_on_sqlite_all_come_up_round_after_round() {
    sqlx::any::install_default_drivers();
    for round in 0..common::start_rounds() {
        let directory = tempfile::tempdir().unwrap();
        let url = format!("sqlite:{}", directory.path().join("ledger.db").display());
        let starts = (0..8).map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                let store = Store::connect(&url, &small_pool(Duration::from_secs(10))).await?;
                let migrated = store.migrate().await;
                store.close().await;
                migrated
            })
        });
        for (n, outcome) in futures::future::join_all(starts).await.into_iter().enumerate() {
            if let Err(error) = outcome.unwrap() {
                panic!("round {round}, start {n}: {}", payledger::startup::error_chain(&error));
            }
        }
    }
}

/// MySQL's named locks hold across the whole server: the migration lock of one database (as
/// docs/operations.md names it) holds up that database's migrations, and not another's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mysql_migration_lock_of_one_database_leaves_another_free() {
    use sqlx::{Connection as _, Executor as _};
    let Some(admin_url) = admin_url("PAYLEDGER_TEST_MYSQL_URL") else { return };
    sqlx::any::install_default_drivers();
    let held = common::ServerDatabase::create(&admin_url, "lockheld").await;
    let free = common::ServerDatabase::create(&admin_url, "lockfree").await;
    let mut holder = sqlx::AnyConnection::connect(&held.url).await.unwrap();
    holder.execute("SELECT GET_LOCK(CONCAT('payledger_migrate_', MD5(DATABASE())), 0)").await.unwrap();
    let migrate = |url: String| async move {
        let store = Store::connect(&url, &small_pool(Duration::from_secs(10))).await.unwrap();
        let migrated = store.migrate().await;
        store.close().await;
        migrated
    };
    let waiting = tokio::spawn(migrate(held.url.clone()));
    let started = std::time::Instant::now();
    migrate(free.url.clone()).await.expect("the other database migrates");
    let took = started.elapsed();
    assert!(took < Duration::from_secs(5), "it did not wait for the other database's lock ({took:?})");
    tokio::time::sleep(Duration::from_secs(3).saturating_sub(took)).await;
    assert!(!waiting.is_finished(), "the held database's migrations wait for its lock");
    holder.close().await.unwrap();
    waiting.await.unwrap().expect("and apply once it is free");
}
