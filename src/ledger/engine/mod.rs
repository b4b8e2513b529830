//! The write engine below the use cases: what every write of the ledger does the same way,
//! whichever use case it serves. It knows accounts, journal entries and transactions, and no
//! use case:
//!
//! - [`transaction`]: one local transaction per write, committed or rolled back, run again
//!   from BEGIN after a deadlock or serialization failure;
//! - [`posting`]: double entry, one posting as two journal entries summing to zero, and the
//!   rules of one leg;
//! - [`invariants`]: the money invariants every write set is checked against before it is
//!   written, in release builds;
//! - [`batching`]: the batch workers and their bounded queues, which hand the calls that
//!   queued up to a writer as one batch, under light load a batch of one;
//! - [`book`]: the accounts a write holds under their row locks, moved in memory by its
//!   postings in arrival order, and the write set it leaves, checked and written (each
//!   balance by a version CAS from the row read under its lock).
//!
//! The use cases (`payments`, `accounts`, `holds`) decide what a write does; the group
//! commit (`group_commit`) is the batch writer that applies their decisions, many in one
//! transaction or one alone. The whole write path is explained in `docs/write-engine.md`.

pub(in crate::ledger) mod batching;
pub(in crate::ledger) mod book;
pub(in crate::ledger) mod invariants;
pub(in crate::ledger) mod posting;
pub(in crate::ledger) mod transaction;
