//! The group commit: the batch writer every batched write goes through, many calls in one
//! transaction ([`write_together`]), and a call alone as a batch of one ([`write_alone`]). It
//! knows no use case: each write says what it needs read and locked and decides its outcome
//! from those rows ([`BatchWrite`]), and what it accepted says what it writes and answers
//! ([`Accepted`]). What it does, what runs alone, and its bounds are explained once, in
//! `docs/write-engine.md`; why: `docs/decisions/003-group-commit.md`. Here, the steps of
//! [`write_together`] as the code takes them:
//!
//! 0. [`read_payments`] (for a batch of one without row locks, [`read_at_once`], which also
//!    reads its record and the orders and accounts of step 1), before the transaction: the
//!    payments the writes read
//!    ([`BatchWrite::payment_to_read`]; a write they decide, [`BatchWrite::decided_before`], is
//!    answered so); [`runs_alone`]: a write holding a key an earlier write of the batch holds
//!    ([`BatchWrite::batch_keys`]) runs alone after it ([`Outcome::Alone`]); in the transaction,
//!    [`Deciding::read_guards`]: the committed records of the calls with an idempotency key
//!    alone ([`Outcome::GuardAnswered`]);
//! 1. [`Deciding::lock`]: the orders locked in key order, the accounts in account_id order, then
//!    the keys the writes find taken or not under those locks ([`BatchWrite::key_to_find`]);
//! 2. [`Deciding::apply`]: the writes decided one after another in arrival order
//!    ([`BatchWrite::decide`]), each in a [`View`] of the rows as the writes before it leave
//!    them;
//! 3. [`claim_prefix_together`] and [`Deciding::claim_guards`]: the accepted writes' guards
//!    claimed, a write whose guard is taken taken out and the others decided again;
//! 4. [`write_accepted`]: the [`WriteSet`] of the accepted writes, written by [`book::write`]
//!    (checked against the money invariants); [`entries_read_back`] and [`complete_claims`];
//! 5. [`Deciding::answer`]: each accepted write's answer.
//!
//! A batch whose rows are all known ([`known_rows`]: the orders and accounts last seen
//! committed) skips 0 and 1, takes its rows from them and is written by [`write_known`] as one
//! statement that commits itself; a miss sends it through the steps above.
//!
//! A call refused before its batch (queue full: OVERLOADED; caller gone) is
//! [`Outcome::NotStarted`], with nothing read or written.

use std::any::Any;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::future::Future;

use prometheus_client::metrics::counter::Counter;

use crate::error::Error;
use crate::metrics::LedgerMetrics;
use crate::store::{
    AccountRow, Dialect, EntryRow, FundingTable, HoldRow, IdempotencyRecordRow, KeysAtOnce, OrderRefund, OrderRow,
    PaymentRow, Queries, RowLocks, Store,
};

use super::batching::{self, BatchWriter, GroupCommitSettings};
use super::book::{self, Book, WriteSet};
use super::known::{Known, Learned};
use super::transaction::in_transaction;
use crate::ledger::guards::{complete_claims, BatchClaim};
use crate::ledger::idempotent::IdempotentCall;
use crate::ledger::{deadline_clock, now_micros, Inserted};

/// A use case's answer to one write, as the write's [`Accepted::answer`] made it.
pub(in crate::ledger) type Answer = Box<dyn Any + Send + Sync>;

/// The counter of one kind of write a group commit committed.
pub(in crate::ledger) type Committed = fn(&LedgerMetrics) -> &Counter;

/// What the batch decided for one write.
pub(in crate::ledger) enum Outcome {
    /// Written and committed by the batch: its answer, and the counter of its kind.
    Written(Answer, Option<Committed>),
    /// Answered by what was read before the batch (a Pay whose out_trade_no was paid already:
    /// the payment and its order): a replay, or a key reused for something else.
    Found(Answer),
    /// Its natural key (an out_trade_no that paid its order, an out_refund_no, a request_id, an
    /// order) was committed before the batch locked its rows: replay it by that key.
    TakenBefore,
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
    /// Refused before it was queued or started: the queue was full, the caller had gone, or
    /// its batch found no connection to the database (UNAVAILABLE).
    NotStarted(Error),
}

impl std::fmt::Debug for Outcome {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Written(..) => formatter.write_str("Written"),
            Outcome::Found(_) => formatter.write_str("Found"),
            Outcome::TakenBefore => formatter.write_str("TakenBefore"),
            Outcome::Rejected(error) => write!(formatter, "Rejected({error})"),
            Outcome::GuardTaken => formatter.write_str("GuardTaken"),
            Outcome::GuardAnswered(_) => formatter.write_str("GuardAnswered"),
            Outcome::Alone => formatter.write_str("Alone"),
            Outcome::NotStarted(error) => write!(formatter, "NotStarted({error})"),
        }
    }
}

/// An order key, or a payment's: (merchant_id, order_no or out_trade_no), owned.
pub(in crate::ledger) type OrderKey = (String, String);

fn order_key(merchant_id: &str, number: &str) -> OrderKey {
    (merchant_id.to_owned(), number.to_owned())
}

/// Nothing read first: what a write names before any row is read.
static NOTHING_READ: std::sync::LazyLock<ReadFirst> = std::sync::LazyLock::new(ReadFirst::default);

/// What writes read before their rows are locked: payments (with their orders) by
/// (merchant_id, out_trade_no), which never change once written; holds by (merchant_id,
/// out_auth_no), which name the order to lock (a hold is read again under its order's lock).
#[derive(Default)]
pub(in crate::ledger) struct ReadFirst {
    payments: HashMap<OrderKey, (PaymentRow, OrderRow)>,
    holds: HashMap<OrderKey, HoldRow>,
}

impl ReadFirst {
    /// The payment of (merchant_id, out_trade_no) and its order.
    pub(in crate::ledger) fn payment(&self, merchant_id: &str, out_trade_no: &str) -> Option<&(PaymentRow, OrderRow)> {
        self.payments.get(&order_key(merchant_id, out_trade_no))
    }

    pub(in crate::ledger) fn add_payment(&mut self, payment: PaymentRow, order: OrderRow) {
        self.payments.insert(order_key(&payment.merchant_id, &payment.out_trade_no), (payment, order));
    }

    /// The hold of (merchant_id, out_auth_no), as read before the locks.
    pub(in crate::ledger) fn hold(&self, merchant_id: &str, out_auth_no: &str) -> Option<&HoldRow> {
        self.holds.get(&order_key(merchant_id, out_auth_no))
    }

    pub(in crate::ledger) fn add_hold(&mut self, hold: HoldRow) {
        self.holds.insert(order_key(&hold.merchant_id, &hold.out_auth_no), hold);
    }
}

/// The rows the accounts a write locks may depend on: its order and its order's hold as read
/// under the order's lock, and what it read first.
#[derive(Clone, Copy)]
pub(in crate::ledger) struct Rows<'a> {
    pub(in crate::ledger) order: Option<&'a OrderRow>,
    pub(in crate::ledger) hold: Option<&'a HoldRow>,
    pub(in crate::ledger) read: &'a ReadFirst,
}

/// A key whose row a write finds taken or not under the batch's locks.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(in crate::ledger) enum KeyToFind {
    /// A refund's (merchant_id, out_refund_no), read under its order's lock.
    Refund(String, String),
    /// A Deposit's or Withdraw's request_id, read under its funding account's lock.
    Funding(FundingTable, String),
}

/// A key a write holds in its batch: a later write of the batch holding the same key runs
/// alone after the batch, unless both hold it shared.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(in crate::ledger) struct BatchKey {
    /// What the key is of ("order", "out_trade_no", ...), and the key.
    pub(in crate::ledger) of: (&'static str, String, String),
    pub(in crate::ledger) shared: bool,
}

impl BatchKey {
    pub(in crate::ledger) fn sole(of: &'static str, first: &str, second: &str) -> Self {
        Self { of: (of, first.to_owned(), second.to_owned()), shared: false }
    }

    pub(in crate::ledger) fn shared(of: &'static str, first: &str, second: &str) -> Self {
        Self { of: (of, first.to_owned(), second.to_owned()), shared: true }
    }
}

/// One write a batch can take: what it needs read and locked, and its decision from those
/// rows. Each use case that batches implements it once; a call alone runs the same decision
/// on a batch of one.
pub(in crate::ledger) trait BatchWrite: Send + Sync {
    /// What routes it to its worker: writes of one route share a worker, so concurrent batches
    /// touch different rows and do not queue on each other's row locks.
    fn route(&self) -> &str;

    /// The (merchant_id, out_trade_no) of the payment it reads before the batch (payments
    /// never change once written).
    fn payment_to_read(&self) -> Option<(&str, &str)> {
        None
    }

    /// Its outcome when the payments read before the batch decide it.
    fn decided_before(&self, _read: &ReadFirst) -> Option<Outcome> {
        None
    }

    /// The keys it holds in its batch; `None` when it runs alone after the batch whatever the
    /// batch holds.
    fn batch_keys(&self, read: &ReadFirst) -> Option<Vec<BatchKey>>;

    /// The order whose row it locks, (merchant_id, order_no).
    fn order_to_lock<'a>(&'a self, _read: &'a ReadFirst) -> Option<(&'a str, &'a str)> {
        None
    }

    /// Whether it reads its order's hold, under the order's lock (every change of a hold is
    /// made under it).
    fn reads_hold(&self) -> bool {
        false
    }

    /// The accounts whose rows it locks, given its order (and hold) as locked.
    fn accounts_to_lock<'a>(&'a self, rows: Rows<'a>) -> Vec<&'a str>;

    /// Whether its answer, once it is accepted, is known before its write
    /// ([`Accepted::message`] is `Some`). A call with an idempotency key whose answer only the
    /// write makes (entry ids) is never written without row locks, since its record must be
    /// claimed with the write COMPLETED: it goes straight to the locked batch.
    fn answered_before_write(&self) -> bool {
        true
    }

    /// The accounts it names by itself, before any row is read, which a batch of one reads
    /// with its payment and its order ([`read_at_once`]); by default those it locks when
    /// nothing is read.
    fn accounts_named(&self) -> Vec<&str> {
        self.accounts_to_lock(Rows { order: None, hold: None, read: &NOTHING_READ })
    }

    /// The key it finds taken or not once its rows are locked.
    fn key_to_find(&self) -> Option<KeyToFind> {
        None
    }

    /// Its decision in `view` (the rows as the batch's writes before it leave them): accepted,
    /// with what it writes and answers, or its outcome, with nothing of it changed in `view`.
    fn decide(&self, view: &mut View<'_>) -> Result<Box<dyn Accepted>, Outcome>;

    /// Whether the batch's refusal of it runs it alone rather than answering it (default
    /// false).
    fn alone_when_refused(&self) -> bool {
        false
    }
}

/// What a write the batch accepted writes and answers.
pub(in crate::ledger) trait Accepted: Send + Sync {
    /// Its rows and its posting, into the batch's write set.
    fn add_to<'s>(&'s self, set: &mut WriteSet<'s>);

    /// The response message its guards record when claimed, when known before the write;
    /// `None` when only the write makes it (its records are claimed IN_PROGRESS and completed
    /// with [`Accepted::answer`]'s message).
    ///
    /// # Errors
    /// [`Error::Internal`] when the answer cannot be encoded.
    fn message(&self) -> Result<Option<Vec<u8>>, Error>;

    /// The journal entries its answer reads back once written, (posting_id, account_id).
    fn entries_to_read(&self) -> Vec<(&str, &str)> {
        Vec::new()
    }

    /// Its answer once written, from the entries read back (`entries`) and the accounts as read
    /// under their locks (`locked`); and its message when [`Accepted::message`] had none.
    ///
    /// # Errors
    /// [`Error::Internal`] when an entry it wrote is missing.
    fn answer(self: Box<Self>, entries: &mut Entries, locked: &Book) -> Result<(Answer, Option<Vec<u8>>), Error>;

    /// The counter of its kind of write, when group commit batches that kind.
    fn committed(&self) -> Option<Committed> {
        None
    }
}

/// Journal entries read back after the write, by (posting_id, account_id).
pub(in crate::ledger) type Entries = HashMap<(String, String), EntryRow>;

/// The rows a write decides in: the orders and accounts as locked and moved by the writes
/// before it, the payments read before the batch and the keys found taken under the locks.
pub(in crate::ledger) struct View<'v> {
    /// When the batch writes, in microseconds since the epoch.
    pub(in crate::ledger) now: i64,
    /// The clock deadlines are judged by, now that the orders are locked (see
    /// `deadline_clock`).
    pub(in crate::ledger) checked_at: i64,
    /// The accounts as read under their locks and moved by the writes before.
    pub(in crate::ledger) book: Book,
    orders: &'v HashMap<OrderKey, OrderRow>,
    /// The orders the writes before moved, as they leave them.
    moved: BTreeMap<OrderKey, OrderRow>,
    holds: &'v HashMap<OrderKey, HoldRow>,
    read: &'v ReadFirst,
    taken: &'v HashSet<KeyToFind>,
}

impl View<'_> {
    /// The order of (merchant_id, order_no) as locked and moved by the writes before.
    pub(in crate::ledger) fn order(&self, merchant_id: &str, order_no: &str) -> Option<&OrderRow> {
        let key = order_key(merchant_id, order_no);
        self.moved.get(&key).or_else(|| self.orders.get(&key))
    }

    /// Moves a locked order to `order`'s status and refunded_amount, written by the order's
    /// CAS from the state it was locked in.
    pub(in crate::ledger) fn move_order(&mut self, order: OrderRow) {
        self.moved.insert(order_key(&order.merchant_id, &order.order_no), order);
    }

    /// The payment of (merchant_id, out_trade_no), as read before the batch.
    pub(in crate::ledger) fn payment(&self, merchant_id: &str, out_trade_no: &str) -> Option<&PaymentRow> {
        self.read.payment(merchant_id, out_trade_no).map(|(payment, _)| payment)
    }

    /// The hold of the order (merchant_id, order_no), as read under the order's lock (for a
    /// write that reads it, [`BatchWrite::reads_hold`]).
    pub(in crate::ledger) fn hold_of_order(&self, merchant_id: &str, order_no: &str) -> Option<&HoldRow> {
        self.holds.get(&order_key(merchant_id, order_no))
    }

    /// What the writes read before the locks.
    pub(in crate::ledger) fn read_first(&self) -> &ReadFirst {
        self.read
    }

    /// Whether `key` was found taken under the batch's locks.
    pub(in crate::ledger) fn taken(&self, key: &KeyToFind) -> bool {
        self.taken.contains(key)
    }
}

/// A call a group commit can write: its write, and its answer out of the batch's outcome (the
/// outcome back when the batch did not write it); and what a call alone does beyond the
/// batch's steps.
pub(in crate::ledger) trait Batchable: IdempotentCall<Answer: 'static> {
    fn write(&self) -> Box<dyn BatchWrite>;

    fn written(outcome: Outcome) -> Result<Self::Answer, Box<Outcome>> {
        match outcome {
            Outcome::Written(answer, committed) => {
                answer.downcast().map(|answer| *answer).map_err(|answer| Box::new(Outcome::Written(answer, committed)))
            }
            other => Err(Box::new(other)),
        }
    }

    /// Alone, in its transaction before its locks and decision: what it reads there first (a
    /// Refund's payment, a Capture's or Void's hold), or the row it needs created if absent (an
    /// OpenAccount's funding account).
    fn before_alone(
        &self,
        _queries: &mut Queries<'_>,
        _read: &mut ReadFirst,
        _now: i64,
    ) -> impl Future<Output = Result<(), Error>> + Send {
        async { Ok(()) }
    }

    /// Alone, when its decision was [`Outcome::Alone`]: creates the row it lacked (a funding
    /// account's shard); true when it is to be decided again.
    fn create_missing(
        &self,
        _queries: &mut Queries<'_>,
        _now: i64,
    ) -> impl Future<Output = Result<bool, Error>> + Send {
        async { Ok(false) }
    }

    /// Alone, refused for `refusal`: whether its key is taken by another call, waiting for it
    /// if it is in flight (see [`write_alone`]); false when it has no key row to insert.
    fn key_taken_in_flight(
        &self,
        _queries: &mut Queries<'_>,
        _read: &ReadFirst,
        _refusal: &Error,
        _now: i64,
    ) -> impl Future<Output = Result<bool, Error>> + Send {
        async { Ok(false) }
    }
}

/// A write as a batch takes it: the write, and the claim of its guards when it carries an
/// `idempotency-key` or `idempotency-token`.
pub(in crate::ledger) struct Batched {
    pub(in crate::ledger) write: Box<dyn BatchWrite>,
    pub(in crate::ledger) claim: Option<BatchClaim>,
}

/// The group commit's writer: the batch workers' batches of [`Batched`] writes, each written
/// by [`write_together`].
pub(in crate::ledger) struct GroupCommit {
    pub(in crate::ledger) store: Store,
    pub(in crate::ledger) metrics: LedgerMetrics,
    /// The rows a batch may be decided from instead of read (`None`: off).
    known: Option<Known>,
}

impl GroupCommit {
    /// The batch writer of `store`, keeping at most `known_rows` orders and accounts known
    /// (0: none) where a batch may be written without row locks (`unlocked`, on PostgreSQL,
    /// whose write is one statement: [`unlocked_allowed`]), the one place they are used.
    pub(in crate::ledger) fn new(store: Store, metrics: LedgerMetrics, settings: &GroupCommitSettings) -> Self {
        let used = settings.unlocked && store.dialect() == Dialect::Postgres;
        let known = if used { Known::new(settings.known_rows) } else { None };
        Self { store, metrics, known }
    }
}

impl BatchWriter for GroupCommit {
    type Call = Batched;
    type Outcome = Outcome;

    fn route(call: &Batched) -> &str {
        call.write.route()
    }

    async fn write(&self, calls: Vec<Batched>, route_alone: bool) -> Vec<Outcome> {
        write_together(&self.store, &calls, &self.metrics, route_alone, self.known.as_ref()).await
    }

    fn not_started(refusal: Option<Error>) -> Outcome {
        refusal.map_or(Outcome::Alone, Outcome::NotStarted)
    }
}

/// The batch workers of the group commit.
pub(in crate::ledger) type Batcher = batching::Batcher<GroupCommit>;

/// Runs `calls` as one group commit and returns one outcome per call, in order: first one
/// read (no transaction, no locks) finds the payments the writes read, then one transaction
/// writes the rest; or, for a batch of one that no batch in flight shares a route with
/// (`route_alone`), one read of all its rows and one write, without row locks
/// ([`write_one_unlocked`]), which leaves it to the transaction, with what it read, when it
/// cannot write it so. What a committed write leaves is told to `known`.
pub(in crate::ledger) async fn write_together(
    store: &Store,
    calls: &[Batched],
    metrics: &LedgerMetrics,
    route_alone: bool,
    known: Option<&Known>,
) -> Vec<Outcome> {
    let first_read = match calls {
        [one] if route_alone && unlocked_allowed(store, one) => {
            match write_one_unlocked(store, one, metrics, known).await {
                Unlocked::Done(outcome) => {
                    count_committed(std::slice::from_ref(&outcome), metrics);
                    return vec![outcome];
                }
                Unlocked::UnderLocks(read) => Ok((vec![None], read)),
                Unlocked::Unread => read_payments(store, calls).await,
            }
        }
        _ => {
            if let Some(outcomes) = write_several_known(store, calls, metrics, known).await {
                count_committed(&outcomes, metrics);
                return outcomes;
            }
            read_payments(store, calls).await
        }
    };
    let (mut outcomes, read) = match first_read {
        Ok(read) => read,
        Err(error) if no_connection(&error) => return unavailable(calls.len(), &error),
        Err(error) => {
            tracing::debug!(%error, calls = calls.len(), "group commit could not read; every call of it runs alone");
            return alone(calls.len());
        }
    };
    let open: Vec<usize> = (0..calls.len()).filter(|index| outcomes[*index].is_none()).collect();
    let batch: Vec<&Batched> = open.iter().map(|index| &calls[*index]).collect();
    for (index, alone) in open.iter().zip(runs_alone(&batch, &read)) {
        if alone {
            outcomes[*index] = Some(Outcome::Alone);
        }
    }
    let open: Vec<usize> = (0..calls.len()).filter(|index| outcomes[*index].is_none()).collect();
    if open.is_empty() {
        return outcomes.into_iter().map(|outcome| outcome.unwrap_or(Outcome::Alone)).collect();
    }
    let batch: Vec<&Batched> = open.iter().map(|index| &calls[*index]).collect();
    let now = now_micros();
    let mut learned = None;
    let result = in_transaction!(store, metrics, tx => {
        let mut queries = tx.queries();
        write_batch(&mut queries, &batch, &read, now, &mut learned).await
    });
    if let (Ok(Inserted::Done(_)), Some(known), Some(learned)) = (&result, known, learned) {
        known.committed(learned);
    }
    let written: Vec<Outcome> = match result {
        Ok(Inserted::Done(written)) => written
            .into_iter()
            .zip(&batch)
            .map(|(outcome, batched)| match outcome {
                Outcome::Rejected(_) if batched.write.alone_when_refused() => Outcome::Alone,
                outcome => outcome,
            })
            .collect(),
        Ok(Inserted::KeyTaken) => alone(batch.len()),
        // A broken money invariant (see `invariants`) is a bug: the batch was rolled back and
        // its calls are refused, never written again another way.
        Err(Error::InvariantBroken(invariant)) => {
            tracing::error!(invariant, calls = batch.len(), "group commit refused; nothing of it was written");
            batch.iter().map(|_| Outcome::Rejected(Error::InvariantBroken(invariant))).collect()
        }
        Err(error) if no_connection(&error) => unavailable(batch.len(), &error),
        Err(error) => {
            tracing::debug!(%error, calls = batch.len(), "group commit failed; every call of it runs alone");
            alone(batch.len())
        }
    };
    count_committed(&written, metrics);
    for (index, outcome) in open.into_iter().zip(written) {
        outcomes[index] = Some(outcome);
    }
    outcomes.into_iter().map(|outcome| outcome.unwrap_or(Outcome::Alone)).collect()
}

/// A batch of several calls decided from known rows and written in one round trip
/// ([`write_known`]), on a pooled connection of its own, outside any transaction; `None` when
/// it is not (then it is read and written under locks, as before).
async fn write_several_known(
    store: &Store,
    calls: &[Batched],
    metrics: &LedgerMetrics,
    known: Option<&Known>,
) -> Option<Vec<Outcome>> {
    let batch: Vec<&Batched> = calls.iter().collect();
    let known = known.filter(|_| batch.len() > 1)?;
    let prefetched = known_rows(store, &batch, known)?;
    let mut reader = store.reader().await.ok()?;
    let outcomes = write_known(&mut reader.queries(), &batch, &prefetched, metrics, known).await?;
    if matches!(outcomes.first(), Some(Outcome::Written(..))) {
        reader.release();
    }
    Some(outcomes)
}

/// Whether a batch of one may be written without row locks ([`write_one_unlocked`]): on
/// PostgreSQL, a call without a one-time token of either store, and, when it carries an
/// idempotency key, whose answer is known before its write
/// ([`BatchWrite::answered_before_write`]).
fn unlocked_allowed(store: &Store, batched: &Batched) -> bool {
    let claim = batched.claim.as_ref();
    store.dialect() == Dialect::Postgres
        && !claim.is_some_and(BatchClaim::carries_token)
        && (claim.is_none() || batched.write.answered_before_write())
}

/// What [`write_one_unlocked`] leaves to do.
enum Unlocked {
    /// The call's outcome.
    Done(Outcome),
    /// To be written under locks, by a batch's transaction, with what it read first.
    UnderLocks(ReadFirst),
    /// Its first read failed (not for want of a connection): to be read and written as any
    /// batch is.
    Unread,
}

/// A batch of one ([`unlocked_allowed`]) written without row locks, as docs/write-engine.md
/// ("A batch of one on PostgreSQL, without row locks") explains: its rows read in one
/// statement as last committed ([`read_at_once`]), the same decision as in a batch, then its
/// write set sent as one statement that commits itself, every row the decision read guarded
/// by it.
///
/// [`Unlocked::UnderLocks`] when the call is to be written under locks, by the batch's
/// transaction, as before: a call not accepted (its refusal is made under the locks, as every
/// refusal is), a keyed call whose answer only the write makes, a write set of several
/// statements, a row or key moved since the read, or an error after the first read;
/// [`Unlocked::Unread`] when the first read fails. A database error of the write itself may
/// leave its outcome unknown: the call then runs alone, which finds its key taken if it
/// committed ([`Outcome::Alone`]). No connection within the pool's acquire timeout answers it
/// UNAVAILABLE, as the batch would ([`no_connection`]).
async fn write_one_unlocked(
    store: &Store,
    batched: &Batched,
    metrics: &LedgerMetrics,
    known: Option<&Known>,
) -> Unlocked {
    let not_read = |error: Error| {
        if no_connection(&error) {
            return Unlocked::Done(unavailable(1, &error).remove(0));
        }
        if matches!(error, Error::Database(sqlx::Error::Decode(_))) {
            // A row the statement gave that its type does not read: a bug, not a fault.
            tracing::warn!(%error, "a batch of one could not decode its rows; it is read and written under locks");
        } else {
            tracing::debug!(%error, "a batch of one could not read; it is read and written under locks");
        }
        Unlocked::Unread
    };
    let mut reader = match store.reader().await {
        Ok(reader) => reader,
        Err(error) => return not_read(Error::Database(error)),
    };
    let mut queries = reader.queries();
    let from_known = known.and_then(|known| Some((known_rows(store, &[batched], known)?, known)));
    if let Some((prefetched, known)) = from_known {
        if let Some(mut outcomes) = write_known(&mut queries, &[batched], &prefetched, metrics, known).await {
            let outcome = outcomes.remove(0);
            if matches!(outcome, Outcome::Written(..)) {
                reader.release();
            }
            return Unlocked::Done(outcome);
        }
    }
    let (read, prefetched) = match read_at_once(&mut queries, batched).await {
        Ok(read) => read,
        Err(error) => return not_read(error),
    };
    if let Some(known) = known {
        known.read(prefetched.orders.values(), prefetched.accounts.values());
    }
    // The connection is kept warm after a read or write that succeeded; after anything else
    // it goes back through the pool, which checks it (see `Reader::release`).
    if let Some(outcome) = batched.write.decided_before(&read) {
        reader.release();
        return Unlocked::Done(outcome);
    }
    if runs_alone(&[batched], &read).contains(&true) {
        reader.release();
        return Unlocked::Done(Outcome::Alone);
    }
    match write_read(&mut queries, &[batched], &read, &prefetched, known).await {
        Ok(mut one) => match one.remove(0) {
            outcome @ Outcome::Written(..) => {
                reader.release();
                Unlocked::Done(outcome)
            }
            outcome => Unlocked::Done(outcome),
        },
        Err(Unwritten::Missed) => {
            metrics.unlocked_write_misses.inc();
            Unlocked::UnderLocks(read)
        }
        Err(Unwritten::NotSent) => Unlocked::UnderLocks(read),
    }
}

/// The first read of [`write_one_unlocked`]: the payment the call reads first, its key's
/// record, its order and its accounts as far as the call names them before any row is read
/// ([`BatchWrite::order_to_lock`] of nothing read, [`BatchWrite::accounts_named`]), with the
/// orders of the payments found and the accounts of the orders and payments found.
async fn read_at_once(queries: &mut Queries<'_>, batched: &Batched) -> Result<(ReadFirst, Prefetched), Error> {
    let order_keys: Vec<(&str, &str)> = batched.write.order_to_lock(&NOTHING_READ).into_iter().collect();
    let account_ids = batched.write.accounts_named();
    let keys = KeysAtOnce {
        payments: batched.write.payment_to_read().into_iter().collect(),
        orders: order_keys.clone(),
        accounts: account_ids.clone(),
        records: batched.claim.as_ref().map(BatchClaim::keys_to_read).unwrap_or_default(),
    };
    let found = queries.read_at_once(&keys).await?;
    let mut prefetched = Prefetched {
        records: found.records,
        order_keys: order_keys.iter().map(|(merchant_id, order_no)| order_key(merchant_id, order_no)).collect(),
        account_ids: account_ids.iter().map(|account_id| (*account_id).to_owned()).collect(),
        ..Prefetched::default()
    };
    let mut read = ReadFirst::default();
    for (payment, order) in found.payments {
        prefetched.order_keys.insert(order_key(&payment.merchant_id, &payment.order_no));
        prefetched.account_ids.insert(payment.payer_account_id.clone());
        read.add_payment(payment, order);
    }
    for order in found.orders {
        prefetched.account_ids.insert(order.payee_account_id.clone());
        prefetched.orders.insert(order_key(&order.merchant_id, &order.order_no), order);
    }
    prefetched.accounts = found.accounts.into_iter().map(|account| (account.account_id.clone(), account)).collect();
    Ok((read, prefetched))
}

/// The rows [`read_at_once`] read, and every key it looked up, found or not: a write whose
/// rows are all among those is decided from them, without reading them again.
#[derive(Default)]
struct Prefetched {
    /// The committed records of the call's [`BatchClaim::keys_to_read`].
    records: Vec<IdempotencyRecordRow>,
    orders: HashMap<OrderKey, OrderRow>,
    order_keys: HashSet<OrderKey>,
    accounts: HashMap<String, AccountRow>,
    account_ids: HashSet<String>,
}

/// The rows `known` holds for a batch to be decided from instead of read: every call's order
/// and the accounts each then locks; `None` when one is not known, their score says not to
/// try ([`Known::try_now`]), or a call is not one a write from known rows takes. Only a call
/// written without row locks at all ([`unlocked_allowed`]) that names its order before reading
/// anything, with no key to find under the locks and no hold to read, and shares no key with
/// another of the batch ([`runs_alone`]), is: its payment to read and its idempotency key's
/// record are taken as not found, which the write's unique indexes guard (a Pay inserts its
/// out_trade_no, a keyed call claims its key).
fn known_rows(store: &Store, batch: &[&Batched], known: &Known) -> Option<Prefetched> {
    let order_of = |batched: &Batched| {
        batched.write.order_to_lock(&NOTHING_READ).map(|(merchant_id, order_no)| order_key(merchant_id, order_no))
    };
    let writes_known = |batched: &&Batched| {
        let write = batched.write.as_ref();
        unlocked_allowed(store, batched)
            && !write.reads_hold()
            && write.key_to_find().is_none()
            && order_of(batched).is_some()
    };
    if !batch.iter().all(writes_known) || runs_alone(batch, &NOTHING_READ).contains(&true) || !known.try_now() {
        return None;
    }
    let keys: Vec<OrderKey> = batch.iter().filter_map(|batched| order_of(batched)).collect();
    let accounts_of = |order: &OrderRow| -> Vec<String> {
        let key = Some(order_key(&order.merchant_id, &order.order_no));
        let rows = || Rows { order: Some(order), hold: None, read: &NOTHING_READ };
        let writes = batch.iter().filter(|batched| order_of(batched) == key);
        writes.flat_map(|batched| batched.write.accounts_to_lock(rows()).into_iter().map(str::to_owned)).collect()
    };
    let (orders, accounts) = known.rows(&keys, accounts_of)?;
    Some(Prefetched {
        records: Vec::new(),
        order_keys: keys.iter().cloned().collect(),
        orders: keys.into_iter().zip(orders).collect(),
        account_ids: accounts.iter().map(|account| account.account_id.clone()).collect(),
        accounts: accounts.into_iter().map(|account| (account.account_id.clone(), account)).collect(),
    })
}

/// A batch decided from the rows `known` holds ([`known_rows`]) and written as [`write_read`]
/// writes it, one statement, without reading: each call's outcome once written, or once the
/// write failed with its outcome unknown (`Alone`); `None` when the write missed (a row moved,
/// a key taken: nothing of it was written; counted, and weighed by [`Known::missed`]) or was
/// not sent (the decision did not accept every call, or its write set is not one statement: no
/// round trip was spent): the batch is then read and written as before.
async fn write_known(
    queries: &mut Queries<'_>,
    batch: &[&Batched],
    prefetched: &Prefetched,
    metrics: &LedgerMetrics,
    known: &Known,
) -> Option<Vec<Outcome>> {
    let outcomes = write_read(queries, batch, &NOTHING_READ, prefetched, Some(known)).await;
    match outcomes.as_deref() {
        Ok([Outcome::Written(..), ..]) => {
            known.hit();
            metrics.known_row_writes.inc();
        }
        Ok(_) | Err(Unwritten::NotSent) => {}
        Err(Unwritten::Missed) => {
            known.missed();
            metrics.known_row_misses.inc();
        }
    }
    outcomes.ok()
}

/// Why [`write_read`] did not write a batch, which is then written under locks.
enum Unwritten {
    /// A row it read moved or a key was taken: its one statement wrote nothing.
    Missed,
    /// Not every call was accepted, or the write set is not one statement, or a read it needed
    /// failed: nothing was sent.
    NotSent,
}

/// The rest of [`write_one_unlocked`] once its rows are read, and of [`write_known`]: the
/// batch decided from `prefetched` and written by one statement that commits itself, or why
/// not (then it is written under locks: a call not accepted, a write set of several
/// statements, a row moved or a key taken). What a committed one leaves is told to `known`.
async fn write_read(
    queries: &mut Queries<'_>,
    batch: &[&Batched],
    read: &ReadFirst,
    prefetched: &Prefetched,
    known: Option<&Known>,
) -> Result<Vec<Outcome>, Unwritten> {
    let now = now_micros();
    let claims: Vec<Option<&BatchClaim>> = batch.iter().map(|batched| batched.claim.as_ref()).collect();
    let outcomes = batch.iter().map(|_| None).collect();
    let mut deciding = Deciding { batch, claims, read, now, outcomes };
    deciding.read_guards(queries, Some(&prefetched.records)).await.map_err(|_| Unwritten::NotSent)?;
    if deciding.undecided().is_empty() {
        // Answered by their keys' committed records, as the locked batch's same read would.
        return Ok(deciding.into_outcomes());
    }
    let locked = deciding.lock(queries, RowLocks::None, Some(prefetched)).await.map_err(|_| Unwritten::NotSent)?;
    let Applied { book, moved, accepted, refused } = deciding.apply(&locked);
    if !refused.is_empty() || accepted.is_empty() {
        return Err(Unwritten::NotSent);
    }
    let mut set = write_set(&accepted, &locked.orders, &moved);
    for (index, accepted_one) in &accepted {
        if let Some(claim) = deciding.claims[*index] {
            let Ok(Some(message)) = accepted_one.message() else { return Err(Unwritten::NotSent) };
            set.records.extend(claim.completed_records(&message));
        }
    }
    if !set.one_statement() {
        return Err(Unwritten::NotSent);
    }
    let all = |outcome: fn() -> Outcome| Ok(batch.iter().map(|_| outcome()).collect());
    let new_orders = known.map(|_| set.orders.clone()).unwrap_or_default();
    match book::write(queries, &set, &book, now).await {
        Ok(Some(accounts)) => {
            if let Some(known) = known {
                let forget = prefetched.order_keys.iter().cloned().collect();
                known.committed(Learned { accounts, orders: new_orders, forget });
            }
        }
        Ok(None) => return Err(Unwritten::Missed),
        Err(Error::InvariantBroken(invariant)) => {
            tracing::error!(invariant, calls = batch.len(), "a write refused; nothing of it was written");
            return Ok(batch.iter().map(|_| Outcome::Rejected(Error::InvariantBroken(invariant))).collect());
        }
        Err(error) => {
            tracing::debug!(%error, calls = batch.len(), "a write without row locks failed; its calls run alone");
            return all(|| Outcome::Alone);
        }
    }
    drop(set);
    // Committed: what follows reads what it wrote, which no one changes. Its records were
    // claimed COMPLETED, so its answers complete none.
    let answered = async {
        let mut entries = entries_read_back(queries, &accepted).await?;
        deciding.answer(accepted, &mut entries, &locked.book)
    };
    match answered.await {
        Ok(completions) if completions.is_empty() => Ok(deciding.into_outcomes()),
        Ok(_) => {
            // Only calls whose answers were known before the write come here, and their records
            // were claimed COMPLETED: an answer to store after it would be lost. The committed
            // write is answered from its records, replays.
            tracing::error!("a write without row locks left an answer to store; its calls are answered as replays");
            all(|| Outcome::Alone)
        }
        Err(error) => {
            tracing::debug!(%error, "a committed write could not be answered; its calls run alone, replays");
            all(|| Outcome::Alone)
        }
    }
}

/// The committed batch's counters: the batch, its size, and each kind of write.
fn count_committed(written: &[Outcome], metrics: &LedgerMetrics) {
    let mut committed = 0_u64;
    for outcome in written {
        if let Outcome::Written(_, counter) = outcome {
            if let Some(counter) = counter {
                counter(metrics).inc();
            }
            committed += 1;
        }
    }
    if committed > 0 {
        metrics.group_commits.inc();
        metrics.group_commit_batch.observe(committed as f64);
    }
}

/// One call written in a transaction of its own, the idempotency driver's (which claims and
/// completes the call's guards around it): the batch's steps for a batch of one, so a call
/// written alone is decided by the same rules, locks and statements as one written with others.
/// What only a call alone does ([`Batchable`]): the payments it reads in its transaction (a
/// Refund's: payments never change; none is PAYMENT_NOT_FOUND); the row it lacked created (a
/// funding account's shard) and the call decided again; a refused call inserts its key before
/// it answers the refusal ([`Batchable::key_taken_in_flight`]), so that another call holding
/// that key, still in flight (a server of an earlier release inserted its key before its locks,
/// or the key is used on other rows), is waited for and answers it.
/// `KeyTaken` when a key of the call (its out_trade_no, the order's one payment, its
/// out_refund_no, its order, its request_id) was committed by another: the driver then answers
/// the committed original.
///
/// # Errors
/// The call's rejection; [`Error::InvariantBroken`] (nothing written); [`Error::Database`].
pub(in crate::ledger) async fn write_alone<C: Batchable>(
    call: &C,
    queries: &mut Queries<'_>,
    now: i64,
) -> Result<Inserted<C::Answer>, Error> {
    let batched = Batched { write: call.write(), claim: None };
    let mut read = ReadFirst::default();
    call.before_alone(queries, &mut read, now).await?;
    let mut outcome = decide_alone(queries, &batched, &read, now).await?;
    if matches!(outcome, Some(Outcome::Alone)) && call.create_missing(queries, now).await? {
        outcome = decide_alone(queries, &batched, &read, now).await?;
    }
    let Some(outcome) = outcome else { return Ok(Inserted::KeyTaken) };
    let outcome = match C::written(outcome) {
        Ok(answer) => return Ok(Inserted::Done(answer)),
        Err(outcome) => *outcome,
    };
    match outcome {
        Outcome::Found(_) | Outcome::TakenBefore => Ok(Inserted::KeyTaken),
        Outcome::Rejected(error) => {
            if call.key_taken_in_flight(queries, &read, &error, now).await? {
                return Ok(Inserted::KeyTaken);
            }
            Err(error)
        }
        // A call alone has no guard of its own in the batch, and nothing else of one call's
        // batch hands it on.
        Outcome::Alone
        | Outcome::GuardTaken
        | Outcome::GuardAnswered(_)
        | Outcome::NotStarted(_)
        | Outcome::Written(..) => Err(Error::Internal(format!("a {} written alone was left undecided", C::METHOD))),
    }
}

/// The outcome of a batch of one, `None` when a key of it was found taken as it wrote.
async fn decide_alone(
    queries: &mut Queries<'_>,
    batched: &Batched,
    read: &ReadFirst,
    now: i64,
) -> Result<Option<Outcome>, Error> {
    // Its transaction is committed by the idempotency driver: what it leaves is not known.
    Ok(match write_batch(queries, &[batched], read, now, &mut None).await? {
        Inserted::Done(mut outcomes) => Some(outcomes.pop().expect("one outcome a call")),
        Inserted::KeyTaken => None,
    })
}

/// The read before the batch, one statement for every payment its writes read; the outcome
/// of each write those payments decide.
async fn read_payments(store: &Store, calls: &[Batched]) -> Result<(Vec<Option<Outcome>>, ReadFirst), Error> {
    let keys: BTreeSet<(&str, &str)> = calls.iter().filter_map(|batched| batched.write.payment_to_read()).collect();
    let keys: Vec<(&str, &str)> = keys.into_iter().collect();
    if keys.is_empty() {
        return Ok((calls.iter().map(|_| None).collect(), ReadFirst::default()));
    }
    let mut reader = store.reader().await?;
    let mut found = ReadFirst::default();
    for (payment, order) in reader.queries().find_payments_and_orders(&keys).await? {
        found.add_payment(payment, order);
    }
    reader.release();
    let outcomes = calls.iter().map(|batched| batched.write.decided_before(&found)).collect();
    Ok((outcomes, found))
}

/// Whether the batch found no connection within the pool's acquire timeout (the database is
/// down or unreachable, or the pool closed; on SQLite also no turn at its one write lock within
/// `--lock-timeout-ms`): then no transaction of it began, and each call alone would wait as
/// long again, so each is answered UNAVAILABLE now, within the bound
/// (`--pool-acquire-timeout-ms`) a call that is not batched keeps too. A call the batch had
/// set to run alone after it ([`runs_alone`]) still does, with its own wait.
fn no_connection(error: &Error) -> bool {
    matches!(error, Error::Database(sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed))
}

/// Every call of a batch that found no connection ([`no_connection`]): not started, nothing of
/// it written, UNAVAILABLE (DATABASE_UNAVAILABLE).
fn unavailable(count: usize, error: &Error) -> Vec<Outcome> {
    tracing::debug!(%error, calls = count, "group commit found no connection; every call of it is unavailable");
    let refusal = || match error {
        Error::Database(sqlx::Error::PoolClosed) => sqlx::Error::PoolClosed,
        _ => sqlx::Error::PoolTimedOut,
    };
    (0..count).map(|_| Outcome::NotStarted(Error::Database(refusal()))).collect()
}

fn alone(count: usize) -> Vec<Outcome> {
    (0..count).map(|_| Outcome::Alone).collect()
}

/// The writes of `batch` that run alone after it, known before any lock: one that says so
/// ([`BatchWrite::batch_keys`]), one holding a key an earlier write holds (unless both hold it
/// shared: Refunds of one order are applied one after another to its state in memory), and a
/// second call with one idempotency key or token (alone after the batch, it is answered by the
/// first one's record or, when the first was refused, runs afresh). Every key of a write is
/// noted, even of one that runs alone.
fn runs_alone(batch: &[&Batched], read: &ReadFirst) -> Vec<bool> {
    let mut held: HashMap<(&'static str, String, String), bool> = HashMap::new();
    let mut guards_seen = HashSet::new();
    batch
        .iter()
        .map(|batched| {
            let mut alone = false;
            match batched.write.batch_keys(read) {
                None => alone = true,
                Some(keys) => {
                    for key in keys {
                        match held.get_mut(&key.of) {
                            Some(shared) => {
                                alone |= !(*shared && key.shared);
                                *shared &= key.shared;
                            }
                            None => {
                                held.insert(key.of, key.shared);
                            }
                        }
                    }
                }
            }
            if let Some(claim) = &batched.claim {
                let seen: Vec<bool> = claim.keys().map(|key| !guards_seen.insert(key)).collect();
                alone |= seen.contains(&true);
            }
            alone
        })
        .collect()
}

/// The batch's writes (none of them one [`runs_alone`] names), in the steps of the module doc.
/// `Inserted::KeyTaken` means "roll back, every call runs alone".
/// `learned`: what the batch leaves, to be known once its transaction commits.
async fn write_batch(
    queries: &mut Queries<'_>,
    batch: &[&Batched],
    read: &ReadFirst,
    now: i64,
    learned: &mut Option<Learned>,
) -> Result<Inserted<Vec<Outcome>>, Error> {
    // Of this run of the transaction only: an earlier run's write was rolled back.
    *learned = None;
    let mut deciding = Deciding {
        batch,
        claims: batch.iter().map(|batched| batched.claim.as_ref()).collect(),
        read,
        now,
        outcomes: batch.iter().map(|_| None).collect(),
    };
    deciding.read_guards(queries, None).await?;
    if deciding.undecided().is_empty() {
        return Ok(Inserted::Done(deciding.into_outcomes()));
    }
    let locked = deciding.lock(queries, RowLocks::Taken, None).await?;
    let mut claimed: HashSet<usize> = HashSet::new();
    // Until a claim of several found a key taken (see `claim_prefix_together`).
    let mut claim_together = true;
    let (moved_orders, book_after, accepted) = loop {
        let applied = deciding.apply(&locked);
        if claim_together {
            claim_together = claim_prefix_together(queries, &deciding.claims, &applied.accepted, &mut claimed).await?;
        }
        if !deciding.claim_guards(queries, &applied.accepted, &mut claimed).await? {
            let Applied { book, moved, accepted, refused } = applied;
            deciding.refuse(refused);
            break (moved, book, accepted);
        }
        // A claimed write refused on the next pass would need its claim undone in the middle
        // of the batch (it cannot be: it came before the one taken out): the batch would roll
        // back instead, and every call of it run alone.
        if applied.refused.iter().any(|(index, _)| claimed.contains(index)) {
            return Ok(Inserted::KeyTaken);
        }
    };
    if !accepted.is_empty() {
        let Some(written) = write_accepted(queries, &accepted, &locked.orders, &moved_orders, &book_after, now).await?
        else {
            return Ok(Inserted::KeyTaken);
        };
        *learned = Some(written);
    }
    let mut entries = entries_read_back(queries, &accepted).await?;
    let completions = deciding.answer(accepted, &mut entries, &locked.book)?;
    let completions: Vec<_> = completions.into_iter().map(|(claim, message)| claim.completion(message)).collect();
    complete_claims(queries, &completions).await?;
    Ok(Inserted::Done(deciding.into_outcomes()))
}

/// One batch's writes as its transaction decides them: each write's outcome once it has one.
struct Deciding<'b> {
    batch: &'b [&'b Batched],
    /// Each call's guards, when it carries an `idempotency-key` or `idempotency-token`.
    claims: Vec<Option<&'b BatchClaim>>,
    /// What the writes read before the locks.
    read: &'b ReadFirst,
    /// When the batch writes, in microseconds since the epoch.
    now: i64,
    outcomes: Vec<Option<Outcome>>,
}

/// The rows a batch locked and the keys it found taken under those locks.
struct Locked {
    orders: HashMap<OrderKey, OrderRow>,
    /// The holds of the locked orders, read under their locks, by order.
    holds: HashMap<OrderKey, HoldRow>,
    book: Book,
    taken: HashSet<KeyToFind>,
    /// Deadlines are judged now that the orders are locked (see `deadline_clock`).
    checked_at: i64,
}

/// The writes of a batch decided in arrival order (one pass of step 2).
struct Applied {
    /// The accounts as the accepted writes leave them.
    book: Book,
    /// The orders the accepted writes moved, as they leave them.
    moved: BTreeMap<OrderKey, OrderRow>,
    accepted: Vec<(usize, Box<dyn Accepted>)>,
    /// The writes not accepted, and their outcomes.
    refused: Vec<(usize, Outcome)>,
}

impl<'b> Deciding<'b> {
    /// Every write's outcome; a write the batch could not decide runs alone.
    fn into_outcomes(self) -> Vec<Outcome> {
        self.outcomes.into_iter().map(|outcome| outcome.unwrap_or(Outcome::Alone)).collect()
    }

    /// The writes not decided yet, in arrival order.
    fn undecided(&self) -> Vec<usize> {
        (0..self.batch.len()).filter(|index| self.outcomes[*index].is_none()).collect()
    }

    /// 0. The committed records of the guards that the calls did not read before they queued
    ///    (an idempotency key alone), in one read: a record that answers a call takes it out
    ///    with nothing of it written, answered by that record after the batch. A record
    ///    committed after this read is found by the claim (3). `read`: those records, read
    ///    already.
    async fn read_guards(
        &mut self,
        queries: &mut Queries<'_>,
        read: Option<&[IdempotencyRecordRow]>,
    ) -> Result<(), Error> {
        let keys_to_read: Vec<(&str, &str)> =
            self.claims.iter().flatten().flat_map(|claim| claim.keys_to_read()).collect();
        if keys_to_read.is_empty() {
            return Ok(());
        }
        let fetched;
        let found: &[IdempotencyRecordRow] = match read {
            Some(read) => read,
            None => {
                fetched = queries.find_answered_records(&keys_to_read).await?;
                &fetched
            }
        };
        for (outcome, claim) in self.outcomes.iter_mut().zip(&self.claims) {
            if let Some(record) = claim.and_then(|claim| claim.answering_record(found, self.now)) {
                *outcome = Some(Outcome::GuardAnswered(Box::new(record)));
            }
        }
        Ok(())
    }

    /// 1. The orders the undecided writes name, locked (one `SELECT ... FOR UPDATE`, in key
    ///    order), and the holds of those whose writes read them (one read an order); then
    ///    their accounts (one `SELECT ... FOR UPDATE`, in account_id order); then the keys they
    ///    find taken or not under those locks (one read a kind of key): a refund's
    ///    out_refund_no under its order's lock (every Refund locks its order before it
    ///    inserts), a request_id under its funding account's (every call of a request_id moves
    ///    that account).
    ///
    /// Why two lock statements, not one: `docs/decisions/008-two-lock-statements.md`.
    ///
    /// Rows `prefetched` looked up (found or not) are taken from it instead of read again.
    async fn lock(
        &self,
        queries: &mut Queries<'_>,
        locks: RowLocks,
        prefetched: Option<&Prefetched>,
    ) -> Result<Locked, Error> {
        let undecided = self.undecided();
        let writes = || undecided.iter().map(|index| &self.batch[*index].write);
        let order_keys: BTreeSet<(&str, &str)> = writes().filter_map(|write| write.order_to_lock(self.read)).collect();
        let order_keys: Vec<OrderKey> =
            order_keys.into_iter().map(|(merchant_id, order_no)| order_key(merchant_id, order_no)).collect();
        let orders: HashMap<OrderKey, OrderRow> = match prefetched
            .filter(|prefetched| order_keys.iter().all(|key| prefetched.order_keys.contains(key)))
        {
            Some(prefetched) => order_keys
                .into_iter()
                .filter_map(|key| prefetched.orders.get(&key).map(|order| (key, order.clone())))
                .collect(),
            None if order_keys.is_empty() => HashMap::new(),
            None => {
                let keys: Vec<(&str, &str)> = order_keys.iter().map(|(first, second)| (&**first, &**second)).collect();
                let rows = queries.lock_orders(&keys, locks).await?;
                rows.into_iter().map(|order| (order_key(&order.merchant_id, &order.order_no), order)).collect()
            }
        };
        let checked_at = deadline_clock(self.now);
        let hold_keys: BTreeSet<(&str, &str)> = writes()
            .filter(|write| write.reads_hold())
            .filter_map(|write| write.order_to_lock(self.read))
            .filter(|(merchant_id, order_no)| orders.contains_key(&order_key(merchant_id, order_no)))
            .collect();
        let mut holds = HashMap::new();
        for (merchant_id, order_no) in hold_keys {
            if let Some(hold) = queries.find_hold_of_order(merchant_id, order_no).await? {
                holds.insert(order_key(merchant_id, order_no), hold);
            }
        }
        let account_ids: BTreeSet<&str> = writes()
            .flat_map(|write| {
                let key =
                    write.order_to_lock(self.read).map(|(merchant_id, order_no)| order_key(merchant_id, order_no));
                let order = key.as_ref().and_then(|key| orders.get(key));
                let hold = key.as_ref().and_then(|key| holds.get(key));
                write.accounts_to_lock(Rows { order, hold, read: self.read })
            })
            .collect();
        let account_ids: Vec<&str> = account_ids.into_iter().collect();
        let book =
            match prefetched.filter(|prefetched| account_ids.iter().all(|id| prefetched.account_ids.contains(*id))) {
                Some(prefetched) => {
                    Book::locked(account_ids.iter().filter_map(|id| prefetched.accounts.get(*id).cloned()).collect())
                }
                None if account_ids.is_empty() => Book::default(),
                None => Book::locked(queries.lock_accounts(&account_ids, locks).await?),
            };
        let keys: Vec<KeyToFind> = writes().filter_map(|write| write.key_to_find()).collect();
        let taken = find_taken(queries, &keys).await?;
        Ok(Locked { orders, holds, book, taken, checked_at })
    }

    /// 2. The writes not decided yet, decided one after another in arrival order, in memory,
    ///    each in a view of the rows (as read under their locks) as the ones before it leave
    ///    them.
    fn apply(&self, locked: &Locked) -> Applied {
        let mut view = View {
            now: self.now,
            checked_at: locked.checked_at,
            book: locked.book.clone(),
            orders: &locked.orders,
            moved: BTreeMap::new(),
            holds: &locked.holds,
            read: self.read,
            taken: &locked.taken,
        };
        let (mut accepted, mut refused) = (Vec::new(), Vec::new());
        for index in self.undecided() {
            match self.batch[index].write.decide(&mut view) {
                Ok(accepted_one) => accepted.push((index, accepted_one)),
                Err(outcome) => refused.push((index, outcome)),
            }
        }
        Applied { book: view.book, moved: view.moved, accepted, refused }
    }

    /// 3. Each accepted write's guards, claimed in arrival order, their records written with
    ///    the answer the write gets if the batch commits. A guard found taken, or a token found
    ///    invalid, takes that write out of the batch with nothing of it written (true: decide
    ///    the writes again without it, as one it paid into may now lack funds, one it spent
    ///    from may now have them, a refund after it may now fit its order). The writes before
    ///    it, claimed already, keep their outcome (each is decided after the ones before it
    ///    only).
    async fn claim_guards(
        &mut self,
        queries: &mut Queries<'_>,
        accepted: &[(usize, Box<dyn Accepted>)],
        claimed: &mut HashSet<usize>,
    ) -> Result<bool, Error> {
        for (index, accepted_one) in accepted {
            let Some(claim) = self.claims[*index].filter(|_| !claimed.contains(index)) else { continue };
            let records = records_to_claim(claim, accepted_one.as_ref())?;
            match claim.claim(queries, &records, self.now).await {
                Ok(true) => {
                    claimed.insert(*index);
                    continue;
                }
                Ok(false) => self.outcomes[*index] = Some(Outcome::GuardTaken),
                Err(error @ Error::Rejected(_)) => self.outcomes[*index] = Some(Outcome::Rejected(error)),
                Err(error) => return Err(error),
            }
            return Ok(true);
        }
        Ok(false)
    }

    /// The outcomes of the writes the final pass did not accept: nothing of them is written.
    fn refuse(&mut self, refused: Vec<(usize, Outcome)>) {
        for (index, outcome) in refused {
            self.outcomes[index] = Some(outcome);
        }
    }

    /// 5. Each accepted write's answer, once written. Returns the claims to complete with the
    ///    messages of the answers known only now (their records were claimed IN_PROGRESS).
    fn answer(
        &mut self,
        accepted: Vec<(usize, Box<dyn Accepted>)>,
        entries: &mut Entries,
        locked: &Book,
    ) -> Result<Vec<(&'b BatchClaim, Vec<u8>)>, Error> {
        let mut completions = Vec::new();
        for (index, accepted_one) in accepted {
            let committed = accepted_one.committed();
            let (answer, message) = accepted_one.answer(entries, locked)?;
            if let (Some(claim), Some(message)) = (self.claims[index], message) {
                completions.push((claim, message));
            }
            self.outcomes[index] = Some(Outcome::Written(answer, committed));
        }
        Ok(completions)
    }
}

/// The keys of `keys` found taken: the refunds' out_refund_nos in one read, the request_ids of
/// deposits and withdrawals in another.
async fn find_taken(queries: &mut Queries<'_>, keys: &[KeyToFind]) -> Result<HashSet<KeyToFind>, Error> {
    let mut taken = HashSet::new();
    let refunds: Vec<(&str, &str)> = keys
        .iter()
        .filter_map(|key| match key {
            KeyToFind::Refund(merchant_id, out_refund_no) => Some((merchant_id.as_str(), out_refund_no.as_str())),
            KeyToFind::Funding(..) => None,
        })
        .collect();
    if !refunds.is_empty() {
        let found = queries.find_refunds(&refunds).await?;
        taken.extend(found.into_iter().map(|row| KeyToFind::Refund(row.merchant_id, row.out_refund_no)));
    }
    let request_ids = |table: FundingTable| -> Vec<&str> {
        keys.iter()
            .filter_map(|key| match key {
                KeyToFind::Funding(of, request_id) if *of == table => Some(request_id.as_str()),
                KeyToFind::Funding(..) | KeyToFind::Refund(..) => None,
            })
            .collect()
    };
    let (deposits, withdrawals) = (request_ids(FundingTable::Deposits), request_ids(FundingTable::Withdrawals));
    if !deposits.is_empty() || !withdrawals.is_empty() {
        let found = queries.find_fundings(&deposits, &withdrawals).await?;
        taken.extend(found.into_iter().map(|(table, request_id)| KeyToFind::Funding(table, request_id)));
    }
    Ok(taken)
}

/// The records an accepted write's guards claim: COMPLETED with its answer when known before
/// the write, IN_PROGRESS otherwise (completed once the write makes its answer).
fn records_to_claim(claim: &BatchClaim, accepted: &dyn Accepted) -> Result<Vec<IdempotencyRecordRow>, Error> {
    Ok(match accepted.message()? {
        Some(message) => claim.completed_records(&message),
        None => claim.in_progress_records().to_vec(),
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
    accepted: &[(usize, Box<dyn Accepted>)],
    claimed: &mut HashSet<usize>,
) -> Result<bool, Error> {
    let mut together: Vec<(usize, Vec<IdempotencyRecordRow>)> = Vec::new();
    for (index, accepted_one) in accepted {
        let Some(claim) = claims[*index].filter(|_| !claimed.contains(index)) else { continue };
        if claim.consumes_token() {
            break;
        }
        together.push((*index, records_to_claim(claim, accepted_one.as_ref())?));
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

/// The journal entries the accepted writes read back, by (posting_id, account_id): one read,
/// none without them.
async fn entries_read_back(
    queries: &mut Queries<'_>,
    accepted: &[(usize, Box<dyn Accepted>)],
) -> Result<Entries, Error> {
    let legs: Vec<(&str, &str)> =
        accepted.iter().flat_map(|(_, accepted_one)| accepted_one.entries_to_read()).collect();
    if legs.is_empty() {
        return Ok(Entries::new());
    }
    let entries = queries.find_entries(&legs).await?;
    Ok(entries.into_iter().map(|entry| ((entry.posting_id.clone(), entry.account_id.clone()), entry)).collect())
}

/// Step 4: the write set of the accepted writes ([`write_set`]), written by [`book::write`]:
/// `None` when a key, an order's state or a version was taken under the batch (roll back);
/// otherwise what it leaves, to be known once the batch commits (the orders it locked
/// forgotten).
async fn write_accepted(
    queries: &mut Queries<'_>,
    accepted: &[(usize, Box<dyn Accepted>)],
    orders: &HashMap<OrderKey, OrderRow>,
    moved: &BTreeMap<OrderKey, OrderRow>,
    book: &Book,
    now: i64,
) -> Result<Option<Learned>, Error> {
    let set = write_set(accepted, orders, moved);
    let Some(accounts) = book::write(queries, &set, book, now).await? else { return Ok(None) };
    Ok(Some(Learned { accounts, orders: set.orders, forget: orders.keys().cloned().collect() }))
}

/// The write set of the accepted writes: each row in its table and each posting in the order
/// the batch applied it, and each order moved by its CAS from the state it was read in.
fn write_set<'s>(
    accepted: &'s [(usize, Box<dyn Accepted>)],
    orders: &'s HashMap<OrderKey, OrderRow>,
    moved: &'s BTreeMap<OrderKey, OrderRow>,
) -> WriteSet<'s> {
    let mut set = WriteSet::default();
    for (_, accepted_one) in accepted {
        accepted_one.add_to(&mut set);
    }
    set.refunded_orders = moved
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
    set
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A write that holds `keys` in its batch (`None`: it runs alone) and decides nothing.
    struct Holding(Option<Vec<BatchKey>>);

    impl BatchWrite for Holding {
        fn route(&self) -> &str {
            "route"
        }

        fn batch_keys(&self, _read: &ReadFirst) -> Option<Vec<BatchKey>> {
            self.0.clone()
        }

        fn accounts_to_lock<'a>(&'a self, _rows: Rows<'a>) -> Vec<&'a str> {
            Vec::new()
        }

        fn decide(&self, _view: &mut View<'_>) -> Result<Box<dyn Accepted>, Outcome> {
            Err(Outcome::Alone)
        }
    }

    fn holding(keys: Option<Vec<BatchKey>>) -> Batched {
        Batched { write: Box::new(Holding(keys)), claim: None }
    }

    #[test]
    fn a_later_write_holding_a_key_an_earlier_one_holds_runs_alone_unless_both_share_it() {
        let calls = [
            holding(Some(vec![BatchKey::sole("order", "m", "o-1")])),
            // o-1 is held by the write before, not shared: alone.
            holding(Some(vec![BatchKey::shared("order", "m", "o-1")])),
            holding(Some(vec![BatchKey::shared("order", "m", "o-2")])),
            // Shared by both: in the batch, after the one before.
            holding(Some(vec![BatchKey::shared("order", "m", "o-2"), BatchKey::sole("out_refund_no", "m", "r-1")])),
            // o-2 shared before, held alone now; r-1 held before: alone.
            holding(Some(vec![BatchKey::sole("order", "m", "o-2")])),
            holding(Some(vec![BatchKey::sole("out_refund_no", "m", "r-1")])),
            // Another merchant's key of the same name is another key.
            holding(Some(vec![BatchKey::sole("out_refund_no", "n", "r-1")])),
            // It says so.
            holding(None),
            holding(Some(Vec::new())),
        ];
        let batch: Vec<&Batched> = calls.iter().collect();

        let alone = runs_alone(&batch, &ReadFirst::default());

        assert_eq!(alone, [false, true, false, false, true, true, false, true, false]);
    }
}
