//! Batch workers: each worker takes the calls routed to it that have queued up and hands them
//! to a [`BatchWriter`] as one batch, whose outcome answers each call. Batching is natural (no
//! timer): under light load a batch holds one call and starts at once, started by its caller
//! with no hand-off to the worker; under load calls queue for the next batch. The workers know
//! no use case: the writer says how a call is routed and
//! how a batch is written.

use std::collections::HashMap;
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use opentelemetry::trace::TraceContextExt as _;
use tokio::sync::{mpsc, oneshot, Notify};
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
    /// Most calls waiting for a batch of one worker (queued, or taken by the worker and waiting
    /// for room in the pipeline); a call that finds them full is refused RESOURCE_EXHAUSTED
    /// (OVERLOADED).
    pub queue_max: usize,
    /// Whether a batch may be `route_alone` at all (see [`BatchWriter::write`]): on PostgreSQL
    /// such a batch of one is written without row locks. False: every batch locks its rows.
    pub unlocked: bool,
    /// Most orders, and most accounts, kept as last seen committed, for a batch to be decided
    /// from and written without reading first (`engine::known`; PostgreSQL, with `unlocked`).
    /// 0: none.
    pub known_rows: usize,
}

impl Default for GroupCommitSettings {
    fn default() -> Self {
        Self {
            max_batch: 64,
            workers: 1,
            pipeline: DEFAULT_PIPELINE,
            queue_max: 1024,
            unlocked: true,
            known_rows: DEFAULT_KNOWN_ROWS,
        }
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

/// The default of [`GroupCommitSettings::known_rows`] (`--pay-batch-known-rows`): at most about
/// 20 MB of orders (about 600 bytes each, measured) and 13 MB of accounts; at 1,000 Pays a
/// second, the orders created in the last half-minute.
pub const DEFAULT_KNOWN_ROWS: usize = 32_768;

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

/// A worker's queue and what its batches in flight hold, shared by the worker and the callers
/// that start a batch of one themselves (see [`Batcher::submit`]).
struct Worker<W: BatchWriter> {
    queue: mpsc::Sender<Job<W>>,
    shared: Arc<Shared>,
}

/// What one worker's batches in flight hold, and the signal that one of them finished.
struct Shared {
    in_flight: Mutex<InFlight>,
    finished: Notify,
    settings: GroupCommitSettings,
}

/// A worker's batches in flight: at most `pipeline` of them, each of at most `max_batch` calls,
/// so `routes` holds at most `pipeline` times `max_batch` entries.
struct InFlight {
    batches: usize,
    calls: usize,
    /// The routes of the calls in flight, each with its number of calls.
    routes: HashMap<String, usize>,
    cooling: [u8; ROUTE_SLOTS],
    /// Calls queued and not yet in a batch the worker started (those it holds count too): while
    /// any wait, a caller does not start a batch of its own ahead of them.
    waiting: usize,
}

impl InFlight {
    /// Whether a batch may start now: at once when none runs; while batches run, only while
    /// fewer than `pipeline` run and each of them holds one call (light load).
    fn may_start(&self, pipeline: usize) -> bool {
        self.batches == 0 || (self.batches < pipeline && self.calls <= self.batches)
    }

    /// Counts a batch of calls with `routes` in flight; whether it is `route_alone`.
    fn start(&mut self, routes: &[String], unlocked: bool) -> bool {
        let route_alone = unlocked && starts_route_alone(routes, &self.routes, self.batches, &mut self.cooling);
        for route in routes {
            *self.routes.entry(route.clone()).or_default() += 1;
        }
        self.batches += 1;
        self.calls += routes.len();
        route_alone
    }

    /// A batch done: its calls and their routes no longer in flight.
    fn finish(&mut self, routes: &[String]) {
        self.batches -= 1;
        self.calls -= routes.len();
        for route in routes {
            if let Some(count) = self.routes.get_mut(route) {
                *count -= 1;
                if *count == 0 {
                    self.routes.remove(route);
                }
            }
        }
    }
}

impl Shared {
    fn new(settings: GroupCommitSettings) -> Self {
        let in_flight =
            InFlight { batches: 0, calls: 0, routes: HashMap::new(), cooling: [0; ROUTE_SLOTS], waiting: 0 };
        Self { in_flight: Mutex::new(in_flight), finished: Notify::new(), settings }
    }

    fn lock(&self) -> MutexGuard<'_, InFlight> {
        // The state is counts, updated whole under the lock: one left by a panic is consistent.
        self.in_flight.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A batch in flight, counted in its worker's [`InFlight`] until dropped, when the batch has
/// ended (its task finished or panicked): then its routes are no longer in flight and the
/// worker is told.
struct Started {
    shared: Arc<Shared>,
    routes: Vec<String>,
}

impl Drop for Started {
    fn drop(&mut self) {
        self.shared.lock().finish(&self.routes);
        self.shared.finished.notify_one();
    }
}

/// The queues in front of the batch workers, one per worker, each call routed to one by
/// [`BatchWriter::route`]. Dropping it ends the workers once their batches in flight finish.
pub(in crate::ledger) struct Batcher<W: BatchWriter> {
    workers: Vec<Worker<W>>,
    writer: Arc<W>,
    metrics: LedgerMetrics,
}

impl<W: BatchWriter> Batcher<W> {
    /// Starts `settings.workers` workers on the current tokio runtime, writing with `writer`.
    pub(in crate::ledger) fn start(writer: W, settings: GroupCommitSettings, metrics: LedgerMetrics) -> Self {
        let writer = Arc::new(writer);
        let workers = (0..settings.workers.max(1))
            .map(|_| {
                let (queue, jobs) = mpsc::channel(settings.queue_max.max(1));
                let shared = Arc::new(Shared::new(settings));
                tokio::spawn(work(writer.clone(), jobs, shared.clone(), metrics.clone()));
                Worker { queue, shared }
            })
            .collect();
        Self { workers, writer, metrics }
    }

    /// Writes a call in a batch and waits for its outcome. When its worker would start a batch
    /// of it at once (no call waits, and a batch may start: see [`GroupCommitSettings::pipeline`])
    /// the call starts a batch of one itself, with no hand-off to the worker; otherwise it is
    /// queued for the worker's next batch. [`BatchWriter::not_started`] with OVERLOADED when its
    /// queue is full (nothing read or written), with `Some(CallerGone)` when its caller has
    /// gone before its batch starts, with `None` when the workers are gone. The batch runs on a
    /// task of its own: a caller that goes away once it started leaves it to finish.
    pub(in crate::ledger) async fn submit(&self, call: W::Call, presence: CallerPresence) -> W::Outcome {
        let mut hasher = std::hash::DefaultHasher::new();
        W::route(&call).hash(&mut hasher);
        let worker = &self.workers[(hasher.finish() % self.workers.len() as u64) as usize];
        if let Some(deadline_passed) = presence.gone() {
            self.metrics.group_commit_not_started.inc();
            return W::not_started(Some(Error::CallerGone { deadline_passed }));
        }
        let link = tracing::Span::current().context().span().span_context().clone();
        let shared = &worker.shared;
        let started = {
            let mut in_flight = shared.lock();
            if in_flight.waiting == 0 && in_flight.may_start(shared.settings.pipeline.max(1)) {
                let routes = vec![W::route(&call).to_owned()];
                let route_alone = in_flight.start(&routes, shared.settings.unlocked);
                Some((Started { shared: shared.clone(), routes }, route_alone))
            } else if in_flight.waiting >= shared.settings.queue_max.max(1) {
                drop(in_flight);
                self.metrics.shed(SHED_QUEUE_FULL);
                return W::not_started(Some(Error::Overloaded(SHED_QUEUE_FULL)));
            } else {
                in_flight.waiting += 1;
                self.metrics.group_commit_queue_depth.inc();
                None
            }
        };
        if let Some((started, route_alone)) = started {
            let writer = self.writer.clone();
            let batch = tokio::spawn(async move {
                let mut outcomes = write_batch(&*writer, vec![call], &[link], route_alone).await;
                drop(started);
                outcomes.pop().unwrap_or_else(|| W::not_started(None))
            });
            return batch.await.unwrap_or_else(|_| W::not_started(None));
        }
        let (reply, outcome) = oneshot::channel();
        // The queue holds no more than `waiting`, which stays within `queue_max`: it is never full.
        if worker.queue.try_send(Job { call, presence, link, reply }).is_err() {
            shared.lock().waiting -= 1;
            self.metrics.group_commit_queue_depth.dec();
            return W::not_started(None);
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
/// flight lose (docs/benchmarks-history.md, "Batches in flight under light load"). The batches
/// callers start themselves ([`Batcher::submit`]) count among those in flight. A call whose
/// caller has gone when its batch is formed is answered [`BatchWriter::not_started`] and left
/// out. Once the queue is closed, the batches in flight finish before the worker ends.
///
/// Batches in flight at once take their row locks in one order (orders by key, then accounts
/// by account_id, as every transaction of the ledger does), so two batches on the same rows
/// wait for each other, one after the other; on other rows they run side by side.
async fn work<W: BatchWriter>(
    writer: Arc<W>,
    mut queue: mpsc::Receiver<Job<W>>,
    shared: Arc<Shared>,
    metrics: LedgerMetrics,
) {
    let (max_batch, pipeline) = (shared.settings.max_batch.max(1), shared.settings.pipeline.max(1));
    loop {
        // Calls queue up while no batch may start, for the next batch to take together.
        if !shared.lock().may_start(pipeline) {
            shared.finished.notified().await;
            continue;
        }
        let Some(first) = queue.recv().await else { break };
        let mut taken = vec![first];
        // Batches callers started may have taken the room meanwhile: the calls taken wait for it.
        let (started, route_alone) = loop {
            {
                let mut in_flight = shared.lock();
                if in_flight.may_start(pipeline) {
                    // What else has queued goes with them.
                    while taken.len() < max_batch {
                        match queue.try_recv() {
                            Ok(job) => taken.push(job),
                            Err(_) => break,
                        }
                    }
                    in_flight.waiting -= taken.len();
                    metrics.group_commit_queue_depth.dec_by(taken.len() as i64);
                    let mut jobs = Vec::with_capacity(taken.len());
                    for job in taken.drain(..) {
                        match job.presence.gone() {
                            Some(deadline_passed) => {
                                metrics.group_commit_not_started.inc();
                                let _ = job.reply.send(W::not_started(Some(Error::CallerGone { deadline_passed })));
                            }
                            None => jobs.push(job),
                        }
                    }
                    if jobs.is_empty() {
                        break (None, false);
                    }
                    let routes: Vec<String> = jobs.iter().map(|job| W::route(&job.call).to_owned()).collect();
                    let route_alone = in_flight.start(&routes, shared.settings.unlocked);
                    break (Some((Started { shared: shared.clone(), routes }, jobs)), route_alone);
                }
            }
            shared.finished.notified().await;
        };
        if let Some((started, jobs)) = started {
            let writer = writer.clone();
            tokio::spawn(async move {
                run_batch(&*writer, jobs, route_alone).await;
                drop(started);
            });
        }
    }
    while shared.lock().batches > 0 {
        shared.finished.notified().await;
    }
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

/// Writes one batch and answers each of its calls.
async fn run_batch<W: BatchWriter>(writer: &W, jobs: Vec<Job<W>>, route_alone: bool) {
    let links: Vec<_> = jobs.iter().map(|job| job.link.clone()).collect();
    let (calls, replies): (Vec<W::Call>, Vec<_>) = jobs.into_iter().map(|job| (job.call, job.reply)).unzip();
    let outcomes = write_batch(writer, calls, &links, route_alone).await;
    for (reply, outcome) in replies.into_iter().zip(outcomes) {
        // The caller may be gone (client cancelled); the batch is committed regardless.
        let _ = reply.send(outcome);
    }
}

/// Writes one batch in a span of its own linked to each call's span; one outcome per call.
async fn write_batch<W: BatchWriter>(
    writer: &W,
    calls: Vec<W::Call>,
    links: &[opentelemetry::trace::SpanContext],
    route_alone: bool,
) -> Vec<W::Outcome> {
    let span = tracing::info_span!("group_commit", calls = calls.len());
    for link in links.iter().filter(|link| link.is_valid()) {
        span.add_link(link.clone());
    }
    writer.write(calls, route_alone).instrument(span).await
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    /// Writes each call (a route) as its outcome (the route and the size of its batch), after a
    /// pause (5 ms; 1 s for a call routed "slow"), noting the most batches in flight at
    /// once; a call routed "panic" panics its batch. A call no batch started is answered with
    /// the refusal's debug text ("gone" without one).
    #[derive(Default)]
    struct Recorder {
        in_flight: AtomicUsize,
        most_in_flight: AtomicUsize,
        batches: AtomicUsize,
    }

    type Answer = Result<(String, usize), String>;

    impl BatchWriter for Arc<Recorder> {
        type Call = String;
        type Outcome = Answer;

        fn route(call: &String) -> &str {
            call
        }

        async fn write(&self, calls: Vec<String>, _route_alone: bool) -> Vec<Answer> {
            let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            self.most_in_flight.fetch_max(now, Ordering::SeqCst);
            self.batches.fetch_add(1, Ordering::SeqCst);
            let pause = if calls.iter().any(|call| call == "slow") { 1_000 } else { 5 };
            tokio::time::sleep(Duration::from_millis(pause)).await;
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            assert!(!calls.iter().any(|call| call == "panic"), "a planted panic");
            let size = calls.len();
            calls.into_iter().map(|call| Ok((call, size))).collect()
        }

        fn not_started(refusal: Option<Error>) -> Answer {
            Err(refusal.map_or_else(|| "gone".to_owned(), |error| format!("{error:?}")))
        }
    }

    fn settings(pipeline: usize, queue_max: usize) -> GroupCommitSettings {
        GroupCommitSettings { pipeline, queue_max, ..GroupCommitSettings::default() }
    }

    fn start(pipeline: usize, queue_max: usize) -> (Arc<Recorder>, Arc<Batcher<Arc<Recorder>>>) {
        let recorder = Arc::new(Recorder::default());
        let batcher = Batcher::start(recorder.clone(), settings(pipeline, queue_max), LedgerMetrics::default());
        (recorder, Arc::new(batcher))
    }

    /// `submit`, failing after 20 s rather than hanging on a batch that never ends.
    async fn submit(batcher: &Batcher<Arc<Recorder>>, call: &str) -> Answer {
        let submitted = batcher.submit(call.to_owned(), CallerPresence::default());
        tokio::time::timeout(Duration::from_secs(20), submitted).await.expect("answered within 20 s")
    }

    /// `submit` on a task of its own.
    fn spawn_submit(batcher: &Arc<Batcher<Arc<Recorder>>>, call: &str) -> tokio::task::JoinHandle<Answer> {
        let (batcher, call) = (batcher.clone(), call.to_owned());
        tokio::spawn(async move { submit(&batcher, &call).await })
    }

    /// The only worker's count of batches in flight and of calls waiting.
    fn counts(batcher: &Batcher<Arc<Recorder>>) -> (usize, usize) {
        let in_flight = batcher.workers[0].shared.lock();
        (in_flight.batches, in_flight.waiting)
    }

    /// Polls until `check` holds (at most 10 s).
    async fn until(what: &str, check: impl Fn() -> bool) {
        for _ in 0..1_000 {
            if check() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("never: {what}");
    }

    /// Waits until every batch of the batcher's workers has ended and nothing waits.
    async fn settled(batcher: &Batcher<Arc<Recorder>>) -> bool {
        for _ in 0..200 {
            let idle = batcher.workers.iter().all(|worker| {
                let in_flight = worker.shared.lock();
                in_flight.batches == 0 && in_flight.calls == 0 && in_flight.routes.is_empty() && in_flight.waiting == 0
            });
            if idle && batcher.metrics.group_commit_queue_depth.get() == 0 {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        false
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_alone_is_a_batch_of_one_and_every_call_gets_its_own_outcome() {
        let (recorder, batcher) = start(DEFAULT_PIPELINE, 1024);
        for n in 0..3 {
            assert_eq!(submit(&batcher, &format!("m{n}")).await, Ok((format!("m{n}"), 1)));
        }
        assert_eq!(recorder.batches.load(Ordering::SeqCst), 3);
        assert!(settled(&batcher).await);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn under_load_calls_queue_into_batches_and_never_exceed_the_pipeline() {
        for pipeline in [1, 2, DEFAULT_PIPELINE] {
            let (recorder, batcher) = start(pipeline, 1024);
            let calls: Vec<_> = (0..200).map(|n| spawn_submit(&batcher, &format!("m{}", n % 7))).collect();
            for (n, call) in calls.into_iter().enumerate() {
                let (route, size) = call.await.unwrap().expect("every call is written");
                assert_eq!(route, format!("m{}", n % 7));
                assert!((1..=64).contains(&size));
            }
            let most = recorder.most_in_flight.load(Ordering::SeqCst);
            assert!(most <= pipeline, "pipeline {pipeline}: {most} batches in flight at once");
            assert!(recorder.batches.load(Ordering::SeqCst) < 200, "pipeline {pipeline}: calls were batched");
            assert!(settled(&batcher).await, "pipeline {pipeline}: nothing left in flight");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn calls_past_queue_max_are_overloaded_and_the_waiting_ones_go_as_one_batch() {
        let (recorder, batcher) = start(1, 2);
        let slow = spawn_submit(&batcher, "slow");
        until("the slow call's batch started", || counts(&batcher) == (1, 0)).await;
        let queued: Vec<_> = ["m1", "m2"].iter().map(|call| spawn_submit(&batcher, call)).collect();
        until("two calls wait", || counts(&batcher) == (1, 2)).await;
        assert_eq!(batcher.metrics.group_commit_queue_depth.get(), 2);
        let refused = submit(&batcher, "m3").await.unwrap_err();
        assert!(refused.contains("Overloaded"), "{refused}");
        assert_eq!(slow.await.unwrap(), Ok(("slow".to_owned(), 1)));
        for (call, answer) in ["m1", "m2"].iter().zip(queued) {
            assert_eq!(answer.await.unwrap(), Ok(((*call).to_owned(), 2)), "both in the worker's one batch");
        }
        assert_eq!(recorder.batches.load(Ordering::SeqCst), 2);
        assert!(settled(&batcher).await);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_that_panics_answers_its_calls_not_started_and_leaves_nothing_in_flight() {
        let (_, batcher) = start(1, 1024);
        // Started by its caller.
        assert_eq!(submit(&batcher, "panic").await, Err("gone".to_owned()));
        assert!(settled(&batcher).await, "after a batch its caller started");
        // Started by the worker: queued behind a batch in flight.
        let first = spawn_submit(&batcher, "slow");
        until("the slow call's batch started", || counts(&batcher) == (1, 0)).await;
        let queued = spawn_submit(&batcher, "panic");
        until("the planted panic waits", || counts(&batcher) == (1, 1)).await;
        assert_eq!(first.await.unwrap(), Ok(("slow".to_owned(), 1)));
        assert_eq!(queued.await.unwrap(), Err("gone".to_owned()));
        assert!(settled(&batcher).await, "after a batch the worker started");
        assert_eq!(submit(&batcher, "m1").await, Ok(("m1".to_owned(), 1)));
    }

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
