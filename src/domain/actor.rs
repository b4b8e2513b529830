//! Who made a change: the authenticated caller's `sub`, recorded as `created_by`.

use sha2::{Digest, Sha256};

/// What `created_by` holds in rows written before callers were recorded (the migrations'
/// default), and in stored answers of the release before, which have no such field.
pub const CREATED_BY_UNKNOWN: &str = "unknown";

/// What `created_by` records for a call without authentication.
const ANONYMOUS: &str = "anonymous";

/// The caller a call runs for.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub enum Actor {
    /// A call to a server that runs without authentication (loopback only, or
    /// `--insecure-allow-unauthenticated`): recorded as `anonymous`.
    #[default]
    Anonymous,
    /// The `sub` claim of a verified JWT.
    Subject(Subject),
}

/// A JWT `sub` as payledger accepts it: 1-[`Subject::LEN_MAX`] printable ASCII characters
/// without spaces (RFC 7519 allows any StringOrURI; identity providers issue ids, e-mail
/// addresses, URIs and SPIFFE ids, all of which fit), other than the two values `created_by`
/// reserves: `anonymous` and `unknown`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Subject(String);

impl Subject {
    pub const LEN_MAX: usize = 128;

    /// `None` for an empty, too long, non-printable or reserved `sub`.
    pub fn parse(raw: &str) -> Option<Self> {
        let printable = raw.bytes().all(|b| b.is_ascii_graphic());
        let reserved = matches!(raw, ANONYMOUS | CREATED_BY_UNKNOWN);
        (!raw.is_empty() && raw.len() <= Self::LEN_MAX && printable && !reserved).then(|| Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Actor {
    /// What `created_by` records.
    pub fn created_by(&self) -> &str {
        match self {
            Actor::Anonymous => ANONYMOUS,
            Actor::Subject(subject) => subject.as_str(),
        }
    }

    /// The tag that puts this caller's idempotency keys and one-time tokens apart from every
    /// other caller's: 32 hex characters of SHA-256 of the `sub` (fixed length, whatever the
    /// `sub`). `None` for [`Actor::Anonymous`], whose keys stay where they were before callers
    /// were authenticated.
    pub fn scope_tag(&self) -> Option<String> {
        match self {
            Actor::Anonymous => None,
            Actor::Subject(subject) => {
                let digest = Sha256::digest(subject.as_str().as_bytes());
                Some(digest.iter().take(16).map(|byte| format!("{byte:02x}")).collect())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_subject_is_printable_ascii_of_bounded_length() {
        assert!(Subject::parse("checkout").is_some());
        assert!(Subject::parse("spiffe://prod/ns/shop/sa/checkout").is_some());
        assert!(Subject::parse("").is_none());
        assert!(Subject::parse("two words").is_none());
        assert!(Subject::parse("caf\u{e9}").is_none());
        assert!(Subject::parse(&"a".repeat(Subject::LEN_MAX)).is_some());
        assert!(Subject::parse(&"a".repeat(Subject::LEN_MAX + 1)).is_none());
        assert!(Subject::parse("anonymous").is_none() && Subject::parse("unknown").is_none());
    }

    #[test]
    fn each_subject_has_its_own_fixed_length_scope_tag_and_anonymous_has_none() {
        let tag = |sub: &str| Actor::Subject(Subject::parse(sub).unwrap()).scope_tag().unwrap();
        assert_eq!(tag("a").len(), 32);
        assert_ne!(tag("a"), tag("b"));
        assert_eq!(tag("a"), tag("a"));
        assert_eq!(Actor::Anonymous.scope_tag(), None);
        assert_eq!(Actor::Anonymous.created_by(), "anonymous");
    }
}
