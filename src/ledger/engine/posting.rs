//! Double entry: one posting moves an amount from one account to another with two journal
//! entries that sum to zero, each balance changed by a version CAS (optimistic lock).

use crate::domain::{Rejection, BALANCE_MINOR_UNITS_MAX};

use super::invariants::{self, AccountMove};
use crate::error::{Error, Resource};
use crate::store::{AccountRow, NewEntry, Queries};

use super::transaction::CAS_ATTEMPTS_MAX;

pub(in crate::ledger) const KIND_EXTERNAL: &str = "EXTERNAL";
pub(in crate::ledger) const KIND_CUSTOMER: &str = "CUSTOMER";

/// What caused a posting; stored as the entries' `kind`.
#[derive(Debug, Clone, Copy)]
pub(in crate::ledger) enum EntryKind {
    Deposit,
    Withdrawal,
    Pay,
    Refund,
    Transfer,
}

impl EntryKind {
    pub(in crate::ledger) fn as_str(self) -> &'static str {
        match self {
            EntryKind::Deposit => "DEPOSIT",
            EntryKind::Withdrawal => "WITHDRAWAL",
            EntryKind::Pay => "PAY",
            EntryKind::Refund => "REFUND",
            EntryKind::Transfer => "TRANSFER",
        }
    }
}

/// One posting: `amount` minor units of `currency` move from one account to another, as two
/// journal entries that sum to zero. Each use case makes its posting from the row it records
/// (a payment, refund, transfer, deposit or withdrawal), once, for both ways it is written:
/// alone ([`post`]) and in a group commit.
pub(in crate::ledger) struct Posting<'a> {
    /// Links both legs: the trade_no, refund_no, transfer_id or funding_id.
    pub posting_id: &'a str,
    pub kind: EntryKind,
    /// The business number that caused it: out_trade_no, out_refund_no, transfer_id or
    /// request_id.
    pub reference: &'a str,
    /// Money leaves this account.
    pub from_account_id: &'a str,
    /// Money arrives in this account.
    pub to_account_id: &'a str,
    /// Minor units, above zero.
    pub amount: i64,
    /// ISO 4217 code of both accounts.
    pub currency: &'a str,
    /// The caller that made it (`sub`).
    pub created_by: &'a str,
}

/// The (balance, version) each leg leaves its account at: (from, to).
pub(in crate::ledger) type Legs = [(i64, i64); 2];

impl<'a> Posting<'a> {
    /// Its two journal entries, from then to, each recording the balance and version its
    /// account has right after it (`legs`), created at `now` (microseconds since the epoch).
    pub(in crate::ledger) fn entries(&self, legs: Legs, now: i64) -> [NewEntry<'a>; 2] {
        let [(from_balance, from_version), (to_balance, to_version)] = legs;
        let leg = |account_id, counterparty_account_id, amount, balance_after, version_after| NewEntry {
            account_id,
            currency: self.currency,
            amount,
            balance_after,
            version_after,
            kind: self.kind.as_str(),
            reference: self.reference,
            posting_id: self.posting_id,
            counterparty_account_id,
            created_at: now,
            created_by: self.created_by,
        };
        [
            leg(self.from_account_id, self.to_account_id, -self.amount, from_balance, from_version),
            leg(self.to_account_id, self.from_account_id, self.amount, to_balance, to_version),
        ]
    }
}

/// Applies a posting inside the caller's transaction at `now`.
///
/// Accounts are touched in ascending account_id order, whichever side they are on, so two
/// opposite postings between the same accounts cannot deadlock.
///
/// # Errors
/// [`Rejection::InsufficientFunds`] when `from` would go below zero,
/// [`Rejection::CurrencyMismatch`] when an account holds another currency,
/// [`Error::NotFound`] for a missing account, [`Error::Contention`] when the CAS kept losing,
/// [`Error::InvariantBroken`] (nothing written) when the write set breaks a money invariant.
///
/// `known` may hold rows of the two accounts already read in this transaction: the first CAS
/// of such an account starts from that read instead of reading again.
pub(in crate::ledger) async fn post(
    queries: &mut Queries<'_>,
    posting: &Posting<'_>,
    known: &[AccountRow],
    now: i64,
) -> Result<(), Error> {
    assert_ne!(posting.from_account_id, posting.to_account_id, "a posting moves money between two accounts");
    let (minor_units, currency) = (posting.amount, posting.currency);
    let (from, to) = (posting.from_account_id, posting.to_account_id);
    let read = |account_id: &str| known.iter().find(|row| row.account_id == account_id).cloned();
    let (from_move, to_move) = if from < to {
        let from_move = change_balance(queries, read(from), from, currency, -minor_units, now).await?;
        (from_move, change_balance(queries, read(to), to, currency, minor_units, now).await?)
    } else {
        let to_move = change_balance(queries, read(to), to, currency, minor_units, now).await?;
        (change_balance(queries, read(from), from, currency, -minor_units, now).await?, to_move)
    };
    let legs = [(from_move.balance_after, from_move.version_after), (to_move.balance_after, to_move.version_after)];
    let entries = posting.entries(legs, now);
    invariants::check(&[from_move, to_move], &entries)?;
    queries.insert_entry_pair(&entries).await?;
    Ok(())
}

/// The rules of one leg: the account holds `currency`, and its balance plus `delta` (minor
/// units) stays within the balance limit and, unless it is the external funding account, at
/// or above what its active holds reserve (zero without holds). Returns the balance after.
///
/// # Errors
/// [`Rejection::CurrencyMismatch`], [`Rejection::BalanceLimitExceeded`],
/// [`Rejection::InsufficientFunds`].
pub(in crate::ledger) fn balance_after(account: &AccountRow, currency: &str, delta: i64) -> Result<i64, Error> {
    if account.currency != currency {
        return Err(Rejection::CurrencyMismatch.into());
    }
    let balance = account
        .balance
        .checked_add(delta)
        .filter(|balance| balance.abs() <= BALANCE_MINOR_UNITS_MAX)
        .ok_or(Rejection::BalanceLimitExceeded)?;
    // What a customer account can spend is its balance minus its active holds.
    if account.kind != KIND_EXTERNAL && balance < account.held {
        return Err(Rejection::InsufficientFunds.into());
    }
    Ok(balance)
}

/// The lowest balance an account may have: what its active holds reserve for a customer
/// account, none for an external funding account (the rule [`balance_after`] applies).
pub(in crate::ledger) fn balance_floor(account: &AccountRow) -> Option<i64> {
    (account.kind != KIND_EXTERNAL).then_some(account.held)
}

/// Adds `delta` minor units to one balance with a version CAS: read (balance, version),
/// check the rules, `UPDATE ... WHERE version = ?`; zero rows means another writer won, so
/// re-read and try again, bounded. Returns the account's move: its balance and version before
/// (as the winning CAS found them) and after.
///
/// The first read takes no lock (optimistic). A retry re-reads with `FOR UPDATE`, which
/// waits for the winner to commit and then holds the row, so the next CAS cannot lose: on a
/// hot account every writer gets through in lock order instead of losing races at random
/// until its retries run out.
async fn change_balance<'a>(
    queries: &mut Queries<'_>,
    mut known: Option<AccountRow>,
    account_id: &'a str,
    currency: &str,
    delta: i64,
    now: i64,
) -> Result<AccountMove<'a>, Error> {
    for attempt in 1..=CAS_ATTEMPTS_MAX {
        let account = match (attempt, known.take()) {
            (1, Some(row)) => Some(row),
            (1, None) => queries.find_account(account_id).await?,
            _ => queries.find_account_for_update(account_id).await?,
        };
        let account = account.ok_or(Error::NotFound(Resource::Account))?;
        let balance = balance_after(&account, currency, delta)?;
        if queries.cas_balance(account_id, balance, account.version, now).await? {
            return Ok(AccountMove {
                account_id,
                balance_before: account.balance,
                version_before: account.version,
                balance_after: balance,
                version_after: account.version + 1,
                floor: balance_floor(&account),
            });
        }
        tracing::debug!(account_id, attempt, "version CAS lost; re-reading the balance under a row lock");
        queries.count_cas_retry();
    }
    Err(Error::Contention)
}
