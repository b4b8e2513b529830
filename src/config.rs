//! Settings, from flags with environment-variable fallbacks.

use std::net::SocketAddr;
use std::time::Duration;

use crate::store::PoolSettings;

/// Where the ledger keeps its data.
#[derive(Debug, Clone, clap::Args)]
pub struct DatabaseSettings {
    /// Database URL; its scheme picks the backend: `postgres://user@host:5432/db`,
    /// `mysql://root@host:3306/db` (also `mariadb://`), or `sqlite:path/to/file.db`
    /// (created on first start).
    #[arg(long, env = "DATABASE_URL", default_value = "sqlite:payledger.db")]
    pub database_url: String,
    /// Most database connections (PostgreSQL and MySQL do best with a few per core).
    #[arg(long, env = "PAYLEDGER_POOL_SIZE", default_value_t = 16)]
    pub pool_size: u32,
    /// Milliseconds a call waits for a free connection before it fails with UNAVAILABLE.
    #[arg(
        long,
        env = "PAYLEDGER_POOL_ACQUIRE_TIMEOUT_MS",
        default_value_t = 5_000
    )]
    pub pool_acquire_timeout_ms: u64,
}

impl DatabaseSettings {
    pub fn pool(&self) -> PoolSettings {
        PoolSettings {
            max_connections: self.pool_size.max(1),
            acquire_timeout: Duration::from_millis(self.pool_acquire_timeout_ms),
        }
    }
}

/// `payledger serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeSettings {
    /// Address to listen on for gRPC (plaintext HTTP/2).
    #[arg(long, env = "PAYLEDGER_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    #[command(flatten)]
    pub database: DatabaseSettings,
    /// Seconds that calls in flight get to finish after SIGTERM or SIGINT.
    #[arg(long, env = "PAYLEDGER_SHUTDOWN_GRACE_SECONDS", default_value_t = 10)]
    pub shutdown_grace_seconds: u64,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Logging, shared by every command.
#[derive(Debug, Clone, clap::Args)]
pub struct LogSettings {
    /// Log format.
    #[arg(
        long,
        env = "PAYLEDGER_LOG_FORMAT",
        value_enum,
        default_value = "text",
        global = true
    )]
    pub log_format: LogFormat,
    /// Log filter in `tracing` EnvFilter syntax, e.g. `info` or `payledger=debug,sqlx=warn`.
    #[arg(
        long,
        env = "PAYLEDGER_LOG",
        default_value = "info,sqlx=warn",
        global = true
    )]
    pub log_filter: String,
}
