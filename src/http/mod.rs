//! HTTP/JSON for every RPC: each RPC's `google.api.http` annotation in the proto names its
//! method and path; the JSON body is the request message in the proto3 JSON mapping; the call
//! then runs in process as the gRPC call it stands for, through the same layers
//! (authentication, idempotency, limits, observation), and its answer, or its
//! `google.rpc.Status`, is turned back into JSON. What a caller sends and gets (paths, bodies,
//! headers, statuses, bounds) is docs/http.md; this module is how: the template router
//! (`Template`, `Gateway::route`), the body's checks (`Route::message`, `Unambiguous`,
//! `is_plain_json`), the call ([`Gateway::handle`]) and the refusal's answer
//! (`Gateway::refusal`), and the OpenAPI document (`openapi`).

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use http_body_util::{BodyExt as _, Limited};
use prost_reflect::{
    DescriptorPool, DeserializeOptions, DynamicMessage, FieldDescriptor, Kind, MessageDescriptor, SerializeOptions,
    Value,
};
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt as _};
use tower::util::BoxCloneSyncService;
use tower::ServiceExt as _;

use crate::error::ERROR_DOMAIN;

mod openapi;
pub use openapi::OPENAPI_PATH;

/// The largest request body accepted, in bytes: the gRPC listener's message bound. A larger
/// body is answered 413 (OUT_OF_RANGE, `REQUEST_TOO_LARGE`) before it is parsed.
pub const BODY_BYTES_MAX: usize = 64 * 1024;

/// The longest a request body may take to arrive once its headers have (a slow or stalled
/// sender): 10 s, then 504 (DEADLINE_EXCEEDED, `REQUEST_BODY_TIMEOUT`) and the connection is
/// free of it.
pub const BODY_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The gRPC services the gateway calls in process: the server's whole gRPC stack.
pub type GrpcService =
    BoxCloneSyncService<http::Request<tonic::body::Body>, http::Response<tonic::body::Body>, Infallible>;

/// Request headers passed on to the gRPC call as its metadata (every value of each).
const FORWARDED_HEADERS: [&str; 6] =
    ["authorization", "idempotency-key", "idempotency-token", "grpc-timeout", "traceparent", "tracestate"];

/// Response metadata passed back as HTTP response headers.
const ANSWERED_HEADERS: [&str; 2] = [payledger_client::REPLAYED_HEADER, payledger_client::KEY_EXPIRES_HEADER];

/// Why the rules of the proto cannot be served.
#[derive(Debug, thiserror::Error)]
#[error("the google.api.http rule of {method} cannot be served: {reason}")]
pub struct RuleError {
    method: String,
    reason: String,
}

/// A path's variables: (field, percent-decoded value), in path order.
type Variables = Vec<(String, String)>;

/// One segment of a path template.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    /// A top-level string field of the request message.
    Field(String),
}

/// A path template: `/v1/merchants/{merchant_id}/orders/{order_no}:pay`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Template {
    segments: Vec<Segment>,
    verb: Option<String>,
}

impl Template {
    /// Parses the subset of the HTTP rule grammar described in the module docs.
    fn parse(text: &str) -> Result<Self, String> {
        let rest = text.strip_prefix('/').ok_or("a path must start with /")?;
        let (path, verb) = match rest.rsplit_once('/') {
            Some((head, last)) => match last.split_once(':') {
                Some((segment, verb)) if !last.starts_with('{') || segment.ends_with('}') => {
                    (format!("{head}/{segment}"), Some(verb.to_owned()))
                }
                _ => (rest.to_owned(), None),
            },
            None => match rest.split_once(':') {
                Some((segment, verb)) => (segment.to_owned(), Some(verb.to_owned())),
                None => (rest.to_owned(), None),
            },
        };
        let literal =
            |text: &str| !text.is_empty() && text.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if verb.as_deref().is_some_and(|verb| !literal(verb)) {
            return Err(format!("the verb of {text} is not a plain literal"));
        }
        let segments = path
            .split('/')
            .map(|segment| match segment.strip_prefix('{').and_then(|inner| inner.strip_suffix('}')) {
                Some(field) if literal(field) && !field.contains('.') => Ok(Segment::Field(field.to_owned())),
                Some(_) => Err(format!("{text}: only {{field}} variables of a top-level field are supported")),
                None if literal(segment) => Ok(Segment::Literal(segment.to_owned())),
                None => Err(format!("{text}: the segment {segment:?} is not supported")),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { segments, verb })
    }

    /// The variables of `path` (percent-decoded), when it matches.
    fn matches(&self, path: &str) -> Option<Result<Variables, String>> {
        let path = path.strip_prefix('/')?;
        let path = match &self.verb {
            Some(verb) => path.strip_suffix(verb.as_str())?.strip_suffix(':')?,
            None => path,
        };
        let parts: Vec<&str> = path.split('/').collect();
        if parts.len() != self.segments.len() {
            return None;
        }
        let mut variables = Vec::new();
        for (segment, part) in self.segments.iter().zip(parts) {
            match segment {
                Segment::Literal(literal) if literal == part => {}
                Segment::Literal(_) => return None,
                Segment::Field(_) if part.is_empty() => return None,
                Segment::Field(field) => match percent_encoding::percent_decode_str(part).decode_utf8() {
                    Ok(value) => variables.push((field.clone(), value.into_owned())),
                    Err(_) => return Some(Err(format!("the path segment of {field} is not UTF-8"))),
                },
            }
        }
        Some(Ok(variables))
    }
}

/// One HTTP binding of an RPC.
#[derive(Debug, Clone)]
struct Route {
    method: Method,
    template: Template,
    /// `body: "*"`: the request message is the JSON body; else it has no body.
    whole_body: bool,
    /// `/payledger.v1.PaymentService/Pay`.
    grpc_path: String,
    input: MessageDescriptor,
    output: MessageDescriptor,
    /// The RPC, for the OpenAPI document's descriptions.
    rpc: prost_reflect::MethodDescriptor,
}

/// Serves the HTTP/JSON API by calling the gRPC services in process.
#[derive(Clone)]
pub struct Gateway {
    routes: Arc<Vec<Route>>,
    grpc: GrpcService,
    status: MessageDescriptor,
    /// The OpenAPI document, served at [`OPENAPI_PATH`].
    openapi: Bytes,
}

impl Gateway {
    /// The routes of every RPC annotated in `descriptors` (an encoded FileDescriptorSet of the
    /// API and its imports) that calls `grpc`.
    ///
    /// # Errors
    /// [`RuleError`] when a rule is outside the supported subset (see the module docs).
    pub fn new(descriptors: &[u8], grpc: GrpcService) -> Result<Self, RuleError> {
        let (routes, status) = routes(descriptors)?;
        let openapi = Bytes::from(openapi_text(&routes));
        Ok(Self { routes: Arc::new(routes), grpc, status, openapi })
    }

    /// The bindings served, as `POST /v1/...` (the tests check that every RPC has one).
    #[cfg(test)]
    fn bindings(&self) -> Vec<String> {
        self.routes.iter().map(|route| format!("{} {}", route.method, route.template_text())).collect()
    }

    /// Answers one HTTP request.
    pub async fn handle(&self, request: http::Request<axum::body::Body>) -> http::Response<axum::body::Body> {
        match self.call(request).await {
            Ok(response) => response,
            Err(status) => self.refusal(&status),
        }
    }

    async fn call(&self, request: http::Request<axum::body::Body>) -> Result<http::Response<axum::body::Body>, Status> {
        let (parts, body) = request.into_parts();
        if parts.uri.path() == OPENAPI_PATH && parts.method == Method::GET {
            let mut response = http::Response::new(axum::body::Body::from(self.openapi.clone()));
            response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
            return Ok(response);
        }
        let (route, variables) = self.route(&parts.method, parts.uri.path())?;
        let declared =
            parts.headers.get(header::CONTENT_LENGTH).and_then(|value| value.to_str().ok()?.parse::<u64>().ok());
        if declared.is_some_and(|length| length > BODY_BYTES_MAX as u64) {
            return Err(too_large());
        }
        let collected = match tokio::time::timeout(BODY_READ_TIMEOUT, Limited::new(body, BODY_BYTES_MAX).collect())
            .await
        {
            Err(_) => {
                return Err(refuse(
                    Code::DeadlineExceeded,
                    "REQUEST_BODY_TIMEOUT",
                    "the request body did not arrive in time",
                ))
            }
            Ok(Ok(collected)) => collected,
            Ok(Err(error)) if error.is::<http_body_util::LengthLimitError>() => return Err(too_large()),
            Ok(Err(_)) => {
                return Err(refuse(Code::InvalidArgument, "MALFORMED_REQUEST", "the request body could not be read"))
            }
        };
        if collected.trailers().is_some_and(|trailers| !trailers.is_empty()) {
            return Err(refuse(
                Code::InvalidArgument,
                "MALFORMED_REQUEST",
                "request trailers are not accepted: send every header before the body",
            ));
        }
        let body = collected.to_bytes();
        let (mut message, named) = route.message(&parts.headers, &body)?;
        route.apply_query(&mut message, parts.uri.query().unwrap_or(""))?;
        route.apply_path(&mut message, variables, &named)?;

        let encoded = prost::Message::encode_to_vec(&message);
        let mut frame = BytesMut::with_capacity(5 + encoded.len());
        frame.put_u8(0);
        frame.put_u32(u32::try_from(encoded.len()).map_err(|_| too_large())?);
        frame.put_slice(&encoded);
        let mut inner = http::Request::new(tonic::body::Body::new(http_body_util::Full::new(frame.freeze())));
        *inner.method_mut() = Method::POST;
        *inner.version_mut() = http::Version::HTTP_2;
        *inner.uri_mut() = route.grpc_path.parse().map_err(|_| refuse(Code::Internal, "INTERNAL", "internal error"))?;
        *inner.extensions_mut() = parts.extensions.clone();
        let headers = inner.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
        for name in FORWARDED_HEADERS {
            for value in parts.headers.get_all(name) {
                headers.append(name, value.clone());
            }
        }

        let Ok(response) = self.grpc.clone().oneshot(inner).await;
        let (answer, body) = response.into_parts();
        if let Some(status) = status_of(&answer.headers) {
            return Err(status);
        }
        let collected = body.collect().await?;
        if let Some(status) = collected.trailers().and_then(status_of) {
            return Err(status);
        }
        let bytes = collected.to_bytes();
        let message = bytes
            .get(5..)
            .filter(|_| bytes.first() == Some(&0))
            .and_then(|encoded| DynamicMessage::decode(route.output.clone(), encoded).ok())
            .ok_or_else(|| refuse(Code::Internal, "INTERNAL", "internal error"))?;
        let mut response = json_response(StatusCode::OK, &message);
        for name in ANSWERED_HEADERS {
            if let Some(value) = answer.headers.get(name) {
                response.headers_mut().insert(name, value.clone());
            }
        }
        Ok(response)
    }

    /// The route of `method` and `path`, and its variables; NOT_FOUND (404) when no rule has
    /// the path, 405 when none has it with this method.
    fn route(&self, method: &Method, path: &str) -> Result<(&Route, Variables), Status> {
        // A path a custom method's template (`...:pay`) matches is that method's, even where a
        // template without a verb would also take it with the verb as part of its last
        // variable (GET /v1/accounts/a:deposit): ids that end in `:<verb>` are sent with the
        // colon percent-encoded (`a%3Adeposit`).
        let matching: Vec<(&Route, Result<Variables, String>)> =
            self.routes.iter().filter_map(|route| route.template.matches(path).map(|found| (route, found))).collect();
        let custom = matching.iter().any(|(route, _)| route.template.verb.is_some());
        let candidates: Vec<_> =
            matching.into_iter().filter(|(route, _)| !custom || route.template.verb.is_some()).collect();
        if candidates.is_empty() {
            return Err(refuse(
                Code::NotFound,
                "ROUTE_NOT_FOUND",
                "no RPC is served at this path (docs/http.md lists them)",
            ));
        }
        let allowed: Vec<String> = candidates.iter().map(|(route, _)| route.method.to_string()).collect();
        match candidates.into_iter().find(|(route, _)| route.method == *method) {
            Some((route, Ok(variables))) => Ok((route, variables)),
            Some((_, Err(reason))) => Err(refuse(Code::InvalidArgument, "MALFORMED_REQUEST", &reason)),
            None => {
                let mut status =
                    refuse(Code::Unimplemented, "METHOD_NOT_ALLOWED", "this path does not take this method");
                if let Ok(value) = allowed.join(", ").parse() {
                    status.metadata_mut().insert("allow", value);
                }
                Err(status)
            }
        }
    }

    /// The JSON answer of a refused call.
    fn refusal(&self, status: &Status) -> http::Response<axum::body::Body> {
        let details = status.get_error_details();
        let reason = details.error_info().map(|info| info.reason.as_str()).unwrap_or_default();
        // Beyond the standard mapping: the Idempotency-Key draft's 422, and the gateway's own.
        let code = match reason {
            "IDEMPOTENCY_KEY_REUSED" | "TOKEN_REUSED" => StatusCode::UNPROCESSABLE_ENTITY,
            "METHOD_NOT_ALLOWED" => StatusCode::METHOD_NOT_ALLOWED,
            "REQUEST_TOO_LARGE" => StatusCode::PAYLOAD_TOO_LARGE,
            "REQUEST_BODY_TIMEOUT" => StatusCode::REQUEST_TIMEOUT,
            "UNSUPPORTED_MEDIA_TYPE" => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            _ => http_status(status.code()),
        };
        // The details as sent (google.rpc.Status), with the status's own code and message.
        let mut body = DynamicMessage::decode(self.status.clone(), status.details())
            .unwrap_or_else(|_| DynamicMessage::new(self.status.clone()));
        body.set_field_by_name("code", Value::I32(status.code() as i32));
        body.set_field_by_name("message", Value::String(status.message().to_owned()));
        let mut response = json_response(code, &body);
        let headers = response.headers_mut();
        if let Some(delay) = details.retry_info().and_then(|info| info.retry_delay) {
            let seconds = delay.as_secs() + u64::from(delay.subsec_nanos() > 0);
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds.max(1)));
        }
        if status.code() == Code::Unauthenticated {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let Some(allow) = status.metadata().get("allow").and_then(|value| value.to_str().ok()) {
            if let Ok(value) = HeaderValue::from_str(allow) {
                headers.insert(header::ALLOW, value);
            }
        }
        response
    }
}

/// The routes of every RPC annotated in `descriptors`, and google.rpc.Status's descriptor.
fn routes(descriptors: &[u8]) -> Result<(Vec<Route>, MessageDescriptor), RuleError> {
    let error = |method: &str, reason: String| RuleError { method: method.to_owned(), reason };
    let mut pool = DescriptorPool::decode(descriptors).map_err(|e| error("the API", e.to_string()))?;
    pool.decode_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)
        .map_err(|e| error("google.rpc", e.to_string()))?;
    let http = pool
        .get_extension_by_name("google.api.http")
        .ok_or_else(|| error("the API", "google.api.http is not among its imports".into()))?;
    let status = pool
        .get_message_by_name("google.rpc.Status")
        .ok_or_else(|| error("google.rpc", "no google.rpc.Status".into()))?;
    let mut routes = Vec::new();
    for service in pool.services() {
        for method in service.methods() {
            let options = method.options();
            if !options.has_extension(&http) {
                continue;
            }
            let rule = options.get_extension(&http);
            let Some(rule) = rule.as_message() else { continue };
            let name = method.full_name().to_owned();
            let mut bindings = vec![rule.clone()];
            if let Some(Value::List(more)) = rule.get_field_by_name("additional_bindings").as_deref() {
                bindings.extend(more.iter().filter_map(Value::as_message).cloned());
            }
            for binding in bindings {
                routes.push(Route::from_rule(&binding, &method).map_err(|reason| error(&name, reason))?);
            }
        }
    }
    Ok((routes, status))
}

fn openapi_text(routes: &[Route]) -> String {
    let mut text = serde_json::to_string_pretty(&openapi::document(routes)).unwrap_or_default();
    text.push('\n');
    text
}

/// The OpenAPI document of the API described by `descriptors` (what the server serves at
/// [`OPENAPI_PATH`]; `payledger openapi` prints it).
///
/// # Errors
/// [`RuleError`] when a rule is outside the supported subset.
pub fn openapi_document(descriptors: &[u8]) -> Result<String, RuleError> {
    Ok(openapi_text(&routes(descriptors)?.0))
}

impl Route {
    fn from_rule(rule: &DynamicMessage, method: &prost_reflect::MethodDescriptor) -> Result<Self, String> {
        let text = |name: &str| match rule.get_field_by_name(name).as_deref() {
            Some(Value::String(text)) if !text.is_empty() => Some(text.clone()),
            _ => None,
        };
        let (verb, path) = [
            ("get", Method::GET),
            ("post", Method::POST),
            ("put", Method::PUT),
            ("delete", Method::DELETE),
            ("patch", Method::PATCH),
        ]
        .into_iter()
        .find_map(|(name, verb)| text(name).map(|path| (verb, path)))
        .ok_or("the rule has no get, post, put, delete or patch path")?;
        let template = Template::parse(&path)?;
        let input = method.input();
        for segment in &template.segments {
            if let Segment::Field(field) = segment {
                let descriptor =
                    input.get_field_by_name(field).ok_or(format!("{path}: {field} is not a field of the request"))?;
                if descriptor.kind() != Kind::String || descriptor.is_list() {
                    return Err(format!("{path}: {field} is not a string field"));
                }
            }
        }
        let whole_body = match text("body").as_deref() {
            None => false,
            Some("*") => true,
            Some(other) => return Err(format!("body {other:?}: only \"*\" or none is supported")),
        };
        Ok(Self {
            method: verb,
            template,
            whole_body,
            grpc_path: format!("/{}/{}", method.parent_service().full_name(), method.name()),
            input,
            output: method.output(),
            rpc: method.clone(),
        })
    }

    fn template_text(&self) -> String {
        let mut text = String::new();
        for segment in &self.template.segments {
            match segment {
                Segment::Literal(literal) => text.push_str(&format!("/{literal}")),
                Segment::Field(field) => text.push_str(&format!("/{{{field}}}")),
            }
        }
        if let Some(verb) = &self.template.verb {
            text.push_str(&format!(":{verb}"));
        }
        text
    }

    /// The request message of the body (an empty one without a body), and the members its
    /// JSON object names (as [`field_key`]s).
    fn message(&self, headers: &HeaderMap, body: &Bytes) -> Result<(DynamicMessage, HashSet<String>), Status> {
        if !self.whole_body {
            if !body.is_empty() {
                return Err(refuse(Code::InvalidArgument, "MALFORMED_REQUEST", "this method takes no request body"));
            }
            return Ok((DynamicMessage::new(self.input.clone()), HashSet::new()));
        }
        if !is_plain_json(headers) {
            return Err(refuse(
                Code::InvalidArgument,
                "UNSUPPORTED_MEDIA_TYPE",
                "the request body must be application/json (UTF-8, one Content-Type, no Content-Encoding)",
            ));
        }
        // No body at all is an empty message; anything else must be one JSON object
        // (whitespace alone is not a JSON text, RFC 8259 section 2).
        if body.is_empty() {
            return Ok((DynamicMessage::new(self.input.clone()), HashSet::new()));
        }
        let named = match serde_json::from_slice::<Unambiguous>(body) {
            Ok(Unambiguous(named)) => named,
            Err(error) => {
                let message = format!("the request body is not a JSON {}: {error}", self.input.name());
                return Err(refuse(Code::InvalidArgument, "MALFORMED_REQUEST", &message));
            }
        };
        let mut json = serde_json::Deserializer::from_slice(body);
        let message =
            DynamicMessage::deserialize_with_options(self.input.clone(), &mut json, &DeserializeOptions::new())
                .and_then(|message| json.end().map(|()| message))
                .map_err(|error| {
                    let message = format!("the request body is not a JSON {}: {error}", self.input.name());
                    refuse(Code::InvalidArgument, "MALFORMED_REQUEST", &message)
                })?;
        Ok((message, named))
    }

    /// Sets the top-level scalar fields named in the query string (rules without a body).
    fn apply_query(&self, message: &mut DynamicMessage, query: &str) -> Result<(), Status> {
        let mut seen = HashMap::new();
        for (name, value) in form_urlencoded::parse(query.as_bytes()) {
            let field = self
                .input
                .get_field_by_name(&name)
                .or_else(|| self.input.get_field_by_json_name(&name))
                .filter(|field| !self.whole_body && self.is_query_field(field));
            let Some(field) = field else {
                return Err(bad_request(&name, "is not a query parameter of this method"));
            };
            if seen.insert(field.name().to_owned(), ()).is_some() {
                return Err(bad_request(&name, "is given more than once"));
            }
            let parsed = match field.kind() {
                Kind::String => Some(Value::String(value.into_owned())),
                Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => value.parse().ok().map(Value::I32),
                Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => value.parse().ok().map(Value::I64),
                Kind::Uint32 | Kind::Fixed32 => value.parse().ok().map(Value::U32),
                Kind::Uint64 | Kind::Fixed64 => value.parse().ok().map(Value::U64),
                Kind::Bool => value.parse().ok().map(Value::Bool),
                _ => None,
            };
            let Some(parsed) = parsed else {
                return Err(bad_request(&name, "is not a valid value of its type"));
            };
            message.set_field(&field, parsed);
        }
        Ok(())
    }

    /// A field the query string may set: a top-level scalar outside any oneof and the path.
    fn is_query_field(&self, field: &FieldDescriptor) -> bool {
        let in_path = self
            .template
            .segments
            .iter()
            .any(|segment| matches!(segment, Segment::Field(name) if name == field.name()));
        !in_path
            && !field.is_list()
            && !field.is_map()
            && field.containing_oneof().is_none()
            && !matches!(field.kind(), Kind::Message(_))
    }

    /// Sets the path's variables. A body that names one of them (`named`, in either spelling,
    /// even as `""` or `null`) must give it the path's value.
    fn apply_path(
        &self,
        message: &mut DynamicMessage,
        variables: Variables,
        named: &HashSet<String>,
    ) -> Result<(), Status> {
        for (name, value) in variables {
            if named.contains(&field_key(&name)) {
                let same = matches!(message.get_field_by_name(&name).as_deref(), Some(Value::String(given)) if *given == value);
                if !same {
                    return Err(bad_request(&name, "differs between the path and the body"));
                }
            }
            message.set_field_by_name(&name, Value::String(value));
        }
        Ok(())
    }
}

/// A JSON member name as the field it names, whichever spelling the proto3 JSON mapping lets
/// a caller use (`out_trade_no`, `outTradeNo`): lowercase, without underscores.
fn field_key(name: &str) -> String {
    name.chars().filter(|c| *c != '_').map(|c| c.to_ascii_lowercase()).collect()
}

/// A JSON document in which no object names a member twice, in either spelling (a parser
/// that kept the first and one that keeps the last would read different requests: the same
/// `amount` twice, or `request_id` beside `requestId`); it holds the members the top-level
/// object names, as [`field_key`]s.
struct Unambiguous(HashSet<String>);

impl<'de> serde::Deserialize<'de> for Unambiguous {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(UnambiguousVisitor)
    }
}

struct UnambiguousVisitor;

impl<'de> serde::de::Visitor<'de> for UnambiguousVisitor {
    type Value = Unambiguous;

    fn expecting(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("JSON")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Unambiguous, A::Error> {
        let mut seen = HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(field_key(&key)) {
                return Err(serde::de::Error::custom(format!("the member {key:?} is given twice")));
            }
            map.next_value::<Unambiguous>()?;
        }
        Ok(Unambiguous(seen))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Unambiguous, A::Error> {
        while seq.next_element::<Unambiguous>()?.is_some() {}
        Ok(Unambiguous(HashSet::new()))
    }

    fn visit_bool<E>(self, _: bool) -> Result<Unambiguous, E> {
        Ok(Unambiguous(HashSet::new()))
    }
    fn visit_i64<E>(self, _: i64) -> Result<Unambiguous, E> {
        Ok(Unambiguous(HashSet::new()))
    }
    fn visit_u64<E>(self, _: u64) -> Result<Unambiguous, E> {
        Ok(Unambiguous(HashSet::new()))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Unambiguous, E> {
        Ok(Unambiguous(HashSet::new()))
    }
    fn visit_str<E>(self, _: &str) -> Result<Unambiguous, E> {
        Ok(Unambiguous(HashSet::new()))
    }
    fn visit_unit<E>(self) -> Result<Unambiguous, E> {
        Ok(Unambiguous(HashSet::new()))
    }
}

/// Whether a body with `headers` is JSON as the gateway reads it: at most one `Content-Type`,
/// `application/json` with no charset but UTF-8 (RFC 8259, section 8.1), and no
/// `Content-Encoding` but `identity` (the gateway decodes none).
fn is_plain_json(headers: &HeaderMap) -> bool {
    let mut types = headers.get_all(header::CONTENT_TYPE).iter();
    let content_type = match (types.next(), types.next()) {
        (None, _) => true,
        (Some(value), None) => {
            let mut parts = value.to_str().unwrap_or("").split(';').map(str::trim);
            let essence = parts.next().unwrap_or("");
            essence.eq_ignore_ascii_case("application/json")
                && parts.filter(|part| !part.is_empty()).all(|part| {
                    part.split_once('=').is_some_and(|(name, value)| {
                        name.trim().eq_ignore_ascii_case("charset")
                            && value.trim().trim_matches('"').eq_ignore_ascii_case("utf-8")
                    })
                })
        }
        (Some(_), Some(_)) => false,
    };
    let encoding = headers
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .all(|value| value.to_str().is_ok_and(|text| text.trim().eq_ignore_ascii_case("identity")));
    content_type && encoding
}

/// The status a gRPC answer carries in `headers` (its trailers, or a trailers-only answer's
/// headers), when it is not OK.
fn status_of(headers: &HeaderMap) -> Option<Status> {
    Status::from_header_map(headers).filter(|status| status.code() != Code::Ok)
}

/// A JSON answer of `message`, fields named as in the proto.
fn json_response(code: StatusCode, message: &DynamicMessage) -> http::Response<axum::body::Body> {
    let mut json = serde_json::Serializer::new(Vec::new());
    let options = SerializeOptions::new().use_proto_field_name(true);
    let body = match message.serialize_with_options(&mut json, &options) {
        Ok(()) => json.into_inner(),
        Err(_) => br#"{"code":13,"message":"internal error"}"#.to_vec(),
    };
    let mut response = http::Response::new(axum::body::Body::from(body));
    *response.status_mut() = code;
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// The HTTP status of a gRPC code (google/rpc/code.proto, "HTTP Mapping").
pub fn http_status(code: Code) -> StatusCode {
    match code {
        Code::Ok => StatusCode::OK,
        Code::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => StatusCode::BAD_REQUEST,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// A refusal of the gateway's own, with its ErrorInfo.
fn refuse(code: Code, reason: &str, message: &str) -> Status {
    let mut details = ErrorDetails::new();
    details.set_error_info(reason, ERROR_DOMAIN, HashMap::new());
    Status::with_error_details(code, message, details)
}

/// INVALID_ARGUMENT naming `field` in a BadRequest.
fn bad_request(field: &str, description: &str) -> Status {
    let mut details = ErrorDetails::new();
    details.set_error_info("INVALID_ARGUMENT", ERROR_DOMAIN, HashMap::new());
    details.add_bad_request_violation(field, description);
    Status::with_error_details(Code::InvalidArgument, format!("invalid argument: {field} {description}"), details)
}

/// A body over [`BODY_BYTES_MAX`].
fn too_large() -> Status {
    let mut details = ErrorDetails::new();
    let metadata = HashMap::from([
        ("bound".to_owned(), "body_bytes_max".to_owned()),
        ("limit".to_owned(), BODY_BYTES_MAX.to_string()),
    ]);
    details.set_error_info("REQUEST_TOO_LARGE", ERROR_DOMAIN, metadata);
    Status::with_error_details(Code::OutOfRange, format!("the request body is over {BODY_BYTES_MAX} bytes"), details)
}

/// The server's router: the HTTP/JSON paths (`/v1/...`) to `gateway`; everything else to the
/// gRPC services, over HTTP/2 (an HTTP/1 request for any other path is answered 404 in JSON).
pub fn router(gateway: Gateway, grpc: GrpcService) -> axum::Router {
    let json = gateway.clone();
    let other = tower::service_fn(move |request: axum::extract::Request| {
        let (grpc, gateway) = (grpc.clone(), gateway.clone());
        async move {
            if request.version() != http::Version::HTTP_2 {
                return Ok::<_, Infallible>(not_http_json(&gateway));
            }
            let Ok(response) = grpc.oneshot(request.map(tonic::body::Body::new)).await;
            Ok(response.map(axum::body::Body::new))
        }
    });
    axum::Router::new()
        .route(
            "/v1/{*rest}",
            axum::routing::any(move |request: axum::extract::Request| async move { json.handle(request).await }),
        )
        .fallback_service(other)
}

/// The answer to an HTTP/1 request for a gRPC path: gRPC needs HTTP/2.
fn not_http_json(gateway: &Gateway) -> http::Response<axum::body::Body> {
    gateway.refusal(&refuse(
        Code::NotFound,
        "ROUTE_NOT_FOUND",
        "no HTTP/JSON RPC is served at this path (gRPC needs HTTP/2; see docs/http.md)",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_parse_and_match_with_colons_inside_variables() {
        let template = Template::parse("/v1/merchants/{merchant_id}/orders/{order_no}:pay").unwrap();
        assert_eq!(template.verb.as_deref(), Some("pay"));
        let variables = template.matches("/v1/merchants/m1/orders/a:b:pay").unwrap().unwrap();
        assert_eq!(variables, vec![("merchant_id".into(), "m1".into()), ("order_no".into(), "a:b".into())]);
        assert!(template.matches("/v1/merchants/m1/orders/a").is_none());
        assert!(template.matches("/v1/merchants/m1/orders/:pay").is_none());
        assert!(template.matches("/v1/merchants/m1/orders/a/b:pay").is_none());
        let plain = Template::parse("/v1/accounts/{account_id}").unwrap();
        assert_eq!(plain.verb, None);
        assert_eq!(plain.matches("/v1/accounts/a%3Ab").unwrap().unwrap(), vec![("account_id".into(), "a:b".into())]);
        assert!(plain.matches("/v1/accounts/%FF").unwrap().is_err());
        assert!(Template::parse("/v1/{name=accounts/*}").is_err());
        assert!(Template::parse("/v1/**").is_err());
        assert!(Template::parse("v1/accounts").is_err());
    }

    #[test]
    fn the_checked_in_openapi_document_is_the_one_served() {
        let document = openapi_document(crate::proto::FILE_DESCRIPTOR_SET).expect("the proto's rules are served");
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.json");
        let checked_in = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            checked_in == document,
            "docs/openapi.json differs from the document the server serves: run `cargo run -- openapi > docs/openapi.json`"
        );
        let json: serde_json::Value = serde_json::from_str(&document).unwrap();
        assert_eq!(json["openapi"], "3.0.3");
        let pay = &json["paths"]["/v1/merchants/{merchant_id}/orders/{order_no}:pay"]["post"];
        assert_eq!(pay["operationId"], "PaymentService_Pay");
        let parameters: Vec<&str> =
            pay["parameters"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
        assert_eq!(parameters, ["merchant_id", "order_no", "Idempotency-Key", "Idempotency-Token"]);
        let body = &pay["requestBody"]["content"]["application/json"]["schema"];
        let mut fields: Vec<&String> = body["properties"].as_object().unwrap().keys().collect();
        fields.sort();
        assert_eq!(
            fields,
            ["amount", "currency", "out_trade_no", "payer_account_id"],
            "the body without the path's fields"
        );
        assert_eq!(body["additionalProperties"], false);
        let entries = &json["paths"]["/v1/accounts/{account_id}/entries"]["get"]["parameters"];
        let names: Vec<&str> = entries.as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["account_id", "page_size", "page_token"]);
        let query_ids: Vec<&str> = ["orders/{order_no}", "payments/{out_trade_no}", "refunds/{out_refund_no}"]
            .iter()
            .map(|tail| {
                json["paths"][format!("/v1/merchants/{{merchant_id}}/{tail}")]["get"]["operationId"].as_str().unwrap()
            })
            .collect();
        assert_eq!(query_ids, ["PaymentService_Query", "PaymentService_Query_2", "PaymentService_Query_3"]);
        let token = &json["paths"]["/v1/merchants/{merchant_id}/tokens"]["post"]["parameters"];
        assert_eq!(token.as_array().unwrap().len(), 1, "IssueToken takes no guard header: {token}");
        let account = &json["components"]["schemas"]["payledger.v1.Account"]["properties"];
        assert_eq!(account["version"]["type"], "string", "64-bit integers are strings in proto3 JSON");
        assert_eq!(account["created_at"]["format"], "date-time");
    }

    #[test]
    fn a_custom_method_takes_its_path_before_a_variable_would() {
        let grpc: GrpcService =
            BoxCloneSyncService::new(tower::service_fn(|_: http::Request<tonic::body::Body>| async {
                Ok::<_, Infallible>(http::Response::new(tonic::body::Body::empty()))
            }));
        let gateway = Gateway::new(crate::proto::FILE_DESCRIPTOR_SET, grpc).unwrap();
        let (route, variables) = gateway.route(&Method::POST, "/v1/accounts/a:deposit").unwrap();
        assert_eq!(route.grpc_path, "/payledger.v1.AccountService/Deposit");
        assert_eq!(variables, vec![("account_id".to_owned(), "a".to_owned())]);
        let refused = gateway.route(&Method::GET, "/v1/accounts/a:deposit").unwrap_err();
        assert_eq!(refused.metadata().get("allow").unwrap(), "POST");
        let (route, variables) = gateway.route(&Method::GET, "/v1/accounts/a%3Adeposit").unwrap();
        assert_eq!(route.grpc_path, "/payledger.v1.AccountService/GetAccount");
        assert_eq!(variables, vec![("account_id".to_owned(), "a:deposit".to_owned())]);
    }

    #[test]
    fn bodies_are_read_only_as_utf8_json_without_encoding() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut map = HeaderMap::new();
            for (name, value) in pairs {
                map.append(*name, HeaderValue::from_static(value));
            }
            map
        };
        assert!(is_plain_json(&headers(&[])));
        assert!(is_plain_json(&headers(&[("content-type", "application/json")])));
        assert!(is_plain_json(&headers(&[("content-type", "Application/JSON; charset=\"UTF-8\"")])));
        assert!(is_plain_json(&headers(&[("content-encoding", "identity")])));
        assert!(!is_plain_json(&headers(&[("content-type", "application/json; charset=latin1")])));
        assert!(!is_plain_json(&headers(&[("content-type", "application/json; boundary=x")])));
        assert!(!is_plain_json(&headers(&[("content-type", "text/plain")])));
        assert!(!is_plain_json(&headers(&[("content-type", "application/json"), ("content-type", "text/plain")])));
        assert!(!is_plain_json(&headers(&[("content-encoding", "gzip")])));
    }

    #[test]
    fn a_member_named_twice_in_either_spelling_is_refused() {
        assert!(serde_json::from_str::<Unambiguous>(r#"{"a": 1, "b": {"c": [1, {"d": 2}]}}"#).is_ok());
        assert!(serde_json::from_str::<Unambiguous>(r#"{"amount": "1", "amount": "9"}"#).is_err());
        assert!(serde_json::from_str::<Unambiguous>(r#"{"request_id": "a", "requestId": "b"}"#).is_err());
        assert!(serde_json::from_str::<Unambiguous>(r#"{"x": [{"k": 1, "k": 2}]}"#).is_err());
    }

    #[test]
    fn grpc_codes_map_to_the_standard_http_statuses() {
        assert_eq!(http_status(Code::InvalidArgument), StatusCode::BAD_REQUEST);
        assert_eq!(http_status(Code::FailedPrecondition), StatusCode::BAD_REQUEST);
        assert_eq!(http_status(Code::AlreadyExists), StatusCode::CONFLICT);
        assert_eq!(http_status(Code::Aborted), StatusCode::CONFLICT);
        assert_eq!(http_status(Code::ResourceExhausted), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(http_status(Code::Unauthenticated), StatusCode::UNAUTHORIZED);
        assert_eq!(http_status(Code::Cancelled).as_u16(), 499);
        assert_eq!(http_status(Code::Unavailable), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(http_status(Code::DeadlineExceeded), StatusCode::GATEWAY_TIMEOUT);
    }

    #[test]
    fn every_rpc_of_the_api_has_a_binding() {
        let grpc: GrpcService =
            BoxCloneSyncService::new(tower::service_fn(|_: http::Request<tonic::body::Body>| async {
                Ok::<_, Infallible>(http::Response::new(tonic::body::Body::empty()))
            }));
        let gateway = Gateway::new(crate::proto::FILE_DESCRIPTOR_SET, grpc).expect("the proto's rules are served");
        let bindings = gateway.bindings();
        assert!(
            bindings.contains(&"POST /v1/merchants/{merchant_id}/orders/{order_no}:pay".to_owned()),
            "{bindings:?}"
        );
        let grpc_paths: std::collections::HashSet<_> =
            gateway.routes.iter().map(|route| route.grpc_path.clone()).collect();
        assert_eq!(grpc_paths.len(), 15, "every RPC of both services: {grpc_paths:?}");
    }
}
