//! The trust boundary, on a server that authenticates callers (`=> authenticated`): every
//! RPC refuses every bad credential and every caller outside its grant, before anything is
//! read or written; callers are kept apart; and every change records who made it.

use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use payledger::auth::dev::SigningKey;
use payledger::proto::{self, query_request::Key};
use tonic::{Code, Request, Status};
use tonic_types::StatusExt;

use crate::helpers::{
    as_caller, assert_status, claims, replayed, test_keys, token, transfer_request, with_authorization, TestApp,
    ADMIN_SUB, ALL_SCOPES,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rpc {
    CreateOrder,
    CloseOrder,
    Pay,
    Refund,
    Query,
    IssueToken,
    Authorize,
    Capture,
    Void,
    OpenAccount,
    Deposit,
    Withdraw,
    GetAccount,
    ListEntries,
    Transfer,
}

impl Rpc {
    const ALL: [Rpc; 15] = [
        Rpc::CreateOrder,
        Rpc::CloseOrder,
        Rpc::Pay,
        Rpc::Refund,
        Rpc::Query,
        Rpc::IssueToken,
        Rpc::Authorize,
        Rpc::Capture,
        Rpc::Void,
        Rpc::OpenAccount,
        Rpc::Deposit,
        Rpc::Withdraw,
        Rpc::GetAccount,
        Rpc::ListEntries,
        Rpc::Transfer,
    ];

    /// The scope docs/security.md says this RPC needs.
    fn scope(self) -> &'static str {
        match self {
            Rpc::CreateOrder
            | Rpc::CloseOrder
            | Rpc::Pay
            | Rpc::Refund
            | Rpc::IssueToken
            | Rpc::Authorize
            | Rpc::Capture
            | Rpc::Void => "payments:write",
            Rpc::Query => "payments:read",
            Rpc::Transfer => "accounts:write",
            Rpc::GetAccount | Rpc::ListEntries => "accounts:read",
            Rpc::OpenAccount | Rpc::Deposit | Rpc::Withdraw => "accounts:admin",
        }
    }

    fn merchant_scoped(self) -> bool {
        matches!(
            self,
            Rpc::CreateOrder
                | Rpc::CloseOrder
                | Rpc::Pay
                | Rpc::Refund
                | Rpc::Query
                | Rpc::IssueToken
                | Rpc::Authorize
                | Rpc::Capture
                | Rpc::Void
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Credential {
    Missing,
    Malformed,
    BadSignature,
    AlgNone,
    HmacWithPublicKey,
    UnknownKid,
    Expired,
    NotYetValid,
    WrongIssuer,
    WrongAudience,
    OtherMerchant,
    MissingScope,
}

impl Credential {
    const ALL: [Credential; 12] = [
        Credential::Missing,
        Credential::Malformed,
        Credential::BadSignature,
        Credential::AlgNone,
        Credential::HmacWithPublicKey,
        Credential::UnknownKid,
        Credential::Expired,
        Credential::NotYetValid,
        Credential::WrongIssuer,
        Credential::WrongAudience,
        Credential::OtherMerchant,
        Credential::MissingScope,
    ];

    fn expected(self) -> (Code, &'static str) {
        match self {
            Credential::Missing => (Code::Unauthenticated, "CREDENTIALS_MISSING"),
            Credential::Expired => (Code::Unauthenticated, "CREDENTIALS_EXPIRED"),
            Credential::OtherMerchant => (Code::PermissionDenied, "MERCHANT_NOT_ALLOWED"),
            Credential::MissingScope => (Code::PermissionDenied, "SCOPE_MISSING"),
            _ => (Code::Unauthenticated, "CREDENTIALS_INVALID"),
        }
    }
}

fn now() -> i64 {
    i64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()).unwrap()
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// A key that is not in the server's JWKS.
fn stranger() -> &'static SigningKey {
    static KEY: std::sync::OnceLock<SigningKey> = std::sync::OnceLock::new();
    KEY.get_or_init(|| SigningKey::generate(jsonwebtoken::Algorithm::EdDSA).unwrap())
}

const MATRIX_CALLER: &str = "matrix-caller";

/// The `authorization` value of `credential` for a call of `rpc` (`None`: no header).
fn authorization(credential: Credential, rpc: Rpc) -> Option<String> {
    let keys = test_keys();
    let valid = claims(MATRIX_CALLER, &["m1"], ALL_SCOPES);
    let with = |changes: &[(&str, serde_json::Value)]| {
        let mut claims = valid.clone();
        for (name, value) in changes {
            claims[*name] = value.clone();
        }
        claims
    };
    let signed = |claims: &serde_json::Value| format!("Bearer {}", keys.eddsa.sign(claims).unwrap());
    Some(match credential {
        Credential::Missing => return None,
        Credential::Malformed => "Bearer not.a.jwt".to_owned(),
        Credential::BadSignature => {
            // Our key's header and claims, with a signature made by another key.
            let ours = keys.eddsa.sign(&valid).unwrap();
            let theirs = stranger().sign(&valid).unwrap();
            let (signed_part, _) = ours.rsplit_once('.').unwrap();
            let (_, signature) = theirs.rsplit_once('.').unwrap();
            format!("Bearer {signed_part}.{signature}")
        }
        Credential::AlgNone => {
            let header = serde_json::json!({"alg": "none", "typ": "JWT", "kid": keys.eddsa.kid()});
            format!("Bearer {}.{}.", b64(header.to_string().as_bytes()), b64(valid.to_string().as_bytes()))
        }
        Credential::HmacWithPublicKey => {
            // The classic confusion: HS256 keyed with the (public) RSA key the server holds.
            let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256);
            header.kid = Some(keys.rs256.kid().to_owned());
            let public = serde_json::to_vec(keys.rs256.public_jwk()).unwrap();
            let secret = jsonwebtoken::EncodingKey::from_secret(&public).unwrap();
            format!("Bearer {}", jsonwebtoken::encode(&header, &valid, &secret).unwrap())
        }
        Credential::UnknownKid => format!("Bearer {}", stranger().sign(&valid).unwrap()),
        Credential::Expired => signed(&with(&[
            ("iat", (now() - 7200).into()),
            ("nbf", (now() - 7200).into()),
            ("exp", (now() - 3600).into()),
        ])),
        Credential::NotYetValid => signed(&with(&[("nbf", (now() + 3600).into()), ("exp", (now() + 7200).into())])),
        Credential::WrongIssuer => signed(&with(&[("iss", "https://issuer.elsewhere.test".into())])),
        Credential::WrongAudience => signed(&with(&[("aud", "another-service".into())])),
        Credential::OtherMerchant => signed(&with(&[("merchants", serde_json::json!(["m2"]))])),
        Credential::MissingScope => {
            let scope: Vec<&str> = ALL_SCOPES.split(' ').filter(|scope| *scope != rpc.scope()).collect();
            signed(&with(&[("scope", scope.join(" ").into())]))
        }
    })
}

/// A request with `authorization` (if any) and the guards a careful caller sends.
fn request<T>(message: T, authorization: Option<&str>, key: Option<&str>, token: Option<&str>) -> Request<T> {
    let mut request = match authorization {
        Some(value) => with_authorization(message, value),
        None => Request::new(message),
    };
    if let Some(key) = key {
        request.metadata_mut().insert("idempotency-key", key.parse().unwrap());
    }
    if let Some(token) = token {
        request.metadata_mut().insert("idempotency-token", token.parse().unwrap());
    }
    request
}

/// Calls `rpc` with a request that would change or read the ledger set up by
/// [`matrix_ledger`] if it were let through.
async fn call(app: &TestApp, rpc: Rpc, authorization: Option<&str>, token: &str) -> Result<(), Status> {
    let (mut payments, mut accounts) = (app.bare_payments.clone(), app.bare_accounts.clone());
    let key = Some("matrix-key");
    match rpc {
        Rpc::CreateOrder => {
            let message = crate::helpers::one_dollar_order("m1", "o-new", "shop");
            payments.create_order(request(message, authorization, key, None)).await.map(drop)
        }
        Rpc::CloseOrder => {
            let message = proto::CloseOrderRequest { merchant_id: "m1".into(), order_no: "o-pending".into() };
            payments.close_order(request(message, authorization, key, None)).await.map(drop)
        }
        Rpc::Pay => {
            let message = app.pay_request("m1", "t-new", "o-pending", "alice", "10.00");
            payments.pay(request(message, authorization, key, Some(token))).await.map(drop)
        }
        Rpc::Refund => {
            let message = app.refund_request("m1", "t-paid", "r-new", "1.00");
            payments.refund(request(message, authorization, key, None)).await.map(drop)
        }
        Rpc::Query => {
            let message = proto::QueryRequest { merchant_id: "m1".into(), key: Some(Key::OutTradeNo("t-paid".into())) };
            payments.query(request(message, authorization, None, None)).await.map(drop)
        }
        Rpc::IssueToken => {
            let message = proto::IssueTokenRequest { merchant_id: "m1".into(), purpose: "checkout".into() };
            payments.issue_token(request(message, authorization, None, None)).await.map(drop)
        }
        Rpc::Authorize => {
            let message = proto::AuthorizeRequest {
                merchant_id: "m1".into(),
                out_auth_no: "a-new".into(),
                order_no: "o-pending".into(),
                payer_account_id: "alice".into(),
                amount: "10.00".into(),
                currency: "USD".into(),
            };
            payments.authorize(request(message, authorization, key, None)).await.map(drop)
        }
        Rpc::Capture => {
            let message = proto::CaptureRequest {
                merchant_id: "m1".into(),
                out_auth_no: "a-held".into(),
                out_trade_no: "t-capture".into(),
                amount: "5.00".into(),
                currency: "USD".into(),
            };
            payments.capture(request(message, authorization, key, None)).await.map(drop)
        }
        Rpc::Void => {
            let message = proto::VoidRequest { merchant_id: "m1".into(), out_auth_no: "a-held".into() };
            payments.void(request(message, authorization, key, None)).await.map(drop)
        }
        Rpc::OpenAccount => {
            let message = proto::OpenAccountRequest { account_id: "carol".into(), currency: "USD".into() };
            accounts.open_account(request(message, authorization, key, None)).await.map(drop)
        }
        Rpc::Deposit => {
            let message = proto::DepositRequest {
                request_id: "d-new".into(),
                account_id: "alice".into(),
                amount: "5.00".into(),
                currency: "USD".into(),
            };
            accounts.deposit(request(message, authorization, key, None)).await.map(drop)
        }
        Rpc::Withdraw => {
            let message = proto::WithdrawRequest {
                request_id: "w-new".into(),
                account_id: "alice".into(),
                amount: "5.00".into(),
                currency: "USD".into(),
            };
            accounts.withdraw(request(message, authorization, key, None)).await.map(drop)
        }
        Rpc::GetAccount => {
            let message = proto::GetAccountRequest { account_id: "alice".into() };
            accounts.get_account(request(message, authorization, None, None)).await.map(drop)
        }
        Rpc::ListEntries => {
            let message =
                proto::ListEntriesRequest { account_id: "alice".into(), page_size: 0, page_token: String::new() };
            accounts.list_entries(request(message, authorization, None, None)).await.map(drop)
        }
        Rpc::Transfer => {
            let message = transfer_request("alice", "bob", "1.00");
            accounts.transfer(request(message, authorization, key, None)).await.map(drop)
        }
    }
}

/// Accounts, a PENDING order and a paid one (through the admin's clients), and a token
/// issued to the admin for m1.
async fn matrix_ledger(app: &TestApp) -> String {
    app.funded("alice", "100.00").await;
    app.open("shop", "USD").await;
    app.open("bob", "USD").await;
    app.create_order("m1", "o-pending", "shop", "10.00").await.unwrap();
    app.create_order("m1", "o-paid", "shop", "10.00").await.unwrap();
    app.pay("m1", "t-paid", "o-paid", "alice", "10.00").await.unwrap();
    app.create_order("m1", "o-held", "shop", "10.00").await.unwrap();
    let authorize = proto::AuthorizeRequest {
        merchant_id: "m1".into(),
        out_auth_no: "a-held".into(),
        order_no: "o-held".into(),
        payer_account_id: "alice".into(),
        amount: "10.00".into(),
        currency: "USD".into(),
    };
    app.payments.clone().authorize(authorize).await.unwrap();
    app.issue_token("m1").await
}

/// Everything a refused call could have changed: row counts, balances, idempotency records
/// and tokens (issued and consumed).
async fn ledger_state(app: &TestApp) -> Vec<String> {
    let mut state: Vec<String> = app.all_rows().await.iter().map(ToString::to_string).collect();
    for table in ["idempotency_record", "idempotency_token", "transfers", "withdrawals", "holds"] {
        state.push(format!("{table}={}", app.rows(table).await));
    }
    let consumed = sqlx::query("SELECT COUNT(*) FROM idempotency_token WHERE consumed_at IS NOT NULL")
        .fetch_one(&app.raw)
        .await
        .unwrap();
    state.push(format!("consumed={}", sqlx::Row::get::<i64, _>(&consumed, 0)));
    for account in ["alice", "shop", "bob"] {
        state.push(format!("{account}={}", app.balance(account).await));
    }
    state
}

pub async fn every_rpc_refuses_every_bad_credential_and_caller_outside_its_grant_leaving_nothing(app: &TestApp) {
    let token_of_admin = matrix_ledger(app).await;
    let before = ledger_state(app).await;

    let mut calls = 0;
    for rpc in Rpc::ALL {
        for credential in Credential::ALL {
            if credential == Credential::OtherMerchant && !rpc.merchant_scoped() {
                continue; // AccountService calls name no merchant.
            }
            let authorization = authorization(credential, rpc);
            let status = call(app, rpc, authorization.as_deref(), &token_of_admin)
                .await
                .expect_err(&format!("{rpc:?} with {credential:?} is refused"));
            let (code, reason) = credential.expected();
            assert_eq!(status.code(), code, "{rpc:?} with {credential:?}: {status:?}");
            assert_status(&status, code, reason);
            if credential == Credential::MissingScope {
                let info = status.get_error_details().error_info().cloned().unwrap();
                assert_eq!(info.metadata.get("scope").map(String::as_str), Some(rpc.scope()), "{rpc:?}");
                assert!(status.message().contains(rpc.scope()), "{rpc:?}: {}", status.message());
            }
            if let Some(value) = &authorization {
                let secret = value.trim_start_matches("Bearer ");
                assert!(!status.message().contains(secret), "{rpc:?} with {credential:?} echoes the credential");
            }
            calls += 1;
        }
    }
    assert_eq!(calls, 15 * 12 - 6);

    assert_eq!(ledger_state(app).await, before, "a refused call changed the ledger");
    // The token presented by every refused Pay was never consumed: its owner can still use it.
    let pay = app.pay_request("m1", "t-new", "o-pending", "alice", "10.00");
    let paid = app.payments.clone().pay(crate::helpers::with_token(pay, &token_of_admin, None)).await.unwrap();
    assert!(!replayed(&paid));
}

pub async fn tokens_of_each_algorithm_verify_and_ambiguous_credentials_are_refused(app: &TestApp) {
    app.funded("alice", "1.00").await;
    let keys = test_keys();
    let reader = claims("reader", &[], "accounts:read");
    for key in [&keys.eddsa, &keys.es256, &keys.rs256] {
        let request = proto::GetAccountRequest { account_id: "alice".into() };
        let answer = app.bare_accounts.clone().get_account(as_caller(request, &key.sign(&reader).unwrap())).await;
        assert_eq!(answer.unwrap().into_inner().account.unwrap().balance, "1.00", "{:?}", key.algorithm());
    }
    // The scheme is case-insensitive (RFC 9110); a second credential is ambiguous.
    let good = token("reader", &[], "accounts:read");
    let request = proto::GetAccountRequest { account_id: "alice".into() };
    assert!(app
        .bare_accounts
        .clone()
        .get_account(with_authorization(request.clone(), &format!("bearer {good}")))
        .await
        .is_ok());
    let mut twice = as_caller(request.clone(), &good);
    twice.metadata_mut().append("authorization", format!("Bearer {good}").parse().unwrap());
    assert_status(
        &app.bare_accounts.clone().get_account(twice).await.unwrap_err(),
        Code::Unauthenticated,
        "CREDENTIALS_INVALID",
    );
    for value in [format!("Basic {good}"), "Bearer".to_owned(), format!("Bearer  {good}"), format!("Bearer {good}x")] {
        let status =
            app.bare_accounts.clone().get_account(with_authorization(request.clone(), &value)).await.unwrap_err();
        assert_status(&status, Code::Unauthenticated, "CREDENTIALS_INVALID");
    }
    // A `sub` outside 1-128 printable ASCII characters is not an identity payledger records.
    for sub in [String::new(), "two words".to_owned(), "x".repeat(129)] {
        let value = keys.eddsa.sign(&claims(&sub, &[], "accounts:read")).unwrap();
        let status = app.bare_accounts.clone().get_account(as_caller(request.clone(), &value)).await.unwrap_err();
        assert_status(&status, Code::Unauthenticated, "CREDENTIALS_INVALID");
    }
    // Health and reflection need no credential.
    let channel =
        tonic::transport::Channel::from_shared(format!("http://{}", app.address)).unwrap().connect().await.unwrap();
    let health = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest { service: String::new() })
        .await
        .unwrap();
    assert_eq!(health.into_inner().status, tonic_health::pb::health_check_response::ServingStatus::Serving as i32);
}

const CALLER_SCOPES: &str = "payments:write payments:read accounts:write accounts:read";

pub async fn callers_reach_only_their_merchants_objects_and_their_own_idempotency_records(app: &TestApp) {
    app.funded("alice", "100.00").await;
    app.open("shop", "USD").await;
    app.open("bob", "USD").await;
    for (merchant, order) in [("m1", "o-1"), ("m1", "o-3"), ("m2", "o-2")] {
        app.create_order(merchant, order, "shop", "10.00").await.unwrap();
    }
    let shop_a = token("shop-a", &["m1"], CALLER_SCOPES);
    let shop_a2 = token("shop-a2", &["m1"], CALLER_SCOPES);
    let shop_b = token("shop-b", &["m2"], CALLER_SCOPES);
    let mut payments = app.bare_payments.clone();

    // shop-a pays m1's order.
    let pay = app.pay_request("m1", "t-1", "o-1", "alice", "10.00");
    let mut request = as_caller(pay.clone(), &shop_a);
    request.metadata_mut().insert("idempotency-key", "k-1".parse().unwrap());
    let paid = payments.pay(request).await.unwrap().into_inner();
    assert_eq!(paid.payment.as_ref().unwrap().created_by, "shop-a");

    // shop-b cannot name m1, and under its own merchant m1's numbers do not exist.
    let query_m1 = proto::QueryRequest { merchant_id: "m1".into(), key: Some(Key::OutTradeNo("t-1".into())) };
    assert_status(
        &payments.query(as_caller(query_m1, &shop_b)).await.unwrap_err(),
        Code::PermissionDenied,
        "MERCHANT_NOT_ALLOWED",
    );
    for key in [Key::OutTradeNo("t-1".into()), Key::OrderNo("o-1".into())] {
        let query = proto::QueryRequest { merchant_id: "m2".into(), key: Some(key) };
        assert_eq!(payments.query(as_caller(query, &shop_b)).await.unwrap_err().code(), Code::NotFound);
    }
    let refund_m2 = app.refund_request("m2", "t-1", "r-b", "10.00");
    assert_status(
        &payments.refund(as_caller(refund_m2, &shop_b)).await.unwrap_err(),
        Code::NotFound,
        "PAYMENT_NOT_FOUND",
    );
    let refund_m1 = app.refund_request("m1", "t-1", "r-b", "10.00");
    assert_status(
        &payments.refund(as_caller(refund_m1, &shop_b)).await.unwrap_err(),
        Code::PermissionDenied,
        "MERCHANT_NOT_ALLOWED",
    );
    let close = proto::CloseOrderRequest { merchant_id: "m2".into(), order_no: "o-1".into() };
    assert_status(
        &payments.close_order(as_caller(close, &shop_b)).await.unwrap_err(),
        Code::NotFound,
        "ORDER_NOT_FOUND",
    );
    let close = proto::CloseOrderRequest { merchant_id: "m1".into(), order_no: "o-3".into() };
    assert_status(
        &payments.close_order(as_caller(close, &shop_b)).await.unwrap_err(),
        Code::PermissionDenied,
        "MERCHANT_NOT_ALLOWED",
    );

    // One idempotency key, two callers: two keys. shop-a2 is neither answered shop-a's stored
    // response nor told the key is taken; each caller's retry replays its own.
    let transfer = |amount: &str, caller: &str| {
        let mut request = as_caller(transfer_request("alice", "bob", amount), caller);
        request.metadata_mut().insert("idempotency-key", "k-transfer".parse().unwrap());
        request
    };
    let mut accounts = app.bare_accounts.clone();
    let first = accounts.transfer(transfer("1.00", &shop_a)).await.unwrap();
    let other_caller = accounts.transfer(transfer("2.00", &shop_a2)).await.unwrap();
    let same_body_other_caller = accounts.transfer(transfer("1.00", &shop_b)).await.unwrap();
    let retry = accounts.transfer(transfer("1.00", &shop_a)).await.unwrap();
    assert!(!replayed(&first) && !replayed(&other_caller) && !replayed(&same_body_other_caller));
    assert!(replayed(&retry));
    let (first, retry) = (first.into_inner(), retry.into_inner());
    assert_eq!(retry, first);
    assert_ne!(other_caller.into_inner().transfer.unwrap().transfer_id, first.transfer.as_ref().unwrap().transfer_id);
    assert_eq!(app.balance("bob").await, "4.00", "three transfers ran: 1.00, 2.00 and 1.00");
    let transfer = first.transfer.unwrap();
    assert_eq!(transfer.created_by, "shop-a");
    assert_eq!(first.from_entry.unwrap().created_by, "shop-a");

    // A one-time token belongs to the caller it was issued to: another caller of the same
    // merchant can neither use it nor be answered its stored response.
    let issue = proto::IssueTokenRequest { merchant_id: "m1".into(), purpose: "checkout".into() };
    let token_a = payments.issue_token(as_caller(issue, &shop_a)).await.unwrap().into_inner().token;
    let pay_3 = app.pay_request("m1", "t-3", "o-3", "alice", "10.00");
    let presented = || crate::helpers::with_token(pay_3.clone(), &token_a, None);
    let by = |mut request: Request<proto::PayRequest>, caller: &str| {
        request.metadata_mut().insert("authorization", format!("Bearer {caller}").parse().unwrap());
        request
    };
    let refused = payments.pay(by(presented(), &shop_a2)).await.unwrap_err();
    assert_status(&refused, Code::FailedPrecondition, "TOKEN_INVALID");
    assert_eq!(app.balance("alice").await, "86.00", "the refused Pay moved nothing");
    let used = payments.pay(by(presented(), &shop_a)).await.unwrap();
    assert!(!replayed(&used));
    let refused_again = payments.pay(by(presented(), &shop_a2)).await.unwrap_err();
    assert_status(&refused_again, Code::FailedPrecondition, "TOKEN_INVALID");
    assert!(replayed(&payments.pay(by(presented(), &shop_a)).await.unwrap()));

    // Who did what: the refund by shop-a2 of shop-a's payment, and every journal entry.
    let refund = app.refund_request("m1", "t-1", "r-1", "4.00");
    let refunded = payments.refund(as_caller(refund, &shop_a2)).await.unwrap().into_inner();
    assert_eq!(refunded.refund.unwrap().created_by, "shop-a2");
    let query = proto::QueryRequest { merchant_id: "m1".into(), key: Some(Key::OrderNo("o-1".into())) };
    let details = payments.query(as_caller(query, &shop_a)).await.unwrap().into_inner();
    assert_eq!(details.payment.unwrap().created_by, "shop-a");
    assert_eq!(details.refunds[0].created_by, "shop-a2");
    let deposit = app.deposit("d-2", "alice", "1.00", "USD").await.unwrap().into_inner();
    assert_eq!(deposit.entry.unwrap().created_by, ADMIN_SUB);
    let list = proto::ListEntriesRequest { account_id: "alice".into(), page_size: 0, page_token: String::new() };
    let entries = app.accounts.clone().list_entries(list).await.unwrap().into_inner().entries;
    let mut creators: Vec<&str> = entries.iter().map(|entry| entry.created_by.as_str()).collect();
    creators.sort_unstable();
    creators.dedup();
    assert_eq!(creators, ["shop-a", "shop-a2", "shop-b", ADMIN_SUB], "payments, refunds, transfers, deposits");
}
