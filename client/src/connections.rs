//! [`Connections`]: several HTTP/2 connections to one payledger endpoint, used in turn, so that
//! a connection that goes silent (a black hole: a dead NAT entry, a peer that stopped reading)
//! holds up only the calls sent on it, and is replaced as soon as one of its attempts times out
//! with nothing heard on it, rather than when TCP or keepalive notice.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tonic::body::Body;
use tonic::transport::{Channel, Endpoint};
use tower::{Service, ServiceExt};

use crate::retry::{parse_grpc_timeout, GRPC_TIMEOUT_HEADER};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Connections a [`crate::PayledgerClient`] opens to its endpoint by default.
pub const CONNECTIONS_DEFAULT: usize = 2;
/// The most connections one client opens.
pub const CONNECTIONS_MAX: usize = 16;

/// An attempt abandoned this close to its `grpc-timeout` (or later) counts as timed out.
const TIMED_OUT_SLACK: Duration = Duration::from_millis(5);
/// An attempt given less time than this says nothing about its connection when it times out.
const TIMED_OUT_BUDGET_MIN: Duration = Duration::from_millis(100);

/// Microseconds since the first use of this module's clock (monotonic).
fn now_micros() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    u64::try_from(START.get_or_init(Instant::now).elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// One connection: its channel, how many times its slot was refilled, and when anything of an
/// answer last arrived on it ([`now_micros`]).
struct Slot {
    generation: u64,
    channel: Channel,
    heard_at: Arc<AtomicU64>,
}

impl Slot {
    fn new(generation: u64, channel: Channel) -> Self {
        Self { generation, channel, heard_at: Arc::new(AtomicU64::new(now_micros())) }
    }
}

/// Several lazily connected channels to one endpoint, as one tower service of HTTP requests.
/// Calls go to the channels in turn. A channel is dropped from its slot, and a new one, to a
/// new connection, takes its place, when an attempt on it was abandoned at the deadline its
/// `grpc-timeout` header gave (the retry layer's per-attempt timer, or the channel's own,
/// fired before the answer ended), that deadline was at least 100 ms, and nothing of any answer
/// arrived on the connection since the attempt was sent: a silent connection, not a slow
/// server. Calls still in flight on the old channel finish or time out on their own. A
/// connection that breaks outright needs nothing of this: its channel reconnects.
#[derive(Clone)]
pub struct Connections {
    /// Where a replacement connects; `None`: a given channel, never replaced.
    endpoint: Option<Endpoint>,
    slots: Arc<Vec<Mutex<Slot>>>,
    next: Arc<AtomicUsize>,
}

impl std::fmt::Debug for Connections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connections")
            .field("uri", &self.endpoint.as_ref().map(Endpoint::uri))
            .field("count", &self.slots.len())
            .finish()
    }
}

impl Connections {
    /// `count` connections (1 to [`CONNECTIONS_MAX`]; outside, clamped) to `endpoint`, each
    /// opened on its first call.
    pub fn new(endpoint: Endpoint, count: usize) -> Self {
        let slots = (0..count.clamp(1, CONNECTIONS_MAX)).map(|_| Mutex::new(Slot::new(0, endpoint.connect_lazy())));
        Self { slots: Arc::new(slots.collect()), endpoint: Some(endpoint), next: Arc::new(AtomicUsize::new(0)) }
    }

    /// One given channel (its own connections, balancing and reconnection), never replaced.
    pub fn from_channel(channel: Channel) -> Self {
        let slot = Mutex::new(Slot::new(0, channel));
        Self { slots: Arc::new(vec![slot]), endpoint: None, next: Arc::new(AtomicUsize::new(0)) }
    }

    /// How many times connections were replaced after an attempt timed out on them.
    pub fn replaced(&self) -> u64 {
        self.slots.iter().map(|slot| lock(slot).generation).sum()
    }

    /// Replaces the channel of `slot` if it is still the one of `generation`. The new channel
    /// is made, and the old one dropped, outside the lock; outside a Tokio runtime (a body
    /// dropped after it shut down) nothing is replaced.
    fn replace(&self, slot: usize, generation: u64) {
        let Some(endpoint) = &self.endpoint else { return };
        if tokio::runtime::Handle::try_current().is_err() || lock(&self.slots[slot]).generation != generation {
            return;
        }
        let fresh = Slot::new(generation + 1, endpoint.connect_lazy());
        let old = {
            let mut current = lock(&self.slots[slot]);
            if current.generation != generation {
                return;
            }
            std::mem::replace(&mut *current, fresh)
        };
        drop(old);
    }
}

fn lock(slot: &Mutex<Slot>) -> std::sync::MutexGuard<'_, Slot> {
    slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Service<http::Request<Body>> for Connections {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    /// Always ready: each call waits for its own channel's readiness.
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let slot = self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len();
        let (generation, channel, heard_at) = {
            let slot = lock(&self.slots[slot]);
            (slot.generation, slot.channel.clone(), slot.heard_at.clone())
        };
        let budget = request.headers().get(GRPC_TIMEOUT_HEADER).and_then(parse_grpc_timeout);
        let sent_at = now_micros();
        let mut watch = Watch {
            connections: self.clone(),
            slot,
            generation,
            heard_at,
            sent_at,
            timed_out_at: budget
                .filter(|budget| *budget >= TIMED_OUT_BUDGET_MIN)
                .map(|budget| Instant::now() + budget - TIMED_OUT_SLACK),
            finished: false,
        };
        Box::pin(async move {
            match channel.oneshot(request).await {
                Ok(response) => {
                    watch.heard();
                    // A trailers-only answer is whole with its headers, and so is one whose
                    // body is empty.
                    watch.finished = response.headers().contains_key("grpc-status")
                        || http_body::Body::is_end_stream(response.body());
                    Ok(response.map(|body| Body::new(Watched { body, watch })))
                }
                // A connection broken before the deadline: its channel reconnects by itself.
                // At the deadline, the channel's own timer (tonic's `TimeoutExpired`) may have
                // ended the attempt: `watch` judges it as one the retry layer's timer ended.
                Err(error) => {
                    drop(watch);
                    Err(error.into())
                }
            }
        })
    }
}

/// Follows one attempt to the end of its answer. Abandoned at its deadline with nothing heard
/// on its connection since it was sent, it replaces the connection.
struct Watch {
    connections: Connections,
    slot: usize,
    generation: u64,
    /// When anything of an answer last arrived on the attempt's connection.
    heard_at: Arc<AtomicU64>,
    sent_at: u64,
    /// `None`: the attempt's budget was too short (or unknown) to judge its connection by.
    timed_out_at: Option<Instant>,
    finished: bool,
}

impl Watch {
    /// Something of this attempt's answer arrived: its connection is alive.
    fn heard(&self) {
        self.heard_at.fetch_max(now_micros(), Ordering::Relaxed);
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let timed_out = self.timed_out_at.is_some_and(|at| Instant::now() >= at);
        let silent = self.heard_at.load(Ordering::Relaxed) <= self.sent_at;
        if !self.finished && timed_out && silent {
            self.connections.replace(self.slot, self.generation);
        }
    }
}

/// An answer's body, with the [`Watch`] of its attempt.
struct Watched {
    body: Body,
    watch: Watch,
}

impl http_body::Body for Watched {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        let frame = Pin::new(&mut this.body).poll_frame(context);
        let last = match &frame {
            Poll::Ready(Some(Ok(frame))) => {
                this.watch.heard();
                frame.is_trailers()
            }
            Poll::Ready(None | Some(Err(_))) => true,
            Poll::Pending => false,
        };
        if last {
            this.watch.finished = true;
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
