//! HTTP/JSON (src/http.rs, docs/http.md) against the real server, on every backend: the same
//! guarantees as over gRPC, as an HTTP caller sees them (statuses, JSON bodies, headers).

use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode};
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

use crate::helpers::{token, TestApp};

/// An HTTP caller of the app's listener: HTTP/1.1, or HTTP/2 cleartext (prior knowledge).
#[derive(Clone)]
struct Caller {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
    /// Sent as `Authorization` on every call unless the call names its own.
    bearer: Option<String>,
}

#[derive(Debug)]
struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    json: Value,
}

impl Reply {
    fn reason(&self) -> &str {
        self.json["details"]
            .as_array()
            .and_then(|details| details.iter().find(|d| d["@type"] == "type.googleapis.com/google.rpc.ErrorInfo"))
            .and_then(|info| info["reason"].as_str())
            .unwrap_or("")
    }

    fn replayed(&self) -> bool {
        self.headers.get("idempotent-replayed").is_some_and(|value| value == "true")
    }

    /// Asserts a refusal: its HTTP status, the google.rpc.Status code of its body and its
    /// ErrorInfo reason (domain payledger).
    #[track_caller]
    fn assert_refused(&self, status: u16, code: i64, reason: &str) {
        assert_eq!(self.status.as_u16(), status, "{self:?}");
        assert_eq!(self.json["code"].as_i64(), Some(code), "{self:?}");
        assert_eq!(self.reason(), reason, "{self:?}");
        assert!(self.json["message"].as_str().is_some_and(|m| !m.is_empty()), "{self:?}");
        assert_eq!(self.headers.get("content-type").unwrap(), "application/json");
    }
}

impl Caller {
    fn new(app: &TestApp, http2: bool) -> Self {
        // No idle HTTP/1.1 connection is kept: the server may close one after answering a
        // refused request before reading its body (413), and a request sent on it would fail.
        let client = Client::builder(TokioExecutor::new())
            .http2_only(http2)
            .pool_max_idle_per_host(if http2 { usize::MAX } else { 0 })
            .build_http();
        let bearer = app.admin_token.as_ref().map(|token| format!("Bearer {token}"));
        Self { client, base: format!("http://{}", app.address), bearer }
    }

    fn as_bearer(&self, token: &str) -> Self {
        Self { bearer: Some(format!("Bearer {token}")), ..self.clone() }
    }

    async fn send(&self, method: Method, path: &str, headers: &[(&str, &str)], body: Option<Value>) -> Reply {
        let body = body.map(|body| body.to_string());
        self.raw(method, path, headers, body.map(Bytes::from)).await
    }

    async fn raw(&self, method: Method, path: &str, headers: &[(&str, &str)], body: Option<Bytes>) -> Reply {
        let mut request = http::Request::builder().method(method).uri(format!("{}{path}", self.base));
        if body.is_some() {
            request = request.header("content-type", "application/json");
        }
        if let Some(bearer) = &self.bearer {
            if !headers.iter().any(|(name, _)| name.eq_ignore_ascii_case("authorization")) {
                request = request.header("authorization", bearer);
            }
        }
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request.body(Full::new(body.unwrap_or_default())).unwrap();
        let response = self.client.request(request).await.expect("the server answers");
        let (parts, body) = response.into_parts();
        let bytes = body.collect().await.expect("the body arrives").to_bytes();
        let json = serde_json::from_slice(&bytes).unwrap_or_else(|_| panic!("a JSON body: {bytes:?}"));
        Reply { status: parts.status, headers: parts.headers, json }
    }

    async fn post(&self, path: &str, headers: &[(&str, &str)], body: Value) -> Reply {
        self.send(Method::POST, path, headers, Some(body)).await
    }

    async fn get(&self, path: &str) -> Reply {
        self.send(Method::GET, path, &[], None).await
    }

    /// Opens the accounts and creates the order `o-1` of merchant `m1` (25.00 USD to `shop`),
    /// with `alice` funded with 100.00, all over HTTP.
    async fn set_up_an_order(&self) {
        for account in ["alice", "shop"] {
            let opened = self.post("/v1/accounts", &[], json!({"account_id": account, "currency": "USD"})).await;
            assert_eq!(opened.status, StatusCode::OK, "{opened:?}");
        }
        let deposit = json!({"request_id": "dep-1", "amount": "100.00", "currency": "USD"});
        let deposited = self.post("/v1/accounts/alice:deposit", &[], deposit).await;
        assert_eq!(deposited.json["account"]["balance"], "100.00", "{deposited:?}");
        let order = json!({"order_no": "o-1", "payee_account_id": "shop", "amount": "25.00", "currency": "USD"});
        let created = self.post("/v1/merchants/m1/orders", &[], order).await;
        assert_eq!(created.json["order"]["status"], "ORDER_STATUS_PENDING", "{created:?}");
    }
}

fn pay_body(out_trade_no: &str, amount: &str) -> Value {
    json!({"out_trade_no": out_trade_no, "payer_account_id": "alice", "amount": amount, "currency": "USD"})
}

const PAY_PATH: &str = "/v1/merchants/m1/orders/o-1:pay";

pub async fn http_json_pays_once_and_replays_by_key_and_by_natural_key(app: &TestApp) {
    let http = Caller::new(app, false);
    http.set_up_an_order().await;
    let key = [("idempotency-key", "pay-o-1")];
    let paid = http.post(PAY_PATH, &key, pay_body("t-1", "25.00")).await;
    assert_eq!(paid.status, StatusCode::OK, "{paid:?}");
    assert!(!paid.replayed());
    assert!(paid.headers.get("idempotency-expires-at").is_some());
    assert_eq!(paid.json["order"]["status"], "ORDER_STATUS_PAID");
    let trade_no = paid.json["payment"]["trade_no"].as_str().unwrap().to_owned();

    // The same key and payload (camelCase names this time, the same message): the original.
    let by_key = http
        .post(
            PAY_PATH,
            &key,
            json!({"outTradeNo": "t-1", "payerAccountId": "alice", "amount": "25.00", "currency": "USD"}),
        )
        .await;
    assert_eq!(by_key.status, StatusCode::OK, "{by_key:?}");
    assert!(by_key.replayed());
    assert_eq!(by_key.json["payment"]["trade_no"], trade_no.as_str());
    // No key: the natural key (merchant_id, out_trade_no) replays it.
    let by_out_trade_no = http.post(PAY_PATH, &[], pay_body("t-1", "25.00")).await;
    assert!(by_out_trade_no.replayed(), "{by_out_trade_no:?}");
    assert_eq!(by_out_trade_no.json["payment"]["trade_no"], trade_no.as_str());
    // The same key with another payload: 422 (Idempotency-Key draft), nothing moved.
    let other = http.post(PAY_PATH, &key, pay_body("t-1", "24.00")).await;
    other.assert_refused(422, 6, "IDEMPOTENCY_KEY_REUSED");
    // The same out_trade_no with other terms: ALREADY_EXISTS, 409.
    let reused = http.post(PAY_PATH, &[], pay_body("t-1", "24.00")).await;
    reused.assert_refused(409, 6, "OUT_TRADE_NO_REUSED");

    let alice = http.get("/v1/accounts/alice").await;
    assert_eq!(alice.json["account"]["balance"], "75.00", "{alice:?}");
    let refunded = http
        .post(
            "/v1/merchants/m1/payments/t-1:refund",
            &[],
            json!({"out_refund_no": "r-1", "amount": "5.00", "currency": "USD"}),
        )
        .await;
    assert_eq!(refunded.json["order"]["status"], "ORDER_STATUS_PARTIALLY_REFUNDED", "{refunded:?}");
    for path in ["/v1/merchants/m1/orders/o-1", "/v1/merchants/m1/payments/t-1", "/v1/merchants/m1/refunds/r-1"] {
        let queried = http.get(path).await;
        assert_eq!(queried.json["payment"]["trade_no"], trade_no.as_str(), "{path}: {queried:?}");
        assert_eq!(queried.json["refunds"][0]["out_refund_no"], "r-1", "{path}: {queried:?}");
    }
    let entries = http.get("/v1/accounts/alice/entries?page_size=1").await;
    assert_eq!(entries.json["entries"].as_array().map(Vec::len), Some(1), "{entries:?}");
    assert_eq!(entries.json["entries"][0]["kind"], "ENTRY_KIND_REFUND");
    assert!(entries.json["next_page_token"].as_str().is_some_and(|token| !token.is_empty()));
}

pub async fn concurrent_http_duplicates_of_a_keyed_pay_move_the_money_once(app: &TestApp) {
    let http1 = Caller::new(app, false);
    let http2 = Caller::new(app, true);
    http1.set_up_an_order().await;
    let calls = (0..20).map(|i| {
        let caller = if i % 2 == 0 { http1.clone() } else { http2.clone() };
        async move { caller.post(PAY_PATH, &[("idempotency-key", "dup-1")], pay_body("t-dup", "25.00")).await }
    });
    let replies = futures::future::join_all(calls).await;
    let trade_nos: std::collections::HashSet<_> =
        replies.iter().map(|reply| reply.json["payment"]["trade_no"].as_str().map(str::to_owned)).collect();
    assert!(replies.iter().all(|reply| reply.status == StatusCode::OK), "{replies:?}");
    assert_eq!(trade_nos.len(), 1, "one payment: {trade_nos:?}");
    assert_eq!(replies.iter().filter(|reply| !reply.replayed()).count(), 1, "one original, the rest replays");
    assert_eq!(app.balance("alice").await, "75.00");
    assert_eq!(app.rows("payment_flow").await, 1);
}

pub async fn http_refusals_carry_their_status_and_a_google_rpc_status_body_and_leave_nothing(app: &TestApp) {
    let http = Caller::new(app, false);
    http.set_up_an_order().await;
    let before = app.all_rows().await;

    let missing = http.post("/v1/merchants/m1/orders/nope:pay", &[], pay_body("t-x", "25.00")).await;
    missing.assert_refused(404, 5, "ORDER_NOT_FOUND");
    let bad = http.post(PAY_PATH, &[], pay_body("t-x", "25.001")).await;
    bad.assert_refused(400, 3, "INVALID_ARGUMENT");
    let violations = bad.json["details"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["@type"] == "type.googleapis.com/google.rpc.BadRequest");
    assert_eq!(violations.unwrap()["field_violations"][0]["field"], "amount", "{bad:?}");
    let poor = http
        .post(
            PAY_PATH,
            &[],
            json!({"out_trade_no": "t-x", "payer_account_id": "shop", "amount": "25.00", "currency": "USD"}),
        )
        .await;
    poor.assert_refused(400, 9, "PAYER_IS_PAYEE");
    let keyless = http
        .post(
            "/v1/transfers",
            &[],
            json!({"from_account_id": "alice", "to_account_id": "shop", "amount": "1.00", "currency": "USD"}),
        )
        .await;
    keyless.assert_refused(400, 3, "INVALID_ARGUMENT");

    // The transport's own refusals.
    let malformed = http.raw(Method::POST, PAY_PATH, &[], Some(Bytes::from_static(b"{\"out_trade_no\":"))).await;
    malformed.assert_refused(400, 3, "MALFORMED_REQUEST");
    // No body is an empty message; whitespace alone is not a JSON text.
    let blank = http.raw(Method::POST, "/v1/merchants/m1/tokens", &[], Some(Bytes::from_static(b"\n"))).await;
    blank.assert_refused(400, 3, "MALFORMED_REQUEST");
    let unknown = http.post(PAY_PATH, &[], json!({"out_trade_no": "t-x", "bogus": 1})).await;
    unknown.assert_refused(400, 3, "MALFORMED_REQUEST");
    let wrong_type = http.post(PAY_PATH, &[], json!({"out_trade_no": 7})).await;
    wrong_type.assert_refused(400, 3, "MALFORMED_REQUEST");
    let big = json!({"out_trade_no": "t-x", "payer_account_id": "x".repeat(70_000)});
    let oversize = http.post(PAY_PATH, &[], big).await;
    oversize.assert_refused(413, 11, "REQUEST_TOO_LARGE");
    let text = http.raw(Method::POST, PAY_PATH, &[("content-type", "text/plain")], None).await;
    text.assert_refused(415, 3, "UNSUPPORTED_MEDIA_TYPE");
    let gzipped = http.post(PAY_PATH, &[("content-encoding", "gzip")], pay_body("t-x", "25.00")).await;
    gzipped.assert_refused(415, 3, "UNSUPPORTED_MEDIA_TYPE");
    let conflict = http.post(PAY_PATH, &[], json!({"order_no": "o-2"})).await;
    conflict.assert_refused(400, 3, "INVALID_ARGUMENT");
    let body_on_get = http.raw(Method::GET, "/v1/accounts/alice", &[], Some(Bytes::from_static(b"{}"))).await;
    body_on_get.assert_refused(400, 3, "MALFORMED_REQUEST");
    let bad_query = http.get("/v1/accounts/alice/entries?page_size=many").await;
    bad_query.assert_refused(400, 3, "INVALID_ARGUMENT");
    let unknown_query = http.get("/v1/accounts/alice?admin=1").await;
    unknown_query.assert_refused(400, 3, "INVALID_ARGUMENT");
    let no_route = http.get("/v1/nothing/here").await;
    no_route.assert_refused(404, 5, "ROUTE_NOT_FOUND");
    let wrong_method = http.send(Method::DELETE, "/v1/accounts", &[], None).await;
    wrong_method.assert_refused(405, 12, "METHOD_NOT_ALLOWED");
    assert_eq!(wrong_method.headers.get("allow").unwrap(), "POST");
    let grpc_path_over_http1 = http.get("/payledger.v1.PaymentService/Pay").await;
    grpc_path_over_http1.assert_refused(404, 5, "ROUTE_NOT_FOUND");
    let twice =
        http.post(PAY_PATH, &[("idempotency-key", "a"), ("idempotency-key", "b")], pay_body("t-x", "25.00")).await;
    twice.assert_refused(400, 3, "INVALID_ARGUMENT");
    let unprintable = http.post(PAY_PATH, &[("idempotency-key", "a\tb")], pay_body("t-x", "25.00")).await;
    unprintable.assert_refused(400, 3, "INVALID_ARGUMENT");
    // A member named twice, in one spelling or in both: parsers disagree on which counts.
    let twice_named =
        br#"{"out_trade_no":"t-x","payer_account_id":"alice","amount":"1.00","amount":"25.00","currency":"USD"}"#;
    let doubled = http.raw(Method::POST, PAY_PATH, &[], Some(Bytes::from_static(twice_named))).await;
    doubled.assert_refused(400, 3, "MALFORMED_REQUEST");
    let aliased = http
        .post(PAY_PATH, &[], json!({"out_trade_no": "t-x", "outTradeNo": "t-y", "payer_account_id": "alice"}))
        .await;
    aliased.assert_refused(400, 3, "MALFORMED_REQUEST");
    // A path field the body names as "" (proto3's default) is another value, not the path's.
    let emptied = http.post(PAY_PATH, &[], json!({"order_no": "", "out_trade_no": "t-x", "payer_account_id": "alice", "amount": "25.00", "currency": "USD"})).await;
    emptied.assert_refused(400, 3, "INVALID_ARGUMENT");
    // Request trailers, even repeating a header's value, and a declared oversize body.
    let keyed_trailer =
        "POST /v1/transfers HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n\
        Idempotency-Key: tr-1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nIdempotency-Key: tr-1\r\n\r\n";
    let answer = raw_http1(app.address, keyed_trailer).await;
    assert!(answer.starts_with("HTTP/1.1 400") && answer.contains("\"MALFORMED_REQUEST\""), "{answer}");
    let declared = "POST /v1/transfers HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 10000000000\r\n\r\n{}";
    let answer = raw_http1(app.address, declared).await;
    assert!(answer.starts_with("HTTP/1.1 413") && answer.contains("\"REQUEST_TOO_LARGE\""), "{answer}");

    assert_eq!(app.all_rows().await, before, "nothing written by a refused call");
}

/// Sends `request` as written on a connection of its own and reads the answer's first bytes.
async fn raw_http1(address: std::net::SocketAddr, request: &str) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(address).await.expect("the server accepts");
    stream.write_all(request.as_bytes()).await.expect("the request is sent");
    let mut answer = vec![0; 4096];
    let read = tokio::time::timeout(std::time::Duration::from_secs(30), stream.read(&mut answer))
        .await
        .expect("an answer without waiting for the body")
        .expect("the answer is read");
    String::from_utf8_lossy(&answer[..read]).into_owned()
}

pub async fn the_served_openapi_document_is_the_one_generated_from_the_proto(app: &TestApp) {
    let http = Caller::new(app, true);
    let served = http.get("/v1/openapi.json").await;
    assert_eq!(served.status, StatusCode::OK);
    let generated = payledger::http::openapi_document(payledger::proto::FILE_DESCRIPTOR_SET).unwrap();
    assert_eq!(served.json, serde_json::from_str::<Value>(&generated).unwrap());
    assert!(served.json["paths"]["/v1/merchants/{merchant_id}/orders/{order_no}:pay"]["post"].is_object());
}

pub async fn http_callers_need_a_valid_bearer_token_and_reach_only_their_merchants(app: &TestApp) {
    let admin = Caller::new(app, false);
    admin.set_up_an_order().await;
    let before = app.all_rows().await;
    let anonymous = Caller { bearer: None, ..admin.clone() };
    let missing = anonymous.post(PAY_PATH, &[], pay_body("t-1", "25.00")).await;
    missing.assert_refused(401, 16, "CREDENTIALS_MISSING");
    assert_eq!(missing.headers.get("www-authenticate").unwrap(), "Bearer");
    let invalid = admin.post(PAY_PATH, &[("authorization", "Bearer not-a-jwt")], pay_body("t-1", "25.00")).await;
    invalid.assert_refused(401, 16, "CREDENTIALS_INVALID");
    let scopes = "payments:write payments:read accounts:write accounts:read";
    let other_merchant = admin.as_bearer(&token("shop-b", &["m2"], scopes));
    let foreign = other_merchant.post(PAY_PATH, &[], pay_body("t-1", "25.00")).await;
    foreign.assert_refused(403, 7, "MERCHANT_NOT_ALLOWED");
    let foreign_query = other_merchant.get("/v1/merchants/m1/orders/o-1").await;
    foreign_query.assert_refused(403, 7, "MERCHANT_NOT_ALLOWED");
    assert_eq!(app.all_rows().await, before, "nothing written by a refused call");

    let own = admin.as_bearer(&token("shop-a", &["m1"], scopes));
    let paid = own.post(PAY_PATH, &[], pay_body("t-1", "25.00")).await;
    assert_eq!(paid.status, StatusCode::OK, "{paid:?}");
    assert_eq!(paid.json["payment"]["created_by"], "shop-a");
}
