//! payledger: a gRPC payment ledger that moves money exactly once under client retries.
//!
//! Layers, each depending only on those below it:
//! `grpc` (transport) -> `ledger` (use cases, transactions, idempotency) -> `store` (SQL)
//! and `domain` (pure types and rules).

pub mod auth;
pub mod config;
pub mod domain;
pub mod error;
pub mod grpc;
pub mod http;
pub mod ledger;
pub mod metrics;
pub mod startup;
pub mod store;
pub mod telemetry;
pub mod tls;

/// The Rust client (the `payledger-client` crate): the retrying client and its settings.
pub use payledger_client as client;

/// The API generated from `proto/payledger/v1/payledger.proto`: the messages and client
/// stubs of `payledger-client`, and the server stubs.
pub mod proto {
    #![allow(clippy::all, clippy::pedantic, missing_docs)]
    pub use payledger_client::proto::*;
    tonic::include_proto!("payledger.v1");

    /// The encoded descriptor set of the payledger API, served by reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/payledger_descriptor.bin"));
}
