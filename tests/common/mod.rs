//! Helpers shared by the integration tests that create their own databases on the shared
//! PostgreSQL and MariaDB servers (each test file includes this module; not every file uses
//! every helper).
#![allow(dead_code)]

use std::time::Duration;

use payledger::store::PoolSettings;

/// The admin URL in `variable`, or `None` when it is unset outside CI (the test skips).
/// Under `CI=true` a missing variable fails the test: no backend may be skipped silently.
pub fn admin_url(variable: &str) -> Option<String> {
    match std::env::var(variable) {
        Ok(url) => Some(url),
        Err(_) => {
            assert!(std::env::var("CI").as_deref() != Ok("true"), "{variable} is required in CI");
            eprintln!("{variable} not set: skipped");
            None
        }
    }
}

/// `admin_url` with its database replaced by `name`.
pub fn database_url(admin_url: &str, name: &str) -> String {
    let base = admin_url.rsplit_once('/').map_or(admin_url, |(base, _)| base);
    format!("{base}/{name}")
}

/// A pool of two connections that waits `acquire_timeout` for one, and 5 s for a lock.
pub fn small_pool(acquire_timeout: Duration) -> PoolSettings {
    PoolSettings {
        max_connections: 2,
        acquire_timeout,
        lock_timeout: Duration::from_secs(5),
        plan_lifetime: PoolSettings::PLAN_LIFETIME_DEFAULT,
    }
}

/// A migrated ledger on a new SQLite file in `directory`, over [`small_pool`].
pub async fn sqlite_ledger(directory: &std::path::Path) -> payledger::ledger::Ledger {
    sqlx::any::install_default_drivers();
    let url = format!("sqlite:{}", directory.join("ledger.db").display());
    let store = payledger::store::Store::connect(&url, &small_pool(Duration::from_secs(5))).await.unwrap();
    store.migrate().await.unwrap();
    payledger::ledger::Ledger::new(store)
}

/// A payledger server in this process (see [`serve`]).
pub struct Served {
    pub ledger: payledger::ledger::Ledger,
    pub address: std::net::SocketAddr,
    pub stop: tokio::sync::oneshot::Sender<()>,
    pub server: tokio::task::JoinHandle<()>,
}

impl Served {
    /// Stops the server and waits for it.
    pub async fn shut_down(self) {
        let _ = self.stop.send(());
        let _ = self.server.await;
    }

    /// Asserts that the audit finds nothing, then stops the server and closes its pool.
    pub async fn finish(self) {
        let violations = self.ledger.audit().await.unwrap();
        assert!(violations.is_empty(), "{violations:#?}");
        let store = self.ledger.store().clone();
        self.shut_down().await;
        store.close().await;
    }
}

/// A payledger server on a free loopback port over `database_url` (migrated first), with a
/// pool of `connections` that waits 5 s for a connection and for a lock.
pub async fn serve(database_url: &str, connections: u32) -> Served {
    serve_planned_for(database_url, connections, PoolSettings::PLAN_LIFETIME_DEFAULT).await
}

/// [`serve`] with connections (and so, on PostgreSQL, their plans) replaced after `plan_lifetime`.
pub async fn serve_planned_for(database_url: &str, connections: u32, plan_lifetime: Duration) -> Served {
    use payledger::store::Store;
    let settings = PoolSettings {
        max_connections: connections,
        acquire_timeout: Duration::from_secs(5),
        lock_timeout: Duration::from_secs(5),
        plan_lifetime,
    };
    let store = Store::connect(database_url, &settings).await.expect("the database connects");
    store.migrate().await.expect("migrations apply");
    serve_ledger(payledger::ledger::Ledger::new(store)).await
}

/// A payledger server in this process on a free loopback port, serving `ledger`.
pub async fn serve_ledger(ledger: payledger::ledger::Ledger) -> Served {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("port 0 binds");
    let application = payledger::startup::Application::with_listener(listener, ledger.clone(), Duration::from_secs(2));
    let address = application.local_addr();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        application
            .run_until(async {
                let _ = stopped.await;
            })
            .await
            .expect("the server runs");
    });
    Served { ledger, address, stop, server }
}

/// A database of its own on a shared server, dropped at the end.
pub struct ServerDatabase {
    admin: String,
    name: String,
    pub url: String,
}

impl ServerDatabase {
    /// A new database named `payledger_<purpose>_<uuid>` on the server of `admin`.
    pub async fn create(admin: &str, purpose: &str) -> Self {
        sqlx::any::install_default_drivers();
        let name = format!("payledger_{purpose}_{}", uuid::Uuid::new_v4().simple());
        let pool = sqlx::AnyPool::connect(admin).await.unwrap();
        sqlx::query(&format!("CREATE DATABASE {name}")).execute(&pool).await.unwrap();
        pool.close().await;
        Self { admin: admin.to_owned(), url: database_url(admin, &name), name }
    }
}

async fn drop_database(admin: String, name: String) {
    if let Ok(pool) = sqlx::AnyPool::connect(&admin).await {
        let force = if admin.starts_with("postgres") { " WITH (FORCE)" } else { "" };
        let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name}{force}")).execute(&pool).await;
        pool.close().await;
    }
}

/// Dropped with the test, passed or failed (from a thread of its own: the test's runtime may
/// be unwinding).
impl Drop for ServerDatabase {
    fn drop(&mut self) {
        let (admin, name) = (self.admin.clone(), self.name.clone());
        let _ = std::thread::spawn(move || {
            if let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() {
                runtime.block_on(drop_database(admin, name));
            }
        })
        .join();
    }
}

/// Every bench scenario, a few dozen calls each, 4 callers; every call must answer OK.
pub async fn run_every_scenario(served: &Served) {
    run_every_scenario_at(served, 4, 60).await;
}

/// [`run_every_scenario`] with `concurrency` callers and `total` calls a scenario: at 32
/// callers a group commit holds a few dozen calls, and its statements a few dozen rows each.
pub async fn run_every_scenario_at(served: &Served, concurrency: usize, total: u64) {
    use clap::ValueEnum as _;
    use payledger::config::Progress;
    use payledger_tools::bench::{BenchSettings, Scenario};
    for &scenario in Scenario::value_variants() {
        let settings = BenchSettings {
            target: format!("http://{}", served.address),
            allow_test_data: true,
            scenario,
            concurrency,
            total,
            duration_seconds: None,
            payers: 10,
            merchants: 3,
            zipf: None,
            duplicate_ratio: 0.2,
            rate: None,
            connections: 1,
            json: false,
            progress: Progress::Never,
            access: payledger_tools::TargetAccess::default(),
        };
        let report = payledger_tools::bench::bench(&settings).await.unwrap();
        assert_eq!(report.status_codes.keys().collect::<Vec<_>>(), ["Ok"], "{scenario:?}: {:?}", report.status_codes);
    }
}

/// How many rounds the start tests run: `PAYLEDGER_TEST_START_ROUNDS`, 4 unless set.
pub fn start_rounds() -> usize {
    std::env::var("PAYLEDGER_TEST_START_ROUNDS").ok().and_then(|rounds| rounds.parse().ok()).unwrap_or(4)
}

/// An instance as `serve` opens one on `url` (connect, migrate), pool of 2.
pub async fn open_instance(url: &str) -> Result<payledger::ledger::Ledger, payledger::startup::StartupError> {
    let database = payledger::config::DatabaseSettings {
        database_url: url.to_owned(),
        pool_size: 2,
        pool_acquire_timeout_ms: 5_000,
        plan_lifetime_seconds: 30,
        lock_timeout_ms: 2_000,
        database_wait_seconds: 10,
    };
    let writes = payledger::config::WriteSettings { pay_batch_pipeline: 1, ..Default::default() };
    payledger::startup::open_ledger(&database, &writes, &payledger::config::IdempotencySettings::default()).await
}

/// `count` instances start at once on `url` (`urls` round-robin), each serves an
/// OpenAccount, and the schema is complete: every migration of this release recorded as
/// applied, none begun and unfinished, and the audit clean.
pub async fn instances_start_together_and_serve(urls: &[String], count: usize) {
    let opened = futures::future::join_all((0..count).map(|n| open_instance(&urls[n % urls.len()]))).await;
    let mut ledgers = Vec::new();
    for (n, ledger) in opened.into_iter().enumerate() {
        ledgers.push(
            ledger.unwrap_or_else(|error| {
                panic!("instance {n} did not start: {}", payledger::startup::error_chain(&error))
            }),
        );
    }
    for (n, ledger) in ledgers.into_iter().enumerate() {
        let store = ledger.store().clone();
        store.check_schema(&urls[0]).await.expect("the schema is complete");
        let begun: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM _sqlx_migrations WHERE success = FALSE")
            .fetch_one(&sqlx::AnyPool::connect(&urls[0]).await.unwrap())
            .await
            .unwrap();
        assert_eq!(begun, 0, "no migration is left begun");
        let served = serve_ledger(ledger).await;
        let client = payledger::client::PayledgerClient::connect(
            &format!("http://{}", served.address),
            payledger::client::ClientSettings::default(),
        )
        .unwrap();
        let request =
            payledger::proto::OpenAccountRequest { account_id: format!("started-{n}"), currency: "USD".into() };
        client.open_account(request).await.unwrap_or_else(|status| panic!("instance {n} does not serve: {status}"));
        served.finish().await;
    }
}

/// Starts `payledger migrate` on `url` and kills it (SIGKILL) once the history shows
/// `applied` migrations applied (at once for 0), or when it has exited by itself.
pub async fn migrate_killed_after(url: &str, applied: i64) {
    let mut migrate = tokio::process::Command::new(env!("CARGO_BIN_EXE_payledger"))
        .args(["migrate", "--database-url", url, "--database-wait-seconds", "0", "--lock-timeout-ms", "60000"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pool = sqlx::any::AnyPoolOptions::new().max_connections(1).connect(url).await.unwrap();
    for _ in 0..10_000 {
        if migrate.try_wait().unwrap().is_some() {
            break;
        }
        if applied == 0 || history_on(&pool).await.0 >= applied {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let _ = migrate.kill().await;
    pool.close().await;
}

/// How many migrations the history of `url` records as applied, and as begun and unfinished
/// (none of either without a history table).
pub async fn history(url: &str) -> (i64, i64) {
    let pool = sqlx::AnyPool::connect(url).await.unwrap();
    let counts = history_on(&pool).await;
    pool.close().await;
    counts
}

pub async fn history_on(pool: &sqlx::AnyPool) -> (i64, i64) {
    let count = |sql| async move { sqlx::query_scalar::<_, i64>(sql).fetch_one(pool).await.unwrap_or(0) };
    (
        count("SELECT COUNT(*) FROM _sqlx_migrations WHERE success = TRUE").await,
        count("SELECT COUNT(*) FROM _sqlx_migrations WHERE success = FALSE").await,
    )
}

/// The migrations of this release on the backend of `url`.
pub fn migration_count(url: &str) -> i64 {
    let directory = if url.starts_with("postgres") { "migrations/postgres" } else { "migrations/mysql" };
    i64::try_from(std::fs::read_dir(directory).unwrap().count()).unwrap()
}
