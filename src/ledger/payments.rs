//! Orders, payments and refunds.

use crate::domain::{
    CloseReason, FieldViolation, MerchantId, OrderEvent, OrderNo, OrderState, OrderStatus, Rejection, Transition,
};
use crate::error::{Error, Resource, ReusedKey};
use crate::proto;
use crate::store::{AccountRow, HoldRow, OrderRow, PaymentRow, Queries, RefundRow};

use super::accounts::{check_transfer, FundingCall};
use super::commands::{CreateOrder, Deposit, Pay, QueryKey, Refund, Transfer, Withdraw};
use super::engine::book::{Book, OrderMove, OrderTo, WriteSet};
use super::engine::group_commit::{
    write_alone, write_together, Accepted, Answer, BatchKey, BatchWrite, Batchable, Batched, Batcher, Committed,
    Entries, GroupCommit, KeyToFind, Outcome, ReadFirst, Rows, View,
};
use super::engine::posting::{EntryKind, Legs, Posting};

use super::guards::{BatchClaim, Call, GuardSession, Guards, Scope};
use super::holds::{release, Released};
use super::idempotent::{differing_from, reply_message, Fields, IdempotentCall, Prepared, Reply};
use super::response;
use super::{new_id, now_micros, read_ended, Identified, Inserted, Ledger, Replayable};
use prost::Message as _;

/// Stored status of a payment row; payments are recorded only when they succeed.
pub(crate) const PAYMENT_SUCCEEDED: &str = "SUCCEEDED";

/// The answer to a Pay: the payment (as first recorded) and the order as it stood right after
/// the Pay (a replay too: [`order_as_paid`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PayReceipt {
    pub payment: PaymentRow,
    pub order: OrderRow,
}

/// The answer to a Refund: the refund (as first recorded) and the order as it stood right after
/// the refund (a replay too: [`order_as_refunded`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RefundReceipt {
    pub refund: RefundRow,
    pub order: OrderRow,
}

/// A call for [`Ledger::write_together`].
#[derive(Debug, Clone)]
pub enum BatchCall {
    Pay(Pay),
    Refund(Refund),
    /// A Transfer: its guards must carry an `idempotency-key`, as [`Ledger::transfer`] needs.
    Transfer(Transfer),
    /// A Deposit, answered as [`Ledger::deposit`] answers.
    Deposit(Deposit),
    /// A Withdraw, answered as [`Ledger::withdraw`] answers.
    Withdraw(Withdraw),
    /// A CreateOrder, answered as [`Ledger::create_order`] answers.
    CreateOrder(CreateOrder),
}

/// The response of one call of [`Ledger::write_together`].
#[derive(Debug, Clone, PartialEq)]
pub enum BatchAnswer {
    Pay(proto::PayResponse),
    Refund(proto::RefundResponse),
    Transfer(proto::TransferResponse),
    Deposit(proto::DepositResponse),
    Withdraw(proto::WithdrawResponse),
    CreateOrder(proto::CreateOrderResponse),
}

/// A call of [`Ledger::write_together`] with the id its row gets.
enum Together {
    Pay(Identified<Pay>),
    Refund(Identified<Refund>),
    Transfer(Identified<Transfer>),
    Deposit(FundingCall<Deposit>),
    Withdraw(FundingCall<Withdraw>),
    CreateOrder(NewOrder),
}

/// One call of [`Ledger::write_together`] after steps 1-3.
#[allow(clippy::large_enum_variant)] // one a call of a test's batch
enum Step<'a> {
    Answered(Result<Replayable<BatchAnswer>, Error>),
    Queued(GuardSession<'a>, Batched),
}

impl BatchWrite for Identified<Pay> {
    /// Its merchant_id: concurrent batches then touch different orders and (when each merchant
    /// is paid into its own account) different payee accounts.
    fn route(&self) -> &str {
        self.command.merchant_id.as_str()
    }

    fn payment_to_read(&self) -> Option<(&str, &str)> {
        Some((self.command.merchant_id.as_str(), self.command.out_trade_no.as_str()))
    }

    /// Its out_trade_no already paid: the payment and its order answer it (a replay, or
    /// OUT_TRADE_NO_REUSED if it paid something else).
    fn decided_before(&self, read: &ReadFirst) -> Option<Outcome> {
        let found = read.payment(self.command.merchant_id.as_str(), self.command.out_trade_no.as_str());
        found.map(|found| Outcome::Found(Box::new(found.clone())))
    }

    /// Its order and its out_trade_no: a second Pay of either waits for the first one's
    /// outcome (alone after the batch it is a replay, ORDER_ALREADY_PAID or
    /// OUT_TRADE_NO_REUSED), and no order is both paid and created or refunded by one batch.
    fn batch_keys(&self, _read: &ReadFirst) -> Option<Vec<BatchKey>> {
        let merchant_id = self.command.merchant_id.as_str();
        Some(vec![
            BatchKey::sole("order", merchant_id, self.command.order_no.as_str()),
            BatchKey::sole("out_trade_no", merchant_id, self.command.out_trade_no.as_str()),
        ])
    }

    fn order_to_lock<'a>(&'a self, _read: &'a ReadFirst) -> Option<(&'a str, &'a str)> {
        Some((self.command.merchant_id.as_str(), self.command.order_no.as_str()))
    }

    fn accounts_to_lock<'a>(&'a self, rows: Rows<'a>) -> Vec<&'a str> {
        rows.order.map_or_else(Vec::new, |order| {
            vec![self.command.payer_account_id.as_str(), order.payee_account_id.as_str()]
        })
    }

    /// Its payer (its order names its payee).
    fn accounts_named(&self) -> Vec<&str> {
        vec![self.command.payer_account_id.as_str()]
    }

    /// Its order's checks under the lock ([`check_pay`]: terms, state machine, deadline), its
    /// payer's ([`check_payer`]), then its payment's posting.
    fn decide(&self, view: &mut View<'_>) -> Result<Box<dyn Accepted>, Outcome> {
        let command = &self.command;
        let order = view.order(command.merchant_id.as_str(), command.order_no.as_str());
        let order = order.ok_or(Outcome::Rejected(Error::NotFound(Resource::Order)))?.clone();
        match check_pay(&order, command, view.checked_at) {
            Ok(PayCheck::Proceed) => {}
            Ok(PayCheck::PaidByThisCall) => return Err(Outcome::TakenBefore),
            Err(error) => return Err(Outcome::Rejected(error)),
        }
        check_payer(view.book.get(command.payer_account_id.as_str()), &order).map_err(Outcome::Rejected)?;
        let payment = new_payment(command, &order, &self.id, view.now);
        let legs = view.book.post(&payment_posting(&payment)).map_err(Outcome::Rejected)?;
        Ok(Box::new(Paid { receipt: paid_receipt(payment, order), legs }))
    }
}

/// A Pay a batch accepted: its receipt if the batch commits, and its legs (payer, payee).
struct Paid {
    receipt: PayReceipt,
    legs: Legs,
}

impl Accepted for Paid {
    fn add_to<'s>(&'s self, set: &mut WriteSet<'s>) {
        set.payments.push(self.receipt.payment.clone());
        set.postings.push((payment_posting(&self.receipt.payment), self.legs));
    }

    fn message(&self) -> Result<Option<Vec<u8>>, Error> {
        Ok(Some(<Identified<Pay> as IdempotentCall>::message(self.receipt.clone())?.encode_to_vec()))
    }

    fn answer(self: Box<Self>, _entries: &mut Entries, _locked: &Book) -> Result<(Answer, Option<Vec<u8>>), Error> {
        Ok((Box::new(self.receipt), None))
    }

    fn committed(&self) -> Option<Committed> {
        Some(|metrics| &metrics.group_committed_pays)
    }
}

impl Batchable for Identified<Pay> {
    fn write(&self) -> Box<dyn BatchWrite> {
        Box::new(self.clone())
    }

    /// Its payment inserted: a Pay of an order that does not exist has no key row to insert.
    async fn key_taken_in_flight(
        &self,
        queries: &mut Queries<'_>,
        _read: &ReadFirst,
        _refusal: &Error,
        now: i64,
    ) -> Result<bool, Error> {
        let command = &self.command;
        Ok(match queries.find_order(command.merchant_id.as_str(), command.order_no.as_str()).await? {
            Some(order) => !queries.insert_payment(&new_payment(command, &order, &self.id, now)).await?,
            None => false,
        })
    }
}

impl BatchWrite for Identified<Refund> {
    fn route(&self) -> &str {
        self.command.merchant_id.as_str()
    }

    fn payment_to_read(&self) -> Option<(&str, &str)> {
        Some((self.command.merchant_id.as_str(), self.command.out_trade_no.as_str()))
    }

    /// Its order, shared with the batch's other Refunds of it (applied one after another to
    /// its state), and its out_refund_no (a second Refund of it is a replay, after the batch).
    /// Without its payment read before the batch (it may be paid by this very batch) it runs
    /// alone: there it finds it, or answers PAYMENT_NOT_FOUND.
    fn batch_keys(&self, read: &ReadFirst) -> Option<Vec<BatchKey>> {
        let (payment, _) = self.payment(read)?;
        Some(vec![
            BatchKey::shared("order", &payment.merchant_id, &payment.order_no),
            BatchKey::sole("out_refund_no", self.command.merchant_id.as_str(), self.command.out_refund_no.as_str()),
        ])
    }

    fn order_to_lock<'a>(&'a self, read: &'a ReadFirst) -> Option<(&'a str, &'a str)> {
        let (payment, _) = self.payment(read)?;
        Some((payment.merchant_id.as_str(), payment.order_no.as_str()))
    }

    fn accounts_to_lock<'a>(&'a self, rows: Rows<'a>) -> Vec<&'a str> {
        self.payment(rows.read).map_or_else(Vec::new, |(payment, _)| {
            vec![payment.payee_account_id.as_str(), payment.payer_account_id.as_str()]
        })
    }

    fn key_to_find(&self) -> Option<KeyToFind> {
        let command = &self.command;
        Some(KeyToFind::Refund(command.merchant_id.as_str().to_owned(), command.out_refund_no.as_str().to_owned()))
    }

    /// Its checks in order: currency, order, key (an out_refund_no committed before the lock
    /// is a replay); then its order's state by the state machine ([`refunded_order`], after
    /// the batch's refunds of it before this one), then its posting (payee back to payer).
    fn decide(&self, view: &mut View<'_>) -> Result<Box<dyn Accepted>, Outcome> {
        let command = &self.command;
        let payment = view.payment(command.merchant_id.as_str(), command.out_trade_no.as_str());
        let payment = payment.ok_or(Outcome::Rejected(Error::NotFound(Resource::Payment)))?.clone();
        check_refund(command, &payment).map_err(Outcome::Rejected)?;
        let order = view.order(&payment.merchant_id, &payment.order_no);
        let order = order.ok_or(Outcome::Rejected(Error::NotFound(Resource::Order)))?.clone();
        let key = KeyToFind::Refund(payment.merchant_id.clone(), command.out_refund_no.as_str().to_owned());
        if view.taken(&key) {
            return Err(Outcome::TakenBefore);
        }
        let refund = new_refund(command, &payment, &self.id, view.now);
        let order = refunded_order(order, refund.amount, view.now).map_err(Outcome::Rejected)?;
        let refund = RefundRow { order_refunded_after: Some(order.refunded_amount), ..refund };
        let legs = view.book.post(&refund_posting(&refund, &payment)).map_err(Outcome::Rejected)?;
        view.move_order(order.clone());
        Ok(Box::new(Refunded { receipt: RefundReceipt { refund, order }, legs, payment }))
    }
}

impl Identified<Refund> {
    /// The (merchant_id, out_trade_no) of the payment it refunds.
    fn payment<'r>(&self, read: &'r ReadFirst) -> Option<&'r (PaymentRow, OrderRow)> {
        read.payment(self.command.merchant_id.as_str(), self.command.out_trade_no.as_str())
    }
}

/// A Refund a batch accepted: its receipt if the batch commits (its order as this refund
/// leaves it), its legs (payee, payer) and the payment it refunds.
struct Refunded {
    receipt: RefundReceipt,
    legs: Legs,
    payment: PaymentRow,
}

impl Accepted for Refunded {
    fn add_to<'s>(&'s self, set: &mut WriteSet<'s>) {
        set.refunds.push(self.receipt.refund.clone());
        set.postings.push((refund_posting(&self.receipt.refund, &self.payment), self.legs));
    }

    fn message(&self) -> Result<Option<Vec<u8>>, Error> {
        Ok(Some(<Identified<Refund> as IdempotentCall>::message(self.receipt.clone())?.encode_to_vec()))
    }

    fn answer(self: Box<Self>, _entries: &mut Entries, _locked: &Book) -> Result<(Answer, Option<Vec<u8>>), Error> {
        Ok((Box::new(self.receipt), None))
    }

    fn committed(&self) -> Option<Committed> {
        Some(|metrics| &metrics.group_committed_refunds)
    }
}

impl Batchable for Identified<Refund> {
    fn write(&self) -> Box<dyn BatchWrite> {
        Box::new(self.clone())
    }

    /// Its payment, read in its transaction (payments never change).
    async fn before_alone(&self, queries: &mut Queries<'_>, read: &mut ReadFirst, _now: i64) -> Result<(), Error> {
        let command = &self.command;
        let found = queries.find_payment_and_order(command.merchant_id.as_str(), command.out_trade_no.as_str()).await?;
        if let Some(found) = found {
            read.add_payment(found.0, found.1);
        }
        Ok(())
    }

    /// Its refund inserted: a Refund without its payment has no key row to insert.
    async fn key_taken_in_flight(
        &self,
        queries: &mut Queries<'_>,
        read: &ReadFirst,
        _refusal: &Error,
        now: i64,
    ) -> Result<bool, Error> {
        let Some((payment, _)) = self.payment(read) else { return Ok(false) };
        Ok(!queries.insert_refund(&new_refund(&self.command, payment, &self.id, now)).await?)
    }
}

/// The answer to a Query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderDetails {
    pub order: OrderRow,
    pub payment: Option<PaymentRow>,
    /// Oldest first.
    pub refunds: Vec<RefundRow>,
    /// The order's authorization hold, if it ever had one.
    pub hold: Option<HoldRow>,
}

/// The state-machine view of a stored order at `now` (microseconds since the Unix epoch):
/// past its expiry when it has an `expires_at` at or before `now`.
pub(super) fn order_state(order: &OrderRow, now: i64) -> Result<OrderState, Error> {
    order_state_with_hold(order, None, now)
}

/// The state-machine view of a stored order and its authorization hold at `now`.
pub(super) fn order_state_with_hold(order: &OrderRow, hold: Option<&HoldRow>, now: i64) -> Result<OrderState, Error> {
    let status = OrderStatus::from_stored(&order.status)
        .ok_or_else(|| Error::Internal(format!("unknown stored order status {:?}", order.status)))?;
    let close_reason = match order.close_reason.as_deref() {
        None => None,
        Some(stored) => Some(
            CloseReason::from_stored(stored)
                .ok_or_else(|| Error::Internal(format!("unknown stored close reason {stored:?}")))?,
        ),
    };
    Ok(OrderState {
        status,
        amount_minor_units: order.amount,
        refunded_minor_units: order.refunded_amount,
        close_reason,
        past_expiry: order.expires_at.is_some_and(|expires_at| expires_at <= now),
        hold_past_expiry: hold.is_some_and(|hold| hold.expires_at <= now),
    })
}

impl Ledger {
    /// Creates an order in PENDING, once per (merchant_id, order_no).
    ///
    /// # Errors
    /// [`Error::NotFound`] (payee account), [`Rejection::CurrencyMismatch`] (payee holds
    /// another currency), [`Error::KeyReused`] (ORDER_NO_REUSED) for other fields.
    ///
    /// An order without `expires_at` gets the server's default (`LedgerSettings::order_ttl`
    /// from now, or none); an explicit `expires_at` must be later than now
    /// ([`Error::InvalidArgument`] otherwise, unless the call replays an existing order).
    ///
    /// With group commit on, an order is written by a batch, guarded or not, routed by
    /// merchant_id with the merchant's Pays and Refunds (see `group_commit`).
    pub async fn create_order(
        &self,
        command: CreateOrder,
        guards: &Guards,
    ) -> Result<Replayable<proto::CreateOrderResponse>, Error> {
        let call = NewOrder { command, default_ttl: self.settings.order_ttl_micros() };
        match self.batcher() {
            Some(batcher) => self.run_in_batch(batcher, &call, guards).await?.try_map(reply_message::<NewOrder>),
            None => self.run_idempotent(&call, guards).await,
        }
    }

    /// Moves a PENDING order to CLOSED; a closed order is returned unchanged (replayed).
    ///
    /// # Errors
    /// [`Error::NotFound`] (ORDER_NOT_FOUND), [`Rejection::OrderAlreadyPaid`].
    pub async fn close_order(
        &self,
        merchant_id: &MerchantId,
        order_no: &OrderNo,
        guards: &Guards,
    ) -> Result<Replayable<proto::CloseOrderResponse>, Error> {
        self.run_idempotent(&CloseOrder { merchant_id: merchant_id.clone(), order_no: order_no.clone() }, guards).await
    }

    /// Pays an order: the payer's money moves to the order's payee and the order moves from
    /// PENDING to PAID, once per (merchant_id, out_trade_no).
    ///
    /// # Errors
    /// [`Error::NotFound`] (order or payer), [`Rejection`]s AMOUNT_MISMATCH,
    /// CURRENCY_MISMATCH, PAYER_IS_PAYEE, INSUFFICIENT_FUNDS, ORDER_ALREADY_PAID, ORDER_CLOSED;
    /// [`Error::KeyReused`] (OUT_TRADE_NO_REUSED) when the out_trade_no paid something else.
    ///
    /// With group commit on, a Pay is written by a batch, guarded or not: a Pay with an
    /// `idempotency-key` or `idempotency-token` has its records claimed and completed inside
    /// the batch's transaction (see `group_commit`).
    pub async fn pay(&self, command: Pay, guards: &Guards) -> Result<Replayable<proto::PayResponse>, Error> {
        let Some(batcher) = self.batcher() else {
            return self.run_idempotent(&Identified { command, id: new_id('T') }, guards).await;
        };
        if !guards.is_empty() {
            let call = Identified { command, id: new_id('T') };
            return self.run_in_batch(batcher, &call, guards).await?.try_map(reply_message::<Identified<Pay>>);
        }
        let call = Identified { command, id: new_id('T') };
        let outcome =
            batcher.submit(Batched { write: Box::new(call.clone()), claim: None }, guards.presence.clone()).await;
        let command = call.command;
        if let Some(answer) = self.answer_decided(&command, outcome).await {
            return answer?.try_map(<Identified<Pay>>::message);
        }
        self.run_idempotent(&Identified { command, id: new_id('T') }, guards).await
    }

    /// A call through a group commit: the idempotency driver's steps 1-3 and 5 as for any
    /// call, and step 4 (claim, body, complete) inside the batch's transaction.
    pub(super) async fn run_in_batch<C: Batchable>(
        &self,
        batcher: &Batcher,
        call: &C,
        guards: &Guards,
    ) -> Result<Replayable<Reply<C::Answer>>, Error> {
        let fingerprint = call.fingerprint(&guards.actor);
        let now = now_micros();
        let (mut session, claim) = match self.prepare_for_batch(guards, &fingerprint, now).await? {
            Prepared::Answered(answer) => return Ok(answer),
            Prepared::Ready(ready) => ready,
        };
        let outcome = match claim {
            Ok(claim) => {
                let decision = batcher.submit(Batched { write: call.write(), claim }, guards.presence.clone()).await;
                self.batched_outcome(call, &mut session, decision, now).await
            }
            Err(error) => Err(error),
        };
        self.settle_call(call, &mut session, outcome, now).await
    }

    /// Steps 1-3 of a call bound for a group commit at `now` ([`Ledger::prepare_guards`]: its
    /// natural key is read by the batch), and the claim of its guards (`None` without guards;
    /// the error, to settle, for a token it may not use).
    async fn prepare_for_batch<'a, T>(
        &'a self,
        guards: &'a Guards,
        fingerprint: &'a Call,
        now: i64,
    ) -> Result<Prepared<T, (GuardSession<'a>, Result<Option<BatchClaim>, Error>)>, Error> {
        Ok(match self.prepare_guards(guards, fingerprint).await? {
            Prepared::Answered(answer) => Prepared::Answered(answer),
            Prepared::Ready(session) => {
                let claim = if guards.is_empty() { Ok(None) } else { session.batch_claim(now).await.map(Some) };
                Prepared::Ready((session, claim))
            }
        })
    }

    /// What a batch's decision means for a call, as its transaction's outcome: a key of it (a
    /// guard, its out_trade_no, out_refund_no or request_id, its order's one payment) found taken is
    /// `KeyTaken`, and a call the batch could not decide, or refused while it has guards, runs
    /// in its own transaction now.
    async fn batched_outcome<C: Batchable>(
        &self,
        call: &C,
        session: &mut GuardSession<'_>,
        outcome: Outcome,
        now: i64,
    ) -> Result<Inserted<C::Answer>, Error> {
        let outcome = match C::written(outcome) {
            Ok(answer) => return Ok(Inserted::Done(answer)),
            Err(outcome) => *outcome,
        };
        match outcome {
            Outcome::GuardAnswered(record) => {
                session.answer_from_batch(*record)?;
                Ok(Inserted::KeyTaken)
            }
            Outcome::Found(_) | Outcome::TakenBefore => {
                session.found_committed_by_batch();
                Ok(Inserted::KeyTaken)
            }
            Outcome::GuardTaken => Ok(Inserted::KeyTaken),
            Outcome::Rejected(error) if !session.records_response() => Err(error),
            Outcome::NotStarted(error) => Err(error),
            // A call with guards that the batch refused runs alone too: there, as every single
            // call, its guards are claimed before its rules are checked, so a retry whose
            // original committed after the retry's own check (or is still in flight) is
            // answered by the original, not refused on the state the original left (a
            // Transfer, which has no natural key, would otherwise be told INSUFFICIENT_FUNDS
            // for money that did move), and a key reused for another call is
            // IDEMPOTENCY_KEY_REUSED, as a single call answers it, not that call's refusal.
            // A call whose guards nobody has read yet reads them first, as step 1 does (its
            // claim would find its own key taken, but not the record its key left before
            // authentication), and a committed record answers it.
            Outcome::Alone | Outcome::Rejected(_) => {
                if session.read_before_alone().await? {
                    return Ok(Inserted::KeyTaken);
                }
                self.metrics.group_commit_alone.inc();
                self.transact(call, session, now).await
            }
            Outcome::Written(..) => {
                Err(Error::Internal(format!("a group commit wrote a {} as another call", C::METHOD)))
            }
        }
    }

    /// The receipt of a Pay whose transaction found its key taken by a committed payment: the
    /// payment of its out_trade_no, or, when the key taken was the order's one payment under
    /// another out_trade_no, ORDER_ALREADY_PAID.
    async fn pay_after_taken(&self, command: &Pay) -> Result<PayReceipt, Error> {
        self.pay_replay(command).await?.ok_or_else(|| Rejection::OrderAlreadyPaid.into())
    }

    /// The group-commit queue, started on first use; `None` when group commit is off.
    pub(super) fn batcher(&self) -> Option<&Batcher> {
        let settings = self.settings.group_commit;
        (settings.max_batch > 1).then(|| {
            self.batcher.get_or_init(|| {
                Batcher::start(
                    GroupCommit::new(self.store.clone(), self.metrics.clone(), &settings),
                    settings,
                    self.metrics.clone(),
                )
            })
        })
    }

    /// The answer a group commit gave a Pay; `None` when the Pay must run alone.
    async fn answer_decided(&self, command: &Pay, outcome: Outcome) -> Option<Result<Replayable<PayReceipt>, Error>> {
        let outcome = match <Identified<Pay> as Batchable>::written(outcome) {
            Ok(receipt) => return Some(Ok(Replayable { value: receipt, replayed: false, key_expires_at: None })),
            Err(outcome) => *outcome,
        };
        Some(match outcome {
            Outcome::Found(found) => match found.downcast::<(PaymentRow, OrderRow)>() {
                Ok(found) => {
                    let (payment, order) = *found;
                    self.replay_of(command, payment, order)
                        .map(|receipt| self.natural_replay(receipt))
                        .map_err(|error| self.natural_conflict(error))
                }
                Err(_) => Err(Error::Internal("a Pay was found as another row".into())),
            },
            Outcome::TakenBefore => self
                .pay_after_taken(command)
                .await
                .map(|receipt| self.natural_replay(receipt))
                .map_err(|error| self.natural_conflict(error)),
            Outcome::Rejected(error) | Outcome::NotStarted(error) => Err(error),
            Outcome::Alone => {
                self.metrics.group_commit_alone.inc();
                return None;
            }
            Outcome::GuardTaken | Outcome::GuardAnswered(_) => {
                Err(Error::Internal("a Pay without guards had a guard taken".into()))
            }
            Outcome::Written(..) => Err(Error::Internal("a group commit answered a Pay as another call".into())),
        })
    }

    /// Pays several orders as one group commit, the way concurrent Pays without an
    /// idempotency-key or token are written: one read for the replays, then one transaction
    /// with one statement per kind of row. Each Pay gets its own outcome, in the order given,
    /// exactly as [`Ledger::pay`] would answer it alone (a rejection fails only its own Pay).
    ///
    /// # Errors
    /// Per Pay, in its own `Result`: the errors of [`Ledger::pay`].
    pub async fn pay_together(&self, commands: Vec<Pay>) -> Vec<Result<Replayable<PayReceipt>, Error>> {
        let batch: Vec<Batched> = commands
            .iter()
            .map(|command| Batched {
                write: Box::new(Identified { command: command.clone(), id: new_id('T') }),
                claim: None,
            })
            .collect();
        let decisions = write_together(&self.store, &batch, &self.metrics, true, None).await;
        let mut answers = Vec::with_capacity(commands.len());
        for (command, decision) in commands.into_iter().zip(decisions) {
            let answer = match self.answer_decided(&command, decision).await {
                Some(answer) => answer,
                None => self.pay_alone(command).await,
            };
            answers.push(answer);
        }
        answers
    }

    /// [`Ledger::pay_together`] for Pays that may carry guards (`idempotency-key`,
    /// `idempotency-token`): [`Ledger::write_together`] of Pays only.
    ///
    /// # Errors
    /// Per Pay, in its own `Result`: the errors of [`Ledger::pay`].
    pub async fn pay_together_guarded(
        &self,
        calls: Vec<(Pay, Guards)>,
    ) -> Vec<Result<Replayable<proto::PayResponse>, Error>> {
        let calls = calls.into_iter().map(|(command, guards)| (BatchCall::Pay(command), guards)).collect();
        let answers = self.write_together(calls).await;
        answers
            .into_iter()
            .map(|answer| {
                answer?.try_map(|answer| match answer {
                    BatchAnswer::Pay(response) => Ok(response),
                    BatchAnswer::Refund(_)
                    | BatchAnswer::Transfer(_)
                    | BatchAnswer::Deposit(_)
                    | BatchAnswer::Withdraw(_)
                    | BatchAnswer::CreateOrder(_) => Err(Error::Internal("a Pay was answered as another call".into())),
                })
            })
            .collect()
    }

    /// Writes Pays, Refunds, Transfers, Deposits, Withdraws and CreateOrders, each with or
    /// without guards (`idempotency-key`, `idempotency-token`; a Transfer needs its key), as one
    /// group commit, the way concurrent calls routed to one worker are written: each call goes through the
    /// idempotency driver's steps before and after the batch on its own, and the batch claims
    /// and completes the records of those it writes. Answers as [`Ledger::pay`],
    /// [`Ledger::refund`], [`Ledger::transfer`], [`Ledger::deposit`], [`Ledger::withdraw`] and
    /// [`Ledger::create_order`] would, in the order given.
    ///
    /// # Errors
    /// Per call, in its own `Result`: the errors of the call's own method.
    pub async fn write_together(&self, calls: Vec<(BatchCall, Guards)>) -> Vec<Result<Replayable<BatchAnswer>, Error>> {
        let (calls, guards): (Vec<BatchCall>, Vec<Guards>) = calls.into_iter().unzip();
        let calls: Vec<Together> = calls
            .into_iter()
            .map(|call| match call {
                BatchCall::Pay(command) => Together::Pay(Identified { command, id: new_id('T') }),
                BatchCall::Refund(command) => Together::Refund(Identified { command, id: new_id('R') }),
                BatchCall::Transfer(command) => Together::Transfer(Identified { command, id: new_id('X') }),
                BatchCall::Deposit(command) => Together::Deposit(self.funding_call(command, 'D')),
                BatchCall::Withdraw(command) => Together::Withdraw(self.funding_call(command, 'W')),
                BatchCall::CreateOrder(command) => {
                    Together::CreateOrder(NewOrder { command, default_ttl: self.settings.order_ttl_micros() })
                }
            })
            .collect();
        let fingerprints: Vec<Call> = calls
            .iter()
            .zip(&guards)
            .map(|(call, guards)| match call {
                Together::Pay(call) => call.fingerprint(&guards.actor),
                Together::Refund(call) => call.fingerprint(&guards.actor),
                Together::Transfer(call) => call.fingerprint(&guards.actor),
                Together::Deposit(call) => call.fingerprint(&guards.actor),
                Together::Withdraw(call) => call.fingerprint(&guards.actor),
                Together::CreateOrder(call) => call.fingerprint(&guards.actor),
            })
            .collect();
        let now = now_micros();
        let mut answers = Vec::with_capacity(calls.len());
        let mut sessions = Vec::new();
        let mut batch = Vec::new();
        for ((call, guards), fingerprint) in calls.iter().zip(&guards).zip(&fingerprints) {
            let step = match call {
                Together::Pay(call) => self.queue_together(call, guards, fingerprint, now, BatchAnswer::Pay).await,
                Together::Refund(call) => {
                    self.queue_together(call, guards, fingerprint, now, BatchAnswer::Refund).await
                }
                Together::Transfer(call) => match check_transfer(&call.command, guards) {
                    Ok(()) => self.queue_together(call, guards, fingerprint, now, BatchAnswer::Transfer).await,
                    Err(error) => Step::Answered(Err(error)),
                },
                Together::Deposit(call) => {
                    self.queue_together(call, guards, fingerprint, now, BatchAnswer::Deposit).await
                }
                Together::Withdraw(call) => {
                    self.queue_together(call, guards, fingerprint, now, BatchAnswer::Withdraw).await
                }
                Together::CreateOrder(call) => {
                    self.queue_together(call, guards, fingerprint, now, BatchAnswer::CreateOrder).await
                }
            };
            match step {
                Step::Answered(answer) => answers.push(Some(answer)),
                Step::Queued(session, batched) => {
                    answers.push(None);
                    batch.push(batched);
                    sessions.push((answers.len() - 1, session));
                }
            }
        }
        let decisions = write_together(&self.store, &batch, &self.metrics, true, None).await;
        for ((index, mut session), decision) in sessions.into_iter().zip(decisions) {
            answers[index] = Some(match &calls[index] {
                Together::Pay(call) => self.settle_together(call, &mut session, decision, now, BatchAnswer::Pay).await,
                Together::Refund(call) => {
                    self.settle_together(call, &mut session, decision, now, BatchAnswer::Refund).await
                }
                Together::Transfer(call) => {
                    self.settle_together(call, &mut session, decision, now, BatchAnswer::Transfer).await
                }
                Together::Deposit(call) => {
                    self.settle_together(call, &mut session, decision, now, BatchAnswer::Deposit).await
                }
                Together::Withdraw(call) => {
                    self.settle_together(call, &mut session, decision, now, BatchAnswer::Withdraw).await
                }
                Together::CreateOrder(call) => {
                    self.settle_together(call, &mut session, decision, now, BatchAnswer::CreateOrder).await
                }
            });
        }
        answers.into_iter().map(|answer| answer.expect("every call answered")).collect()
    }

    /// Steps 1-3 of one call of [`Ledger::write_together`]: its answer, or what it queues.
    async fn queue_together<'a, C: Batchable>(
        &'a self,
        call: &C,
        guards: &'a Guards,
        fingerprint: &'a Call,
        now: i64,
        wrap: fn(C::Message) -> BatchAnswer,
    ) -> Step<'a> {
        let answered =
            |answer: Replayable<Reply<C::Answer>>| answer.try_map(|reply| reply_message::<C>(reply).map(wrap));
        match self.prepare_for_batch(guards, fingerprint, now).await {
            Ok(Prepared::Ready((session, Ok(claim)))) => Step::Queued(session, Batched { write: call.write(), claim }),
            Ok(Prepared::Ready((mut session, Err(error)))) => {
                Step::Answered(self.settle_call(call, &mut session, Err(error), now).await.and_then(answered))
            }
            Ok(Prepared::Answered(answer)) => Step::Answered(answered(answer)),
            Err(error) => Step::Answered(Err(error)),
        }
    }

    /// Step 5 of one call of [`Ledger::write_together`], from its batch's decision.
    async fn settle_together<C: Batchable>(
        &self,
        call: &C,
        session: &mut GuardSession<'_>,
        outcome: Outcome,
        now: i64,
        wrap: fn(C::Message) -> BatchAnswer,
    ) -> Result<Replayable<BatchAnswer>, Error> {
        let outcome = self.batched_outcome(call, session, outcome, now).await;
        self.settle_call(call, session, outcome, now).await?.try_map(|reply| reply_message::<C>(reply).map(wrap))
    }

    /// A Pay without idempotency key or token in its own transaction: its receipt.
    async fn pay_alone(&self, command: Pay) -> Result<Replayable<PayReceipt>, Error> {
        self.run_guarded(&Identified { command, id: new_id('T') }, &Guards::default()).await?.try_map(|reply| {
            match reply {
                Reply::Value(receipt) => Ok(receipt),
                Reply::Stored(_) => Err(Error::Internal("a Pay without guards was answered from a record".into())),
            }
        })
    }

    async fn pay_replay(&self, command: &Pay) -> Result<Option<PayReceipt>, Error> {
        let mut reader = self.store.reader().await?;
        let mut queries = reader.queries();
        let merchant_id = command.merchant_id.as_str();
        // One round trip: the payment by its key, with its order.
        let found = queries.find_payment_and_order(merchant_id, command.out_trade_no.as_str()).await?;
        reader.release();
        let Some((payment, order)) = found else {
            return Ok(None);
        };
        self.replay_of(command, payment, order).map(Some)
    }

    /// The replay of a Pay whose out_trade_no holds `payment`: the payment as first recorded
    /// and its order as it stood right after it ([`order_as_paid`]); OUT_TRADE_NO_REUSED when
    /// the key paid something else.
    fn replay_of(&self, command: &Pay, payment: PaymentRow, order: OrderRow) -> Result<PayReceipt, Error> {
        let stored = pay_fields(
            &payment.out_trade_no,
            &payment.order_no,
            &payment.payer_account_id,
            payment.amount,
            &payment.currency,
        );
        let fields = differing_from(&pay_command_fields(command), &stored);
        if !fields.is_empty() {
            return Err(Error::KeyReused { key: ReusedKey::OutTradeNo, fields });
        }
        Ok(PayReceipt { order: order_as_paid(&payment, order), payment })
    }

    /// Refunds part or all of a payment, once per (merchant_id, out_refund_no).
    ///
    /// # Errors
    /// [`Error::NotFound`] (PAYMENT_NOT_FOUND), [`Rejection`]s REFUND_EXCEEDS_PAID,
    /// CURRENCY_MISMATCH, INSUFFICIENT_FUNDS (the payee spent the money);
    /// [`Error::KeyReused`] (OUT_REFUND_NO_REUSED).
    ///
    /// With group commit on, a Refund is written by a batch, guarded or not (see
    /// `group_commit`), together with the calls routed to its worker that queued with it.
    pub async fn refund(&self, command: Refund, guards: &Guards) -> Result<Replayable<proto::RefundResponse>, Error> {
        let call = Identified { command, id: new_id('R') };
        match self.batcher() {
            Some(batcher) => {
                self.run_in_batch(batcher, &call, guards).await?.try_map(reply_message::<Identified<Refund>>)
            }
            None => self.run_idempotent(&call, guards).await,
        }
    }

    /// An order with its payment and refunds, found by any of its business numbers.
    ///
    /// # Errors
    /// [`Error::NotFound`] for the number asked by.
    pub async fn query(&self, merchant_id: &MerchantId, key: &QueryKey) -> Result<OrderDetails, Error> {
        // The order, its payment, its refunds and its hold as they stood at one moment: read
        // one by one outside a snapshot, refunds landing meanwhile could be listed beside an
        // order that does not count them yet.
        let mut snapshot = self.store.snapshot().await?;
        let details = Self::order_details(&mut snapshot.queries(), merchant_id, key).await;
        read_ended(snapshot, details).await
    }

    /// [`Ledger::query`]'s reads, in the caller's snapshot.
    async fn order_details(
        queries: &mut Queries<'_>,
        merchant_id: &MerchantId,
        key: &QueryKey,
    ) -> Result<OrderDetails, Error> {
        let merchant_id = merchant_id.as_str();
        // The payment a lookup by out_trade_no found is the order's (one payment per order),
        // and an order nothing was refunded from has no refunds: neither is read twice.
        let (order_no, mut payment) = match key {
            QueryKey::OrderNo(order_no) => (order_no.as_str().to_owned(), None),
            QueryKey::OutTradeNo(out_trade_no) => {
                let payment = queries
                    .find_payment(merchant_id, out_trade_no.as_str())
                    .await?
                    .ok_or(Error::NotFound(Resource::Payment))?;
                (payment.order_no.clone(), Some(payment))
            }
            QueryKey::OutRefundNo(out_refund_no) => {
                let refund = queries
                    .find_refund(merchant_id, out_refund_no.as_str())
                    .await?
                    .ok_or(Error::NotFound(Resource::Refund))?;
                (refund.order_no, None)
            }
        };
        let (order, hold) =
            queries.find_order_and_hold(merchant_id, &order_no).await?.ok_or(Error::NotFound(Resource::Order))?;
        payment = match &order.out_trade_no {
            Some(out_trade_no) if payment.as_ref().is_some_and(|found| &found.out_trade_no == out_trade_no) => payment,
            Some(out_trade_no) => queries.find_payment(merchant_id, out_trade_no).await?,
            None => None,
        };
        let refunds =
            if order.refunded_amount == 0 { Vec::new() } else { queries.list_refunds(merchant_id, &order_no).await? };
        Ok(OrderDetails { order, payment, refunds, hold })
    }
}

/// CreateOrder's business fields, from a request or a stored order. `expires_at` is one of
/// them only when the caller gave it: an order created with the server's default matches a
/// retry that leaves it out, and fingerprints of calls without it are those of earlier
/// releases.
fn create_order_fields(
    order_no: &str,
    payee_account_id: &str,
    amount: i64,
    currency: &str,
    subject: &str,
    expires_at: Option<Option<i64>>,
) -> Fields {
    let mut fields = vec![
        ("order_no", order_no.to_owned()),
        ("payee_account_id", payee_account_id.to_owned()),
        ("amount", amount.to_string()),
        ("currency", currency.to_owned()),
        ("subject", subject.to_owned()),
    ];
    if let Some(expires_at) = expires_at {
        fields.push(("expires_at", expires_at.map_or_else(|| "never".to_owned(), |micros| micros.to_string())));
    }
    fields
}

/// A CreateOrder call with the server's default lifetime of an order (microseconds; 0: none).
#[derive(Debug, Clone)]
pub(super) struct NewOrder {
    pub(super) command: CreateOrder,
    pub(super) default_ttl: i64,
}

impl NewOrder {
    /// The PENDING order this call creates at `now` (microseconds since the Unix epoch): its
    /// `expires_at` as given, or the server's default from `now`, or none.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an `expires_at` at or before `now`.
    pub(super) fn order_at(&self, now: i64) -> Result<OrderRow, Error> {
        let command = &self.command;
        let expires_at = match command.expires_at {
            Some(expires_at) if expires_at <= now => {
                return Err(FieldViolation::new("expires_at", "must be later than now").into());
            }
            Some(expires_at) => Some(expires_at),
            None if self.default_ttl > 0 => Some(now.saturating_add(self.default_ttl)),
            None => None,
        };
        Ok(OrderRow {
            merchant_id: command.merchant_id.as_str().to_owned(),
            order_no: command.order_no.as_str().to_owned(),
            payee_account_id: command.payee_account_id.as_str().to_owned(),
            amount: command.amount.minor_units(),
            currency: command.amount.currency().code().to_owned(),
            subject: command.subject.as_str().to_owned(),
            status: OrderStatus::Pending.as_str().to_owned(),
            out_trade_no: None,
            refunded_amount: 0,
            created_at: now,
            updated_at: now,
            expires_at,
            close_reason: None,
        })
    }
}

/// CreateOrder's rule on its payee account (`None`: not found): it exists and holds the
/// order's currency.
///
/// # Errors
/// [`Error::NotFound`] (ACCOUNT_NOT_FOUND), [`Rejection::CurrencyMismatch`].
pub(super) fn check_payee(payee: Option<&AccountRow>, order: &OrderRow) -> Result<(), Error> {
    let payee = payee.ok_or(Error::NotFound(Resource::Account))?;
    if payee.currency != order.currency {
        return Err(Rejection::CurrencyMismatch.into());
    }
    Ok(())
}

impl BatchWrite for NewOrder {
    fn route(&self) -> &str {
        self.command.merchant_id.as_str()
    }

    /// Its order: a second CreateOrder of it runs alone after the first (a replay of it, or
    /// ORDER_NO_REUSED), and so does a later Pay or Refund of it (alone it finds the order the
    /// batch committed, or ORDER_NOT_FOUND if the batch refused it).
    fn batch_keys(&self, _read: &ReadFirst) -> Option<Vec<BatchKey>> {
        Some(vec![BatchKey::sole("order", self.command.merchant_id.as_str(), self.command.order_no.as_str())])
    }

    /// Its order's key, locked to find one committed before.
    fn order_to_lock<'a>(&'a self, _read: &'a ReadFirst) -> Option<(&'a str, &'a str)> {
        Some((self.command.merchant_id.as_str(), self.command.order_no.as_str()))
    }

    /// Its payee (it moves no money: its lock only orders it with the batch's other rows).
    fn accounts_to_lock<'a>(&'a self, _rows: Rows<'a>) -> Vec<&'a str> {
        vec![self.command.payee_account_id.as_str()]
    }

    /// An order committed before is a replay (or ORDER_NO_REUSED), whatever its expires_at
    /// says now, as the driver's read before the batch answers it; then the order's own checks
    /// ([`NewOrder::order_at`]) and its payee's ([`check_payee`]).
    fn decide(&self, view: &mut View<'_>) -> Result<Box<dyn Accepted>, Outcome> {
        if view.order(self.command.merchant_id.as_str(), self.command.order_no.as_str()).is_some() {
            return Err(Outcome::TakenBefore);
        }
        let order = self.order_at(view.now).map_err(Outcome::Rejected)?;
        check_payee(view.book.get(&order.payee_account_id), &order).map_err(Outcome::Rejected)?;
        Ok(Box::new(Created(order)))
    }
}

/// A new order a batch accepted; it moves no money.
struct Created(OrderRow);

impl Accepted for Created {
    fn add_to<'s>(&'s self, set: &mut WriteSet<'s>) {
        set.orders.push(self.0.clone());
    }

    fn message(&self) -> Result<Option<Vec<u8>>, Error> {
        Ok(Some(NewOrder::message(self.0.clone())?.encode_to_vec()))
    }

    fn answer(self: Box<Self>, _entries: &mut Entries, _locked: &Book) -> Result<(Answer, Option<Vec<u8>>), Error> {
        Ok((Box::new(self.0), None))
    }

    fn committed(&self) -> Option<Committed> {
        Some(|metrics| &metrics.group_committed_orders)
    }
}

impl Batchable for NewOrder {
    fn write(&self) -> Box<dyn BatchWrite> {
        Box::new(self.clone())
    }
}

impl IdempotentCall for NewOrder {
    type Answer = OrderRow;
    type Message = proto::CreateOrderResponse;
    const METHOD: &'static str = "CreateOrder";

    fn message(order: OrderRow) -> Result<Self::Message, Error> {
        Ok(proto::CreateOrderResponse { order: Some(response::order(order)?) })
    }

    fn scope(&self) -> Scope<'_> {
        Scope::Merchant(&self.command.merchant_id)
    }

    fn fields(&self) -> Fields {
        let command = &self.command;
        let amount = &command.amount;
        let (order_no, payee, subject) =
            (command.order_no.as_str(), command.payee_account_id.as_str(), command.subject.as_str());
        let expires_at = command.expires_at.map(Some);
        create_order_fields(order_no, payee, amount.minor_units(), amount.currency().code(), subject, expires_at)
    }

    async fn natural_replay(&self, ledger: &Ledger) -> Result<Option<OrderRow>, Error> {
        let mut reader = ledger.store.reader().await?;
        let (merchant_id, order_no) = (self.command.merchant_id.as_str(), self.command.order_no.as_str());
        let found = reader.queries().find_order_and_hold(merchant_id, order_no).await?;
        reader.release();
        let Some((order, hold)) = found else {
            return Ok(None);
        };
        // A capture leaves the order's amount at what was captured; the order was created for
        // the amount its hold authorized.
        let created_amount = hold.as_ref().map_or(order.amount, |hold| hold.amount);
        let stored = create_order_fields(
            &order.order_no,
            &order.payee_account_id,
            created_amount,
            &order.currency,
            &order.subject,
            self.command.expires_at.map(|_| order.expires_at),
        );
        let fields = differing_from(&self.fields(), &stored);
        if !fields.is_empty() {
            return Err(Error::KeyReused { key: ReusedKey::OrderNo, fields });
        }
        Ok(Some(order))
    }

    async fn body(&self, queries: &mut Queries<'_>, now: i64) -> Result<Inserted<OrderRow>, Error> {
        write_alone(self, queries, now).await
    }
}

/// A CloseOrder call: the order it closes.
#[derive(Clone)]
struct CloseOrder {
    merchant_id: MerchantId,
    order_no: OrderNo,
}

impl IdempotentCall for CloseOrder {
    type Answer = OrderRow;
    type Message = proto::CloseOrderResponse;
    const METHOD: &'static str = "CloseOrder";

    fn message(order: OrderRow) -> Result<Self::Message, Error> {
        Ok(proto::CloseOrderResponse { order: Some(response::order(order)?) })
    }

    fn scope(&self) -> Scope<'_> {
        Scope::Merchant(&self.merchant_id)
    }

    fn fields(&self) -> Fields {
        vec![("order_no", self.order_no.to_string())]
    }

    /// Closing a closed order changes nothing and answers the order as it stands.
    async fn replay_after_taken(&self, ledger: &Ledger) -> Result<Option<OrderRow>, Error> {
        let mut reader = ledger.store.reader().await?;
        let order = reader.queries().find_order(self.merchant_id.as_str(), self.order_no.as_str()).await?;
        reader.release();
        Ok(order)
    }

    async fn body(&self, queries: &mut Queries<'_>, now: i64) -> Result<Inserted<OrderRow>, Error> {
        write_alone(self, queries, now).await
    }
}

impl BatchWrite for CloseOrder {
    fn route(&self) -> &str {
        self.merchant_id.as_str()
    }

    /// None: a CloseOrder runs alone.
    fn batch_keys(&self, _read: &ReadFirst) -> Option<Vec<BatchKey>> {
        None
    }

    fn order_to_lock<'a>(&'a self, _read: &'a ReadFirst) -> Option<(&'a str, &'a str)> {
        Some((self.merchant_id.as_str(), self.order_no.as_str()))
    }

    /// An AUTHORIZED order's hold is released with it.
    fn reads_hold(&self) -> bool {
        true
    }

    fn accounts_to_lock<'a>(&'a self, rows: Rows<'a>) -> Vec<&'a str> {
        let authorized = rows.order.is_some_and(|order| order.status == OrderStatus::Authorized.as_str());
        match rows.hold {
            Some(hold) if authorized => vec![hold.payer_account_id.as_str()],
            _ => Vec::new(),
        }
    }

    /// The state machine says what closing means: a closed order is a replay (nothing
    /// written); a PENDING one is CLOSED by the merchant; an AUTHORIZED one too, its hold
    /// released ([`release`]).
    fn decide(&self, view: &mut View<'_>) -> Result<Box<dyn Accepted>, Outcome> {
        let (merchant_id, order_no) = (self.merchant_id.as_str(), self.order_no.as_str());
        let refused = |error: Error| Outcome::Rejected(error);
        let order = view.order(merchant_id, order_no).ok_or(refused(Error::NotFound(Resource::Order)))?.clone();
        let state = order_state(&order, view.now).map_err(refused)?;
        let Transition::To(next) = state.apply(OrderEvent::Close).map_err(|error| refused(error.into()))? else {
            return Err(Outcome::TakenBefore);
        };
        if order.status == OrderStatus::Authorized.as_str() {
            let hold = view.hold_of_order(merchant_id, order_no);
            let hold = hold.ok_or_else(|| refused(Error::Internal("an authorized order has no hold".into())))?.clone();
            let mut book = view.book.clone();
            let released = release(&order, &hold, OrderEvent::Close, view.now, &mut book).map_err(refused)?;
            let released = released
                .ok_or_else(|| refused(Error::Internal("closing an authorized order changed nothing".into())))?;
            view.book = book;
            return Ok(Box::new(ClosedWithHold(Released { released, before: hold })));
        }
        let reason =
            next.close_reason.ok_or_else(|| refused(Error::Internal("a closed order has no reason".into())))?;
        let order = OrderRow {
            status: next.status.as_str().to_owned(),
            close_reason: Some(reason.as_str().to_owned()),
            updated_at: view.now,
            ..order
        };
        Ok(Box::new(Closed { order, reason: reason.as_str() }))
    }
}

/// A PENDING order a CloseOrder closed, and why.
struct Closed {
    order: OrderRow,
    reason: &'static str,
}

impl Accepted for Closed {
    fn add_to<'s>(&'s self, set: &mut WriteSet<'s>) {
        let (merchant_id, order_no) = (self.order.merchant_id.as_str(), self.order.order_no.as_str());
        let to = OrderTo::ClosedFromPending { reason: self.reason };
        set.order_moves.push(OrderMove { merchant_id, order_no, to });
    }

    fn message(&self) -> Result<Option<Vec<u8>>, Error> {
        Ok(Some(CloseOrder::message(self.order.clone())?.encode_to_vec()))
    }

    fn answer(self: Box<Self>, _entries: &mut Entries, _locked: &Book) -> Result<(Answer, Option<Vec<u8>>), Error> {
        Ok((Box::new(self.order), None))
    }
}

/// An AUTHORIZED order a CloseOrder closed, its hold released.
struct ClosedWithHold(Released);

impl Accepted for ClosedWithHold {
    fn add_to<'s>(&'s self, set: &mut WriteSet<'s>) {
        self.0.add_to(set);
    }

    fn message(&self) -> Result<Option<Vec<u8>>, Error> {
        Ok(Some(CloseOrder::message(self.0.released.order.clone())?.encode_to_vec()))
    }

    fn answer(self: Box<Self>, _entries: &mut Entries, _locked: &Book) -> Result<(Answer, Option<Vec<u8>>), Error> {
        Ok((Box::new(self.0.released.order), None))
    }
}

impl Batchable for CloseOrder {
    fn write(&self) -> Box<dyn BatchWrite> {
        Box::new(self.clone())
    }
}

/// Pay's business fields, from a request or a stored payment.
fn pay_fields(out_trade_no: &str, order_no: &str, payer_account_id: &str, amount: i64, currency: &str) -> Fields {
    vec![
        ("out_trade_no", out_trade_no.to_owned()),
        ("order_no", order_no.to_owned()),
        ("payer_account_id", payer_account_id.to_owned()),
        ("amount", amount.to_string()),
        ("currency", currency.to_owned()),
    ]
}

fn pay_command_fields(command: &Pay) -> Fields {
    let Pay { merchant_id: _, out_trade_no, order_no, payer_account_id, amount, created_by: _ } = command;
    let currency = amount.currency().code();
    pay_fields(out_trade_no.as_str(), order_no.as_str(), payer_account_id.as_str(), amount.minor_units(), currency)
}

impl IdempotentCall for Identified<Pay> {
    type Answer = PayReceipt;
    type Message = proto::PayResponse;
    const METHOD: &'static str = "Pay";

    fn message(receipt: PayReceipt) -> Result<Self::Message, Error> {
        Ok(proto::PayResponse {
            payment: Some(response::payment(receipt.payment)?),
            order: Some(response::order(receipt.order)?),
        })
    }

    fn scope(&self) -> Scope<'_> {
        Scope::Merchant(&self.command.merchant_id)
    }

    fn fields(&self) -> Fields {
        pay_command_fields(&self.command)
    }

    async fn natural_replay(&self, ledger: &Ledger) -> Result<Option<PayReceipt>, Error> {
        ledger.pay_replay(&self.command).await
    }

    /// The taken key may be the order's one payment under another out_trade_no.
    async fn replay_after_taken(&self, ledger: &Ledger) -> Result<Option<PayReceipt>, Error> {
        ledger.pay_after_taken(&self.command).await.map(Some)
    }

    async fn body(&self, queries: &mut Queries<'_>, now: i64) -> Result<Inserted<PayReceipt>, Error> {
        write_alone(self, queries, now).await
    }
}

/// Refund's business fields, from a request or a stored refund.
fn refund_fields(out_trade_no: &str, out_refund_no: &str, amount: i64, currency: &str, reason: &str) -> Fields {
    vec![
        ("out_trade_no", out_trade_no.to_owned()),
        ("out_refund_no", out_refund_no.to_owned()),
        ("amount", amount.to_string()),
        ("currency", currency.to_owned()),
        ("reason", reason.to_owned()),
    ]
}

impl IdempotentCall for Identified<Refund> {
    type Answer = RefundReceipt;
    type Message = proto::RefundResponse;
    const METHOD: &'static str = "Refund";

    fn message(receipt: RefundReceipt) -> Result<Self::Message, Error> {
        Ok(proto::RefundResponse {
            refund: Some(response::refund(receipt.refund)?),
            order: Some(response::order(receipt.order)?),
        })
    }

    fn scope(&self) -> Scope<'_> {
        Scope::Merchant(&self.command.merchant_id)
    }

    fn fields(&self) -> Fields {
        let Refund { merchant_id: _, out_trade_no, out_refund_no, amount, reason, created_by: _ } = &self.command;
        let (minor_units, currency) = (amount.minor_units(), amount.currency().code());
        refund_fields(out_trade_no.as_str(), out_refund_no.as_str(), minor_units, currency, reason.as_str())
    }

    /// The refund as first recorded and its order as it stood right after it
    /// ([`order_as_refunded`]).
    async fn natural_replay(&self, ledger: &Ledger) -> Result<Option<RefundReceipt>, Error> {
        let mut reader = ledger.store.reader().await?;
        let mut queries = reader.queries();
        let merchant_id = self.command.merchant_id.as_str();
        let Some(refund) = queries.find_refund(merchant_id, self.command.out_refund_no.as_str()).await? else {
            return Ok(None);
        };
        let stored =
            refund_fields(&refund.out_trade_no, &refund.out_refund_no, refund.amount, &refund.currency, &refund.reason);
        let fields = differing_from(&self.fields(), &stored);
        if !fields.is_empty() {
            return Err(Error::KeyReused { key: ReusedKey::OutRefundNo, fields });
        }
        let found = queries.find_payment_and_order(merchant_id, &refund.out_trade_no).await?;
        reader.release();
        let (payment, order) = found.ok_or_else(|| Error::Internal("a refund's payment is missing".into()))?;
        let order = order_as_refunded(&refund, &payment, order)?;
        Ok(Some(RefundReceipt { refund, order }))
    }

    async fn body(&self, queries: &mut Queries<'_>, now: i64) -> Result<Inserted<RefundReceipt>, Error> {
        write_alone(self, queries, now).await
    }
}

/// What an order read under its row lock says about a Pay of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PayCheck {
    /// PENDING and the Pay's terms match: go on.
    Proceed,
    /// Already paid under this very out_trade_no: a replay.
    PaidByThisCall,
}

/// The order's side of a Pay judged at `now` (read after the order's row lock, see
/// `deadline_clock`): its currency and amount, payer and payee apart, and the state machine
/// (PENDING -> PAID, refused once the order's expires_at has passed).
///
/// # Errors
/// [`Rejection`]s CURRENCY_MISMATCH, AMOUNT_MISMATCH, PAYER_IS_PAYEE, ORDER_ALREADY_PAID,
/// ORDER_CLOSED, ORDER_EXPIRED.
pub(super) fn check_pay(order: &OrderRow, command: &Pay, now: i64) -> Result<PayCheck, Error> {
    if order.status != OrderStatus::Pending.as_str() {
        if order.out_trade_no.as_deref() == Some(command.out_trade_no.as_str()) {
            return Ok(PayCheck::PaidByThisCall);
        }
        // Moved on: the state machine's answer comes first (a captured order's amount is what
        // was captured, which a Pay of the order's original amount would not match).
        order_state(order, now)?.apply(OrderEvent::Pay)?;
        return Err(Error::Internal("the state machine let a Pay through an order that is not PENDING".into()));
    }
    if order.currency != command.amount.currency().code() {
        return Err(Rejection::CurrencyMismatch.into());
    }
    if order.amount != command.amount.minor_units() {
        return Err(Rejection::AmountMismatch.into());
    }
    if order.payee_account_id == command.payer_account_id.as_str() {
        return Err(Rejection::PayerIsPayee.into());
    }
    match order_state(order, now)?.apply(OrderEvent::Pay)? {
        Transition::To(_) => Ok(PayCheck::Proceed),
        Transition::AlreadyApplied => Err(Error::Internal("the state machine found a Pay already applied".into())),
    }
}

/// The payer's side of a Pay of `order`, checked before its money moves: the payer exists and
/// holds the order's currency (the legs' own rules are `balance_after`'s).
///
/// # Errors
/// [`Error::NotFound`] (ACCOUNT), [`Rejection::CurrencyMismatch`].
pub(super) fn check_payer(payer: Option<&AccountRow>, order: &OrderRow) -> Result<(), Error> {
    let payer = payer.ok_or(Error::NotFound(Resource::Account))?;
    if payer.currency != order.currency {
        return Err(Rejection::CurrencyMismatch.into());
    }
    Ok(())
}

/// A Refund's side of its payment, checked before anything else: it refunds in the payment's
/// currency.
///
/// # Errors
/// [`Rejection::CurrencyMismatch`].
pub(super) fn check_refund(command: &Refund, payment: &PaymentRow) -> Result<(), Error> {
    if payment.currency != command.amount.currency().code() {
        return Err(Rejection::CurrencyMismatch.into());
    }
    Ok(())
}

/// The payment row of a Pay of `order`, as it is recorded when the Pay succeeds.
pub(super) fn new_payment(command: &Pay, order: &OrderRow, trade_no: &str, now: i64) -> PaymentRow {
    PaymentRow {
        trade_no: trade_no.to_owned(),
        merchant_id: command.merchant_id.as_str().to_owned(),
        out_trade_no: command.out_trade_no.as_str().to_owned(),
        order_no: command.order_no.as_str().to_owned(),
        payer_account_id: command.payer_account_id.as_str().to_owned(),
        payee_account_id: order.payee_account_id.clone(),
        amount: order.amount,
        currency: order.currency.clone(),
        status: PAYMENT_SUCCEEDED.to_owned(),
        created_at: now,
        created_by: command.created_by.created_by().to_owned(),
    }
}

/// The posting of a payment (a Pay's or a Capture's): its amount from the payer to the payee.
pub(super) fn payment_posting(payment: &PaymentRow) -> Posting<'_> {
    Posting {
        posting_id: &payment.trade_no,
        kind: EntryKind::Pay,
        reference: &payment.out_trade_no,
        from_account_id: &payment.payer_account_id,
        to_account_id: &payment.payee_account_id,
        amount: payment.amount,
        currency: &payment.currency,
        created_by: &payment.created_by,
    }
}

/// The answer to a Pay that just committed: its payment, and the order as read under its lock
/// moved to PAID ([`order_as_paid`]).
pub(super) fn paid_receipt(payment: PaymentRow, order: OrderRow) -> PayReceipt {
    PayReceipt { order: order_as_paid(&payment, order), payment }
}

/// `order` as it stood right after the Pay or Capture that recorded `payment` moved it to PAID,
/// at the payment's `created_at`: what only later steps change (its status and refunded
/// amount by refunds, `updated_at`) set back; its terms never change once it is paid. So a
/// replay answers the order the original answered, from today's row.
pub(super) fn order_as_paid(payment: &PaymentRow, order: OrderRow) -> OrderRow {
    OrderRow {
        status: OrderStatus::Paid.as_str().to_owned(),
        out_trade_no: Some(payment.out_trade_no.clone()),
        refunded_amount: 0,
        updated_at: payment.created_at,
        close_reason: None,
        ..order
    }
}

/// `order` as it stood right after `refund`: paid, with what the refund recorded its order had
/// refunded then, as one refund of the paid order by the state machine ([`refunded_order`]);
/// a refund recorded before that column has only `order` as it stands.
fn order_as_refunded(refund: &RefundRow, payment: &PaymentRow, order: OrderRow) -> Result<OrderRow, Error> {
    let Some(refunded_after) = refund.order_refunded_after else { return Ok(order) };
    refunded_order(order_as_paid(payment, order), refunded_after, refund.created_at)
}

/// The refund row of a Refund of `payment`, as it is recorded when the Refund succeeds, but
/// for what its order has refunded after it (`None`: the decision sets it).
pub(super) fn new_refund(command: &Refund, payment: &PaymentRow, refund_no: &str, now: i64) -> RefundRow {
    RefundRow {
        refund_no: refund_no.to_owned(),
        merchant_id: command.merchant_id.as_str().to_owned(),
        out_refund_no: command.out_refund_no.as_str().to_owned(),
        out_trade_no: payment.out_trade_no.clone(),
        order_no: payment.order_no.clone(),
        amount: command.amount.minor_units(),
        currency: payment.currency.clone(),
        reason: command.reason.as_str().to_owned(),
        created_at: now,
        created_by: command.created_by.created_by().to_owned(),
        order_refunded_after: None,
    }
}

/// The posting of a refund of `payment`: its amount back from the payment's payee to its payer.
pub(super) fn refund_posting<'a>(refund: &'a RefundRow, payment: &'a PaymentRow) -> Posting<'a> {
    Posting {
        posting_id: &refund.refund_no,
        kind: EntryKind::Refund,
        reference: &refund.out_refund_no,
        from_account_id: &payment.payee_account_id,
        to_account_id: &payment.payer_account_id,
        amount: refund.amount,
        currency: &refund.currency,
        created_by: &refund.created_by,
    }
}

/// The order after a refund of `amount` minor units at `now`, by the state machine (PAID or
/// PARTIALLY_REFUNDED to PARTIALLY_REFUNDED or REFUNDED, the refunded amount within the
/// order's amount).
///
/// # Errors
/// The state machine's [`Rejection`]s: REFUND_EXCEEDS_PAID, and an order in a state that
/// takes no refund.
pub(super) fn refunded_order(order: OrderRow, amount: i64, now: i64) -> Result<OrderRow, Error> {
    let from = order_state(&order, now)?;
    let Transition::To(to) = from.apply(OrderEvent::Refund { amount_minor_units: amount })? else {
        return Err(Error::Internal("a refund is never already applied".into()));
    };
    Ok(OrderRow {
        status: to.status.as_str().to_owned(),
        refunded_amount: to.refunded_minor_units,
        updated_at: now,
        ..order
    })
}
