//! Authorization holds (two-phase payments). Authorize reserves an order's amount on the
//! payer's account (`held` grows, the balance does not; the order goes PENDING -> AUTHORIZED);
//! Capture pays all or part of it exactly as a Pay would (a payment under its out_trade_no,
//! the order PAID) and releases the rest; Void, CloseOrder and the hold sweeper release it and
//! close the order.
//!
//! Every step locks the order's row first (`FOR UPDATE`) and only then reads the hold, so all
//! the steps of one order, and the sweeper, take their turns on that one lock; then the
//! payer's account (and a Capture's payee), in account_id order. Each order transition is a
//! conditional UPDATE from the state it requires (order `PENDING` or `AUTHORIZED`). What a
//! step does to money goes through the write engine as every write's does: the hold reserved
//! ([`Book::reserve`]) or released ([`Book::release`]) and a Capture's posting applied to the
//! accounts as read under their locks, then the write set (the new or settled hold, the new
//! `held` and balances by version CAS, the entries) checked against the money invariants and
//! written ([`book::write`]).

use crate::domain::{CloseReason, OrderEvent, OrderStatus, Rejection, Transition};
use crate::error::{Error, Resource, ReusedKey};
use crate::proto;
use crate::store::{HoldRow, OrderRow, PaymentRow, Queries};

use super::commands::{Authorize, Capture, Void};
use super::engine::book::{self, Book, SettledHold, WriteSet};
use super::guards::{Guards, Scope};
use super::idempotent::{differing_from, Fields, IdempotentCall};
use super::payments::{order_state_with_hold, payment_posting, PAYMENT_SUCCEEDED};
use super::response;
use super::{deadline_clock, new_id, now_micros, Identified, Inserted, Ledger, Replayable};

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
                    Some(hold) if hold.status == HOLD_ACTIVE => {
                        release_hold(&mut queries, &order, hold, OrderEvent::HoldExpire, now).await
                    }
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

/// Releases an ACTIVE `hold` of `order` (whose row this transaction has locked) for `event`:
/// Void (hold VOIDED, order CLOSED as VOIDED), Close (hold VOIDED, order CLOSED by the
/// merchant) or HoldExpire (hold EXPIRED, order CLOSED as HOLD_EXPIRED). `None` when the event
/// is already in effect (nothing written); the hold and order after it otherwise.
///
/// # Errors
/// The state machine's [`Rejection`] (ORDER_ALREADY_PAID once captured, HOLD_NOT_EXPIRED for
/// an early sweep); [`Error::Contention`] if a conditional UPDATE found its row moved.
pub(super) async fn release_hold(
    queries: &mut Queries<'_>,
    order: &OrderRow,
    hold: &HoldRow,
    event: OrderEvent,
    now: i64,
) -> Result<Option<HoldReceipt>, Error> {
    let Transition::To(next) = order_state_with_hold(order, Some(hold), now)?.apply(event)? else {
        return Ok(None);
    };
    let reason = next.close_reason.ok_or_else(|| Error::Internal("a released hold's order is not closed".into()))?;
    let hold_status = if reason == CloseReason::HoldExpired { HOLD_EXPIRED } else { HOLD_VOIDED };
    if hold.status != HOLD_ACTIVE {
        return Err(Error::Contention);
    }
    let (merchant_id, order_no) = (order.merchant_id.as_str(), order.order_no.as_str());
    if !queries.close_authorized_order(merchant_id, order_no, reason.as_str(), now).await? {
        return Err(Error::Contention);
    }
    let mut book = Book::locked(queries.lock_accounts(&[hold.payer_account_id.as_str()]).await?);
    book.release(hold)?;
    let settled = SettledHold { hold, status: hold_status, captured_amount: 0, out_trade_no: None };
    let set = WriteSet { settled_holds: vec![settled], ..WriteSet::default() };
    if !book::write(queries, &set, &book, now).await? {
        return Err(Error::Contention);
    }
    let hold = HoldRow { status: hold_status.to_owned(), updated_at: now, ..hold.clone() };
    let order = OrderRow {
        status: OrderStatus::Closed.as_str().to_owned(),
        close_reason: Some(reason.as_str().to_owned()),
        updated_at: now,
        ..order.clone()
    };
    Ok(Some(HoldReceipt { hold, order }))
}

/// Two account ids in ascending order, the order their rows are locked in.
fn sorted_pair<'a>(first: &'a str, second: &'a str) -> [&'a str; 2] {
    if first <= second {
        [first, second]
    } else {
        [second, first]
    }
}

/// The hold of (merchant_id, out_auth_no) and its order as they stand, read after the order's
/// row lock when `queries` is a transaction's.
async fn hold_and_order(
    queries: &mut Queries<'_>,
    merchant_id: &str,
    out_auth_no: &str,
    lock: bool,
) -> Result<(HoldRow, OrderRow), Error> {
    let hold = queries.find_hold(merchant_id, out_auth_no).await?.ok_or(Error::NotFound(Resource::Hold))?;
    let order = if lock {
        queries.find_order_for_update(merchant_id, &hold.order_no).await?
    } else {
        queries.find_order(merchant_id, &hold.order_no).await?
    };
    let order = order.ok_or_else(|| Error::Internal("a hold's order is missing".into()))?;
    if !lock {
        return Ok((hold, order));
    }
    // Read again under the order's lock: every change of a hold is made under it.
    let hold = queries
        .find_hold(merchant_id, out_auth_no)
        .await?
        .ok_or_else(|| Error::Internal("a hold vanished under its order's lock".into()))?;
    Ok((hold, order))
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
        let (hold, order) = hold_and_order(&mut queries, merchant_id, out_auth_no, false).await?;
        let stored =
            authorize_fields(&hold.out_auth_no, &hold.order_no, &hold.payer_account_id, hold.amount, &hold.currency);
        let fields = differing_from(&self.fields(), &stored);
        if !fields.is_empty() {
            return Err(Error::KeyReused { key: ReusedKey::OutAuthNo, fields });
        }
        Ok(Some(HoldReceipt { hold, order }))
    }

    async fn body(&self, queries: &mut Queries<'_>, now: i64) -> Result<Inserted<HoldReceipt>, Error> {
        let command = &self.command;
        let (merchant_id, order_no) = (command.merchant_id.as_str(), command.order_no.as_str());
        let order =
            queries.find_order_for_update(merchant_id, order_no).await?.ok_or(Error::NotFound(Resource::Order))?;
        let hold = queries.find_hold_of_order(merchant_id, order_no).await?;
        if hold.as_ref().is_some_and(|hold| hold.out_auth_no == command.out_auth_no.as_str()) {
            return Ok(Inserted::KeyTaken);
        }
        // The state machine first: an order that moved on is refused as such, whatever the
        // request's amount (a captured order's amount is what was captured).
        let at = deadline_clock(now);
        let Transition::To(next) = order_state_with_hold(&order, hold.as_ref(), at)?.apply(OrderEvent::Authorize)?
        else {
            return Err(Error::Internal("the state machine found an Authorize already applied".into()));
        };
        if order.currency != command.amount.currency().code() {
            return Err(Rejection::CurrencyMismatch.into());
        }
        if order.amount != command.amount.minor_units() {
            return Err(Rejection::AmountMismatch.into());
        }
        if order.payee_account_id == command.payer_account_id.as_str() {
            return Err(Rejection::PayerIsPayee.into());
        }
        let payer_account_id = command.payer_account_id.as_str();
        let mut book = Book::locked(queries.lock_accounts(&[payer_account_id]).await?);
        let payer = book.get(payer_account_id).ok_or(Error::NotFound(Resource::Account))?;
        if payer.currency != order.currency {
            return Err(Rejection::CurrencyMismatch.into());
        }
        let hold = HoldRow {
            hold_no: self.hold_no.clone(),
            merchant_id: merchant_id.to_owned(),
            out_auth_no: command.out_auth_no.as_str().to_owned(),
            order_no: order_no.to_owned(),
            payer_account_id: payer_account_id.to_owned(),
            amount: order.amount,
            currency: order.currency.clone(),
            status: HOLD_ACTIVE.to_owned(),
            captured_amount: 0,
            out_trade_no: None,
            expires_at: now.saturating_add(self.ttl),
            created_at: now,
            updated_at: now,
            created_by: command.created_by.created_by().to_owned(),
        };
        if let Err(refusal) = book.reserve(&hold) {
            // Its out_auth_no inserted before the refusal is answered (the transaction rolls
            // back with it): an original of it still in flight on another order is waited for
            // and answers instead (a replay, or OUT_AUTH_NO_REUSED).
            return if queries.insert_hold(&hold).await? { Err(refusal) } else { Ok(Inserted::KeyTaken) };
        }
        if !queries.authorize_order(merchant_id, order_no, now).await? {
            return Err(Error::Contention);
        }
        let set = WriteSet { holds: vec![hold.clone()], ..WriteSet::default() };
        if !book::write(queries, &set, &book, now).await? {
            return Ok(Inserted::KeyTaken);
        }
        let order = OrderRow { status: next.status.as_str().to_owned(), updated_at: now, ..order };
        Ok(Inserted::Done(HoldReceipt { hold, order }))
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
        Ok(Some(CaptureReceipt { payment, order, hold }))
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
        let (hold, order) = hold_and_order(&mut queries, merchant_id, out_auth_no, false).await?;
        let capture = OrderEvent::Capture { amount_minor_units: self.command.amount.minor_units() };
        order_state_with_hold(&order, Some(&hold), now_micros())?.apply(capture)?;
        Ok(None)
    }

    async fn body(&self, queries: &mut Queries<'_>, now: i64) -> Result<Inserted<CaptureReceipt>, Error> {
        let Identified { command, id: trade_no } = self;
        let merchant_id = command.merchant_id.as_str();
        let (hold, order) = hold_and_order(queries, merchant_id, command.out_auth_no.as_str(), true).await?;
        if hold.currency != command.amount.currency().code() {
            return Err(Rejection::CurrencyMismatch.into());
        }
        if order.status != OrderStatus::Authorized.as_str()
            && order.out_trade_no.as_deref() == Some(command.out_trade_no.as_str())
        {
            return Ok(Inserted::KeyTaken);
        }
        let captured = command.amount.minor_units();
        let capture = OrderEvent::Capture { amount_minor_units: captured };
        let Transition::To(next) = order_state_with_hold(&order, Some(&hold), deadline_clock(now))?.apply(capture)?
        else {
            return Err(Error::Internal("the state machine found a Capture already applied".into()));
        };
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
        if !queries.insert_payment(&payment).await? {
            return Ok(Inserted::KeyTaken);
        }
        // The two accounts locked now, in account_id order, before the payer's row is written
        // below: the ledger's one lock order (orders, then accounts by account_id).
        let accounts =
            queries.lock_accounts(&sorted_pair(&payment.payer_account_id, &payment.payee_account_id)).await?;
        let out_trade_no = payment.out_trade_no.as_str();
        if !queries.capture_order(merchant_id, &order.order_no, out_trade_no, captured, now).await? {
            return Err(Error::Contention);
        }
        // The whole hold is released before the money moves, so the payer's leg sees what
        // stays reserved by its other holds only.
        let mut book = Book::locked(accounts);
        book.release(&hold)?;
        let posting = payment_posting(&payment);
        let legs = book.post(&posting)?;
        let settled = SettledHold {
            hold: &hold,
            status: HOLD_CAPTURED,
            captured_amount: captured,
            out_trade_no: Some(out_trade_no),
        };
        let set = WriteSet { settled_holds: vec![settled], postings: vec![(posting, legs)], ..WriteSet::default() };
        if !book::write(queries, &set, &book, now).await? {
            return Err(Error::Contention);
        }
        let order = OrderRow {
            status: next.status.as_str().to_owned(),
            amount: captured,
            out_trade_no: Some(payment.out_trade_no.clone()),
            updated_at: now,
            ..order
        };
        let hold = HoldRow {
            status: HOLD_CAPTURED.to_owned(),
            captured_amount: captured,
            out_trade_no: Some(payment.out_trade_no.clone()),
            updated_at: now,
            ..hold
        };
        Ok(Inserted::Done(CaptureReceipt { payment, order, hold }))
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
        let (hold, order) =
            hold_and_order(&mut queries, self.merchant_id.as_str(), self.out_auth_no.as_str(), false).await?;
        Ok(Some(HoldReceipt { hold, order }))
    }

    async fn body(&self, queries: &mut Queries<'_>, now: i64) -> Result<Inserted<HoldReceipt>, Error> {
        let (hold, order) = hold_and_order(queries, self.merchant_id.as_str(), self.out_auth_no.as_str(), true).await?;
        if hold.status != HOLD_ACTIVE {
            // Released or captured already: the state machine says which answer that is.
            order_state_with_hold(&order, Some(&hold), now)?.apply(OrderEvent::Void)?;
            return Ok(Inserted::KeyTaken);
        }
        Ok(match release_hold(queries, &order, &hold, OrderEvent::Void, now).await? {
            Some(receipt) => Inserted::Done(receipt),
            None => Inserted::KeyTaken,
        })
    }
}
