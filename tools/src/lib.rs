//! payledger's test tools, on top of the client crate (and the server library, for the
//! in-process servers they start): `demo`, `bench` and `storm` with its fault proxy.
//!
//! They write test data (funded accounts, orders, payments), so they refuse a server or a
//! database they did not start themselves unless told explicitly: `--allow-test-data` for
//! `demo --target` and `bench`, `--reuse-database` for `storm`. None of them reads
//! `DATABASE_URL`.

pub mod bench;
pub mod demo;
pub mod storm;

/// The error of a tool run: printed with its causes, then exit code 1.
pub type AnyError = Box<dyn std::error::Error + Send + Sync>;

/// Refuses to write test data to a server this process did not start, unless allowed.
///
/// # Errors
/// When `allowed` is false: a message naming the flag that allows it.
pub fn check_test_data_allowed(target: &str, allowed: bool) -> Result<(), AnyError> {
    if allowed {
        return Ok(());
    }
    Err(format!(
        "refusing to write test data (funded accounts, orders, payments) to {target}, a server this command did not \
         start; pass --allow-test-data if that server is meant for it"
    )
    .into())
}
