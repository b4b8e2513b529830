//! The transaction boundary: run a body in one local transaction, commit it or roll it back,
//! and run it again from BEGIN after a deadlock or serialization failure.

use std::time::Duration;

use crate::error::Error;
use crate::metrics::{CauseLabel, LedgerMetrics};
use crate::store::{classify, conflict_cause, Dialect, Fault, Tx};

use crate::ledger::Inserted;

/// Runs of a whole transaction before a transient failure is returned (as ABORTED).
const TRANSACTION_ATTEMPTS_MAX: u32 = 5;
/// The first backoff step; each retry doubles the ceiling, with full jitter.
const BACKOFF_BASE_MS: u64 = 2;

/// Runs a body in a transaction: commit on `Ok(Inserted::Done)`, roll back otherwise. A deadlock (40P01,
/// 1213), serialization failure (40001), lock timeout or busy database rolls the whole
/// transaction back, so the body runs again from BEGIN, never a single statement.
///
/// `in_transaction!(store, metrics, tx => { ...; Ok(value) })`: the body is an async block
/// over the [`Tx`] named `tx`, so `?` inside it ends the attempt, not the caller. Each
/// attempt is a `db.transaction` span; CAS retries, whole-transaction retries (by cause) and
/// CAS aborts are counted in the [`LedgerMetrics`].
macro_rules! in_transaction {
    ($store:expr, $metrics:expr, $tx:ident => $body:block) => {{
        let metrics: &$crate::metrics::LedgerMetrics = $metrics;
        let mut attempt = 1;
        loop {
            let span = $crate::ledger::engine::transaction::attempt_span($store.dialect(), attempt);
            let outcome = tracing::Instrument::instrument(
                async {
                    match $store.begin().await {
                        Ok(mut $tx) => {
                            let result = async { $body }.await;
                            metrics.cas_retries.inc_by(u64::from($tx.cas_retries()));
                            $crate::ledger::engine::transaction::finish($tx, result).await
                        }
                        Err(error) => Err($crate::error::Error::from(error)),
                    }
                },
                span,
            )
            .await;
            if !$crate::ledger::engine::transaction::should_retry(&outcome, &mut attempt, metrics).await {
                if matches!(outcome, Err($crate::error::Error::Contention)) {
                    metrics.cas_aborts.inc();
                }
                break outcome;
            }
        }
    }};
}
pub(in crate::ledger) use in_transaction;

/// Commits a `Done`, rolls back a `KeyTaken` or an error.
///
/// `KeyTaken` rolls back too: whatever the attempt wrote before it found the key taken (an
/// idempotency record it claimed, say) must not outlive it; the caller replays the original.
pub(crate) async fn finish<T>(mut tx: Tx, mut result: Result<Inserted<T>, Error>) -> Result<Inserted<T>, Error> {
    // A transient error needs no check: it already runs the transaction again.
    let transient = matches!(&result, Err(Error::Database(error)) if classify(error) == Fault::Transient);
    if !transient {
        match tx.still_open().await {
            Ok(true) => {}
            Ok(false) => {
                tracing::debug!("the cluster aborted the transaction under its outcome; running it again");
                result = Err(Error::ClusterAborted);
            }
            Err(error) => result = Err(Error::Database(error)),
        }
    }
    if matches!(result, Ok(Inserted::Done(_))) {
        tx.commit().await?;
        return result;
    }
    if let Err(rollback_error) = tx.rollback().await {
        tracing::warn!(error = %rollback_error, "rollback failed; the connection is discarded");
    }
    result
}

/// The span of one run of a transaction (OpenTelemetry database conventions).
pub(crate) fn attempt_span(dialect: Dialect, attempt: u32) -> tracing::Span {
    tracing::info_span!("db.transaction", otel.kind = "client", db.system.name = dialect.system_name(), attempt)
}

/// True (after a backoff) when the attempt failed transiently and attempts remain.
pub(crate) async fn should_retry<T>(outcome: &Result<T, Error>, attempt: &mut u32, metrics: &LedgerMetrics) -> bool {
    match outcome {
        Err(Error::Database(error)) if classify(error) == Fault::Transient && *attempt < TRANSACTION_ATTEMPTS_MAX => {
            tracing::debug!(%error, attempt = *attempt, "transient conflict; running the transaction again");
            metrics.transaction_retries.get_or_create(&CauseLabel { cause: conflict_cause(error) }).inc();
            backoff(*attempt).await;
            *attempt += 1;
            true
        }
        Err(Error::ClusterAborted) if *attempt < TRANSACTION_ATTEMPTS_MAX => {
            metrics.transaction_retries.get_or_create(&CauseLabel { cause: "cluster_abort" }).inc();
            backoff(*attempt).await;
            *attempt += 1;
            true
        }
        _ => false,
    }
}

/// Sleeps a random time in `0..=BACKOFF_BASE_MS * 2^attempt` ms ("full jitter").
async fn backoff(attempt: u32) {
    let ceiling_ms = BACKOFF_BASE_MS << attempt.min(6);
    tokio::time::sleep(Duration::from_millis(rand::random_range(0..=ceiling_ms))).await;
}
