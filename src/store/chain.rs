//! The journal's hash chain and the ledger's digest (docs/audit.md, "The hash chain"): pure
//! functions, used where entries are written (`crate::ledger::engine::book`) and where the
//! audit checks them.
//!
//! An entry's hash is SHA-256 (FIPS 180-4) over a domain tag, the hash of its account's entry
//! before it (32 zero bytes before the first) and its fields, each string length-prefixed and
//! each integer as 8 big-endian bytes, so that no two different entries encode alike. Stored as
//! 64 lowercase hex digits. A digest is the root of a Merkle tree over each account's latest
//! hash up to one entry id (leaves and nodes hashed apart, as RFC 6962 section 2.1 does).
//!
//! Why: `docs/decisions/007-journal-hash-chain.md`.

use std::fmt;
use std::str::FromStr;

use sha2::{Digest, Sha256};

/// A SHA-256 hash.
pub type Hash = [u8; 32];

/// What the first entry of an account chains from.
pub const GENESIS: Hash = [0; 32];

const ENTRY_TAG: &[u8] = b"payledger.journal_entry.v1";
const DIGEST_PREFIX: &str = "payledger-digest-v1";

/// The fields of a journal entry its hash covers: every column but `entry_id` (assigned by the
/// database after the hash is made; an account's entries are ordered by `version_after`).
#[derive(Debug, Clone, Copy)]
pub struct ChainedEntry<'a> {
    pub account_id: &'a str,
    pub currency: &'a str,
    /// Minor units, signed: negative debits the account.
    pub amount: i64,
    pub balance_after: i64,
    pub version_after: i64,
    pub kind: &'a str,
    pub reference: &'a str,
    pub posting_id: &'a str,
    pub counterparty_account_id: &'a str,
    /// Microseconds since the Unix epoch.
    pub created_at: i64,
    pub created_by: &'a str,
}

/// The hash of `entry` chained to `previous`, its account's hash before it ([`GENESIS`] for
/// the first).
#[must_use]
pub fn entry_hash(previous: &Hash, entry: &ChainedEntry<'_>) -> Hash {
    let mut hasher = Sha256::new();
    hasher.update(ENTRY_TAG);
    hasher.update(previous);
    for text in [entry.account_id, entry.currency] {
        update_text(&mut hasher, text);
    }
    for number in [entry.amount, entry.balance_after, entry.version_after] {
        hasher.update(number.to_be_bytes());
    }
    for text in [entry.kind, entry.reference, entry.posting_id, entry.counterparty_account_id] {
        update_text(&mut hasher, text);
    }
    hasher.update(entry.created_at.to_be_bytes());
    update_text(&mut hasher, entry.created_by);
    hasher.finalize().into()
}

fn update_text(hasher: &mut Sha256, text: &str) {
    // Column lengths are at most a few hundred bytes; a longer text still encodes uniquely.
    let length = u32::try_from(text.len()).unwrap_or(u32::MAX);
    hasher.update(length.to_be_bytes());
    hasher.update(text.as_bytes());
}

/// `hash` as 64 lowercase hex digits, as stored.
#[must_use]
pub fn to_hex(hash: &Hash) -> String {
    use fmt::Write;
    hash.iter().fold(String::with_capacity(64), |mut text, byte| {
        let _ = write!(text, "{byte:02x}");
        text
    })
}

/// The hash of 64 hex digits; `None` for anything else.
#[must_use]
pub fn from_hex(text: &str) -> Option<Hash> {
    // Lowercase only, as stored: one hash has one text.
    if text.len() != 64 || !text.bytes().all(|byte| byte.is_ascii_digit() || (b'a'..=b'f').contains(&byte)) {
        return None;
    }
    let mut hash = GENESIS;
    for (slot, pair) in hash.iter_mut().zip(text.as_bytes().chunks(2)) {
        *slot = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(hash)
}

/// A stored hash (`entry_hash`, `chain_hash`) as a hash: its hex digits decoded, or, when they
/// are not a hash (a hand-edited row), the SHA-256 of the text, so that it still counts.
#[must_use]
pub fn stored(text: &str) -> Hash {
    from_hex(text).unwrap_or_else(|| Sha256::digest(text.as_bytes()).into())
}

/// The root of the Merkle tree over `heads`, (account_id, latest hash) sorted by account_id:
/// a leaf is SHA-256(0x00, account_id length-prefixed, hash), a node SHA-256(0x01, left,
/// right), a last node without a sibling carried up as it is; the empty tree's root is
/// SHA-256 of nothing.
#[must_use]
pub fn merkle_root(heads: &[(String, Hash)]) -> Hash {
    if heads.is_empty() {
        return Sha256::digest([]).into();
    }
    let mut level: Vec<Hash> = heads
        .iter()
        .map(|(account_id, head)| {
            let mut hasher = Sha256::new();
            hasher.update([0]);
            update_text(&mut hasher, account_id);
            hasher.update(head);
            hasher.finalize().into()
        })
        .collect();
    while level.len() > 1 {
        level = level
            .chunks(2)
            .map(|pair| match pair {
                [left, right] => {
                    let mut hasher = Sha256::new();
                    hasher.update([1]);
                    hasher.update(left);
                    hasher.update(right);
                    hasher.finalize().into()
                }
                [alone] => *alone,
                _ => unreachable!("chunks of two"),
            })
            .collect();
    }
    level[0]
}

/// The first account, in account_id byte order, whose chain hash differs between `kept` (the
/// leaves a digest was made of) and `now` (both sorted by account_id), and how: `None` when
/// they are the same.
#[must_use]
pub fn first_difference(kept: &[(String, Hash)], now: &[(String, Hash)]) -> Option<String> {
    let (mut kept, mut now) = (kept.iter().peekable(), now.iter().peekable());
    loop {
        let found = match (kept.peek(), now.peek()) {
            (None, None) => return None,
            (Some(was), Some(is)) if was == is => {
                kept.next();
                now.next();
                continue;
            }
            (Some(was), Some(is)) if was.0 == is.0 && was.0 == ENTRIES_LEAF => {
                "the number of journal entries up to the entry changed".to_owned()
            }
            (Some(was), Some(is)) if was.0 == is.0 && was.0 == UNCHAINED_LEAF => {
                "the ranges of entries outside the chain (unchained_entries) up to the entry changed".to_owned()
            }
            (Some(was), Some(is)) if was.0 == is.0 => format!("account {}: its history up to the entry changed", was.0),
            (Some(was), Some(is)) if was.0.as_bytes() < is.0.as_bytes() => {
                format!("account {}: its chained history is gone", was.0)
            }
            (Some(was), None) => format!("account {}: its chained history is gone", was.0),
            (_, Some(is)) => format!("account {}: a chained history the digest did not have", is.0),
        };
        return Some(found);
    }
}

/// The name of the leaf that stands for how many journal entries have ids up to the digest's
/// entry (a space: no account id has one).
pub const ENTRIES_LEAF: &str = "# entries";
/// The name of the leaf that stands for the id ranges of `unchained_entries` up to the digest's
/// entry.
pub const UNCHAINED_LEAF: &str = "# unchained";

/// The leaf of a number of entries.
#[must_use]
pub fn count_leaf(entries: i64) -> (String, Hash) {
    (ENTRIES_LEAF.to_owned(), Sha256::digest(entries.to_be_bytes()).into())
}

/// The leaf of the ranges `(first, last)` of entries outside the chain, sorted.
#[must_use]
pub fn ranges_leaf(ranges: &[(i64, i64)]) -> (String, Hash) {
    let mut hasher = Sha256::new();
    for (first, last) in ranges {
        hasher.update(first.to_be_bytes());
        hasher.update(last.to_be_bytes());
    }
    (UNCHAINED_LEAF.to_owned(), hasher.finalize().into())
}

/// The ledger's digest up to one journal entry: `payledger-digest-v1:<entry id>:<accounts>:<root
/// hex>`, the root of [`merkle_root`] over one leaf per account with an entry at or before that
/// id (its latest chained hash there, [`GENESIS`] when none is chained), the leaf of how many
/// entries there are up to it ([`count_leaf`]) and that of the ranges outside the chain up to it
/// ([`ranges_leaf`]); and how many accounts it has a leaf for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalDigest {
    /// The newest entry id it covers.
    pub upto_entry: i64,
    pub accounts: u64,
    pub root: Hash,
}

impl JournalDigest {
    /// The digest of `heads` (sorted by account_id) up to `upto_entry`.
    #[must_use]
    pub fn of(upto_entry: i64, heads: &[(String, Hash)]) -> Self {
        let accounts = heads.iter().filter(|(name, _)| !name.starts_with("# ")).count() as u64;
        Self { upto_entry, accounts, root: merkle_root(heads) }
    }
}

impl fmt::Display for JournalDigest {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{DIGEST_PREFIX}:{}:{}:{}", self.upto_entry, self.accounts, to_hex(&self.root))
    }
}

impl FromStr for JournalDigest {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let malformed = || format!("not a payledger digest ({DIGEST_PREFIX}:<entry id>:<accounts>:<64 hex digits>)");
        let mut parts = text.trim().split(':');
        if parts.next() != Some(DIGEST_PREFIX) {
            return Err(malformed());
        }
        let digits = |part: &&str| !part.is_empty() && part.bytes().all(|byte| byte.is_ascii_digit());
        let upto_entry = parts.next().filter(digits).and_then(|part| part.parse().ok());
        let accounts = parts.next().filter(digits).and_then(|part| part.parse().ok());
        let root = parts.next().and_then(from_hex);
        match (upto_entry, accounts, root, parts.next()) {
            (Some(upto_entry), Some(accounts), Some(root), None) => Ok(Self { upto_entry, accounts, root }),
            _ => Err(malformed()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(amount: i64) -> ChainedEntry<'static> {
        ChainedEntry {
            account_id: "alice",
            currency: "USD",
            amount,
            balance_after: 100,
            version_after: 1,
            kind: "DEPOSIT",
            reference: "r",
            posting_id: "p",
            counterparty_account_id: "funding",
            created_at: 7,
            created_by: "svc",
        }
    }

    #[test]
    fn every_field_and_the_previous_hash_change_the_hash() {
        let base = entry_hash(&GENESIS, &entry(100));
        assert_ne!(base, entry_hash(&GENESIS, &entry(101)));
        assert_ne!(base, entry_hash(&[1; 32], &entry(100)));
        let moved_boundary = ChainedEntry { kind: "DEPOSITr", reference: "", ..entry(100) };
        assert_ne!(base, entry_hash(&GENESIS, &moved_boundary), "texts are length-prefixed");
        assert_eq!(base, entry_hash(&GENESIS, &entry(100)));
    }

    #[test]
    fn hex_round_trips_and_refuses_anything_else() {
        let hash = entry_hash(&GENESIS, &entry(5));
        assert_eq!(from_hex(&to_hex(&hash)), Some(hash));
        assert_eq!(to_hex(&hash).len(), 64);
        assert_eq!(from_hex("zz"), None);
        assert_eq!(from_hex(&to_hex(&hash).to_uppercase()), None, "one text per hash");
        assert_eq!(from_hex(&format!("+{}", &to_hex(&hash)[1..])), None);
        assert_eq!(from_hex(&"g".repeat(64)), None);
    }

    #[test]
    fn the_root_changes_with_any_head_and_the_digest_round_trips() {
        let heads: Vec<(String, Hash)> = (0..5_u8).map(|n| (format!("a{n}"), [n; 32])).collect();
        let root = merkle_root(&heads);
        for changed in 0..heads.len() {
            let mut other = heads.clone();
            other[changed].1[0] ^= 1;
            assert_ne!(merkle_root(&other), root, "head {changed}");
        }
        assert_ne!(merkle_root(&heads[..4]), root);
        let digest = JournalDigest::of(42, &heads);
        assert_eq!(digest.to_string().parse::<JournalDigest>(), Ok(digest));
        assert!("payledger-digest-v1:1:2".parse::<JournalDigest>().is_err());
        assert!(format!("payledger-digest-v1:-1:0:{}", to_hex(&root)).parse::<JournalDigest>().is_err());
        assert!(format!("payledger-digest-v1:+42:5:{}", to_hex(&root)).parse::<JournalDigest>().is_err());
    }

    #[test]
    fn the_first_difference_names_the_account_changed_gone_or_added() {
        let heads: Vec<(String, Hash)> = ["a", "b", "c"].iter().map(|name| ((*name).to_owned(), [1; 32])).collect();
        assert_eq!(first_difference(&heads, &heads), None);
        let mut changed = heads.clone();
        changed[1].1 = [2; 32];
        assert_eq!(
            first_difference(&heads, &changed).as_deref(),
            Some("account b: its history up to the entry changed")
        );
        assert_eq!(first_difference(&heads, &heads[..2]).as_deref(), Some("account c: its chained history is gone"));
        let without_b = [heads[0].clone(), heads[2].clone()];
        assert_eq!(first_difference(&heads, &without_b).as_deref(), Some("account b: its chained history is gone"));
        assert_eq!(
            first_difference(&without_b, &heads).as_deref(),
            Some("account b: a chained history the digest did not have")
        );
    }
}
