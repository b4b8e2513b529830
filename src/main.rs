//! The `payledger` command: `serve`, `audit` and `auth` (keys and tokens for local use). The
//! test tools (demo, bench, storm) are the separate `payledger-tools` binary.

use std::process::ExitCode;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use payledger::config::{AuditSettings, DatabaseSettings, HealthSettings, LogSettings, ServeSettings};
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
    Serve(Box<ServeSettings>),
    /// Apply the database migrations this release needs, then exit (a pre-deploy Job or init
    /// container; pair it with `serve --migrations check`).
    Migrate(Box<DatabaseSettings>),
    /// Check the ledger invariants; exits 1 on any violation.
    Audit(AuditSettings),
    /// Ask a running server's gRPC health service; exits 0 when SERVING, 1 otherwise.
    Health(HealthSettings),
    /// Development aid: a signing key pair and tokens for local use (production tokens come
    /// from your identity provider; payledger needs only its JWKS).
    #[command(subcommand)]
    Auth(AuthCommand),
    /// Print the OpenAPI 3.0 document of the HTTP/JSON API (what a server serves at
    /// /v1/openapi.json; docs/http.md).
    Openapi,
}

#[derive(Debug, Subcommand)]
enum AuthCommand {
    /// Writes a new Ed25519 signing key (`jwt-signing-key.pem`, owner-only) and its public
    /// JWKS (`jwks.json`, for `serve --auth-jwks`) into a directory.
    Keygen {
        /// Directory to write both files into (created if missing).
        #[arg(long, default_value = ".")]
        dir: PathBuf,
        /// Key type: EdDSA (Ed25519) or ES256 (P-256).
        #[arg(long, default_value = "EdDSA", value_parser = ["EdDSA", "ES256"])]
        algorithm: String,
        /// Replace a signing key already in the directory (tokens it signed stop verifying).
        #[arg(long)]
        force: bool,
    },
    /// Prints a signed JWT for local use.
    Mint {
        /// The private key written by `auth keygen` (PKCS #8 PEM; RS256 keys too).
        #[arg(long, default_value = "jwt-signing-key.pem")]
        key: PathBuf,
        /// The caller's identity (`sub`): 1-128 printable ASCII characters, no spaces.
        #[arg(long)]
        sub: String,
        /// merchant_ids the caller may act for, comma-separated, or `*` for all (none: a token
        /// for AccountService scopes only).
        #[arg(long, value_delimiter = ',')]
        merchants: Vec<String>,
        /// Space-separated scopes: payments:write payments:read accounts:write accounts:read
        /// accounts:admin.
        #[arg(long)]
        scope: String,
        /// `iss`, as `serve --auth-issuer` expects it.
        #[arg(long, default_value = "payledger-dev")]
        issuer: String,
        /// `aud`, as `serve --auth-audience` expects it.
        #[arg(long, default_value = "payledger")]
        audience: String,
        /// Seconds until the token expires.
        #[arg(long, default_value_t = 3600)]
        ttl_seconds: u64,
    },
}

fn openapi() -> Result<ExitCode, AnyError> {
    print!("{}", payledger::http::openapi_document(payledger::proto::FILE_DESCRIPTOR_SET)?);
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Command::Serve(settings) = &cli.command {
        if let Some(threads) = settings.worker_threads {
            runtime.worker_threads(usize::from(threads));
        }
    }
    match runtime.enable_all().build() {
        Ok(runtime) => runtime.block_on(run(cli)),
        Err(error) => {
            eprintln!("payledger: cannot start the async runtime: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> ExitCode {
    let _telemetry = match telemetry::init(&cli.log) {
        Ok(telemetry) => telemetry,
        Err(error) => {
            eprintln!("payledger: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Command::Serve(settings) => serve(*settings).await,
        Command::Migrate(settings) => migrate(&settings).await,
        Command::Audit(settings) => audit(settings).await,
        Command::Health(settings) => health(settings).await,
        Command::Auth(command) => auth(command),
        Command::Openapi => openapi(),
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

async fn migrate(settings: &DatabaseSettings) -> Result<ExitCode, AnyError> {
    let applied = payledger::startup::migrate(settings).await?;
    let database = payledger::store::redacted(&settings.database_url);
    if applied.is_empty() {
        eprintln!("payledger: nothing to apply: the schema of {database} is complete");
    } else {
        let versions: Vec<String> = applied.iter().map(i64::to_string).collect();
        eprintln!(
            "payledger: migrations {} applied (by this run, or by an instance migrating beside it): the schema of {database} is complete",
            versions.join(", ")
        );
    }
    Ok(ExitCode::SUCCESS)
}

async fn serve(settings: ServeSettings) -> Result<ExitCode, AnyError> {
    let application = Application::build(&settings).await?;
    tracing::info!(
        listen = %application.local_addr(),
        backend = application.ledger().store().dialect().name(),
        galera = application.ledger().store().is_galera(),
        funding_account_shards = application.ledger().funding_account_shards(),
        authentication = application.authentication(),
        transport = application.transport_security(),
        metrics = %application.metrics_addr().map_or_else(|| "off".to_owned(), |address| format!("http://{address}/metrics")),
        traces = telemetry::traces_exported(),
        "payledger serving"
    );
    application.run_until(shutdown_signal()).await?;
    Ok(ExitCode::SUCCESS)
}

fn auth(command: AuthCommand) -> Result<ExitCode, AnyError> {
    use payledger::auth::dev::{SigningKey, TokenClaims, JWKS_FILE, PRIVATE_KEY_FILE};
    match command {
        AuthCommand::Keygen { dir, algorithm, force } => {
            if let Some(existing) = [PRIVATE_KEY_FILE, JWKS_FILE]
                .iter()
                .map(|name| dir.join(name))
                .find(|path| path.exists())
                .filter(|_| !force)
            {
                let shown = existing.display().to_string();
                return Err(
                    format!("{shown} exists; pass --force to replace it (tokens it signed stop verifying)").into()
                );
            }
            let algorithm =
                if algorithm == "ES256" { jsonwebtoken::Algorithm::ES256 } else { jsonwebtoken::Algorithm::EdDSA };
            let key = SigningKey::generate(algorithm)?;
            key.write(&dir)?;
            println!(
                "wrote {} (private, keep it secret) and {} (kid {})",
                dir.join(PRIVATE_KEY_FILE).display(),
                dir.join(JWKS_FILE).display(),
                key.kid()
            );
        }
        AuthCommand::Mint { key, sub, merchants, scope, issuer, audience, ttl_seconds } => {
            check_claims(&sub, &merchants, &scope)?;
            if issuer.is_empty() || audience.is_empty() || ttl_seconds == 0 {
                return Err("--issuer and --audience must not be empty, and --ttl-seconds must be at least 1".into());
            }
            let key = SigningKey::read(&key)?;
            let claims = TokenClaims { issuer, audience, subject: sub, merchants, scope, ttl_seconds };
            println!("{}", key.sign(&claims.to_json())?);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Refuses to mint a token that `serve` would refuse or that grants nothing it says.
fn check_claims(sub: &str, merchants: &[String], scope: &str) -> Result<(), AnyError> {
    use payledger::auth::Permission;
    use payledger::domain::{MerchantId, Subject};
    if Subject::parse(sub).is_none() {
        return Err(format!(
            "--sub must be 1-{} printable ASCII characters without spaces, not `anonymous` or `unknown`",
            Subject::LEN_MAX
        )
        .into());
    }
    for merchant in merchants {
        if merchant != "*" && MerchantId::parse("merchants", merchant).is_err() {
            return Err(format!("--merchants: {merchant:?} is not a merchant_id ([A-Za-z0-9._:-], 1-64) or *").into());
        }
    }
    for name in scope.split(' ') {
        if Permission::parse(name).is_none() {
            let known: Vec<&str> = Permission::ALL.iter().map(|permission| permission.as_str()).collect();
            return Err(format!("--scope: {name:?} is not one of {} (space-separated)", known.join(" ")).into());
        }
    }
    Ok(())
}

async fn health(settings: HealthSettings) -> Result<ExitCode, AnyError> {
    use payledger::client::{endpoint, ClientTls};
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let target = settings.target();
    let tls = if target.starts_with("https://") {
        let identity_pem = match (&settings.tls_cert, &settings.tls_key) {
            (Some(cert), Some(key)) => Some((std::fs::read(cert)?, std::fs::read(key)?)),
            _ => None,
        };
        let ca_certificate_pem = settings.tls_ca.as_ref().map(std::fs::read).transpose()?;
        Some(ClientTls { ca_certificate_pem, identity_pem, domain_name: settings.tls_domain.clone() })
    } else {
        None
    };
    let wait = std::time::Duration::from_millis(settings.timeout_ms);
    let channel = endpoint(&target, tls.as_ref())?.connect_timeout(wait).timeout(wait);
    let asked = async {
        let mut client = HealthClient::new(channel.connect().await?);
        let answer = client.check(HealthCheckRequest { service: settings.service.clone() }).await?;
        Ok::<_, AnyError>(answer.into_inner().status())
    };
    let asked = tokio::time::timeout(wait, asked)
        .await
        .map_err(|_| AnyError::from("no answer in time"))
        .and_then(|asked| asked);
    let status = asked.map_err(|error| -> AnyError {
        let said = payledger::startup::error_chain(&*error);
        // A plaintext call to a TLS port ends as a closed or cancelled connection.
        let closed = said.contains("closed") || said.contains("cancelled");
        let hint =
            if closed && target.starts_with("http://") { " (if it serves TLS, use an https:// target)" } else { "" };
        format!("cannot ask {target} for its health: {said}{hint}").into()
    })?;
    println!("{}", status.as_str_name());
    Ok(if status == ServingStatus::Serving { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

async fn audit(settings: AuditSettings) -> Result<ExitCode, AnyError> {
    let limit = std::time::Duration::from_secs(settings.timeout_seconds);
    tokio::time::timeout(limit, audit_within(&settings)).await.unwrap_or_else(|_| {
        Err(format!(
            "the audit did not finish within {} s (--timeout-seconds); nothing was concluded",
            settings.timeout_seconds
        )
        .into())
    })
}

async fn audit_within(settings: &AuditSettings) -> Result<ExitCode, AnyError> {
    // A malformed digest is refused before the audit runs, not after.
    let kept = settings.verify_digest.as_deref().map(read_kept_digest).transpose()?;
    let connect_limit = std::time::Duration::from_secs(settings.connect_timeout_seconds);
    let ledger = tokio::time::timeout(connect_limit, open_existing_ledger(settings)).await.map_err(|_| {
        format!(
            "no answer from the database at {} within {} s of connecting (--connect-timeout-seconds)",
            payledger::store::redacted(&settings.database_url),
            settings.connect_timeout_seconds
        )
    })??;
    let settled_before = std::time::SystemTime::now() - std::time::Duration::from_secs(settings.settled_after_seconds);
    let settled_before = settled_before.duration_since(std::time::UNIX_EPOCH)?.as_micros();
    // Taken before the checks run: a full audit covers at least every entry up to it.
    let checkpoint = ledger.settled_entry(i64::try_from(settled_before)?).await?;
    let newest = ledger.settled_entry(i64::MAX).await?;
    // Each check as it finishes, on stderr (a full audit of a large ledger runs for minutes;
    // stdout keeps the violations and the verdict).
    let shown = settings.progress.shown();
    let mut started = std::time::Instant::now();
    let mut report = |step: payledger::store::AuditProgress| {
        if !shown {
            return;
        }
        eprintln!(
            "audit: check {} of {} done in {:.1} s, {} violation(s): {}",
            step.done,
            step.of,
            started.elapsed().as_secs_f64(),
            step.violations,
            step.check
        );
        started = std::time::Instant::now();
    };
    let (violations, covered, next) = match settings.from_entry {
        None => (ledger.audit_reporting(&mut report).await?, "the ledger is".to_owned(), checkpoint),
        // A checkpoint is an id an earlier audit printed, never past the journal's end: a
        // mistyped one would otherwise check nothing, night after night.
        Some(after) if after > newest => {
            return Err(format!(
                "--from-entry {after} is past the journal's newest entry ({newest}): give the checkpoint an earlier audit printed"
            )
            .into());
        }
        // Nothing settled since: the range is empty, and the balances of each currency are
        // still checked.
        Some(after) if after >= checkpoint => (
            ledger.audit_entries_reporting(after, after, &mut report).await?,
            format!(
                "no settled journal entry after {after} ({} newer, audited once {} s old); the currency sums are",
                newest - after,
                settings.settled_after_seconds
            ),
            after,
        ),
        Some(after) => (
            ledger.audit_entries_reporting(after, checkpoint, &mut report).await?,
            format!("journal entries {} to {checkpoint} are", after + 1),
            checkpoint,
        ),
    };
    for violation in &violations {
        println!("VIOLATION {}: {} ({})", violation.check, violation.subject, violation.detail);
    }
    if !violations.is_empty() {
        println!("audit: {} violation(s)", violations.len());
        return Ok(ExitCode::FAILURE);
    }
    if let Some(given) = &kept {
        if let Some(changed) = digest_changed(&ledger, given, newest).await? {
            println!(
                "VIOLATION the journal up to the digest's entry is as it was when the digest was taken: {changed}"
            );
            println!("audit: 1 violation(s)");
            return Ok(ExitCode::FAILURE);
        }
        println!("audit: the digest holds: no journal entry up to its entry changed since it was taken");
    }
    println!("audit: {covered} consistent; checkpoint: entry {next} (next: payledger audit --from-entry {next})");
    let (digest, heads) = ledger.journal_digest(next).await?;
    println!("digest: {digest}");
    if let Some(path) = &settings.digest_file {
        let mut text = format!("{digest}\n");
        for (account_id, head) in &heads {
            text.push_str(&format!("{account_id} {}\n", payledger::store::chain::to_hex(head)));
        }
        std::fs::write(path, text)
            .map_err(|error| format!("cannot write the digest to {}: {error}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// A digest kept outside the database, as `--verify-digest` gives it: the digest, and the leaves
/// it was made of when it was given as the file `--digest-file` wrote.
type KeptDigest = (payledger::store::chain::JournalDigest, Option<Vec<(String, payledger::store::chain::Hash)>>);

/// Reads `given`: an existing file (its first line the digest, optionally after `digest: `,
/// then `name hash` lines, which must make that digest; a file of the digest line alone is a
/// digest without leaves), or else a digest as the audit prints it.
///
/// # Errors
/// A malformed digest or line; a file whose lines do not make its digest.
fn read_kept_digest(given: &str) -> Result<KeptDigest, AnyError> {
    use payledger::store::chain::{self, JournalDigest};
    let digest_of = |line: &str| line.trim().trim_start_matches("digest:").trim().parse::<JournalDigest>();
    if !std::path::Path::new(given).is_file() {
        return Ok((digest_of(given)?, None));
    }
    let text =
        std::fs::read_to_string(given).map_err(|error| format!("cannot read the digest file {given}: {error}"))?;
    let mut lines = text.lines().map(|line| line.trim_start_matches('\u{feff}').trim()).filter(|line| !line.is_empty());
    let kept = digest_of(lines.next().unwrap_or_default()).map_err(|error| format!("{given}: {error}"))?;
    let mut leaves = Vec::new();
    for line in lines {
        let leaf =
            line.rsplit_once(' ').and_then(|(name, head)| Some((name.trim_end().to_owned(), chain::from_hex(head)?)));
        leaves.push(leaf.ok_or_else(|| format!("{given}: not a `name hash` line: {line}"))?);
    }
    if leaves.is_empty() {
        return Ok((kept, None));
    }
    if JournalDigest::of(kept.upto_entry, &leaves) != kept {
        return Err(
            format!("{given}: its lines do not make its digest: the file was changed after it was written").into()
        );
    }
    Ok((kept, Some(leaves)))
}

/// What changed in the journal since `kept` was taken: `None` when its root is the ledger's root
/// at the digest's entry now; else the first leaf that differs, when the kept file names them.
async fn digest_changed(
    ledger: &payledger::ledger::Ledger,
    (kept, leaves): &KeptDigest,
    newest: i64,
) -> Result<Option<String>, AnyError> {
    if kept.upto_entry > newest {
        return Ok(Some(format!(
            "the digest covers entry {}, past the journal's newest entry {newest}: entries were deleted, or it is another ledger's",
            kept.upto_entry
        )));
    }
    let (now, heads) = ledger.journal_digest(kept.upto_entry).await?;
    if now == *kept {
        return Ok(None);
    }
    let Some(leaves) = leaves else {
        return Ok(Some(format!(
            "its root at entry {} differs (now {now}); give the file --digest-file wrote to name the account",
            kept.upto_entry
        )));
    };
    Ok(Some(
        payledger::store::chain::first_difference(leaves, &heads)
            .unwrap_or_else(|| format!("the root at entry {} differs", kept.upto_entry)),
    ))
}
