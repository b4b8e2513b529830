//! JWT verification against a JWK set (read from a file or a URL by [`super::jwks`], and
//! replaced while the server runs).

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, JwkSet, KeyAlgorithm, PublicKeyUse};
use jsonwebtoken::{errors::ErrorKind, Algorithm, DecodingKey, Validation};
use serde::Deserialize;
use sha2::{Digest as _, Sha256};
use tokio::sync::Notify;

use super::{Caller, MerchantGrant, Permission, Unauthenticated};
use crate::domain::{Actor, Subject};

/// Seconds of clock skew allowed on `exp` and `nbf` unless set otherwise.
pub const LEEWAY_SECONDS_DEFAULT: u64 = 30;
/// The longest `authorization` value read; a longer one is CREDENTIALS_INVALID unread.
pub const TOKEN_BYTES_MAX: usize = 8 * 1024;
/// Most verified tokens remembered (a caller sends the same token on call after call, and a
/// signature check costs more than the rest of the call's CPU on a fast path). When full,
/// the expired ones go, and if that frees nothing, all of them.
const VERIFIED_TOKENS_MAX: usize = 10_000;
/// Longest a verified token is remembered, in seconds, however long it is valid.
const VERIFIED_TOKEN_SECONDS_MAX: u64 = 300;

/// A JWK set (a file or a URL) or auth setting that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum AuthSettingsError {
    #[error("cannot read the JWKS file {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("the JWKS {path} is not a JWK set: {detail}")]
    Parse { path: String, detail: String },
    #[error("the JWKS {0} holds no usable signing key (EdDSA Ed25519, ES256 P-256 or RS256, each with a kid)")]
    NoKeys(String),
    #[error("{0}")]
    Missing(&'static str),
    #[error("{0}")]
    Source(String),
    #[error("cannot fetch the JWKS {url}: {detail}")]
    Fetch { url: String, detail: String },
}

impl AuthSettingsError {
    /// The same error, naming `source` (a file or URL) where the set's text was judged.
    pub fn with_source(self, source: &str) -> Self {
        match self {
            AuthSettingsError::Parse { detail, .. } => AuthSettingsError::Parse { path: source.to_owned(), detail },
            AuthSettingsError::NoKeys(_) => AuthSettingsError::NoKeys(source.to_owned()),
            other => other,
        }
    }
}

/// One verification key of the JWKS.
struct VerificationKey {
    algorithm: Algorithm,
    key: DecodingKey,
}

/// A verified token's caller, until when it may be taken from memory (Unix seconds), and the
/// digest of the key set that verified it.
type Remembered = (Caller, u64, [u8; 32]);

/// The keys in force, and a digest of the JWKs they came from (to tell a changed set).
struct KeySet {
    keys: HashMap<String, VerificationKey>,
    digest: [u8; 32],
}

/// Verifies bearer tokens against the keys in force (see [`Authenticator::replace_keys`]).
pub struct Authenticator {
    keys: RwLock<Arc<KeySet>>,
    /// Signalled when a token names a `kid` no key has (the refresher then reads the set).
    unknown_kid: Arc<Notify>,
    issuer: String,
    audience: String,
    leeway_seconds: u64,
    /// Tokens verified before: the caller each one names, until when (Unix seconds) it may
    /// be taken from here: never past its `exp` (with the leeway), at most
    /// [`VERIFIED_TOKEN_SECONDS_MAX`] after its check, and only while the key set that
    /// verified it (its digest) is in force.
    verified: Mutex<HashMap<String, Remembered>>,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator")
            .field("kids", &self.kids())
            .field("issuer", &self.issuer)
            .field("audience", &self.audience)
            .field("leeway_seconds", &self.leeway_seconds)
            .finish()
    }
}

/// The claims payledger reads; `exp`, `nbf`, `iss` and `aud` are checked by the library.
#[derive(Deserialize)]
struct Claims {
    /// Read only so that a list is refused: RFC 7519 makes `iss` one StringOrURI (the library
    /// would accept a list that holds the issuer).
    #[allow(dead_code)]
    iss: String,
    sub: String,
    /// A NumericDate: seconds, a fraction allowed (RFC 7519, section 2).
    exp: f64,
    #[serde(default)]
    merchants: Vec<String>,
    #[serde(default)]
    scope: String,
}

/// The one algorithm a JWK verifies: its `alg` when given, else what its key type implies.
/// `None` for keys payledger never verifies with: symmetric (`oct`) keys, encryption keys,
/// and other algorithms.
fn algorithm_of(jwk: &Jwk) -> Option<Algorithm> {
    if matches!(jwk.common.public_key_use, Some(PublicKeyUse::Encryption)) {
        return None;
    }
    let implied = match &jwk.algorithm {
        AlgorithmParameters::OctetKeyPair(params) if params.curve == EllipticCurve::Ed25519 => Algorithm::EdDSA,
        AlgorithmParameters::EllipticCurve(params) if params.curve == EllipticCurve::P256 => Algorithm::ES256,
        AlgorithmParameters::RSA(_) => Algorithm::RS256,
        _ => return None,
    };
    match jwk.common.key_algorithm {
        None => Some(implied),
        Some(KeyAlgorithm::EdDSA) if implied == Algorithm::EdDSA => Some(implied),
        Some(KeyAlgorithm::ES256) if implied == Algorithm::ES256 => Some(implied),
        Some(KeyAlgorithm::RS256) if implied == Algorithm::RS256 => Some(implied),
        Some(_) => None,
    }
}

/// The usable keys of the JWK set `jwks`. Keys without a `kid`, symmetric keys, encryption
/// keys and algorithms other than EdDSA, ES256 and RS256 are skipped (and logged).
fn key_set(jwks: &str) -> Result<KeySet, AuthSettingsError> {
    let set: JwkSet = serde_json::from_str(jwks)
        .map_err(|error| AuthSettingsError::Parse { path: String::new(), detail: error.to_string() })?;
    let mut keys = HashMap::new();
    let mut usable = Vec::new();
    for jwk in &set.keys {
        let (Some(kid), Some(algorithm)) = (jwk.common.key_id.clone(), algorithm_of(jwk)) else {
            tracing::warn!(kid = ?jwk.common.key_id, "JWKS key skipped: no kid, or not an EdDSA, ES256 or RS256 signing key");
            continue;
        };
        // One key the provider published malformed does not block the others (nor a rotation).
        let key = match DecodingKey::from_jwk(jwk) {
            Ok(key) => key,
            Err(error) => {
                tracing::warn!(%kid, %error, "JWKS key skipped: it cannot be decoded");
                continue;
            }
        };
        if keys.insert(kid.clone(), VerificationKey { algorithm, key }).is_some() {
            return Err(AuthSettingsError::Parse {
                path: String::new(),
                detail: format!("two keys have the kid {kid:?}: which one would verify?"),
            });
        }
        usable.push((kid, serde_json::to_string(jwk).unwrap_or_default()));
    }
    if keys.is_empty() {
        return Err(AuthSettingsError::NoKeys(String::new()));
    }
    usable.sort();
    let mut digest = Sha256::new();
    for (kid, jwk) in &usable {
        digest.update((kid.len() as u64).to_be_bytes());
        digest.update(kid.as_bytes());
        digest.update((jwk.len() as u64).to_be_bytes());
        digest.update(jwk.as_bytes());
    }
    Ok(KeySet { keys, digest: digest.finalize().into() })
}

impl Authenticator {
    /// Reads the JWKS file at `path`.
    ///
    /// # Errors
    /// [`AuthSettingsError`] for an unreadable file, one that is not a JWK set, or one
    /// without a usable key.
    pub fn from_file(
        path: &Path,
        issuer: &str,
        audience: &str,
        leeway_seconds: u64,
    ) -> Result<Self, AuthSettingsError> {
        let shown = path.display().to_string();
        let text =
            std::fs::read_to_string(path).map_err(|source| AuthSettingsError::Read { path: shown.clone(), source })?;
        Self::from_jwks(&text, issuer, audience, leeway_seconds).map_err(|error| error.with_source(&shown))
    }

    /// Builds from the text of a JWK set. Keys without a `kid`, symmetric keys, encryption
    /// keys and algorithms other than EdDSA, ES256 and RS256 are skipped (and logged).
    ///
    /// # Errors
    /// [`AuthSettingsError`] as for [`Authenticator::from_file`].
    pub fn from_jwks(jwks: &str, issuer: &str, audience: &str, leeway_seconds: u64) -> Result<Self, AuthSettingsError> {
        if issuer.is_empty() {
            return Err(AuthSettingsError::Missing("--auth-issuer is required with --auth-jwks"));
        }
        if audience.is_empty() {
            return Err(AuthSettingsError::Missing("--auth-audience is required with --auth-jwks"));
        }
        Ok(Self {
            keys: RwLock::new(Arc::new(key_set(jwks)?)),
            unknown_kid: Arc::new(Notify::new()),
            issuer: issuer.to_owned(),
            audience: audience.to_owned(),
            leeway_seconds,
            verified: Mutex::new(HashMap::new()),
        })
    }

    /// Puts the keys of the JWK set `jwks` in force, when they differ from those in force: a
    /// token signed by a key no longer in the set is refused from now on (the tokens verified
    /// before are forgotten), one signed by a new key verifies. True when the keys changed.
    ///
    /// # Errors
    /// [`AuthSettingsError`] as for [`Authenticator::from_jwks`]; the keys in force stay.
    pub fn replace_keys(&self, jwks: &str) -> Result<bool, AuthSettingsError> {
        let set = key_set(jwks)?;
        let mut keys = self.keys.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        if keys.digest == set.digest {
            return Ok(false);
        }
        *keys = Arc::new(set);
        drop(keys);
        // Remembered under the old set, they would no longer be taken anyway.
        self.verified.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clear();
        Ok(true)
    }

    /// The `kid`s of the keys in force, sorted.
    pub fn kids(&self) -> Vec<String> {
        let keys = self.keys.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let mut kids: Vec<String> = keys.keys.keys().cloned().collect();
        kids.sort();
        kids
    }

    /// Signalled each time a token names a `kid` that no key in force has.
    pub fn unknown_kid_signal(&self) -> Arc<Notify> {
        self.unknown_kid.clone()
    }

    /// The caller of a request, from the value of its `authorization` header (`None`: no
    /// header).
    ///
    /// # Errors
    /// [`Unauthenticated::Missing`] without a credential; [`Unauthenticated::Expired`] for a
    /// token past its `exp` (and the leeway); [`Unauthenticated::Invalid`] for anything else
    /// that does not verify: not `Bearer <JWT>`, alg `none` or an algorithm other than the
    /// key's (an HMAC token against a public key, say), an unknown or absent `kid`, a bad
    /// signature, a wrong `iss` or `aud`, `nbf` in the future, no `exp`, or a `sub` that is
    /// not 1-128 printable ASCII characters.
    pub fn authenticate(&self, authorization: Option<&[u8]>) -> Result<Caller, Unauthenticated> {
        let Some(value) = authorization else { return Err(Unauthenticated::Missing) };
        if value.len() > TOKEN_BYTES_MAX {
            return Err(Unauthenticated::Invalid);
        }
        let value = std::str::from_utf8(value).map_err(|_| Unauthenticated::Invalid)?;
        // RFC 6750 section 2.1: `Bearer` (a case-insensitive scheme, RFC 9110), one space, token.
        let token = match value.split_once(' ') {
            Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") && !token.is_empty() => token,
            _ => return Err(Unauthenticated::Invalid),
        };
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |elapsed| elapsed.as_secs());
        // One set for the whole check: a token is remembered under the set that verified it,
        // and taken from memory only while that set is in force.
        let keys = self.keys.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        if let Some(caller) = self.remembered(token, now, &keys.digest) {
            return Ok(caller);
        }
        let (caller, exp) = self.verify(token, &keys)?;
        let until = exp.saturating_add(self.leeway_seconds).min(now + VERIFIED_TOKEN_SECONDS_MAX);
        self.remember(token, &caller, until, keys.digest);
        Ok(caller)
    }

    fn remembered(&self, token: &str, now: u64, digest: &[u8; 32]) -> Option<Caller> {
        let verified = self.verified.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        verified
            .get(token)
            .filter(|(_, until, verified_by)| *until > now && verified_by == digest)
            .map(|(caller, _, _)| caller.clone())
    }

    fn remember(&self, token: &str, caller: &Caller, until: u64, digest: [u8; 32]) {
        let mut verified = self.verified.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if verified.len() >= VERIFIED_TOKENS_MAX {
            let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |elapsed| elapsed.as_secs());
            verified.retain(|_, (_, valid_until, _)| *valid_until > now);
            if verified.len() >= VERIFIED_TOKENS_MAX {
                verified.clear();
            }
        }
        verified.insert(token.to_owned(), (caller.clone(), until, digest));
    }

    /// The signature and claims check of `token`: its caller and its `exp`.
    fn verify(&self, token: &str, keys: &KeySet) -> Result<(Caller, u64), Unauthenticated> {
        let header = jsonwebtoken::decode_header(token).map_err(|_| Unauthenticated::Invalid)?;
        let Some(key) = header.kid.as_deref().and_then(|kid| keys.keys.get(kid)) else {
            if header.kid.is_some() {
                self.unknown_kid.notify_one();
            }
            return Err(Unauthenticated::Invalid);
        };
        if header.alg != key.algorithm {
            return Err(Unauthenticated::Invalid);
        }
        let mut validation = Validation::new(key.algorithm);
        validation.set_issuer(&[&self.issuer]);
        validation.set_audience(&[&self.audience]);
        validation.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        validation.validate_nbf = true;
        validation.leeway = self.leeway_seconds;
        let claims = jsonwebtoken::decode::<Claims>(token, &key.key, &validation)
            .map_err(|error| match error.kind() {
                ErrorKind::ExpiredSignature => Unauthenticated::Expired,
                _ => Unauthenticated::Invalid,
            })?
            .claims;
        let subject = Subject::parse(&claims.sub).ok_or(Unauthenticated::Invalid)?;
        let merchants = if claims.merchants.iter().any(|merchant| merchant == "*") {
            MerchantGrant::All
        } else {
            MerchantGrant::Only(claims.merchants.into_iter().collect())
        };
        // Scopes of other services in the same token are ignored.
        let permissions: BTreeSet<Permission> = claims.scope.split(' ').filter_map(Permission::parse).collect();
        // Whole seconds, down: a cached token is never taken past its `exp` (`as` saturates).
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let exp = claims.exp.floor() as u64;
        Ok((Caller::new(Actor::Subject(subject), merchants, permissions), exp))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::dev::SigningKey;

    #[test]
    fn a_jwks_without_usable_keys_or_with_one_kid_twice_is_refused() {
        let key = SigningKey::generate(Algorithm::EdDSA).unwrap();
        let twice = SigningKey::jwks([&key, &key]);
        let error = Authenticator::from_jwks(&twice, "iss", "aud", 5).unwrap_err();
        assert!(error.to_string().contains("two keys have the kid"), "{error}");
        let symmetric = r#"{"keys":[{"kty":"oct","kid":"h","k":"c2VjcmV0"}]}"#;
        assert!(matches!(Authenticator::from_jwks(symmetric, "iss", "aud", 5), Err(AuthSettingsError::NoKeys(_))));
        assert!(matches!(Authenticator::from_jwks("{}", "iss", "aud", 5), Err(AuthSettingsError::Parse { .. })));
        let one = SigningKey::jwks([&key]);
        assert!(matches!(Authenticator::from_jwks(&one, "", "aud", 5), Err(AuthSettingsError::Missing(_))));
        assert!(matches!(Authenticator::from_jwks(&one, "iss", "", 5), Err(AuthSettingsError::Missing(_))));
        assert!(Authenticator::from_jwks(&one, "iss", "aud", 5).is_ok());
    }

    #[test]
    fn a_remembered_token_is_answered_only_until_it_expires() {
        let key = SigningKey::generate(Algorithm::EdDSA).unwrap();
        let authenticator = Authenticator::from_jwks(&SigningKey::jwks([&key]), "iss", "aud", 0).unwrap();
        let claims = crate::auth::dev::TokenClaims {
            issuer: "iss".into(),
            audience: "aud".into(),
            subject: "checkout".into(),
            merchants: vec!["m1".into()],
            scope: "payments:read".into(),
            ttl_seconds: 1,
        };
        let header = format!("Bearer {}", key.sign(&claims.to_json()).unwrap());
        let first = authenticator.authenticate(Some(header.as_bytes())).unwrap();
        assert_eq!(authenticator.authenticate(Some(header.as_bytes())).unwrap(), first);
        assert_eq!(authenticator.verified.lock().unwrap().len(), 1);
        std::thread::sleep(std::time::Duration::from_millis(2_100));
        assert_eq!(authenticator.authenticate(Some(header.as_bytes())), Err(Unauthenticated::Expired));
        // A NumericDate may hold a fraction (RFC 7519, section 2).
        let mut fractional = claims.to_json();
        fractional["exp"] = serde_json::json!(fractional["exp"].as_f64().unwrap() + 600.5);
        let header = format!("Bearer {}", key.sign(&fractional).unwrap());
        assert!(authenticator.authenticate(Some(header.as_bytes())).is_ok());
        fractional["exp"] = serde_json::json!(fractional["exp"].as_f64().unwrap() - 3600.0);
        let header = format!("Bearer {}", key.sign(&fractional).unwrap());
        assert_eq!(authenticator.authenticate(Some(header.as_bytes())), Err(Unauthenticated::Expired));
        // Another token is another entry, however alike.
        let other = format!("Bearer {}x", key.sign(&claims.to_json()).unwrap());
        assert_eq!(authenticator.authenticate(Some(other.as_bytes())), Err(Unauthenticated::Invalid));
    }
}
