//! Several instances starting at once over one empty database all come up: the migrations
//! run once, under a lock that really waits (on MariaDB too).

use std::time::Duration;

use payledger::store::{PoolSettings, Store};
use sqlx::AnyPool;

fn admin_url(variable: &str) -> Option<String> {
    match std::env::var(variable) {
        Ok(url) => Some(url),
        Err(_) => {
            assert!(std::env::var("CI").as_deref() != Ok("true"), "{variable} is required in CI");
            eprintln!("{variable} not set: skipped");
            None
        }
    }
}

async fn instances_start_together(admin_url: &str) {
    sqlx::any::install_default_drivers();
    let name = format!("payledger_migrate_{}", uuid::Uuid::new_v4().simple());
    let admin = AnyPool::connect(admin_url).await.unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await.unwrap();
    let base = admin_url.rsplit_once('/').map_or(admin_url, |(base, _)| base);
    let url = format!("{base}/{name}");
    let settings = PoolSettings {
        max_connections: 2,
        acquire_timeout: Duration::from_secs(30),
        lock_timeout: Duration::from_secs(5),
    };

    let starts = (0..4).map(|_| {
        let (url, settings) = (url.clone(), settings.clone());
        tokio::spawn(async move {
            let store = Store::connect(&url, &settings).await?;
            let migrated = store.migrate().await;
            store.close().await;
            migrated
        })
    });
    let outcomes = futures::future::join_all(starts).await;
    let _ = sqlx::query(&format!("DROP DATABASE {name}")).execute(&admin).await;
    admin.close().await;

    for outcome in outcomes {
        outcome.unwrap().expect("every instance starts");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_instances_starting_together_on_postgres_all_come_up() {
    if let Some(url) = admin_url("PAYLEDGER_TEST_POSTGRES_URL") {
        instances_start_together(&url).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_instances_starting_together_on_mysql_all_come_up() {
    if let Some(url) = admin_url("PAYLEDGER_TEST_MYSQL_URL") {
        instances_start_together(&url).await;
    }
}

/// During a rolling deploy an instance of an older release may start after a newer one has
/// migrated: a migration it does not know is ignored, not refused.
#[tokio::test]
async fn an_instance_starts_on_a_database_migrated_by_a_newer_release() {
    sqlx::any::install_default_drivers();
    let directory = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", directory.path().join("ledger.db").display());
    let settings = PoolSettings {
        max_connections: 2,
        acquire_timeout: Duration::from_secs(5),
        lock_timeout: Duration::from_secs(5),
    };
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
