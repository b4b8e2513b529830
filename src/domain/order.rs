//! The order state machine. This is the one place that decides which transitions exist;
//! the store only applies them with conditional UPDATEs.
//!
//! ```text
//!             Pay (before expires_at)    Refund (part)              Refund (rest)
//! PENDING -------------------> PAID ------------------> PARTIALLY_REFUNDED ---------> REFUNDED
//!  |  |                       ^  \_________________ Refund (all) ____________________/
//!  |  | Authorize             | Capture (all or part, before the hold's expires_at)
//!  |  +-----------> AUTHORIZED+
//!  |                    | Void (VOIDED), hold expiry (HOLD_EXPIRED), Close (MERCHANT)
//!  | Close (CloseOrder, reason MERCHANT)
//!  | Expire (the sweeper, once expires_at has passed, reason EXPIRED)
//!  v                    v
//! CLOSED <--------------+
//! ```
//!
//! An order past its `expires_at` refuses a Pay or an Authorize with ORDER_EXPIRED whether or
//! not the sweeper has closed it yet: the clock, not the sweeper, decides. Once AUTHORIZED, the
//! hold's own deadline governs: a Capture after it is HOLD_EXPIRED, and the order's deadline no
//! longer applies.

use super::Rejection;

/// The status of an order, as stored (`as_str`) and as sent (`crate::grpc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OrderStatus {
    Pending,
    /// An authorization hold reserves the amount on the payer's account.
    Authorized,
    Paid,
    PartiallyRefunded,
    Refunded,
    Closed,
}

impl OrderStatus {
    pub const ALL: [OrderStatus; 6] = [
        OrderStatus::Pending,
        OrderStatus::Authorized,
        OrderStatus::Paid,
        OrderStatus::PartiallyRefunded,
        OrderStatus::Refunded,
        OrderStatus::Closed,
    ];

    /// The stored form, e.g. `"PARTIALLY_REFUNDED"`.
    pub fn as_str(self) -> &'static str {
        match self {
            OrderStatus::Pending => "PENDING",
            OrderStatus::Authorized => "AUTHORIZED",
            OrderStatus::Paid => "PAID",
            OrderStatus::PartiallyRefunded => "PARTIALLY_REFUNDED",
            OrderStatus::Refunded => "REFUNDED",
            OrderStatus::Closed => "CLOSED",
        }
    }

    /// Reads the stored form; `None` for anything this version does not know.
    pub fn from_stored(stored: &str) -> Option<Self> {
        OrderStatus::ALL.into_iter().find(|status| status.as_str() == stored)
    }

    /// True once money has moved for the order (it was paid, whatever refunds followed).
    pub fn is_paid(self) -> bool {
        matches!(self, OrderStatus::Paid | OrderStatus::PartiallyRefunded | OrderStatus::Refunded)
    }
}

/// Why a CLOSED order closed, as stored (`as_str`) and as sent (`crate::grpc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CloseReason {
    /// The merchant called CloseOrder.
    Merchant,
    /// The order's `expires_at` passed while it was PENDING.
    Expired,
    /// Its authorization hold was voided (Void).
    Voided,
    /// Its authorization hold expired before it was captured.
    HoldExpired,
}

impl CloseReason {
    pub const ALL: [CloseReason; 4] =
        [CloseReason::Merchant, CloseReason::Expired, CloseReason::Voided, CloseReason::HoldExpired];

    /// The stored form, e.g. `"EXPIRED"`.
    pub fn as_str(self) -> &'static str {
        match self {
            CloseReason::Merchant => "MERCHANT",
            CloseReason::Expired => "EXPIRED",
            CloseReason::Voided => "VOIDED",
            CloseReason::HoldExpired => "HOLD_EXPIRED",
        }
    }

    /// Reads the stored form; `None` for anything this version does not know.
    pub fn from_stored(stored: &str) -> Option<Self> {
        CloseReason::ALL.into_iter().find(|reason| reason.as_str() == stored)
    }
}

/// What can happen to an order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrderEvent {
    Pay,
    /// CloseOrder.
    Close,
    /// The sweeper closing an order whose `expires_at` has passed.
    Expire,
    /// A refund of this many minor units.
    Refund {
        amount_minor_units: i64,
    },
    /// An authorization hold of the order's amount on the payer's account.
    Authorize,
    /// The capture of this many minor units of the hold (the rest is released).
    Capture {
        amount_minor_units: i64,
    },
    /// Void: the hold is released and the order closed.
    Void,
    /// The sweeper releasing a hold whose expires_at has passed.
    HoldExpire,
}

/// The part of an order the state machine needs: its status, its amount and what has been
/// refunded so far (both in minor units), why it closed, and whether its `expires_at` has
/// passed at the moment the event happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OrderState {
    pub status: OrderStatus,
    pub amount_minor_units: i64,
    pub refunded_minor_units: i64,
    /// Set exactly when `status` is CLOSED (`None` in orders closed before reasons were kept).
    pub close_reason: Option<CloseReason>,
    /// The order has an `expires_at` and it is at or before now.
    pub past_expiry: bool,
    /// The order's authorization hold has an `expires_at` at or before now (false without a
    /// hold).
    pub hold_past_expiry: bool,
}

/// The result of applying an event that is allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// The order moves to this state.
    To(OrderState),
    /// The event is already in effect (closing a closed order): answer with the order as is.
    AlreadyApplied,
}

impl OrderState {
    /// Applies `event` to this state.
    ///
    /// # Errors
    /// The [`Rejection`] that refuses the event in this state.
    pub fn apply(self, event: OrderEvent) -> Result<Transition, Rejection> {
        use OrderEvent::{Authorize, Capture, Close, Expire, HoldExpire, Pay, Refund, Void};
        use OrderStatus::*;
        let closed = |reason| Ok(self.moved_to(Closed, self.refunded_minor_units, Some(reason)));
        match (self.status, event) {
            (Pending, Pay | Authorize) if self.past_expiry => Err(Rejection::OrderExpired),
            (Pending, Pay) => Ok(self.moved_to(Paid, self.refunded_minor_units, None)),
            (Pending, Authorize) => Ok(self.moved_to(Authorized, self.refunded_minor_units, None)),
            (Pending | Authorized, Close) => closed(CloseReason::Merchant),
            (Pending, Expire) if self.past_expiry => closed(CloseReason::Expired),
            (Pending, Expire) => Err(Rejection::OrderNotExpired),
            (Pending, Capture { .. } | Void | HoldExpire) => Err(Rejection::OrderNotAuthorized),
            (Pending | Authorized | Closed, Refund { .. }) => Err(Rejection::OrderNotPaid),
            (Authorized, Pay | Authorize | Expire) => Err(Rejection::OrderAuthorized),
            (Authorized, Capture { .. }) if self.hold_past_expiry => Err(Rejection::HoldExpired),
            (Authorized, Capture { amount_minor_units }) => {
                if amount_minor_units > self.amount_minor_units {
                    return Err(Rejection::CaptureExceedsAuthorized);
                }
                // The order's amount becomes what was captured: the payment's amount, the
                // most that can be refunded.
                let captured = OrderState { amount_minor_units, ..self };
                Ok(captured.moved_to(Paid, self.refunded_minor_units, None))
            }
            (Authorized, Void) => closed(CloseReason::Voided),
            (Authorized, HoldExpire) if self.hold_past_expiry => closed(CloseReason::HoldExpired),
            (Authorized, HoldExpire) => Err(Rejection::HoldNotExpired),
            (
                Paid | PartiallyRefunded | Refunded,
                Pay | Close | Expire | Authorize | Capture { .. } | Void | HoldExpire,
            ) => Err(Rejection::OrderAlreadyPaid),
            (Closed, Pay | Authorize) if self.close_reason == Some(CloseReason::Expired) => {
                Err(Rejection::OrderExpired)
            }
            (Closed, Pay | Authorize) => Err(Rejection::OrderClosed),
            (Closed, Close | Expire | Void | HoldExpire) => Ok(Transition::AlreadyApplied),
            (Closed, Capture { .. }) => Err(match self.close_reason {
                Some(CloseReason::HoldExpired) => Rejection::HoldExpired,
                Some(CloseReason::Voided) => Rejection::HoldVoided,
                Some(CloseReason::Expired) => Rejection::OrderExpired,
                Some(CloseReason::Merchant) | None => Rejection::OrderClosed,
            }),
            (Paid | PartiallyRefunded | Refunded, Refund { amount_minor_units }) => {
                let refunded = self
                    .refunded_minor_units
                    .checked_add(amount_minor_units)
                    .filter(|refunded| *refunded <= self.amount_minor_units)
                    .ok_or(Rejection::RefundExceedsPaid)?;
                let status = if refunded == self.amount_minor_units { Refunded } else { PartiallyRefunded };
                Ok(self.moved_to(status, refunded, None))
            }
        }
    }

    fn moved_to(self, status: OrderStatus, refunded_minor_units: i64, close_reason: Option<CloseReason>) -> Transition {
        Transition::To(OrderState { status, refunded_minor_units, close_reason, ..self })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use CloseReason::*;
    use OrderStatus::*;

    /// An order of 1,000 minor units; `past` says whether its deadlines (the order's and its
    /// hold's) have passed.
    fn state(status: OrderStatus, refunded: i64, reason: Option<CloseReason>, past: bool) -> OrderState {
        OrderState {
            status,
            amount_minor_units: 1_000,
            refunded_minor_units: refunded,
            close_reason: reason,
            past_expiry: past,
            hold_past_expiry: past,
        }
    }

    fn refund(amount: i64) -> OrderEvent {
        OrderEvent::Refund { amount_minor_units: amount }
    }

    fn capture(amount: i64) -> OrderEvent {
        OrderEvent::Capture { amount_minor_units: amount }
    }

    /// Every event kind once (amounts stand for their kind).
    fn every_event() -> [OrderEvent; 8] {
        use OrderEvent::*;
        [Pay, Close, Expire, refund(1), Authorize, capture(1), Void, HoldExpire]
    }

    #[test]
    fn every_state_and_event_pair_has_the_specified_outcome() {
        use OrderEvent::{Authorize, Close, Expire, HoldExpire, Pay, Void};
        let to = |status, refunded, reason, past| Ok(Transition::To(state(status, refunded, reason, past)));
        let done = Ok(Transition::AlreadyApplied);
        let no = Err;
        let captured =
            |amount, past| Ok(Transition::To(OrderState { amount_minor_units: amount, ..state(Paid, 0, None, past) }));
        // (state, refunded so far, close reason, deadlines passed, event, expected outcome):
        // the whole table, row by row.
        let mut table = vec![
            (Pending, 0, None, false, Pay, to(Paid, 0, None, false)),
            (Pending, 0, None, true, Pay, no(Rejection::OrderExpired)),
            (Pending, 0, None, false, Close, to(Closed, 0, Some(Merchant), false)),
            (Pending, 0, None, true, Close, to(Closed, 0, Some(Merchant), true)),
            (Pending, 0, None, false, Expire, no(Rejection::OrderNotExpired)),
            (Pending, 0, None, true, Expire, to(Closed, 0, Some(Expired), true)),
            (Pending, 0, None, false, refund(1), no(Rejection::OrderNotPaid)),
            (Pending, 0, None, true, refund(1), no(Rejection::OrderNotPaid)),
            (Pending, 0, None, false, Authorize, to(Authorized, 0, None, false)),
            (Pending, 0, None, true, Authorize, no(Rejection::OrderExpired)),
            (Pending, 0, None, false, capture(1), no(Rejection::OrderNotAuthorized)),
            (Pending, 0, None, true, capture(1), no(Rejection::OrderNotAuthorized)),
            (Pending, 0, None, false, Void, no(Rejection::OrderNotAuthorized)),
            (Pending, 0, None, true, Void, no(Rejection::OrderNotAuthorized)),
            (Pending, 0, None, false, HoldExpire, no(Rejection::OrderNotAuthorized)),
            (Pending, 0, None, true, HoldExpire, no(Rejection::OrderNotAuthorized)),
            (Authorized, 0, None, false, Pay, no(Rejection::OrderAuthorized)),
            (Authorized, 0, None, true, Pay, no(Rejection::OrderAuthorized)),
            (Authorized, 0, None, false, Close, to(Closed, 0, Some(Merchant), false)),
            (Authorized, 0, None, true, Close, to(Closed, 0, Some(Merchant), true)),
            (Authorized, 0, None, false, Expire, no(Rejection::OrderAuthorized)),
            (Authorized, 0, None, true, Expire, no(Rejection::OrderAuthorized)),
            (Authorized, 0, None, false, refund(1), no(Rejection::OrderNotPaid)),
            (Authorized, 0, None, true, refund(1), no(Rejection::OrderNotPaid)),
            (Authorized, 0, None, false, Authorize, no(Rejection::OrderAuthorized)),
            (Authorized, 0, None, true, Authorize, no(Rejection::OrderAuthorized)),
            (Authorized, 0, None, false, capture(1_000), captured(1_000, false)),
            (Authorized, 0, None, false, capture(600), captured(600, false)),
            (Authorized, 0, None, false, capture(1_001), no(Rejection::CaptureExceedsAuthorized)),
            (Authorized, 0, None, true, capture(1), no(Rejection::HoldExpired)),
            (Authorized, 0, None, false, Void, to(Closed, 0, Some(Voided), false)),
            (Authorized, 0, None, true, Void, to(Closed, 0, Some(Voided), true)),
            (Authorized, 0, None, false, HoldExpire, no(Rejection::HoldNotExpired)),
            (Authorized, 0, None, true, HoldExpire, to(Closed, 0, Some(HoldExpired), true)),
            (Paid, 0, None, false, refund(400), to(PartiallyRefunded, 400, None, false)),
            (Paid, 0, None, true, refund(1_000), to(Refunded, 1_000, None, true)),
            (Paid, 0, None, false, refund(1_001), no(Rejection::RefundExceedsPaid)),
            (PartiallyRefunded, 400, None, false, refund(100), to(PartiallyRefunded, 500, None, false)),
            (PartiallyRefunded, 400, None, true, refund(600), to(Refunded, 1_000, None, true)),
            (PartiallyRefunded, 400, None, false, refund(601), no(Rejection::RefundExceedsPaid)),
            (Refunded, 1_000, None, false, refund(1), no(Rejection::RefundExceedsPaid)),
            (Refunded, 1_000, None, true, refund(1), no(Rejection::RefundExceedsPaid)),
            (Closed, 0, Some(Merchant), false, Pay, no(Rejection::OrderClosed)),
            (Closed, 0, Some(Merchant), true, Pay, no(Rejection::OrderClosed)),
            (Closed, 0, None, true, Pay, no(Rejection::OrderClosed)),
            (Closed, 0, Some(Expired), true, Pay, no(Rejection::OrderExpired)),
            (Closed, 0, Some(Voided), false, Pay, no(Rejection::OrderClosed)),
            (Closed, 0, Some(Merchant), false, Authorize, no(Rejection::OrderClosed)),
            (Closed, 0, Some(Expired), true, Authorize, no(Rejection::OrderExpired)),
            (Closed, 0, Some(Merchant), false, Close, done),
            (Closed, 0, Some(Expired), true, Close, done),
            (Closed, 0, Some(Merchant), false, Expire, done),
            (Closed, 0, Some(Expired), true, Expire, done),
            (Closed, 0, Some(Merchant), false, refund(1), no(Rejection::OrderNotPaid)),
            (Closed, 0, Some(Expired), true, refund(1), no(Rejection::OrderNotPaid)),
            (Closed, 0, Some(Merchant), false, capture(1), no(Rejection::OrderClosed)),
            (Closed, 0, Some(Voided), false, capture(1), no(Rejection::HoldVoided)),
            (Closed, 0, Some(HoldExpired), true, capture(1), no(Rejection::HoldExpired)),
            (Closed, 0, Some(Expired), true, capture(1), no(Rejection::OrderExpired)),
            (Closed, 0, Some(Voided), false, Void, done),
            (Closed, 0, Some(HoldExpired), true, Void, done),
            (Closed, 0, Some(Voided), false, HoldExpire, done),
            (Closed, 0, Some(HoldExpired), true, HoldExpire, done),
        ];
        // A paid order (whatever was refunded) refuses every event but a refund as already paid.
        for (status, refunded) in [(Paid, 0), (PartiallyRefunded, 400), (Refunded, 1_000)] {
            for past in [false, true] {
                for event in [Pay, Close, Expire, Authorize, capture(1), Void, HoldExpire] {
                    table.push((status, refunded, None, past, event, no(Rejection::OrderAlreadyPaid)));
                }
            }
        }
        for (status, refunded, reason, past, event, expected) in &table {
            let from = state(*status, *refunded, *reason, *past);
            assert_eq!(from.apply(*event), *expected, "{from:?} + {event:?}");
        }
        // Every (state, deadlines passed, event kind) triple appears in the table above.
        for status in OrderStatus::ALL {
            for past in [false, true] {
                for event in every_event() {
                    let covered = table.iter().any(|(s, _, _, p, e, _)| {
                        *s == status && *p == past && std::mem::discriminant(e) == std::mem::discriminant(&event)
                    });
                    assert!(covered, "{status:?} (deadlines passed: {past}) + {event:?} is missing from the table");
                }
            }
        }
    }

    #[test]
    fn stored_status_and_close_reason_text_round_trip() {
        for status in OrderStatus::ALL {
            assert_eq!(OrderStatus::from_stored(status.as_str()), Some(status));
        }
        for reason in CloseReason::ALL {
            assert_eq!(CloseReason::from_stored(reason.as_str()), Some(reason));
        }
        assert_eq!(OrderStatus::from_stored("paid"), None);
        assert_eq!(CloseReason::from_stored("expired"), None);
    }

    fn any_event() -> impl Strategy<Value = OrderEvent> {
        prop_oneof![
            Just(OrderEvent::Pay),
            Just(OrderEvent::Close),
            Just(OrderEvent::Expire),
            (1i64..=1_200).prop_map(refund),
            Just(OrderEvent::Authorize),
            (1i64..=1_200).prop_map(capture),
            Just(OrderEvent::Void),
            Just(OrderEvent::HoldExpire),
        ]
    }

    proptest! {
        /// Any sequence of events, with the deadlines passing at any point: refunds stay within
        /// the paid amount, the amount only ever shrinks to a capture, a closed order has its
        /// reason and is never paid, nothing is paid or authorized after the order's deadline
        /// nor captured after the hold's, and money moved only by one Pay or one Capture.
        #[test]
        fn any_event_sequence_keeps_the_invariants(
            events in prop::collection::vec(any_event(), 0..40),
            deadline in 0usize..40,
            hold_deadline in 0usize..40,
        ) {
            let mut current = state(Pending, 0, None, false);
            let mut refunded_total = 0;
            let mut settled = 0;
            for (step, event) in events.into_iter().enumerate() {
                current.past_expiry = step >= deadline;
                current.hold_past_expiry = step >= hold_deadline;
                let before = current;
                match current.apply(event) {
                    Ok(Transition::To(next)) => {
                        if let OrderEvent::Refund { amount_minor_units } = event {
                            refunded_total += amount_minor_units;
                        }
                        if next.status == Paid && before.status != Paid {
                            settled += 1;
                            match before.status {
                                Pending => prop_assert!(!before.past_expiry),
                                Authorized => prop_assert!(!before.hold_past_expiry),
                                other => prop_assert!(false, "paid from {other:?}"),
                            }
                        }
                        if next.status == Authorized {
                            prop_assert!(before.status == Pending && !before.past_expiry);
                        }
                        prop_assert!(next.amount_minor_units <= before.amount_minor_units);
                        current = next;
                    }
                    Ok(Transition::AlreadyApplied) => prop_assert_eq!(current.status, Closed),
                    Err(_) => {}
                }
                prop_assert!(settled <= 1);
                prop_assert_eq!(current.refunded_minor_units, refunded_total);
                prop_assert!(current.refunded_minor_units <= current.amount_minor_units);
                prop_assert_eq!(current.status == Refunded, current.refunded_minor_units == current.amount_minor_units);
                prop_assert_eq!(current.status == PartiallyRefunded, current.refunded_minor_units > 0 && current.refunded_minor_units < current.amount_minor_units);
                prop_assert_eq!(current.status == Closed, current.close_reason.is_some());
                if current.refunded_minor_units > 0 { prop_assert!(current.status.is_paid()); }
                if current.close_reason == Some(Expired) { prop_assert!(current.past_expiry); }
                if current.close_reason == Some(HoldExpired) { prop_assert!(current.hold_past_expiry); }
            }
        }
    }
}
