//! `payledger audit` as an operator runs it: a checkpoint past the journal's end is refused, a
//! night with no settled entry still checks the balances of each currency, and a file without
//! a ledger is named and left as it was.

use crate::common;

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

/// A full audit of `url` that counts every entry as settled, with `extra` arguments.
fn full_audit(url: &str, extra: &[&str]) -> (bool, String) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_payledger"))
        .args(["audit", "--database-url", url, "--settled-after-seconds", "0"])
        .args(extra)
        .output()
        .unwrap();
    (
        output.status.success(),
        format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr)),
    )
}

#[tokio::test]
async fn a_digest_kept_outside_the_database_proves_its_history_and_names_the_account_rewritten() {
    use payledger::domain::{AccountId, Actor, Amount, Currency, RequestId};
    use payledger::ledger::{Deposit, Guards, OpenAccount};
    use payledger::store::chain;
    use sqlx::Row as _;

    let directory = tempfile::tempdir().unwrap();
    let ledger = common::sqlite_ledger(directory.path()).await;
    let usd = Currency::parse("currency", "USD").unwrap();
    for name in ["alice", "bob"] {
        let account_id = AccountId::parse("account_id", name).unwrap();
        ledger.open_account(OpenAccount { account_id, currency: usd }, &Guards::default()).await.unwrap();
        for request in ["first", "second"] {
            let deposit = Deposit {
                request_id: RequestId::parse("request_id", &format!("{name}-{request}")).unwrap(),
                account_id: AccountId::parse("account_id", name).unwrap(),
                amount: Amount::parse("amount", "10.00", usd).unwrap(),
                created_by: Actor::Anonymous,
            };
            ledger.deposit(deposit, &Guards::default()).await.unwrap();
        }
    }
    let url = format!("sqlite:{}", directory.path().join("ledger.db").display());
    // Named as an operator would date it: a file, not a digest, though its name starts alike.
    let file = directory.path().join("payledger-digest-2026-12-03.txt");
    let file_arg = file.to_str().unwrap();

    let (passed, output) = full_audit(&url, &["--digest-file", file_arg]);
    assert!(passed, "{output}");
    let digest = output.lines().find_map(|line| line.strip_prefix("digest: ")).expect("a digest is printed").to_owned();
    let kept = std::fs::read_to_string(&file).unwrap();
    assert_eq!(kept.lines().next(), Some(digest.as_str()));
    assert!(kept.lines().any(|line| line.starts_with("alice ")) && kept.lines().any(|line| line.starts_with("bob ")));
    let line_only = directory.path().join("digest-line.txt");
    std::fs::write(&line_only, format!("digest: {digest}\n")).unwrap();
    let printed = format!("digest: {digest}");
    for given in [digest.as_str(), printed.as_str(), file_arg, line_only.to_str().unwrap()] {
        let (passed, output) = full_audit(&url, &["--verify-digest", given]);
        assert!(passed && output.contains("the digest holds"), "{given}: {output}");
    }

    // bob's first entry rewritten with every hash after it and his chain_hash: consistent, so
    // no check of the database sees it; the digest does.
    let rows = ledger
        .store()
        .on_pooled_session(
            "SELECT entry_id, currency, amount, balance_after, version_after, kind, reference, posting_id, \
             counterparty_account_id, created_at, created_by FROM journal_entries WHERE account_id = 'bob' ORDER BY entry_id",
        )
        .await
        .unwrap();
    let mut previous = chain::GENESIS;
    for (index, row) in rows.iter().enumerate() {
        let reference: String = row.get(6);
        let reference = if index == 0 { format!("{reference}-rewritten") } else { reference };
        let (kind, posting_id, counterparty, created_by): (String, String, String, String) =
            (row.get(5), row.get(7), row.get(8), row.get(10));
        let currency: String = row.get(1);
        let entry = chain::ChainedEntry {
            account_id: "bob",
            currency: &currency,
            amount: row.get(2),
            balance_after: row.get(3),
            version_after: row.get(4),
            kind: &kind,
            reference: &reference,
            posting_id: &posting_id,
            counterparty_account_id: &counterparty,
            created_at: row.get(9),
            created_by: &created_by,
        };
        previous = chain::entry_hash(&previous, &entry);
        let hash = chain::to_hex(&previous);
        let entry_id: i64 = row.get(0);
        let update = format!(
            "UPDATE journal_entries SET reference = '{reference}', entry_hash = '{hash}' WHERE entry_id = {entry_id}"
        );
        ledger.store().on_pooled_session(&update).await.unwrap();
        let head = format!("UPDATE accounts SET chain_hash = '{hash}' WHERE account_id = 'bob'");
        ledger.store().on_pooled_session(&head).await.unwrap();
    }
    let (passed, output) = full_audit(&url, &[]);
    assert!(passed, "a consistent rewrite passes every check of the database: {output}");
    let (passed, output) = full_audit(&url, &["--verify-digest", &digest]);
    assert!(!passed && output.contains("VIOLATION") && output.contains("differs"), "{output}");
    let (passed, output) = full_audit(&url, &["--verify-digest", file_arg]);
    assert!(!passed && output.contains("account bob: its history up to the entry changed"), "{output}");

    // A kept file whose lines no longer make its digest is refused as such, before the audit.
    std::fs::write(&file, kept.replace("alice ", "alicia ")).unwrap();
    let (passed, output) = full_audit(&url, &["--verify-digest", file_arg]);
    assert!(!passed && output.contains("the file was changed after it was written"), "{output}");
    assert!(!output.contains("audit:"), "refused before the audit ran: {output}");
    // bob put back as he was (his rows rewritten again, now to the originals) is not needed
    // here: money minted outside the chain, in entries below the digest's entry (ids below 1,
    // recorded as unchained), passes every check of the database but changes the digest.
    let mint = [
        "INSERT INTO accounts (account_id, currency, kind, balance, version, created_at, updated_at, held) VALUES \
         ('@external:EUR', 'EUR', 'EXTERNAL', -500000, 1, 1, 1, 0), ('mallory', 'EUR', 'CUSTOMER', 500000, 1, 1, 1, 0)",
        "INSERT INTO deposits (request_id, deposit_id, account_id, amount, currency, created_at, created_by, held_after) \
         VALUES ('mallory-funds', 'D0evil', 'mallory', 500000, 'EUR', 1, 'anonymous', 0)",
        "INSERT INTO journal_entries (entry_id, account_id, currency, amount, balance_after, version_after, kind, \
         reference, posting_id, counterparty_account_id, created_at, created_by) VALUES \
         (-2, '@external:EUR', 'EUR', -500000, -500000, 1, 'DEPOSIT', 'mallory-funds', 'D0evil', 'mallory', 1, 'anonymous'), \
         (-1, 'mallory', 'EUR', 500000, 500000, 1, 'DEPOSIT', 'mallory-funds', 'D0evil', '@external:EUR', 1, 'anonymous')",
        "INSERT INTO unchained_entries (first_entry_id, last_entry_id, written_by) VALUES (-2, -1, 'before the hash chain')",
    ];
    for statement in mint {
        ledger.store().on_pooled_session(statement).await.unwrap();
    }
    std::fs::write(&file, &kept).unwrap();
    let (passed, output) = full_audit(&url, &["--verify-digest", file_arg]);
    assert!(!passed && output.contains("VIOLATION"), "{output}");
    assert!(output.contains("an id below 1"), "{output}");
    // A digest of something else is refused as malformed.
    let (passed, output) = full_audit(&url, &["--verify-digest", "payledger-digest-v1:nonsense"]);
    assert!(!passed && output.contains("not a payledger digest"), "{output}");
}
