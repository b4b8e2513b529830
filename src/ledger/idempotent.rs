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
//!    claim the guards first, then the body, then complete the guards with the answer;
//! 5. settle: a fresh answer, or, when a key was found taken, the replay of the committed
//!    original (by the guards' record, or else by the natural key); with Redis, a token whose
//!    business change failed is restored.
//!
//! A body that fails rolls everything back with it, the guards' claims included, so a retry
//! runs afresh.

use std::future::Future;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::Error;
use crate::store::Queries;

use super::guards::{Call, Guards, Opened, Scope};
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
    /// The answer, fresh or replayed. Stored with the guards' record for replays.
    type Answer: Serialize + DeserializeOwned + Send;

    /// The gRPC method: part of the fingerprint, so one key cannot serve two methods.
    const METHOD: &'static str;

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

impl Ledger {
    /// Runs `call` exactly once whatever its retries: the steps in the module docs.
    ///
    /// # Errors
    /// The body's errors; ALREADY_EXISTS when a key is reused for another request;
    /// [`crate::domain::Rejection::TokenInvalid`] for a token that cannot be used.
    pub(super) async fn run_idempotent<C: IdempotentCall>(
        &self,
        call: &C,
        guards: &Guards,
    ) -> Result<Replayable<C::Answer>, Error> {
        let fingerprint = Call::new(C::METHOD, call.scope(), call.fields());
        let mut session = match self.open_guards(guards, &fingerprint).await? {
            Opened::Replayed(answer) => return Ok(answer),
            Opened::Run(session) => session,
        };
        if let Some(answer) = call.natural_replay(self).await? {
            return Ok(self.natural_replay(answer));
        }
        session.reserve_token().await?;
        let now = now_micros();
        let outcome = in_transaction!(self.store, tx => {
            let mut queries = tx.queries();
            if !session.claim(&mut queries, now).await? {
                return Ok(Inserted::KeyTaken);
            }
            let outcome = call.body(&mut queries, now).await?;
            if let Inserted::Done(answer) = &outcome {
                session.complete(&mut queries, answer).await?;
            }
            Ok(outcome)
        });
        match session.settle(outcome, now).await? {
            Some(answer) => Ok(answer),
            None => Ok(self.natural_replay(call.replay_after_taken(self).await?)),
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
