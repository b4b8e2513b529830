//! payledger: a gRPC payment ledger that moves money exactly once under client retries.
//!
//! Layers, each depending only on those below it:
//! `grpc` (transport) -> `ledger` (use cases, transactions, idempotency) -> `store` (SQL)
//! and `domain` (pure types and rules).

pub mod bench;
pub mod client;
pub mod config;
pub mod demo;
pub mod domain;
pub mod error;
pub mod grpc;
pub mod ledger;
pub mod startup;
pub mod store;
pub mod storm;
pub mod telemetry;

/// Messages and service stubs generated from `proto/payledger/v1/payledger.proto`.
pub mod proto {
    #![allow(clippy::all, clippy::pedantic, missing_docs)]
    tonic::include_proto!("payledger.v1");

    /// The encoded descriptor set of the payledger API, served by reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/payledger_descriptor.bin"));
}
