//! A database that turns read-only under load. Every call is then answered with a retryable
//! code (UNAVAILABLE or ABORTED), never INTERNAL, and health is NOT_SERVING; once writes are
//! allowed again calls succeed, health is SERVING, nothing acknowledged is lost, and the
//! audit holds. Without load, with health checked every [`HEALTH_INTERVAL`]: NOT_SERVING
//! within two intervals of the switch and `payledger health` exits 1, then SERVING and 0.
//!
//! - PostgreSQL: the test's own database, made read-only with `ALTER DATABASE ... SET
//!   default_transaction_read_only = on` (SQLSTATE 25006 on every write) and, under load, its
//!   sessions cut so that new ones take the setting; health sees it without the cut, as its
//!   check opens a new session each time.
//! - MariaDB: `read_only` is server-wide, so the test starts a server of its own
//!   (`mariadb-install-db` and `mariadbd` from the machine's packages, as the `mysql` user, on a
//!   free loopback port), never the shared one; payledger connects as a user without SUPER,
//!   whose writes then fail with error 1290.
//!
//! SQLite has no such state to enter from outside: a file opened read-write stays writable.
//! Its read-only, full-disk and I/O error codes are covered by the classification tests in
//! `src/store/dialect.rs`.

use crate::common;
use crate::health::{health_command, status, until_a_health_check_passes, until_health_is, HealthServer};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt;
use payledger::proto::account_service_client::AccountServiceClient;
use payledger::proto::payment_service_client::PaymentServiceClient;
use payledger::proto::{self};
use sqlx::{AnyPool, Row};
use tonic::transport::Channel;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

/// Concurrent callers, each creating an order and paying it, over and over.
const CALLERS: usize = 6;
/// The longest the test waits for each phase to show (failures while read-only, successes
/// after); a bound on the test, not a timing assertion.
const PHASE_WAIT_MAX: Duration = Duration::from_secs(20);
/// Calls that must be seen in a phase before it ends.
const CALLS_PER_PHASE: usize = 10;

/// What the callers saw.
#[derive(Default)]
struct Seen {
    /// Every status code, with how many calls got it, by phase.
    codes: BTreeMap<(&'static str, String), usize>,
    /// Pays acknowledged: (out_trade_no, trade_no).
    paid: Vec<(String, String)>,
}

/// The phase the database is in, as the callers label what they see.
struct Phase(Mutex<&'static str>);

async fn caller(number: usize, channel: Channel, phase: Arc<Phase>, seen: Arc<Mutex<Seen>>, running: Arc<AtomicBool>) {
    let mut payments = PaymentServiceClient::new(channel);
    let mut call = 0;
    while running.load(Ordering::SeqCst) {
        call += 1;
        let (order_no, out_trade_no) = (format!("o-{number}-{call}"), format!("p-{number}-{call}"));
        let label = *phase.0.lock().unwrap();
        let create = proto::CreateOrderRequest {
            merchant_id: "m1".into(),
            order_no: order_no.clone(),
            payee_account_id: "shop".into(),
            amount: "1.00".into(),
            currency: "USD".into(),
            subject: String::new(),
            expires_at: None,
        };
        let created = payments.create_order(create).await;
        let code = created.as_ref().map_or_else(|status| status.code(), |_| Code::Ok);
        *seen.lock().unwrap().codes.entry((label, format!("{code:?}"))).or_default() += 1;
        if created.is_err() {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        let pay = proto::PayRequest {
            merchant_id: "m1".into(),
            out_trade_no: out_trade_no.clone(),
            order_no,
            payer_account_id: "payer".into(),
            amount: "1.00".into(),
            currency: "USD".into(),
        };
        let label = *phase.0.lock().unwrap();
        let paid = payments.pay(pay).await;
        let mut seen = seen.lock().unwrap();
        match paid {
            Ok(response) => {
                *seen.codes.entry((label, "Ok".to_owned())).or_default() += 1;
                let trade_no = response.into_inner().payment.unwrap().trade_no;
                seen.paid.push((out_trade_no, trade_no));
            }
            Err(status) => *seen.codes.entry((label, format!("{:?}", status.code()))).or_default() += 1,
        }
    }
}

/// Calls seen in `phase` with `code`.
fn count(seen: &Mutex<Seen>, phase: &str, code: &str) -> usize {
    seen.lock().unwrap().codes.iter().filter(|((p, c), _)| *p == phase && c == code).map(|(_, n)| n).sum()
}

/// Waits until `enough` holds, at most [`PHASE_WAIT_MAX`].
async fn wait_for(what: &str, enough: impl Fn() -> bool) {
    let deadline = Instant::now() + PHASE_WAIT_MAX;
    while !enough() {
        assert!(Instant::now() < deadline, "gave up waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Funds a payer, opens the shop, runs the callers through writable, read-only and writable
/// again (`read_only(true)` / `read_only(false)` switch the database), and checks the outcome.
async fn read_only_under_load<F, Fut>(database_url: &str, read_only: F)
where
    F: Fn(bool) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let served = common::serve(database_url, 4).await;
    let channel = Channel::from_shared(format!("http://{}", served.address)).unwrap().connect().await.unwrap();
    let mut accounts = AccountServiceClient::new(channel.clone());
    for account_id in ["payer", "shop"] {
        let request = proto::OpenAccountRequest { account_id: account_id.into(), currency: "USD".into() };
        accounts.open_account(request).await.unwrap();
    }
    let deposit = proto::DepositRequest {
        request_id: "funds".into(),
        account_id: "payer".into(),
        amount: "1000000.00".into(),
        currency: "USD".into(),
    };
    accounts.deposit(deposit).await.unwrap();

    let (phase, seen, running) = (
        Arc::new(Phase(Mutex::new("writable"))),
        Arc::new(Mutex::new(Seen::default())),
        Arc::new(AtomicBool::new(true)),
    );
    let callers: Vec<_> = (0..CALLERS)
        .map(|number| tokio::spawn(caller(number, channel.clone(), phase.clone(), seen.clone(), running.clone())))
        .collect();
    wait_for("successes before read-only", || count(&seen, "writable", "Ok") >= CALLS_PER_PHASE).await;
    read_only(true).await;
    *phase.0.lock().unwrap() = "read-only";
    wait_for("refusals while read-only", || count(&seen, "read-only", "Unavailable") >= CALLS_PER_PHASE).await;
    until_health_is(served.address, ServingStatus::NotServing).await;
    read_only(false).await;
    *phase.0.lock().unwrap() = "writable again";
    wait_for("successes once writable again", || count(&seen, "writable again", "Ok") >= CALLS_PER_PHASE).await;
    until_health_is(served.address, ServingStatus::Serving).await;
    running.store(false, Ordering::SeqCst);
    for caller in callers {
        caller.await.unwrap();
    }

    let seen = Arc::try_unwrap(seen).ok().unwrap().into_inner().unwrap();
    println!("codes by phase: {:?}", seen.codes);
    for ((phase, code), calls) in &seen.codes {
        assert!(
            ["Ok", "Unavailable", "Aborted"].contains(&code.as_str()),
            "{calls} call(s) got {code} while {phase}: a transient state must be retryable"
        );
    }
    let raw = AnyPool::connect(database_url).await.unwrap();
    for (out_trade_no, trade_no) in &seen.paid {
        let sql =
            format!("SELECT trade_no FROM payment_flow WHERE merchant_id = 'm1' AND out_trade_no = '{out_trade_no}'");
        let stored: String = sqlx::query(&sql).fetch_one(&raw).await.unwrap().try_get(0).unwrap();
        assert_eq!(&stored, trade_no, "an acknowledged Pay is stored as acknowledged");
    }
    let payments = sqlx::query("SELECT COUNT(*) FROM payment_flow").fetch_one(&raw).await.unwrap();
    assert_eq!(payments.try_get::<i64, _>(0).unwrap() as usize, seen.paid.len(), "nothing unacknowledged was paid");
    raw.close().await;
    served.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_postgres_database_turned_read_only_under_load_gets_only_retryable_codes_then_recovers() {
    let Some(admin_url) = common::admin_url("PAYLEDGER_TEST_POSTGRES_URL") else { return };
    sqlx::any::install_default_drivers();
    let name = format!("payledger_read_only_{}", uuid::Uuid::new_v4().simple());
    let admin = AnyPool::connect(&admin_url).await.unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await.unwrap();
    let database_url = common::database_url(&admin_url, &name);

    let switch = |on: bool| {
        let (admin, name) = (admin.clone(), name.clone());
        async move {
            let setting =
                if on { "SET default_transaction_read_only = on" } else { "RESET default_transaction_read_only" };
            sqlx::query(&format!("ALTER DATABASE {name} {setting}")).execute(&admin).await.unwrap();
            // Sessions take the database's settings when they start: cut the open ones.
            let cut = format!("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'");
            sqlx::query(&cut).execute(&admin).await.unwrap();
        }
    };
    // The database is dropped whatever the outcome, then a failure is reported.
    let outcome = std::panic::AssertUnwindSafe(read_only_under_load(&database_url, switch)).catch_unwind().await;

    sqlx::query(&format!("DROP DATABASE {name} WITH (FORCE)")).execute(&admin).await.unwrap();
    admin.close().await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// How often the servers of the health tests check the database.
const HEALTH_INTERVAL: Duration = Duration::from_millis(250);
/// Room for the scheduler of a shared 2-core machine, on top of two intervals: a check may
/// have passed just before the switch committed, so the next one is the first that can see
/// it, and it may itself be delayed. A bound that catches a check blind to the switch (it
/// would never turn), not a timing assertion: the times seen are printed.
const SCHEDULING_SLACK: Duration = Duration::from_millis(500);

/// A server on `database_url` checking its health every [`HEALTH_INTERVAL`], writable, then
/// switched to read-only by `read_only(true)` (which returns once the switch committed), then
/// writable again by `read_only(false)`: gRPC health turns NOT_SERVING within two intervals
/// (and [`SCHEDULING_SLACK`]) of the switch, `payledger health` exits 1 and
/// `payledger_db_up` is 0; once writable, SERVING, exit 0 and 1.
async fn health_follows_writability<F, Fut>(database_url: &str, read_only: F)
where
    F: Fn(bool) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let server = HealthServer::checking_every(database_url, HEALTH_INTERVAL).await;
    let target = format!("http://{}", server.address);
    until_a_health_check_passes(&server.ledger).await;
    until_health_is(server.address, ServingStatus::Serving).await;
    let serving = health_command(&target, "").await;
    assert_eq!(serving.status.code(), Some(0), "{serving:?}");

    read_only(true).await;
    let switched = Instant::now();
    while status(server.address, "").await != Some(ServingStatus::NotServing) {
        assert!(switched.elapsed() < PHASE_WAIT_MAX, "health never turned NOT_SERVING on a read-only database");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let to_not_serving = switched.elapsed();
    println!("NOT_SERVING {} ms after the switch to read-only", to_not_serving.as_millis());
    assert!(
        to_not_serving <= 2 * HEALTH_INTERVAL + SCHEDULING_SLACK,
        "NOT_SERVING only {} ms after the switch, health checked every {} ms",
        to_not_serving.as_millis(),
        HEALTH_INTERVAL.as_millis()
    );
    until_health_is(server.address, ServingStatus::NotServing).await;
    let not_serving = health_command(&target, "").await;
    assert_eq!(not_serving.status.code(), Some(1), "{not_serving:?}");
    assert_eq!(String::from_utf8_lossy(&not_serving.stdout).trim(), "NOT_SERVING");
    assert_eq!(server.ledger.store().up().get(), 0, "payledger_db_up follows health");

    read_only(false).await;
    let switched_back = Instant::now();
    until_health_is(server.address, ServingStatus::Serving).await;
    println!("SERVING {} ms after the switch back", switched_back.elapsed().as_millis());
    let serving_again = health_command(&target, "").await;
    assert_eq!(serving_again.status.code(), Some(0), "{serving_again:?}");
    assert_eq!(server.ledger.store().up().get(), 1);
    server.stop().await;
}

/// `default_transaction_read_only` set on the database, and no session cut: what a
/// per-database setting does in production, where sessions keep their settings until they end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_not_serving_while_a_postgres_database_refuses_writes_and_serving_again_after() {
    let Some(admin_url) = common::admin_url("PAYLEDGER_TEST_POSTGRES_URL") else { return };
    let database = common::ServerDatabase::create(&admin_url, "read_only_health").await;
    let admin = AnyPool::connect(&admin_url).await.unwrap();
    let name = database.url.rsplit_once('/').unwrap().1.to_owned();

    let switch = |on: bool| {
        let (admin, name) = (admin.clone(), name.clone());
        async move {
            let setting =
                if on { "SET default_transaction_read_only = on" } else { "RESET default_transaction_read_only" };
            sqlx::query(&format!("ALTER DATABASE {name} {setting}")).execute(&admin).await.unwrap();
        }
    };
    health_follows_writability(&database.url, switch).await;
    admin.close().await;
}

/// A MariaDB server of the test's own, stopped and removed when dropped.
struct OwnMariaDb {
    directory: tempfile::TempDir,
    socket: PathBuf,
    port: u16,
    server: Child,
}

impl OwnMariaDb {
    /// Starts one, or `None` (skipped outside CI) where this machine cannot: not root, or no
    /// MariaDB server package.
    fn start() -> Option<Self> {
        let usable = Path::new("/usr/sbin/mariadbd").exists()
            && Command::new("mariadb-install-db").arg("--help").output().is_ok()
            && Command::new("id").arg("-u").output().is_ok_and(|out| out.stdout.starts_with(b"0\n"));
        if !usable {
            assert!(std::env::var("CI").as_deref() != Ok("true"), "CI needs root and the MariaDB server package");
            eprintln!("no MariaDB server package or not root: skipped");
            return None;
        }
        let directory = tempfile::tempdir().unwrap();
        let data = directory.path().join("data");
        let status = Command::new("chown").args(["mysql:mysql"]).arg(directory.path()).status().unwrap();
        assert!(status.success());
        let installed = Command::new("mariadb-install-db")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .args(["--user=mysql", "--auth-root-authentication-method=normal", "--skip-test-db"])
            .output()
            .unwrap();
        assert!(installed.status.success(), "mariadb-install-db: {}", String::from_utf8_lossy(&installed.stderr));
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let socket = directory.path().join("mariadb.sock");
        let server = Command::new("/usr/sbin/mariadbd")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .arg(format!("--socket={}", socket.display()))
            .arg(format!("--port={port}"))
            .args(["--bind-address=127.0.0.1", "--user=mysql", "--skip-log-bin", "--innodb-buffer-pool-size=32M"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let own = Self { directory, socket, port, server };
        let deadline = Instant::now() + Duration::from_secs(60);
        while own.admin("SELECT 1").is_err() {
            assert!(Instant::now() < deadline, "the test's MariaDB did not start");
            std::thread::sleep(Duration::from_millis(200));
        }
        Some(own)
    }

    /// Runs `sql` as root over the socket.
    fn admin(&self, sql: &str) -> Result<(), String> {
        let output = Command::new("mariadb")
            .arg("--no-defaults")
            .arg(format!("--socket={}", self.socket.display()))
            .args(["-uroot", "-e", sql])
            .output()
            .map_err(|error| error.to_string())?;
        if output.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&output.stderr).into_owned())
        }
    }
}

impl Drop for OwnMariaDb {
    fn drop(&mut self) {
        let _ = self.admin("SHUTDOWN");
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline && matches!(self.server.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.server.kill();
        let _ = self.server.wait();
        let _ = self.directory.path();
    }
}

impl OwnMariaDb {
    /// A `ledger` database and the URL of a user with every right on it but SUPER, whose
    /// writes `read_only` refuses.
    fn ledger_for_a_user_without_super(&self) -> String {
        sqlx::any::install_default_drivers();
        self.admin("CREATE DATABASE ledger; CREATE USER 'payledger'@'%' IDENTIFIED BY 'pw'; GRANT ALL ON ledger.* TO 'payledger'@'%'")
            .unwrap();
        format!("mysql://payledger:pw@127.0.0.1:{}/ledger", self.port)
    }

    /// Turns the server's `read_only` on or off.
    fn switch_read_only(&self, on: bool) -> impl std::future::Future<Output = ()> {
        let result = self.admin(if on { "SET GLOBAL read_only = 1" } else { "SET GLOBAL read_only = 0" });
        async move { result.unwrap() }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_mariadb_server_turned_read_only_under_load_gets_only_retryable_codes_then_recovers() {
    let Some(mariadb) = OwnMariaDb::start() else { return };
    let database_url = mariadb.ledger_for_a_user_without_super();
    let switch = |on: bool| mariadb.switch_read_only(on);
    read_only_under_load(&database_url, switch).await;
}

/// `read_only` on the test's own MariaDB server; payledger's user has no SUPER.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_not_serving_while_a_mariadb_server_refuses_writes_and_serving_again_after() {
    let Some(mariadb) = OwnMariaDb::start() else { return };
    let database_url = mariadb.ledger_for_a_user_without_super();
    let switch = |on: bool| mariadb.switch_read_only(on);
    health_follows_writability(&database_url, switch).await;
}
