//! `payledger bench`: a gRPC load generator for payledger with a ghz-like report.
//!
//! It prepares its data untimed through the API (payer accounts with deposits, merchants,
//! orders), then drives one scenario with `--concurrency` tasks for `--total` calls (or until
//! `--duration-seconds`), timing every call into an HDR histogram. Calls go through plain
//! tonic clients without retries, as ghz does, so every status is counted as it came.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::Stub;
use futures::stream::{self, StreamExt};
use hdrhistogram::Histogram;
use payledger::config::Progress;
use rand::Rng;
use rand_distr::{Distribution, Zipf};
use tower::Layer;

use payledger_client::proto::account_service_client::AccountServiceClient;
use payledger_client::proto::payment_service_client::PaymentServiceClient;
use payledger_client::proto::{self, query_request::Key};
use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};

use crate::AnyError;

/// Concurrent calls while preparing data.
const PREPARE_CONCURRENCY: usize = 64;
/// Refunds of 1.00 drawn against each prepared 100.00 payment in the `refund` scenario.
const REFUNDS_PER_ORDER: u64 = 20;
/// Queries per paid order in the `query` scenario.
const QUERIES_PER_ORDER: u64 = 10;

/// What is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scenario {
    /// Pay fresh orders; payers and merchants spread over many accounts (no contention).
    Pay,
    /// As `pay`, each Pay with an `idempotency-key` of its own (the keyed path: its dedup
    /// record claimed and completed in the Pay's transaction; not group-committed).
    KeyedPay,
    /// Transfers of 0.01 from a payer to a shop, each with an `idempotency-key` of its own,
    /// payers and shops spread over many accounts.
    Transfer,
    /// Deposits of 0.01 into payers spread over many accounts, each with a request_id of its
    /// own: every one moves the currency's funding account, the hot row
    /// (`--funding-account-shards` on the server spreads it).
    Deposit,
    /// CreateOrder of fresh orders, each with an order_no of its own, spread over the
    /// merchants (`--merchants`) and their shops: the write path that moves no money.
    CreateOrder,
    /// The same Pay re-sent: its out_trade_no is already paid (the read-only replay path).
    Replay,
    /// Every Pay credits one merchant account (with `--zipf`, payers are skewed too).
    Hot,
    /// Partial refunds of paid orders.
    Refund,
    /// As `refund`, every order paid to one merchant: each Refund debits the same shop account
    /// (a hot row, as `hot` credits one).
    HotRefund,
    /// Query of paid orders by out_trade_no (the read path), each order about ten times.
    Query,
    /// `grpc.health.v1.Health/Check` of the server as a whole: a gRPC round trip through the
    /// server's transport, router and observation (metrics, access line) with no ledger work
    /// and no database statement, the floor under every other scenario's call. Prepares no
    /// data.
    Health,
    /// 45% Pay (a third of the orders with an `expires_at` an hour ahead), 5% Authorize then
    /// Capture of part of it, 5% Authorize then Void (two calls each, timed as one), 5%
    /// Withdraw, 10% Refund, 10% Query, 10% Deposit, 10% Transfer; `--duplicate-ratio` re-sent.
    Mixed,
}

/// `payledger bench` settings.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchSettings {
    /// The server to load, e.g. `http://127.0.0.1:50051`. Bench writes test data there
    /// (accounts funded with 1,000,000,000.00 each, orders, payments), so it also needs
    /// `--allow-test-data`.
    #[arg(long)]
    pub target: String,
    /// Let `--target` receive the bench's test data.
    #[arg(long)]
    pub allow_test_data: bool,
    #[arg(long, value_enum, default_value = "pay")]
    pub scenario: Scenario,
    /// Concurrent callers.
    #[arg(short = 'c', long, default_value_t = 32)]
    pub concurrency: usize,
    /// Calls to make (timed).
    #[arg(short = 'n', long, default_value_t = 10_000)]
    pub total: u64,
    /// Stop after this many seconds even if `--total` is not reached.
    #[arg(long)]
    pub duration_seconds: Option<u64>,
    /// Payer accounts.
    #[arg(long, default_value_t = 1_000)]
    pub payers: usize,
    /// Merchant accounts.
    #[arg(long, default_value_t = 100)]
    pub merchants: usize,
    /// `hot` only: draw payers with a Zipf distribution of this exponent (e.g. 1.1).
    #[arg(long)]
    pub zipf: Option<f64>,
    /// `mixed` only: share of calls sent twice.
    #[arg(long, default_value_t = 0.1)]
    pub duplicate_ratio: f64,
    /// Open-loop load: start calls at this many per second in all (ghz's `--rps`), with
    /// `--concurrency` as the most in flight. Latency is then measured from each call's
    /// scheduled start, so a stalled server shows up in it (no coordinated omission).
    #[arg(long)]
    pub rate: Option<f64>,
    /// HTTP/2 connections to spread the calls over.
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// Also print the report as one JSON line (prefixed `bench-report: `).
    #[arg(long)]
    pub json: bool,
    /// A progress line on stderr every 2 s while the calls run, and one when they end (calls
    /// done of the total, calls/s, time left): `auto` when stderr is a terminal. Never on
    /// stdout.
    #[arg(long, value_enum, default_value_t = Progress::Auto)]
    pub progress: Progress,
    #[command(flatten)]
    pub access: crate::TargetAccess,
}

/// What one run measured. Latencies are in microseconds.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchReport {
    pub scenario: Scenario,
    pub concurrency: usize,
    /// `--rate`: the calls per second offered (open loop), if set.
    pub offered_rate: Option<f64>,
    pub count: u64,
    pub duration_seconds: f64,
    pub calls_per_second: f64,
    pub latency_us: BTreeMap<String, u64>,
    pub histogram: Vec<(u64, u64)>,
    pub status_codes: BTreeMap<String, u64>,
    pub replays: u64,
}

/// The stubs of the timed calls (`Stub`: one attempt each, as ghz makes them), or of the
/// untimed preparation (`PrepareStub`).
#[derive(Clone)]
struct Clients<S = Stub> {
    accounts: Vec<AccountServiceClient<S>>,
    payments: Vec<PaymentServiceClient<S>>,
    health: Vec<HealthClient<S>>,
}

/// The preparation's stubs retry what a careful caller retries (UNAVAILABLE, ABORTED,
/// RESOURCE_EXHAUSTED: the client crate's retry layer and defaults), so that a conflict while
/// the data is laid out (Deposits through several cluster nodes, say) does not end the run.
type PrepareStub = payledger_client::RetryService<tonic::transport::Channel>;

impl<S: Clone> Clients<S> {
    fn account(&self, n: u64) -> AccountServiceClient<S> {
        self.accounts[usize::try_from(n).unwrap_or(0) % self.accounts.len()].clone()
    }

    fn payment(&self, n: u64) -> PaymentServiceClient<S> {
        self.payments[usize::try_from(n).unwrap_or(0) % self.payments.len()].clone()
    }

    fn health(&self, n: u64) -> HealthClient<S> {
        self.health[usize::try_from(n).unwrap_or(0) % self.health.len()].clone()
    }
}

/// The data one scenario calls with, prepared untimed.
struct Prepared {
    run: String,
    payers: Vec<String>,
    shops: Vec<String>,
    /// Orders to pay: (merchant, order_no, payer index).
    orders: Vec<(String, String, usize)>,
    /// Paid orders: (merchant, out_trade_no).
    paid: Vec<(String, String)>,
}

fn payer_draw(settings: &BenchSettings, count: usize) -> Box<dyn Fn(u64) -> usize + Send + Sync> {
    match (settings.scenario, settings.zipf) {
        (Scenario::Hot, Some(exponent)) => {
            let zipf = Zipf::new(count as f64, exponent).expect("a valid Zipf exponent");
            Box::new(move |_| (zipf.sample(&mut rand::rng()) as usize).saturating_sub(1).min(count - 1))
        }
        _ => Box::new(move |n| usize::try_from(n).unwrap_or(0) % count),
    }
}

async fn prepare(settings: &BenchSettings, clients: &Clients<PrepareStub>) -> Result<Prepared, AnyError> {
    let run = uuid::Uuid::now_v7().simple().to_string()[18..].to_owned();
    if settings.scenario == Scenario::Health {
        return Ok(Prepared { run, payers: Vec::new(), shops: Vec::new(), orders: Vec::new(), paid: Vec::new() });
    }
    let payers: Vec<String> = (0..settings.payers.max(1)).map(|n| format!("b{run}-p{n}")).collect();
    let merchants =
        if matches!(settings.scenario, Scenario::Hot | Scenario::HotRefund) { 1 } else { settings.merchants.max(1) };
    let shops: Vec<String> = (0..merchants).map(|n| format!("b{run}-s{n}")).collect();
    let accounts = payers.iter().chain(shops.iter()).cloned().enumerate();
    stream::iter(accounts)
        .map(|(n, account_id)| {
            let mut client = clients.account(n as u64);
            async move {
                let open = proto::OpenAccountRequest { account_id: account_id.clone(), currency: "USD".into() };
                client.open_account(open).await?;
                let deposit = proto::DepositRequest {
                    request_id: format!("{account_id}-funds"),
                    account_id,
                    amount: "1000000000.00".into(),
                    currency: "USD".into(),
                };
                client.deposit(deposit).await?;
                Ok::<_, tonic::Status>(())
            }
        })
        .buffer_unordered(PREPARE_CONCURRENCY)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;

    let order_count = match settings.scenario {
        Scenario::Pay | Scenario::KeyedPay | Scenario::Hot => settings.total,
        Scenario::Transfer | Scenario::Deposit | Scenario::CreateOrder | Scenario::Health => 0,
        Scenario::Replay => 1,
        Scenario::Refund | Scenario::HotRefund => settings.total.div_ceil(REFUNDS_PER_ORDER),
        Scenario::Query => settings.total.div_ceil(QUERIES_PER_ORDER),
        // A fifth more than the calls: that fifth is paid during preparation, and each call
        // then has an order of its own (a Pay and an Authorize never meet on one order).
        Scenario::Mixed => settings.total + settings.total / 5,
    };
    let amount = if matches!(settings.scenario, Scenario::Refund | Scenario::HotRefund) { "100.00" } else { "1.00" };
    // `mixed`: a third of the orders can expire (an hour ahead, so that every Pay is in time).
    let an_hour_ahead = {
        let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        payledger_client::prost_types::Timestamp {
            seconds: i64::try_from(since_epoch.as_secs()).unwrap_or(0) + 3_600,
            nanos: 0,
        }
    };
    let draw = payer_draw(settings, payers.len());
    let orders: Vec<(String, String, usize)> =
        (0..order_count).map(|n| (format!("b{run}-m{}", n % merchants as u64), format!("o{n}"), draw(n))).collect();
    stream::iter(orders.iter().enumerate())
        .map(|(n, (merchant, order_no, _))| {
            let mut client = clients.payment(n as u64);
            let request = proto::CreateOrderRequest {
                merchant_id: merchant.clone(),
                order_no: order_no.clone(),
                payee_account_id: shops[n % shops.len()].clone(),
                amount: amount.into(),
                currency: "USD".into(),
                subject: "bench".into(),
                expires_at: (settings.scenario == Scenario::Mixed && n % 3 == 0).then_some(an_hour_ahead),
            };
            async move { client.create_order(request).await.map(|_| ()) }
        })
        .buffer_unordered(PREPARE_CONCURRENCY)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    let mut prepared = Prepared { run, payers, shops, orders, paid: Vec::new() };
    // Replay, refund and mixed need paid orders to start from.
    let to_pay = match settings.scenario {
        Scenario::Replay | Scenario::Refund | Scenario::HotRefund | Scenario::Query => prepared.orders.len(),
        Scenario::Mixed => usize::try_from(settings.total / 5).unwrap_or(0),
        Scenario::Pay
        | Scenario::KeyedPay
        | Scenario::Hot
        | Scenario::Transfer
        | Scenario::Deposit
        | Scenario::CreateOrder
        | Scenario::Health => 0,
    };
    let paid: Vec<(String, String)> = stream::iter(prepared.orders.drain(..to_pay).enumerate())
        .map(|(n, (merchant, order_no, payer))| {
            let mut client = clients.payment(n as u64);
            let out_trade_no = format!("{order_no}-pay");
            let request = pay_request(&merchant, &out_trade_no, &order_no, &prepared.payers[payer], amount);
            async move { client.pay(request).await.map(|_| (merchant, out_trade_no)) }
        })
        .buffer_unordered(PREPARE_CONCURRENCY)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    prepared.paid = paid;
    Ok(prepared)
}

fn pay_request(merchant: &str, out_trade_no: &str, order_no: &str, payer: &str, amount: &str) -> proto::PayRequest {
    proto::PayRequest {
        merchant_id: merchant.to_owned(),
        out_trade_no: out_trade_no.to_owned(),
        order_no: order_no.to_owned(),
        payer_account_id: payer.to_owned(),
        amount: amount.to_owned(),
        currency: "USD".into(),
    }
}

/// Makes call number `n` of the scenario: `Ok(replayed)` or the status code.
async fn call(
    scenario: Scenario,
    n: u64,
    prepared: &Prepared,
    clients: &Clients,
    duplicate_ratio: f64,
) -> Result<bool, tonic::Code> {
    let replayed = |metadata: &tonic::metadata::MetadataMap| metadata.get(payledger_client::REPLAYED_HEADER).is_some();
    let index = usize::try_from(n).unwrap_or(0);
    match scenario {
        Scenario::Pay | Scenario::Hot => {
            let (merchant, order_no, payer) = &prepared.orders[index % prepared.orders.len()];
            let request = pay_request(merchant, &format!("{order_no}-pay"), order_no, &prepared.payers[*payer], "1.00");
            clients.payment(n).pay(request).await.map(|r| replayed(r.metadata())).map_err(|s| s.code())
        }
        Scenario::KeyedPay => {
            let (merchant, order_no, payer) = &prepared.orders[index % prepared.orders.len()];
            let request = pay_request(merchant, &format!("{order_no}-pay"), order_no, &prepared.payers[*payer], "1.00");
            let request = payledger_client::with_idempotency_key(request, &format!("b{}-k{n}", prepared.run))
                .map_err(|s| s.code())?;
            clients.payment(n).pay(request).await.map(|r| replayed(r.metadata())).map_err(|s| s.code())
        }
        Scenario::Transfer => {
            transfer(n, index, &prepared.payers[index % prepared.payers.len()], prepared, clients).await
        }
        Scenario::Deposit => {
            let request = proto::DepositRequest {
                request_id: format!("b{}-d{n}", prepared.run),
                account_id: prepared.payers[index % prepared.payers.len()].clone(),
                amount: "0.01".into(),
                currency: "USD".into(),
            };
            clients.account(n).deposit(request).await.map(|r| replayed(r.metadata())).map_err(|s| s.code())
        }
        Scenario::CreateOrder => {
            let shops = &prepared.shops;
            let request = proto::CreateOrderRequest {
                merchant_id: format!("b{}-m{}", prepared.run, index % shops.len()),
                order_no: format!("c{n}"),
                payee_account_id: shops[index % shops.len()].clone(),
                amount: "1.00".into(),
                currency: "USD".into(),
                subject: "bench".into(),
                expires_at: None,
            };
            clients.payment(n).create_order(request).await.map(|r| replayed(r.metadata())).map_err(|s| s.code())
        }
        Scenario::Replay => {
            let (merchant, out_trade_no) = &prepared.paid[0];
            let request = pay_request(merchant, out_trade_no, "o0", &prepared.payers[0], "1.00");
            clients.payment(n).pay(request).await.map(|r| replayed(r.metadata())).map_err(|s| s.code())
        }
        Scenario::Refund | Scenario::HotRefund => {
            let (merchant, out_trade_no) = &prepared.paid[index % prepared.paid.len()];
            let request = proto::RefundRequest {
                merchant_id: merchant.clone(),
                out_trade_no: out_trade_no.clone(),
                out_refund_no: format!("r{n}"),
                amount: "1.00".into(),
                currency: "USD".into(),
                reason: String::new(),
            };
            clients.payment(n).refund(request).await.map(|r| replayed(r.metadata())).map_err(|s| s.code())
        }
        Scenario::Query => {
            let (merchant, out_trade_no) = &prepared.paid[index % prepared.paid.len()];
            query(clients, n, merchant, out_trade_no).await
        }
        Scenario::Health => {
            let request = HealthCheckRequest { service: String::new() };
            clients.health(n).check(request).await.map(|_| false).map_err(|s| s.code())
        }
        Scenario::Mixed => {
            let (draw, duplicate) = {
                let mut rng = rand::rng();
                (rng.random_range(0..20), rng.random_bool(duplicate_ratio))
            };
            let sends = if duplicate { 2 } else { 1 };
            let mut outcome = Ok(false);
            for _ in 0..sends {
                outcome = mixed_call(draw, n, prepared, clients).await;
            }
            outcome
        }
    }
}

/// Transfer number `n` of 0.01 from `payer` to a shop, with an idempotency-key of its own.
async fn transfer(
    n: u64,
    index: usize,
    payer: &str,
    prepared: &Prepared,
    clients: &Clients,
) -> Result<bool, tonic::Code> {
    let replayed = |metadata: &tonic::metadata::MetadataMap| metadata.get(payledger_client::REPLAYED_HEADER).is_some();
    let to = &prepared.shops[index % prepared.shops.len()];
    let request = proto::TransferRequest {
        from_account_id: payer.to_owned(),
        to_account_id: to.clone(),
        amount: "0.01".into(),
        currency: "USD".into(),
        memo: String::new(),
    };
    let request =
        payledger_client::with_idempotency_key(request, &format!("b{}-t{n}", prepared.run)).map_err(|s| s.code())?;
    clients.account(n).transfer(request).await.map(|r| replayed(r.metadata())).map_err(|s| s.code())
}

/// Queries a paid order by its out_trade_no (never a replay: Query changes nothing).
async fn query(clients: &Clients, n: u64, merchant: &str, out_trade_no: &str) -> Result<bool, tonic::Code> {
    let request =
        proto::QueryRequest { merchant_id: merchant.to_owned(), key: Some(Key::OutTradeNo(out_trade_no.to_owned())) };
    clients.payment(n).query(request).await.map(|_| false).map_err(|s| s.code())
}

async fn mixed_call(draw: u32, n: u64, prepared: &Prepared, clients: &Clients) -> Result<bool, tonic::Code> {
    let replayed = |metadata: &tonic::metadata::MetadataMap| metadata.get(payledger_client::REPLAYED_HEADER).is_some();
    let index = usize::try_from(n).unwrap_or(0);
    let payer = &prepared.payers[index % prepared.payers.len()];
    match draw {
        9..11 => {
            let (merchant, order_no, payer) = &prepared.orders[index % prepared.orders.len()];
            let authorize = proto::AuthorizeRequest {
                merchant_id: merchant.clone(),
                out_auth_no: format!("{order_no}-auth"),
                order_no: order_no.clone(),
                payer_account_id: prepared.payers[*payer].clone(),
                amount: "1.00".into(),
                currency: "USD".into(),
            };
            let mut client = clients.payment(n);
            client.authorize(authorize).await.map_err(|s| s.code())?;
            if draw == 10 {
                let void =
                    proto::VoidRequest { merchant_id: merchant.clone(), out_auth_no: format!("{order_no}-auth") };
                return client.void(void).await.map(|r| replayed(r.metadata())).map_err(|s| s.code());
            }
            let capture = proto::CaptureRequest {
                merchant_id: merchant.clone(),
                out_auth_no: format!("{order_no}-auth"),
                out_trade_no: format!("{order_no}-capture"),
                amount: "0.60".into(),
                currency: "USD".into(),
            };
            client.capture(capture).await.map(|r| replayed(r.metadata())).map_err(|s| s.code())
        }
        0..11 => {
            let (merchant, order_no, payer) = &prepared.orders[index % prepared.orders.len()];
            let request = pay_request(merchant, &format!("{order_no}-pay"), order_no, &prepared.payers[*payer], "1.00");
            clients.payment(n).pay(request).await.map(|r| replayed(r.metadata())).map_err(|s| s.code())
        }
        11 => {
            let request = proto::WithdrawRequest {
                request_id: format!("b{}-w{n}", prepared.run),
                account_id: payer.clone(),
                amount: "1.00".into(),
                currency: "USD".into(),
            };
            clients.account(n).withdraw(request).await.map(|r| replayed(r.metadata())).map_err(|s| s.code())
        }
        12..14 => {
            let (merchant, out_trade_no) = &prepared.paid[index % prepared.paid.len()];
            let request = proto::RefundRequest {
                merchant_id: merchant.clone(),
                out_trade_no: out_trade_no.clone(),
                out_refund_no: format!("r{n}"),
                amount: "0.01".into(),
                currency: "USD".into(),
                reason: String::new(),
            };
            clients.payment(n).refund(request).await.map(|r| replayed(r.metadata())).map_err(|s| s.code())
        }
        14..16 => {
            let (merchant, out_trade_no) = &prepared.paid[index % prepared.paid.len()];
            query(clients, n, merchant, out_trade_no).await
        }
        16..18 => {
            let request = proto::DepositRequest {
                request_id: format!("b{}-d{n}", prepared.run),
                account_id: payer.clone(),
                amount: "1.00".into(),
                currency: "USD".into(),
            };
            clients.account(n).deposit(request).await.map(|r| replayed(r.metadata())).map_err(|s| s.code())
        }
        _ => transfer(n, index, payer, prepared, clients).await,
    }
}

/// Runs one benchmark and returns its report.
///
/// # Errors
/// When the target cannot be reached or the preparation fails.
pub async fn bench(settings: &BenchSettings) -> Result<BenchReport, AnyError> {
    let (mut accounts, mut payments, mut health) = (Vec::new(), Vec::new(), Vec::new());
    let (mut prepare_accounts, mut prepare_payments, mut prepare_health) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..settings.connections.max(1) {
        let (channel, bearer) = settings.access.connect(&settings.target).await?;
        let retrying = payledger_client::RetryLayer::new(payledger_client::RetrySettings::default())
            .with_bearer_token(bearer.clone())
            .layer(channel.clone());
        prepare_accounts.push(AccountServiceClient::new(retrying.clone()));
        prepare_payments.push(PaymentServiceClient::new(retrying.clone()));
        prepare_health.push(HealthClient::new(retrying));
        accounts.push(AccountServiceClient::with_interceptor(channel.clone(), bearer.clone()));
        payments.push(PaymentServiceClient::with_interceptor(channel.clone(), bearer.clone()));
        health.push(HealthClient::with_interceptor(channel, bearer));
    }
    let clients = Clients { accounts, payments, health };
    eprintln!("preparing {:?} data (untimed)...", settings.scenario);
    let prepare_clients = Clients { accounts: prepare_accounts, payments: prepare_payments, health: prepare_health };
    let prepared = Arc::new(prepare(settings, &prepare_clients).await?);
    match settings.rate {
        Some(rate) => eprintln!(
            "running {} calls at {rate} calls/s (open loop), at most {} in flight...",
            settings.total, settings.concurrency
        ),
        None => eprintln!("running {} calls at concurrency {}...", settings.total, settings.concurrency),
    }

    let next = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = settings.duration_seconds.map(|seconds| started + Duration::from_secs(seconds));
    let ticker = settings
        .progress
        .shown()
        .then(|| tokio::spawn(report_progress(done.clone(), settings.total, started, deadline)));
    let workers: Vec<_> = (0..settings.concurrency.max(1))
        .map(|_| {
            let (next, done, prepared, clients) = (next.clone(), done.clone(), prepared.clone(), clients.clone());
            let (scenario, total, duplicate_ratio) = (settings.scenario, settings.total, settings.duplicate_ratio);
            let interval = settings.rate.filter(|rate| *rate > 0.0).map(|rate| Duration::from_secs_f64(1.0 / rate));
            tokio::spawn(async move {
                let mut histogram = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
                let mut codes: BTreeMap<String, u64> = BTreeMap::new();
                let mut replays = 0;
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= total || deadline.is_some_and(|deadline| Instant::now() >= deadline) {
                        break;
                    }
                    let call_started = match interval {
                        Some(interval) => {
                            let scheduled = started + interval.mul_f64(n as f64);
                            tokio::time::sleep_until(scheduled.into()).await;
                            scheduled
                        }
                        None => Instant::now(),
                    };
                    let outcome = call(scenario, n, &prepared, &clients, duplicate_ratio).await;
                    let micros = u64::try_from(call_started.elapsed().as_micros()).unwrap_or(u64::MAX);
                    let _ = histogram.record(micros.max(1));
                    let code = match outcome {
                        Ok(replayed) => {
                            replays += u64::from(replayed);
                            tonic::Code::Ok
                        }
                        Err(code) => code,
                    };
                    *codes.entry(format!("{code:?}")).or_default() += 1;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                (histogram, codes, replays)
            })
        })
        .collect();
    let mut histogram = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
    let mut status_codes: BTreeMap<String, u64> = BTreeMap::new();
    let mut replays = 0;
    for worker in workers {
        let (worker_histogram, codes, worker_replays) = worker.await?;
        histogram.add(&worker_histogram)?;
        for (code, count) in codes {
            *status_codes.entry(code).or_default() += count;
        }
        replays += worker_replays;
    }
    if let Some(ticker) = ticker {
        ticker.abort();
        // The last line, so a run shorter than the interval shows its progress too.
        eprintln!("{}", progress_line(done.load(Ordering::Relaxed), settings.total, started, deadline));
    }
    let elapsed = started.elapsed().as_secs_f64();
    let count = histogram.len();
    let mut latency_us = BTreeMap::new();
    latency_us.insert("min".to_owned(), histogram.min());
    for (name, quantile) in [("p50", 0.5), ("p90", 0.9), ("p99", 0.99)] {
        latency_us.insert(name.to_owned(), histogram.value_at_quantile(quantile));
    }
    latency_us.insert("max".to_owned(), histogram.max());
    latency_us.insert("mean".to_owned(), histogram.mean() as u64);
    let buckets = 10u64;
    let width = (histogram.max() - histogram.min()).div_ceil(buckets).max(1);
    let histogram_rows = (1..=buckets)
        .map(|bucket| {
            let upper = histogram.min() + width * bucket;
            let lower = upper - width;
            (upper, histogram.count_between(lower + u64::from(bucket > 1), upper))
        })
        .collect();
    Ok(BenchReport {
        scenario: settings.scenario,
        concurrency: settings.concurrency,
        offered_rate: settings.rate,
        count,
        duration_seconds: elapsed,
        calls_per_second: count as f64 / elapsed.max(f64::EPSILON),
        latency_us,
        histogram: histogram_rows,
        status_codes,
        replays,
    })
}

fn millis(micros: u64) -> String {
    format!("{:.2} ms", micros as f64 / 1000.0)
}

fn print_report(report: &BenchReport) {
    match report.offered_rate {
        Some(rate) => println!(
            "Summary ({:?}, concurrency {}, open loop at {rate} calls/s offered; latency from each call's scheduled start):",
            report.scenario, report.concurrency
        ),
        None => println!("Summary ({:?}, concurrency {}):", report.scenario, report.concurrency),
    }
    println!("  Count:        {}", report.count);
    println!("  Total:        {:.2} s", report.duration_seconds);
    for (label, key) in [("Slowest", "max"), ("Fastest", "min"), ("Average", "mean")] {
        println!("  {label}:      {}", millis(report.latency_us[key]));
    }
    println!("  Requests/sec: {:.1}", report.calls_per_second);
    println!("\nResponse time histogram:");
    let peak = report.histogram.iter().map(|(_, count)| *count).max().unwrap_or(1).max(1);
    for (upper, count) in &report.histogram {
        let bar = "∎".repeat(usize::try_from(count * 40 / peak).unwrap_or(0));
        println!("  {:>10} [{count:>7}] |{bar}", millis(*upper));
    }
    println!("\nLatency distribution:");
    for key in ["p50", "p90", "p99"] {
        println!("  {key} in {}", millis(report.latency_us[key]));
    }
    println!("\nStatus code distribution:");
    for (code, count) in &report.status_codes {
        println!("  [{code}] {count} responses");
    }
    println!("  replayed: {}", report.replays);
}

/// Runs `payledger bench`: exit status 1 when a call failed other than as the scenario expects.
///
/// Every 2 s until aborted, on stderr: calls done of `total`, the rate so far, and the time
/// left at that rate (or to `deadline`, when that comes first).
async fn report_progress(done: Arc<AtomicU64>, total: u64, started: Instant, deadline: Option<Instant>) {
    let mut ticks = tokio::time::interval_at((started + PROGRESS_EVERY).into(), PROGRESS_EVERY);
    loop {
        ticks.tick().await;
        eprintln!("{}", progress_line(done.load(Ordering::Relaxed), total, started, deadline));
    }
}

/// One progress line: `calls` done of `total`, the rate since `started`, and the time left at
/// that rate (or to `deadline`, when that comes first).
fn progress_line(calls: u64, total: u64, started: Instant, deadline: Option<Instant>) -> String {
    let rate = calls as f64 / started.elapsed().as_secs_f64();
    let mut left = if rate > 0.0 { total.saturating_sub(calls) as f64 / rate } else { f64::INFINITY };
    if let Some(deadline) = deadline {
        left = left.min(deadline.saturating_duration_since(Instant::now()).as_secs_f64());
    }
    let percent = calls as f64 * 100.0 / total.max(1) as f64;
    format!("bench: {calls} of {total} calls ({percent:.0}%), {rate:.0} calls/s, about {left:.0} s left")
}

/// How often `bench` reports its progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);

/// # Errors
/// When the target cannot be reached or the preparation fails.
pub async fn run(settings: BenchSettings) -> Result<ExitCode, AnyError> {
    crate::check_test_data_allowed(&settings.target, settings.allow_test_data)?;
    let report = bench(&settings).await?;
    print_report(&report);
    if settings.json {
        println!("bench-report: {}", serde_json::to_string(&report)?);
    }
    let failed: u64 =
        report.status_codes.iter().filter(|(code, _)| code.as_str() != "Ok").map(|(_, count)| count).sum();
    Ok(if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
