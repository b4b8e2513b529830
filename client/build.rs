//! Compiles the payledger API (`../proto`) into messages and client stubs with the pure-Rust
//! `protox` compiler, so a caller's build needs no system `protoc`.

use std::path::Path;

const PROTO_ROOT: &str = "proto";
const PROTO_FILE: &str = "proto/payledger/v1/payledger.proto";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed={PROTO_ROOT}");
    let descriptors = protox::compile([Path::new(PROTO_FILE)], [Path::new(PROTO_ROOT)])?;
    // Client stubs only, with tonic-prost's plain codec: a response that cannot be decoded is
    // reported as the client's own decode failure, never as the server's verdict on the request.
    tonic_prost_build::configure().build_server(false).build_client(true).compile_fds(descriptors)?;
    Ok(())
}
