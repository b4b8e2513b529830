//! The rest of the money's life: orders that expire (refused by the clock, closed by the
//! sweeper) and payouts (Withdraw). Written once, run on every backend (see `main.rs`).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use payledger::ledger::ReaperSettings;
use payledger::proto::{self, query_request::Key, EntryKind, HoldStatus, OrderCloseReason, OrderStatus};
use tonic::{Code, Response, Status};

use crate::helpers::{assert_status, replayed, violated_fields, with_key, TestApp};

/// Now plus `ahead` (which may be negative) as a protobuf Timestamp, to the microsecond.
fn timestamp_in(ahead_ms: i64) -> prost_types::Timestamp {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let micros = i64::try_from(now.as_micros()).unwrap() + ahead_ms * 1_000;
    prost_types::Timestamp {
        seconds: micros.div_euclid(1_000_000),
        nanos: (micros.rem_euclid(1_000_000) * 1_000) as i32,
    }
}

fn order_request(
    order_no: &str,
    amount: &str,
    expires_at: Option<prost_types::Timestamp>,
) -> proto::CreateOrderRequest {
    proto::CreateOrderRequest {
        merchant_id: "m1".into(),
        order_no: order_no.into(),
        payee_account_id: "shop".into(),
        amount: amount.into(),
        currency: "USD".into(),
        subject: format!("order {order_no}"),
        expires_at,
    }
}

/// A sweeper run with small batches, so that a test crosses batch boundaries.
fn sweeper(batch_size: u32) -> ReaperSettings {
    ReaperSettings { interval: Duration::from_secs(1), batch_size, pause: Duration::from_millis(1) }
}

async fn order_of(app: &TestApp, order_no: &str) -> proto::Order {
    app.query("m1", Key::OrderNo(order_no.into())).await.unwrap().order.unwrap()
}

async fn withdraw(
    app: &TestApp,
    request_id: &str,
    account_id: &str,
    amount: &str,
    currency: &str,
) -> Result<Response<proto::WithdrawResponse>, Status> {
    let request = proto::WithdrawRequest {
        request_id: request_id.into(),
        account_id: account_id.into(),
        amount: amount.into(),
        currency: currency.into(),
    };
    app.accounts.clone().withdraw(request).await
}

/// The balance of a currency's external funding account, in minor units (read directly: its
/// id is not one a caller may name).
async fn external_balance(app: &TestApp, currency: &str) -> i64 {
    let sql = format!("SELECT balance FROM accounts WHERE account_id = '@external:{currency}'");
    sqlx::query_scalar(&sql).fetch_one(&app.raw).await.unwrap()
}

pub async fn an_order_past_its_expires_at_refuses_pay_before_and_after_the_sweeper_closes_it(app: &TestApp) {
    app.funded("alice", "100.00").await;
    app.open("shop", "USD").await;
    let mut payments = app.payments.clone();
    for order_no in ["short", "paid-in-time", "keyed"] {
        payments.create_order(order_request(order_no, "5.00", Some(timestamp_in(1_200)))).await.unwrap();
    }
    payments.create_order(order_request("no-deadline", "5.00", None)).await.unwrap();
    app.pay("m1", "pay-in-time", "paid-in-time", "alice", "5.00").await.unwrap();
    let pending = order_of(app, "short").await;
    assert_eq!((pending.status(), pending.close_reason()), (OrderStatus::Pending, OrderCloseReason::Unspecified));
    assert!(pending.expires_at.is_some() && order_of(app, "no-deadline").await.expires_at.is_none());

    tokio::time::sleep(Duration::from_millis(1_400)).await;
    let before = app.all_rows().await;
    // Refused by the clock, before any sweep: grouped (no key) and alone (with a key).
    let late = app.pay("m1", "pay-late", "short", "alice", "5.00").await.unwrap_err();
    assert_status(&late, Code::FailedPrecondition, "ORDER_EXPIRED");
    let keyed = payments.pay(with_key(app.pay_request("m1", "pay-keyed", "keyed", "alice", "5.00"), "k-1")).await;
    assert_status(&keyed.unwrap_err(), Code::FailedPrecondition, "ORDER_EXPIRED");
    assert_eq!(app.all_rows().await, before, "a refused Pay leaves nothing behind");
    assert_eq!(app.balance("alice").await, "95.00");
    // The payment made in time still replays, and still refunds, after the deadline.
    let replay = app.pay("m1", "pay-in-time", "paid-in-time", "alice", "5.00").await.unwrap();
    assert!(replayed(&replay));
    app.refund("m1", "pay-in-time", "refund-1", "1.00").await.unwrap();

    let report = app.ledger.close_expired_orders(&sweeper(1)).await.unwrap();
    assert_eq!((report.orders_closed, report.orders_skipped), (2, 0), "{report:?}");
    for order_no in ["short", "keyed"] {
        let closed = order_of(app, order_no).await;
        assert_eq!((closed.status(), closed.close_reason()), (OrderStatus::Closed, OrderCloseReason::Expired));
    }
    let paid = order_of(app, "paid-in-time").await;
    assert_eq!((paid.status(), paid.close_reason()), (OrderStatus::PartiallyRefunded, OrderCloseReason::Unspecified));
    assert_eq!(order_of(app, "no-deadline").await.status(), OrderStatus::Pending);
    // After the sweep: still ORDER_EXPIRED; CloseOrder answers the closed order as it is.
    let after = app.pay("m1", "pay-later", "short", "alice", "5.00").await.unwrap_err();
    assert_status(&after, Code::FailedPrecondition, "ORDER_EXPIRED");
    let close = proto::CloseOrderRequest { merchant_id: "m1".into(), order_no: "short".into() };
    let closed = payments.close_order(close).await.unwrap();
    assert!(replayed(&closed));
    assert_eq!(closed.into_inner().order.unwrap().close_reason(), OrderCloseReason::Expired);
    // A second sweep finds nothing; a merchant's close says MERCHANT.
    let again = app.ledger.close_expired_orders(&sweeper(10)).await.unwrap();
    assert_eq!((again.orders_closed, again.orders_skipped), (0, 0));
    let close = proto::CloseOrderRequest { merchant_id: "m1".into(), order_no: "no-deadline".into() };
    let closed = payments.close_order(close).await.unwrap().into_inner().order.unwrap();
    assert_eq!((closed.status(), closed.close_reason()), (OrderStatus::Closed, OrderCloseReason::Merchant));
    let on_closed = app.pay("m1", "pay-closed", "no-deadline", "alice", "5.00").await.unwrap_err();
    assert_status(&on_closed, Code::FailedPrecondition, "ORDER_CLOSED");
    assert_eq!(app.metrics().await.get("payledger_orders_expired_total").copied(), Some(2.0));
}

pub async fn expires_at_must_be_a_valid_future_timestamp_and_is_part_of_the_orders_terms(app: &TestApp) {
    app.open("shop", "USD").await;
    let mut payments = app.payments.clone();
    let before = app.all_rows().await;
    for (expires_at, why) in [
        (timestamp_in(-1_000), "in the past"),
        (prost_types::Timestamp { seconds: 4_000_000_000, nanos: 1_000_000_000 }, "nanos out of range"),
        (prost_types::Timestamp { seconds: 253_402_300_800, nanos: 0 }, "after 9999-12-31"),
        (prost_types::Timestamp { seconds: -62_135_596_801, nanos: 0 }, "before 0001-01-01"),
    ] {
        let refused = payments.create_order(order_request("order-1", "5.00", Some(expires_at))).await.unwrap_err();
        assert_eq!(refused.code(), Code::InvalidArgument, "{why}: {refused:?}");
        assert_eq!(violated_fields(&refused), ["expires_at"], "{why}");
    }
    assert_eq!(app.all_rows().await, before, "a refused CreateOrder leaves nothing behind");

    let deadline = timestamp_in(3_600_000);
    let first = payments.create_order(order_request("order-1", "5.00", Some(deadline))).await.unwrap();
    assert!(!replayed(&first));
    let created = first.into_inner().order.unwrap();
    let kept = created.expires_at.unwrap();
    assert_eq!((kept.seconds, kept.nanos / 1_000), (deadline.seconds, deadline.nanos / 1_000), "kept to the µs");
    // The same deadline, or none, replays; another deadline is another order's terms.
    let same = payments.create_order(order_request("order-1", "5.00", Some(deadline))).await.unwrap();
    let without = payments.create_order(order_request("order-1", "5.00", None)).await.unwrap();
    assert!(replayed(&same) && replayed(&without));
    assert_eq!(without.into_inner().order.unwrap(), created);
    let other = payments.create_order(order_request("order-1", "5.00", Some(timestamp_in(7_200_000)))).await;
    let other = other.unwrap_err();
    assert_status(&other, Code::AlreadyExists, "ORDER_NO_REUSED");
    assert!(other.message().contains("expires_at"), "{other:?}");
    // An order made without a deadline on this server (no --order-ttl-seconds) never expires,
    // and a retry naming a deadline is a different order.
    payments.create_order(order_request("order-2", "5.00", None)).await.unwrap();
    let named = payments.create_order(order_request("order-2", "5.00", Some(deadline))).await.unwrap_err();
    assert_status(&named, Code::AlreadyExists, "ORDER_NO_REUSED");
}

/// On a server with `--order-ttl-seconds 2`: an order without expires_at gets one.
pub async fn an_order_without_expires_at_gets_the_servers_default_lifetime(app: &TestApp) {
    app.funded("alice", "10.00").await;
    app.open("shop", "USD").await;
    let order = app.create_order("m1", "order-1", "shop", "1.00").await.unwrap().into_inner().order.unwrap();
    let (created, expires) = (order.created_at.unwrap(), order.expires_at.unwrap());
    assert_eq!((expires.seconds - created.seconds, expires.nanos), (2, created.nanos));
    // Its retry, which leaves expires_at out as the first call did, replays the same order.
    let again = app.create_order("m1", "order-1", "shop", "1.00").await.unwrap();
    assert!(replayed(&again));
    assert_eq!(again.into_inner().order.unwrap(), order);
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    let late = app.pay("m1", "pay-1", "order-1", "alice", "1.00").await.unwrap_err();
    assert_status(&late, Code::FailedPrecondition, "ORDER_EXPIRED");
}

/// Pays land just before, at and after their orders' deadline while two sweepers run over and
/// over: every order ends PAID (by a Pay before the deadline) with its one payment, or CLOSED
/// as EXPIRED with none, and each Pay was told which.
pub async fn pays_racing_the_expiry_sweeper_end_with_exactly_one_winner_per_order(app: &TestApp) {
    const ORDERS: usize = 60;
    app.funded("alice", "1000.00").await;
    app.open("shop", "USD").await;
    let payments = app.payments.clone();
    // One deadline for every order, 2 s from now; the orders are created well within it, all
    // at once (group-committed together: one after another they took over 1.5 s on a slow
    // machine).
    let (deadline_ms, started) = (2_000, tokio::time::Instant::now());
    let deadline = timestamp_in(deadline_ms);
    let creations = (0..ORDERS).map(|n| {
        let mut payments = payments.clone();
        async move { payments.create_order(order_request(&format!("order-{n}"), "1.00", Some(deadline))).await }
    });
    for created in futures::future::join_all(creations).await {
        created.unwrap();
    }
    assert!(started.elapsed() < Duration::from_millis(1_500), "creating the orders took {:?}", started.elapsed());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sweepers: Vec<_> = (0..2)
        .map(|_| {
            let (ledger, stop) = (app.ledger.clone(), stop.clone());
            tokio::spawn(async move {
                let mut closed = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    closed += ledger.close_expired_orders(&sweeper(7)).await.expect("a sweep").orders_closed;
                    // Some Pays land on orders past their deadline but not yet swept.
                    tokio::time::sleep(Duration::from_millis(40)).await;
                }
                closed
            })
        })
        .collect();
    // Each order gets a Pay (grouped, or alone with a key) and its retry, timed from 300 ms
    // before the deadline to 300 ms after it.
    let mut calls = Vec::new();
    for n in 0..ORDERS {
        let at = Duration::from_millis(u64::try_from(deadline_ms - 300 + (n * 600 / ORDERS) as i64).unwrap());
        let request = app.pay_request("m1", &format!("pay-{n}"), &format!("order-{n}"), "alice", "1.00");
        for attempt in 0..2 {
            let (mut payments, request) = (payments.clone(), request.clone());
            calls.push(tokio::spawn(async move {
                tokio::time::sleep_until(started + at).await;
                let outcome = if n % 3 == 0 {
                    payments.pay(with_key(request, &format!("key-{n}"))).await
                } else {
                    payments.pay(request).await
                };
                (n, attempt, outcome.map(|response| response.into_inner()))
            }));
        }
    }
    let outcomes: Vec<_> = futures::future::join_all(calls).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut swept = 0;
    for sweeper in sweepers {
        swept += sweeper.await.unwrap();
    }

    let mut paid = 0;
    for n in 0..ORDERS {
        let order = order_of(app, &format!("order-{n}")).await;
        let answers: Vec<_> =
            outcomes.iter().map(|joined| joined.as_ref().unwrap()).filter(|(m, _, _)| *m == n).collect();
        match order.status() {
            OrderStatus::Paid => {
                paid += 1;
                for (_, attempt, answer) in &answers {
                    let answer = answer
                        .as_ref()
                        .unwrap_or_else(|error| panic!("order-{n} is paid, yet attempt {attempt}: {error:?}"));
                    let payment = answer.payment.as_ref().unwrap();
                    assert_eq!(payment.out_trade_no, format!("pay-{n}"));
                    // Paid before its deadline, by the server's clock.
                    let paid_at = payment.created_at.unwrap();
                    assert!(
                        (paid_at.seconds, paid_at.nanos) < (deadline.seconds, deadline.nanos / 1_000 * 1_000),
                        "order-{n}"
                    );
                }
            }
            OrderStatus::Closed => {
                assert_eq!(order.close_reason(), OrderCloseReason::Expired, "order-{n}");
                for (_, _, answer) in &answers {
                    assert_status(answer.as_ref().unwrap_err(), Code::FailedPrecondition, "ORDER_EXPIRED");
                }
            }
            other => panic!("order-{n} ended {other:?}"),
        }
    }
    assert_eq!(app.rows("payment_flow").await, paid);
    assert_eq!(swept, ORDERS as u64 - u64::try_from(paid).unwrap(), "every unpaid order was closed by one sweep");
    assert!(paid > 0 && paid < ORDERS as i64, "the Pays straddle the deadline: {paid} of {ORDERS} paid");
    eprintln!("{:?}: {paid} of {ORDERS} orders paid, {swept} closed by the sweepers", app.backend);
    assert_eq!(app.balance("shop").await, format!("{paid}.00"));
}

pub async fn withdraw_pays_out_once_per_request_id_and_refuses_what_it_cannot_pay(app: &TestApp) {
    app.funded("alice", "100.00").await;
    app.open("bob", "EUR").await;
    let external_before = external_balance(app, "USD").await;

    let first = withdraw(app, "out-1", "alice", "30.25", "USD").await.unwrap();
    let again = withdraw(app, "out-1", "alice", "30.25", "USD").await.unwrap();
    assert!(!replayed(&first) && replayed(&again));
    let (first, again) = (first.into_inner(), again.into_inner());
    assert_eq!(first, again, "a replay answers with the original result");
    let entry = first.entry.unwrap();
    assert_eq!((entry.amount.as_str(), entry.balance_after.as_str(), entry.version_after), ("-30.25", "69.75", 2));
    assert_eq!((entry.kind(), entry.reference.as_str()), (EntryKind::Withdrawal, "out-1"));
    assert_eq!(entry.counterparty_account_id, "@external:USD");
    assert_eq!(first.account.unwrap().balance, "69.75");
    assert_eq!(external_balance(app, "USD").await, external_before + 3_025, "the payout goes back outside");

    let before = (app.all_rows().await, app.rows("withdrawals").await);
    let changed = withdraw(app, "out-1", "alice", "1.00", "USD").await.unwrap_err();
    assert_status(&changed, Code::AlreadyExists, "REQUEST_ID_REUSED");
    assert!(changed.message().contains("amount"), "{changed:?}");
    let short = withdraw(app, "out-2", "alice", "69.76", "USD").await.unwrap_err();
    assert_status(&short, Code::FailedPrecondition, "INSUFFICIENT_FUNDS");
    let missing = withdraw(app, "out-3", "nobody", "1.00", "USD").await.unwrap_err();
    assert_status(&missing, Code::NotFound, "ACCOUNT_NOT_FOUND");
    let currency = withdraw(app, "out-4", "bob", "1.00", "USD").await.unwrap_err();
    assert_status(&currency, Code::FailedPrecondition, "CURRENCY_MISMATCH");
    let bad = withdraw(app, "", "alice", "-1", "usd").await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);
    assert_eq!(violated_fields(&bad), ["request_id", "currency", "amount"]);
    assert_eq!((app.all_rows().await, app.rows("withdrawals").await), before, "refusals leave nothing behind");

    // Withdraw's request_ids are its own: a deposit's request_id is free for a withdrawal.
    let out = withdraw(app, "fund-alice", "alice", "69.75", "USD").await.unwrap();
    assert!(!replayed(&out));
    assert_eq!(app.balance("alice").await, "0.00");
    assert_eq!(external_balance(app, "USD").await, 0, "all the money that came in went out");
    // A withdrawal with an idempotency-key replays from its record too.
    app.deposit("top-up", "alice", "5.00", "USD").await.unwrap();
    let keyed = |amount: &str| {
        let request = proto::WithdrawRequest {
            request_id: "out-5".into(),
            account_id: "alice".into(),
            amount: amount.into(),
            currency: "USD".into(),
        };
        with_key(request, "w-key")
    };
    let mut accounts = app.accounts.clone();
    accounts.withdraw(keyed("5.00")).await.unwrap();
    assert!(replayed(&accounts.withdraw(keyed("5.00")).await.unwrap()));
    assert_status(&accounts.withdraw(keyed("4.00")).await.unwrap_err(), Code::AlreadyExists, "IDEMPOTENCY_KEY_REUSED");
    assert_eq!(app.balance("alice").await, "0.00");
}

/// With `--funding-account-shards 4`, Deposits and Withdraws use four funding accounts, each
/// chosen by its request_id: every shard that took money is an EXTERNAL account named in its
/// entries, a replay names the same shard, and the shards together mirror the customers.
pub async fn deposits_and_withdrawals_spread_over_the_funding_shards_and_the_audit_sums_them(app: &TestApp) {
    app.open("alice", "USD").await;
    let mut counterparties = std::collections::BTreeSet::new();
    for n in 0..40 {
        let deposit = app.deposit(&format!("in-{n}"), "alice", "10.00", "USD").await.unwrap().into_inner();
        counterparties.insert(deposit.entry.unwrap().counterparty_account_id);
    }
    for n in 0..20 {
        let withdrawal = withdraw(app, &format!("out-{n}"), "alice", "3.00", "USD").await.unwrap().into_inner();
        counterparties.insert(withdrawal.entry.unwrap().counterparty_account_id);
    }
    let expected: std::collections::BTreeSet<String> =
        ["@external:USD", "@external:USD:1", "@external:USD:2", "@external:USD:3"].map(String::from).into();
    assert_eq!(counterparties, expected, "60 request_ids reach all four shards");
    let replay = app.deposit("in-7", "alice", "10.00", "USD").await.unwrap();
    assert!(replayed(&replay));
    let again = app.deposit("in-7", "alice", "10.00", "USD").await.unwrap().into_inner().entry.unwrap();
    assert!(expected.contains(&again.counterparty_account_id));
    assert_eq!(app.balance("alice").await, "340.00");
    let shards: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT account_id, kind, balance FROM accounts WHERE account_id LIKE '@external:USD%' ORDER BY account_id",
    )
    .fetch_all(&app.raw)
    .await
    .unwrap();
    assert_eq!(shards.len(), 4);
    assert!(shards.iter().all(|(_, kind, _)| kind == "EXTERNAL"), "{shards:?}");
    assert_eq!(shards.iter().map(|(_, _, balance)| balance).sum::<i64>(), -34_000, "the shards mirror alice");
}

/// Deposits use up the external account's room (balances are at most 10^17 minor units, a
/// request at most 10^15); withdrawals give it back, so money can go round for good.
pub async fn deposits_and_withdrawals_go_round_past_the_one_way_limit(app: &TestApp) {
    app.open("whale", "JPY").await;
    let amount = "1000000000000000"; // 10^15 yen, the largest request
    let rounds = 101; // 1.01 x 10^17 yen deposited in all
    for round in 0..rounds {
        app.deposit(&format!("in-{round}"), "whale", amount, "JPY").await.unwrap();
        withdraw(app, &format!("out-{round}"), "whale", amount, "JPY").await.unwrap();
    }
    assert_eq!(app.rows("deposits").await, rounds);
    assert_eq!(app.balance("whale").await, "0");
    assert_eq!(external_balance(app, "JPY").await, 0);
}

/// Pays and withdrawals of 1.00 race on one balance of 100.00: exactly 100 succeed, every
/// other one is INSUFFICIENT_FUNDS, and a retried withdrawal replays.
pub async fn withdrawals_racing_pays_on_one_account_never_overdraw_it(app: &TestApp) {
    app.funded("alice", "100.00").await;
    app.open("shop", "USD").await;
    for n in 0..70 {
        app.create_order("m1", &format!("order-{n}"), "shop", "1.00").await.unwrap();
    }
    let pays = (0..70).map(|n| {
        let mut payments = app.payments.clone();
        let request = app.pay_request("m1", &format!("pay-{n}"), &format!("order-{n}"), "alice", "1.00");
        tokio::spawn(async move { payments.pay(request).await.map(|_| ()) })
    });
    let withdrawals = (0..70).map(|n| {
        let mut accounts = app.accounts.clone();
        let request = proto::WithdrawRequest {
            request_id: format!("out-{n}"),
            account_id: "alice".into(),
            amount: "1.00".into(),
            currency: "USD".into(),
        };
        tokio::spawn(async move { accounts.withdraw(request).await.map(|_| ()) })
    });
    let outcomes: Vec<_> = futures::future::join_all(pays.chain(withdrawals).collect::<Vec<_>>()).await;
    let outcomes: Vec<_> = outcomes.into_iter().map(|joined| joined.unwrap()).collect();
    for error in outcomes.iter().filter_map(|outcome| outcome.as_ref().err()) {
        assert_status(error, Code::FailedPrecondition, "INSUFFICIENT_FUNDS");
    }
    assert_eq!(outcomes.iter().filter(|outcome| outcome.is_ok()).count(), 100);
    assert_eq!(app.balance("alice").await, "0.00");
    let paid = app.rows("payment_flow").await;
    assert_eq!(app.rows("withdrawals").await, 100 - paid);
    assert_eq!(app.balance("shop").await, format!("{paid}.00"));
    // Whichever withdrawal went through replays; one refused runs afresh and is refused again.
    let done: String = sqlx::query_scalar("SELECT request_id FROM withdrawals ORDER BY request_id LIMIT 1")
        .fetch_one(&app.raw)
        .await
        .unwrap();
    assert!(replayed(&withdraw(app, &done, "alice", "1.00", "USD").await.unwrap()));
}

fn authorize_request(out_auth_no: &str, order_no: &str, amount: &str) -> proto::AuthorizeRequest {
    proto::AuthorizeRequest {
        merchant_id: "m1".into(),
        out_auth_no: out_auth_no.into(),
        order_no: order_no.into(),
        payer_account_id: "alice".into(),
        amount: amount.into(),
        currency: "USD".into(),
    }
}

fn capture_request(out_auth_no: &str, out_trade_no: &str, amount: &str) -> proto::CaptureRequest {
    proto::CaptureRequest {
        merchant_id: "m1".into(),
        out_auth_no: out_auth_no.into(),
        out_trade_no: out_trade_no.into(),
        amount: amount.into(),
        currency: "USD".into(),
    }
}

fn void_request(out_auth_no: &str) -> proto::VoidRequest {
    proto::VoidRequest { merchant_id: "m1".into(), out_auth_no: out_auth_no.into() }
}

/// (balance, available_balance) of an account.
async fn balances(app: &TestApp, account_id: &str) -> (String, String) {
    let request = proto::GetAccountRequest { account_id: account_id.into() };
    let account = app.accounts.clone().get_account(request).await.unwrap().into_inner().account.unwrap();
    (account.balance, account.available_balance)
}

fn pair(balance: &str, available: &str) -> (String, String) {
    (balance.to_owned(), available.to_owned())
}

pub async fn a_deposit_or_withdraw_replayed_by_its_request_id_answers_the_account_as_it_stood(app: &TestApp) {
    app.open("alice", "USD").await;
    app.open("shop", "USD").await;
    let deposited = app.deposit("dep-1", "alice", "100.00", "USD").await.unwrap().into_inner();
    let withdraw = proto::WithdrawRequest {
        request_id: "wd-1".into(),
        account_id: "alice".into(),
        amount: "10.00".into(),
        currency: "USD".into(),
    };
    let withdrawn = app.accounts.clone().withdraw(withdraw.clone()).await.unwrap().into_inner();
    app.create_order("m1", "o-1", "shop", "30.00").await.unwrap();
    app.payments.clone().authorize(authorize_request("a-1", "o-1", "30.00")).await.unwrap();

    // Replayed after a hold that came later: each answers the account as it was right after it.
    let deposited_again = app.deposit("dep-1", "alice", "100.00", "USD").await.unwrap();
    let withdrawn_again = app.accounts.clone().withdraw(withdraw).await.unwrap();

    assert!(replayed(&deposited_again) && replayed(&withdrawn_again));
    assert_eq!(deposited_again.into_inner(), deposited, "the deposit's replay is its original answer");
    assert_eq!(withdrawn_again.into_inner(), withdrawn, "the withdrawal's replay is its original answer");
    let available = |account: Option<proto::Account>| {
        let account = account.unwrap();
        (account.balance, account.available_balance)
    };
    assert_eq!(available(deposited.account), pair("100.00", "100.00"));
    assert_eq!(available(withdrawn.account), pair("90.00", "90.00"));
    let now = app.accounts.clone().get_account(proto::GetAccountRequest { account_id: "alice".into() }).await;
    assert_eq!(available(now.unwrap().into_inner().account), pair("90.00", "60.00"), "the hold holds now");
}

pub async fn every_natural_replay_answers_what_its_original_answered_after_later_steps_moved_its_order(app: &TestApp) {
    app.funded("alice", "500.00").await;
    app.open("shop", "USD").await;
    let mut payments = app.payments.clone();
    app.create_order("m1", "o-1", "shop", "100.00").await.unwrap();
    let paid = app.pay("m1", "t-1", "o-1", "alice", "100.00").await.unwrap().into_inner();
    let first_refund = app.refund("m1", "t-1", "r-1", "30.00").await.unwrap().into_inner();
    let last_refund = app.refund("m1", "t-1", "r-2", "70.00").await.unwrap().into_inner();
    app.create_order("m1", "o-2", "shop", "80.00").await.unwrap();
    let authorized = payments.authorize(authorize_request("a-2", "o-2", "80.00")).await.unwrap().into_inner();
    let captured = payments.capture(capture_request("a-2", "t-2", "50.00")).await.unwrap().into_inner();
    app.refund("m1", "t-2", "r-3", "20.00").await.unwrap();

    // Each replayed after the steps that moved its order (and hold) on.
    let paid_again = app.pay("m1", "t-1", "o-1", "alice", "100.00").await.unwrap();
    let first_refund_again = app.refund("m1", "t-1", "r-1", "30.00").await.unwrap();
    let last_refund_again = app.refund("m1", "t-1", "r-2", "70.00").await.unwrap();
    let authorized_again = payments.authorize(authorize_request("a-2", "o-2", "80.00")).await.unwrap();
    let captured_again = payments.capture(capture_request("a-2", "t-2", "50.00")).await.unwrap();

    for was_replayed in [
        replayed(&paid_again),
        replayed(&first_refund_again),
        replayed(&last_refund_again),
        replayed(&authorized_again),
        replayed(&captured_again),
    ] {
        assert!(was_replayed, "every repeat is a replay");
    }
    assert_eq!(paid_again.into_inner(), paid, "a Pay replays its order as PAID, before its refunds");
    assert_eq!(first_refund_again.into_inner(), first_refund, "a refund replays its order as it left it");
    assert_eq!(last_refund_again.into_inner(), last_refund);
    assert_eq!(authorized_again.into_inner(), authorized, "an Authorize replays its hold ACTIVE, before the capture");
    assert_eq!(captured_again.into_inner(), captured, "a Capture replays its order before the refund");
    let status = |order: Option<proto::Order>| order.unwrap().status();
    assert_eq!(status(paid.order), OrderStatus::Paid);
    assert_eq!(status(first_refund.order), OrderStatus::PartiallyRefunded);
    assert_eq!(status(last_refund.order), OrderStatus::Refunded);
    assert_eq!(status(authorized.order), OrderStatus::Authorized);
    assert_eq!(status(captured.order), OrderStatus::Paid);
    let now = app.query("m1", Key::OrderNo("o-2".into())).await.unwrap();
    assert_eq!(status(now.order), OrderStatus::PartiallyRefunded, "the order moved on meanwhile");
}

pub async fn replays_racing_refunds_of_their_order_each_answer_their_original(app: &TestApp) {
    app.funded("alice", "100.00").await;
    app.open("shop", "USD").await;
    app.create_order("m1", "o-1", "shop", "40.00").await.unwrap();
    let paid = app.pay("m1", "t-1", "o-1", "alice", "40.00").await.unwrap().into_inner();
    let first_refund = app.refund("m1", "t-1", "r-0", "1.00").await.unwrap().into_inner();
    let (pay, refund) =
        (app.pay_request("m1", "t-1", "o-1", "alice", "40.00"), app.refund_request("m1", "t-1", "r-0", "1.00"));
    app.read_while_refunds_land("t-1", 13, move |mut payments| {
        let (pay, refund, paid, first_refund) = (pay.clone(), refund.clone(), paid.clone(), first_refund.clone());
        async move {
            let paid_again = payments.pay(pay).await.expect("the Pay's replay");
            assert!(replayed(&paid_again));
            assert_eq!(paid_again.into_inner(), paid, "a Pay's replay, while its order is refunded");
            let refunded_again = payments.refund(refund).await.expect("the refund's replay");
            assert!(replayed(&refunded_again));
            assert_eq!(refunded_again.into_inner(), first_refund, "a refund's replay, while others land");
        }
    })
    .await;
    let order = app.query("m1", Key::OrderNo("o-1".into())).await.unwrap().order.unwrap();
    assert_eq!((order.status(), order.refunded_amount.as_str()), (OrderStatus::Refunded, "40.00"));
}

pub async fn a_hold_reserves_the_available_balance_and_a_partial_capture_pays_like_a_pay(app: &TestApp) {
    app.funded("alice", "100.00").await;
    app.open("shop", "USD").await;
    app.open("bob", "USD").await;
    let mut payments = app.payments.clone();
    for (order_no, amount) in [("o-1", "60.00"), ("o-2", "50.00"), ("o-3", "20.00")] {
        app.create_order("m1", order_no, "shop", amount).await.unwrap();
    }

    let first = payments.authorize(authorize_request("a-1", "o-1", "60.00")).await.unwrap();
    let again = payments.authorize(authorize_request("a-1", "o-1", "60.00")).await.unwrap();
    assert!(!replayed(&first) && replayed(&again));
    let (first, again) = (first.into_inner(), again.into_inner());
    assert_eq!(first.hold, again.hold);
    let hold = first.hold.unwrap();
    assert_eq!(
        (hold.status(), hold.amount.as_str(), hold.captured_amount.as_str()),
        (HoldStatus::Active, "60.00", "0.00")
    );
    assert_eq!(first.order.unwrap().status(), OrderStatus::Authorized);
    assert_eq!(balances(app, "alice").await, pair("100.00", "40.00"), "held, not spent");
    let reused = payments.authorize(authorize_request("a-1", "o-2", "50.00")).await.unwrap_err();
    assert_status(&reused, Code::AlreadyExists, "OUT_AUTH_NO_REUSED");

    // Every debit checks the available balance, not the balance.
    let before = (app.all_rows().await, app.rows("holds").await, app.rows("withdrawals").await);
    let pay = app.pay("m1", "t-2", "o-2", "alice", "50.00").await.unwrap_err();
    assert_status(&pay, Code::FailedPrecondition, "INSUFFICIENT_FUNDS");
    let mut accounts = app.accounts.clone();
    let transfer = accounts.transfer(with_key(crate::helpers::transfer_request("alice", "bob", "40.01"), "x-1")).await;
    assert_status(&transfer.unwrap_err(), Code::FailedPrecondition, "INSUFFICIENT_FUNDS");
    let out = withdraw(app, "out-1", "alice", "40.01", "USD").await.unwrap_err();
    assert_status(&out, Code::FailedPrecondition, "INSUFFICIENT_FUNDS");
    assert_eq!(
        (app.all_rows().await, app.rows("holds").await, app.rows("withdrawals").await),
        before,
        "refusals leave nothing behind"
    );
    withdraw(app, "out-2", "alice", "30.00", "USD").await.unwrap();
    let short = payments.authorize(authorize_request("a-4", "o-2", "50.00")).await.unwrap_err();
    assert_status(&short, Code::FailedPrecondition, "INSUFFICIENT_FUNDS");
    assert_eq!(order_of(app, "o-2").await.status(), OrderStatus::Pending, "a refused hold leaves its order PENDING");
    let on_held = app.pay("m1", "t-1", "o-1", "alice", "60.00").await.unwrap_err();
    assert_status(&on_held, Code::FailedPrecondition, "ORDER_AUTHORIZED");

    // A partial capture: the payment and the order's amount are what was captured.
    let captured = payments.capture(capture_request("a-1", "c-1", "45.00")).await.unwrap();
    assert!(!replayed(&captured));
    let captured = captured.into_inner();
    let payment = captured.payment.clone().unwrap();
    assert_eq!(
        (payment.amount.as_str(), payment.out_trade_no.as_str(), payment.payer_account_id.as_str()),
        ("45.00", "c-1", "alice")
    );
    let order = captured.order.clone().unwrap();
    assert_eq!(
        (order.status(), order.amount.as_str(), order.out_trade_no.as_str()),
        (OrderStatus::Paid, "45.00", "c-1")
    );
    let hold = captured.hold.clone().unwrap();
    assert_eq!(
        (hold.status(), hold.captured_amount.as_str(), hold.out_trade_no.as_str()),
        (HoldStatus::Captured, "45.00", "c-1")
    );
    assert_eq!(balances(app, "alice").await, pair("25.00", "25.00"), "45.00 paid, 15.00 released");
    assert_eq!(app.balance("shop").await, "45.00");
    let retried = payments.capture(capture_request("a-1", "c-1", "45.00")).await.unwrap();
    assert!(replayed(&retried));
    assert_eq!(retried.into_inner().payment, captured.payment);
    let twice = payments.capture(capture_request("a-1", "c-2", "45.00")).await.unwrap_err();
    assert_status(&twice, Code::FailedPrecondition, "ORDER_ALREADY_PAID");
    let changed = payments.capture(capture_request("a-1", "c-1", "44.00")).await.unwrap_err();
    assert_status(&changed, Code::AlreadyExists, "OUT_TRADE_NO_REUSED");
    let void = payments.void(void_request("a-1")).await.unwrap_err();
    assert_status(&void, Code::FailedPrecondition, "ORDER_ALREADY_PAID");
    // The order was created for 60.00 and is now PAID for 45.00: a retry of its CreateOrder
    // still replays, and a Pay or an Authorize of the old amount is told it is paid.
    let create = app.create_order("m1", "o-1", "shop", "60.00").await.unwrap();
    assert!(replayed(&create));
    assert_eq!(create.into_inner().order.unwrap().amount, "45.00", "the order as it stands");
    let pay_again = app.pay("m1", "t-9", "o-1", "alice", "60.00").await.unwrap_err();
    assert_status(&pay_again, Code::FailedPrecondition, "ORDER_ALREADY_PAID");
    let authorize_again = payments.authorize(authorize_request("a-9", "o-1", "60.00")).await.unwrap_err();
    assert_status(&authorize_again, Code::FailedPrecondition, "ORDER_ALREADY_PAID");

    // Refund and Query work on a captured order as on a paid one.
    app.refund("m1", "c-1", "r-1", "45.00").await.unwrap();
    let over = app.refund("m1", "c-1", "r-2", "0.01").await.unwrap_err();
    assert_status(&over, Code::FailedPrecondition, "REFUND_EXCEEDS_PAID");
    let details = app.query("m1", Key::OutTradeNo("c-1".into())).await.unwrap();
    assert_eq!(details.order.unwrap().status(), OrderStatus::Refunded);
    assert_eq!(details.hold.unwrap().status(), HoldStatus::Captured);
    assert_eq!(balances(app, "alice").await, pair("70.00", "70.00"));
}

pub async fn void_close_order_and_expiry_release_a_hold_and_a_released_hold_replays(app: &TestApp) {
    app.funded("alice", "100.00").await;
    app.open("shop", "USD").await;
    let mut payments = app.payments.clone();
    for order_no in ["o-1", "o-2"] {
        app.create_order("m1", order_no, "shop", "30.00").await.unwrap();
    }
    payments.authorize(authorize_request("a-1", "o-1", "30.00")).await.unwrap();
    payments.authorize(authorize_request("a-2", "o-2", "30.00")).await.unwrap();
    assert_eq!(balances(app, "alice").await, pair("100.00", "40.00"));
    let over = payments.capture(capture_request("a-1", "c-1", "30.01")).await.unwrap_err();
    assert_status(&over, Code::FailedPrecondition, "CAPTURE_EXCEEDS_AUTHORIZED");
    let missing = payments.void(void_request("a-none")).await.unwrap_err();
    assert_status(&missing, Code::NotFound, "HOLD_NOT_FOUND");

    let voided = payments.void(void_request("a-1")).await.unwrap();
    assert!(!replayed(&voided));
    let voided = voided.into_inner();
    assert_eq!(voided.hold.unwrap().status(), HoldStatus::Voided);
    let order = voided.order.unwrap();
    assert_eq!((order.status(), order.close_reason()), (OrderStatus::Closed, OrderCloseReason::Voided));
    assert!(replayed(&payments.void(void_request("a-1")).await.unwrap()));
    let late = payments.capture(capture_request("a-1", "c-1", "30.00")).await.unwrap_err();
    assert_status(&late, Code::FailedPrecondition, "HOLD_VOIDED");
    let again = payments.authorize(authorize_request("a-3", "o-1", "30.00")).await.unwrap_err();
    assert_status(&again, Code::FailedPrecondition, "ORDER_CLOSED");

    // CloseOrder of an authorized order releases its hold.
    let close = proto::CloseOrderRequest { merchant_id: "m1".into(), order_no: "o-2".into() };
    let closed = payments.close_order(close).await.unwrap().into_inner().order.unwrap();
    assert_eq!((closed.status(), closed.close_reason()), (OrderStatus::Closed, OrderCloseReason::Merchant));
    let details = app.query("m1", Key::OrderNo("o-2".into())).await.unwrap();
    assert_eq!(details.hold.unwrap().status(), HoldStatus::Voided);
    assert!(replayed(&payments.void(void_request("a-2")).await.unwrap()));
    assert_eq!(balances(app, "alice").await, pair("100.00", "100.00"), "every hold released");
    assert_eq!(app.rows("payment_flow").await, 0);
}

/// On a server with `--hold-ttl-seconds 2`.
pub async fn a_hold_past_its_expires_at_refuses_capture_and_the_sweeper_releases_it(app: &TestApp) {
    app.funded("alice", "100.00").await;
    app.open("shop", "USD").await;
    let mut payments = app.payments.clone();
    app.create_order("m1", "o-1", "shop", "30.00").await.unwrap();
    let hold = payments.authorize(authorize_request("a-1", "o-1", "30.00")).await.unwrap().into_inner().hold.unwrap();
    let (created, expires) = (hold.created_at.unwrap(), hold.expires_at.unwrap());
    assert_eq!((expires.seconds - created.seconds, expires.nanos), (2, created.nanos));
    tokio::time::sleep(Duration::from_millis(2_100)).await;

    let late = payments.capture(capture_request("a-1", "c-1", "30.00")).await.unwrap_err();
    assert_status(&late, Code::FailedPrecondition, "HOLD_EXPIRED");
    assert_eq!(balances(app, "alice").await, pair("100.00", "70.00"), "held until the sweeper releases it");
    assert_eq!(app.ledger.release_expired_holds(1).await.unwrap(), (1, 0));
    assert_eq!(app.ledger.release_expired_holds(1).await.unwrap(), (0, 0));
    let details = app.query("m1", Key::OrderNo("o-1".into())).await.unwrap();
    let order = details.order.unwrap();
    assert_eq!((order.status(), order.close_reason()), (OrderStatus::Closed, OrderCloseReason::HoldExpired));
    assert_eq!(details.hold.unwrap().status(), HoldStatus::Expired);
    assert_eq!(balances(app, "alice").await, pair("100.00", "100.00"));
    let after = payments.capture(capture_request("a-1", "c-1", "30.00")).await.unwrap_err();
    assert_status(&after, Code::FailedPrecondition, "HOLD_EXPIRED");
    assert!(replayed(&payments.void(void_request("a-1")).await.unwrap()));
    assert_eq!(app.metrics().await.get("payledger_holds_expired_total").copied(), Some(1.0));
}

/// Two Captures (of different amounts), a Void and a CloseOrder race on each of 30 holds: each
/// order ends PAID by exactly one Capture or CLOSED with its hold released, and every loser
/// is told why.
pub async fn captures_void_and_close_order_racing_on_one_hold_end_with_one_winner(app: &TestApp) {
    const ORDERS: usize = 30;
    app.funded("alice", "1000.00").await;
    app.open("shop", "USD").await;
    let payments = app.payments.clone();
    for n in 0..ORDERS {
        app.create_order("m1", &format!("o-{n}"), "shop", "10.00").await.unwrap();
        payments.clone().authorize(authorize_request(&format!("a-{n}"), &format!("o-{n}"), "10.00")).await.unwrap();
    }
    let mut calls = Vec::new();
    for n in 0..ORDERS {
        for step in 0..4 {
            let mut payments = payments.clone();
            calls.push(tokio::spawn(async move {
                // A third of the orders give the captures a head start, a third the releases,
                // and a third start all four at once (every call queues on the one payer's
                // row, so without a head start the outcome is mostly the queue's).
                let delayed = match n % 3 {
                    0 => step >= 2,
                    1 => step < 2,
                    _ => false,
                };
                if delayed {
                    tokio::time::sleep(Duration::from_millis(150)).await;
                }
                let auth = format!("a-{n}");
                let outcome = match step {
                    0 => payments.capture(capture_request(&auth, &format!("c-{n}-6"), "6.00")).await.map(|_| ()),
                    1 => payments.capture(capture_request(&auth, &format!("c-{n}-7"), "7.00")).await.map(|_| ()),
                    2 => payments.void(void_request(&auth)).await.map(|_| ()),
                    _ => {
                        let close = proto::CloseOrderRequest { merchant_id: "m1".into(), order_no: format!("o-{n}") };
                        payments.close_order(close).await.map(|_| ())
                    }
                };
                (n, step, outcome)
            }));
        }
    }
    let outcomes: Vec<_> = futures::future::join_all(calls).await.into_iter().map(|joined| joined.unwrap()).collect();
    let mut captured_cents = 0;
    for n in 0..ORDERS {
        let details = app.query("m1", Key::OrderNo(format!("o-{n}"))).await.unwrap();
        let (order, hold) = (details.order.unwrap(), details.hold.unwrap());
        let of = |step| outcomes.iter().find(|(m, s, _)| *m == n && *s == step).map(|(_, _, outcome)| outcome).unwrap();
        match order.status() {
            OrderStatus::Paid => {
                let winner = if of(0).is_ok() { 0 } else { 1 };
                assert!(of(winner).is_ok() && of(1 - winner).is_err(), "o-{n}: exactly one capture wins");
                assert_status(of(1 - winner).as_ref().unwrap_err(), Code::FailedPrecondition, "ORDER_ALREADY_PAID");
                for step in [2, 3] {
                    assert_status(of(step).as_ref().unwrap_err(), Code::FailedPrecondition, "ORDER_ALREADY_PAID");
                }
                let cents = if winner == 0 { 600 } else { 700 };
                assert_eq!(order.amount, format!("{}.00", cents / 100));
                assert_eq!(hold.status(), HoldStatus::Captured);
                assert_eq!(details.payment.unwrap().out_trade_no, format!("c-{n}-{}", cents / 100));
                captured_cents += cents;
            }
            OrderStatus::Closed => {
                assert_eq!(hold.status(), HoldStatus::Voided, "o-{n}");
                for step in [0, 1] {
                    let refused = of(step).as_ref().unwrap_err();
                    assert_eq!(refused.code(), Code::FailedPrecondition, "o-{n}: {refused:?}");
                }
                assert!(of(2).is_ok() && of(3).is_ok(), "o-{n}: a void and a close of a released hold both answer");
                assert!(details.payment.is_none());
            }
            other => panic!("o-{n} ended {other:?}"),
        }
    }
    let left = 100_000 - captured_cents;
    let expected = format!("{}.{:02}", left / 100, left % 100);
    assert_eq!(balances(app, "alice").await, (expected.clone(), expected), "nothing is left held");
    eprintln!("{:?}: {} of {ORDERS} holds captured", app.backend, app.rows("payment_flow").await);
}

/// On a server with `--hold-ttl-seconds 2`: Captures land around their holds' deadline while
/// two hold sweepers run over and over.
pub async fn captures_racing_the_hold_sweeper_end_with_one_winner(app: &TestApp) {
    const ORDERS: usize = 40;
    app.funded("alice", "1000.00").await;
    app.open("shop", "USD").await;
    let payments = app.payments.clone();
    for n in 0..ORDERS {
        app.create_order("m1", &format!("o-{n}"), "shop", "1.00").await.unwrap();
    }
    let mut holds = Vec::new();
    for n in 0..ORDERS {
        let hold = payments.clone().authorize(authorize_request(&format!("a-{n}"), &format!("o-{n}"), "1.00")).await;
        holds.push(hold.unwrap().into_inner().hold.unwrap());
    }
    let started = tokio::time::Instant::now();
    let micros = |t: &prost_types::Timestamp| t.seconds * 1_000_000 + i64::from(t.nanos / 1_000);
    let now_micros = i64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros()).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sweepers: Vec<_> = (0..2)
        .map(|_| {
            let (ledger, stop) = (app.ledger.clone(), stop.clone());
            tokio::spawn(async move {
                let mut released = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    released += ledger.release_expired_holds(7).await.expect("a sweep").0;
                    tokio::time::sleep(Duration::from_millis(40)).await;
                }
                released
            })
        })
        .collect();
    // Capture n from 300 ms before its hold's deadline (n = 0) to 285 ms after it (n = 39).
    let mut calls = Vec::new();
    for (n, hold) in holds.iter().enumerate() {
        let offset_ms = i64::try_from(15 * n).unwrap() - 300;
        let from_start = micros(hold.expires_at.as_ref().unwrap()) - now_micros + offset_ms * 1_000;
        let at = started + Duration::from_micros(u64::try_from(from_start).unwrap_or(0));
        let mut payments = payments.clone();
        calls.push(tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            payments.capture(capture_request(&format!("a-{n}"), &format!("c-{n}"), "1.00")).await
        }));
    }
    let outcomes: Vec<_> = futures::future::join_all(calls).await.into_iter().map(|joined| joined.unwrap()).collect();
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut released = 0;
    for sweeper in sweepers {
        released += sweeper.await.unwrap();
    }
    let mut captured = 0;
    for (n, outcome) in outcomes.iter().enumerate() {
        let details = app.query("m1", Key::OrderNo(format!("o-{n}"))).await.unwrap();
        let (order, hold) = (details.order.unwrap(), details.hold.unwrap());
        match outcome {
            Ok(response) => {
                captured += 1;
                assert_eq!((order.status(), hold.status()), (OrderStatus::Paid, HoldStatus::Captured), "o-{n}");
                let paid_at = response.get_ref().payment.as_ref().unwrap().created_at.unwrap();
                assert!(micros(&paid_at) < micros(&hold.expires_at.unwrap()), "o-{n} captured after its deadline");
            }
            Err(status) => {
                assert_status(status, Code::FailedPrecondition, "HOLD_EXPIRED");
                assert_eq!(
                    (order.status(), order.close_reason()),
                    (OrderStatus::Closed, OrderCloseReason::HoldExpired)
                );
                assert_eq!(hold.status(), HoldStatus::Expired);
            }
        }
    }
    assert_eq!(released, ORDERS as u64 - captured, "every uncaptured hold was released by one sweep");
    assert!(captured > 0 && captured < ORDERS as u64, "the captures straddle the deadline: {captured} of {ORDERS}");
    let left = 100_000 - captured * 100;
    let expected = format!("{}.{:02}", left / 100, left % 100);
    assert_eq!(balances(app, "alice").await, (expected.clone(), expected));
    eprintln!("{:?}: {captured} of {ORDERS} holds captured, {released} released by the sweepers", app.backend);
}

/// A transaction that holds an expired order's row (a Pay in flight, a long Refund) neither
/// holds up the sweeper nor makes it fail: that order is skipped and closed by a later sweep,
/// the others are closed at once. (PostgreSQL and MySQL; SQLite has no row locks, and its
/// writers queue for the one write lock.)
pub async fn the_sweeper_skips_an_order_another_transaction_holds(app: &TestApp) {
    app.open("shop", "USD").await;
    let mut payments = app.payments.clone();
    for n in 0..3 {
        payments.create_order(order_request(&format!("o-{n}"), "1.00", Some(timestamp_in(500)))).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    let mut holder = app.raw.begin().await.unwrap();
    sqlx::query("SELECT status FROM orders WHERE merchant_id = 'm1' AND order_no = 'o-1' FOR UPDATE")
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    let settings = sweeper(10);
    let sweep = tokio::time::timeout(Duration::from_secs(3), app.ledger.close_expired_orders(&settings));
    let report = sweep.await.expect("the sweep does not wait for the lock").unwrap();
    assert_eq!((report.orders_closed, report.orders_skipped), (2, 1), "{report:?}");
    assert_eq!(order_of(app, "o-1").await.status(), OrderStatus::Pending);
    holder.rollback().await.unwrap();
    let report = app.ledger.close_expired_orders(&sweeper(10)).await.unwrap();
    assert_eq!((report.orders_closed, report.orders_skipped), (1, 0));
    assert_eq!(order_of(app, "o-1").await.close_reason(), OrderCloseReason::Expired);
}

/// Minor units of a decimal string with two decimals ("98.00" -> 9800).
fn cents(amount: &str) -> i64 {
    amount.replace('.', "").parse().unwrap()
}

/// GetAccount while Pays move alice's balance and version and Authorize and Void move what her
/// holds reserve: every answer is her row at one moment, so its balance is 100.00 less 1.00 per
/// version since the Pays began, and its available balance is that balance less 5.00 per hold
/// active at that moment (0 to 6).
pub async fn get_account_answers_one_moment_while_pays_and_holds_move_the_account(app: &TestApp) {
    app.funded("alice", "100.00").await;
    app.open("shop", "USD").await;
    for n in 0..20 {
        app.create_order("m1", &format!("p-{n}"), "shop", "1.00").await.unwrap();
    }
    for n in 0..6 {
        app.create_order("m1", &format!("h-{n}"), "shop", "5.00").await.unwrap();
    }
    let read = proto::GetAccountRequest { account_id: "alice".into() };
    let first = app.accounts.clone().get_account(read.clone()).await.unwrap().into_inner().account.unwrap();
    let (start_version, start_balance) = (first.version, cents(&first.balance));
    assert_eq!(start_balance, 10_000);

    let pays = {
        let mut payments = app.payments.clone();
        let requests: Vec<_> =
            (0..20).map(|n| app.pay_request("m1", &format!("pay-{n}"), &format!("p-{n}"), "alice", "1.00")).collect();
        tokio::spawn(async move {
            for request in requests {
                payments.pay(request).await.expect("a Pay within alice's balance");
            }
        })
    };
    let holds = {
        let mut payments = app.payments.clone();
        tokio::spawn(async move {
            for n in 0..6 {
                payments.authorize(authorize_request(&format!("a-{n}"), &format!("h-{n}"), "5.00")).await.unwrap();
            }
            for n in 0..6 {
                payments.void(void_request(&format!("a-{n}"))).await.unwrap();
            }
        })
    };
    let moving = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (mut accounts, moving, read) = (app.accounts.clone(), moving.clone(), read.clone());
            tokio::spawn(async move {
                let mut answers = Vec::new();
                while moving.load(std::sync::atomic::Ordering::Relaxed) {
                    answers.push(accounts.get_account(read.clone()).await.unwrap().into_inner().account.unwrap());
                }
                answers
            })
        })
        .collect();
    pays.await.unwrap();
    holds.await.unwrap();
    moving.store(false, std::sync::atomic::Ordering::Relaxed);
    let mut reads = 0;
    for reader in readers {
        for account in reader.await.unwrap() {
            reads += 1;
            let (balance, available) = (cents(&account.balance), cents(&account.available_balance));
            let paid = account.version - start_version;
            assert!((0..=20).contains(&paid), "{account:?}");
            assert_eq!(balance, start_balance - 100 * paid, "balance and version of one moment: {account:?}");
            let held = balance - available;
            assert!(held % 500 == 0 && (0..=3_000).contains(&held), "available of the same moment: {account:?}");
        }
    }
    assert!(reads > 0, "the readers ran while the account moved");
}
