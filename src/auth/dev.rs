//! A development aid: a signing key pair and tokens for local use (`payledger auth keygen`,
//! `payledger auth mint`), and for tests. Production tokens come from the organisation's
//! identity provider; payledger only ever needs its public keys (the JWKS file).

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use jsonwebtoken::jwk::{Jwk, JwkSet, ThumbprintHash};
use jsonwebtoken::{EncodingKey, Header};

/// The signing algorithms (the `jsonwebtoken` crate's), for [`SigningKey::generate`].
pub use jsonwebtoken::Algorithm;

/// The private key file written by keygen (PKCS #8 PEM).
pub const PRIVATE_KEY_FILE: &str = "jwt-signing-key.pem";
/// The public key file written by keygen, for `--auth-jwks`.
pub const JWKS_FILE: &str = "jwks.json";

#[derive(Debug, thiserror::Error)]
pub enum DevKeyError {
    #[error("cannot generate a key: {0}")]
    Generate(String),
    #[error("the key is not a usable {algorithm:?} private key (PKCS #8 PEM): {detail}")]
    Key { algorithm: Algorithm, detail: String },
    #[error("cannot write {path}: {source}")]
    Write { path: String, source: std::io::Error },
    #[error("cannot read {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("cannot sign the token: {0}")]
    Sign(String),
}

/// A private signing key with its public JWK; the `kid` is the key's RFC 7638 thumbprint.
pub struct SigningKey {
    algorithm: Algorithm,
    key: EncodingKey,
    pem: String,
    jwk: Jwk,
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKey").field("algorithm", &self.algorithm).field("kid", &self.kid()).finish()
    }
}

/// The PEM of a PKCS #8 private key without its optional public key: ring (behind rcgen)
/// writes RFC 5958 "v2" keys that carry it, which OpenSSL 3.0 and Python's `cryptography`
/// cannot read for Ed25519; RFC 5208 "v1", which every tool reads, leaves it out.
fn pkcs8_v1_pem(der: &[u8]) -> Result<String, DevKeyError> {
    use pkcs8::der::Decode as _;
    let failed = |error: &dyn std::fmt::Display| DevKeyError::Generate(error.to_string());
    let info = pkcs8::PrivateKeyInfoRef::from_der(der).map_err(|error| failed(&error))?;
    let v1 = pkcs8::PrivateKeyInfoRef { public_key: None, ..info };
    let document = pkcs8::SecretDocument::try_from(&v1).map_err(|error| failed(&error))?;
    let pem = document.to_pem("PRIVATE KEY", pkcs8::LineEnding::LF).map_err(|error| failed(&error))?;
    Ok(pem.to_string())
}

impl SigningKey {
    /// A fresh key: `Algorithm::EdDSA` (Ed25519) or `Algorithm::ES256` (P-256).
    ///
    /// # Errors
    /// [`DevKeyError::Generate`] for another algorithm (RS256 keys come from elsewhere: see
    /// [`SigningKey::from_pem`]).
    pub fn generate(algorithm: Algorithm) -> Result<Self, DevKeyError> {
        let kind = match algorithm {
            Algorithm::EdDSA => &rcgen::PKCS_ED25519,
            Algorithm::ES256 => &rcgen::PKCS_ECDSA_P256_SHA256,
            other => return Err(DevKeyError::Generate(format!("{other:?} keys are not generated here"))),
        };
        let pair = rcgen::KeyPair::generate_for(kind).map_err(|error| DevKeyError::Generate(error.to_string()))?;
        Self::from_pem(algorithm, &pkcs8_v1_pem(&pair.serialize_der())?)
    }

    /// A private key in PKCS #8 PEM (PKCS #1 also for RS256).
    ///
    /// # Errors
    /// [`DevKeyError::Key`].
    pub fn from_pem(algorithm: Algorithm, pem: &str) -> Result<Self, DevKeyError> {
        let bad = |detail: String| DevKeyError::Key { algorithm, detail };
        let key = match algorithm {
            Algorithm::EdDSA => EncodingKey::from_ed_pem(pem.as_bytes()),
            Algorithm::ES256 => EncodingKey::from_ec_pem(pem.as_bytes()),
            Algorithm::RS256 => EncodingKey::from_rsa_pem(pem.as_bytes()),
            other => return Err(bad(format!("{other:?} is not supported"))),
        }
        .map_err(|error| bad(error.to_string()))?;
        let mut jwk = match algorithm {
            // jsonwebtoken derives an Ed25519 public key only from a PKCS #8 v1 key, and ring
            // (behind rcgen) writes v2 (RFC 5958, the public key included): read it with rcgen.
            Algorithm::EdDSA => {
                let pair = rcgen::KeyPair::from_pem(pem).map_err(|error| bad(error.to_string()))?;
                let x = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(pair.public_key_raw());
                let public = serde_json::json!({"kty": "OKP", "crv": "Ed25519", "x": x, "alg": "EdDSA"});
                serde_json::from_value(public).map_err(|error| bad(error.to_string()))?
            }
            _ => Jwk::from_encoding_key(&key, algorithm).map_err(|error| bad(error.to_string()))?,
        };
        let kid = jwk.thumbprint(ThumbprintHash::SHA256).map_err(|error| bad(error.to_string()))?;
        jwk.common.key_id = Some(kid);
        Ok(Self { algorithm, key, pem: pem.to_owned(), jwk })
    }

    /// Reads a key file written by [`SigningKey::write`], of any algorithm it holds.
    ///
    /// # Errors
    /// [`DevKeyError::Read`], [`DevKeyError::Key`].
    pub fn read(path: &Path) -> Result<Self, DevKeyError> {
        let pem = std::fs::read_to_string(path)
            .map_err(|source| DevKeyError::Read { path: path.display().to_string(), source })?;
        let mut last = None;
        for algorithm in [Algorithm::EdDSA, Algorithm::ES256, Algorithm::RS256] {
            match Self::from_pem(algorithm, &pem) {
                Ok(key) => return Ok(key),
                Err(error) => last = Some(error),
            }
        }
        Err(last.unwrap_or_else(|| DevKeyError::Generate("no algorithm".into())))
    }

    pub fn kid(&self) -> &str {
        self.jwk.common.key_id.as_deref().unwrap_or_default()
    }

    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The public half, as a JWK (with `kid` and `alg`).
    pub fn public_jwk(&self) -> &Jwk {
        &self.jwk
    }

    /// A JWK set of the public keys of `keys`, as `--auth-jwks` reads it.
    pub fn jwks<'a>(keys: impl IntoIterator<Item = &'a SigningKey>) -> String {
        let set = JwkSet { keys: keys.into_iter().map(|key| key.jwk.clone()).collect() };
        serde_json::to_string_pretty(&set).unwrap_or_default()
    }

    /// Writes the private key (`jwt-signing-key.pem`, readable by the owner only) and the JWK
    /// set of its public key (`jwks.json`, readable by all) into `directory`.
    ///
    /// # Errors
    /// [`DevKeyError::Write`].
    pub fn write(&self, directory: &Path) -> Result<(), DevKeyError> {
        let write = |name: &str, text: &str, private: bool| {
            let path = directory.join(name);
            let failed = |source| DevKeyError::Write { path: path.display().to_string(), source };
            let mut options = std::fs::OpenOptions::new();
            options.write(true).create(true).truncate(true);
            #[cfg(unix)]
            if private {
                use std::os::unix::fs::OpenOptionsExt;
                options.mode(0o600);
            }
            #[cfg(not(unix))]
            let _ = private;
            let mut file = options.open(&path).map_err(failed)?;
            // The public JWKS readable by all whatever the umask (a container that runs as
            // another user mounts it); the private key stays the owner's.
            #[cfg(unix)]
            if !private {
                use std::os::unix::fs::PermissionsExt;
                file.set_permissions(std::fs::Permissions::from_mode(0o644)).map_err(failed)?;
            }
            std::io::Write::write_all(&mut file, text.as_bytes()).map_err(failed)
        };
        std::fs::create_dir_all(directory)
            .map_err(|source| DevKeyError::Write { path: directory.display().to_string(), source })?;
        write(PRIVATE_KEY_FILE, &self.pem, true)?;
        write(JWKS_FILE, &(Self::jwks([self]) + "\n"), false)
    }

    /// Signs `claims` (a JSON object) with this key, `kid` in the header.
    ///
    /// # Errors
    /// [`DevKeyError::Sign`].
    pub fn sign(&self, claims: &serde_json::Value) -> Result<String, DevKeyError> {
        let mut header = Header::new(self.algorithm);
        header.kid = Some(self.kid().to_owned());
        jsonwebtoken::encode(&header, claims, &self.key).map_err(|error| DevKeyError::Sign(error.to_string()))
    }
}

/// What a minted token says.
#[derive(Debug, Clone)]
pub struct TokenClaims {
    pub issuer: String,
    pub audience: String,
    pub subject: String,
    /// merchant_ids, or `["*"]`.
    pub merchants: Vec<String>,
    /// Space-separated scopes.
    pub scope: String,
    /// Seconds from now until `exp`.
    pub ttl_seconds: u64,
}

impl TokenClaims {
    /// The JSON claims, with `iat` and `nbf` now and `exp` after the TTL.
    pub fn to_json(&self) -> serde_json::Value {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |elapsed| elapsed.as_secs());
        serde_json::json!({
            "iss": self.issuer,
            "aud": self.audience,
            "sub": self.subject,
            "merchants": self.merchants,
            "scope": self.scope,
            "iat": now,
            "nbf": now,
            "exp": now.saturating_add(self.ttl_seconds),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::{Authenticator, Permission};

    #[test]
    fn a_minted_token_verifies_against_the_written_jwks() {
        let directory = tempfile::tempdir().unwrap();
        let key = SigningKey::generate(Algorithm::EdDSA).unwrap();
        key.write(directory.path()).unwrap();
        let reread = SigningKey::read(&directory.path().join(PRIVATE_KEY_FILE)).unwrap();
        assert_eq!(reread.kid(), key.kid());
        let claims = TokenClaims {
            issuer: "iss".into(),
            audience: "aud".into(),
            subject: "checkout".into(),
            merchants: vec!["m-1".into()],
            scope: "payments:write payments:read".into(),
            ttl_seconds: 60,
        };
        let token = reread.sign(&claims.to_json()).unwrap();
        let authenticator = Authenticator::from_file(&directory.path().join(JWKS_FILE), "iss", "aud", 5).unwrap();
        let caller = authenticator.authenticate(Some(format!("Bearer {token}").as_bytes())).unwrap();
        assert_eq!(caller.subject(), "checkout");
        assert!(caller.require(Permission::PaymentsRead).is_ok());
        assert!(caller.require(Permission::AccountsAdmin).is_err());
    }
}
