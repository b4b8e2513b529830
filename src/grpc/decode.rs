//! Wire requests to commands. Every conversion destructures the whole message, so a field
//! added to the .proto fails the build until it is handled here. All bad fields of a
//! request are reported together.

use crate::domain::{
    AccountId, Actor, Amount, Currency, FieldViolation, FreeText, IdempotencyKey, MerchantId, OneTimeToken, OrderNo,
    OutAuthNo, OutRefundNo, OutTradeNo, RequestId,
};
use crate::error::Error;
use crate::ledger::{
    Authorize, CallerPresence, Capture, CreateOrder, Deposit, Guards, ListEntries, OpenAccount, Pay, QueryKey, Refund,
    Transfer, Void, Withdraw, IDEMPOTENCY_KEY_HEADER, IDEMPOTENCY_TOKEN_HEADER,
};
use crate::proto;

use super::GuardHeaders;

/// Collects the violations of one request.
#[derive(Default)]
struct Violations(Vec<FieldViolation>);

impl Violations {
    fn check<T>(&mut self, parsed: Result<T, FieldViolation>) -> Option<T> {
        parsed.map_err(|violation| self.0.push(violation)).ok()
    }

    /// Parses an amount against a currency that may itself have failed to parse.
    fn amount(&mut self, raw: &str, currency: Option<Currency>) -> Option<Amount> {
        match currency {
            Some(currency) => self.check(Amount::parse("amount", raw, currency)),
            // The currency is bad too: still say what is wrong with the amount's text.
            None => {
                self.check(Amount::check_text("amount", raw));
                None
            }
        }
    }

    fn into_error(self) -> Error {
        debug_assert!(!self.0.is_empty(), "a request failed to parse with no violation");
        Error::InvalidArgument(self.0)
    }
}

pub(super) fn open_account(request: proto::OpenAccountRequest) -> Result<OpenAccount, Error> {
    let proto::OpenAccountRequest { account_id, currency } = request;
    let mut v = Violations::default();
    let account_id = v.check(AccountId::parse("account_id", &account_id));
    let currency = v.check(Currency::parse("currency", &currency));
    match (account_id, currency) {
        (Some(account_id), Some(currency)) => Ok(OpenAccount { account_id, currency }),
        _ => Err(v.into_error()),
    }
}

pub(super) fn deposit(request: proto::DepositRequest, actor: &Actor) -> Result<Deposit, Error> {
    let proto::DepositRequest { request_id, account_id, amount, currency } = request;
    let (request_id, account_id, amount) = funding(&request_id, &account_id, &amount, &currency)?;
    Ok(Deposit { request_id, account_id, amount, created_by: actor.clone() })
}

pub(super) fn withdraw(request: proto::WithdrawRequest, actor: &Actor) -> Result<Withdraw, Error> {
    let proto::WithdrawRequest { request_id, account_id, amount, currency } = request;
    let (request_id, account_id, amount) = funding(&request_id, &account_id, &amount, &currency)?;
    Ok(Withdraw { request_id, account_id, amount, created_by: actor.clone() })
}

/// The fields Deposit and Withdraw share.
fn funding(
    request_id: &str,
    account_id: &str,
    amount: &str,
    currency: &str,
) -> Result<(RequestId, AccountId, Amount), Error> {
    let mut v = Violations::default();
    let request_id = v.check(RequestId::parse("request_id", request_id));
    let account_id = v.check(AccountId::parse("account_id", account_id));
    let currency = v.check(Currency::parse("currency", currency));
    let amount = v.amount(amount, currency);
    match (request_id, account_id, amount) {
        (Some(request_id), Some(account_id), Some(amount)) => Ok((request_id, account_id, amount)),
        _ => Err(v.into_error()),
    }
}

/// The first and last second a `google.protobuf.Timestamp` may hold (0001-01-01T00:00:00Z and
/// 9999-12-31T23:59:59Z, as its definition in timestamp.proto says).
const TIMESTAMP_SECONDS: std::ops::RangeInclusive<i64> = -62_135_596_800..=253_402_300_799;

/// A Timestamp as microseconds since the Unix epoch (nanoseconds below a microsecond are
/// dropped), or the violation of `field` when it is outside what a Timestamp may hold.
fn timestamp_micros(field: &'static str, timestamp: &prost_types::Timestamp) -> Result<i64, FieldViolation> {
    if !TIMESTAMP_SECONDS.contains(&timestamp.seconds) || !(0..1_000_000_000).contains(&timestamp.nanos) {
        return Err(FieldViolation::new(
            field,
            "is not a valid Timestamp (seconds from 0001-01-01 to 9999-12-31, nanos 0 to 999,999,999)",
        ));
    }
    Ok(timestamp.seconds * 1_000_000 + i64::from(timestamp.nanos / 1_000))
}

pub(super) fn account_id(request: proto::GetAccountRequest) -> Result<AccountId, Error> {
    let proto::GetAccountRequest { account_id } = request;
    Ok(AccountId::parse("account_id", &account_id)?)
}

pub(super) fn list_entries(request: proto::ListEntriesRequest) -> Result<ListEntries, Error> {
    let proto::ListEntriesRequest { account_id, page_size, page_token } = request;
    let mut v = Violations::default();
    let account_id = v.check(AccountId::parse("account_id", &account_id));
    // AIP-158: zero means the default, a size above the maximum is clamped to it.
    let page_size = match page_size {
        0 => Some(ListEntries::PAGE_SIZE_DEFAULT),
        size if size < 0 => v.check(Err(FieldViolation::new("page_size", "must not be negative"))),
        size => Some(u32::try_from(size).unwrap_or(u32::MAX).min(ListEntries::PAGE_SIZE_MAX)),
    };
    let before_entry_id = if page_token.is_empty() {
        Some(None)
    } else {
        // Only the canonical text of a positive entry id, as next_page_token gives it: "01"
        // and "1" would otherwise be two texts for one page.
        let canonical =
            page_token.len() <= 19 && page_token.bytes().all(|b| b.is_ascii_digit()) && !page_token.starts_with('0');
        let token = canonical.then(|| page_token.parse::<i64>().ok()).flatten().filter(|id| *id > 0).map(Some);
        v.check(token.ok_or_else(|| FieldViolation::new("page_token", "is not a next_page_token of this API")))
    };
    match (account_id, page_size, before_entry_id) {
        (Some(account_id), Some(page_size), Some(before_entry_id)) => {
            Ok(ListEntries { account_id, page_size, before_entry_id })
        }
        _ => Err(v.into_error()),
    }
}

pub(super) fn create_order(request: proto::CreateOrderRequest) -> Result<CreateOrder, Error> {
    let proto::CreateOrderRequest { merchant_id, order_no, payee_account_id, amount, currency, subject, expires_at } =
        request;
    let mut v = Violations::default();
    let merchant_id = v.check(MerchantId::parse("merchant_id", &merchant_id));
    let order_no = v.check(OrderNo::parse("order_no", &order_no));
    let payee_account_id = v.check(AccountId::parse("payee_account_id", &payee_account_id));
    let currency = v.check(Currency::parse("currency", &currency));
    let amount = v.amount(&amount, currency);
    let subject = v.check(FreeText::parse("subject", &subject));
    let expires_at = match &expires_at {
        Some(timestamp) => v.check(timestamp_micros("expires_at", timestamp)).map(Some),
        None => Some(None),
    };
    match (merchant_id, order_no, payee_account_id, amount, subject, expires_at) {
        (Some(merchant_id), Some(order_no), Some(payee_account_id), Some(amount), Some(subject), Some(expires_at)) => {
            Ok(CreateOrder { merchant_id, order_no, payee_account_id, amount, subject, expires_at })
        }
        _ => Err(v.into_error()),
    }
}

pub(super) fn close_order(request: proto::CloseOrderRequest) -> Result<(MerchantId, OrderNo), Error> {
    let proto::CloseOrderRequest { merchant_id, order_no } = request;
    let mut v = Violations::default();
    let merchant_id = v.check(MerchantId::parse("merchant_id", &merchant_id));
    let order_no = v.check(OrderNo::parse("order_no", &order_no));
    match (merchant_id, order_no) {
        (Some(merchant_id), Some(order_no)) => Ok((merchant_id, order_no)),
        _ => Err(v.into_error()),
    }
}

pub(super) fn pay(request: proto::PayRequest, actor: &Actor) -> Result<Pay, Error> {
    let proto::PayRequest { merchant_id, out_trade_no, order_no, payer_account_id, amount, currency } = request;
    let mut v = Violations::default();
    let merchant_id = v.check(MerchantId::parse("merchant_id", &merchant_id));
    let out_trade_no = v.check(OutTradeNo::parse("out_trade_no", &out_trade_no));
    let order_no = v.check(OrderNo::parse("order_no", &order_no));
    let payer_account_id = v.check(AccountId::parse("payer_account_id", &payer_account_id));
    let currency = v.check(Currency::parse("currency", &currency));
    let amount = v.amount(&amount, currency);
    match (merchant_id, out_trade_no, order_no, payer_account_id, amount) {
        (Some(merchant_id), Some(out_trade_no), Some(order_no), Some(payer_account_id), Some(amount)) => {
            Ok(Pay { merchant_id, out_trade_no, order_no, payer_account_id, amount, created_by: actor.clone() })
        }
        _ => Err(v.into_error()),
    }
}

pub(super) fn refund(request: proto::RefundRequest, actor: &Actor) -> Result<Refund, Error> {
    let proto::RefundRequest { merchant_id, out_trade_no, out_refund_no, amount, currency, reason } = request;
    let mut v = Violations::default();
    let merchant_id = v.check(MerchantId::parse("merchant_id", &merchant_id));
    let out_trade_no = v.check(OutTradeNo::parse("out_trade_no", &out_trade_no));
    let out_refund_no = v.check(OutRefundNo::parse("out_refund_no", &out_refund_no));
    let currency = v.check(Currency::parse("currency", &currency));
    let amount = v.amount(&amount, currency);
    let reason = v.check(FreeText::parse("reason", &reason));
    match (merchant_id, out_trade_no, out_refund_no, amount, reason) {
        (Some(merchant_id), Some(out_trade_no), Some(out_refund_no), Some(amount), Some(reason)) => {
            Ok(Refund { merchant_id, out_trade_no, out_refund_no, amount, reason, created_by: actor.clone() })
        }
        _ => Err(v.into_error()),
    }
}

pub(super) fn authorize(request: proto::AuthorizeRequest, actor: &Actor) -> Result<Authorize, Error> {
    let proto::AuthorizeRequest { merchant_id, out_auth_no, order_no, payer_account_id, amount, currency } = request;
    let mut v = Violations::default();
    let merchant_id = v.check(MerchantId::parse("merchant_id", &merchant_id));
    let out_auth_no = v.check(OutAuthNo::parse("out_auth_no", &out_auth_no));
    let order_no = v.check(OrderNo::parse("order_no", &order_no));
    let payer_account_id = v.check(AccountId::parse("payer_account_id", &payer_account_id));
    let currency = v.check(Currency::parse("currency", &currency));
    let amount = v.amount(&amount, currency);
    match (merchant_id, out_auth_no, order_no, payer_account_id, amount) {
        (Some(merchant_id), Some(out_auth_no), Some(order_no), Some(payer_account_id), Some(amount)) => {
            Ok(Authorize { merchant_id, out_auth_no, order_no, payer_account_id, amount, created_by: actor.clone() })
        }
        _ => Err(v.into_error()),
    }
}

pub(super) fn capture(request: proto::CaptureRequest, actor: &Actor) -> Result<Capture, Error> {
    let proto::CaptureRequest { merchant_id, out_auth_no, out_trade_no, amount, currency } = request;
    let mut v = Violations::default();
    let merchant_id = v.check(MerchantId::parse("merchant_id", &merchant_id));
    let out_auth_no = v.check(OutAuthNo::parse("out_auth_no", &out_auth_no));
    let out_trade_no = v.check(OutTradeNo::parse("out_trade_no", &out_trade_no));
    let currency = v.check(Currency::parse("currency", &currency));
    let amount = v.amount(&amount, currency);
    match (merchant_id, out_auth_no, out_trade_no, amount) {
        (Some(merchant_id), Some(out_auth_no), Some(out_trade_no), Some(amount)) => {
            Ok(Capture { merchant_id, out_auth_no, out_trade_no, amount, created_by: actor.clone() })
        }
        _ => Err(v.into_error()),
    }
}

pub(super) fn void(request: proto::VoidRequest) -> Result<Void, Error> {
    let proto::VoidRequest { merchant_id, out_auth_no } = request;
    let mut v = Violations::default();
    let merchant_id = v.check(MerchantId::parse("merchant_id", &merchant_id));
    let out_auth_no = v.check(OutAuthNo::parse("out_auth_no", &out_auth_no));
    match (merchant_id, out_auth_no) {
        (Some(merchant_id), Some(out_auth_no)) => Ok(Void { merchant_id, out_auth_no }),
        _ => Err(v.into_error()),
    }
}

pub(super) fn query(request: proto::QueryRequest) -> Result<(MerchantId, QueryKey), Error> {
    use proto::query_request::Key;
    let proto::QueryRequest { merchant_id, key } = request;
    let mut v = Violations::default();
    let merchant_id = v.check(MerchantId::parse("merchant_id", &merchant_id));
    let key = match key {
        Some(Key::OutTradeNo(raw)) => v.check(OutTradeNo::parse("out_trade_no", &raw)).map(QueryKey::OutTradeNo),
        Some(Key::OrderNo(raw)) => v.check(OrderNo::parse("order_no", &raw)).map(QueryKey::OrderNo),
        Some(Key::OutRefundNo(raw)) => v.check(OutRefundNo::parse("out_refund_no", &raw)).map(QueryKey::OutRefundNo),
        None => v.check(Err(FieldViolation::new("key", "one of out_trade_no, order_no or out_refund_no is required"))),
    };
    match (merchant_id, key) {
        (Some(merchant_id), Some(key)) => Ok((merchant_id, key)),
        _ => Err(v.into_error()),
    }
}

/// The `idempotency-key` and `idempotency-token` request headers.
///
/// Each has exactly one reading or the call is refused: a header sent more than once (which
/// value would count?), sent in the request's trailers (tonic would let the trailer replace
/// the header), or sent as its binary twin `idempotency-key-bin` / `idempotency-token-bin`
/// (a different gRPC metadata key that a caller may believe is the same) is
/// INVALID_ARGUMENT naming the header, before anything is read or written.
/// The guards belong to `actor`, the authenticated caller.
pub(super) fn guards<T>(request: &tonic::Request<T>, actor: &Actor) -> Result<Guards, Error> {
    let metadata = request.metadata();
    let mut v = Violations::default();
    if let Some(headers) = request.extensions().get::<GuardHeaders>() {
        // A value that is not the HEADERS frame's came in the request's trailers.
        for (name, sent) in
            [(IDEMPOTENCY_KEY_HEADER, &headers.idempotency_key), (IDEMPOTENCY_TOKEN_HEADER, &headers.idempotency_token)]
        {
            if !metadata
                .get_all(name)
                .iter()
                .map(|value| value.as_bytes())
                .eq(sent.iter().map(|value| value.as_bytes()))
            {
                v.check::<()>(Err(FieldViolation::new(name, "must be sent as a request header, not in trailers")));
            }
        }
        if !v.0.is_empty() {
            return Err(v.into_error());
        }
    }
    let idempotency_key = single_header(metadata, IDEMPOTENCY_KEY_HEADER, "idempotency-key-bin", &mut v)
        .and_then(|raw| v.check(IdempotencyKey::parse(IDEMPOTENCY_KEY_HEADER, raw)));
    let token = single_header(metadata, IDEMPOTENCY_TOKEN_HEADER, "idempotency-token-bin", &mut v)
        .and_then(|raw| v.check(OneTimeToken::parse(IDEMPOTENCY_TOKEN_HEADER, raw)));
    if v.0.is_empty() {
        // The call's deadline and liveness, as the server's outer layer recorded them.
        let presence = request.extensions().get::<CallerPresence>().cloned().unwrap_or_default();
        Ok(Guards { idempotency_key, token, actor: actor.clone(), presence })
    } else {
        Err(v.into_error())
    }
}

/// The one ASCII value of header `name`, or `None` when it is absent or refused (with its
/// violation recorded); `binary_twin` is the `-bin` key of the same name.
fn single_header<'a>(
    metadata: &'a tonic::metadata::MetadataMap,
    name: &'static str,
    binary_twin: &'static str,
    v: &mut Violations,
) -> Option<&'a str> {
    if metadata.get_bin(binary_twin).is_some() {
        v.check::<()>(Err(FieldViolation::new(
            name,
            format!("must be sent as the ASCII header {name}, not {binary_twin}"),
        )));
        return None;
    }
    let mut values = metadata.get_all(name).iter();
    let value = values.next()?;
    if values.next().is_some() {
        v.check::<()>(Err(FieldViolation::new(name, "must be sent once")));
        return None;
    }
    v.check(value.to_str().map_err(|_| FieldViolation::new(name, "must be printable ASCII (0x20-0x7E)")))
}

pub(super) fn transfer(request: proto::TransferRequest, actor: &Actor) -> Result<Transfer, Error> {
    let proto::TransferRequest { from_account_id, to_account_id, amount, currency, memo } = request;
    let mut v = Violations::default();
    let from_account_id = v.check(AccountId::parse("from_account_id", &from_account_id));
    let to_account_id = v.check(AccountId::parse("to_account_id", &to_account_id));
    let currency = v.check(Currency::parse("currency", &currency));
    let amount = v.amount(&amount, currency);
    let memo = v.check(FreeText::parse("memo", &memo));
    if let (Some(from), Some(to)) = (&from_account_id, &to_account_id) {
        if from == to {
            v.check::<()>(Err(FieldViolation::new("to_account_id", "must differ from from_account_id")));
        }
    }
    match (from_account_id, to_account_id, amount, memo) {
        (Some(from_account_id), Some(to_account_id), Some(amount), Some(memo)) if v.0.is_empty() => {
            Ok(Transfer { from_account_id, to_account_id, amount, memo, created_by: actor.clone() })
        }
        _ => Err(v.into_error()),
    }
}

pub(super) fn issue_token(request: proto::IssueTokenRequest) -> Result<(MerchantId, FreeText), Error> {
    let proto::IssueTokenRequest { merchant_id, purpose } = request;
    let mut v = Violations::default();
    let merchant_id = v.check(MerchantId::parse("merchant_id", &merchant_id));
    let purpose = v.check(FreeText::parse("purpose", &purpose));
    match (merchant_id, purpose) {
        (Some(merchant_id), Some(purpose)) => Ok((merchant_id, purpose)),
        _ => Err(v.into_error()),
    }
}
