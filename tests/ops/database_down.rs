//! The database gone: a batched Pay and a Deposit are answered UNAVAILABLE within the pool's
//! acquire timeout (`--pool-acquire-timeout-ms`) plus a margin, as a call that is not batched
//! is, never after one wait for each way the call could be written; nothing of them is written,
//! and once the database is back the same calls move the money once.
//!
//! The server reaches its database through a TCP proxy of this test, which, cut, closes every
//! connection it carries and every new one at once (what a stopped database server or a
//! refused port looks like to the pool). PostgreSQL and MariaDB; SQLite has no connection to
//! lose.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use payledger::proto::account_service_client::AccountServiceClient;
use payledger::proto::payment_service_client::PaymentServiceClient;
use payledger::proto::{self};
use payledger::store::{PoolSettings, Store};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use tonic::Code;

/// The pool's acquire timeout in this test.
const ACQUIRE_TIMEOUT: Duration = Duration::from_millis(1_000);
/// What a call may take beyond [`ACQUIRE_TIMEOUT`] to be answered: the call's own work and a
/// loaded machine's scheduling, well under a second wait for a connection.
const MARGIN: Duration = Duration::from_millis(700);

/// Ports the proxy listens on: below Linux's ephemeral range (32768 to 60999 by default), from
/// which the kernel gives outgoing connections their local port. Cut, the proxy frees its
/// port; one of the ephemeral range could meanwhile become some other test's connection's
/// own, and `restore` could not bind it again.
const PROXY_PORTS: std::ops::Range<u16> = 20_000..32_000;

/// A TCP proxy to the database that can be cut and restored.
struct Proxy {
    address: std::net::SocketAddr,
    target: String,
    carried: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accepting: Mutex<Option<JoinHandle<()>>>,
}

impl Proxy {
    async fn start(target: String) -> Self {
        let listener = Self::bind_outside_ephemeral_range().await;
        let address = listener.local_addr().unwrap();
        let proxy = Self { address, target, carried: Arc::default(), accepting: Mutex::new(None) };
        proxy.accept(listener);
        proxy
    }

    /// A listener on a free port of [`PROXY_PORTS`], tried from a point that differs between
    /// runs and tests.
    async fn bind_outside_ephemeral_range() -> TcpListener {
        let span = u32::from(PROXY_PORTS.end - PROXY_PORTS.start);
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        for step in 0..span {
            let port = PROXY_PORTS.start + u16::try_from((seed + step) % span).unwrap();
            if let Ok(listener) = TcpListener::bind(("127.0.0.1", port)).await {
                return listener;
            }
        }
        panic!("no free port in {PROXY_PORTS:?} for the proxy");
    }

    fn accept(&self, listener: TcpListener) {
        let (target, carried) = (self.target.clone(), self.carried.clone());
        let accepting = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let target = target.clone();
                carried.lock().unwrap().push(tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                }));
            }
        });
        *self.accepting.lock().unwrap() = Some(accepting);
    }

    /// Closes every connection it carries and its port, so that new ones are refused: what
    /// a stopped database server looks like.
    async fn cut(&self) {
        if let Some(accepting) = self.accepting.lock().unwrap().take() {
            accepting.abort();
        }
        for task in self.carried.lock().unwrap().drain(..) {
            task.abort();
        }
        // The aborted tasks drop their sockets, and the listener, when next polled.
        tokio::task::yield_now().await;
        while TcpStream::connect(self.address).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn restore(&self) {
        self.accept(TcpListener::bind(self.address).await.expect("the proxy's port again"));
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(accepting) = self.accepting.lock().unwrap().take() {
            accepting.abort();
        }
        for task in self.carried.lock().unwrap().drain(..) {
            task.abort();
        }
    }
}

/// `url` split around its `host:port`: what comes before it (`scheme://user@`), it, and what
/// comes after it (`/database...`).
fn around_host(url: &str) -> (&str, &str, &str) {
    let start = url.find("://").unwrap() + 3;
    let end = start + url[start..].find('/').unwrap();
    let start = url[start..end].rfind('@').map_or(start, |at| start + at + 1);
    (&url[..start], &url[start..end], &url[end..])
}

async fn database_down(admin_variable: &str) {
    let Some(admin) = common::admin_url(admin_variable) else { return };
    let database = common::ServerDatabase::create(&admin, "down").await;
    let (before, target, after) = around_host(&database.url);
    let proxy = Proxy::start(target.to_owned()).await;
    let url = format!("{before}{}{after}", proxy.address);
    let settings = PoolSettings {
        max_connections: 4,
        acquire_timeout: ACQUIRE_TIMEOUT,
        lock_timeout: Duration::from_secs(5),
        plan_lifetime: PoolSettings::PLAN_LIFETIME_DEFAULT,
    };
    let store = Store::connect(&url, &settings).await.expect("the database connects");
    store.migrate().await.expect("migrations apply");
    let served = common::serve_ledger(payledger::ledger::Ledger::new(store)).await;
    let channel = Channel::from_shared(format!("http://{}", served.address)).unwrap().connect().await.unwrap();
    let (mut accounts, mut payments) = (AccountServiceClient::new(channel.clone()), PaymentServiceClient::new(channel));
    for account_id in ["payer", "shop"] {
        let request = proto::OpenAccountRequest { account_id: account_id.into(), currency: "USD".into() };
        accounts.open_account(request).await.unwrap();
    }
    let deposit = |request_id: &str| proto::DepositRequest {
        request_id: request_id.into(),
        account_id: "payer".into(),
        amount: "10.00".into(),
        currency: "USD".into(),
    };
    accounts.deposit(deposit("funds")).await.unwrap();
    let order = proto::CreateOrderRequest {
        merchant_id: "m1".into(),
        order_no: "o1".into(),
        payee_account_id: "shop".into(),
        amount: "1.00".into(),
        currency: "USD".into(),
        subject: "down".into(),
        expires_at: None,
    };
    payments.create_order(order).await.unwrap();
    let pay = proto::PayRequest {
        merchant_id: "m1".into(),
        out_trade_no: "t1".into(),
        order_no: "o1".into(),
        payer_account_id: "payer".into(),
        amount: "1.00".into(),
        currency: "USD".into(),
    };

    proxy.cut().await;
    let started = Instant::now();
    let refused = payments.pay(pay.clone()).await.unwrap_err();
    let pay_took = started.elapsed();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    let started = Instant::now();
    let refused = accounts.deposit(deposit("d1")).await.unwrap_err();
    let deposit_took = started.elapsed();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    // The pool's connections are all gone by now: a Pay again waits for a new one.
    let started = Instant::now();
    let refused = payments.pay(pay.clone()).await.unwrap_err();
    let again_took = started.elapsed();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    println!("Pay answered in {pay_took:?}, Deposit in {deposit_took:?}, Pay again in {again_took:?}");
    let bound = ACQUIRE_TIMEOUT + MARGIN;
    for (call, took) in [("Pay", pay_took), ("Deposit", deposit_took), ("Pay again", again_took)] {
        assert!(took <= bound, "{call} answered in {took:?}: over the bound {bound:?}");
    }

    proxy.restore().await;
    let paid = payments.pay(pay).await.unwrap().into_inner();
    assert_eq!(paid.payment.unwrap().out_trade_no, "t1");
    accounts.deposit(deposit("d1")).await.unwrap();
    let payer = accounts.get_account(proto::GetAccountRequest { account_id: "payer".into() }).await.unwrap();
    assert_eq!(payer.into_inner().account.unwrap().balance, "19.00", "10 + 10 deposited once - 1 paid once");
    served.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_gone_answers_a_batched_pay_and_a_deposit_unavailable_within_the_acquire_timeout() {
    database_down("PAYLEDGER_TEST_POSTGRES_URL").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_gone_answers_a_batched_pay_and_a_deposit_unavailable_within_the_acquire_timeout() {
    database_down("PAYLEDGER_TEST_MYSQL_URL").await;
}

/// A start on a database server that refuses connections is told why at once, in the
/// driver's words, with the URL's password redacted, rather than "pool timed out" after the
/// pool's acquire timeout (here a minute, which the test would otherwise wait out).
async fn a_refused_start_says_why(admin_variable: &str) {
    let Some(admin) = common::admin_url(admin_variable) else { return };
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
    let (before, _, after) = around_host(&admin);
    let scheme = &before[..before.find("://").unwrap() + 3];
    let url = format!("{scheme}payledger:secret-password@{closed}{after}");
    let settings = PoolSettings {
        max_connections: 4,
        acquire_timeout: Duration::from_secs(60),
        lock_timeout: Duration::from_secs(5),
        plan_lifetime: PoolSettings::PLAN_LIFETIME_DEFAULT,
    };
    let refused = Store::connect(&url, &settings).await.err().expect("nothing listens there");
    let said = payledger::startup::error_chain(&refused);
    assert!(said.contains("Connection refused"), "{said}");
    assert!(!said.contains("secret-password") && !said.contains("pool timed out"), "{said}");
}

#[tokio::test]
async fn a_start_on_a_postgres_port_that_refuses_connections_says_so() {
    a_refused_start_says_why("PAYLEDGER_TEST_POSTGRES_URL").await;
}

#[tokio::test]
async fn a_start_on_a_mariadb_port_that_refuses_connections_says_so() {
    a_refused_start_says_why("PAYLEDGER_TEST_MYSQL_URL").await;
}
