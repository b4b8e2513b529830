//! Known rows: the orders and accounts this process last saw committed, most recently used
//! first, a bounded number of each (`--pay-batch-known-rows`). A batch (of one call, or of
//! several under load) whose orders and accounts are all known is decided from them and its
//! write sent at once, one round trip ([`super::group_commit`]; docs/write-engine.md, "Known
//! rows"). Nothing here decides anything: the write guards every row the decisions read (an
//! order by its state's conditional UPDATE, each account by its version CAS, which compares
//! the held amount too, the out_trade_no and the idempotency key by their unique indexes), so
//! a known row that is no longer current fails the write whole, and the batch is then read and
//! written as before. Why: `docs/decisions/012-known-rows.md`.
//!
//! Only committed rows are known: rows read outside a transaction, and the rows of a write once
//! its commit succeeded. Never a row a write left before its commit: a version it wrote that was
//! rolled back could later be committed by another transaction with another balance, and the
//! version CAS compares the version and the held amount, not the balance or the chain hash.
//!
//! Rows another instance, or a path of this one that does not tell it (the expiry sweeper, a
//! call written by the idempotency driver's transaction), moved stay known as they were: each
//! costs one failed write. So that a deployment where that is common (several instances writing
//! the same accounts) does not pay it on every call, misses weigh [`MISS_WEIGHT`] and a write
//! from known rows is tried only while their score is below [`MISSES_TOLERATED`]; each call
//! not tried, and each write that succeeds, takes one off. When every try misses, one call in
//! 17 tries.

use std::sync::Mutex;

use hashlink::LruCache;

use crate::store::{AccountRow, OrderRow};

use super::group_commit::OrderKey;

/// What one missed write from known rows adds to the score.
const MISS_WEIGHT: u32 = 16;
/// A write from known rows is tried only while the score is below this.
const MISSES_TOLERATED: u32 = 64;
/// The score's ceiling: after a long run of misses, trying starts again within this many calls.
const SCORE_MAX: u32 = 1_024;

/// The known rows of one group commit (see the module doc).
pub(in crate::ledger) struct Known {
    state: Mutex<State>,
}

struct State {
    orders: LruCache<OrderKey, OrderRow>,
    accounts: LruCache<String, AccountRow>,
    /// Recent misses, weighed (see the module doc).
    score: u32,
}

/// What a committed write tells the known rows: the accounts and new orders as it left them,
/// and the orders it moved or locked (forgotten: the write's own next state of them is not
/// kept, a later call of them reads them).
#[derive(Default)]
pub(in crate::ledger) struct Learned {
    pub(in crate::ledger) accounts: Vec<AccountRow>,
    pub(in crate::ledger) orders: Vec<OrderRow>,
    pub(in crate::ledger) forget: Vec<OrderKey>,
}

impl Known {
    /// At most `capacity` orders and `capacity` accounts; `None` for 0 (known rows off).
    pub(in crate::ledger) fn new(capacity: usize) -> Option<Self> {
        (capacity > 0).then(|| Self {
            state: Mutex::new(State { orders: LruCache::new(capacity), accounts: LruCache::new(capacity), score: 0 }),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while the lock was held leaves rows that are each whole: keep using them.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether a write from known rows is tried now (see the module doc); a call not tried
    /// takes one off the score.
    pub(in crate::ledger) fn try_now(&self) -> bool {
        let mut state = self.state();
        if state.score < MISSES_TOLERATED {
            return true;
        }
        state.score -= 1;
        false
    }

    /// A write from known rows that committed.
    pub(in crate::ledger) fn hit(&self) {
        let mut state = self.state();
        state.score = state.score.saturating_sub(1);
    }

    /// A write from known rows that found a row moved or a key taken, and wrote nothing.
    pub(in crate::ledger) fn missed(&self) {
        let mut state = self.state();
        state.score = (state.score + MISS_WEIGHT).min(SCORE_MAX);
    }

    /// The orders `keys` and the accounts each names (`accounts_of`), every one known, each
    /// account once; or `None`.
    pub(in crate::ledger) fn rows(
        &self,
        keys: &[OrderKey],
        accounts_of: impl Fn(&OrderRow) -> Vec<String>,
    ) -> Option<(Vec<OrderRow>, Vec<AccountRow>)> {
        let mut state = self.state();
        let orders = keys.iter().map(|key| state.orders.get(key).cloned()).collect::<Option<Vec<_>>>()?;
        let mut account_ids: Vec<String> = orders.iter().flat_map(&accounts_of).collect();
        account_ids.sort_unstable();
        account_ids.dedup();
        let accounts =
            account_ids.iter().map(|account_id| state.accounts.get(account_id).cloned()).collect::<Option<Vec<_>>>()?;
        Some((orders, accounts))
    }

    /// Rows read as last committed, outside a transaction. An account known at a later version
    /// stays as it is.
    pub(in crate::ledger) fn read<'r>(
        &self,
        orders: impl IntoIterator<Item = &'r OrderRow>,
        accounts: impl IntoIterator<Item = &'r AccountRow>,
    ) {
        let mut state = self.state();
        for order in orders {
            state.orders.insert((order.merchant_id.clone(), order.order_no.clone()), order.clone());
        }
        for account in accounts {
            state.learn_account(account.clone());
        }
    }

    /// What a write that committed left (see [`Learned`]).
    pub(in crate::ledger) fn committed(&self, learned: Learned) {
        let mut state = self.state();
        for key in &learned.forget {
            state.orders.remove(key);
        }
        for order in learned.orders {
            state.orders.insert((order.merchant_id.clone(), order.order_no.clone()), order);
        }
        for account in learned.accounts {
            state.learn_account(account);
        }
    }

    /// The number of orders and of accounts known.
    #[cfg(test)]
    fn len(&self) -> (usize, usize) {
        let state = self.state();
        (state.orders.len(), state.accounts.len())
    }
}

impl State {
    fn learn_account(&mut self, account: AccountRow) {
        if self.accounts.peek(&account.account_id).is_some_and(|known| known.version > account.version) {
            return;
        }
        self.accounts.insert(account.account_id.clone(), account);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn account(account_id: &str, version: i64, balance: i64) -> AccountRow {
        AccountRow {
            account_id: account_id.into(),
            currency: "USD".into(),
            kind: "CUSTOMER".into(),
            balance,
            version,
            created_at: 0,
            updated_at: 0,
            held: 0,
            chain_hash: None,
        }
    }

    fn order(order_no: &str, payee: &str) -> OrderRow {
        OrderRow {
            merchant_id: "m".into(),
            order_no: order_no.into(),
            payee_account_id: payee.into(),
            amount: 100,
            currency: "USD".into(),
            subject: "s".into(),
            status: "PENDING".into(),
            out_trade_no: None,
            refunded_amount: 0,
            created_at: 0,
            updated_at: 0,
            expires_at: None,
            close_reason: None,
        }
    }

    fn key(order_no: &str) -> OrderKey {
        ("m".into(), order_no.into())
    }

    #[test]
    fn rows_are_given_only_when_every_order_and_every_account_they_name_are_known() {
        let known = Known::new(8).unwrap();
        known.read([&order("o1", "shop")], [&account("payer", 3, 500)]);
        let payer_and_payee = |order: &OrderRow| vec!["payer".to_owned(), order.payee_account_id.clone()];
        assert!(known.rows(&[key("o1")], payer_and_payee).is_none(), "the payee is not known");
        known.read([&order("o2", "shop")], [&account("shop", 7, 0)]);
        let (orders, accounts) = known.rows(&[key("o1"), key("o2")], payer_and_payee).unwrap();
        assert_eq!(orders.iter().map(|order| order.order_no.as_str()).collect::<Vec<_>>(), ["o1", "o2"]);
        let accounts: Vec<_> = accounts.iter().map(|a| (a.account_id.as_str(), a.version)).collect();
        assert_eq!(accounts, [("payer", 3), ("shop", 7)], "each account once");
        assert!(known.rows(&[key("o1"), key("o3")], payer_and_payee).is_none(), "an order is not known");
    }

    #[test]
    fn a_committed_write_forgets_the_orders_it_moved_and_keeps_the_accounts_it_left() {
        let known = Known::new(8).unwrap();
        known.read([&order("o1", "shop")], [&account("payer", 3, 500), &account("shop", 7, 0)]);
        known.committed(Learned {
            accounts: vec![account("payer", 4, 400), account("shop", 8, 100)],
            orders: vec![order("o2", "shop")],
            forget: vec![key("o1")],
        });
        let both = |order: &OrderRow| vec!["payer".to_owned(), order.payee_account_id.clone()];
        assert!(known.rows(&[key("o1")], both).is_none(), "a paid order is forgotten");
        let (_, accounts) = known.rows(&[key("o2")], both).unwrap();
        assert_eq!(accounts.iter().map(|a| (a.version, a.balance)).collect::<Vec<_>>(), [(4, 400), (8, 100)]);
        // A read that raced the write, as last committed before it, does not take it back.
        known.read([], [&account("payer", 3, 500)]);
        let (_, accounts) = known.rows(&[key("o2")], both).unwrap();
        assert_eq!(accounts[0].version, 4);
    }

    #[test]
    fn each_kind_holds_at_most_its_capacity_dropping_the_least_recently_used() {
        let known = Known::new(2).unwrap();
        known.read([&order("o1", "a"), &order("o2", "a"), &order("o3", "a")], [&account("a", 0, 0)]);
        assert_eq!(known.len(), (2, 1));
        let one = |_: &OrderRow| vec!["a".to_owned()];
        assert!(known.rows(&[key("o1")], one).is_none());
        assert!(known.rows(&[key("o3")], one).is_some());
        assert!(Known::new(0).is_none(), "0 turns known rows off");
    }

    #[test]
    fn misses_make_tries_rare_and_hits_make_them_common_again() {
        let known = Known::new(1).unwrap();
        let tries_of = |calls: usize, hit: bool| {
            let mut tried = 0;
            for _ in 0..calls {
                if known.try_now() {
                    tried += 1;
                    if hit {
                        known.hit();
                    } else {
                        known.missed();
                    }
                }
            }
            tried
        };
        let tried = tries_of(1_700, false);
        assert!((95..=110).contains(&tried), "when every try misses, about one call in 17 tries: {tried}");
        // Once rows are current again, tries come back within the score's ceiling.
        tries_of(SCORE_MAX as usize, true);
        assert_eq!(tries_of(100, true), 100);
    }
}
