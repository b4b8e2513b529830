//! The reaper: deletes expired idempotency records and tokens, closes PENDING orders whose
//! `expires_at` has passed (the order sweeper) and releases authorization holds past theirs
//! (the hold sweeper), in small batches, so it never holds locks long against live traffic.

use std::time::Duration;

use tokio::task::JoinHandle;

use crate::domain::{CloseReason, OrderEvent, Rejection, Transition};
use crate::error::Error;

use super::payments::order_state;
use super::{now_micros, Ledger};

/// How the reaper runs.
#[derive(Debug, Clone)]
pub struct ReaperSettings {
    /// Time between sweeps.
    pub interval: Duration,
    /// Most rows one DELETE statement removes, and most orders one sweeper transaction closes.
    pub batch_size: u32,
    /// Pause between two batches of one sweep.
    pub pause: Duration,
}

impl Default for ReaperSettings {
    fn default() -> Self {
        Self { interval: Duration::from_secs(60), batch_size: 500, pause: Duration::from_millis(50) }
    }
}

/// What one sweep deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReapReport {
    pub records_deleted: u64,
    pub tokens_deleted: u64,
    /// DELETE statements run, including the last one that found nothing (or less than a
    /// batch).
    pub batches: u64,
}

impl Ledger {
    /// One sweep: deletes everything that expired by now, `batch_size` rows per statement
    /// (each its own short write transaction, queued with requests' transactions on SQLite),
    /// pausing `pause` between statements.
    ///
    /// # Errors
    /// [`Error::Database`]; what was deleted before stays deleted.
    pub async fn reap_expired(&self, settings: &ReaperSettings) -> Result<ReapReport, Error> {
        let now = now_micros();
        let limit = i64::from(settings.batch_size.max(1));
        let mut report = ReapReport::default();
        for table in [Table::Records, Table::Tokens] {
            loop {
                // A write transaction of its own, begun like a request's: on SQLite it takes its
                // turn in the same writer queue as requests instead of polling SQLite's busy
                // handler against them (which could wait seconds under load).
                let mut tx = self.store.begin().await?;
                let deleted = match table {
                    Table::Records => tx.queries().reap_records(now, limit).await?,
                    Table::Tokens => tx.queries().reap_tokens(now, limit).await?,
                };
                tx.commit().await?;
                report.batches += 1;
                match table {
                    Table::Records => report.records_deleted += deleted,
                    Table::Tokens => report.tokens_deleted += deleted,
                }
                self.metrics.reaper_deletions.inc_by(deleted);
                if deleted < limit.unsigned_abs() {
                    break;
                }
                tokio::time::sleep(settings.pause).await;
            }
        }
        Ok(report)
    }
}

/// What one sweep of expired orders did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExpiryReport {
    /// Orders moved from PENDING to CLOSED (reason EXPIRED) by this sweep.
    pub orders_closed: u64,
    /// Orders found expired whose conditional UPDATE changed nothing: a Pay or CloseOrder
    /// (or another instance's sweeper) moved them first, or another transaction held them
    /// (left to the next sweep, never waited for).
    pub orders_skipped: u64,
    /// Transactions run, including the last one that found less than a batch.
    pub batches: u64,
}

impl Ledger {
    /// One sweep of the order sweeper: closes every PENDING order whose `expires_at` is at or
    /// before now, at most `batch_size` per transaction, pausing `pause` between them. Each
    /// order moves by the same conditional UPDATE as CloseOrder (`WHERE status = 'PENDING'`,
    /// here also `AND expires_at <= now`), so a Pay racing the sweeper on an order leaves it
    /// PAID (the sweeper's UPDATE then changes nothing) or CLOSED (the Pay, which reads the
    /// order under its row lock, then gets ORDER_EXPIRED), never both. The sweeper never waits
    /// for a lock: an order another transaction holds is skipped (`FOR UPDATE SKIP LOCKED`)
    /// and closed by a later sweep, so one long transaction cannot hold up a batch.
    ///
    /// # Errors
    /// [`Error::Database`]; what was closed before stays closed.
    pub async fn close_expired_orders(&self, settings: &ReaperSettings) -> Result<ExpiryReport, Error> {
        let now = now_micros();
        let limit = i64::from(settings.batch_size.max(1));
        let mut report = ExpiryReport::default();
        loop {
            let closed_before = report.orders_closed;
            let mut tx = self.store.begin().await?;
            let mut keys = tx.queries().find_expired_orders(now, limit).await?;
            keys.sort();
            let found = keys.len();
            for (merchant_id, order_no) in &keys {
                let mut queries = tx.queries();
                // An order another transaction holds (a Pay in flight) is left to the next sweep.
                let Some(order) = queries.try_lock_order(merchant_id, order_no).await? else {
                    report.orders_skipped += 1;
                    continue;
                };
                if queries.close_order(merchant_id, order_no, CloseReason::Expired.as_str(), now, Some(now)).await? {
                    report.orders_closed += 1;
                    continue;
                }
                // Changed nothing: the state machine says why (it moved on), and the sweeper skips it.
                match order_state(&order, now)?.apply(OrderEvent::Expire) {
                    Ok(Transition::AlreadyApplied) | Err(Rejection::OrderAlreadyPaid | Rejection::OrderAuthorized) => {}
                    outcome => tracing::warn!(merchant_id, order_no, ?outcome, "an expired order was not closed"),
                }
                report.orders_skipped += 1;
            }
            tx.commit().await?;
            report.batches += 1;
            // A short batch was the last; a batch that closed nothing (its orders held by other
            // transactions, or moved on) is left to the next sweep rather than read again at once.
            if found < usize::try_from(limit).unwrap_or(usize::MAX) || report.orders_closed == closed_before {
                break;
            }
            tokio::time::sleep(settings.pause).await;
        }
        self.metrics.orders_expired.inc_by(report.orders_closed);
        Ok(report)
    }
}

#[derive(Clone, Copy)]
enum Table {
    Records,
    Tokens,
}

/// Runs [`Ledger::close_expired_orders`], [`Ledger::release_expired_holds`] and
/// [`Ledger::reap_expired`] every `settings.interval` until the task is aborted.
pub fn spawn_reaper(ledger: Ledger, settings: ReaperSettings) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(settings.interval).await;
            match ledger.close_expired_orders(&settings).await {
                Ok(report) if report.orders_closed + report.orders_skipped > 0 => {
                    tracing::info!(
                        closed = report.orders_closed,
                        skipped = report.orders_skipped,
                        batches = report.batches,
                        "closed expired orders"
                    );
                }
                Ok(_) => {}
                Err(error) => tracing::warn!(?error, "order sweep failed; trying again next interval"),
            }
            match ledger.release_expired_holds(settings.batch_size).await {
                Ok((released, skipped)) if released + skipped > 0 => {
                    tracing::info!(released, skipped, "released expired holds");
                }
                Ok(_) => {}
                Err(error) => tracing::warn!(?error, "hold sweep failed; trying again next interval"),
            }
            match ledger.reap_expired(&settings).await {
                Ok(report) if report.records_deleted + report.tokens_deleted > 0 => {
                    tracing::info!(
                        records = report.records_deleted,
                        tokens = report.tokens_deleted,
                        batches = report.batches,
                        "reaped expired keys"
                    );
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(%error, "reaper sweep failed; trying again next interval")
                }
            }
        }
    })
}
