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

use std::future::Future;

use prost::Message;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::Error;
use crate::store::Queries;

use super::guards::{Call, Guards, Opened, Scope, Settled, StoredResponse};
use super::transaction::in_transaction;
use super::{key_vanished, now_micros, Inserted, Ledger, Replayable};

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

    /// Before the transaction, without a lock: the committed answer under the call's natural
    /// key, when there is one (a conflicting one is ALREADY_EXISTS naming the differing
    /// fields). Calls without a natural key have none.
    fn natural_replay(&self, _ledger: &Ledger) -> impl Future<Output = Result<Option<Self::Answer>, Error>> + Send {
        async { Ok(None) }
    }

    /// The answer when the body found its natural key taken and none of the call's guards
    /// was: by default the natural replay, which must then exist.
    fn replay_after_taken(&self, ledger: &Ledger) -> impl Future<Output = Result<Self::Answer, Error>> + Send {
        async move { self.natural_replay(ledger).await?.ok_or_else(key_vanished) }
    }

    /// The business change, inside the transaction after the guards are claimed, at `now`
    /// (microseconds since the Unix epoch). `KeyTaken` when its natural key is taken.
    fn body(
        &self,
        queries: &mut Queries<'_>,
        now: i64,
    ) -> impl Future<Output = Result<Inserted<Self::Answer>, Error>> + Send;
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
        self.run_guarded(call, guards).await?.try_map(|reply| match reply {
            Reply::Value(answer) => C::message(answer),
            Reply::Stored(stored) => stored_message::<C>(stored),
        })
    }

    /// [`Ledger::run_idempotent`] before the answer becomes a message.
    pub(super) async fn run_guarded<C: IdempotentCall>(
        &self,
        call: &C,
        guards: &Guards,
    ) -> Result<Replayable<Reply<C::Answer>>, Error> {
        let fingerprint = Call::new(C::METHOD, call.scope(), call.fields());
        let mut session = match self.open_guards(guards, &fingerprint).await? {
            Opened::Replayed(stored) => return stored.try_map(|stored| Ok(Reply::Stored(stored))),
            Opened::Run(session) => session,
        };
        if let Some(answer) = call.natural_replay(self).await? {
            return Ok(self.natural_replay(Reply::Value(answer)));
        }
        session.reserve_token().await?;
        let now = now_micros();
        let outcome = in_transaction!(self.store, tx => {
            let mut queries = tx.queries();
            if !session.claim(&mut queries, now).await? {
                return Ok(Inserted::KeyTaken);
            }
            let outcome = call.body(&mut queries, now).await?;
            if let (Inserted::Done(answer), true) = (&outcome, session.records_response()) {
                let message = C::message(answer.clone())?.encode_to_vec();
                session.complete(&mut queries, answer, &message).await?;
            }
            Ok(outcome)
        });
        match session.settle(outcome, now).await? {
            Settled::Fresh(answer) => answer.try_map(|answer| Ok(Reply::Value(answer))),
            Settled::Replayed(stored) => stored.try_map(|stored| Ok(Reply::Stored(stored))),
            Settled::NaturalKeyTaken => Ok(self.natural_replay(Reply::Value(call.replay_after_taken(self).await?))),
        }
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
}
