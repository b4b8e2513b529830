//! [`Connections`]: several HTTP/2 connections to one payledger endpoint, used in turn, so that
//! a connection that goes silent (a black hole: a dead NAT entry, a peer that stopped reading)
//! holds up only the calls sent on it, and is replaced as soon as one of its attempts outlives
//! its deadline, rather than when TCP or keepalive notice.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
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

/// One connection and how many times its slot was refilled.
struct Slot {
    generation: u64,
    channel: Channel,
}

/// Several lazily connected channels to one endpoint, as one tower service of HTTP requests.
/// Calls go to the channels in turn. When an attempt on a channel is abandoned at or after the
/// deadline its `grpc-timeout` header gave (the retry layer's per-attempt timer fired, before
/// or after the answer's headers), that channel is dropped from its slot and a new one, to a
/// new connection, takes its place; calls still in flight on the old one finish or time out on
/// their own. A connection that breaks outright needs nothing of this: its channel reconnects.
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
        let slots = (0..count.clamp(1, CONNECTIONS_MAX))
            .map(|_| Mutex::new(Slot { generation: 0, channel: endpoint.connect_lazy() }));
        Self { slots: Arc::new(slots.collect()), endpoint: Some(endpoint), next: Arc::new(AtomicUsize::new(0)) }
    }

    /// One given channel (its own connections, balancing and reconnection), never replaced.
    pub fn from_channel(channel: Channel) -> Self {
        let slot = Mutex::new(Slot { generation: 0, channel });
        Self { slots: Arc::new(vec![slot]), endpoint: None, next: Arc::new(AtomicUsize::new(0)) }
    }

    /// How many times connections were replaced after an attempt timed out on them.
    pub fn replaced(&self) -> u64 {
        self.slots.iter().map(|slot| lock(slot).generation).sum()
    }

    /// Replaces the channel of `slot` if it is still the one of `generation`.
    fn replace(&self, slot: usize, generation: u64) {
        let Some(endpoint) = &self.endpoint else { return };
        let mut slot = lock(&self.slots[slot]);
        if slot.generation == generation {
            slot.generation += 1;
            slot.channel = endpoint.connect_lazy();
        }
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
        let (generation, channel) = {
            let slot = lock(&self.slots[slot]);
            (slot.generation, slot.channel.clone())
        };
        let deadline = request.headers().get(GRPC_TIMEOUT_HEADER).and_then(parse_grpc_timeout);
        let mut watch = Watch {
            connections: self.clone(),
            slot,
            generation,
            timed_out_at: deadline.map(|deadline| Instant::now() + deadline.saturating_sub(TIMED_OUT_SLACK)),
            finished: false,
        };
        Box::pin(async move {
            match channel.oneshot(request).await {
                Ok(response) => {
                    // A trailers-only answer is whole with its headers.
                    watch.finished = response.headers().contains_key("grpc-status");
                    Ok(response.map(|body| Body::new(Watched { body, watch })))
                }
                // A connection broken before the deadline: its channel reconnects by itself.
                // At the deadline, the channel's own timer (tonic's `TimeoutExpired`) may have
                // ended the attempt: `watch` replaces the connection as for the retry layer's.
                Err(error) => {
                    drop(watch);
                    Err(error.into())
                }
            }
        })
    }
}

/// Follows one attempt to the end of its answer; abandoned at or past its deadline, it
/// replaces the attempt's connection.
struct Watch {
    connections: Connections,
    slot: usize,
    generation: u64,
    timed_out_at: Option<Instant>,
    finished: bool,
}

impl Drop for Watch {
    fn drop(&mut self) {
        if !self.finished && self.timed_out_at.is_some_and(|at| Instant::now() >= at) {
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
            Poll::Ready(Some(Ok(frame))) => frame.is_trailers(),
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
