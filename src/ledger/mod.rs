//! Use cases. Each one owns its transaction boundary and its idempotency rule:
//!
//! | RPC          | guarded by                                                        |
//! |--------------|-------------------------------------------------------------------|
//! | OpenAccount  | primary key on account_id                                         |
//! | Deposit      | primary key on request_id                                         |
//! | CreateOrder  | primary key on (merchant_id, order_no)                            |
//! | CloseOrder   | conditional UPDATE `WHERE status = 'PENDING'`                     |
//! | Pay          | unique (merchant_id, out_trade_no), then `WHERE status = 'PENDING'` |
//! | Refund       | unique (merchant_id, out_refund_no), then the order's refund CAS  |
//! | balances     | version CAS on every account, in account_id order                 |
//!
//! The shape is the same everywhere: a read-only replay path answers a key that is already
//! committed; otherwise one transaction inserts the key row first (a concurrent duplicate
//! waits on the unique index for the first one's outcome), advances the state machine with
//! a conditional UPDATE, moves money by version CAS with two journal entries, and commits
//! all of it or nothing. When the insert finds the key taken, the transaction is rolled back
//! and the committed original is replayed.

mod accounts;
mod commands;
mod payments;
mod posting;

mod transaction;

use std::time::{SystemTime, UNIX_EPOCH};

pub use accounts::{DepositReceipt, EntryPage};
pub use commands::{CreateOrder, Deposit, ListEntries, OpenAccount, Pay, QueryKey, Refund};
pub use payments::{OrderDetails, PayReceipt, RefundReceipt};

use crate::error::Error;
use crate::store::{AuditViolation, Store};

/// Stored records, as the use cases return them.
pub mod records {
    pub use crate::store::{AccountRow, EntryRow, OrderRow, PaymentRow, RefundRow};
}

/// The value of a mutating call, and whether it was replayed from an earlier call with the
/// same key (then the transport adds `idempotent-replayed: true`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replayable<T> {
    pub value: T,
    pub replayed: bool,
}

impl<T> Replayable<T> {
    fn fresh(value: T) -> Self {
        Self {
            value,
            replayed: false,
        }
    }

    fn replayed(value: T) -> Self {
        Self {
            value,
            replayed: true,
        }
    }
}

/// The payment ledger: every use case, over one [`Store`].
#[derive(Clone)]
pub struct Ledger {
    store: Store,
}

impl Ledger {
    pub fn new(store: Store) -> Self {
        Self { store }
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Checks every ledger invariant (see `payledger audit`): for every account, balance =
    /// sum of its entries and version = their count; the balances of each currency sum to
    /// zero; every posting has two legs summing to zero; refunds never exceed payments.
    ///
    /// # Errors
    /// [`Error::Database`] when the checks cannot run.
    pub async fn audit(&self) -> Result<Vec<AuditViolation>, Error> {
        let mut reader = self.store.reader().await?;
        Ok(reader.queries().audit().await?)
    }

    /// Checks that the database answers.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn ping(&self) -> Result<(), Error> {
        Ok(self.store.reader().await?.ping().await?)
    }
}

/// Now, in microseconds since the Unix epoch.
fn now_micros() -> i64 {
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(since_epoch.as_micros()).unwrap_or(i64::MAX)
}

/// A server-issued id: a prefix letter and a time-ordered UUIDv7 in hex (33 characters).
fn new_id(prefix: char) -> String {
    format!("{prefix}{}", uuid::Uuid::now_v7().simple())
}

/// The names of the fields whose stored and requested values differ.
fn differing_fields(comparisons: &[(&'static str, bool)]) -> Vec<&'static str> {
    comparisons
        .iter()
        .filter(|(_, same)| !same)
        .map(|(field, _)| *field)
        .collect()
}

/// What a transaction that inserts a key row first found.
enum Inserted<T> {
    Done(T),
    /// The key row was already there: roll back and replay the committed original.
    KeyTaken,
}

/// The key row was taken by a committed row that is no longer there: impossible while rows
/// are never deleted.
fn key_vanished() -> Error {
    Error::Internal("a key reported as taken has no committed row".into())
}
