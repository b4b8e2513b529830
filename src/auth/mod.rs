//! The trust boundary: who the caller is and what it may do.
//!
//! - Authentication ([`Authenticator`]): every RPC except health and reflection carries
//!   `authorization: Bearer <JWT>`, verified against the public keys of a JWK set (RFC 7517:
//!   a file or an `https://` URL, kept fresh by [`jwks`]; EdDSA, ES256 and RS256, RFC 7518
//!   and RFC 8037) with the `jsonwebtoken` crate: signature,
//!   `iss`, `aud`, `exp` and `nbf` (with a leeway of a few seconds for clock skew).
//! - Authorization ([`Caller`]): the token's `scope` claim (space-separated [`Permission`]s)
//!   and its `merchants` claim (the merchant_ids it may act for, or `["*"]`).
//!
//! A server run without authentication (loopback only, or with
//! `--insecure-allow-unauthenticated`) treats every call as [`Caller::anonymous`], which may
//! do everything.

pub mod dev;
pub mod jwks;
mod jwt;

use std::collections::BTreeSet;
use std::fmt;

pub use jwt::{AuthSettingsError, Authenticator, LEEWAY_SECONDS_DEFAULT, TOKEN_BYTES_MAX};

use crate::domain::{Actor, MerchantId};

/// What a caller may do, as named in the token's `scope` claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Permission {
    /// CreateOrder, CloseOrder, Pay, Refund, IssueToken, Authorize, Capture, Void.
    PaymentsWrite,
    /// Query.
    PaymentsRead,
    /// Transfer.
    AccountsWrite,
    /// GetAccount, ListEntries.
    AccountsRead,
    /// OpenAccount, Deposit, Withdraw.
    AccountsAdmin,
}

impl Permission {
    pub const ALL: [Permission; 5] = [
        Permission::PaymentsWrite,
        Permission::PaymentsRead,
        Permission::AccountsWrite,
        Permission::AccountsRead,
        Permission::AccountsAdmin,
    ];

    /// The scope string of the `scope` claim.
    pub fn as_str(self) -> &'static str {
        match self {
            Permission::PaymentsWrite => "payments:write",
            Permission::PaymentsRead => "payments:read",
            Permission::AccountsWrite => "accounts:write",
            Permission::AccountsRead => "accounts:read",
            Permission::AccountsAdmin => "accounts:admin",
        }
    }

    pub fn parse(raw: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|permission| permission.as_str() == raw)
    }
}

impl fmt::Display for Permission {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The merchants a caller may act for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MerchantGrant {
    /// `merchants: ["*"]`.
    All,
    /// Exactly these merchant_ids (byte for byte).
    Only(BTreeSet<String>),
}

/// An authenticated caller: its identity and its grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub actor: Actor,
    merchants: MerchantGrant,
    permissions: BTreeSet<Permission>,
}

/// Why a call carries no usable credential: UNAUTHENTICATED with the ErrorInfo reason of
/// [`Unauthenticated::reason`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Unauthenticated {
    #[error("this call needs `authorization: Bearer <JWT>`")]
    Missing,
    #[error("the credential is malformed or cannot be verified")]
    Invalid,
    #[error("the credential has expired")]
    Expired,
}

impl Unauthenticated {
    pub fn reason(self) -> &'static str {
        match self {
            Unauthenticated::Missing => "CREDENTIALS_MISSING",
            Unauthenticated::Invalid => "CREDENTIALS_INVALID",
            Unauthenticated::Expired => "CREDENTIALS_EXPIRED",
        }
    }
}

/// An authenticated caller acting outside its grant: PERMISSION_DENIED with the ErrorInfo
/// reason of [`Denied::reason`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Denied {
    #[error("the caller may not act for this merchant_id")]
    MerchantNotAllowed,
    #[error("the caller's token lacks the scope {0}")]
    ScopeMissing(Permission),
}

impl Denied {
    pub fn reason(self) -> &'static str {
        match self {
            Denied::MerchantNotAllowed => "MERCHANT_NOT_ALLOWED",
            Denied::ScopeMissing(_) => "SCOPE_MISSING",
        }
    }
}

impl Caller {
    /// The caller of a server without authentication: may do everything.
    pub fn anonymous() -> Self {
        Self { actor: Actor::Anonymous, merchants: MerchantGrant::All, permissions: Permission::ALL.into() }
    }

    pub fn new(actor: Actor, merchants: MerchantGrant, permissions: BTreeSet<Permission>) -> Self {
        Self { actor, merchants, permissions }
    }

    /// # Errors
    /// [`Denied::ScopeMissing`] naming `permission`.
    pub fn require(&self, permission: Permission) -> Result<(), Denied> {
        if self.permissions.contains(&permission) {
            Ok(())
        } else {
            Err(Denied::ScopeMissing(permission))
        }
    }

    /// # Errors
    /// [`Denied::MerchantNotAllowed`].
    pub fn require_merchant(&self, merchant_id: &MerchantId) -> Result<(), Denied> {
        match &self.merchants {
            MerchantGrant::All => Ok(()),
            MerchantGrant::Only(merchants) if merchants.contains(merchant_id.as_str()) => Ok(()),
            MerchantGrant::Only(_) => Err(Denied::MerchantNotAllowed),
        }
    }

    /// The `sub` for logs; `anonymous` without authentication.
    pub fn subject(&self) -> &str {
        self.actor.created_by()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Subject;

    fn merchant(raw: &str) -> MerchantId {
        MerchantId::parse("merchant_id", raw).unwrap()
    }

    #[test]
    fn a_caller_may_do_exactly_what_its_scopes_and_merchants_grant() {
        let caller = Caller::new(
            Actor::Subject(Subject::parse("checkout").unwrap()),
            MerchantGrant::Only(["m-1".to_owned()].into()),
            [Permission::PaymentsWrite].into(),
        );
        assert_eq!(caller.require(Permission::PaymentsWrite), Ok(()));
        assert_eq!(caller.require(Permission::PaymentsRead), Err(Denied::ScopeMissing(Permission::PaymentsRead)));
        assert_eq!(caller.require_merchant(&merchant("m-1")), Ok(()));
        assert_eq!(caller.require_merchant(&merchant("m-2")), Err(Denied::MerchantNotAllowed));
        assert_eq!(caller.require_merchant(&merchant("M-1")), Err(Denied::MerchantNotAllowed));
    }

    #[test]
    fn the_anonymous_caller_may_do_everything() {
        let caller = Caller::anonymous();
        for permission in Permission::ALL {
            assert_eq!(caller.require(permission), Ok(()));
            assert_eq!(Permission::parse(permission.as_str()), Some(permission));
        }
        assert_eq!(caller.require_merchant(&merchant("any")), Ok(()));
    }
}
