//! The retrying client against a scripted fake server that counts the attempts it sees.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use payledger::client::{PayledgerClient, RetrySettings};
use payledger::proto::{self, account_service_server, payment_service_server};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Code, Request, Response, Status};

/// One attempt as the server saw it.
#[derive(Debug, Clone)]
struct Seen {
    method: &'static str,
    merchant: String,
    previous_attempts: Option<String>,
    idempotency_key: Option<String>,
    at: Instant,
}

#[derive(Clone, Default)]
struct Fake {
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Fake {
    /// Records the attempt; returns how many attempts of this method and merchant came before.
    fn see<T>(&self, method: &'static str, merchant: &str, request: &Request<T>) -> usize {
        let header = |name: &str| request.metadata().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let mut seen = self.seen.lock().unwrap();
        let before = seen.iter().filter(|s| s.method == method && s.merchant == merchant).count();
        seen.push(Seen {
            method,
            merchant: merchant.to_owned(),
            previous_attempts: header("grpc-previous-rpc-attempts"),
            idempotency_key: header("idempotency-key"),
            at: Instant::now(),
        });
        before
    }

    fn attempts(&self, method: &str, merchant: &str) -> Vec<Seen> {
        self.seen.lock().unwrap().iter().filter(|s| s.method == method && s.merchant == merchant).cloned().collect()
    }
}

fn unavailable_with_pushback(ms: &str) -> Status {
    let mut status = Status::unavailable("try later");
    status.metadata_mut().insert("grpc-retry-pushback-ms", ms.parse().unwrap());
    status
}

#[tonic::async_trait]
impl payment_service_server::PaymentService for Fake {
    async fn create_order(
        &self,
        request: Request<proto::CreateOrderRequest>,
    ) -> Result<Response<proto::CreateOrderResponse>, Status> {
        self.see("CreateOrder", &request.get_ref().merchant_id.clone(), &request);
        Err(Status::already_exists("order_no was already used"))
    }

    async fn close_order(
        &self,
        request: Request<proto::CloseOrderRequest>,
    ) -> Result<Response<proto::CloseOrderResponse>, Status> {
        self.see("CloseOrder", &request.get_ref().merchant_id.clone(), &request);
        Err(Status::not_found("order not found"))
    }

    async fn pay(&self, request: Request<proto::PayRequest>) -> Result<Response<proto::PayResponse>, Status> {
        let merchant = request.get_ref().merchant_id.clone();
        let before = self.see("Pay", &merchant, &request);
        match (merchant.as_str(), before) {
            ("flaky", 0) => Err(unavailable_with_pushback("150")),
            ("flaky", 1) => Err(Status::aborted("contention")),
            ("bad", _) => Err(Status::invalid_argument("amount: must be more than zero")),
            ("stop", _) => Err(unavailable_with_pushback("-1")),
            ("down", _) => Err(Status::unavailable("database unavailable")),
            _ => Ok(Response::new(proto::PayResponse {
                payment: Some(proto::Payment { trade_no: "T1".into(), ..Default::default() }),
                order: None,
            })),
        }
    }

    async fn refund(&self, request: Request<proto::RefundRequest>) -> Result<Response<proto::RefundResponse>, Status> {
        self.see("Refund", &request.get_ref().merchant_id.clone(), &request);
        Err(Status::failed_precondition("the refund would exceed the amount paid"))
    }

    async fn query(&self, request: Request<proto::QueryRequest>) -> Result<Response<proto::QueryResponse>, Status> {
        if self.see("Query", &request.get_ref().merchant_id.clone(), &request) == 0 {
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        Ok(Response::new(proto::QueryResponse::default()))
    }

    async fn issue_token(
        &self,
        _: Request<proto::IssueTokenRequest>,
    ) -> Result<Response<proto::IssueTokenResponse>, Status> {
        Err(Status::unimplemented("not in this fake"))
    }

    async fn authorize(
        &self,
        _: Request<proto::AuthorizeRequest>,
    ) -> Result<Response<proto::AuthorizeResponse>, Status> {
        Err(Status::unimplemented("not in this fake"))
    }

    async fn capture(&self, _: Request<proto::CaptureRequest>) -> Result<Response<proto::CaptureResponse>, Status> {
        Err(Status::unimplemented("not in this fake"))
    }

    async fn void(&self, _: Request<proto::VoidRequest>) -> Result<Response<proto::VoidResponse>, Status> {
        Err(Status::unimplemented("not in this fake"))
    }
}

#[tonic::async_trait]
impl account_service_server::AccountService for Fake {
    async fn open_account(
        &self,
        _: Request<proto::OpenAccountRequest>,
    ) -> Result<Response<proto::OpenAccountResponse>, Status> {
        Err(Status::unimplemented("not in this fake"))
    }

    async fn deposit(&self, _: Request<proto::DepositRequest>) -> Result<Response<proto::DepositResponse>, Status> {
        Err(Status::unimplemented("not in this fake"))
    }

    async fn withdraw(&self, _: Request<proto::WithdrawRequest>) -> Result<Response<proto::WithdrawResponse>, Status> {
        Err(Status::unimplemented("not in this fake"))
    }

    async fn get_account(
        &self,
        _: Request<proto::GetAccountRequest>,
    ) -> Result<Response<proto::GetAccountResponse>, Status> {
        Err(Status::unimplemented("not in this fake"))
    }

    async fn list_entries(
        &self,
        _: Request<proto::ListEntriesRequest>,
    ) -> Result<Response<proto::ListEntriesResponse>, Status> {
        Err(Status::unimplemented("not in this fake"))
    }

    async fn transfer(
        &self,
        request: Request<proto::TransferRequest>,
    ) -> Result<Response<proto::TransferResponse>, Status> {
        if self.see("Transfer", &request.get_ref().from_account_id.clone(), &request) < 2 {
            return Err(Status::unavailable("connection reset"));
        }
        Ok(Response::new(proto::TransferResponse::default()))
    }
}

async fn fake_server() -> (Fake, String) {
    let fake = Fake::default();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let server = tonic::transport::Server::builder()
        .add_service(payment_service_server::PaymentServiceServer::new(fake.clone()))
        .add_service(account_service_server::AccountServiceServer::new(fake.clone()))
        .serve_with_incoming(TcpListenerStream::new(listener));
    tokio::spawn(server);
    (fake, format!("http://{address}"))
}

fn settings() -> RetrySettings {
    RetrySettings {
        max_attempts: 4,
        initial_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(50),
        per_attempt_timeout: Duration::from_millis(500),
        overall_deadline: Duration::from_secs(10),
        ..RetrySettings::default()
    }
}

fn pay(merchant: &str) -> proto::PayRequest {
    proto::PayRequest { merchant_id: merchant.into(), out_trade_no: "pay-1".into(), ..Default::default() }
}

#[tokio::test]
async fn unavailable_and_aborted_are_retried_with_the_attempt_count_and_the_servers_pushback() {
    let (fake, endpoint) = fake_server().await;
    let client = PayledgerClient::connect_lazy(&endpoint, settings()).unwrap();

    let response = client.pay(pay("flaky")).await.unwrap();

    assert_eq!(response.into_inner().payment.unwrap().trade_no, "T1");
    let attempts = fake.attempts("Pay", "flaky");
    assert_eq!(attempts.len(), 3, "the server saw three attempts");
    let counts: Vec<_> = attempts.iter().map(|a| a.previous_attempts.clone()).collect();
    assert_eq!(counts, [None, Some("1".into()), Some("2".into())]);
    assert!(attempts[1].at - attempts[0].at >= Duration::from_millis(150), "the 150 ms pushback was honoured");
}

#[tokio::test]
async fn refusals_are_never_retried() {
    let (fake, endpoint) = fake_server().await;
    let client = PayledgerClient::connect_lazy(&endpoint, settings()).unwrap();

    let invalid = client.pay(pay("bad")).await.unwrap_err();
    let precondition =
        client.refund(proto::RefundRequest { merchant_id: "m".into(), ..Default::default() }).await.unwrap_err();
    let exists = client
        .create_order(proto::CreateOrderRequest { merchant_id: "m".into(), ..Default::default() })
        .await
        .unwrap_err();
    let missing = client
        .close_order(proto::CloseOrderRequest { merchant_id: "m".into(), ..Default::default() })
        .await
        .unwrap_err();

    assert_eq!(
        [invalid.code(), precondition.code(), exists.code(), missing.code()],
        [Code::InvalidArgument, Code::FailedPrecondition, Code::AlreadyExists, Code::NotFound]
    );
    for method in ["Pay", "Refund", "CreateOrder", "CloseOrder"] {
        let merchant = if method == "Pay" { "bad" } else { "m" };
        assert_eq!(fake.attempts(method, merchant).len(), 1, "{method} was attempted once");
    }
    assert_eq!(client.stats().retries.load(std::sync::atomic::Ordering::Relaxed), 0);
}

#[tokio::test]
async fn attempts_stop_at_the_cap_and_a_negative_pushback_stops_at_once() {
    let (fake, endpoint) = fake_server().await;
    let client = PayledgerClient::connect_lazy(&endpoint, settings()).unwrap();

    let down = client.pay(pay("down")).await.unwrap_err();
    let stopped = client.pay(pay("stop")).await.unwrap_err();

    assert_eq!(down.code(), Code::Unavailable);
    assert_eq!(fake.attempts("Pay", "down").len(), 4, "max_attempts");
    assert_eq!(stopped.code(), Code::Unavailable);
    assert_eq!(fake.attempts("Pay", "stop").len(), 1, "pushback -1 means do not retry (gRFC A6)");
}

#[tokio::test]
async fn an_attempt_past_its_deadline_is_retried_within_the_overall_deadline() {
    let (fake, endpoint) = fake_server().await;
    let client = PayledgerClient::connect_lazy(&endpoint, settings()).unwrap();

    client.query(proto::QueryRequest { merchant_id: "slow".into(), key: None }).await.unwrap();

    assert_eq!(fake.attempts("Query", "slow").len(), 2, "the first attempt timed out and was retried");
}

#[tokio::test]
async fn every_attempt_of_a_transfer_carries_the_same_generated_idempotency_key() {
    let (fake, endpoint) = fake_server().await;
    let client = PayledgerClient::connect_lazy(&endpoint, settings()).unwrap();

    client.transfer(proto::TransferRequest { from_account_id: "alice".into(), ..Default::default() }).await.unwrap();
    client.transfer(proto::TransferRequest { from_account_id: "bob".into(), ..Default::default() }).await.unwrap();

    let alice: Vec<_> = fake.attempts("Transfer", "alice").into_iter().map(|a| a.idempotency_key.unwrap()).collect();
    let bob: Vec<_> = fake.attempts("Transfer", "bob").into_iter().map(|a| a.idempotency_key.unwrap()).collect();
    assert_eq!(alice.len(), 3);
    assert!(alice.iter().all(|key| *key == alice[0]), "one key per logical call: {alice:?}");
    assert_ne!(alice[0], bob[0], "a new logical call gets a new key");
}

#[test]
fn the_shipped_service_config_retries_only_transient_codes() {
    let config: serde_json::Value =
        serde_json::from_str(include_str!("../../client/service_config.json")).expect("valid JSON");
    let methods = config["methodConfig"].as_array().unwrap();
    let mut named = Vec::new();
    for method_config in methods {
        let policy = &method_config["retryPolicy"];
        let codes: Vec<&str> =
            policy["retryableStatusCodes"].as_array().unwrap().iter().map(|c| c.as_str().unwrap()).collect();
        assert_eq!(codes, ["UNAVAILABLE", "ABORTED", "RESOURCE_EXHAUSTED"]);
        assert!(policy["maxAttempts"].as_u64().unwrap() <= 5, "gRPC caps maxAttempts at 5");
        named
            .extend(method_config["name"].as_array().unwrap().iter().map(|n| n["method"].as_str().unwrap().to_owned()));
    }
    for rpc in ["Pay", "Refund", "CreateOrder", "CloseOrder", "Transfer", "Deposit", "OpenAccount", "Query"] {
        assert!(named.iter().any(|name| name == rpc), "{rpc} has a retry policy");
    }
}

#[test]
fn the_typed_reasons_are_the_error_table_of_the_api_docs() {
    let readme = include_str!("../../docs/api.md");
    let table = readme.split("| Code | Reason | When |").nth(1).expect("the error table of docs/api.md");
    let mut documented: Vec<&str> = Vec::new();
    for row in table.lines().skip(2).take_while(|line| line.starts_with('|')) {
        let reasons = row.split('|').nth(2).expect("a Reason column");
        documented.extend(reasons.split('`').skip(1).step_by(2));
    }
    documented.sort_unstable();
    documented.dedup();
    let mut known = payledger::client::Reason::KNOWN.to_vec();
    known.sort_unstable();
    assert_eq!(documented, known, "client/src/error.rs and the error table of docs/api.md name the same reasons");
}
