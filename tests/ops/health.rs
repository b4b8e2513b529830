//! Honest health: gRPC health follows the database while payledger runs, and `serve` waits
//! at start for a database that is not there yet. On databases created by the test on the
//! shared servers (PostgreSQL for the health flip, both servers for the wait at start), and on
//! SQLite files. A database that refuses writes is in `read_only.rs`, which uses the helpers
//! here.

use crate::common;

use std::time::{Duration, Instant};

use common::{admin_url, database_url};
use payledger::config::{DatabaseSettings, IdempotencySettings, WriteSettings};
use payledger::ledger::Ledger;
use payledger::startup::{open_ledger, Application};
use payledger::store::{PoolSettings, Store};
use sqlx::AnyPool;
use tokio::net::TcpListener;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// The health status of `service` as a client sees it.
pub(crate) async fn status(address: std::net::SocketAddr, service: &str) -> Option<ServingStatus> {
    let channel = tonic::transport::Channel::from_shared(format!("http://{address}")).ok()?.connect().await.ok()?;
    let request = HealthCheckRequest { service: service.to_owned() };
    let answer = HealthClient::new(channel).check(request).await.ok()?;
    ServingStatus::try_from(answer.into_inner().status).ok()
}

/// Waits (at most 15 s) until every name gRPC health answers for says `expected`.
pub(crate) async fn until_health_is(address: std::net::SocketAddr, expected: ServingStatus) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let mut all = true;
        for service in ["", "payledger.v1.PaymentService", "payledger.v1.AccountService"] {
            all &= status(address, service).await == Some(expected);
        }
        if all {
            return;
        }
        assert!(Instant::now() < deadline, "health did not turn {expected:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `payledger health` (the built binary) asking the server at `target` about `service`, as a
/// container HEALTHCHECK runs it, with a 2 s timeout.
pub(crate) async fn health_command(target: &str, service: &str) -> std::process::Output {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_payledger"));
    command.args(["health", "--target", target, "--service", service, "--timeout-ms", "2000"]);
    command.env_remove("PAYLEDGER_HEALTH_TARGET").kill_on_drop(true);
    command.output().await.expect("payledger health runs")
}

/// Waits (at most 15 s) until a health check has passed since the call: the gauge it sets is
/// put to 0 first, and a passing check sets it to 1 again.
pub(crate) async fn until_a_health_check_passes(ledger: &Ledger) {
    ledger.store().up().set(0);
    let deadline = Instant::now() + Duration::from_secs(15);
    while ledger.store().up().get() != 1 {
        assert!(Instant::now() < deadline, "no health check passed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A server on the database at `url` (migrated) that checks its health every 100 ms, or as
/// often as [`HealthServer::checking_every`] says.
pub(crate) struct HealthServer {
    pub(crate) ledger: Ledger,
    pub(crate) address: std::net::SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), payledger::startup::StartupError>>,
}

impl HealthServer {
    async fn start(url: &str) -> Self {
        Self::checking_every(url, Duration::from_millis(100)).await
    }

    pub(crate) async fn checking_every(url: &str, interval: Duration) -> Self {
        let settings = PoolSettings {
            max_connections: 2,
            acquire_timeout: Duration::from_secs(2),
            lock_timeout: Duration::from_secs(2),
            plan_lifetime: PoolSettings::PLAN_LIFETIME_DEFAULT,
        };
        let store = Store::connect(url, &settings).await.unwrap();
        store.migrate().await.unwrap();
        let ledger = Ledger::new(store);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let application = Application::with_listener(listener, ledger.clone(), Duration::from_secs(1))
            .with_health_check_interval(interval);
        let address = application.local_addr();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(application.run_until(async {
            let _ = stopped.await;
        }));
        Self { ledger, address, stop, task }
    }

    pub(crate) async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_turns_not_serving_while_postgres_refuses_connections_and_back_without_a_restart() {
    let Some(admin_url) = admin_url("PAYLEDGER_TEST_POSTGRES_URL") else { return };
    sqlx::any::install_default_drivers();
    let name = format!("payledger_health_{}", uuid::Uuid::new_v4().simple());
    let admin = AnyPool::connect(&admin_url).await.unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await.unwrap();
    let server = HealthServer::start(&database_url(&admin_url, &name)).await;
    let address = server.address;

    until_health_is(address, ServingStatus::Serving).await;
    sqlx::query(&format!("ALTER DATABASE {name} WITH ALLOW_CONNECTIONS false")).execute(&admin).await.unwrap();
    sqlx::query(&format!("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'"))
        .execute(&admin)
        .await
        .unwrap();
    until_health_is(address, ServingStatus::NotServing).await;
    // Why, in the database's words (not a pool's timeout).
    let unhealthy = server.ledger.store().check_health().await.unwrap_err();
    let said = payledger::startup::error_chain(&unhealthy);
    assert!(said.contains("not currently accepting connections"), "{said}");
    sqlx::query(&format!("ALTER DATABASE {name} WITH ALLOW_CONNECTIONS true")).execute(&admin).await.unwrap();
    until_health_is(address, ServingStatus::Serving).await;

    server.stop().await;
    let _ = sqlx::query(&format!("DROP DATABASE {name} WITH (FORCE)")).execute(&admin).await;
    admin.close().await;
}

/// A ledger opened before its database exists opens once the database is created; with no
/// time to wait, it fails at once.
async fn opens_once_the_database_exists(admin_url: &str, force: &str) {
    sqlx::any::install_default_drivers();
    let name = format!("payledger_later_{}", uuid::Uuid::new_v4().simple());
    let settings = |wait: u64| DatabaseSettings {
        database_url: database_url(admin_url, &name),
        pool_size: 2,
        pool_acquire_timeout_ms: 2_000,
        plan_lifetime_seconds: 30,
        lock_timeout_ms: 2_000,
        database_wait_seconds: wait,
    };
    let writes = || WriteSettings { pay_batch_pipeline: 1, ..WriteSettings::default() };
    let started = Instant::now();
    assert!(open_ledger(&settings(0), &writes(), &IdempotencySettings::default()).await.is_err());
    assert!(started.elapsed() < Duration::from_secs(5), "no wait: one try");

    let waiting = settings(60);
    let opening = tokio::spawn(async move { open_ledger(&waiting, &writes(), &IdempotencySettings::default()).await });
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(!opening.is_finished(), "it waits for the database");
    let admin = AnyPool::connect(admin_url).await.unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await.unwrap();
    let opened = tokio::time::timeout(Duration::from_secs(30), opening).await;
    let outcome = opened.map(|joined| joined.unwrap());
    if let Ok(Ok(ledger)) = &outcome {
        assert_eq!(ledger.audit().await.unwrap(), Vec::new(), "a fresh, migrated ledger");
        ledger.store().close().await;
    }
    let _ = sqlx::query(&format!("DROP DATABASE {name}{force}")).execute(&admin).await;
    admin.close().await;
    assert!(matches!(outcome, Ok(Ok(_))), "the ledger opens once its database exists");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_waits_for_a_postgres_database_created_after_it_starts() {
    if let Some(url) = admin_url("PAYLEDGER_TEST_POSTGRES_URL") {
        opens_once_the_database_exists(&url, " WITH (FORCE)").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_waits_for_a_mysql_database_created_after_it_starts() {
    if let Some(url) = admin_url("PAYLEDGER_TEST_MYSQL_URL") {
        opens_once_the_database_exists(&url, "").await;
    }
}

/// `payledger health`, as a container HEALTHCHECK runs it: SERVING exits 0, a server that is
/// not there exits 1 within the timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_command_exits_zero_only_for_a_serving_server() {
    let directory = tempfile::tempdir().unwrap();
    let ledger = common::sqlite_ledger(directory.path()).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let application = Application::with_listener(listener, ledger, Duration::from_secs(2));
    let address = application.local_addr();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(application.run_until(async {
        let _ = stopped.await;
    }));
    let target = format!("http://{address}");
    for service in ["", "payledger.v1.PaymentService"] {
        let output = health_command(&target, service).await;
        assert!(output.status.success(), "{service:?}: {output:?}");
        assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "SERVING");
    }
    let unknown = health_command(&target, "no.such.Service").await;
    assert!(!unknown.status.success(), "an unknown service is not healthy: {unknown:?}");

    let _ = stop.send(());
    server.await.unwrap().unwrap();
    let started = Instant::now();
    let down = health_command(&target, "").await;
    assert_eq!(down.status.code(), Some(1), "{down:?}");
    assert!(started.elapsed() < Duration::from_secs(10), "refused or timed out within --timeout-ms");
    let said = String::from_utf8_lossy(&down.stderr);
    assert!(said.contains(&format!("cannot ask {target} for its health")), "names what it asked: {said}");
}

/// SQLite runs no write in its check (see `Store::check_health`): a healthy server passes its
/// checks and stays SERVING.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_stays_serving_on_a_healthy_sqlite_database() {
    let directory = tempfile::tempdir().unwrap();
    sqlx::any::install_default_drivers();
    let server = HealthServer::start(&format!("sqlite:{}", directory.path().join("ledger.db").display())).await;

    // Twice: the second check runs on the connection the first one kept.
    until_a_health_check_passes(&server.ledger).await;
    until_a_health_check_passes(&server.ledger).await;

    assert_eq!(status(server.address, "").await, Some(ServingStatus::Serving));
    let output = health_command(&format!("http://{}", server.address), "").await;
    assert!(output.status.success(), "{output:?}");
    server.stop().await;
}

/// The same on MariaDB, which has no per-database switch: the ledger connects as a user of
/// its own, which is locked (and its sessions killed), then unlocked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_turns_not_serving_while_mariadb_refuses_its_user_and_back_without_a_restart() {
    let Some(admin_url) = admin_url("PAYLEDGER_TEST_MYSQL_URL") else { return };
    sqlx::any::install_default_drivers();
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..12];
    let (name, user) = (format!("payledger_health_{suffix}"), format!("health_{suffix}"));
    let admin = AnyPool::connect(&admin_url).await.unwrap();
    for statement in [
        format!("CREATE DATABASE {name}"),
        format!("CREATE USER '{user}'@'%' IDENTIFIED BY 'health-pw'"),
        format!("GRANT ALL ON {name}.* TO '{user}'@'%'"),
    ] {
        sqlx::query(&statement).execute(&admin).await.unwrap();
    }
    let host = admin_url.split_once('@').map_or("127.0.0.1:3306/test", |(_, host)| host);
    let host = host.split_once('/').map_or(host, |(host, _)| host);
    let url = format!("mysql://{user}:health-pw@{host}/{name}");
    let server = HealthServer::start(&url).await;
    let (address, ledger) = (server.address, server.ledger.clone());

    until_health_is(address, ServingStatus::Serving).await;
    sqlx::query(&format!("ALTER USER '{user}'@'%' ACCOUNT LOCK")).execute(&admin).await.unwrap();
    let sessions: Vec<(i64,)> =
        sqlx::query_as(&format!("SELECT CAST(id AS SIGNED) FROM information_schema.processlist WHERE user = '{user}'"))
            .fetch_all(&admin)
            .await
            .unwrap();
    for (id,) in sessions {
        let _ = sqlx::query(&format!("KILL {id}")).execute(&admin).await;
    }
    until_health_is(address, ServingStatus::NotServing).await;
    assert_eq!(ledger.store().up().get(), 0, "payledger_db_up follows health");
    let said = payledger::startup::error_chain(&ledger.store().check_health().await.unwrap_err());
    assert!(said.contains("account is locked"), "{said}");
    sqlx::query(&format!("ALTER USER '{user}'@'%' ACCOUNT UNLOCK")).execute(&admin).await.unwrap();
    until_health_is(address, ServingStatus::Serving).await;
    assert_eq!(ledger.store().up().get(), 1);

    server.stop().await;
    let _ = sqlx::query(&format!("DROP DATABASE {name}")).execute(&admin).await;
    let _ = sqlx::query(&format!("DROP USER '{user}'@'%'")).execute(&admin).await;
    admin.close().await;
}

/// A table lock held by an operator on the table the health check writes to makes the check
/// fail as `lock_wait` (its write waited 1 s), not as a database that refuses writes; the
/// check passes once the lock is gone. PostgreSQL (`LOCK TABLE`) and MariaDB (`LOCK TABLES`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_lock_in_the_way_of_the_health_check_is_told_as_a_lock_wait() {
    use sqlx::{Connection as _, Executor as _};
    for (variable, lock) in [
        ("PAYLEDGER_TEST_POSTGRES_URL", "BEGIN; LOCK TABLE _sqlx_migrations IN ACCESS EXCLUSIVE MODE"),
        ("PAYLEDGER_TEST_MYSQL_URL", "LOCK TABLES _sqlx_migrations WRITE"),
    ] {
        let Some(admin) = admin_url(variable) else { continue };
        let database = common::ServerDatabase::create(&admin, "lockwait").await;
        let store = Store::connect(&database.url, &common::small_pool(Duration::from_secs(5))).await.unwrap();
        store.migrate().await.unwrap();
        store.check_health().await.expect("healthy before the lock");
        let mut holder = sqlx::AnyConnection::connect(&database.url).await.unwrap();
        holder.execute(lock).await.unwrap();
        let locked = store.check_health().await;
        holder.close().await.unwrap();
        let reason = locked.as_ref().err().map(payledger::store::Unhealthy::reason);
        assert_eq!(reason, Some("lock_wait"), "{variable}: {locked:?}");
        store.check_health().await.expect("healthy once the lock is gone");
        store.close().await;
    }
}
