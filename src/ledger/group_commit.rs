//! Group commit of Pays: Pays that arrive while the database is busy are written together,
//! in one transaction, with one statement per kind of row instead of one per Pay:
//!
//! 1. lock every order of the batch (one `SELECT ... FOR UPDATE`, in key order) and check each
//!    Pay against its order ([`check_pay`]: terms and state machine);
//! 2. lock every account the batch touches (one `SELECT ... FOR UPDATE`, in account_id order)
//!    and apply the Pays one after another in arrival order, in memory, with the same leg rules
//!    as a single posting ([`balance_after`]); a Pay that breaks a rule is rejected alone and
//!    changes nothing;
//! 3. write what the accepted Pays did: one multi-row INSERT of payments, one conditional
//!    UPDATE of the orders (`WHERE status = 'PENDING'`), one version CAS per account (all in
//!    one UPDATE; an account paid N times in the batch moves N versions at once), one
//!    multi-row INSERT of journal entries (two legs per Pay, in order, so every entry records
//!    the balance and version right after it), then one COMMIT.
//!
//! Each Pay keeps its own outcome: a rejection is that Pay's answer only, a replay stays a
//! replay. Whatever the batch cannot decide on its own (a second Pay of the same order or
//! out_trade_no in one batch, a key taken under it by a concurrent writer, any database error
//! that is not a transient conflict) makes those Pays, or the whole batch after a rollback, run
//! alone through the ordinary one-Pay transaction, which is idempotent by out_trade_no: a Pay
//! whose batch did commit after all is then answered as a replay.
//!
//! Batching is natural (no timer): a worker takes whatever has queued up, up to a maximum,
//! while the workers before it are busy; under light load a batch holds one Pay.
//!
//! Pays with an `idempotency-key` or `idempotency-token` (guarded) are batched too. Each goes
//! through the idempotency driver's steps before the batch on its own (a committed record
//! answers it; a token's owner is checked), and the batch does step 4 for all of them in its
//! one transaction: once the accepted Pays are known (after 2), it claims each accepted
//! Pay's records in arrival order, inserting them already COMPLETED with the response that Pay
//! gets if the batch commits (one statement a record; a token with the database store is
//! consumed there too, under a savepoint, so a claim that fails part way leaves nothing). A
//! guard found taken (its original committed, or was in flight, under the batch) or a token
//! found invalid takes that Pay out with nothing of it written, and the Pays after it are
//! applied again without it; the Pay is then answered as the driver answers a key taken: the
//! original's stored response, or ALREADY_EXISTS. Two Pays of one batch with one key or token:
//! the second runs alone after it (a replay of the first's record, or, when the first was
//! refused, afresh).
//!
//! Each worker's queue is bounded ([`GroupCommitSettings::queue_max`]): a Pay that finds it
//! full is refused RESOURCE_EXHAUSTED (OVERLOADED) before anything is read or written. A
//! queued Pay whose caller has gone (cancelled, or past its deadline) when its batch is
//! formed is dropped unstarted; one already in a batch completes with it.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use opentelemetry::trace::TraceContextExt as _;
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use crate::error::{Error, Resource};
use crate::store::{AccountRow, BalanceUpdate, NewEntry, OrderRow, PaidBatch, PaymentRow, Queries, Store};

use prost::Message as _;

use super::commands::Pay;
use super::guards::BatchClaim;
use super::idempotent::IdempotentCall;
use super::payments::{check_pay, new_payment, paid_receipt, PayCheck, PayReceipt};
use super::posting::{balance_after, EntryKind};
use super::transaction::in_transaction;
use super::{deadline_clock, new_id, now_micros, Identified, Inserted};
use crate::metrics::{LedgerMetrics, SHED_QUEUE_FULL};

/// How Pays are grouped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupCommitSettings {
    /// Most Pays written by one transaction; 1 turns group commit off.
    pub max_batch: usize,
    /// Batches in flight at once (each holds one pooled connection while it runs).
    pub workers: usize,
    /// Most Pays waiting in one worker's queue; a Pay that finds it full is refused
    /// RESOURCE_EXHAUSTED (OVERLOADED).
    pub queue_max: usize,
}

impl Default for GroupCommitSettings {
    fn default() -> Self {
        Self { max_batch: 64, workers: 1, queue_max: 1024 }
    }
}

/// Whether a call's caller still waits for its answer: its deadline (`grpc-timeout`) and
/// whether the transport dropped the call (cancelled by the client, or the connection
/// closed). A queued Pay whose caller has gone is not started.
#[derive(Debug, Clone, Default)]
pub struct CallerPresence {
    deadline: Option<Instant>,
    dropped: Arc<AtomicBool>,
}

impl CallerPresence {
    /// The presence of a call with `deadline`, and the guard that marks it dropped when the
    /// handler that holds it is dropped (tonic drops a cancelled call's handler).
    pub fn new(deadline: Option<Instant>) -> (Self, CallGuard) {
        let presence = Self { deadline, dropped: Arc::default() };
        let guard = CallGuard(presence.dropped.clone());
        (presence, guard)
    }

    /// `Some` once the caller has gone: whether its deadline passed (else it was dropped).
    fn gone(&self) -> Option<bool> {
        if self.deadline.is_some_and(|deadline| Instant::now() >= deadline) {
            return Some(true);
        }
        self.dropped.load(Ordering::Relaxed).then_some(false)
    }
}

/// Marks its [`CallerPresence`] dropped when dropped.
#[derive(Debug)]
pub struct CallGuard(Arc<AtomicBool>);

impl Drop for CallGuard {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// What the batch decided for one Pay.
#[derive(Debug)]
pub(super) enum Decision {
    /// Paid and committed by the batch.
    Paid(PayReceipt),
    /// A payment under this out_trade_no was already committed (with its order): a replay,
    /// or OUT_TRADE_NO_REUSED if it paid something else.
    Found(PaymentRow, OrderRow),
    /// The order was already paid under this out_trade_no: replay it.
    PaidBefore,
    /// The Pay breaks a rule; nothing of it was written.
    Rejected(Error),
    /// One of the Pay's guards (`idempotency-key` or `idempotency-token`) was found taken
    /// when the batch claimed it; nothing of the Pay was written: the committed original
    /// answers it.
    GuardTaken,
    /// The batch could not decide it: run it in its own transaction.
    Alone,
    /// Refused before it was queued or started: the queue was full, or the caller had gone.
    NotStarted(Error),
}

/// A Pay as a batch takes it: the command, and the claim of its guards when it carries an
/// `idempotency-key` or `idempotency-token`.
pub(super) struct Batched {
    pub(super) command: Pay,
    pub(super) claim: Option<BatchClaim>,
}

struct Job {
    batched: Batched,
    presence: CallerPresence,
    /// The Pay's span, which the batch's span links to.
    link: opentelemetry::trace::SpanContext,
    reply: oneshot::Sender<Decision>,
}

/// The queues in front of the batch workers, one per worker. Pays are routed by merchant_id,
/// so concurrent batches touch different orders and (when each merchant is paid into its own
/// account) different payee accounts, and do not queue on each other's row locks. Dropping
/// the last clone ends the workers.
pub(super) struct PayBatcher {
    queues: Vec<mpsc::Sender<Job>>,
    metrics: LedgerMetrics,
}

impl PayBatcher {
    /// Starts `settings.workers` workers on the current tokio runtime.
    pub(super) fn start(store: Store, settings: GroupCommitSettings, metrics: LedgerMetrics) -> Self {
        let queues = (0..settings.workers.max(1))
            .map(|_| {
                let (jobs, queue) = mpsc::channel(settings.queue_max.max(1));
                tokio::spawn(work(store.clone(), queue, settings.max_batch.max(1), metrics.clone()));
                jobs
            })
            .collect();
        Self { queues, metrics }
    }

    /// Queues a Pay and waits for its batch. [`Decision::NotStarted`] (OVERLOADED) when its
    /// queue is full; [`Decision::Alone`] when the workers are gone.
    pub(super) async fn submit(&self, batched: Batched, presence: CallerPresence) -> Decision {
        let mut hasher = std::hash::DefaultHasher::new();
        batched.command.merchant_id.as_str().hash(&mut hasher);
        let queue = &self.queues[(hasher.finish() % self.queues.len() as u64) as usize];
        let (reply, decision) = oneshot::channel();
        let link = tracing::Span::current().context().span().span_context().clone();
        match queue.try_send(Job { batched, presence, link, reply }) {
            Ok(()) => {
                self.metrics.group_commit_queue_depth.inc();
            }
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.metrics.shed(SHED_QUEUE_FULL);
                return Decision::NotStarted(Error::Overloaded(SHED_QUEUE_FULL));
            }
            Err(mpsc::error::TrySendError::Closed(_)) => return Decision::Alone,
        }
        decision.await.unwrap_or(Decision::Alone)
    }
}

/// A worker: takes whatever has queued up (at most `max_batch`) while its last batch ran, and
/// runs it as one batch. Under light load a batch holds one Pay and starts at once. A Pay
/// whose caller has gone by then is answered [`Decision::NotStarted`] and left out.
async fn work(store: Store, mut queue: mpsc::Receiver<Job>, max_batch: usize, metrics: LedgerMetrics) {
    while let Some(first) = queue.recv().await {
        let mut taken = vec![first];
        while taken.len() < max_batch {
            match queue.try_recv() {
                Ok(job) => taken.push(job),
                Err(_) => break,
            }
        }
        metrics.group_commit_queue_depth.dec_by(taken.len() as i64);
        let mut jobs = Vec::with_capacity(taken.len());
        for job in taken {
            match job.presence.gone() {
                Some(deadline_passed) => {
                    metrics.group_commit_not_started.inc();
                    let _ = job.reply.send(Decision::NotStarted(Error::CallerGone { deadline_passed }));
                }
                None => jobs.push(job),
            }
        }
        if jobs.is_empty() {
            continue;
        }
        let span = tracing::info_span!("group_commit", pays = jobs.len());
        for job in &jobs {
            if job.link.is_valid() {
                span.add_link(job.link.clone());
            }
        }
        let (commands, replies): (Vec<Batched>, Vec<_>) = jobs.into_iter().map(|job| (job.batched, job.reply)).unzip();
        let decisions = pay_together(&store, &commands, &metrics).instrument(span).await;
        for (reply, decision) in replies.into_iter().zip(decisions) {
            // The caller may be gone (client cancelled); the batch is committed regardless.
            let _ = reply.send(decision);
        }
    }
}

/// Runs `commands` as one group commit and returns one decision per command, in order:
/// first one read (no transaction, no locks) finds the out_trade_nos already paid, then one
/// transaction writes the rest.
pub(super) async fn pay_together(store: &Store, commands: &[Batched], metrics: &LedgerMetrics) -> Vec<Decision> {
    let mut decisions: Vec<Option<Decision>> = match find_paid(store, commands).await {
        Ok(found) => found,
        Err(error) => {
            tracing::debug!(%error, pays = commands.len(), "group commit could not read; every Pay of it runs alone");
            return alone(commands.len());
        }
    };
    let open: Vec<usize> = (0..commands.len()).filter(|index| decisions[*index].is_none()).collect();
    if open.is_empty() {
        return decisions.into_iter().map(|decision| decision.unwrap_or(Decision::Alone)).collect();
    }
    let batch: Vec<&Batched> = open.iter().map(|index| &commands[*index]).collect();
    let now = now_micros();
    let trade_nos: Vec<String> = batch.iter().map(|_| new_id('T')).collect();
    let outcome = in_transaction!(store, metrics, tx => {
        let mut queries = tx.queries();
        write_batch(&mut queries, &batch, &trade_nos, now).await
    });
    let written = match outcome {
        Ok(Inserted::Done(written)) => written,
        Ok(Inserted::KeyTaken) => alone(batch.len()),
        Err(error) => {
            tracing::debug!(%error, pays = batch.len(), "group commit failed; every Pay of it runs alone");
            alone(batch.len())
        }
    };
    let paid = written.iter().filter(|decision| matches!(decision, Decision::Paid(_))).count();
    if paid > 0 {
        metrics.group_commits.inc();
        metrics.group_committed_pays.inc_by(paid as u64);
        metrics.group_commit_batch.observe(paid as f64);
    }
    for (index, decision) in open.into_iter().zip(written) {
        decisions[index] = Some(decision);
    }
    decisions.into_iter().map(|decision| decision.unwrap_or(Decision::Alone)).collect()
}

/// The replay read: [`Decision::Found`] for every Pay whose out_trade_no is already paid.
async fn find_paid(store: &Store, commands: &[Batched]) -> Result<Vec<Option<Decision>>, Error> {
    let commands: Vec<&Pay> = commands.iter().map(|batched| &batched.command).collect();
    let keys: BTreeSet<(&str, &str)> =
        commands.iter().map(|command| (command.merchant_id.as_str(), command.out_trade_no.as_str())).collect();
    let keys: Vec<(&str, &str)> = keys.into_iter().collect();
    let mut reader = store.reader().await?;
    let found: HashMap<(String, String), (PaymentRow, OrderRow)> = reader
        .queries()
        .find_payments_and_orders(&keys)
        .await?
        .into_iter()
        .map(|(payment, order)| ((payment.merchant_id.clone(), payment.out_trade_no.clone()), (payment, order)))
        .collect();
    Ok(commands
        .iter()
        .map(|command| {
            let key = (command.merchant_id.as_str().to_owned(), command.out_trade_no.as_str().to_owned());
            found.get(&key).map(|(payment, order)| Decision::Found(payment.clone(), order.clone()))
        })
        .collect())
}

fn alone(count: usize) -> Vec<Decision> {
    (0..count).map(|_| Decision::Alone).collect()
}

/// One account's state as the batch moves it, in memory, under its row lock.
#[derive(Clone)]
struct Ledgered {
    row: AccountRow,
    read_version: i64,
}

/// The batch's writes. `Inserted::KeyTaken` means "roll back, every Pay runs alone".
async fn write_batch(
    queries: &mut Queries<'_>,
    batch: &[&Batched],
    trade_nos: &[String],
    now: i64,
) -> Result<Inserted<Vec<Decision>>, Error> {
    let commands: Vec<&Pay> = batch.iter().map(|batched| &batched.command).collect();
    let commands = commands.as_slice();
    let claims: Vec<Option<&BatchClaim>> = batch.iter().map(|batched| batched.claim.as_ref()).collect();
    let mut decisions: Vec<Option<Decision>> = commands.iter().map(|_| None).collect();

    // A second Pay of the same order or out_trade_no waits for the first one's outcome: it
    // runs alone after the batch (then it is a replay, ORDER_ALREADY_PAID or
    // OUT_TRADE_NO_REUSED, exactly as if it had come second on its own).
    let mut orders_seen = HashSet::new();
    let mut trade_nos_seen = HashSet::new();
    for (decision, command) in decisions.iter_mut().zip(commands) {
        let merchant_id = command.merchant_id.as_str();
        let first_of_order = orders_seen.insert((merchant_id, command.order_no.as_str()));
        let first_of_trade_no = trade_nos_seen.insert((merchant_id, command.out_trade_no.as_str()));
        if !(first_of_order && first_of_trade_no) {
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

    // 1. The orders, locked.
    let order_keys: BTreeSet<(&str, &str)> = commands
        .iter()
        .zip(&decisions)
        .filter(|(_, decision)| decision.is_none())
        .map(|(command, _)| (command.merchant_id.as_str(), command.order_no.as_str()))
        .collect();
    let order_keys: Vec<(&str, &str)> = order_keys.into_iter().collect();
    let mut orders: HashMap<(String, String), OrderRow> = queries
        .lock_orders(&order_keys)
        .await?
        .into_iter()
        .map(|order| ((order.merchant_id.clone(), order.order_no.clone()), order))
        .collect();
    let mut claimed: HashSet<usize> = HashSet::new();
    // Deadlines are judged now that the orders are locked (see `deadline_clock`).
    let checked_at = deadline_clock(now);
    let mut candidates = Vec::new();
    for (index, command) in commands.iter().enumerate() {
        if decisions[index].is_some() {
            continue;
        }
        let key = (command.merchant_id.as_str().to_owned(), command.order_no.as_str().to_owned());
        let Some(order) = orders.remove(&key) else {
            decisions[index] = Some(Decision::Rejected(Error::NotFound(Resource::Order)));
            continue;
        };
        match check_pay(&order, command, checked_at) {
            Ok(PayCheck::Proceed) => candidates.push((index, order)),
            Ok(PayCheck::PaidByThisCall) => decisions[index] = Some(Decision::PaidBefore),
            Err(error) => decisions[index] = Some(Decision::Rejected(error)),
        }
    }

    // 2. The accounts, locked, and the Pays applied in arrival order; then the guards of the
    //    accepted Pays claimed (3).
    if candidates.is_empty() {
        return Ok(Inserted::Done(decisions.into_iter().map(|decision| decision.unwrap_or(Decision::Alone)).collect()));
    }
    let account_ids: BTreeSet<&str> = candidates
        .iter()
        .flat_map(|(index, order)| [commands[*index].payer_account_id.as_str(), order.payee_account_id.as_str()])
        .collect();
    let account_ids: Vec<&str> = account_ids.into_iter().collect();
    let locked: BTreeMap<String, Ledgered> = queries
        .lock_accounts(&account_ids)
        .await?
        .into_iter()
        .map(|row| (row.account_id.clone(), Ledgered { read_version: row.version, row }))
        .collect();
    let (accounts, receipts) = loop {
        let mut accounts = locked.clone();
        let mut receipts = Vec::new();
        let mut refused = Vec::new();
        for (index, order) in candidates.iter().filter(|(index, _)| decisions[*index].is_none()) {
            match apply(&mut accounts, commands[*index], order) {
                Ok(legs) => receipts.push((*index, order.clone(), legs)),
                Err(error) => refused.push((*index, error)),
            }
        }
        // 3. Each accepted Pay's guards, claimed in arrival order, their records written with
        //    the answer the Pay gets if the batch commits. A guard found taken, or a
        //    token found invalid, takes that Pay out of the batch with nothing of it written,
        //    and the Pays after it are applied again without it: one it paid into may now
        //    lack funds, one it spent from may now have them. The Pays before it, claimed
        //    already, keep their outcome (each is applied after the ones before it only).
        let mut taken_out = false;
        for (index, order, _) in &receipts {
            let Some(claim) = claims[*index].filter(|_| !claimed.contains(index)) else { continue };
            let receipt =
                paid_receipt(new_payment(commands[*index], order, &trade_nos[*index], now), order.clone(), now);
            let message = <Identified<Pay> as IdempotentCall>::message(receipt.clone())?.encode_to_vec();
            match claim.claim(queries, &receipt, &message, now).await {
                Ok(true) => {
                    claimed.insert(*index);
                    continue;
                }
                Ok(false) => decisions[*index] = Some(Decision::GuardTaken),
                Err(error @ Error::Rejected(_)) => decisions[*index] = Some(Decision::Rejected(error)),
                Err(error) => return Err(error),
            }
            taken_out = true;
            break;
        }
        if !taken_out {
            for (index, error) in refused {
                decisions[index] = Some(Decision::Rejected(error));
            }
            break (accounts, receipts);
        }
        // A claimed Pay refused on the next pass would need its claim undone in the middle
        // of the batch (it cannot be: it came before the one taken out): the batch would roll
        // back instead, and every Pay of it run alone.
        if refused.iter().any(|(index, _)| claimed.contains(index)) {
            return Ok(Inserted::KeyTaken);
        }
    };

    // 4. The writes.
    let payments: Vec<PaymentRow> = receipts
        .iter()
        .map(|(index, order, _)| new_payment(commands[*index], order, &trade_nos[*index], now))
        .collect();
    if !payments.is_empty() && !write_accepted(queries, &payments, &receipts, &accounts, now).await? {
        return Ok(Inserted::KeyTaken);
    }
    for ((index, order, _), payment) in receipts.into_iter().zip(payments) {
        decisions[index] = Some(Decision::Paid(paid_receipt(payment, order, now)));
    }
    Ok(Inserted::Done(decisions.into_iter().map(|decision| decision.unwrap_or(Decision::Alone)).collect()))
}

/// The (balance, version) after each leg of one Pay: (payer, payee).
type Legs = [(i64, i64); 2];

/// Moves the Pay's money between the in-memory accounts, or changes nothing and says why.
/// Legs are checked in account_id order, as a single posting checks them.
fn apply(accounts: &mut BTreeMap<String, Ledgered>, command: &Pay, order: &OrderRow) -> Result<Legs, Error> {
    let (payer_id, payee_id) = (command.payer_account_id.as_str(), order.payee_account_id.as_str());
    let payer = accounts.get(payer_id).ok_or(Error::NotFound(Resource::Account))?;
    if payer.row.currency != order.currency {
        return Err(crate::domain::Rejection::CurrencyMismatch.into());
    }
    let minor_units = command.amount.minor_units();
    let mut after = [(0, 0); 2];
    let mut legs = [(payer_id, -minor_units, 0), (payee_id, minor_units, 1)];
    legs.sort_by(|a, b| a.0.cmp(b.0));
    for (account_id, delta, slot) in legs {
        let account = accounts.get(account_id).ok_or(Error::NotFound(Resource::Account))?;
        after[slot] = (balance_after(&account.row, &order.currency, delta)?, account.row.version + 1);
    }
    for (account_id, _, slot) in legs {
        let account = accounts.get_mut(account_id).expect("checked above");
        (account.row.balance, account.row.version) = after[slot];
    }
    Ok(after)
}

/// Step 3: false when a key or a version was taken under the batch (roll back).
async fn write_accepted(
    queries: &mut Queries<'_>,
    payments: &[PaymentRow],
    receipts: &[(usize, OrderRow, Legs)],
    accounts: &BTreeMap<String, Ledgered>,
    now: i64,
) -> Result<bool, Error> {
    let balances: Vec<BalanceUpdate<'_>> = accounts
        .values()
        .filter(|account| account.row.version != account.read_version)
        .map(|account| BalanceUpdate {
            account_id: &account.row.account_id,
            balance: account.row.balance,
            expected_version: account.read_version,
            version: account.row.version,
        })
        .collect();
    let kind = EntryKind::Pay.as_str();
    let mut entries = Vec::with_capacity(payments.len() * 2);
    for (payment, (_, _, [(payer_balance, payer_version), (payee_balance, payee_version)])) in
        payments.iter().zip(receipts)
    {
        let leg = |account_id, counterparty_account_id, amount, balance_after, version_after| NewEntry {
            account_id,
            currency: &payment.currency,
            amount,
            balance_after,
            version_after,
            kind,
            reference: &payment.out_trade_no,
            posting_id: &payment.trade_no,
            counterparty_account_id,
            created_at: now,
            created_by: &payment.created_by,
        };
        entries.push(leg(
            &payment.payer_account_id,
            &payment.payee_account_id,
            -payment.amount,
            *payer_balance,
            *payer_version,
        ));
        entries.push(leg(
            &payment.payee_account_id,
            &payment.payer_account_id,
            payment.amount,
            *payee_balance,
            *payee_version,
        ));
    }
    Ok(queries.write_pays(&PaidBatch { payments, balances: &balances, entries: &entries, now }).await?)
}
