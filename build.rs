//! Compiles `proto/` with the pure-Rust `protox` compiler, so a build needs no system `protoc`.

use std::{env, fs, path::PathBuf};

const PROTO_FILE: &str = "proto/payledger/v1/payledger.proto";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    println!("cargo:rustc-env=PAYLEDGER_BUILD_COMMIT={}", build_commit());
    let mut compiler = protox::Compiler::new(["proto"])?;
    compiler.include_imports(true).include_source_info(true).open_file(PROTO_FILE)?;
    let descriptors = compiler.file_descriptor_set();
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    // Server reflection serves this encoded set, so grpcurl, buf curl and ghz need no .proto;
    // the HTTP/JSON gateway reads its google.api.http options (which this encoding keeps, and
    // prost's own types would drop).
    fs::write(out_dir.join("payledger_descriptor.bin"), compiler.encode_file_descriptor_set())?;
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

/// The commit `payledger_build_info` names: `PAYLEDGER_BUILD_COMMIT` when set (a build without
/// the repository, such as the Dockerfile's, passes it as a build argument), else the checkout's
/// `git rev-parse HEAD`, else `unknown`. The build script runs again when either changes.
fn build_commit() -> String {
    println!("cargo:rerun-if-env-changed=PAYLEDGER_BUILD_COMMIT");
    if let Some(commit) = env::var("PAYLEDGER_BUILD_COMMIT").ok().filter(|commit| !commit.trim().is_empty()) {
        return commit.trim().to_owned();
    }
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|output| output.status.success())
            .and_then(|output| String::from_utf8(output.stdout).ok())
            .map(|text| text.trim().to_owned())
    };
    // HEAD, the branch it points to and packed-refs: whichever moves when a commit is made or
    // checked out. Only paths that exist: cargo reruns a script whose watched path is missing
    // on every build.
    let mut watched = vec!["HEAD".to_owned(), "packed-refs".to_owned()];
    watched.extend(git(&["symbolic-ref", "-q", "HEAD"]));
    for name in watched {
        if let Some(path) = git(&["rev-parse", "--path-format=absolute", "--git-path", &name]) {
            if std::path::Path::new(&path).exists() {
                println!("cargo:rerun-if-changed={path}");
            }
        }
    }
    git(&["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".to_owned())
}
