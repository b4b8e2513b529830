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
//!   postings and holds in arrival order, and the write set it leaves, checked and written
//!   (each balance by a version CAS from the row read under its lock);
//! - [`group_commit`]: the batch writer: it locks and reads what each write says it needs,
//!   runs each write's decision in arrival order, claims the writes' guards and writes one
//!   write set, many calls in one transaction or one alone;
//! - [`known`]: the orders and accounts last seen committed, from which a batch of one is
//!   decided and written in one round trip, every row it read guarded by its write.
//!
//! The use cases (`payments`, `accounts`, `holds`) decide what a write does, each once
//! (`group_commit::BatchWrite`). The whole write path is explained in `docs/write-engine.md`.

pub(in crate::ledger) mod batching;
pub(in crate::ledger) mod book;
pub(in crate::ledger) mod group_commit;
pub(in crate::ledger) mod invariants;
pub(in crate::ledger) mod known;
pub(in crate::ledger) mod posting;
pub(in crate::ledger) mod transaction;
