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

/// The progress lines of `command` (`seed`, `bench`) on its stderr.
fn progress_lines(output: &Output, command: &str) -> Vec<String> {
    let stderr = String::from_utf8_lossy(&output.stderr);
    let prefix = format!("{command}: ");
    stderr.lines().filter(|line| line.starts_with(&prefix)).map(str::to_owned).collect()
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

    assert_eq!(progress_lines(&quiet, "seed"), Vec::<String>::new(), "off a terminal, auto is quiet");
    assert_eq!(progress_lines(&never, "seed"), Vec::<String>::new());
    let lines = progress_lines(&always, "seed");
    let last = lines.last().expect("a progress line at least at the end");
    let (done, total) = last
        .strip_prefix("seed: ")
        .and_then(|rest| rest.split_once(" statements"))
        .map_or(("", ""), |(counts, _)| counts.split_once(" of ").unwrap_or(("", "")));
    assert!(!total.is_empty() && done == total, "the last line reports every statement done: {last}");
    assert_eq!(verdict(&always), verdict(&quiet), "stdout is the same with progress shown");
    assert!(!verdict(&quiet).contains("seed: "), "no progress on stdout");
}

/// A server of the tools' own (`storm-instance`, which serves as `payledger serve` does) on a
/// temporary SQLite file, stopped when dropped.
struct Server {
    child: std::process::Child,
    target: String,
}

impl Server {
    /// Starts the server on a port the kernel picks and learns which from its first stdout
    /// line: a port probed here and freed before the server binds it could be taken in between
    /// by a storm test running beside this one.
    fn start(directory: &std::path::Path) -> Self {
        use std::io::BufRead;
        let mut child = Command::new(env!("CARGO_BIN_EXE_payledger-tools"))
            .args(["storm-instance", "--listen", "127.0.0.1:0", "--database-url"])
            .arg(format!("sqlite:{}", directory.join("bench.db").display()))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let address = line.trim_end().strip_prefix("listening ").unwrap_or_else(|| panic!("not listening: {line:?}"));
        let target = format!("http://{address}");
        std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
        Self { child, target }
    }

    fn bench(&self, progress: Option<&str>) -> Output {
        let mut command = Command::new(env!("CARGO_BIN_EXE_payledger-tools"));
        command.args(["bench", "--allow-test-data", "--target", &self.target, "--scenario", "pay", "--json"]);
        command.args(["-c", "2", "-n", "20", "--payers", "4", "--merchants", "2"]);
        if let Some(progress) = progress {
            command.args(["--progress", progress]);
        }
        let output = command.output().unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        output
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The report `bench --json` prints on stdout, parsed.
fn bench_report(output: &Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout.lines().find_map(|line| line.strip_prefix("bench-report: ")).expect("a bench-report line");
    serde_json::from_str(line).expect("the report is one JSON document")
}

#[test]
fn bench_reports_progress_only_where_asked_and_never_in_its_machine_readable_output() {
    let directory = tempfile::tempdir().unwrap();
    let server = Server::start(directory.path());
    let quiet = server.bench(None);
    let never = server.bench(Some("never"));
    let always = server.bench(Some("always"));

    assert_eq!(progress_lines(&quiet, "bench"), Vec::<String>::new(), "off a terminal, auto is quiet");
    assert_eq!(progress_lines(&never, "bench"), Vec::<String>::new());
    let lines = progress_lines(&always, "bench");
    let last = lines.last().expect("a progress line at least at the end");
    assert!(last.starts_with("bench: 20 of 20 calls (100%)"), "the last line reports every call done: {last}");
    for output in [&quiet, &never, &always] {
        let report = bench_report(output);
        assert_eq!(report["count"], 20, "{report}");
        assert_eq!(report["status_codes"]["Ok"], 20, "{report}");
        assert!(!String::from_utf8_lossy(&output.stdout).contains("bench: "), "no progress on stdout");
    }
}
