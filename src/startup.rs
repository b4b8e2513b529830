//! Builds the server on a listener: both services over gRPC and HTTP/JSON, health, reflection,
//! graceful shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;
use tonic_health::ServingStatus;

use crate::auth::jwks::{spawn_refresher, JwksSource, Refresh};
use crate::auth::{AuthSettingsError, Authenticator};
use crate::config::{
    AuditSettings, AuthSettings, DatabaseSettings, IdempotencySettings, Migrations, ServeSettings, TlsSettings,
    WriteSettings,
};
use crate::grpc::{capture_guard_headers, AccountApi, Admission, Authentication, Observe, PaymentApi};
use crate::ledger::{spawn_reaper, Ledger, LedgerSettings, ReaperSettings, TokenStore};
use crate::metrics::{Metrics, RpcMetrics};
use crate::proto;
use crate::proto::account_service_server::AccountServiceServer;
use crate::proto::payment_service_server::PaymentServiceServer;
use crate::store::{ConnectError, Store};
use crate::tls::{PrefaceDeadline, ServerTls, TlsError};

/// The largest request message accepted, in bytes; every field has a far smaller limit.
const REQUEST_BYTES_MAX: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error(transparent)]
    Database(#[from] ConnectError),
    #[error("cannot listen on {0}")]
    Bind(SocketAddr, #[source] std::io::Error),
    #[error("cannot listen for metrics on {0}")]
    BindMetrics(SocketAddr, #[source] std::io::Error),
    #[error("cannot build the reflection service")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("cannot reach the token store: {0}")]
    TokenStore(String),
    #[error("invalid settings: {0}")]
    Settings(String),
    #[error(transparent)]
    Auth(#[from] AuthSettingsError),
    #[error("the TLS certificate, key or client CA cannot be used: {0}")]
    Tls(#[from] TlsError),
    #[error(transparent)]
    HttpRules(#[from] crate::http::RuleError),
    #[error("the gRPC server failed")]
    Serve(#[from] tonic::transport::Error),
}

/// Connects to the database (applying its migrations) and to the token store, and writes
/// as `writes` says.
///
/// # Errors
/// [`StartupError::Database`], [`StartupError::TokenStore`].
pub async fn open_ledger(
    database: &DatabaseSettings,
    writes: &WriteSettings,
    idempotency: &IdempotencySettings,
) -> Result<Ledger, StartupError> {
    open_ledger_with(database, writes, idempotency, Migrations::Apply).await
}

/// [`open_ledger`], applying the migrations the database lacks (`Migrations::Apply`) or
/// only checking that none is lacking (`Migrations::Check`).
///
/// # Errors
/// As [`open_ledger`]; with `Check`, [`StartupError::Database`] (`SchemaBehind`) when a
/// migration of this release is not applied (`SchemaDiffers`, `History`: see
/// [`Store::check_schema`]).
pub async fn open_ledger_with(
    database: &DatabaseSettings,
    writes: &WriteSettings,
    idempotency: &IdempotencySettings,
    migrations: Migrations,
) -> Result<Ledger, StartupError> {
    idempotency.validate().map_err(StartupError::Settings)?;
    // Checking a SQLite database that is not there must not create an empty one.
    if migrations == Migrations::Check && crate::store::sqlite_file_missing(&database.database_url) {
        let url = crate::store::redacted(&database.database_url);
        return Err(ConnectError::SchemaBehind(url, "every one: there is no such file".to_owned()).into());
    }
    let store = connect_waiting(&database.database_url, &database.pool(), database.database_wait()).await?;
    match migrations {
        Migrations::Apply => store.migrate().await?,
        Migrations::Check => store.check_schema(&database.database_url).await?,
    }
    let tokens = TokenStore::connect(&idempotency.token_store)
        .await
        .map_err(|error| StartupError::TokenStore(error.to_string()))?;
    let settings = LedgerSettings {
        group_commit: writes.group_commit(),
        funding_account_shards: writes.funding_account_shards(store.is_galera()),
        ..idempotency.ledger()
    };
    Ok(Ledger::with_settings(store, tokens, settings))
}

/// `payledger migrate`: applies the migrations the database lacks and returns (waiting for
/// the database as `serve` does, `--database-wait-seconds`). Several at once, and beside
/// starting servers, take turns.
///
/// Returns the versions applied while it ran (by it, or by another instance migrating at the
/// same time; none when the schema was complete already).
///
/// # Errors
/// [`StartupError::Database`] for a database that cannot be reached or migrated.
pub async fn migrate(database: &DatabaseSettings) -> Result<Vec<i64>, StartupError> {
    let store = connect_waiting(&database.database_url, &database.pool(), database.database_wait()).await?;
    let before = store.applied_migrations().await;
    let outcome = store.migrate().await;
    let after = store.applied_migrations().await;
    store.close().await;
    outcome?;
    Ok(after.into_iter().filter(|version| !before.contains(version)).collect())
}

/// Connects to the database, trying again with backoff (0.25 s doubling up to 5 s) until
/// `wait` has passed: the database may start after payledger, or be created by a job that
/// runs beside it. A URL with an unknown scheme, and SQLite (a local file, not a server),
/// fail at once.
///
/// # Errors
/// The last [`ConnectError`] when `wait` is over.
async fn connect_waiting(url: &str, pool: &crate::store::PoolSettings, wait: Duration) -> Result<Store, StartupError> {
    let wait =
        if crate::store::Dialect::from_url(url) == Some(crate::store::Dialect::Sqlite) { Duration::ZERO } else { wait };
    let deadline = tokio::time::Instant::now() + wait;
    let mut backoff = Duration::from_millis(250);
    loop {
        match Store::connect(url, pool).await {
            Ok(store) => return Ok(store),
            Err(error @ ConnectError::Connect(..)) if tokio::time::Instant::now() + backoff < deadline => {
                tracing::warn!(error = %error_chain(&error), retry_in_ms = backoff.as_millis(), "database not reachable yet");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
            Err(error) => return Err(error.into()),
        }
    }
}

/// Opens an existing ledger read as it is, for `payledger audit`: no migrations, nothing
/// created.
///
/// # Errors
/// [`StartupError::Database`], also when the database holds no ledger.
pub async fn open_existing_ledger(settings: &AuditSettings) -> Result<Ledger, StartupError> {
    Ok(Ledger::new(Store::connect_existing(&settings.database_url, &settings.pool()).await?))
}

/// The authenticator of `settings` (its JWK set read now) and where its set is read again
/// from; `None` without `--auth-jwks`, allowed only on a loopback `listen` address or with
/// `--insecure-allow-unauthenticated`.
///
/// # Errors
/// [`StartupError::Settings`] for an unauthenticated non-loopback listener;
/// [`StartupError::Auth`] for a JWK set that cannot be read, fetched or used, or missing
/// issuer or audience.
pub async fn authenticator(listen: SocketAddr, settings: &AuthSettings) -> Result<Option<Jwks>, StartupError> {
    let Some(location) = settings.auth_jwks.as_deref().filter(|location| !location.is_empty()) else {
        if listen.ip().is_loopback() || settings.insecure_allow_unauthenticated {
            return Ok(None);
        }
        return Err(StartupError::Settings(format!(
            "refusing to serve unauthenticated calls on {listen}, which is not a loopback address: give \
             --auth-jwks with --auth-issuer and --auth-audience (see docs/security.md), or \
             --insecure-allow-unauthenticated for a network that only trusted callers can reach"
        )));
    };
    let ca = match &settings.auth_jwks_ca {
        Some(path) => Some(
            std::fs::read(path)
                .map_err(|source| AuthSettingsError::Read { path: path.display().to_string(), source })?,
        ),
        None => None,
    };
    let source = JwksSource::new(location, ca.as_deref())?;
    let text = source.read().await?;
    let authenticator =
        Authenticator::from_jwks(&text, &settings.auth_issuer, &settings.auth_audience, settings.auth_leeway_seconds)
            .map_err(|error| error.with_source(&source.describe()))?;
    let refresh = Refresh {
        interval: Duration::from_secs(settings.auth_jwks_refresh_seconds),
        min_interval: Duration::from_secs(settings.auth_jwks_min_refresh_seconds),
    };
    Ok(Some(Jwks { authenticator: Arc::new(authenticator), source, refresh }))
}

/// An authenticator with the source its JWK set is read again from, on `refresh`'s schedule
/// once the server runs (see [`crate::auth::jwks`]).
#[derive(Debug, Clone)]
pub struct Jwks {
    pub authenticator: Arc<Authenticator>,
    pub source: JwksSource,
    pub refresh: Refresh,
}

/// The TLS configuration of `settings`; `None` without `--tls-cert`. Its files are read
/// again every `--tls-reload-interval-seconds` once the server runs (see [`crate::tls`]).
///
/// # Errors
/// [`StartupError::Settings`] for a key without a certificate or a client CA without either;
/// [`StartupError::Tls`] for a file that cannot be read, or PEMs rustls cannot use (read
/// now, so that a bad file stops the start, not the first connection).
pub fn server_tls(settings: &TlsSettings) -> Result<Option<ServerTls>, StartupError> {
    let (cert, key) = match (&settings.tls_cert, &settings.tls_key) {
        (Some(cert), Some(key)) => (cert, key),
        (None, None) if settings.tls_client_ca.is_none() => return Ok(None),
        _ => {
            return Err(StartupError::Settings(
                "--tls-cert and --tls-key go together (and --tls-client-ca needs both)".into(),
            ))
        }
    };
    Ok(Some(ServerTls::from_files(cert, key, settings.tls_client_ca.as_deref())?))
}

type BoxFuture<T> = std::pin::Pin<Box<dyn Future<Output = T> + Send>>;

/// Aborts its task when dropped (the TLS reloader, when the server stops).
struct AbortOnDrop(Option<tokio::task::JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

/// Server-side HTTP/2 keepalive: a PING after `interval` without a frame from the caller, the
/// connection closed when it goes unanswered for `timeout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keepalive {
    pub interval: Duration,
    pub timeout: Duration,
}

/// A ready server: database migrated, port bound.
pub struct Application {
    listener: TcpListener,
    ledger: Ledger,
    shutdown_grace: Duration,
    reaper: ReaperSettings,
    authenticator: Option<Arc<Authenticator>>,
    /// Where the authenticator's JWK set is read again from while serving.
    jwks_refresh: Option<(JwksSource, Refresh)>,
    tls: Option<ServerTls>,
    /// How often the TLS files are read again (`None`: never).
    tls_reload: Option<Duration>,
    health_check_interval: Duration,
    max_concurrent_calls: Option<usize>,
    /// The most a caller's connection is served before its GOAWAY (gRFC A9).
    connection_age: Option<Duration>,
    /// Server-side HTTP/2 keepalive (gRFC A8).
    keepalive: Option<Keepalive>,
    /// Longest an accepted connection may take to send its HTTP/2 preface or the start of an
    /// HTTP/1 request (after its TLS handshake, if any).
    preface_timeout: Duration,
    metrics_listener: Option<TcpListener>,
    rpc_metrics: RpcMetrics,
}

impl Application {
    /// # Errors
    /// [`StartupError`] when the database or the port cannot be had.
    pub async fn build(settings: &ServeSettings) -> Result<Self, StartupError> {
        // Settings first, then the port: a server that cannot listen creates no database file.
        let jwks = authenticator(settings.listen, &settings.auth).await?;
        let tls = server_tls(&settings.tls)?;
        let listener =
            TcpListener::bind(settings.listen).await.map_err(|error| StartupError::Bind(settings.listen, error))?;
        let metrics_listener = match settings.metrics_listen {
            Some(address) => {
                Some(TcpListener::bind(address).await.map_err(|error| StartupError::BindMetrics(address, error))?)
            }
            None => None,
        };
        let ledger =
            open_ledger_with(&settings.database, &settings.writes, &settings.idempotency, settings.migrations).await?;
        let mut application =
            Self::with_listener(listener, ledger, Duration::from_secs(settings.shutdown_grace_seconds)).with_jwks(jwks);
        if let Some(tls) = tls {
            let reload = settings.tls.tls_reload_interval_seconds;
            application = application.with_tls(tls, (reload > 0).then(|| Duration::from_secs(reload)));
        }
        Ok(application
            .with_reaper(settings.idempotency.reaper())
            .with_health_check_interval(Duration::from_millis(settings.health_check_interval_ms))
            .with_max_connection_age(
                (settings.max_connection_age_seconds > 0)
                    .then(|| Duration::from_secs(settings.max_connection_age_seconds)),
            )
            .with_keepalive((settings.keepalive_interval_seconds > 0).then(|| Keepalive {
                interval: Duration::from_secs(settings.keepalive_interval_seconds),
                timeout: Duration::from_secs(settings.keepalive_timeout_seconds),
            }))
            .with_max_concurrent_calls(
                (settings.max_concurrent_calls > 0).then_some(settings.max_concurrent_calls as usize),
            )
            .with_preface_timeout(Duration::from_secs(settings.preface_timeout_seconds))
            .with_metrics_listener(metrics_listener))
    }

    /// A server on an already bound listener (tests bind port 0), without authentication or
    /// TLS until [`Application::with_authenticator`] and [`Application::with_tls`].
    pub fn with_listener(listener: TcpListener, ledger: Ledger, shutdown_grace: Duration) -> Self {
        Self {
            listener,
            ledger,
            shutdown_grace,
            reaper: ReaperSettings::default(),
            authenticator: None,
            jwks_refresh: None,
            tls: None,
            tls_reload: None,
            health_check_interval: Duration::from_secs(2),
            max_concurrent_calls: Some(512),
            connection_age: None,
            keepalive: None,
            preface_timeout: crate::tls::PREFACE_TIMEOUT,
            metrics_listener: None,
            rpc_metrics: RpcMetrics::default(),
        }
    }

    /// The most PaymentService and AccountService use cases running at once (default 512;
    /// `None`: no limit); a call past it is refused RESOURCE_EXHAUSTED (OVERLOADED) before
    /// anything is read or written.
    pub fn with_max_concurrent_calls(mut self, limit: Option<usize>) -> Self {
        self.max_concurrent_calls = limit;
        self
    }

    /// Serves Prometheus `/metrics` on `listener` (none by default).
    pub fn with_metrics_listener(mut self, listener: Option<TcpListener>) -> Self {
        self.metrics_listener = listener;
        self
    }

    /// The bound address of the metrics listener, if there is one.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_listener.as_ref().and_then(|listener| listener.local_addr().ok())
    }

    /// Sends each caller's connection a GOAWAY once it is `age` old; it closes when its calls
    /// in flight have finished (`None`, the default here: connections are never closed for
    /// their age; `serve` sets `--max-connection-age-seconds`).
    ///
    /// No forced close after a grace: tonic 0.14 given one (`max_connection_age_grace`) sends
    /// no GOAWAY at all and cuts the connection at age plus grace, calls in flight with it.
    pub fn with_max_connection_age(mut self, age: Option<Duration>) -> Self {
        self.connection_age = age;
        self
    }

    /// PINGs each caller's connection after `interval` without a frame from it, and closes it
    /// when a PING goes unanswered for `timeout` (`None`, the default here: no PINGs; `serve`
    /// sets `--keepalive-interval-seconds`).
    pub fn with_keepalive(mut self, keepalive: Option<Keepalive>) -> Self {
        self.keepalive = keepalive;
        self
    }

    /// Closes a connection that has sent neither a whole HTTP/2 preface nor the start of an
    /// HTTP/1 request `timeout` after it was accepted (on TLS, after its handshake). Default
    /// [`crate::tls::PREFACE_TIMEOUT`] (10 s).
    pub fn with_preface_timeout(mut self, timeout: Duration) -> Self {
        self.preface_timeout = timeout;
        self
    }

    /// How often health checks the database (default every 2 s).
    pub fn with_health_check_interval(mut self, interval: Duration) -> Self {
        self.health_check_interval = interval;
        self
    }

    /// Authenticates every call with `authenticator` (`None`: every call is anonymous).
    pub fn with_authenticator(mut self, authenticator: Option<Arc<Authenticator>>) -> Self {
        self.authenticator = authenticator;
        self
    }

    /// Authenticates every call with `jwks`'s authenticator, whose JWK set is read again from
    /// its source while the server runs (`None`: every call is anonymous).
    pub fn with_jwks(mut self, jwks: Option<Jwks>) -> Self {
        match jwks {
            Some(Jwks { authenticator, source, refresh }) => {
                self.authenticator = Some(authenticator);
                self.jwks_refresh = Some((source, refresh));
            }
            None => {
                self.authenticator = None;
                self.jwks_refresh = None;
            }
        }
        self
    }

    /// Serves TLS, its files read again every `reload` (`None`: never; see [`crate::tls`]).
    pub fn with_tls(mut self, tls: ServerTls, reload: Option<Duration>) -> Self {
        self.tls = Some(tls);
        self.tls_reload = reload;
        self
    }

    /// How callers are authenticated, for the start-up log line.
    pub fn authentication(&self) -> &'static str {
        if self.authenticator.is_some() {
            "jwt"
        } else if self.local_addr().ip().is_loopback() {
            "none (loopback only)"
        } else {
            "none (--insecure-allow-unauthenticated)"
        }
    }

    /// The transport security, for the start-up log line: `plaintext`, `tls` or `mtls`.
    pub fn transport_security(&self) -> &'static str {
        match &self.tls {
            None => "plaintext",
            Some(tls) if tls.is_mutual() => "mtls",
            Some(_) => "tls",
        }
    }

    /// Replaces the reaper's schedule (the default sweeps every minute).
    pub fn with_reaper(mut self, reaper: ReaperSettings) -> Self {
        self.reaper = reaper;
        self
    }

    /// The bound address (the real port when bound to port 0).
    ///
    /// # Panics
    /// When the socket has no local address, which a bound listener always has.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("a bound listener has an address")
    }

    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Serves until `shutdown` completes. Then health turns NOT_SERVING, the listener stops
    /// accepting, and calls in flight get the grace period to finish.
    ///
    /// # Errors
    /// [`StartupError`] when the server cannot start or fails.
    pub async fn run_until(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), StartupError> {
        let Self {
            listener,
            ledger,
            shutdown_grace,
            reaper,
            authenticator,
            jwks_refresh,
            tls,
            tls_reload,
            health_check_interval,
            max_concurrent_calls,
            connection_age,
            keepalive,
            preface_timeout,
            metrics_listener,
            rpc_metrics,
        } = self;
        let _jwks_refresher = AbortOnDrop(
            authenticator
                .clone()
                .zip(jwks_refresh)
                .map(|(authenticator, (source, refresh))| spawn_refresher(authenticator, source, refresh)),
        );
        let authentication = Authentication::new(authenticator);
        let metrics_server = metrics_listener
            .map(|listener| crate::metrics::serve(listener, Arc::new(Metrics::new(&ledger, &rpc_metrics))));
        let tls_refused = rpc_metrics.tls_refused.clone();
        let observe = Observe::new(rpc_metrics);
        let admission = Admission::new(max_concurrent_calls, ledger.metrics().clone());
        let reaper = spawn_reaper(ledger.clone(), reaper);
        let (health, health_service) = tonic_health::server::health_reporter();
        health.set_serving::<AccountServiceServer<AccountApi>>().await;
        health.set_serving::<PaymentServiceServer<PaymentApi>>().await;
        let health_check = tokio::spawn(check_health(ledger.clone(), health.clone(), health_check_interval));
        // The API, health, and the google.rpc error details (ErrorInfo, BadRequest,
        // RetryInfo), so that reflection clients decode every status's details.
        let descriptors = || {
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)
        };
        let reflection_v1 = descriptors().build_v1()?;
        let reflection_v1alpha = descriptors().build_v1alpha()?;
        let (stop_accepting, stopped) = tokio::sync::oneshot::channel::<()>();
        let mut builder = Server::builder();
        if let Some(age) = connection_age {
            builder = builder.max_connection_age(age);
        }
        if let Some(Keepalive { interval, timeout }) = keepalive {
            builder = builder.http2_keepalive_interval(Some(interval)).http2_keepalive_timeout(Some(timeout));
        }
        // The gRPC services behind their layers: what a gRPC caller reaches, and what the
        // HTTP/JSON gateway calls in process for each HTTP call (so both go through the same
        // observation, authentication, idempotency and limits).
        let grpc_routes = tonic::service::Routes::new(health_service)
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha)
            .add_service(InterceptedService::new(
                AccountServiceServer::new(AccountApi::new(ledger.clone()).with_admission(admission.clone()))
                    .max_decoding_message_size(REQUEST_BYTES_MAX),
                authentication.clone(),
            ))
            .add_service(InterceptedService::new(
                PaymentServiceServer::new(PaymentApi::new(ledger.clone()).with_admission(admission))
                    .max_decoding_message_size(REQUEST_BYTES_MAX),
                authentication,
            ))
            .prepare();
        let grpc: crate::http::GrpcService = tower::util::BoxCloneSyncService::new(
            tower::ServiceBuilder::new()
                .layer(observe)
                .layer(tower::util::MapRequestLayer::new(capture_guard_headers))
                .service(grpc_routes),
        );
        let gateway = crate::http::Gateway::new(proto::FILE_DESCRIPTOR_SET, grpc.clone())?;
        let router =
            builder.accept_http1(true).add_routes(tonic::service::Routes::from(crate::http::router(gateway, grpc)));
        let stopped = async {
            let _ = stopped.await;
        };
        // TCP_NODELAY on every accepted connection: without it Nagle's algorithm holds small
        // responses back until the client's delayed ACK, some 40 ms per call.
        let (server, tls_reloader): (BoxFuture<Result<(), tonic::transport::Error>>, _) =
            match tls {
                None => {
                    // A connection without a preface is closed after `preface_timeout`, as on TLS.
                    let incoming = futures_util::StreamExt::map(
                        TcpIncoming::from(listener).with_nodelay(Some(true)),
                        move |accepted| accepted.map(|stream| PrefaceDeadline::new(stream, preface_timeout)),
                    );
                    (Box::pin(router.serve_with_incoming_shutdown(incoming, stopped)), None)
                }
                Some(tls) => {
                    let reloader = tls_reload.and_then(|interval| tls.reload_every(interval));
                    (
                        Box::pin(router.serve_with_incoming_shutdown(
                            tls.incoming(listener, tls_refused, preface_timeout),
                            stopped,
                        )),
                        reloader,
                    )
                }
            };
        let _tls_reloader = AbortOnDrop(tls_reloader);
        let mut server = server;
        tokio::select! {
            result = &mut server => {
                reaper.abort();
                health_check.abort();
                if let Some(metrics_server) = &metrics_server {
                    metrics_server.abort();
                }
                return Ok(result?);
            }
            () = shutdown => {}
        }
        tracing::info!(grace_seconds = shutdown_grace.as_secs(), "shutting down: health NOT_SERVING, draining calls");
        health_check.abort();
        for service in SERVICES {
            health.set_service_status(service, ServingStatus::NotServing).await;
        }
        let _ = stop_accepting.send(());
        reaper.abort();
        // One deadline for draining calls and closing the pool: the whole grace period.
        let deadline = tokio::time::Instant::now() + shutdown_grace;
        match tokio::time::timeout_at(deadline, server).await {
            Ok(result) => result?,
            Err(_) => tracing::warn!("grace period over with calls in flight; their transactions roll back"),
        }
        if let Some(metrics_server) = &metrics_server {
            metrics_server.abort();
        }
        if tokio::time::timeout_at(deadline, ledger.store().close()).await.is_err() {
            tracing::warn!("database connections still busy at exit");
        }
        let counters = ledger.counters();
        tracing::info!(
            replays = counters.replays,
            key_conflicts = counters.key_conflicts,
            in_flight_waits = counters.in_flight_waits,
            token_consumptions = counters.token_consumptions,
            reaper_deletions = counters.reaper_deletions,
            group_commits = counters.group_commits,
            group_committed_pays = counters.group_committed_pays,
            group_committed_refunds = counters.group_committed_refunds,
            group_committed_transfers = counters.group_committed_transfers,
            group_committed_deposits = counters.group_committed_deposits,
            group_committed_withdrawals = counters.group_committed_withdrawals,
            group_committed_orders = counters.group_committed_orders,
            "stopped"
        );
        Ok(())
    }
}

/// The names gRPC health answers for: the server as a whole and each service.
const SERVICES: [&str; 3] = ["", "payledger.v1.AccountService", "payledger.v1.PaymentService"];

/// Checks the database every `interval` (see [`Store::check_health`]) and says what it
/// found through gRPC health: NOT_SERVING while it does not answer or refuses writes, so that
/// a load balancer sends calls elsewhere, SERVING again once a check passes. Each change is
/// logged, and so is a change of the reason while NOT_SERVING (unreachable, then refusing
/// writes, say).
async fn check_health(ledger: Ledger, health: tonic_health::server::HealthReporter, interval: Duration) {
    let mut serving = true;
    let mut reason = None;
    loop {
        tokio::time::sleep(interval).await;
        let passed = match ledger.store().check_health().await {
            Ok(()) => true,
            Err(unhealthy) => {
                if reason != Some(unhealthy.reason()) {
                    tracing::warn!(
                        reason = unhealthy.reason(),
                        error = %error_chain(&unhealthy),
                        "database health check failed: health NOT_SERVING"
                    );
                    reason = Some(unhealthy.reason());
                }
                false
            }
        };
        if passed != serving {
            if passed {
                tracing::info!("database health check passed again: health SERVING");
                reason = None;
            }
            let status = if passed { ServingStatus::Serving } else { ServingStatus::NotServing };
            for service in SERVICES {
                health.set_service_status(service, status).await;
            }
            serving = passed;
        }
    }
}

/// Completes on SIGTERM or SIGINT (Ctrl-C).
pub async fn shutdown_signal() {
    let interrupt = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
}

/// The error and its causes, each said once (a driver error often repeats its cause).
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}
