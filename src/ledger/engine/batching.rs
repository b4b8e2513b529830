//! Batch workers: each worker takes the calls routed to it that have queued up and hands them
//! to a [`BatchWriter`] as one batch, whose outcome answers each call. Batching is natural (no
//! timer): under light load a batch holds one call and starts at once; under load calls queue
//! for the next batch. The workers know no use case: the writer says how a call is routed and
//! how a batch is written.

use std::collections::HashMap;
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use opentelemetry::trace::TraceContextExt as _;
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use crate::error::Error;
use crate::metrics::{LedgerMetrics, SHED_QUEUE_FULL};

/// Writes the batches the workers form.
pub(in crate::ledger) trait BatchWriter: Send + Sync + 'static {
    /// A call as a batch takes it.
    type Call: Send + 'static;
    /// What a batch answers one call.
    type Outcome: Send + 'static;

    /// What routes a call to its worker: calls of one route share a worker (and its queue).
    fn route(call: &Self::Call) -> &str;

    /// Writes one batch; one outcome per call, in order. `route_alone`: the database is not busy
    /// (at most [`ROUTE_ALONE_BESIDE_MAX`] other batches of its worker in flight) and no call of
    /// the batch's routes is in one of them, nor was lately ([`ROUTE_COOLDOWN_BATCHES`]), so no
    /// batch beside it is likely to move its rows.
    fn write(&self, calls: Vec<Self::Call>, route_alone: bool) -> impl Future<Output = Vec<Self::Outcome>> + Send;

    /// The outcome of a call no batch started: refused with `Some(error)` (its queue was full:
    /// OVERLOADED; its caller had gone), or, with `None`, the workers are gone.
    fn not_started(refusal: Option<Error>) -> Self::Outcome;
}

/// How the batch workers group calls (`--pay-batch-max`, `--pay-batch-workers`,
/// `--pay-batch-pipeline`, `--pay-queue-max`, `--pay-batch-unlocked`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupCommitSettings {
    /// Most calls (Pays, Refunds, Transfers, Deposits, Withdraws, CreateOrders) written by one
    /// transaction; 1 turns group commit off.
    pub max_batch: usize,
    /// Workers, each with its own queue (a call is routed to one by what it moves: a Pay by its
    /// merchant_id, a Transfer by its from_account_id, a Deposit by its funding account).
    pub workers: usize,
    /// Most batches of one worker in flight at once (each holds one pooled connection while
    /// it runs). A batch starts at once when none runs; while batches run, another starts only
    /// while each of them holds a single call (light load), so a second caller is served
    /// beside the first, and under load calls queue for the next batch instead (see `work`).
    /// 1: one batch after another.
    pub pipeline: usize,
    /// Most calls waiting in one worker's queue; a call that finds it full is refused
    /// RESOURCE_EXHAUSTED (OVERLOADED).
    pub queue_max: usize,
    /// Whether a batch may be `route_alone` at all (see [`BatchWriter::write`]): on PostgreSQL
    /// such a batch of one is written without row locks. False: every batch locks its rows.
    pub unlocked: bool,
}

impl Default for GroupCommitSettings {
    fn default() -> Self {
        Self { max_batch: 64, workers: 1, pipeline: DEFAULT_PIPELINE, queue_max: 1024, unlocked: true }
    }
}

impl GroupCommitSettings {
    /// Calls the queues hold in all (`payledger_group_commit_queue_capacity`): workers times
    /// `queue_max`. With several workers one queue can fill before the sum reaches this.
    pub fn capacity(&self) -> i64 {
        i64::try_from(self.workers.max(1).saturating_mul(self.queue_max.max(1))).unwrap_or(i64::MAX)
    }
}

/// Batches of one worker in flight at once by default (see [`GroupCommitSettings::pipeline`]):
/// four, which serve two callers a quarter faster than one batch at a time and keep the rate
/// at 32 callers (docs/benchmarks-history.md, "Batches in flight under light load").
pub const DEFAULT_PIPELINE: usize = 4;

/// Whether a call's caller still waits for its answer: its deadline (`grpc-timeout`) and
/// whether the transport dropped the call (cancelled by the client, or the connection
/// closed). A queued call whose caller has gone is not started.
#[derive(Debug, Clone, Default)]
pub struct CallerPresence {
    deadline: Option<Instant>,
    dropped: Arc<AtomicBool>,
}

impl CallerPresence {
    /// The presence of a call with `deadline`, and the guard that marks it dropped when the
    /// handler that holds it is dropped (tonic drops a cancelled call's handler).
    pub fn new(deadline: Option<Instant>) -> (Self, CallGuard) {
        let presence = Self { deadline, dropped: Arc::default() };
        let guard = CallGuard(presence.dropped.clone());
        (presence, guard)
    }

    /// `Some` once the caller has gone: whether its deadline passed (else it was dropped).
    fn gone(&self) -> Option<bool> {
        if self.deadline.is_some_and(|deadline| Instant::now() >= deadline) {
            return Some(true);
        }
        self.dropped.load(Ordering::Relaxed).then_some(false)
    }
}

/// Marks its [`CallerPresence`] dropped when dropped.
#[derive(Debug)]
pub struct CallGuard(Arc<AtomicBool>);

impl Drop for CallGuard {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

struct Job<W: BatchWriter> {
    call: W::Call,
    presence: CallerPresence,
    /// The call's span, which the batch's span links to.
    link: opentelemetry::trace::SpanContext,
    reply: oneshot::Sender<W::Outcome>,
}

/// The queues in front of the batch workers, one per worker, each call routed to one by
/// [`BatchWriter::route`]. Dropping it ends the workers once their batches in flight finish.
pub(in crate::ledger) struct Batcher<W: BatchWriter> {
    queues: Vec<mpsc::Sender<Job<W>>>,
    metrics: LedgerMetrics,
}

impl<W: BatchWriter> Batcher<W> {
    /// Starts `settings.workers` workers on the current tokio runtime, writing with `writer`.
    pub(in crate::ledger) fn start(writer: W, settings: GroupCommitSettings, metrics: LedgerMetrics) -> Self {
        let writer = Arc::new(writer);
        let queues = (0..settings.workers.max(1))
            .map(|_| {
                let (jobs, queue) = mpsc::channel(settings.queue_max.max(1));
                tokio::spawn(work(writer.clone(), queue, settings, metrics.clone()));
                jobs
            })
            .collect();
        Self { queues, metrics }
    }

    /// Queues a call and waits for its batch. [`BatchWriter::not_started`] with OVERLOADED when
    /// its queue is full (nothing read or written), with `None` when the workers are gone.
    pub(in crate::ledger) async fn submit(&self, call: W::Call, presence: CallerPresence) -> W::Outcome {
        let mut hasher = std::hash::DefaultHasher::new();
        W::route(&call).hash(&mut hasher);
        let queue = &self.queues[(hasher.finish() % self.queues.len() as u64) as usize];
        let (reply, outcome) = oneshot::channel();
        let link = tracing::Span::current().context().span().span_context().clone();
        match queue.try_send(Job { call, presence, link, reply }) {
            Ok(()) => {
                self.metrics.group_commit_queue_depth.inc();
            }
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.metrics.shed(SHED_QUEUE_FULL);
                return W::not_started(Some(Error::Overloaded(SHED_QUEUE_FULL)));
            }
            Err(mpsc::error::TrySendError::Closed(_)) => return W::not_started(None),
        }
        outcome.await.unwrap_or_else(|_| W::not_started(None))
    }
}

/// A worker: takes whatever has queued up (at most `max_batch`) and runs it as one batch. A
/// batch starts at once when none runs; while batches run, another starts only under light
/// load: fewer than `pipeline` run and each of them holds one call. So a second caller is
/// served beside the first instead of after it, and once batches hold several calls (the
/// database is busy) calls queue up for the next batch, which takes them together: on two
/// cores a batch's CPU, not its round trips, bounds the rate there, and more, smaller batches in
/// flight lose (docs/benchmarks-history.md, "Batches in flight under light load"). A call whose caller has
/// gone when its batch is formed is answered [`BatchWriter::not_started`] and left out. Once the
/// queue is closed, the batches in flight finish before the worker ends.
///
/// Batches in flight at once take their row locks in one order (orders by key, then accounts
/// by account_id, as every transaction of the ledger does), so two batches on the same rows
/// wait for each other, one after the other; on other rows they run side by side.
async fn work<W: BatchWriter>(
    writer: Arc<W>,
    mut queue: mpsc::Receiver<Job<W>>,
    settings: GroupCommitSettings,
    metrics: LedgerMetrics,
) {
    let (max_batch, pipeline) = (settings.max_batch.max(1), settings.pipeline.max(1));
    // Each batch in flight returns the routes of the calls it holds.
    let mut running = tokio::task::JoinSet::new();
    let mut running_calls = 0;
    // The routes of the calls in flight, each with its number of calls: at most `pipeline`
    // batches of `max_batch` calls.
    let mut routes: HashMap<String, usize> = HashMap::new();
    let mut cooling = [0_u8; ROUTE_SLOTS];
    loop {
        // Each batch in flight holds one call: the database is not busy.
        let light_load = running_calls <= running.len();
        let may_start = running.is_empty() || (running.len() < pipeline && light_load);
        if !may_start {
            if let Some(Ok(done)) = running.join_next().await {
                finished(done, &mut running_calls, &mut routes);
            }
            continue;
        }
        let first = tokio::select! {
            job = queue.recv() => match job {
                Some(job) => job,
                None => break,
            },
            Some(done) = running.join_next(), if !running.is_empty() => {
                if let Ok(done) = done {
                    finished(done, &mut running_calls, &mut routes);
                }
                continue;
            }
        };
        let mut taken = vec![first];
        while taken.len() < max_batch {
            match queue.try_recv() {
                Ok(job) => taken.push(job),
                Err(_) => break,
            }
        }
        metrics.group_commit_queue_depth.dec_by(taken.len() as i64);
        let mut jobs = Vec::with_capacity(taken.len());
        for job in taken {
            match job.presence.gone() {
                Some(deadline_passed) => {
                    metrics.group_commit_not_started.inc();
                    let _ = job.reply.send(W::not_started(Some(Error::CallerGone { deadline_passed })));
                }
                None => jobs.push(job),
            }
        }
        if !jobs.is_empty() {
            let calls: Vec<String> = jobs.iter().map(|job| W::route(&job.call).to_owned()).collect();
            let route_alone = settings.unlocked && starts_route_alone(&calls, &routes, running.len(), &mut cooling);
            for route in &calls {
                *routes.entry(route.clone()).or_default() += 1;
            }
            running_calls += calls.len();
            let batch = run_batch(writer.clone(), jobs, route_alone);
            running.spawn(async move {
                batch.await;
                calls
            });
        }
    }
    while running.join_next().await.is_some() {}
}

/// The most other batches in flight beside which a batch may be `route_alone`: past it the
/// database is busy, and batching, not a call's round trips, sets the rate.
pub(in crate::ledger) const ROUTE_ALONE_BESIDE_MAX: usize = 1;

/// After a batch started while another batch held a call of its route (calls of one route
/// contend for its rows), the batches of that route's slot that start next, up to this many,
/// are not `route_alone`.
pub(in crate::ledger) const ROUTE_COOLDOWN_BATCHES: u8 = 32;

/// The slots of [`ROUTE_COOLDOWN_BATCHES`], by route hash: a bounded table, where two routes
/// sharing a slot at worst cool down together.
const ROUTE_SLOTS: usize = 256;

fn route_slot(route: &str) -> usize {
    let mut hasher = std::hash::DefaultHasher::new();
    route.hash(&mut hasher);
    (hasher.finish() % ROUTE_SLOTS as u64) as usize
}

/// Whether a batch of `calls` (their routes) starting now is `route_alone`, noting the routes
/// that contend: a route already in flight cools its slot down; a batch on a cooling slot
/// counts it down by one.
fn starts_route_alone(
    calls: &[String],
    routes: &HashMap<String, usize>,
    beside: usize,
    cooling: &mut [u8; ROUTE_SLOTS],
) -> bool {
    let mut alone = beside <= ROUTE_ALONE_BESIDE_MAX;
    for route in calls {
        let slot = route_slot(route);
        if routes.contains_key(route) {
            cooling[slot] = ROUTE_COOLDOWN_BATCHES;
            alone = false;
        } else if cooling[slot] > 0 {
            cooling[slot] -= 1;
            alone = false;
        }
    }
    alone
}

/// A batch done: its calls and their routes no longer in flight.
fn finished(calls: Vec<String>, running_calls: &mut usize, routes: &mut HashMap<String, usize>) {
    *running_calls -= calls.len();
    for route in calls {
        if let Some(count) = routes.get_mut(&route) {
            *count -= 1;
            if *count == 0 {
                routes.remove(&route);
            }
        }
    }
}

/// Writes one batch and answers each of its calls.
async fn run_batch<W: BatchWriter>(writer: Arc<W>, jobs: Vec<Job<W>>, route_alone: bool) {
    let span = tracing::info_span!("group_commit", calls = jobs.len());
    for job in &jobs {
        if job.link.is_valid() {
            span.add_link(job.link.clone());
        }
    }
    let (calls, replies): (Vec<W::Call>, Vec<_>) = jobs.into_iter().map(|job| (job.call, job.reply)).unzip();
    let outcomes = writer.write(calls, route_alone).instrument(span).await;
    for (reply, outcome) in replies.into_iter().zip(outcomes) {
        // The caller may be gone (client cancelled); the batch is committed regardless.
        let _ = reply.send(outcome);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_route_alone_only_beside_few_batches_none_of_its_route_nor_lately() {
        let mut cooling = [0_u8; ROUTE_SLOTS];
        let mut routes = HashMap::new();
        let merchant = vec!["m1".to_owned()];
        assert!(starts_route_alone(&merchant, &routes, 0, &mut cooling));
        assert!(starts_route_alone(&merchant, &routes, ROUTE_ALONE_BESIDE_MAX, &mut cooling));
        assert!(!starts_route_alone(&merchant, &routes, ROUTE_ALONE_BESIDE_MAX + 1, &mut cooling), "busy");

        routes.insert("m1".to_owned(), 1);
        assert!(!starts_route_alone(&merchant, &routes, 1, &mut cooling), "its route in flight");
        assert!(starts_route_alone(&["m2".to_owned()], &routes, 1, &mut cooling), "another route");
        routes.clear();
        for started in 0..ROUTE_COOLDOWN_BATCHES {
            assert!(!starts_route_alone(&merchant, &routes, 0, &mut cooling), "cooling down, batch {started}");
        }
        assert!(starts_route_alone(&merchant, &routes, 0, &mut cooling), "cooled down");
    }
}
