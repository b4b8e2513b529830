//! Double entry: one posting moves an amount from one account to another with two journal
//! entries that sum to zero, each recording its account's balance and version right after it;
//! the rules of one leg. Postings are applied to a `book::Book` and written by `book::write`,
//! each balance by a version CAS (optimistic lock) under its row lock.

use crate::domain::{Rejection, BALANCE_MINOR_UNITS_MAX};

use crate::error::Error;
use crate::store::{AccountRow, NewEntry};

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
/// (a payment, refund, transfer, deposit, withdrawal or capture), once; it is applied to a
/// `book::Book` and written with the write set, in a batch or alone.
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
            // Chained when the batch writes ([`super::book::write`]).
            entry_hash: String::new(),
        };
        [
            leg(self.from_account_id, self.to_account_id, -self.amount, from_balance, from_version),
            leg(self.to_account_id, self.from_account_id, self.amount, to_balance, to_version),
        ]
    }
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
