//! `payledger audit --from-entry` as an operator runs it: a checkpoint past the journal's end
//! is refused, and a night with no settled entry still checks the balances of each currency.

mod common;

fn audit(url: &str, from_entry: &str) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_payledger"))
        .args(["audit", "--database-url", url, "--from-entry", from_entry])
        .output()
        .unwrap()
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
