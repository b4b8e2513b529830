//! The `payledger` command: `serve`, `audit`, `demo`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use payledger::config::{AuditSettings, LogSettings, ServeSettings};
use payledger::startup::{open_existing_ledger, shutdown_signal, Application};
use payledger::{bench, demo, storm, telemetry};

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
    /// Play a short story that shows exactly-once money movement; exits 1 if a step misbehaves.
    Demo(demo::DemoSettings),
    /// Run a duplicate storm under faults against several instances and check that money
    /// moved exactly once; exits 1 on any violation.
    Storm(storm::StormSettings),
    /// Load a running server with one scenario and print a ghz-like report.
    Bench(bench::BenchSettings),
}

#[tokio::main]
async fn main() -> ExitCode {
    let mut cli = Cli::parse();
    if matches!(cli.command, Command::Demo(_) | Command::Storm(_) | Command::Bench(_))
        && std::env::var_os("PAYLEDGER_LOG").is_none()
    {
        // The story is the demo's output; the in-process server only speaks up on problems.
        cli.log.log_filter = "warn".into();
    }
    telemetry::init(&cli.log);
    let result = match cli.command {
        Command::Serve(settings) => serve(settings).await,
        Command::Audit(settings) => audit(settings).await,
        Command::Demo(settings) => demo::run(settings).await,
        Command::Storm(settings) => storm::run(settings).await,
        Command::Bench(settings) => bench::run(settings).await,
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

/// The error and its causes, each said once (a driver error often repeats its cause).
fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}
