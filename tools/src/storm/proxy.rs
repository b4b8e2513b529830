//! A fault-injecting TCP proxy for gRPC (HTTP/2 over plaintext TCP). It sits between a client
//! and a payledger instance, reads the HTTP/2 frames (RFC 9113) going both ways, and for each
//! new request (a client HEADERS frame opening a stream) draws one fault with the given
//! probabilities:
//! - delay: the request is forwarded late;
//! - reset before the request: the connection is reset and the request never arrives;
//! - drop the response: the request is forwarded, and the connection is reset when the server's
//!   first frame for that stream arrives (the server answered, maybe committed, and the client
//!   never hears it);
//! - black hole: nothing more is forwarded either way, and the connection is held open,
//!   unanswered, until the hold time runs out;
//! - cut after the headers: the request is forwarded, the server's
//!   response headers reach the client, and the connection is reset before the rest of the
//!   answer (its message and trailers) does.
//!
//! Only loopback targets are meant; the proxy listens on 127.0.0.1.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// How long a black-holed connection is held before the proxy lets it go.
const BLACKHOLE_HOLD: Duration = Duration::from_secs(10);
/// How long a cut after the headers waits, with the headers sent, before the reset.
const CUT_AFTER_HEADERS_PAUSE: Duration = Duration::from_millis(20);
/// Bytes of an HTTP/2 frame header (RFC 9113, section 4.1).
const FRAME_HEADER_BYTES: usize = 9;

/// Fault probabilities, each per new connection (0.0 to 1.0), and the delay.
#[derive(Debug, Clone, Default)]
pub struct FaultSettings {
    pub delay_probability: f64,
    pub delay: Duration,
    pub reset_before_probability: f64,
    pub drop_response_probability: f64,
    pub blackhole_probability: f64,
    pub cut_after_headers_probability: f64,
}

impl FaultSettings {
    /// No faults: a plain pass-through.
    pub fn none() -> Self {
        Self::default()
    }
}

/// Faults injected so far.
#[derive(Debug, Default)]
pub struct FaultCounters {
    pub connections: AtomicU64,
    pub delays: AtomicU64,
    pub resets_before_request: AtomicU64,
    pub dropped_responses: AtomicU64,
    pub blackholes: AtomicU64,
    pub cuts_after_headers: AtomicU64,
}

/// A copy of [`FaultCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct FaultCount {
    pub connections: u64,
    pub delays: u64,
    pub resets_before_request: u64,
    pub dropped_responses: u64,
    pub blackholes: u64,
    pub cuts_after_headers: u64,
}

impl FaultCount {
    /// Faults injected (delays, resets, dropped responses, black holes, cuts after headers).
    pub fn injected(&self) -> u64 {
        self.delays + self.resets_before_request + self.dropped_responses + self.blackholes + self.cuts_after_headers
    }
}

/// One fault, as applied to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    Pass,
    Delay,
    ResetBefore,
    DropResponse,
    Blackhole,
    CutAfterHeaders,
}

struct Shared {
    target: Mutex<SocketAddr>,
    settings: Mutex<FaultSettings>,
    /// Faults the next requests get, in order, whatever the probabilities say.
    forced: Mutex<std::collections::VecDeque<Fault>>,
    counters: FaultCounters,
}

/// A running proxy; dropping it stops accepting (open connections end on their own).
pub struct FaultProxy {
    address: SocketAddr,
    shared: Arc<Shared>,
    acceptor: JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.acceptor.abort();
    }
}

impl FaultProxy {
    /// Starts a proxy on 127.0.0.1 (a free port) in front of `target`.
    ///
    /// # Errors
    /// When no port can be bound.
    pub async fn start(target: SocketAddr, settings: FaultSettings) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?;
        let shared = Arc::new(Shared {
            target: Mutex::new(target),
            settings: Mutex::new(settings),
            forced: Mutex::new(std::collections::VecDeque::new()),
            counters: FaultCounters::default(),
        });
        let acceptor = tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(Self { address, shared, acceptor })
    }

    /// Where clients connect.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Points the proxy at a new target (an instance restarted on another port); connections
    /// already open keep their old one.
    pub fn set_target(&self, target: SocketAddr) {
        *lock(&self.shared.target) = target;
    }

    /// Changes the fault probabilities, from the next request on.
    pub fn set_settings(&self, settings: FaultSettings) {
        *lock(&self.shared.settings) = settings;
    }

    /// Makes the next `count` requests go through and lose their response.
    pub fn drop_next_responses(&self, count: u64) {
        self.force_next((0..count).map(|_| Fault::DropResponse));
    }

    /// Gives the next requests these faults, in order.
    pub fn force_next(&self, faults: impl IntoIterator<Item = Fault>) {
        lock(&self.shared.forced).extend(faults);
    }

    /// Forgets the faults forced and not yet applied.
    pub fn clear_forced(&self) {
        lock(&self.shared.forced).clear();
    }

    pub fn counters(&self) -> FaultCount {
        let counters = &self.shared.counters;
        let read = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        FaultCount {
            connections: read(&counters.connections),
            delays: read(&counters.delays),
            resets_before_request: read(&counters.resets_before_request),
            dropped_responses: read(&counters.dropped_responses),
            blackholes: read(&counters.blackholes),
            cuts_after_headers: read(&counters.cuts_after_headers),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((client, _)) = listener.accept().await else { continue };
        shared.counters.connections.fetch_add(1, Ordering::Relaxed);
        let shared = shared.clone();
        tokio::spawn(async move {
            let _ = handle(client, &shared).await;
        });
    }
}

fn choose_fault(shared: &Shared) -> Fault {
    if let Some(fault) = lock(&shared.forced).pop_front() {
        return fault;
    }
    let settings = lock(&shared.settings).clone();
    let draw: f64 = rand::random();
    let mut threshold = 0.0;
    for (probability, fault) in [
        (settings.reset_before_probability, Fault::ResetBefore),
        (settings.drop_response_probability, Fault::DropResponse),
        (settings.blackhole_probability, Fault::Blackhole),
        (settings.cut_after_headers_probability, Fault::CutAfterHeaders),
        (settings.delay_probability, Fault::Delay),
    ] {
        threshold += probability;
        if draw < threshold {
            return fault;
        }
    }
    Fault::Pass
}

/// Closes with RST instead of FIN, as a crashed peer or a middlebox would.
fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}

/// The client connection preface (RFC 9113, section 3.4).
const CLIENT_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_TYPE_HEADERS: u8 = 0x1;

/// One complete HTTP/2 frame at the start of `buffer`: (type, stream id, total length).
fn next_frame(buffer: &[u8]) -> Option<(u8, u32, usize)> {
    if buffer.len() < FRAME_HEADER_BYTES {
        return None;
    }
    let length = usize::from(buffer[0]) << 16 | usize::from(buffer[1]) << 8 | usize::from(buffer[2]);
    let total = FRAME_HEADER_BYTES + length;
    let stream_id = u32::from_be_bytes([buffer[5], buffer[6], buffer[7], buffer[8]]) & 0x7fff_ffff;
    (buffer.len() >= total).then_some((buffer[3], stream_id, total))
}

fn broken(what: &'static str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::ConnectionReset, what)
}

async fn handle(client: TcpStream, shared: &Shared) -> std::io::Result<()> {
    let counters = &shared.counters;
    let target = *lock(&shared.target);
    let Ok(server) = TcpStream::connect(target).await else {
        // The instance is down (killed, restarting): the client sees a reset and retries.
        reset(client);
        return Ok(());
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    // The stream whose response is to be dropped (0: none), the one whose response is to be
    // cut after its headers, and whether the connection fell into a black hole.
    let drop_stream = AtomicU64::new(0);
    let cut_stream = AtomicU64::new(0);
    let blackholed = std::sync::atomic::AtomicBool::new(false);
    let upstream = async {
        let mut buffer = vec![0u8; 16 * 1024];
        let mut pending: Vec<u8> = Vec::new();
        let mut preface_left = CLIENT_PREFACE.len();
        loop {
            let read = client_read.read(&mut buffer).await?;
            if read == 0 {
                break;
            }
            if blackholed.load(Ordering::SeqCst) {
                continue;
            }
            pending.extend_from_slice(&buffer[..read]);
            if preface_left > 0 {
                let forwarded = preface_left.min(pending.len());
                server_write.write_all(&pending[..forwarded]).await?;
                pending.drain(..forwarded);
                preface_left -= forwarded;
            }
            while let Some((frame_type, stream_id, total)) = next_frame(&pending) {
                if frame_type == FRAME_TYPE_HEADERS
                    && stream_id != 0
                    && drop_stream.load(Ordering::SeqCst) != u64::from(stream_id)
                {
                    match choose_fault(shared) {
                        Fault::Pass => {}
                        Fault::Delay => {
                            counters.delays.fetch_add(1, Ordering::Relaxed);
                            let delay = lock(&shared.settings).delay;
                            tokio::time::sleep(delay).await;
                        }
                        Fault::ResetBefore => {
                            counters.resets_before_request.fetch_add(1, Ordering::Relaxed);
                            return Err(broken("reset before the request"));
                        }
                        Fault::DropResponse => drop_stream.store(u64::from(stream_id), Ordering::SeqCst),
                        Fault::CutAfterHeaders => cut_stream.store(u64::from(stream_id), Ordering::SeqCst),
                        Fault::Blackhole => {
                            counters.blackholes.fetch_add(1, Ordering::Relaxed);
                            blackholed.store(true, Ordering::SeqCst);
                            pending.clear();
                            break;
                        }
                    }
                }
                let frame: Vec<u8> = pending.drain(..total).collect();
                server_write.write_all(&frame).await?;
            }
        }
        server_write.shutdown().await
    };
    let downstream = async {
        let mut buffer = vec![0u8; 16 * 1024];
        let mut pending: Vec<u8> = Vec::new();
        let mut cut_headers_sent = false;
        loop {
            let read = server_read.read(&mut buffer).await?;
            if read == 0 {
                break;
            }
            if blackholed.load(Ordering::SeqCst) {
                continue;
            }
            pending.extend_from_slice(&buffer[..read]);
            while let Some((frame_type, stream_id, total)) = next_frame(&pending) {
                if stream_id != 0 && u64::from(stream_id) == drop_stream.load(Ordering::SeqCst) {
                    counters.dropped_responses.fetch_add(1, Ordering::Relaxed);
                    return Err(broken("response dropped"));
                }
                if stream_id != 0 && u64::from(stream_id) == cut_stream.load(Ordering::SeqCst) {
                    if cut_headers_sent || frame_type != FRAME_TYPE_HEADERS {
                        counters.cuts_after_headers.fetch_add(1, Ordering::Relaxed);
                        // Time for the client to read the headers before the reset.
                        tokio::time::sleep(CUT_AFTER_HEADERS_PAUSE).await;
                        return Err(broken("response cut after its headers"));
                    }
                    cut_headers_sent = true;
                }
                let frame: Vec<u8> = pending.drain(..total).collect();
                client_write.write_all(&frame).await?;
            }
        }
        client_write.shutdown().await
    };
    let holder = async {
        // A black hole holds the connection open, unanswered, then lets it go.
        while !blackholed.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(BLACKHOLE_HOLD).await;
        Err::<(), _>(broken("black hole released"))
    };
    let outcome = tokio::select! {
        result = async { tokio::try_join!(upstream, downstream) } => result.map(|_| ()),
        result = holder => result,
    };
    if outcome.is_err() {
        // The client must see a broken connection, not a clean end.
        if let Ok(client) = client_write.reunite(client_read) {
            reset(client);
        }
    }
    Ok(())
}
