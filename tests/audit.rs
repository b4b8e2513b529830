//! `payledger audit` as an operator runs it: a checkpoint past the journal's end is refused, a
//! night with no settled entry still checks the balances of each currency, and a file without
//! a ledger is named and left as it was.

mod common;

fn audit(url: &str, from_entry: &str) -> std::process::Output {
    audit_with(url, from_entry, &[])
}

fn audit_with(url: &str, from_entry: &str, extra: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_payledger"))
        .args(["audit", "--database-url", url, "--from-entry", from_entry])
        .args(extra)
        .output()
        .unwrap()
}

/// The lines of an audit's progress on its stderr.
fn progress_lines(output: &std::process::Output) -> Vec<String> {
    let stderr = String::from_utf8_lossy(&output.stderr);
    stderr.lines().filter(|line| line.starts_with("audit: check ")).map(str::to_owned).collect()
}

#[tokio::test]
async fn an_audit_from_a_checkpoint_refuses_one_past_the_journal_and_still_sums_each_currency() {
    let directory = tempfile::tempdir().unwrap();
    let ledger = common::sqlite_ledger(directory.path()).await;
    drop(ledger);
    let url = format!("sqlite:{}", directory.path().join("ledger.db").display());

    let quiet = audit(&url, "0");
    let stdout = String::from_utf8_lossy(&quiet.stdout);
    assert!(quiet.status.success(), "{stdout}");
    // Progress: none where stderr is not a terminal (here) or when asked for none; with
    // `--progress always`, each check as it finishes, the last numbered as the total; stdout
    // the same either way.
    assert_eq!(progress_lines(&quiet), Vec::<String>::new());
    assert_eq!(progress_lines(&audit_with(&url, "0", &["--progress", "never"])), Vec::<String>::new());
    let shown = audit_with(&url, "0", &["--progress", "always"]);
    let steps = progress_lines(&shown);
    assert!(steps.len() > 1 && steps[0].starts_with("audit: check 1 of "), "{steps:?}");
    let total = steps.len().to_string();
    assert!(steps.last().unwrap().starts_with(&format!("audit: check {total} of {total} done in ")), "{steps:?}");
    assert_eq!(String::from_utf8_lossy(&shown.stdout), stdout, "progress never reaches stdout");
    assert!(stdout.contains("no settled journal entry after 0") && stdout.contains("checkpoint: entry 0"), "{stdout}");

    let mistyped = audit(&url, "1");
    let stderr = String::from_utf8_lossy(&mistyped.stderr);
    assert!(!mistyped.status.success());
    assert!(stderr.contains("--from-entry 1 is past the journal's newest entry (0)"), "{stderr}");

    // Money from nowhere: an account whose balance no entry wrote.
    let raw = sqlx::SqlitePool::connect(&url).await.unwrap();
    sqlx::query(
        "INSERT INTO accounts (account_id, currency, kind, balance, version, created_at, updated_at) \
         VALUES ('mallory', 'USD', 'CUSTOMER', 500, 0, 0, 0)",
    )
    .execute(&raw)
    .await
    .unwrap();
    raw.close().await;
    let broken = audit(&url, "0");
    let stdout = String::from_utf8_lossy(&broken.stdout);
    assert!(!broken.status.success(), "{stdout}");
    assert!(stdout.contains("balances of each currency sum to zero: USD (sum 500)"), "{stdout}");
}

/// The audit reads: a file that holds no ledger is named as such at once, and left as it was.
#[test]
fn an_audit_of_a_file_without_a_ledger_names_the_cause_and_writes_nothing() {
    let directory = tempfile::tempdir().unwrap();
    let empty = directory.path().join("empty.db");
    let junk = directory.path().join("junk.db");
    std::fs::write(&empty, b"").unwrap();
    std::fs::write(&junk, b"not a database\n").unwrap();
    for (file, cause) in [(&empty, "no such table: accounts"), (&junk, "file is not a database")] {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_payledger"))
            .args(["audit", "--database-url"])
            .arg(format!("sqlite:{}", file.display()))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success());
        assert!(stderr.contains("no payledger ledger at") && stderr.contains(cause), "{stderr}");
    }
    assert_eq!(std::fs::metadata(&empty).unwrap().len(), 0, "the empty file is not made a database");
    let mut names: Vec<_> =
        std::fs::read_dir(directory.path()).unwrap().map(|entry| entry.unwrap().file_name()).collect();
    names.sort();
    assert_eq!(names, ["empty.db", "junk.db"], "no -wal or -shm beside them");
}

/// A database server that accepts the audit's connection and never answers: the audit fails
/// after `--connect-timeout-seconds`, naming the database and the setting, instead of hanging.
#[test]
fn an_audit_of_a_database_that_never_answers_fails_naming_its_connect_timeout() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    // Accepts every connection and holds it open, silent.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming() {
            held.push(stream);
        }
    });
    for url in [
        format!("postgres://auditor:secret@127.0.0.1:{port}/ledger"),
        format!("mysql://auditor:secret@127.0.0.1:{port}/ledger"),
    ] {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_payledger"))
            .args(["audit", "--connect-timeout-seconds", "1", "--database-url", &url])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // A guard against the hang itself, far above the 1 s asked for (not a measure of it).
        let guard = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while child.try_wait().unwrap().is_none() {
            if std::time::Instant::now() > guard {
                child.kill().unwrap();
                panic!("the audit of {url} still waits after 60 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let output = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success());
        assert!(
            stderr.contains("no answer from the database at") && stderr.contains("--connect-timeout-seconds"),
            "{stderr}"
        );
        assert!(!stderr.contains("secret"), "the password is never printed: {stderr}");
    }
}
