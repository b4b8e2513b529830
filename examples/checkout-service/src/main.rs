//! A checkout service's call into payledger, as a calling microservice writes it: one
//! `PayledgerClient` for the process, a deadline for the whole call (retries included), an
//! idempotency key generated once per logical payment and re-sent on every retry, and the
//! `idempotent-replayed` header read from the answer.
//!
//! `checkout-service http://127.0.0.1:50051` opens a shopper and a shop account, funds the
//! shopper, creates an order, pays it, then sends the same payment again as a retry would,
//! and exits non-zero unless the second answer is a replay of the first.

use std::process::ExitCode;
use std::time::Duration;

use payledger_client::proto::{CreateOrderRequest, DepositRequest, OpenAccountRequest, PayRequest, PayResponse};
use payledger_client::tonic::Response;
use payledger_client::{was_replayed, with_idempotency_key, PayledgerClient, RetrySettings};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> ExitCode {
    let target = std::env::args().nth(1).unwrap_or_else(|| "http://127.0.0.1:50051".to_owned());
    match checkout(&target).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("checkout-service: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn checkout(target: &str) -> Result<bool, Error> {
    // Retries: UNAVAILABLE, ABORTED, RESOURCE_EXHAUSTED and a per-attempt DEADLINE_EXCEEDED,
    // at most 5 attempts with full-jitter backoff, all within the 10 s deadline of the call.
    let settings = RetrySettings {
        max_attempts: 5,
        per_attempt_timeout: Duration::from_secs(2),
        overall_deadline: Duration::from_secs(10),
        ..RetrySettings::default()
    };
    let client = PayledgerClient::connect_lazy(target, settings)?;
    let run = uuid::Uuid::new_v4().simple().to_string();
    let (shopper, shop, order_no) = (format!("shopper-{run}"), format!("shop-{run}"), format!("order-{run}"));

    for account_id in [&shopper, &shop] {
        client.open_account(OpenAccountRequest { account_id: account_id.clone(), currency: "USD".into() }).await?;
    }
    let deposit = DepositRequest {
        request_id: format!("topup-{run}"),
        account_id: shopper.clone(),
        amount: "50.00".into(),
        currency: "USD".into(),
    };
    client.deposit(deposit).await?;
    let order = CreateOrderRequest {
        merchant_id: "checkout".into(),
        order_no: order_no.clone(),
        payee_account_id: shop.clone(),
        amount: "19.99".into(),
        currency: "USD".into(),
        subject: "one tea pot".into(),
        // Payable for 15 minutes; after that a Pay gets ORDER_EXPIRED.
        expires_at: Some(in_fifteen_minutes()),
    };
    client.create_order(order).await?;

    // One logical payment: its out_trade_no and its idempotency key are chosen once and sent
    // unchanged on every attempt and every later retry of it.
    let pay = PayRequest {
        merchant_id: "checkout".into(),
        out_trade_no: format!("pay-{run}"),
        order_no,
        payer_account_id: shopper,
        amount: "19.99".into(),
        currency: "USD".into(),
    };
    let idempotency_key = format!("checkout-pay-{run}");
    let first = client.payments().pay(with_idempotency_key(pay.clone(), &idempotency_key)?).await?;
    let retried = client.payments().pay(with_idempotency_key(pay, &idempotency_key)?).await?;

    report("first answer", &first);
    report("same payment again", &retried);
    let same_trade = trade_no(&first) == trade_no(&retried);
    Ok(!was_replayed(&first) && was_replayed(&retried) && same_trade)
}

fn trade_no(response: &Response<PayResponse>) -> String {
    response.get_ref().payment.as_ref().map(|payment| payment.trade_no.clone()).unwrap_or_default()
}

fn report(what: &str, response: &Response<PayResponse>) {
    println!("{what}: trade_no {}, idempotent-replayed: {}", trade_no(response), was_replayed(response));
}

/// Now plus 15 minutes, as a protobuf Timestamp.
fn in_fifteen_minutes() -> payledger_client::prost_types::Timestamp {
    let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    payledger_client::prost_types::Timestamp {
        seconds: i64::try_from(since_epoch.as_secs()).unwrap_or(0) + 15 * 60,
        nanos: 0,
    }
}
