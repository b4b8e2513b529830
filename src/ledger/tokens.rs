//! One-time tokens (`IssueToken`, then the `idempotency-token` header), in one of two stores.
//!
//! - **Database** (default): the token is a row of `idempotency_token`, consumed by a
//!   conditional UPDATE in the same transaction as the business change, so consumption and
//!   business change commit together or not at all: strongly consistent.
//! - **Redis** (`--token-store redis://...`): issued with `SET NX EX`, consumed by one Lua
//!   script, restored by another when the business change fails; the token's idempotency
//!   record in the database stays the backstop. What a caller sees of each, and why:
//!   `docs/idempotency.md` ("Token stores").

use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::Script;

use crate::domain::{MerchantId, OneTimeToken, Rejection};
use crate::error::Error;
use crate::store::{Store, TokenRow};

use super::guards::token_owner;

/// Random bytes in a token: 192 bits, written as 48 hex characters.
const TOKEN_RANDOM_BYTES: usize = 24;
/// Prefix of token keys in Redis.
const REDIS_KEY_PREFIX: &str = "payledger:token:";

/// Consumes an issued token: 1 consumed now, 2 consumed before, 0 unknown or expired,
/// -1 issued to another merchant or caller (whether consumed or not). KEYS\[1\] token key;
/// ARGV\[1\] the owner a merchant-scoped call requires ('' on AccountService); ARGV\[2\] this
/// consumer's mark; ARGV\[3\] the caller tag an AccountService call requires ('' without
/// authentication). An issued token's value is `i:<owner>`, the owner being
/// `<merchant>[/by:<caller tag>]`; a consumed one's `c:<mark>:i:<owner>` (marks are hex,
/// without ':').
const CONSUME_SCRIPT: &str = r"
local value = redis.call('GET', KEYS[1])
if not value then return 0 end
local issued = value
if string.sub(value, 1, 2) == 'c:' then
  local at = string.find(value, ':i:', 3, true)
  if not at then return 0 end
  issued = string.sub(value, at + 1)
end
local owner = string.sub(issued, 3)
if ARGV[1] ~= '' then
  if owner ~= ARGV[1] then return -1 end
else
  local by = string.find(owner, '/by:', 1, true)
  local tag = ''
  if by then tag = string.sub(owner, by + 4) end
  if tag ~= ARGV[3] then return -1 end
end
if issued ~= value then return 2 end
redis.call('SET', KEYS[1], 'c:' .. ARGV[2] .. ':' .. value, 'KEEPTTL')
return 1
";

/// Puts a token back to issued if it still carries this consumer's mark: 1 restored, 0 not.
const RESTORE_SCRIPT: &str = r"
local value = redis.call('GET', KEYS[1])
local mark = 'c:' .. ARGV[1] .. ':'
if value and string.sub(value, 1, #mark) == mark then
  redis.call('SET', KEYS[1], string.sub(value, #mark + 1), 'KEEPTTL')
  return 1
end
return 0
";

/// Where one-time tokens live.
#[derive(Clone)]
pub enum TokenStore {
    Database,
    Redis(RedisTokens),
}

/// A freshly issued token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IssuedToken {
    pub token: String,
    /// Microseconds since the Unix epoch.
    pub expires_at: i64,
}

fn new_token() -> String {
    rand::random::<[u8; TOKEN_RANDOM_BYTES]>().iter().map(|byte| format!("{byte:02x}")).collect()
}

impl TokenStore {
    /// Connects to Redis for `redis://...`; anything else is the database store.
    ///
    /// # Errors
    /// [`Error::TokenStore`] when Redis cannot be reached.
    pub async fn connect(setting: &str) -> Result<Self, Error> {
        if setting.is_empty() || setting == "database" {
            return Ok(TokenStore::Database);
        }
        let client = redis::Client::open(setting)?;
        Ok(TokenStore::Redis(RedisTokens { connection: ConnectionManager::new(client).await? }))
    }

    pub fn name(&self) -> &'static str {
        match self {
            TokenStore::Database => "database",
            TokenStore::Redis(_) => "redis",
        }
    }

    /// Issues a token to `merchant_id` and the caller of `caller_tag` (`None` without
    /// authentication), valid for `ttl`.
    ///
    /// # Errors
    /// [`Error::Database`] or [`Error::TokenStore`].
    pub(super) async fn issue(
        &self,
        store: &Store,
        merchant_id: &MerchantId,
        caller_tag: Option<&str>,
        purpose: &str,
        now: i64,
        ttl: Duration,
    ) -> Result<IssuedToken, Error> {
        let token = new_token();
        let ttl_micros = i64::try_from(ttl.as_micros()).unwrap_or(i64::MAX);
        let expires_at = now.saturating_add(ttl_micros);
        match self {
            TokenStore::Database => {
                let row = TokenRow {
                    token: token.clone(),
                    merchant_id: merchant_id.as_str().to_owned(),
                    purpose: purpose.to_owned(),
                    created_at: now,
                    expires_at,
                    consumed_at: None,
                    caller_tag: caller_tag.map(str::to_owned),
                };
                // A write, so in a transaction of its own (a Galera session writes only there).
                let mut tx = store.begin().await?;
                tx.queries().insert_token(&row).await?;
                tx.commit().await?;
            }
            TokenStore::Redis(redis) => {
                let mut connection = redis.connection.clone();
                let created: Option<String> = redis::cmd("SET")
                    .arg(format!("{REDIS_KEY_PREFIX}{token}"))
                    .arg(format!("i:{}", token_owner(merchant_id.as_str(), caller_tag)))
                    .arg("NX")
                    .arg("EX")
                    .arg(ttl.as_secs().max(1))
                    .query_async(&mut connection)
                    .await?;
                if created.is_none() {
                    return Err(Error::Internal("a fresh random token already existed".into()));
                }
            }
        }
        Ok(IssuedToken { token, expires_at })
    }
}

/// The Redis token store.
#[derive(Clone)]
pub struct RedisTokens {
    connection: ConnectionManager,
}

/// A token this call consumed in Redis, to restore if its business change fails.
pub(super) struct RedisConsumption {
    key: String,
    mark: String,
}

impl RedisTokens {
    /// Consumes `token` atomically. `Ok(Some)`: consumed now by this call. `Ok(None)`:
    /// consumed before by another call, which either committed (this call's claim then finds
    /// its record and replays it) or is still in flight (the claim waits for it).
    ///
    /// # Errors
    /// [`Rejection::TokenInvalid`] for an unknown, expired or foreign token;
    /// [`Error::TokenStore`] when Redis fails.
    pub(super) async fn consume(
        &self,
        token: &OneTimeToken,
        owner: Option<&str>,
        caller_tag: Option<&str>,
    ) -> Result<Option<RedisConsumption>, Error> {
        let key = format!("{REDIS_KEY_PREFIX}{}", token.as_str());
        let mark = uuid::Uuid::new_v4().simple().to_string();
        let mut connection = self.connection.clone();
        let outcome: i64 = Script::new(CONSUME_SCRIPT)
            .key(&key)
            .arg(owner.unwrap_or(""))
            .arg(&mark)
            .arg(caller_tag.unwrap_or(""))
            .invoke_async(&mut connection)
            .await?;
        match outcome {
            1 => Ok(Some(RedisConsumption { key, mark })),
            2 => Ok(None),
            _ => Err(Rejection::TokenInvalid.into()),
        }
    }

    /// The owner `token` was issued to (`<merchant>[/by:<caller tag>]`), while Redis still
    /// holds it (issued or consumed).
    ///
    /// # Errors
    /// [`Error::TokenStore`] when Redis fails.
    pub(super) async fn issued_to(&self, token: &OneTimeToken) -> Result<Option<String>, Error> {
        let mut connection = self.connection.clone();
        let value: Option<String> =
            redis::cmd("GET").arg(format!("{REDIS_KEY_PREFIX}{}", token.as_str())).query_async(&mut connection).await?;
        // `i:<owner>` issued, `c:<mark>:i:<owner>` consumed (marks hold no ':').
        Ok(value.and_then(|value| value.split_once("i:").map(|(_, owner)| owner.to_owned())))
    }

    /// Puts a token back after its business change failed. Best effort: when Redis fails,
    /// the token stays consumed and the caller asks for a new one.
    pub(super) async fn restore(&self, consumption: RedisConsumption) {
        let mut connection = self.connection.clone();
        let restored: Result<i64, _> = Script::new(RESTORE_SCRIPT)
            .key(&consumption.key)
            .arg(&consumption.mark)
            .invoke_async(&mut connection)
            .await;
        if let Err(error) = restored {
            tracing::warn!(%error, "could not restore a one-time token; the caller needs a new one");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_long_random_and_parse_as_tokens() {
        let (first, second) = (new_token(), new_token());
        assert_eq!(first.len(), TOKEN_RANDOM_BYTES * 2);
        assert_ne!(first, second);
        assert!(OneTimeToken::parse("idempotency-token", &first).is_ok());
    }
}
