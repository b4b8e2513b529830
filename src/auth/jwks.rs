//! Where the JWKS comes from (`--auth-jwks`): a file, or an identity provider's `jwks_uri`
//! (`https://` only), and the task that keeps the [`Authenticator`]'s keys fresh.
//!
//! - **At start** the set is read (fetched) once; a server that never had one does not start.
//! - **Every `--auth-jwks-refresh-seconds`** it is read again, and a token whose `kid` no key
//!   has asks for a read at once; reads are at least `--auth-jwks-min-refresh-seconds` apart,
//!   so that a stream of forged `kid`s cannot turn into a stream of fetches.
//! - **A read that fails** (the provider unreachable, a 5xx, a body that is not a usable JWK
//!   set) keeps the last good set, and the log says so.
//! - **Bounds**: a fetch takes at most [`FETCH_TIMEOUT`], follows no redirect, and reads at
//!   most [`JWKS_BYTES_MAX`] of body.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::{AuthSettingsError, Authenticator};
use crate::tls::AnchorsError;

/// Longest a JWKS fetch may take, connection included.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest JWKS body read, in bytes (an identity provider's set is a few kilobytes).
pub const JWKS_BYTES_MAX: usize = 1024 * 1024;

/// A hyper client that speaks HTTP/1.1 over TLS only (rustls, *ring*), and follows no
/// redirect.
type HttpsClient = hyper_util::client::legacy::Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    http_body_util::Empty<bytes::Bytes>,
>;

/// The origin of the JWK set.
#[derive(Clone)]
pub enum JwksSource {
    File(PathBuf),
    /// An `https://` URL, fetched with a client that trusts the roots it was made with.
    Url {
        url: String,
        client: Box<HttpsClient>,
    },
}

impl std::fmt::Debug for JwksSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl JwksSource {
    /// `location` as given to `--auth-jwks`: an `https://` URL, or a file path. `ca_pem`: the
    /// CA certificate(s) a URL's server must chain to (default: the Mozilla root programme's
    /// CAs, as bundled by `webpki-roots`).
    ///
    /// # Errors
    /// [`AuthSettingsError::Source`] for an `http://` URL (a JWKS decides who may move money:
    /// it is fetched over TLS only), or a CA that cannot be used.
    pub fn new(location: &str, ca_pem: Option<&[u8]>) -> Result<Self, AuthSettingsError> {
        let lowercase = location.to_ascii_lowercase();
        if lowercase.starts_with("http://") {
            return Err(AuthSettingsError::Source(format!(
                "--auth-jwks {}: a JWKS URL must be https:// (the keys decide who may move money)",
                redacted(location)
            )));
        }
        if !lowercase.starts_with("https://") {
            if ca_pem.is_some() {
                return Err(AuthSettingsError::Source("--auth-jwks-ca goes with an https:// --auth-jwks".into()));
            }
            return Ok(Self::File(PathBuf::from(location)));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let roots = crate::tls::trust_anchors(ca_pem).map_err(|error| match error {
            AnchorsError::NotPem(_) => AuthSettingsError::Source("--auth-jwks-ca is not a PEM certificate".into()),
            AnchorsError::Empty => AuthSettingsError::Source("--auth-jwks-ca holds no certificate".into()),
            AnchorsError::NotUsable(error) => AuthSettingsError::Source(format!("--auth-jwks-ca: {error}")),
        })?;
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|error| AuthSettingsError::Source(error.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let connector =
            hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(tls).https_only().enable_http1().build();
        let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build(connector);
        location
            .parse::<http::Uri>()
            .map_err(|error| AuthSettingsError::Source(format!("--auth-jwks {}: {error}", redacted(location))))?;
        Ok(Self::Url { url: location.to_owned(), client: Box::new(client) })
    }

    /// The file's path or the URL, for logs and errors: a URL without its user information and
    /// query, which may carry a credential.
    pub fn describe(&self) -> String {
        match self {
            Self::File(path) => path.display().to_string(),
            Self::Url { url, .. } => redacted(url),
        }
    }

    /// The text of the JWK set now.
    ///
    /// # Errors
    /// [`AuthSettingsError::Read`] for a file that cannot be read; [`AuthSettingsError::Fetch`]
    /// for a fetch that fails, answers other than 200, or sends more than [`JWKS_BYTES_MAX`].
    pub async fn read(&self) -> Result<String, AuthSettingsError> {
        match self {
            Self::File(path) => tokio::fs::read_to_string(path)
                .await
                .map_err(|source| AuthSettingsError::Read { path: path.display().to_string(), source }),
            Self::Url { url, client } => {
                let failed = |detail: String| AuthSettingsError::Fetch { url: redacted(url), detail };
                tokio::time::timeout(FETCH_TIMEOUT, fetch(client, url))
                    .await
                    .unwrap_or_else(|_| Err(format!("no answer within {} s", FETCH_TIMEOUT.as_secs())))
                    .map_err(failed)
            }
        }
    }
}

/// The body of a GET of `url`: at most [`JWKS_BYTES_MAX`] bytes of UTF-8, answered 200.
async fn fetch(client: &HttpsClient, url: &str) -> Result<String, String> {
    use http_body_util::BodyExt as _;
    let request = http::Request::get(url)
        .header(http::header::ACCEPT, "application/jwk-set+json, application/json")
        .body(http_body_util::Empty::new())
        .map_err(|error| error.to_string())?;
    let response = client.request(request).await.map_err(|error| error_text(&error))?;
    if response.status() != http::StatusCode::OK {
        return Err(format!("answered {}", response.status()));
    }
    let body = http_body_util::Limited::new(response.into_body(), JWKS_BYTES_MAX)
        .collect()
        .await
        .map_err(|_| format!("a body over {JWKS_BYTES_MAX} bytes, or one cut short"))?
        .to_bytes();
    String::from_utf8(body.to_vec()).map_err(|_| "a body that is not UTF-8".to_owned())
}

/// `url` as scheme, host, port and path only.
fn redacted(url: &str) -> String {
    match url.parse::<http::Uri>() {
        Ok(uri) => {
            let host = uri.host().unwrap_or_default();
            let port = uri.port_u16().map(|port| format!(":{port}")).unwrap_or_default();
            format!("{}://{host}{port}{}", uri.scheme_str().unwrap_or("https"), uri.path())
        }
        Err(_) => "(an unparsable URL)".to_owned(),
    }
}

/// An error with its causes, on one line (hyper's own text omits them).
fn error_text(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// How often the refresher reads the set.
#[derive(Debug, Clone, Copy)]
pub struct Refresh {
    /// Between two scheduled reads (never less than `min_interval`).
    pub interval: Duration,
    /// At least this long between any two reads, those asked for by an unknown `kid` too.
    pub min_interval: Duration,
}

/// Reads `source` again on `refresh`'s schedule and whenever `authenticator` meets an unknown
/// `kid`, and puts a changed, usable set in force; until the returned task is aborted.
pub fn spawn_refresher(
    authenticator: Arc<Authenticator>,
    source: JwksSource,
    refresh: Refresh,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let unknown_kid = authenticator.unknown_kid_signal();
        let mut last_read = tokio::time::Instant::now();
        let mut failing = false;
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(last_read + refresh.interval.max(refresh.min_interval)) => {}
                () = unknown_kid.notified() => {
                    tokio::time::sleep_until(last_read + refresh.min_interval).await;
                }
            }
            last_read = tokio::time::Instant::now();
            let outcome = match source.read().await {
                Ok(text) => authenticator.replace_keys(&text).map_err(|error| error.with_source(&source.describe())),
                Err(error) => Err(error),
            };
            match outcome {
                Ok(changed) => {
                    if changed {
                        tracing::info!(jwks = %source.describe(), kids = ?authenticator.kids(), "JWKS changed: its keys are in force");
                    } else if failing {
                        tracing::info!(jwks = %source.describe(), "JWKS read again");
                    }
                    failing = false;
                }
                Err(error) => {
                    tracing::warn!(%error, "JWKS not refreshed; the last good set stays in force");
                    failing = true;
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_is_shown_without_its_credentials() {
        assert_eq!(redacted("https://user:secret@idp.example:8443/keys?token=abc"), "https://idp.example:8443/keys");
        assert_eq!(redacted("https://idp.example/.well-known/jwks.json"), "https://idp.example/.well-known/jwks.json");
    }
}
