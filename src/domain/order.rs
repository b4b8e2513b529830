//! The order state machine. This is the one place that decides which transitions exist;
//! the store only applies them with conditional UPDATEs.
//!
//! ```text
//!             Pay                Refund (part)              Refund (rest)
//! PENDING ---------> PAID ------------------> PARTIALLY_REFUNDED ---------> REFUNDED
//!    |                 \_________________ Refund (all) ____________________/
//!    | Close
//!    v
//! CLOSED
//! ```

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

/// What can happen to an order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrderEvent {
    Pay,
    Close,
    /// A refund of this many minor units.
    Refund {
        amount_minor_units: i64,
    },
}

/// The part of an order the state machine needs: its status, its amount and what has been
/// refunded so far (both in minor units).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OrderState {
    pub status: OrderStatus,
    pub amount_minor_units: i64,
    pub refunded_minor_units: i64,
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
            (Pending, OrderEvent::Pay) => Ok(self.moved_to(Paid, self.refunded_minor_units)),
            (Pending, OrderEvent::Close) => Ok(self.moved_to(Closed, self.refunded_minor_units)),
            (Pending | Closed, OrderEvent::Refund { .. }) => Err(Rejection::OrderNotPaid),
            (Paid | PartiallyRefunded | Refunded, OrderEvent::Pay | OrderEvent::Close) => {
                Err(Rejection::OrderAlreadyPaid)
            }
            (Closed, OrderEvent::Pay) => Err(Rejection::OrderClosed),
            (Closed, OrderEvent::Close) => Ok(Transition::AlreadyApplied),
            (Paid | PartiallyRefunded | Refunded, OrderEvent::Refund { amount_minor_units }) => {
                let refunded = self
                    .refunded_minor_units
                    .checked_add(amount_minor_units)
                    .filter(|refunded| *refunded <= self.amount_minor_units)
                    .ok_or(Rejection::RefundExceedsPaid)?;
                let status = if refunded == self.amount_minor_units { Refunded } else { PartiallyRefunded };
                Ok(self.moved_to(status, refunded))
            }
        }
    }

    fn moved_to(self, status: OrderStatus, refunded_minor_units: i64) -> Transition {
        Transition::To(OrderState { status, refunded_minor_units, ..self })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use OrderStatus::*;

    fn state(status: OrderStatus, refunded: i64) -> OrderState {
        OrderState { status, amount_minor_units: 1_000, refunded_minor_units: refunded }
    }

    fn refund(amount: i64) -> OrderEvent {
        OrderEvent::Refund { amount_minor_units: amount }
    }

    fn to(status: OrderStatus, refunded: i64) -> Result<Transition, Rejection> {
        Ok(Transition::To(state(status, refunded)))
    }

    #[test]
    fn every_state_and_event_pair_has_the_specified_outcome() {
        // (state, refunded so far, event, expected outcome): the whole table, row by row.
        let table = [
            (Pending, 0, OrderEvent::Pay, to(Paid, 0)),
            (Pending, 0, OrderEvent::Close, to(Closed, 0)),
            (Pending, 0, refund(1), Err(Rejection::OrderNotPaid)),
            (Paid, 0, OrderEvent::Pay, Err(Rejection::OrderAlreadyPaid)),
            (Paid, 0, OrderEvent::Close, Err(Rejection::OrderAlreadyPaid)),
            (Paid, 0, refund(400), to(PartiallyRefunded, 400)),
            (Paid, 0, refund(1_000), to(Refunded, 1_000)),
            (Paid, 0, refund(1_001), Err(Rejection::RefundExceedsPaid)),
            (PartiallyRefunded, 400, OrderEvent::Pay, Err(Rejection::OrderAlreadyPaid)),
            (PartiallyRefunded, 400, OrderEvent::Close, Err(Rejection::OrderAlreadyPaid)),
            (PartiallyRefunded, 400, refund(100), to(PartiallyRefunded, 500)),
            (PartiallyRefunded, 400, refund(600), to(Refunded, 1_000)),
            (PartiallyRefunded, 400, refund(601), Err(Rejection::RefundExceedsPaid)),
            (Refunded, 1_000, OrderEvent::Pay, Err(Rejection::OrderAlreadyPaid)),
            (Refunded, 1_000, OrderEvent::Close, Err(Rejection::OrderAlreadyPaid)),
            (Refunded, 1_000, refund(1), Err(Rejection::RefundExceedsPaid)),
            (Closed, 0, OrderEvent::Pay, Err(Rejection::OrderClosed)),
            (Closed, 0, OrderEvent::Close, Ok(Transition::AlreadyApplied)),
            (Closed, 0, refund(1), Err(Rejection::OrderNotPaid)),
        ];
        for (status, refunded, event, expected) in table {
            assert_eq!(state(status, refunded).apply(event), expected, "{status:?} + {event:?}");
        }
        // Every (state, event kind) pair appears in the table above.
        for status in OrderStatus::ALL {
            for event in [OrderEvent::Pay, OrderEvent::Close, refund(1)] {
                let covered = table
                    .iter()
                    .any(|(s, _, e, _)| *s == status && std::mem::discriminant(e) == std::mem::discriminant(&event));
                assert!(covered, "{status:?} + {event:?} is missing from the table");
            }
        }
    }

    #[test]
    fn stored_status_text_round_trips() {
        for status in OrderStatus::ALL {
            assert_eq!(OrderStatus::from_stored(status.as_str()), Some(status));
        }
        assert_eq!(OrderStatus::from_stored("paid"), None);
    }

    fn any_event() -> impl Strategy<Value = OrderEvent> {
        prop_oneof![Just(OrderEvent::Pay), Just(OrderEvent::Close), (1i64..=1_200).prop_map(refund),]
    }

    proptest! {
        #[test]
        fn any_event_sequence_keeps_refunds_within_the_paid_amount(events in prop::collection::vec(any_event(), 0..40)) {
            let mut current = state(Pending, 0);
            let mut refunded_total = 0;
            for event in events {
                match current.apply(event) {
                    Ok(Transition::To(next)) => {
                        if let OrderEvent::Refund { amount_minor_units } = event {
                            refunded_total += amount_minor_units;
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
                if current.refunded_minor_units > 0 { prop_assert!(current.status.is_paid()); }
            }
        }
    }
}
