//! Use cases. Each one owns its transaction boundary and its idempotency rule; which mechanism
//! guards which RPC is the table in `README.md` ("The guarantee"), and how each works is
//! `docs/exactly-once.md`.
//!
//! The shape is the same everywhere: a read-only replay path answers a key that is already
//! committed; otherwise one transaction locks the rows the call moves (its order, then its
//! accounts in account_id order), finds under those locks whether its key was taken
//! meanwhile, decides by the use case's rules, advances the state machine with a conditional
//! UPDATE, moves money by version CAS with two journal entries, and commits all of it or
//! nothing. A key row's unique index catches a duplicate the locks did not order (a
//! concurrent duplicate waits on it for the first one's outcome): the transaction is rolled
//! back and the committed original is replayed.
//!
//! What every write does the same way lives below the use cases, in `engine` (it imports
//! none of them): the transaction, the posting, the money invariants, the batch workers, a
//! batch's book and write set, and the batch writer. Each write decides once, in its use
//! case's module (`impl BatchWrite for Identified<Pay>`, ...), and every write goes through
//! the engine's group commit by that one decision: Pays, Refunds, Transfers, Deposits,
//! Withdraws and CreateOrders in batches or alone as a batch of one; OpenAccount, CloseOrder,
//! Authorize, Capture and Void always alone. The write path is explained once, in
//! `docs/write-engine.md`.

mod accounts;
mod commands;
mod engine;
mod guards;
mod holds;
mod idempotent;
mod payments;
mod reaper;
pub mod response;
mod tokens;

use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub use accounts::FUNDING_ACCOUNT_SHARDS_MAX;
pub use accounts::{DepositReceipt, EntryPage, TransferReceipt, WithdrawalReceipt};
pub use commands::{
    Authorize, Capture, CreateOrder, Deposit, ListEntries, OpenAccount, Pay, QueryKey, Refund, Transfer, Void, Withdraw,
};
pub use engine::batching::{CallGuard, CallerPresence, GroupCommitSettings};
pub use guards::{Guards, IDEMPOTENCY_KEY_HEADER, IDEMPOTENCY_TOKEN_HEADER};
pub use holds::{CaptureReceipt, HoldReceipt};
pub use payments::{BatchAnswer, BatchCall, OrderDetails, PayReceipt, RefundReceipt};
pub use reaper::{spawn_reaper, ExpiryReport, ReapReport, ReaperSettings};
pub use tokens::{IssuedToken, TokenStore};

use crate::error::Error;
use crate::metrics::{LedgerMetrics, Mechanism};
use crate::store::chain::{self, JournalDigest};
use crate::store::{AuditProgress, AuditViolation, Snapshot, Store};

/// Stored records, as the use cases return them.
pub mod records {
    pub use crate::store::{AccountRow, EntryRow, OrderRow, PaymentRow, RefundRow, TransferRow};
}

/// The value of a mutating call, whether it was replayed from an earlier call with the same
/// key (then the transport adds `idempotent-replayed: true`), and until when the call's
/// `idempotency-key` is kept (microseconds since the Unix epoch; `None` without a key).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replayable<T> {
    pub value: T,
    pub replayed: bool,
    pub key_expires_at: Option<i64>,
}

impl<T> Replayable<T> {
    /// The same answer with its value mapped (replay flag and key expiry kept).
    pub(crate) fn try_map<U>(self, map: impl FnOnce(T) -> Result<U, Error>) -> Result<Replayable<U>, Error> {
        Ok(Replayable { value: map(self.value)?, replayed: self.replayed, key_expires_at: self.key_expires_at })
    }
}

/// Lifetimes of idempotency keys and one-time tokens.
#[derive(Debug, Clone)]
pub struct LedgerSettings {
    /// How long an `idempotency-key` record is kept (default 24 hours). After that a retry
    /// is still stopped by the natural key (out_trade_no, out_refund_no, request_id...).
    pub key_ttl: Duration,
    /// How long an issued one-time token stays valid (default 5 minutes).
    pub token_ttl: Duration,
    /// How concurrent Pays are grouped into one transaction (see [`GroupCommitSettings`]).
    pub group_commit: GroupCommitSettings,
    /// The lifetime of an order created without `expires_at` (`--order-ttl-seconds`); zero
    /// (the default) means such an order never expires.
    pub order_ttl: Duration,
    /// The lifetime of an authorization hold (`--hold-ttl-seconds`, default 7 days): after it
    /// a Capture is HOLD_EXPIRED and the sweeper releases the hold.
    pub hold_ttl: Duration,
    /// Shards of each currency's funding account that Deposits and Withdraws spread over
    /// (1 to [`FUNDING_ACCOUNT_SHARDS_MAX`]; 1, the default, is the one `@external:USD`).
    pub funding_account_shards: u32,
}

impl Default for LedgerSettings {
    fn default() -> Self {
        Self {
            key_ttl: Duration::from_secs(24 * 60 * 60),
            token_ttl: Duration::from_secs(5 * 60),
            group_commit: GroupCommitSettings::default(),
            order_ttl: Duration::ZERO,
            hold_ttl: Duration::from_secs(7 * 24 * 60 * 60),
            funding_account_shards: 1,
        }
    }
}

impl LedgerSettings {
    fn key_ttl_micros(&self) -> i64 {
        i64::try_from(self.key_ttl.as_micros()).unwrap_or(i64::MAX)
    }

    fn order_ttl_micros(&self) -> i64 {
        i64::try_from(self.order_ttl.as_micros()).unwrap_or(i64::MAX)
    }
}

/// The shutdown line's summary of the ledger's counters (read from [`LedgerMetrics`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CountersSnapshot {
    pub replays: u64,
    pub key_conflicts: u64,
    pub in_flight_waits: u64,
    pub token_consumptions: u64,
    pub reaper_deletions: u64,
    pub group_commits: u64,
    pub group_committed_pays: u64,
    pub group_committed_refunds: u64,
    pub group_committed_transfers: u64,
    pub group_committed_deposits: u64,
    pub group_committed_withdrawals: u64,
    pub group_committed_orders: u64,
}

/// The payment ledger: every use case, over one [`Store`].
#[derive(Clone)]
pub struct Ledger {
    store: Store,
    tokens: TokenStore,
    settings: LedgerSettings,
    metrics: LedgerMetrics,
    /// Started on the first call that can be batched.
    batcher: Arc<OnceLock<engine::group_commit::Batcher>>,
}

impl Ledger {
    /// A ledger with the database token store and default lifetimes.
    pub fn new(store: Store) -> Self {
        Self::with_settings(store, TokenStore::Database, LedgerSettings::default())
    }

    pub fn with_settings(store: Store, tokens: TokenStore, settings: LedgerSettings) -> Self {
        let metrics = LedgerMetrics::default();
        let group_commit = settings.group_commit;
        if group_commit.max_batch > 1 {
            metrics.group_commit_queue_capacity.set(group_commit.capacity());
        }
        Self { store, tokens, settings, metrics, batcher: Arc::default() }
    }

    /// Shards of each currency's funding account that Deposits and Withdraws spread over.
    pub fn funding_account_shards(&self) -> u32 {
        self.settings.funding_account_shards
    }

    /// The counters of the ledger (registered by `crate::metrics::Metrics`).
    pub fn metrics(&self) -> &LedgerMetrics {
        &self.metrics
    }

    /// A summary of the ledger's counters now, for the shutdown line.
    pub fn counters(&self) -> CountersSnapshot {
        let metrics = &self.metrics;
        CountersSnapshot {
            replays: metrics.replays_total(),
            key_conflicts: metrics.key_conflicts_total(),
            in_flight_waits: metrics.in_flight_waits.get(),
            token_consumptions: metrics.tokens_consumed.get(),
            reaper_deletions: metrics.reaper_deletions.get(),
            group_commits: metrics.group_commits.get(),
            group_committed_pays: metrics.group_committed_pays.get(),
            group_committed_refunds: metrics.group_committed_refunds.get(),
            group_committed_transfers: metrics.group_committed_transfers.get(),
            group_committed_deposits: metrics.group_committed_deposits.get(),
            group_committed_withdrawals: metrics.group_committed_withdrawals.get(),
            group_committed_orders: metrics.group_committed_orders.get(),
        }
    }

    pub fn token_store(&self) -> &TokenStore {
        &self.tokens
    }

    /// Counts and marks a replay answered by a natural key (out_trade_no, request_id...).
    fn natural_replay<T>(&self, value: T) -> Replayable<T> {
        self.metrics.replay(Mechanism::NaturalKey);
        Replayable { value, replayed: true, key_expires_at: None }
    }

    /// Counts a natural key reused with other parameters, where that is the call's answer: the
    /// idempotency driver once no guard of the call answers instead
    /// (`guard_or_natural_conflict`), a group-committed Pay without guards once its batch
    /// found its out_trade_no taken. The reads that find the conflict only build the error.
    fn natural_conflict(&self, error: Error) -> Error {
        if let Error::KeyReused { key, .. } = &error {
            self.metrics.key_conflict(key.reason());
        }
        error
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Checks every ledger invariant (see `payledger audit` and docs/audit.md): for
    /// every account, balance = sum of its entries and version = their count; the balances of
    /// each currency sum to zero; every entry is a leg of its business row; and the rest.
    ///
    /// # Errors
    /// [`Error::Database`] when the checks cannot run.
    pub async fn audit(&self) -> Result<Vec<AuditViolation>, Error> {
        self.audit_reporting(&mut |_| {}).await
    }

    /// [`Ledger::audit`], telling `progress` of each check as it finishes.
    ///
    /// # Errors
    /// [`Error::Database`] when the checks cannot run.
    pub async fn audit_reporting(
        &self,
        progress: &mut (dyn FnMut(AuditProgress) + Send),
    ) -> Result<Vec<AuditViolation>, Error> {
        let mut reader = self.store.reader().await?;
        Ok(reader.queries().audit(progress).await?)
    }

    /// Checks what the journal entries with ids in `(after, upto]` wrote, in time that grows
    /// with that range rather than with the ledger (see `payledger audit --from-entry`). Sound
    /// only together with a full [`Ledger::audit`] that covered the entries up to `after`.
    ///
    /// # Errors
    /// [`Error::Database`] when the checks cannot run.
    pub async fn audit_entries(&self, after: i64, upto: i64) -> Result<Vec<AuditViolation>, Error> {
        self.audit_entries_reporting(after, upto, &mut |_| {}).await
    }

    /// [`Ledger::audit_entries`], telling `progress` of each check as it finishes.
    ///
    /// # Errors
    /// [`Error::Database`] when the checks cannot run.
    pub async fn audit_entries_reporting(
        &self,
        after: i64,
        upto: i64,
        progress: &mut (dyn FnMut(AuditProgress) + Send),
    ) -> Result<Vec<AuditViolation>, Error> {
        let mut reader = self.store.reader().await?;
        Ok(reader.queries().audit_entries(after, upto, progress).await?)
    }

    /// The ledger's digest up to journal entry `upto`, and its leaves (each account's latest
    /// chain hash at or before it, the number of entries and the ranges outside the chain up to
    /// it), sorted by name (see `docs/audit.md`, "The hash
    /// chain"). It proves something only of a ledger whose chains a full audit found intact.
    ///
    /// # Errors
    /// [`Error::Database`] when the journal cannot be read.
    pub async fn journal_digest(&self, upto: i64) -> Result<(JournalDigest, Vec<(String, chain::Hash)>), Error> {
        let mut reader = self.store.reader().await?;
        let heads = reader.queries().digest_leaves(upto).await?;
        Ok((JournalDigest::of(upto, &heads), heads))
    }

    /// The id of the newest journal entry written at or before `time` (microseconds since the
    /// Unix epoch), 0 when there is none: the checkpoint an audit reports.
    ///
    /// # Errors
    /// [`Error::Database`] when the journal cannot be read.
    pub async fn settled_entry(&self, time: i64) -> Result<i64, Error> {
        let mut reader = self.store.reader().await?;
        Ok(reader.queries().settled_entry(time).await?)
    }

    /// Checks that the database answers.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn ping(&self) -> Result<(), Error> {
        Ok(self.store.reader().await?.ping().await?)
    }
}

/// The answer of reads at one moment (`outcome`), the snapshot ended: finished whatever the
/// reads found (a key not found is an answer too, and the connection goes back to the pool),
/// except after a driver error, when it is dropped and its connection closed.
///
/// # Errors
/// The reads' error; then [`Error::Database`] when the snapshot cannot end.
async fn read_ended<T>(snapshot: Snapshot, outcome: Result<T, Error>) -> Result<T, Error> {
    if !matches!(outcome, Err(Error::Database(_))) {
        snapshot.finish().await?;
    }
    outcome
}

/// Now, in microseconds since the Unix epoch.
fn now_micros() -> i64 {
    let since_epoch = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    i64::try_from(since_epoch.as_micros()).unwrap_or(i64::MAX)
}

/// The time a deadline (an order's or a hold's `expires_at`) is judged at: read after the
/// order's row lock is taken, so a call that waited for the lock past the deadline is refused
/// even though its transaction's `now` (its rows' `created_at`) was read before the wait; never
/// earlier than `now`.
fn deadline_clock(now: i64) -> i64 {
    now_micros().max(now)
}

/// A server-issued id: a prefix letter and a time-ordered UUIDv7 in hex (33 characters).
fn new_id(prefix: char) -> String {
    format!("{prefix}{}", uuid::Uuid::now_v7().simple())
}

/// A command with the id the server gives what it creates (deposit_id, trade_no,
/// refund_no, transfer_id), made once per call so that every run of its transaction writes
/// the same id.
#[derive(Clone)]
struct Identified<C> {
    command: C,
    id: String,
}

/// What a transaction that inserts a key row first found.
enum Inserted<T> {
    Done(T),
    /// The key row was already there: roll back and replay the committed original.
    KeyTaken,
}
