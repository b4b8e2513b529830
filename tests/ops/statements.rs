//! The set of statements a server prepares is fixed: group commits of every size from 1 to 34
//! Pays, over one to five merchants, each with a rejected Pay, a replay, Pays with an
//! idempotency key and a token, a Refund, a Transfer, a Deposit, a Withdraw and a CreateOrder
//! in it, prepare
//! no statement that the first batches did not already prepare.
//!
//! Then every bench scenario (keys, tokens, refunds, holds, deposits, transfers...) runs on the
//! same server, and all it prepared still fits sqlx's statement cache (100 a connection), so
//! no statement is evicted and prepared again however long the server runs.
//!
//! A server over a pool of one connection serves the calls, so every statement runs on that
//! connection, whose server-side prepared statements are counted: PostgreSQL's
//! `pg_prepared_statements` of the session, MariaDB's session `Com_stmt_prepare` less
//! `Com_stmt_close` (sqlx keeps each statement it prepared, up to 100 a connection, and closes
//! the ones it evicts).

use crate::common;

use payledger::domain::{
    AccountId, Actor, Amount, Currency, FreeText, IdempotencyKey, MerchantId, OneTimeToken, OrderNo, OutRefundNo,
    OutTradeNo, RequestId,
};
use payledger::ledger::{BatchCall, CreateOrder, Deposit, Guards, Pay, Refund, Transfer, Withdraw};
use payledger::proto;
use payledger::proto::account_service_client::AccountServiceClient;
use payledger::proto::payment_service_client::PaymentServiceClient;
use sqlx::Row;

/// The most statements that the first group commits prepare, whatever their size, beyond
/// those of the set-up (whose Deposit and CreateOrders, group commits of their own, already
/// prepared the orders' and the accounts' locks, the request_ids' read, the entries' read back
/// and, on PostgreSQL, the statement that writes a batch of Deposits and the one that writes a
/// batch of CreateOrders): PostgreSQL writes a batch of Pays, one of Refunds, one of Transfers
/// and one that mixes kinds (Deposits and Withdraws) each with a statement of its shape
/// (`postgres_write_shape`: ten at most, whatever the batch sizes), and reads the replays
/// (MariaDB also writes in up to ten statements, one a kind of row); then the guards: the replay read of a record
/// (a call with a token), the token's owner, and in the batch the records of the calls with a
/// key alone read, the token consumed (and read back when it was not) and
/// the records inserted (one call's alone, several calls' in one statement); then a call whose
/// natural key the batch found taken, answered after it by that key (a payment and its order,
/// an order and its hold); then the Refunds: the replay read of a refund and its
/// order, and in the batch the refunds read under the orders' locks; then the Transfers' and
/// Deposits' records completed; then the Withdraws' replay read, and the refused Withdraw's
/// own transaction (a Deposit or Withdraw the batch refuses runs alone): its request_id's
/// insert and its account's locking read. Measured: exactly these.
const POSTGRES_BATCH_STATEMENTS: i64 = 21;
const MYSQL_BATCH_STATEMENTS: i64 = 23;

/// sqlx's statement cache, a connection (`statement_cache_capacity`, 100 by default): a set
/// larger than this would be evicted and prepared again, call after call.
const STATEMENT_CACHE: i64 = 100;

/// The batch sizes of the second phase (none of them 2, the first phase's size).
const SIZES: [usize; 8] = [1, 3, 5, 8, 13, 21, 34, 4];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_prepares_the_same_statements_for_every_batch_size() {
    let Some(admin) = common::admin_url("PAYLEDGER_TEST_POSTGRES_URL") else { return };
    every_batch_size_prepares_nothing_new(
        &admin,
        "SELECT CAST(COUNT(*) AS BIGINT) FROM pg_prepared_statements",
        POSTGRES_BATCH_STATEMENTS,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_prepares_the_same_statements_for_every_batch_size() {
    let Some(admin) = common::admin_url("PAYLEDGER_TEST_MYSQL_URL") else { return };
    let open_statements = "SELECT CAST(SUM(CASE VARIABLE_NAME WHEN 'COM_STMT_PREPARE' THEN VARIABLE_VALUE \
                           ELSE -VARIABLE_VALUE END) AS SIGNED) FROM information_schema.SESSION_STATUS \
                           WHERE VARIABLE_NAME IN ('COM_STMT_PREPARE', 'COM_STMT_CLOSE')";
    every_batch_size_prepares_nothing_new(&admin, open_statements, MYSQL_BATCH_STATEMENTS).await;
}

async fn every_batch_size_prepares_nothing_new(admin: &str, count_statements: &str, batch_statements: i64) {
    let database = common::ServerDatabase::create(admin, "statements").await;
    let served = common::serve(&database.url, 1).await;
    let target = format!("http://{}", served.address);
    let mut accounts = AccountServiceClient::connect(target.clone()).await.unwrap();
    let mut payments = PaymentServiceClient::connect(target).await.unwrap();
    let prepared = || async {
        let rows = served.ledger.store().on_pooled_session(count_statements).await.unwrap();
        rows[0].get::<i64, _>(0)
    };

    // One more order than the Pays to come, which the poor payer's first Pay is refused.
    let orders: usize = 2 + SIZES.iter().sum::<usize>();
    for account_id in ["payer", "poor"] {
        let request = proto::OpenAccountRequest { account_id: account_id.into(), currency: "USD".into() };
        accounts.open_account(request).await.unwrap();
    }
    let deposit = proto::DepositRequest {
        request_id: "fund-payer".into(),
        account_id: "payer".into(),
        amount: "1000.00".into(),
        currency: "USD".into(),
    };
    accounts.deposit(deposit).await.unwrap();
    for merchant in 0..5 {
        let request = proto::OpenAccountRequest { account_id: format!("shop-{merchant}"), currency: "USD".into() };
        accounts.open_account(request).await.unwrap();
    }
    for order in 0..=orders {
        let request = proto::CreateOrderRequest {
            merchant_id: merchant_of(order),
            order_no: format!("o{order}"),
            payee_account_id: format!("shop-{}", order % 5),
            amount: "1.00".into(),
            currency: "USD".into(),
            subject: format!("order {order}"),
            expires_at: None,
        };
        payments.create_order(request).await.unwrap();
    }
    // A token for each Pay that presents one: order 1, then each batch's second Pay.
    let token_orders = std::iter::once(1).chain(SIZES.iter().scan(2, |next, size| {
        let order = *next + 1;
        *next += size;
        Some(order)
    }));
    let mut tokens = Vec::new();
    for order in token_orders {
        let request = proto::IssueTokenRequest { merchant_id: merchant_of(order), purpose: "statements".into() };
        tokens.push(payments.issue_token(request).await.unwrap().into_inner().token);
    }
    let setup = prepared().await;

    // Phase 1: one batch of two Pays, one with a key, one with a token, then the same two
    // Pays and a refused one, then a plain replay.
    let keyed = |order: usize, payer: &str| (pay(order, payer), guards(Some(&format!("k{order}")), None));
    let with_token = |order: usize, payer: &str, token: &str| (pay(order, payer), guards(None, Some(token)));
    let first = served.ledger.pay_together_guarded(vec![keyed(0, "payer"), with_token(1, "payer", &tokens[0])]).await;
    assert!(first.iter().all(|paid| paid.as_ref().is_ok_and(|paid| !paid.replayed)), "{first:?}");
    let first = served.ledger.pay_together(vec![pay(0, "payer"), pay(orders, "poor")]).await;
    assert!(first[0].as_ref().is_ok_and(|paid| paid.replayed), "{first:?}");
    assert!(first[1].is_err(), "the poor payer's Pay is refused: {first:?}");
    let replay = served.ledger.pay_together_guarded(vec![keyed(0, "payer"), with_token(1, "payer", &tokens[0])]).await;
    assert!(replay.iter().all(|paid| paid.as_ref().is_ok_and(|paid| paid.replayed)), "{replay:?}");
    // And a plain replay in a batch of calls of every kind, as every later batch has one: the
    // batch finds its payment, and it is answered after the batch by its natural key.
    let again = served.ledger.write_together(vec![(BatchCall::Pay(pay(0, "payer")), guards(None, None))]).await;
    assert!(again[0].as_ref().is_ok_and(|paid| paid.replayed), "{again:?}");
    // And Refunds in a batch: one with a key, two of one order, one refused (more than paid),
    // then the same again: replays, and the refusal again.
    let refunds = || {
        vec![
            (BatchCall::Refund(refund(0, "ra", "0.10")), guards(Some("kra"), None)),
            (BatchCall::Refund(refund(1, "rb", "0.10")), guards(None, None)),
            (BatchCall::Refund(refund(1, "rc", "0.10")), guards(None, None)),
            (BatchCall::Refund(refund(0, "rd", "5.00")), guards(None, None)),
        ]
    };
    for replayed in [false, true] {
        let answers = served.ledger.write_together(refunds()).await;
        assert!(answers[..3].iter().all(|answer| answer.as_ref().is_ok_and(|a| a.replayed == replayed)), "{answers:?}");
        assert!(answers[3].is_err(), "{answers:?}");
    }
    // And Transfers in a batch (each with its key): two fresh, one refused (the poor account
    // has nothing), then the same again: replays, and the refusal again.
    let transfers = || {
        vec![
            (BatchCall::Transfer(transfer("payer", "shop-0")), guards(Some("kta"), None)),
            (BatchCall::Transfer(transfer("payer", "shop-1")), guards(Some("ktb"), None)),
            (BatchCall::Transfer(transfer("poor", "shop-1")), guards(Some("ktc"), None)),
        ]
    };
    for replayed in [false, true] {
        let answers = served.ledger.write_together(transfers()).await;
        assert!(answers[..2].iter().all(|answer| answer.as_ref().is_ok_and(|a| a.replayed == replayed)), "{answers:?}");
        assert!(answers[2].is_err(), "{answers:?}");
    }
    // And Deposits and Withdraws in a batch: a Deposit with a key, a Withdraw, one refused
    // (the poor account has nothing), then the same again: replays, and the refusal again.
    let fundings = || {
        vec![
            (funding("da", "payer", false), guards(Some("kda"), None)),
            (funding("wa", "payer", true), guards(None, None)),
            (funding("wb", "poor", true), guards(None, None)),
        ]
    };
    for replayed in [false, true] {
        let answers = served.ledger.write_together(fundings()).await;
        assert!(answers[..2].iter().all(|answer| answer.as_ref().is_ok_and(|a| a.replayed == replayed)), "{answers:?}");
        assert!(answers[2].is_err(), "{answers:?}");
    }
    // And CreateOrders in a batch: one with a key, one without, one refused (no such payee),
    // then the same again: replays, and the refusal again.
    let new_orders = || {
        vec![
            (new_order("na", "shop-0"), guards(Some("kna"), None)),
            (new_order("nb", "shop-1"), guards(None, None)),
            (new_order("nc", "nobody"), guards(None, None)),
        ]
    };
    for replayed in [false, true] {
        let answers = served.ledger.write_together(new_orders()).await;
        assert!(answers[..2].iter().all(|answer| answer.as_ref().is_ok_and(|a| a.replayed == replayed)), "{answers:?}");
        assert!(answers[2].is_err(), "{answers:?}");
    }
    let after_first = prepared().await;
    assert!(after_first - setup <= batch_statements, "one batch prepared {} statements", after_first - setup);

    // Phase 2: every other size, each batch over several merchants, its first Pay with a key
    // and its second with a token, with the last Pay of the batch refused and the first Pay
    // ever replayed in it.
    let mut next = 2;
    let before = served.ledger.counters();
    for (round, size) in SIZES.into_iter().enumerate() {
        let mut batch: Vec<_> = (next..next + size - 1)
            .map(|order| match order - next {
                0 => keyed(order, "payer"),
                1 => with_token(order, "payer", &tokens[round + 1]),
                _ => (pay(order, "payer"), guards(None, None)),
            })
            .collect();
        batch.push((pay(next + size - 1, "poor"), guards(None, None)));
        batch.push((pay(0, "payer"), guards(None, None)));
        // A refund of the first Pay in every batch, with a key every other round.
        let refund_key = format!("kr{round}");
        let refund_call = (
            BatchCall::Refund(refund(0, &format!("r{round}"), "0.01")),
            guards((round % 2 == 0).then_some(refund_key.as_str()), None),
        );
        let mut batch: Vec<_> = batch.into_iter().map(|(pay, guards)| (BatchCall::Pay(pay), guards)).collect();
        let middle = batch.len() / 2;
        batch.insert(middle, refund_call);
        // And a Transfer with a key of its own first in every batch.
        let transfer_key = format!("kt{round}");
        batch.insert(0, (BatchCall::Transfer(transfer("payer", "shop-2")), guards(Some(&transfer_key), None)));
        // And a Deposit and a Withdraw after it, one of them with a key.
        let (deposit_key, withdraw_key) = (format!("kd{round}"), format!("kw{round}"));
        let keyed_when = |even: bool, key| guards((round % 2 == usize::from(!even)).then_some(key), None);
        batch.insert(1, (funding(&format!("d{round}"), "payer", false), keyed_when(false, deposit_key.as_str())));
        batch.insert(2, (funding(&format!("w{round}"), "payer", true), keyed_when(true, withdraw_key.as_str())));
        // And a CreateOrder, with a key every other round.
        let order_key = format!("kn{round}");
        batch.insert(3, (new_order(&format!("n{round}"), "shop-3"), keyed_when(true, order_key.as_str())));
        let mut answers = served.ledger.write_together(batch).await;
        for _ in 0..4 {
            let written = answers.remove(0);
            assert!(written.as_ref().is_ok_and(|written| !written.replayed), "{written:?}");
        }
        let refunded = answers.remove(middle);
        assert!(refunded.as_ref().is_ok_and(|refunded| !refunded.replayed), "{refunded:?}");
        for (index, answer) in answers.iter().enumerate() {
            match index {
                _ if index + 2 < answers.len() => {
                    assert!(answer.as_ref().is_ok_and(|paid| !paid.replayed), "{answer:?}")
                }
                _ if index + 2 == answers.len() => assert!(answer.is_err(), "{answer:?}"),
                _ => assert!(answer.as_ref().is_ok_and(|paid| paid.replayed), "{answer:?}"),
            }
        }
        next += size;
    }
    let after = served.ledger.counters();
    let paid: usize = SIZES.iter().map(|size| size - 1).sum();
    assert_eq!(after.group_committed_pays - before.group_committed_pays, paid as u64, "{after:?}");
    assert_eq!(after.group_committed_refunds - before.group_committed_refunds, SIZES.len() as u64, "{after:?}");
    assert_eq!(after.group_committed_transfers - before.group_committed_transfers, SIZES.len() as u64, "{after:?}");
    assert_eq!(after.group_committed_deposits - before.group_committed_deposits, SIZES.len() as u64, "{after:?}");
    assert_eq!(after.group_committed_withdrawals - before.group_committed_withdrawals, SIZES.len() as u64);
    assert_eq!(after.group_committed_orders - before.group_committed_orders, SIZES.len() as u64);
    assert_eq!(after.group_commits - before.group_commits, SIZES.len() as u64);

    let after_all = prepared().await;
    assert_eq!(after_all, after_first, "batches of sizes {SIZES:?} prepared statements the first batches had not");

    // Phase 3: everything else a server runs on a connection.
    common::run_every_scenario(&served).await;
    let whole_set = prepared().await;
    assert!(whole_set < STATEMENT_CACHE, "{whole_set} statements fill sqlx's cache of {STATEMENT_CACHE}");
    eprintln!(
        "prepared statements on the connection: {setup} after set-up, {after_all} after every batch, \
         {whole_set} after every bench scenario"
    );
    assert!(served.ledger.audit().await.unwrap().is_empty());
    served.shut_down().await;
    drop(database);
}

/// Orders are spread over five merchants, interleaved, so each batch holds several.
fn merchant_of(order: usize) -> String {
    format!("m{}", order % 5)
}

/// The guards of a call: an `idempotency-key` and/or an `idempotency-token`.
fn guards(key: Option<&str>, token: Option<&str>) -> Guards {
    Guards {
        idempotency_key: key.map(|key| IdempotencyKey::parse("idempotency-key", key).unwrap()),
        token: token.map(|token| OneTimeToken::parse("idempotency-token", token).unwrap()),
        ..Guards::default()
    }
}

fn pay(order: usize, payer: &str) -> Pay {
    let currency = Currency::parse("currency", "USD").unwrap();
    Pay {
        merchant_id: MerchantId::parse("merchant_id", &merchant_of(order)).unwrap(),
        out_trade_no: OutTradeNo::parse("out_trade_no", &format!("t{order}")).unwrap(),
        order_no: OrderNo::parse("order_no", &format!("o{order}")).unwrap(),
        payer_account_id: AccountId::parse("payer_account_id", payer).unwrap(),
        amount: Amount::parse("amount", "1.00", currency).unwrap(),
        created_by: Actor::Anonymous,
    }
}

/// A refund of order `order`'s Pay (`t{order}`).
fn refund(order: usize, out_refund_no: &str, amount: &str) -> Refund {
    let currency = Currency::parse("currency", "USD").unwrap();
    Refund {
        merchant_id: MerchantId::parse("merchant_id", &merchant_of(order)).unwrap(),
        out_trade_no: OutTradeNo::parse("out_trade_no", &format!("t{order}")).unwrap(),
        out_refund_no: OutRefundNo::parse("out_refund_no", out_refund_no).unwrap(),
        amount: Amount::parse("amount", amount, currency).unwrap(),
        reason: FreeText::parse("reason", "statements").unwrap(),
        created_by: Actor::Anonymous,
    }
}

/// A Deposit into `account_id` (`withdraw` false) or a Withdraw from it, of 0.01.
fn funding(request_id: &str, account_id: &str, withdraw: bool) -> BatchCall {
    let request_id = RequestId::parse("request_id", request_id).unwrap();
    let account_id = AccountId::parse("account_id", account_id).unwrap();
    let amount = Amount::parse("amount", "0.01", Currency::parse("currency", "USD").unwrap()).unwrap();
    let created_by = Actor::Anonymous;
    if withdraw {
        BatchCall::Withdraw(Withdraw { request_id, account_id, amount, created_by })
    } else {
        BatchCall::Deposit(Deposit { request_id, account_id, amount, created_by })
    }
}

/// A CreateOrder of merchant m3 for 1.00 to `payee`.
fn new_order(order_no: &str, payee: &str) -> BatchCall {
    BatchCall::CreateOrder(CreateOrder {
        merchant_id: MerchantId::parse("merchant_id", "m3").unwrap(),
        order_no: OrderNo::parse("order_no", order_no).unwrap(),
        payee_account_id: AccountId::parse("payee_account_id", payee).unwrap(),
        amount: Amount::parse("amount", "1.00", Currency::parse("currency", "USD").unwrap()).unwrap(),
        subject: FreeText::parse("subject", "statements").unwrap(),
        expires_at: None,
    })
}

/// A Transfer of 0.01 from `from` to `to`.
fn transfer(from: &str, to: &str) -> Transfer {
    let currency = Currency::parse("currency", "USD").unwrap();
    Transfer {
        from_account_id: AccountId::parse("from_account_id", from).unwrap(),
        to_account_id: AccountId::parse("to_account_id", to).unwrap(),
        amount: Amount::parse("amount", "0.01", currency).unwrap(),
        memo: FreeText::parse("memo", "statements").unwrap(),
        created_by: Actor::Anonymous,
    }
}
