//! The server's TLS: its certificate chain, private key and (for mutual TLS) client CA,
//! reloaded from their files while the server runs, so that a renewed certificate or a
//! rotated client CA takes effect without a restart.
//!
//! Every `--tls-reload-interval-seconds` the three files are read again; when their bytes
//! changed and they make a usable configuration, new connections are handshaken with it.
//! Connections already open keep the session they have, and no call on them fails. Files that
//! cannot be read or used leave the configuration in force as it was, and the log says why
//! (once per change). A certificate manager that writes the certificate and the key one after
//! the other is seen half-written at most until its next write: the pair is only taken once
//! it matches.
//!
//! TLS 1.2 and 1.3 (rustls's safe defaults, the *ring* provider), ALPN `h2`. Handshakes run
//! concurrently, each bounded by [`HANDSHAKE_TIMEOUT`], at most [`HANDSHAKES_MAX`] at once.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use sha2::{Digest as _, Sha256};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// Longest a TLS handshake may take; a connection that has not finished it by then is closed.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most TLS handshakes in progress at once; further connections wait in the listen backlog.
pub const HANDSHAKES_MAX: usize = 1_024;

/// A TLS file or configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read the TLS file {path}: {source}")]
    Read { path: String, source: io::Error },
    #[error("the TLS file {path} holds no {what} in PEM")]
    Pem { path: String, what: &'static str },
    #[error("the TLS files cannot be used together: {0}")]
    Config(#[from] rustls::Error),
    #[error("the client CA cannot verify client certificates: {0}")]
    ClientCa(#[from] rustls::server::VerifierBuilderError),
}

/// The PEM texts of one TLS configuration.
#[derive(Clone, PartialEq, Eq)]
struct Pems {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl Pems {
    fn fingerprint(&self) -> [u8; 32] {
        let mut hasher = Sha256::new();
        for part in [Some(&self.cert), Some(&self.key), self.client_ca.as_ref()] {
            let bytes = part.map_or(&[][..], Vec::as_slice);
            hasher.update((bytes.len() as u64).to_be_bytes());
            hasher.update(bytes);
        }
        hasher.finalize().into()
    }

    /// The rustls configuration of these PEMs (`names` name the files in errors).
    fn config(&self, names: &FileNames) -> Result<Arc<ServerConfig>, TlsError> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&self.cert)
            .collect::<Result<_, _>>()
            .ok()
            .filter(|certs: &Vec<_>| !certs.is_empty())
            .ok_or_else(|| TlsError::Pem { path: names.cert.clone(), what: "certificate" })?;
        let key = PrivateKeyDer::from_pem_slice(&self.key)
            .map_err(|_| TlsError::Pem { path: names.key.clone(), what: "private key" })?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(provider.clone()).with_safe_default_protocol_versions()?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(client_ca) => {
                let path = names.client_ca.clone().unwrap_or_default();
                let mut roots = RootCertStore::empty();
                for ca in CertificateDer::pem_slice_iter(client_ca) {
                    let ca = ca.map_err(|_| TlsError::Pem { path: path.clone(), what: "certificate" })?;
                    roots.add(ca)?;
                }
                if roots.is_empty() {
                    return Err(TlsError::Pem { path, what: "certificate" });
                }
                builder.with_client_cert_verifier(
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider).build()?,
                )
            }
        };
        let mut config = builder.with_single_cert(certs, key)?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(config))
    }
}

/// The files a configuration was read from, as shown in errors.
#[derive(Clone, Default)]
struct FileNames {
    cert: String,
    key: String,
    client_ca: Option<String>,
}

/// Where the PEMs come from.
#[derive(Clone)]
struct Files {
    cert: PathBuf,
    key: PathBuf,
    client_ca: Option<PathBuf>,
}

impl Files {
    fn names(&self) -> FileNames {
        FileNames {
            cert: self.cert.display().to_string(),
            key: self.key.display().to_string(),
            client_ca: self.client_ca.as_ref().map(|path| path.display().to_string()),
        }
    }

    fn read(&self) -> Result<Pems, TlsError> {
        let read = |path: &Path| {
            std::fs::read(path).map_err(|source| TlsError::Read { path: path.display().to_string(), source })
        };
        Ok(Pems {
            cert: read(&self.cert)?,
            key: read(&self.key)?,
            client_ca: self.client_ca.as_deref().map(read).transpose()?,
        })
    }
}

/// The server's TLS configuration, replaced while the server runs when its files change
/// (see the module docs). Cheap to clone.
#[derive(Clone)]
pub struct ServerTls {
    current: Arc<RwLock<Arc<ServerConfig>>>,
    files: Option<Files>,
    mutual: bool,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls").field("mutual", &self.mutual).field("reloads", &self.files.is_some()).finish()
    }
}

impl ServerTls {
    /// Reads `cert` (the chain, PEM), `key` (PEM) and, for mutual TLS, `client_ca` (PEM: the
    /// CAs client certificates must chain to). [`ServerTls::reload_every`] keeps them fresh.
    ///
    /// # Errors
    /// [`TlsError`] for a file that cannot be read, or PEMs rustls cannot use (a key that is
    /// not the certificate's, say).
    pub fn from_files(cert: &Path, key: &Path, client_ca: Option<&Path>) -> Result<Self, TlsError> {
        let files = Files { cert: cert.to_owned(), key: key.to_owned(), client_ca: client_ca.map(Path::to_owned) };
        let config = files.read()?.config(&files.names())?;
        Ok(Self { current: Arc::new(RwLock::new(config)), mutual: client_ca.is_some(), files: Some(files) })
    }

    /// A configuration from PEM texts, never reloaded (tests, and embedders that hold their
    /// own PEMs).
    ///
    /// # Errors
    /// [`TlsError`] for PEMs rustls cannot use.
    pub fn from_pem(cert: &[u8], key: &[u8], client_ca: Option<&[u8]>) -> Result<Self, TlsError> {
        let pems = Pems { cert: cert.to_vec(), key: key.to_vec(), client_ca: client_ca.map(<[u8]>::to_vec) };
        let names = FileNames {
            cert: "(certificate)".into(),
            key: "(key)".into(),
            client_ca: client_ca.map(|_| "(client CA)".into()),
        };
        let config = pems.config(&names)?;
        Ok(Self { current: Arc::new(RwLock::new(config)), mutual: client_ca.is_some(), files: None })
    }

    /// True when client certificates are required.
    pub fn is_mutual(&self) -> bool {
        self.mutual
    }

    fn config(&self) -> Arc<ServerConfig> {
        self.current.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Reads the files again every `interval` until the returned task is aborted, and puts a
    /// changed, usable configuration in force for new connections. `None` for a configuration
    /// made from PEM texts.
    pub fn reload_every(&self, interval: Duration) -> Option<tokio::task::JoinHandle<()>> {
        let files = self.files.clone()?;
        let current = self.current.clone();
        Some(tokio::spawn(async move {
            let names = files.names();
            let mut in_force = files.read().ok().map(|pems| pems.fingerprint());
            let mut refused = None;
            loop {
                tokio::time::sleep(interval).await;
                let pems = match files.read() {
                    Ok(pems) => pems,
                    Err(error) => {
                        let text = error.to_string();
                        if refused.as_ref() != Some(&text) {
                            tracing::warn!(%error, "TLS files not reloaded; the configuration in force stays");
                            refused = Some(text);
                        }
                        continue;
                    }
                };
                let fingerprint = pems.fingerprint();
                if in_force == Some(fingerprint) {
                    continue;
                }
                match pems.config(&names) {
                    Ok(config) => {
                        *current.write().unwrap_or_else(std::sync::PoisonError::into_inner) = config;
                        in_force = Some(fingerprint);
                        refused = None;
                        tracing::info!(cert = %names.cert, "TLS files reloaded: new connections use them");
                    }
                    Err(error) => {
                        let text = error.to_string();
                        if refused.as_ref() != Some(&text) {
                            tracing::warn!(%error, "TLS files not reloaded; the configuration in force stays");
                            refused = Some(text);
                        }
                    }
                }
            }
        }))
    }

    /// The TLS connections of `listener`, each handshaken with the configuration in force when
    /// it was accepted (TCP_NODELAY set), for `Server::serve_with_incoming_shutdown`. A
    /// handshake that fails or takes longer than [`HANDSHAKE_TIMEOUT`] closes its connection
    /// and is logged at debug level. Ends when the receiving side is dropped.
    pub fn incoming(
        &self,
        listener: TcpListener,
    ) -> impl futures_util::Stream<Item = io::Result<TlsStream<TcpStream>>> {
        let (connections, incoming) = mpsc::channel(64);
        let tls = self.clone();
        tokio::spawn(async move {
            let handshakes = Arc::new(Semaphore::new(HANDSHAKES_MAX));
            loop {
                let Ok(permit) = handshakes.clone().acquire_owned().await else { return };
                let accepted = tokio::select! {
                    accepted = listener.accept() => accepted,
                    () = connections.closed() => return,
                };
                let (stream, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        // Out of file descriptors, say: wait rather than spin.
                        tracing::warn!(%error, "accepting a connection failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let acceptor = TlsAcceptor::from(tls.config());
                let connections = connections.clone();
                tokio::spawn(async move {
                    let _permit = permit;
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(stream)) => {
                            let _ = connections.send(Ok(stream)).await;
                        }
                        Ok(Err(error)) => tracing::debug!(%peer, %error, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        futures_util::stream::unfold(incoming, |mut incoming| async move {
            incoming.recv().await.map(|connection| (connection, incoming))
        })
    }
}
