//! docs/operations.md against the server itself: its settings table names every flag (and its
//! environment variable) of `payledger serve`, the logging flags included, and nothing else, and its metrics table names
//! every family `/metrics` exposes and nothing else.

use crate::common;

use std::collections::BTreeSet;
use std::time::Duration;

use clap::Args as _;
use payledger::config::{LogSettings, ServeSettings};
use payledger::startup::Application;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const OPERATIONS: &str = include_str!("../../docs/operations.md");

/// The lines of the `## {title}` section, up to its first subsection.
fn section(title: &str) -> Vec<&'static str> {
    let heading = format!("## {title}");
    OPERATIONS
        .lines()
        .skip_while(|line| *line != heading)
        .skip(1)
        .take_while(|line| !line.starts_with("## ") && !line.starts_with("### "))
        .collect()
}

/// The backticked words of one column of a section's table rows.
fn column(lines: &[&str], index: usize) -> BTreeSet<String> {
    lines
        .iter()
        .filter(|line| line.starts_with("| `"))
        .filter_map(|line| line.split('|').nth(index + 1))
        .flat_map(|cell| cell.split('`').skip(1).step_by(2).map(str::to_owned).collect::<Vec<_>>())
        .collect()
}

#[test]
fn the_settings_table_names_every_flag_and_variable_of_serve() {
    // `serve`'s own flags and the logging flags every command takes.
    let command = LogSettings::augment_args(ServeSettings::augment_args(clap::Command::new("serve")));
    let mut flags = BTreeSet::new();
    let mut variables = BTreeSet::new();
    for argument in command.get_arguments().filter(|argument| !argument.is_hide_set()) {
        let Some(long) = argument.get_long() else { continue };
        flags.insert(format!("--{long}"));
        if let Some(variable) = argument.get_env() {
            variables.insert(variable.to_string_lossy().into_owned());
        }
    }
    let settings = section("Settings");
    let documented_flags: BTreeSet<_> =
        column(&settings, 0).into_iter().filter(|word| word.starts_with("--")).collect();
    let documented_variables = column(&settings, 1);
    assert_eq!(
        flags.difference(&documented_flags).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "flags of serve missing from the settings table"
    );
    assert_eq!(
        documented_flags.difference(&flags).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "flags in the settings table that serve does not have"
    );
    assert_eq!(
        variables.difference(&documented_variables).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "environment variables of serve missing from the settings table"
    );
}

/// `payledger migrate --help` offers the database's flags, and none of those only `serve`
/// reads (how it writes, where it listens).
#[test]
fn migrate_offers_only_the_flags_it_reads() {
    let help =
        std::process::Command::new(env!("CARGO_BIN_EXE_payledger")).args(["migrate", "--help"]).output().unwrap();
    assert!(help.status.success());
    let help = String::from_utf8_lossy(&help.stdout);
    let offered: BTreeSet<String> = help
        .lines()
        .filter_map(|line| line.trim_start().strip_prefix("--"))
        .filter_map(|flag| flag.split([' ', '=', ',']).next())
        .map(|flag| format!("--{flag}"))
        .collect();
    let database = payledger::config::DatabaseSettings::augment_args(clap::Command::new("migrate"));
    let logging = LogSettings::augment_args(clap::Command::new("migrate"));
    let expected: BTreeSet<String> = database
        .get_arguments()
        .chain(logging.get_arguments())
        .filter_map(|argument| argument.get_long())
        .map(|long| format!("--{long}"))
        .collect();
    assert_eq!(offered, expected, "{help}");
    let serve_only = payledger::config::WriteSettings::augment_args(clap::Command::new("serve"));
    for argument in serve_only.get_arguments() {
        let flag = format!("--{}", argument.get_long().unwrap());
        assert!(!help.contains(&flag), "migrate offers {flag}, which only serve reads");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_table_names_every_family_of_metrics() {
    let directory = tempfile::tempdir().unwrap();
    let ledger = common::sqlite_ledger(directory.path()).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics_address = metrics_listener.local_addr().unwrap();
    let application = Application::with_listener(listener, ledger, Duration::from_secs(1))
        .with_metrics_listener(Some(metrics_listener));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(application.run_until(async {
        let _ = stopped.await;
    }));
    let mut stream = tokio::net::TcpStream::connect(metrics_address).await.unwrap();
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).await.unwrap();
    // `# TYPE name kind`: a counter's samples are `name_total`, as the table names them.
    let exposed: BTreeSet<String> = text
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .map(|line| {
            let (name, kind) = line.split_once(' ').unwrap();
            if kind == "counter" {
                format!("{name}_total")
            } else {
                name.to_owned()
            }
        })
        .collect();
    assert!(exposed.len() > 20, "{text}");
    let documented: BTreeSet<String> = column(&section("Metrics"), 0)
        .into_iter()
        .filter(|word| word.starts_with("payledger_") || word.starts_with("process_"))
        .collect();
    assert_eq!(
        exposed.difference(&documented).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "families of /metrics missing from the metrics table"
    );
    assert_eq!(
        documented.difference(&exposed).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "names in the metrics table that /metrics does not expose"
    );
    let _ = stop.send(());
    server.await.unwrap().unwrap();
}
