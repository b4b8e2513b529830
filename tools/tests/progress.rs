//! Progress of the long commands as a script sees it: none when stderr is not a terminal (the
//! default `--progress auto`) or when asked for none, lines on stderr with `--progress always`,
//! and stdout the same whichever.

use std::process::{Command, Output};

fn seed(file: &std::path::Path, progress: Option<&str>) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_payledger-tools"));
    command.args(["seed", "--allow-test-data", "--orders", "300", "--payers", "10", "--merchants", "3"]);
    command.args(["--batch-rows", "50", "--database-url"]).arg(format!("sqlite:{}", file.display()));
    if let Some(progress) = progress {
        command.args(["--progress", progress]);
    }
    let output = command.output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    output
}

fn progress_lines(output: &Output) -> Vec<String> {
    let stderr = String::from_utf8_lossy(&output.stderr);
    stderr.lines().filter(|line| line.starts_with("seed: ")).map(str::to_owned).collect()
}

/// The stdout of a seed without the part that differs from run to run (its time and tag).
fn verdict(output: &Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout);
    stdout.lines().map(|line| line.split(" in ").next().unwrap_or(line).to_owned()).collect::<Vec<_>>().join("\n")
}

#[test]
fn seed_reports_progress_only_where_asked_and_never_on_stdout() {
    let directory = tempfile::tempdir().unwrap();
    let quiet = seed(&directory.path().join("auto.db"), None);
    let never = seed(&directory.path().join("never.db"), Some("never"));
    let always = seed(&directory.path().join("always.db"), Some("always"));

    assert_eq!(progress_lines(&quiet), Vec::<String>::new(), "off a terminal, auto is quiet");
    assert_eq!(progress_lines(&never), Vec::<String>::new());
    let lines = progress_lines(&always);
    let last = lines.last().expect("a progress line at least at the end");
    let (done, total) = last
        .strip_prefix("seed: ")
        .and_then(|rest| rest.split_once(" statements"))
        .map_or(("", ""), |(counts, _)| counts.split_once(" of ").unwrap_or(("", "")));
    assert!(!total.is_empty() && done == total, "the last line reports every statement done: {last}");
    assert_eq!(verdict(&always), verdict(&quiet), "stdout is the same with progress shown");
    assert!(!verdict(&quiet).contains("seed: "), "no progress on stdout");
}
