//! Authorization holds (two-phase payments). Authorize reserves an order's amount on the
//! payer's account (`held` grows, the balance does not; the order goes PENDING -> AUTHORIZED);
//! Capture pays all or part of it exactly as a Pay would (a payment under its out_trade_no,
//! the order PAID) and releases the rest; Void, CloseOrder and the hold sweeper release it and
//! close the order.
//!
//! Each step is a write of the engine's group commit, run alone (`BatchWrite`): its order
//! locked first, then its hold read under that lock, then the payer (and a Capture's payee);
//! how the engine writes it is explained once, in `docs/write-engine.md` ("Which calls").

use crate::domain::{CloseReason, OrderEvent, OrderStatus, Rejection, Transition};
use crate::error::{Error, Resource, ReusedKey};
use crate::proto;
use crate::store::{HoldRow, OrderRow, PaymentRow, Queries, RowLocks};

use super::commands::{Authorize, Capture, Void};
use super::engine::book::{self, Book, OrderMove, OrderTo, SettledHold, WriteSet};
use super::engine::group_commit::{
    write_alone, Accepted, Answer, BatchKey, BatchWrite, Batchable, Entries, Outcome, ReadFirst, Rows, View,
};
use super::engine::posting::Legs;

use super::guards::{Guards, Scope};
use super::idempotent::{differing_from, Fields, IdempotentCall};
use super::payments::{order_as_paid, order_state_with_hold, payment_posting, PAYMENT_SUCCEEDED};
use super::response;
use super::{new_id, now_micros, Identified, Inserted, Ledger, Replayable};
use prost::Message as _;

/// Stored statuses of a hold.
pub(crate) const HOLD_ACTIVE: &str = "ACTIVE";
pub(crate) const HOLD_CAPTURED: &str = "CAPTURED";
pub(crate) const HOLD_VOIDED: &str = "VOIDED";
pub(crate) const HOLD_EXPIRED: &str = "EXPIRED";

/// The answer to an Authorize or a Void: the hold and its order as they stand.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HoldReceipt {
    pub hold: HoldRow,
    pub order: OrderRow,
}

/// The answer to a Capture: its payment (as first recorded), the order and the hold.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CaptureReceipt {
    pub payment: PaymentRow,
    pub order: OrderRow,
    pub hold: HoldRow,
}

impl Ledger {
    /// Reserves an order's amount on the payer's account, once per (merchant_id, out_auth_no);
    /// the hold lasts `LedgerSettings::hold_ttl`.
    ///
    /// # Errors
    /// [`Error::NotFound`] (order, payer); [`Rejection`]s AMOUNT_MISMATCH, CURRENCY_MISMATCH,
    /// PAYER_IS_PAYEE, INSUFFICIENT_FUNDS (the available balance is short), ORDER_EXPIRED,
    /// ORDER_AUTHORIZED (another hold), ORDER_ALREADY_PAID, ORDER_CLOSED;
    /// [`Error::KeyReused`] (OUT_AUTH_NO_REUSED).
    pub async fn authorize(
        &self,
        command: Authorize,
        guards: &Guards,
    ) -> Result<Replayable<proto::AuthorizeResponse>, Error> {
        let ttl = i64::try_from(self.settings.hold_ttl.as_micros()).unwrap_or(i64::MAX);
        self.run_idempotent(&NewHold { command, hold_no: new_id('H'), ttl }, guards).await
    }

    /// Pays all or part of a hold as a payment under out_trade_no and releases the rest, once
    /// per (merchant_id, out_trade_no).
    ///
    /// # Errors
    /// [`Error::NotFound`] (HOLD_NOT_FOUND); [`Rejection`]s CAPTURE_EXCEEDS_AUTHORIZED,
    /// CURRENCY_MISMATCH, HOLD_EXPIRED, HOLD_VOIDED, ORDER_CLOSED, ORDER_ALREADY_PAID (captured
    /// under another out_trade_no); [`Error::KeyReused`] (OUT_TRADE_NO_REUSED).
    pub async fn capture(
        &self,
        command: Capture,
        guards: &Guards,
    ) -> Result<Replayable<proto::CaptureResponse>, Error> {
        self.run_idempotent(&Identified { command, id: new_id('T') }, guards).await
    }

    /// Releases a hold and closes its order (reason VOIDED); a released hold is answered as
    /// it stands (replayed).
    ///
    /// # Errors
    /// [`Error::NotFound`] (HOLD_NOT_FOUND); [`Rejection::OrderAlreadyPaid`] once captured.
    pub async fn void(&self, command: Void, guards: &Guards) -> Result<Replayable<proto::VoidResponse>, Error> {
        self.run_idempotent(&command, guards).await
    }

    /// One sweep of the hold sweeper: releases every ACTIVE hold whose `expires_at` is at or
    /// before now (hold EXPIRED, order CLOSED with reason HOLD_EXPIRED), at most `batch_size`
    /// per transaction. Each order's row is locked first, as every hold step does, so a
    /// Capture racing the sweeper ends with one winner: the hold CAPTURED (the sweeper skips
    /// it) or EXPIRED (the Capture is told HOLD_EXPIRED). An order another transaction holds is
    /// skipped (`FOR UPDATE SKIP LOCKED`), never waited for.
    ///
    /// # Errors
    /// [`Error::Database`]; what was released before stays released.
    pub async fn release_expired_holds(&self, batch_size: u32) -> Result<(u64, u64), Error> {
        let now = now_micros();
        let limit = i64::from(batch_size.max(1));
        let (mut released, mut skipped) = (0, 0);
        loop {
            let released_before = released;
            let mut tx = self.store.begin().await?;
            let mut keys = tx.queries().find_expired_holds(now, limit).await?;
            keys.sort();
            for (merchant_id, order_no) in &keys {
                let mut queries = tx.queries();
                // An order another transaction holds (a Capture in flight) is left to the next sweep.
                let Some(order) = queries.try_lock_order(merchant_id, order_no).await? else {
                    skipped += 1;
                    continue;
                };
                let hold = queries.find_hold_of_order(merchant_id, order_no).await?;
                let outcome = match &hold {
                    Some(hold) if hold.status == HOLD_ACTIVE => release_expired(&mut queries, &order, hold, now).await,
                    _ => Ok(None),
                };
                match outcome {
                    Ok(Some(_)) => released += 1,
                    Ok(None) | Err(Error::Rejected(_)) => skipped += 1,
                    Err(error) => return Err(error),
                }
            }
            tx.commit().await?;
            // A short batch was the last; a batch that released nothing (all of it held by other
            // transactions) is left to the next sweep rather than read again at once.
            if keys.len() < usize::try_from(limit).unwrap_or(usize::MAX) || released == released_before {
                break;
            }
        }
        self.metrics.holds_expired.inc_by(released);
        Ok((released, skipped))
    }
}

/// An ACTIVE hold released with its order closed: the hold and order as the release leaves
/// them, and the hold's new status and the order's close reason.
pub(super) struct Release {
    pub(super) hold: HoldRow,
    pub(super) order: OrderRow,
    status: &'static str,
    reason: &'static str,
}

/// Releases an ACTIVE `hold` of `order` (both as read under the order's lock) for `event` in
/// `book` (the payer locked): Void (hold VOIDED, order CLOSED as VOIDED), Close (hold VOIDED,
/// order CLOSED by the merchant) or HoldExpire (hold EXPIRED, order CLOSED as HOLD_EXPIRED).
/// `None` when the event is already in effect (nothing to write).
///
/// # Errors
/// The state machine's [`Rejection`] (ORDER_ALREADY_PAID once captured, HOLD_NOT_EXPIRED for
/// an early sweep); [`Error::Contention`] if the hold is no longer ACTIVE.
pub(super) fn release(
    order: &OrderRow,
    hold: &HoldRow,
    event: OrderEvent,
    now: i64,
    book: &mut Book,
) -> Result<Option<Release>, Error> {
    let Transition::To(next) = order_state_with_hold(order, Some(hold), now)?.apply(event)? else {
        return Ok(None);
    };
    let reason = next.close_reason.ok_or_else(|| Error::Internal("a released hold's order is not closed".into()))?;
    let status = if reason == CloseReason::HoldExpired { HOLD_EXPIRED } else { HOLD_VOIDED };
    if hold.status != HOLD_ACTIVE {
        return Err(Error::Contention);
    }
    book.release(hold)?;
    let hold = HoldRow { status: status.to_owned(), updated_at: now, ..hold.clone() };
    let order = OrderRow {
        status: OrderStatus::Closed.as_str().to_owned(),
        close_reason: Some(reason.as_str().to_owned()),
        updated_at: now,
        ..order.clone()
    };
    Ok(Some(Release { hold, order, status, reason: reason.as_str() }))
}

impl Release {
    /// Its order closed from AUTHORIZED and its hold (`before`: as read under the order's
    /// lock) settled, into `set`.
    pub(super) fn add_to<'s>(&'s self, before: &'s HoldRow, set: &mut WriteSet<'s>) {
        let (merchant_id, order_no) = (self.order.merchant_id.as_str(), self.order.order_no.as_str());
        set.order_moves.push(OrderMove {
            merchant_id,
            order_no,
            to: OrderTo::ClosedFromAuthorized { reason: self.reason },
        });
        set.settled_holds.push(SettledHold {
            hold: before,
            status: self.status,
            captured_amount: 0,
            out_trade_no: None,
        });
    }
}

/// The sweeper's release of an expired ACTIVE `hold` of `order` (locked by this
/// transaction): its payer locked, [`release`], and the write set written through the engine.
/// `None` when there was nothing to release.
///
/// # Errors
/// As [`release`]; [`Error::InvariantBroken`] (nothing written); [`Error::Contention`] if a
/// row moved under its lock.
async fn release_expired(
    queries: &mut Queries<'_>,
    order: &OrderRow,
    hold: &HoldRow,
    now: i64,
) -> Result<Option<Release>, Error> {
    let mut book = Book::locked(queries.lock_accounts(&[hold.payer_account_id.as_str()], RowLocks::Taken).await?);
    let Some(released) = release(order, hold, OrderEvent::HoldExpire, now, &mut book)? else { return Ok(None) };
    let mut set = WriteSet::default();
    released.add_to(hold, &mut set);
    if book::write(queries, &set, &book, now).await?.is_none() {
        return Err(Error::Contention);
    }
    Ok(Some(released))
}

/// The answer an Authorize gave, from its hold and order as they stand: the hold ACTIVE as
/// placed and its order AUTHORIZED for the hold's amount, both at the hold's `created_at`, with
/// what only later steps change (a capture, a release, the order's payment, refunds or close)
/// set back.
fn authorized_receipt(hold: HoldRow, order: OrderRow) -> HoldReceipt {
    let order = OrderRow {
        status: OrderStatus::Authorized.as_str().to_owned(),
        amount: hold.amount,
        out_trade_no: None,
        refunded_amount: 0,
        updated_at: hold.created_at,
        close_reason: None,
        ..order
    };
    let hold = HoldRow {
        status: HOLD_ACTIVE.to_owned(),
        captured_amount: 0,
        out_trade_no: None,
        updated_at: hold.created_at,
        ..hold
    };
    HoldReceipt { hold, order }
}

/// The hold of (merchant_id, out_auth_no) and its order as they stand.
async fn hold_and_order(
    queries: &mut Queries<'_>,
    merchant_id: &str,
    out_auth_no: &str,
) -> Result<(HoldRow, OrderRow), Error> {
    let hold = queries.find_hold(merchant_id, out_auth_no).await?.ok_or(Error::NotFound(Resource::Hold))?;
    let order = queries.find_order(merchant_id, &hold.order_no).await?;
    let order = order.ok_or_else(|| Error::Internal("a hold's order is missing".into()))?;
    Ok((hold, order))
}

/// A hold step's hold, read before its order's lock (it names the order), into `read`.
async fn read_hold(
    queries: &mut Queries<'_>,
    read: &mut ReadFirst,
    merchant_id: &str,
    out_auth_no: &str,
) -> Result<(), Error> {
    if let Some(hold) = queries.find_hold(merchant_id, out_auth_no).await? {
        read.add_hold(hold);
    }
    Ok(())
}

/// A hold step's hold and its order, as read under the order's lock; HOLD_NOT_FOUND when the
/// hold was not read first.
fn locked_hold_and_order(
    view: &View<'_>,
    merchant_id: &str,
    out_auth_no: &str,
) -> Result<(HoldRow, OrderRow), Outcome> {
    let first = view.read_first().hold(merchant_id, out_auth_no);
    let first = first.ok_or(Outcome::Rejected(Error::NotFound(Resource::Hold)))?;
    let internal = |what: &str| Outcome::Rejected(Error::Internal(what.into()));
    let order = view.order(merchant_id, &first.order_no).ok_or_else(|| internal("a hold's order is missing"))?;
    let hold = view.hold_of_order(merchant_id, &first.order_no);
    let hold = hold.ok_or_else(|| internal("a hold vanished under its order's lock"))?;
    Ok((hold.clone(), order.clone()))
}

/// The order a hold step locks: its hold's, as read first.
fn order_of_hold<'a>(read: &'a ReadFirst, merchant_id: &'a str, out_auth_no: &str) -> Option<(&'a str, &'a str)> {
    read.hold(merchant_id, out_auth_no).map(|hold| (merchant_id, hold.order_no.as_str()))
}

/// Authorize's business fields, from a request or a stored hold.
fn authorize_fields(out_auth_no: &str, order_no: &str, payer: &str, amount: i64, currency: &str) -> Fields {
    vec![
        ("out_auth_no", out_auth_no.to_owned()),
        ("order_no", order_no.to_owned()),
        ("payer_account_id", payer.to_owned()),
        ("amount", amount.to_string()),
        ("currency", currency.to_owned()),
    ]
}

/// An Authorize call with the id of its hold and the hold's lifetime (microseconds).
#[derive(Clone)]
struct NewHold {
    command: Authorize,
    hold_no: String,
    ttl: i64,
}

impl IdempotentCall for NewHold {
    type Answer = HoldReceipt;
    type Message = proto::AuthorizeResponse;
    const METHOD: &'static str = "Authorize";

    fn message(receipt: HoldReceipt) -> Result<Self::Message, Error> {
        Ok(proto::AuthorizeResponse {
            hold: Some(response::hold(receipt.hold)?),
            order: Some(response::order(receipt.order)?),
        })
    }

    fn scope(&self) -> Scope<'_> {
        Scope::Merchant(&self.command.merchant_id)
    }

    fn fields(&self) -> Fields {
        let Authorize { out_auth_no, order_no, payer_account_id, amount, .. } = &self.command;
        let currency = amount.currency().code();
        authorize_fields(
            out_auth_no.as_str(),
            order_no.as_str(),
            payer_account_id.as_str(),
            amount.minor_units(),
            currency,
        )
    }

    async fn natural_replay(&self, ledger: &Ledger) -> Result<Option<HoldReceipt>, Error> {
        let mut reader = ledger.store.reader().await?;
        let mut queries = reader.queries();
        let (merchant_id, out_auth_no) = (self.command.merchant_id.as_str(), self.command.out_auth_no.as_str());
        if queries.find_hold(merchant_id, out_auth_no).await?.is_none() {
            return Ok(None);
        }
        let (hold, order) = hold_and_order(&mut queries, merchant_id, out_auth_no).await?;
        let stored =
            authorize_fields(&hold.out_auth_no, &hold.order_no, &hold.payer_account_id, hold.amount, &hold.currency);
        let fields = differing_from(&self.fields(), &stored);
        if !fields.is_empty() {
            return Err(Error::KeyReused { key: ReusedKey::OutAuthNo, fields });
        }
        Ok(Some(authorized_receipt(hold, order)))
    }

    async fn body(&self, queries: &mut Queries<'_>, now: i64) -> Result<Inserted<HoldReceipt>, Error> {
        write_alone(self, queries, now).await
    }
}

/// Capture's business fields, from a request or a stored payment and hold.
fn capture_fields(out_auth_no: &str, out_trade_no: &str, amount: i64, currency: &str) -> Fields {
    vec![
        ("out_auth_no", out_auth_no.to_owned()),
        ("out_trade_no", out_trade_no.to_owned()),
        ("amount", amount.to_string()),
        ("currency", currency.to_owned()),
    ]
}

impl IdempotentCall for Identified<Capture> {
    type Answer = CaptureReceipt;
    type Message = proto::CaptureResponse;
    const METHOD: &'static str = "Capture";

    fn message(receipt: CaptureReceipt) -> Result<Self::Message, Error> {
        Ok(proto::CaptureResponse {
            payment: Some(response::payment(receipt.payment)?),
            order: Some(response::order(receipt.order)?),
            hold: Some(response::hold(receipt.hold)?),
        })
    }

    fn scope(&self) -> Scope<'_> {
        Scope::Merchant(&self.command.merchant_id)
    }

    fn fields(&self) -> Fields {
        let Capture { out_auth_no, out_trade_no, amount, .. } = &self.command;
        capture_fields(out_auth_no.as_str(), out_trade_no.as_str(), amount.minor_units(), amount.currency().code())
    }

    /// The payment of this out_trade_no, when it is this hold's capture (another payment
    /// under it is OUT_TRADE_NO_REUSED).
    async fn natural_replay(&self, ledger: &Ledger) -> Result<Option<CaptureReceipt>, Error> {
        let mut reader = ledger.store.reader().await?;
        let mut queries = reader.queries();
        let merchant_id = self.command.merchant_id.as_str();
        let Some((payment, order)) =
            queries.find_payment_and_order(merchant_id, self.command.out_trade_no.as_str()).await?
        else {
            return Ok(None);
        };
        let hold = queries.find_hold_of_order(merchant_id, &payment.order_no).await?;
        let captured_hold = hold.as_ref().filter(|hold| hold.out_trade_no.as_deref() == Some(&payment.out_trade_no));
        let out_auth_no = captured_hold.map_or("", |hold| hold.out_auth_no.as_str());
        let stored = capture_fields(out_auth_no, &payment.out_trade_no, payment.amount, &payment.currency);
        let fields = differing_from(&self.fields(), &stored);
        if !fields.is_empty() {
            return Err(Error::KeyReused { key: ReusedKey::OutTradeNo, fields });
        }
        let hold = hold.ok_or_else(|| Error::Internal("a capture's hold is missing".into()))?;
        // A captured hold never changes again: as it stands is as the capture left it.
        Ok(Some(CaptureReceipt { order: order_as_paid(&payment, order), payment, hold }))
    }

    /// The taken key may be the order's one payment under another out_trade_no: the state
    /// machine says why the capture cannot happen.
    async fn replay_after_taken(&self, ledger: &Ledger) -> Result<Option<CaptureReceipt>, Error> {
        if let Some(receipt) = self.natural_replay(ledger).await? {
            return Ok(Some(receipt));
        }
        let mut reader = ledger.store.reader().await?;
        let mut queries = reader.queries();
        let (merchant_id, out_auth_no) = (self.command.merchant_id.as_str(), self.command.out_auth_no.as_str());
        let (hold, order) = hold_and_order(&mut queries, merchant_id, out_auth_no).await?;
        let capture = OrderEvent::Capture { amount_minor_units: self.command.amount.minor_units() };
        order_state_with_hold(&order, Some(&hold), now_micros())?.apply(capture)?;
        Ok(None)
    }

    async fn body(&self, queries: &mut Queries<'_>, now: i64) -> Result<Inserted<CaptureReceipt>, Error> {
        write_alone(self, queries, now).await
    }
}

impl IdempotentCall for Void {
    type Answer = HoldReceipt;
    type Message = proto::VoidResponse;
    const METHOD: &'static str = "Void";

    fn message(receipt: HoldReceipt) -> Result<Self::Message, Error> {
        Ok(proto::VoidResponse {
            hold: Some(response::hold(receipt.hold)?),
            order: Some(response::order(receipt.order)?),
        })
    }

    fn scope(&self) -> Scope<'_> {
        Scope::Merchant(&self.merchant_id)
    }

    fn fields(&self) -> Fields {
        vec![("out_auth_no", self.out_auth_no.to_string())]
    }

    /// Voiding a released hold changes nothing and answers it as it stands.
    async fn replay_after_taken(&self, ledger: &Ledger) -> Result<Option<HoldReceipt>, Error> {
        let mut reader = ledger.store.reader().await?;
        let mut queries = reader.queries();
        let (hold, order) = hold_and_order(&mut queries, self.merchant_id.as_str(), self.out_auth_no.as_str()).await?;
        Ok(Some(HoldReceipt { hold, order }))
    }

    async fn body(&self, queries: &mut Queries<'_>, now: i64) -> Result<Inserted<HoldReceipt>, Error> {
        write_alone(self, queries, now).await
    }
}

impl NewHold {
    /// The hold it places on `order` at `now`.
    fn hold(&self, order: &OrderRow, now: i64) -> HoldRow {
        let command = &self.command;
        HoldRow {
            hold_no: self.hold_no.clone(),
            merchant_id: command.merchant_id.as_str().to_owned(),
            out_auth_no: command.out_auth_no.as_str().to_owned(),
            order_no: command.order_no.as_str().to_owned(),
            payer_account_id: command.payer_account_id.as_str().to_owned(),
            amount: order.amount,
            currency: order.currency.clone(),
            status: HOLD_ACTIVE.to_owned(),
            captured_amount: 0,
            out_trade_no: None,
            expires_at: now.saturating_add(self.ttl),
            created_at: now,
            updated_at: now,
            created_by: command.created_by.created_by().to_owned(),
        }
    }
}

impl BatchWrite for NewHold {
    fn route(&self) -> &str {
        self.command.merchant_id.as_str()
    }

    /// None: a hold step runs alone.
    fn batch_keys(&self, _read: &ReadFirst) -> Option<Vec<BatchKey>> {
        None
    }

    fn order_to_lock<'a>(&'a self, _read: &'a ReadFirst) -> Option<(&'a str, &'a str)> {
        Some((self.command.merchant_id.as_str(), self.command.order_no.as_str()))
    }

    fn reads_hold(&self) -> bool {
        true
    }

    fn accounts_to_lock<'a>(&'a self, _rows: Rows<'a>) -> Vec<&'a str> {
        vec![self.command.payer_account_id.as_str()]
    }

    /// Its order's hold under this out_auth_no is a replay; then the state machine (an order
    /// that moved on is refused as such, whatever the request's amount), the order's terms,
    /// the payer's currency, and the hold reserved on the payer ([`Book::reserve`]).
    fn decide(&self, view: &mut View<'_>) -> Result<Box<dyn Accepted>, Outcome> {
        let command = &self.command;
        let (merchant_id, order_no) = (command.merchant_id.as_str(), command.order_no.as_str());
        let order =
            view.order(merchant_id, order_no).ok_or(Outcome::Rejected(Error::NotFound(Resource::Order)))?.clone();
        let hold = view.hold_of_order(merchant_id, order_no);
        if hold.is_some_and(|hold| hold.out_auth_no == command.out_auth_no.as_str()) {
            return Err(Outcome::TakenBefore);
        }
        let refused = |error: Error| Outcome::Rejected(error);
        let state = order_state_with_hold(&order, hold, view.checked_at).map_err(refused)?;
        let Transition::To(next) = state.apply(OrderEvent::Authorize).map_err(|error| refused(error.into()))? else {
            return Err(refused(Error::Internal("the state machine found an Authorize already applied".into())));
        };
        if order.currency != command.amount.currency().code() {
            return Err(refused(Rejection::CurrencyMismatch.into()));
        }
        if order.amount != command.amount.minor_units() {
            return Err(refused(Rejection::AmountMismatch.into()));
        }
        if order.payee_account_id == command.payer_account_id.as_str() {
            return Err(refused(Rejection::PayerIsPayee.into()));
        }
        let payer =
            view.book.get(command.payer_account_id.as_str()).ok_or(refused(Error::NotFound(Resource::Account)))?;
        if payer.currency != order.currency {
            return Err(refused(Rejection::CurrencyMismatch.into()));
        }
        let hold = self.hold(&order, view.now);
        view.book.reserve(&hold).map_err(refused)?;
        let order = OrderRow { status: next.status.as_str().to_owned(), updated_at: view.now, ..order };
        Ok(Box::new(Authorized(HoldReceipt { hold, order })))
    }
}

/// An Authorize accepted: its new hold, and its order AUTHORIZED.
struct Authorized(HoldReceipt);

impl Accepted for Authorized {
    fn add_to<'s>(&'s self, set: &mut WriteSet<'s>) {
        let order = &self.0.order;
        set.holds.push(self.0.hold.clone());
        set.order_moves.push(OrderMove {
            merchant_id: &order.merchant_id,
            order_no: &order.order_no,
            to: OrderTo::Authorized,
        });
    }

    fn message(&self) -> Result<Option<Vec<u8>>, Error> {
        Ok(Some(NewHold::message(self.0.clone())?.encode_to_vec()))
    }

    fn answer(self: Box<Self>, _entries: &mut Entries, _locked: &Book) -> Result<(Answer, Option<Vec<u8>>), Error> {
        Ok((Box::new(self.0), None))
    }
}

impl Batchable for NewHold {
    fn write(&self) -> Box<dyn BatchWrite> {
        Box::new(self.clone())
    }

    /// Refused for its payer's funds, its hold is inserted before the refusal is answered
    /// (the transaction rolls back with it): an original of its out_auth_no still in flight on
    /// another order is waited for and answers instead (a replay, or OUT_AUTH_NO_REUSED).
    async fn key_taken_in_flight(
        &self,
        queries: &mut Queries<'_>,
        _read: &ReadFirst,
        refusal: &Error,
        now: i64,
    ) -> Result<bool, Error> {
        if !matches!(refusal, Error::Rejected(Rejection::InsufficientFunds)) {
            return Ok(false);
        }
        let command = &self.command;
        Ok(match queries.find_order(command.merchant_id.as_str(), command.order_no.as_str()).await? {
            Some(order) => !queries.insert_hold(&self.hold(&order, now)).await?,
            None => false,
        })
    }
}

impl BatchWrite for Identified<Capture> {
    fn route(&self) -> &str {
        self.command.merchant_id.as_str()
    }

    fn batch_keys(&self, _read: &ReadFirst) -> Option<Vec<BatchKey>> {
        None
    }

    fn order_to_lock<'a>(&'a self, read: &'a ReadFirst) -> Option<(&'a str, &'a str)> {
        order_of_hold(read, self.command.merchant_id.as_str(), self.command.out_auth_no.as_str())
    }

    fn reads_hold(&self) -> bool {
        true
    }

    /// Its payer and payee, in account_id order.
    fn accounts_to_lock<'a>(&'a self, rows: Rows<'a>) -> Vec<&'a str> {
        match (rows.hold, rows.order) {
            (Some(hold), Some(order)) => vec![hold.payer_account_id.as_str(), order.payee_account_id.as_str()],
            _ => Vec::new(),
        }
    }

    /// The hold's currency; its order already paid under this out_trade_no is a replay; the
    /// state machine; then the whole hold released (so the payer's leg sees what stays
    /// reserved by its other holds only) and the captured amount posted, as a Pay's payment.
    fn decide(&self, view: &mut View<'_>) -> Result<Box<dyn Accepted>, Outcome> {
        let Identified { command, id: trade_no } = self;
        let merchant_id = command.merchant_id.as_str();
        let (hold, order) = locked_hold_and_order(view, merchant_id, command.out_auth_no.as_str())?;
        let refused = |error: Error| Outcome::Rejected(error);
        if hold.currency != command.amount.currency().code() {
            return Err(refused(Rejection::CurrencyMismatch.into()));
        }
        if order.status != OrderStatus::Authorized.as_str()
            && order.out_trade_no.as_deref() == Some(command.out_trade_no.as_str())
        {
            return Err(Outcome::TakenBefore);
        }
        let captured = command.amount.minor_units();
        let capture = OrderEvent::Capture { amount_minor_units: captured };
        let state = order_state_with_hold(&order, Some(&hold), view.checked_at).map_err(refused)?;
        let Transition::To(next) = state.apply(capture).map_err(|error| refused(error.into()))? else {
            return Err(refused(Error::Internal("the state machine found a Capture already applied".into())));
        };
        let now = view.now;
        let payment = PaymentRow {
            trade_no: trade_no.clone(),
            merchant_id: merchant_id.to_owned(),
            out_trade_no: command.out_trade_no.as_str().to_owned(),
            order_no: order.order_no.clone(),
            payer_account_id: hold.payer_account_id.clone(),
            payee_account_id: order.payee_account_id.clone(),
            amount: captured,
            currency: hold.currency.clone(),
            status: PAYMENT_SUCCEEDED.to_owned(),
            created_at: now,
            created_by: command.created_by.created_by().to_owned(),
        };
        let mut book = view.book.clone();
        book.release(&hold).map_err(refused)?;
        let legs = book.post(&payment_posting(&payment)).map_err(refused)?;
        view.book = book;
        let order = OrderRow {
            status: next.status.as_str().to_owned(),
            amount: captured,
            out_trade_no: Some(payment.out_trade_no.clone()),
            updated_at: now,
            ..order
        };
        let captured_hold = HoldRow {
            status: HOLD_CAPTURED.to_owned(),
            captured_amount: captured,
            out_trade_no: Some(payment.out_trade_no.clone()),
            updated_at: now,
            ..hold.clone()
        };
        Ok(Box::new(Captured { receipt: CaptureReceipt { payment, order, hold: captured_hold }, before: hold, legs }))
    }
}

/// A Capture accepted: its receipt, its hold as read under the order's lock, and its legs.
struct Captured {
    receipt: CaptureReceipt,
    before: HoldRow,
    legs: Legs,
}

impl Accepted for Captured {
    fn add_to<'s>(&'s self, set: &mut WriteSet<'s>) {
        let CaptureReceipt { payment, order, .. } = &self.receipt;
        let out_trade_no = payment.out_trade_no.as_str();
        set.captured_payments.push(payment.clone());
        let to = OrderTo::Captured { out_trade_no, amount: payment.amount };
        set.order_moves.push(OrderMove { merchant_id: &order.merchant_id, order_no: &order.order_no, to });
        let settled = SettledHold {
            hold: &self.before,
            status: HOLD_CAPTURED,
            captured_amount: payment.amount,
            out_trade_no: Some(out_trade_no),
        };
        set.settled_holds.push(settled);
        set.postings.push((payment_posting(payment), self.legs));
    }

    fn message(&self) -> Result<Option<Vec<u8>>, Error> {
        Ok(Some(<Identified<Capture> as IdempotentCall>::message(self.receipt.clone())?.encode_to_vec()))
    }

    fn answer(self: Box<Self>, _entries: &mut Entries, _locked: &Book) -> Result<(Answer, Option<Vec<u8>>), Error> {
        Ok((Box::new(self.receipt), None))
    }
}

impl Batchable for Identified<Capture> {
    fn write(&self) -> Box<dyn BatchWrite> {
        Box::new(self.clone())
    }

    async fn before_alone(&self, queries: &mut Queries<'_>, read: &mut ReadFirst, _now: i64) -> Result<(), Error> {
        read_hold(queries, read, self.command.merchant_id.as_str(), self.command.out_auth_no.as_str()).await
    }
}

impl BatchWrite for Void {
    fn route(&self) -> &str {
        self.merchant_id.as_str()
    }

    fn batch_keys(&self, _read: &ReadFirst) -> Option<Vec<BatchKey>> {
        None
    }

    fn order_to_lock<'a>(&'a self, read: &'a ReadFirst) -> Option<(&'a str, &'a str)> {
        order_of_hold(read, self.merchant_id.as_str(), self.out_auth_no.as_str())
    }

    fn reads_hold(&self) -> bool {
        true
    }

    fn accounts_to_lock<'a>(&'a self, rows: Rows<'a>) -> Vec<&'a str> {
        rows.hold.map_or_else(Vec::new, |hold| vec![hold.payer_account_id.as_str()])
    }

    /// A hold released or captured already: the state machine says which answer that is (a
    /// replay, or ORDER_ALREADY_PAID); an ACTIVE one is released ([`release`]).
    fn decide(&self, view: &mut View<'_>) -> Result<Box<dyn Accepted>, Outcome> {
        let (hold, order) = locked_hold_and_order(view, self.merchant_id.as_str(), self.out_auth_no.as_str())?;
        let refused = |error: Error| Outcome::Rejected(error);
        if hold.status != HOLD_ACTIVE {
            let state = order_state_with_hold(&order, Some(&hold), view.now).map_err(refused)?;
            state.apply(OrderEvent::Void).map_err(|error| refused(error.into()))?;
            return Err(Outcome::TakenBefore);
        }
        let mut book = view.book.clone();
        let Some(released) = release(&order, &hold, OrderEvent::Void, view.now, &mut book).map_err(refused)? else {
            return Err(Outcome::TakenBefore);
        };
        view.book = book;
        Ok(Box::new(Released { released, before: hold }))
    }
}

/// A hold released with its order closed (Void, or CloseOrder of an AUTHORIZED order): the
/// release, and the hold as read under the order's lock.
pub(super) struct Released {
    pub(super) released: Release,
    pub(super) before: HoldRow,
}

impl Released {
    /// Into `set`, as [`Release::add_to`].
    pub(super) fn add_to<'s>(&'s self, set: &mut WriteSet<'s>) {
        self.released.add_to(&self.before, set);
    }
}

impl Accepted for Released {
    fn add_to<'s>(&'s self, set: &mut WriteSet<'s>) {
        Released::add_to(self, set);
    }

    fn message(&self) -> Result<Option<Vec<u8>>, Error> {
        let receipt = HoldReceipt { hold: self.released.hold.clone(), order: self.released.order.clone() };
        Ok(Some(Void::message(receipt)?.encode_to_vec()))
    }

    /// The hold and its order as the release leaves them.
    fn answer(self: Box<Self>, _entries: &mut Entries, _locked: &Book) -> Result<(Answer, Option<Vec<u8>>), Error> {
        let Release { hold, order, .. } = self.released;
        Ok((Box::new(HoldReceipt { hold, order }), None))
    }
}

impl Batchable for Void {
    fn write(&self) -> Box<dyn BatchWrite> {
        Box::new(self.clone())
    }

    async fn before_alone(&self, queries: &mut Queries<'_>, read: &mut ReadFirst, _now: i64) -> Result<(), Error> {
        read_hold(queries, read, self.merchant_id.as_str(), self.out_auth_no.as_str()).await
    }
}
