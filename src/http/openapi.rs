//! The OpenAPI 3.0 document of the HTTP/JSON API, made from the same descriptor set (compiled
//! from the proto at build time) and the same routes the gateway serves, so it cannot drift
//! from them: served at [`OPENAPI_PATH`], printed by `payledger openapi`, and checked in as
//! `docs/openapi.json` (a test keeps that copy equal to this document). What it says of each
//! operation, and what it cannot say, is docs/http.md, "The OpenAPI document".

use std::collections::BTreeMap;

use prost_reflect::{FieldDescriptor, Kind, MessageDescriptor};
use serde_json::{json, Map, Value as Json};

use super::{Route, Segment};

/// Where the server serves the document (GET, no authentication: it holds no data).
pub const OPENAPI_PATH: &str = "/v1/openapi.json";

/// The pattern of an `Idempotency-Key` (docs/api.md): 1-128 printable ASCII characters but `,`,
/// no space at either end.
const KEY_PATTERN: &str = "^[\\x21-\\x2B\\x2D-\\x7E]([\\x20-\\x2B\\x2D-\\x7E]{0,126}[\\x21-\\x2B\\x2D-\\x7E])?$";

/// The pattern of an `Idempotency-Token` as IssueToken makes them (docs/idempotency.md).
const TOKEN_PATTERN: &str = "^[A-Za-z0-9_-]{16,64}$";

/// The RPCs that require an `Idempotency-Key` (they have no natural key).
const KEY_REQUIRED: [&str; 1] = ["/payledger.v1.AccountService/Transfer"];

/// The RPCs that take no guard header (`Idempotency-Key`, `Idempotency-Token`): they write
/// nothing a retry could repeat.
const UNGUARDED: [&str; 1] = ["/payledger.v1.PaymentService/IssueToken"];

/// The shapes the proto's conventions give fields by name (the comment at the top of
/// payledger.proto): business numbers are 1-64 characters of `[A-Za-z0-9._:-]`, amounts
/// decimal strings in major units, currencies ISO 4217 alphabetic codes. In a request body a
/// field may also be `""`, which proto3 JSON reads as unset.
fn convention(field: &str) -> Option<(&'static str, &'static str)> {
    const BUSINESS_NUMBER: &str = "[A-Za-z0-9._:-]{1,64}";
    match field {
        "account_id" | "from_account_id" | "to_account_id" | "payer_account_id" | "payee_account_id"
        | "merchant_id" | "order_no" | "out_trade_no" | "out_refund_no" | "out_auth_no" | "request_id" => {
            Some((BUSINESS_NUMBER, "A business number: 1-64 characters of [A-Za-z0-9._:-], compared byte for byte."))
        }
        "amount" => Some((
            "[0-9]+(\\.[0-9]+)?",
            "A decimal string in major units, at most the currency's ISO 4217 minor-unit digits.",
        )),
        "currency" => Some(("[A-Z]{3}", "An ISO 4217 alphabetic code.")),
        _ => None,
    }
}

/// The document of `routes`.
pub(super) fn document(routes: &[Route]) -> Json {
    let mut schemas = BTreeMap::new();
    let mut paths: BTreeMap<String, Map<String, Json>> = BTreeMap::new();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for route in routes {
        let (service, method) =
            route.grpc_path.trim_start_matches('/').split_once('/').unwrap_or(("", &route.grpc_path));
        let service = service.rsplit('.').next().unwrap_or(service);
        let count = seen.entry(format!("{service}_{method}")).and_modify(|n| *n += 1).or_insert(1);
        let operation_id =
            if *count == 1 { format!("{service}_{method}") } else { format!("{service}_{method}_{count}") };
        let operation = operation(route, operation_id, &mut schemas);
        paths.entry(route.template_text()).or_default().insert(route.method.as_str().to_ascii_lowercase(), operation);
    }
    schemas.insert("google.rpc.Status".to_owned(), status_schema());
    json!({
        "openapi": "3.0.3",
        "info": {
            "title": "payledger",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "payledger's API over HTTP/JSON: every RPC of payledger.v1's AccountService and \
    PaymentService, at the path of its google.api.http option, bodies in the proto3 JSON mapping \
    (docs/http.md). Amounts are decimal strings in major units; errors are google.rpc.Status with \
    an ErrorInfo reason (docs/api.md#errors).",
            "license": {"name": "Apache-2.0", "url": "https://www.apache.org/licenses/LICENSE-2.0"}
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT",
                    "description": "Required by a server that authenticates callers (docs/security.md)."}
            }
        },
        "security": [{}, {"bearer": []}]
    })
}

fn operation(route: &Route, operation_id: String, schemas: &mut BTreeMap<String, Json>) -> Json {
    let path_fields: Vec<&str> = route
        .template
        .segments
        .iter()
        .filter_map(|segment| match segment {
            Segment::Field(field) => Some(field.as_str()),
            Segment::Literal(_) => None,
        })
        .collect();
    let mut parameters: Vec<Json> = path_fields
        .iter()
        .map(|field| {
            let mut schema = json!({"type": "string"});
            if let Some((pattern, description)) = convention(field) {
                schema = json!({"type": "string", "pattern": format!("^{pattern}$")});
                return json!({"name": field, "in": "path", "required": true, "schema": schema, "description": description});
            }
            json!({"name": field, "in": "path", "required": true, "schema": schema})
        })
        .collect();
    let guarded = !UNGUARDED.contains(&route.grpc_path.as_str());
    if route.whole_body && guarded {
        let key_required = KEY_REQUIRED.contains(&route.grpc_path.as_str());
        let key = "The client idempotency key: a retry with it is answered with the original (docs/idempotency.md).";
        let token = "A one-time token from IssueToken (docs/idempotency.md).";
        for (name, pattern, required, description) in
            [("Idempotency-Key", KEY_PATTERN, key_required, key), ("Idempotency-Token", TOKEN_PATTERN, false, token)]
        {
            parameters.push(json!({"name": name, "in": "header", "required": required, "description": description,
                "schema": {"type": "string", "pattern": pattern}}));
        }
    } else if !route.whole_body {
        for field in route.input.fields().filter(|field| route.is_query_field(field)) {
            let mut schema = field_schema(&field, schemas);
            if field.name() == "page_size" {
                schema["minimum"] = json!(0);
                schema["description"] = json!("0: 50; above 500 is read as 500.");
            }
            parameters.push(json!({"name": field.name(), "in": "query", "required": false, "schema": schema}));
        }
    }
    let answer = reference(&route.output, schemas);
    let mut operation = json!({
        "operationId": operation_id,
        "tags": [operation_id.split('_').next().unwrap_or_default()],
        "parameters": parameters,
        "responses": responses(route, answer, guarded)
    });
    if let Some(description) = leading_comment(route) {
        operation["description"] = Json::String(description);
    }
    if route.whole_body {
        let mut properties = Map::new();
        for field in route.input.fields().filter(|field| !path_fields.contains(&field.name())) {
            let mut schema = field_schema(&field, schemas);
            if let (Some((pattern, description)), Kind::String) = (convention(field.name()), field.kind()) {
                schema = json!({"type": "string", "pattern": format!("^({pattern})?$"), "description": description});
            }
            // proto3 JSON reads `null` as the field's default value.
            if let Some(object) = schema.as_object_mut().filter(|object| !object.contains_key("$ref")) {
                object.insert("nullable".to_owned(), Json::Bool(true));
            }
            properties.insert(field.name().to_owned(), schema);
        }
        operation["requestBody"] = json!({
            "required": false,
            "content": {"application/json": {"schema": {
                "type": "object", "properties": properties, "additionalProperties": false
            }}}
        });
    }
    operation
}

/// An operation's answers: 200 with its response message (and, on a mutating call, the
/// replay headers); each refusal status with a google.rpc.Status (docs/http.md#errors).
fn responses(route: &Route, answer: Json, guarded: bool) -> Json {
    let mut ok = json!({
        "description": format!("The {}.", route.output.name()),
        "content": {"application/json": {"schema": answer}}
    });
    if route.whole_body && guarded {
        ok["headers"] = json!({
            "Idempotent-Replayed": {"description": "`true` on an answer replayed from the original call.",
                "schema": {"type": "string", "enum": ["true"]}},
            "Idempotency-Expires-At": {"description": "Until when the Idempotency-Key is kept (RFC 3339).",
                "schema": {"type": "string", "format": "date-time"}}
        });
    }
    let status = json!({"application/json": {"schema": {"$ref": "#/components/schemas/google.rpc.Status"}}});
    let retry_after = json!({"Retry-After": {"description": "Seconds to wait before a retry with the same key (RetryInfo).",
        "schema": {"type": "integer", "minimum": 1}}});
    let mut responses = json!({"200": ok});
    let refusals: &[(&str, &str)] = &[
        ("400", "INVALID_ARGUMENT (a BadRequest names each bad field), FAILED_PRECONDITION (a business rule: INSUFFICIENT_FUNDS, ORDER_ALREADY_PAID, ...), MALFORMED_REQUEST, OUT_OF_RANGE."),
        ("401", "UNAUTHENTICATED: no usable bearer token."),
        ("403", "PERMISSION_DENIED: a scope or merchant outside the caller's grant."),
        ("404", "NOT_FOUND: the account, order, payment, refund or hold does not exist (or is another merchant's)."),
        ("408", "REQUEST_BODY_TIMEOUT: the body did not arrive in time."),
        ("409", "ALREADY_EXISTS (a natural key used with other terms) or ABORTED (CONTENTION, LOCK_TIMEOUT: retry with the same key)."),
        ("413", "REQUEST_TOO_LARGE: the body is over 65,536 bytes."),
        ("415", "UNSUPPORTED_MEDIA_TYPE: the body is not application/json."),
        ("422", "IDEMPOTENCY_KEY_REUSED or TOKEN_REUSED: the key or token was used for another request."),
        ("429", "RESOURCE_EXHAUSTED (OVERLOADED): retry later with the same key."),
        ("500", "INTERNAL."),
        ("503", "UNAVAILABLE: the database or token store is unreachable; retry with the same key."),
        ("504", "DEADLINE_EXCEEDED: the grpc-timeout passed; retry with the same key."),
    ];
    for (code, description) in refusals {
        if !route.whole_body && matches!(*code, "408" | "413" | "415" | "422") {
            continue;
        }
        let mut refusal = json!({"description": description, "content": status.clone()});
        match *code {
            "401" => {
                refusal["headers"] = json!({"WWW-Authenticate": {"schema": {"type": "string", "enum": ["Bearer"]}}})
            }
            "409" | "429" | "503" => refusal["headers"] = retry_after.clone(),
            _ => {}
        }
        responses[*code] = refusal;
    }
    responses["default"] = json!({"description": "Any other refusal (docs/http.md#errors).", "content": status});
    responses
}

/// The RPC's comment in the proto, from the descriptor set's source info.
fn leading_comment(route: &Route) -> Option<String> {
    let method = &route.rpc;
    let file = method.parent_file();
    let info = file.file_descriptor_proto().source_code_info.as_ref()?;
    let location = info.location.iter().find(|location| location.path == method.path())?;
    let text = location.leading_comments.as_deref()?.trim();
    (!text.is_empty()).then(|| text.split_whitespace().collect::<Vec<_>>().join(" "))
}

/// A `$ref` to `message`'s schema, adding it (and the messages it holds) to `schemas`.
fn reference(message: &MessageDescriptor, schemas: &mut BTreeMap<String, Json>) -> Json {
    let name = message.full_name().to_owned();
    if !schemas.contains_key(&name) {
        schemas.insert(name.clone(), Json::Null);
        let mut properties = Map::new();
        for field in message.fields() {
            properties.insert(field.name().to_owned(), field_schema(&field, schemas));
        }
        schemas.insert(name.clone(), json!({"type": "object", "properties": properties}));
    }
    json!({"$ref": format!("#/components/schemas/{name}")})
}

/// A field's schema in the proto3 JSON mapping.
fn field_schema(field: &FieldDescriptor, schemas: &mut BTreeMap<String, Json>) -> Json {
    let item = match field.kind() {
        Kind::String => json!({"type": "string"}),
        Kind::Bool => json!({"type": "boolean"}),
        Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => json!({"type": "integer", "format": "int32"}),
        Kind::Uint32 | Kind::Fixed32 => {
            json!({"type": "integer", "format": "int64", "minimum": 0, "maximum": u32::MAX})
        }
        Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => {
            json!({"type": "string", "format": "int64", "pattern": "^-?[0-9]+$"})
        }
        Kind::Uint64 | Kind::Fixed64 => json!({"type": "string", "format": "uint64", "pattern": "^[0-9]+$"}),
        Kind::Float | Kind::Double => json!({"type": "number"}),
        Kind::Bytes => json!({"type": "string", "format": "byte"}),
        Kind::Enum(enumeration) => {
            let names: Vec<String> = enumeration.values().map(|value| value.name().to_owned()).collect();
            json!({"type": "string", "enum": names})
        }
        Kind::Message(message) if message.full_name() == "google.protobuf.Timestamp" => {
            json!({"type": "string", "format": "date-time"})
        }
        Kind::Message(message) => reference(&message, schemas),
    };
    if field.is_list() {
        json!({"type": "array", "items": item})
    } else {
        item
    }
}

/// google.rpc.Status in JSON: its details are `Any`s (`@type` and the detail's own fields).
fn status_schema() -> Json {
    json!({
        "type": "object",
        "description": "google.rpc.Status: the gRPC code, a message, and details such as google.rpc.ErrorInfo (reason, domain \"payledger\"), google.rpc.BadRequest and google.rpc.RetryInfo.",
        "properties": {
            "code": {"type": "integer", "format": "int32"},
            "message": {"type": "string"},
            "details": {"type": "array", "items": {
                "type": "object",
                "properties": {"@type": {"type": "string"}},
                "additionalProperties": true
            }}
        }
    })
}
