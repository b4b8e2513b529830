//! The money invariants of a write set, checked in release builds on every write, group
//! commit and one-call transaction alike, before anything of it is written:
//! - each posting has exactly two legs, on two accounts, in one currency, summing to zero;
//! - each account's legs continue its chain: every entry's `balance_after` is the balance before
//!   it plus its amount and its `version_after` the version before it plus one, and the account
//!   ends at the balance and version the write set gives it (so its version moves by its number
//!   of legs, and its new balance is its previous balance plus its legs);
//! - no leg without its account's balance change, and no balance change without a leg;
//! - each account's held amount moves by exactly the holds the write set reserves on it (new
//!   ACTIVE holds) and releases from it (ACTIVE holds settled), and never below zero; no hold
//!   reserved or released without its account's held amount moving;
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
    /// What the account's active holds reserve before and after the write set.
    pub held_before: i64,
    pub held_after: i64,
    /// The lowest balance allowed: what the account's active holds reserve for a customer
    /// account; `None` for an external funding account, which may go negative.
    pub floor: Option<i64>,
}

/// One hold a write set reserves (`amount` above zero: a new ACTIVE hold) or releases
/// (`amount` below zero: an ACTIVE hold settled) on its payer's account, in minor units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::ledger) struct HoldMove<'a> {
    pub account_id: &'a str,
    pub amount: i64,
}

/// Checks every invariant of the module docs over `moves`, `entries` (in the order the
/// balances moved) and `holds`.
///
/// # Errors
/// [`Error::InvariantBroken`], naming the first invariant broken.
pub(in crate::ledger) fn check(
    moves: &[AccountMove<'_>],
    entries: &[NewEntry<'_>],
    holds: &[HoldMove<'_>],
) -> Result<(), Error> {
    check_postings(entries)?;
    check_holds(moves, holds)?;
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
        if version == account.version_before && account.balance_after != account.balance_before {
            return Err(broken("a balance change without a leg"));
        }
        if version == account.version_before && account.held_after == account.held_before {
            return Err(broken("an account written without a leg or a hold"));
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
/// Each account's held amount against the holds reserved and released on it.
fn check_holds(moves: &[AccountMove<'_>], holds: &[HoldMove<'_>]) -> Result<(), Error> {
    let mut held: HashMap<&str, i64> = moves.iter().map(|account| (account.account_id, account.held_before)).collect();
    for hold in holds {
        let amount = held
            .get_mut(hold.account_id)
            .ok_or_else(|| broken("a hold reserved or released on an account the write set does not move"))?;
        if hold.amount == 0 {
            return Err(broken("a hold of nothing"));
        }
        *amount = amount.checked_add(hold.amount).ok_or_else(|| broken("a held amount overflows"))?;
    }
    for account in moves {
        if held[account.account_id] != account.held_after {
            return Err(broken(
                "an account's held amount is not its previous one plus the holds reserved and released",
            ));
        }
        if account.held_after < 0 {
            return Err(broken("an account holds less than nothing"));
        }
    }
    Ok(())
}

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
            entry_hash: String::new(),
        }
    }

    fn account(account_id: &str, before: (i64, i64), after: (i64, i64)) -> AccountMove<'_> {
        AccountMove {
            account_id,
            balance_before: before.0,
            version_before: before.1,
            balance_after: after.0,
            version_after: after.1,
            held_before: 0,
            held_after: 0,
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
        refusal_with_holds(moves, entries, &[])
    }

    fn refusal_with_holds(moves: &[AccountMove<'_>], entries: &[NewEntry<'_>], holds: &[HoldMove<'_>]) -> String {
        match check(moves, entries, holds) {
            Err(Error::InvariantBroken(invariant)) => invariant.to_owned(),
            other => panic!("a broken write set was accepted: {other:?}"),
        }
    }

    #[test]
    fn a_write_set_whose_postings_and_chains_agree_is_accepted() {
        let (moves, entries) = two_pays();
        check(&moves, &entries, &[]).unwrap();
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
        check(&moves, &entries, &[]).unwrap();
        let beyond = BALANCE_MINOR_UNITS_MAX + 1;
        let moves = vec![
            AccountMove { floor: None, ..account("@external:USD", (0, 0), (-beyond, 1)) },
            account("payer", (0, 0), (beyond, 1)),
        ];
        let entries = vec![leg("@external:USD", "D1", -beyond, -beyond, 1), leg("payer", "D1", beyond, beyond, 1)];
        assert!(refusal(&moves, &entries).contains("balance limit"));
    }

    /// A hold of 300 reserved on the payer (no posting), and a Capture of 200: the hold
    /// released and the payment posted.
    fn reserve(amount: i64) -> (Vec<AccountMove<'static>>, Vec<HoldMove<'static>>) {
        let moves = vec![AccountMove { held_after: amount, ..account("payer", (1_000, 7), (1_000, 7)) }];
        (moves, vec![HoldMove { account_id: "payer", amount }])
    }

    #[test]
    fn a_hold_reserved_with_its_account_moved_by_it_is_accepted() {
        let (moves, holds) = reserve(300);
        check(&moves, &[], &holds).unwrap();
        let moves = vec![
            AccountMove { held_before: 300, held_after: 0, ..account("payer", (1_000, 7), (900, 8)) },
            account("payee", (0, 3), (100, 4)),
        ];
        let entries = vec![leg("payer", "T1", -100, 900, 8), leg("payee", "T1", 100, 100, 4)];
        check(&moves, &entries, &[HoldMove { account_id: "payer", amount: -300 }]).unwrap();
    }

    #[test]
    fn a_held_amount_moved_without_its_hold_is_refused() {
        let (moves, _) = reserve(300);
        assert!(refusal_with_holds(&moves, &[], &[]).contains("holds reserved and released"));
    }

    #[test]
    fn a_hold_without_its_held_amount_moved_is_refused() {
        let (mut moves, holds) = reserve(300);
        moves[0].held_after = 200;
        assert!(refusal_with_holds(&moves, &[], &holds).contains("holds reserved and released"));
        assert!(refusal_with_holds(&[], &[], &holds).contains("does not move"));
    }

    #[test]
    fn a_hold_released_below_nothing_is_refused() {
        let moves =
            vec![AccountMove { held_before: 100, held_after: -200, ..account("payer", (1_000, 7), (1_000, 7)) }];
        let holds = [HoldMove { account_id: "payer", amount: -300 }];
        assert!(refusal_with_holds(&moves, &[], &holds).contains("less than nothing"));
    }

    #[test]
    fn an_account_written_without_a_leg_or_a_hold_is_refused() {
        let moves = vec![account("payer", (1_000, 7), (1_000, 7))];
        assert!(refusal(&moves, &[]).contains("without a leg or a hold"));
    }
}
