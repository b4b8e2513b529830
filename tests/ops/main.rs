//! The server as an operator and a caller meet it, one module a topic: the audit command,
//! the retrying client against a scripted server, connections that move (gRFC A9) and
//! server keepalive (gRFC A8), the
//! database gone and back, health, start-up migrations of several instances at once, a
//! database turned read-only, the statements a server prepares, and TLS. One test binary, so the crate and its dependencies are linked once
//! for all of them; the backend suite is `tests/api/`, and the tests that install a global
//! tracing subscriber (`tests/plans.rs`, `tests/traces.rs`) keep binaries of their own.

#[path = "../common/mod.rs"]
mod common;

mod audit;
mod client;
mod connection_age;
mod database_down;
mod documented;
mod health;
mod keepalive;
mod migrations;
mod read_only;
mod rotation;
mod statements;
mod tls;
