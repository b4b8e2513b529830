//! Server-side HTTP/2 keepalive (gRFC A8): a caller's connection that stops answering PINGs
//! (a host gone without closing, a NAT mapping dropped) is closed, one that answers stays. The
//! caller here speaks raw HTTP/2 frames, so that the test decides which PINGs are answered.
//! And the bound before any frame: a plaintext connection that sends nothing, or part of the
//! HTTP/2 preface, is closed after the preface timeout.

use crate::common;

use std::time::Duration;

use payledger::startup::{Application, Keepalive};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// HTTP/2 frame types (RFC 9113, section 6).
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const ACK: u8 = 0x1;

/// The most the test waits for the server's PINGs or its close: a bound on the test, not a
/// timing assertion.
const WAIT_MAX: Duration = Duration::from_secs(15);

/// What a connection saw until it closed, or until `watch` elapsed.
#[derive(Debug, Default)]
struct Seen {
    pings: usize,
    goaway: bool,
    closed: bool,
}

async fn server(keepalive: Option<Keepalive>) -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>) {
    server_with(keepalive, payledger::tls::PREFACE_TIMEOUT).await
}

async fn server_with(
    keepalive: Option<Keepalive>,
    preface_timeout: Duration,
) -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let directory = tempfile::tempdir().unwrap();
    let ledger = common::sqlite_ledger(directory.path()).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let application = Application::with_listener(listener, ledger, Duration::from_secs(1))
        .with_keepalive(keepalive)
        .with_preface_timeout(preface_timeout);
    let address = application.local_addr();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let _directory = directory;
        application
            .run_until(async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
    });
    (address, stop)
}

fn frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
    let length = u32::try_from(payload.len()).unwrap().to_be_bytes();
    let mut bytes = vec![length[1], length[2], length[3], kind, flags, 0, 0, 0, 0];
    bytes.extend_from_slice(payload);
    bytes
}

/// Opens an HTTP/2 connection (preface, SETTINGS, the server's SETTINGS acknowledged) and
/// reads frames for `watch`, answering each PING when `answer_pings`.
async fn watch_connection(address: std::net::SocketAddr, answer_pings: bool, watch: Duration) -> Seen {
    let mut stream = TcpStream::connect(address).await.unwrap();
    stream.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.unwrap();
    stream.write_all(&frame(SETTINGS, 0, &[])).await.unwrap();
    let mut seen = Seen::default();
    let deadline = tokio::time::Instant::now() + watch;
    loop {
        let mut header = [0u8; 9];
        match tokio::time::timeout_at(deadline, stream.read_exact(&mut header)).await {
            Err(_) => return seen,
            Ok(Err(_)) => {
                seen.closed = true;
                return seen;
            }
            Ok(Ok(_)) => {}
        }
        let length = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
        let (kind, flags) = (header[3], header[4]);
        let mut payload = vec![0u8; length];
        if stream.read_exact(&mut payload).await.is_err() {
            seen.closed = true;
            return seen;
        }
        match kind {
            SETTINGS if flags & ACK == 0 => stream.write_all(&frame(SETTINGS, ACK, &[])).await.unwrap(),
            PING if flags & ACK == 0 => {
                seen.pings += 1;
                if answer_pings {
                    let _ = stream.write_all(&frame(PING, ACK, &payload)).await;
                }
            }
            GOAWAY => seen.goaway = true,
            _ => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_stops_answering_pings_is_closed_and_one_that_answers_stays() {
    let keepalive = Keepalive { interval: Duration::from_millis(200), timeout: Duration::from_millis(300) };
    let (address, stop) = server(Some(keepalive)).await;

    let silent = watch_connection(address, false, WAIT_MAX).await;
    assert!(silent.pings >= 1, "the server PINGed the idle connection: {silent:?}");
    assert!(silent.closed, "a connection that answers no PING is closed: {silent:?}");

    // Answered, the PINGs keep coming and the connection stays, over many intervals.
    let answering = watch_connection(address, true, Duration::from_secs(2)).await;
    assert!(answering.pings >= 2, "{answering:?}");
    assert!(!answering.closed && !answering.goaway, "{answering:?}");
    let _ = stop.send(());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_keepalive_the_server_sends_no_ping() {
    let (address, stop) = server(None).await;
    let seen = watch_connection(address, false, Duration::from_secs(1)).await;
    assert_eq!(seen.pings, 0, "{seen:?}");
    assert!(!seen.closed, "{seen:?}");
    let _ = stop.send(());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_connection_without_a_preface_is_closed_after_the_preface_timeout() {
    let preface_timeout = Duration::from_millis(300);
    let (address, stop) = server_with(None, preface_timeout).await;

    for sent in [&b""[..], b"P", b"PRI * HTTP/2.0\r\n\r\n"] {
        let mut stalled = TcpStream::connect(address).await.unwrap();
        stalled.write_all(sent).await.unwrap();
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(WAIT_MAX, stalled.read(&mut byte)).await;
        assert!(
            matches!(read, Ok(Ok(0)) | Ok(Err(_))),
            "the server closed, within {WAIT_MAX:?}, a connection that sent {sent:?} and stalled: {read:?}"
        );
    }

    // One that sent its preface is served past it, with no keepalive to close it either.
    let spoken = watch_connection(address, false, preface_timeout * 5).await;
    assert!(!spoken.closed && !spoken.goaway, "{spoken:?}");

    // An HTTP/1 caller (HTTP/JSON) that sent its request is answered as before.
    let mut http1 = TcpStream::connect(address).await.unwrap();
    http1.write_all(b"GET /v1/nothing-here HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(WAIT_MAX, http1.read_to_end(&mut answer)).await.unwrap().unwrap();
    assert!(answer.starts_with(b"HTTP/1.1 "), "{}", String::from_utf8_lossy(&answer));
    let _ = stop.send(());
}
