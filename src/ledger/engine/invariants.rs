//! The money invariants of a write set, checked in release builds on every write, group
//! commit and one-call transaction alike, before anything of it is written:
//! - each posting has exactly two legs, on two accounts, in one currency, summing to zero;
//! - each account's legs continue its chain: every entry's `balance_after` is the balance before
//!   it plus its amount and its `version_after` the version before it plus one, and the account
//!   ends at the balance and version the write set gives it (so its version moves by its number
//!   of legs, and its new balance is its previous balance plus its legs);
//! - no leg without its account's balance change, and no balance change without a leg;
//! - every new balance within the balance limit and, for a customer account, at or above what
//!   its active holds reserve.
//!
//! A broken invariant is a bug, not something a caller can cause: the write is refused as
//! [`Error::InvariantBroken`] (the call is INTERNAL and the log names the invariant), its transaction
//! rolls back, and nothing of it is written.

use std::collections::{BTreeMap, HashMap};

use crate::domain::BALANCE_MINOR_UNITS_MAX;
use crate::error::Error;
use crate::store::NewEntry;

/// One account's balance as a write set moves it (minor units), under its row lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::ledger) struct AccountMove<'a> {
    pub account_id: &'a str,
    pub balance_before: i64,
    pub version_before: i64,
    pub balance_after: i64,
    pub version_after: i64,
    /// The lowest balance allowed: what the account's active holds reserve for a customer
    /// account; `None` for an external funding account, which may go negative.
    pub floor: Option<i64>,
}

/// Checks every invariant of the module docs over `moves` and `entries` (the entries in the
/// order the balances moved).
///
/// # Errors
/// [`Error::InvariantBroken`], naming the first invariant broken.
pub(in crate::ledger) fn check(moves: &[AccountMove<'_>], entries: &[NewEntry<'_>]) -> Result<(), Error> {
    check_postings(entries)?;
    let mut chains: HashMap<&str, (i64, i64)> =
        moves.iter().map(|account| (account.account_id, (account.balance_before, account.version_before))).collect();
    if chains.len() != moves.len() {
        return Err(broken("an account is moved twice in one write set"));
    }
    for entry in entries {
        let (balance, version) = chains
            .get_mut(entry.account_id)
            .ok_or_else(|| broken("a leg on an account whose balance does not move"))?;
        *balance = balance.checked_add(entry.amount).ok_or_else(|| broken("a balance overflows"))?;
        *version += 1;
        if entry.balance_after != *balance {
            return Err(broken("a leg's balance_after is not the balance before it plus its amount"));
        }
        if entry.version_after != *version {
            return Err(broken("a leg's version_after is not the version before it plus one"));
        }
    }
    for account in moves {
        let (balance, version) = chains[account.account_id];
        if version == account.version_before {
            return Err(broken("a balance change without a leg"));
        }
        if (balance, version) != (account.balance_after, account.version_after) {
            return Err(broken("an account's new balance or version is not its previous one plus its legs"));
        }
        if balance.abs() > BALANCE_MINOR_UNITS_MAX {
            return Err(broken("a balance beyond the balance limit"));
        }
        if account.floor.is_some_and(|floor| balance < floor) {
            return Err(broken("a customer balance below what its holds reserve"));
        }
    }
    Ok(())
}

/// Two legs a posting, on two accounts, in one currency, summing to zero, and not zero.
fn check_postings(entries: &[NewEntry<'_>]) -> Result<(), Error> {
    let mut postings: BTreeMap<&str, Vec<&NewEntry<'_>>> = BTreeMap::new();
    for entry in entries {
        postings.entry(entry.posting_id).or_default().push(entry);
    }
    for legs in postings.values() {
        let [first, second] = legs.as_slice() else {
            return Err(broken("a posting without exactly two legs"));
        };
        if first.account_id == second.account_id || first.currency != second.currency {
            return Err(broken("a posting's legs are not on two accounts in one currency"));
        }
        if first.amount.checked_add(second.amount) != Some(0) || first.amount == 0 {
            return Err(broken("a posting's legs do not sum to zero"));
        }
    }
    Ok(())
}

fn broken(invariant: &'static str) -> Error {
    Error::InvariantBroken(invariant)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leg<'a>(
        account_id: &'a str,
        posting_id: &'a str,
        amount: i64,
        balance_after: i64,
        version_after: i64,
    ) -> NewEntry<'a> {
        NewEntry {
            account_id,
            currency: "USD",
            amount,
            balance_after,
            version_after,
            kind: "PAY",
            reference: "o-1",
            posting_id,
            counterparty_account_id: if account_id == "payer" { "payee" } else { "payer" },
            created_at: 1,
            created_by: "test",
        }
    }

    fn account(account_id: &str, before: (i64, i64), after: (i64, i64)) -> AccountMove<'_> {
        AccountMove {
            account_id,
            balance_before: before.0,
            version_before: before.1,
            balance_after: after.0,
            version_after: after.1,
            floor: Some(0),
        }
    }

    /// Two Pays of 100 from one payer to one payee: two postings, four legs.
    fn two_pays() -> (Vec<AccountMove<'static>>, Vec<NewEntry<'static>>) {
        let moves = vec![account("payer", (1_000, 7), (800, 9)), account("payee", (0, 3), (200, 5))];
        let entries = vec![
            leg("payer", "T1", -100, 900, 8),
            leg("payee", "T1", 100, 100, 4),
            leg("payer", "T2", -100, 800, 9),
            leg("payee", "T2", 100, 200, 5),
        ];
        (moves, entries)
    }

    fn refusal(moves: &[AccountMove<'_>], entries: &[NewEntry<'_>]) -> String {
        match check(moves, entries) {
            Err(Error::InvariantBroken(invariant)) => invariant.to_owned(),
            other => panic!("a broken write set was accepted: {other:?}"),
        }
    }

    #[test]
    fn a_write_set_whose_postings_and_chains_agree_is_accepted() {
        let (moves, entries) = two_pays();
        check(&moves, &entries).unwrap();
    }

    #[test]
    fn a_posting_with_a_leg_dropped_is_refused() {
        let (moves, mut entries) = two_pays();
        entries.remove(3);
        assert!(refusal(&moves, &entries).contains("exactly two legs"));
    }

    #[test]
    fn legs_that_do_not_sum_to_zero_are_refused() {
        let (mut moves, mut entries) = two_pays();
        entries[3].amount = 101;
        entries[3].balance_after = 201;
        moves[1].balance_after = 201;
        assert!(refusal(&moves, &entries).contains("sum to zero"));
    }

    #[test]
    fn a_skipped_version_is_refused() {
        let (mut moves, mut entries) = two_pays();
        entries[2].version_after = 10;
        moves[0].version_after = 10;
        assert!(refusal(&moves, &entries).contains("version_after"));
    }

    #[test]
    fn a_new_balance_that_is_not_the_previous_plus_its_legs_is_refused() {
        let (mut moves, entries) = two_pays();
        moves[1].balance_after = 300;
        assert!(refusal(&moves, &entries).contains("previous one plus its legs"));
    }

    #[test]
    fn a_leg_on_an_account_whose_balance_does_not_move_is_refused() {
        let (moves, entries) = two_pays();
        assert!(refusal(&moves[..1], &entries).contains("does not move"));
    }

    #[test]
    fn a_customer_balance_below_its_holds_is_refused() {
        let (mut moves, entries) = two_pays();
        moves[0].floor = Some(900);
        assert!(refusal(&moves, &entries).contains("holds reserve"));
    }

    #[test]
    fn an_external_account_may_go_negative_within_the_limit_but_not_beyond() {
        let moves = vec![
            AccountMove { floor: None, ..account("@external:USD", (0, 0), (-100, 1)) },
            account("payer", (0, 0), (100, 1)),
        ];
        let entries = vec![leg("@external:USD", "D1", -100, -100, 1), leg("payer", "D1", 100, 100, 1)];
        check(&moves, &entries).unwrap();
        let beyond = BALANCE_MINOR_UNITS_MAX + 1;
        let moves = vec![
            AccountMove { floor: None, ..account("@external:USD", (0, 0), (-beyond, 1)) },
            account("payer", (0, 0), (beyond, 1)),
        ];
        let entries = vec![leg("@external:USD", "D1", -beyond, -beyond, 1), leg("payer", "D1", beyond, beyond, 1)];
        assert!(refusal(&moves, &entries).contains("balance limit"));
    }
}
