//! `payledger-tools`: `demo`, `bench` and `storm`. The server binary (`payledger`) carries
//! none of them.

use std::process::ExitCode;

use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

use payledger::config::{LogSettings, ServeSettings};
use payledger::startup::{shutdown_signal, Application};
use payledger::telemetry;
use payledger_tools::{bench, demo, seed, storm, AnyError};

#[derive(Debug, Parser)]
#[command(
    name = "payledger-tools",
    version,
    about = "payledger's test tools: demo, load (bench), bulk fill (seed) and duplicate storm"
)]
struct Cli {
    #[command(flatten)]
    log: LogSettings,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Play a short story that shows exactly-once money movement; exits 1 if a step misbehaves.
    Demo(demo::DemoSettings),
    /// Load a server with one scenario and print a ghz-like report.
    Bench(bench::BenchSettings),
    /// Fill a ledger in bulk with paid and refunded orders, consistent for `payledger audit`.
    Seed(seed::SeedSettings),
    /// Run a duplicate storm under faults against several instances over a database it
    /// creates, and check that money moved exactly once; exits 1 on any violation.
    Storm(storm::StormSettings),
    /// One server instance of a storm (the storm starts and kills these).
    #[command(hide = true)]
    StormInstance(Box<ServeSettings>),
}

#[tokio::main]
async fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let mut cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(error) => error.exit(),
    };
    let filter_chosen =
        matches!(matches.value_source("log_filter"), Some(source) if source != ValueSource::DefaultValue);
    if !matches!(cli.command, Command::StormInstance(_)) && !filter_chosen {
        // The report is the output: unless told otherwise (--log-filter or PAYLEDGER_LOG), an
        // in-process server only speaks up on problems.
        cli.log.log_filter = "warn".into();
    }
    let _telemetry = match telemetry::init(&cli.log) {
        Ok(telemetry) => telemetry,
        Err(error) => {
            eprintln!("payledger-tools: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Command::Demo(settings) => demo::run(settings).await,
        Command::Bench(settings) => bench::run(settings).await,
        Command::Seed(settings) => seed::run(settings).await,
        Command::Storm(settings) => storm::run(settings).await,
        Command::StormInstance(settings) => storm_instance(&settings).await,
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("payledger-tools: {}", payledger::startup::error_chain(error.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// Serves as `payledger serve` does and, once bound, prints `listening ADDRESS` as its only
/// stdout line (its logs go to stderr), so that `--listen 127.0.0.1:0` can be used.
async fn storm_instance(settings: &ServeSettings) -> Result<ExitCode, AnyError> {
    use std::io::Write;
    let application = Application::build(settings).await?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{}{}", storm::INSTANCE_LISTENING, application.local_addr())?;
    stdout.flush()?;
    drop(stdout);
    application.run_until(shutdown_signal()).await?;
    Ok(ExitCode::SUCCESS)
}
