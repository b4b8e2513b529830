//! A real payledger server on port 0 over a fresh database, and a client to drive it.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use payledger::auth::dev::{SigningKey, TokenClaims};
use payledger::auth::Authenticator;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;

use payledger::ledger::{GroupCommitSettings, Ledger, LedgerSettings, TokenStore};
use payledger::proto::account_service_client::AccountServiceClient;
use payledger::proto::payment_service_client::PaymentServiceClient;

/// A PaymentService client of a test's server.
pub type Payments = PaymentServiceClient<InterceptedService<Channel, DefaultCredential>>;
use payledger::proto::{self, query_request::Key};
use payledger::startup::Application;
use payledger::store::{PoolSettings, Store};
use sqlx::{AnyPool, Row};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};
use tonic_types::StatusExt;

/// The backends the one suite runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
    MySql,
}

impl Backend {
    /// The variable holding an admin URL of this backend's server; each test creates its
    /// own database there.
    fn admin_url_variable(self) -> Option<&'static str> {
        match self {
            Backend::Sqlite => None,
            Backend::Postgres => Some("PAYLEDGER_TEST_POSTGRES_URL"),
            Backend::MySql => Some("PAYLEDGER_TEST_MYSQL_URL"),
        }
    }
}

/// How a case wants its server set up.
#[derive(Debug, Clone)]
pub struct TestOptions {
    /// Use the Redis token store (`PAYLEDGER_TEST_REDIS_URL`) instead of the database's.
    pub redis_tokens: bool,
    pub key_ttl: Duration,
    pub token_ttl: Duration,
    pub lock_timeout: Duration,
    /// How concurrent Pays are grouped (the default: grouped, as `serve` does).
    pub group_commit: GroupCommitSettings,
    /// Authenticate callers with JWTs signed by [`test_keys`]; the app's own clients then
    /// send [`ADMIN_SUB`]'s token (every scope, every merchant).
    pub authenticated: bool,
    /// The server's concurrency limit (`serve --max-concurrent-calls`).
    pub max_concurrent_calls: Option<usize>,
    /// The lifetime of an order created without expires_at (`--order-ttl-seconds`).
    pub order_ttl: Duration,
    /// The lifetime of an authorization hold (`--hold-ttl-seconds`).
    pub hold_ttl: Duration,
    /// Shards of each currency's funding account (`--funding-account-shards`).
    pub funding_account_shards: u32,
}

impl Default for TestOptions {
    fn default() -> Self {
        let defaults = LedgerSettings::default();
        Self {
            redis_tokens: false,
            key_ttl: defaults.key_ttl,
            token_ttl: defaults.token_ttl,
            lock_timeout: Duration::from_secs(10),
            group_commit: defaults.group_commit,
            authenticated: false,
            max_concurrent_calls: Some(512),
            order_ttl: defaults.order_ttl,
            hold_ttl: defaults.hold_ttl,
            funding_account_shards: defaults.funding_account_shards,
        }
    }
}

impl TestOptions {
    pub fn redis() -> Self {
        Self { redis_tokens: true, ..Self::default() }
    }

    pub fn short_lived() -> Self {
        Self { key_ttl: Duration::from_secs(1), token_ttl: Duration::from_secs(1), ..Self::default() }
    }

    /// Every Pay in its own transaction (group commit off).
    pub fn one_by_one() -> Self {
        Self { group_commit: GroupCommitSettings { max_batch: 1, ..GroupCommitSettings::default() }, ..Self::default() }
    }

    /// Orders created without expires_at live 2 s (`--order-ttl-seconds 2`).
    pub fn short_order_ttl() -> Self {
        Self { order_ttl: Duration::from_secs(2), ..Self::default() }
    }

    /// Each currency's funding account split into 4 shards (`--funding-account-shards 4`).
    pub fn four_funding_shards() -> Self {
        Self { funding_account_shards: 4, ..Self::default() }
    }

    /// Four funding shards, and every call in its own transaction (group commit off).
    pub fn four_funding_shards_one_by_one() -> Self {
        Self { funding_account_shards: 4, ..Self::one_by_one() }
    }

    /// Authorization holds last 2 s (`--hold-ttl-seconds 2`).
    pub fn short_hold_ttl() -> Self {
        Self { hold_ttl: Duration::from_secs(2), ..Self::default() }
    }

    pub fn authenticated() -> Self {
        Self { authenticated: true, ..Self::default() }
    }

    pub fn authenticated_redis() -> Self {
        Self { authenticated: true, redis_tokens: true, ..Self::default() }
    }

    /// One ledger call at a time; a group-commit queue of one Pay.
    pub fn tightly_bounded() -> Self {
        Self {
            max_concurrent_calls: Some(1),
            // One batch in flight and a queue of one: the second call queues, the third finds
            // the queue full.
            group_commit: GroupCommitSettings { queue_max: 1, pipeline: 1, ..GroupCommitSettings::default() },
            ..Self::default()
        }
    }

    /// Two batches of a group-commit worker in flight at once (`--pay-batch-pipeline 2`).
    pub fn two_batches_in_flight() -> Self {
        Self { group_commit: GroupCommitSettings { pipeline: 2, ..GroupCommitSettings::default() }, ..Self::default() }
    }

    pub fn short_lock_timeout() -> Self {
        Self { lock_timeout: Duration::from_millis(1_000), ..Self::default() }
    }
}

/// A variable's value, or `None` when unset outside CI (the caller skips). Under `CI=true`
/// a missing variable fails the test: no backend may be skipped silently.
fn required_variable(variable: &str, what: &str) -> Option<String> {
    match std::env::var(variable) {
        Ok(value) => Some(value),
        Err(_) => {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "{variable} is required in CI: {what} must not be skipped"
            );
            eprintln!("{what}: not configured (set {variable}); skipped");
            None
        }
    }
}

/// Runs one case on a fresh server and database, then checks the ledger invariants and
/// drops the database. A server backend without its URL variable is skipped, except in CI
/// (`CI=true`), where it fails.
pub async fn run(backend: Backend, options: TestOptions, case: impl AsyncFnOnce(&TestApp)) {
    let Some(app) = TestApp::spawn(backend, options).await else { return };
    case(&app).await;
    app.finish().await;
}

enum TestDatabase {
    /// Removed with the test.
    Sqlite {
        _directory: tempfile::TempDir,
    },
    /// Dropped by `finish`.
    Dropped,
    Server {
        admin_url: String,
        name: String,
    },
}

/// `iss` and `aud` of an authenticated test server.
pub const TEST_ISSUER: &str = "https://issuer.payledger.test";
pub const TEST_AUDIENCE: &str = "payledger-test";
/// The `sub` of the token the app's own clients send to an authenticated server.
pub const ADMIN_SUB: &str = "test-admin";
/// Every scope.
pub const ALL_SCOPES: &str = "payments:write payments:read accounts:write accounts:read accounts:admin";

/// The signing keys of authenticated test servers, one per algorithm, made once per run.
pub struct TestKeys {
    pub eddsa: SigningKey,
    pub es256: SigningKey,
    pub rs256: SigningKey,
}

/// RSA-2048 in PKCS #8 PEM (rcgen cannot generate RSA keys with ring).
fn rsa_pem() -> String {
    use rsa::pkcs8::{EncodePrivateKey, LineEnding};
    use rsa::Generate;
    let key = rsa::PrivateKey::generate();
    key.to_pkcs8_pem(LineEnding::LF).expect("an RSA key encodes").to_string()
}

pub fn test_keys() -> &'static TestKeys {
    static KEYS: OnceLock<TestKeys> = OnceLock::new();
    KEYS.get_or_init(|| TestKeys {
        eddsa: SigningKey::generate(jsonwebtoken::Algorithm::EdDSA).expect("an Ed25519 key"),
        es256: SigningKey::generate(jsonwebtoken::Algorithm::ES256).expect("a P-256 key"),
        rs256: SigningKey::from_pem(jsonwebtoken::Algorithm::RS256, &rsa_pem()).expect("an RSA key"),
    })
}

/// Claims of a valid token for `sub`, acting for `merchants` with `scope`.
pub fn claims(sub: &str, merchants: &[&str], scope: &str) -> serde_json::Value {
    TokenClaims {
        issuer: TEST_ISSUER.into(),
        audience: TEST_AUDIENCE.into(),
        subject: sub.into(),
        merchants: merchants.iter().map(|merchant| (*merchant).to_owned()).collect(),
        scope: scope.into(),
        ttl_seconds: 600,
    }
    .to_json()
}

/// A valid EdDSA token for `sub`, acting for `merchants` with `scope`.
pub fn token(sub: &str, merchants: &[&str], scope: &str) -> String {
    test_keys().eddsa.sign(&claims(sub, merchants, scope)).expect("a token signs")
}

/// Sends `authorization` (the whole header value) unless the request has its own.
#[derive(Clone)]
pub struct DefaultCredential(Option<MetadataValue<Ascii>>);

impl tonic::service::Interceptor for DefaultCredential {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(value) = &self.0 {
            if !request.metadata().contains_key("authorization") {
                request.metadata_mut().insert("authorization", value.clone());
            }
        }
        Ok(request)
    }
}

/// A request carrying `authorization: <value>` (a whole header value, for malformed ones).
pub fn with_authorization<T>(message: T, value: &str) -> Request<T> {
    let mut request = Request::new(message);
    request.metadata_mut().insert("authorization", value.parse().expect("an ASCII header value"));
    request
}

/// A request carrying `authorization: Bearer <token>`.
pub fn as_caller<T>(message: T, token: &str) -> Request<T> {
    with_authorization(message, &format!("Bearer {token}"))
}

pub struct TestApp {
    pub backend: Backend,
    pub address: SocketAddr,
    /// The Prometheus listener (`GET /metrics`).
    pub metrics_address: SocketAddr,
    pub accounts: AccountServiceClient<InterceptedService<Channel, DefaultCredential>>,
    pub payments: PaymentServiceClient<InterceptedService<Channel, DefaultCredential>>,
    /// The token the app's own clients send (`None`: the server does not authenticate).
    pub admin_token: Option<String>,
    /// Clients that send no credential of their own.
    pub bare_accounts: AccountServiceClient<Channel>,
    pub bare_payments: PaymentServiceClient<Channel>,
    pub ledger: Ledger,
    /// A separate pool for looking at the tables directly.
    pub raw: AnyPool,
    database: TestDatabase,
    stop: Option<oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<()>>,
}

/// A pool on the admin URL that gives up quickly: an unreachable server fails the test in
/// seconds, not at the pool's default 30 s per test.
async fn admin_pool(admin_url: &str) -> AnyPool {
    sqlx::any::AnyPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect(admin_url)
        .await
        .unwrap_or_else(|error| panic!("the admin URL {admin_url} connects: {error}"))
}

async fn drop_database(backend: Backend, admin_url: &str, name: &str) {
    let admin = admin_pool(admin_url).await;
    let force = if backend == Backend::Postgres { " WITH (FORCE)" } else { "" };
    let _ = sqlx::query(&format!("DROP DATABASE {name}{force}")).execute(&admin).await;
    admin.close().await;
}

impl Drop for TestApp {
    /// A test that failed before `finish` still drops its database (from a thread of its own:
    /// the test's runtime is unwinding).
    fn drop(&mut self) {
        if let TestDatabase::Server { admin_url, name } = &self.database {
            let (backend, admin_url, name) = (self.backend, admin_url.clone(), name.clone());
            let _ = std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
                if let Ok(runtime) = runtime {
                    runtime.block_on(drop_database(backend, &admin_url, &name));
                }
            })
            .join();
        }
    }
}

fn with_database(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let path_start = base[scheme_end..].find('/').map_or(base.len(), |i| scheme_end + i);
    let mut out = format!("{}/{name}", &base[..path_start]);
    if let Some(query) = query {
        out.push('?');
        out.push_str(query);
    }
    out
}

impl TestApp {
    pub async fn spawn(backend: Backend, options: TestOptions) -> Option<Self> {
        let token_store = if options.redis_tokens {
            let url = required_variable("PAYLEDGER_TEST_REDIS_URL", "the Redis token store")?;
            TokenStore::connect(&url).await.expect("Redis connects")
        } else {
            TokenStore::Database
        };
        sqlx::any::install_default_drivers();
        let (database, database_url) = match backend.admin_url_variable() {
            None => {
                let dir = tempfile::tempdir().expect("a temporary directory");
                let url = format!("sqlite:{}", dir.path().join("ledger.db").display());
                (TestDatabase::Sqlite { _directory: dir }, url)
            }
            Some(variable) => {
                let admin_url = required_variable(variable, &format!("the {backend:?} suite"))?;
                let name = format!("payledger_test_{}", uuid::Uuid::new_v4().simple());
                let admin = admin_pool(&admin_url).await;
                sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await.expect("CREATE DATABASE");
                admin.close().await;
                let url = with_database(&admin_url, &name);
                (TestDatabase::Server { admin_url, name }, url)
            }
        };
        let settings = PoolSettings {
            max_connections: 8,
            acquire_timeout: Duration::from_secs(30),
            lock_timeout: options.lock_timeout,
            plan_lifetime: PoolSettings::PLAN_LIFETIME_DEFAULT,
        };
        let store = Store::connect(&database_url, &settings).await.expect("the test database connects");
        store.migrate().await.expect("migrations apply");
        let ledger = Ledger::with_settings(
            store,
            token_store,
            LedgerSettings {
                key_ttl: options.key_ttl,
                token_ttl: options.token_ttl,
                group_commit: options.group_commit,
                order_ttl: options.order_ttl,
                hold_ttl: options.hold_ttl,
                funding_account_shards: options.funding_account_shards,
            },
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("port 0 binds");
        let metrics_listener = TcpListener::bind("127.0.0.1:0").await.expect("port 0 binds");
        let metrics_address = metrics_listener.local_addr().expect("a bound address");
        let mut application = Application::with_listener(listener, ledger.clone(), Duration::from_secs(5))
            .with_max_concurrent_calls(options.max_concurrent_calls)
            .with_metrics_listener(Some(metrics_listener));
        let mut default_credential = DefaultCredential(None);
        let mut admin_token = None;
        if options.authenticated {
            let keys = test_keys();
            let jwks = SigningKey::jwks([&keys.eddsa, &keys.es256, &keys.rs256]);
            let authenticator =
                Authenticator::from_jwks(&jwks, TEST_ISSUER, TEST_AUDIENCE, 5).expect("the test JWKS loads");
            application = application.with_authenticator(Some(Arc::new(authenticator)));
            let admin = token(ADMIN_SUB, &["*"], ALL_SCOPES);
            default_credential = DefaultCredential(Some(format!("Bearer {admin}").parse().expect("ASCII")));
            admin_token = Some(admin);
        }
        let address = application.local_addr();
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            application
                .run_until(async {
                    let _ = stopped.await;
                })
                .await
                .expect("the server runs");
        });
        let channel =
            Channel::from_shared(format!("http://{address}")).unwrap().connect().await.expect("the server accepts");
        let raw = AnyPool::connect(&database_url).await.expect("a raw pool");
        Some(Self {
            backend,
            address,
            metrics_address,
            accounts: AccountServiceClient::with_interceptor(channel.clone(), default_credential.clone()),
            payments: PaymentServiceClient::with_interceptor(channel.clone(), default_credential),
            admin_token,
            bare_accounts: AccountServiceClient::new(channel.clone()),
            bare_payments: PaymentServiceClient::new(channel),
            ledger,
            raw,
            database,
            stop: Some(stop),
            server: Some(server),
        })
    }

    /// Asserts the audit invariants, stops the server and drops the database.
    pub async fn finish(mut self) {
        let violations = self.ledger.audit().await.expect("the audit runs");
        assert!(violations.is_empty(), "ledger invariants broken: {violations:#?}");
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            let _ = server.await;
        }
        self.raw.close().await;
        self.ledger.store().close().await;
        if let TestDatabase::Server { admin_url, name } = &self.database {
            drop_database(self.backend, admin_url, name).await;
        }
        self.database = TestDatabase::Dropped;
    }

    /// `GET /metrics`: every sample line as `name{labels}` -> value.
    pub async fn metrics(&self) -> std::collections::HashMap<String, f64> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(self.metrics_address).await.expect("the metrics listener");
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .await
            .expect("a request");
        let mut text = String::new();
        stream.read_to_string(&mut text).await.expect("a response");
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        assert!(text.contains("application/openmetrics-text"), "{text}");
        let body = &text[text.find("\r\n\r\n").expect("a header end") + 4..];
        assert!(body.trim_end().ends_with("# EOF"), "an OpenMetrics exposition ends with # EOF: {body}");
        body.lines()
            .filter(|line| !line.starts_with('#') && !line.is_empty())
            .filter_map(|line| {
                let (name, value) = line.rsplit_once(' ')?;
                Some((name.to_owned(), value.parse().ok()?))
            })
            .collect()
    }

    /// Rows in a table, read directly.
    pub async fn rows(&self, table: &str) -> i64 {
        let row = sqlx::query(&format!("SELECT COUNT(*) FROM {table}")).fetch_one(&self.raw).await.expect("COUNT(*)");
        row.try_get::<i64, _>(0).expect("a count")
    }

    /// Answered idempotency records that hold a JSON copy of their answer besides the response
    /// message (records keep the message alone; only those written before messages were
    /// stored hold JSON, and no message).
    pub async fn records_with_a_json_copy(&self) -> i64 {
        let sql = format!(
            "SELECT COUNT(*) FROM idempotency_record WHERE response_message IS NOT NULL AND response <> {}",
            self.bytes_literal("")
        );
        let row = sqlx::query(&sql).fetch_one(&self.raw).await.expect("COUNT(*)");
        row.try_get::<i64, _>(0).expect("a count")
    }

    /// Row counts of every business table, to show that a refused request left nothing.
    pub async fn all_rows(&self) -> [i64; 6] {
        [
            self.rows("accounts").await,
            self.rows("journal_entries").await,
            self.rows("orders").await,
            self.rows("payment_flow").await,
            self.rows("refunds").await,
            self.rows("deposits").await,
        ]
    }

    pub async fn open(&self, account_id: &str, currency: &str) -> proto::Account {
        let request = proto::OpenAccountRequest { account_id: account_id.into(), currency: currency.into() };
        self.accounts.clone().open_account(request).await.expect("OpenAccount").into_inner().account.unwrap()
    }

    pub async fn deposit(
        &self,
        request_id: &str,
        account_id: &str,
        amount: &str,
        currency: &str,
    ) -> Result<Response<proto::DepositResponse>, Status> {
        let request = proto::DepositRequest {
            request_id: request_id.into(),
            account_id: account_id.into(),
            amount: amount.into(),
            currency: currency.into(),
        };
        self.accounts.clone().deposit(request).await
    }

    /// Opens an account and deposits `amount` into it.
    pub async fn funded(&self, account_id: &str, amount: &str) {
        self.open(account_id, "USD").await;
        self.deposit(&format!("fund-{account_id}"), account_id, amount, "USD").await.expect("Deposit");
    }

    /// The `balance_after` of the account's latest ten journal entries, newest first.
    pub async fn balances_after(&self, account_id: &str) -> Vec<String> {
        let request =
            proto::ListEntriesRequest { account_id: account_id.into(), page_size: 10, page_token: String::new() };
        let entries = self.accounts.clone().list_entries(request).await.expect("ListEntries").into_inner().entries;
        entries.into_iter().map(|entry| entry.balance_after).collect()
    }

    pub async fn balance(&self, account_id: &str) -> String {
        let request = proto::GetAccountRequest { account_id: account_id.into() };
        self.accounts.clone().get_account(request).await.expect("GetAccount").into_inner().account.unwrap().balance
    }

    pub async fn create_order(
        &self,
        merchant_id: &str,
        order_no: &str,
        payee: &str,
        amount: &str,
    ) -> Result<Response<proto::CreateOrderResponse>, Status> {
        let request = proto::CreateOrderRequest {
            merchant_id: merchant_id.into(),
            order_no: order_no.into(),
            payee_account_id: payee.into(),
            amount: amount.into(),
            currency: "USD".into(),
            subject: format!("order {order_no}"),
            expires_at: None,
        };
        self.payments.clone().create_order(request).await
    }

    pub fn pay_request(
        &self,
        merchant_id: &str,
        out_trade_no: &str,
        order_no: &str,
        payer: &str,
        amount: &str,
    ) -> proto::PayRequest {
        proto::PayRequest {
            merchant_id: merchant_id.into(),
            out_trade_no: out_trade_no.into(),
            order_no: order_no.into(),
            payer_account_id: payer.into(),
            amount: amount.into(),
            currency: "USD".into(),
        }
    }

    pub async fn pay(
        &self,
        merchant_id: &str,
        out_trade_no: &str,
        order_no: &str,
        payer: &str,
        amount: &str,
    ) -> Result<Response<proto::PayResponse>, Status> {
        self.payments.clone().pay(self.pay_request(merchant_id, out_trade_no, order_no, payer, amount)).await
    }

    pub fn refund_request(
        &self,
        merchant_id: &str,
        out_trade_no: &str,
        out_refund_no: &str,
        amount: &str,
    ) -> proto::RefundRequest {
        proto::RefundRequest {
            merchant_id: merchant_id.into(),
            out_trade_no: out_trade_no.into(),
            out_refund_no: out_refund_no.into(),
            amount: amount.into(),
            currency: "USD".into(),
            reason: "customer asked".into(),
        }
    }

    pub async fn refund(
        &self,
        merchant_id: &str,
        out_trade_no: &str,
        out_refund_no: &str,
        amount: &str,
    ) -> Result<Response<proto::RefundResponse>, Status> {
        self.payments.clone().refund(self.refund_request(merchant_id, out_trade_no, out_refund_no, amount)).await
    }

    pub async fn query(&self, merchant_id: &str, key: Key) -> Result<proto::QueryResponse, Status> {
        let request = proto::QueryRequest { merchant_id: merchant_id.into(), key: Some(key) };
        self.payments.clone().query(request).await.map(Response::into_inner)
    }

    /// Three callers each refund 1.00 of m1's payment `out_trade_no` `per_caller` times while
    /// two readers run `read` (on a client of their own) over and over until the refunds have
    /// landed; returns how many reads ran, at least one.
    pub async fn read_while_refunds_land<F, Fut>(&self, out_trade_no: &str, per_caller: usize, read: F) -> usize
    where
        F: Fn(Payments) -> Fut + Clone + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let refunding = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let refunds: Vec<_> = (0..3)
            .map(|caller| {
                let mut payments = self.payments.clone();
                let requests: Vec<_> = (0..per_caller)
                    .map(|n| {
                        self.refund_request("m1", out_trade_no, &format!("{out_trade_no}-refund-{caller}-{n}"), "1.00")
                    })
                    .collect();
                tokio::spawn(async move {
                    for request in requests {
                        payments.refund(request).await.expect("a refund within the paid amount");
                    }
                })
            })
            .collect();
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (payments, refunding, read) = (self.payments.clone(), refunding.clone(), read.clone());
                tokio::spawn(async move {
                    let mut reads = 0;
                    while refunding.load(std::sync::atomic::Ordering::Relaxed) {
                        read(payments.clone()).await;
                        reads += 1;
                    }
                    reads
                })
            })
            .collect();
        for refund in futures::future::join_all(refunds).await {
            refund.unwrap();
        }
        refunding.store(false, std::sync::atomic::Ordering::Relaxed);
        let reads: usize = futures::future::join_all(readers).await.into_iter().map(Result::unwrap).sum();
        assert!(reads > 0, "the readers ran while the refunds landed");
        reads
    }

    /// A payer with `funds`, a merchant account, and a PENDING order of `amount`.
    pub async fn order_ready_to_pay(&self, order_no: &str, funds: &str, amount: &str) {
        self.funded("alice", funds).await;
        self.open("shop", "USD").await;
        self.create_order("m1", order_no, "shop", amount).await.expect("CreateOrder");
    }

    /// Waits (at most 10 s) until a session of this test's database waits in a statement
    /// that writes `table`: on PostgreSQL for a lock, on MySQL/MariaDB (whose INFORMATION_SCHEMA
    /// does not always list the waiting transaction) in the statement (not counting the session
    /// that asks, whose own statement holds the pattern); on SQLite, whose
    /// writers wait on the database's one write lock unseen, 300 ms.
    pub async fn wait_for_a_write_waiting_on(&self, table: &str) {
        self.wait_for_a_session_in(&format!("%INTO {table} %")).await;
    }

    /// Waits until a session of this test's database waits for a lock in a statement whose
    /// text is `LIKE pattern` (on SQLite, which has no sessions to see: 300 ms).
    pub async fn wait_for_a_session_in(&self, pattern: &str) {
        let TestDatabase::Server { name, .. } = &self.database else {
            tokio::time::sleep(Duration::from_millis(300)).await;
            return;
        };
        let sql = match self.backend {
            Backend::Postgres => format!(
                "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = '{name}' AND wait_event_type = 'Lock' \
                 AND query LIKE '{pattern}'"
            ),
            _ => format!(
                "SELECT COUNT(*) FROM information_schema.processlist WHERE db = '{name}' \
                 AND command IN ('Query', 'Execute') AND info LIKE '{pattern}' AND id <> CONNECTION_ID()"
            ),
        };
        for _ in 0..1000 {
            let row = sqlx::query(&sql).fetch_one(&self.raw).await.expect("lock waits");
            if row.try_get::<i64, _>(0).expect("a count") > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("no session waited in a statement like {pattern}");
    }

    /// Sessions of this test's database left idle inside a transaction (PostgreSQL and
    /// MySQL; SQLite has no sessions).
    pub async fn sessions_idle_in_transaction(&self) -> i64 {
        let TestDatabase::Server { name, .. } = &self.database else {
            return 0;
        };
        let sql = match self.backend {
            Backend::Postgres => format!("SELECT COUNT(*) FROM pg_stat_activity WHERE datname = '{name}' AND state LIKE 'idle in transaction%'"),
            Backend::MySql => format!(
                "SELECT COUNT(*) FROM information_schema.innodb_trx t JOIN information_schema.processlist p ON p.id = t.trx_mysql_thread_id \
                 WHERE p.db = '{name}' AND p.command = 'Sleep'"
            ),
            Backend::Sqlite => return 0,
        };
        let row = sqlx::query(&sql).fetch_one(&self.raw).await.expect("session count");
        row.try_get::<i64, _>(0).expect("a count")
    }
}

/// True when the response carries `idempotent-replayed: true`.
pub fn replayed<T>(response: &Response<T>) -> bool {
    response.metadata().get("idempotent-replayed").and_then(|v| v.to_str().ok()) == Some("true")
}

/// Asserts a status code and ErrorInfo reason (domain `payledger`).
#[track_caller]
pub fn assert_status(status: &Status, code: Code, reason: &str) {
    assert_eq!(status.code(), code, "unexpected status: {status:?}");
    let details = status.get_error_details();
    let info = details.error_info().unwrap_or_else(|| panic!("no ErrorInfo in {status:?}"));
    assert_eq!(info.domain, "payledger");
    assert_eq!(info.reason, reason, "unexpected reason in {status:?}");
}

/// The fields named by a status's BadRequest field violations.
pub fn violated_fields(status: &Status) -> Vec<String> {
    let details = status.get_error_details();
    details.bad_request().map(|bad| bad.field_violations.iter().map(|v| v.field.clone()).collect()).unwrap_or_default()
}

/// A request carrying an `idempotency-key` header.
pub fn with_key<T>(message: T, key: &str) -> Request<T> {
    let mut request = Request::new(message);
    request.metadata_mut().insert("idempotency-key", key.parse().expect("an ASCII key"));
    request
}

/// A request carrying an `idempotency-token` header (and an `idempotency-key` if given).
pub fn with_token<T>(message: T, token: &str, key: Option<&str>) -> Request<T> {
    let mut request = match key {
        Some(key) => with_key(message, key),
        None => Request::new(message),
    };
    request.metadata_mut().insert("idempotency-token", token.parse().expect("an ASCII token"));
    request
}

/// A CreateOrder of 1.00 USD with no subject.
pub fn one_dollar_order(merchant_id: &str, order_no: &str, payee: &str) -> proto::CreateOrderRequest {
    proto::CreateOrderRequest {
        merchant_id: merchant_id.into(),
        order_no: order_no.into(),
        payee_account_id: payee.into(),
        amount: "1.00".into(),
        currency: "USD".into(),
        subject: String::new(),
        expires_at: None,
    }
}

pub fn transfer_request(from: &str, to: &str, amount: &str) -> proto::TransferRequest {
    proto::TransferRequest {
        from_account_id: from.into(),
        to_account_id: to.into(),
        amount: amount.into(),
        currency: "USD".into(),
        memo: "rent".into(),
    }
}

impl TestApp {
    /// A SQL literal of the bytes of `text`, for this backend's BYTEA/BLOB columns.
    pub fn bytes_literal(&self, text: &str) -> String {
        self.blob_literal(text.as_bytes())
    }

    /// A SQL literal of `bytes`, for this backend's BYTEA/BLOB columns.
    pub fn blob_literal(&self, bytes: &[u8]) -> String {
        let hex: String = bytes.iter().map(|byte| format!("{byte:02x}")).collect();
        match self.backend {
            Backend::Postgres => format!("decode('{hex}', 'hex')"),
            Backend::MySql | Backend::Sqlite => format!("X'{hex}'"),
        }
    }

    /// Writes in `holder` the COMPLETED idempotency record another writer of `method` with
    /// `fields` (the request's business fields, one `name=value` line each, as the server
    /// fingerprints them) leaves under (`scope`, `key`), answering with `message`.
    pub async fn write_record(
        &self,
        holder: &mut sqlx::Transaction<'_, sqlx::Any>,
        (scope, key, method): (&str, &str, &str),
        fields: &str,
        message: &[u8],
    ) {
        use sha2::Digest as _;
        let fingerprint: String =
            sha2::Sha256::digest(format!("{method}\n{fields}")).iter().map(|byte| format!("{byte:02x}")).collect();
        let sql = format!(
            "INSERT INTO idempotency_record (scope, idempotency_key, method, request_fingerprint, request_fields, \
             response, response_message, caller_scope, status, created_at, expires_at) VALUES ('{scope}', '{key}', \
             '{method}', '{fingerprint}', {}, {}, {}, '{scope}', 'COMPLETED', 0, 9000000000000000)",
            self.bytes_literal(fields),
            self.bytes_literal("{}"),
            self.blob_literal(message),
        );
        sqlx::query(&sql).execute(&mut **holder).await.unwrap();
    }

    /// Writes in `holder` the two legs of posting `posting_id` (`kind`, `reference`) as a
    /// single posting leaves them: each account's balance and version moved by its amount (USD
    /// minor units) and one, read in `holder`, and its journal entry, chained to the account's
    /// hash as the engine chains it.
    pub async fn write_posting(
        &self,
        holder: &mut sqlx::Transaction<'_, sqlx::Any>,
        (kind, reference, posting_id): (&str, &str, &str),
        legs: [(&str, &str, i64); 2],
    ) {
        use payledger::store::chain;
        for (account_id, counterparty, amount) in legs {
            let row = sqlx::query(&format!(
                "SELECT balance, version, chain_hash FROM accounts WHERE account_id = '{account_id}'"
            ))
            .fetch_one(&mut **holder)
            .await
            .unwrap();
            let (balance, version): (i64, i64) = (row.try_get(0).unwrap(), row.try_get(1).unwrap());
            let previous =
                row.try_get::<Option<String>, _>(2).unwrap().map_or(chain::GENESIS, |head| chain::stored(&head));
            let (balance, version) = (balance + amount, version + 1);
            let entry = chain::ChainedEntry {
                account_id,
                currency: "USD",
                amount,
                balance_after: balance,
                version_after: version,
                kind,
                reference,
                posting_id,
                counterparty_account_id: counterparty,
                created_at: 1,
                created_by: "anonymous",
            };
            let hash = chain::to_hex(&chain::entry_hash(&previous, &entry));
            let writes = [
                format!(
                    "UPDATE accounts SET balance = {balance}, version = {version}, chain_hash = '{hash}' \
                     WHERE account_id = '{account_id}'"
                ),
                format!(
                    "INSERT INTO journal_entries (account_id, currency, amount, balance_after, version_after, kind, \
                     reference, posting_id, counterparty_account_id, created_at, created_by, entry_hash) VALUES \
                     ('{account_id}', 'USD', {amount}, {balance}, {version}, '{kind}', '{reference}', '{posting_id}', \
                     '{counterparty}', 1, 'anonymous', '{hash}')"
                ),
            ];
            for write in writes {
                sqlx::query(&write).execute(&mut **holder).await.unwrap();
            }
        }
    }

    pub async fn issue_token(&self, merchant_id: &str) -> String {
        let request = proto::IssueTokenRequest { merchant_id: merchant_id.into(), purpose: "checkout".into() };
        self.payments.clone().issue_token(request).await.expect("IssueToken").into_inner().token
    }
}
