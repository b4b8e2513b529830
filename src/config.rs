//! Settings, from flags with environment-variable fallbacks.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::ledger::{GroupCommitSettings, LedgerSettings, ReaperSettings};
use crate::store::PoolSettings;

/// Where the ledger keeps its data. `Debug` hides the URL's password.
#[derive(Clone, clap::Args)]
pub struct DatabaseSettings {
    /// Database URL; its scheme picks the backend: `postgres://user@host:5432/db`,
    /// `mysql://root@host:3306/db` (also `mariadb://`), or `sqlite:path/to/file.db` (`migrate`
    /// and `serve` create the file on first start, `serve --migrations check` and `audit`
    /// never create anything).
    #[arg(long, env = "DATABASE_URL", default_value = "sqlite:payledger.db")]
    pub database_url: String,
    /// Most database connections (PostgreSQL and MySQL do best with a few per core). 1 to
    /// 10,000.
    #[arg(long, env = "PAYLEDGER_POOL_SIZE", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub pool_size: u32,
    /// Milliseconds a call waits for a free connection before it fails with UNAVAILABLE; also
    /// how long a start waits for its first connection to a database server.
    #[arg(long, env = "PAYLEDGER_POOL_ACQUIRE_TIMEOUT_MS", default_value_t = 5_000)]
    pub pool_acquire_timeout_ms: u64,
    /// PostgreSQL: seconds a pooled connection, and the query plans it keeps, is used before it
    /// is replaced, which bounds how long a plan made while a table was small outlives the
    /// table's growth (docs/decisions/001-generic-plans.md). 1 to 86,400.
    #[arg(long, env = "PAYLEDGER_PLAN_LIFETIME_SECONDS", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub plan_lifetime_seconds: u64,
    /// Milliseconds a call waits for a row lock, or for a concurrent request with the same
    /// idempotency key to finish, before it fails with ABORTED (LOCK_TIMEOUT); also the lock
    /// waits of migrations (on MySQL/MariaDB their row-lock waits only).
    #[arg(long, env = "PAYLEDGER_LOCK_TIMEOUT_MS", default_value_t = 5_000)]
    pub lock_timeout_ms: u64,
    /// Seconds `serve` and `migrate` wait at start for a PostgreSQL or MySQL database to
    /// accept connections (it may come up after payledger, or be created later), retrying with
    /// backoff, before they exit with the last error; 0 tries once. SQLite is never waited for.
    #[arg(long, env = "PAYLEDGER_DATABASE_WAIT_SECONDS", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(0..=3600))]
    pub database_wait_seconds: u64,
}

impl DatabaseSettings {
    pub fn pool(&self) -> PoolSettings {
        PoolSettings {
            max_connections: self.pool_size.max(1),
            acquire_timeout: Duration::from_millis(self.pool_acquire_timeout_ms),
            lock_timeout: Duration::from_millis(self.lock_timeout_ms.max(1)),
            plan_lifetime: Duration::from_secs(self.plan_lifetime_seconds),
        }
    }

    pub fn database_wait(&self) -> Duration {
        Duration::from_secs(self.database_wait_seconds)
    }
}

/// How `serve` writes: group commit's bounds and the funding account shards (`payledger
/// migrate` has none of these).
#[derive(Debug, Clone, clap::Args)]
pub struct WriteSettings {
    /// Most Pays, Refunds, Transfers, Deposits, Withdraws and CreateOrders written together by
    /// one transaction (group commit: the calls that arrive while the database is busy share
    /// one transaction and one commit, with or without an idempotency-key or
    /// idempotency-token); 1 turns it off.
    /// At most 500, which bounds the rows one batch statement carries (its bound values are a
    /// fixed few whatever the batch holds).
    #[arg(long, env = "PAYLEDGER_PAY_BATCH_MAX", default_value_t = 64,
          value_parser = clap::value_parser!(u16).range(1..=500))]
    pub pay_batch_max: u16,
    /// Group-commit workers, each with its own queue (Pays, Refunds and CreateOrders are routed
    /// by merchant_id, Transfers by from_account_id, Deposits and Withdraws by funding account
    /// shard), each running `--pay-batch-pipeline` batches at once, with one pooled connection
    /// a batch while it runs.
    #[arg(long, env = "PAYLEDGER_PAY_BATCH_WORKERS", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=64))]
    pub pay_batch_workers: u16,
    /// Most group-commit transactions of one worker in flight at once. A batch starts at once
    /// when none runs; while batches run, another starts only while each of them holds a single
    /// call (light load), so a second caller is served beside the first, and under load calls
    /// queue for the next batch instead. Each holds one pooled connection while it runs, so keep
    /// workers x pipeline below the pool size. 1: one batch after another.
    #[arg(long, env = "PAYLEDGER_PAY_BATCH_PIPELINE", default_value_t = 4,
          value_parser = clap::value_parser!(u16).range(1..=16))]
    pub pay_batch_pipeline: u16,
    /// On PostgreSQL, whether a batch of one call without a one-time token, started beside at
    /// most one other batch and none of its route (merchant, from_account or funding account),
    /// is read without row locks and written by one statement that commits itself, all or
    /// nothing, its idempotency key's record claimed by that statement (docs/write-engine.md);
    /// it is written under locks when a row it read moved or its key was taken. false: every
    /// batch locks its rows first. No effect on MariaDB or SQLite.
    #[arg(long, env = "PAYLEDGER_PAY_BATCH_UNLOCKED", default_value_t = true, action = clap::ArgAction::Set)]
    pub pay_batch_unlocked: bool,
    /// On PostgreSQL, with --pay-batch-unlocked, the most orders, and the most accounts, kept
    /// as last seen committed (read, or written by a write that committed), least recently used
    /// dropped first, so that a batch whose orders and accounts are all kept (Pays of orders
    /// created or read here) is decided from them and written in one round trip; every
    /// row it read is guarded by the write, and one that moved meanwhile sends the call through
    /// the read (docs/write-engine.md, "Known rows"). 0: every batch reads or locks its rows first.
    #[arg(long, env = "PAYLEDGER_PAY_BATCH_KNOWN_ROWS", default_value_t = 32_768,
          value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub pay_batch_known_rows: u32,
    /// Most calls (Pays, Refunds, Transfers, Deposits, Withdraws, CreateOrders) waiting for a
    /// batch of one group-commit worker; a call that finds that many waiting is refused
    /// RESOURCE_EXHAUSTED (reason OVERLOADED, pushback 100 ms) before any work.
    #[arg(long, env = "PAYLEDGER_PAY_QUEUE_MAX", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub pay_queue_max: u32,
    /// Shards of each currency's external funding account that Deposits and Withdraws
    /// spread over, by a hash of their request_id (`@external:USD`, `@external:USD:1`...;
    /// the audit sums them), so that they do not all write one row. 1 to 32; unset: 16 on a
    /// MariaDB Galera node, where writes of one row through several nodes fail certification
    /// and run again, and 1 elsewhere.
    #[arg(long, env = "PAYLEDGER_FUNDING_ACCOUNT_SHARDS",
          value_parser = clap::value_parser!(u32).range(1..=i64::from(crate::ledger::FUNDING_ACCOUNT_SHARDS_MAX)))]
    pub funding_account_shards: Option<u32>,
}

impl Default for WriteSettings {
    /// The flags' defaults.
    fn default() -> Self {
        Self {
            pay_batch_max: 64,
            pay_batch_workers: 1,
            pay_batch_pipeline: 4,
            pay_batch_unlocked: true,
            pay_batch_known_rows: 32_768,
            pay_queue_max: 1024,
            funding_account_shards: None,
        }
    }
}

impl WriteSettings {
    /// The funding account shards for a store that is (`galera`) or is not a Galera node.
    pub fn funding_account_shards(&self, galera: bool) -> u32 {
        self.funding_account_shards.unwrap_or(if galera { GALERA_FUNDING_ACCOUNT_SHARDS } else { 1 })
    }

    pub fn group_commit(&self) -> GroupCommitSettings {
        GroupCommitSettings {
            max_batch: usize::from(self.pay_batch_max.max(1)),
            workers: usize::from(self.pay_batch_workers.max(1)),
            pipeline: usize::from(self.pay_batch_pipeline.max(1)),
            queue_max: self.pay_queue_max.max(1) as usize,
            unlocked: self.pay_batch_unlocked,
            known_rows: self.pay_batch_known_rows as usize,
        }
    }
}

/// `--funding-account-shards` when unset on a Galera node: with 3 nodes and 32 callers
/// Deposits through every node rarely meet on one shard (`docs/decisions/009-funding-account-shards.md`).
const GALERA_FUNDING_ACCOUNT_SHARDS: u32 = 16;

impl std::fmt::Debug for DatabaseSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatabaseSettings")
            .field("database_url", &crate::store::redacted(&self.database_url))
            .field("pool_size", &self.pool_size)
            .field("pool_acquire_timeout_ms", &self.pool_acquire_timeout_ms)
            .field("plan_lifetime_seconds", &self.plan_lifetime_seconds)
            .field("lock_timeout_ms", &self.lock_timeout_ms)
            .field("database_wait_seconds", &self.database_wait_seconds)
            .finish()
    }
}

/// `payledger audit`: only where the ledger is; it reads and changes nothing. `Debug` hides
/// the URL's password.
#[derive(Clone, clap::Args)]
pub struct AuditSettings {
    /// Database URL of an existing ledger: `postgres://user@host:5432/db`,
    /// `mysql://root@host:3306/db` (also `mariadb://`) or `sqlite:path/to/file.db`. Nothing
    /// is created or migrated.
    #[arg(long, env = "DATABASE_URL", default_value = "sqlite:payledger.db")]
    pub database_url: String,
    /// Check only what the journal entries after this id wrote (the checkpoint an earlier
    /// audit printed), in time that grows with them rather than with the ledger. Sound only
    /// after a full audit that passed up to that checkpoint.
    #[arg(long, value_parser = clap::value_parser!(i64).range(0..))]
    pub from_entry: Option<i64>,
    /// Seconds the database has to accept the audit's connection and answer its first read;
    /// past it the audit fails, naming the database, instead of waiting on a server that
    /// accepts connections and never answers (1-3600).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub connect_timeout_seconds: u64,
    /// Seconds the whole audit may take; past it the audit fails and concludes nothing (a
    /// database that goes silent mid-audit ends here). A full audit of a ledger of 10 million
    /// orders took 23 minutes on MariaDB here (docs/benchmarks-history.md, "Ledger size"); the default leaves room for ten
    /// times that (1-604800).
    #[arg(long, default_value_t = 14_400, value_parser = clap::value_parser!(u64).range(1..=604_800))]
    pub timeout_seconds: u64,
    /// Each check reported on stderr as it finishes: `auto` when stderr is a terminal.
    #[arg(long, value_enum, default_value_t = Progress::Auto)]
    pub progress: Progress,
    /// Seconds after which a journal entry counts as settled: the checkpoint (and the digest)
    /// an audit prints is the newest entry written at least this long ago. By then every
    /// transaction that wrote an entry with a smaller id has ended (each statement waits at most
    /// the lock timeout, and PostgreSQL ends a transaction left idle for 60 s), so a checkpoint
    /// never skips one; lower it only on a ledger nothing writes to (0-86400).
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub settled_after_seconds: u64,
    /// Where to write, once the audit passes, the digest it prints and the chain hash of every
    /// account it covers (one `account_id hash` line each): kept outside the database, it lets
    /// `--verify-digest` name the first account whose history changed.
    #[arg(long, value_name = "FILE")]
    pub digest_file: Option<std::path::PathBuf>,
    /// A digest an earlier audit printed (`payledger-digest-v1:...`), or the file its
    /// `--digest-file` wrote: the full audit then also proves that no journal entry up to the
    /// digest's entry changed, or names the first account whose history did (with the file).
    /// Not with `--from-entry`.
    #[arg(long, value_name = "DIGEST|FILE", conflicts_with = "from_entry")]
    pub verify_digest: Option<String>,
}

impl std::fmt::Debug for AuditSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuditSettings")
            .field("database_url", &crate::store::redacted(&self.database_url))
            .field("from_entry", &self.from_entry)
            .field("connect_timeout_seconds", &self.connect_timeout_seconds)
            .field("timeout_seconds", &self.timeout_seconds)
            .field("progress", &self.progress)
            .field("settled_after_seconds", &self.settled_after_seconds)
            .field("digest_file", &self.digest_file)
            .field("verify_digest", &self.verify_digest)
            .finish()
    }
}

impl AuditSettings {
    /// The audit reads on one connection at a time.
    pub fn pool(&self) -> PoolSettings {
        PoolSettings {
            max_connections: 2,
            acquire_timeout: Duration::from_secs(30),
            lock_timeout: Duration::from_secs(5),
            plan_lifetime: PoolSettings::PLAN_LIFETIME_DEFAULT,
        }
    }
}

/// Idempotency keys, one-time tokens, the lifetime of orders, and the reaper that deletes
/// expired keys and tokens and closes expired orders. `Debug` hides a password in the token
/// store's URL.
#[derive(Clone, clap::Args)]
pub struct IdempotencySettings {
    /// Where one-time tokens live: `database` (consumed in the business transaction) or a
    /// Redis URL such as `redis://127.0.0.1:6379` (see docs/idempotency.md).
    #[arg(long, env = "PAYLEDGER_TOKEN_STORE", default_value = "database")]
    pub token_store: String,
    /// Seconds an `idempotency-key` is kept (default 24 hours): at least 1, and at least
    /// `--token-ttl-seconds`, since a consumed token's record must outlive the token (checked
    /// at start).
    #[arg(long, env = "PAYLEDGER_IDEMPOTENCY_KEY_TTL_SECONDS", default_value_t = 86_400,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub idempotency_key_ttl_seconds: u64,
    /// Seconds an issued one-time token stays valid (at least 1).
    #[arg(long, env = "PAYLEDGER_TOKEN_TTL_SECONDS", default_value_t = 300,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub token_ttl_seconds: u64,
    /// Seconds a PENDING order created without `expires_at` stays payable; 0 (the default)
    /// means such orders never expire. At most 315,360,000 (ten years).
    #[arg(long, env = "PAYLEDGER_ORDER_TTL_SECONDS", default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(0..=315_360_000))]
    pub order_ttl_seconds: u64,
    /// Seconds an authorization hold lasts (default 7 days): after it a Capture is
    /// HOLD_EXPIRED and the sweeper releases the hold. At least 1, at most 315,360,000.
    #[arg(long, env = "PAYLEDGER_HOLD_TTL_SECONDS", default_value_t = 604_800,
          value_parser = clap::value_parser!(u64).range(1..=315_360_000))]
    pub hold_ttl_seconds: u64,
    /// Seconds between two sweeps of the reaper (expired keys and tokens deleted, expired
    /// orders closed).
    #[arg(long, env = "PAYLEDGER_REAPER_INTERVAL_SECONDS", default_value_t = 60)]
    pub reaper_interval_seconds: u64,
    /// Most expired rows one reaper DELETE removes, and most expired orders one sweeper
    /// transaction closes.
    #[arg(long, env = "PAYLEDGER_REAPER_BATCH_SIZE", default_value_t = 500)]
    pub reaper_batch_size: u32,
    /// Milliseconds the reaper pauses between two batches.
    #[arg(long, env = "PAYLEDGER_REAPER_PAUSE_MS", default_value_t = 50)]
    pub reaper_pause_ms: u64,
}

impl Default for IdempotencySettings {
    fn default() -> Self {
        Self {
            token_store: "database".to_owned(),
            idempotency_key_ttl_seconds: 86_400,
            token_ttl_seconds: 300,
            order_ttl_seconds: 0,
            hold_ttl_seconds: 604_800,
            reaper_interval_seconds: 60,
            reaper_batch_size: 500,
            reaper_pause_ms: 50,
        }
    }
}

impl std::fmt::Debug for IdempotencySettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencySettings")
            .field("token_store", &crate::store::redacted(&self.token_store))
            .field("idempotency_key_ttl_seconds", &self.idempotency_key_ttl_seconds)
            .field("token_ttl_seconds", &self.token_ttl_seconds)
            .field("order_ttl_seconds", &self.order_ttl_seconds)
            .field("hold_ttl_seconds", &self.hold_ttl_seconds)
            .field("reaper_interval_seconds", &self.reaper_interval_seconds)
            .field("reaper_batch_size", &self.reaper_batch_size)
            .field("reaper_pause_ms", &self.reaper_pause_ms)
            .finish()
    }
}

impl IdempotencySettings {
    /// Checks the bounds that span two settings.
    ///
    /// # Errors
    /// A message naming the settings when a key would be forgotten before a token it
    /// records: a consumed token whose record expired could run a second time.
    pub fn validate(&self) -> Result<(), String> {
        if self.idempotency_key_ttl_seconds < self.token_ttl_seconds {
            return Err(format!(
                "--idempotency-key-ttl-seconds ({}) must be at least --token-ttl-seconds ({}): a consumed token's \
                 record must outlive the token",
                self.idempotency_key_ttl_seconds, self.token_ttl_seconds
            ));
        }
        Ok(())
    }

    pub fn ledger(&self) -> LedgerSettings {
        LedgerSettings {
            key_ttl: Duration::from_secs(self.idempotency_key_ttl_seconds),
            token_ttl: Duration::from_secs(self.token_ttl_seconds.max(1)),
            group_commit: GroupCommitSettings::default(),
            order_ttl: Duration::from_secs(self.order_ttl_seconds),
            hold_ttl: Duration::from_secs(self.hold_ttl_seconds.max(1)),
            funding_account_shards: 1,
        }
    }

    pub fn reaper(&self) -> ReaperSettings {
        ReaperSettings {
            interval: Duration::from_secs(self.reaper_interval_seconds.max(1)),
            batch_size: self.reaper_batch_size.max(1),
            pause: Duration::from_millis(self.reaper_pause_ms),
        }
    }
}

/// Caller authentication (see docs/security.md). Without `--auth-jwks`, calls are
/// unauthenticated, which `serve` allows only on a loopback address unless
/// `--insecure-allow-unauthenticated` is given.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct AuthSettings {
    /// The JWK set (RFC 7517) of the public keys that sign callers' JWTs (EdDSA, ES256, RS256;
    /// each key with a `kid`): a file, or an identity provider's `jwks_uri` (`https://`
    /// only). Every RPC except health and reflection then needs `authorization: Bearer <JWT>`.
    /// Read at start (a server that cannot read it does not start), then again every
    /// `--auth-jwks-refresh-seconds` and when a token names an unknown `kid`; a read that
    /// fails keeps the last good set.
    #[arg(long, env = "PAYLEDGER_AUTH_JWKS")]
    pub auth_jwks: Option<String>,
    /// CA certificate(s) (PEM) that an `https://` `--auth-jwks` server must chain to
    /// (default: the Mozilla root programme's CAs, as bundled by webpki-roots).
    #[arg(long, env = "PAYLEDGER_AUTH_JWKS_CA", requires = "auth_jwks")]
    pub auth_jwks_ca: Option<PathBuf>,
    /// Seconds between two scheduled reads of `--auth-jwks`, 1 to 86400 (never less than
    /// `--auth-jwks-min-refresh-seconds`).
    #[arg(long, env = "PAYLEDGER_AUTH_JWKS_REFRESH_SECONDS", default_value_t = 300,
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub auth_jwks_refresh_seconds: u64,
    /// Least seconds between any two reads of `--auth-jwks`, those a token with an unknown
    /// `kid` asks for included (such a token is refused; the next with that `kid` verifies
    /// once the read found its key), 1 to 3600.
    #[arg(long, env = "PAYLEDGER_AUTH_JWKS_MIN_REFRESH_SECONDS", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(1..=3_600))]
    pub auth_jwks_min_refresh_seconds: u64,
    /// The `iss` every token must carry (required with --auth-jwks).
    #[arg(long, env = "PAYLEDGER_AUTH_ISSUER", default_value = "")]
    pub auth_issuer: String,
    /// The `aud` every token must carry (required with --auth-jwks).
    #[arg(long, env = "PAYLEDGER_AUTH_AUDIENCE", default_value = "")]
    pub auth_audience: String,
    /// Seconds of clock skew allowed on `exp` and `nbf`.
    #[arg(long, env = "PAYLEDGER_AUTH_LEEWAY_SECONDS", default_value_t = crate::auth::LEEWAY_SECONDS_DEFAULT,
          value_parser = clap::value_parser!(u64).range(0..=300))]
    pub auth_leeway_seconds: u64,
    /// Serve unauthenticated calls on a non-loopback address. Every caller that reaches the
    /// port may then move any money: for a network that only trusted callers can reach.
    #[arg(long, env = "PAYLEDGER_INSECURE_ALLOW_UNAUTHENTICATED")]
    pub insecure_allow_unauthenticated: bool,
}

/// TLS on the gRPC listener (rustls). With `--tls-client-ca`, mutual TLS: a client without
/// a certificate signed by that CA is refused at the handshake.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TlsSettings {
    /// The server's certificate chain (PEM).
    #[arg(long, env = "PAYLEDGER_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The server certificate's private key (PEM).
    #[arg(long, env = "PAYLEDGER_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// CA certificate(s) (PEM) that client certificates must chain to: mutual TLS.
    #[arg(long, env = "PAYLEDGER_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// Seconds between two reads of the TLS files: when they changed and make a usable
    /// configuration (the key matching the certificate), new connections are handshaken with
    /// it; open connections keep theirs. Files that cannot be used leave the configuration in
    /// force, with a warning. 0: read once, at start.
    #[arg(long, env = "PAYLEDGER_TLS_RELOAD_INTERVAL_SECONDS", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub tls_reload_interval_seconds: u64,
}

/// What `serve` does with the database schema at start (`--migrations`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Migrations {
    /// Apply the migrations the database lacks (several instances at once take turns).
    Apply,
    /// Apply nothing: refuse to start unless every migration of this release is applied
    /// (by `payledger migrate`, run before the deploy as a Job or init container).
    Check,
}

/// `payledger serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeSettings {
    /// Address to listen on for gRPC (HTTP/2) and HTTP/JSON (HTTP/1.1 and HTTP/2; docs/http.md);
    /// TLS with --tls-cert.
    #[arg(long, env = "PAYLEDGER_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    #[command(flatten)]
    pub tls: TlsSettings,
    #[command(flatten)]
    pub auth: AuthSettings,
    #[command(flatten)]
    pub database: DatabaseSettings,
    #[command(flatten)]
    pub writes: WriteSettings,
    /// `apply`: apply the migrations the database lacks at start; `check`: apply none and
    /// refuse to start unless the schema is complete (`payledger migrate` applies them).
    #[arg(long, env = "PAYLEDGER_MIGRATIONS", value_enum, default_value_t = Migrations::Apply)]
    pub migrations: Migrations,
    #[command(flatten)]
    pub idempotency: IdempotencySettings,
    /// Seconds that calls in flight get to finish after SIGTERM or SIGINT.
    #[arg(long, env = "PAYLEDGER_SHUTDOWN_GRACE_SECONDS", default_value_t = 10)]
    pub shutdown_grace_seconds: u64,
    /// Seconds an HTTP/2 connection of a caller is served before the server sends it a GOAWAY
    /// (gRFC A9, `MAX_CONNECTION_AGE`): the caller opens its next calls on a new connection,
    /// so long-lived connections move to instances added since, and the old connection closes
    /// once its calls in flight have finished (the API's RPCs are unary, bounded by their
    /// deadlines; a health Watch or reflection stream keeps it open until the stream ends).
    /// No jitter is added. 0: no limit.
    #[arg(long, env = "PAYLEDGER_MAX_CONNECTION_AGE_SECONDS", default_value_t = 600,
          value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub max_connection_age_seconds: u64,
    /// Seconds without a frame from a caller's connection after which the server sends it an
    /// HTTP/2 PING (server-side keepalive, gRFC A8); a PING unanswered within
    /// `--keepalive-timeout-seconds` closes the connection, so a caller that vanished without
    /// closing (a killed host, a dropped NAT mapping) frees its connection and streams. 0: no
    /// PINGs. The server does not police its callers' own PINGs: hyper has no PING policy
    /// (gRFC A8's `permit_keepalive_time`); payledger's client sends one only while calls are
    /// in flight, at most every 10 s.
    #[arg(long, env = "PAYLEDGER_KEEPALIVE_INTERVAL_SECONDS", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub keepalive_interval_seconds: u64,
    /// Seconds a keepalive PING (`--keepalive-interval-seconds`) may go unanswered before the
    /// server closes the connection.
    #[arg(long, env = "PAYLEDGER_KEEPALIVE_TIMEOUT_SECONDS", default_value_t = 20,
          value_parser = clap::value_parser!(u64).range(1..=3_600))]
    pub keepalive_timeout_seconds: u64,
    /// Seconds an accepted connection (on TLS, from the end of its handshake) may take to send
    /// a whole HTTP/2 preface or the start of an HTTP/1 request; past it the connection is
    /// closed, so that a peer that connects and sends nothing, or a preface a byte at a time,
    /// holds a socket no longer (RFC 9113, section 3.4).
    #[arg(long, env = "PAYLEDGER_PREFACE_TIMEOUT_SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=3_600))]
    pub preface_timeout_seconds: u64,
    /// Milliseconds between two health checks of the database (on a connection of their
    /// own, a new session at each check on PostgreSQL and MySQL): a check that finds the
    /// database unreachable or refusing writes (read-only; an UPDATE of no row, which writes
    /// nothing), on Galera a node not Synced, or that takes over 2 s, turns gRPC health
    /// NOT_SERVING; the next one that passes turns it SERVING again.
    #[arg(long, env = "PAYLEDGER_HEALTH_CHECK_INTERVAL_MS", default_value_t = 2_000,
          value_parser = clap::value_parser!(u64).range(100..=60_000))]
    pub health_check_interval_ms: u64,
    /// Most PaymentService and AccountService use cases running at once. A call past it is
    /// refused RESOURCE_EXHAUSTED (reason OVERLOADED, pushback 100 ms) once its message is
    /// decoded and its caller checked, before anything is read or written; a use case holds
    /// its place until it commits or rolls back, even if its caller has gone. Health and
    /// reflection are not counted. 0: no limit.
    #[arg(long, env = "PAYLEDGER_MAX_CONCURRENT_CALLS", default_value_t = 512,
          value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub max_concurrent_calls: u32,
    /// Address of the Prometheus `/metrics` listener (plain HTTP/1.1; none by default). Put
    /// it where only the scraper reaches: it needs no credential.
    #[arg(long, env = "PAYLEDGER_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Threads of the server's async runtime (tokio's worker threads), 1 to 1,024. Default:
    /// one a CPU core. Where the database shares the machine, fewer threads than cores spare
    /// the wake-ups of tasks moving between threads (docs/benchmarks-history.md, "Runtime threads").
    #[arg(long, env = "PAYLEDGER_WORKER_THREADS", value_parser = clap::value_parser!(u16).range(1..=1_024))]
    pub worker_threads: Option<u16>,
}

/// `payledger health`: asks a running server's gRPC health service (for container
/// HEALTHCHECKs and probes that cannot speak gRPC).
#[derive(Debug, Clone, clap::Args)]
pub struct HealthSettings {
    /// The server: `http://host:port`, or `https://host:port` for TLS. Default: this
    /// container's own server, `127.0.0.1` at the port of `PAYLEDGER_LISTEN` (else 50051),
    /// over `https://` when `PAYLEDGER_TLS_CERT` is set.
    #[arg(long, env = "PAYLEDGER_HEALTH_TARGET")]
    pub target: Option<String>,
    /// The service to ask about (`payledger.v1.PaymentService`...); empty: the server as a
    /// whole.
    #[arg(long, default_value = "")]
    pub service: String,
    /// Milliseconds to wait for the answer (connection included), 1 to 60000.
    #[arg(long, env = "PAYLEDGER_HEALTH_TIMEOUT_MS", default_value_t = 2_000,
          value_parser = clap::value_parser!(u64).range(1..=60_000))]
    pub timeout_ms: u64,
    /// CA certificate (PEM) that an `https://` target's certificate must chain to.
    #[arg(long, env = "PAYLEDGER_HEALTH_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// The name the server's certificate must carry, when it is not the target's host (a
    /// probe inside the container asks `127.0.0.1`; the certificate names the service).
    #[arg(long, env = "PAYLEDGER_HEALTH_TLS_DOMAIN")]
    pub tls_domain: Option<String>,
    /// Client certificate (PEM), for a server that requires mutual TLS.
    #[arg(long, env = "PAYLEDGER_HEALTH_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// Client certificate's private key (PEM).
    #[arg(long, env = "PAYLEDGER_HEALTH_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

impl HealthSettings {
    /// `--target`, or this host's server as `PAYLEDGER_LISTEN` and `PAYLEDGER_TLS_CERT`
    /// describe it.
    pub fn target(&self) -> String {
        if let Some(target) = self.target.as_ref().filter(|target| !target.is_empty()) {
            return target.clone();
        }
        let port = std::env::var("PAYLEDGER_LISTEN")
            .ok()
            .and_then(|listen| listen.parse::<SocketAddr>().ok())
            .map_or(50051, |listen| listen.port());
        let tls = std::env::var("PAYLEDGER_TLS_CERT").is_ok_and(|cert| !cert.is_empty());
        format!("{}://127.0.0.1:{port}", if tls { "https" } else { "http" })
    }
}

/// Whether a long command reports its progress (on stderr, never in its results on stdout).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Progress {
    /// When stderr is a terminal.
    Auto,
    /// Always (say, into a log file).
    Always,
    /// Never.
    Never,
}

impl Progress {
    /// Whether to report, given where stderr goes.
    pub fn shown(self) -> bool {
        use std::io::IsTerminal as _;
        match self {
            Progress::Auto => std::io::stderr().is_terminal(),
            Progress::Always => true,
            Progress::Never => false,
        }
    }
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
    #[arg(long, env = "PAYLEDGER_LOG_FORMAT", value_enum, default_value = "text", global = true)]
    pub log_format: LogFormat,
    /// Log filter in `tracing` EnvFilter syntax, e.g. `info` or `payledger=debug,sqlx=warn`.
    #[arg(long, env = "PAYLEDGER_LOG", default_value = "info,sqlx=warn", global = true)]
    pub log_filter: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `WriteSettings::default()` is what `serve` gets without the flags.
    #[test]
    fn write_settings_default_to_the_flags_defaults() {
        #[derive(clap::Parser)]
        struct Writes {
            #[command(flatten)]
            writes: WriteSettings,
        }
        use clap::Parser as _;
        let parsed = Writes::try_parse_from(["serve"]).unwrap().writes;
        assert_eq!(format!("{parsed:?}"), format!("{:?}", WriteSettings::default()));
    }

    /// A pool of no connection is refused as the flag is read, not taken as one.
    #[test]
    fn a_pool_of_no_connection_is_refused() {
        #[derive(clap::Parser)]
        struct Database {
            #[command(flatten)]
            database: DatabaseSettings,
        }
        use clap::Parser as _;
        let refused = Database::try_parse_from(["migrate", "--pool-size", "0"]).err().expect("0 is refused");
        assert!(refused.to_string().contains("--pool-size"), "{refused}");
        assert_eq!(Database::try_parse_from(["migrate", "--pool-size", "1"]).unwrap().database.pool_size, 1);
    }

    #[test]
    fn a_key_kept_shorter_than_a_token_lives_is_refused_at_start() {
        let settings =
            IdempotencySettings { idempotency_key_ttl_seconds: 2, token_ttl_seconds: 300, ..Default::default() };
        assert!(settings.validate().unwrap_err().contains("--token-ttl-seconds"));
        let equal =
            IdempotencySettings { idempotency_key_ttl_seconds: 300, token_ttl_seconds: 300, ..Default::default() };
        assert!(equal.validate().is_ok());
        assert!(IdempotencySettings::default().validate().is_ok());
    }

    #[test]
    fn a_key_ttl_of_zero_is_refused_by_the_command_line() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            idempotency: IdempotencySettings,
        }
        use clap::Parser as _;
        assert!(Cli::try_parse_from(["payledger", "--idempotency-key-ttl-seconds", "0"]).is_err());
        assert!(Cli::try_parse_from(["payledger", "--token-ttl-seconds", "0"]).is_err());
        assert!(Cli::try_parse_from(["payledger", "--idempotency-key-ttl-seconds", "1"]).is_ok());
    }

    #[test]
    fn runtime_threads_are_one_to_1024_and_default_to_tokios_choice() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            serve: ServeSettings,
        }
        use clap::Parser as _;
        let threads = |args: &[&str]| {
            Cli::try_parse_from(std::iter::once("payledger").chain(args.iter().copied()))
                .map(|cli| cli.serve.worker_threads)
        };
        assert!(threads(&["--worker-threads", "0"]).is_err());
        assert!(threads(&["--worker-threads", "1025"]).is_err());
        assert_eq!(threads(&["--worker-threads", "1"]).unwrap(), Some(1));
        assert_eq!(threads(&[]).unwrap(), None);
    }
}
