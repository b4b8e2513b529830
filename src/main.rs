//! The `payledger` command: `serve` and `audit`. The test tools (demo, bench, storm) are the
//! separate `payledger-tools` binary.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use payledger::config::{AuditSettings, LogSettings, ServeSettings};
use payledger::startup::{error_chain, open_existing_ledger, shutdown_signal, Application};
use payledger::telemetry;

#[derive(Debug, Parser)]
#[command(name = "payledger", version, about = "A gRPC payment ledger that moves money exactly once under retries")]
struct Cli {
    #[command(flatten)]
    log: LogSettings,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve PaymentService, AccountService, gRPC health and reflection.
    Serve(ServeSettings),
    /// Check the ledger invariants; exits 1 on any violation.
    Audit(AuditSettings),
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    telemetry::init(&cli.log);
    let result = match cli.command {
        Command::Serve(settings) => serve(settings).await,
        Command::Audit(settings) => audit(settings).await,
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("payledger: {}", error_chain(error.as_ref()));
            ExitCode::FAILURE
        }
    }
}

type AnyError = Box<dyn std::error::Error + Send + Sync>;

async fn serve(settings: ServeSettings) -> Result<ExitCode, AnyError> {
    let application = Application::build(&settings).await?;
    tracing::info!(
        listen = %application.local_addr(),
        backend = application.ledger().store().dialect().name(),
        "payledger serving"
    );
    application.run_until(shutdown_signal()).await?;
    Ok(ExitCode::SUCCESS)
}

async fn audit(settings: AuditSettings) -> Result<ExitCode, AnyError> {
    let ledger = open_existing_ledger(&settings).await?;
    let violations = ledger.audit().await?;
    for violation in &violations {
        println!("VIOLATION {}: {} ({})", violation.check, violation.subject, violation.detail);
    }
    if violations.is_empty() {
        println!("audit: ledger is consistent");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("audit: {} violation(s)", violations.len());
        Ok(ExitCode::FAILURE)
    }
}
