//! The reaper: deletes expired idempotency records and tokens in small batches, with a pause
//! between batches, so it never holds locks long against live traffic.

use std::time::Duration;

use tokio::task::JoinHandle;

use crate::error::Error;

use super::{now_micros, Ledger};

/// How the reaper runs.
#[derive(Debug, Clone)]
pub struct ReaperSettings {
    /// Time between sweeps.
    pub interval: Duration,
    /// Most rows one DELETE statement removes.
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

#[derive(Clone, Copy)]
enum Table {
    Records,
    Tokens,
}

/// Runs [`Ledger::reap_expired`] every `settings.interval` until the task is aborted.
pub fn spawn_reaper(ledger: Ledger, settings: ReaperSettings) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(settings.interval).await;
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
