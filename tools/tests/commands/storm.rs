//! The duplicate storm under every fault kind, on the server backends, bounded in time; and
//! the storm's refusal of a database it did not create. `payledger-tools storm` runs as a
//! separate process that creates its database, starts two payledger instances over it and
//! drops it after a clean run; the test reads its JSON summary.

use std::process::{Command, Output};

use serde_json::Value;
use sqlx::{AnyPool, Row};

/// Seconds of load per backend: enough for every fault kind to fire several times.
const STORM_SECONDS: &str = "12";

fn admin_url(variable: &str) -> Option<String> {
    match std::env::var(variable) {
        Ok(url) => Some(url),
        Err(_) => {
            assert!(std::env::var("CI").as_deref() != Ok("true"), "{variable} is required in CI");
            eprintln!("{variable} not set: storm skipped");
            None
        }
    }
}

/// The URL of database `name` on the server of `admin_url`.
fn database_url(admin_url: &str, name: &str) -> String {
    let base = admin_url.rsplit_once('/').map_or(admin_url, |(base, _)| base);
    format!("{base}/{name}")
}

fn storm(database_url: &str, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_payledger-tools"))
        .args(["storm", "--database-url", database_url, "--instances", "2", "--callers", "12"])
        .args(extra)
        .output()
        .expect("payledger-tools storm runs")
}

/// How many databases named `name` the server of `admin` holds.
async fn databases_named(admin: &AnyPool, name: &str) -> i64 {
    let sql = if admin.connect_options().database_url.scheme() == "postgres" {
        format!("SELECT COUNT(*) FROM pg_database WHERE datname = '{name}'")
    } else {
        format!("SELECT COUNT(*) FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = '{name}'")
    };
    sqlx::query(&sql).fetch_one(admin).await.unwrap().try_get::<i64, _>(0).unwrap()
}

/// Drops database `name`, cutting any session still attached to it on PostgreSQL.
async fn drop_database(admin: &AnyPool, admin_url: &str, name: &str) {
    let force = if admin_url.starts_with("postgres") { " WITH (FORCE)" } else { "" };
    sqlx::query(&format!("DROP DATABASE {name}{force}")).execute(admin).await.expect("the test's database drops");
}

async fn storm_on(admin_url: &str) {
    sqlx::any::install_default_drivers();
    let name = format!("payledger_storm_{}", uuid::Uuid::new_v4().simple());
    let output = storm(
        &database_url(admin_url, &name),
        &["--duration-seconds", STORM_SECONDS, "--kill-interval-seconds", "4", "--cut-interval-seconds", "3", "--json"],
    );
    let admin = AnyPool::connect(admin_url).await.unwrap();
    let left_behind = databases_named(&admin, &name).await;
    if left_behind > 0 {
        drop_database(&admin, admin_url, &name).await;
    }
    admin.close().await;

    let stdout = String::from_utf8_lossy(&output.stdout);
    println!("{stdout}");
    let summary: Value = stdout
        .lines()
        .find_map(|line| line.strip_prefix("storm-summary: "))
        .map(|json| serde_json::from_str(json).unwrap())
        .unwrap_or_else(|| panic!("no summary; stderr: {}", String::from_utf8_lossy(&output.stderr)));
    assert_eq!(summary["violations"], Value::Array(vec![]), "money moved other than exactly once");
    assert!(output.status.success());
    assert_eq!(left_behind, 0, "a clean storm drops the database it created");
    for counter in ["retries", "duplicates_sent", "replays_served", "instance_kills", "database_cuts", "acknowledged"] {
        assert!(summary[counter].as_u64().unwrap() > 0, "{counter} was zero: {summary}");
    }
    for fault in ["delays", "resets_before_request", "dropped_responses", "blackholes"] {
        assert!(summary["faults"][fault].as_u64().unwrap() > 0, "no {fault} injected: {summary}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_under_every_fault_moves_money_exactly_once_on_postgres() {
    if let Some(url) = admin_url("PAYLEDGER_TEST_POSTGRES_URL") {
        storm_on(&url).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_under_every_fault_moves_money_exactly_once_on_mysql() {
    if let Some(url) = admin_url("PAYLEDGER_TEST_MYSQL_URL") {
        storm_on(&url).await;
    }
}

/// Creates a database as someone else would, points the storm at it, and checks that the
/// storm refused it and left it exactly as it was (no tables, not dropped).
async fn storm_refuses_a_database_it_did_not_create_on(admin_url: &str) {
    sqlx::any::install_default_drivers();
    let name = format!("payledger_not_storms_{}", uuid::Uuid::new_v4().simple());
    let admin = AnyPool::connect(admin_url).await.unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await.unwrap();

    let output = storm(&database_url(admin_url, &name), &["--duration-seconds", "1"]);

    let still_there = databases_named(&admin, &name).await;
    let target = AnyPool::connect(&database_url(admin_url, &name)).await.unwrap();
    let tables_sql = if admin_url.starts_with("postgres") {
        "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = 'public'"
    } else {
        "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE()"
    };
    let tables: i64 = sqlx::query(tables_sql).fetch_one(&target).await.unwrap().try_get(0).unwrap();
    target.close().await;
    drop_database(&admin, admin_url, &name).await;
    admin.close().await;

    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "the storm ran on a database it did not create");
    assert!(stderr.contains("did not create") && stderr.contains("--reuse-database"), "{stderr}");
    assert_eq!(still_there, 1, "the database is left in place");
    assert_eq!(tables, 0, "nothing was migrated or written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storm_refuses_a_postgres_database_it_did_not_create() {
    if let Some(url) = admin_url("PAYLEDGER_TEST_POSTGRES_URL") {
        storm_refuses_a_database_it_did_not_create_on(&url).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storm_refuses_a_mysql_database_it_did_not_create() {
    if let Some(url) = admin_url("PAYLEDGER_TEST_MYSQL_URL") {
        storm_refuses_a_database_it_did_not_create_on(&url).await;
    }
}

#[test]
fn storm_refuses_a_sqlite_file_it_did_not_create_and_ignores_database_url() {
    let directory = tempfile::tempdir().unwrap();
    let existing = directory.path().join("someone_elses.db");
    std::fs::write(&existing, b"").unwrap();

    let output = Command::new(env!("CARGO_BIN_EXE_payledger-tools"))
        .args(["storm", "--database-url", &format!("sqlite:{}", existing.display()), "--duration-seconds", "1"])
        .output()
        .unwrap();
    let without_url = Command::new(env!("CARGO_BIN_EXE_payledger-tools"))
        .args(["storm", "--duration-seconds", "1"])
        .env("DATABASE_URL", format!("sqlite:{}", directory.path().join("ambient.db").display()))
        .output()
        .unwrap();

    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("did not create"));
    assert_eq!(std::fs::read(&existing).unwrap(), b"", "the file is untouched");
    assert!(!without_url.status.success(), "storm never falls back to DATABASE_URL");
    assert!(String::from_utf8_lossy(&without_url.stderr).contains("--database-url"));
    assert!(!directory.path().join("ambient.db").exists());
}
