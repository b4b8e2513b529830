//! Compiles `proto/` with the pure-Rust `protox` compiler, so a build needs no system `protoc`.

use std::{env, fs, path::PathBuf};

use prost::Message;

const PROTO_FILE: &str = "proto/payledger/v1/payledger.proto";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let descriptors = protox::compile([PROTO_FILE], ["proto"])?;
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    // Server reflection serves this encoded set, so grpcurl, buf curl and ghz need no .proto.
    fs::write(out_dir.join("payledger_descriptor.bin"), descriptors.encode_to_vec())?;
    // Server stubs only: the messages (and client stubs) are the payledger-client crate's, so
    // server and callers share one set of types.
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(false)
        .extern_path(".payledger.v1", "::payledger_client::proto")
        // Malformed protobuf is INVALID_ARGUMENT, not INTERNAL (see src/grpc/codec.rs).
        .codec_path("crate::grpc::codec::LedgerCodec")
        .compile_fds(descriptors)?;
    Ok(())
}
