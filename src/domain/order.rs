//! The order state machine. This is the one place that decides which transitions exist;
//! the store only applies them with conditional UPDATEs.
//!
//! ```text
//!             Pay (before expires_at)    Refund (part)              Refund (rest)
//! PENDING -------------------> PAID ------------------> PARTIALLY_REFUNDED ---------> REFUNDED
//!    |                           \_________________ Refund (all) ____________________/
//!    | Close (CloseOrder, reason MERCHANT)
//!    | Expire (the sweeper, once expires_at has passed, reason EXPIRED)
//!    v
//! CLOSED
//! ```
//!
//! An order past its `expires_at` refuses a Pay with ORDER_EXPIRED whether or not the sweeper
//! has closed it yet: the clock, not the sweeper, decides.

use super::Rejection;

/// The status of an order, as stored (`as_str`) and as sent (`crate::grpc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OrderStatus {
    Pending,
    Paid,
    PartiallyRefunded,
    Refunded,
    Closed,
}

impl OrderStatus {
    pub const ALL: [OrderStatus; 5] = [
        OrderStatus::Pending,
        OrderStatus::Paid,
        OrderStatus::PartiallyRefunded,
        OrderStatus::Refunded,
        OrderStatus::Closed,
    ];

    /// The stored form, e.g. `"PARTIALLY_REFUNDED"`.
    pub fn as_str(self) -> &'static str {
        match self {
            OrderStatus::Pending => "PENDING",
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
}

impl CloseReason {
    pub const ALL: [CloseReason; 2] = [CloseReason::Merchant, CloseReason::Expired];

    /// The stored form, e.g. `"EXPIRED"`.
    pub fn as_str(self) -> &'static str {
        match self {
            CloseReason::Merchant => "MERCHANT",
            CloseReason::Expired => "EXPIRED",
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
        use OrderStatus::*;
        match (self.status, event) {
            (Pending, OrderEvent::Pay) if self.past_expiry => Err(Rejection::OrderExpired),
            (Pending, OrderEvent::Pay) => Ok(self.moved_to(Paid, self.refunded_minor_units, None)),
            (Pending, OrderEvent::Close) => {
                Ok(self.moved_to(Closed, self.refunded_minor_units, Some(CloseReason::Merchant)))
            }
            (Pending, OrderEvent::Expire) if self.past_expiry => {
                Ok(self.moved_to(Closed, self.refunded_minor_units, Some(CloseReason::Expired)))
            }
            (Pending, OrderEvent::Expire) => Err(Rejection::OrderNotExpired),
            (Pending | Closed, OrderEvent::Refund { .. }) => Err(Rejection::OrderNotPaid),
            (Paid | PartiallyRefunded | Refunded, OrderEvent::Pay | OrderEvent::Close | OrderEvent::Expire) => {
                Err(Rejection::OrderAlreadyPaid)
            }
            (Closed, OrderEvent::Pay) if self.close_reason == Some(CloseReason::Expired) => {
                Err(Rejection::OrderExpired)
            }
            (Closed, OrderEvent::Pay) => Err(Rejection::OrderClosed),
            (Closed, OrderEvent::Close | OrderEvent::Expire) => Ok(Transition::AlreadyApplied),
            (Paid | PartiallyRefunded | Refunded, OrderEvent::Refund { amount_minor_units }) => {
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

    /// An order of 1,000 minor units; `past` says whether its expires_at has passed.
    fn state(status: OrderStatus, refunded: i64, reason: Option<CloseReason>, past: bool) -> OrderState {
        OrderState {
            status,
            amount_minor_units: 1_000,
            refunded_minor_units: refunded,
            close_reason: reason,
            past_expiry: past,
        }
    }

    fn refund(amount: i64) -> OrderEvent {
        OrderEvent::Refund { amount_minor_units: amount }
    }

    #[test]
    fn every_state_and_event_pair_has_the_specified_outcome() {
        use OrderEvent::{Close, Expire, Pay};
        let to = |status, refunded, reason, past| Ok(Transition::To(state(status, refunded, reason, past)));
        let done = Ok(Transition::AlreadyApplied);
        let no = Err;
        // (state, refunded so far, close reason, past expiry, event, expected outcome): the
        // whole table, row by row.
        let table = [
            (Pending, 0, None, false, Pay, to(Paid, 0, None, false)),
            (Pending, 0, None, true, Pay, no(Rejection::OrderExpired)),
            (Pending, 0, None, false, Close, to(Closed, 0, Some(Merchant), false)),
            (Pending, 0, None, true, Close, to(Closed, 0, Some(Merchant), true)),
            (Pending, 0, None, false, Expire, no(Rejection::OrderNotExpired)),
            (Pending, 0, None, true, Expire, to(Closed, 0, Some(Expired), true)),
            (Pending, 0, None, false, refund(1), no(Rejection::OrderNotPaid)),
            (Pending, 0, None, true, refund(1), no(Rejection::OrderNotPaid)),
            (Paid, 0, None, false, Pay, no(Rejection::OrderAlreadyPaid)),
            (Paid, 0, None, true, Pay, no(Rejection::OrderAlreadyPaid)),
            (Paid, 0, None, false, Close, no(Rejection::OrderAlreadyPaid)),
            (Paid, 0, None, true, Close, no(Rejection::OrderAlreadyPaid)),
            (Paid, 0, None, false, Expire, no(Rejection::OrderAlreadyPaid)),
            (Paid, 0, None, true, Expire, no(Rejection::OrderAlreadyPaid)),
            (Paid, 0, None, false, refund(400), to(PartiallyRefunded, 400, None, false)),
            (Paid, 0, None, true, refund(1_000), to(Refunded, 1_000, None, true)),
            (Paid, 0, None, false, refund(1_001), no(Rejection::RefundExceedsPaid)),
            (PartiallyRefunded, 400, None, false, Pay, no(Rejection::OrderAlreadyPaid)),
            (PartiallyRefunded, 400, None, true, Pay, no(Rejection::OrderAlreadyPaid)),
            (PartiallyRefunded, 400, None, false, Close, no(Rejection::OrderAlreadyPaid)),
            (PartiallyRefunded, 400, None, true, Close, no(Rejection::OrderAlreadyPaid)),
            (PartiallyRefunded, 400, None, false, Expire, no(Rejection::OrderAlreadyPaid)),
            (PartiallyRefunded, 400, None, true, Expire, no(Rejection::OrderAlreadyPaid)),
            (PartiallyRefunded, 400, None, false, refund(100), to(PartiallyRefunded, 500, None, false)),
            (PartiallyRefunded, 400, None, true, refund(600), to(Refunded, 1_000, None, true)),
            (PartiallyRefunded, 400, None, false, refund(601), no(Rejection::RefundExceedsPaid)),
            (Refunded, 1_000, None, false, Pay, no(Rejection::OrderAlreadyPaid)),
            (Refunded, 1_000, None, true, Pay, no(Rejection::OrderAlreadyPaid)),
            (Refunded, 1_000, None, false, Close, no(Rejection::OrderAlreadyPaid)),
            (Refunded, 1_000, None, true, Close, no(Rejection::OrderAlreadyPaid)),
            (Refunded, 1_000, None, false, Expire, no(Rejection::OrderAlreadyPaid)),
            (Refunded, 1_000, None, true, Expire, no(Rejection::OrderAlreadyPaid)),
            (Refunded, 1_000, None, false, refund(1), no(Rejection::RefundExceedsPaid)),
            (Refunded, 1_000, None, true, refund(1), no(Rejection::RefundExceedsPaid)),
            (Closed, 0, Some(Merchant), false, Pay, no(Rejection::OrderClosed)),
            (Closed, 0, Some(Merchant), true, Pay, no(Rejection::OrderClosed)),
            (Closed, 0, None, true, Pay, no(Rejection::OrderClosed)),
            (Closed, 0, Some(Expired), true, Pay, no(Rejection::OrderExpired)),
            (Closed, 0, Some(Merchant), false, Close, done),
            (Closed, 0, Some(Expired), true, Close, done),
            (Closed, 0, Some(Merchant), false, Expire, done),
            (Closed, 0, Some(Merchant), true, Expire, done),
            (Closed, 0, Some(Expired), true, Expire, done),
            (Closed, 0, Some(Merchant), false, refund(1), no(Rejection::OrderNotPaid)),
            (Closed, 0, Some(Expired), true, refund(1), no(Rejection::OrderNotPaid)),
        ];
        for (status, refunded, reason, past, event, expected) in table {
            let from = state(status, refunded, reason, past);
            assert_eq!(from.apply(event), expected, "{from:?} + {event:?}");
        }
        // Every (state, past expiry, event kind) triple appears in the table above.
        for status in OrderStatus::ALL {
            for past in [false, true] {
                for event in [Pay, Close, Expire, refund(1)] {
                    let covered = table.iter().any(|(s, _, _, p, e, _)| {
                        *s == status && *p == past && std::mem::discriminant(e) == std::mem::discriminant(&event)
                    });
                    assert!(covered, "{status:?} (past expiry: {past}) + {event:?} is missing from the table");
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
        ]
    }

    proptest! {
        /// Any sequence of events, with the deadline passing at any point: refunds stay within
        /// the paid amount, a closed order has its reason and is never paid, and an order that
        /// moved at all after its deadline moved only to CLOSED or by refunds of a payment
        /// made before it.
        #[test]
        fn any_event_sequence_keeps_the_invariants(
            events in prop::collection::vec(any_event(), 0..40),
            deadline in 0usize..40,
        ) {
            let mut current = state(Pending, 0, None, false);
            let mut refunded_total = 0;
            let mut paid_at = None;
            for (step, event) in events.into_iter().enumerate() {
                current.past_expiry = step >= deadline;
                match current.apply(event) {
                    Ok(Transition::To(next)) => {
                        if let OrderEvent::Refund { amount_minor_units } = event {
                            refunded_total += amount_minor_units;
                        }
                        if next.status == Paid && current.status == Pending {
                            paid_at = Some(step);
                        }
                        current = next;
                    }
                    Ok(Transition::AlreadyApplied) => prop_assert_eq!(current.status, Closed),
                    Err(_) => {}
                }
                prop_assert_eq!(current.refunded_minor_units, refunded_total);
                prop_assert!(current.refunded_minor_units <= current.amount_minor_units);
                prop_assert_eq!(current.status == Refunded, current.refunded_minor_units == current.amount_minor_units);
                prop_assert_eq!(current.status == PartiallyRefunded, current.refunded_minor_units > 0 && current.refunded_minor_units < current.amount_minor_units);
                prop_assert_eq!(current.status == Closed, current.close_reason.is_some());
                if current.refunded_minor_units > 0 { prop_assert!(current.status.is_paid()); }
                if let Some(paid_at) = paid_at { prop_assert!(paid_at < deadline); }
                if current.close_reason == Some(Expired) { prop_assert!(current.past_expiry); }
            }
        }
    }
}
