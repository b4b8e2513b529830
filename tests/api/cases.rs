//! The behavioural suite, written once and run against every backend (see `main.rs`).

use std::time::Duration;

use payledger::proto::{self, query_request::Key, EntryKind, OrderStatus};
use tonic::Code;

use crate::helpers::{assert_status, replayed, violated_fields, TestApp};
use tonic::transport::Channel;
use tonic_types::StatusExt as _;

pub use crate::auth_cases::*;
pub use crate::http_cases::*;
pub use crate::lifecycle_cases::*;

pub async fn open_account_is_replayed_and_a_different_currency_is_already_exists(app: &TestApp) {
    let mut accounts = app.accounts.clone();
    let request = proto::OpenAccountRequest { account_id: "alice".into(), currency: "USD".into() };

    let first = accounts.open_account(request.clone()).await.unwrap();
    let again = accounts.open_account(request).await.unwrap();
    let other_currency = accounts
        .open_account(proto::OpenAccountRequest { account_id: "alice".into(), currency: "EUR".into() })
        .await
        .unwrap_err();

    assert!(!replayed(&first));
    assert!(replayed(&again));
    let account = first.into_inner().account.unwrap();
    assert_eq!((account.balance.as_str(), account.version, account.currency.as_str()), ("0.00", 0, "USD"));
    assert_eq!(again.into_inner().account.unwrap(), account);
    assert_status(&other_currency, Code::AlreadyExists, "ACCOUNT_ALREADY_EXISTS");
    assert_eq!(app.rows("accounts").await, 2, "alice and the USD funding account");
}

pub async fn deposit_credits_the_account_and_a_repeated_request_id_is_a_replay(app: &TestApp) {
    app.open("alice", "USD").await;

    let first = app.deposit("dep-1", "alice", "100.50", "USD").await.unwrap();
    let again = app.deposit("dep-1", "alice", "100.50", "USD").await.unwrap();
    let changed = app.deposit("dep-1", "alice", "7.00", "USD").await.unwrap_err();

    assert!(!replayed(&first) && replayed(&again));
    let (first, again) = (first.into_inner(), again.into_inner());
    assert_eq!(first, again, "a replay answers with the original result");
    let entry = first.entry.unwrap();
    assert_eq!((entry.amount.as_str(), entry.balance_after.as_str(), entry.version_after), ("100.50", "100.50", 1));
    assert_eq!(entry.kind(), EntryKind::Deposit);
    assert_eq!(entry.reference, "dep-1");
    assert_eq!(entry.counterparty_account_id, "@external:USD");
    assert_eq!(first.account.unwrap().balance, "100.50");
    assert_status(&changed, Code::AlreadyExists, "REQUEST_ID_REUSED");
    assert!(changed.message().contains("amount"), "{changed:?}");
    assert_eq!(app.balance("alice").await, "100.50");
    assert_eq!(app.rows("journal_entries").await, 2, "one posting, two legs");
}

pub async fn deposit_into_a_missing_account_or_in_another_currency_is_refused(app: &TestApp) {
    app.open("alice", "USD").await;
    let before = app.all_rows().await;

    let missing = app.deposit("dep-1", "nobody", "1.00", "USD").await.unwrap_err();
    let wrong_currency = app.deposit("dep-2", "alice", "1.00", "EUR").await.unwrap_err();

    assert_status(&missing, Code::NotFound, "ACCOUNT_NOT_FOUND");
    assert_status(&wrong_currency, Code::FailedPrecondition, "CURRENCY_MISMATCH");
    assert_eq!(app.all_rows().await, before, "refused requests leave nothing behind");
}

pub async fn list_entries_pages_newest_first(app: &TestApp) {
    app.open("alice", "USD").await;
    for n in 1..=5 {
        app.deposit(&format!("dep-{n}"), "alice", &format!("{n}.00"), "USD").await.unwrap();
    }
    let mut accounts = app.accounts.clone();
    let mut amounts = Vec::new();
    let mut token = String::new();
    let mut pages = 0;
    loop {
        let request = proto::ListEntriesRequest { account_id: "alice".into(), page_size: 2, page_token: token.clone() };
        let page = accounts.list_entries(request).await.unwrap().into_inner();
        pages += 1;
        assert!(page.entries.len() <= 2);
        amounts.extend(page.entries.into_iter().map(|entry| entry.amount));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(pages, 3);
    assert_eq!(amounts, ["5.00", "4.00", "3.00", "2.00", "1.00"]);

    let bad_token =
        proto::ListEntriesRequest { account_id: "alice".into(), page_size: 2, page_token: "garbage".into() };
    let error = accounts.list_entries(bad_token).await.unwrap_err();
    assert_status(&error, Code::InvalidArgument, "INVALID_ARGUMENT");
    assert_eq!(violated_fields(&error), ["page_token"]);
}

pub async fn create_order_is_replayed_and_other_fields_are_already_exists(app: &TestApp) {
    app.open("shop", "USD").await;

    let first = app.create_order("m1", "order-1", "shop", "25.00").await.unwrap();
    let again = app.create_order("m1", "order-1", "shop", "25.00").await.unwrap();
    let changed = app.create_order("m1", "order-1", "shop", "26.00").await.unwrap_err();
    let same_number_other_merchant = app.create_order("m2", "order-1", "shop", "26.00").await.unwrap();

    assert!(!replayed(&first) && replayed(&again));
    let order = first.into_inner().order.unwrap();
    assert_eq!(order.status(), OrderStatus::Pending);
    assert_eq!((order.amount.as_str(), order.refunded_amount.as_str()), ("25.00", "0.00"));
    assert_eq!(again.into_inner().order.unwrap(), order);
    assert_status(&changed, Code::AlreadyExists, "ORDER_NO_REUSED");
    assert!(!replayed(&same_number_other_merchant), "order numbers are scoped by merchant");
    assert_eq!(app.rows("orders").await, 2);
}

pub async fn create_order_for_a_missing_payee_is_not_found(app: &TestApp) {
    let error = app.create_order("m1", "order-1", "nobody", "1.00").await.unwrap_err();
    assert_status(&error, Code::NotFound, "ACCOUNT_NOT_FOUND");
    assert_eq!(app.rows("orders").await, 0);
}

pub async fn pay_moves_the_order_amount_from_payer_to_payee_once(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;

    let response = app.pay("m1", "pay-1", "order-1", "alice", "30.00").await.unwrap();

    assert!(!replayed(&response));
    let response = response.into_inner();
    let payment = response.payment.unwrap();
    assert!(payment.trade_no.starts_with('T'));
    assert_eq!(
        (payment.merchant_id.as_str(), payment.out_trade_no.as_str(), payment.order_no.as_str()),
        ("m1", "pay-1", "order-1")
    );
    assert_eq!((payment.payer_account_id.as_str(), payment.payee_account_id.as_str()), ("alice", "shop"));
    assert_eq!((payment.amount.as_str(), payment.currency.as_str()), ("30.00", "USD"));
    assert_eq!(payment.status(), proto::PaymentStatus::Succeeded);
    let order = response.order.unwrap();
    assert_eq!((order.status(), order.out_trade_no.as_str()), (OrderStatus::Paid, "pay-1"));
    assert_eq!(app.balance("alice").await, "70.00");
    assert_eq!(app.balance("shop").await, "30.00");
}

pub async fn pay_retried_with_the_same_out_trade_no_is_replayed_with_the_original_trade_no(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;

    let first = app.pay("m1", "pay-1", "order-1", "alice", "30.00").await.unwrap();
    let again = app.pay("m1", "pay-1", "order-1", "alice", "30.00").await.unwrap();

    assert!(replayed(&again));
    assert_eq!(first.into_inner().payment, again.into_inner().payment);
    assert_eq!(app.balance("alice").await, "70.00", "debited once");
    assert_eq!(app.rows("payment_flow").await, 1);
}

pub async fn pay_with_a_used_out_trade_no_and_other_fields_names_the_differing_fields(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;
    app.create_order("m1", "order-2", "shop", "30.00").await.unwrap();
    app.pay("m1", "pay-1", "order-1", "alice", "30.00").await.unwrap();

    let error = app.pay("m1", "pay-1", "order-2", "alice", "30.00").await.unwrap_err();

    assert_status(&error, Code::AlreadyExists, "OUT_TRADE_NO_REUSED");
    let details = tonic_types::StatusExt::get_error_details(&error);
    assert_eq!(details.error_info().unwrap().metadata.get("fields").map(String::as_str), Some("order_no"));
    assert_eq!(app.balance("alice").await, "70.00");
}

pub async fn a_second_out_trade_no_for_a_paid_order_moves_no_money(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;
    app.pay("m1", "pay-1", "order-1", "alice", "30.00").await.unwrap();
    let before = app.all_rows().await;

    let error = app.pay("m1", "pay-2", "order-1", "alice", "30.00").await.unwrap_err();

    assert_status(&error, Code::FailedPrecondition, "ORDER_ALREADY_PAID");
    assert_eq!(app.balance("alice").await, "70.00");
    assert_eq!(app.all_rows().await, before);
}

pub async fn pay_refuses_mismatched_amount_currency_and_self_payment_leaving_nothing(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;
    app.open("bob-eur", "EUR").await;
    let before = app.all_rows().await;

    let amount = app.pay("m1", "pay-1", "order-1", "alice", "29.99").await.unwrap_err();
    let mut eur = app.pay_request("m1", "pay-2", "order-1", "alice", "30.00");
    eur.currency = "EUR".into();
    let currency = app.payments.clone().pay(eur).await.unwrap_err();
    let self_payment = app.pay("m1", "pay-3", "order-1", "shop", "30.00").await.unwrap_err();
    let missing_order = app.pay("m1", "pay-4", "order-404", "alice", "30.00").await.unwrap_err();
    let missing_payer = app.pay("m1", "pay-5", "order-1", "nobody", "30.00").await.unwrap_err();

    assert_status(&amount, Code::FailedPrecondition, "AMOUNT_MISMATCH");
    assert_status(&currency, Code::FailedPrecondition, "CURRENCY_MISMATCH");
    assert_status(&self_payment, Code::FailedPrecondition, "PAYER_IS_PAYEE");
    assert_status(&missing_order, Code::NotFound, "ORDER_NOT_FOUND");
    assert_status(&missing_payer, Code::NotFound, "ACCOUNT_NOT_FOUND");
    assert_eq!(app.all_rows().await, before);
    let retry = app.pay("m1", "pay-1", "order-1", "alice", "30.00").await.unwrap();
    assert!(!replayed(&retry), "a refused key is evaluated afresh");
}

pub async fn pay_without_funds_leaves_nothing_and_succeeds_after_a_deposit(app: &TestApp) {
    app.order_ready_to_pay("order-1", "10.00", "30.00").await;
    let before = app.all_rows().await;

    let error = app.pay("m1", "pay-1", "order-1", "alice", "30.00").await.unwrap_err();
    let after_refusal = app.all_rows().await;
    app.deposit("top-up", "alice", "20.00", "USD").await.unwrap();
    let retry = app.pay("m1", "pay-1", "order-1", "alice", "30.00").await.unwrap();

    assert_status(&error, Code::FailedPrecondition, "INSUFFICIENT_FUNDS");
    assert_eq!(after_refusal, before);
    assert!(!replayed(&retry));
    assert_eq!(app.balance("alice").await, "0.00");
}

pub async fn close_order_closes_once_and_refuses_paid_orders(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;
    app.create_order("m1", "order-2", "shop", "30.00").await.unwrap();
    let mut payments = app.payments.clone();
    let close = |order_no: &str| proto::CloseOrderRequest { merchant_id: "m1".into(), order_no: order_no.into() };

    let first = payments.close_order(close("order-1")).await.unwrap();
    let again = payments.close_order(close("order-1")).await.unwrap();
    let pay_closed = app.pay("m1", "pay-1", "order-1", "alice", "30.00").await.unwrap_err();
    app.pay("m1", "pay-2", "order-2", "alice", "30.00").await.unwrap();
    let close_paid = payments.close_order(close("order-2")).await.unwrap_err();
    let close_missing = payments.close_order(close("order-404")).await.unwrap_err();

    assert!(!replayed(&first) && replayed(&again));
    assert_eq!(first.into_inner().order.unwrap().status(), OrderStatus::Closed);
    assert_eq!(again.into_inner().order.unwrap().status(), OrderStatus::Closed);
    assert_status(&pay_closed, Code::FailedPrecondition, "ORDER_CLOSED");
    assert_status(&close_paid, Code::FailedPrecondition, "ORDER_ALREADY_PAID");
    assert_status(&close_missing, Code::NotFound, "ORDER_NOT_FOUND");
    assert_eq!(app.balance("alice").await, "70.00");
    assert_eq!(app.rows("payment_flow").await, 1);
}

pub async fn partial_then_full_refunds_move_money_back_and_replays_do_not(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;
    app.pay("m1", "pay-1", "order-1", "alice", "30.00").await.unwrap();

    let part = app.refund("m1", "pay-1", "refund-1", "10.00").await.unwrap();
    let part_again = app.refund("m1", "pay-1", "refund-1", "10.00").await.unwrap();
    let too_much = app.refund("m1", "pay-1", "refund-2", "20.01").await.unwrap_err();
    let rest = app.refund("m1", "pay-1", "refund-3", "20.00").await.unwrap();
    let beyond = app.refund("m1", "pay-1", "refund-4", "0.01").await.unwrap_err();
    let key_reused = app.refund("m1", "pay-1", "refund-1", "11.00").await.unwrap_err();

    assert!(!replayed(&part) && replayed(&part_again));
    let (part, part_again) = (part.into_inner(), part_again.into_inner());
    assert_eq!(part.refund, part_again.refund);
    let refund = part.refund.unwrap();
    assert!(refund.refund_no.starts_with('R'));
    assert_eq!(
        (refund.amount.as_str(), refund.out_trade_no.as_str(), refund.reason.as_str()),
        ("10.00", "pay-1", "customer asked")
    );
    let order = part.order.unwrap();
    assert_eq!((order.status(), order.refunded_amount.as_str()), (OrderStatus::PartiallyRefunded, "10.00"));
    assert_status(&too_much, Code::FailedPrecondition, "REFUND_EXCEEDS_PAID");
    let order = rest.into_inner().order.unwrap();
    assert_eq!((order.status(), order.refunded_amount.as_str()), (OrderStatus::Refunded, "30.00"));
    assert_status(&beyond, Code::FailedPrecondition, "REFUND_EXCEEDS_PAID");
    assert_status(&key_reused, Code::AlreadyExists, "OUT_REFUND_NO_REUSED");
    assert_eq!(app.balance("alice").await, "100.00");
    assert_eq!(app.balance("shop").await, "0.00");
    assert_eq!(app.rows("refunds").await, 2);
}

pub async fn refund_of_an_unknown_payment_or_without_an_amount_is_refused(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;
    app.pay("m1", "pay-1", "order-1", "alice", "30.00").await.unwrap();
    let before = app.all_rows().await;

    let unknown = app.refund("m1", "pay-404", "refund-1", "1.00").await.unwrap_err();
    let no_amount = app.refund("m1", "pay-1", "refund-2", "").await.unwrap_err();
    let other_merchant = app.refund("m2", "pay-1", "refund-3", "1.00").await.unwrap_err();

    assert_status(&unknown, Code::NotFound, "PAYMENT_NOT_FOUND");
    assert_status(&no_amount, Code::InvalidArgument, "INVALID_ARGUMENT");
    assert_eq!(violated_fields(&no_amount), ["amount"], "a missing amount never means refund everything");
    assert_status(&other_merchant, Code::NotFound, "PAYMENT_NOT_FOUND");
    assert_eq!(app.all_rows().await, before);
}

pub async fn query_finds_the_order_by_each_business_number(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;
    app.create_order("m1", "order-2", "shop", "5.00").await.unwrap();
    app.pay("m1", "pay-1", "order-1", "alice", "30.00").await.unwrap();
    app.refund("m1", "pay-1", "refund-1", "1.00").await.unwrap();
    app.refund("m1", "pay-1", "refund-2", "2.00").await.unwrap();

    let by_order = app.query("m1", Key::OrderNo("order-1".into())).await.unwrap();
    let by_trade = app.query("m1", Key::OutTradeNo("pay-1".into())).await.unwrap();
    let by_refund = app.query("m1", Key::OutRefundNo("refund-2".into())).await.unwrap();
    let unpaid = app.query("m1", Key::OrderNo("order-2".into())).await.unwrap();
    let missing = app.query("m1", Key::OutRefundNo("refund-404".into())).await.unwrap_err();
    let no_key =
        app.payments.clone().query(proto::QueryRequest { merchant_id: "m1".into(), key: None }).await.unwrap_err();

    assert_eq!(by_order, by_trade);
    assert_eq!(by_order, by_refund);
    assert_eq!(by_order.order.as_ref().unwrap().status(), OrderStatus::PartiallyRefunded);
    assert_eq!(by_order.payment.as_ref().unwrap().out_trade_no, "pay-1");
    let refunds: Vec<_> = by_order.refunds.iter().map(|r| (r.out_refund_no.as_str(), r.amount.as_str())).collect();
    assert_eq!(refunds, [("refund-1", "1.00"), ("refund-2", "2.00")]);
    assert!(unpaid.payment.is_none() && unpaid.refunds.is_empty());
    assert_status(&missing, Code::NotFound, "REFUND_NOT_FOUND");
    assert_status(&no_key, Code::InvalidArgument, "INVALID_ARGUMENT");
}

pub async fn bad_input_is_invalid_argument_naming_every_bad_field_and_leaves_nothing(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;
    let before = app.all_rows().await;
    let mut payments = app.payments.clone();

    let mut request = app.pay_request("m 1", &"x".repeat(65), "", "alice", "-30.00");
    request.currency = "usd".into();
    let error = payments.pay(request).await.unwrap_err();
    assert_status(&error, Code::InvalidArgument, "INVALID_ARGUMENT");
    assert_eq!(violated_fields(&error), ["merchant_id", "out_trade_no", "order_no", "currency", "amount"]);
    assert!(error.message().len() < 512, "messages never echo large input");

    for amount in ["30.001", "0", "0.00", "1e3", " 30.00", "30,00", "99999999999999999999", "NaN"] {
        let error = app.pay("m1", "pay-1", "order-1", "alice", amount).await.unwrap_err();
        assert_status(&error, Code::InvalidArgument, "INVALID_ARGUMENT");
        assert_eq!(violated_fields(&error), ["amount"], "amount {amount:?}");
    }
    let huge_subject = proto::CreateOrderRequest {
        merchant_id: "m1".into(),
        order_no: "order-2".into(),
        payee_account_id: "shop".into(),
        amount: "1.00".into(),
        currency: "USD".into(),
        subject: "s".repeat(10_000),
        expires_at: None,
    };
    let error = payments.create_order(huge_subject).await.unwrap_err();
    assert_eq!(violated_fields(&error), ["subject"]);
    let huge_message = proto::OpenAccountRequest { account_id: "a".repeat(100_000), currency: "USD".into() };
    let error = app.accounts.clone().open_account(huge_message).await.unwrap_err();
    assert!(matches!(error.code(), Code::InvalidArgument | Code::OutOfRange | Code::ResourceExhausted), "{error:?}");
    let xau = app
        .accounts
        .clone()
        .open_account(proto::OpenAccountRequest { account_id: "gold".into(), currency: "XAU".into() })
        .await;
    assert_status(&xau.unwrap_err(), Code::InvalidArgument, "INVALID_ARGUMENT");

    assert_eq!(app.all_rows().await, before);
}

pub async fn yen_and_dinar_amounts_follow_their_minor_units(app: &TestApp) {
    app.open("yen", "JPY").await;
    app.open("dinar", "KWD").await;

    let yen = app.deposit("dep-jpy", "yen", "500", "JPY").await.unwrap().into_inner();
    let dinar = app.deposit("dep-kwd", "dinar", "1.005", "KWD").await.unwrap().into_inner();
    let yen_fraction = app.deposit("dep-jpy-2", "yen", "1.5", "JPY").await.unwrap_err();

    assert_eq!(yen.account.unwrap().balance, "500");
    assert_eq!(dinar.account.unwrap().balance, "1.005");
    assert_status(&yen_fraction, Code::InvalidArgument, "INVALID_ARGUMENT");
}

pub async fn twenty_concurrent_identical_pays_execute_once_with_one_trade_no(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;

    let calls = (0..20).map(|_| {
        let mut payments = app.payments.clone();
        let request = app.pay_request("m1", "pay-1", "order-1", "alice", "30.00");
        tokio::spawn(async move { payments.pay(request).await })
    });
    let responses: Vec<_> =
        futures::future::join_all(calls).await.into_iter().map(|joined| joined.unwrap().unwrap()).collect();

    let fresh = responses.iter().filter(|response| !replayed(response)).count();
    let trade_nos: std::collections::HashSet<_> =
        responses.into_iter().map(|response| response.into_inner().payment.unwrap().trade_no).collect();
    assert_eq!(fresh, 1, "exactly one call ran, the others were replays");
    assert_eq!(trade_nos.len(), 1, "every caller got the same trade_no");
    assert_eq!(app.balance("alice").await, "70.00");
    assert_eq!(app.rows("payment_flow").await, 1);
}

pub async fn concurrent_pays_against_one_balance_never_overdraw_it(app: &TestApp) {
    app.funded("alice", "100.00").await;
    app.open("shop", "USD").await;
    for n in 0..110 {
        app.create_order("m1", &format!("order-{n}"), "shop", "1.00").await.unwrap();
    }

    let calls = (0..110).map(|n| {
        let mut payments = app.payments.clone();
        let request = app.pay_request("m1", &format!("pay-{n}"), &format!("order-{n}"), "alice", "1.00");
        tokio::spawn(async move { payments.pay(request).await })
    });
    let outcomes: Vec<_> = futures::future::join_all(calls).await.into_iter().map(|joined| joined.unwrap()).collect();

    let paid = outcomes.iter().filter(|outcome| outcome.is_ok()).count();
    for error in outcomes.iter().filter_map(|outcome| outcome.as_ref().err()) {
        assert_status(error, Code::FailedPrecondition, "INSUFFICIENT_FUNDS");
    }
    assert_eq!(paid, 100);
    assert_eq!(app.balance("alice").await, "0.00");
    assert_eq!(app.balance("shop").await, "100.00");
    assert_eq!(app.rows("payment_flow").await, 100);
    app.create_order("m1", "order-last", "shop", "1.00").await.unwrap();
    let next = app.pay("m1", "pay-last", "order-last", "alice", "1.00").await.unwrap_err();
    assert_status(&next, Code::FailedPrecondition, "INSUFFICIENT_FUNDS");
}

pub async fn concurrent_partial_refunds_never_exceed_the_paid_amount(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "10.00").await;
    app.pay("m1", "pay-1", "order-1", "alice", "10.00").await.unwrap();

    let calls = (0..25).map(|n| {
        let mut payments = app.payments.clone();
        let request = app.refund_request("m1", "pay-1", &format!("refund-{n}"), "1.00");
        tokio::spawn(async move { payments.refund(request).await })
    });
    let outcomes: Vec<_> = futures::future::join_all(calls).await.into_iter().map(|joined| joined.unwrap()).collect();

    let refunded = outcomes.iter().filter(|outcome| outcome.is_ok()).count();
    for error in outcomes.iter().filter_map(|outcome| outcome.as_ref().err()) {
        assert_status(error, Code::FailedPrecondition, "REFUND_EXCEEDS_PAID");
    }
    assert_eq!(refunded, 10);
    let details = app.query("m1", Key::OrderNo("order-1".into())).await.unwrap();
    let order = details.order.unwrap();
    assert_eq!((order.status(), order.refunded_amount.as_str()), (OrderStatus::Refunded, "10.00"));
    assert_eq!(details.refunds.len(), 10);
    assert_eq!(app.balance("alice").await, "100.00");
    assert_eq!(app.balance("shop").await, "0.00");
}

/// Queries racing the refunds of their order: every answer lists refunds that add up to the
/// refunded amount its order shows (the order and its refunds read at one moment).
pub async fn a_query_racing_refunds_answers_one_moment(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "60.00").await;
    app.pay("m1", "pay-1", "order-1", "alice", "60.00").await.unwrap();
    app.read_while_refunds_land("pay-1", 20, |mut payments| async move {
        let request = proto::QueryRequest { merchant_id: "m1".into(), key: Some(Key::OrderNo("order-1".into())) };
        let details = payments.query(request).await.expect("Query").into_inner();
        let order = details.order.unwrap();
        let listed: i64 = details.refunds.iter().map(|refund| cents(&refund.amount)).sum();
        assert_eq!(listed, cents(&order.refunded_amount), "refunds listed against the order's refunded amount");
    })
    .await;
    let order = app.query("m1", Key::OrderNo("order-1".into())).await.unwrap().order.unwrap();
    assert_eq!((order.status(), order.refunded_amount.as_str()), (OrderStatus::Refunded, "60.00"));
}

/// "12.34" as 1234 (two decimals, as USD amounts are written).
fn cents(amount: &str) -> i64 {
    let (units, fraction) = amount.split_once('.').expect("a decimal amount");
    units.parse::<i64>().unwrap() * 100 + fraction.parse::<i64>().unwrap()
}

pub async fn opposite_payments_between_two_accounts_finish_without_deadlock(app: &TestApp) {
    app.funded("alpha", "100.00").await;
    app.funded("beta", "100.00").await;
    for n in 0..30 {
        app.create_order("m1", &format!("to-beta-{n}"), "beta", "1.00").await.unwrap();
        app.create_order("m1", &format!("to-alpha-{n}"), "alpha", "2.00").await.unwrap();
    }

    let calls = (0..30).flat_map(|n| {
        let to_beta = app.pay_request("m1", &format!("pay-b-{n}"), &format!("to-beta-{n}"), "alpha", "1.00");
        let to_alpha = app.pay_request("m1", &format!("pay-a-{n}"), &format!("to-alpha-{n}"), "beta", "2.00");
        [to_beta, to_alpha].map(|request| {
            let mut payments = app.payments.clone();
            tokio::spawn(async move { payments.pay(request).await })
        })
    });
    let outcomes = futures::future::join_all(calls).await;

    for outcome in outcomes {
        outcome.unwrap().expect("no client-visible deadlock or abort");
    }
    assert_eq!(app.balance("alpha").await, "130.00");
    assert_eq!(app.balance("beta").await, "70.00");
}

pub async fn a_pay_whose_client_gave_up_is_all_or_nothing_and_a_retry_is_exact(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;

    let mut impatient = app.pay_request("m1", "pay-1", "order-1", "alice", "30.00");
    let mut payments = app.payments.clone();
    let mut request = tonic::Request::new(impatient.clone());
    request.set_timeout(Duration::from_micros(200));
    let first = payments.pay(request).await;
    // The detached transaction finishes (commit or rollback) whatever the client did.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let paid_rows = app.rows("payment_flow").await;
    assert!(paid_rows <= 1);
    assert_eq!(app.balance("alice").await, if paid_rows == 1 { "70.00" } else { "100.00" });
    assert_eq!(app.sessions_idle_in_transaction().await, 0, "no session left idle in a transaction");

    impatient.currency = "USD".into();
    let retry = app.payments.clone().pay(impatient).await.unwrap();

    if let Ok(first) = first {
        assert_eq!(first.into_inner().payment, retry.get_ref().payment.clone());
    }
    assert_eq!(replayed(&retry), paid_rows == 1);
    assert_eq!(app.balance("alice").await, "70.00");
    assert_eq!(app.rows("payment_flow").await, 1);
}

pub async fn health_is_serving_and_reflection_lists_both_services(app: &TestApp) {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;

    let channel =
        tonic::transport::Channel::from_shared(format!("http://{}", app.address)).unwrap().connect().await.unwrap();
    let mut health = HealthClient::new(channel.clone());
    for service in ["", "payledger.v1.PaymentService", "payledger.v1.AccountService"] {
        let status = health.check(HealthCheckRequest { service: service.into() }).await.unwrap().into_inner().status;
        assert_eq!(status, 1, "{service:?} is SERVING");
    }

    let mut reflection = ServerReflectionClient::new(channel);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = reflection.server_reflection_info(futures::stream::iter([request])).await.unwrap().into_inner();
    let Some(MessageResponse::ListServicesResponse(list)) = stream.message().await.unwrap().unwrap().message_response
    else {
        panic!("expected a service list");
    };
    let names: Vec<_> = list.service.into_iter().map(|service| service.name).collect();
    assert!(names.contains(&"payledger.v1.PaymentService".to_owned()), "{names:?}");
    assert!(names.contains(&"payledger.v1.AccountService".to_owned()), "{names:?}");

    // The error details every status carries resolve too, so that reflection clients
    // (grpcurl) decode ErrorInfo, BadRequest and RetryInfo.
    for symbol in ["google.rpc.ErrorInfo", "google.rpc.BadRequest", "google.rpc.RetryInfo"] {
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::FileContainingSymbol(symbol.into())),
        };
        let mut stream =
            reflection.server_reflection_info(futures::stream::iter([request])).await.unwrap().into_inner();
        let answer = stream.message().await.unwrap().unwrap().message_response;
        assert!(matches!(answer, Some(MessageResponse::FileDescriptorResponse(_))), "{symbol}: {answer:?}");
    }
}

pub async fn audit_reports_a_balance_that_disagrees_with_its_entries(app: &TestApp) {
    app.funded("alice", "10.00").await;
    assert!(app.ledger.audit().await.unwrap().is_empty());

    sqlx::query("UPDATE accounts SET balance = balance + 1 WHERE account_id = 'alice'")
        .execute(&app.raw)
        .await
        .unwrap();
    let violations = app.ledger.audit().await.unwrap();
    sqlx::query("UPDATE accounts SET balance = balance - 1 WHERE account_id = 'alice'")
        .execute(&app.raw)
        .await
        .unwrap();

    // The details are read as an operator reads them, unpadded on every backend (PostgreSQL's
    // CHAR(24) pads with spaces; the checks trim it).
    let details: Vec<_> =
        violations.iter().map(|violation| (violation.subject.as_str(), violation.detail.as_str())).collect();
    assert!(
        details.contains(&("alice", "balance 1001 version 1 entries sum 1000 count 1")),
        "the balance no longer matches its entries: {violations:#?}"
    );
    assert!(details.contains(&("USD", "sum 1")), "the balances no longer sum to zero: {violations:#?}");
}

/// Rows edited by hand the way the audit once could not see: a posting whose accounts are not
/// its payment's or transfer's, a refunded order set back to PAID, an old entry's balance or
/// version rewritten, and a consistent posting forged between two new accounts. Each is named
/// by its check, by the full audit and (what lies in its range) by the audit from a checkpoint.
pub async fn the_audit_finds_legs_that_are_not_their_rows_statuses_that_misstate_refunds_and_rewritten_history(
    app: &TestApp,
) {
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;
    app.open("carol", "USD").await;
    let checkpoint = app.ledger.settled_entry(i64::MAX).await.unwrap();
    app.pay("m1", "pay-1", "order-1", "alice", "30.00").await.unwrap();
    app.refund("m1", "pay-1", "refund-1", "30.00").await.unwrap();
    let transfer = with_key(transfer_request("alice", "carol", "5.00"), "transfer-1");
    app.accounts.clone().transfer(transfer).await.unwrap();
    let newest = app.ledger.settled_entry(i64::MAX).await.unwrap();
    assert_eq!(app.ledger.audit().await.unwrap(), Vec::new());
    assert_eq!(app.ledger.audit_entries(checkpoint, newest).await.unwrap(), Vec::new());
    let first: i64 = sqlx::query_scalar("SELECT MIN(entry_id) FROM journal_entries WHERE account_id = 'alice'")
        .fetch_one(&app.raw)
        .await
        .unwrap();

    let legs = "is a leg of the payment, refund, transfer, deposit or withdrawal";
    let forged = [
        "INSERT INTO accounts (account_id, currency, kind, balance, version, created_at, updated_at) VALUES \
         ('mallory', 'USD', 'CUSTOMER', 700, 1, 0, 0), ('mallory-source', 'USD', 'EXTERNAL', -700, 1, 0, 0)",
        "INSERT INTO journal_entries (account_id, currency, amount, balance_after, version_after, kind, reference, \
         posting_id, counterparty_account_id, created_at) VALUES \
         ('mallory-source', 'USD', -700, -700, 1, 'PAY', 'forged', 'forged-1', 'mallory', 0), \
         ('mallory', 'USD', 700, 700, 1, 'PAY', 'forged', 'forged-1', 'mallory-source', 0)",
    ];
    let unforged = [
        "DELETE FROM journal_entries WHERE posting_id = 'forged-1'",
        "DELETE FROM accounts WHERE account_id IN ('mallory', 'mallory-source')",
    ];
    let first_entry = |change: &str| change.replace("{first}", &first.to_string());
    let breaks: [(Vec<String>, Vec<String>, &str, bool); 6] = [
        (
            vec!["UPDATE payment_flow SET payer_account_id = 'carol' WHERE out_trade_no = 'pay-1'".into()],
            vec!["UPDATE payment_flow SET payer_account_id = 'alice' WHERE out_trade_no = 'pay-1'".into()],
            legs,
            true,
        ),
        (
            vec!["UPDATE transfers SET to_account_id = 'shop' WHERE to_account_id = 'carol'".into()],
            vec!["UPDATE transfers SET to_account_id = 'carol' WHERE to_account_id = 'shop'".into()],
            legs,
            true,
        ),
        (
            vec!["UPDATE orders SET status = 'PAID' WHERE order_no = 'order-1'".into()],
            vec!["UPDATE orders SET status = 'REFUNDED' WHERE order_no = 'order-1'".into()],
            "status says how much of it was refunded",
            false,
        ),
        (
            vec![first_entry("UPDATE journal_entries SET balance_after = balance_after + 1 WHERE entry_id = {first}")],
            vec![first_entry("UPDATE journal_entries SET balance_after = balance_after - 1 WHERE entry_id = {first}")],
            "every entry continues its account",
            false,
        ),
        (
            vec![first_entry("UPDATE journal_entries SET version_after = version_after + 1 WHERE entry_id = {first}")],
            vec![first_entry("UPDATE journal_entries SET version_after = version_after - 1 WHERE entry_id = {first}")],
            "every entry continues its account",
            false,
        ),
        (forged.map(str::to_owned).to_vec(), unforged.map(str::to_owned).to_vec(), legs, true),
    ];
    for (edits, mends, check, in_range) in breaks {
        for edit in &edits {
            sqlx::query(edit).execute(&app.raw).await.unwrap();
        }
        let full = app.ledger.audit().await.unwrap();
        let ranged = app.ledger.audit_entries(checkpoint, i64::MAX).await.unwrap();
        for mend in &mends {
            sqlx::query(mend).execute(&app.raw).await.unwrap();
        }
        assert!(full.iter().any(|violation| violation.check.contains(check)), "{edits:?}: {full:#?}");
        if in_range {
            assert!(ranged.iter().any(|violation| violation.check.contains(check)), "{edits:?}: {ranged:#?}");
        }
    }
    assert_eq!(app.ledger.audit().await.unwrap(), Vec::new(), "every edit mended");
}

pub async fn an_audit_from_a_checkpoint_finds_what_breaks_the_entries_written_since(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;
    let checkpoint = app.ledger.settled_entry(i64::MAX).await.unwrap();
    app.pay("m1", "pay-1", "order-1", "alice", "30.00").await.unwrap();
    app.refund("m1", "pay-1", "refund-1", "10.00").await.unwrap();
    let newest = app.ledger.settled_entry(i64::MAX).await.unwrap();
    assert!(checkpoint > 0 && newest > checkpoint, "{checkpoint} {newest}");
    assert_eq!(app.ledger.audit_entries(checkpoint, newest).await.unwrap(), Vec::new());

    // alice's last entry before the range: the range's first entry of alice continues it.
    let before: i64 = sqlx::query_scalar(&format!(
        "SELECT MAX(entry_id) FROM journal_entries WHERE account_id = 'alice' AND entry_id <= {checkpoint}"
    ))
    .fetch_one(&app.raw)
    .await
    .unwrap();
    let breaks = [
        ("journal_entries SET balance_after = balance_after + 1 WHERE entry_id = {newest}", "continues its account"),
        ("journal_entries SET balance_after = balance_after + 1 WHERE entry_id = {before}", "continues its account"),
        ("accounts SET balance = balance + 1 WHERE account_id = 'alice'", "holds its latest entry's balance"),
        (
            "payment_flow SET amount = amount + 1 WHERE out_trade_no = 'pay-1'",
            "deposit, withdrawal or transfer of its amount",
        ),
        ("orders SET refunded_amount = refunded_amount + 1 WHERE order_no = 'order-1'", "its refunds sum"),
    ];
    for (change, check) in breaks {
        let change = change.replace("{newest}", &newest.to_string()).replace("{before}", &before.to_string());
        sqlx::query(&format!("UPDATE {change}")).execute(&app.raw).await.unwrap();
        let violations = app.ledger.audit_entries(checkpoint, newest).await.unwrap();
        let mended = change.replace("+ 1", "- 1");
        sqlx::query(&format!("UPDATE {mended}")).execute(&app.raw).await.unwrap();
        assert!(violations.iter().any(|violation| violation.check.contains(check)), "{change}: {violations:#?}");
    }
    // An order whose row is gone is named, not left out of the join.
    sqlx::query("UPDATE orders SET order_no = 'order-gone' WHERE order_no = 'order-1'")
        .execute(&app.raw)
        .await
        .unwrap();
    let violations = app.ledger.audit_entries(checkpoint, newest).await.unwrap();
    sqlx::query("UPDATE orders SET order_no = 'order-1' WHERE order_no = 'order-gone'")
        .execute(&app.raw)
        .await
        .unwrap();
    assert!(
        violations.iter().any(|violation| violation.subject == "m1/order-1" && violation.detail == "no order"),
        "{violations:#?}"
    );
    // Entries after the range are not read, but every account is: the same break past `newest`
    // is seen by the accounts' check alone.
    sqlx::query("UPDATE accounts SET balance = balance + 1 WHERE account_id = 'alice'")
        .execute(&app.raw)
        .await
        .unwrap();
    let outside = app.ledger.audit_entries(newest, i64::MAX).await.unwrap();
    sqlx::query("UPDATE accounts SET balance = balance - 1 WHERE account_id = 'alice'")
        .execute(&app.raw)
        .await
        .unwrap();
    let alice: Vec<_> = outside.iter().filter(|violation| violation.subject == "alice").collect();
    assert!(!alice.is_empty(), "{outside:#?}");
    assert!(alice.iter().all(|violation| violation.check.contains("holds its latest entry's balance")), "{alice:#?}");
    assert_eq!(app.ledger.audit_entries(checkpoint, newest).await.unwrap(), Vec::new());
}

// ---- Idempotency keys, one-time tokens and their lifecycle -------------------------------

use crate::helpers::{one_dollar_order, transfer_request, with_key, with_token};
use payledger::ledger::{BatchAnswer, BatchCall};

fn header(metadata: &tonic::metadata::MetadataMap, name: &str) -> Option<String> {
    metadata.get(name).and_then(|value| value.to_str().ok()).map(str::to_owned)
}

pub async fn fifty_concurrent_transfers_with_one_idempotency_key_move_money_once(app: &TestApp) {
    app.funded("alice", "100.00").await;
    app.open("bob", "USD").await;

    let calls = (0..50).map(|_| {
        let mut accounts = app.accounts.clone();
        tokio::spawn(async move {
            accounts.transfer(with_key(transfer_request("alice", "bob", "10.00"), "rent-2026-11")).await
        })
    });
    let responses: Vec<_> =
        futures::future::join_all(calls).await.into_iter().map(|joined| joined.unwrap().unwrap()).collect();

    let fresh = responses.iter().filter(|response| !replayed(response)).count();
    assert!(responses.iter().all(|response| header(response.metadata(), "idempotency-expires-at").is_some()));
    let ids: std::collections::HashSet<_> =
        responses.into_iter().map(|response| response.into_inner().transfer.unwrap().transfer_id).collect();
    assert_eq!(fresh, 1);
    assert_eq!(ids.len(), 1, "all 50 callers got the same transfer id");
    assert_eq!(app.balance("alice").await, "90.00");
    assert_eq!(app.balance("bob").await, "10.00");
    assert_eq!(app.rows("transfers").await, 1);
    assert_eq!(app.rows("idempotency_record").await, 1);
    let counters = app.ledger.counters();
    assert_eq!(counters.replays, 49);
    assert_eq!(counters.key_conflicts, 0);
}

pub async fn an_idempotency_key_reused_for_another_request_is_already_exists(app: &TestApp) {
    app.funded("alice", "100.00").await;
    app.open("bob", "USD").await;
    let mut accounts = app.accounts.clone();
    accounts.transfer(with_key(transfer_request("alice", "bob", "10.00"), "k-1")).await.unwrap();

    let other_amount = accounts.transfer(with_key(transfer_request("alice", "bob", "11.00"), "k-1")).await.unwrap_err();
    let deposit = proto::DepositRequest {
        request_id: "d-9".into(),
        account_id: "alice".into(),
        amount: "1.00".into(),
        currency: "USD".into(),
    };
    let other_method = accounts.deposit(with_key(deposit, "k-1")).await.unwrap_err();
    app.funded("carol", "5.00").await;
    let other_scope = accounts.transfer(with_key(transfer_request("carol", "bob", "1.00"), "k-1")).await.unwrap();

    assert_status(&other_amount, Code::AlreadyExists, "IDEMPOTENCY_KEY_REUSED");
    let details = tonic_types::StatusExt::get_error_details(&other_amount);
    assert_eq!(details.error_info().unwrap().metadata.get("fields").map(String::as_str), Some("amount"));
    assert_status(&other_method, Code::AlreadyExists, "IDEMPOTENCY_KEY_REUSED");
    assert!(other_method.message().contains("method"), "{other_method:?}");
    assert!(!replayed(&other_scope), "keys are scoped by caller: carol's k-1 is not alice's");
    assert_eq!(app.balance("alice").await, "90.00");
    assert_eq!(app.ledger.counters().key_conflicts, 2);
}

pub async fn transfer_requires_an_idempotency_key(app: &TestApp) {
    app.funded("alice", "100.00").await;
    app.open("bob", "USD").await;
    let mut accounts = app.accounts.clone();

    let without = accounts.transfer(transfer_request("alice", "bob", "1.00")).await.unwrap_err();
    let to_self = accounts.transfer(with_key(transfer_request("alice", "alice", "1.00"), "k")).await.unwrap_err();
    let mut bad_key = tonic::Request::new(transfer_request("alice", "bob", "1.00"));
    bad_key.metadata_mut().insert("idempotency-key", "x".repeat(129).parse().unwrap());
    let too_long = accounts.transfer(bad_key).await.unwrap_err();

    assert_status(&without, Code::InvalidArgument, "INVALID_ARGUMENT");
    assert_eq!(violated_fields(&without), ["idempotency-key"]);
    assert_eq!(violated_fields(&to_self), ["to_account_id"]);
    assert_eq!(violated_fields(&too_long), ["idempotency-key"]);
    assert_eq!(app.rows("transfers").await, 0);
    assert_eq!(app.balance("alice").await, "100.00");
}

pub async fn a_failed_transfer_leaves_no_record_and_its_retry_runs_afresh(app: &TestApp) {
    app.funded("alice", "5.00").await;
    app.open("bob", "USD").await;
    let mut accounts = app.accounts.clone();

    let refused = accounts.transfer(with_key(transfer_request("alice", "bob", "10.00"), "k-1")).await.unwrap_err();
    let records_after_refusal = app.rows("idempotency_record").await;
    app.deposit("top-up", "alice", "5.00", "USD").await.unwrap();
    let retry = accounts.transfer(with_key(transfer_request("alice", "bob", "10.00"), "k-1")).await.unwrap();

    assert_status(&refused, Code::FailedPrecondition, "INSUFFICIENT_FUNDS");
    assert_eq!(records_after_refusal, 0, "a failed business change records nothing");
    assert!(!replayed(&retry));
    assert_eq!(app.balance("alice").await, "0.00");
    assert_eq!(app.balance("bob").await, "10.00");
}

pub async fn a_pay_with_an_idempotency_key_replays_the_stored_response_and_says_until_when(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;
    let mut payments = app.payments.clone();
    let request = app.pay_request("m1", "pay-1", "order-1", "alice", "30.00");

    let first = payments.pay(with_key(request.clone(), "checkout-1")).await.unwrap();
    let again = payments.pay(with_key(request, "checkout-1")).await.unwrap();

    let expires_at = header(first.metadata(), "idempotency-expires-at").expect("the key's expiry is sent");
    assert!(expires_at.ends_with('Z') && expires_at.contains('T'), "RFC 3339: {expires_at}");
    assert_eq!(header(again.metadata(), "idempotency-expires-at"), Some(expires_at));
    assert!(!replayed(&first) && replayed(&again));
    assert_eq!(first.into_inner(), again.into_inner(), "the stored response comes back unchanged");
    assert_eq!(app.balance("alice").await, "70.00");
}

pub async fn a_duplicate_in_flight_past_the_lock_timeout_is_aborted_then_runs(app: &TestApp) {
    app.funded("alice", "100.00").await;
    app.open("bob", "USD").await;
    // Another request holds the key "k-1" in an open transaction.
    let mut holder = app.raw.begin().await.unwrap();
    let sql = format!(
        "INSERT INTO idempotency_record (scope, idempotency_key, method, request_fingerprint, request_fields, response, status, created_at, expires_at) \
         VALUES ('account:alice', 'k-1', 'Transfer', 'f', {}, NULL, 'IN_PROGRESS', 0, 9000000000000000)",
        app.bytes_literal("")
    );
    sqlx::query(&sql).execute(&mut *holder).await.unwrap();

    let waited =
        app.accounts.clone().transfer(with_key(transfer_request("alice", "bob", "1.00"), "k-1")).await.unwrap_err();
    holder.rollback().await.unwrap();
    let after = app.accounts.clone().transfer(with_key(transfer_request("alice", "bob", "1.00"), "k-1")).await.unwrap();

    assert_eq!(waited.code(), Code::Aborted, "a timed-out wait is ABORTED, never INTERNAL: {waited:?}");
    let retry_info = tonic_types::StatusExt::get_error_details(&waited).retry_info().cloned().expect("RetryInfo");
    let pushback_ms = header(waited.metadata(), "grpc-retry-pushback-ms").expect("a pushback header");
    assert_eq!(
        retry_info.retry_delay.map(|delay| delay.as_millis().to_string()),
        Some(pushback_ms),
        "RetryInfo and the pushback header ask for the same wait"
    );
    assert!(!replayed(&after), "the holder rolled back, so the retry runs");
    assert_eq!(app.balance("alice").await, "99.00");
}

/// 50 different CreateOrder calls present one token: one runs, the others are refused.
async fn one_token_runs_exactly_once(app: &TestApp) {
    app.open("shop", "USD").await;
    let token = app.issue_token("m1").await;

    let calls = (0..50).map(|n| {
        let mut payments = app.payments.clone();
        let token = token.clone();
        let request = proto::CreateOrderRequest {
            merchant_id: "m1".into(),
            order_no: format!("order-{n}"),
            payee_account_id: "shop".into(),
            amount: "1.00".into(),
            currency: "USD".into(),
            subject: String::new(),
            expires_at: None,
        };
        tokio::spawn(async move { (request.clone(), payments.create_order(with_token(request, &token, None)).await) })
    });
    let outcomes: Vec<_> = futures::future::join_all(calls).await.into_iter().map(|joined| joined.unwrap()).collect();

    let winners: Vec<_> = outcomes.iter().filter(|(_, outcome)| outcome.is_ok()).collect();
    assert_eq!(winners.len(), 1, "exactly one request ran: {:?}", outcomes.iter().take(2).collect::<Vec<_>>());
    for (_, outcome) in &outcomes {
        if let Err(status) = outcome {
            assert_status(status, Code::AlreadyExists, "TOKEN_REUSED");
        }
    }
    assert_eq!(app.rows("orders").await, 1);
    let winning_request = winners[0].0.clone();
    let later = app.payments.clone().create_order(with_token(winning_request, &token, None)).await.unwrap();
    assert!(replayed(&later), "a later presentation replays the result");
    assert_eq!(app.ledger.counters().token_consumptions, 1);
}

pub async fn fifty_concurrent_requests_presenting_one_token_run_exactly_once(app: &TestApp) {
    one_token_runs_exactly_once(app).await;
}

pub async fn fifty_concurrent_requests_presenting_one_redis_token_run_exactly_once(app: &TestApp) {
    assert_eq!(app.ledger.token_store().name(), "redis");
    one_token_runs_exactly_once(app).await;
}

pub async fn an_expired_unknown_or_foreign_token_is_token_invalid(app: &TestApp) {
    app.open("shop", "USD").await;
    let order = |order_no: &str| one_dollar_order("m1", order_no, "shop");
    let mut payments = app.payments.clone();
    let foreign = app.issue_token("m2").await;
    let expiring = app.issue_token("m1").await;

    let unknown =
        payments.create_order(with_token(order("o-1"), "0123456789abcdef0123456789abcdef", None)).await.unwrap_err();
    let of_another_merchant = payments.create_order(with_token(order("o-2"), &foreign, None)).await.unwrap_err();
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let expired = payments.create_order(with_token(order("o-3"), &expiring, None)).await.unwrap_err();

    for status in [&unknown, &of_another_merchant, &expired] {
        assert_status(status, Code::FailedPrecondition, "TOKEN_INVALID");
    }
    assert_eq!(app.rows("orders").await, 0);
}

/// Pay without funds presenting a token, then again after a deposit with the same token.
async fn token_survives_a_failed_business_change(app: &TestApp) {
    app.order_ready_to_pay("order-1", "10.00", "30.00").await;
    let token = app.issue_token("m1").await;
    let request = app.pay_request("m1", "pay-1", "order-1", "alice", "30.00");

    let refused = app.payments.clone().pay(with_token(request.clone(), &token, None)).await.unwrap_err();
    app.deposit("top-up", "alice", "20.00", "USD").await.unwrap();
    let paid = app.payments.clone().pay(with_token(request, &token, None)).await.unwrap();

    assert_status(&refused, Code::FailedPrecondition, "INSUFFICIENT_FUNDS");
    assert!(!replayed(&paid));
    assert_eq!(app.balance("alice").await, "0.00");
}

pub async fn a_token_whose_business_change_failed_can_be_presented_again(app: &TestApp) {
    token_survives_a_failed_business_change(app).await;
}

pub async fn a_redis_token_whose_business_change_failed_is_restored(app: &TestApp) {
    assert_eq!(app.ledger.token_store().name(), "redis");
    token_survives_a_failed_business_change(app).await;
}

pub async fn a_redis_token_forgotten_by_a_failover_never_charges_twice(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;
    app.create_order("m1", "order-2", "shop", "30.00").await.unwrap();
    let token = app.issue_token("m1").await;
    let first = app.pay_request("m1", "pay-1", "order-1", "alice", "30.00");
    app.payments.clone().pay(with_token(first.clone(), &token, None)).await.unwrap();

    // A failover promotes a replica that never saw the consumption: the token looks issued.
    let redis_url = std::env::var("PAYLEDGER_TEST_REDIS_URL").unwrap();
    let mut redis = redis::Client::open(redis_url).unwrap().get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("SET")
        .arg(format!("payledger:token:{token}"))
        .arg("i:m1")
        .arg("EX")
        .arg(300)
        .query_async(&mut redis)
        .await
        .unwrap();
    let other = app.pay_request("m1", "pay-2", "order-2", "alice", "30.00");
    let second = app.payments.clone().pay(with_token(other, &token, None)).await.unwrap_err();
    // Or it forgot the token altogether: the identical request is still a replay.
    let _: () = redis::cmd("DEL").arg(format!("payledger:token:{token}")).query_async(&mut redis).await.unwrap();
    let again = app.payments.clone().pay(with_token(first, &token, None)).await.unwrap();

    assert_status(&second, Code::AlreadyExists, "TOKEN_REUSED");
    assert!(replayed(&again));
    assert_eq!(app.balance("alice").await, "70.00", "charged once");
    assert_eq!(app.rows("payment_flow").await, 1);
}

pub async fn the_reaper_deletes_expired_keys_in_batches_while_pays_run(app: &TestApp) {
    app.funded("alice", "1000.00").await;
    app.open("shop", "USD").await;
    for n in 0..40 {
        app.create_order("m1", &format!("order-{n}"), "shop", "1.00").await.unwrap();
    }
    // 1,000 expired keys, written straight into the table in chunks.
    let (no_fields, empty_response) = (app.bytes_literal(""), app.bytes_literal("{}"));
    for chunk in 0..10 {
        let values: Vec<String> = (0..100)
            .map(|n| {
                format!(
                    "('merchant:old', 'k-{chunk}-{n}', 'Pay', 'f', {no_fields}, {empty_response}, 'COMPLETED', 1, 2)"
                )
            })
            .collect();
        let sql = format!(
            "INSERT INTO idempotency_record (scope, idempotency_key, method, request_fingerprint, request_fields, response, status, created_at, expires_at) VALUES {}",
            values.join(", ")
        );
        sqlx::query(&sql).execute(&app.raw).await.unwrap();
    }

    let settings = payledger::ledger::ReaperSettings {
        interval: Duration::from_secs(1),
        batch_size: 100,
        pause: Duration::from_millis(5),
    };
    let reaper = {
        let ledger = app.ledger.clone();
        tokio::spawn(async move { ledger.reap_expired(&settings).await })
    };
    let pays = (0..40).map(|n| {
        let mut payments = app.payments.clone();
        let request = app.pay_request("m1", &format!("pay-{n}"), &format!("order-{n}"), "alice", "1.00");
        tokio::spawn(async move { payments.pay(with_key(request, &format!("key-{n}"))).await })
    });
    let pays = futures::future::join_all(pays).await;
    let report = reaper.await.unwrap().expect("the sweep succeeds");

    for pay in pays {
        pay.unwrap().expect("no Pay fails while the reaper runs");
    }
    assert_eq!(report.records_deleted, 1_000);
    assert!(report.batches >= 10, "deleted in batches of at most 100: {report:?}");
    assert_eq!(app.rows("idempotency_record").await, 40, "only the live keys of the Pays remain");
    assert_eq!(app.ledger.counters().reaper_deletions, 1_000);
    assert_eq!(app.balance("alice").await, "960.00");
}

pub async fn a_pay_retried_after_its_key_expired_is_still_a_replay(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;
    let request = app.pay_request("m1", "pay-1", "order-1", "alice", "30.00");
    let first = app.payments.clone().pay(with_key(request.clone(), "checkout-1")).await.unwrap().into_inner();

    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let report = app.ledger.reap_expired(&payledger::ledger::ReaperSettings::default()).await.unwrap();
    let retry = app.payments.clone().pay(with_key(request, "checkout-1")).await.unwrap();

    assert_eq!(report.records_deleted, 1, "the key expired and was reaped");
    assert!(replayed(&retry), "out_trade_no still stops the second charge");
    assert_eq!(retry.into_inner().payment, first.payment);
    assert_eq!(app.balance("alice").await, "70.00");
}

// ---- The retrying client under faults ------------------------------------------------------

pub async fn a_pay_whose_response_is_lost_is_retried_and_answered_with_the_original_trade_no(app: &TestApp) {
    use payledger::client::{was_replayed, PayledgerClient, RetrySettings};
    use payledger_tools::storm::{FaultProxy, FaultSettings};

    app.order_ready_to_pay("order-1", "100.00", "30.00").await;
    let proxy = FaultProxy::start(app.address, FaultSettings::none()).await.unwrap();
    proxy.drop_next_responses(1);
    let client =
        PayledgerClient::connect_lazy(&format!("http://{}", proxy.address()), RetrySettings::default()).unwrap();

    let response = client.pay(app.pay_request("m1", "pay-1", "order-1", "alice", "30.00")).await.unwrap();

    assert_eq!(proxy.counters().dropped_responses, 1, "the server answered and the answer was lost");
    assert!(client.stats().retries.load(std::sync::atomic::Ordering::Relaxed) >= 1, "the client retried");
    assert!(was_replayed(&response), "the retry was answered from the committed original");
    let stored = app.query("m1", Key::OutTradeNo("pay-1".into())).await.unwrap().payment.unwrap();
    assert_eq!(
        response.into_inner().payment.unwrap().trade_no,
        stored.trade_no,
        "the caller got the original trade_no"
    );
    assert_eq!(app.balance("alice").await, "70.00", "the payer was debited once");
    assert_eq!(app.rows("payment_flow").await, 1);
}

/// Retry settings for the fault cases: attempts bounded by time, not by count (the cases end
/// each call by its deadline), quick backoffs, no throttling.
fn retries_within(per_attempt_timeout: Duration) -> payledger::client::RetrySettings {
    payledger::client::RetrySettings {
        max_attempts: 100,
        initial_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(50),
        per_attempt_timeout,
        throttling: None,
        ..payledger::client::RetrySettings::default()
    }
}

/// Orders `order-1` and `order-2` of 30.00 each, payable by alice (100.00) to shop, and a
/// client with `per_attempt_timeout` reaching the server through a pass-through fault proxy.
async fn two_orders_behind_a_proxy(
    app: &TestApp,
    per_attempt_timeout: Duration,
) -> (payledger_tools::storm::FaultProxy, payledger::client::PayledgerClient) {
    use payledger_tools::storm::{FaultProxy, FaultSettings};
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;
    app.create_order("m1", "order-2", "shop", "30.00").await.unwrap();
    let proxy = FaultProxy::start(app.address, FaultSettings::none()).await.unwrap();
    let target = format!("http://{}", proxy.address());
    let client =
        payledger::client::PayledgerClient::connect_lazy(&target, retries_within(per_attempt_timeout)).unwrap();
    (proxy, client)
}

/// A Pay sent through `client` with a deadline of its own (`Request::set_timeout`).
async fn pay_within(
    client: &payledger::client::PayledgerClient,
    request: proto::PayRequest,
    deadline: Duration,
) -> Result<tonic::Response<proto::PayResponse>, tonic::Status> {
    let mut request = tonic::Request::new(request);
    request.set_timeout(deadline);
    let started = std::time::Instant::now();
    let answer = client.payments().pay(request).await;
    // The caller's deadline, not the client's 15 s default, bounded the retries (with room for
    // a loaded machine).
    assert!(started.elapsed() < deadline + Duration::from_secs(2), "{:?} for {deadline:?}", started.elapsed());
    answer
}

/// A connection cut after the answer's headers, before its message and trailers (what a
/// caller reading the body itself sees as UNKNOWN): the client retries, the retry is answered
/// from the committed Pay, and the money moves once. With every attempt cut, a caller's
/// deadline ends the call DEADLINE_EXCEEDED; the same Pay later is answered once.
pub async fn a_pay_cut_after_its_answers_headers_is_retried_and_moves_the_money_once(app: &TestApp) {
    use payledger::client::was_replayed;
    use payledger_tools::storm::Fault;

    let (proxy, client) = two_orders_behind_a_proxy(app, Duration::from_secs(3)).await;

    proxy.force_next([Fault::CutAfterHeaders]);
    let response = client.pay(app.pay_request("m1", "pay-1", "order-1", "alice", "30.00")).await.unwrap();
    assert_eq!(proxy.counters().cuts_after_headers, 1, "the first answer was cut after its headers");
    assert!(was_replayed(&response), "the retry was answered from the committed Pay");
    assert_eq!(response.into_inner().payment.unwrap().out_trade_no, "pay-1");
    assert_eq!(app.balance("alice").await, "70.00", "debited once");

    proxy.force_next(std::iter::repeat_n(Fault::CutAfterHeaders, 1_000));
    let pay_2 = app.pay_request("m1", "pay-2", "order-2", "alice", "30.00");
    let status = pay_within(&client, pay_2.clone(), Duration::from_millis(400)).await.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(proxy.counters().cuts_after_headers > 2, "it was retried until its deadline");
    proxy.clear_forced();
    let response = client.pay(pay_2).await.unwrap();
    assert!(was_replayed(&response), "the first of the cut attempts had committed");
    assert_eq!(app.balance("alice").await, "40.00", "each Pay debited once");
    assert_eq!(app.rows("payment_flow").await, 2);
    assert!(app.ledger.audit().await.unwrap().is_empty());
}

/// A connection that goes silent (a black hole: nothing forwarded either way, the connection
/// held open): the attempt on it times out, the connection is replaced, and the retry, on
/// another connection, pays once. With every connection silent, a caller's deadline ends the
/// call DEADLINE_EXCEEDED, and nothing moved.
pub async fn a_pay_on_a_connection_gone_silent_is_retried_on_another_and_moves_the_money_once(app: &TestApp) {
    use payledger_tools::storm::Fault;
    use std::sync::atomic::Ordering;

    let (proxy, client) = two_orders_behind_a_proxy(app, Duration::from_millis(500)).await;

    proxy.force_next([Fault::Blackhole]);
    let response = client.pay(app.pay_request("m1", "pay-1", "order-1", "alice", "30.00")).await.unwrap();
    assert_eq!(proxy.counters().blackholes, 1);
    assert_eq!(client.stats().attempts.load(Ordering::Relaxed), 2, "one attempt lost, one answered");
    assert_eq!(client.connections_replaced(), 1, "the silent connection was replaced");
    assert_eq!(response.into_inner().payment.unwrap().out_trade_no, "pay-1");
    assert_eq!(app.balance("alice").await, "70.00", "debited once");

    proxy.force_next(std::iter::repeat_n(Fault::Blackhole, 1_000));
    let pay_2 = app.pay_request("m1", "pay-2", "order-2", "alice", "30.00");
    let status = pay_within(&client, pay_2.clone(), Duration::from_millis(1_200)).await.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(proxy.counters().blackholes >= 3, "each attempt went silent: {:?}", proxy.counters());
    assert_eq!(app.balance("alice").await, "70.00", "no silent attempt reached the server");
    proxy.clear_forced();
    client.pay(pay_2).await.unwrap();
    assert_eq!(app.balance("alice").await, "40.00");
    assert_eq!(app.rows("payment_flow").await, 2);
    assert!(app.ledger.audit().await.unwrap().is_empty());
}

/// Attempts that outlive their deadline on the server (every pooled connection held, so the
/// Pay waits): each is answered DEADLINE_EXCEEDED and retried until the connections are free,
/// and the money moves once. With the connections held past a caller's own deadline, the
/// caller gets DEADLINE_EXCEEDED, never CANCELLED; the same Pay later is answered once.
pub async fn a_pay_whose_attempts_outlive_their_deadline_is_retried_and_moves_the_money_once(app: &TestApp) {
    use std::sync::atomic::Ordering;

    let (_proxy, client) = two_orders_behind_a_proxy(app, Duration::from_millis(300)).await;

    let held = hold_the_pool(app).await;
    let (paid, ()) = tokio::join!(client.pay(app.pay_request("m1", "pay-1", "order-1", "alice", "30.00")), async {
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        drop(held);
    });
    assert_eq!(paid.unwrap().into_inner().payment.unwrap().out_trade_no, "pay-1");
    assert!(client.stats().retries.load(Ordering::Relaxed) >= 2, "the attempts that waited were retried");
    assert_eq!(app.balance("alice").await, "70.00", "debited once");

    let held = hold_the_pool(app).await;
    let pay_2 = app.pay_request("m1", "pay-2", "order-2", "alice", "30.00");
    let status = pay_within(&client, pay_2.clone(), Duration::from_millis(700)).await.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    drop(held);
    client.pay(pay_2).await.unwrap();
    assert_eq!(app.balance("alice").await, "40.00", "each Pay debited once");
    assert_eq!(app.rows("payment_flow").await, 2);
    assert!(app.ledger.audit().await.unwrap().is_empty());
}

/// A caller branches on the typed reason of a refusal ([`payledger::client::CallError`]),
/// with its ErrorInfo metadata and bad fields, without decoding `google.rpc` details itself.
pub async fn a_caller_branches_on_the_typed_reason_of_a_refusal(app: &TestApp) {
    use payledger::client::{CallError, PayledgerClient, Reason, RetrySettings};

    app.order_ready_to_pay("order-1", "10.00", "30.00").await;
    let client = PayledgerClient::connect_lazy(&format!("http://{}", app.address), RetrySettings::default()).unwrap();
    let what_to_do = |status: tonic::Status| match CallError::from(status).reason() {
        Some(Reason::InsufficientFunds) => "ask for another card",
        Some(Reason::OrderAlreadyPaid) => "show the order as paid",
        Some(Reason::InvalidArgument) => "fix the request",
        _ => "report it",
    };

    let short = client.pay(app.pay_request("m1", "pay-1", "order-1", "alice", "30.00")).await.unwrap_err();
    assert_eq!(what_to_do(short), "ask for another card");
    app.deposit("d-1", "alice", "20.00", "USD").await.unwrap();
    client.pay(app.pay_request("m1", "pay-1", "order-1", "alice", "30.00")).await.unwrap();
    let again = client.pay(app.pay_request("m1", "pay-2", "order-1", "alice", "30.00")).await.unwrap_err();
    assert_eq!(what_to_do(again), "show the order as paid");

    let reused =
        CallError::from(client.pay(app.pay_request("m1", "pay-1", "order-1", "alice", "31.00")).await.unwrap_err());
    assert_eq!((reused.code(), reused.reason()), (Code::AlreadyExists, Some(&Reason::OutTradeNoReused)));
    assert_eq!(reused.metadata().get("fields").map(String::as_str), Some("amount"), "{reused}");
    let invalid =
        CallError::from(client.pay(app.pay_request("m1", "pay-3", "order-1", "alice", "-1")).await.unwrap_err());
    assert_eq!(invalid.reason(), Some(&Reason::InvalidArgument));
    assert!(invalid.field_violations().iter().any(|violation| violation.field == "amount"), "{invalid:?}");
    assert_eq!(app.balance("alice").await, "0.00", "paid once");
}

// ---- Benchmark smoke: every scenario runs clean (correctness only, never a timing) ----------

pub async fn every_bench_scenario_runs_clean_and_keeps_the_ledger_sound(app: &TestApp) {
    use payledger::config::Progress;
    use payledger_tools::bench::{bench, BenchSettings, Scenario};

    for (scenario, zipf, rate) in [
        (Scenario::Pay, None, None),
        // Open-loop: calls started at 2,000/s.
        (Scenario::Pay, None, Some(2_000.0)),
        (Scenario::Replay, None, None),
        (Scenario::Hot, None, None),
        (Scenario::Hot, Some(1.1), None),
        (Scenario::Refund, None, None),
        (Scenario::Query, None, None),
        (Scenario::Mixed, None, None),
    ] {
        let settings = BenchSettings {
            target: format!("http://{}", app.address),
            allow_test_data: true,
            scenario,
            concurrency: 8,
            total: 120,
            duration_seconds: None,
            payers: 20,
            merchants: 5,
            zipf,
            duplicate_ratio: 0.2,
            rate,
            connections: 2,
            json: false,
            progress: Progress::Never,
            access: payledger_tools::TargetAccess { token: app.admin_token.clone(), ..Default::default() },
        };
        let report = bench(&settings).await.unwrap();

        assert_eq!(report.count, 120, "{scenario:?}");
        assert_eq!(report.status_codes.keys().collect::<Vec<_>>(), ["Ok"], "{scenario:?}: {:?}", report.status_codes);
        if scenario == Scenario::Replay {
            assert_eq!(report.replays, 120, "every replay call is answered as a replay");
        }
    }
    let violations = app.ledger.audit().await.unwrap();
    assert!(violations.is_empty(), "{violations:#?}");
}

/// A message whose field 1 is bytes: sent where field 1 is a string, it can be invalid UTF-8.
#[derive(Clone, PartialEq, prost::Message)]
struct RawField {
    #[prost(bytes = "vec", tag = "1")]
    value: Vec<u8>,
}

pub async fn a_malformed_protobuf_message_is_invalid_argument(app: &TestApp) {
    let channel =
        tonic::transport::Channel::from_shared(format!("http://{}", app.address)).unwrap().connect().await.unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    // Field 1 of GetAccountRequest is a string; these bytes are not UTF-8.
    let not_utf8 = RawField { value: vec![0xff, 0xfe] };
    let codec = tonic_prost::ProstCodec::<RawField, proto::GetAccountResponse>::default();
    let path = http::uri::PathAndQuery::from_static("/payledger.v1.AccountService/GetAccount");

    let status = grpc.unary(tonic::Request::new(not_utf8), path, codec).await.unwrap_err();

    assert_status(&status, Code::InvalidArgument, "MALFORMED_REQUEST");
}

pub async fn a_call_answered_by_its_natural_key_leaves_no_half_done_idempotency_record(app: &TestApp) {
    app.order_ready_to_pay("order-1", "1000.00", "30.00").await;
    let mut payments = app.payments.clone();
    let close = proto::CloseOrderRequest { merchant_id: "m1".into(), order_no: "order-1".into() };
    app.create_order("m1", "order-2", "shop", "30.00").await.unwrap();
    payments.close_order(close.clone()).await.unwrap();

    // Closing the closed order again, with a new key: answered from the order itself.
    let again = payments.close_order(with_key(close, "k-close")).await.unwrap();
    // Identical Pays, each with its own key: one runs, the rest meet the taken out_trade_no
    // inside their transaction.
    let calls = (0..10).map(|n| {
        let mut payments = app.payments.clone();
        let request = app.pay_request("m1", "pay-2", "order-2", "alice", "30.00");
        tokio::spawn(async move { payments.pay(with_key(request, &format!("k-pay-{n}"))).await })
    });
    let pays: Vec<_> =
        futures::future::join_all(calls).await.into_iter().map(|joined| joined.unwrap().unwrap()).collect();
    // The key of the replayed close is free for another request: not INTERNAL.
    let reused = app.create_order("m1", "order-3", "shop", "1.00").await.map(|_| ());
    let order = proto::CreateOrderRequest {
        merchant_id: "m1".into(),
        order_no: "order-4".into(),
        payee_account_id: "shop".into(),
        amount: "1.00".into(),
        currency: "USD".into(),
        subject: String::new(),
        expires_at: None,
    };
    let with_closed_key = payments.create_order(with_key(order, "k-close")).await;

    assert!(replayed(&again));
    assert_eq!(pays.iter().filter(|response| !replayed(response)).count(), 1);
    reused.unwrap();
    assert!(with_closed_key.is_ok(), "{with_closed_key:?}");
    let in_progress = sqlx::query("SELECT COUNT(*) FROM idempotency_record WHERE status = 'IN_PROGRESS'")
        .fetch_one(&app.raw)
        .await
        .unwrap();
    assert_eq!(sqlx::Row::try_get::<i64, _>(&in_progress, 0).unwrap(), 0, "no record is left half done");
    assert_eq!(app.balance("alice").await, "970.00");
}

// Cases run a second time with group commit off (see `main.rs`).
pub use a_deposit_or_withdraw_replayed_by_its_request_id_answers_the_account_as_it_stood as funding_replays_as_they_stood_one_by_one;
pub use a_failed_transfer_leaves_no_record_and_its_retry_runs_afresh as a_failed_transfer_one_by_one;
pub use callers_reach_only_their_merchants_objects_and_their_own_idempotency_records as callers_are_kept_apart_with_redis_tokens;
pub use concurrent_partial_refunds_never_exceed_the_paid_amount as concurrent_partial_refunds_one_by_one;
pub use concurrent_pays_against_one_balance_never_overdraw_it as concurrent_pays_against_one_balance_one_by_one;
pub use create_order_for_a_missing_payee_is_not_found as create_order_for_a_missing_payee_one_by_one;
pub use create_order_is_replayed_and_other_fields_are_already_exists as create_order_replays_one_by_one;
pub use deposit_credits_the_account_and_a_repeated_request_id_is_a_replay as deposit_replays_one_by_one;
pub use deposit_into_a_missing_account_or_in_another_currency_is_refused as deposit_refusals_one_by_one;
pub use every_bench_scenario_runs_clean_and_keeps_the_ledger_sound as every_bench_scenario_runs_clean_with_a_token;
pub use every_bench_scenario_runs_clean_and_keeps_the_ledger_sound as every_bench_scenario_one_by_one;
pub use every_natural_replay_answers_what_its_original_answered_after_later_steps_moved_its_order as natural_replays_as_they_stood_one_by_one;
pub use fifty_concurrent_requests_presenting_one_token_run_exactly_once as fifty_requests_with_one_token_one_by_one;
pub use fifty_concurrent_transfers_with_one_idempotency_key_move_money_once as fifty_keyed_transfers_one_by_one;
pub use opposite_payments_between_two_accounts_finish_without_deadlock as opposite_payments_between_two_accounts_one_by_one;
pub use partial_then_full_refunds_move_money_back_and_replays_do_not as refunds_one_by_one;
pub use pay_refuses_mismatched_amount_currency_and_self_payment_leaving_nothing as pay_refusals_one_by_one;
pub use pay_without_funds_leaves_nothing_and_succeeds_after_a_deposit as pay_without_funds_one_by_one;
pub use refund_of_an_unknown_payment_or_without_an_amount_is_refused as refund_refusals_one_by_one;
pub use twenty_concurrent_identical_pays_execute_once_with_one_trade_no as twenty_concurrent_identical_pays_one_by_one;

/// With group commit off and four funding shards, concurrent Deposits and Withdraws each run
/// alone (a batch of one): the first call of a shard with no row creates it, concurrent
/// creators of one shard agree on one row, a repeated request_id replays, a Withdraw past the
/// balance is refused, and the books balance.
pub async fn deposits_and_withdrawals_over_new_funding_shards_one_by_one(app: &TestApp) {
    app.open("bob", "USD").await;
    let deposits = (0..16).map(|n| {
        let app_accounts = app.accounts.clone();
        async move {
            let request = proto::DepositRequest {
                request_id: format!("d-{n}"),
                account_id: "bob".into(),
                amount: "1.00".into(),
                currency: "USD".into(),
            };
            app_accounts.clone().deposit(request).await
        }
    });
    let answers = futures::future::join_all(deposits).await;
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    let again = app.deposit("d-3", "bob", "1.00", "USD").await.expect("a replay");
    assert!(replayed(&again));
    let shards = "SELECT COUNT(*) FROM accounts WHERE account_id LIKE '@external:USD%'";
    let shards = sqlx::query_scalar::<_, i64>(shards).fetch_one(&app.raw).await.unwrap();
    assert!((1..=4).contains(&shards), "{shards} shards");
    let withdraw = |request_id: &str, amount: &str| {
        let request = proto::WithdrawRequest {
            request_id: request_id.into(),
            account_id: "bob".into(),
            amount: amount.into(),
            currency: "USD".into(),
        };
        let mut accounts = app.accounts.clone();
        async move { accounts.withdraw(request).await }
    };
    withdraw("w-1", "10.00").await.expect("within the balance");
    let refused = withdraw("w-2", "6.01").await.expect_err("past the balance");
    assert_status(&refused, Code::FailedPrecondition, "INSUFFICIENT_FUNDS");
    assert_eq!(app.balance("bob").await, "6.00");
    assert_eq!(app.rows("deposits").await, 16);
    assert_eq!(app.rows("withdrawals").await, 1);
    assert_eq!(app.ledger.counters().group_commits, 0, "group commit is off");
    assert!(app.ledger.audit().await.unwrap().is_empty());
}

/// A Pay command as the gRPC edge would build it.
fn pay_command(out_trade_no: &str, order_no: &str, payer: &str, amount: &str) -> payledger::ledger::Pay {
    use payledger::domain::{AccountId, Amount, Currency, MerchantId, OrderNo, OutTradeNo};
    let currency = Currency::parse("currency", "USD").unwrap();
    payledger::ledger::Pay {
        merchant_id: MerchantId::parse("merchant_id", "m1").unwrap(),
        out_trade_no: OutTradeNo::parse("out_trade_no", out_trade_no).unwrap(),
        order_no: OrderNo::parse("order_no", order_no).unwrap(),
        payer_account_id: AccountId::parse("payer_account_id", payer).unwrap(),
        amount: Amount::parse("amount", amount, currency).unwrap(),
        created_by: payledger::domain::Actor::Anonymous,
    }
}

pub async fn one_group_commit_decides_each_pay_on_its_own(app: &TestApp) {
    app.funded("alice", "5.00").await;
    app.funded("bob", "100.00").await;
    app.open("shop", "USD").await;
    for order_no in ["o1", "o2", "o3", "o4", "o5", "o6", "o7", "o8", "o-closed"] {
        app.create_order("m1", order_no, "shop", "2.00").await.unwrap();
    }
    let close = proto::CloseOrderRequest { merchant_id: "m1".into(), order_no: "o-closed".into() };
    app.payments.clone().close_order(close).await.unwrap();

    // The set-up's Deposits were group commits of their own.
    let before = app.ledger.counters();
    let answers = app
        .ledger
        .pay_together(vec![
            pay_command("t1", "o1", "alice", "2.00"),
            pay_command("t2", "o2", "alice", "2.00"),
            // alice has 1.00 left: refused, and only this Pay.
            pay_command("t3", "o3", "alice", "2.00"),
            pay_command("t4", "o4", "bob", "2.00"),
            // A second Pay of o1 in the same batch, under another out_trade_no.
            pay_command("t5", "o1", "bob", "2.00"),
            // t1 again, for another order.
            pay_command("t1", "o5", "bob", "2.00"),
            // The very same Pay as the first, in the same batch: a replay of it.
            pay_command("t1", "o1", "alice", "2.00"),
            pay_command("t6", "o6", "bob", "3.00"),
            pay_command("t7", "missing", "bob", "2.00"),
            pay_command("t8", "o7", "carol", "2.00"),
            pay_command("t9", "o-closed", "bob", "2.00"),
            pay_command("t10", "o8", "bob", "2.00"),
        ])
        .await;
    assert_eq!(answers.len(), 12);
    // Through the one error mapping, as a gRPC caller would see them.
    let answers: Vec<_> = answers.into_iter().map(|answer| answer.map_err(tonic::Status::from)).collect();
    let paid = |index: usize, out_trade_no: &str| {
        let answer = answers[index].as_ref().unwrap_or_else(|error| panic!("{out_trade_no}: {error}"));
        assert!(!answer.replayed, "{out_trade_no}");
        assert_eq!(answer.value.payment.out_trade_no, out_trade_no);
        assert_eq!(answer.value.order.status, "PAID");
        assert_eq!(answer.value.order.out_trade_no.as_deref(), Some(out_trade_no));
        answer.value.payment.trade_no.clone()
    };
    let refused = |index: usize, code: Code, reason: &str| {
        assert_status(answers[index].as_ref().expect_err(reason), code, reason);
    };
    let first_trade_no = paid(0, "t1");
    paid(1, "t2");
    refused(2, Code::FailedPrecondition, "INSUFFICIENT_FUNDS");
    paid(3, "t4");
    refused(4, Code::FailedPrecondition, "ORDER_ALREADY_PAID");
    refused(5, Code::AlreadyExists, "OUT_TRADE_NO_REUSED");
    let replay = answers[6].as_ref().expect("the same Pay again is a replay");
    assert!(replay.replayed);
    assert_eq!(replay.value.payment.trade_no, first_trade_no, "the replay answers with the original trade_no");
    refused(7, Code::FailedPrecondition, "AMOUNT_MISMATCH");
    refused(8, Code::NotFound, "ORDER_NOT_FOUND");
    refused(9, Code::NotFound, "ACCOUNT_NOT_FOUND");
    refused(10, Code::FailedPrecondition, "ORDER_CLOSED");
    paid(11, "t10");

    assert_eq!(app.balance("alice").await, "1.00");
    assert_eq!(app.balance("bob").await, "96.00");
    assert_eq!(app.balance("shop").await, "8.00");
    let counters = app.ledger.counters();
    assert_eq!(counters.group_committed_pays, 4, "t1, t2, t4 and t10 in one group commit: {counters:?}");
    assert_eq!(counters.group_commits - before.group_commits, 1);
    // Entries follow the order the balances moved: the shop's four credits are versions 1..=4.
    let balances = app.balances_after("shop").await;
    assert_eq!(balances, ["8.00", "6.00", "4.00", "2.00"], "newest first");
    assert!(app.ledger.audit().await.unwrap().is_empty());

    // Sent again together: every one is a replay with its original trade_no, nothing moves.
    let again = app
        .ledger
        .pay_together(vec![pay_command("t4", "o4", "bob", "2.00"), pay_command("t1", "o1", "alice", "2.00")])
        .await;
    assert!(again.iter().all(|answer| answer.as_ref().is_ok_and(|answer| answer.replayed)), "{again:?}");
    assert_eq!(again[1].as_ref().unwrap().value.payment.trade_no, first_trade_no);
    assert_eq!(app.balance("bob").await, "96.00");
    assert_eq!(app.rows("payment_flow").await, 4);
}

/// The guards of a call: an `idempotency-key` and/or an `idempotency-token`.
fn guards(key: Option<&str>, token: Option<&str>) -> payledger::ledger::Guards {
    use payledger::domain::{IdempotencyKey, OneTimeToken};
    payledger::ledger::Guards {
        idempotency_key: key.map(|key| IdempotencyKey::parse("idempotency-key", key).unwrap()),
        token: token.map(|token| OneTimeToken::parse("idempotency-token", token).unwrap()),
        ..Default::default()
    }
}

pub async fn one_group_commit_of_keyed_and_token_pays_decides_each_on_its_own(app: &TestApp) {
    app.funded("alice", "5.00").await;
    app.funded("bob", "100.00").await;
    app.open("shop", "USD").await;
    for n in 1..=10 {
        app.create_order("m1", &format!("o{n}"), "shop", "2.00").await.unwrap();
    }
    let token = app.issue_token("m1").await;
    let foreign_token = app.issue_token("m2").await;
    let spare_token = app.issue_token("m1").await;
    let pay = |out_trade_no: &str, order_no: &str, payer: &str| pay_command(out_trade_no, order_no, payer, "2.00");

    // The set-up's Deposits were group commits of their own.
    let before = app.ledger.counters();
    let answers = app
        .ledger
        .pay_together_guarded(vec![
            (pay("t1", "o1", "bob"), guards(Some("k1"), None)),
            // Two calls with one key in one batch: the second is answered by the first's record.
            (pay("t1", "o1", "bob"), guards(Some("k1"), None)),
            // The same key for another Pay, in the same batch.
            (pay("t7", "o7", "bob"), guards(Some("k1"), None)),
            (pay("t2", "o2", "alice"), guards(Some("k2"), None)),
            (pay("t3", "o3", "alice"), guards(Some("k3"), None)),
            // alice has 1.00 left: refused, its key left unclaimed.
            (pay("t4", "o4", "alice"), guards(Some("k4"), None)),
            (pay("t5", "o5", "bob"), guards(None, Some(&token))),
            // The same token again, for another Pay, in the same batch.
            (pay("t6", "o6", "bob"), guards(None, Some(&token))),
            // A token issued to another merchant.
            (pay("t8", "o8", "bob"), guards(None, Some(&foreign_token))),
            // A key and a token on a Pay of a missing order: neither is used up.
            (pay("t9", "missing", "bob"), guards(Some("k5"), Some(&spare_token))),
            // A Pay without guards in the same batch.
            (pay("t10", "o9", "bob"), guards(None, None)),
        ])
        .await;
    let answers: Vec<_> = answers.into_iter().map(|answer| answer.map_err(tonic::Status::from)).collect();
    let paid = |index: usize, out_trade_no: &str| {
        let answer = answers[index].as_ref().unwrap_or_else(|error| panic!("{out_trade_no}: {error}"));
        assert!(!answer.replayed, "{out_trade_no}");
        let payment = answer.value.payment.as_ref().unwrap();
        assert_eq!(payment.out_trade_no, out_trade_no);
        assert_eq!(answer.value.order.as_ref().unwrap().status, OrderStatus::Paid as i32);
        payment.trade_no.clone()
    };
    let refused = |index: usize, code: Code, reason: &str| {
        assert_status(answers[index].as_ref().expect_err(reason), code, reason);
    };
    let first = paid(0, "t1");
    let replay = answers[1].as_ref().expect("the same call with its key is a replay");
    assert!(replay.replayed);
    assert_eq!(replay.value.payment.as_ref().unwrap().trade_no, first, "answered by the first call's record");
    refused(2, Code::AlreadyExists, "IDEMPOTENCY_KEY_REUSED");
    paid(3, "t2");
    paid(4, "t3");
    refused(5, Code::FailedPrecondition, "INSUFFICIENT_FUNDS");
    paid(6, "t5");
    refused(7, Code::AlreadyExists, "TOKEN_REUSED");
    refused(8, Code::FailedPrecondition, "TOKEN_INVALID");
    refused(9, Code::NotFound, "ORDER_NOT_FOUND");
    paid(10, "t10");

    let counters = app.ledger.counters();
    assert_eq!(counters.group_committed_pays, 5, "t1, t2, t3, t5 and t10 in one group commit: {counters:?}");
    assert_eq!(counters.group_commits - before.group_commits, 1);
    assert_eq!(app.balance("alice").await, "1.00");
    assert_eq!(app.balance("bob").await, "94.00");
    assert_eq!(app.balance("shop").await, "10.00");
    assert_eq!(app.rows("payment_flow").await, 5);
    // k1, k2, k3 and the token's record: the refused calls left none.
    assert_eq!(app.rows("idempotency_record").await, 4);
    assert!(app.ledger.audit().await.unwrap().is_empty());

    // The refused key runs afresh once alice has the money, and the unused key and token
    // still guard a Pay of their own.
    app.deposit("top-up", "alice", "5.00", "USD").await.unwrap();
    let mut payments = app.payments.clone();
    let retried = payments.pay(with_key(app.pay_request("m1", "t4", "o4", "alice", "2.00"), "k4")).await.unwrap();
    assert!(!replayed(&retried));
    let request = app.pay_request("m1", "t11", "o10", "bob", "2.00");
    let fresh = payments.pay(with_token(request, &spare_token, Some("k5"))).await.unwrap();
    assert!(!replayed(&fresh));
    // Sent again together, the committed calls are replays of their records.
    let again = app
        .ledger
        .pay_together_guarded(vec![
            (pay("t5", "o5", "bob"), guards(None, Some(&token))),
            (pay("t1", "o1", "bob"), guards(Some("k1"), None)),
        ])
        .await;
    let again: Vec<_> = again.into_iter().map(|answer| answer.unwrap()).collect();
    assert!(again.iter().all(|answer| answer.replayed));
    assert_eq!(again[1].value.payment.as_ref().unwrap().trade_no, first);
    assert_eq!(app.balance("bob").await, "92.00");
    assert!(app.ledger.audit().await.unwrap().is_empty());
}

/// The in-flight waits counted when a batch's call finds its key taken by an original that
/// commits under the batch: on a database server the batch's read of the records does not
/// see the uncommitted original, and its claim waits for it (one wait); SQLite has one writer
/// at a time, so the batch's transaction begins only once the original's has committed, and
/// its read finds the record (a replay, no wait).
fn in_flight_waits_of_a_key_taken_under_a_batch(app: &TestApp) -> u64 {
    match app.backend {
        crate::helpers::Backend::Sqlite => 0,
        crate::helpers::Backend::Postgres | crate::helpers::Backend::MySql => 1,
    }
}

/// An original with key `ka` commits while a group commit holding a Pay with `ka` waits to
/// claim it: that Pay is answered by the original's record, and the Pays after it in the
/// batch are applied again without it.
pub async fn a_key_taken_under_a_group_commit_is_replayed_and_the_pays_after_it_are_applied_again(app: &TestApp) {
    use prost::Message as _;
    app.funded("alice", "10.00").await;
    app.funded("bob", "10.00").await;
    app.open("shop", "USD").await;
    app.open("shop2", "USD").await;
    app.create_order("m1", "oa", "shop2", "2.00").await.unwrap();
    app.create_order("m1", "ob", "shop", "2.00").await.unwrap();
    app.create_order("m1", "oc", "shop", "2.00").await.unwrap();

    // The original of ta, as its transaction writes its record, still uncommitted.
    let fields = "out_trade_no=ta\norder_no=oa\npayer_account_id=alice\namount=200\ncurrency=USD\n";
    let original = proto::PayResponse {
        payment: Some(proto::Payment {
            trade_no: "T-original".into(),
            out_trade_no: "ta".into(),
            ..Default::default()
        }),
        order: None,
    };
    let mut holder = app.raw.begin().await.unwrap();
    app.write_record(&mut holder, ("merchant:m1", "ka", "Pay"), fields, &original.encode_to_vec()).await;

    let ledger = app.ledger.clone();
    let batch = tokio::spawn(async move {
        ledger
            .pay_together_guarded(vec![
                (pay_command("ta", "oa", "alice", "2.00"), guards(Some("ka"), None)),
                // shop2 pays with what ta would bring it.
                (pay_command("tb", "ob", "shop2", "2.00"), guards(None, None)),
                (pay_command("tc", "oc", "bob", "2.00"), guards(Some("kc"), None)),
            ])
            .await
    });
    app.wait_for_a_write_waiting_on("idempotency_record").await;
    holder.commit().await.unwrap();
    let answers: Vec<_> = batch.await.unwrap().into_iter().map(|answer| answer.map_err(tonic::Status::from)).collect();

    let ta = answers[0].as_ref().expect("ta is answered by the original's record");
    assert!(ta.replayed);
    assert_eq!(ta.value, original);
    assert_status(answers[1].as_ref().expect_err("tb"), Code::FailedPrecondition, "INSUFFICIENT_FUNDS");
    let tc = answers[2].as_ref().expect("tc is paid");
    assert!(!tc.replayed);
    let counters = app.ledger.counters();
    assert_eq!(counters.in_flight_waits, in_flight_waits_of_a_key_taken_under_a_batch(app), "{counters:?}");
    assert_eq!(counters.group_committed_pays, 1);
    assert_eq!(app.balance("alice").await, "10.00");
    assert_eq!(app.balance("shop2").await, "0.00");
    assert_eq!(app.balance("bob").await, "8.00");
    assert_eq!(app.balance("shop").await, "2.00");
    assert_eq!(app.rows("payment_flow").await, 1);
    assert!(app.ledger.audit().await.unwrap().is_empty());
}

/// A Refund command, in USD unless `currency` says otherwise.
fn refund_command(out_trade_no: &str, out_refund_no: &str, amount: &str, currency: &str) -> payledger::ledger::Refund {
    use payledger::domain::{Amount, Currency, FreeText, MerchantId, OutRefundNo, OutTradeNo};
    let currency = Currency::parse("currency", currency).unwrap();
    payledger::ledger::Refund {
        merchant_id: MerchantId::parse("merchant_id", "m1").unwrap(),
        out_trade_no: OutTradeNo::parse("out_trade_no", out_trade_no).unwrap(),
        out_refund_no: OutRefundNo::parse("out_refund_no", out_refund_no).unwrap(),
        amount: Amount::parse("amount", amount, currency).unwrap(),
        reason: FreeText::parse("reason", "batched").unwrap(),
        created_by: payledger::domain::Actor::Anonymous,
    }
}

/// The response of a batch's answer of the kind `pick` takes, fresh or replayed as
/// `replayed` says.
fn batch_response<T: Clone>(
    answer: &Result<payledger::ledger::Replayable<BatchAnswer>, tonic::Status>,
    replayed: bool,
    pick: fn(&BatchAnswer) -> Option<&T>,
) -> T {
    let answer = answer.as_ref().unwrap_or_else(|error| panic!("{error}"));
    assert_eq!(answer.replayed, replayed, "{answer:?}");
    pick(&answer.value).unwrap_or_else(|| panic!("answered as another call: {answer:?}")).clone()
}

/// The refund of a batch's answer, fresh or replayed as `replayed` says.
fn refunded(
    answer: &Result<payledger::ledger::Replayable<BatchAnswer>, tonic::Status>,
    replayed: bool,
) -> proto::RefundResponse {
    batch_response(answer, replayed, |answer| match answer {
        BatchAnswer::Refund(response) => Some(response),
        _ => None,
    })
}

pub async fn one_group_commit_of_pays_and_refunds_decides_each_on_its_own(app: &TestApp) {
    app.funded("alice", "20.00").await;
    app.funded("bob", "10.00").await;
    app.open("shop", "USD").await;
    app.open("lean", "USD").await;
    app.open("carol", "USD").await;
    for (order_no, payee, amount) in [
        ("o1", "shop", "5.00"),
        ("o2", "shop", "5.00"),
        ("o3", "shop", "2.00"),
        ("o6", "lean", "3.00"),
        ("o7", "lean", "2.00"),
    ] {
        app.create_order("m1", order_no, payee, amount).await.unwrap();
    }
    let mut payments = app.payments.clone();
    for (out_trade_no, order_no, payer, amount) in
        [("t1", "o1", "alice", "5.00"), ("t2", "o2", "alice", "5.00"), ("t6", "o6", "bob", "3.00")]
    {
        payments.pay(app.pay_request("m1", out_trade_no, order_no, payer, amount)).await.unwrap();
    }
    // lean keeps 1.00 of the 3.00 it was paid.
    app.accounts.clone().transfer(with_key(transfer_request("lean", "carol", "2.00"), "move-out")).await.unwrap();
    let token = app.issue_token("m1").await;
    let before = app.ledger.counters();

    let refund = |out_trade_no: &str, out_refund_no: &str, amount: &str| {
        BatchCall::Refund(refund_command(out_trade_no, out_refund_no, amount, "USD"))
    };
    let answers = app
        .ledger
        .write_together(vec![
            (refund("t1", "r1", "1.00"), guards(Some("kr1"), None)),
            // A second refund of one order in one batch: applied after the first.
            (refund("t1", "r2", "4.00"), guards(None, None)),
            // o1 is refunded in full by the two before it.
            (refund("t1", "r3", "1.00"), guards(None, None)),
            // r1 again, the same request without its key: a replay of it.
            (refund("t1", "r1", "1.00"), guards(None, None)),
            (BatchCall::Refund(refund_command("t2", "r4", "1.00", "EUR")), guards(None, None)),
            (BatchCall::Pay(pay_command("t3", "o3", "alice", "2.00")), guards(Some("kp3"), None)),
            // A refund of the Pay just before it, in the same batch.
            (refund("t3", "r5", "1.00"), guards(None, None)),
            (refund("t-missing", "r6", "1.00"), guards(None, None)),
            // The key of r1 for another refund, in the same batch.
            (refund("t2", "r7", "1.00"), guards(Some("kr1"), None)),
            (refund("t2", "r8", "2.00"), guards(None, Some(&token))),
            // The same token again, for another refund.
            (refund("t2", "r9", "1.00"), guards(None, Some(&token))),
            // lean has 1.00 of the 3.00: refused; the Pay after it brings lean 2.00, so the
            // refund after that fits.
            (refund("t6", "r10", "3.00"), guards(None, None)),
            (BatchCall::Pay(pay_command("t7", "o7", "bob", "2.00")), guards(None, None)),
            (refund("t6", "r11", "2.00"), guards(Some("kr11"), None)),
        ])
        .await;
    let answers: Vec<_> = answers.into_iter().map(|answer| answer.map_err(tonic::Status::from)).collect();
    let refused = |index: usize, code: Code, reason: &str| {
        assert_status(answers[index].as_ref().expect_err(reason), code, reason);
    };
    let r1 = refunded(&answers[0], false);
    assert_eq!(r1.order.as_ref().unwrap().status, OrderStatus::PartiallyRefunded as i32);
    assert_eq!(r1.order.as_ref().unwrap().refunded_amount, "1.00");
    let r2 = refunded(&answers[1], false);
    assert_eq!(r2.order.as_ref().unwrap().status, OrderStatus::Refunded as i32, "r2 applies after r1");
    assert_eq!(r2.order.as_ref().unwrap().refunded_amount, "5.00");
    refused(2, Code::FailedPrecondition, "REFUND_EXCEEDS_PAID");
    let r1_again = refunded(&answers[3], true);
    assert_eq!(r1_again.refund.as_ref().unwrap().refund_no, r1.refund.as_ref().unwrap().refund_no);
    refused(4, Code::FailedPrecondition, "CURRENCY_MISMATCH");
    match &answers[5].as_ref().expect("t3 is paid").value {
        BatchAnswer::Pay(response) => assert_eq!(response.payment.as_ref().unwrap().out_trade_no, "t3"),
        other => panic!("a Pay answered as another call: {other:?}"),
    }
    let r5 = refunded(&answers[6], false);
    assert_eq!(r5.order.as_ref().unwrap().refunded_amount, "1.00", "r5 ran alone after t3 committed");
    refused(7, Code::NotFound, "PAYMENT_NOT_FOUND");
    refused(8, Code::AlreadyExists, "IDEMPOTENCY_KEY_REUSED");
    refunded(&answers[9], false);
    refused(10, Code::AlreadyExists, "TOKEN_REUSED");
    refused(11, Code::FailedPrecondition, "INSUFFICIENT_FUNDS");
    assert!(answers[12].is_ok(), "t7: {:?}", answers[12]);
    let r11 = refunded(&answers[13], false);
    assert_eq!(r11.order.as_ref().unwrap().refunded_amount, "2.00", "r10 left o6 as it was");

    let counters = app.ledger.counters();
    let refunds = counters.group_committed_refunds - before.group_committed_refunds;
    let pays = counters.group_committed_pays - before.group_committed_pays;
    assert_eq!((refunds, pays), (4, 2), "r1, r2, r8, r11, t3 and t7 in one group commit: {counters:?}");
    assert_eq!(counters.group_commits - before.group_commits, 1);
    // alice: 20 - 5 - 5 (t1, t2), then r1 + r2, t3, r8, and r5 alone after the batch.
    assert_eq!(app.balance("alice").await, "16.00");
    assert_eq!(app.balance("shop").await, "4.00");
    assert_eq!(app.balance("bob").await, "7.00");
    assert_eq!(app.balance("lean").await, "1.00");
    assert_eq!(app.rows("refunds").await, 5);
    // kr1, kp3, kr11, the token's record and the Transfer's key: the refused calls left none.
    assert_eq!(app.rows("idempotency_record").await, 5);
    // The shop's entries follow the order its balance moved: t1, t2, r1, r2, t3, r8, r5.
    let balances = app.balances_after("shop").await;
    assert_eq!(balances, ["4.00", "5.00", "7.00", "5.00", "9.00", "10.00", "5.00"], "newest first");
    assert!(app.ledger.audit().await.unwrap().is_empty());

    // Sent again together, the committed refunds are replays, by their key or out_refund_no.
    let again = app
        .ledger
        .write_together(vec![
            (refund("t1", "r1", "1.00"), guards(Some("kr1"), None)),
            (refund("t1", "r2", "4.00"), guards(None, None)),
            (refund("t6", "r11", "2.00"), guards(Some("kr11"), None)),
        ])
        .await;
    let again: Vec<_> = again.into_iter().map(|answer| answer.map_err(tonic::Status::from)).collect();
    assert_eq!(refunded(&again[0], true).refund.unwrap().refund_no, r1.refund.unwrap().refund_no);
    assert_eq!(refunded(&again[1], true).refund.unwrap().refund_no, r2.refund.unwrap().refund_no);
    assert_eq!(refunded(&again[2], true).refund.unwrap().refund_no, r11.refund.unwrap().refund_no);
    assert_eq!(app.balance("alice").await, "16.00");
    assert_eq!(app.rows("refunds").await, 5);
}

/// A Refund commits its row while a group commit holding a Refund with the same
/// out_refund_no waits for the order's lock: that Refund is a replay of it, and the batch's
/// other refund of the order applies on top of it.
pub async fn a_refund_committed_under_a_group_commit_is_replayed_and_the_next_refund_applies_on_top(app: &TestApp) {
    app.funded("alice", "10.00").await;
    app.open("shop", "USD").await;
    app.create_order("m1", "o1", "shop", "5.00").await.unwrap();
    app.payments.clone().pay(app.pay_request("m1", "t1", "o1", "alice", "5.00")).await.unwrap();

    // The other writer of ra: it holds o1's row lock, writes its refund row and moves the
    // order, and commits once the batch waits for that lock.
    let mut holder = app.raw.begin().await.unwrap();
    let lock = match app.backend {
        crate::helpers::Backend::Sqlite => None,
        _ => Some("SELECT status FROM orders WHERE merchant_id = 'm1' AND order_no = 'o1' FOR UPDATE"),
    };
    if let Some(lock) = lock {
        sqlx::query(lock).execute(&mut *holder).await.unwrap();
    }
    // The whole of ra, as its own transaction writes it: the row, the order's refund CAS,
    // 1.00 from shop back to alice by version CAS, and the two journal entries.
    let writes = [
        "INSERT INTO refunds (refund_no, merchant_id, out_refund_no, out_trade_no, order_no, amount, currency, reason, \
         created_at, created_by) VALUES ('R-original', 'm1', 'ra', 't1', 'o1', 100, 'USD', 'batched', 1, 'anonymous')",
        "UPDATE orders SET status = 'PARTIALLY_REFUNDED', refunded_amount = 100 WHERE merchant_id = 'm1' AND order_no = 'o1'",
    ];
    for write in writes {
        sqlx::query(write).execute(&mut *holder).await.unwrap();
    }
    let legs = [("shop", "alice", -100), ("alice", "shop", 100)];
    app.write_posting(&mut holder, ("REFUND", "ra", "R-original"), legs).await;
    let ledger = app.ledger.clone();
    let batch = tokio::spawn(async move {
        ledger
            .write_together(vec![
                (BatchCall::Refund(refund_command("t1", "ra", "1.00", "USD")), guards(None, None)),
                (BatchCall::Refund(refund_command("t1", "rb", "2.00", "USD")), guards(Some("kb"), None)),
            ])
            .await
    });
    app.wait_for_a_session_in("%orders%FOR%UPDATE%").await;
    holder.commit().await.unwrap();
    let answers: Vec<_> = batch.await.unwrap().into_iter().map(|answer| answer.map_err(tonic::Status::from)).collect();

    let ra = refunded(&answers[0], true);
    assert_eq!(ra.refund.as_ref().unwrap().refund_no, "R-original", "answered by the committed row");
    let rb = refunded(&answers[1], false);
    assert_eq!(rb.order.as_ref().unwrap().refunded_amount, "3.00", "rb applies on top of ra");
    assert_eq!(app.ledger.counters().group_committed_refunds, 1);
    assert_eq!(app.rows("refunds").await, 2);
    assert_eq!(app.balance("alice").await, "8.00");
    assert_eq!(app.balance("shop").await, "2.00");
    assert!(app.ledger.audit().await.unwrap().is_empty());
}

/// A Transfer command from `from` to `to`, in USD.
fn transfer_command(from: &str, to: &str, amount: &str) -> payledger::ledger::Transfer {
    transfer_by(from, to, amount, &payledger::domain::Actor::Anonymous)
}

/// A Transfer of `amount` USD, memo "rent", made by `actor`.
fn transfer_by(from: &str, to: &str, amount: &str, actor: &payledger::domain::Actor) -> payledger::ledger::Transfer {
    use payledger::domain::{AccountId, Amount, Currency, FreeText};
    let currency = Currency::parse("currency", "USD").unwrap();
    payledger::ledger::Transfer {
        from_account_id: AccountId::parse("from_account_id", from).unwrap(),
        to_account_id: AccountId::parse("to_account_id", to).unwrap(),
        amount: Amount::parse("amount", amount, currency).unwrap(),
        memo: FreeText::parse("memo", "rent").unwrap(),
        created_by: actor.clone(),
    }
}

/// The transfer of a batch's answer, fresh or replayed as `replayed` says.
fn transferred(
    answer: &Result<payledger::ledger::Replayable<BatchAnswer>, tonic::Status>,
    replayed: bool,
) -> proto::TransferResponse {
    batch_response(answer, replayed, |answer| match answer {
        BatchAnswer::Transfer(response) => Some(response),
        _ => None,
    })
}

pub async fn one_group_commit_of_transfers_and_pays_decides_each_on_its_own(app: &TestApp) {
    app.funded("alice", "10.00").await;
    app.funded("bob", "5.00").await;
    app.open("shop", "USD").await;
    app.open("euro", "EUR").await;
    app.create_order("m1", "o1", "shop", "2.00").await.unwrap();
    let transfer = |from: &str, to: &str, amount: &str| BatchCall::Transfer(transfer_command(from, to, amount));

    // The set-up's Deposits were group commits of their own.
    let before = app.ledger.counters();
    let answers = app
        .ledger
        .write_together(vec![
            (transfer("alice", "bob", "3.00"), guards(Some("x1"), None)),
            // Two calls with one key in one batch: the second is answered by the first's record.
            (transfer("alice", "bob", "3.00"), guards(Some("x1"), None)),
            // The same key for another Transfer, in the same batch.
            (transfer("alice", "bob", "1.00"), guards(Some("x1"), None)),
            // bob can send 7.00 only with the 3.00 the first Transfer brought him.
            (transfer("bob", "shop", "7.00"), guards(Some("x2"), None)),
            // bob has 1.00 left: refused, its key left unclaimed.
            (transfer("bob", "shop", "2.00"), guards(Some("x3"), None)),
            (transfer("alice", "euro", "1.00"), guards(Some("x4"), None)),
            (transfer("alice", "nobody", "1.00"), guards(Some("x5"), None)),
            // A Transfer without a key.
            (transfer("alice", "bob", "1.00"), guards(None, None)),
            // A Pay in the same batch, into shop.
            (BatchCall::Pay(pay_command("t1", "o1", "alice", "2.00")), guards(None, None)),
            // shop sends on what the Transfer and the Pay before it brought it.
            (transfer("shop", "alice", "9.00"), guards(Some("x6"), None)),
        ])
        .await;
    let answers: Vec<_> = answers.into_iter().map(|answer| answer.map_err(tonic::Status::from)).collect();
    let refused = |index: usize, code: Code, reason: &str| {
        assert_status(answers[index].as_ref().expect_err(reason), code, reason);
    };
    let first = transferred(&answers[0], false);
    let replay = transferred(&answers[1], true);
    assert_eq!(replay, first, "answered by the first call's record, exactly");
    refused(2, Code::AlreadyExists, "IDEMPOTENCY_KEY_REUSED");
    let bobs = transferred(&answers[3], false);
    refused(4, Code::FailedPrecondition, "INSUFFICIENT_FUNDS");
    refused(5, Code::FailedPrecondition, "CURRENCY_MISMATCH");
    refused(6, Code::NotFound, "ACCOUNT_NOT_FOUND");
    assert_eq!(answers[7].as_ref().expect_err("no key").code(), Code::InvalidArgument);
    assert!(answers[8].is_ok(), "{:?}", answers[8]);
    let shops = transferred(&answers[9], false);

    // Each receipt's entries are the journal's, with the balance right after each leg.
    let legs = |response: &proto::TransferResponse| {
        let transfer_id = &response.transfer.as_ref().unwrap().transfer_id;
        let [from, to] = [response.from_entry.as_ref().unwrap(), response.to_entry.as_ref().unwrap()];
        assert!(from.posting_id == *transfer_id && to.posting_id == *transfer_id, "{response:?}");
        assert!(from.entry_id > 0 && to.entry_id > from.entry_id, "{response:?}");
        [(from.account_id.clone(), from.balance_after.clone()), (to.account_id.clone(), to.balance_after.clone())]
    };
    assert_eq!(legs(&first), [("alice".into(), "7.00".into()), ("bob".into(), "8.00".into())]);
    assert_eq!(legs(&bobs), [("bob".into(), "1.00".into()), ("shop".into(), "7.00".into())]);
    assert_eq!(legs(&shops), [("shop".into(), "0.00".into()), ("alice".into(), "14.00".into())]);
    let request = proto::ListEntriesRequest { account_id: "shop".into(), page_size: 10, page_token: String::new() };
    let journal = app.accounts.clone().list_entries(request).await.unwrap().into_inner().entries;
    assert_eq!(journal.first(), shops.from_entry.as_ref(), "the newest entry of shop is the receipt's");
    assert!(journal.contains(bobs.to_entry.as_ref().unwrap()));

    let counters = app.ledger.counters();
    assert_eq!(counters.group_committed_transfers, 3, "x1, x2 and x6 in one group commit: {counters:?}");
    assert_eq!(counters.group_committed_pays, 1);
    assert_eq!(counters.group_commits - before.group_commits, 1);
    assert_eq!(app.balance("alice").await, "14.00");
    assert_eq!(app.balance("bob").await, "1.00");
    assert_eq!(app.balance("shop").await, "0.00");
    assert_eq!(app.rows("transfers").await, 3);
    // x1, x2 and x6: the refused calls left no record.
    assert_eq!(app.rows("idempotency_record").await, 3);
    assert!(app.ledger.audit().await.unwrap().is_empty());

    // The refused key runs afresh once bob has the money; the committed ones replay their
    // records over the wire exactly as the batch answered them.
    app.deposit("top-up", "bob", "5.00", "USD").await.unwrap();
    let mut accounts = app.accounts.clone();
    let retried = accounts.transfer(with_key(transfer_request("bob", "shop", "2.00"), "x3")).await.unwrap();
    assert!(!replayed(&retried));
    let again = accounts.transfer(with_key(transfer_request("alice", "bob", "3.00"), "x1")).await.unwrap();
    assert!(replayed(&again));
    assert_eq!(again.into_inner(), first);
    assert_eq!(app.balance("bob").await, "4.00");
    assert!(app.ledger.audit().await.unwrap().is_empty());
}

/// An original Transfer with key `xa` commits while a group commit holding a Transfer with
/// `xa` waits to claim it: that Transfer is answered by the original's record, and the one
/// after it in the batch is applied again without it (it now has the money).
pub async fn a_key_taken_under_a_group_commit_is_replayed_and_the_transfers_after_it_are_applied_again(app: &TestApp) {
    use prost::Message as _;
    app.funded("alice", "10.00").await;
    app.open("bob", "USD").await;
    app.open("shop", "USD").await;

    // The original of xa, as its transaction writes its record, still uncommitted.
    let fields = "from_account_id=alice\nto_account_id=bob\namount=800\ncurrency=USD\nmemo=rent\n";
    let original = proto::TransferResponse {
        transfer: Some(proto::Transfer { transfer_id: "X-original".into(), ..Default::default() }),
        from_entry: None,
        to_entry: None,
    };
    let mut holder = app.raw.begin().await.unwrap();
    app.write_record(&mut holder, ("account:alice", "xa", "Transfer"), fields, &original.encode_to_vec()).await;

    let ledger = app.ledger.clone();
    let batch = tokio::spawn(async move {
        ledger
            .write_together(vec![
                (BatchCall::Transfer(transfer_command("alice", "bob", "8.00")), guards(Some("xa"), None)),
                // Refused if xa were applied first: alice would have 2.00 left.
                (BatchCall::Transfer(transfer_command("alice", "shop", "5.00")), guards(Some("xb"), None)),
            ])
            .await
    });
    app.wait_for_a_write_waiting_on("idempotency_record").await;
    holder.commit().await.unwrap();
    let answers: Vec<_> = batch.await.unwrap().into_iter().map(|answer| answer.map_err(tonic::Status::from)).collect();

    let xa = transferred(&answers[0], true);
    assert_eq!(xa, original, "answered by the original's record");
    let xb = transferred(&answers[1], false);
    assert_eq!(xb.from_entry.as_ref().unwrap().balance_after, "5.00", "xb applied without xa");
    let counters = app.ledger.counters();
    assert_eq!(counters.in_flight_waits, in_flight_waits_of_a_key_taken_under_a_batch(app), "{counters:?}");
    assert_eq!(counters.group_committed_transfers, 1);
    assert_eq!(app.balance("alice").await, "5.00");
    assert_eq!(app.balance("bob").await, "0.00");
    assert_eq!(app.balance("shop").await, "5.00");
    assert_eq!(app.rows("transfers").await, 1);
    assert!(app.ledger.audit().await.unwrap().is_empty());
}

/// A retry of a Transfer whose pre-check ran before its original committed, and whose batch
/// then finds the money gone (the original moved it): the batch refuses it on the state the
/// original left, so it runs alone, where its key is claimed first, as on the single-call
/// path, and it is answered by the original's record instead of INSUFFICIENT_FUNDS.
pub async fn a_transfer_retried_while_its_original_commits_is_replayed_not_refused(app: &TestApp) {
    use prost::Message as _;
    app.funded("alice", "10.00").await;
    app.open("bob", "USD").await;

    // The original of xr, as its own transaction writes it: alice's and bob's rows locked,
    // its record, its transfer row, both balances by version CAS and both entries; not yet
    // committed.
    let fields = "from_account_id=alice\nto_account_id=bob\namount=1000\ncurrency=USD\nmemo=rent\n";
    let original = proto::TransferResponse {
        transfer: Some(proto::Transfer { transfer_id: "X-original".into(), ..Default::default() }),
        from_entry: None,
        to_entry: None,
    };
    let mut holder = app.raw.begin().await.unwrap();
    if app.backend != crate::helpers::Backend::Sqlite {
        let lock = "SELECT balance FROM accounts WHERE account_id IN ('alice', 'bob') ORDER BY account_id FOR UPDATE";
        sqlx::query(lock).execute(&mut *holder).await.unwrap();
    }
    app.write_record(&mut holder, ("account:alice", "xr", "Transfer"), fields, &original.encode_to_vec()).await;
    let transfer = "INSERT INTO transfers (transfer_id, from_account_id, to_account_id, amount, currency, memo, \
                    created_at, created_by) VALUES ('X-original', 'alice', 'bob', 1000, 'USD', 'rent', 1, 'anonymous')";
    sqlx::query(transfer).execute(&mut *holder).await.unwrap();
    let legs = [("alice", "bob", -1000), ("bob", "alice", 1000)];
    app.write_posting(&mut holder, ("TRANSFER", "X-original", "X-original"), legs).await;

    // The retry: its check finds no record (the original has not committed), so it queues.
    let ledger = app.ledger.clone();
    let retry = tokio::spawn(async move {
        let call = (BatchCall::Transfer(transfer_command("alice", "bob", "10.00")), guards(Some("xr"), None));
        ledger.write_together(vec![call]).await
    });
    app.wait_for_a_session_in("%accounts%FOR%UPDATE%").await;
    holder.commit().await.unwrap();
    let answers: Vec<_> = retry.await.unwrap().into_iter().map(|answer| answer.map_err(tonic::Status::from)).collect();

    assert_eq!(transferred(&answers[0], true), original, "answered by the original's record");
    assert_eq!(app.ledger.counters().group_committed_transfers, 0);
    assert_eq!(app.balance("alice").await, "0.00");
    assert_eq!(app.balance("bob").await, "10.00");
    assert_eq!(app.rows("transfers").await, 1);
    assert!(app.ledger.audit().await.unwrap().is_empty());
}

/// A Deposit (`withdraw` false) or Withdraw command of `amount` in `currency`.
fn funding_command(request_id: &str, account_id: &str, amount: &str, currency: &str, withdraw: bool) -> BatchCall {
    use payledger::domain::{AccountId, Actor, Amount, Currency, RequestId};
    let request_id = RequestId::parse("request_id", request_id).unwrap();
    let account_id = AccountId::parse("account_id", account_id).unwrap();
    let amount = Amount::parse("amount", amount, Currency::parse("currency", currency).unwrap()).unwrap();
    let created_by = Actor::Anonymous;
    if withdraw {
        BatchCall::Withdraw(payledger::ledger::Withdraw { request_id, account_id, amount, created_by })
    } else {
        BatchCall::Deposit(payledger::ledger::Deposit { request_id, account_id, amount, created_by })
    }
}

/// The (account, entry) of a batch's Deposit or Withdraw answer, fresh or replayed as
/// `replayed` says.
fn funded(
    answer: &Result<payledger::ledger::Replayable<BatchAnswer>, tonic::Status>,
    replayed: bool,
) -> (proto::Account, proto::Entry) {
    match batch_response(answer, replayed, |answer| Some(answer)) {
        BatchAnswer::Deposit(proto::DepositResponse { account, entry })
        | BatchAnswer::Withdraw(proto::WithdrawResponse { account, entry }) => (account.unwrap(), entry.unwrap()),
        other => panic!("answered as another call: {other:?}"),
    }
}

/// The balance of the USD funding account (shard 0), in minor units, read directly.
async fn funding_balance(app: &TestApp) -> i64 {
    sqlx::query_scalar("SELECT balance FROM accounts WHERE account_id = '@external:USD'")
        .fetch_one(&app.raw)
        .await
        .unwrap()
}

pub async fn one_group_commit_of_deposits_and_withdrawals_decides_each_on_its_own(app: &TestApp) {
    app.funded("alice", "10.00").await;
    app.open("bob", "USD").await;
    app.open("euro", "EUR").await;
    let deposit = |request_id: &str, account_id: &str, amount: &str| {
        funding_command(request_id, account_id, amount, "USD", false)
    };
    let withdraw =
        |request_id: &str, account_id: &str, amount: &str| funding_command(request_id, account_id, amount, "USD", true);

    let answers = app
        .ledger
        .write_together(vec![
            (deposit("d1", "bob", "5.00"), guards(None, None)),
            // One request_id twice in one batch: the second is a replay of the first.
            (deposit("d1", "bob", "5.00"), guards(None, None)),
            // And once more for another amount.
            (deposit("d1", "bob", "6.00"), guards(None, None)),
            // bob can withdraw 4.00 only with the 5.00 that d1 brought him.
            (withdraw("w1", "bob", "4.00"), guards(None, None)),
            // bob has 1.00 left: refused (alone, where its key is claimed first), no record left.
            (withdraw("w2", "bob", "2.00"), guards(Some("kw2"), None)),
            (deposit("d2", "euro", "1.00"), guards(None, None)),
            (deposit("d3", "nobody", "1.00"), guards(None, None)),
            // A Deposit with an idempotency key: its record is completed in the batch.
            (deposit("d4", "alice", "1.00"), guards(Some("kd4"), None)),
            // A Withdraw's request_ids are its own: the request_id of alice's first Deposit.
            (withdraw("fund-alice", "alice", "2.00"), guards(None, None)),
            // A Deposit committed before the batch: the batch finds its request_id, and it is
            // answered by it after the batch.
            (deposit("fund-alice", "alice", "10.00"), guards(None, None)),
            (BatchCall::Transfer(transfer_command("alice", "bob", "3.00")), guards(Some("x1"), None)),
            // bob withdraws what the Transfer before it brought him.
            (withdraw("w3", "bob", "4.00"), guards(Some("kw3"), None)),
            // d4's key for another Deposit.
            (deposit("d5", "alice", "1.00"), guards(Some("kd4"), None)),
        ])
        .await;
    let answers: Vec<_> = answers.into_iter().map(|answer| answer.map_err(tonic::Status::from)).collect();
    let refused = |index: usize, code: Code, reason: &str| {
        assert_status(answers[index].as_ref().expect_err(reason), code, reason);
    };
    let d1 = funded(&answers[0], false);
    assert_eq!(funded(&answers[1], true), d1, "answered as the first call of d1, exactly");
    refused(2, Code::AlreadyExists, "REQUEST_ID_REUSED");
    let w1 = funded(&answers[3], false);
    refused(4, Code::FailedPrecondition, "INSUFFICIENT_FUNDS");
    refused(5, Code::FailedPrecondition, "CURRENCY_MISMATCH");
    refused(6, Code::NotFound, "ACCOUNT_NOT_FOUND");
    let d4 = funded(&answers[7], false);
    let alice_out = funded(&answers[8], false);
    let _ = funded(&answers[9], true);
    assert!(answers[10].is_ok(), "{:?}", answers[10]);
    let w3 = funded(&answers[11], false);
    refused(12, Code::AlreadyExists, "IDEMPOTENCY_KEY_REUSED");

    // Each receipt is the account right after its entry, and the entry is the journal's.
    let after = |(account, entry): &(proto::Account, proto::Entry)| {
        assert_eq!(account.balance, entry.balance_after, "{account:?} {entry:?}");
        assert_eq!(account.version, entry.version_after, "{account:?} {entry:?}");
        assert!(entry.entry_id > 0 && !entry.posting_id.is_empty(), "{entry:?}");
        (entry.account_id.clone(), entry.kind, entry.amount.clone(), entry.balance_after.clone())
    };
    assert_eq!(after(&d1), ("bob".into(), EntryKind::Deposit as i32, "5.00".into(), "5.00".into()));
    assert_eq!(after(&w1), ("bob".into(), EntryKind::Withdrawal as i32, "-4.00".into(), "1.00".into()));
    assert_eq!(after(&d4), ("alice".into(), EntryKind::Deposit as i32, "1.00".into(), "11.00".into()));
    assert_eq!(after(&alice_out), ("alice".into(), EntryKind::Withdrawal as i32, "-2.00".into(), "9.00".into()));
    assert_eq!(after(&w3), ("bob".into(), EntryKind::Withdrawal as i32, "-4.00".into(), "0.00".into()));
    let request = proto::ListEntriesRequest { account_id: "bob".into(), page_size: 10, page_token: String::new() };
    let journal = app.accounts.clone().list_entries(request).await.unwrap().into_inner().entries;
    assert_eq!(journal.len(), 4, "{journal:?}");
    assert_eq!([&journal[0], &journal[2], &journal[3]], [&w3.1, &w1.1, &d1.1], "the receipts' entries, newest first");

    let counters = app.ledger.counters();
    // alice's first Deposit was a batch of its own, then d1 and d4 in one group commit.
    assert_eq!(counters.group_committed_deposits, 1 + 2, "{counters:?}");
    assert_eq!(counters.group_committed_withdrawals, 3, "w1, alice's and w3: {counters:?}");
    assert_eq!(counters.group_committed_transfers, 1);
    assert_eq!(counters.group_commits, 2);
    assert_eq!(app.balance("alice").await, "6.00");
    assert_eq!(app.balance("bob").await, "0.00");
    assert_eq!(funding_balance(app).await, -1000 - 500 - 100 + 400 + 200 + 400);
    assert_eq!(app.rows("deposits").await, 3);
    assert_eq!(app.rows("withdrawals").await, 3);
    // kd4, x1 and kw3.
    assert_eq!(app.rows("idempotency_record").await, 3);
    assert!(app.ledger.audit().await.unwrap().is_empty());

    // Over the wire, a retry by request_id rebuilds the batch's answer, and one by key replays
    // its record, exactly.
    let by_request_id = app.deposit("d1", "bob", "5.00", "USD").await.unwrap();
    assert!(replayed(&by_request_id));
    let by_request_id = by_request_id.into_inner();
    assert_eq!((by_request_id.account.unwrap(), by_request_id.entry.unwrap()), d1);
    let request = proto::DepositRequest {
        request_id: "d4".into(),
        account_id: "alice".into(),
        amount: "1.00".into(),
        currency: "USD".into(),
    };
    let by_key = app.accounts.clone().deposit(with_key(request, "kd4")).await.unwrap();
    assert!(replayed(&by_key));
    let by_key = by_key.into_inner();
    assert_eq!((by_key.account.unwrap(), by_key.entry.unwrap()), d4);
    let request = proto::WithdrawRequest {
        request_id: "w3".into(),
        account_id: "bob".into(),
        amount: "4.00".into(),
        currency: "USD".into(),
    };
    let by_key = app.accounts.clone().withdraw(with_key(request, "kw3")).await.unwrap();
    assert!(replayed(&by_key));
    let by_key = by_key.into_inner();
    assert_eq!((by_key.account.unwrap(), by_key.entry.unwrap()), w3);
    assert_eq!(app.rows("journal_entries").await, 2 * (3 + 3 + 1));
}

/// A Deposit of request_id `dz` commits while a group commit that holds a Deposit of `dz`
/// waits for the funding account's lock: the batch finds `dz` taken once it holds the lock,
/// answers that call by request_id, and writes the Withdraw after it, which has the money
/// only with the committed `dz`.
pub async fn a_request_id_taken_under_a_group_commit_is_replayed_and_the_rest_of_it_commits(app: &TestApp) {
    app.open("bob", "USD").await;

    // The original of dz, as its own transaction writes it: both accounts locked, its row,
    // both balances and both entries; not yet committed.
    let mut holder = app.raw.begin().await.unwrap();
    if app.backend != crate::helpers::Backend::Sqlite {
        let lock =
            "SELECT balance FROM accounts WHERE account_id IN ('@external:USD', 'bob') ORDER BY account_id FOR UPDATE";
        sqlx::query(lock).execute(&mut *holder).await.unwrap();
    }
    let deposit =
        "INSERT INTO deposits (request_id, deposit_id, account_id, amount, currency, created_at, created_by) \
                   VALUES ('dz', 'D-original', 'bob', 500, 'USD', 1, 'anonymous')";
    sqlx::query(deposit).execute(&mut *holder).await.unwrap();
    let legs = [("@external:USD", "bob", -500), ("bob", "@external:USD", 500)];
    app.write_posting(&mut holder, ("DEPOSIT", "dz", "D-original"), legs).await;

    let ledger = app.ledger.clone();
    let batch = tokio::spawn(async move {
        ledger
            .write_together(vec![
                (funding_command("dz", "bob", "5.00", "USD", false), guards(None, None)),
                (funding_command("wz", "bob", "5.00", "USD", true), guards(None, None)),
            ])
            .await
    });
    app.wait_for_a_session_in("%accounts%FOR%UPDATE%").await;
    holder.commit().await.unwrap();
    let answers: Vec<_> = batch.await.unwrap().into_iter().map(|answer| answer.map_err(tonic::Status::from)).collect();

    let (account, entry) = funded(&answers[0], true);
    assert_eq!((entry.posting_id.as_str(), account.balance.as_str()), ("D-original", "5.00"), "the original's answer");
    let (account, entry) = funded(&answers[1], false);
    assert_eq!((entry.kind, account.balance.as_str()), (EntryKind::Withdrawal as i32, "0.00"));
    let counters = app.ledger.counters();
    assert_eq!(counters.group_committed_withdrawals, 1, "wz committed by the batch, not alone: {counters:?}");
    assert_eq!(counters.group_committed_deposits, 0);
    assert_eq!(app.balance("bob").await, "0.00");
    assert_eq!(funding_balance(app).await, 0);
    assert_eq!(app.rows("deposits").await, 1);
    assert_eq!(app.rows("withdrawals").await, 1);
    assert!(app.ledger.audit().await.unwrap().is_empty());
}

/// A Withdraw refused (bob has nothing) while another call's Withdraw of its request_id is in
/// flight without a lock the refused one needs (here it withdraws from carol; a server of an
/// earlier version inserted a request_id before it locked its accounts): the batch's read
/// does not see it, the batch refuses the Withdraw, which then runs alone, is refused again,
/// and inserts its request_id before it answers: that insert waits for the other call, and
/// once it commits, the Withdraw is answered by it (REQUEST_ID_REUSED: another account), not
/// INSUFFICIENT_FUNDS. Nothing of the refused Withdraw is written.
pub async fn a_refused_withdraw_waits_for_its_request_id_in_flight_and_is_answered_by_it(app: &TestApp) {
    let refused = withdraw_bob_while_carol_holds_its_request_id(app, "wq", true).await;
    let refused = refused.expect_err("answered by the committed original");
    assert_status(&refused, Code::AlreadyExists, "REQUEST_ID_REUSED");
    assert!(refused.message().contains("account_id"), "{refused:?}");
    assert_eq!(app.balance("bob").await, "0.00");
    assert_eq!(app.rows("withdrawals").await, 1, "the original's only");
    assert_eq!(app.rows("journal_entries").await, 0);
    // The stand-in original moved no money: its row goes, for the audit after the test.
    sqlx::query("DELETE FROM withdrawals WHERE request_id = 'wq'").execute(&app.raw).await.unwrap();
}

/// The same refused Withdraw while the other call holding its request_id rolls back: its
/// probe insert then takes the request_id, and the refusal stands (INSUFFICIENT_FUNDS), with
/// nothing of the Withdraw written (the probe rolls back with it).
pub async fn a_refused_withdraw_whose_request_id_in_flight_rolls_back_stays_refused(app: &TestApp) {
    let refused = withdraw_bob_while_carol_holds_its_request_id(app, "wr", false).await;
    let refused = refused.expect_err("bob has nothing to withdraw");
    assert_status(&refused, Code::FailedPrecondition, "INSUFFICIENT_FUNDS");
    assert_eq!(app.balance("bob").await, "0.00");
    assert_eq!(app.rows("withdrawals").await, 0, "neither the other call's nor the probe's");
    assert_eq!(app.rows("journal_entries").await, 0);
}

/// A Withdraw of 5.00 from bob (who has nothing), in a batch, while an uncommitted Withdraw of
/// carol's holds `request_id`; once the Withdraw waits on that request_id, the holder commits
/// (`commit`) or rolls back. The Withdraw's answer.
async fn withdraw_bob_while_carol_holds_its_request_id(
    app: &TestApp,
    request_id: &'static str,
    commit: bool,
) -> Result<payledger::ledger::Replayable<BatchAnswer>, tonic::Status> {
    app.open("bob", "USD").await;
    app.open("carol", "USD").await;
    let mut holder = app.raw.begin().await.unwrap();
    let original = format!(
        "INSERT INTO withdrawals (request_id, withdrawal_id, account_id, amount, currency, created_at, created_by) \
         VALUES ('{request_id}', 'W-original', 'carol', 500, 'USD', 1, 'anonymous')"
    );
    sqlx::query(&original).execute(&mut *holder).await.unwrap();

    let ledger = app.ledger.clone();
    let batch = tokio::spawn(async move {
        let withdraw = funding_command(request_id, "bob", "5.00", "USD", true);
        ledger.write_together(vec![(withdraw, guards(None, None))]).await
    });
    app.wait_for_a_write_waiting_on("withdrawals").await;
    if commit {
        holder.commit().await.unwrap();
    } else {
        holder.rollback().await.unwrap();
    }
    let mut answers = batch.await.unwrap();
    answers.pop().expect("one answer").map_err(tonic::Status::from)
}

/// With group commit off, a Pay refused alone (alice has nothing) while another order's Pay
/// holds its out_trade_no, not yet committed: the refused Pay inserts its key before it
/// answers, waits for the other, and once that commits is answered OUT_TRADE_NO_REUSED (the
/// key names another order), not INSUFFICIENT_FUNDS; nothing of it is written.
pub async fn a_refused_pay_waits_for_its_out_trade_no_in_flight_and_is_answered_by_it(app: &TestApp) {
    app.open("alice", "USD").await;
    app.open("shop", "USD").await;
    app.create_order("m1", "order-1", "shop", "10.00").await.unwrap();
    app.create_order("m1", "order-2", "shop", "10.00").await.unwrap();
    let mut holder = app.raw.begin().await.unwrap();
    let other = "INSERT INTO payment_flow (trade_no, merchant_id, out_trade_no, order_no, payer_account_id, \
                 payee_account_id, amount, currency, status, created_at, created_by) VALUES ('T-other', 'm1', \
                 'pay-x', 'order-2', 'alice', 'shop', 1000, 'USD', 'SUCCEEDED', 1, 'anonymous')";
    sqlx::query(other).execute(&mut *holder).await.unwrap();

    let mut payments = app.payments.clone();
    let request = app.pay_request("m1", "pay-x", "order-1", "alice", "10.00");
    let pay = tokio::spawn(async move { payments.pay(request).await });
    app.wait_for_a_write_waiting_on("payment_flow").await;
    holder.commit().await.unwrap();
    let refused = pay.await.unwrap().expect_err("answered by the key's holder");

    assert_status(&refused, Code::AlreadyExists, "OUT_TRADE_NO_REUSED");
    assert!(refused.message().contains("order_no"), "{refused:?}");
    assert_eq!(app.balance("alice").await, "0.00");
    assert_eq!(app.rows("payment_flow").await, 1, "the other's only");
    assert_eq!(app.rows("journal_entries").await, 0);
    // The stand-in moved no money: its row goes, for the audit after the test.
    sqlx::query("DELETE FROM payment_flow WHERE trade_no = 'T-other'").execute(&app.raw).await.unwrap();
}

/// With four funding shards, a Deposit whose shard has no row yet runs alone (its transaction
/// creates the shard); once every shard exists, Deposits of every shard share one batch.
pub async fn deposits_over_funding_shards_are_group_committed_once_each_shard_exists(app: &TestApp) {
    app.open("bob", "USD").await;
    let shards = || async {
        let sql = "SELECT COUNT(*) FROM accounts WHERE account_id LIKE '@external:USD%'";
        sqlx::query_scalar::<_, i64>(sql).fetch_one(&app.raw).await.unwrap()
    };
    let batch = |prefix: &'static str| {
        (0..8).map(move |n| (funding_command(&format!("{prefix}{n}"), "bob", "1.00", "USD", false), guards(None, None)))
    };
    let first: Vec<_> = app.ledger.write_together(batch("first-").collect()).await;
    let first: Vec<_> = first.into_iter().map(|answer| answer.map_err(tonic::Status::from)).collect();
    // Each entry's counterparty names the shard its Deposit moved: those of shard 0, which
    // OpenAccount created, were batched; the others ran alone.
    let on_shard_0 = first.iter().filter(|answer| funded(answer, false).1.counterparty_account_id == "@external:USD");
    let on_shard_0 = on_shard_0.count() as u64;
    assert!(shards().await > 1, "a shard other than the first was created");
    let counters = app.ledger.counters();
    assert_eq!(counters.group_committed_deposits, on_shard_0, "{counters:?}");
    assert_eq!(counters.group_commits, u64::from(on_shard_0 > 0), "{counters:?}");
    // Then more Deposits, one at a time, until every shard exists.
    let mut n = 0;
    while shards().await < 4 {
        app.deposit(&format!("warm-{n}"), "bob", "1.00", "USD").await.unwrap();
        n += 1;
        assert!(n < 200, "four shards after 200 Deposits");
    }
    let before = app.ledger.counters();
    let second: Vec<_> = app.ledger.write_together(batch("second-").collect()).await;
    assert!(second.iter().all(|answer| answer.as_ref().is_ok_and(|answer| !answer.replayed)), "{second:?}");
    let after = app.ledger.counters();
    assert_eq!(after.group_committed_deposits - before.group_committed_deposits, 8, "{after:?}");
    assert_eq!(after.group_commits - before.group_commits, 1, "{after:?}");
    assert_eq!(app.balance("bob").await, format!("{}.00", 16 + n));
    assert!(app.ledger.audit().await.unwrap().is_empty());
}

pub async fn concurrent_pays_to_one_merchant_are_grouped_and_each_moves_money_once(app: &TestApp) {
    app.open("shop", "USD").await;
    for n in 0..40 {
        app.funded(&format!("payer-{n}"), "10.00").await;
        app.create_order("m1", &format!("o{n}"), "shop", "1.00").await.unwrap();
    }
    // Each Pay is sent twice at once: 80 concurrent calls for 40 payments.
    let calls = (0..80).map(|call| {
        let n = call % 40;
        let request = app.pay_request("m1", &format!("t{n}"), &format!("o{n}"), &format!("payer-{n}"), "1.00");
        let mut payments = app.payments.clone();
        async move { (n, payments.pay(request).await) }
    });
    let answers = futures::future::join_all(calls).await;
    let mut trade_nos = std::collections::BTreeMap::new();
    for (n, answer) in answers {
        let payment = answer.expect("every Pay succeeds or is replayed").into_inner().payment.unwrap();
        let first = trade_nos.entry(n).or_insert_with(|| payment.trade_no.clone());
        assert_eq!(*first, payment.trade_no, "both sends of t{n} answer with one trade_no");
    }
    assert_eq!(trade_nos.len(), 40);
    assert_eq!(app.balance("shop").await, "40.00");
    for n in 0..40 {
        assert_eq!(app.balance(&format!("payer-{n}")).await, "9.00");
    }
    assert_eq!(app.rows("payment_flow").await, 40);
    assert_eq!(app.ledger.counters().group_committed_pays, 40, "every fresh Pay went through a group commit");
    assert!(app.ledger.audit().await.unwrap().is_empty());
}

// ---- Identifiers compare byte for byte; ambiguous input is refused ------------------------

/// The `transfer_id` of a successful Transfer.
fn transfer_id(response: tonic::Response<proto::TransferResponse>) -> String {
    response.into_inner().transfer.unwrap().transfer_id
}

pub async fn idempotency_keys_that_differ_by_spaces_or_case_mean_the_same_on_every_backend(app: &TestApp) {
    app.funded("alice", "10.00").await;
    app.open("bob", "USD").await;
    let mut accounts = app.accounts.clone();
    let transfer = |key: &str, amount: &str| with_key(transfer_request("alice", "bob", amount), key);

    let plain = accounts.transfer(transfer("k", "1.00")).await.unwrap();
    let trailing_space = accounts.transfer(transfer("k ", "1.00")).await.unwrap_err();
    let trailing_space_other_amount = accounts.transfer(transfer("k ", "2.00")).await.unwrap_err();
    let leading_space = accounts.transfer(transfer(" k", "1.00")).await.unwrap_err();
    let upper_case = accounts.transfer(transfer("K", "1.00")).await.unwrap();
    let upper_case_again = accounts.transfer(transfer("K", "1.00")).await.unwrap();
    let one_inner_space = accounts.transfer(transfer("a b", "1.00")).await.unwrap();
    let two_inner_spaces = accounts.transfer(transfer("a  b", "1.00")).await.unwrap();
    let longest_key = "k".repeat(128);
    let longest = accounts.transfer(transfer(&longest_key, "1.00")).await.unwrap();
    let longest_again = accounts.transfer(transfer(&longest_key, "1.00")).await.unwrap();
    let one_too_long = accounts.transfer(transfer(&"k".repeat(129), "1.00")).await.unwrap_err();

    for refused in [&trailing_space, &trailing_space_other_amount, &leading_space, &one_too_long] {
        assert_status(refused, Code::InvalidArgument, "INVALID_ARGUMENT");
        assert_eq!(violated_fields(refused), ["idempotency-key"]);
    }
    assert!(!replayed(&plain) && !replayed(&upper_case) && !replayed(&one_inner_space) && !replayed(&longest));
    assert!(replayed(&upper_case_again) && replayed(&longest_again));
    let ids: Vec<String> =
        [plain, upper_case, one_inner_space, two_inner_spaces, longest].into_iter().map(transfer_id).collect();
    let distinct: std::collections::HashSet<_> = ids.iter().collect();
    assert_eq!(distinct.len(), 5, "k, K, 'a b', 'a  b' and the 128-character key are five keys");
    assert_eq!(transfer_id(upper_case_again), ids[1]);
    assert_eq!(transfer_id(longest_again), ids[4]);
    assert_eq!(app.balance("alice").await, "5.00");
    assert_eq!(app.balance("bob").await, "5.00");
    assert_eq!(app.rows("transfers").await, 5);
    assert_eq!(app.rows("idempotency_record").await, 5);
}

pub async fn business_numbers_tokens_and_currencies_compare_byte_for_byte_on_every_backend(app: &TestApp) {
    let mut accounts = app.accounts.clone();
    let mut payments = app.payments.clone();
    // Account ids: "alice" and "Alice" are two accounts.
    app.funded("alice", "100.00").await;
    app.open("Alice", "USD").await;
    app.open("shop", "USD").await;
    // Request ids: "dep" and "DEP" are two deposits.
    let dep = app.deposit("dep", "Alice", "1.00", "USD").await.unwrap();
    let dep_upper = app.deposit("DEP", "Alice", "1.00", "USD").await.unwrap();
    // Merchant ids and order numbers: each case-distinct pair is two orders.
    for (merchant, order_no) in [("m1", "o-1"), ("M1", "o-1"), ("m1", "O-1")] {
        assert!(!replayed(&app.create_order(merchant, order_no, "shop", "10.00").await.unwrap()));
    }
    // out_trade_no: "P-1" and "p-1" are two payments.
    let paid = app.pay("m1", "P-1", "o-1", "alice", "10.00").await.unwrap();
    let paid_lower = app.pay("m1", "p-1", "O-1", "alice", "10.00").await.unwrap();
    let paid_other_merchant = app.pay("M1", "P-1", "o-1", "alice", "10.00").await.unwrap();
    // out_refund_no: "R-1" and "r-1" are two refunds.
    let refund = app.refund("m1", "P-1", "R-1", "1.00").await.unwrap();
    let refund_lower = app.refund("m1", "P-1", "r-1", "1.00").await.unwrap();
    // The longest business numbers are stored and found whole.
    let (long_order, long_trade) = ("o".repeat(64), "t".repeat(64));
    app.create_order("m1", &long_order, "shop", "1.00").await.unwrap();
    app.pay("m1", &long_trade, &long_order, "alice", "1.00").await.unwrap();
    let found = app.query("m1", Key::OutTradeNo(long_trade.clone())).await.unwrap();
    // A space at either end, or another case of a currency code, is refused everywhere.
    let spaced = [
        app.pay("m1", "p-2 ", "o-1", "alice", "10.00").await.unwrap_err(),
        app.pay("m1", " p-2", "o-1", "alice", "10.00").await.unwrap_err(),
        app.deposit("dep ", "Alice", "1.00", "USD").await.unwrap_err(),
        app.deposit("dep", "Alice ", "1.00", "USD").await.unwrap_err(),
        app.deposit("dep-3", "Alice", "1.00", "usd").await.unwrap_err(),
        app.deposit("dep-3", "Alice", "1.00", "USD ").await.unwrap_err(),
    ];
    // Tokens: another case of an issued token is an unknown token; a space makes it no token.
    let token = app.issue_token("m1").await;
    let order = |order_no: &str| one_dollar_order("m1", order_no, "shop");
    let upper_token = payments.create_order(with_token(order("o-t"), &token.to_uppercase(), None)).await.unwrap_err();
    let spaced_token = payments.create_order(with_token(order("o-t"), &format!("{token} "), None)).await.unwrap_err();
    let with_token_as_issued = payments.create_order(with_token(order("o-t"), &token, None)).await.unwrap();
    let other_currency = accounts
        .open_account(proto::OpenAccountRequest { account_id: "alice".into(), currency: "usd".into() })
        .await
        .unwrap_err();

    assert!(!replayed(&dep) && !replayed(&dep_upper));
    let trade_nos: std::collections::HashSet<_> = [paid, paid_lower, paid_other_merchant]
        .into_iter()
        .map(|response| response.into_inner().payment.unwrap().trade_no)
        .collect();
    assert_eq!(trade_nos.len(), 3);
    assert_ne!(refund.into_inner().refund.unwrap().refund_no, refund_lower.into_inner().refund.unwrap().refund_no);
    assert_eq!(found.payment.unwrap().out_trade_no, long_trade);
    assert_eq!(found.order.unwrap().order_no, long_order);
    for status in spaced.iter().chain([&spaced_token, &other_currency]) {
        assert_status(status, Code::InvalidArgument, "INVALID_ARGUMENT");
    }
    assert_status(&upper_token, Code::FailedPrecondition, "TOKEN_INVALID");
    assert!(!replayed(&with_token_as_issued), "the refused presentations did not consume the token");
    // alice paid 10 + 10 + 10 + 1 and got 2 back; Alice holds her two deposits.
    assert_eq!(app.balance("alice").await, "71.00");
    assert_eq!(app.balance("Alice").await, "2.00");
    assert_eq!(app.balance("shop").await, "29.00");
    assert_eq!(app.rows("orders").await, 5);
    assert_eq!(app.rows("refunds").await, 2);
}

pub async fn ambiguous_headers_and_page_tokens_are_invalid_argument_and_write_nothing(app: &TestApp) {
    use tonic::metadata::{AsciiMetadataValue, BinaryMetadataValue};
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;
    let token = app.issue_token("m1").await;
    let before = app.all_rows().await;
    let mut payments = app.payments.clone();
    let pay = || tonic::Request::new(app.pay_request("m1", "pay-1", "order-1", "alice", "30.00"));
    let ascii = |text: &str| text.parse::<AsciiMetadataValue>().unwrap();

    let mut key_twice_same = pay();
    key_twice_same.metadata_mut().append("idempotency-key", ascii("k-1"));
    key_twice_same.metadata_mut().append("idempotency-key", ascii("k-1"));
    let mut key_twice_different = pay();
    key_twice_different.metadata_mut().append("idempotency-key", ascii("k-1"));
    key_twice_different.metadata_mut().append("idempotency-key", ascii("k-2"));
    let mut token_twice = pay();
    token_twice.metadata_mut().append("idempotency-token", ascii(&token));
    token_twice.metadata_mut().append("idempotency-token", ascii(&token));
    let mut binary_key = pay();
    binary_key.metadata_mut().insert_bin("idempotency-key-bin", BinaryMetadataValue::from_bytes(b"k-1"));
    let mut binary_token = pay();
    binary_token.metadata_mut().insert_bin("idempotency-token-bin", BinaryMetadataValue::from_bytes(token.as_bytes()));
    let mut comma_key = pay();
    comma_key.metadata_mut().insert("idempotency-key", ascii("k-1,k-2"));
    let mut tab_key = pay();
    tab_key.metadata_mut().insert("idempotency-key", ascii("k-1\t"));
    let mut non_ascii_key = pay();
    non_ascii_key.metadata_mut().insert("idempotency-key", AsciiMetadataValue::try_from(&b"caf\xe9"[..]).unwrap());

    let mut refusals = Vec::new();
    for (header, request) in [
        ("idempotency-key", key_twice_same),
        ("idempotency-key", key_twice_different),
        ("idempotency-token", token_twice),
        ("idempotency-key", binary_key),
        ("idempotency-token", binary_token),
        ("idempotency-key", comma_key),
        ("idempotency-key", tab_key),
        ("idempotency-key", non_ascii_key),
    ] {
        refusals.push((header, payments.pay(request).await.unwrap_err()));
    }
    let mut page_token_refusals = Vec::new();
    for page_token in ["01", "+1", " 1", "1 ", "0"] {
        let request =
            proto::ListEntriesRequest { account_id: "alice".into(), page_size: 1, page_token: page_token.into() };
        page_token_refusals.push(app.accounts.clone().list_entries(request).await.unwrap_err());
    }
    let rows_after_refusals = app.all_rows().await;
    let records_after_refusals = app.rows("idempotency_record").await;
    let paid_with_the_token = payments.pay(with_token(pay().into_inner(), &token, None)).await.unwrap();

    for (header, status) in &refusals {
        assert_status(status, Code::InvalidArgument, "INVALID_ARGUMENT");
        assert_eq!(violated_fields(status), [*header], "{status:?}");
    }
    for status in &page_token_refusals {
        assert_status(status, Code::InvalidArgument, "INVALID_ARGUMENT");
        assert_eq!(violated_fields(status), ["page_token"]);
    }
    assert_eq!(rows_after_refusals, before, "nothing written");
    assert_eq!(records_after_refusals, 0, "no idempotency record claimed");
    assert!(!replayed(&paid_with_the_token), "no refusal consumed the token or paid the order");
    assert_eq!(app.balance("alice").await, "70.00");
}

/// A keyed Pay's record as the release before stored-response messages wrote it: the answer
/// as JSON of rows, no message. Ids and times are its own, so a replay from it is told apart.
const PAY_RECORD_OF_THE_PREVIOUS_RELEASE: &str = r#"{"payment":{"trade_no":"T0000000000000000000000000000old1","merchant_id":"m1","out_trade_no":"pay-1","order_no":"order-1","payer_account_id":"alice","payee_account_id":"shop","amount":3000,"currency":"USD","status":"SUCCEEDED","created_at":1764460800000000},"order":{"merchant_id":"m1","order_no":"order-1","payee_account_id":"shop","amount":3000,"currency":"USD","subject":"order order-1","status":"PAID","out_trade_no":"pay-1","refunded_amount":0,"created_at":1764460000000000,"updated_at":1764460800000000}}"#;

pub async fn records_replay_the_response_as_sent_and_records_of_the_previous_release_still_replay(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;
    app.create_order("m1", "order-2", "shop", "20.00").await.unwrap();
    let mut payments = app.payments.clone();
    let pay_1 = app.pay_request("m1", "pay-1", "order-1", "alice", "30.00");
    let pay_2 = app.pay_request("m1", "pay-2", "order-2", "alice", "20.00");
    payments.pay(with_key(pay_1.clone(), "k-old")).await.unwrap();
    let sent = payments.pay(with_key(pay_2.clone(), "k-new")).await.unwrap().into_inner();
    assert_eq!(app.rows("idempotency_record").await, 2);
    assert_eq!(app.records_with_a_json_copy().await, 0, "a record keeps the response message alone");
    // k-old as the previous release left it; k-new's JSON copy ruined, so that only its
    // stored message can answer.
    let rewrite = |key: &str, json: &str| {
        format!(
            "UPDATE idempotency_record SET response = {}, response_message = NULL WHERE idempotency_key = '{key}'",
            app.bytes_literal(json)
        )
    };
    sqlx::query(&rewrite("k-old", PAY_RECORD_OF_THE_PREVIOUS_RELEASE)).execute(&app.raw).await.unwrap();
    let ruin_json = format!(
        "UPDATE idempotency_record SET response = {} WHERE idempotency_key = 'k-new'",
        app.bytes_literal("not json")
    );
    sqlx::query(&ruin_json).execute(&app.raw).await.unwrap();

    let old = payments.pay(with_key(pay_1, "k-old")).await.unwrap();
    let new = payments.pay(with_key(pay_2, "k-new")).await.unwrap();

    assert!(replayed(&old) && replayed(&new));
    assert!(header(old.metadata(), "idempotency-expires-at").is_some());
    let old = old.into_inner();
    let payment = old.payment.unwrap();
    assert_eq!(payment.trade_no, "T0000000000000000000000000000old1", "answered from the old record");
    assert_eq!((payment.amount.as_str(), payment.currency.as_str()), ("30.00", "USD"));
    assert_eq!(payment.created_at.unwrap().seconds, 1_764_460_800);
    assert_eq!(old.order.unwrap().status, OrderStatus::Paid as i32);
    assert_eq!(new.into_inner(), sent, "the stored message is the response as first sent");
    assert_eq!(app.balance("alice").await, "50.00", "nothing paid twice");
}

/// Sends one gRPC call over raw HTTP/2, with `headers` in the HEADERS frame and `trailers`
/// after the message (tonic's client cannot send request trailers); returns its grpc-status.
async fn raw_call_with_trailers(
    app: &TestApp,
    path: &str,
    message: &impl prost::Message,
    headers: &[(&str, &str)],
    trailers: &[(&'static str, &str)],
) -> String {
    let tcp = tokio::net::TcpStream::connect(app.address).await.unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let mut client = client.ready().await.unwrap();
    let mut request = http::Request::post(format!("http://{}{path}", app.address))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let (response, mut stream) = client.send_request(request.body(()).unwrap(), false).unwrap();
    let body = message.encode_to_vec();
    let mut frame = vec![0u8];
    frame.extend_from_slice(&u32::try_from(body.len()).unwrap().to_be_bytes());
    frame.extend_from_slice(&body);
    stream.send_data(bytes::Bytes::from(frame), false).unwrap();
    let mut sent_trailers = http::HeaderMap::new();
    for (name, value) in trailers {
        sent_trailers.append(*name, value.parse().unwrap());
    }
    stream.send_trailers(sent_trailers).unwrap();
    let response = response.await.unwrap();
    let status_in_headers = response.headers().get("grpc-status").cloned();
    let mut body = response.into_body();
    while let Some(chunk) = body.data().await {
        chunk.unwrap();
    }
    let trailers = body.trailers().await.unwrap().unwrap_or_default();
    let status = trailers.get("grpc-status").cloned().or(status_in_headers).expect("a grpc-status");
    status.to_str().unwrap().to_owned()
}

pub async fn guard_headers_sent_in_request_trailers_are_invalid_argument_and_move_nothing(app: &TestApp) {
    app.funded("alice", "100.00").await;
    app.open("bob", "USD").await;
    let token = app.issue_token("m1").await;
    let transfer = transfer_request("alice", "bob", "7.00");
    let path = "/payledger.v1.AccountService/Transfer";

    let replaced = raw_call_with_trailers(
        app,
        path,
        &transfer,
        &[("idempotency-key", "split-A")],
        &[("idempotency-key", "split-B")],
    )
    .await;
    let only_in_trailers = raw_call_with_trailers(app, path, &transfer, &[], &[("idempotency-key", "split-C")]).await;
    let same_in_both = raw_call_with_trailers(
        app,
        path,
        &transfer,
        &[("idempotency-key", "split-D")],
        &[("idempotency-key", "split-D")],
    )
    .await;
    let token_in_trailers = raw_call_with_trailers(
        app,
        path,
        &transfer,
        &[("idempotency-key", "split-E")],
        &[("idempotency-token", &token)],
    )
    .await;
    let plain_trailer =
        raw_call_with_trailers(app, path, &transfer, &[("idempotency-key", "split-F")], &[("x-unrelated", "1")]).await;

    assert_eq!(replaced, "3", "a key whose trailer replaces its header is INVALID_ARGUMENT");
    assert_eq!(only_in_trailers, "3");
    assert_eq!(token_in_trailers, "3");
    // The same value in the trailer leaves one reading; an unrelated trailer changes nothing.
    assert_eq!(same_in_both, "0");
    assert_eq!(plain_trailer, "0");
    assert_eq!(app.rows("transfers").await, 2);
    assert_eq!(app.balance("alice").await, "86.00");
    let mut accounts = app.accounts.clone();
    let retried = accounts.transfer(with_key(transfer_request("alice", "bob", "7.00"), "split-D")).await.unwrap();
    assert!(replayed(&retried), "split-D was recorded under its header's value");
    let order = one_dollar_order("m1", "o-1", "bob");
    let with_the_token = app.payments.clone().create_order(with_token(order, &token, None)).await.unwrap();
    assert!(!replayed(&with_the_token), "the refused call did not consume the token");
}

/// A token used by merchant m1 never answers or serves merchant m2: not its stored response,
/// not a fresh run.
async fn a_used_token_answers_only_its_own_merchant(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "10.00").await;
    app.create_order("m2", "order-1", "shop", "10.00").await.unwrap();
    let mut payments = app.payments.clone();
    let token = app.issue_token("m1").await;
    payments.create_order(with_token(one_dollar_order("m1", "o-t", "shop"), &token, None)).await.unwrap();
    // As a record written before callers were recorded: the token's issuer still decides.
    let forget_caller = format!("UPDATE idempotency_record SET caller_scope = NULL WHERE idempotency_key = '{token}'");
    sqlx::query(&forget_caller).execute(&app.raw).await.unwrap();
    let before = app.all_rows().await;

    let same_fields_other_merchant =
        payments.create_order(with_token(one_dollar_order("m2", "o-t", "shop"), &token, None)).await.unwrap_err();
    let pay_of_other_merchant = payments
        .pay(with_token(app.pay_request("m2", "pay-1", "order-1", "alice", "10.00"), &token, None))
        .await
        .unwrap_err();
    let own_replay =
        payments.create_order(with_token(one_dollar_order("m1", "o-t", "shop"), &token, None)).await.unwrap();

    assert_status(&same_fields_other_merchant, Code::FailedPrecondition, "TOKEN_INVALID");
    assert_status(&pay_of_other_merchant, Code::FailedPrecondition, "TOKEN_INVALID");
    assert!(replayed(&own_replay));
    assert_eq!(app.all_rows().await, before, "nothing written for m2");
    assert_eq!(app.balance("alice").await, "100.00");
}

pub async fn a_used_token_answers_only_its_own_merchant_in_the_database_store(app: &TestApp) {
    a_used_token_answers_only_its_own_merchant(app).await;
}

pub async fn a_used_token_answers_only_its_own_merchant_in_the_redis_store(app: &TestApp) {
    a_used_token_answers_only_its_own_merchant(app).await;
}

/// A token presented with a call that its natural key answers (nothing runs) is not used up,
/// in either store, and stays its merchant's.
async fn a_token_whose_call_changed_nothing_stays_usable_by_its_merchant_only(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "2.00").await;
    app.create_order("m1", "closed", "shop", "1.00").await.unwrap();
    app.create_order("m2", "order-2", "shop", "2.00").await.unwrap();
    let mut payments = app.payments.clone();
    let close = proto::CloseOrderRequest { merchant_id: "m1".into(), order_no: "closed".into() };
    payments.close_order(close.clone()).await.unwrap();
    let token = app.issue_token("m1").await;

    let closed_again = payments.close_order(with_token(close, &token, None)).await.unwrap();
    let other_merchant = payments
        .pay(with_token(app.pay_request("m2", "pay-2", "order-2", "alice", "2.00"), &token, None))
        .await
        .unwrap_err();
    let own_merchant = payments
        .pay(with_token(app.pay_request("m1", "pay-1", "order-1", "alice", "2.00"), &token, None))
        .await
        .unwrap();

    assert!(replayed(&closed_again), "closing a closed order is a replay");
    assert_status(&other_merchant, Code::FailedPrecondition, "TOKEN_INVALID");
    assert!(!replayed(&own_merchant), "the token was still unused: this Pay ran");
    assert_eq!(app.balance("alice").await, "98.00", "only m1's Pay moved money");
    assert_eq!(app.rows("payment_flow").await, 1);
}

pub async fn a_token_whose_call_changed_nothing_stays_usable_in_the_database_store(app: &TestApp) {
    a_token_whose_call_changed_nothing_stays_usable_by_its_merchant_only(app).await;
}

pub async fn a_token_whose_call_changed_nothing_stays_usable_in_the_redis_store(app: &TestApp) {
    a_token_whose_call_changed_nothing_stays_usable_by_its_merchant_only(app).await;
}

pub async fn concurrent_duplicates_of_a_keyed_pay_are_answered_from_its_key_record(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;
    let request = app.pay_request("m1", "pay-1", "order-1", "alice", "30.00");

    let calls = (0..20).map(|_| {
        let (mut payments, request) = (app.payments.clone(), request.clone());
        tokio::spawn(async move { payments.pay(with_key(request, "k-1")).await })
    });
    let responses: Vec<_> =
        futures::future::join_all(calls).await.into_iter().map(|joined| joined.unwrap().unwrap()).collect();

    assert_eq!(responses.iter().filter(|response| !replayed(response)).count(), 1);
    for response in &responses {
        // Every duplicate is the key's replay (the response as first sent, with the key's
        // expiry), never an answer rebuilt from the natural key.
        assert!(header(response.metadata(), "idempotency-expires-at").is_some(), "{:?}", response.metadata());
    }
    let trade_nos: std::collections::HashSet<_> =
        responses.into_iter().map(|response| response.into_inner().payment.unwrap().trade_no).collect();
    assert_eq!(trade_nos.len(), 1);
    assert_eq!(app.balance("alice").await, "70.00");
}

pub async fn created_by_is_anonymous_on_a_server_without_authentication(app: &TestApp) {
    app.order_ready_to_pay("o-1", "10.00", "10.00").await;
    let paid = app.pay("m1", "t-1", "o-1", "alice", "10.00").await.unwrap().into_inner();
    assert_eq!(paid.payment.unwrap().created_by, "anonymous");
    let refunded = app.refund("m1", "t-1", "r-1", "1.00").await.unwrap().into_inner();
    assert_eq!(refunded.refund.unwrap().created_by, "anonymous");
    let request = proto::ListEntriesRequest { account_id: "alice".into(), page_size: 0, page_token: String::new() };
    let entries = app.accounts.clone().list_entries(request).await.unwrap().into_inner().entries;
    assert!(entries.iter().all(|entry| entry.created_by == "anonymous"), "{entries:?}");
}

/// The demo's story against a running server, as `payledger-tools demo --target` plays it
/// (with `--token` when the server authenticates callers).
pub async fn the_demo_plays_clean_against_a_running_server(app: &TestApp) {
    let settings = payledger_tools::demo::DemoSettings {
        target: Some(format!("http://{}", app.address)),
        allow_test_data: true,
        access: payledger_tools::TargetAccess { token: app.admin_token.clone(), ..Default::default() },
    };
    let outcome = payledger_tools::demo::run(settings).await.unwrap();
    assert_eq!(outcome, std::process::ExitCode::SUCCESS);
}

/// A Transfer of `amount` USD from alice to bob, memo "rent", made by `actor`.
fn rent_from_alice_to_bob(amount: &str, actor: &payledger::domain::Actor) -> payledger::ledger::Transfer {
    transfer_by("alice", "bob", amount, actor)
}

/// The guards of a call by `actor` with idempotency key `key` alone.
fn keyed_by(key: &str, actor: &payledger::domain::Actor) -> payledger::ledger::Guards {
    payledger::ledger::Guards { actor: actor.clone(), ..guards(Some(key), None) }
}

/// A call sent before authentication was turned on and retried after it, with the caller's
/// token now, still runs once: the authenticated retry is answered from the record its key
/// left without authentication (same method and request), while another request under that
/// key, and the same key of another caller, run as their own.
pub async fn a_key_used_before_authentication_was_turned_on_answers_its_retry_after(app: &TestApp) {
    use payledger::domain::{Actor, FreeText, IdempotencyKey, Subject};
    use payledger::ledger::Guards;
    app.funded("alice", "100.00").await;
    app.open("bob", "USD").await;
    let transfer = rent_from_alice_to_bob;
    let guards = |actor: &Actor| keyed_by("rent-2026-11", actor);
    let (anonymous, checkout) = (Actor::Anonymous, Actor::Subject(Subject::parse("checkout").unwrap()));

    let before = app.ledger.transfer(transfer("10.00", &anonymous), &guards(&anonymous)).await.unwrap();
    let retried_after = app.ledger.transfer(transfer("10.00", &checkout), &guards(&checkout)).await.unwrap();
    assert!(!before.replayed && retried_after.replayed);
    assert_eq!(retried_after.value, before.value, "the original transfer, as first answered");
    assert_eq!(app.balance("bob").await, "10.00");

    let other_request = app.ledger.transfer(transfer("5.00", &checkout), &guards(&checkout)).await.unwrap();
    assert!(!other_request.replayed, "another request under the key is the caller's own call");
    assert_eq!(app.balance("bob").await, "15.00");
    let again = app.ledger.transfer(transfer("5.00", &checkout), &guards(&checkout)).await.unwrap();
    assert!(again.replayed);
    assert_eq!(again.value, other_request.value, "from then on the caller's own record answers");
    assert_eq!(app.balance("bob").await, "15.00");

    // The same with a one-time token issued before the switch: its retry, token and all, is
    // answered; the token guards nothing else for the authenticated caller.
    let merchant = payledger::domain::MerchantId::parse("merchant_id", "m1").unwrap();
    let purpose = FreeText::parse("purpose", "checkout").unwrap();
    let issued = app.ledger.issue_token(&merchant, &anonymous, &purpose).await.unwrap();
    let with_token = |actor: &Actor| Guards {
        idempotency_key: Some(IdempotencyKey::parse("idempotency-key", "rent-2026-12").unwrap()),
        token: Some(payledger::domain::OneTimeToken::parse("idempotency-token", &issued.token).unwrap()),
        actor: actor.clone(),
        presence: Default::default(),
    };
    let before = app.ledger.transfer(transfer("1.00", &anonymous), &with_token(&anonymous)).await.unwrap();
    let retried_after = app.ledger.transfer(transfer("1.00", &checkout), &with_token(&checkout)).await.unwrap();
    assert!(retried_after.replayed);
    assert_eq!(retried_after.value, before.value);
    let error = app.ledger.transfer(transfer("2.00", &checkout), &with_token(&checkout)).await.unwrap_err();
    assert_eq!(tonic::Status::from(error).code(), Code::FailedPrecondition, "TOKEN_INVALID");
    assert_eq!(app.balance("bob").await, "16.00");
}

/// The keyed calls of one group commit are looked up by the batch, in one read, as step 1
/// looks up a single call: a retry across the switch to authentication is answered by the
/// record its key left before (same method and request), and one of the caller's own keys
/// by its record (a replay, or IDEMPOTENCY_KEY_REUSED for another request); another request
/// under a key used before the switch, and a fresh key, are written by the batch; a second
/// retry of one key in the batch runs alone after it, and is answered alike. Money
/// moves once per call, and no answer counts as an in-flight wait (every record was
/// committed before the batch).
pub async fn a_batch_answers_its_keyed_calls_from_records_made_before_and_after_authentication(app: &TestApp) {
    use payledger::domain::{Actor, Subject};
    app.funded("alice", "100.00").await;
    app.open("bob", "USD").await;
    let (transfer, guards) = (rent_from_alice_to_bob, keyed_by);
    let (anonymous, checkout) = (Actor::Anonymous, Actor::Subject(Subject::parse("checkout").unwrap()));
    let before = app.ledger.transfer(transfer("10.00", &anonymous), &guards("k-before", &anonymous)).await.unwrap();
    app.ledger.transfer(transfer("2.00", &anonymous), &guards("k-other", &anonymous)).await.unwrap();
    let own = app.ledger.transfer(transfer("1.00", &checkout), &guards("k-own", &checkout)).await.unwrap();
    app.ledger.transfer(transfer("4.00", &checkout), &guards("k-own-2", &checkout)).await.unwrap();
    let counters_before = app.ledger.counters();

    let answers = app
        .ledger
        .write_together(vec![
            (BatchCall::Transfer(transfer("10.00", &checkout)), guards("k-before", &checkout)),
            (BatchCall::Transfer(transfer("3.00", &checkout)), guards("k-other", &checkout)),
            (BatchCall::Transfer(transfer("1.00", &checkout)), guards("k-own", &checkout)),
            (BatchCall::Transfer(transfer("7.00", &checkout)), guards("k-own-2", &checkout)),
            (BatchCall::Transfer(transfer("2.00", &checkout)), guards("k-new", &checkout)),
            // A second retry across the switch, and a second retry of the caller's own key, in
            // the same batch: each runs alone after it, where its read finds the record.
            (BatchCall::Transfer(transfer("10.00", &checkout)), guards("k-before", &checkout)),
            (BatchCall::Transfer(transfer("1.00", &checkout)), guards("k-own", &checkout)),
        ])
        .await;
    let answers: Vec<_> = answers.into_iter().map(|answer| answer.map_err(tonic::Status::from)).collect();

    let retried_across = answers[0].as_ref().expect("the retry across the switch");
    assert!(retried_across.replayed);
    assert_eq!(retried_across.value, BatchAnswer::Transfer(before.value), "the original, as first answered");
    let other_request = answers[1].as_ref().expect("another request under a key used before the switch");
    assert!(!other_request.replayed);
    let own_retry = answers[2].as_ref().expect("a retry of the caller's own key");
    assert!(own_retry.replayed);
    assert_eq!(own_retry.value, BatchAnswer::Transfer(own.value));
    let reused = answers[3].as_ref().expect_err("the caller's key for another request");
    assert_status(reused, Code::AlreadyExists, "IDEMPOTENCY_KEY_REUSED");
    assert!(!answers[4].as_ref().expect("a fresh key").replayed);
    let retried_again = answers[5].as_ref().expect("the second retry across the switch");
    assert!(retried_again.replayed);
    assert_eq!(retried_again.value, retried_across.value);
    let own_again = answers[6].as_ref().expect("the second retry of the caller's own key");
    assert!(own_again.replayed);
    assert_eq!(own_again.value, own_retry.value);
    let counters = app.ledger.counters();
    assert_eq!(counters.group_committed_transfers - counters_before.group_committed_transfers, 2, "{counters:?}");
    assert_eq!(counters.replays - counters_before.replays, 4, "{counters:?}");
    assert_eq!(counters.key_conflicts - counters_before.key_conflicts, 1, "{counters:?}");
    assert_eq!(counters.in_flight_waits, 0, "every record answered was committed before the batch: {counters:?}");
    assert_eq!(app.balance("bob").await, "22.00", "10 + 2 + 1 + 4 before the batch, 3 + 2 in it");
    assert_eq!(app.rows("transfers").await, 6);
    // Claimed IN_PROGRESS and completed, alone and in the batch: the message alone.
    assert!(app.rows("idempotency_record").await >= 6);
    assert_eq!(app.records_with_a_json_copy().await, 0);
    assert!(app.ledger.audit().await.unwrap().is_empty());
}

/// A retry whose batch read found it answered by its key's record is answered by that record
/// even when the batch is then held up (waiting for a row lock) until after the record has
/// expired: not refused as not yet visible (which its client would retry, running it again),
/// nor written. SQLite has one writer at a time: a batch there begins only once the lock is
/// released, and finds the key expired (a new call, as any call after its key's lifetime).
pub async fn a_retry_its_batch_found_answered_stays_answered_when_its_key_expires_under_the_batch(app: &TestApp) {
    app.funded("alice", "100.00").await;
    app.open("bob", "USD").await;
    app.open("carol", "USD").await;
    let first = app
        .ledger
        .write_together(vec![(
            BatchCall::Transfer(transfer_command("alice", "bob", "10.00")),
            guards(Some("k1"), None),
        )])
        .await;
    let original = first.into_iter().next().unwrap().expect("the original");
    let mut holder = app.raw.begin().await.unwrap();
    let lock = "SELECT balance FROM accounts WHERE account_id = 'carol' FOR UPDATE";
    sqlx::query(lock).execute(&mut *holder).await.unwrap();

    let ledger = app.ledger.clone();
    let batch = tokio::spawn(async move {
        ledger
            .write_together(vec![
                (BatchCall::Transfer(transfer_command("alice", "bob", "10.00")), guards(Some("k1"), None)),
                (BatchCall::Transfer(transfer_command("alice", "carol", "1.00")), guards(Some("k2"), None)),
            ])
            .await
    });
    app.wait_for_a_session_in("%accounts%UPDATE%").await;
    // Past the key's lifetime (1 s, `short_lived`) before the batch goes on.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    holder.commit().await.unwrap();
    let answers: Vec<_> = batch.await.unwrap().into_iter().map(|answer| answer.map_err(tonic::Status::from)).collect();

    let retry = answers[0].as_ref().expect("the retry, answered by the record its batch read");
    assert!(retry.replayed);
    assert_eq!(retry.value, original.value);
    assert!(!answers[1].as_ref().expect("the Transfer the batch waited for").replayed);
    assert_eq!(app.balance("bob").await, "10.00");
    assert_eq!(app.balance("carol").await, "1.00");
    assert_eq!(app.rows("transfers").await, 2);
    assert!(app.ledger.audit().await.unwrap().is_empty());
}

// ---- Operability: metrics and bounds under overload ---------------------------------------

/// The sample of `name` with exactly `labels` (OpenMetrics text, labels in their order).
fn sample(metrics: &std::collections::HashMap<String, f64>, name: &str, labels: &str) -> f64 {
    let key = if labels.is_empty() { name.to_owned() } else { format!("{name}{{{labels}}}") };
    *metrics.get(&key).unwrap_or_else(|| {
        let mut known: Vec<_> = metrics.keys().filter(|known| known.starts_with(name)).collect();
        known.sort();
        panic!("no sample {key}; samples of {name}: {known:#?}")
    })
}

pub async fn metrics_count_calls_replays_key_conflicts_and_refusals(app: &TestApp) {
    app.funded("alice", "10.00").await;
    app.open("shop", "USD").await;
    for order_no in ["o1", "o2", "o3"] {
        app.create_order("m1", order_no, "shop", "1.00").await.unwrap();
    }
    // Two fresh Pays, one replay, one out_trade_no reused for another order, one bad input.
    app.pay("m1", "t1", "o1", "alice", "1.00").await.unwrap();
    app.pay("m1", "t2", "o2", "alice", "1.00").await.unwrap();
    assert!(replayed(&app.pay("m1", "t1", "o1", "alice", "1.00").await.unwrap()));
    let reused = app.pay("m1", "t1", "o3", "alice", "1.00").await.unwrap_err();
    assert_status(&reused, Code::AlreadyExists, "OUT_TRADE_NO_REUSED");
    let bad = app.pay("m1", "t3", "o3", "alice", "one dollar").await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);
    // An idempotency key replayed once and reused once.
    app.funded("bob", "5.00").await;
    let transfer = transfer_request("bob", "alice", "1.00");
    app.accounts.clone().transfer(with_key(transfer.clone(), "k-1")).await.unwrap();
    assert!(replayed(&app.accounts.clone().transfer(with_key(transfer, "k-1")).await.unwrap()));
    let other = transfer_request("bob", "alice", "2.00");
    let conflict = app.accounts.clone().transfer(with_key(other, "k-1")).await.unwrap_err();
    assert_status(&conflict, Code::AlreadyExists, "IDEMPOTENCY_KEY_REUSED");
    // Two health checks: counted apart from the API.
    let channel =
        tonic::transport::Channel::from_shared(format!("http://{}", app.address)).unwrap().connect().await.unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    for _ in 0..2 {
        health.check(tonic_health::pb::HealthCheckRequest { service: String::new() }).await.expect("health answers");
    }

    let metrics = app.metrics().await;
    let checks = r#"grpc_service="grpc.health.v1.Health",grpc_method="Check",grpc_type="unary",grpc_code="OK""#;
    assert_eq!(sample(&metrics, "payledger_rpc_platform_calls_total", checks), 2.0);
    let watches =
        r#"grpc_service="grpc.health.v1.Health",grpc_method="Watch",grpc_type="server_stream",grpc_code="OK""#;
    assert_eq!(sample(&metrics, "payledger_rpc_platform_calls_total", watches), 0.0);
    assert!(
        !metrics.keys().any(|key| key.starts_with("payledger_rpc_calls_total") && key.contains("grpc.health")),
        "health is not API traffic"
    );
    let build = metrics.keys().find(|key| key.starts_with("payledger_build_info{")).expect("payledger_build_info");
    assert!(build.contains(&format!(r#"version="{}""#, env!("CARGO_PKG_VERSION"))), "{build}");
    assert_eq!(metrics[build], 1.0);
    if cfg!(target_os = "linux") {
        assert!(sample(&metrics, "process_resident_memory_bytes", "") > 0.0);
        assert!(sample(&metrics, "process_open_fds", "") > 0.0);
        assert!(sample(&metrics, "process_cpu_seconds_total", "") > 0.0);
    }
    let pay = |code: &str| {
        sample(
            &metrics,
            "payledger_rpc_calls_total",
            &format!(
                r#"grpc_service="payledger.v1.PaymentService",grpc_method="Pay",grpc_type="unary",grpc_code="{code}""#
            ),
        )
    };
    assert_eq!(pay("OK"), 3.0);
    assert_eq!(pay("ALREADY_EXISTS"), 1.0);
    assert_eq!(pay("INVALID_ARGUMENT"), 1.0);
    let transfers =
        r#"grpc_service="payledger.v1.AccountService",grpc_method="Transfer",grpc_type="unary",grpc_code="OK""#;
    assert_eq!(sample(&metrics, "payledger_rpc_calls_total", transfers), 2.0);
    let pay_method = r#"grpc_service="payledger.v1.PaymentService",grpc_method="Pay",grpc_type="unary""#;
    assert_eq!(sample(&metrics, "payledger_rpc_duration_seconds_count", pay_method), 5.0);
    assert_eq!(sample(&metrics, "payledger_rpc_in_flight", pay_method), 0.0);
    assert_eq!(sample(&metrics, "payledger_replays_total", r#"mechanism="natural_key""#), 1.0);
    assert_eq!(sample(&metrics, "payledger_replays_total", r#"mechanism="idempotency_key""#), 1.0);
    assert_eq!(sample(&metrics, "payledger_key_conflicts_total", r#"reason="OUT_TRADE_NO_REUSED""#), 1.0);
    assert_eq!(sample(&metrics, "payledger_key_conflicts_total", r#"reason="IDEMPOTENCY_KEY_REUSED""#), 1.0);
    // The two Deposits, the three orders, the two fresh Pays (one each, or one together) and
    // the fresh Transfer were written by group commits, one after another.
    let committed =
        |kind: &str| sample(&metrics, "payledger_group_committed_calls_total", &format!(r#"kind="{kind}""#));
    assert_eq!(committed("deposit"), 2.0);
    assert_eq!(committed("withdraw"), 0.0);
    assert_eq!(committed("create_order"), 3.0);
    assert_eq!(committed("pay"), 2.0);
    assert_eq!(committed("transfer"), 1.0);
    assert_eq!(committed("refund"), 0.0);
    let batches = sample(&metrics, "payledger_group_commit_batch_calls_count", "");
    assert!((7.0..=8.0).contains(&batches), "{batches}");
    assert_eq!(sample(&metrics, "payledger_group_commit_batch_calls_sum", ""), 8.0);
    // No family of the old names is left.
    for old in ["payledger_group_committed_pays_total", "payledger_group_commit_batch_pays_count"] {
        assert!(!metrics.contains_key(old), "{old}");
    }
    assert_eq!(sample(&metrics, "payledger_group_commit_queue_depth", ""), 0.0);
    // The default settings: one worker, 1,024 calls in its queue.
    assert_eq!(sample(&metrics, "payledger_group_commit_queue_capacity", ""), 1024.0);
    assert_eq!(sample(&metrics, "payledger_db_up", ""), 1.0);
    assert_eq!(sample(&metrics, "payledger_db_pool_max_connections", ""), 8.0);
    assert!(sample(&metrics, "payledger_db_pool_acquire_duration_seconds_count", "") > 0.0);
    assert!(sample(&metrics, "payledger_db_pool_connections", r#"state="idle""#) >= 1.0);
    // The shutdown line reads the same counters.
    let counters = app.ledger.counters();
    assert_eq!((counters.replays, counters.key_conflicts, counters.group_committed_pays), (2, 2, 2));
    assert_eq!(counters.group_committed_transfers, 1);
}

/// Takes every pooled connection of the app's ledger, so that its calls wait for one.
async fn hold_the_pool(app: &TestApp) -> Vec<payledger::store::Reader> {
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(app.ledger.store().reader().await.expect("a pooled connection"));
    }
    held
}

/// Polls until `check` holds (at most 10 s).
async fn eventually(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !check().await {
        assert!(std::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A call still unanswered when its deadline (`grpc-timeout`) passes is answered
/// DEADLINE_EXCEEDED (`DEADLINE_PASSED`), a code gRPC clients retry, never CANCELLED ("Timeout
/// expired", tonic's own answer, which they do not retry): here a Pay and a Deposit waiting for
/// a pooled connection, sent over raw HTTP/2 (a tonic client gives up by its own timer at the
/// deadline, and says CANCELLED itself). Each may still be written once the connections are
/// free; the same call again is answered, and the money moves once.
pub async fn a_call_past_its_deadline_is_deadline_exceeded_and_its_retry_moves_the_money_once(app: &TestApp) {
    use prost::Message as _;
    app.order_ready_to_pay("o1", "5.00", "1.00").await;
    let deposit = proto::DepositRequest {
        request_id: "d1".into(),
        account_id: "alice".into(),
        amount: "2.00".into(),
        currency: "USD".into(),
    };
    let held = hold_the_pool(app).await;
    let pay = app.pay_request("m1", "t1", "o1", "alice", "1.00").encode_to_vec();
    let gave_up = raw_call_with_deadline(app, "PaymentService/Pay", &pay, "300m").await;
    assert_status(&gave_up, Code::DeadlineExceeded, "DEADLINE_PASSED");
    let gave_up = raw_call_with_deadline(app, "AccountService/Deposit", &deposit.encode_to_vec(), "300m").await;
    assert_status(&gave_up, Code::DeadlineExceeded, "DEADLINE_PASSED");
    drop(held);

    let paid = app.pay("m1", "t1", "o1", "alice", "1.00").await.unwrap().into_inner();
    assert_eq!(paid.payment.unwrap().out_trade_no, "t1");
    app.accounts.clone().deposit(deposit).await.unwrap();
    assert_eq!(app.balance("alice").await, "6.00", "5.00 + 2.00 deposited once - 1.00 paid once");
    assert_eq!((app.rows("payment_flow").await, app.rows("deposits").await), (1, 2));
    assert!(app.ledger.audit().await.unwrap().is_empty());
}

/// One call of `method` ("Service/Method" of package payledger.v1) with `message` and the
/// header `grpc-timeout: deadline`, over raw HTTP/2 ([`raw_stream`]): the status the server
/// answers, from its headers or trailers.
async fn raw_call_with_deadline(app: &TestApp, method: &str, message: &[u8], deadline: &str) -> tonic::Status {
    let (response, mut stream) = raw_stream(app, method, Some(deadline), false).await;
    let mut framed = vec![0_u8];
    framed.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    framed.extend_from_slice(message);
    stream.send_data(bytes::Bytes::from(framed), true).unwrap();
    let response = response.await.unwrap();
    if let Some(status) = tonic::Status::from_header_map(response.headers()) {
        return status;
    }
    let mut body = response.into_body();
    while body.data().await.is_some() {}
    let trailers = body.trailers().await.unwrap().expect("trailers");
    tonic::Status::from_header_map(&trailers).expect("a status in the trailers")
}

pub async fn a_call_past_the_concurrency_limit_is_resource_exhausted_before_any_work(app: &TestApp) {
    app.order_ready_to_pay("o1", "5.00", "1.00").await;
    for order_no in ["o2", "o3"] {
        app.create_order("m1", order_no, "shop", "1.00").await.unwrap();
    }
    // A caller that sends its headers and never its message holds no place.
    let stalled = raw_pay_stream(app, false).await;
    let in_flight =
        r#"payledger_rpc_in_flight{grpc_service="payledger.v1.PaymentService",grpc_method="Pay",grpc_type="unary"}"#;
    eventually("the stalled Pay is in flight", async || app.metrics().await.get(in_flight) == Some(&1.0)).await;

    // The one use case the limit allows waits for a connection; its caller gives up after
    // 300 ms, but the use case keeps its place until it commits.
    let held = hold_the_pool(app).await;
    let mut first = tonic::Request::new(app.pay_request("m1", "t1", "o1", "alice", "1.00"));
    first.set_timeout(Duration::from_millis(300));
    let gave_up = app.payments.clone().pay(first).await.unwrap_err();
    assert!(matches!(gave_up.code(), Code::DeadlineExceeded | Code::Cancelled), "{gave_up:?}");

    let refused = app.pay("m1", "t2", "o2", "alice", "1.00").await.unwrap_err();
    assert_status(&refused, Code::ResourceExhausted, "OVERLOADED");
    let details = refused.get_error_details();
    assert_eq!(details.error_info().unwrap().metadata.get("bound").map(String::as_str), Some("concurrency_limit"));
    let retry_delay = details.retry_info().and_then(|info| info.retry_delay).expect("RetryInfo");
    let pushback = refused.metadata().get("grpc-retry-pushback-ms").expect("the pushback header");
    assert_eq!(pushback.to_str().unwrap(), retry_delay.as_millis().to_string(), "one wait, said twice");
    // Health and reflection are not counted against the limit.
    let channel = Channel::from_shared(format!("http://{}", app.address)).unwrap().connect().await.unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    health.check(tonic_health::pb::HealthCheckRequest { service: String::new() }).await.expect("health answers");

    drop(held);
    // (A Query is refused too while the use case still holds the one place.)
    eventually("the first Pay's use case committed", async || {
        let query = app.query("m1", Key::OrderNo("o1".into())).await;
        query.ok().and_then(|query| query.order).is_some_and(|order| order.status() == OrderStatus::Paid)
    })
    .await;
    let query = app.query("m1", Key::OrderNo("o2".into())).await.unwrap();
    assert_eq!(query.order.unwrap().status(), OrderStatus::Pending, "the refused Pay did nothing");
    // Its place is free again.
    eventually("the place is free", async || app.pay("m1", "t3", "o3", "alice", "1.00").await.is_ok()).await;
    assert_eq!(app.rows("payment_flow").await, 2);
    drop(stalled);

    let metrics = app.metrics().await;
    // Every refusal, of Pays and of the Queries that polled, is counted as shed.
    let calls = |method: &str, code: &str| {
        let labels = format!(
            r#"grpc_service="payledger.v1.PaymentService",grpc_method="{method}",grpc_type="unary",grpc_code="{code}""#
        );
        metrics.get(&format!("payledger_rpc_calls_total{{{labels}}}")).copied().unwrap_or(0.0)
    };
    let refused = calls("Pay", "RESOURCE_EXHAUSTED") + calls("Query", "RESOURCE_EXHAUSTED");
    assert!(calls("Pay", "RESOURCE_EXHAUSTED") >= 1.0);
    assert_eq!(sample(&metrics, "payledger_load_shed_total", r#"reason="concurrency_limit""#), refused);
    // Answered DEADLINE_EXCEEDED by the server a moment before the caller's own timer, or
    // CANCELLED when the caller left first.
    let gave_up = calls("Pay", "DEADLINE_EXCEEDED") + calls("Pay", "CANCELLED");
    assert_eq!(gave_up, 1.0, "the caller that gave up is counted as it ended");
}

pub async fn a_full_group_commit_queue_refuses_and_a_gone_callers_pay_never_starts(app: &TestApp) {
    use payledger::ledger::{CallerPresence, Guards};
    app.funded("alice", "5.00").await;
    app.open("shop", "USD").await;
    for order_no in ["o1", "o2", "o3"] {
        app.create_order("m1", order_no, "shop", "1.00").await.unwrap();
    }
    let held = hold_the_pool(app).await;
    let depth = || app.ledger.metrics().group_commit_queue_depth.get();
    // o1's Pay starts its batch (a batch of one, started by its caller), which waits for a
    // connection.
    let first = tokio::spawn({
        let payments = app.payments.clone();
        let request = app.pay_request("m1", "t1", "o1", "alice", "1.00");
        async move { payments.clone().pay(request).await }
    });
    let in_flight =
        r#"payledger_rpc_in_flight{grpc_service="payledger.v1.PaymentService",grpc_method="Pay",grpc_type="unary"}"#;
    eventually("the first Pay is in flight", async || app.metrics().await.get(in_flight) == Some(&1.0)).await;
    // It starts within microseconds; a second is room for a loaded machine.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(depth(), 0, "the first Pay's batch started");
    // o2's Pay fills the queue of one; its caller then goes away (cancelled).
    let (presence, call) = CallerPresence::new(None);
    let gone = tokio::spawn({
        let ledger = app.ledger.clone();
        let guards = Guards { presence, ..Guards::default() };
        async move { ledger.pay(pay_command("t2", "o2", "alice", "1.00"), &guards).await }
    });
    eventually("the second Pay is queued", async || depth() == 1).await;
    drop(call);
    // o3's Pay finds the queue full.
    let full = app.ledger.pay(pay_command("t3", "o3", "alice", "1.00"), &Guards::default()).await.unwrap_err();
    let full = tonic::Status::from(full);
    assert_status(&full, Code::ResourceExhausted, "OVERLOADED");
    let info = full.get_error_details().error_info().cloned().unwrap();
    assert_eq!(info.metadata.get("bound").map(String::as_str), Some("group_commit_queue_full"));

    drop(held);
    assert!(first.await.unwrap().is_ok(), "the Pay its batch took completes");
    let not_started = tonic::Status::from(gone.await.unwrap().unwrap_err());
    assert_status(&not_started, Code::Cancelled, "CALLER_GONE");
    for (order_no, status) in [("o1", OrderStatus::Paid), ("o2", OrderStatus::Pending), ("o3", OrderStatus::Pending)] {
        let query = app.query("m1", Key::OrderNo(order_no.into())).await.unwrap();
        assert_eq!(query.order.unwrap().status(), status, "{order_no}");
    }
    assert_eq!(app.rows("payment_flow").await, 1);
    assert_eq!(app.balance("alice").await, "4.00");
    let metrics = app.ledger.metrics();
    assert_eq!(metrics.group_commit_not_started.get(), 1);
    assert_eq!(depth(), 0);
}

pub async fn a_request_over_the_size_limit_is_resource_exhausted(app: &TestApp) {
    app.order_ready_to_pay("o1", "5.00", "1.00").await;
    let before = app.all_rows().await;
    let mut request = app.pay_request("m1", "t1", "o1", "alice", "1.00");
    request.out_trade_no = "x".repeat(100 * 1024);
    let status = app.payments.clone().pay(request.clone()).await.unwrap_err();
    assert_status(&status, Code::ResourceExhausted, "MESSAGE_TOO_LARGE");
    // A negative pushback (gRFC A6): no client retries a message that would be refused again,
    // though RESOURCE_EXHAUSTED is among the codes retried.
    assert_eq!(status.metadata().get("grpc-retry-pushback-ms").map(|value| value.to_str().unwrap()), Some("-1"));
    let client =
        payledger::client::PayledgerClient::connect_lazy(&format!("http://{}", app.address), Default::default())
            .unwrap();
    let status = client.pay(request).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(client.stats().attempts.load(std::sync::atomic::Ordering::Relaxed), 1, "sent once, not retried");
    assert_eq!(app.all_rows().await, before);
}

/// A Pay's HEADERS sent over raw HTTP/2 (ending the stream when `end`): the response to
/// come and the request stream, open for whatever framing a case sends.
async fn raw_pay_stream(app: &TestApp, end: bool) -> (h2::client::ResponseFuture, h2::SendStream<bytes::Bytes>) {
    raw_stream(app, "PaymentService/Pay", None, end).await
}

/// The HEADERS of a call of `method` ("Service/Method" of package payledger.v1), with
/// `grpc-timeout` when given, sent over raw HTTP/2 (ending the stream when `end`), whose
/// client keeps no timer of its own: the response to come and the request stream.
async fn raw_stream(
    app: &TestApp,
    method: &str,
    grpc_timeout: Option<&str>,
    end: bool,
) -> (h2::client::ResponseFuture, h2::SendStream<bytes::Bytes>) {
    let tcp = tokio::net::TcpStream::connect(app.address).await.unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let mut client = client.ready().await.unwrap();
    let mut request = http::Request::post(format!("http://{}/payledger.v1.{method}", app.address))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(timeout) = grpc_timeout {
        request = request.header("grpc-timeout", timeout);
    }
    client.send_request(request.body(()).unwrap(), end).unwrap()
}

/// A Pay whose gRPC framing is `body`, sent over raw HTTP/2: the trailers-only status.
async fn raw_framed_call(app: &TestApp, body: &'static [u8]) -> tonic::Status {
    let (response, mut stream) = raw_pay_stream(app, body.is_empty()).await;
    if !body.is_empty() {
        stream.send_data(bytes::Bytes::from_static(body), true).unwrap();
    }
    let response = response.await.unwrap();
    tonic::Status::from_header_map(response.headers()).expect("a trailers-only status")
}

pub async fn a_request_with_broken_framing_is_invalid_argument(app: &TestApp) {
    app.order_ready_to_pay("o1", "5.00", "1.00").await;
    let before = app.all_rows().await;
    // No message at all; a frame cut short; a compressed frame without grpc-encoding.
    for body in [&b""[..], b"\x00\x00\x00\x00\x10abc", b"\x01\x00\x00\x00\x00"] {
        let status = raw_framed_call(app, body).await;
        assert_status(&status, Code::InvalidArgument, "MALFORMED_REQUEST");
    }
    assert_eq!(app.all_rows().await, before);
}

// ---- CreateOrder in the group commit ------------------------------------------------------

/// A CreateOrder command of merchant m1 for `amount` USD to `payee`, with `expires_at` when
/// given (microseconds since the Unix epoch).
fn order_command(order_no: &str, payee: &str, amount: &str, expires_at: Option<i64>) -> BatchCall {
    use payledger::domain::{AccountId, Amount, Currency, FreeText, MerchantId, OrderNo};
    let currency = Currency::parse("currency", "USD").unwrap();
    BatchCall::CreateOrder(payledger::ledger::CreateOrder {
        merchant_id: MerchantId::parse("merchant_id", "m1").unwrap(),
        order_no: OrderNo::parse("order_no", order_no).unwrap(),
        payee_account_id: AccountId::parse("payee_account_id", payee).unwrap(),
        amount: Amount::parse("amount", amount, currency).unwrap(),
        subject: FreeText::parse("subject", &format!("order {order_no}")).unwrap(),
        expires_at,
    })
}

/// The order of a batch's CreateOrder answer, fresh or replayed as `replayed` says.
fn created(answer: &Result<payledger::ledger::Replayable<BatchAnswer>, tonic::Status>, replayed: bool) -> proto::Order {
    batch_response(answer, replayed, |answer| match answer {
        BatchAnswer::CreateOrder(response) => response.order.as_ref(),
        _ => None,
    })
}

pub async fn one_group_commit_of_create_orders_decides_each_on_its_own(app: &TestApp) {
    app.funded("alice", "10.00").await;
    app.open("shop", "USD").await;
    app.open("euro", "EUR").await;
    app.create_order("m1", "before", "shop", "1.00").await.unwrap();
    let token = app.issue_token("m1").await;
    let order = |order_no: &str, payee: &str, amount: &str| order_command(order_no, payee, amount, None);

    let before = app.ledger.counters();
    let answers = app
        .ledger
        .write_together(vec![
            (order("o1", "shop", "2.00"), guards(None, None)),
            // One order twice in one batch: the second is a replay of the first.
            (order("o1", "shop", "2.00"), guards(None, None)),
            // And once more for another amount.
            (order("o1", "shop", "3.00"), guards(None, None)),
            (order("o2", "nobody", "2.00"), guards(None, None)),
            (order("o3", "euro", "2.00"), guards(None, None)),
            (order_command("o4", "shop", "2.00", Some(1)), guards(None, None)),
            // An order created before the batch: the batch finds it, and it is answered by it
            // after the batch.
            (order("before", "shop", "1.00"), guards(None, None)),
            // A keyed CreateOrder: its record is written in the batch.
            (order("o5", "shop", "2.00"), guards(Some("ko5"), None)),
            // o5's key for another order.
            (order("o6", "shop", "2.00"), guards(Some("ko5"), None)),
            // A Pay of an order this batch creates runs alone after it, and finds it.
            (BatchCall::Pay(pay_command("t1", "o1", "alice", "2.00")), guards(None, None)),
            (order("o7", "shop", "2.00"), guards(None, Some(&token))),
            // A keyed CreateOrder the batch refuses: alone, where its key is claimed first; no
            // record is left.
            (order("o8", "nobody", "2.00"), guards(Some("ko8"), None)),
        ])
        .await;
    let answers: Vec<_> = answers.into_iter().map(|answer| answer.map_err(tonic::Status::from)).collect();
    let refused = |index: usize, code: Code, reason: &str| {
        assert_status(answers[index].as_ref().expect_err(reason), code, reason);
    };
    let o1 = created(&answers[0], false);
    assert_eq!((o1.order_no.as_str(), o1.amount.as_str(), o1.status), ("o1", "2.00", OrderStatus::Pending as i32));
    assert_eq!(created(&answers[1], true), o1, "answered as the first call of o1, exactly");
    refused(2, Code::AlreadyExists, "ORDER_NO_REUSED");
    refused(3, Code::NotFound, "ACCOUNT_NOT_FOUND");
    refused(4, Code::FailedPrecondition, "CURRENCY_MISMATCH");
    assert_eq!(answers[5].as_ref().unwrap_err().code(), Code::InvalidArgument, "{:?}", answers[5]);
    assert_eq!(created(&answers[6], true).order_no, "before");
    let o5 = created(&answers[7], false);
    refused(8, Code::AlreadyExists, "IDEMPOTENCY_KEY_REUSED");
    let paid = answers[9].as_ref().expect("the Pay of o1, alone after the batch");
    let BatchAnswer::Pay(paid) = &paid.value else { panic!("answered as another call: {paid:?}") };
    assert_eq!(paid.order.as_ref().unwrap().status, OrderStatus::Paid as i32);
    let o7 = created(&answers[10], false);
    refused(11, Code::NotFound, "ACCOUNT_NOT_FOUND");

    let after = app.ledger.counters();
    assert_eq!(after.group_committed_orders - before.group_committed_orders, 3, "o1, o5 and o7: {after:?}");
    assert_eq!(after.group_commits - before.group_commits, 1, "{after:?}");
    assert_eq!(after.group_committed_pays, before.group_committed_pays, "the Pay ran alone: {after:?}");
    assert_eq!(app.rows("orders").await, 4, "before, o1, o5 and o7");
    // ko5 and the token's record: the refused calls left none.
    assert_eq!(app.rows("idempotency_record").await, 2);
    assert_eq!(app.balance("shop").await, "2.00");
    assert!(app.ledger.audit().await.unwrap().is_empty());

    // Over the wire, a retry by order_no, by key and by token replays the batch's answer
    // exactly, and the refused key runs afresh.
    let mut payments = app.payments.clone();
    let by_order_no = app.create_order("m1", "o7", "shop", "2.00").await.unwrap();
    assert!(replayed(&by_order_no));
    assert_eq!(by_order_no.into_inner().order.unwrap(), o7);
    let request = |order_no: &str, payee: &str| proto::CreateOrderRequest {
        merchant_id: "m1".into(),
        order_no: order_no.into(),
        payee_account_id: payee.into(),
        amount: "2.00".into(),
        currency: "USD".into(),
        subject: format!("order {order_no}"),
        expires_at: None,
    };
    let by_key = payments.create_order(with_key(request("o5", "shop"), "ko5")).await.unwrap();
    assert!(replayed(&by_key));
    assert_eq!(by_key.into_inner().order.unwrap(), o5);
    let by_token = payments.create_order(with_token(request("o7", "shop"), &token, None)).await.unwrap();
    assert!(replayed(&by_token));
    assert_eq!(by_token.into_inner().order.unwrap(), o7);
    let afresh = payments.create_order(with_key(request("o8", "shop"), "ko8")).await.unwrap();
    assert!(!replayed(&afresh));
    assert_eq!(app.rows("orders").await, 5);
}

/// An order of `oz` is inserted, not yet committed, by a CreateOrder of its own while a group
/// commit holds a CreateOrder of `oz` and two other calls. On MariaDB the batch's locking read
/// of its orders waits for it and finds `oz` committed (a replay, in the batch); on PostgreSQL
/// that read does not see it, the batch's INSERT waits for it and finds `oz` taken, and every
/// call of the batch runs alone after a rollback. Either way `oz` is answered by the original
/// and the others are written once.
pub async fn an_order_created_under_a_group_commit_is_replayed_and_the_rest_of_it_commits(app: &TestApp) {
    app.funded("alice", "10.00").await;
    app.open("shop", "USD").await;
    app.create_order("m1", "paid-here", "shop", "2.00").await.unwrap();

    let mut holder = app.raw.begin().await.unwrap();
    let original = "INSERT INTO orders (merchant_id, order_no, payee_account_id, amount, currency, subject, status, \
                    refunded_amount, created_at, updated_at) \
                    VALUES ('m1', 'oz', 'shop', 200, 'USD', 'order oz', 'PENDING', 0, 1, 1)";
    sqlx::query(original).execute(&mut *holder).await.unwrap();

    let ledger = app.ledger.clone();
    let batch = tokio::spawn(async move {
        ledger
            .write_together(vec![
                (order_command("oz", "shop", "2.00", None), guards(None, None)),
                (order_command("oz2", "shop", "3.00", None), guards(Some("koz2"), None)),
                (BatchCall::Pay(pay_command("tz", "paid-here", "alice", "2.00")), guards(None, None)),
            ])
            .await
    });
    // SQLite: the holder's write keeps the batch from starting (one writer), so the batch
    // reads `oz` committed instead; the answers are the same.
    app.wait_for_a_session_in("%orders%").await;
    holder.commit().await.unwrap();
    let answers: Vec<_> = batch.await.unwrap().into_iter().map(|answer| answer.map_err(tonic::Status::from)).collect();

    let oz = created(&answers[0], true);
    assert_eq!(
        (oz.order_no.as_str(), oz.created_at.as_ref().map(|time| time.seconds)),
        ("oz", Some(0)),
        "the original"
    );
    let oz2 = created(&answers[1], false);
    assert_eq!(oz2.amount, "3.00");
    let paid = answers[2].as_ref().expect("the Pay");
    assert!(!paid.replayed);
    let metrics = app.metrics().await;
    let alone = sample(&metrics, "payledger_group_commit_alone_total", "");
    let in_batch = app.ledger.counters().group_committed_orders - 1;
    if app.backend == crate::helpers::Backend::Postgres {
        assert_eq!((alone, in_batch), (3.0, 0), "rolled back, each call alone");
    } else {
        assert_eq!((alone, in_batch), (0.0, 1), "oz replayed in the batch, oz2 written by it");
    }
    assert_eq!(app.rows("orders").await, 3);
    assert_eq!(app.rows("payment_flow").await, 1);
    assert_eq!(app.balance("shop").await, "2.00");
    assert_eq!(app.rows("idempotency_record").await, 1);
    assert!(app.ledger.audit().await.unwrap().is_empty());
}

/// A keyed CreateOrder whose original (same key, same order) commits while the retry is in its
/// batch: the retry found no record before it queued and does not read its order before the
/// batch; the batch finds the order (MariaDB, SQLite) or the key (PostgreSQL) taken, and the
/// retry is answered by its key's record, the response as first sent, as it is when the
/// original committed before the retry read its key; not by the order as its natural key finds
/// it. The record's stored order is marked by its subject so that the two answers differ.
pub async fn a_call_whose_original_commits_under_its_batch_is_answered_by_its_key_record(app: &TestApp) {
    use prost::Message as _;
    app.open("shop", "USD").await;

    let mut holder = app.raw.begin().await.unwrap();
    let original = "INSERT INTO orders (merchant_id, order_no, payee_account_id, amount, currency, subject, status, \
                    refunded_amount, created_at, updated_at) \
                    VALUES ('m1', 'ok', 'shop', 200, 'USD', 'order ok', 'PENDING', 0, 1, 1)";
    sqlx::query(original).execute(&mut *holder).await.unwrap();
    let as_first_sent = proto::CreateOrderResponse {
        order: Some(proto::Order {
            merchant_id: "m1".into(),
            order_no: "ok".into(),
            subject: "as first sent".into(),
            ..Default::default()
        }),
    };
    let fields = "order_no=ok\npayee_account_id=shop\namount=200\ncurrency=USD\nsubject=order ok\n";
    app.write_record(&mut holder, ("merchant:m1", "kok", "CreateOrder"), fields, &as_first_sent.encode_to_vec()).await;

    let ledger = app.ledger.clone();
    let batch = tokio::spawn(async move {
        ledger.write_together(vec![(order_command("ok", "shop", "2.00", None), guards(Some("kok"), None))]).await
    });
    // PostgreSQL's batch does not see the uncommitted order and waits in its claim of the key;
    // MariaDB's locking read of the order waits for it; SQLite's batch waits for the writer.
    match app.backend {
        crate::helpers::Backend::Postgres => app.wait_for_a_write_waiting_on("idempotency_record").await,
        _ => app.wait_for_a_session_in("%orders%").await,
    }
    holder.commit().await.unwrap();
    let answers: Vec<_> = batch.await.unwrap().into_iter().map(|answer| answer.map_err(tonic::Status::from)).collect();

    let answered = created(&answers[0], true);
    assert_eq!(Some(answered), as_first_sent.order, "answered by the key's record");
    assert_eq!(app.rows("orders").await, 1);
    assert_eq!(app.rows("idempotency_record").await, 1);
}

/// With two batches of one worker in flight (`GroupCommitSettings::pipeline`,
/// `--pay-batch-pipeline 2`), a batch that waits for a row lock another transaction holds does
/// not hold up the calls queued behind it on other rows: bob's Pay is written by a batch of its own while the
/// batch of alice's Pay still waits for alice's row, which then commits in its batch too
/// (one batch after another, alice's batch would wait until the lock timeout while bob's
/// Pay queued behind it, and alice's Pay would then run alone).
pub async fn a_batch_waiting_for_a_row_lock_does_not_hold_up_the_next_batch(app: &TestApp) {
    app.funded("alice", "10.00").await;
    app.funded("bob", "10.00").await;
    app.open("shop", "USD").await;
    app.open("shop2", "USD").await;
    app.create_order("m1", "oa", "shop", "1.00").await.unwrap();
    app.create_order("m1", "ob", "shop2", "1.00").await.unwrap();
    let before = app.ledger.counters();

    let mut holder = app.raw.begin().await.unwrap();
    let lock = "SELECT balance FROM accounts WHERE account_id = 'alice' FOR UPDATE";
    sqlx::query(lock).execute(&mut *holder).await.unwrap();
    let request = app.pay_request("m1", "ta", "oa", "alice", "1.00");
    let mut payments = app.payments.clone();
    let alice = tokio::spawn(async move { payments.pay(request).await });
    // PostgreSQL's batch of one reads without locks and waits in its write, at alice's version
    // CAS (`write_one_unlocked`); MariaDB's batch waits in its lock of her row.
    let waiting = match app.backend {
        crate::helpers::Backend::Postgres => "%UPDATE accounts%",
        _ => "%accounts%FOR%UPDATE%",
    };
    app.wait_for_a_session_in(waiting).await;

    let bob = app.pay("m1", "tb", "ob", "bob", "1.00").await.unwrap();
    assert!(!replayed(&bob));
    assert!(!alice.is_finished(), "alice's batch still waits for her row");
    assert_eq!(app.ledger.counters().group_committed_pays - before.group_committed_pays, 1, "bob's batch committed");
    holder.commit().await.unwrap();
    let alice = alice.await.unwrap().unwrap();
    assert!(!replayed(&alice));

    let after = app.ledger.counters();
    assert_eq!(after.group_committed_pays - before.group_committed_pays, 2, "{after:?}");
    assert_eq!(after.group_commits - before.group_commits, 2, "{after:?}");
    assert_eq!(sample(&app.metrics().await, "payledger_group_commit_alone_total", ""), 0.0, "neither ran alone");
    assert_eq!((app.balance("alice").await, app.balance("bob").await), ("9.00".to_owned(), "9.00".to_owned()));
    assert!(app.ledger.audit().await.unwrap().is_empty());
}

/// [`a_batch_waiting_for_a_row_lock_does_not_hold_up_the_next_batch`] on the default server:
/// a batch starts beside the running ones while each of them holds a single call (light load),
/// so a second caller is served beside a batch of one that waits for a row lock.
pub async fn a_second_caller_is_served_beside_a_batch_of_one_waiting_for_a_row_lock(app: &TestApp) {
    a_batch_waiting_for_a_row_lock_does_not_hold_up_the_next_batch(app).await;
}

/// On PostgreSQL a batch of one whose order and accounts the server saw committed is decided
/// from them and written in one round trip (docs/write-engine.md, "Known rows"). Rows another
/// writer moved meanwhile (here `pay_together`, which passes by the known rows, as another
/// instance's write would) fail that write whole, with nothing of it written, and the call is
/// read and written again: a payer's funds are not spent twice, and a paid order is forgotten,
/// so that a retry of its Pay reads its payment at once and is a replay.
pub async fn pays_decided_from_known_rows_that_moved_meanwhile_are_read_again_and_move_money_once(app: &TestApp) {
    app.funded("alice", "3.00").await;
    app.open("shop", "USD").await;
    for order_no in ["k1", "k2", "k3", "k4"] {
        app.create_order("m1", order_no, "shop", "1.00").await.unwrap();
    }
    let counts = async || {
        let metrics = app.metrics().await;
        let count = |name| sample(&metrics, name, "");
        (count("payledger_known_row_writes_total"), count("payledger_known_row_misses_total"))
    };
    let before = counts().await;

    // Both are decided from rows the server saw committed: the accounts as opened and funded
    // and the orders as created, then alice and the shop as k1 left them.
    assert!(!replayed(&app.pay("m1", "t1", "k1", "alice", "1.00").await.unwrap()));
    assert!(!replayed(&app.pay("m1", "t2", "k2", "alice", "1.00").await.unwrap()));
    let other = app.ledger.pay_together(vec![pay_command("t3", "k3", "alice", "1.00")]).await;
    assert!(other[0].is_ok(), "{:?}", other[0]);
    // alice has nothing left, and the row the server knows says 1.00.
    let refused = app.pay("m1", "t4", "k4", "alice", "1.00").await.unwrap_err();
    assert_status(&refused, Code::FailedPrecondition, "INSUFFICIENT_FUNDS");
    assert!(replayed(&app.pay("m1", "t2", "k2", "alice", "1.00").await.unwrap()));

    let (writes, misses) = counts().await;
    let expected = if app.backend == crate::helpers::Backend::Postgres { (2.0, 1.0) } else { (0.0, 0.0) };
    assert_eq!((writes - before.0, misses - before.1), expected, "(writes from known rows, misses)");
    assert_eq!((app.balance("alice").await, app.balance("shop").await), ("0.00".to_owned(), "3.00".to_owned()));
    assert_eq!(app.rows("payment_flow").await, 3);
    assert!(app.ledger.audit().await.unwrap().is_empty());
}

/// [`racing_calls_with_one_key_and_other_terms_are_answered_by_the_key`] with each call in its
/// own transaction (group commit off): a loser reads the order, taken, before its key has a
/// record, and is answered by the key's record.
pub async fn racing_calls_with_one_key_and_other_terms_one_by_one(app: &TestApp) {
    racing_calls_with_one_key_and_other_terms_are_answered_by_the_key(app).await;
}

/// Calls that share one idempotency key and one order_no but not their terms, sent at once:
/// one creates the order, and every other call is answered by the key, as it is when they come
/// one after the other: a replay of the winner's record for the winner's terms,
/// IDEMPOTENCY_KEY_REUSED for other terms, never ORDER_NO_REUSED (the key's record commits
/// with the order, so a call that finds the order finds the record too).
pub async fn racing_calls_with_one_key_and_other_terms_are_answered_by_the_key(app: &TestApp) {
    app.open("shop", "USD").await;
    let mut refused = 0;
    for round in 0..30 {
        let calls: Vec<_> = (0..6)
            .map(|n| {
                let amount = if n % 2 == 0 { "3.00" } else { "4.00" };
                let request = proto::CreateOrderRequest {
                    merchant_id: "m1".into(),
                    order_no: format!("race-{round}"),
                    payee_account_id: "shop".into(),
                    amount: amount.into(),
                    currency: "USD".into(),
                    subject: "race".into(),
                    expires_at: None,
                };
                let request = with_key(request, &format!("race-key-{round}"));
                let mut payments = app.payments.clone();
                tokio::spawn(async move { (amount, payments.create_order(request).await) })
            })
            .collect();
        let mut answers = Vec::new();
        for call in calls {
            answers.push(call.await.unwrap());
        }
        let winners: Vec<&str> = answers
            .iter()
            .filter(|(_, answer)| answer.as_ref().is_ok_and(|created| !replayed(created)))
            .map(|(amount, _)| *amount)
            .collect();
        assert_eq!(winners.len(), 1, "round {round}: {answers:?}");
        for (amount, answer) in &answers {
            match answer {
                Ok(created) => assert_eq!(created.get_ref().order.as_ref().unwrap().amount, winners[0], "{answers:?}"),
                Err(status) => {
                    assert_ne!(*amount, winners[0], "round {round}: the winner's terms replay: {status:?}");
                    assert_status(status, Code::AlreadyExists, "IDEMPOTENCY_KEY_REUSED");
                    refused += 1;
                }
            }
        }
    }
    assert_eq!(app.rows("orders").await, 30);
    // Each refusal counted once, as what it was answered: not also as the ORDER_NO_REUSED a
    // loser may have found first.
    assert_eq!(app.ledger.counters().key_conflicts, refused);
}

// ---- The journal's hash chain -------------------------------------------------------------

use payledger::store::chain;
use sqlx::Row as _;

/// One stored journal entry with the fields its hash covers.
struct StoredEntry {
    entry_id: i64,
    currency: String,
    amount: i64,
    balance_after: i64,
    version_after: i64,
    kind: String,
    reference: String,
    posting_id: String,
    counterparty_account_id: String,
    created_at: i64,
    created_by: String,
    entry_hash: String,
}

impl StoredEntry {
    fn hash(&self, account_id: &str, previous: &chain::Hash) -> chain::Hash {
        let fields = chain::ChainedEntry {
            account_id,
            currency: &self.currency,
            amount: self.amount,
            balance_after: self.balance_after,
            version_after: self.version_after,
            kind: &self.kind,
            reference: &self.reference,
            posting_id: &self.posting_id,
            counterparty_account_id: &self.counterparty_account_id,
            created_at: self.created_at,
            created_by: &self.created_by,
        };
        chain::entry_hash(previous, &fields)
    }
}

/// `account_id`'s entries, oldest first.
async fn stored_entries(app: &TestApp, account_id: &str) -> Vec<StoredEntry> {
    let rows = sqlx::query(&format!(
        "SELECT entry_id, currency, amount, balance_after, version_after, kind, reference, posting_id, \
         counterparty_account_id, created_at, created_by, entry_hash FROM journal_entries \
         WHERE account_id = '{account_id}' ORDER BY entry_id"
    ))
    .fetch_all(&app.raw)
    .await
    .unwrap();
    rows.iter()
        .map(|row| StoredEntry {
            entry_id: row.get(0),
            currency: row.get(1),
            amount: row.get(2),
            balance_after: row.get(3),
            version_after: row.get(4),
            kind: row.get(5),
            reference: row.get(6),
            posting_id: row.get(7),
            counterparty_account_id: row.get(8),
            created_at: row.get(9),
            created_by: row.get(10),
            entry_hash: row.get(11),
        })
        .collect()
}

/// How a forger who knows the chain rewrites an account's history: entry `index`'s reference
/// changed, then the hashes recomputed from it on for `rehashed` entries (0: none), and the
/// account's chain_hash set to the last hash when `head`.
struct Forgery {
    index: usize,
    rehashed: usize,
    head: bool,
}

/// Writes `entries` (`account_id`'s, oldest first) as `forgery` changes them, or as they were
/// (`forgery` `None`).
async fn write_history(app: &TestApp, account_id: &str, entries: &[StoredEntry], forgery: Option<&Forgery>) {
    let mut previous = chain::GENESIS;
    let mut head = entries.last().map(|entry| entry.entry_hash.clone()).unwrap_or_default();
    for (index, entry) in entries.iter().enumerate() {
        let (reference, hash) = match forgery {
            Some(forgery) if index >= forgery.index => {
                let forged = StoredEntry { reference: format!("{}-rewritten", entry.reference), ..clone_entry(entry) };
                let edited = if index == forgery.index { forged } else { clone_entry(entry) };
                let hash = if index < forgery.index + forgery.rehashed {
                    chain::to_hex(&edited.hash(account_id, &previous))
                } else {
                    entry.entry_hash.clone()
                };
                (edited.reference, hash)
            }
            _ => (entry.reference.clone(), entry.entry_hash.clone()),
        };
        previous = chain::stored(&hash);
        if forgery.is_some_and(|forgery| forgery.head) {
            head.clone_from(&hash);
        }
        let update = format!(
            "UPDATE journal_entries SET reference = '{reference}', entry_hash = '{hash}' WHERE entry_id = {}",
            entry.entry_id
        );
        sqlx::query(&update).execute(&app.raw).await.unwrap();
    }
    let update = format!("UPDATE accounts SET chain_hash = '{head}' WHERE account_id = '{account_id}'");
    sqlx::query(&update).execute(&app.raw).await.unwrap();
}

fn clone_entry(entry: &StoredEntry) -> StoredEntry {
    StoredEntry {
        currency: entry.currency.clone(),
        kind: entry.kind.clone(),
        reference: entry.reference.clone(),
        posting_id: entry.posting_id.clone(),
        counterparty_account_id: entry.counterparty_account_id.clone(),
        created_by: entry.created_by.clone(),
        entry_hash: entry.entry_hash.clone(),
        ..*entry
    }
}

/// History rewritten by hand: an entry edited alone, an entry edited with its own hash
/// recomputed, the latest entry edited with its hash but not the account's, each found by the
/// audit's chain or head check; and a history rewritten with every hash and the account's
/// chain_hash recomputed, which no check of the database alone can see, found by the digest
/// taken before it, which names the account.
pub async fn the_hash_chain_finds_rewritten_history_and_the_digest_what_was_rewritten_consistently(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;
    let checkpoint = app.ledger.settled_entry(i64::MAX).await.unwrap();
    app.pay("m1", "pay-1", "order-1", "alice", "30.00").await.unwrap();
    app.refund("m1", "pay-1", "refund-1", "10.00").await.unwrap();
    let newest = app.ledger.settled_entry(i64::MAX).await.unwrap();
    assert_eq!(app.ledger.audit().await.unwrap(), Vec::new());
    let (digest, leaves) = app.ledger.journal_digest(newest).await.unwrap();
    let alice = stored_entries(app, "alice").await;
    assert!(alice.len() >= 3, "a deposit, a payment and a refund");
    assert!(alice.iter().all(|entry| chain::from_hex(&entry.entry_hash).is_some()), "every entry is chained");

    let last = alice.len() - 1;
    let careless = [
        (Forgery { index: 0, rehashed: 0, head: false }, "chains it to its account's entry before it"),
        (Forgery { index: 0, rehashed: 1, head: false }, "chains it to its account's entry before it"),
        (Forgery { index: last, rehashed: 1, head: false }, "holds its latest entry's balance, version and chain hash"),
    ];
    for (forgery, check) in &careless {
        write_history(app, "alice", &alice, Some(forgery)).await;
        let full = app.ledger.audit().await.unwrap();
        let ranged = app.ledger.audit_entries(checkpoint, newest).await.unwrap();
        write_history(app, "alice", &alice, None).await;
        let named = |found: &[payledger::store::AuditViolation]| {
            found.iter().any(|violation| violation.check.contains(check) && violation.subject == "alice")
        };
        assert!(named(&full), "{check}: {full:#?}");
        if forgery.index > 0 {
            assert!(named(&ranged), "from the checkpoint, {check}: {ranged:#?}");
        }
    }

    // Every hash recomputed and the account's chain_hash with them: consistent.
    write_history(app, "alice", &alice, Some(&Forgery { index: 1, rehashed: alice.len(), head: true })).await;
    assert_eq!(app.ledger.audit().await.unwrap(), Vec::new(), "a consistent rewrite passes the database's checks");
    let (now, heads) = app.ledger.journal_digest(newest).await.unwrap();
    assert_ne!(now, digest);
    assert_eq!(now.upto_entry, digest.upto_entry);
    assert_eq!(
        chain::first_difference(&leaves, &heads).as_deref(),
        Some("account alice: its history up to the entry changed")
    );
    write_history(app, "alice", &alice, None).await;
    assert_eq!(app.ledger.journal_digest(newest).await.unwrap().0, digest, "put back, the digest holds again");
    assert_eq!(app.ledger.audit().await.unwrap(), Vec::new());
}

/// A posting deleted whole after the checkpoint, with its transfer row, leaves no entry in the
/// range to check: its accounts still hold the versions and chain hashes it left, which the
/// audit from the checkpoint reads for every account.
pub async fn an_audit_from_a_checkpoint_finds_a_posting_deleted_whole_after_it(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;
    app.open("carol", "USD").await;
    let checkpoint = app.ledger.settled_entry(i64::MAX).await.unwrap();
    let transfer = with_key(transfer_request("alice", "carol", "5.00"), "transfer-1");
    app.accounts.clone().transfer(transfer).await.unwrap();
    let newest = app.ledger.settled_entry(i64::MAX).await.unwrap();
    assert_eq!(app.ledger.audit_entries(checkpoint, newest).await.unwrap(), Vec::new());

    sqlx::query("DELETE FROM journal_entries WHERE kind = 'TRANSFER'").execute(&app.raw).await.unwrap();
    sqlx::query("DELETE FROM transfers").execute(&app.raw).await.unwrap();
    let violations = app.ledger.audit_entries(checkpoint, newest).await.unwrap();

    // The accounts set back to their latest entries, as a careful forger would: consistent.
    for column in ["balance_after", "version_after"] {
        let account_column = column.trim_end_matches("_after").replace("balance_", "balance");
        sqlx::query(&format!(
            "UPDATE accounts SET {account_column} = COALESCE((SELECT e.{column} FROM journal_entries e \
             WHERE e.account_id = accounts.account_id ORDER BY e.entry_id DESC LIMIT 1), 0) \
             WHERE account_id IN ('alice', 'carol')"
        ))
        .execute(&app.raw)
        .await
        .unwrap();
    }
    sqlx::query(
        "UPDATE accounts SET chain_hash = (SELECT e.entry_hash FROM journal_entries e \
         WHERE e.account_id = accounts.account_id ORDER BY e.entry_id DESC LIMIT 1) WHERE account_id IN ('alice', 'carol')",
    )
    .execute(&app.raw)
    .await
    .unwrap();
    for account_id in ["alice", "carol"] {
        assert!(
            violations.iter().any(|violation| violation.subject == account_id
                && violation.check.contains("holds its latest entry's balance, version and chain hash")),
            "{account_id}: {violations:#?}"
        );
    }
    assert_eq!(app.ledger.audit().await.unwrap(), Vec::new(), "deleted consistently, only a digest could tell");
}

/// Close reasons their order's history does not explain: a hold's reason on an order closed
/// by its merchant, a closed order whose hold is active, a reason no transition writes, and an
/// expiry before the order's deadline.
pub async fn the_audit_finds_close_reasons_the_history_does_not_explain(app: &TestApp) {
    app.order_ready_to_pay("order-1", "100.00", "30.00").await;
    let close = proto::CloseOrderRequest { merchant_id: "m1".into(), order_no: "order-1".into() };
    app.payments.clone().close_order(close).await.unwrap();
    assert_eq!(app.ledger.audit().await.unwrap(), Vec::new());
    let edits = [
        "close_reason = 'VOIDED'",
        "close_reason = 'HOLD_EXPIRED'",
        "close_reason = 'LOST'",
        "close_reason = 'EXPIRED', expires_at = NULL",
    ];
    for edit in edits {
        sqlx::query(&format!("UPDATE orders SET {edit} WHERE order_no = 'order-1'")).execute(&app.raw).await.unwrap();
        let violations = app.ledger.audit().await.unwrap();
        sqlx::query("UPDATE orders SET close_reason = 'MERCHANT' WHERE order_no = 'order-1'")
            .execute(&app.raw)
            .await
            .unwrap();
        assert!(
            violations
                .iter()
                .any(|violation| violation.subject == "m1/order-1"
                    && violation.check.contains("one its history explains")),
            "{edit}: {violations:#?}"
        );
    }
    assert_eq!(app.ledger.audit().await.unwrap(), Vec::new());
}
