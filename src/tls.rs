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
//! TLS 1.2 and 1.3 (rustls's safe defaults, the *ring* provider), ALPN `h2` (gRPC and
//! HTTP/JSON) then `http/1.1` (HTTP/JSON, see [`crate::http`]). A certificate
//! outside its validity period is refused, at start and on reload. Handshakes run concurrently,
//! each bounded by [`HANDSHAKE_TIMEOUT`], at most [`HANDSHAKES_MAX`] at once and
//! [`HANDSHAKES_PER_PEER_MAX`] from one IP address: a connection past either is closed at
//! once, so that peers holding handshakes open cannot keep others waiting. After the
//! handshake, a connection that has sent neither a whole HTTP/2 preface nor the start of an
//! HTTP/1 request within its preface timeout ([`PREFACE_TIMEOUT`] by default) is closed, as a
//! plaintext connection is, counted from when it was accepted ([`PrefaceDeadline`]).

use std::collections::HashMap;
use std::future::Future as _;
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use sha2::{Digest as _, Sha256};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tonic::transport::server::Connected;

use crate::metrics::ReasonLabel;

/// Longest a TLS handshake may take; a connection that has not finished it by then is closed.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Most TLS handshakes in progress at once; a connection past it is closed at once.
pub const HANDSHAKES_MAX: usize = 1_024;
/// Most TLS handshakes in progress from one IP address; a connection past it is closed at once.
/// Room for a burst of reconnections through one proxy or NAT address (callers behind an L4
/// load balancer share its address), while one address alone cannot take every slot.
pub const HANDSHAKES_PER_PEER_MAX: usize = 128;
/// Longest a connection may take, after its TLS handshake or on a plaintext listener after it
/// is accepted, to send a whole HTTP/2 preface or the start of an HTTP/1 request (an HTTP/2
/// client sends its preface at once, an HTTP/1 client its request); past it the connection is
/// closed. The server's default (`Application::with_preface_timeout`).
pub const PREFACE_TIMEOUT: Duration = Duration::from_secs(10);

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
    #[error("the certificate in {path} is not valid now (valid from {not_before} to {not_after})")]
    NotValidNow { path: String, not_before: String, not_after: String },
    #[error("the certificate in {path} cannot be read as X.509")]
    NotX509 { path: String },
}

/// Why a PEM file of CA certificates cannot be trusted (see [`trust_anchors`]).
#[derive(Debug, thiserror::Error)]
pub enum AnchorsError {
    #[error("not PEM certificates: {0}")]
    NotPem(rustls::pki_types::pem::Error),
    #[error("no PEM certificate (-----BEGIN CERTIFICATE-----) in the file")]
    Empty,
    #[error("a certificate that is not a usable CA: {0}")]
    NotUsable(rustls::Error),
}

/// The CAs a peer's certificate must chain to: those of `ca_pem` alone (its `CERTIFICATE`
/// blocks; other blocks are skipped) when given, else the public web roots (the Mozilla root
/// programme's CAs, as bundled by webpki-roots). For the server's client CA, the JWKS fetch and
/// the trace exporter alike.
///
/// # Errors
/// [`AnchorsError`] for a malformed block, no certificate, or one rustls cannot trust.
pub fn trust_anchors(ca_pem: Option<&[u8]>) -> Result<RootCertStore, AnchorsError> {
    let mut roots = RootCertStore::empty();
    let Some(pem) = ca_pem else {
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        return Ok(roots);
    };
    for certificate in CertificateDer::pem_slice_iter(pem) {
        roots.add(certificate.map_err(AnchorsError::NotPem)?).map_err(AnchorsError::NotUsable)?;
    }
    if roots.is_empty() {
        return Err(AnchorsError::Empty);
    }
    Ok(roots)
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
        // A certificate outside its validity period would fail every handshake: refuse it, and
        // keep the configuration in force (or do not start).
        let (_, leaf) = x509_parser::parse_x509_certificate(&certs[0])
            .map_err(|_| TlsError::NotX509 { path: names.cert.clone() })?;
        if !leaf.validity().is_valid() {
            return Err(TlsError::NotValidNow {
                path: names.cert.clone(),
                not_before: leaf.validity().not_before.to_string(),
                not_after: leaf.validity().not_after.to_string(),
            });
        }
        let key = PrivateKeyDer::from_pem_slice(&self.key)
            .map_err(|_| TlsError::Pem { path: names.key.clone(), what: "private key" })?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(provider.clone()).with_safe_default_protocol_versions()?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(client_ca) => {
                let path = names.client_ca.clone().unwrap_or_default();
                let roots = trust_anchors(Some(client_ca)).map_err(|error| match error {
                    AnchorsError::NotUsable(error) => TlsError::Config(error),
                    AnchorsError::NotPem(_) | AnchorsError::Empty => TlsError::Pem { path, what: "certificate" },
                })?;
                builder.with_client_cert_verifier(
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider).build()?,
                )
            }
        };
        let mut config = builder.with_single_cert(certs, key)?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

/// The end of the validity period of the leaf certificate of `pems`, for the log.
fn not_after(pems: &Pems) -> String {
    CertificateDer::pem_slice_iter(&pems.cert)
        .next()
        .and_then(Result::ok)
        .and_then(|leaf| {
            x509_parser::parse_x509_certificate(&leaf).ok().map(|(_, leaf)| leaf.validity().not_after.to_string())
        })
        .unwrap_or_default()
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
    /// The digest of the PEMs the configuration in force at start was made from.
    loaded: Option<[u8; 32]>,
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
        let pems = files.read()?;
        let config = pems.config(&files.names())?;
        Ok(Self {
            current: Arc::new(RwLock::new(config)),
            mutual: client_ca.is_some(),
            loaded: Some(pems.fingerprint()),
            files: Some(files),
        })
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
        Ok(Self { current: Arc::new(RwLock::new(config)), mutual: client_ca.is_some(), loaded: None, files: None })
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
        let (current, loaded) = (self.current.clone(), self.loaded);
        Some(tokio::spawn(async move {
            let names = files.names();
            let mut in_force = loaded;
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
                        tracing::info!(cert = %names.cert, not_after = %not_after(&pems), "TLS files reloaded: new connections use them");
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
    /// connection past the handshake bounds is closed at once; a handshake that fails or takes
    /// longer than [`HANDSHAKE_TIMEOUT`] closes its connection; each is counted in `refused` by
    /// its reason ([`crate::metrics::TLS_REFUSALS`]) and logged at debug level (a peer can
    /// cause as many as it likes); one that has then sent neither a whole HTTP/2 preface nor
    /// the start of an HTTP/1 request `preface_timeout` after its handshake is closed
    /// ([`PrefaceDeadline`]). Ends when the receiving side is dropped.
    pub fn incoming(
        &self,
        listener: TcpListener,
        refused: Family<ReasonLabel, Counter>,
        preface_timeout: Duration,
    ) -> impl futures_util::Stream<Item = io::Result<PrefaceDeadline<TlsStream<TcpStream>>>> {
        let refuse = move |reason: &'static str| {
            refused.get_or_create(&ReasonLabel { reason }).inc();
        };
        let (connections, incoming) = mpsc::channel(64);
        let tls = self.clone();
        tokio::spawn(async move {
            let handshakes = Arc::new(Semaphore::new(HANDSHAKES_MAX));
            let per_peer: Arc<std::sync::Mutex<HashMap<IpAddr, usize>>> = Arc::default();
            loop {
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
                let Ok(permit) = handshakes.clone().try_acquire_owned() else {
                    refuse("handshakes_at_bound");
                    tracing::debug!(%peer, "TLS handshakes at their bound: connection closed");
                    continue;
                };
                let Some(peer_slot) = PeerSlot::take(&per_peer, peer.ip()) else {
                    refuse("peer_at_bound");
                    tracing::debug!(%peer, "TLS handshakes of this address at their bound: connection closed");
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let acceptor = TlsAcceptor::from(tls.config());
                let connections = connections.clone();
                let refuse = refuse.clone();
                tokio::spawn(async move {
                    let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await;
                    drop((permit, peer_slot));
                    match handshake {
                        Ok(Ok(stream)) => {
                            let _ = connections.send(Ok(PrefaceDeadline::new(stream, preface_timeout))).await;
                        }
                        // The peer closed the connection before the handshake ended: a TCP
                        // probe or a port scan (nothing sent), or a client that gave up.
                        Ok(Err(error)) if error.kind() == io::ErrorKind::UnexpectedEof => {
                            refuse("closed_early");
                            tracing::debug!(%peer, %error, "connection closed during the TLS handshake");
                        }
                        Ok(Err(error)) => {
                            refuse("handshake_failed");
                            tracing::debug!(%peer, %error, "TLS handshake failed");
                        }
                        Err(_) => {
                            refuse("handshake_timed_out");
                            tracing::debug!(%peer, "TLS handshake timed out");
                        }
                    }
                });
            }
        });
        futures_util::stream::unfold(incoming, |mut incoming| async move {
            incoming.recv().await.map(|connection| (connection, incoming))
        })
    }
}

/// One handshake in progress from an address, counted in a map shared by the accept loop.
struct PeerSlot {
    peers: Arc<std::sync::Mutex<HashMap<IpAddr, usize>>>,
    peer: IpAddr,
}

impl PeerSlot {
    /// A slot for `peer`, or `None` when it has [`HANDSHAKES_PER_PEER_MAX`] already.
    fn take(peers: &Arc<std::sync::Mutex<HashMap<IpAddr, usize>>>, peer: IpAddr) -> Option<Self> {
        let mut counts = peers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let count = counts.entry(peer).or_insert(0);
        if *count >= HANDSHAKES_PER_PEER_MAX {
            return None;
        }
        *count += 1;
        Some(Self { peers: peers.clone(), peer })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut counts = self.peers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(count) = counts.get_mut(&self.peer) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&self.peer);
            }
        }
    }
}

/// The client connection preface of HTTP/2 (RFC 9113, section 3.4): the first bytes an
/// HTTP/2 client sends.
const HTTP2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A stream whose reads fail with `TimedOut` when its deadline passes before it has received
/// either a whole HTTP/2 preface or a byte that cannot begin one (an HTTP/1 request, which
/// hyper's own header-read timeout bounds from then on, or bytes hyper refuses at once); after
/// that it is the stream itself. Every accepted connection, TLS or plaintext, is served
/// through one, so that a peer that connects and sends nothing, or part of a preface, holds
/// its socket at most that long.
pub struct PrefaceDeadline<S> {
    inner: S,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Bytes of [`HTTP2_PREFACE`] received so far, while the deadline holds.
    matched: usize,
}

impl<S> PrefaceDeadline<S> {
    pub(crate) fn new(inner: S, timeout: Duration) -> Self {
        Self { inner, deadline: Some(Box::pin(tokio::time::sleep(timeout))), matched: 0 }
    }

    /// Follows `received`, the bytes a read just gave: the deadline ends with the preface's
    /// last byte, or with the first byte that departs from it.
    fn saw(&mut self, received: &[u8]) {
        let expected = &HTTP2_PREFACE[self.matched..];
        let compared = received.len().min(expected.len());
        if received[..compared] == expected[..compared] {
            self.matched += compared;
            if self.matched == HTTP2_PREFACE.len() {
                self.deadline = None;
            }
        } else {
            self.deadline = None;
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for PrefaceDeadline<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffer: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buffer.filled().len();
        let read = Pin::new(&mut self.inner).poll_read(context, buffer);
        match &read {
            Poll::Ready(Ok(())) if self.deadline.is_some() && buffer.filled().len() > before => {
                self.saw(&buffer.filled()[before..]);
            }
            Poll::Pending => {
                if let Some(deadline) = self.deadline.as_mut() {
                    if deadline.as_mut().poll(context).is_ready() {
                        return Poll::Ready(Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "no HTTP/2 preface or HTTP/1 request within the preface timeout",
                        )));
                    }
                }
            }
            Poll::Ready(_) => {}
        }
        read
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for PrefaceDeadline<S> {
    fn poll_write(mut self: Pin<&mut Self>, context: &mut Context<'_>, bytes: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(context, bytes)
    }

    fn poll_flush(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(context)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(context)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffers: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(context, buffers)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl<S: Connected> Connected for PrefaceDeadline<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    const DEADLINE: Duration = Duration::from_millis(100);

    /// Sends `pieces` one after another into a fresh stream, each read back whole, then reads
    /// once more with the client silent: what that read gave within four deadlines.
    async fn silent_after(pieces: &[&[u8]]) -> Result<io::Result<usize>, tokio::time::error::Elapsed> {
        let (mut client, server) = tokio::io::duplex(64);
        let mut stream = PrefaceDeadline::new(server, DEADLINE);
        let mut buffer = [0u8; 64];
        for piece in pieces {
            client.write_all(piece).await.unwrap();
            assert_eq!(stream.read(&mut buffer).await.unwrap(), piece.len());
        }
        let result = tokio::time::timeout(DEADLINE * 4, stream.read(&mut buffer)).await;
        drop(client);
        result
    }

    fn timed_out(result: &Result<io::Result<usize>, tokio::time::error::Elapsed>) -> bool {
        matches!(result, Ok(Err(error)) if error.kind() == io::ErrorKind::TimedOut)
    }

    #[tokio::test]
    async fn a_stream_fails_at_its_deadline_until_it_has_sent_a_whole_preface_or_bytes_that_are_not_one() {
        assert!(timed_out(&silent_after(&[]).await), "nothing sent");
        assert!(timed_out(&silent_after(&[b"P"]).await), "one byte of the preface");
        assert!(timed_out(&silent_after(&[b"PRI * HTTP/2.0\r\n", b"\r\nSM\r\n"]).await), "a preface cut short");
        // Done: the whole preface, at once, in pieces, or with the first frame behind it.
        assert!(silent_after(&[HTTP2_PREFACE]).await.is_err(), "still open, silent past the deadline");
        assert!(silent_after(&[b"PRI * HTTP/2.0", b"\r\n\r\nSM", b"\r\n\r\n"]).await.is_err(), "in pieces");
        let mut with_settings = HTTP2_PREFACE.to_vec();
        with_settings.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
        assert!(silent_after(&[&with_settings]).await.is_err(), "with a SETTINGS frame behind it");
        // Not HTTP/2: an HTTP/1 request (its first byte already) or bytes that fit no protocol,
        // bounded from then on by hyper.
        assert!(silent_after(&[b"G"]).await.is_err(), "an HTTP/1 GET");
        assert!(silent_after(&[b"POST /v1/pay HTTP/1.1\r\n"]).await.is_err(), "a POST, departing at its second byte");
        assert!(silent_after(&[b"\x16\x03"]).await.is_err(), "TLS to the plaintext port");
    }

    #[test]
    fn handshakes_are_counted_per_address_up_to_their_bound() {
        let peers = Arc::default();
        let one: IpAddr = "192.0.2.1".parse().unwrap();
        let slots: Vec<PeerSlot> = (0..HANDSHAKES_PER_PEER_MAX).map(|_| PeerSlot::take(&peers, one).unwrap()).collect();
        assert!(PeerSlot::take(&peers, one).is_none(), "past the bound");
        assert!(PeerSlot::take(&peers, "192.0.2.2".parse().unwrap()).is_some(), "another address has its own");
        drop(slots);
        assert!(PeerSlot::take(&peers, one).is_some(), "slots come back when handshakes end");
        assert!(peers.lock().unwrap().is_empty(), "an address without a handshake leaves the map");
    }
}
