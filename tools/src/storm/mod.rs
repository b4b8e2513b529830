//! `payledger storm`: a duplicate storm under faults that proves money moves exactly once.
//!
//! It starts several `payledger serve` processes on loopback ports over one database, puts a
//! [`FaultProxy`] in front of each, and lets N virtual callers run a random mix of Deposit,
//! Withdraw, CreateOrder + Pay (a share of the orders expiring around the Pay), CreateOrder +
//! Authorize + Capture or Void (holds that last a second), Refund, Transfer and Query through
//! the retrying client
//! ([`payledger_client`]), re-sending a share of the mutating calls as duplicates through another
//! instance. Meanwhile it injects faults: proxy delays, resets before the request, responses
//! dropped after the server answered, black holes, SIGKILL and restart of an instance, and cut
//! database connections. At the end it checks, from the database and from its own log of
//! acknowledged calls, that every acknowledged payment, refund, deposit, withdrawal and
//! transfer is present exactly once with the acknowledged id, that nothing refused moved money,
//! that no order was paid at or after its expires_at, and the ledger audit (balances equal the sum of their entries, all balances sum to zero, refunds
//! never exceed payments).

mod database;
pub mod proxy;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::seq::IndexedRandom;
use rand::Rng;
use sqlx::{AnyPool, Row};
use tokio::process::{Child, Command};
use tonic::{Code, Response, Status};

use payledger::ledger::Ledger;
use payledger::store::{Dialect, PoolSettings, Store};
use payledger_client::proto::{self, query_request::Key};
use payledger_client::{was_replayed, BearerToken, ClientSettings, PayledgerClient, RetrySettings};

pub use database::StormDatabase;
pub use proxy::{Fault, FaultCount, FaultProxy, FaultSettings};

use crate::AnyError;

/// `payledger storm` settings.
#[derive(Debug, Clone, clap::Args)]
pub struct StormSettings {
    /// Database the instances share, which the storm creates (PostgreSQL or MySQL/MariaDB: a
    /// new database on that server; SQLite, a new file, run without the connection-cut fault)
    /// and drops after a clean run. Never read from `DATABASE_URL`. Repeat it to point the
    /// instances at the nodes of one cluster (MariaDB Galera), each URL naming the same
    /// database on another node: instance i uses URL i modulo their number; the first URL
    /// creates and drops the database, connections are cut on every node, and the audit
    /// runs against every node.
    #[arg(long, required = true)]
    pub database_url: Vec<String>,
    /// Run on the database even though it exists already (the storm cuts its connections
    /// and writes test money into it); it is then left in place.
    #[arg(long)]
    pub reuse_database: bool,
    /// Keep the database the storm created, even after a clean run.
    #[arg(long)]
    pub keep_database: bool,
    /// payledger processes to start, each on its own loopback port.
    #[arg(long, default_value_t = 2)]
    pub instances: usize,
    /// Concurrent virtual callers.
    #[arg(long, default_value_t = 16)]
    pub callers: usize,
    /// Seconds of load (CI runs a short storm; run 600 or more by hand).
    #[arg(long, default_value_t = 20)]
    pub duration_seconds: u64,
    /// Share of mutating calls also sent a second time, concurrently, through another instance.
    #[arg(long, default_value_t = 0.15)]
    pub duplicate_ratio: f64,
    /// Run without any fault (proxies pass through, nothing is killed or cut).
    #[arg(long)]
    pub no_faults: bool,
    /// Seconds of the same load without faults before `--duration-seconds` with them, so that
    /// the summary compares the two rates from one run (0: no such phase). Its calls are
    /// checked as all others.
    #[arg(long, default_value_t = 0)]
    pub baseline_seconds: u64,
    /// Each client's per-attempt timeout, ms: what a call that met a black hole waits before
    /// its retry.
    #[arg(long, default_value_t = 1_000)]
    pub attempt_timeout_ms: u64,
    /// HTTP/2 connections of each instance's client (a black hole holds up the calls on one).
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// Seconds between two SIGKILLs of a random instance (each restarted at once).
    #[arg(long, default_value_t = 6)]
    pub kill_interval_seconds: u64,
    /// Seconds between two cuts of every database connection of the instances.
    #[arg(long, default_value_t = 5)]
    pub cut_interval_seconds: u64,
    /// Also print the summary as one JSON line (prefixed `storm-summary: `).
    #[arg(long)]
    pub json: bool,
}

/// What the storm did and found.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct StormSummary {
    pub calls: u64,
    pub acknowledged: u64,
    pub refused: u64,
    pub unknown_outcome: u64,
    /// The final gRPC status code of every mutating call (after the client's retries), by
    /// code name (`Ok`, `Unavailable`...).
    pub status_codes: std::collections::BTreeMap<String, u64>,
    pub attempts: u64,
    pub retries: u64,
    pub duplicates_sent: u64,
    pub replays_served: u64,
    pub queries: u64,
    pub faults: FaultCount,
    pub instance_kills: u64,
    pub database_cuts: u64,
    /// Mutating calls finished per second under faults (after the baseline), and during the
    /// baseline without faults (`None`: no baseline).
    pub rate_with_faults: f64,
    pub rate_without_faults: Option<f64>,
    /// Orders closed by the instances' sweepers once their expires_at passed.
    pub orders_expired: u64,
    /// Authorization holds captured, and released by the sweepers once their expires_at passed.
    pub holds_captured: u64,
    pub holds_expired: u64,
    pub violations: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum OperationKind {
    Deposit,
    Withdraw,
    Pay,
    Authorize,
    Capture,
    Void,
    Refund,
    Transfer,
}

#[derive(Debug, Clone)]
enum Outcome {
    /// Acknowledged with this id (deposit id, withdrawal id, trade_no, refund_no or transfer_id).
    Acknowledged { id: String, replayed: bool },
    /// A definitive refusal (INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS,
    /// FAILED_PRECONDITION): the call did not happen.
    Refused(Code),
    /// Transient to the end (retries ran out), or INTERNAL: it may or may not have happened.
    Unknown(Code),
}

#[derive(Debug, Clone)]
struct Operation {
    kind: OperationKind,
    merchant_id: String,
    /// request_id, out_trade_no, out_refund_no, or the transfer's memo.
    key: String,
    amount: String,
    outcomes: Vec<Outcome>,
}

fn classify<T>(result: &Result<Response<T>, Status>, id: impl FnOnce(&T) -> String) -> Outcome {
    match result {
        Ok(response) => Outcome::Acknowledged { id: id(response.get_ref()), replayed: was_replayed(response) },
        Err(status)
            if matches!(
                status.code(),
                Code::InvalidArgument | Code::NotFound | Code::AlreadyExists | Code::FailedPrecondition
            ) =>
        {
            Outcome::Refused(status.code())
        }
        Err(status) => Outcome::Unknown(status.code()),
    }
}

struct Instance {
    address: SocketAddr,
    child: Child,
    /// The database (node) it serves from; a restart serves from the same one.
    database_url: String,
}

/// The storm's own signing key: its instances authenticate callers as a production server
/// does, and its clients present a token minted with this key.
struct StormAuth {
    directory: tempfile::TempDir,
    token: String,
}

const STORM_ISSUER: &str = "payledger-storm";
const STORM_AUDIENCE: &str = "payledger";

impl StormAuth {
    /// A fresh key pair, its JWKS in a temporary directory, and a token with every scope for
    /// every merchant, valid for `lifetime`.
    fn new(lifetime: Duration) -> Result<Self, AnyError> {
        use payledger::auth::dev::{Algorithm, SigningKey, TokenClaims};
        let key = SigningKey::generate(Algorithm::EdDSA)?;
        let directory = tempfile::tempdir()?;
        key.write(directory.path())?;
        let claims = TokenClaims {
            issuer: STORM_ISSUER.into(),
            audience: STORM_AUDIENCE.into(),
            subject: "payledger-storm".into(),
            merchants: vec!["*".into()],
            scope: "payments:write payments:read accounts:write accounts:read accounts:admin".into(),
            ttl_seconds: lifetime.as_secs(),
        };
        Ok(Self { token: key.sign(&claims.to_json())?, directory })
    }

    fn jwks(&self) -> std::path::PathBuf {
        self.directory.path().join(payledger::auth::dev::JWKS_FILE)
    }
}

/// Starts one server instance: this binary's hidden `storm-instance` command, which serves
/// exactly as `payledger serve` does, with JWT authentication. It listens on a port the kernel
/// picks (`127.0.0.1:0`) and says which on its first stdout line (`listening ADDRESS`), so no
/// other process can hold the port it is reached at: a port chosen here and freed before the
/// instance binds it could be taken in between by any other test or storm on the machine.
async fn spawn_instance(database_url: &str, auth: &StormAuth) -> Result<Instance, AnyError> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(["storm-instance", "--listen", "127.0.0.1:0", "--database-url", database_url])
        .arg("--auth-jwks")
        .arg(auth.jwks())
        .args(["--auth-issuer", STORM_ISSUER, "--auth-audience", STORM_AUDIENCE])
        .args(["--pool-size", "8", "--shutdown-grace-seconds", "1", "--log-filter", "error"])
        // The sweeper closes expired orders while Pays of them are still arriving.
        .args(["--reaper-interval-seconds", "1", "--hold-ttl-seconds", "1"])
        .kill_on_drop(true)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let stdout = child.stdout.take().ok_or("the instance's stdout is not piped")?;
    let address = tokio::time::timeout(Duration::from_secs(30), instance_address(stdout))
        .await
        .map_err(|_| "an instance did not start listening within 30 s")??;
    Ok(Instance { address, child, database_url: database_url.to_owned() })
}

/// Reads the `listening ADDRESS` line of a `storm-instance`, then drains its stdout in the
/// background so that the instance never blocks on a full pipe.
async fn instance_address(stdout: tokio::process::ChildStdout) -> Result<SocketAddr, AnyError> {
    use tokio::io::AsyncBufReadExt;
    let mut reader = tokio::io::BufReader::new(stdout);
    let mut line = String::new();
    if reader.read_line(&mut line).await? == 0 {
        return Err("an instance exited before it listened (its error is on stderr)".into());
    }
    let address = line
        .trim_end()
        .strip_prefix(INSTANCE_LISTENING)
        .and_then(|address| address.parse().ok())
        .ok_or_else(|| format!("an instance's first line is not `{INSTANCE_LISTENING}ADDRESS`: {line:?}"))?;
    tokio::spawn(async move {
        let _ = tokio::io::copy(&mut reader, &mut tokio::io::sink()).await;
    });
    Ok(address)
}

/// What a `storm-instance` prints, followed by its bound address, once it listens.
pub const INSTANCE_LISTENING: &str = "listening ";

/// Cuts every database connection of the instances: PostgreSQL `pg_terminate_backend`,
/// MySQL `KILL`. Returns how many were cut.
async fn cut_database_connections(admin: &AnyPool, dialect: Dialect) -> Result<u64, sqlx::Error> {
    match dialect {
        Dialect::Postgres => {
            let rows = sqlx::query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()",
            )
            .fetch_all(admin)
            .await?;
            Ok(rows.len() as u64)
        }
        Dialect::MySql => {
            let ids: Vec<i64> = sqlx::query(
                "SELECT CAST(ID AS SIGNED) FROM information_schema.PROCESSLIST WHERE DB = DATABASE() AND ID <> CONNECTION_ID()",
            )
            .fetch_all(admin)
            .await?
            .iter()
            .filter_map(|row| row.try_get::<i64, _>(0).ok())
            .collect();
            let mut cut = 0;
            for id in ids {
                if sqlx::query(&format!("KILL {id}")).execute(admin).await.is_ok() {
                    cut += 1;
                }
            }
            Ok(cut)
        }
        Dialect::Sqlite => Ok(0),
    }
}

/// Time between two progress lines.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(5);

fn storm_faults() -> FaultSettings {
    // Per request. Every fault but the delay breaks the whole HTTP/2 connection, and with it
    // every call in flight on it, so the probabilities stay small.
    FaultSettings {
        delay_probability: 0.05,
        delay: Duration::from_millis(20),
        reset_before_probability: 0.01,
        drop_response_probability: 0.015,
        blackhole_probability: 0.002,
        cut_after_headers_probability: 0.005,
    }
}

struct World {
    clients: Vec<PayledgerClient>,
    payers: Vec<String>,
    merchants: Vec<(String, String)>,
    operations: Mutex<Vec<Operation>>,
    /// Acknowledged payments: (merchant_id, out_trade_no, amount, trade_no).
    payments: Mutex<Vec<(String, String, String, String)>>,
    duplicates_sent: AtomicU64,
    queries: AtomicU64,
    query_mismatches: Mutex<Vec<String>>,
    run: String,
    /// Mutating calls answered so far, for the progress line: acknowledged, refused, other.
    progress: [AtomicU64; 3],
}

impl World {
    fn client(&self) -> &PayledgerClient {
        self.clients.choose(&mut rand::rng()).expect("at least one instance")
    }

    /// Another instance's client than `first`, where there is one.
    fn other_client(&self, first: usize) -> (usize, usize) {
        let count = self.clients.len();
        let first = first % count;
        (first, (first + 1) % count)
    }

    fn new_key(&self, prefix: &str) -> String {
        format!("{}-{prefix}-{}", self.run, &uuid::Uuid::new_v4().simple().to_string()[..20])
    }

    /// Counts answered calls for the progress line.
    fn count(&self, outcomes: Vec<Outcome>) -> Vec<Outcome> {
        for outcome in &outcomes {
            let slot = match outcome {
                Outcome::Acknowledged { .. } => 0,
                Outcome::Refused(_) => 1,
                Outcome::Unknown(_) => 2,
            };
            self.progress[slot].fetch_add(1, Ordering::Relaxed);
        }
        outcomes
    }

    fn record(&self, kind: OperationKind, merchant_id: &str, key: String, amount: String, outcomes: Vec<Outcome>) {
        let operation = Operation { kind, merchant_id: merchant_id.to_owned(), key, amount, outcomes };
        self.operations.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(operation);
    }
}

fn random_amount(rng: &mut impl Rng, max_cents: i64) -> String {
    let cents = rng.random_range(100..=max_cents.max(101));
    format!("{}.{:02}", cents / 100, cents % 100)
}

/// Sends a call once or, for a duplicate, twice at once through two instances.
async fn send<T, F, Fut>(world: &World, duplicate: bool, call: F, id: impl Fn(&T) -> String + Copy) -> Vec<Outcome>
where
    F: Fn(PayledgerClient) -> Fut,
    Fut: std::future::Future<Output = Result<Response<T>, Status>>,
{
    if duplicate {
        world.duplicates_sent.fetch_add(1, Ordering::Relaxed);
        let (first, second) = world.other_client(rand::rng().random_range(0..world.clients.len()));
        let (one, two) = tokio::join!(call(world.clients[first].clone()), call(world.clients[second].clone()));
        world.count(vec![classify(&one, id), classify(&two, id)])
    } else {
        world.count(vec![classify(&call(world.client().clone()).await, id)])
    }
}

async fn caller(world: Arc<World>, until: Instant, duplicate_ratio: f64) {
    while Instant::now() < until {
        let (choice, duplicate, payer, other_payer, merchant) = {
            let mut rng = rand::rng();
            let payer = world.payers.choose(&mut rng).cloned().unwrap_or_default();
            let other_payer = world.payers.choose(&mut rng).cloned().unwrap_or_default();
            let merchant = world.merchants.choose(&mut rng).cloned().unwrap_or_default();
            (rng.random_range(0..100), rng.random_bool(duplicate_ratio), payer, other_payer, merchant)
        };
        match choice {
            0..10 => deposit(&world, duplicate, &payer).await,
            10..15 => withdraw(&world, duplicate, &payer).await,
            15..42 => pay(&world, duplicate, &payer, &merchant).await,
            42..50 => hold(&world, duplicate, &payer, &merchant).await,
            50..65 => refund(&world, duplicate).await,
            65..85 if payer != other_payer => transfer(&world, duplicate, &payer, &other_payer).await,
            _ => query(&world).await,
        }
    }
}

async fn deposit(world: &World, duplicate: bool, account_id: &str) {
    let request_id = world.new_key("dep");
    let amount = random_amount(&mut rand::rng(), 5_000);
    let request = proto::DepositRequest {
        request_id: request_id.clone(),
        account_id: account_id.to_owned(),
        amount: amount.clone(),
        currency: "USD".into(),
    };
    let outcomes = send(
        world,
        duplicate,
        |client| {
            let request = request.clone();
            async move { client.deposit(request).await }
        },
        |response: &proto::DepositResponse| {
            response.entry.as_ref().map(|entry| entry.posting_id.clone()).unwrap_or_default()
        },
    )
    .await;
    world.record(OperationKind::Deposit, "", request_id, amount, outcomes);
}

/// A payout of up to 20.00 (refused INSUFFICIENT_FUNDS when the payer is short).
async fn withdraw(world: &World, duplicate: bool, account_id: &str) {
    let request_id = world.new_key("out");
    let amount = random_amount(&mut rand::rng(), 2_000);
    let request = proto::WithdrawRequest {
        request_id: request_id.clone(),
        account_id: account_id.to_owned(),
        amount: amount.clone(),
        currency: "USD".into(),
    };
    let outcomes = send(
        world,
        duplicate,
        |client| {
            let request = request.clone();
            async move { client.withdraw(request).await }
        },
        |response: &proto::WithdrawResponse| {
            response.entry.as_ref().map(|entry| entry.posting_id.clone()).unwrap_or_default()
        },
    )
    .await;
    world.record(OperationKind::Withdraw, "", request_id, amount, outcomes);
}

/// One order in four expires 0-400 ms after it is created, and its Pay waits 0-400 ms: some
/// are paid in time, some refused ORDER_EXPIRED, and the instances' sweepers close the rest.
fn maybe_expiring() -> (Option<payledger_client::prost_types::Timestamp>, Duration) {
    let mut rng = rand::rng();
    if !rng.random_bool(0.25) {
        return (None, Duration::ZERO);
    }
    let ahead = Duration::from_millis(rng.random_range(0..=400));
    let expires_at = std::time::SystemTime::now() + ahead;
    let since_epoch = expires_at.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let timestamp = payledger_client::prost_types::Timestamp {
        seconds: i64::try_from(since_epoch.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(since_epoch.subsec_nanos()).unwrap_or(0),
    };
    (Some(timestamp), Duration::from_millis(rng.random_range(0..=400)))
}

/// Creates an order of a random amount up to 30.00 for `payee`: its order_no and amount, or
/// `None` when it could not be created.
async fn new_order(
    world: &World,
    merchant_id: &str,
    payee: &str,
    expires_at: Option<payledger_client::prost_types::Timestamp>,
) -> Option<(String, String)> {
    let order_no = world.new_key("order");
    let amount = random_amount(&mut rand::rng(), 3_000);
    let order = proto::CreateOrderRequest {
        merchant_id: merchant_id.to_owned(),
        order_no: order_no.clone(),
        payee_account_id: payee.to_owned(),
        amount: amount.clone(),
        currency: "USD".into(),
        subject: "storm".into(),
        expires_at,
    };
    world.client().create_order(order).await.ok().map(|_| (order_no, amount))
}

/// Remembers an acknowledged payment (of a Pay or a Capture) for later Refunds and Queries.
fn remember_payment(world: &World, merchant_id: &str, out_trade_no: &str, amount: &str, outcomes: &[Outcome]) {
    if let Some(Outcome::Acknowledged { id, .. }) =
        outcomes.iter().find(|outcome| matches!(outcome, Outcome::Acknowledged { .. }))
    {
        world.payments.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push((
            merchant_id.to_owned(),
            out_trade_no.to_owned(),
            amount.to_owned(),
            id.clone(),
        ));
    }
}

async fn pay(world: &World, duplicate: bool, payer: &str, (merchant_id, payee): &(String, String)) {
    let (expires_at, pay_after) = maybe_expiring();
    let Some((order_no, amount)) = new_order(world, merchant_id, payee, expires_at).await else {
        return;
    };
    tokio::time::sleep(pay_after).await;
    let out_trade_no = world.new_key("pay");
    let request = proto::PayRequest {
        merchant_id: merchant_id.clone(),
        out_trade_no: out_trade_no.clone(),
        order_no,
        payer_account_id: payer.to_owned(),
        amount: amount.clone(),
        currency: "USD".into(),
    };
    let outcomes = send(
        world,
        duplicate,
        |client| {
            let request = request.clone();
            async move { client.pay(request).await }
        },
        |response: &proto::PayResponse| {
            response.payment.as_ref().map(|payment| payment.trade_no.clone()).unwrap_or_default()
        },
    )
    .await;
    remember_payment(world, merchant_id, &out_trade_no, &amount, &outcomes);
    world.record(OperationKind::Pay, merchant_id, out_trade_no, amount, outcomes);
}

/// An order authorized for its amount, then, 0-1,500 ms later (holds last one second in the
/// storm), captured in part or voided.
async fn hold(world: &World, duplicate: bool, payer: &str, (merchant_id, payee): &(String, String)) {
    let Some((order_no, amount)) = new_order(world, merchant_id, payee, None).await else {
        return;
    };
    let out_auth_no = world.new_key("auth");
    let request = proto::AuthorizeRequest {
        merchant_id: merchant_id.clone(),
        out_auth_no: out_auth_no.clone(),
        order_no,
        payer_account_id: payer.to_owned(),
        amount: amount.clone(),
        currency: "USD".into(),
    };
    let outcomes = send(
        world,
        duplicate,
        |client| {
            let request = request.clone();
            async move { client.authorize(request).await }
        },
        |response: &proto::AuthorizeResponse| {
            response.hold.as_ref().map(|hold| hold.hold_no.clone()).unwrap_or_default()
        },
    )
    .await;
    let authorized = outcomes.iter().any(|outcome| matches!(outcome, Outcome::Acknowledged { .. }));
    world.record(OperationKind::Authorize, merchant_id, out_auth_no.clone(), amount.clone(), outcomes);
    if !authorized {
        return;
    }
    let (wait, void) = {
        let mut rng = rand::rng();
        (Duration::from_millis(rng.random_range(0..=1_500)), rng.random_bool(0.3))
    };
    tokio::time::sleep(wait).await;
    if void {
        let request = proto::VoidRequest { merchant_id: merchant_id.clone(), out_auth_no: out_auth_no.clone() };
        let outcomes = send(
            world,
            duplicate,
            |client| {
                let request = request.clone();
                async move { client.void(request).await }
            },
            |response: &proto::VoidResponse| {
                response.hold.as_ref().map(|hold| hold.hold_no.clone()).unwrap_or_default()
            },
        )
        .await;
        world.record(OperationKind::Void, merchant_id, out_auth_no, amount, outcomes);
        return;
    }
    let authorized_cents = amount.replace('.', "").parse::<i64>().unwrap_or(100);
    let cents = rand::rng().random_range(authorized_cents.min(100)..=authorized_cents);
    let captured = format!("{}.{:02}", cents / 100, cents % 100);
    let out_trade_no = world.new_key("capture");
    let request = proto::CaptureRequest {
        merchant_id: merchant_id.clone(),
        out_auth_no,
        out_trade_no: out_trade_no.clone(),
        amount: captured.clone(),
        currency: "USD".into(),
    };
    let outcomes = send(
        world,
        duplicate,
        |client| {
            let request = request.clone();
            async move { client.capture(request).await }
        },
        |response: &proto::CaptureResponse| {
            response.payment.as_ref().map(|payment| payment.trade_no.clone()).unwrap_or_default()
        },
    )
    .await;
    remember_payment(world, merchant_id, &out_trade_no, &captured, &outcomes);
    world.record(OperationKind::Capture, merchant_id, out_trade_no, captured, outcomes);
}

async fn refund(world: &World, duplicate: bool) {
    let Some((merchant_id, out_trade_no, amount, _)) =
        world.payments.lock().unwrap_or_else(std::sync::PoisonError::into_inner).choose(&mut rand::rng()).cloned()
    else {
        return;
    };
    let paid_cents = amount.replace('.', "").parse::<i64>().unwrap_or(100);
    let refund_amount = {
        let cents = rand::rng().random_range(1..=paid_cents.max(2) * 2 / 3);
        format!("{}.{:02}", cents / 100, cents % 100)
    };
    let out_refund_no = world.new_key("refund");
    let request = proto::RefundRequest {
        merchant_id: merchant_id.clone(),
        out_trade_no,
        out_refund_no: out_refund_no.clone(),
        amount: refund_amount.clone(),
        currency: "USD".into(),
        reason: "storm".into(),
    };
    let outcomes = send(
        world,
        duplicate,
        |client| {
            let request = request.clone();
            async move { client.refund(request).await }
        },
        |response: &proto::RefundResponse| {
            response.refund.as_ref().map(|refund| refund.refund_no.clone()).unwrap_or_default()
        },
    )
    .await;
    world.record(OperationKind::Refund, &merchant_id, out_refund_no, refund_amount, outcomes);
}

async fn transfer(world: &World, duplicate: bool, from: &str, to: &str) {
    let memo = world.new_key("transfer");
    let idempotency_key = uuid::Uuid::new_v4().to_string();
    let amount = random_amount(&mut rand::rng(), 2_000);
    let request = proto::TransferRequest {
        from_account_id: from.to_owned(),
        to_account_id: to.to_owned(),
        amount: amount.clone(),
        currency: "USD".into(),
        memo: memo.clone(),
    };
    let outcomes = send(
        world,
        duplicate,
        |client| {
            let (request, key) = (request.clone(), idempotency_key.clone());
            async move { client.transfer_with_key(request, &key).await }
        },
        |response: &proto::TransferResponse| {
            response.transfer.as_ref().map(|transfer| transfer.transfer_id.clone()).unwrap_or_default()
        },
    )
    .await;
    world.record(OperationKind::Transfer, "", memo, amount, outcomes);
}

async fn query(world: &World) {
    let Some((merchant_id, out_trade_no, _, trade_no)) =
        world.payments.lock().unwrap_or_else(std::sync::PoisonError::into_inner).choose(&mut rand::rng()).cloned()
    else {
        return;
    };
    world.queries.fetch_add(1, Ordering::Relaxed);
    let request = proto::QueryRequest { merchant_id, key: Some(Key::OutTradeNo(out_trade_no.clone())) };
    if let Ok(response) = world.client().query(request).await {
        let found = response.into_inner().payment.map(|payment| payment.trade_no).unwrap_or_default();
        if found != trade_no {
            world
                .query_mismatches
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(format!("Query {out_trade_no}: trade_no {found:?}, acknowledged {trade_no}"));
        }
    }
}

/// Runs the storm and prints its summary; exit status 1 on any violation.
///
/// # Errors
/// When instances cannot start or the database cannot be reached for the checks.
pub async fn run(settings: StormSettings) -> Result<ExitCode, AnyError> {
    let summary = storm(&settings).await?;
    print_summary(&summary);
    if settings.json {
        println!("storm-summary: {}", serde_json::to_string(&summary)?);
    }
    Ok(if summary.violations.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

fn print_summary(summary: &StormSummary) {
    println!("storm summary");
    println!(
        "  calls {}  acknowledged {}  refused {}  unknown {}  queries {}",
        summary.calls, summary.acknowledged, summary.refused, summary.unknown_outcome, summary.queries
    );
    println!(
        "  client attempts (setup included) {}  retries {}  duplicates sent {}  replays served {}",
        summary.attempts, summary.retries, summary.duplicates_sent, summary.replays_served
    );
    let faults = &summary.faults;
    println!(
        "  faults: delays {}  resets before request {}  dropped responses {}  black holes {}  cuts after headers {}  instance kills {}  database cuts {}",
        faults.delays,
        faults.resets_before_request,
        faults.dropped_responses,
        faults.blackholes,
        faults.cuts_after_headers,
        summary.instance_kills,
        summary.database_cuts
    );
    match summary.rate_without_faults {
        Some(without) => println!(
            "  rate: {:.1} calls/s with faults, {without:.1} without (the baseline): {:.2} of it",
            summary.rate_with_faults,
            summary.rate_with_faults / without.max(f64::EPSILON)
        ),
        None => println!("  rate: {:.1} calls/s", summary.rate_with_faults),
    }
    let codes: Vec<String> = summary.status_codes.iter().map(|(code, calls)| format!("{code} {calls}")).collect();
    println!("  final status codes of mutating calls: {}", codes.join("  "));
    println!(
        "  orders closed by the expiry sweeper {}  holds captured {}  holds released by the sweeper {}",
        summary.orders_expired, summary.holds_captured, summary.holds_expired
    );
    let audit_broken = summary.violations.iter().any(|violation| violation.starts_with("audit:"));
    println!("  ledger audit: {}", if audit_broken { "VIOLATED" } else { "passed" });
    println!("  violations {}", summary.violations.len());
    for violation in &summary.violations {
        println!("    VIOLATION {violation}");
    }
}

/// Runs the storm and checks its outcome.
///
/// # Errors
/// When instances cannot start or the database cannot be reached for the checks.
pub async fn storm(settings: &StormSettings) -> Result<StormSummary, AnyError> {
    sqlx::any::install_default_drivers();
    let database = StormDatabase::create(&settings.database_url[0], settings.reuse_database).await?;
    // Interrupted (SIGINT, SIGTERM), the run is dropped: its instances are killed
    // (`kill_on_drop`) and the database it created is dropped, as after a failure.
    let outcome = tokio::select! {
        outcome = storm_on(settings, &database) => outcome,
        () = payledger::startup::shutdown_signal() => Err("interrupted".into()),
    };
    let summary = match outcome {
        Ok(summary) => summary,
        Err(error) => {
            // A storm that could not run leaves no database of its own behind.
            if let Err(drop_error) = database.drop_if_created().await {
                eprintln!("payledger-tools: could not drop the storm's database: {drop_error}");
            }
            return Err(error);
        }
    };
    if summary.violations.is_empty() && !settings.keep_database {
        database.drop_if_created().await?;
    } else {
        println!("storm database kept for inspection: {}", payledger::store::redacted(&database.url));
    }
    Ok(summary)
}

async fn storm_on(settings: &StormSettings, database: &StormDatabase) -> Result<StormSummary, AnyError> {
    let dialect = database.dialect;
    let instance_count = settings.instances.max(1);
    // The token outlives the run with room to spare (the run's own bound is its duration).
    let auth =
        StormAuth::new(Duration::from_secs(settings.duration_seconds).saturating_add(Duration::from_secs(3600)))?;
    if instance_count < settings.database_url.len() {
        return Err(format!(
            "--instances ({instance_count}) is fewer than the --database-url given ({}): every node needs an instance",
            settings.database_url.len()
        )
        .into());
    }
    // One URL per node of a cluster; the first is the database the storm created.
    let mut node_urls = vec![database.url.clone()];
    for url in &settings.database_url[1..] {
        node_urls.push(database.on_node(url)?);
    }
    // Every node answers before the load starts (an instance would wait for its database,
    // and the storm would find out only at its end).
    for url in &node_urls {
        let node = <sqlx::AnyConnection as sqlx::Connection>::connect(url)
            .await
            .map_err(|error| format!("cannot reach the database at {}: {error}", payledger::store::redacted(url)))?;
        let _ = sqlx::Connection::close(node).await;
    }
    // Migrated once, before any instance starts: a MySQL named lock (GET_LOCK), which keeps
    // instances that start together from migrating at once, holds on one Galera node only.
    Store::connect(&database.url, &check_pool()).await?.migrate().await?;
    let mut instances = Vec::new();
    for number in 0..instance_count {
        instances.push(spawn_instance(&node_urls[number % node_urls.len()], &auth).await?);
    }
    let mut proxies = Vec::new();
    for instance in &instances {
        proxies.push(FaultProxy::start(instance.address, FaultSettings::none()).await?);
    }
    let retry = RetrySettings {
        // Bounded by the 30 s deadline rather than by count: short attempts, and quick
        // refusals each followed by the server's 250 ms pushback, must still span a cluster
        // node's absence (a Galera node killed and rejoined is gone 15 s or more).
        max_attempts: 100,
        initial_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_secs(1),
        per_attempt_timeout: Duration::from_millis(settings.attempt_timeout_ms.max(1)),
        overall_deadline: Duration::from_secs(30),
        // The storm cuts connections and kills instances on purpose and checks that every
        // call still ends exactly once: it wants every call retried, never throttled.
        throttling: None,
    };
    let clients = proxies
        .iter()
        .map(|proxy| {
            let settings = ClientSettings {
                retry: retry.clone(),
                bearer_token: Some(BearerToken::new(&auth.token)?),
                connections: settings.connections,
                ..ClientSettings::default()
            };
            Ok::<_, AnyError>(PayledgerClient::connect(&format!("http://{}", proxy.address()), settings)?)
        })
        .collect::<Result<Vec<_>, _>>()?;

    let run = uuid::Uuid::now_v7().simple().to_string()[20..].to_owned();
    let payers: Vec<String> = (0..20).map(|n| format!("storm-{run}-payer-{n}")).collect();
    let merchants: Vec<(String, String)> =
        (0..3).map(|n| (format!("storm-{run}-m{n}"), format!("storm-{run}-shop-{n}"))).collect();
    let setup = &clients[0];
    for account_id in payers.iter().chain(merchants.iter().map(|(_, shop)| shop)) {
        setup
            .open_account(proto::OpenAccountRequest { account_id: account_id.clone(), currency: "USD".into() })
            .await?;
    }
    for payer in &payers {
        let request = proto::DepositRequest {
            request_id: format!("{payer}-initial"),
            account_id: payer.clone(),
            amount: "300.00".into(),
            currency: "USD".into(),
        };
        setup.deposit(request).await?;
    }

    let world = Arc::new(World {
        clients,
        payers,
        merchants,
        operations: Mutex::new(Vec::new()),
        payments: Mutex::new(Vec::new()),
        duplicates_sent: AtomicU64::new(0),
        queries: AtomicU64::new(0),
        query_mismatches: Mutex::new(Vec::new()),
        run,
        progress: Default::default(),
    });

    let faults = !settings.no_faults;
    let finished = || world.progress.iter().map(|counter| counter.load(Ordering::Relaxed)).sum::<u64>();
    let baseline = Duration::from_secs(settings.baseline_seconds);
    let until = Instant::now() + baseline + Duration::from_secs(settings.duration_seconds);
    let callers: Vec<_> = (0..settings.callers.max(1))
        .map(|_| tokio::spawn(caller(world.clone(), until, settings.duplicate_ratio)))
        .collect();
    let mut rate_without_faults = None;
    if !baseline.is_zero() {
        tokio::time::sleep(baseline).await;
        let rate = finished() as f64 / baseline.as_secs_f64();
        println!("storm baseline: {}s without faults, {rate:.1} calls/s; the faults start now", baseline.as_secs());
        rate_without_faults = Some(rate);
    }
    let (faults_started, finished_before_faults) = (Instant::now(), finished());
    if faults {
        for proxy in &proxies {
            proxy.set_settings(storm_faults());
        }
    }

    // Chaos: kill and restart instances, cut database connections (on every node), until the
    // load ends. A node that is down (killed by the cluster test) is skipped within a second.
    let mut admins = Vec::new();
    for url in &node_urls {
        admins.push(
            sqlx::any::AnyPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(Duration::from_secs(1))
                .connect_lazy(url)?,
        );
    }
    let (mut kills, mut cuts) = (0u64, 0u64);
    let kill_every = Duration::from_secs(settings.kill_interval_seconds.max(1));
    let cut_every = Duration::from_secs(settings.cut_interval_seconds.max(1));
    let (mut next_kill, mut next_cut) = (Instant::now() + kill_every / 2, Instant::now() + cut_every / 3);
    // Besides the random draws, every fault kind is forced a few times, so that a short storm
    // still exercises each of them.
    let load = Duration::from_secs(settings.duration_seconds);
    // At seven points, so that a run whose connections are often cut (a forced fault is spent
    // on the next request, and a connection that dies first loses it) still shows each kind.
    let mut forced_at: Vec<Instant> = (1..=7).map(|eighth| Instant::now() + load * eighth / 8).collect();
    let started = Instant::now();
    let mut next_progress = started + PROGRESS_INTERVAL;
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if Instant::now() >= next_progress {
            next_progress += PROGRESS_INTERVAL;
            let injected: u64 = proxies.iter().map(|proxy| proxy.counters().injected()).sum();
            let [acknowledged, refused, other] = &world.progress;
            let read = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
            println!(
                "storm progress: {:>4}s  calls {}  acknowledged {}  refused {}  unknown or failed {}  faults {}  kills {}  cuts {}",
                started.elapsed().as_secs(),
                read(acknowledged) + read(refused) + read(other),
                read(acknowledged),
                read(refused),
                read(other),
                injected + kills + cuts,
                kills,
                cuts
            );
        }
        if !faults {
            continue;
        }
        if forced_at.first().is_some_and(|at| Instant::now() >= *at) {
            forced_at.remove(0);
            let proxy = &proxies[rand::rng().random_range(0..proxies.len())];
            proxy.force_next([
                Fault::Delay,
                Fault::ResetBefore,
                Fault::DropResponse,
                Fault::Blackhole,
                Fault::CutAfterHeaders,
            ]);
        }
        if Instant::now() >= next_kill {
            next_kill += kill_every;
            let victim = rand::rng().random_range(0..instances.len());
            instances[victim].child.start_kill()?;
            let _ = instances[victim].child.wait().await;
            kills += 1;
            tokio::time::sleep(Duration::from_millis(300)).await;
            let database_url = instances[victim].database_url.clone();
            // Restarted on a port of its own, behind the same proxy: its clients see one
            // address throughout, as behind a load balancer.
            instances[victim] = spawn_instance(&database_url, &auth).await?;
            proxies[victim].set_target(instances[victim].address);
        }
        if Instant::now() >= next_cut && dialect != Dialect::Sqlite {
            next_cut += cut_every;
            let mut cut = 0;
            for admin in &admins {
                cut += cut_database_connections(admin, dialect).await.unwrap_or(0);
            }
            if cut > 0 {
                cuts += 1;
            }
        }
    }
    for proxy in &proxies {
        proxy.set_settings(FaultSettings::none());
    }
    for caller in callers {
        caller.await?;
    }
    for admin in admins {
        admin.close().await;
    }

    let rate_with_faults =
        (finished() - finished_before_faults) as f64 / faults_started.elapsed().as_secs_f64().max(f64::EPSILON);
    let mut summary = StormSummary {
        instance_kills: kills,
        database_cuts: cuts,
        rate_with_faults,
        rate_without_faults,
        ..StormSummary::default()
    };
    for proxy in &proxies {
        let count = proxy.counters();
        summary.faults.connections += count.connections;
        summary.faults.delays += count.delays;
        summary.faults.resets_before_request += count.resets_before_request;
        summary.faults.dropped_responses += count.dropped_responses;
        summary.faults.blackholes += count.blackholes;
        summary.faults.cuts_after_headers += count.cuts_after_headers;
    }
    for client in &world.clients {
        summary.attempts += client.stats().attempts.load(Ordering::Relaxed);
        summary.retries += client.stats().retries.load(Ordering::Relaxed);
    }
    summary.duplicates_sent = world.duplicates_sent.load(Ordering::Relaxed);
    summary.queries = world.queries.load(Ordering::Relaxed);
    summary
        .violations
        .extend(world.query_mismatches.lock().unwrap_or_else(std::sync::PoisonError::into_inner).iter().cloned());
    let operations = world.operations.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
    check(&node_urls, &operations, &mut summary).await?;
    for mut instance in instances {
        let _ = instance.child.start_kill();
        let _ = instance.child.wait().await;
    }
    Ok(summary)
}

/// The pool of the storm's own checks (and of its migration).
fn check_pool() -> PoolSettings {
    PoolSettings {
        max_connections: 2,
        acquire_timeout: Duration::from_secs(10),
        lock_timeout: Duration::from_secs(10),
        plan_lifetime: PoolSettings::PLAN_LIFETIME_DEFAULT,
    }
}

/// The statement that reads the row (id, amount) `operation` wrote, in the form `dialect`
/// takes, with its values: the operation's key (a request_id, a memo), or its merchant_id and
/// key. None for a Void, which writes no row of its own (the hold's status and the audit say
/// the rest).
fn written_row(operation: &Operation, dialect: Dialect) -> Option<(&'static str, Vec<&str>)> {
    let postgres = dialect == Dialect::Postgres;
    let by_key = vec![operation.key.as_str()];
    let by_merchant = vec![operation.merchant_id.as_str(), operation.key.as_str()];
    Some(match operation.kind {
        OperationKind::Void => return None,
        OperationKind::Deposit if postgres => ("SELECT deposit_id, amount FROM deposits WHERE request_id = $1", by_key),
        OperationKind::Deposit => ("SELECT deposit_id, amount FROM deposits WHERE request_id = ?", by_key),
        OperationKind::Withdraw if postgres => {
            ("SELECT withdrawal_id, amount FROM withdrawals WHERE request_id = $1", by_key)
        }
        OperationKind::Withdraw => ("SELECT withdrawal_id, amount FROM withdrawals WHERE request_id = ?", by_key),
        OperationKind::Transfer if postgres => ("SELECT transfer_id, amount FROM transfers WHERE memo = $1", by_key),
        OperationKind::Transfer => ("SELECT transfer_id, amount FROM transfers WHERE memo = ?", by_key),
        OperationKind::Authorize if postgres => {
            ("SELECT hold_no, amount FROM holds WHERE merchant_id = $1 AND out_auth_no = $2", by_merchant)
        }
        OperationKind::Authorize => {
            ("SELECT hold_no, amount FROM holds WHERE merchant_id = ? AND out_auth_no = ?", by_merchant)
        }
        OperationKind::Pay | OperationKind::Capture if postgres => {
            ("SELECT trade_no, amount FROM payment_flow WHERE merchant_id = $1 AND out_trade_no = $2", by_merchant)
        }
        OperationKind::Pay | OperationKind::Capture => {
            ("SELECT trade_no, amount FROM payment_flow WHERE merchant_id = ? AND out_trade_no = ?", by_merchant)
        }
        OperationKind::Refund if postgres => {
            ("SELECT refund_no, amount FROM refunds WHERE merchant_id = $1 AND out_refund_no = $2", by_merchant)
        }
        OperationKind::Refund => {
            ("SELECT refund_no, amount FROM refunds WHERE merchant_id = ? AND out_refund_no = ?", by_merchant)
        }
    })
}

/// The final checks, from the database and the log of acknowledged calls; the audit runs
/// against every node's URL.
async fn check(node_urls: &[String], operations: &[Operation], summary: &mut StormSummary) -> Result<(), AnyError> {
    let database_url = node_urls[0].as_str();
    let store = Store::connect(database_url, &check_pool()).await?;
    let dialect = store.dialect();
    let raw = AnyPool::connect(database_url).await?;
    for operation in operations {
        summary.calls += operation.outcomes.len() as u64;
        let mut acknowledged_ids: Vec<&str> = Vec::new();
        let (mut refused, mut unknown) = (0, 0);
        for outcome in &operation.outcomes {
            let code = match outcome {
                Outcome::Acknowledged { id, replayed } => {
                    summary.acknowledged += 1;
                    summary.replays_served += u64::from(*replayed);
                    acknowledged_ids.push(id);
                    Code::Ok
                }
                Outcome::Refused(code) => {
                    refused += 1;
                    *code
                }
                Outcome::Unknown(code) => {
                    unknown += 1;
                    *code
                }
            };
            *summary.status_codes.entry(format!("{code:?}")).or_default() += 1;
            // INTERNAL means a bug (or a database state answered as one): never expected.
            if code == Code::Internal {
                summary.violations.push(format!("{:?} {}: answered INTERNAL", operation.kind, operation.key));
            }
        }
        summary.refused += refused;
        summary.unknown_outcome += unknown;
        acknowledged_ids.dedup();
        if acknowledged_ids.len() > 1 {
            summary.violations.push(format!(
                "{:?} {}: different ids acknowledged: {acknowledged_ids:?}",
                operation.kind, operation.key
            ));
        }
        let Some((sql, binds)) = written_row(operation, dialect) else { continue };
        let mut query = sqlx::query(sql);
        for bind in binds {
            query = query.bind(bind);
        }
        let rows = query.fetch_all(&raw).await?;
        let stored: Vec<(String, i64)> = rows
            .iter()
            .filter_map(|row| Some((row.try_get::<String, _>(0).ok()?, row.try_get::<i64, _>(1).ok()?)))
            .collect();
        let expected_cents = operation.amount.replace('.', "").parse::<i64>().unwrap_or(-1);
        let label = format!("{:?} {}", operation.kind, operation.key);
        match (acknowledged_ids.first(), stored.as_slice()) {
            (Some(id), [(stored_id, amount)]) => {
                if stored_id != id || *amount != expected_cents {
                    summary.violations.push(format!("{label}: acknowledged {id}, stored {stored_id} of {amount}"));
                }
            }
            (Some(id), rows) => {
                summary.violations.push(format!("{label}: acknowledged {id}, stored {} times", rows.len()))
            }
            (None, rows) if rows.len() > 1 => summary.violations.push(format!("{label}: stored {} times", rows.len())),
            (None, [_]) if unknown == 0 => summary.violations.push(format!("{label}: refused, yet it moved money")),
            (None, _) => {}
        }
    }
    let ledger = Ledger::new(store);
    for violation in ledger.audit().await? {
        summary.violations.push(format!("audit: {}: {} ({})", violation.check, violation.subject, violation.detail));
    }
    for (node, url) in node_urls.iter().enumerate().skip(1) {
        let node_ledger = Ledger::new(Store::connect(url, &check_pool()).await?);
        for violation in node_ledger.audit().await? {
            summary.violations.push(format!(
                "audit: node {}: {}: {} ({})",
                node + 1,
                violation.check,
                violation.subject,
                violation.detail
            ));
        }
        node_ledger.store().close().await;
    }
    let duplicated: Vec<(String, i64)> =
        sqlx::query("SELECT memo, COUNT(*) FROM transfers GROUP BY memo HAVING COUNT(*) > 1")
            .fetch_all(&raw)
            .await?
            .iter()
            .filter_map(|row| Some((row.try_get(0).ok()?, row.try_get(1).ok()?)))
            .collect();
    for (memo, count) in duplicated {
        summary.violations.push(format!("transfer {memo} executed {count} times"));
    }
    // Order expiry: no order was paid at or after its deadline.
    let paid_late: Vec<String> = sqlx::query(
        "SELECT p.out_trade_no FROM payment_flow p JOIN orders o ON o.merchant_id = p.merchant_id \
         AND o.order_no = p.order_no WHERE o.expires_at IS NOT NULL AND p.created_at >= o.expires_at",
    )
    .fetch_all(&raw)
    .await?
    .iter()
    .filter_map(|row| row.try_get(0).ok())
    .collect();
    for out_trade_no in paid_late {
        summary.violations.push(format!("Pay {out_trade_no}: paid at or after its order's expires_at"));
    }
    // Holds: none captured at or after its deadline.
    let captured_late: Vec<String> = sqlx::query(
        "SELECT out_auth_no FROM holds h JOIN payment_flow p ON p.merchant_id = h.merchant_id \
         AND p.out_trade_no = h.out_trade_no WHERE h.status = 'CAPTURED' AND p.created_at >= h.expires_at",
    )
    .fetch_all(&raw)
    .await?
    .iter()
    .filter_map(|row| row.try_get(0).ok())
    .collect();
    for out_auth_no in captured_late {
        summary.violations.push(format!("Capture of {out_auth_no}: captured at or after the hold's expires_at"));
    }
    let count = |status: &'static str| {
        let raw = &raw;
        async move {
            let sql = format!("SELECT COUNT(*) FROM holds WHERE status = '{status}'");
            let row = sqlx::query(&sql).fetch_one(raw).await?;
            Ok::<u64, sqlx::Error>(u64::try_from(row.try_get::<i64, _>(0)?).unwrap_or(0))
        }
    };
    summary.holds_captured = count("CAPTURED").await?;
    summary.holds_expired = count("EXPIRED").await?;
    let expired = sqlx::query("SELECT COUNT(*) FROM orders WHERE close_reason = 'EXPIRED'").fetch_one(&raw).await?;
    summary.orders_expired = u64::try_from(expired.try_get::<i64, _>(0)?).unwrap_or(0);
    raw.close().await;
    ledger.store().close().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn operation(kind: OperationKind, key: &str, outcomes: Vec<Outcome>) -> Operation {
        Operation { kind, merchant_id: "m1".into(), key: key.into(), amount: "1.00".into(), outcomes }
    }

    #[tokio::test]
    async fn the_checks_report_an_acknowledged_call_that_left_no_trace() {
        let directory = tempfile::tempdir().unwrap();
        let url = format!("sqlite:{}", directory.path().join("storm.db").display());
        let settings = PoolSettings {
            max_connections: 1,
            acquire_timeout: Duration::from_secs(5),
            lock_timeout: Duration::from_secs(5),
            plan_lifetime: PoolSettings::PLAN_LIFETIME_DEFAULT,
        };
        let store = Store::connect(&url, &settings).await.unwrap();
        store.migrate().await.unwrap();
        store.close().await;
        let acknowledged = Outcome::Acknowledged { id: "T-lost".into(), replayed: false };
        let operations = [
            operation(OperationKind::Pay, "pay-1", vec![acknowledged.clone(), Outcome::Unknown(Code::Unavailable)]),
            operation(OperationKind::Transfer, "memo-1", vec![Outcome::Refused(Code::FailedPrecondition)]),
            operation(OperationKind::Deposit, "dep-1", vec![Outcome::Unknown(Code::Internal)]),
        ];

        let mut summary = StormSummary::default();
        check(std::slice::from_ref(&url), &operations, &mut summary).await.unwrap();

        assert_eq!(
            summary.violations,
            ["Pay pay-1: acknowledged T-lost, stored 0 times", "Deposit dep-1: answered INTERNAL"]
        );
        assert_eq!((summary.calls, summary.acknowledged, summary.refused, summary.unknown_outcome), (4, 1, 1, 2));
        let codes: Vec<_> = summary.status_codes.iter().map(|(code, calls)| (code.as_str(), *calls)).collect();
        assert_eq!(codes, [("FailedPrecondition", 1), ("Internal", 1), ("Ok", 1), ("Unavailable", 1)]);
    }
}
