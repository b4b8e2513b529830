//! A checkout service's call into payledger, as a calling microservice writes it: one
//! `PayledgerClient` for the process, a deadline for the whole call (retries included), an
//! idempotency key generated once per logical payment and re-sent on every retry, and the
//! `idempotent-replayed` header read from the answer.
//!
//! `checkout-service http://127.0.0.1:50051` opens a shopper and a shop account, funds the
//! shopper, creates an order, pays it, then sends the same payment again as a retry would,
//! and exits non-zero unless the second answer is a replay of the first. Against a server with
//! authentication and TLS: `checkout-service https://payledger.internal:50051 --token "$JWT"
//! --tls-ca ca.pem` (and `--tls-cert`, `--tls-key` where it requires client certificates);
//! the token needs merchant `checkout` and the scopes `payments:write accounts:admin` (it opens
//! and funds its own accounts).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use payledger_client::proto::{CreateOrderRequest, DepositRequest, OpenAccountRequest, PayRequest, PayResponse};
use payledger_client::tonic::Response;
use payledger_client::{
    was_replayed, with_idempotency_key, BearerToken, ClientSettings, ClientTls, PayledgerClient, RetrySettings,
};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Pays one order through payledger, then retries the payment and checks the retry is a replay.
#[derive(Parser)]
struct Args {
    /// payledger's address: `http://host:port`, or `https://host:port` for TLS.
    #[arg(default_value = "http://127.0.0.1:50051")]
    target: String,
    /// The caller's JWT, sent as `authorization: Bearer` (never printed).
    #[arg(long, env = "PAYLEDGER_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// PEM file of the CA that signed the server's certificate (default: the public roots).
    #[arg(long, env = "PAYLEDGER_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// PEM files of this caller's certificate and key, for a server requiring mutual TLS.
    #[arg(long, env = "PAYLEDGER_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    #[arg(long, env = "PAYLEDGER_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match checkout(&args).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("checkout-service: {error}");
            ExitCode::FAILURE
        }
    }
}

/// The client's settings from the arguments: retries, TLS for an `https://` target, the token.
fn client_settings(args: &Args) -> Result<ClientSettings, Error> {
    // Retries: UNAVAILABLE, ABORTED, RESOURCE_EXHAUSTED and a per-attempt DEADLINE_EXCEEDED,
    // at most 5 attempts with full-jitter backoff, all within the 10 s deadline of the call.
    let retry = RetrySettings {
        max_attempts: 5,
        per_attempt_timeout: Duration::from_secs(2),
        overall_deadline: Duration::from_secs(10),
        ..RetrySettings::default()
    };
    let identity = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some((std::fs::read(cert)?, std::fs::read(key)?)),
        _ => None,
    };
    let ca_certificate_pem = args.tls_ca.as_ref().map(std::fs::read).transpose()?;
    let tls = (ca_certificate_pem.is_some() || identity.is_some()).then(|| ClientTls {
        ca_certificate_pem,
        identity_pem: identity,
        ..ClientTls::default()
    });
    let bearer_token = args.token.as_deref().map(BearerToken::new).transpose()?;
    Ok(ClientSettings { retry, tls, bearer_token, ..ClientSettings::default() })
}

async fn checkout(args: &Args) -> Result<bool, Error> {
    let client = PayledgerClient::connect(&args.target, client_settings(args)?)?;
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
