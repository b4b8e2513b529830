//! Generic idempotency keys and one-time tokens: records in a dedup table
//! (`idempotency_record`, unique on (scope, key)) written in the same transaction as the
//! business change. The idempotency driver (`idempotent.rs`) calls these steps, in order:
//! 1. [`Ledger::open_guards`] (no transaction): a committed, unexpired record of the call's
//!    key or token answers it at once (same method and fingerprint: the stored response,
//!    replayed; otherwise ALREADY_EXISTS).
//! 2. [`GuardSession::reserve_token`] (Redis store only) consumes the token in Redis, one
//!    Lua script, right before the transaction.
//! 3. [`GuardSession::claim`], first thing in the transaction: inserts an IN_PROGRESS record
//!    per guard (a duplicate in flight makes the insert wait for its outcome), and with the
//!    database token store consumes the token by conditional UPDATE.
//! 4. [`GuardSession::complete`], last thing in the transaction: stores the response.
//! 5. [`GuardSession::settle`], after it: a claim that found the key taken is answered from the
//!    committed record; with Redis, a token whose business change failed is restored.
//!
//! A business change that fails rolls the claim back with it: nothing is recorded and a retry
//! runs afresh.

use sha2::{Digest, Sha256};

use crate::domain::{AccountId, Actor, IdempotencyKey, MerchantId, OneTimeToken, Rejection};
use crate::error::Error;
use crate::store::{IdempotencyRecordRow, Queries, RecordCompletion, Savepoint, TokenRow};

use super::engine::batching::CallerPresence;
use super::idempotent::{differing, Fields};
use super::tokens::{RedisConsumption, TokenStore};
use super::{now_micros, Inserted, Ledger, Replayable};
use crate::metrics::Mechanism;

/// The request metadata headers of a client-supplied idempotency key and a one-time token
/// (the wire contract, defined once in the client crate).
pub use payledger_client::{IDEMPOTENCY_KEY_HEADER, IDEMPOTENCY_TOKEN_HEADER};

const RECORD_IN_PROGRESS: &str = "IN_PROGRESS";
const RECORD_COMPLETED: &str = "COMPLETED";
/// The scope of records that hold the response of a consumed one-time token (tokens are
/// random and global, so they need no caller scope).
const TOKEN_SCOPE: &str = "token";

/// What a caller sent beside the request, in metadata headers, parsed.
#[derive(Debug, Clone, Default)]
pub struct Guards {
    /// `idempotency-key`.
    pub idempotency_key: Option<IdempotencyKey>,
    /// `idempotency-token`.
    pub token: Option<OneTimeToken>,
    /// The authenticated caller: its keys and tokens are its own (see [`Actor::scope_tag`]).
    pub actor: Actor,
    /// Whether the caller still waits (a queued Pay whose caller has gone is not started).
    pub presence: CallerPresence,
}

impl Guards {
    /// True when the call carries neither an idempotency key nor a token.
    pub fn is_empty(&self) -> bool {
        self.idempotency_key.is_none() && self.token.is_none()
    }
}

/// Whose keys a call's idempotency key lives among, so two callers' keys never collide.
pub(super) enum Scope<'a> {
    Merchant(&'a MerchantId),
    Account(&'a AccountId),
}

/// The owner of a one-time token as the token stores keep it: the merchant it was issued
/// to, and `/by:<tag>` when it was issued to an authenticated caller (merchant ids hold no
/// `/`).
pub(super) fn token_owner(merchant_id: &str, caller_tag: Option<&str>) -> String {
    match caller_tag {
        Some(tag) => format!("{merchant_id}/by:{tag}"),
        None => merchant_id.to_owned(),
    }
}

/// The caller tag of a token owner written by [`token_owner`].
fn caller_tag_of(owner: &str) -> Option<&str> {
    owner.split_once("/by:").map(|(_, tag)| tag)
}

/// One call as idempotency sees it: method, caller scope and business fields.
pub(super) struct Call {
    method: &'static str,
    /// Whose keys the call's key lives among: `merchant:<id>` or `account:<id>`, with
    /// `/by:<tag>` for an authenticated caller.
    scope: String,
    /// On a merchant-scoped call, the only token owner whose tokens it accepts (its merchant
    /// and caller); `None` on AccountService.
    token_owner: Option<String>,
    /// The caller's scope tag; `None` without authentication.
    caller_tag: Option<String>,
    /// For an authenticated caller, the scope its key had before authentication was turned
    /// on (see [`GuardSession::committed_replay`]).
    unauthenticated_scope: Option<String>,
    /// The business fields, normalized (amounts in minor units).
    fields: Fields,
    /// The same as `name=value` lines, as stored with a record.
    fields_text: String,
    /// Hex SHA-256 of method and fields.
    fingerprint: String,
}

impl Call {
    pub(super) fn new(method: &'static str, scope: Scope<'_>, fields: Fields, actor: &Actor) -> Self {
        let caller_tag = actor.scope_tag();
        let unauthenticated_scope = caller_tag.as_ref().map(|_| match scope {
            Scope::Merchant(merchant_id) => format!("merchant:{merchant_id}"),
            Scope::Account(account_id) => format!("account:{account_id}"),
        });
        let (scope, token_owner) = match scope {
            Scope::Merchant(merchant_id) => {
                let owner = token_owner(merchant_id.as_str(), caller_tag.as_deref());
                (format!("merchant:{owner}"), Some(owner))
            }
            Scope::Account(account_id) => {
                (format!("account:{}", token_owner(account_id.as_str(), caller_tag.as_deref())), None)
            }
        };
        let fields_text: String = fields.iter().map(|(name, value)| format!("{name}={value}\n")).collect();
        let fingerprint = Sha256::digest(format!("{method}\n{fields_text}").as_bytes())
            .iter()
            .map(|byte| format!("{byte:02x}"))
            .collect();
        Self { method, scope, token_owner, caller_tag, unauthenticated_scope, fields, fields_text, fingerprint }
    }

    /// The names of what differs from a stored record: `method` and/or field names.
    fn differences(&self, record: &IdempotencyRecordRow) -> Vec<String> {
        if record.method != self.method {
            return vec!["method".to_owned()];
        }
        if record.request_fingerprint == self.fingerprint {
            return Vec::new();
        }
        let stored_fields = String::from_utf8_lossy(&record.request_fields);
        let stored = stored_fields.lines().filter_map(|line| line.split_once('='));
        let mut fields: Vec<String> = differing(&self.fields, stored).into_iter().map(str::to_owned).collect();
        if fields.is_empty() {
            fields.push("request".to_owned());
        }
        fields
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GuardKind {
    Key,
    Token,
}

/// The guards of one call in progress.
pub(super) struct GuardSession<'a> {
    ledger: &'a Ledger,
    call: &'a Call,
    claims: Vec<(GuardKind, String, String)>,
    token: Option<&'a OneTimeToken>,
    redis: Option<RedisConsumption>,
    /// Whether step 1 saw no record: a claim that then finds the key taken waited for (or
    /// just missed) a duplicate in flight.
    seen_absent: bool,
    /// Whether the guards' records have been read: false for a call bound for a group commit
    /// with an idempotency key alone, whose batch reads them (see [`Ledger::unread_guards`]).
    read: bool,
    /// The replay that a read after the call queued found (its batch's, or its own before it
    /// ran alone), which answers it when its transaction finds its key taken, without
    /// reading the record again (by then it may have expired).
    answered: Option<Replayable<StoredResponse>>,
}

/// The outcome of step 1.
pub(super) enum Opened<'a> {
    Replayed(Replayable<StoredResponse>),
    Run(GuardSession<'a>),
}

/// What a completed record holds to answer a replay with.
/// Why the message as sent: `docs/decisions/005-replays-from-the-stored-response.md`.
#[derive(Debug, Clone)]
pub(super) struct StoredResponse {
    /// The response message as the caller received it (encoded protobuf).
    pub message: Option<Vec<u8>>,
    /// The answer as JSON of rows: all that records written before the message was stored
    /// hold (empty in later records).
    pub json: Vec<u8>,
}

/// The outcome of step 5.
pub(super) enum Settled<T> {
    /// The business change committed: its fresh answer.
    Fresh(Replayable<T>),
    /// A guard of the call was taken by a committed original: its stored response.
    Replayed(Replayable<StoredResponse>),
    /// A natural key (out_trade_no...) was taken and none of the call's guards: the use case
    /// replays by its natural key.
    NaturalKeyTaken,
}

impl Ledger {
    /// Step 1 (see the module docs).
    pub(super) async fn open_guards<'a>(&'a self, guards: &'a Guards, call: &'a Call) -> Result<Opened<'a>, Error> {
        let mut session = self.unread_guards(guards, call);
        if session.claims.is_empty() {
            return Ok(Opened::Run(session));
        }
        if let Some(replayed) = session.committed_replay().await? {
            return Ok(Opened::Replayed(replayed));
        }
        Ok(Opened::Run(session))
    }

    /// The guards of a call before step 1 reads their records. A call bound for a group
    /// commit with an idempotency key alone queues like this: its batch reads the records of
    /// all its calls in one statement ([`BatchClaim::keys_to_read`]), where a read of each
    /// call before it queued cost a pooled connection and a round trip a call. A call with a
    /// token reads first: a Redis token is consumed before the call queues (a retry would
    /// find it used), and a database token's owner is read then anyway.
    pub(super) fn unread_guards<'a>(&'a self, guards: &'a Guards, call: &'a Call) -> GuardSession<'a> {
        let mut claims = Vec::new();
        if let Some(key) = &guards.idempotency_key {
            claims.push((GuardKind::Key, call.scope.clone(), key.as_str().to_owned()));
        }
        if let Some(token) = &guards.token {
            claims.push((GuardKind::Token, TOKEN_SCOPE.to_owned(), token.as_str().to_owned()));
        }
        GuardSession {
            ledger: self,
            call,
            claims,
            token: guards.token.as_ref(),
            redis: None,
            seen_absent: true,
            read: false,
            answered: None,
        }
    }
}

impl GuardSession<'_> {
    /// The first committed, unexpired record of this call's guards, as a replay.
    ///
    /// An authenticated caller's key with no record of its own is also looked up where the
    /// same key lived before authentication was turned on: a record there with this very
    /// method and request is the original of a call retried across the switch, and answers it
    /// (anything else there is another call, and is neither answered nor reported).
    pub(super) async fn committed_replay(&mut self) -> Result<Option<Replayable<StoredResponse>>, Error> {
        if self.claims.is_empty() {
            return Ok(None);
        }
        self.read = true;
        let now = now_micros();
        let mut reader = self.ledger.store.reader().await?;
        let mut queries = reader.queries();
        for (kind, scope, key) in &self.claims {
            let Some(record) = queries.find_record(scope, key).await? else {
                continue;
            };
            if record.expires_at <= now || record.response.is_none() {
                continue;
            }
            self.seen_absent = false;
            if *kind == GuardKind::Token && !self.token_owned_by_caller(&mut queries, &record).await? {
                // A token used before authentication was turned on belongs to no caller now;
                // presented with the key and request of that very call, it is its retry.
                if let Some(replayed) = self.unauthenticated_original(&mut queries, now).await? {
                    return Ok(Some(replayed));
                }
                return Err(Rejection::TokenInvalid.into());
            }
            return self.replay(*kind, record).map(Some);
        }
        self.unauthenticated_original(&mut queries, now).await
    }

    /// For an authenticated caller, the replay of the record its key left before
    /// authentication was turned on, when that record holds this very method and request.
    async fn unauthenticated_original(
        &mut self,
        queries: &mut Queries<'_>,
        now: i64,
    ) -> Result<Option<Replayable<StoredResponse>>, Error> {
        let Some((scope, key)) = self.unauthenticated_key() else { return Ok(None) };
        let Some(record) = queries.find_record(&scope, &key).await? else { return Ok(None) };
        let original = record.expires_at > now && record.response.is_some();
        if !(original && self.call.differences(&record).is_empty()) {
            return Ok(None);
        }
        self.seen_absent = false;
        self.replay(GuardKind::Key, record).map(Some)
    }

    /// For an authenticated caller's idempotency key, (scope, key) where the key lived before
    /// authentication was turned on.
    fn unauthenticated_key(&self) -> Option<(String, String)> {
        let key = self.claims.iter().find(|(kind, _, _)| *kind == GuardKind::Key).map(|(_, _, key)| key.clone())?;
        Some((self.call.unauthenticated_scope.clone()?, key))
    }

    /// Step 1 for a call whose guards were not read before it queued ([`Ledger::unread_guards`])
    /// and that now runs in its own transaction, not in its batch: true when a committed
    /// record answers it (kept for [`GuardSession::settle`]; its transaction is then not run).
    ///
    /// # Errors
    /// ALREADY_EXISTS when its key holds another request.
    pub(super) async fn read_before_alone(&mut self) -> Result<bool, Error> {
        if self.read {
            return Ok(false);
        }
        self.answered = self.committed_replay().await?;
        Ok(self.answered.is_some())
    }

    /// A call whose batch's read found `record`, committed, answering it
    /// ([`BatchClaim::answering_record`]): its replay, kept for [`GuardSession::settle`] (a call
    /// whose guards its batch reads carries an idempotency key alone).
    ///
    /// # Errors
    /// ALREADY_EXISTS when the record holds another request.
    pub(super) fn answer_from_batch(&mut self, record: IdempotencyRecordRow) -> Result<(), Error> {
        self.found_committed_by_batch();
        self.answered = Some(self.replay(GuardKind::Key, record)?);
        Ok(())
    }

    /// A call whose batch found a committed row that answers it: one of its guards' records
    /// ([`BatchClaim::answering_record`]), or its natural key's row, with which its records commit.
    /// For a call whose guards were not read before it queued, the batch's read was its step
    /// 1: the original had committed before it, so its replay is not an in-flight wait.
    pub(super) fn found_committed_by_batch(&mut self) {
        if !self.read {
            self.read = true;
            self.seen_absent = false;
        }
    }

    /// Whether the presented token was issued to this call's caller: a token's record is
    /// keyed by the token alone, so this is what keeps its stored response from another
    /// merchant or caller. The owner comes from the token store, or, where the token is gone
    /// from it, from the record's caller scope: on PaymentService it must be this call's scope
    /// (merchant and caller), on AccountService name this call's caller; a record that names
    /// no caller (written before callers were recorded) is refused. Without authentication, a
    /// token on AccountService is a bearer secret.
    async fn token_owned_by_caller(
        &self,
        queries: &mut Queries<'_>,
        record: &IdempotencyRecordRow,
    ) -> Result<bool, Error> {
        let Some(token) = self.token else { return Ok(true) };
        if self.call.token_owner.is_none() && self.call.caller_tag.is_none() {
            return Ok(true);
        }
        let issued_to = match &self.ledger.tokens {
            TokenStore::Database => queries
                .find_token(token.as_str())
                .await?
                .map(|row| token_owner(&row.merchant_id, row.caller_tag.as_deref())),
            TokenStore::Redis(redis) => redis.issued_to(token).await?,
        };
        Ok(match (issued_to, record.caller_scope.as_deref()) {
            (Some(owner), _) => self.may_use(&owner),
            (None, None) => false,
            // On PaymentService the whole scope (merchant and caller); on AccountService the
            // caller (its token may guard a call from any account).
            (None, Some(scope)) if self.call.token_owner.is_some() => scope == self.call.scope,
            (None, Some(scope)) => caller_tag_of(scope) == self.call.caller_tag.as_deref(),
        })
    }

    fn replay(&self, kind: GuardKind, record: IdempotencyRecordRow) -> Result<Replayable<StoredResponse>, Error> {
        let metrics = &self.ledger.metrics;
        let fields = self.call.differences(&record);
        if !fields.is_empty() {
            return Err(match kind {
                GuardKind::Key => {
                    metrics.key_conflict("IDEMPOTENCY_KEY_REUSED");
                    Error::IdempotencyKeyReused { fields }
                }
                GuardKind::Token => {
                    metrics.key_conflict("TOKEN_REUSED");
                    Error::TokenReused { fields }
                }
            });
        }
        let json = record.response.ok_or_else(|| Error::Internal("a completed record has no response".into()))?;
        let value = StoredResponse { message: record.response_message, json };
        metrics.replay(match kind {
            GuardKind::Key => Mechanism::IdempotencyKey,
            GuardKind::Token => Mechanism::Token,
        });
        Ok(Replayable { value, replayed: true, key_expires_at: self.key_expires_at(kind, record.expires_at) })
    }

    /// True when this call's token has a committed record.
    async fn token_record_committed(&self) -> Result<bool, Error> {
        let Some(token) = self.token else { return Ok(false) };
        let mut reader = self.ledger.store.reader().await?;
        let record = reader.queries().find_record(TOKEN_SCOPE, token.as_str()).await?;
        reader.release();
        Ok(record.is_some_and(|record| record.response.is_some()))
    }

    /// Whether a token issued to `owner` (see [`token_owner`]) may guard this call: on a
    /// merchant-scoped call (PaymentService) only one issued to its merchant and caller; on
    /// AccountService one issued to its caller, for any merchant.
    fn may_use(&self, owner: &str) -> bool {
        match &self.call.token_owner {
            Some(expected) => owner == expected,
            None => caller_tag_of(owner) == self.call.caller_tag.as_deref(),
        }
    }

    fn key_expires_at(&self, kind: GuardKind, expires_at: i64) -> Option<i64> {
        (kind == GuardKind::Key).then_some(expires_at)
    }

    /// When the call's idempotency key will be forgotten, if it has one and it is claimed now.
    fn fresh_key_expires_at(&self, now: i64) -> Option<i64> {
        self.claims
            .iter()
            .any(|(kind, _, _)| *kind == GuardKind::Key)
            .then(|| now.saturating_add(self.ledger.settings.key_ttl_micros()))
    }

    /// With the Redis token store, consumes the token (atomically, in Redis) right before the
    /// transaction; a no-op otherwise.
    ///
    /// # Errors
    /// [`Rejection::TokenInvalid`], [`Error::TokenStore`].
    pub(super) async fn reserve_token(&mut self) -> Result<(), Error> {
        if let (Some(token), TokenStore::Redis(redis)) = (self.token, &self.ledger.tokens) {
            self.redis =
                redis.consume(token, self.call.token_owner.as_deref(), self.call.caller_tag.as_deref()).await?;
        }
        Ok(())
    }

    /// Step 3, inside the transaction: false when a guard is taken (the caller then returns
    /// `Inserted::KeyTaken`, rolls back, and [`GuardSession::settle`] replays the original).
    ///
    /// # Errors
    /// [`Rejection::TokenInvalid`] for an unknown, expired or foreign token (database store).
    pub(super) async fn claim(&self, queries: &mut Queries<'_>, now: i64) -> Result<bool, Error> {
        if let Some(token) = self.database_token() {
            let consumed_now = queries.consume_token(token, now).await?;
            let row = queries.find_token(token).await?.ok_or(Rejection::TokenInvalid)?;
            // A token issued to another merchant or caller is invalid here, consumed or not.
            if !self.may_use(&token_owner(&row.merchant_id, row.caller_tag.as_deref())) {
                return Err(Rejection::TokenInvalid.into());
            }
            if !consumed_now {
                return consumed_before(Some(&row));
            }
        }
        claim_records(queries, &self.records(now), now).await
    }

    /// The call's token when the database token store consumes it inside the transaction.
    fn database_token(&self) -> Option<&str> {
        match (self.token, &self.ledger.tokens) {
            (Some(token), TokenStore::Database) => Some(token.as_str()),
            _ => None,
        }
    }

    /// The IN_PROGRESS records that claim the call's guards at `now`.
    fn records(&self, now: i64) -> Vec<IdempotencyRecordRow> {
        let expires_at = now.saturating_add(self.ledger.settings.key_ttl_micros());
        self.claims
            .iter()
            .map(|(_, scope, key)| IdempotencyRecordRow {
                scope: scope.clone(),
                idempotency_key: key.clone(),
                method: self.call.method.to_owned(),
                request_fingerprint: self.call.fingerprint.clone(),
                request_fields: self.call.fields_text.clone().into_bytes(),
                response: None,
                response_message: None,
                caller_scope: Some(self.call.scope.clone()),
                status: RECORD_IN_PROGRESS.to_owned(),
                created_at: now,
                expires_at,
            })
            .collect()
    }

    /// Step 3 as a group commit runs it: what its transaction claims for this call at `now`
    /// (as later given to [`GuardSession::settle`]). With the database token store the
    /// token's owner is checked here, before the call is queued: it never changes once
    /// issued, and a token the call may not use is refused with nothing written.
    ///
    /// # Errors
    /// [`Rejection::TokenInvalid`] for an unknown or foreign token (database store).
    pub(super) async fn batch_claim(&self, now: i64) -> Result<BatchClaim, Error> {
        let consume_token = self.database_token().map(str::to_owned);
        if let Some(token) = &consume_token {
            let mut reader = self.ledger.store.reader().await?;
            let row = reader.queries().find_token(token).await?;
            reader.release();
            let row = row.ok_or(Rejection::TokenInvalid)?;
            if !self.may_use(&token_owner(&row.merchant_id, row.caller_tag.as_deref())) {
                return Err(Rejection::TokenInvalid.into());
            }
        }
        let records_read = match self.read {
            true => RecordsRead::BeforeQueued,
            false => RecordsRead::ByBatch { unauthenticated_key: self.unauthenticated_key() },
        };
        Ok(BatchClaim { records: self.records(now), consume_token, token: self.token.is_some(), records_read })
    }

    /// True when the call claims a record, whose response [`GuardSession::complete`] then
    /// stores.
    pub(super) fn records_response(&self) -> bool {
        !self.claims.is_empty()
    }

    /// Step 4, inside the transaction: the response message as the caller receives it
    /// (encoded protobuf), in the records this call claimed.
    pub(super) async fn complete(&self, queries: &mut Queries<'_>, message: &[u8]) -> Result<(), Error> {
        let keys: Vec<(&str, &str)> =
            self.claims.iter().map(|(_, scope, key)| (scope.as_str(), key.as_str())).collect();
        complete_records(queries, &keys, message).await
    }

    /// Step 5, after the transaction (`now` as given to [`GuardSession::claim`]).
    ///
    /// # Errors
    /// The business error, after restoring a token consumed in Redis; or the replay's error.
    pub(super) async fn settle<T>(
        &mut self,
        outcome: Result<Inserted<T>, Error>,
        now: i64,
    ) -> Result<Settled<T>, Error> {
        let metrics = &self.ledger.metrics;
        match outcome {
            Ok(Inserted::Done(value)) => {
                if self.token.is_some() {
                    metrics.tokens_consumed.inc();
                }
                Ok(Settled::Fresh(Replayable {
                    value,
                    replayed: false,
                    key_expires_at: self.fresh_key_expires_at(now),
                }))
            }
            Ok(Inserted::KeyTaken) => {
                // A token consumed in Redis stays consumed only when the call that committed
                // was this token's (its record exists). When the call was answered by another
                // key (a natural key, say), nothing used the token: put it back, as the
                // database store's rollback does, before the replay (which may be an error).
                if let (Some(consumption), TokenStore::Redis(redis)) = (self.redis.take(), &self.ledger.tokens) {
                    if !self.token_record_committed().await? {
                        redis.restore(consumption).await;
                    }
                }
                // An in-flight wait: step 1 saw no record of this call's guards, yet one was
                // committed by the time the claim met it (not: a natural key was taken).
                let was_absent = self.seen_absent;
                let replay = match self.answered.take() {
                    Some(answered) => Some(answered),
                    None => self.committed_replay().await?,
                };
                if was_absent && replay.is_some() {
                    metrics.in_flight_waits.inc();
                }
                Ok(replay.map_or(Settled::NaturalKeyTaken, Settled::Replayed))
            }
            Err(error) => {
                if let (Some(consumption), TokenStore::Redis(redis)) = (self.redis.take(), &self.ledger.tokens) {
                    redis.restore(consumption).await;
                }
                Err(error)
            }
        }
    }
}

/// A token that this transaction could not consume: taken when it was consumed before (its
/// original committed or is in flight), otherwise (unknown or expired) invalid.
fn consumed_before(row: Option<&TokenRow>) -> Result<bool, Error> {
    match row {
        Some(row) if row.consumed_at.is_some() => Ok(false),
        _ => Err(Rejection::TokenInvalid.into()),
    }
}

/// Inserts the IN_PROGRESS `records`: false when one is taken (a concurrent uncommitted claim
/// of the same key makes the insert wait for its outcome). An expired record the reaper has
/// not deleted yet no longer holds its key, and is replaced.
async fn claim_records(queries: &mut Queries<'_>, records: &[IdempotencyRecordRow], now: i64) -> Result<bool, Error> {
    for record in records {
        if queries.insert_record(record).await? {
            continue;
        }
        let (scope, key) = (record.scope.as_str(), record.idempotency_key.as_str());
        if !(queries.delete_expired_record(scope, key, now).await? && queries.insert_record(record).await?) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// What a record written now holds in `response`: nothing, though not NULL. That column held
/// the answer as JSON of rows before records stored the response message (migration 0003), and
/// a record of that release still replays from it ([`StoredResponse`]); since then every
/// release replays from the message, and reads a record whose `response` is not NULL as
/// answered. Writing the JSON copy too cost a keyed Pay or Transfer 6 to 17% of its throughput
/// (`docs/decisions/005-replays-from-the-stored-response.md`).
const NO_JSON_COPY: &[u8] = b"";

/// Stores the response in the records of `keys` (scope, key), claimed by this transaction.
async fn complete_records(queries: &mut Queries<'_>, keys: &[(&str, &str)], message: &[u8]) -> Result<(), Error> {
    for (scope, key) in keys.iter().copied() {
        if !queries.complete_record(scope, key, NO_JSON_COPY, message).await? {
            return Err(Error::Internal("a claimed idempotency record vanished".into()));
        }
    }
    Ok(())
}

/// The answer of one call claimed IN_PROGRESS by a group commit, for its records.
pub(super) struct Completion<'a> {
    claim: &'a BatchClaim,
    message: Vec<u8>,
}

/// Completes the records of the calls a group commit claimed IN_PROGRESS, all in one
/// statement, inside its transaction.
///
/// # Errors
/// [`Error::Internal`] when a claimed record is not there to complete; a database error.
pub(super) async fn complete_claims(queries: &mut Queries<'_>, completions: &[Completion<'_>]) -> Result<(), Error> {
    let records: Vec<RecordCompletion<'_>> = completions
        .iter()
        .flat_map(|completion| {
            completion.claim.keys().map(|(scope, idempotency_key)| RecordCompletion {
                scope,
                idempotency_key,
                response: NO_JSON_COPY,
                response_message: &completion.message,
            })
        })
        .collect();
    if records.is_empty() {
        return Ok(());
    }
    if queries.complete_records(&records).await? != records.len() as u64 {
        return Err(Error::Internal("a claimed idempotency record vanished".into()));
    }
    Ok(())
}

/// One call's guards as a group commit claims them inside its transaction (built by
/// [`GuardSession::batch_claim`]): the records to insert and, with the database token store,
/// the token to consume.
#[derive(Debug, Clone)]
pub(super) struct BatchClaim {
    records: Vec<IdempotencyRecordRow>,
    consume_token: Option<String>,
    /// Whether the call carries a one-time token, whichever store keeps it.
    token: bool,
    records_read: RecordsRead,
}

/// Who reads a call's committed records before its claim.
#[derive(Debug, Clone)]
enum RecordsRead {
    /// The call, before it queued (step 1).
    BeforeQueued,
    /// Its batch ([`BatchClaim::keys_to_read`]; see [`Ledger::unread_guards`]), also where the
    /// key of an authenticated caller lived before authentication was turned on.
    ByBatch { unauthenticated_key: Option<(String, String)> },
}

impl BatchClaim {
    /// The (scope, key) of each record it claims: two calls of one batch that share one are
    /// not both claimed there.
    pub(super) fn keys(&self) -> impl Iterator<Item = (&str, &str)> {
        self.records.iter().map(|record| (record.scope.as_str(), record.idempotency_key.as_str()))
    }

    /// The (scope, key) whose committed records the batch reads for this call before it
    /// claims it ([`BatchClaim::answering_record`]): its own keys and the one its key had before
    /// authentication; none when the call read them before it queued.
    pub(super) fn keys_to_read(&self) -> Vec<(&str, &str)> {
        let RecordsRead::ByBatch { unauthenticated_key } = &self.records_read else { return Vec::new() };
        let unauthenticated = unauthenticated_key.iter().map(|(scope, key)| (scope.as_str(), key.as_str()));
        self.keys().chain(unauthenticated).collect()
    }

    /// The committed record `found` by the batch's read (of [`BatchClaim::keys_to_read`]) that
    /// answers the call, as step 1 answers it: the record of its key, unexpired at `now` (a
    /// replay, or ALREADY_EXISTS naming what differs); else the unexpired record its key left
    /// before authentication, when it holds this very method and request. The call is then
    /// not written, and that record answers it ([`GuardSession::answer_from_batch`]).
    pub(super) fn answering_record(&self, found: &[IdempotencyRecordRow], now: i64) -> Option<IdempotencyRecordRow> {
        let RecordsRead::ByBatch { unauthenticated_key } = &self.records_read else { return None };
        let live = |scope: &str, key: &str| {
            found
                .iter()
                .find(|record| record.scope == scope && record.idempotency_key == key && record.expires_at > now)
        };
        if let Some(own) = self.keys().find_map(|(scope, key)| live(scope, key)) {
            return Some(own.clone());
        }
        // Every record of a call holds its method and fingerprint.
        let claimed = self.records.first()?;
        let (scope, key) = unauthenticated_key.as_ref()?;
        live(scope, key)
            .filter(|record| {
                record.method == claimed.method && record.request_fingerprint == claimed.request_fingerprint
            })
            .cloned()
    }

    /// The records of a call whose answer the batch has decided, for [`BatchClaim::claim`]:
    /// COMPLETED with its response message, as the single-call path leaves them at commit.
    pub(super) fn completed_records(&self, message: &[u8]) -> Vec<IdempotencyRecordRow> {
        self.records
            .iter()
            .map(|record| IdempotencyRecordRow {
                response: Some(NO_JSON_COPY.to_vec()),
                response_message: Some(message.to_vec()),
                status: RECORD_COMPLETED.to_owned(),
                ..record.clone()
            })
            .collect()
    }

    /// The records of a call whose answer holds what only the batch's write makes (a
    /// Transfer's entry ids), for [`BatchClaim::claim`]: IN_PROGRESS, as the single-call path
    /// claims them; [`complete_claims`] stores the answer after the write, in the same
    /// transaction (no other transaction sees either before the commit).
    pub(super) fn in_progress_records(&self) -> &[IdempotencyRecordRow] {
        &self.records
    }

    /// True when the claim consumes a token of the database store: only its own claim
    /// ([`BatchClaim::claim`]) writes it, under a savepoint.
    pub(super) fn consumes_token(&self) -> bool {
        self.consume_token.is_some()
    }

    /// True when the call carries a one-time token (of either store).
    pub(super) fn carries_token(&self) -> bool {
        self.token
    }

    /// The answer for the records claimed IN_PROGRESS ([`BatchClaim::in_progress_records`]),
    /// as [`GuardSession::complete`] stores it, for [`complete_claims`].
    pub(super) fn completion(&self, message: Vec<u8>) -> Completion<'_> {
        Completion { claim: self, message }
    }

    /// Claims inside the batch's transaction, once the batch has decided the call's answer:
    /// inserts `records` ([`BatchClaim::completed_records`] or
    /// [`BatchClaim::in_progress_records`]) and consumes the token. No other transaction sees a
    /// record before its commit, and the batch's writes commit with it or not at all. False
    /// when a guard is taken, and then nothing of this claim is written: a claim of more than
    /// one write (a token consumed, two records) runs under a savepoint, undone alone when it
    /// fails part way, so the rest of the batch goes on.
    ///
    /// # Errors
    /// [`Rejection::TokenInvalid`] for a token expired since it was checked (nothing of the
    /// claim written); a database error (the batch then fails as a whole).
    ///
    /// `checked_at` is the batch transaction's time (microseconds since the Unix epoch): a
    /// token's or an old record's expiry is judged at it, not when the call was queued. The
    /// records keep the call's own time, which its answer's `idempotency-expires-at` reports.
    pub(super) async fn claim(
        &self,
        queries: &mut Queries<'_>,
        records: &[IdempotencyRecordRow],
        checked_at: i64,
    ) -> Result<bool, Error> {
        if self.consume_token.is_none() && records.len() == 1 {
            return claim_records(queries, records, checked_at).await;
        }
        queries.savepoint(Savepoint::Set).await?;
        let claimed = async {
            if let Some(token) = &self.consume_token {
                if !queries.consume_token(token, checked_at).await? {
                    return consumed_before(queries.find_token(token).await?.as_ref());
                }
            }
            claim_records(queries, records, checked_at).await
        }
        .await;
        match claimed {
            Ok(true) => queries.savepoint(Savepoint::Release).await?,
            Ok(false) | Err(Error::Rejected(_)) => {
                queries.savepoint(Savepoint::RollBack).await?;
                queries.savepoint(Savepoint::Release).await?;
            }
            // The batch fails as a whole on this error, which is what it must see: after a
            // deadlock MySQL has rolled the transaction back, savepoint and all, and a
            // ROLLBACK TO would fail with "no such savepoint" instead.
            Err(_) => {}
        }
        claimed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(amount: &str, order_no: &str) -> Call {
        let merchant = MerchantId::parse("merchant_id", "m1").unwrap();
        Call::new(
            "Pay",
            Scope::Merchant(&merchant),
            vec![("amount", amount.to_owned()), ("order_no", order_no.to_owned())],
            &Actor::Anonymous,
        )
    }

    fn record_of(call: &Call) -> IdempotencyRecordRow {
        IdempotencyRecordRow {
            scope: call.scope.clone(),
            idempotency_key: "k".into(),
            method: call.method.into(),
            request_fingerprint: call.fingerprint.clone(),
            request_fields: call.fields_text.clone().into_bytes(),
            response: Some(b"{}".to_vec()),
            response_message: None,
            caller_scope: Some(call.scope.clone()),
            status: "COMPLETED".into(),
            created_at: 0,
            expires_at: 1,
        }
    }

    #[test]
    fn same_fields_give_the_same_fingerprint_and_no_differences() {
        let first = call("100", "o-1");
        assert_eq!(first.fingerprint, call("100", "o-1").fingerprint);
        assert!(call("100", "o-1").differences(&record_of(&first)).is_empty());
    }

    #[test]
    fn differences_name_exactly_the_fields_that_changed() {
        let stored = record_of(&call("100", "o-1"));
        assert_eq!(call("200", "o-1").differences(&stored), ["amount"]);
        assert_eq!(call("200", "o-2").differences(&stored), ["amount", "order_no"]);
    }

    #[test]
    fn the_same_key_on_another_method_differs_in_method() {
        let mut stored = record_of(&call("100", "o-1"));
        stored.method = "Refund".into();
        assert_eq!(call("100", "o-1").differences(&stored), ["method"]);
    }

    #[test]
    fn scopes_keep_merchants_and_accounts_apart() {
        let merchant = MerchantId::parse("merchant_id", "x").unwrap();
        let account = AccountId::parse("account_id", "x").unwrap();
        let by_merchant = Call::new("Pay", Scope::Merchant(&merchant), Vec::new(), &Actor::Anonymous);
        let by_account = Call::new("Pay", Scope::Account(&account), Vec::new(), &Actor::Anonymous);
        assert_ne!(by_merchant.scope, by_account.scope);
    }

    #[test]
    fn scopes_keep_callers_apart_and_keep_the_unauthenticated_scope_as_before() {
        let merchant = MerchantId::parse("merchant_id", "m-1").unwrap();
        let actor = |sub: &str| Actor::Subject(crate::domain::Subject::parse(sub).unwrap());
        let scope = |actor: &Actor| Call::new("Pay", Scope::Merchant(&merchant), Vec::new(), actor).scope;
        assert_eq!(scope(&Actor::Anonymous), "merchant:m-1");
        assert_ne!(scope(&actor("a")), scope(&actor("b")));
        assert_ne!(scope(&actor("a")), scope(&Actor::Anonymous));
        let tagged = scope(&actor(&"z".repeat(crate::domain::Subject::LEN_MAX)));
        let longest_merchant = MerchantId::parse("merchant_id", &"m".repeat(64)).unwrap();
        let longest = Call::new("Pay", Scope::Merchant(&longest_merchant), Vec::new(), &actor("a")).scope;
        assert!(tagged.len() < 160 && longest.len() <= 160, "{}", longest.len());
        let call = Call::new("Pay", Scope::Merchant(&merchant), Vec::new(), &actor("a"));
        assert_eq!(call.token_owner.as_deref(), call.scope.strip_prefix("merchant:"));
        assert_eq!(caller_tag_of(call.token_owner.as_deref().unwrap()), call.caller_tag.as_deref());
    }
}
