//! The group commit: the batch writer of Pays, Refunds, Transfers, Deposits, Withdraws and
//! CreateOrders, many calls in one transaction, and a call alone as a batch of one
//! ([`write_alone`]). What it does and why, what runs alone, and its bounds are explained once,
//! in `docs/write-engine.md`; the engine it writes through, in `engine`'s module doc. Here,
//! the steps of [`write_together`] as the code takes them:
//!
//! 0. [`read_payments`], before the transaction: the out_trade_nos already paid
//!    ([`Decision::Found`]) and the payments the Refunds refund; [`runs_alone`]: the calls the
//!    batch cannot decide ([`Decision::Alone`]); in the transaction, [`Deciding::read_guards`]:
//!    the committed records of the calls with an idempotency key alone
//!    ([`Decision::GuardAnswered`]);
//! 1. [`Deciding::lock_orders`] (orders locked in key order, then the Refunds' out_refund_nos)
//!    and [`Deciding::candidates`]: each call checked against its order ([`check_pay`],
//!    [`check_refund`], [`NewOrder::order_at`]);
//! 2. [`lock_accounts`] (in account_id order), [`decide_fundings`] (the request_ids under the
//!    funding accounts' locks), then [`Deciding::apply`]: the calls applied one after another in
//!    arrival order to a [`Book`], by their use cases' rules ([`apply_pay`], [`apply_refund`]
//!    with [`refunded_order`], [`Book::post`], [`apply_funding`], [`check_payee`]);
//! 3. [`claim_prefix_together`] and [`Deciding::claim_guards`]: the accepted calls' guards
//!    claimed, a call whose guard is taken taken out and the others applied again;
//!    [`Deciding::refuse`]: the refused calls' decisions;
//! 4. [`write_accepted`]: the [`WriteSet`] of the accepted calls, written by [`book::write`]
//!    (checked against the money invariants); [`entries_read_back`] and [`complete_claims`];
//! 5. [`Deciding::answer`]: each accepted call's answer.
//!
//! A call refused before its batch (queue full: OVERLOADED; caller gone) is
//! [`Decision::NotStarted`], with nothing read or written.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use crate::error::{Error, Resource};
use crate::store::{
    EntryRow, FundingRow, FundingTable, IdempotencyRecordRow, OrderRefund, OrderRow, PaymentRow, Queries, Store,
    TransferRow,
};

use prost::Message as _;

use super::accounts::{
    ensure_funding_account, receipt_after, transfer_posting, transfer_row, DepositReceipt, FundingCall, FundingWrite,
    TransferReceipt,
};
use super::commands::{Deposit, Pay, Refund, Transfer, Withdraw};
use super::engine::batching::{self, BatchWriter};
use super::engine::book::{self, Book, WriteSet};
use super::engine::posting::{EntryKind, Legs, Posting};
use super::engine::transaction::in_transaction;
use super::guards::{complete_claims, BatchClaim};
use super::idempotent::IdempotentCall;
use super::payments::{
    check_pay, check_payee, check_payer, check_refund, new_payment, new_refund, paid_receipt, payment_posting,
    refund_posting, refunded_order, NewOrder, PayCheck, PayReceipt, RefundReceipt,
};
use super::{deadline_clock, now_micros, Identified, Inserted};
use crate::metrics::LedgerMetrics;

/// What the batch decided for one write.
#[derive(Debug)]
pub(super) enum Decision {
    /// Paid and committed by the batch.
    Paid(PayReceipt),
    /// Refunded and committed by the batch.
    Refunded(RefundReceipt),
    /// Transferred and committed by the batch.
    Transferred(TransferReceipt),
    /// Deposited or withdrawn and committed by the batch.
    Funded(DepositReceipt),
    /// An order created and committed by the batch.
    Created(OrderRow),
    /// A payment under this out_trade_no was already committed (with its order): a replay,
    /// or OUT_TRADE_NO_REUSED if it paid something else.
    Found(PaymentRow, OrderRow),
    /// The order was already paid under this out_trade_no: replay it.
    PaidBefore,
    /// A refund under this out_refund_no was committed before the batch locked its order:
    /// replay it by out_refund_no.
    RefundedBefore,
    /// A Deposit or Withdraw under this request_id was committed before the batch locked its
    /// funding account: replay it by request_id.
    FundedBefore,
    /// An order of this (merchant_id, order_no) was committed before the batch read it: replay
    /// it (or ORDER_NO_REUSED) by its order.
    CreatedBefore,
    /// The write breaks a rule; nothing of it was written.
    Rejected(Error),
    /// One of the write's guards (`idempotency-key` or `idempotency-token`) was found taken
    /// when the batch claimed it; nothing of the write was written: the committed original
    /// answers it.
    GuardTaken,
    /// The batch's read of the guards' records (of a call that did not read them before it
    /// queued) found this committed record, which answers the write; nothing of it was
    /// written.
    GuardAnswered(Box<IdempotencyRecordRow>),
    /// The batch could not decide it: run it in its own transaction.
    Alone,
    /// Refused before it was queued or started: the queue was full, or the caller had gone.
    NotStarted(Error),
}

/// A write a batch takes.
#[derive(Debug, Clone)]
pub(super) enum Write {
    /// A Pay, with the trade_no its payment gets.
    Pay { command: Pay, trade_no: String },
    /// A Refund, with the refund_no its row gets (the same the call's own transaction
    /// would write, should it run alone).
    Refund { command: Refund, refund_no: String },
    /// A Transfer (always with an `idempotency-key`), with the transfer_id its row gets.
    Transfer { command: Transfer, transfer_id: String },
    /// A Deposit or Withdraw, with the funding_id its row gets and its funding account.
    Funding(FundingWrite),
    /// A CreateOrder, with the server's default lifetime of an order.
    CreateOrder(NewOrder),
}

impl Write {
    /// What routes the write to its worker: a Pay's, Refund's or CreateOrder's merchant_id, so
    /// concurrent batches touch different orders and (when each merchant is paid into its own
    /// account) different payee accounts, and do not queue on each other's row locks; a
    /// Transfer's from_account_id, so the Transfers of one account share a worker (their
    /// to-accounts may be another worker's too: those batches then wait for each other's row
    /// locks, taken in account_id order); a Deposit's or Withdraw's funding account (the row
    /// every one of them moves), so the calls of one shard share a worker.
    fn route(&self) -> &str {
        match self {
            Write::Pay { command, .. } => command.merchant_id.as_str(),
            Write::CreateOrder(call) => call.command.merchant_id.as_str(),
            Write::Refund { command, .. } => command.merchant_id.as_str(),
            Write::Transfer { command, .. } => command.from_account_id.as_str(),
            Write::Funding(funding) => funding.funding_account_id.as_str(),
        }
    }

    /// The (merchant_id, out_trade_no) the write pays, or refunds the payment of; none for a
    /// Transfer, Deposit, Withdraw or CreateOrder.
    fn trade_key(&self) -> Option<(&str, &str)> {
        match self {
            Write::Pay { command, .. } => Some((command.merchant_id.as_str(), command.out_trade_no.as_str())),
            Write::Refund { command, .. } => Some((command.merchant_id.as_str(), command.out_trade_no.as_str())),
            Write::Transfer { .. } | Write::Funding(_) | Write::CreateOrder(_) => None,
        }
    }

    /// The (merchant_id, order_no) a CreateOrder creates.
    fn created_order(&self) -> Option<(&str, &str)> {
        match self {
            Write::CreateOrder(call) => Some((call.command.merchant_id.as_str(), call.command.order_no.as_str())),
            Write::Pay { .. } | Write::Refund { .. } | Write::Transfer { .. } | Write::Funding(_) => None,
        }
    }
}

/// A call a group commit can write: its write, and its answer out of the batch's decision
/// (the decision back when the batch did not write it).
pub(super) trait Batchable: IdempotentCall {
    fn write(&self) -> Write;
    fn written(decision: Decision) -> Result<Self::Answer, Box<Decision>>;
}

/// A write as a batch takes it: the write, and the claim of its guards when it carries an
/// `idempotency-key` or `idempotency-token`.
pub(super) struct Batched {
    pub(super) write: Write,
    pub(super) claim: Option<BatchClaim>,
}

/// The group commit's writer: the batch workers' batches of [`Batched`] writes, each written
/// by [`write_together`].
pub(super) struct GroupCommit {
    pub(super) store: Store,
    pub(super) metrics: LedgerMetrics,
}

impl BatchWriter for GroupCommit {
    type Call = Batched;
    type Outcome = Decision;

    fn route(call: &Batched) -> &str {
        call.write.route()
    }

    async fn write(&self, calls: Vec<Batched>) -> Vec<Decision> {
        write_together(&self.store, &calls, &self.metrics).await
    }

    fn not_started(refusal: Option<Error>) -> Decision {
        refusal.map_or(Decision::Alone, Decision::NotStarted)
    }
}

/// The batch workers of the group commit.
pub(super) type Batcher = batching::Batcher<GroupCommit>;

/// Runs `commands` as one group commit and returns one decision per command, in order:
/// first one read (no transaction, no locks) finds the out_trade_nos already paid and the
/// payments the Refunds refund, then one transaction writes the rest.
pub(super) async fn write_together(store: &Store, commands: &[Batched], metrics: &LedgerMetrics) -> Vec<Decision> {
    let (mut decisions, payments) = match read_payments(store, commands).await {
        Ok(read) => read,
        Err(error) => {
            tracing::debug!(%error, calls = commands.len(), "group commit could not read; every call of it runs alone");
            return alone(commands.len());
        }
    };
    let open: Vec<usize> = (0..commands.len()).filter(|index| decisions[*index].is_none()).collect();
    let batch: Vec<&Batched> = open.iter().map(|index| &commands[*index]).collect();
    for (index, alone) in open.iter().zip(runs_alone(&batch, &payments)) {
        if alone {
            decisions[*index] = Some(Decision::Alone);
        }
    }
    let open: Vec<usize> = (0..commands.len()).filter(|index| decisions[*index].is_none()).collect();
    if open.is_empty() {
        return decisions.into_iter().map(|decision| decision.unwrap_or(Decision::Alone)).collect();
    }
    let batch: Vec<&Batched> = open.iter().map(|index| &commands[*index]).collect();
    let now = now_micros();
    let outcome = in_transaction!(store, metrics, tx => {
        let mut queries = tx.queries();
        write_batch(&mut queries, &batch, &payments, now).await
    });
    let written = match outcome {
        // A Deposit or Withdraw the batch refuses runs alone, where it inserts its request_id
        // before its refusal is answered (see `write_alone`).
        Ok(Inserted::Done(written)) => written
            .into_iter()
            .zip(&batch)
            .map(|(decision, batched)| match (decision, &batched.write) {
                (Decision::Rejected(_), Write::Funding(_)) => Decision::Alone,
                (decision, _) => decision,
            })
            .collect(),
        Ok(Inserted::KeyTaken) => alone(batch.len()),
        // A broken money invariant (see `invariants`) is a bug: the batch was rolled back and
        // its calls are refused, never written again another way.
        Err(Error::InvariantBroken(invariant)) => {
            tracing::error!(invariant, calls = batch.len(), "group commit refused; nothing of it was written");
            batch.iter().map(|_| Decision::Rejected(Error::InvariantBroken(invariant))).collect()
        }
        Err(error) => {
            tracing::debug!(%error, calls = batch.len(), "group commit failed; every call of it runs alone");
            alone(batch.len())
        }
    };
    let paid = written.iter().filter(|decision| matches!(decision, Decision::Paid(_))).count();
    let refunded = written.iter().filter(|decision| matches!(decision, Decision::Refunded(_))).count();
    let transferred = written.iter().filter(|decision| matches!(decision, Decision::Transferred(_))).count();
    let deposited = written
        .iter()
        .filter(|decision| matches!(decision, Decision::Funded(receipt) if receipt.entry.kind == EntryKind::Deposit.as_str()))
        .count();
    let withdrawn = written.iter().filter(|decision| matches!(decision, Decision::Funded(_))).count() - deposited;
    let created = written.iter().filter(|decision| matches!(decision, Decision::Created(_))).count();
    let committed = paid + refunded + transferred + deposited + withdrawn + created;
    if committed > 0 {
        metrics.group_commits.inc();
        metrics.group_committed_pays.inc_by(paid as u64);
        metrics.group_committed_refunds.inc_by(refunded as u64);
        metrics.group_committed_transfers.inc_by(transferred as u64);
        metrics.group_committed_deposits.inc_by(deposited as u64);
        metrics.group_committed_withdrawals.inc_by(withdrawn as u64);
        metrics.group_committed_orders.inc_by(created as u64);
        metrics.group_commit_batch.observe(committed as f64);
    }
    for (index, decision) in open.into_iter().zip(written) {
        decisions[index] = Some(decision);
    }
    decisions.into_iter().map(|decision| decision.unwrap_or(Decision::Alone)).collect()
}

/// One call written in a transaction of its own, the idempotency driver's (which claims and
/// completes the call's guards around it): the batch's steps for a batch of one, so a call
/// written alone is decided by the same rules, locks and statements as one written with others.
/// What only a call alone does: a Refund's payment is read first, in the transaction (payments
/// never change; none is PAYMENT_NOT_FOUND); a Deposit's or Withdraw's funding account, a shard
/// with no row yet, is created, and the call decided again; a refused call inserts its key
/// before it answers the refusal ([`key_taken_in_flight`]), so that another call holding that
/// key, still in flight, is waited for and answers it.
/// `KeyTaken` when a key of the call (its out_trade_no, the order's one payment, its
/// out_refund_no, its order, its request_id) was committed by another: the driver then answers
/// the committed original.
///
/// # Errors
/// The call's rejection; [`Error::InvariantBroken`] (nothing written); [`Error::Database`].
pub(super) async fn write_alone<C: Batchable>(
    call: &C,
    queries: &mut Queries<'_>,
    now: i64,
) -> Result<Inserted<C::Answer>, Error> {
    let batched = Batched { write: call.write(), claim: None };
    let mut payments = PaymentsRead::new();
    if let Write::Refund { command, .. } = &batched.write {
        let (merchant_id, out_trade_no) = (command.merchant_id.as_str(), command.out_trade_no.as_str());
        let found = queries.find_payment_and_order(merchant_id, out_trade_no).await?;
        payments.insert(order_key(merchant_id, out_trade_no), found.ok_or(Error::NotFound(Resource::Payment))?);
    }
    let mut decision = decide_alone(queries, &batched, &payments, now).await?;
    if let (Some(Decision::Alone), Write::Funding(funding)) = (&decision, &batched.write) {
        let currency = funding.amount.currency().code();
        ensure_funding_account(queries, &funding.funding_account_id, currency, now).await?;
        decision = decide_alone(queries, &batched, &payments, now).await?;
    }
    let Some(decision) = decision else { return Ok(Inserted::KeyTaken) };
    let decision = match C::written(decision) {
        Ok(answer) => return Ok(Inserted::Done(answer)),
        Err(decision) => *decision,
    };
    match decision {
        Decision::Found(..)
        | Decision::PaidBefore
        | Decision::RefundedBefore
        | Decision::FundedBefore
        | Decision::CreatedBefore => Ok(Inserted::KeyTaken),
        Decision::Rejected(error) => {
            if key_taken_in_flight(queries, &batched.write, &payments, now).await? {
                return Ok(Inserted::KeyTaken);
            }
            Err(error)
        }
        // A call alone has no guard of its own in the batch, and nothing else of one call's
        // batch hands it on.
        Decision::Alone
        | Decision::GuardTaken
        | Decision::GuardAnswered(_)
        | Decision::NotStarted(_)
        | Decision::Paid(_)
        | Decision::Refunded(_)
        | Decision::Transferred(_)
        | Decision::Funded(_)
        | Decision::Created(_) => Err(Error::Internal(format!("a {} written alone was left undecided", C::METHOD))),
    }
}

/// Whether a refused call alone finds its key taken by another call, waiting for it if it is
/// in flight: its key row is inserted (the caller's transaction then rolls back with the
/// refusal, the row with it). A call alone checks its rules under its locks before it inserts
/// its key, so without this an original of its request_id, or another order's call holding its
/// out_trade_no or out_refund_no, still in flight without the locks it took (a server of an
/// earlier release inserted its key before its locks) would let it answer the refusal rather
/// than the original, or OUT_TRADE_NO_REUSED / OUT_REFUND_NO_REUSED. A Pay of an order that
/// does not exist has no key row to insert; nor has a Transfer (its key is its guard) or a
/// CreateOrder (its order is its key, read under its lock).
async fn key_taken_in_flight(
    queries: &mut Queries<'_>,
    write: &Write,
    payments: &PaymentsRead,
    now: i64,
) -> Result<bool, Error> {
    Ok(match write {
        Write::Funding(funding) => !queries.insert_funding(funding.table, &funding.row(now)).await?,
        Write::Pay { command, trade_no } => {
            let (merchant_id, order_no) = (command.merchant_id.as_str(), command.order_no.as_str());
            match queries.find_order(merchant_id, order_no).await? {
                Some(order) => !queries.insert_payment(&new_payment(command, &order, trade_no, now)).await?,
                None => false,
            }
        }
        Write::Refund { command, refund_no } => {
            let key = order_key(command.merchant_id.as_str(), command.out_trade_no.as_str());
            let (payment, _) = payments.get(&key).expect("a Refund alone reads its payment first");
            !queries.insert_refund(&new_refund(command, payment, refund_no, now)).await?
        }
        Write::Transfer { .. } | Write::CreateOrder(_) => false,
    })
}

/// The decision of a batch of one, `None` when a key of it was found taken as it wrote.
async fn decide_alone(
    queries: &mut Queries<'_>,
    batched: &Batched,
    payments: &PaymentsRead,
    now: i64,
) -> Result<Option<Decision>, Error> {
    Ok(match write_batch(queries, &[batched], payments, now).await? {
        Inserted::Done(mut decisions) => Some(decisions.pop().expect("one decision a call")),
        Inserted::KeyTaken => None,
    })
}

/// Payments found by (merchant_id, out_trade_no).
type PaymentsRead = HashMap<(String, String), (PaymentRow, OrderRow)>;

/// The read before the batch, one statement for the Pays and Refunds of it: a
/// [`Decision::Found`] for every Pay whose out_trade_no is already paid, and the payments
/// (immutable once written) the Refunds refund.
async fn read_payments(store: &Store, commands: &[Batched]) -> Result<(Vec<Option<Decision>>, PaymentsRead), Error> {
    let keys: BTreeSet<(&str, &str)> = commands.iter().filter_map(|batched| batched.write.trade_key()).collect();
    let keys: Vec<(&str, &str)> = keys.into_iter().collect();
    if keys.is_empty() {
        // Transfers, Deposits and Withdraws only: nothing to read.
        return Ok((commands.iter().map(|_| None).collect(), PaymentsRead::new()));
    }
    let mut reader = store.reader().await?;
    let found: PaymentsRead = reader
        .queries()
        .find_payments_and_orders(&keys)
        .await?
        .into_iter()
        .map(|(payment, order)| ((payment.merchant_id.clone(), payment.out_trade_no.clone()), (payment, order)))
        .collect();
    let decisions = commands
        .iter()
        .map(|batched| {
            let Write::Pay { command, .. } = &batched.write else { return None };
            let key = (command.merchant_id.as_str().to_owned(), command.out_trade_no.as_str().to_owned());
            found.get(&key).map(|(payment, order)| Decision::Found(payment.clone(), order.clone()))
        })
        .collect();
    Ok((decisions, found))
}

fn alone(count: usize) -> Vec<Decision> {
    (0..count).map(|_| Decision::Alone).collect()
}

/// What the batch can go on with for one write, its rows locked and read.
#[allow(clippy::large_enum_variant)] // one a call of one batch, never moved
enum Candidate<'a> {
    /// A Pay, with its trade_no, of this order (as read under its lock).
    Pay(&'a Pay, &'a str, OrderRow),
    /// A Refund of this payment.
    Refund(&'a Refund, &'a str, &'a PaymentRow),
    /// A Transfer, with its transfer_id.
    Transfer(&'a Transfer, &'a str),
    /// A Deposit or Withdraw.
    Funding(&'a FundingWrite),
    /// A CreateOrder, and the order it creates.
    CreateOrder(OrderRow),
}

/// What one accepted write does, in the order the batch applied it.
enum Accepted {
    /// The receipt of a Pay if the batch commits, and its legs (payer, payee).
    Paid(PayReceipt, Legs),
    /// The receipt of a Refund if the batch commits (its order as this refund leaves it), its
    /// legs and the payment it refunds.
    Refunded(RefundReceipt, Legs, Box<PaymentRow>),
    /// The row of a Transfer and its legs (from, to). Its receipt holds its entries, whose
    /// ids only the write gives: its guards are claimed IN_PROGRESS and completed after it.
    Transferred(TransferRow, Legs),
    /// A Deposit or Withdraw, its row and its legs (from, to); claimed as a Transfer is.
    Funded(FundingWrite, FundingRow, Legs),
    /// A new order; it moves no money.
    Created(OrderRow),
}

impl Accepted {
    /// Its posting and the (balance, version) each leg leaves; none for a new order.
    fn posting(&self) -> Option<(Posting<'_>, Legs)> {
        match self {
            Accepted::Paid(receipt, legs) => Some((payment_posting(&receipt.payment), *legs)),
            Accepted::Refunded(receipt, legs, payment) => Some((refund_posting(&receipt.refund, payment), *legs)),
            Accepted::Transferred(transfer, legs) => Some((transfer_posting(transfer), *legs)),
            Accepted::Funded(funding, row, legs) => Some((funding.posting(row), *legs)),
            Accepted::Created(_) => None,
        }
    }

    /// The response message of a Pay, Refund or CreateOrder, which its guards record when
    /// claimed; `None` for a Transfer, Deposit or Withdraw (known only once its entries are read
    /// back).
    fn message(&self) -> Result<Option<Vec<u8>>, Error> {
        Ok(match self {
            Accepted::Paid(receipt, _) => {
                Some(<Identified<Pay> as IdempotentCall>::message(receipt.clone())?.encode_to_vec())
            }
            Accepted::Refunded(receipt, ..) => {
                Some(<Identified<Refund> as IdempotentCall>::message(receipt.clone())?.encode_to_vec())
            }
            Accepted::Created(order) => Some(NewOrder::message(order.clone())?.encode_to_vec()),
            Accepted::Transferred(..) | Accepted::Funded(..) => None,
        })
    }
}

/// An order key, owned.
type OrderKey = (String, String);

fn order_key(merchant_id: &str, order_no: &str) -> OrderKey {
    (merchant_id.to_owned(), order_no.to_owned())
}

/// The calls of `batch` that run alone after it, known before any lock: a second Pay of one
/// order or out_trade_no, a second Refund of one out_refund_no, a Refund whose payment the
/// read did not find or whose order a Pay of the batch names, a second Deposit (or Withdraw)
/// of one request_id, a second CreateOrder of one order, a Pay or Refund of an order a
/// CreateOrder of the batch creates, a second call with one idempotency key or token.
fn runs_alone(batch: &[&Batched], payments: &PaymentsRead) -> Vec<bool> {
    let claims: Vec<Option<&BatchClaim>> = batch.iter().map(|batched| batched.claim.as_ref()).collect();
    let refunded = refunded_payments(batch, payments);
    let mut decisions: Vec<Option<Decision>> = batch.iter().map(|_| None).collect();
    // A second CreateOrder of one order runs alone after the first (a replay of it, or
    // ORDER_NO_REUSED), and so does a Pay or Refund of an order the batch creates (alone it
    // finds the order the batch committed, or ORDER_NOT_FOUND if the batch refused it): no
    // order is both created and moved by one batch.
    let mut orders_created = HashSet::new();
    for (decision, batched) in decisions.iter_mut().zip(batch) {
        let Some(key) = batched.write.created_order() else { continue };
        if !orders_created.insert(key) {
            *decision = Some(Decision::Alone);
        }
    }
    for ((decision, batched), payment) in decisions.iter_mut().zip(batch).zip(&refunded) {
        let moved = match &batched.write {
            Write::Pay { command, .. } => Some((command.merchant_id.as_str(), command.order_no.as_str())),
            Write::Refund { .. } => payment.map(|payment| (payment.merchant_id.as_str(), payment.order_no.as_str())),
            Write::Transfer { .. } | Write::Funding(_) | Write::CreateOrder(_) => None,
        };
        if moved.is_some_and(|key| orders_created.contains(&key)) {
            *decision = Some(Decision::Alone);
        }
    }
    // A second Pay of the same order or out_trade_no waits for the first one's outcome: it
    // runs alone after the batch (then it is a replay, ORDER_ALREADY_PAID or
    // OUT_TRADE_NO_REUSED, exactly as if it had come second on its own).
    let mut orders_paid = HashSet::new();
    let mut trade_nos_seen = HashSet::new();
    for (decision, batched) in decisions.iter_mut().zip(batch) {
        let Write::Pay { command, .. } = &batched.write else { continue };
        let merchant_id = command.merchant_id.as_str();
        let first_of_order = orders_paid.insert((merchant_id, command.order_no.as_str()));
        let first_of_trade_no = trade_nos_seen.insert((merchant_id, command.out_trade_no.as_str()));
        if !(first_of_order && first_of_trade_no) {
            *decision = Some(Decision::Alone);
        }
    }
    // So does a second Refund of one out_refund_no (it is then a replay of the first), one
    // whose payment the read did not find (it may be paid by this very batch: alone it
    // finds it, or answers PAYMENT_NOT_FOUND), and one of an order a Pay of the batch
    // names, so that no order is both paid and refunded by one batch. Refunds of one order
    // are applied one after another to its state in memory.
    let mut refund_nos_seen = HashSet::new();
    for ((decision, batched), payment) in decisions.iter_mut().zip(batch).zip(&refunded) {
        let Write::Refund { command, .. } = &batched.write else { continue };
        let first = refund_nos_seen.insert((command.merchant_id.as_str(), command.out_refund_no.as_str()));
        let paid_here =
            |payment: &PaymentRow| orders_paid.contains(&(payment.merchant_id.as_str(), payment.order_no.as_str()));
        if !first || payment.is_none_or(paid_here) {
            *decision = Some(Decision::Alone);
        }
    }
    // So does a second Deposit (or Withdraw) of one request_id: alone after the batch, it is a
    // replay of the first (or REQUEST_ID_REUSED).
    let mut request_ids_seen = HashSet::new();
    for (decision, batched) in decisions.iter_mut().zip(batch) {
        let Write::Funding(funding) = &batched.write else { continue };
        if !request_ids_seen.insert((funding.table, funding.request_id.as_str())) {
            *decision = Some(Decision::Alone);
        }
    }
    // So does a second call with one idempotency key or token: alone after the batch, it is
    // answered by the first one's record (or, when the first was refused, runs afresh).
    let mut guards_seen = HashSet::new();
    for (decision, claim) in decisions.iter_mut().zip(&claims) {
        let Some(claim) = claim else { continue };
        // Every key of the call is noted, even after one already seen.
        let seen: Vec<bool> = claim.keys().map(|key| !guards_seen.insert(key)).collect();
        if seen.contains(&true) && decision.is_none() {
            *decision = Some(Decision::Alone);
        }
    }
    decisions.iter().map(Option::is_some).collect()
}

/// The payment each Refund of `batch` refunds, as read before the batch.
fn refunded_payments<'a>(batch: &[&Batched], payments: &'a PaymentsRead) -> Vec<Option<&'a PaymentRow>> {
    batch
        .iter()
        .map(|batched| match &batched.write {
            Write::Refund { command, .. } => payments
                .get(&order_key(command.merchant_id.as_str(), command.out_trade_no.as_str()))
                .map(|(payment, _)| payment),
            Write::Pay { .. } | Write::Transfer { .. } | Write::Funding(_) | Write::CreateOrder(_) => None,
        })
        .collect()
}

/// The batch's writes (none of its calls is one [`runs_alone`] names), in the steps of the
/// module doc. `Inserted::KeyTaken` means "roll back, every call runs alone".
async fn write_batch(
    queries: &mut Queries<'_>,
    batch: &[&Batched],
    payments: &PaymentsRead,
    now: i64,
) -> Result<Inserted<Vec<Decision>>, Error> {
    let mut deciding = Deciding {
        batch,
        claims: batch.iter().map(|batched| batched.claim.as_ref()).collect(),
        refunded: refunded_payments(batch, payments),
        now,
        decisions: batch.iter().map(|_| None).collect(),
    };
    deciding.read_guards(queries).await?;
    let orders = deciding.lock_orders(queries).await?;
    let candidates = deciding.candidates(&orders);
    if candidates.is_empty() {
        return Ok(Inserted::Done(deciding.into_decisions()));
    }
    let locked = lock_accounts(queries, &candidates).await?;
    decide_fundings(queries, &candidates, &locked, &mut deciding.decisions).await?;
    let mut claimed: HashSet<usize> = HashSet::new();
    // Until a claim of several found a key taken (see `claim_prefix_together`).
    let mut claim_together = true;
    let (accounts, refunded_orders, accepted) = loop {
        let applied = deciding.apply(&candidates, &locked, &orders.rows);
        if claim_together {
            claim_together = claim_prefix_together(queries, &deciding.claims, &applied.accepted, &mut claimed).await?;
        }
        if !deciding.claim_guards(queries, &applied.accepted, &mut claimed).await? {
            let Applied { accounts, refunded_orders, accepted, refused } = applied;
            deciding.refuse(refused);
            break (accounts, refunded_orders, accepted);
        }
        // A claimed write refused on the next pass would need its claim undone in the middle
        // of the batch (it cannot be: it came before the one taken out): the batch would roll
        // back instead, and every call of it run alone.
        if applied.refused.iter().any(|(index, _)| claimed.contains(index)) {
            return Ok(Inserted::KeyTaken);
        }
    };

    // 4. The writes; then the entries of the Transfers, Deposits and Withdraws read back
    //    (their ids are the database's), and their records claimed IN_PROGRESS completed with
    //    their receipts.
    if !accepted.is_empty()
        && !write_accepted(queries, &accepted, &orders.rows, &refunded_orders, &accounts, now).await?
    {
        return Ok(Inserted::KeyTaken);
    }
    let entries = entries_read_back(queries, &accepted).await?;
    let completions = deciding.answer(accepted, entries, &locked)?;
    let completions: Vec<_> = completions.into_iter().map(|(claim, message)| claim.completion(message)).collect();
    complete_claims(queries, &completions).await?;
    Ok(Inserted::Done(deciding.into_decisions()))
}

/// One batch's calls as its transaction decides them: each call's decision once it has one.
struct Deciding<'b> {
    batch: &'b [&'b Batched],
    /// Each call's guards, when it carries an `idempotency-key` or `idempotency-token`.
    claims: Vec<Option<&'b BatchClaim>>,
    /// The payment each Refund refunds, as read before the batch.
    refunded: Vec<Option<&'b PaymentRow>>,
    /// When the batch writes, in microseconds since the epoch.
    now: i64,
    decisions: Vec<Option<Decision>>,
}

/// The orders a batch locked, by (merchant_id, order_no), and the Refunds' out_refund_nos
/// found committed under those locks, by (merchant_id, out_refund_no).
struct LockedOrders {
    rows: HashMap<OrderKey, OrderRow>,
    refunded_before: HashSet<OrderKey>,
}

/// The writes of a batch applied in arrival order (one pass of step 2).
struct Applied {
    /// The accounts as the accepted writes leave them.
    accounts: Book,
    /// The orders the batch refunds, as its refunds leave them.
    refunded_orders: BTreeMap<OrderKey, OrderRow>,
    accepted: Vec<(usize, Accepted)>,
    /// The writes that break a rule, and why.
    refused: Vec<(usize, Error)>,
}

impl<'b> Deciding<'b> {
    /// Every call's decision; a call the batch could not decide runs alone.
    fn into_decisions(self) -> Vec<Decision> {
        self.decisions.into_iter().map(|decision| decision.unwrap_or(Decision::Alone)).collect()
    }

    /// 0. The committed records of the guards that the calls did not read before they queued
    ///    (an idempotency key alone), in one read: a record that answers a call takes it out
    ///    with nothing of it written, answered by that record after the batch. A record
    ///    committed after this read is found by the claim (3).
    async fn read_guards(&mut self, queries: &mut Queries<'_>) -> Result<(), Error> {
        let keys_to_read: Vec<(&str, &str)> =
            self.claims.iter().flatten().flat_map(|claim| claim.keys_to_read()).collect();
        if keys_to_read.is_empty() {
            return Ok(());
        }
        let found = queries.find_answered_records(&keys_to_read).await?;
        for (decision, claim) in self.decisions.iter_mut().zip(&self.claims) {
            if let Some(record) = claim.and_then(|claim| claim.answering_record(&found, self.now)) {
                *decision = Some(Decision::GuardAnswered(Box::new(record)));
            }
        }
        Ok(())
    }

    /// The order a call locks: a Pay's, a Refund's payment's, a CreateOrder's (read to find
    /// one committed before); none for a Transfer, Deposit or Withdraw.
    fn order_of(&self, index: usize) -> Option<(&'b str, &'b str)> {
        match &self.batch[index].write {
            Write::Pay { command, .. } => Some((command.merchant_id.as_str(), command.order_no.as_str())),
            Write::CreateOrder(call) => Some((call.command.merchant_id.as_str(), call.command.order_no.as_str())),
            Write::Refund { .. } => {
                let payment = self.refunded[index].expect("a Refund without its payment runs alone");
                Some((payment.merchant_id.as_str(), payment.order_no.as_str()))
            }
            Write::Transfer { .. } | Write::Funding(_) => None,
        }
    }

    /// The calls not decided yet, in arrival order.
    fn undecided(&self) -> Vec<usize> {
        (0..self.batch.len()).filter(|index| self.decisions[*index].is_none()).collect()
    }

    /// 1. The orders, locked; then the refunds committed before the lock was taken (a Refund
    ///    locks its order before it inserts its row, so none of these orders can gain one
    ///    after; one of the same out_refund_no on another order would fail the refunds' INSERT,
    ///    and the batch would run alone).
    async fn lock_orders(&self, queries: &mut Queries<'_>) -> Result<LockedOrders, Error> {
        let undecided = self.undecided();
        let order_keys: BTreeSet<(&str, &str)> = undecided.iter().filter_map(|index| self.order_of(*index)).collect();
        let order_keys: Vec<(&str, &str)> = order_keys.into_iter().collect();
        let rows: HashMap<OrderKey, OrderRow> = if order_keys.is_empty() {
            HashMap::new()
        } else {
            queries
                .lock_orders(&order_keys)
                .await?
                .into_iter()
                .map(|order| ((order.merchant_id.clone(), order.order_no.clone()), order))
                .collect()
        };
        let refund_keys: Vec<(&str, &str)> = undecided
            .iter()
            .filter_map(|index| match &self.batch[*index].write {
                Write::Refund { command, .. } => Some((command.merchant_id.as_str(), command.out_refund_no.as_str())),
                Write::Pay { .. } | Write::Transfer { .. } | Write::Funding(_) | Write::CreateOrder(_) => None,
            })
            .collect();
        let refunded_before: HashSet<OrderKey> = if refund_keys.is_empty() {
            HashSet::new()
        } else {
            let found = queries.find_refunds(&refund_keys).await?;
            found.into_iter().map(|row| (row.merchant_id, row.out_refund_no)).collect()
        };
        Ok(LockedOrders { rows, refunded_before })
    }

    /// 1. Each undecided call's checks against its locked order, in its own transaction's
    ///    order: what the batch can go on with, the others decided (a replay, or a rule
    ///    broken).
    fn candidates(&mut self, orders: &LockedOrders) -> Vec<(usize, Candidate<'b>)> {
        // Deadlines are judged now that the orders are locked (see `deadline_clock`).
        let checked_at = deadline_clock(self.now);
        let mut candidates = Vec::new();
        for index in self.undecided() {
            let order = self
                .order_of(index)
                .and_then(|(merchant_id, order_no)| orders.rows.get(&order_key(merchant_id, order_no)));
            let decided = match &self.batch[index].write {
                Write::Transfer { command, transfer_id } => Ok(Candidate::Transfer(command, transfer_id)),
                Write::Funding(funding) => Ok(Candidate::Funding(funding)),
                // An order committed before is a replay (or ORDER_NO_REUSED), whatever its
                // expires_at says now, as the driver's read before the batch answers it; then
                // the order's own checks, as its own transaction makes them.
                Write::CreateOrder(call) => match order {
                    Some(_) => Err(Decision::CreatedBefore),
                    None => call.order_at(self.now).map(Candidate::CreateOrder).map_err(Decision::Rejected),
                },
                Write::Pay { command, trade_no } => {
                    match order.map(|order| (order, check_pay(order, command, checked_at))) {
                        None => Err(Decision::Rejected(Error::NotFound(Resource::Order))),
                        Some((order, Ok(PayCheck::Proceed))) => Ok(Candidate::Pay(command, trade_no, order.clone())),
                        Some((_, Ok(PayCheck::PaidByThisCall))) => Err(Decision::PaidBefore),
                        Some((_, Err(error))) => Err(Decision::Rejected(error)),
                    }
                }
                // A Refund's checks in the one-refund transaction's order: currency, order, key.
                Write::Refund { command, refund_no } => {
                    let payment = self.refunded[index].expect("a Refund without its payment runs alone");
                    let refunded_before = || {
                        let key = order_key(&payment.merchant_id, command.out_refund_no.as_str());
                        orders.refunded_before.contains(&key)
                    };
                    match (check_refund(command, payment), order) {
                        (Err(error), _) => Err(Decision::Rejected(error)),
                        (Ok(()), None) => Err(Decision::Rejected(Error::NotFound(Resource::Order))),
                        (Ok(()), Some(_)) if refunded_before() => Err(Decision::RefundedBefore),
                        (Ok(()), Some(_)) => Ok(Candidate::Refund(command, refund_no, payment)),
                    }
                }
            };
            match decided {
                Ok(candidate) => candidates.push((index, candidate)),
                Err(decision) => self.decisions[index] = Some(decision),
            }
        }
        candidates
    }

    /// 2. The candidates not decided yet applied one after another in arrival order, in
    ///    memory, each to the accounts (`locked`, as read under their locks) and orders as the
    ///    ones before it leave them.
    fn apply(
        &self,
        candidates: &[(usize, Candidate<'b>)],
        locked: &Book,
        orders: &HashMap<OrderKey, OrderRow>,
    ) -> Applied {
        let mut accounts = locked.clone();
        let mut refunded_orders: BTreeMap<OrderKey, OrderRow> = BTreeMap::new();
        let (mut accepted, mut refused) = (Vec::new(), Vec::new());
        let now = self.now;
        for (index, candidate) in candidates.iter().filter(|(index, _)| self.decisions[*index].is_none()) {
            let applied = match candidate {
                Candidate::Pay(command, trade_no, order) => apply_pay(&mut accounts, command, order, trade_no, now),
                Candidate::Refund(command, refund_no, payment) => {
                    let key = order_key(&payment.merchant_id, &payment.order_no);
                    let order = refunded_orders.get(&key).or_else(|| orders.get(&key)).expect("locked above");
                    apply_refund(&mut accounts, command, refund_no, payment, order.clone(), now).map(
                        |(receipt, legs)| {
                            refunded_orders.insert(key, receipt.order.clone());
                            Accepted::Refunded(receipt, legs, Box::new((*payment).clone()))
                        },
                    )
                }
                Candidate::Transfer(command, transfer_id) => {
                    let transfer = transfer_row(command, transfer_id, now);
                    accounts.post(&transfer_posting(&transfer)).map(|legs| Accepted::Transferred(transfer, legs))
                }
                Candidate::Funding(funding) => apply_funding(&mut accounts, funding, now),
                Candidate::CreateOrder(order) => {
                    check_payee(accounts.get(&order.payee_account_id), order).map(|()| Accepted::Created(order.clone()))
                }
            };
            match applied {
                Ok(accepted_one) => accepted.push((*index, accepted_one)),
                Err(error) => refused.push((*index, error)),
            }
        }
        Applied { accounts, refunded_orders, accepted, refused }
    }

    /// 3. Each accepted write's guards, claimed in arrival order, their records written with
    ///    the answer the write gets if the batch commits. A guard found taken, or a token found
    ///    invalid, takes that write out of the batch with nothing of it written (true: apply
    ///    the writes again without it, as one it paid into may now lack funds, one it spent
    ///    from may now have them, a refund after it may now fit its order). The writes before
    ///    it, claimed already, keep their outcome (each is applied after the ones before it
    ///    only).
    async fn claim_guards(
        &mut self,
        queries: &mut Queries<'_>,
        accepted: &[(usize, Accepted)],
        claimed: &mut HashSet<usize>,
    ) -> Result<bool, Error> {
        for (index, accepted_one) in accepted {
            let Some(claim) = self.claims[*index].filter(|_| !claimed.contains(index)) else { continue };
            let records = records_to_claim(claim, accepted_one)?;
            match claim.claim(queries, &records, self.now).await {
                Ok(true) => {
                    claimed.insert(*index);
                    continue;
                }
                Ok(false) => self.decisions[*index] = Some(Decision::GuardTaken),
                Err(error @ Error::Rejected(_)) => self.decisions[*index] = Some(Decision::Rejected(error)),
                Err(error) => return Err(error),
            }
            return Ok(true);
        }
        Ok(false)
    }

    /// The writes the final pass refused: nothing of them is written.
    fn refuse(&mut self, refused: Vec<(usize, Error)>) {
        for (index, error) in refused {
            self.decisions[index] = Some(Decision::Rejected(error));
        }
    }

    /// 5. Each accepted write's answer, once written: a Transfer's with its entries, a
    ///    Deposit's or Withdraw's with its account's entry (`entries`, read back), the account
    ///    as read under its lock (`locked`) moved by it. Returns the claims to complete with
    ///    the messages of those answers (their records were claimed IN_PROGRESS).
    fn answer(
        &mut self,
        accepted: Vec<(usize, Accepted)>,
        mut entries: HashMap<(String, String), EntryRow>,
        locked: &Book,
    ) -> Result<Vec<(&'b BatchClaim, Vec<u8>)>, Error> {
        let mut completions = Vec::new();
        for (index, accepted_one) in accepted {
            let decision = match accepted_one {
                Accepted::Paid(receipt, _) => Decision::Paid(receipt),
                Accepted::Refunded(receipt, ..) => Decision::Refunded(receipt),
                Accepted::Created(order) => Decision::Created(order),
                Accepted::Transferred(transfer, _) => {
                    let mut entry = |account_id: &str| {
                        entries
                            .remove(&(transfer.transfer_id.clone(), account_id.to_owned()))
                            .ok_or_else(|| Error::Internal("a transfer's entry is missing".into()))
                    };
                    let (from_entry, to_entry) = (entry(&transfer.from_account_id)?, entry(&transfer.to_account_id)?);
                    let receipt = TransferReceipt { transfer, from_entry, to_entry };
                    if let Some(claim) = self.claims[index] {
                        let message = <Identified<Transfer> as IdempotentCall>::message(receipt.clone())?;
                        completions.push((claim, message.encode_to_vec()));
                    }
                    Decision::Transferred(receipt)
                }
                Accepted::Funded(funding, _, _) => {
                    let entry = entries
                        .remove(&(funding.funding_id.clone(), funding.account_id.clone()))
                        .ok_or_else(|| Error::Internal("the entry of a deposit or withdrawal is missing".into()))?;
                    let account = locked.get(&funding.account_id).expect("locked above").clone();
                    let receipt = receipt_after(account, entry);
                    if let Some(claim) = self.claims[index] {
                        completions.push((claim, funding_message(&funding, &receipt)?));
                    }
                    Decision::Funded(receipt)
                }
            };
            self.decisions[index] = Some(decision);
        }
        Ok(completions)
    }
}

/// 2. Every account the candidates touch, locked (one `SELECT ... FOR UPDATE`, in account_id
///    order). A CreateOrder's payee is read with them (it moves no money: its lock only orders
///    it with the batch's other rows).
async fn lock_accounts(queries: &mut Queries<'_>, candidates: &[(usize, Candidate<'_>)]) -> Result<Book, Error> {
    let account_ids: BTreeSet<&str> = candidates
        .iter()
        .flat_map(|(_, candidate)| match candidate {
            Candidate::Pay(command, _, order) => {
                vec![command.payer_account_id.as_str(), order.payee_account_id.as_str()]
            }
            Candidate::Refund(_, _, payment) => {
                vec![payment.payee_account_id.as_str(), payment.payer_account_id.as_str()]
            }
            Candidate::Transfer(command, _) => vec![command.from_account_id.as_str(), command.to_account_id.as_str()],
            Candidate::Funding(funding) => vec![funding.account_id.as_str(), funding.funding_account_id.as_str()],
            Candidate::CreateOrder(order) => vec![order.payee_account_id.as_str()],
        })
        .collect();
    let account_ids: Vec<&str> = account_ids.into_iter().collect();
    Ok(Book::locked(queries.lock_accounts(&account_ids).await?))
}

/// The records an accepted write's guards claim: COMPLETED with the answer of a Pay, Refund
/// or CreateOrder; IN_PROGRESS for a Transfer, Deposit or Withdraw, whose answer the write
/// makes.
fn records_to_claim(claim: &BatchClaim, accepted: &Accepted) -> Result<Vec<IdempotencyRecordRow>, Error> {
    Ok(match (accepted, accepted.message()?) {
        (Accepted::Paid(..) | Accepted::Refunded(..) | Accepted::Created(..), Some(message)) => {
            claim.completed_records(&message)
        }
        (Accepted::Transferred(..) | Accepted::Funded(..), None) => claim.in_progress_records().to_vec(),
        (Accepted::Paid(..) | Accepted::Refunded(..) | Accepted::Created(..), None)
        | (Accepted::Transferred(..) | Accepted::Funded(..), Some(_)) => unreachable!(
            "a Pay's, Refund's or CreateOrder's message is known before the write, a Transfer's, Deposit's or Withdraw's after it"
        ),
    })
}

/// The guards of the accepted writes not claimed yet, up to the first that consumes a
/// token, claimed in one statement, all or none ([`Queries::claim_records`]): what the loop of
/// step 3 does one write at a time, in one round trip. It claims a prefix, in arrival order, so
/// that a write the loop takes out afterwards still comes after every write claimed. False
/// when nothing was claimed for a key taken (or on SQLite): the loop then claims each write
/// alone, which names the taken key and replaces an expired record, and this is not tried again
/// in the batch.
async fn claim_prefix_together(
    queries: &mut Queries<'_>,
    claims: &[Option<&BatchClaim>],
    accepted: &[(usize, Accepted)],
    claimed: &mut HashSet<usize>,
) -> Result<bool, Error> {
    let mut together: Vec<(usize, Vec<IdempotencyRecordRow>)> = Vec::new();
    for (index, accepted_one) in accepted {
        let Some(claim) = claims[*index].filter(|_| !claimed.contains(index)) else { continue };
        if claim.consumes_token() {
            break;
        }
        together.push((*index, records_to_claim(claim, accepted_one)?));
    }
    // One claim alone gains nothing over the loop.
    if together.len() < 2 {
        return Ok(true);
    }
    let records: Vec<&IdempotencyRecordRow> = together.iter().flat_map(|(_, records)| records).collect();
    if !queries.claim_records(&records).await? {
        return Ok(false);
    }
    claimed.extend(together.iter().map(|(index, _)| *index));
    Ok(true)
}

/// The journal entries of the accepted Transfers (both legs of each), Deposits and Withdraws
/// (the account's leg), by (posting_id, account_id): one read, none without them.
async fn entries_read_back(
    queries: &mut Queries<'_>,
    accepted: &[(usize, Accepted)],
) -> Result<HashMap<(String, String), EntryRow>, Error> {
    let legs: Vec<(&str, &str)> = accepted
        .iter()
        .flat_map(|(_, accepted_one)| match accepted_one {
            Accepted::Transferred(transfer, _) => {
                let transfer_id = transfer.transfer_id.as_str();
                vec![(transfer_id, transfer.from_account_id.as_str()), (transfer_id, transfer.to_account_id.as_str())]
            }
            Accepted::Funded(funding, ..) => vec![(funding.funding_id.as_str(), funding.account_id.as_str())],
            Accepted::Paid(..) | Accepted::Refunded(..) | Accepted::Created(..) => Vec::new(),
        })
        .collect();
    if legs.is_empty() {
        return Ok(HashMap::new());
    }
    let entries = queries.find_entries(&legs).await?;
    Ok(entries.into_iter().map(|entry| ((entry.posting_id.clone(), entry.account_id.clone()), entry)).collect())
}

/// A Pay applied to the book: its payer checked ([`check_payer`]), then its payment's posting;
/// or nothing changed and why.
fn apply_pay(book: &mut Book, command: &Pay, order: &OrderRow, trade_no: &str, now: i64) -> Result<Accepted, Error> {
    check_payer(book.get(command.payer_account_id.as_str()), order)?;
    let payment = new_payment(command, order, trade_no, now);
    let legs = book.post(&payment_posting(&payment))?;
    Ok(Accepted::Paid(paid_receipt(payment, order.clone(), now), legs))
}

/// A Refund applied to its order's state (`order`, as the batch's refunds before it leave it)
/// by the state machine, as the one-refund transaction does, then its posting (payee back to
/// payer); or nothing changed and why.
fn apply_refund(
    book: &mut Book,
    command: &Refund,
    refund_no: &str,
    payment: &PaymentRow,
    order: OrderRow,
    now: i64,
) -> Result<(RefundReceipt, Legs), Error> {
    let refund = new_refund(command, payment, refund_no, now);
    let order = refunded_order(order, refund.amount, now)?;
    let legs = book.post(&refund_posting(&refund, payment))?;
    Ok((RefundReceipt { refund, order }, legs))
}

/// A Deposit or Withdraw applied to the book: its account checked
/// ([`FundingWrite::check_account`]), then its posting; or nothing changed and why.
fn apply_funding(book: &mut Book, funding: &FundingWrite, now: i64) -> Result<Accepted, Error> {
    funding.check_account(book.get(&funding.account_id))?;
    let row = funding.row(now);
    let legs = book.post(&funding.posting(&row))?;
    Ok(Accepted::Funded(funding.clone(), row, legs))
}

/// Decides, once the accounts are locked, the Deposits and Withdraws the batch cannot write:
/// one whose request_id a committed call took ([`Decision::FundedBefore`]; one taken after
/// this read fails the batch's INSERT on the primary key, and the batch runs alone: rare, as
/// the calls of a request_id move one funding account, locked now), and one whose funding
/// account (a shard not used yet) has no row: it runs alone, where its own transaction
/// creates it.
async fn decide_fundings(
    queries: &mut Queries<'_>,
    candidates: &[(usize, Candidate<'_>)],
    locked: &Book,
    decisions: &mut [Option<Decision>],
) -> Result<(), Error> {
    let fundings: Vec<(usize, &FundingWrite)> = candidates
        .iter()
        .filter_map(|(index, candidate)| match candidate {
            Candidate::Funding(funding) => Some((*index, *funding)),
            Candidate::Pay(..) | Candidate::Refund(..) | Candidate::Transfer(..) | Candidate::CreateOrder(..) => None,
        })
        .collect();
    if fundings.is_empty() {
        return Ok(());
    }
    let request_ids = |table: FundingTable| -> Vec<&str> {
        fundings
            .iter()
            .filter(|(_, funding)| funding.table == table)
            .map(|(_, funding)| funding.request_id.as_str())
            .collect()
    };
    let taken: HashSet<(FundingTable, String)> = queries
        .find_fundings(&request_ids(FundingTable::Deposits), &request_ids(FundingTable::Withdrawals))
        .await?
        .into_iter()
        .collect();
    for (index, funding) in fundings {
        if taken.contains(&(funding.table, funding.request_id.clone())) {
            decisions[index] = Some(Decision::FundedBefore);
        } else if locked.get(&funding.funding_account_id).is_none() {
            decisions[index] = Some(Decision::Alone);
        }
    }
    Ok(())
}

/// The response message of a Deposit or Withdraw, which its guards record.
fn funding_message(funding: &FundingWrite, receipt: &DepositReceipt) -> Result<Vec<u8>, Error> {
    Ok(match funding.table {
        FundingTable::Deposits => <FundingCall<Deposit> as IdempotentCall>::message(receipt.clone())?.encode_to_vec(),
        FundingTable::Withdrawals => {
            <FundingCall<Withdraw> as IdempotentCall>::message(receipt.clone())?.encode_to_vec()
        }
    })
}

/// Step 4: the write set of the accepted writes, each row in its table and each posting in
/// the order the batch applied it, written by [`book::write`]: false when a key, an order's
/// state or a version was taken under the batch (roll back).
async fn write_accepted(
    queries: &mut Queries<'_>,
    accepted: &[(usize, Accepted)],
    orders: &HashMap<OrderKey, OrderRow>,
    refunded_orders: &BTreeMap<OrderKey, OrderRow>,
    book: &Book,
    now: i64,
) -> Result<bool, Error> {
    let mut set = WriteSet::default();
    for (_, accepted_one) in accepted {
        match accepted_one {
            Accepted::Created(order) => set.orders.push(order.clone()),
            Accepted::Paid(receipt, _) => set.payments.push(receipt.payment.clone()),
            Accepted::Refunded(receipt, ..) => set.refunds.push(receipt.refund.clone()),
            Accepted::Transferred(transfer, _) => set.transfers.push(transfer.clone()),
            Accepted::Funded(funding, row, _) => match funding.table {
                FundingTable::Deposits => set.deposits.push(row.clone()),
                FundingTable::Withdrawals => set.withdrawals.push(row.clone()),
            },
        }
        set.postings.extend(accepted_one.posting());
    }
    set.refunded_orders = refunded_orders
        .iter()
        .map(|(key, after)| {
            let before = &orders[key];
            OrderRefund {
                merchant_id: &after.merchant_id,
                order_no: &after.order_no,
                from_status: &before.status,
                from_refunded: before.refunded_amount,
                to_status: &after.status,
                to_refunded: after.refunded_amount,
            }
        })
        .collect();
    book::write(queries, &set, book, now).await
}
