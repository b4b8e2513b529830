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
