//! `payledger demo`: a short story that shows money moving exactly once, told step by step
//! through the public gRPC API. Every step states what must happen and checks it, so the
//! demo doubles as a smoke test: it exits non-zero when any step misbehaves.

use std::process::ExitCode;
use std::time::Duration;

use tokio::net::TcpListener;
use tonic::transport::Channel;
use tonic::{Code, Response, Status};
use tonic_types::StatusExt;

use payledger::config::{DatabaseSettings, IdempotencySettings, WriteSettings};
use payledger::startup::{open_ledger, Application};
use payledger_client::proto::account_service_client::AccountServiceClient;
use payledger_client::proto::payment_service_client::PaymentServiceClient;
use payledger_client::proto::{self, query_request::Key};
use payledger_client::{BearerToken, REPLAYED_HEADER};

use crate::{AnyError, Stub};

/// `payledger demo` settings.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoSettings {
    /// Play against a running server (e.g. `http://127.0.0.1:50051`) instead of starting one
    /// in-process on a temporary SQLite database; needs `--allow-test-data`.
    #[arg(long)]
    pub target: Option<String>,
    /// Let `--target` receive the demo's accounts, deposits, orders and payments.
    #[arg(long)]
    pub allow_test_data: bool,
    #[command(flatten)]
    pub access: crate::TargetAccess,
}

/// Runs the demo; `Ok(ExitCode::FAILURE)` when a step did not behave as stated.
///
/// # Errors
/// When the in-process server cannot start or the target cannot be reached.
pub async fn run(settings: DemoSettings) -> Result<ExitCode, AnyError> {
    match settings.target {
        Some(target) => {
            crate::check_test_data_allowed(&target, settings.allow_test_data)?;
            println!("payledger demo against {target}\n");
            let (channel, bearer) = settings.access.connect(&target).await?;
            let passed = Story::new(channel, bearer).play().await?;
            Ok(verdict(passed))
        }
        None => {
            let directory = tempfile::tempdir()?;
            let database_url = format!("sqlite:{}", directory.path().join("demo.db").display());
            println!("payledger demo on a temporary SQLite database ({database_url})\n");
            let database = DatabaseSettings {
                database_url,
                pool_size: 4,
                pool_acquire_timeout_ms: 5_000,
                plan_lifetime_seconds: 30,
                lock_timeout_ms: 5_000,
                database_wait_seconds: 0,
            };
            let writes = WriteSettings { pay_batch_workers: 2, pay_batch_pipeline: 1, ..WriteSettings::default() };
            let ledger = open_ledger(&database, &writes, &IdempotencySettings::default()).await?;
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            let application = Application::with_listener(listener, ledger.clone(), Duration::from_secs(5));
            let address = application.local_addr();
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let server = tokio::spawn(application.run_until(async {
                let _ = stopped.await;
            }));
            let channel = Channel::from_shared(format!("http://{address}"))?.connect().await?;
            let mut passed = Story::new(channel, BearerToken::default()).play().await?;
            let violations = ledger.audit().await?;
            passed &= check(
                violations.is_empty(),
                "payledger audit: every balance equals the sum of its entries, all balances sum to zero",
            );
            for violation in violations {
                println!("    VIOLATION {}: {} ({})", violation.check, violation.subject, violation.detail);
            }
            let _ = stop.send(());
            server.await??;
            Ok(verdict(passed))
        }
    }
}

fn verdict(passed: bool) -> ExitCode {
    if passed {
        println!("\nEvery step behaved as stated: money moved exactly once.");
        ExitCode::SUCCESS
    } else {
        println!("\nSome steps did NOT behave as stated (marked FAILED above).");
        ExitCode::FAILURE
    }
}

/// Prints one expectation and whether it held.
fn check(held: bool, expectation: &str) -> bool {
    println!("    [{}] {expectation}", if held { " ok " } else { "FAILED" });
    held
}

fn was_replayed<T>(response: &Response<T>) -> bool {
    response.metadata().get(REPLAYED_HEADER).and_then(|value| value.to_str().ok()) == Some("true")
}

fn reason(status: &Status) -> String {
    status.get_error_details().error_info().map(|info| info.reason.clone()).unwrap_or_default()
}

struct Story {
    accounts: AccountServiceClient<Stub>,
    payments: PaymentServiceClient<Stub>,
    /// Makes the ids of this run unique, so the demo can run again against one server.
    run: String,
    passed: bool,
}

impl Story {
    fn new(channel: Channel, bearer: BearerToken) -> Self {
        let run = uuid::Uuid::now_v7().simple().to_string()[20..].to_owned();
        Self {
            accounts: AccountServiceClient::with_interceptor(channel.clone(), bearer.clone()),
            payments: PaymentServiceClient::with_interceptor(channel, bearer),
            run,
            passed: true,
        }
    }

    fn id(&self, name: &str) -> String {
        format!("demo-{}-{name}", self.run)
    }

    fn expect(&mut self, held: bool, expectation: &str) {
        self.passed &= check(held, expectation);
    }

    async fn balance(&self, account_id: &str) -> Result<String, Status> {
        let request = proto::GetAccountRequest { account_id: account_id.to_owned() };
        Ok(self.accounts.clone().get_account(request).await?.into_inner().account.unwrap_or_default().balance)
    }

    fn pay_request(&self, out_trade_no: &str, payer: &str) -> proto::PayRequest {
        proto::PayRequest {
            merchant_id: self.id("merchant"),
            out_trade_no: self.id(out_trade_no),
            order_no: self.id("order-1"),
            payer_account_id: payer.to_owned(),
            amount: "30.00".into(),
            currency: "USD".into(),
        }
    }

    fn refund_request(&self, out_refund_no: &str, amount: &str) -> proto::RefundRequest {
        proto::RefundRequest {
            merchant_id: self.id("merchant"),
            out_trade_no: self.id("pay-1"),
            out_refund_no: self.id(out_refund_no),
            amount: amount.into(),
            currency: "USD".into(),
            reason: "customer returned an item".into(),
        }
    }

    async fn play(mut self) -> Result<bool, AnyError> {
        let (alice, shop) = (self.id("alice"), self.id("shop"));

        println!("1. Open a payer account ({alice}) and a merchant account ({shop}), both in USD.");
        for account_id in [&alice, &shop] {
            let request = proto::OpenAccountRequest { account_id: account_id.clone(), currency: "USD".into() };
            self.accounts.open_account(request).await?;
        }
        let balance = self.balance(&alice).await?;
        self.expect(balance == "0.00", "both accounts start at 0.00");

        println!("2. Deposit 100.00 into the payer's account.");
        let deposit = proto::DepositRequest {
            request_id: self.id("deposit-1"),
            account_id: alice.clone(),
            amount: "100.00".into(),
            currency: "USD".into(),
        };
        self.accounts.deposit(deposit).await?;
        let balance = self.balance(&alice).await?;
        self.expect(balance == "100.00", "the payer holds 100.00");

        println!("3. The merchant creates order order-1 for 30.00, payable for 15 minutes.");
        let order = proto::CreateOrderRequest {
            merchant_id: self.id("merchant"),
            order_no: self.id("order-1"),
            payee_account_id: shop.clone(),
            amount: "30.00".into(),
            currency: "USD".into(),
            subject: "a pot of tea".into(),
            expires_at: Some(timestamp_in(Duration::from_secs(15 * 60))),
        };
        let order = self.payments.create_order(order).await?.into_inner().order.unwrap_or_default();
        self.expect(order.status() == proto::OrderStatus::Pending, "the order is PENDING");
        self.expect(order.expires_at.is_some(), "it shows when it expires");

        println!("4. Pay order-1 with out_trade_no pay-1.");
        let first = self.payments.pay(self.pay_request("pay-1", &alice)).await?;
        let first_replayed = was_replayed(&first);
        let first = first.into_inner();
        let trade_no = first.payment.clone().unwrap_or_default().trade_no;
        println!("    trade_no = {trade_no}");
        self.expect(!first_replayed, "the payment runs");
        self.expect(first.order.unwrap_or_default().status() == proto::OrderStatus::Paid, "the order is PAID");
        let balance = self.balance(&alice).await?;
        self.expect(balance == "70.00", "the payer holds 70.00");

        println!("5. The caller's client times out and retries: Pay again with the same out_trade_no.");
        let retry = self.payments.pay(self.pay_request("pay-1", &alice)).await?;
        self.expect(was_replayed(&retry), "the answer is marked idempotent-replayed: true");
        self.expect(
            retry.into_inner().payment.unwrap_or_default().trade_no == trade_no,
            "the retry gets the original trade_no",
        );
        let balance = self.balance(&alice).await?;
        self.expect(balance == "70.00", "the payer still holds 70.00: debited once");

        println!("6. Someone pays order-1 again under a new out_trade_no pay-2.");
        let second = self.payments.pay(self.pay_request("pay-2", &alice)).await;
        self.expect(
            matches!(&second, Err(status) if status.code() == Code::FailedPrecondition && reason(status) == "ORDER_ALREADY_PAID"),
            "refused with FAILED_PRECONDITION ORDER_ALREADY_PAID",
        );
        let balance = self.balance(&alice).await?;
        self.expect(balance == "70.00", "no money moved");

        println!("7. Two partial refunds: refund-1 of 10.00, then refund-2 of 15.00.");
        let refund_one = self.payments.refund(self.refund_request("refund-1", "10.00")).await?.into_inner();
        self.expect(
            refund_one.order.unwrap_or_default().status() == proto::OrderStatus::PartiallyRefunded,
            "the order is PARTIALLY_REFUNDED",
        );
        let refund_two = self.payments.refund(self.refund_request("refund-2", "15.00")).await?.into_inner();
        let refund_no = refund_two.refund.unwrap_or_default().refund_no;
        self.expect(refund_two.order.unwrap_or_default().refunded_amount == "25.00", "25.00 of 30.00 is refunded");

        println!("8. A refund refund-3 of 10.00 would exceed the 5.00 left.");
        let too_much = self.payments.refund(self.refund_request("refund-3", "10.00")).await;
        self.expect(
            matches!(&too_much, Err(status) if status.code() == Code::FailedPrecondition && reason(status) == "REFUND_EXCEEDS_PAID"),
            "refused with FAILED_PRECONDITION REFUND_EXCEEDS_PAID",
        );

        println!("9. The refund-2 call is retried.");
        let retried = self.payments.refund(self.refund_request("refund-2", "15.00")).await?;
        self.expect(was_replayed(&retried), "the answer is marked idempotent-replayed: true");
        self.expect(
            retried.into_inner().refund.unwrap_or_default().refund_no == refund_no,
            "the retry gets the original refund_no",
        );

        println!("10. Query order-1 by its out_trade_no.");
        let query =
            proto::QueryRequest { merchant_id: self.id("merchant"), key: Some(Key::OutTradeNo(self.id("pay-1"))) };
        let details = self.payments.query(query).await?.into_inner();
        self.expect(
            details.payment.map(|payment| payment.trade_no) == Some(trade_no.clone()),
            "one payment, the original",
        );
        self.expect(details.refunds.len() == 2, "two refunds, none doubled");

        println!("11. Order order-2 for 12.00 expires after one second; the payer pays it too late.");
        let order = proto::CreateOrderRequest {
            merchant_id: self.id("merchant"),
            order_no: self.id("order-2"),
            payee_account_id: shop.clone(),
            amount: "12.00".into(),
            currency: "USD".into(),
            subject: "a second pot".into(),
            expires_at: Some(timestamp_in(Duration::from_secs(1))),
        };
        self.payments.create_order(order).await?;
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        let late = proto::PayRequest {
            order_no: self.id("order-2"),
            amount: "12.00".into(),
            ..self.pay_request("pay-3", &alice)
        };
        let late = self.payments.pay(late).await;
        self.expect(
            matches!(&late, Err(status) if status.code() == Code::FailedPrecondition && reason(status) == "ORDER_EXPIRED"),
            "refused with FAILED_PRECONDITION ORDER_EXPIRED",
        );
        let balance = self.balance(&alice).await?;
        self.expect(balance == "95.00", "no money moved");

        println!("12. The payer withdraws 20.00 (request_id withdraw-1), and the call is retried.");
        let withdraw = proto::WithdrawRequest {
            request_id: self.id("withdraw-1"),
            account_id: alice.clone(),
            amount: "20.00".into(),
            currency: "USD".into(),
        };
        let first = self.accounts.withdraw(withdraw.clone()).await?;
        self.expect(!was_replayed(&first), "the payout runs");
        let retry = self.accounts.withdraw(withdraw).await?;
        self.expect(was_replayed(&retry), "the retry is a replay");
        self.expect(first.into_inner() == retry.into_inner(), "with the original entry");

        println!("13. Order order-3 for 40.00 is authorized (auth-1), then 25.00 of it is captured (capture-1).");
        let order = proto::CreateOrderRequest {
            merchant_id: self.id("merchant"),
            order_no: self.id("order-3"),
            payee_account_id: shop.clone(),
            amount: "40.00".into(),
            currency: "USD".into(),
            subject: "a room, deposit first".into(),
            expires_at: None,
        };
        self.payments.create_order(order).await?;
        let authorize = proto::AuthorizeRequest {
            merchant_id: self.id("merchant"),
            out_auth_no: self.id("auth-1"),
            order_no: self.id("order-3"),
            payer_account_id: alice.clone(),
            amount: "40.00".into(),
            currency: "USD".into(),
        };
        let held = self.payments.authorize(authorize).await?.into_inner();
        self.expect(
            held.order.unwrap_or_default().status() == proto::OrderStatus::Authorized,
            "the order is AUTHORIZED",
        );
        let request = proto::GetAccountRequest { account_id: alice.clone() };
        let account = self.accounts.get_account(request).await?.into_inner().account.unwrap_or_default();
        self.expect(
            account.balance == "75.00" && account.available_balance == "35.00",
            "the payer holds 75.00, of which 35.00 is available",
        );
        let capture = proto::CaptureRequest {
            merchant_id: self.id("merchant"),
            out_auth_no: self.id("auth-1"),
            out_trade_no: self.id("capture-1"),
            amount: "25.00".into(),
            currency: "USD".into(),
        };
        let captured = self.payments.capture(capture).await?.into_inner();
        let order = captured.order.unwrap_or_default();
        self.expect(
            order.status() == proto::OrderStatus::Paid && order.amount == "25.00",
            "the order is PAID for 25.00; the other 15.00 is released",
        );

        println!("14. Order order-4 for 10.00 is authorized (auth-2), then the hold is voided, twice.");
        let order = proto::CreateOrderRequest {
            merchant_id: self.id("merchant"),
            order_no: self.id("order-4"),
            payee_account_id: shop.clone(),
            amount: "10.00".into(),
            currency: "USD".into(),
            subject: "a cancelled booking".into(),
            expires_at: None,
        };
        self.payments.create_order(order).await?;
        let authorize = proto::AuthorizeRequest {
            merchant_id: self.id("merchant"),
            out_auth_no: self.id("auth-2"),
            order_no: self.id("order-4"),
            payer_account_id: alice.clone(),
            amount: "10.00".into(),
            currency: "USD".into(),
        };
        self.payments.authorize(authorize).await?;
        let void = proto::VoidRequest { merchant_id: self.id("merchant"), out_auth_no: self.id("auth-2") };
        let voided = self.payments.void(void.clone()).await?.into_inner();
        let order = voided.order.unwrap_or_default();
        self.expect(
            order.status() == proto::OrderStatus::Closed && order.close_reason() == proto::OrderCloseReason::Voided,
            "the order is CLOSED, its hold VOIDED",
        );
        let again = self.payments.void(void).await?;
        self.expect(was_replayed(&again), "voiding it again is a replay");
        let request = proto::GetAccountRequest { account_id: alice.clone() };
        let account = self.accounts.get_account(request).await?.into_inner().account.unwrap_or_default();
        self.expect(account.available_balance == "50.00", "the payer's 10.00 is available again");

        println!("15. Final balances and the payer's journal.");
        let (alice_balance, shop_balance) = (self.balance(&alice).await?, self.balance(&shop).await?);
        println!("    {alice}: {alice_balance}    {shop}: {shop_balance}");
        self.expect(alice_balance == "50.00" && shop_balance == "30.00", "payer 50.00, merchant 30.00");
        for account_id in [&alice, &shop] {
            let request =
                proto::ListEntriesRequest { account_id: account_id.clone(), page_size: 50, page_token: String::new() };
            let entries = self.accounts.list_entries(request).await?.into_inner().entries;
            if account_id == &alice {
                for entry in entries.iter().rev() {
                    println!(
                        "    {:>10} {:>7}  balance {:>6}  {}",
                        entry.kind().as_str_name().trim_start_matches("ENTRY_KIND_"),
                        entry.amount,
                        entry.balance_after,
                        entry.reference
                    );
                }
            }
            let total: rust_decimal::Decimal =
                entries.iter().filter_map(|entry| entry.amount.parse::<rust_decimal::Decimal>().ok()).sum();
            let balance: rust_decimal::Decimal = self.balance(account_id).await?.parse().unwrap_or_default();
            self.expect(total == balance, &format!("{account_id}: balance equals the sum of its journal entries"));
        }
        Ok(self.passed)
    }
}

/// Now plus `ahead`, as a protobuf Timestamp.
fn timestamp_in(ahead: Duration) -> payledger_client::prost_types::Timestamp {
    let at = std::time::SystemTime::now() + ahead;
    let since_epoch = at.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    payledger_client::prost_types::Timestamp {
        seconds: i64::try_from(since_epoch.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(since_epoch.subsec_nanos()).unwrap_or(0),
    }
}
