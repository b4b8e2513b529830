//! `payledger demo`.
use std::process::ExitCode;

#[derive(Debug, Clone, clap::Args)]
pub struct DemoSettings {
    /// Play against a running server instead of an in-process one on a temporary SQLite file.
    #[arg(long)]
    pub target: Option<String>,
}

pub async fn run(
    _settings: DemoSettings,
) -> Result<ExitCode, Box<dyn std::error::Error + Send + Sync>> {
    Ok(ExitCode::SUCCESS)
}
