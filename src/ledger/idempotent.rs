//! The idempotency driver: the one place where a mutating call goes through the steps that
//! make it run exactly once. A use case gives only its own data ([`IdempotentCall`]): its
//! method and scope, its business fields (one list, for the fingerprint and for the fields
//! named when a key is reused), its natural-key lookup and its body; [`Ledger::run_idempotent`]
//! does the rest, in this order:
//!
//! 1. guards: a committed record of the call's `idempotency-key` or `idempotency-token`
//!    answers it at once (replay, or ALREADY_EXISTS naming what differs);
//! 2. natural replay: a committed row under the call's natural key (out_trade_no,
//!    request_id...) answers it, without a lock;
//! 3. token: with the Redis token store, the token is consumed right before the transaction;
//! 4. in one transaction (run again from BEGIN after a deadlock or serialization failure):
//!    claim the guards first, then the body, then complete the guards' records with the
//!    response message as the caller receives it (encoded protobuf);
//! 5. settle: a fresh answer, or, when a key was found taken, the replay of the committed
//!    original (the guards' stored response message, or else by the natural key); with
//!    Redis, a token whose business change failed is restored.
//!
//! A body that fails rolls everything back with it, the guards' claims included, so a retry
//! runs afresh.
//!
//! A group commit of Pays, Refunds, Transfers, Deposits, Withdraws and CreateOrders
//! (`group_commit`) runs steps 1-3 and 5 here for each call, and step 4 for the whole batch in
//! its one transaction. The body of each of those calls, when it runs here alone, is the
//! group commit's steps for a batch of one (`engine::group_commit::write_alone`).

use std::future::Future;
use std::time::Duration;

use prost::Message;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::Error;
use crate::store::Queries;

use super::engine::transaction::in_transaction;
use super::guards::{Call, GuardSession, Guards, Opened, Scope, Settled, StoredResponse};
use super::{now_micros, Inserted, Ledger, Replayable};

/// Reads of a taken key's committed original before the call is ABORTED as not yet visible.
const TAKEN_KEY_READS_MAX: u32 = 4;
/// The wait before the second read; it doubles before each later one (5, 10, 20 ms).
const TAKEN_KEY_READ_WAIT: Duration = Duration::from_millis(5);

/// A call's business fields as `(name, value)` pairs, normalized (amounts in minor units,
/// currencies as ISO 4217 codes), in a fixed order.
pub(super) type Fields = Vec<(&'static str, String)>;

/// The names of `requested` fields whose value differs from the `stored` one of that name.
pub(super) fn differing<'a>(
    requested: &[(&'static str, String)],
    stored: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Vec<&'static str> {
    let stored: Vec<(&str, &str)> = stored.into_iter().collect();
    requested.iter().filter(|(name, value)| !stored.contains(&(*name, value.as_str()))).map(|(name, _)| *name).collect()
}

/// The names of the fields in which a stored row, seen as `stored` fields, differs from
/// the call's `requested` ones.
pub(super) fn differing_from(requested: &Fields, stored: &Fields) -> Vec<&'static str> {
    differing(requested, stored.iter().map(|(name, value)| (*name, value.as_str())))
}

/// A mutating use case, as the idempotency driver runs it.
pub(super) trait IdempotentCall: Sync {
    /// The answer, fresh or replayed by the natural key.
    type Answer: Serialize + DeserializeOwned + Clone + Send;

    /// The response message the caller receives, stored with the guards' records.
    type Message: Message + Default + Send;

    /// The gRPC method: part of the fingerprint, so one key cannot serve two methods.
    const METHOD: &'static str;

    /// The response message of an answer.
    ///
    /// # Errors
    /// [`Error::Internal`] for a stored value that cannot be encoded.
    fn message(answer: Self::Answer) -> Result<Self::Message, Error>;

    /// Whose keys the call's `idempotency-key` lives among.
    fn scope(&self) -> Scope<'_>;

    /// The business fields: hashed into the fingerprint of a guard's record, and the names
    /// reported when a key or a natural key is reused for other values.
    fn fields(&self) -> Fields;

    /// The call as its guards see it, for `actor`: method, scope, fields and fingerprint.
    fn fingerprint(&self, actor: &crate::domain::Actor) -> Call {
        Call::new(Self::METHOD, self.scope(), self.fields(), actor)
    }

    /// Before the transaction, without a lock: the committed answer under the call's natural
    /// key, when there is one (a conflicting one is ALREADY_EXISTS naming the differing
    /// fields). Calls without a natural key have none.
    fn natural_replay(&self, _ledger: &Ledger) -> impl Future<Output = Result<Option<Self::Answer>, Error>> + Send {
        async { Ok(None) }
    }

    /// The answer when the body found its natural key taken and none of the call's guards
    /// was: by default the natural replay. `None` while the committed original cannot be read
    /// yet (a replica or cluster node behind the one that committed it); the driver reads
    /// again, a bounded number of times.
    fn replay_after_taken(&self, ledger: &Ledger) -> impl Future<Output = Result<Option<Self::Answer>, Error>> + Send {
        self.natural_replay(ledger)
    }

    /// The business change, inside the transaction after the guards are claimed, at `now`
    /// (microseconds since the Unix epoch). `KeyTaken` when its natural key is taken.
    fn body(
        &self,
        queries: &mut Queries<'_>,
        now: i64,
    ) -> impl Future<Output = Result<Inserted<Self::Answer>, Error>> + Send;
}

/// The outcome of steps 1 to 3.
pub(super) enum Prepared<T, R> {
    /// Answered already: a replay.
    Answered(Replayable<Reply<T>>),
    /// To be run (the guards' session, with what else the caller prepared): claim the
    /// guards, run the body, complete the records.
    Ready(R),
}

/// What the driver answers, before it becomes a response message.
pub(super) enum Reply<T> {
    /// Fresh, or replayed by the natural key.
    Value(T),
    /// Replayed from a guard's record.
    Stored(StoredResponse),
}

impl Ledger {
    /// Runs `call` exactly once whatever its retries (the steps in the module docs) and
    /// answers with its response message: the stored one for a replay of a guard's record.
    ///
    /// # Errors
    /// The body's errors; ALREADY_EXISTS when a key is reused for another request;
    /// [`crate::domain::Rejection::TokenInvalid`] for a token that cannot be used;
    /// [`Error::Internal`] for a stored response that cannot be read.
    pub(super) async fn run_idempotent<C: IdempotentCall>(
        &self,
        call: &C,
        guards: &Guards,
    ) -> Result<Replayable<C::Message>, Error> {
        self.run_guarded(call, guards).await?.try_map(reply_message::<C>)
    }

    /// [`Ledger::run_idempotent`] before the answer becomes a message.
    pub(super) async fn run_guarded<C: IdempotentCall>(
        &self,
        call: &C,
        guards: &Guards,
    ) -> Result<Replayable<Reply<C::Answer>>, Error> {
        let fingerprint = call.fingerprint(&guards.actor);
        let mut session = match self.prepare(call, guards, &fingerprint).await? {
            Prepared::Answered(answer) => return Ok(answer),
            Prepared::Ready(session) => session,
        };
        let now = now_micros();
        let outcome = self.transact(call, &session, now).await;
        self.settle_call(call, &mut session, outcome, now).await
    }

    /// Steps 1 to 3 (see the module docs): the answer when a guard's record or the natural
    /// key already holds one, otherwise the guards ready to be claimed (the token, with
    /// Redis, consumed).
    pub(super) async fn prepare<'a, C: IdempotentCall>(
        &'a self,
        call: &C,
        guards: &'a Guards,
        fingerprint: &'a Call,
    ) -> Result<Prepared<C::Answer, GuardSession<'a>>, Error> {
        let mut session = match self.open_guards(guards, fingerprint).await? {
            Opened::Replayed(stored) => {
                return Ok(Prepared::Answered(stored.try_map(|stored| Ok(Reply::Stored(stored)))?))
            }
            Opened::Run(session) => session,
        };
        let natural = match call.natural_replay(self).await {
            Err(error @ Error::KeyReused { .. }) => {
                return self.guard_or_natural_conflict(&mut session, error).await.map(Prepared::Answered)
            }
            natural => natural?,
        };
        if let Some(answer) = natural {
            // The natural key's row commits together with the guards' records, so a guard of
            // this call that has a record by now answers instead: the response as first sent.
            if let Some(stored) = session.committed_replay().await? {
                return Ok(Prepared::Answered(stored.try_map(|stored| Ok(Reply::Stored(stored)))?));
            }
            return Ok(Prepared::Answered(self.natural_replay(Reply::Value(answer))));
        }
        session.reserve_token().await?;
        Ok(Prepared::Ready(session))
    }

    /// Steps 1 to 3 of a call bound for a group commit: the answer when a guard's record
    /// already holds one, otherwise the guards ready to be claimed. Its natural key is not read
    /// here, unlike [`Ledger::prepare`]: the batch reads the natural keys of all its calls with
    /// its own rows (the payments' replay read, the orders', refunds' and request_ids' locking
    /// reads), and answers a call whose key is taken as a transaction that found it taken
    /// (`GuardSession::settle`: a guard's committed record first, then [`Ledger::replay_taken`],
    /// after the batch). Nor are the records of a call with an idempotency key alone: its batch
    /// reads them too ([`Ledger::unread_guards`]). A read for each call before it queues
    /// would cost more database time than the batch's own statements (docs/benchmarks-history.md,
    /// "Natural keys read by the batch, a batch's records in one statement").
    pub(super) async fn prepare_guards<'a, T>(
        &'a self,
        guards: &'a Guards,
        fingerprint: &'a Call,
    ) -> Result<Prepared<T, GuardSession<'a>>, Error> {
        if guards.token.is_none() {
            return Ok(Prepared::Ready(self.unread_guards(guards, fingerprint)));
        }
        let mut session = match self.open_guards(guards, fingerprint).await? {
            Opened::Replayed(stored) => {
                return Ok(Prepared::Answered(stored.try_map(|stored| Ok(Reply::Stored(stored)))?))
            }
            Opened::Run(session) => session,
        };
        session.reserve_token().await?;
        Ok(Prepared::Ready(session))
    }

    /// Step 4 alone: one transaction that claims the guards, runs the body and completes the
    /// guards' records (a group commit does the same for many calls in one transaction).
    pub(super) async fn transact<C: IdempotentCall>(
        &self,
        call: &C,
        session: &GuardSession<'_>,
        now: i64,
    ) -> Result<Inserted<C::Answer>, Error> {
        in_transaction!(self.store, &self.metrics, tx => {
            let mut queries = tx.queries();
            if !session.claim(&mut queries, now).await? {
                return Ok(Inserted::KeyTaken);
            }
            let outcome = call.body(&mut queries, now).await?;
            if let (Inserted::Done(answer), true) = (&outcome, session.records_response()) {
                let message = C::message(answer.clone())?.encode_to_vec();
                session.complete(&mut queries, &message).await?;
            }
            Ok(outcome)
        })
    }

    /// Step 5: the answer of the transaction's `outcome` (begun at `now`), or the replay of
    /// the committed original when it found a key taken.
    pub(super) async fn settle_call<C: IdempotentCall>(
        &self,
        call: &C,
        session: &mut GuardSession<'_>,
        outcome: Result<Inserted<C::Answer>, Error>,
        now: i64,
    ) -> Result<Replayable<Reply<C::Answer>>, Error> {
        match session.settle(outcome, now).await? {
            Settled::Fresh(answer) => answer.try_map(|answer| Ok(Reply::Value(answer))),
            Settled::Replayed(stored) => stored.try_map(|stored| Ok(Reply::Stored(stored))),
            Settled::NaturalKeyTaken => self.replay_taken(call, session).await,
        }
    }

    /// The committed original of a call whose transaction found a key taken: by its natural
    /// key, or by a guard's record. A row another transaction committed may not be readable
    /// here yet (replica or cluster lag), so it is read again, at most
    /// [`TAKEN_KEY_READS_MAX`] times with a short wait, before the call is ABORTED
    /// (`KEY_NOT_YET_VISIBLE`, retryable with the same key).
    async fn replay_taken<C: IdempotentCall>(
        &self,
        call: &C,
        session: &mut GuardSession<'_>,
    ) -> Result<Replayable<Reply<C::Answer>>, Error> {
        for read in 1..=TAKEN_KEY_READS_MAX {
            if read > 1 {
                tokio::time::sleep(TAKEN_KEY_READ_WAIT * 2_u32.pow(read - 2)).await;
            }
            let natural = match call.replay_after_taken(self).await {
                Err(error @ Error::KeyReused { .. }) => return self.guard_or_natural_conflict(session, error).await,
                natural => natural?,
            };
            if let Some(answer) = natural {
                return Ok(self.natural_replay(Reply::Value(answer)));
            }
            if let Some(stored) = session.committed_replay().await? {
                return stored.try_map(|stored| Ok(Reply::Stored(stored)));
            }
        }
        Err(Error::NotYetVisible)
    }

    /// The answer to a call whose natural key another request took (`conflict`, a
    /// [`Error::KeyReused`] such as ORDER_NO_REUSED): when one of this call's own guards has a
    /// committed record by now, that record answers (its replay, or IDEMPOTENCY_KEY_REUSED),
    /// as it does when the two calls come one after the other. The other request carried this
    /// call's key and committed its record with the natural key's row after this call's
    /// guards were read (two calls with one key and other terms, racing).
    async fn guard_or_natural_conflict<T>(
        &self,
        session: &mut GuardSession<'_>,
        conflict: Error,
    ) -> Result<Replayable<Reply<T>>, Error> {
        match session.committed_replay().await? {
            Some(stored) => stored.try_map(|stored| Ok(Reply::Stored(stored))),
            None => Err(self.natural_conflict(conflict)),
        }
    }
}

/// The response message of the driver's answer: fresh, or the one a guard's record stored.
///
/// # Errors
/// [`Error::Internal`] for a value that cannot be encoded or a record that cannot be read.
pub(super) fn reply_message<C: IdempotentCall>(reply: Reply<C::Answer>) -> Result<C::Message, Error> {
    match reply {
        Reply::Value(answer) => C::message(answer),
        Reply::Stored(stored) => stored_message::<C>(stored),
    }
}

/// The response message of a guard's record: the stored message, or, in a record written
/// before messages were stored, the message of its answer stored as JSON of rows.
fn stored_message<C: IdempotentCall>(stored: StoredResponse) -> Result<C::Message, Error> {
    match stored.message {
        Some(message) => C::Message::decode(message.as_slice())
            .map_err(|error| Error::Internal(format!("stored response message: {error}"))),
        None => {
            let answer: C::Answer = serde_json::from_slice(&stored.json)
                .map_err(|error| Error::Internal(format!("stored response (JSON of rows): {error}")))?;
            C::message(answer)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differing_names_the_requested_fields_whose_stored_value_is_other_or_missing() {
        let requested: Fields = vec![("order_no", "o-1".into()), ("amount", "100".into()), ("currency", "USD".into())];
        let stored: Fields = vec![("order_no", "o-1".into()), ("amount", "200".into())];
        assert_eq!(differing_from(&requested, &stored), ["amount", "currency"]);
        assert!(differing_from(&requested, &requested).is_empty());
    }

    use std::sync::atomic::{AtomicU32, Ordering};

    use crate::domain::AccountId;
    use crate::store::{PoolSettings, Store};

    /// A call whose key is always found taken, and whose committed original becomes readable
    /// only at read number `visible_at` after that (`u32::MAX`: never).
    struct TakenKey {
        account_id: AccountId,
        visible_at: u32,
        reads: AtomicU32,
    }

    impl IdempotentCall for TakenKey {
        type Answer = String;
        type Message = crate::proto::GetAccountRequest;
        const METHOD: &'static str = "TakenKey";

        fn message(answer: String) -> Result<Self::Message, Error> {
            Ok(crate::proto::GetAccountRequest { account_id: answer })
        }

        fn scope(&self) -> Scope<'_> {
            Scope::Account(&self.account_id)
        }

        fn fields(&self) -> Fields {
            Vec::new()
        }

        async fn replay_after_taken(&self, _ledger: &Ledger) -> Result<Option<String>, Error> {
            let read = self.reads.fetch_add(1, Ordering::SeqCst) + 1;
            Ok((read >= self.visible_at).then(|| "the original".to_owned()))
        }

        async fn body(&self, _queries: &mut Queries<'_>, _now: i64) -> Result<Inserted<String>, Error> {
            Ok(Inserted::KeyTaken)
        }
    }

    async fn ledger(directory: &tempfile::TempDir) -> Ledger {
        let url = format!("sqlite:{}", directory.path().join("ledger.db").display());
        let settings = PoolSettings {
            max_connections: 2,
            acquire_timeout: Duration::from_secs(5),
            lock_timeout: Duration::from_secs(5),
            plan_lifetime: PoolSettings::PLAN_LIFETIME_DEFAULT,
        };
        let store = Store::connect(&url, &settings).await.unwrap();
        store.migrate().await.unwrap();
        Ledger::new(store)
    }

    fn taken_key(visible_at: u32) -> TakenKey {
        TakenKey { account_id: AccountId::parse("account_id", "a").unwrap(), visible_at, reads: AtomicU32::new(0) }
    }

    #[tokio::test]
    async fn a_taken_key_whose_original_becomes_readable_late_is_replayed() {
        let directory = tempfile::tempdir().unwrap();
        let ledger = ledger(&directory).await;
        let call = taken_key(3);

        let answer = ledger.run_idempotent(&call, &Guards::default()).await.unwrap();

        assert!(answer.replayed);
        assert_eq!(answer.value.account_id, "the original");
        assert_eq!(call.reads.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_taken_key_whose_original_stays_unreadable_is_aborted_never_internal() {
        let directory = tempfile::tempdir().unwrap();
        let ledger = ledger(&directory).await;
        let call = taken_key(u32::MAX);

        let error = ledger.run_idempotent(&call, &Guards::default()).await.unwrap_err();

        assert!(matches!(error, Error::NotYetVisible), "{error:?}");
        assert_eq!(call.reads.load(Ordering::SeqCst), TAKEN_KEY_READS_MAX);
        assert_eq!(tonic::Status::from(error).code(), tonic::Code::Aborted);
    }
}
