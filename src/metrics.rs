//! Prometheus metrics (prometheus-client): what the ledger, the gRPC layer and the pool count,
//! and the `/metrics` listener (`serve --metrics-listen`) that exposes them in the
//! OpenMetrics text format. Names follow Prometheus conventions: base units (seconds),
//! `_total` on counters (added by the encoder). The Metrics table of docs/operations.md lists them all.
//!
//! The counters live in the objects that count (the [`Ledger`]'s [`LedgerMetrics`], the
//! store's acquire histogram, the gRPC layer's [`RpcMetrics`]) and are registered into one
//! [`Registry`] per server; the shutdown log line reads the same counters.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};
use tokio::net::TcpListener;

use crate::ledger::Ledger;
use crate::store::Store;

/// How a replayed answer was found (label `mechanism`: `natural_key`, `idempotency_key`,
/// `token`).
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Mechanism {
    /// A business number: out_trade_no, out_refund_no, request_id, order_no, account_id.
    NaturalKey,
    /// The `idempotency-key` header.
    IdempotencyKey,
    /// The `idempotency-token` header.
    Token,
}

impl Mechanism {
    pub fn as_str(self) -> &'static str {
        match self {
            Mechanism::NaturalKey => "natural_key",
            Mechanism::IdempotencyKey => "idempotency_key",
            Mechanism::Token => "token",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MechanismLabel {
    pub mechanism: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// An ErrorInfo reason (`IDEMPOTENCY_KEY_REUSED`, `OUT_TRADE_NO_REUSED`...) or a load
    /// shedding cause.
    pub reason: &'static str,
}

/// What a group commit committed (label `kind` of `payledger_group_committed_calls_total`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// `pay`, `refund`, `transfer`, `deposit`, `withdraw` or `create_order`.
    pub kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CauseLabel {
    /// `deadlock`, `serialization`, `busy` (SQLite) or `interrupted`.
    pub cause: &'static str,
}

/// Every reason of `payledger_key_conflicts_total`: the ALREADY_EXISTS reasons.
pub const KEY_CONFLICT_REASONS: [&str; 7] = [
    "IDEMPOTENCY_KEY_REUSED",
    "TOKEN_REUSED",
    "ACCOUNT_ALREADY_EXISTS",
    "REQUEST_ID_REUSED",
    "ORDER_NO_REUSED",
    "OUT_TRADE_NO_REUSED",
    "OUT_REFUND_NO_REUSED",
];

/// Load shedding causes (label `reason` of `payledger_load_shed_total`).
pub const SHED_CONCURRENCY: &str = "concurrency_limit";
pub const SHED_QUEUE_FULL: &str = "group_commit_queue_full";

/// Buckets of the group-commit batch size: 1, 2, 4 ... 512 calls.
fn batch_buckets() -> Histogram {
    Histogram::new(exponential_buckets(1.0, 2.0, 10))
}

/// Buckets of durations: 0.5 ms to about 16 s, doubling.
pub(crate) fn duration_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

/// What the use cases count. Cheap to clone (every metric is shared).
#[derive(Debug, Clone)]
pub struct LedgerMetrics {
    pub replays: Family<MechanismLabel, Counter>,
    pub key_conflicts: Family<ReasonLabel, Counter>,
    pub in_flight_waits: Counter,
    pub tokens_issued: Counter,
    pub tokens_consumed: Counter,
    pub cas_retries: Counter,
    pub cas_aborts: Counter,
    /// Writes without row locks (a batch of one on PostgreSQL) that found a row they read moved
    /// and were written under locks instead.
    pub unlocked_write_misses: Counter,
    /// Batches (of one call or several) decided from known rows and written in one round trip.
    pub known_row_writes: Counter,
    /// Writes from known rows that found a row moved or a key taken (nothing written), then
    /// read and written as before.
    pub known_row_misses: Counter,
    pub transaction_retries: Family<CauseLabel, Counter>,
    pub reaper_deletions: Counter,
    pub orders_expired: Counter,
    pub holds_expired: Counter,
    pub group_commits: Counter,
    /// `payledger_group_committed_calls_total`, by kind; each field below is one of its
    /// series (a clone shares its count).
    pub group_committed: Family<KindLabel, Counter>,
    pub group_committed_pays: Counter,
    pub group_committed_refunds: Counter,
    pub group_committed_transfers: Counter,
    pub group_committed_deposits: Counter,
    pub group_committed_withdrawals: Counter,
    pub group_committed_orders: Counter,
    pub group_commit_batch: Histogram,
    pub group_commit_queue_depth: Gauge,
    pub group_commit_queue_capacity: Gauge,
    pub group_commit_alone: Counter,
    pub group_commit_not_started: Counter,
    pub load_shed: Family<ReasonLabel, Counter>,
}

impl Default for LedgerMetrics {
    /// Every labelled counter starts with its known label values at 0, so that a query or
    /// an alert over it sees 0 rather than no data.
    fn default() -> Self {
        let group_committed = Family::<KindLabel, Counter>::default();
        let kind = |kind| group_committed.get_or_create_owned(&KindLabel { kind });
        let metrics = Self {
            replays: Family::default(),
            key_conflicts: Family::default(),
            in_flight_waits: Counter::default(),
            tokens_issued: Counter::default(),
            tokens_consumed: Counter::default(),
            cas_retries: Counter::default(),
            cas_aborts: Counter::default(),
            unlocked_write_misses: Counter::default(),
            known_row_writes: Counter::default(),
            known_row_misses: Counter::default(),
            transaction_retries: Family::default(),
            reaper_deletions: Counter::default(),
            orders_expired: Counter::default(),
            holds_expired: Counter::default(),
            group_commits: Counter::default(),
            group_committed_pays: kind("pay"),
            group_committed_refunds: kind("refund"),
            group_committed_transfers: kind("transfer"),
            group_committed_deposits: kind("deposit"),
            group_committed_withdrawals: kind("withdraw"),
            group_committed_orders: kind("create_order"),
            group_committed: group_committed.clone(),
            group_commit_batch: batch_buckets(),
            group_commit_queue_depth: Gauge::default(),
            group_commit_queue_capacity: Gauge::default(),
            group_commit_alone: Counter::default(),
            group_commit_not_started: Counter::default(),
            load_shed: Family::default(),
        };
        for mechanism in [Mechanism::NaturalKey, Mechanism::IdempotencyKey, Mechanism::Token] {
            metrics.replays.get_or_create_owned(&MechanismLabel { mechanism: mechanism.as_str() });
        }
        for reason in KEY_CONFLICT_REASONS {
            metrics.key_conflicts.get_or_create_owned(&ReasonLabel { reason });
        }
        for reason in [SHED_CONCURRENCY, SHED_QUEUE_FULL] {
            metrics.load_shed.get_or_create_owned(&ReasonLabel { reason });
        }
        for cause in RETRY_CAUSES {
            metrics.transaction_retries.get_or_create_owned(&CauseLabel { cause });
        }
        metrics
    }
}

/// Every cause of `payledger_transaction_retries_total` (see `crate::store::conflict_cause`).
const RETRY_CAUSES: [&str; 6] = ["deadlock", "serialization", "busy", "interrupted", "cluster_abort", "other"];

impl LedgerMetrics {
    pub fn replay(&self, mechanism: Mechanism) {
        self.replays.get_or_create(&MechanismLabel { mechanism: mechanism.as_str() }).inc();
    }

    pub fn key_conflict(&self, reason: &'static str) {
        self.key_conflicts.get_or_create(&ReasonLabel { reason }).inc();
    }

    pub fn shed(&self, reason: &'static str) {
        self.load_shed.get_or_create(&ReasonLabel { reason }).inc();
    }

    /// Replays of every mechanism.
    pub fn replays_total(&self) -> u64 {
        [Mechanism::NaturalKey, Mechanism::IdempotencyKey, Mechanism::Token]
            .into_iter()
            .filter_map(|mechanism| {
                self.replays.get(&MechanismLabel { mechanism: mechanism.as_str() }).map(|counter| counter.get())
            })
            .sum()
    }

    /// Key conflicts of every reason.
    pub fn key_conflicts_total(&self) -> u64 {
        KEY_CONFLICT_REASONS
            .into_iter()
            .filter_map(|reason| self.key_conflicts.get(&ReasonLabel { reason }).map(|counter| counter.get()))
            .sum()
    }

    fn register(&self, registry: &mut Registry) {
        registry.register(
            "payledger_replays",
            "Calls answered with an earlier call's result, by how the original was found",
            self.replays.clone(),
        );
        registry.register(
            "payledger_key_conflicts",
            "Keys, tokens or business numbers reused for a different request (ALREADY_EXISTS), by reason",
            self.key_conflicts.clone(),
        );
        registry.register(
            "payledger_in_flight_waits",
            "Calls that waited for a duplicate still in flight holding their key or token",
            self.in_flight_waits.clone(),
        );
        registry.register("payledger_tokens_issued", "One-time tokens issued", self.tokens_issued.clone());
        registry.register(
            "payledger_tokens_consumed",
            "One-time tokens consumed by a committed call",
            self.tokens_consumed.clone(),
        );
        registry.register(
            "payledger_cas_retries",
            "Version CAS or conditional UPDATEs that lost and were tried again inside their transaction",
            self.cas_retries.clone(),
        );
        registry.register(
            "payledger_cas_aborts",
            "Calls answered ABORTED CONTENTION after their CAS attempts ran out",
            self.cas_aborts.clone(),
        );
        registry.register(
            "payledger_unlocked_write_misses",
            "Writes without row locks (a batch of one on PostgreSQL) that found a row they read moved, then written under row locks",
            self.unlocked_write_misses.clone(),
        );
        registry.register(
            "payledger_known_row_writes",
            "Batches on PostgreSQL decided from the orders and accounts last seen committed and written in one round trip",
            self.known_row_writes.clone(),
        );
        registry.register(
            "payledger_known_row_misses",
            "Writes from known rows that found a row moved or a key taken (nothing written), then read and written as before",
            self.known_row_misses.clone(),
        );
        registry.register(
            "payledger_transaction_retries",
            "Whole transactions run again from BEGIN, by cause",
            self.transaction_retries.clone(),
        );
        registry.register(
            "payledger_reaper_deletions",
            "Expired idempotency records and tokens deleted by the reaper",
            self.reaper_deletions.clone(),
        );
        registry.register(
            "payledger_orders_expired",
            "PENDING orders closed by the sweeper once their expires_at passed",
            self.orders_expired.clone(),
        );
        registry.register(
            "payledger_holds_expired",
            "Authorization holds released by the sweeper once their expires_at passed",
            self.holds_expired.clone(),
        );
        registry.register(
            "payledger_group_commits",
            "Group-commit transactions that committed at least one call (Pay, Refund, Transfer, Deposit, Withdraw, CreateOrder)",
            self.group_commits.clone(),
        );
        registry.register(
            "payledger_group_committed_calls",
            "Calls committed by group commits, by kind (pay, refund, transfer, deposit, withdraw, create_order)",
            self.group_committed.clone(),
        );
        registry.register(
            "payledger_group_commit_batch_calls",
            "Calls (Pays, Refunds, Transfers, Deposits, Withdraws, CreateOrders) committed per group commit",
            self.group_commit_batch.clone(),
        );
        registry.register(
            "payledger_group_commit_queue_depth",
            "Pays, Refunds, Transfers, Deposits, Withdraws and CreateOrders queued for group commit, not yet taken by a batch",
            self.group_commit_queue_depth.clone(),
        );
        registry.register(
            "payledger_group_commit_queue_capacity",
            "Calls the group-commit queues hold in all: workers times --pay-queue-max (a call finding its worker's queue full is refused RESOURCE_EXHAUSTED)",
            self.group_commit_queue_capacity.clone(),
        );
        registry.register(
            "payledger_group_commit_alone",
            "Pays, Refunds, Transfers, Deposits, Withdraws and CreateOrders run in a transaction of their own after their batch could not decide them, or refused them while they carried an idempotency key or token",
            self.group_commit_alone.clone(),
        );
        registry.register(
            "payledger_group_commit_not_started",
            "Queued calls dropped before their batch because their caller had gone (cancelled or past its deadline)",
            self.group_commit_not_started.clone(),
        );
        registry.register(
            "payledger_load_shed",
            "Calls refused RESOURCE_EXHAUSTED before any work, by bound",
            self.load_shed.clone(),
        );
    }
}

/// The labels of one RPC, named as go-grpc-middleware and the community gRPC dashboards name
/// them (not `service`, which the Prometheus Operator sets on every target).
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabels {
    /// `payledger.v1.PaymentService`..., or `unknown` for a path that is not an RPC.
    pub grpc_service: &'static str,
    /// `Pay`..., or `unknown`.
    pub grpc_method: &'static str,
    /// `unary`, `server_stream` or `bidi_stream` (gRPC's streaming kinds), or `unknown`.
    pub grpc_type: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    pub grpc_service: &'static str,
    pub grpc_method: &'static str,
    pub grpc_type: &'static str,
    /// The gRPC status code's name (`OK`, `INVALID_ARGUMENT`...).
    pub grpc_code: &'static str,
}

impl CallLabels {
    pub fn new(method: MethodLabels, grpc_code: &'static str) -> Self {
        Self {
            grpc_service: method.grpc_service,
            grpc_method: method.grpc_method,
            grpc_type: method.grpc_type,
            grpc_code,
        }
    }
}

/// Per-RPC metrics of the gRPC layer: the API's calls (PaymentService, AccountService, and
/// paths that are not an RPC), and apart from them the platform's (health and reflection),
/// so that an error ratio or a latency over the API is not diluted by probes.
#[derive(Debug, Clone)]
pub struct RpcMetrics {
    pub calls: Family<CallLabels, Counter>,
    pub duration: Family<MethodLabels, Histogram, fn() -> Histogram>,
    pub in_flight: Family<MethodLabels, Gauge>,
    pub platform_calls: Family<CallLabels, Counter>,
    /// TLS connections closed before they were served, by [`TLS_REFUSALS`] reason.
    pub tls_refused: Family<ReasonLabel, Counter>,
}

/// Why a TLS connection was closed before it was served: its handshake failed (a client
/// certificate no CA of `--tls-client-ca` signed, an expired one, a caller that refused the
/// server's certificate, no common protocol or cipher, plaintext to the TLS port), its peer
/// closed it before the handshake ended (a TCP probe, a port scan, a client that gave up),
/// it did not finish within 5 s, or it arrived while the handshakes in progress (of all
/// peers, or of its address) were at their bound.
pub const TLS_REFUSALS: [&str; 5] =
    ["handshake_failed", "closed_early", "handshake_timed_out", "handshakes_at_bound", "peer_at_bound"];

impl Default for RpcMetrics {
    fn default() -> Self {
        let tls_refused = Family::<ReasonLabel, Counter>::default();
        for reason in TLS_REFUSALS {
            tls_refused.get_or_create_owned(&ReasonLabel { reason });
        }
        Self {
            calls: Family::default(),
            duration: Family::new_with_constructor(duration_buckets),
            in_flight: Family::default(),
            platform_calls: Family::default(),
            tls_refused,
        }
    }
}

impl RpcMetrics {
    /// Starts the families of an API method at 0 (calls with code OK, duration, in flight).
    pub fn know(&self, method: MethodLabels) {
        self.calls.get_or_create_owned(&CallLabels::new(method, "OK"));
        self.duration.get_or_create_owned(&method);
        self.in_flight.get_or_create_owned(&method);
    }

    /// Starts the count of a health or reflection method at 0.
    pub fn know_platform(&self, method: MethodLabels) {
        self.platform_calls.get_or_create_owned(&CallLabels::new(method, "OK"));
    }

    fn register(&self, registry: &mut Registry) {
        registry.register(
            "payledger_rpc_calls",
            "Completed API RPCs (PaymentService, AccountService, unknown paths) by service, method, type and gRPC code",
            self.calls.clone(),
        );
        registry.register_with_unit(
            "payledger_rpc_duration",
            "Handling time of API RPCs, from the request's headers to the response's",
            Unit::Seconds,
            self.duration.clone(),
        );
        registry.register("payledger_rpc_in_flight", "API RPCs being handled now", self.in_flight.clone());
        registry.register(
            "payledger_rpc_platform_calls",
            "Completed health and reflection RPCs, apart from API traffic, by service, method, type and gRPC code",
            self.platform_calls.clone(),
        );
        registry.register(
            "payledger_tls_connections_refused",
            "TLS connections closed before they were served, by reason (handshake_failed, closed_early, \
             handshake_timed_out, handshakes_at_bound, peer_at_bound)",
            self.tls_refused.clone(),
        );
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: &'static str,
}

/// Everything one server exposes.
pub struct Metrics {
    registry: Registry,
    store: Store,
    connections: Family<StateLabel, Gauge>,
    max_connections: Gauge,
}

impl Metrics {
    /// The registry of one server: the ledger's, the store's and the RPC layer's metrics.
    pub fn new(ledger: &Ledger, rpc: &RpcMetrics) -> Self {
        let mut registry = Registry::default();
        ledger.metrics().register(&mut registry);
        rpc.register(&mut registry);
        let store = ledger.store().clone();
        let connections = Family::<StateLabel, Gauge>::default();
        let max_connections = Gauge::default();
        registry.register(
            "payledger_db_pool_connections",
            "Pooled database connections, by state (in_use, idle)",
            connections.clone(),
        );
        registry.register(
            "payledger_db_pool_max_connections",
            "Most connections the pool opens (--pool-size)",
            max_connections.clone(),
        );
        registry.register_with_unit(
            "payledger_db_pool_acquire_duration",
            "Time a transaction or read waited for a pooled connection",
            Unit::Seconds,
            store.acquire_duration().clone(),
        );
        let build_info = Family::<BuildLabels, Gauge>::default();
        build_info.get_or_create(&BuildLabels::default()).set(1);
        registry.register(
            "payledger_build_info",
            "1, labelled with the running build's version and commit",
            build_info,
        );
        registry.register_collector(Box::new(ProcessCollector));
        registry.register(
            "payledger_db_up",
            "1 while the last health check passed (the database answered and accepted a write), 0 after one failed",
            store.up().clone(),
        );
        Self { registry, store, connections, max_connections }
    }

    /// The OpenMetrics text exposition, with the pool's gauges read now.
    pub fn encode(&self) -> String {
        let (size, idle, max) = self.store.pool_state();
        self.connections.get_or_create(&StateLabel { state: "in_use" }).set(i64::from(size.saturating_sub(idle)));
        self.connections.get_or_create(&StateLabel { state: "idle" }).set(i64::from(idle));
        self.max_connections.set(i64::from(max));
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}

/// `payledger_build_info`'s labels: the crate's version and the git commit it was built from
/// (`PAYLEDGER_BUILD_COMMIT` at build time, else `git rev-parse HEAD`, else `unknown`; see
/// build.rs).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
    commit: &'static str,
}

impl Default for BuildLabels {
    fn default() -> Self {
        Self { version: env!("CARGO_PKG_VERSION"), commit: env!("PAYLEDGER_BUILD_COMMIT") }
    }
}

/// The standard process metrics (Prometheus, "Writing client libraries", "Process metrics"),
/// read at each scrape by the metrics-process crate: `process_cpu_seconds_total`,
/// `process_resident_memory_bytes`, `process_virtual_memory_bytes`, `process_open_fds`,
/// `process_max_fds`, `process_start_time_seconds`, `process_threads`. A value the platform
/// cannot give is left out.
#[derive(Debug)]
struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let process = metrics_process::collector::collect();
        if let Some(seconds) = process.cpu_seconds_total {
            let counter = ConstCounter::new(seconds);
            let metric = encoder.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds",
                None,
                counter.metric_type(),
            )?;
            counter.encode(metric)?;
        }
        let gauges = [
            ("process_resident_memory_bytes", "Resident memory size in bytes", process.resident_memory_bytes),
            ("process_virtual_memory_bytes", "Virtual memory size in bytes", process.virtual_memory_bytes),
            ("process_open_fds", "Number of open file descriptors", process.open_fds),
            ("process_max_fds", "Maximum number of open file descriptors (0: unlimited)", process.max_fds),
            (
                "process_start_time_seconds",
                "Start time of the process since the Unix epoch in seconds",
                process.start_time_seconds,
            ),
            ("process_threads", "Number of OS threads in the process", process.threads),
        ];
        for (name, help, value) in gauges {
            if let Some(value) = value {
                let gauge = ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX));
                let metric = encoder.encode_descriptor(name, help, None, gauge.metric_type())?;
                gauge.encode(metric)?;
            }
        }
        Ok(())
    }
}

/// The content type of [`Metrics::encode`].
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Serves `GET /metrics` on `listener` (HTTP/1.1, plain text: put it on an address only the
/// scraper reaches) until the returned task is aborted. Every other path is 404.
pub fn serve(listener: TcpListener, metrics: Arc<Metrics>) -> tokio::task::JoinHandle<()> {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let metrics = metrics.clone();
            async move { ([(http::header::CONTENT_TYPE, CONTENT_TYPE)], metrics.encode()) }
        }),
    );
    tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            tracing::error!(%error, "the metrics listener failed");
        }
    })
}
