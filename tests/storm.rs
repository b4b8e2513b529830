//! The duplicate storm under every fault kind, on the server backends, bounded in time.
//! `payledger storm` runs as a separate process that starts two payledger instances over a
//! fresh database; the test reads its JSON summary.

use std::process::Command;

use serde_json::Value;
use sqlx::AnyPool;

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

async fn storm_on(admin_url: &str) {
    sqlx::any::install_default_drivers();
    let name = format!("payledger_storm_{}", uuid::Uuid::new_v4().simple());
    let admin = AnyPool::connect(admin_url).await.unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await.unwrap();
    let base = admin_url.rsplit_once('/').map_or(admin_url, |(base, _)| base);
    let database_url = format!("{base}/{name}");

    let output = Command::new(env!("CARGO_BIN_EXE_payledger"))
        .args(["storm", "--database-url", &database_url, "--instances", "2", "--callers", "12"])
        .args([
            "--duration-seconds",
            STORM_SECONDS,
            "--kill-interval-seconds",
            "4",
            "--cut-interval-seconds",
            "3",
            "--json",
        ])
        .output()
        .expect("payledger storm runs");
    let _ = sqlx::query(&format!("DROP DATABASE {name}")).execute(&admin).await;
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
