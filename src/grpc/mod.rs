//! The gRPC transport: decode a request into a command, run the use case, encode the answer.

mod accounts;
pub mod codec;
mod decode;
mod observe;
mod payments;

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::metadata::MetadataValue;
use tonic::{Response, Status};
use tracing::{Instrument, Span};

pub use accounts::AccountApi;
pub use observe::{code_name, Observe, ACCESS_LOG_TARGET};
pub use payments::PaymentApi;

use crate::auth::{Authenticator, Caller, Denied, Permission};
use crate::domain::MerchantId;
use crate::error::Error;
use crate::ledger::{response, Replayable};
use crate::metrics::{LedgerMetrics, SHED_CONCURRENCY};

/// Response metadata headers: `idempotent-replayed: true` on an answer replayed from an
/// earlier call; `idempotency-expires-at`, until when the call's `idempotency-key` is kept
/// (RFC 3339). Defined once, in the client crate.
pub use payledger_client::{KEY_EXPIRES_HEADER, REPLAYED_HEADER};

/// The guard headers (`idempotency-key`, `idempotency-token`) as they arrived in the request's
/// HTTP/2 HEADERS frame. tonic merges request trailers into the metadata, where a trailer
/// replaces a header of the same name; this record, taken before that (by
/// [`capture_guard_headers`], a layer of the server), lets the decoder refuse a guard sent
/// in trailers instead of silently reading the trailer's value.
#[derive(Debug, Clone, Default)]
pub struct GuardHeaders {
    idempotency_key: Vec<http::HeaderValue>,
    idempotency_token: Vec<http::HeaderValue>,
}

/// The request's path (`/package.Service/Method`), for the log line of a refused call.
#[derive(Debug, Clone)]
struct RpcPath(String);

/// Records the guard headers of `request` in its extensions (see [`GuardHeaders`]), and its
/// path.
pub fn capture_guard_headers<B>(mut request: http::Request<B>) -> http::Request<B> {
    let values = |name: &str| request.headers().get_all(name).iter().cloned().collect();
    let captured = GuardHeaders {
        idempotency_key: values(crate::ledger::IDEMPOTENCY_KEY_HEADER),
        idempotency_token: values(crate::ledger::IDEMPOTENCY_TOKEN_HEADER),
    };
    let path = RpcPath(request.uri().path().to_owned());
    request.extensions_mut().insert(captured);
    request.extensions_mut().insert(path);
    request
}

/// The request header of the caller's credential: `authorization: Bearer <JWT>` (RFC 6750).
pub use payledger_client::AUTHORIZATION_HEADER;

/// Authenticates every call of the services it wraps (PaymentService and AccountService;
/// health and reflection stay open) before its message is decoded, and puts the [`Caller`]
/// in the request's extensions: the verified caller, or [`Caller::anonymous`] on a server
/// without authentication. A refused call is UNAUTHENTICATED and logged with its method and
/// reason, never its credential.
#[derive(Clone)]
pub struct Authentication {
    authenticator: Option<Arc<Authenticator>>,
}

impl Authentication {
    /// `None`: no authentication (every call runs as [`Caller::anonymous`]).
    pub fn new(authenticator: Option<Arc<Authenticator>>) -> Self {
        Self { authenticator }
    }
}

impl tonic::service::Interceptor for Authentication {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        let caller = match &self.authenticator {
            None => Caller::anonymous(),
            Some(authenticator) => {
                let mut values = request.metadata().get_all(AUTHORIZATION_HEADER).iter();
                let credential = match (values.next(), values.next()) {
                    (Some(value), None) => authenticator.authenticate(Some(value.as_bytes())),
                    (None, _) => authenticator.authenticate(None),
                    // Two credentials: which one would count?
                    (Some(_), Some(_)) => Err(crate::auth::Unauthenticated::Invalid),
                };
                match credential {
                    Ok(caller) => caller,
                    Err(failure) => {
                        // The method's name, as the other refusals log it (`Pay`, not the path).
                        let path = request.extensions().get::<RpcPath>().map_or("", |path| path.0.as_str());
                        let method = path.rsplit('/').next().unwrap_or(path);
                        tracing::info!(method, reason = failure.reason(), "call refused: unauthenticated");
                        return Err(Error::from(failure).into());
                    }
                }
            }
        };
        observe::record_caller(caller.subject());
        request.extensions_mut().insert(caller);
        Ok(request)
    }
}

/// A refused call's status, logged with the caller's `sub`, the method and the reason.
fn denied(caller: &Caller, method: &'static str, denied: Denied) -> Status {
    tracing::info!(sub = caller.subject(), method, reason = denied.reason(), %denied, "call refused: permission denied");
    Error::from(denied).into()
}

/// The caller of `request`, once it is known to hold `permission`; checked before anything
/// is decoded, read or written.
fn permitted<T>(request: &tonic::Request<T>, method: &'static str, permission: Permission) -> Result<Caller, Status> {
    let caller = request
        .extensions()
        .get::<Caller>()
        .cloned()
        .ok_or_else(|| Status::from(Error::Internal("a call reached its handler unauthenticated".into())))?;
    caller.require(permission).map_err(|refusal| denied(&caller, method, refusal))?;
    Ok(caller)
}

/// Refuses a caller that may not act for `merchant_id`, before anything is read or written.
fn for_merchant(caller: &Caller, method: &'static str, merchant_id: &MerchantId) -> Result<(), Status> {
    observe::record_merchant(merchant_id.as_str());
    caller.require_merchant(merchant_id).map_err(|refusal| denied(caller, method, refusal))
}

/// The concurrency limit of the ledger's use cases (`--max-concurrent-calls`). A call takes
/// its permit once its message is decoded and its caller checked, before anything is read or
/// written, and its use case's task holds it until it commits or rolls back, whether or not
/// the caller still waits: so the limit bounds the work in flight, and neither a caller slow
/// to send its message nor one that cancels can make it count less than the work.
#[derive(Clone, Default)]
pub struct Admission {
    limit: Option<Arc<Semaphore>>,
    metrics: LedgerMetrics,
}

impl Admission {
    /// At most `limit` use cases at once (`None`: no limit); refusals are counted in
    /// `metrics`.
    pub fn new(limit: Option<usize>, metrics: LedgerMetrics) -> Self {
        Self { limit: limit.map(|limit| Arc::new(Semaphore::new(limit.max(1)))), metrics }
    }

    /// A permit, or RESOURCE_EXHAUSTED (OVERLOADED, `bound` = `concurrency_limit`).
    fn admit(&self) -> Result<Option<OwnedSemaphorePermit>, Status> {
        let Some(limit) = &self.limit else { return Ok(None) };
        limit.clone().try_acquire_owned().map(Some).map_err(|_| {
            self.metrics.shed(SHED_CONCURRENCY);
            Error::Overloaded(SHED_CONCURRENCY).into()
        })
    }
}

/// Runs a use case on its own task, so that a client that cancels or whose deadline passes
/// (tonic then drops the handler future) cannot cut a transaction in half: the task runs to
/// commit or rollback whatever happens to the call, and its connection returns to the pool
/// clean. The task holds the call's [`Admission`] permit until then.
async fn run_detached<T, F>(admission: &Admission, span: Span, use_case: F) -> Result<T, Status>
where
    T: Send + 'static,
    F: Future<Output = Result<T, Error>> + Send + 'static,
{
    let permit = admission.admit()?;
    let task = tokio::spawn(
        async move {
            let _permit = permit;
            let outcome = use_case.await;
            if let Err(error) = &outcome {
                tracing::info!(%error, "call refused");
            }
            outcome
        }
        .instrument(span),
    );
    match task.await {
        Ok(outcome) => outcome.map_err(Status::from),
        Err(join_error) => Err(Error::Internal(format!("use case task failed: {join_error}")).into()),
    }
}

/// Wraps an answer, marking replays with `idempotent-replayed: true`.
fn reply<T>(message: T, replayed: bool) -> Response<T> {
    let mut response = Response::new(message);
    if replayed {
        response.metadata_mut().insert(REPLAYED_HEADER, MetadataValue::from_static("true"));
    }
    response
}

/// A use case's answer message, with the replay and key-expiry headers.
fn reply_replayable<M>(answer: Replayable<M>) -> Response<M> {
    let mut response = reply(answer.value, answer.replayed);
    if let Some(expires_at) = answer.key_expires_at {
        let text = response::timestamp(expires_at).map(|timestamp| timestamp.to_string()).unwrap_or_default();
        if let Ok(value) = MetadataValue::try_from(text) {
            response.metadata_mut().insert(KEY_EXPIRES_HEADER, value);
        }
    }
    response
}
