//! payledger's test tools, on top of the client crate (and the server library, for the
//! in-process servers they start): `demo`, `bench`, `seed` (a ledger filled in bulk) and `storm` with its fault proxy.
//!
//! They write test data (funded accounts, orders, payments), so they refuse a server or a
//! database they did not start themselves unless told explicitly: `--allow-test-data` for
//! `demo --target` and `bench`, `--reuse-database` for `storm`. None of them reads
//! `DATABASE_URL`.

pub mod bench;
pub mod demo;
pub mod seed;
pub mod storm;

/// The error of a tool run: printed with its causes, then exit code 1.
pub type AnyError = Box<dyn std::error::Error + Send + Sync>;

/// Refuses to write test data to a server this process did not start, unless allowed.
///
/// # Errors
/// When `allowed` is false: a message naming the flag that allows it.
pub fn check_test_data_allowed(target: &str, allowed: bool) -> Result<(), AnyError> {
    if allowed {
        return Ok(());
    }
    Err(format!(
        "refusing to write test data (funded accounts, orders, payments) to {target}, a server this command did not \
         start; pass --allow-test-data if that server is meant for it"
    )
    .into())
}

/// How a tool reaches a server it did not start: TLS for `https://` targets, and a bearer
/// token for a server that authenticates callers.
#[derive(Clone, Default, clap::Args)]
pub struct TargetAccess {
    /// A JWT to send as `authorization: Bearer <JWT>` (for a server run with
    /// `--auth-jwks`; see `payledger auth mint`). Read from the environment rather than the
    /// command line where others can see process arguments.
    #[arg(long = "token", env = "PAYLEDGER_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// CA certificate (PEM) that an `https://` target's certificate must chain to (default:
    /// the public roots).
    #[arg(long)]
    pub tls_ca: Option<std::path::PathBuf>,
    /// This client's certificate (PEM), for a server that requires mutual TLS.
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,
    /// This client's private key (PEM), with `--tls-cert`.
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,
}

/// Never shows the token.
impl std::fmt::Debug for TargetAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TargetAccess")
            .field("token", &self.token.as_ref().map(|_| ".."))
            .field("tls_ca", &self.tls_ca)
            .field("tls_cert", &self.tls_cert)
            .field("tls_key", &self.tls_key)
            .finish()
    }
}

/// The gRPC stubs a tool calls through: a channel, with the bearer token (if any) added to
/// every call.
pub type Stub =
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, payledger_client::BearerToken>;

impl TargetAccess {
    /// A connected channel to `target` and the interceptor that sends the token.
    ///
    /// # Errors
    /// When a PEM file cannot be read, the token is not a header value, or the target
    /// cannot be reached.
    pub async fn connect(
        &self,
        target: &str,
    ) -> Result<(tonic::transport::Channel, payledger_client::BearerToken), AnyError> {
        let read = |path: &std::path::PathBuf| {
            std::fs::read(path).map_err(|error| format!("cannot read {}: {error}", path.display()))
        };
        // TLS settings for an http:// target are refused by `endpoint`, never dropped.
        let tls_flags = self.tls_ca.is_some() || self.tls_cert.is_some();
        let tls = if target.starts_with("https://") || tls_flags {
            let identity = match (&self.tls_cert, &self.tls_key) {
                (Some(cert), Some(key)) => Some((read(cert)?, read(key)?)),
                _ => None,
            };
            let ca_certificate_pem = self.tls_ca.as_ref().map(read).transpose()?;
            Some(payledger_client::ClientTls { ca_certificate_pem, identity_pem: identity, domain_name: None })
        } else {
            None
        };
        let channel = payledger_client::endpoint(target, tls.as_ref())?.connect().await?;
        let bearer = match &self.token {
            Some(token) => payledger_client::BearerToken::new(token.trim())?,
            None => payledger_client::BearerToken::default(),
        };
        Ok((channel, bearer))
    }
}
