//! Business numbers: caller-chosen identifiers that double as idempotency keys.
//!
//! Why these alphabets, compared byte for byte: `docs/decisions/006-ambiguous-identifiers-refused.md`.

use super::FieldViolation;

/// The longest business number, in characters.
pub const BUSINESS_NO_LEN_MAX: usize = 64;

/// Checks the shared rule for business numbers: 1-64 characters of `[A-Za-z0-9._:-]`.
fn check_business_no(field: &'static str, raw: &str) -> Result<(), FieldViolation> {
    if raw.is_empty() {
        return Err(FieldViolation::new(field, "is required"));
    }
    if raw.len() > BUSINESS_NO_LEN_MAX {
        return Err(FieldViolation::new(field, format!("must be at most {BUSINESS_NO_LEN_MAX} characters")));
    }
    let allowed = |c: u8| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b':' | b'-');
    if !raw.bytes().all(allowed) {
        return Err(FieldViolation::new(field, "may contain only A-Z a-z 0-9 . _ : -"));
    }
    Ok(())
}

macro_rules! business_number {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(String);

        impl $name {
            /// Parses a raw wire value; `field` names the proto field in the violation.
            ///
            /// # Errors
            /// A [`FieldViolation`] when the value is empty, longer than 64 characters or
            /// has a character outside `[A-Za-z0-9._:-]`.
            pub fn parse(field: &'static str, raw: &str) -> Result<Self, FieldViolation> {
                check_business_no(field, raw)?;
                Ok(Self(raw.to_owned()))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

business_number!(
    /// A caller-chosen account id.
    AccountId
);
business_number!(
    /// The merchant that owns orders, payments and refunds; scopes their numbers.
    MerchantId
);
business_number!(
    /// The merchant's order number, unique per merchant.
    OrderNo
);
business_number!(
    /// The merchant's payment number: the idempotency key of a Pay, unique per merchant.
    OutTradeNo
);
business_number!(
    /// The merchant's refund number: the idempotency key of a Refund, unique per merchant.
    OutRefundNo
);
business_number!(
    /// The merchant's authorization number: the idempotency key of an Authorize (a hold),
    /// unique per merchant.
    OutAuthNo
);
business_number!(
    /// The idempotency key of a Deposit, unique across all deposits (and of a Withdraw,
    /// unique across all withdrawals).
    RequestId
);

/// A client-supplied idempotency key (the `idempotency-key` header): 1-128 printable ASCII
/// characters (0x20-0x7E) other than `,`, neither beginning nor ending with a space. Keys
/// compare byte for byte, so `k` and `K` are two keys on every backend.
///
/// The refused forms have more than one reading, so they are refused rather than kept:
/// - a space at either end: HTTP field values exclude leading and trailing whitespace
///   (RFC 9110, section 5.5), so a proxy or client library may strip it, and MySQL's PAD
///   SPACE collations compare `k` and `k ` as equal;
/// - a comma: an intermediary may join two header lines of one name into one value with a
///   comma (RFC 9110, section 5.3), so `a,b` may be one key or two.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// The longest key, in characters.
    pub const LEN_MAX: usize = 128;

    /// # Errors
    /// A [`FieldViolation`] on `field` when the key is empty, too long, not printable ASCII,
    /// holds a comma, or begins or ends with a space.
    pub fn parse(field: &'static str, raw: &str) -> Result<Self, FieldViolation> {
        if raw.is_empty() || raw.len() > Self::LEN_MAX {
            return Err(FieldViolation::new(field, format!("must be 1-{} characters", Self::LEN_MAX)));
        }
        if !raw.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
            return Err(FieldViolation::new(field, "must be printable ASCII (0x20-0x7E)"));
        }
        if raw.starts_with(' ') || raw.ends_with(' ') {
            return Err(FieldViolation::new(field, "must not begin or end with a space"));
        }
        if raw.contains(',') {
            return Err(FieldViolation::new(field, "must not contain a comma (it joins repeated headers)"));
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A server-issued one-time token (the `idempotency-token` header): 16-64 characters of
/// `[A-Za-z0-9_-]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OneTimeToken(String);

impl OneTimeToken {
    /// # Errors
    /// A [`FieldViolation`] on `field` when the text cannot be a token of this service.
    pub fn parse(field: &'static str, raw: &str) -> Result<Self, FieldViolation> {
        let allowed = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b'-';
        if !(16..=64).contains(&raw.len()) || !raw.bytes().all(allowed) {
            return Err(FieldViolation::new(field, "is not a token issued by IssueToken"));
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Free text such as an order subject or a refund reason: at most 256 characters, no
/// control characters. May be empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FreeText(String);

impl FreeText {
    /// The longest free text, in characters (Unicode scalar values).
    pub const LEN_MAX: usize = 256;

    /// # Errors
    /// A [`FieldViolation`] when `raw` is longer than [`FreeText::LEN_MAX`] characters or
    /// holds a control character.
    pub fn parse(field: &'static str, raw: &str) -> Result<Self, FieldViolation> {
        // Bytes bound the work before characters are counted.
        if raw.len() > Self::LEN_MAX * 4 || raw.chars().count() > Self::LEN_MAX {
            return Err(FieldViolation::new(field, format!("must be at most {} characters", Self::LEN_MAX)));
        }
        if raw.chars().any(char::is_control) {
            return Err(FieldViolation::new(field, "must not contain control characters"));
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn business_number_of_allowed_characters_is_accepted() {
        let no = OutTradeNo::parse("out_trade_no", "ORD-2026.11_29:0001").unwrap();
        assert_eq!(no.as_str(), "ORD-2026.11_29:0001");
    }

    #[test]
    fn empty_business_number_is_rejected_as_required() {
        let err = OrderNo::parse("order_no", "").unwrap_err();
        assert_eq!(err.field, "order_no");
        assert_eq!(err.description, "is required");
    }

    #[test]
    fn business_number_of_65_characters_is_rejected() {
        assert!(MerchantId::parse("merchant_id", &"a".repeat(64)).is_ok());
        assert!(MerchantId::parse("merchant_id", &"a".repeat(65)).is_err());
    }

    #[test]
    fn idempotency_key_is_1_to_128_printable_ascii_characters() {
        assert!(IdempotencyKey::parse("idempotency-key", "a b~!").is_ok());
        assert!(IdempotencyKey::parse("idempotency-key", &"k".repeat(128)).is_ok());
        for raw in ["", "tab\there", "caf\u{e9}", "nul\0", &"k".repeat(129)] {
            assert!(IdempotencyKey::parse("idempotency-key", raw).is_err(), "{raw:?}");
        }
    }

    #[test]
    fn idempotency_key_with_a_space_at_either_end_or_a_comma_is_rejected_and_a_space_inside_is_kept() {
        for raw in ["k ", " k", " ", "k\t", "a,b"] {
            assert!(IdempotencyKey::parse("idempotency-key", raw).is_err(), "{raw:?}");
        }
        assert_eq!(IdempotencyKey::parse("idempotency-key", "a b").unwrap().as_str(), "a b");
    }

    #[test]
    fn token_text_is_checked_before_any_lookup() {
        assert!(OneTimeToken::parse("idempotency-token", "abcdefghijklmnop").is_ok());
        assert!(OneTimeToken::parse("idempotency-token", "short").is_err());
        assert!(OneTimeToken::parse("idempotency-token", "abcdefghijklmnop!").is_err());
    }

    #[test]
    fn free_text_of_256_characters_is_accepted_and_257_rejected() {
        assert!(FreeText::parse("subject", &"\u{e9}".repeat(256)).is_ok());
        assert!(FreeText::parse("subject", &"a".repeat(257)).is_err());
        assert!(FreeText::parse("subject", "line\nbreak").is_err());
        assert!(FreeText::parse("subject", "").is_ok());
    }

    #[test]
    fn business_number_with_space_slash_or_non_ascii_is_rejected() {
        for raw in ["a b", "a/b", "caf\u{e9}", "a\0", "@external:USD"] {
            assert!(AccountId::parse("account_id", raw).is_err(), "{raw:?}");
        }
    }
}
