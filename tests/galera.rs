//! payledger on a 3-node MariaDB Galera cluster (multi-primary), one instance per node, as
//! `bench/galera.sh start` runs it on loopback. `PAYLEDGER_TEST_GALERA_URLS` names one admin
//! URL per node, comma-separated (`bench/galera.sh urls`); each test creates its own database
//! through the first node and drops it after.
//!
//! - The same Pay, then the same Refund, sent through all three instances at once: money
//!   moves once, and the three answers carry one trade_no (refund_no), two of them replays.
//! - CreateOrder through one node, Pay through the next, Query through the third, right after
//!   each other: never NOT_FOUND (each session reads with `wsrep_sync_wait`).
//! - Deposits into many accounts through all three nodes at once: the funding account is
//!   sharded on Galera, so few are refused ABORTED even on the first attempt (the rate is
//!   printed, and bounded).
//!
//! Every test ends with the audit, run against every node. One test desyncs the last node
//! (`SET GLOBAL wsrep_desync`) for a few seconds: run them on a cluster of their own.

mod common;

use std::time::Duration;

use futures::StreamExt;

use payledger::config::{DatabaseSettings, IdempotencySettings, WriteSettings};
use payledger::ledger::Ledger;
use payledger::proto::{self, query_request::Key};
use payledger_client::{was_replayed, ClientSettings, PayledgerClient, RetrySettings};
use tonic::Code;

const URLS_VARIABLE: &str = "PAYLEDGER_TEST_GALERA_URLS";

/// A database of this test on every node, and an instance of payledger on each.
struct Cluster {
    name: String,
    admin_url: String,
    node_urls: Vec<String>,
    instances: Vec<common::Served>,
    clients: Vec<PayledgerClient>,
}

/// A ledger on the node at `url` as `serve` opens one (migrations, Galera detection, the
/// funding shards' default when `funding_account_shards` is `None`).
async fn open_node(
    url: &str,
    pool_size: u32,
    funding_account_shards: Option<u32>,
) -> Result<Ledger, payledger::startup::StartupError> {
    let database = DatabaseSettings {
        database_url: url.to_owned(),
        pool_size,
        pool_acquire_timeout_ms: 5_000,
        plan_lifetime_seconds: 30,
        lock_timeout_ms: 5_000,
        database_wait_seconds: 10,
    };
    let writes = WriteSettings { pay_batch_pipeline: 1, funding_account_shards, ..WriteSettings::default() };
    payledger::startup::open_ledger(&database, &writes, &IdempotencySettings::default()).await
}

/// A pool of one connection on a node, which gives up within 5 s when the node is down.
async fn admin_pool(url: &str) -> Result<sqlx::AnyPool, sqlx::Error> {
    sqlx::any::AnyPoolOptions::new().max_connections(1).acquire_timeout(Duration::from_secs(5)).connect(url).await
}

/// [`admin_pool`] on a database just created through another node, which this node may not
/// have applied yet (its DDL is ordered, not waited for, on the other nodes): tried for up to 10 s.
async fn pool_once_there(url: &str) -> sqlx::AnyPool {
    let mut tries = 0;
    loop {
        match admin_pool(url).await {
            Ok(pool) => return pool,
            Err(_) if tries < 100 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => panic!("{url}: {error}"),
        }
    }
}

/// The cluster's admin URLs, or `None` (skipped) when the variable is unset outside CI.
fn node_admin_urls() -> Option<Vec<String>> {
    let urls = common::admin_url(URLS_VARIABLE)?;
    let urls: Vec<String> = urls.split(',').map(str::trim).filter(|url| !url.is_empty()).map(String::from).collect();
    assert!(urls.len() >= 2, "{URLS_VARIABLE} names at least two nodes");
    Some(urls)
}

impl Cluster {
    /// A new database through the first node, then one instance per node, started one after
    /// another (the first migrates; MySQL's migration lock holds on one Galera node only).
    /// `funding_account_shards`: `None` for the default (16 on Galera).
    async fn start(admin_urls: &[String], funding_account_shards: Option<u32>, retry: RetrySettings) -> Self {
        sqlx::any::install_default_drivers();
        let name = format!("payledger_galera_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        let admin = admin_pool(&admin_urls[0]).await.expect("the first node answers");
        sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await.unwrap();
        admin.close().await;
        let node_urls: Vec<String> = admin_urls.iter().map(|url| common::database_url(url, &name)).collect();
        let mut instances = Vec::new();
        for url in &node_urls {
            let ledger = open_node(url, 8, funding_account_shards).await.expect("an instance opens its node");
            assert!(ledger.store().is_galera(), "{url} is a Galera node");
            instances.push(common::serve_ledger(ledger).await);
        }
        let clients = instances
            .iter()
            .map(|instance| {
                let settings = ClientSettings { retry: retry.clone(), ..ClientSettings::default() };
                PayledgerClient::connect(&format!("http://{}", instance.address), settings).unwrap()
            })
            .collect();
        Self { name, admin_url: admin_urls[0].clone(), node_urls, instances, clients }
    }

    fn client(&self, n: usize) -> &PayledgerClient {
        &self.clients[n % self.clients.len()]
    }

    async fn open(&self, account_id: &str) {
        let request = proto::OpenAccountRequest { account_id: account_id.into(), currency: "USD".into() };
        self.client(0).open_account(request).await.expect("the account opens");
    }

    async fn deposit(&self, through: usize, request_id: &str, account_id: &str, amount: &str) -> Result<(), Code> {
        let request = proto::DepositRequest {
            request_id: request_id.into(),
            account_id: account_id.into(),
            amount: amount.into(),
            currency: "USD".into(),
        };
        self.client(through).deposit(request).await.map(|_| ()).map_err(|status| status.code())
    }

    async fn create_order(&self, through: usize, order_no: &str, amount: &str) {
        let request = proto::CreateOrderRequest {
            merchant_id: "m1".into(),
            order_no: order_no.into(),
            payee_account_id: "shop".into(),
            amount: amount.into(),
            currency: "USD".into(),
            subject: String::new(),
            expires_at: None,
        };
        self.client(through).create_order(request).await.expect("the order is created");
    }

    /// The balance of `account_id` as every node reads it; they must agree.
    async fn balance(&self, account_id: &str) -> String {
        let mut seen = Vec::new();
        for client in &self.clients {
            let request = proto::GetAccountRequest { account_id: account_id.into() };
            seen.push(client.get_account(request).await.unwrap().into_inner().account.unwrap().balance);
        }
        assert!(seen.windows(2).all(|pair| pair[0] == pair[1]), "every node reads one balance: {seen:?}");
        seen.remove(0)
    }

    /// Runs the audit against every node, stops the instances and drops the database.
    async fn audit_and_drop(self) {
        for instance in self.instances {
            instance.shut_down().await;
        }
        for url in &self.node_urls {
            let settings = common::small_pool(Duration::from_secs(10));
            let ledger = Ledger::new(payledger::store::Store::connect_existing(url, &settings).await.unwrap());
            let violations = ledger.audit().await.unwrap();
            assert!(violations.is_empty(), "audit on {url}: {violations:?}");
            ledger.store().close().await;
        }
        let admin = admin_pool(&self.admin_url).await.unwrap();
        sqlx::query(&format!("DROP DATABASE {}", self.name)).execute(&admin).await.unwrap();
        admin.close().await;
    }
}

/// The retrying client as callers run it.
fn retrying() -> RetrySettings {
    RetrySettings::default()
}

/// One attempt per call: what the server answers first.
fn single_attempt() -> RetrySettings {
    RetrySettings { max_attempts: 1, throttling: None, ..RetrySettings::default() }
}

/// The answers to one call sent through every node at once: all OK, one fresh and the others
/// replays, all with the same id.
fn one_original_and_replays<T>(
    call: &str,
    answers: Vec<Result<tonic::Response<T>, tonic::Status>>,
    id: impl Fn(T) -> String,
) {
    let mut ids = Vec::new();
    let mut fresh = 0;
    for answer in answers {
        let answer = answer.unwrap_or_else(|status| panic!("{call}: {status:?}"));
        fresh += usize::from(!was_replayed(&answer));
        ids.push(id(answer.into_inner()));
    }
    assert!(ids.windows(2).all(|pair| pair[0] == pair[1]), "{call}: one id, got {ids:?}");
    assert_eq!(fresh, 1, "{call}: one fresh answer, the others replays");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_same_pays_and_refunds_through_three_nodes_move_money_once() {
    let Some(admin_urls) = node_admin_urls() else { return };
    let cluster = Cluster::start(&admin_urls, None, retrying()).await;
    cluster.open("payer").await;
    cluster.open("shop").await;
    cluster.deposit(0, "fund", "payer", "1000.00").await.unwrap();
    const ORDERS: usize = 40;
    for n in 0..ORDERS {
        let order_no = format!("o-{n}");
        cluster.create_order(n, &order_no, "10.00").await;
        let pay = proto::PayRequest {
            merchant_id: "m1".into(),
            out_trade_no: format!("p-{n}"),
            order_no: order_no.clone(),
            payer_account_id: "payer".into(),
            amount: "10.00".into(),
            currency: "USD".into(),
        };
        let answers = futures::future::join_all(cluster.clients.iter().map(|client| client.pay(pay.clone()))).await;
        one_original_and_replays(&format!("Pay {n}"), answers, |answer| answer.payment.unwrap().trade_no);

        let refund = proto::RefundRequest {
            merchant_id: "m1".into(),
            out_trade_no: format!("p-{n}"),
            out_refund_no: format!("r-{n}"),
            amount: "4.00".into(),
            currency: "USD".into(),
            reason: String::new(),
        };
        let answers =
            futures::future::join_all(cluster.clients.iter().map(|client| client.refund(refund.clone()))).await;
        one_original_and_replays(&format!("Refund {n}"), answers, |answer| answer.refund.unwrap().refund_no);
    }
    // 40 Pays of 10.00 and 40 Refunds of 4.00, each once.
    assert_eq!(cluster.balance("payer").await, "760.00");
    assert_eq!(cluster.balance("shop").await, "240.00");
    cluster.audit_and_drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_query_right_after_a_pay_through_another_node_never_answers_not_found() {
    let Some(admin_urls) = node_admin_urls() else { return };
    // One attempt: the first answer of each node is what is checked, NOT_FOUND included.
    let cluster = Cluster::start(&admin_urls, None, single_attempt()).await;
    cluster.open("payer").await;
    cluster.open("shop").await;
    cluster.deposit(0, "fund", "payer", "10000.00").await.unwrap();
    const ROUNDS: usize = 300;
    let (mut not_found, mut other) = (Vec::new(), Vec::new());
    for n in 0..ROUNDS {
        let order_no = format!("o-{n}");
        cluster.create_order(n, &order_no, "1.00").await;
        let pay = proto::PayRequest {
            merchant_id: "m1".into(),
            out_trade_no: format!("p-{n}"),
            order_no,
            payer_account_id: "payer".into(),
            amount: "1.00".into(),
            currency: "USD".into(),
        };
        let trade_no = match cluster.client(n + 1).pay(pay).await {
            Ok(answer) => answer.into_inner().payment.unwrap().trade_no,
            Err(status) if status.code() == Code::NotFound => {
                not_found.push(format!("Pay {n} after CreateOrder through another node"));
                continue;
            }
            Err(status) => {
                other.push(format!("Pay {n}: {status:?}"));
                continue;
            }
        };
        let query = proto::QueryRequest { merchant_id: "m1".into(), key: Some(Key::OutTradeNo(format!("p-{n}"))) };
        match cluster.client(n + 2).query(query).await {
            Ok(answer) => assert_eq!(answer.into_inner().payment.unwrap().trade_no, trade_no),
            Err(status) if status.code() == Code::NotFound => {
                not_found.push(format!("Query {n} after Pay through another node"));
            }
            Err(status) => other.push(format!("Query {n}: {status:?}")),
        }
    }
    assert!(not_found.is_empty(), "stale reads across nodes: {not_found:?}");
    // Anything else must be retryable (a certification conflict that outlasted the server's
    // own retries), never INTERNAL.
    assert!(
        other.iter().all(|failure| failure.contains("Aborted") || failure.contains("Unavailable")),
        "non-retryable failures: {other:?}"
    );
    cluster.audit_and_drop().await;
}

/// Deposits into `ACCOUNTS` accounts, `CONCURRENT` at a time, round-robin through the nodes,
/// one attempt each: the share answered ABORTED (a certification conflict that outlasted the
/// server's transaction retries). Any other failure fails the test.
async fn aborted_share_of_deposits_through_every_node(cluster: &Cluster) -> f64 {
    const ACCOUNTS: usize = 30;
    const DEPOSITS: usize = 900;
    const CONCURRENT: usize = 30;
    for n in 0..ACCOUNTS {
        cluster.open(&format!("a-{n}")).await;
    }
    let outcomes: Vec<Result<(), Code>> = futures::stream::iter(0..DEPOSITS)
        .map(|n| async move { cluster.deposit(n, &format!("d-{n}"), &format!("a-{}", n % ACCOUNTS), "1.00").await })
        .buffer_unordered(CONCURRENT)
        .collect()
        .await;
    let aborted = outcomes.iter().filter(|outcome| **outcome == Err(Code::Aborted)).count();
    let failed: Vec<_> =
        outcomes.iter().filter(|outcome| matches!(outcome, Err(code) if *code != Code::Aborted)).collect();
    assert!(failed.is_empty(), "deposits failed otherwise than ABORTED: {failed:?}");
    let done = DEPOSITS - aborted;
    let mut total = 0;
    for n in 0..ACCOUNTS {
        let balance = cluster.balance(&format!("a-{n}")).await;
        total += balance.replace('.', "").parse::<usize>().unwrap();
    }
    assert_eq!(total, done * 100, "every acknowledged deposit credited once, no refused one");
    aborted as f64 / DEPOSITS as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deposits_through_three_nodes_are_rarely_refused_with_a_sharded_funding_account() {
    let Some(admin_urls) = node_admin_urls() else { return };
    let sharded = Cluster::start(&admin_urls, None, single_attempt()).await;
    assert_eq!(sharded.instances[0].ledger.funding_account_shards(), 16, "Galera's default");
    let sharded_share = aborted_share_of_deposits_through_every_node(&sharded).await;
    sharded.audit_and_drop().await;
    let single = Cluster::start(&admin_urls, Some(1), single_attempt()).await;
    let single_share = aborted_share_of_deposits_through_every_node(&single).await;
    single.audit_and_drop().await;
    eprintln!(
        "deposits through every node answered ABORTED on their only attempt: {:.1}% with 16 funding shards, {:.1}% with one",
        sharded_share * 100.0,
        single_share * 100.0
    );
    assert!(
        sharded_share <= 0.02,
        "at most 2% ABORTED with a sharded funding account, got {:.1}%",
        sharded_share * 100.0
    );
}

/// The gRPC health of the server at `address` for the whole server (`""`).
async fn health(address: std::net::SocketAddr) -> Option<tonic_health::pb::health_check_response::ServingStatus> {
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let channel = tonic::transport::Channel::from_shared(format!("http://{address}")).ok()?.connect().await.ok()?;
    let answer = HealthClient::new(channel).check(HealthCheckRequest { service: String::new() }).await.ok()?;
    tonic_health::pb::health_check_response::ServingStatus::try_from(answer.into_inner().status).ok()
}

/// Waits (at most 15 s, a bound on the test) until health says `expected`.
async fn until_health_is(
    address: std::net::SocketAddr,
    expected: tonic_health::pb::health_check_response::ServingStatus,
) {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while health(address).await != Some(expected) {
        assert!(std::time::Instant::now() < deadline, "health did not turn {expected:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_follows_the_node_state_not_only_whether_it_answers() {
    use tonic_health::pb::health_check_response::ServingStatus;
    let Some(admin_urls) = node_admin_urls() else { return };
    let node = admin_urls.last().unwrap().clone();
    let cluster = Cluster::start(std::slice::from_ref(&node), None, retrying()).await;
    let ledger = cluster.instances[0].ledger.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let application = payledger::startup::Application::with_listener(listener, ledger, Duration::from_secs(1))
        .with_health_check_interval(Duration::from_millis(100));
    let address = application.local_addr();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(application.run_until(async {
        let _ = stopped.await;
    }));
    until_health_is(address, ServingStatus::Serving).await;
    // A desynced node (as for a backup, or a donor of a state transfer) answers every query,
    // yet the cluster's load balancers take it out (clustercheck: Synced only); so does health.
    let admin = admin_pool(&node).await.unwrap();
    sqlx::query("SET GLOBAL wsrep_desync = ON").execute(&admin).await.unwrap();
    let desynced = async {
        until_health_is(address, ServingStatus::NotServing).await;
    };
    let outcome = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(desynced)).await;
    sqlx::query("SET GLOBAL wsrep_desync = OFF").execute(&admin).await.unwrap();
    admin.close().await;
    assert!(outcome.is_ok(), "health did not turn NOT_SERVING on a desynced node");
    until_health_is(address, ServingStatus::Serving).await;
    let _ = stop.send(());
    let _ = server.await;
    cluster.audit_and_drop().await;
}

/// Round after round on a fresh database: in every other round a `payledger migrate` through
/// the first node is killed once it has applied a random number of the migrations (while it
/// holds the cluster's migration lease, so the others wait for the lease to lapse); then one
/// instance per node starts, all at once. Every instance comes up and serves, and the schema
/// is complete. MySQL's `GET_LOCK` holds on one node only: the instances race through three
/// nodes, one wins the cluster-wide lease, the others wait for its migrations.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn instances_that_start_together_on_every_node_all_migrate_and_serve() {
    let Some(admin_urls) = node_admin_urls() else { return };
    sqlx::any::install_default_drivers();
    let (rounds, total) = (common::start_rounds(), common::migration_count("mysql:"));
    let mut left = Vec::new();
    for round in 0..rounds {
        let name = format!("payledger_galera_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        let admin = admin_pool(&admin_urls[0]).await.unwrap();
        sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await.unwrap();
        let node_urls: Vec<String> = admin_urls.iter().map(|url| common::database_url(url, &name)).collect();
        if round % 2 == 1 {
            common::migrate_killed_after(&node_urls[0], rand::random_range(0..total)).await;
            left.push(common::history(&node_urls[0]).await);
        }
        common::instances_start_together_and_serve(&node_urls, node_urls.len()).await;
        sqlx::query(&format!("DROP DATABASE {name}")).execute(&admin).await.unwrap();
        admin.close().await;
    }
    eprintln!(
        "{rounds} rounds of one start per node at once; {} after a killed `payledger migrate`, which left \
         (applied, begun) of {total} migrations: {left:?}",
        left.len()
    );
}

/// Where [`pause_a_lease_holder`] stops the first instance.
#[derive(Debug, Clone, Copy)]
enum PauseAt {
    /// Once it has applied this many migrations, wherever it then is.
    Applied(i64),
    /// Once it has applied this many migrations, while the answer to its next lease check
    /// (which found the lease still its own) is on its way: the check passed, and what the
    /// holder does next happens after the lease moved on.
    LeaseCheckAnswered(i64),
}

/// A lease holder paused for longer than the lease (SIGSTOP while it migrates through the
/// first node, once it has applied a random number of migrations) loses the lease to an
/// instance starting through the second node, which completes the migrations; resumed, the
/// first finds its lease gone before its next statement, stops migrating, waits, and finds
/// the schema complete. Nothing is applied twice: the history and the progress table end
/// as one clean run leaves them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_holder_paused_past_its_lease_stops_when_it_resumes() {
    let total = common::migration_count("mysql:");
    pause_a_lease_holder(PauseAt::Applied(rand::random_range(1..total - 1))).await;
}

/// As above, with the holder stopped between a lease check's answer and what it sends next
/// (the test holds the lease row's lock until the check waits for it, stops the holder, and
/// lets the check through): no check can stop it, so it finds its progress row gone or its
/// statement's change there, and takes that for the lost lease rather than a failed
/// migration.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_holder_paused_after_a_passed_check_stops_when_it_resumes() {
    let total = common::migration_count("mysql:");
    pause_a_lease_holder(PauseAt::LeaseCheckAnswered(rand::random_range(1..total - 1))).await;
}

async fn pause_a_lease_holder(at: PauseAt) {
    let Some(admin_urls) = node_admin_urls() else { return };
    sqlx::any::install_default_drivers();
    let name = format!("payledger_galera_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let admin = admin_pool(&admin_urls[0]).await.unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await.unwrap();
    let node_urls: Vec<String> = admin_urls.iter().map(|url| common::database_url(url, &name)).collect();
    let total = common::migration_count("mysql:");
    let watch = pool_once_there(&node_urls[1]).await;
    // Row locks hold on the node that takes them: the lease row is locked where the first migrates.
    let first_node = sqlx::any::AnyPoolOptions::new().max_connections(2).connect(&node_urls[0]).await.unwrap();

    let mut first = tokio::process::Command::new(env!("CARGO_BIN_EXE_payledger"))
        .args(["migrate", "--database-url", &node_urls[0], "--database-wait-seconds", "0"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = first.id().unwrap().to_string();
    let pause = |pid: &str| {
        let stopped = std::process::Command::new("kill").args(["-STOP", pid]).status().unwrap();
        assert!(stopped.success());
    };
    let (PauseAt::Applied(target) | PauseAt::LeaseCheckAnswered(target)) = at;
    let mut paused_at = None;
    for _ in 0..5_000 {
        let (applied, _) = common::history_on(&watch).await;
        if applied < target {
            tokio::time::sleep(Duration::from_millis(2)).await;
            continue;
        }
        if let PauseAt::LeaseCheckAnswered(_) = at {
            let mut blocker = first_node.begin().await.unwrap();
            sqlx::query("SELECT holder FROM payledger_migration_lease WHERE id = 1 FOR UPDATE")
                .fetch_optional(&mut *blocker)
                .await
                .unwrap();
            // The migrating connection (not the renewal's): the one holding the migration lock.
            let waiting = "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
                           WHERE ID = IS_USED_LOCK(CONCAT('payledger_migrate_', MD5(DATABASE()))) \
                           AND INFO LIKE '%UPDATE payledger_migration_lease SET expires_at%'";
            let mut checked = false;
            for _ in 0..2_000 {
                if sqlx::query_scalar::<_, i64>(waiting).fetch_one(&first_node).await.unwrap() > 0 {
                    checked = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            assert!(checked, "the migrating connection's lease check waits for the lease row");
            pause(&pid);
            blocker.commit().await.unwrap();
            // The check, let through, renews the lease: it lapses a lease from now.
        } else {
            pause(&pid);
        }
        paused_at = Some(common::history_on(&watch).await);
        break;
    }
    let paused_at = paused_at.expect("the first instance got as far as the target");
    assert!(paused_at.0 < total, "paused before the end: {paused_at:?}");
    // The lease lapses 20 s after its last renewal.
    let lapsed = "SELECT COUNT(*) FROM payledger_migration_lease WHERE expires_at >= UNIX_TIMESTAMP()";
    for _ in 0..60 {
        if sqlx::query_scalar::<_, i64>(lapsed).fetch_one(&watch).await.unwrap() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }

    let second = common::open_instance(&node_urls[1]).await;
    let second = second.unwrap_or_else(|error| panic!("{}", payledger::startup::error_chain(&error)));
    assert_eq!(common::history_on(&watch).await, (total, 0), "the second instance completed the migrations");
    let resumed = std::process::Command::new("kill").args(["-CONT", &pid]).status().unwrap();
    assert!(resumed.success());
    let exited = tokio::time::timeout(Duration::from_secs(150), first.wait()).await.expect("the first exits").unwrap();
    let mut said = String::new();
    if let Some(mut stderr) = first.stderr.take() {
        use tokio::io::AsyncReadExt as _;
        let _ = stderr.read_to_string(&mut said).await;
    }
    assert!(exited.success(), "the first instance, resumed, finds the schema complete: {said}");
    assert_eq!(common::history_on(&watch).await, (total, 0));
    let progress: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM payledger_migration_progress").fetch_one(&watch).await.unwrap();
    assert_eq!(progress, 0, "no migration is left in progress");
    assert!(second.audit().await.unwrap().is_empty());
    second.store().close().await;
    watch.close().await;
    first_node.close().await;
    eprintln!("{at:?}: paused with (applied, begun) = {paused_at:?}; the first said: {said}");
    sqlx::query(&format!("DROP DATABASE {name}")).execute(&admin).await.unwrap();
    admin.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_transaction_runs_after_the_cluster_aborted_it_is_never_committed() {
    let Some(admin_urls) = node_admin_urls() else { return };
    let cluster = Cluster::start(&admin_urls[..1], None, retrying()).await;
    cluster.open("a").await;
    cluster.open("b").await;
    let ledger = cluster.instances[0].ledger.clone();
    let other = admin_pool(&common::database_url(&admin_urls[1], &cluster.name)).await.unwrap();
    let b_updated_at = "SELECT updated_at FROM accounts WHERE account_id = 'b'";
    let before: i64 = sqlx::query_scalar(b_updated_at).fetch_one(&other).await.unwrap();

    let mut tx = ledger.store().begin().await.unwrap();
    tx.on_session("UPDATE accounts SET updated_at = updated_at + 1 WHERE account_id = 'a'").await.unwrap();
    // Another node commits a write of the same row: applied here, it aborts `tx`.
    sqlx::query("UPDATE accounts SET updated_at = updated_at + 10 WHERE account_id = 'a'")
        .execute(&other)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The abort is reported on the next statement; a body that went on anyway (or one that
    // the database never told) writes outside the transaction that began.
    let reported = tx.on_session("UPDATE accounts SET updated_at = updated_at + 100 WHERE account_id = 'b'").await;
    assert!(reported.is_err(), "the abort is reported: {reported:?}");
    tx.on_session("UPDATE accounts SET updated_at = updated_at + 1000 WHERE account_id = 'b'").await.unwrap();
    assert!(!tx.still_open().await.unwrap(), "the transaction that began is gone");
    tx.rollback().await.unwrap();

    // Read through another node, after a causal wait: nothing of it was committed.
    let reader = admin_pool(&common::database_url(&admin_urls[1], &cluster.name)).await.unwrap();
    let after: i64 = sqlx::query_scalar(&format!("SET STATEMENT wsrep_sync_wait = 1 FOR {b_updated_at}"))
        .fetch_one(&reader)
        .await
        .unwrap();
    assert_eq!(after, before, "a write after the abort committed alone");
    other.close().await;
    reader.close().await;
    cluster.audit_and_drop().await;
}
