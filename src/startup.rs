//! Builds the server on a listener: both services, health, reflection, graceful shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;
use tonic_health::ServingStatus;

use crate::config::{AuditSettings, DatabaseSettings, IdempotencySettings, ServeSettings};
use crate::grpc::{capture_guard_headers, AccountApi, PaymentApi};
use crate::ledger::{spawn_reaper, Ledger, LedgerSettings, ReaperSettings, TokenStore};
use crate::proto;
use crate::proto::account_service_server::AccountServiceServer;
use crate::proto::payment_service_server::PaymentServiceServer;
use crate::store::{ConnectError, Store};

/// The largest request message accepted, in bytes; every field has a far smaller limit.
const REQUEST_BYTES_MAX: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error(transparent)]
    Database(#[from] ConnectError),
    #[error("cannot listen on {0}")]
    Bind(SocketAddr, #[source] std::io::Error),
    #[error("cannot build the reflection service")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("cannot reach the token store: {0}")]
    TokenStore(String),
    #[error("invalid settings: {0}")]
    Settings(String),
    #[error("the gRPC server failed")]
    Serve(#[from] tonic::transport::Error),
}

/// Connects to the database (applying its migrations) and to the token store.
///
/// # Errors
/// [`StartupError::Database`], [`StartupError::TokenStore`].
pub async fn open_ledger(
    database: &DatabaseSettings,
    idempotency: &IdempotencySettings,
) -> Result<Ledger, StartupError> {
    idempotency.validate().map_err(StartupError::Settings)?;
    let store = Store::connect(&database.database_url, &database.pool()).await?;
    store.migrate().await?;
    let tokens = TokenStore::connect(&idempotency.token_store)
        .await
        .map_err(|error| StartupError::TokenStore(error.to_string()))?;
    let settings = LedgerSettings { group_commit: database.group_commit(), ..idempotency.ledger() };
    Ok(Ledger::with_settings(store, tokens, settings))
}

/// Opens an existing ledger read as it is, for `payledger audit`: no migrations, nothing
/// created.
///
/// # Errors
/// [`StartupError::Database`], also when the database holds no ledger.
pub async fn open_existing_ledger(settings: &AuditSettings) -> Result<Ledger, StartupError> {
    Ok(Ledger::new(Store::connect_existing(&settings.database_url, &settings.pool()).await?))
}

/// A ready server: database migrated, port bound.
pub struct Application {
    listener: TcpListener,
    ledger: Ledger,
    shutdown_grace: Duration,
    reaper: ReaperSettings,
}

impl Application {
    /// # Errors
    /// [`StartupError`] when the database or the port cannot be had.
    pub async fn build(settings: &ServeSettings) -> Result<Self, StartupError> {
        // The port first: a server that cannot listen creates no database file.
        let listener =
            TcpListener::bind(settings.listen).await.map_err(|error| StartupError::Bind(settings.listen, error))?;
        let ledger = open_ledger(&settings.database, &settings.idempotency).await?;
        let application = Self::with_listener(listener, ledger, Duration::from_secs(settings.shutdown_grace_seconds));
        Ok(application.with_reaper(settings.idempotency.reaper()))
    }

    /// A server on an already bound listener (tests bind port 0).
    pub fn with_listener(listener: TcpListener, ledger: Ledger, shutdown_grace: Duration) -> Self {
        Self { listener, ledger, shutdown_grace, reaper: ReaperSettings::default() }
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
        let Self { listener, ledger, shutdown_grace, reaper } = self;
        let reaper = spawn_reaper(ledger.clone(), reaper);
        let (health, health_service) = tonic_health::server::health_reporter();
        health.set_serving::<AccountServiceServer<AccountApi>>().await;
        health.set_serving::<PaymentServiceServer<PaymentApi>>().await;
        let reflection_v1 = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1()?;
        let reflection_v1alpha = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1alpha()?;
        let (stop_accepting, stopped) = tokio::sync::oneshot::channel::<()>();
        // TCP_NODELAY on every accepted connection: without it Nagle's algorithm holds small
        // responses back until the client's delayed ACK, some 40 ms per call.
        let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
        let server = Server::builder()
            .trace_fn(|request| tracing::info_span!("grpc", path = %request.uri().path()))
            .layer(tower::util::MapRequestLayer::new(capture_guard_headers))
            .add_service(health_service)
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha)
            .add_service(
                AccountServiceServer::new(AccountApi::new(ledger.clone())).max_decoding_message_size(REQUEST_BYTES_MAX),
            )
            .add_service(
                PaymentServiceServer::new(PaymentApi::new(ledger.clone())).max_decoding_message_size(REQUEST_BYTES_MAX),
            )
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stopped.await;
            });
        tokio::pin!(server);
        tokio::select! {
            result = &mut server => {
                reaper.abort();
                return Ok(result?);
            }
            () = shutdown => {}
        }
        tracing::info!(grace_seconds = shutdown_grace.as_secs(), "shutting down: health NOT_SERVING, draining calls");
        for service in ["", "payledger.v1.AccountService", "payledger.v1.PaymentService"] {
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
            "stopped"
        );
        Ok(())
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
