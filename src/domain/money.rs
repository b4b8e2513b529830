//! Money: ISO 4217 currencies and amounts held as integer minor units.

use std::fmt;

use rust_decimal::Decimal;

use super::FieldViolation;

/// The largest amount of one request, in minor units (10^15: ten trillion USD in cents).
pub const AMOUNT_MINOR_UNITS_MAX: i64 = 1_000_000_000_000_000;

/// The largest balance an account may hold, in minor units (10^17). It leaves room below
/// `i64::MAX` so that sums over many accounts cannot overflow a BIGINT.
pub const BALANCE_MINOR_UNITS_MAX: i64 = 100_000_000_000_000_000;

/// The longest amount string accepted from the wire, checked before parsing.
const AMOUNT_TEXT_LEN_MAX: usize = 32;

/// An ISO 4217 currency that has a minor unit (the table comes from the `iso_currency`
/// crate). Codes without one, such as XAU (gold) or XXX, are rejected: they cannot be
/// held as integer minor units.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Currency {
    iso: iso_currency::Currency,
    minor_unit_digits: u32,
}

impl Currency {
    /// Parses an upper-case ISO 4217 alphabetic code such as `"USD"`.
    ///
    /// # Errors
    /// A [`FieldViolation`] for an unknown code, a lower-case code or a currency without a
    /// minor unit.
    pub fn parse(field: &'static str, raw: &str) -> Result<Self, FieldViolation> {
        if raw.is_empty() {
            return Err(FieldViolation::new(field, "is required"));
        }
        if raw.len() != 3 || !raw.bytes().all(|b| b.is_ascii_uppercase()) {
            return Err(FieldViolation::new(field, "must be an ISO 4217 code such as USD"));
        }
        let iso = iso_currency::Currency::from_code(raw)
            .ok_or_else(|| FieldViolation::new(field, "is not an ISO 4217 currency"))?;
        let minor_unit_digits = iso
            .exponent()
            .ok_or_else(|| FieldViolation::new(field, "has no minor unit and cannot be held by the ledger"))?;
        Ok(Self { iso, minor_unit_digits: u32::from(minor_unit_digits) })
    }

    /// The three-letter code, e.g. `"USD"`.
    pub fn code(&self) -> &'static str {
        self.iso.code()
    }

    /// Digits after the decimal point in this currency's minor unit (ISO 4217 "exponent"):
    /// 2 for USD, 0 for JPY, 3 for KWD.
    pub fn minor_unit_digits(&self) -> u32 {
        self.minor_unit_digits
    }
}

impl fmt::Display for Currency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

/// A positive amount of money: integer minor units of one currency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Amount {
    minor_units: i64,
    currency: Currency,
}

impl Amount {
    /// Parses a decimal string in major units, e.g. `"100.00"` USD is 10 000 minor units.
    ///
    /// Accepted: ASCII digits with an optional `.` and at least one digit after it, no more
    /// fraction digits than the currency's minor unit, more than zero and at most
    /// [`AMOUNT_MINOR_UNITS_MAX`] minor units. Refused: signs, exponents, spaces, separators.
    ///
    /// # Errors
    /// A [`FieldViolation`] naming `field` with the rule that failed.
    pub fn parse(field: &'static str, raw: &str, currency: Currency) -> Result<Self, FieldViolation> {
        let fraction = Self::check_text(field, raw)?;
        let digits = currency.minor_unit_digits();
        if fraction.map_or(0, str::len) > digits as usize {
            return Err(FieldViolation::new(field, format!("{currency} allows at most {digits} fraction digits")));
        }
        let too_large = || {
            FieldViolation::new(field, format!("must be at most {}", format_minor(AMOUNT_MINOR_UNITS_MAX, currency)))
        };
        let decimal = Decimal::from_str_exact(raw).map_err(|_| too_large())?;
        let minor_units = decimal
            .checked_mul(Decimal::from(10_i64.pow(digits)))
            .and_then(|scaled| i64::try_from(scaled.normalize()).ok())
            .ok_or_else(too_large)?;
        if minor_units <= 0 {
            return Err(FieldViolation::new(field, "must be more than zero"));
        }
        if minor_units > AMOUNT_MINOR_UNITS_MAX {
            return Err(too_large());
        }
        Ok(Self { minor_units, currency })
    }

    /// Checks the text of an amount whatever its currency: present, short enough, digits with
    /// an optional fraction. Returns the fraction digits (the part after `.`).
    ///
    /// # Errors
    /// A [`FieldViolation`] naming `field` with the rule that failed.
    pub fn check_text<'a>(field: &'static str, raw: &'a str) -> Result<Option<&'a str>, FieldViolation> {
        if raw.is_empty() {
            return Err(FieldViolation::new(field, "is required"));
        }
        if raw.len() > AMOUNT_TEXT_LEN_MAX {
            return Err(FieldViolation::new(field, format!("must be at most {AMOUNT_TEXT_LEN_MAX} characters")));
        }
        let (whole, fraction) = match raw.split_once('.') {
            Some((whole, fraction)) => (whole, Some(fraction)),
            None => (raw, None),
        };
        let all_digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !all_digits(whole) || !fraction.is_none_or(all_digits) {
            return Err(FieldViolation::new(
                field,
                "must be a decimal number such as 100.00 (digits, optional fraction, no sign)",
            ));
        }
        Ok(fraction)
    }

    /// Builds an amount from stored minor units (trusted: written by this service).
    ///
    /// # Panics
    /// When `minor_units` is not positive, which would mean corrupted storage.
    pub fn from_minor_units(minor_units: i64, currency: Currency) -> Self {
        assert!(minor_units > 0, "a stored amount is always positive");
        Self { minor_units, currency }
    }

    pub fn minor_units(&self) -> i64 {
        self.minor_units
    }

    pub fn currency(&self) -> Currency {
        self.currency
    }
}

impl fmt::Display for Amount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_minor(self.minor_units, self.currency))
    }
}

/// Formats signed minor units with exactly the currency's fraction digits:
/// `format_minor(-150, USD) == "-1.50"`, `format_minor(5, JPY) == "5"`.
pub fn format_minor(minor_units: i64, currency: Currency) -> String {
    Decimal::new(minor_units, currency.minor_unit_digits()).to_string()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn usd() -> Currency {
        Currency::parse("currency", "USD").unwrap()
    }

    fn currency(code: &str) -> Currency {
        Currency::parse("currency", code).unwrap()
    }

    #[test]
    fn amount_in_major_units_becomes_minor_units() {
        assert_eq!(Amount::parse("amount", "100.00", usd()).unwrap().minor_units(), 10_000);
        assert_eq!(Amount::parse("amount", "100.5", usd()).unwrap().minor_units(), 10_050);
        assert_eq!(Amount::parse("amount", "7", usd()).unwrap().minor_units(), 700);
        assert_eq!(Amount::parse("amount", "0.01", usd()).unwrap().minor_units(), 1);
    }

    #[test]
    fn currencies_follow_their_iso_4217_minor_unit() {
        assert_eq!(Amount::parse("amount", "500", currency("JPY")).unwrap().minor_units(), 500);
        assert_eq!(Amount::parse("amount", "1.234", currency("KWD")).unwrap().minor_units(), 1234);
        assert!(Amount::parse("amount", "1.5", currency("JPY")).is_err());
    }

    #[test]
    fn amount_with_more_fraction_digits_than_the_currency_allows_is_rejected() {
        let err = Amount::parse("amount", "1.001", usd()).unwrap_err();
        assert_eq!(err.description, "USD allows at most 2 fraction digits");
    }

    #[test]
    fn zero_signed_exponent_and_spaced_amounts_are_rejected() {
        for raw in
            ["", "0", "0.00", "-1.00", "+1.00", "1e2", " 1.00", "1.00 ", "1,000.00", "1.", ".5", "1..0", "NaN", "١"]
        {
            assert!(Amount::parse("amount", raw, usd()).is_err(), "{raw:?} was accepted");
        }
    }

    #[test]
    fn amount_above_the_maximum_is_rejected() {
        assert!(Amount::parse("amount", "10000000000000.00", usd()).is_ok());
        assert!(Amount::parse("amount", "10000000000000.01", usd()).is_err());
        assert!(Amount::parse("amount", &"9".repeat(30), usd()).is_err());
        assert!(Amount::parse("amount", &"9".repeat(33), usd()).is_err());
    }

    #[test]
    fn lower_case_unknown_and_unit_less_currencies_are_rejected() {
        for raw in ["usd", "US", "USDD", "ABC", "XAU", ""] {
            assert!(Currency::parse("currency", raw).is_err(), "{raw:?} was accepted");
        }
    }

    #[test]
    fn minor_units_format_with_exactly_the_currency_digits() {
        assert_eq!(format_minor(10_000, usd()), "100.00");
        assert_eq!(format_minor(-150, usd()), "-1.50");
        assert_eq!(format_minor(0, usd()), "0.00");
        assert_eq!(format_minor(5, currency("JPY")), "5");
        assert_eq!(format_minor(1, currency("KWD")), "0.001");
    }

    proptest! {
        #[test]
        fn formatting_then_parsing_gives_back_the_same_minor_units(minor in 1..=AMOUNT_MINOR_UNITS_MAX, code in prop::sample::select(vec!["USD", "JPY", "KWD", "CNY", "CLF"])) {
            let currency = currency(code);
            let text = format_minor(minor, currency);
            let parsed = Amount::parse("amount", &text, currency).unwrap();
            prop_assert_eq!(parsed.minor_units(), minor);
            prop_assert_eq!(parsed.to_string(), text);
        }

        #[test]
        fn arbitrary_text_never_panics_and_accepted_text_is_a_plain_decimal(raw in "\\PC{0,40}") {
            if let Ok(amount) = Amount::parse("amount", &raw, usd()) {
                prop_assert!(amount.minor_units() > 0 && amount.minor_units() <= AMOUNT_MINOR_UNITS_MAX);
                prop_assert!(raw.bytes().all(|b| b.is_ascii_digit() || b == b'.'));
            }
        }

        #[test]
        fn digit_strings_parse_to_the_exact_scaled_value(whole in 0u64..10_000_000, cents in 0u32..100) {
            let raw = format!("{whole}.{cents:02}");
            let expected = i64::try_from(whole).unwrap() * 100 + i64::from(cents);
            match Amount::parse("amount", &raw, usd()) {
                Ok(amount) => prop_assert_eq!(amount.minor_units(), expected),
                Err(_) => prop_assert_eq!(expected, 0),
            }
        }
    }
}
