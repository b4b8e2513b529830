//! The accounts one batch holds under their row locks, moved in memory by its postings and
//! holds in the order its writes are applied, and the write set it leaves: checked against the
//! money invariants, then written (its rows, balances and entries on PostgreSQL in one
//! statement; a hold reserved or settled by one statement of its own).

use std::collections::BTreeMap;

use crate::domain::Rejection;
use crate::error::{Error, Resource};
use crate::store::chain::{self, Hash};
use crate::store::{
    AccountRow, BalanceUpdate, BatchWrite, FundingRow, HoldRow, IdempotencyRecordRow, NewEntry, OrderRefund, OrderRow,
    PaymentRow, Queries, RefundRow, TransferRow,
};

use super::invariants::{self, AccountMove, HoldMove};
use super::posting::{balance_after, balance_floor, Legs, Posting, KIND_CUSTOMER};

/// One account as a batch moves it: the row as read under its lock, moved by the postings
/// and holds applied so far.
#[derive(Clone)]
struct Ledgered {
    row: AccountRow,
    read_version: i64,
    read_balance: i64,
    read_held: i64,
}

/// The accounts a batch locked, by account_id, as the postings applied so far leave them.
#[derive(Clone, Default)]
pub(in crate::ledger) struct Book {
    accounts: BTreeMap<String, Ledgered>,
}

impl Book {
    /// The book of the rows a batch read under their row locks.
    pub(in crate::ledger) fn locked(rows: Vec<AccountRow>) -> Self {
        let accounts = rows
            .into_iter()
            .map(|row| {
                let read = Ledgered { read_version: row.version, read_balance: row.balance, read_held: row.held, row };
                (read.row.account_id.clone(), read)
            })
            .collect();
        Self { accounts }
    }

    /// The account as the postings applied so far leave it.
    pub(in crate::ledger) fn get(&self, account_id: &str) -> Option<&AccountRow> {
        self.accounts.get(account_id).map(|account| &account.row)
    }

    /// Applies a posting with the rules of a single posting (legs checked in account_id order;
    /// each leg moves its account's version by one), or
    /// changes nothing and says why. Returns the (balance, version) each leg leaves: (from, to).
    ///
    /// # Errors
    /// [`Error::NotFound`] (ACCOUNT), and the rules of a leg ([`balance_after`]).
    pub(in crate::ledger) fn post(&mut self, posting: &Posting<'_>) -> Result<Legs, Error> {
        let (from_id, to_id) = (posting.from_account_id, posting.to_account_id);
        if from_id == to_id {
            // The edge refuses it (and a Pay's payer cannot be its payee): both legs on one row
            // would leave only the second.
            return Err(Error::Internal("a posting moves money between two accounts".into()));
        }
        let mut after = [(0, 0); 2];
        let mut legs = [(from_id, -posting.amount, 0), (to_id, posting.amount, 1)];
        legs.sort_by(|a, b| a.0.cmp(b.0));
        for (account_id, delta, slot) in legs {
            let account = self.accounts.get(account_id).ok_or(Error::NotFound(Resource::Account))?;
            after[slot] = (balance_after(&account.row, posting.currency, delta)?, account.row.version + 1);
        }
        for (account_id, _, slot) in legs {
            let account = self.accounts.get_mut(account_id).expect("checked above");
            (account.row.balance, account.row.version) = after[slot];
        }
        Ok(after)
    }

    /// Reserves a new hold's amount on its payer (a customer account of the hold's currency
    /// whose balance minus what its holds reserve already covers it), or changes nothing and
    /// says why. The account's version does not move: a hold posts no entry.
    ///
    /// # Errors
    /// [`Error::NotFound`] (ACCOUNT), [`Rejection::CurrencyMismatch`],
    /// [`Rejection::InsufficientFunds`] (also for an account that is not a customer's).
    pub(in crate::ledger) fn reserve(&mut self, hold: &HoldRow) -> Result<(), Error> {
        let account = self.accounts.get_mut(&hold.payer_account_id).ok_or(Error::NotFound(Resource::Account))?;
        let row = &mut account.row;
        if row.currency != hold.currency {
            return Err(Rejection::CurrencyMismatch.into());
        }
        let held = row.held.checked_add(hold.amount).filter(|held| *held <= row.balance);
        match held {
            Some(held) if row.kind == KIND_CUSTOMER && hold.amount > 0 => row.held = held,
            _ => return Err(Rejection::InsufficientFunds.into()),
        }
        Ok(())
    }

    /// Releases an ACTIVE hold's amount from its payer, as the hold is settled (captured,
    /// voided or expired).
    ///
    /// # Errors
    /// [`Error::Internal`] when the account is not locked or holds less than the hold.
    pub(in crate::ledger) fn release(&mut self, hold: &HoldRow) -> Result<(), Error> {
        let account = self
            .accounts
            .get_mut(&hold.payer_account_id)
            .ok_or_else(|| Error::Internal("a hold's payer is not locked".into()))?;
        if account.row.held < hold.amount {
            return Err(Error::Internal("an account holds less than its active hold".into()));
        }
        account.row.held -= hold.amount;
        Ok(())
    }

    /// Chains `entries` (in the order they are written, so each account's in version order) to
    /// the hash each account had when it was locked ([`chain::GENESIS`] before its first chained
    /// entry), setting each entry's hash; returns the hash each account is left with.
    ///
    /// # Errors
    /// [`Error::InvariantBroken`] when an account's stored chain_hash is not a hash, or an entry's
    /// account is not locked.
    fn chain<'e>(&self, entries: &mut [NewEntry<'e>]) -> Result<BTreeMap<String, String>, Error> {
        let mut heads: BTreeMap<&'e str, Hash> = BTreeMap::new();
        for entry in entries.iter_mut() {
            let previous = match heads.get(entry.account_id) {
                Some(head) => *head,
                None => {
                    let account = self
                        .accounts
                        .get(entry.account_id)
                        .ok_or(Error::InvariantBroken("an entry whose account the batch did not lock"))?;
                    match &account.row.chain_hash {
                        None => chain::GENESIS,
                        Some(stored) => chain::from_hex(stored)
                            .ok_or(Error::InvariantBroken("an account's chain_hash that is not a hash"))?,
                    }
                }
            };
            let hash = chain::entry_hash(&previous, &entry.chained());
            entry.entry_hash = chain::to_hex(&hash);
            heads.insert(entry.account_id, hash);
        }
        Ok(heads.into_iter().map(|(account_id, head)| (account_id.to_owned(), chain::to_hex(&head))).collect())
    }

    /// The accounts the postings and holds moved.
    fn moved(&self) -> impl Iterator<Item = &Ledgered> {
        self.accounts
            .values()
            .filter(|account| account.row.version != account.read_version || account.row.held != account.read_held)
    }
}

/// An ACTIVE hold a write settles, and how: `CAPTURED` (with the captured amount and the
/// capture's out_trade_no), `VOIDED` or `EXPIRED`. Its whole amount is released from its payer.
pub(in crate::ledger) struct SettledHold<'a> {
    /// The hold as read under its order's lock.
    pub(in crate::ledger) hold: &'a HoldRow,
    pub(in crate::ledger) status: &'static str,
    pub(in crate::ledger) captured_amount: i64,
    pub(in crate::ledger) out_trade_no: Option<&'a str>,
}

/// An order moved by one write from the state it requires, by a conditional UPDATE of its
/// own: false (roll back) when the order is no longer in that state.
pub(in crate::ledger) struct OrderMove<'a> {
    pub(in crate::ledger) merchant_id: &'a str,
    pub(in crate::ledger) order_no: &'a str,
    pub(in crate::ledger) to: OrderTo<'a>,
}

/// Where an [`OrderMove`] takes its order.
pub(in crate::ledger) enum OrderTo<'a> {
    /// PENDING -> AUTHORIZED (a hold placed on it).
    Authorized,
    /// AUTHORIZED -> PAID by the capture of `amount` minor units under `out_trade_no`.
    Captured { out_trade_no: &'a str, amount: i64 },
    /// AUTHORIZED -> CLOSED with `reason` (its hold released).
    ClosedFromAuthorized { reason: &'static str },
    /// PENDING -> CLOSED with `reason`.
    ClosedFromPending { reason: &'static str },
}

/// What one batch writes: new rows by table, the orders it moves, the holds it reserves and
/// settles, and its postings with the (balance, version) each leg left, in the order they were
/// applied.
#[derive(Default)]
pub(in crate::ledger) struct WriteSet<'a> {
    /// New accounts, empty (no money, no holds, version 0): false when one is taken.
    pub(in crate::ledger) accounts: Vec<AccountRow>,
    /// Orders moved by a conditional UPDATE of their own (holds, CloseOrder).
    pub(in crate::ledger) order_moves: Vec<OrderMove<'a>>,
    /// Payments of captures (their orders move by [`OrderTo::Captured`], not PENDING -> PAID).
    pub(in crate::ledger) captured_payments: Vec<PaymentRow>,
    /// New ACTIVE holds, each reserved on its payer ([`Book::reserve`]).
    pub(in crate::ledger) holds: Vec<HoldRow>,
    /// ACTIVE holds settled, each released from its payer ([`Book::release`]).
    pub(in crate::ledger) settled_holds: Vec<SettledHold<'a>>,
    pub(in crate::ledger) orders: Vec<OrderRow>,
    pub(in crate::ledger) payments: Vec<PaymentRow>,
    pub(in crate::ledger) refunds: Vec<RefundRow>,
    pub(in crate::ledger) transfers: Vec<TransferRow>,
    pub(in crate::ledger) deposits: Vec<FundingRow>,
    pub(in crate::ledger) withdrawals: Vec<FundingRow>,
    pub(in crate::ledger) refunded_orders: Vec<OrderRefund<'a>>,
    pub(in crate::ledger) postings: Vec<(Posting<'a>, Legs)>,
    /// Idempotency records claimed COMPLETED with the write, by a call written without row
    /// locks (a locked batch claims its records before it writes): false when a key is taken.
    pub(in crate::ledger) records: Vec<IdempotencyRecordRow>,
}

impl WriteSet<'_> {
    /// Whether [`write`] writes it in one statement on PostgreSQL, which then writes all of it
    /// or nothing, in a transaction or as one of its own (`Queries::write_batch`): no new
    /// account, no order moved by a conditional UPDATE of its own, no capture's payment, no hold
    /// reserved or settled.
    pub(in crate::ledger) fn one_statement(&self) -> bool {
        self.accounts.is_empty()
            && self.order_moves.is_empty()
            && self.captured_payments.is_empty()
            && self.holds.is_empty()
            && self.settled_holds.is_empty()
    }
}

/// Writes `set` and the balances and held amounts `book` moved (one version CAS per account:
/// an account moved N times moves N versions at once), the entries of each posting in order,
/// so that every entry records its account's balance and version right after it; at `now`
/// (microseconds since the epoch). False when a key (a hold's out_auth_no or its order's one
/// hold among them), an order's or hold's state or a version was taken under the batch (roll
/// back). Otherwise the accounts as it left them, new ones among them: each row as its
/// transaction writes it, to be known once that commits ([`super::known`]).
///
/// # Errors
/// [`Error::InvariantBroken`] with nothing written; [`Error::Database`].
pub(in crate::ledger) async fn write(
    queries: &mut Queries<'_>,
    set: &WriteSet<'_>,
    book: &Book,
    now: i64,
) -> Result<Option<Vec<AccountRow>>, Error> {
    let mut entries: Vec<NewEntry<'_>> =
        set.postings.iter().flat_map(|(posting, legs)| posting.entries(*legs, now)).collect();
    let heads = book.chain(&mut entries)?;
    let balances: Vec<BalanceUpdate<'_>> = book
        .moved()
        .map(|account| BalanceUpdate {
            account_id: &account.row.account_id,
            balance: account.row.balance,
            held: account.row.held,
            expected_version: account.read_version,
            version: account.row.version,
            expected_held: account.read_held,
            chain_hash: heads.get(&account.row.account_id).or(account.row.chain_hash.as_ref()).map(String::as_str),
        })
        .collect();
    let moves: Vec<AccountMove<'_>> = book
        .moved()
        .map(|account| AccountMove {
            account_id: &account.row.account_id,
            balance_before: account.read_balance,
            version_before: account.read_version,
            balance_after: account.row.balance,
            version_after: account.row.version,
            held_before: account.read_held,
            held_after: account.row.held,
            floor: balance_floor(&account.row),
        })
        .collect();
    let reserved = set.holds.iter().map(|hold| HoldMove { account_id: &hold.payer_account_id, amount: hold.amount });
    let released = set
        .settled_holds
        .iter()
        .map(|settled| HoldMove { account_id: &settled.hold.payer_account_id, amount: -settled.hold.amount });
    let holds: Vec<HoldMove<'_>> = reserved.chain(released).collect();
    let written = BatchWrite {
        payments: &set.payments,
        refunds: &set.refunds,
        transfers: &set.transfers,
        deposits: &set.deposits,
        withdrawals: &set.withdrawals,
        orders: &set.orders,
        refunded_orders: &set.refunded_orders,
        balances: &balances,
        entries: &entries,
        records: &set.records,
        now,
    };
    if !write_checked(queries, &moves, &holds, set, &written).await? {
        return Ok(None);
    }
    let moved = balances.iter().map(|update| {
        let mut row = book.get(update.account_id).expect("a moved account is in its book").clone();
        row.chain_hash = update.chain_hash.map(str::to_owned);
        row.updated_at = now;
        row
    });
    Ok(Some(set.accounts.iter().cloned().chain(moved).collect()))
}

/// Checks the write set's money invariants ([`invariants::check`]), then writes it: its holds
/// (one statement each: reserves and settlements are rare and one a call), then its rows,
/// balances and entries. False when a key, an order's or hold's state or a version was taken
/// under the batch (roll back).
///
/// # Errors
/// [`Error::InvariantBroken`] with nothing written; [`Error::Database`].
async fn write_checked(
    queries: &mut Queries<'_>,
    moves: &[AccountMove<'_>],
    holds: &[HoldMove<'_>],
    set: &WriteSet<'_>,
    written: &BatchWrite<'_>,
) -> Result<bool, Error> {
    invariants::check(moves, written.entries, holds)?;
    if set.accounts.iter().any(|account| (account.balance, account.held, account.version) != (0, 0, 0)) {
        return Err(Error::InvariantBroken("a new account that is not empty"));
    }
    for account in &set.accounts {
        if !queries.insert_account(account).await? {
            return Ok(false);
        }
    }
    for order in &set.order_moves {
        if !move_order(queries, order, written.now).await? {
            return Ok(false);
        }
    }
    for payment in &set.captured_payments {
        if !queries.insert_payment(payment).await? {
            return Ok(false);
        }
    }
    for hold in &set.holds {
        if !queries.insert_hold(hold).await? {
            return Ok(false);
        }
    }
    for settled in &set.settled_holds {
        let SettledHold { hold, status, captured_amount, out_trade_no } = settled;
        if !queries.settle_hold(&hold.hold_no, status, *captured_amount, *out_trade_no, written.now).await? {
            return Ok(false);
        }
    }
    Ok(queries.write_batch(written).await?)
}

/// One order's move by its conditional UPDATE: false when it was not in the state the move
/// requires.
async fn move_order(queries: &mut Queries<'_>, order: &OrderMove<'_>, now: i64) -> Result<bool, Error> {
    let (merchant_id, order_no) = (order.merchant_id, order.order_no);
    Ok(match order.to {
        OrderTo::Authorized => queries.authorize_order(merchant_id, order_no, now).await?,
        OrderTo::Captured { out_trade_no, amount } => {
            queries.capture_order(merchant_id, order_no, out_trade_no, amount, now).await?
        }
        OrderTo::ClosedFromAuthorized { reason } => {
            queries.close_authorized_order(merchant_id, order_no, reason, now).await?
        }
        OrderTo::ClosedFromPending { reason } => queries.close_order(merchant_id, order_no, reason, now, None).await?,
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::domain::{AccountId, Actor, Amount, Currency, RequestId};
    use crate::ledger::engine::posting::EntryKind;
    use crate::ledger::engine::transaction::in_transaction;
    use crate::ledger::{Deposit, Guards, Inserted, Ledger, OpenAccount};
    use crate::metrics::LedgerMetrics;
    use crate::store::{KeysAtOnce, PoolSettings, RowLocks, Store};

    /// A database these tests own: a SQLite file, or a database of its own on the PostgreSQL
    /// or MariaDB server of `PAYLEDGER_TEST_POSTGRES_URL` / `PAYLEDGER_TEST_MYSQL_URL`
    /// (required under `CI=true`, as the backend suite requires them), dropped with it.
    struct TestDatabase {
        url: String,
        server: Option<(String, String)>,
        _directory: Option<tempfile::TempDir>,
    }

    impl Drop for TestDatabase {
        fn drop(&mut self) {
            let Some((admin, name)) = self.server.take() else { return };
            // From a thread of its own: the test's runtime may be unwinding.
            let _ = std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                runtime.block_on(async {
                    let pool = sqlx::AnyPool::connect(&admin).await.unwrap();
                    let force = if admin.starts_with("postgres") { " WITH (FORCE)" } else { "" };
                    sqlx::query(&format!("DROP DATABASE IF EXISTS {name}{force}")).execute(&pool).await.unwrap();
                })
            })
            .join();
        }
    }

    /// SQLite, and every server backend the environment names.
    async fn test_databases() -> Vec<TestDatabase> {
        sqlx::any::install_default_drivers();
        let directory = tempfile::tempdir().unwrap();
        let sqlite = format!("sqlite:{}", directory.path().join("ledger.db").display());
        let mut databases = vec![TestDatabase { url: sqlite, server: None, _directory: Some(directory) }];
        for variable in ["PAYLEDGER_TEST_POSTGRES_URL", "PAYLEDGER_TEST_MYSQL_URL"] {
            let Ok(admin) = std::env::var(variable) else {
                assert!(std::env::var("CI").as_deref() != Ok("true"), "{variable} is required in CI");
                continue;
            };
            let name = format!("payledger_book_{}", uuid::Uuid::new_v4().simple());
            let pool = sqlx::AnyPool::connect(&admin).await.unwrap();
            sqlx::query(&format!("CREATE DATABASE {name}")).execute(&pool).await.unwrap();
            pool.close().await;
            let base = admin.rsplit_once('/').map_or(admin.as_str(), |(base, _)| base);
            let url = format!("{base}/{name}");
            databases.push(TestDatabase { url, server: Some((admin, name)), _directory: None });
        }
        databases
    }

    /// A ledger on `database` with alice (10.00 USD) and bob (nothing).
    async fn ledger_of_two(database: &TestDatabase) -> Ledger {
        let settings = PoolSettings {
            max_connections: 2,
            acquire_timeout: Duration::from_secs(5),
            lock_timeout: Duration::from_secs(5),
            plan_lifetime: PoolSettings::PLAN_LIFETIME_DEFAULT,
        };
        let store = Store::connect(&database.url, &settings).await.unwrap();
        store.migrate().await.unwrap();
        let ledger = Ledger::new(store);
        let usd = Currency::parse("currency", "USD").unwrap();
        for name in ["alice", "bob"] {
            let account_id = AccountId::parse("account_id", name).unwrap();
            ledger.open_account(OpenAccount { account_id, currency: usd }, &Guards::default()).await.unwrap();
        }
        let deposit = Deposit {
            request_id: RequestId::parse("request_id", "funding").unwrap(),
            account_id: AccountId::parse("account_id", "alice").unwrap(),
            amount: Amount::parse("amount", "10.00", usd).unwrap(),
            created_by: Actor::Anonymous,
        };
        ledger.deposit(deposit, &Guards::default()).await.unwrap();
        ledger
    }

    /// The journal's entries, and alice's and bob's (balance, version).
    async fn books(ledger: &Ledger) -> (i64, [(i64, i64); 2]) {
        let mut reader = ledger.store().reader().await.unwrap();
        let mut queries = reader.queries();
        let mut accounts = [(0, 0); 2];
        for (slot, name) in ["alice", "bob"].into_iter().enumerate() {
            let row = queries.find_account(name).await.unwrap().unwrap();
            accounts[slot] = (row.balance, row.version);
        }
        let rows = ledger.store().on_pooled_session("SELECT COUNT(*) FROM journal_entries").await.unwrap();
        (sqlx::Row::get::<i64, _>(&rows[0], 0), accounts)
    }

    /// A posting of `minor_units` from alice to bob whose versions move by `step`, as a batch
    /// writes one: the moves, the version CAS of both accounts and the two legs.
    fn posting<'a>(
        posting_id: &'a str,
        alice: &'a AccountRow,
        bob: &'a AccountRow,
        minor_units: i64,
        step: i64,
    ) -> (Vec<AccountMove<'a>>, Vec<BalanceUpdate<'a>>, Vec<NewEntry<'a>>) {
        let sides = [(alice, -minor_units, bob), (bob, minor_units, alice)];
        let moves: Vec<AccountMove<'a>> = sides
            .iter()
            .map(|(account, delta, _)| AccountMove {
                account_id: &account.account_id,
                balance_before: account.balance,
                version_before: account.version,
                balance_after: account.balance + delta,
                version_after: account.version + step,
                held_before: account.held,
                held_after: account.held,
                floor: balance_floor(account),
            })
            .collect();
        let balances = moves
            .iter()
            .map(|moved| BalanceUpdate {
                account_id: moved.account_id,
                balance: moved.balance_after,
                held: moved.held_after,
                expected_version: moved.version_before,
                version: moved.version_after,
                expected_held: moved.held_before,
                chain_hash: None,
            })
            .collect();
        let entries = sides
            .iter()
            .map(|(account, delta, counterparty)| NewEntry {
                account_id: &account.account_id,
                currency: "USD",
                amount: *delta,
                balance_after: account.balance + delta,
                version_after: account.version + step,
                kind: EntryKind::Transfer.as_str(),
                reference: posting_id,
                posting_id,
                counterparty_account_id: &counterparty.account_id,
                created_at: 1,
                created_by: "test",
                entry_hash: String::new(),
            })
            .collect();
        (moves, balances, entries)
    }

    fn write_set<'a>(balances: &'a [BalanceUpdate<'a>], entries: &'a [NewEntry<'a>]) -> BatchWrite<'a> {
        BatchWrite {
            payments: &[],
            refunds: &[],
            transfers: &[],
            deposits: &[],
            withdrawals: &[],
            orders: &[],
            refunded_orders: &[],
            balances,
            entries,
            records: &[],
            now: 1,
        }
    }

    /// Runs `break_it` over a posting of 1.00 from alice to bob inside a transaction that first
    /// writes an intact posting of 2.00, and returns what the transaction answered.
    async fn write_broken(
        ledger: &Ledger,
        break_it: impl Fn(&mut Vec<AccountMove<'_>>, &mut Vec<BalanceUpdate<'_>>, &mut Vec<NewEntry<'_>>),
    ) -> Result<Inserted<bool>, Error> {
        let metrics = LedgerMetrics::default();
        in_transaction!(ledger.store(), &metrics, tx => {
            let mut queries = tx.queries();
            let alice = queries.find_account("alice").await?.unwrap();
            let bob = queries.find_account("bob").await?.unwrap();
            let (moves, balances, entries) = posting("X1", &alice, &bob, 200, 1);
            assert!(write_checked(&mut queries, &moves, &[], &WriteSet::default(), &write_set(&balances, &entries)).await?);
            let moved = [(moves[0].balance_after, moves[0].version_after), (moves[1].balance_after, moves[1].version_after)];
            let alice = AccountRow { balance: moved[0].0, version: moved[0].1, ..alice.clone() };
            let bob = AccountRow { balance: moved[1].0, version: moved[1].1, ..bob.clone() };
            let (mut moves, mut balances, mut entries) = posting("X2", &alice, &bob, 100, 1);
            break_it(&mut moves, &mut balances, &mut entries);
            let written = write_checked(&mut queries, &moves, &[], &WriteSet::default(), &write_set(&balances, &entries)).await?;
            Ok(Inserted::Done(written))
        })
    }

    #[tokio::test]
    async fn an_intact_write_set_is_written() {
        for database in test_databases().await {
            let ledger = ledger_of_two(&database).await;
            let (entries_before, _) = books(&ledger).await;

            let written = write_broken(&ledger, |_, _, _| {}).await.unwrap();

            assert!(matches!(written, Inserted::Done(true)), "{}", database.url);
            let (entries, [alice, bob]) = books(&ledger).await;
            assert_eq!(entries - entries_before, 4, "{}", database.url);
            assert_eq!((alice.0, bob.0), (700, 300), "{}", database.url);
        }
    }

    #[tokio::test]
    async fn a_write_set_sent_outside_a_transaction_with_one_version_moved_writes_nothing_of_it() {
        // PostgreSQL's write is one statement, which a write without row locks sends alone
        // (`group_commit::write_one_unlocked`): alice's version CAS misses, bob's would not, the
        // entries would go in; the statement must fail whole.
        for database in test_databases().await.iter().filter(|database| database.url.starts_with("postgres")) {
            let ledger = ledger_of_two(database).await;
            let before = books(&ledger).await;
            let mut reader = ledger.store().reader().await.unwrap();
            let mut queries = reader.queries();
            let alice = queries.find_account("alice").await.unwrap().unwrap();
            let bob = queries.find_account("bob").await.unwrap().unwrap();
            let stale = AccountRow { version: alice.version - 1, ..alice.clone() };
            let (moves, balances, entries) = posting("X3", &stale, &bob, 100, 1);

            let missed =
                write_checked(&mut queries, &moves, &[], &WriteSet::default(), &write_set(&balances, &entries))
                    .await
                    .unwrap();
            let (moves, balances, entries) = posting("X4", &alice, &bob, 100, 1);
            let written =
                write_checked(&mut queries, &moves, &[], &WriteSet::default(), &write_set(&balances, &entries))
                    .await
                    .unwrap();
            drop(reader);

            assert!(!missed && written, "{}", database.url);
            let (entries, [alice, bob]) = books(&ledger).await;
            // Only the second: bob's CAS and the entries of the first were not written.
            assert_eq!((entries - before.0, alice.0, bob.0), (2, 900, 100), "{}", database.url);
        }
    }

    #[tokio::test]
    async fn a_write_set_sent_alone_while_another_transaction_moves_its_account_writes_nothing() {
        // The version CAS must hold on the row as the other transaction leaves it (PostgreSQL's
        // EvalPlanQual), not only in the statement's snapshot: the write waits for the other
        // transaction's row lock, then finds alice's version moved.
        for database in test_databases().await.iter().filter(|database| database.url.starts_with("postgres")) {
            let ledger = ledger_of_two(database).await;
            let mut reader = ledger.store().reader().await.unwrap();
            let alice = reader.queries().find_account("alice").await.unwrap().unwrap();
            let bob = reader.queries().find_account("bob").await.unwrap().unwrap();
            drop(reader);
            let before = books(&ledger).await;
            let mut other = ledger.store().begin().await.unwrap();
            other.on_session("UPDATE accounts SET version = version + 1 WHERE account_id = 'alice'").await.unwrap();

            let store = ledger.store().clone();
            let write = tokio::spawn(async move {
                let mut reader = store.reader().await.unwrap();
                let mut queries = reader.queries();
                let (moves, balances, entries) = posting("X6", &alice, &bob, 100, 1);
                write_checked(&mut queries, &moves, &[], &WriteSet::default(), &write_set(&balances, &entries)).await
            });
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert!(!write.is_finished(), "{}: the write waits for alice's row", database.url);
            other.commit().await.unwrap();

            assert!(!write.await.unwrap().unwrap(), "{}", database.url);
            let (entries, [alice_after, bob_after]) = books(&ledger).await;
            let moved_by_the_other = (before.0, [(before.1[0].0, before.1[0].1 + 1), before.1[1]]);
            assert_eq!((entries, [alice_after, bob_after]), moved_by_the_other, "{}", database.url);
        }
    }

    #[tokio::test]
    async fn a_write_set_read_before_a_held_amount_moved_writes_nothing() {
        // A hold reserved or released moves `held` and not the version: the CAS compares both.
        for database in test_databases().await {
            let ledger = ledger_of_two(&database).await;
            let mut reader = ledger.store().reader().await.unwrap();
            let alice = reader.queries().find_account("alice").await.unwrap().unwrap();
            let bob = reader.queries().find_account("bob").await.unwrap().unwrap();
            drop(reader);
            ledger
                .store()
                .on_pooled_session("UPDATE accounts SET held = 300 WHERE account_id = 'alice'")
                .await
                .unwrap();
            let before = books(&ledger).await;

            let metrics = LedgerMetrics::default();
            let written: Result<Inserted<bool>, Error> = in_transaction!(ledger.store(), &metrics, tx => {
                let mut queries = tx.queries();
                let (moves, balances, entries) = posting("X5", &alice, &bob, 100, 1);
                let written = write_checked(&mut queries, &moves, &[], &WriteSet::default(), &write_set(&balances, &entries)).await?;
                Ok(if written { Inserted::Done(true) } else { Inserted::KeyTaken })
            });

            assert!(matches!(written, Ok(Inserted::KeyTaken)), "{}", database.url);
            assert_eq!(books(&ledger).await, before, "{}", database.url);
        }
    }

    /// An idempotency record claimed with a write, COMPLETED, under `key`.
    fn record(key: &str) -> IdempotencyRecordRow {
        IdempotencyRecordRow {
            scope: "merchant:m1".into(),
            idempotency_key: key.into(),
            method: "Pay".into(),
            request_fingerprint: "f".repeat(64),
            request_fields: b"amount=1.00".to_vec(),
            response: Some(Vec::new()),
            response_message: Some(vec![0x0a, 0x00, 0xff]),
            caller_scope: None,
            status: "COMPLETED".into(),
            created_at: 1,
            expires_at: i64::MAX / 2,
        }
    }

    #[tokio::test]
    async fn a_write_set_claims_its_records_with_it_and_writes_nothing_when_a_key_is_taken() {
        // A call written without row locks claims its idempotency key in its write; on
        // PostgreSQL that write is one statement sent outside a transaction, which must fail
        // whole when the key is taken, elsewhere the caller rolls its transaction back.
        for database in test_databases().await {
            let ledger = ledger_of_two(&database).await;
            let records_of = |key: &'static str| {
                let ledger = &ledger;
                async move {
                    let sql = format!("SELECT COUNT(*) FROM idempotency_record WHERE idempotency_key = '{key}'");
                    let rows = ledger.store().on_pooled_session(&sql).await.unwrap();
                    sqlx::Row::get::<i64, _>(&rows[0], 0)
                }
            };
            let write = |posting_id: &'static str, records: Vec<IdempotencyRecordRow>| {
                let ledger = &ledger;
                async move {
                    let postgres = ledger.store().dialect() == crate::store::Dialect::Postgres;
                    let metrics = LedgerMetrics::default();
                    let written: Result<Inserted<bool>, Error> = in_transaction!(ledger.store(), &metrics, tx => {
                        let mut queries = tx.queries();
                        let alice = queries.find_account("alice").await?.unwrap();
                        let bob = queries.find_account("bob").await?.unwrap();
                        let (moves, balances, entries) = posting(posting_id, &alice, &bob, 100, 1);
                        let written = BatchWrite { records: &records, ..write_set(&balances, &entries) };
                        let set = WriteSet::default();
                        let done = if postgres {
                            // Outside the transaction, on a connection of its own.
                            let mut reader = ledger.store().reader().await?;
                            write_checked(&mut reader.queries(), &moves, &[], &set, &written).await?
                        } else {
                            write_checked(&mut queries, &moves, &[], &set, &written).await?
                        };
                        Ok(if done { Inserted::Done(true) } else { Inserted::KeyTaken })
                    });
                    written.unwrap()
                }
            };

            assert!(matches!(write("X9", vec![record("k1")]).await, Inserted::Done(true)), "{}", database.url);
            assert_eq!(records_of("k1").await, 1, "{}", database.url);
            let mut reader = ledger.store().reader().await.unwrap();
            let found = reader.queries().find_answered_records(&[("merchant:m1", "k1")]).await.unwrap();
            drop(reader);
            assert_eq!(found, vec![record("k1")], "{}: the record as claimed, bytes and NULLs", database.url);
            let before = books(&ledger).await;

            // k2 is free, k1 taken: nothing of the write, k2 included.
            let taken = write("X10", vec![record("k2"), record("k1")]).await;

            assert!(matches!(taken, Inserted::KeyTaken), "{}", database.url);
            assert_eq!(records_of("k2").await, 0, "{}", database.url);
            assert_eq!(books(&ledger).await, before, "{}", database.url);
        }
    }

    #[tokio::test]
    async fn a_write_locks_its_accounts_in_account_id_order_whatever_join_is_planned() {
        // PostgreSQL writes a batch as one statement, which may be sent without row locks taken
        // before it (a batch written from known rows): it must lock its accounts in account_id
        // order, as a locked batch does, or the two could deadlock. alice's row, moved by her
        // deposit, now lies after bob's in the table, and this fresh database has no
        // statistics, the case where a planner joins the table to the statement's rows in the
        // table's order. Another transaction holds alice: the write must wait there, holding
        // nothing, so that bob is free.
        use sqlx::Connection as _;
        for database in test_databases().await {
            let ledger = ledger_of_two(&database).await;
            if ledger.store().dialect() != crate::store::Dialect::Postgres {
                continue;
            }
            let connect = || sqlx::PgConnection::connect(&database.url);
            let (mut holder, mut watcher) = (connect().await.unwrap(), connect().await.unwrap());
            sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
            let lock = "SELECT 1 FROM accounts WHERE account_id = $1 FOR NO KEY UPDATE";
            sqlx::query(lock).bind("alice").execute(&mut holder).await.unwrap();
            let before = books(&ledger).await;
            let store = ledger.store().clone();
            let write = tokio::spawn(async move {
                let mut reader = store.reader().await.unwrap();
                let mut queries = reader.queries();
                let alice = queries.find_account("alice").await.unwrap().unwrap();
                let bob = queries.find_account("bob").await.unwrap().unwrap();
                let (moves, balances, entries) = posting("X11", &alice, &bob, 100, 1);
                let set = WriteSet::default();
                write_checked(&mut queries, &moves, &[], &set, &write_set(&balances, &entries)).await
            });
            let waiting = "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND wait_event_type = 'Lock' AND query LIKE '%UPDATE accounts%'";
            let mut waits = false;
            for _ in 0..500 {
                let count: i64 = sqlx::query_scalar(waiting).fetch_one(&mut watcher).await.unwrap();
                waits = count > 0;
                if waits {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert!(waits, "the write waits for a row lock");
            sqlx::query("SET LOCAL lock_timeout = '500ms'").execute(&mut holder).await.unwrap();
            let bob = sqlx::query(lock).bind("bob").execute(&mut holder).await;
            assert!(bob.is_ok(), "the write waiting for alice holds bob: {bob:?}");
            sqlx::query("COMMIT").execute(&mut holder).await.unwrap();
            assert!(write.await.unwrap().unwrap(), "written once alice is free");
            let (entries, [alice, bob]) = books(&ledger).await;
            assert_eq!((entries, alice, bob), (before.0 + 2, (before.1[0].0 - 100, before.1[0].1 + 1), (100, 1)));
        }
    }

    #[tokio::test]
    async fn the_read_at_once_finds_each_kind_of_row_by_its_key_and_the_rows_those_name() {
        // A batch of one without row locks reads all its rows in one statement (PostgreSQL's
        // only): each row as stored, the accounts its order and payment name, nothing else.
        for database in test_databases().await {
            let ledger = ledger_of_two(&database).await;
            let mut reader = ledger.store().reader().await.unwrap();
            if ledger.store().dialect() != crate::store::Dialect::Postgres {
                let keys = KeysAtOnce { accounts: vec!["alice"], ..KeysAtOnce::default() };
                let refused = reader.queries().read_at_once(&keys).await;
                assert!(matches!(refused, Err(sqlx::Error::Configuration(_))), "{}: {refused:?}", database.url);
                continue;
            }
            drop(reader);
            let rows = "INSERT INTO accounts (account_id, currency, kind, balance, version, created_at, updated_at) \
                 VALUES ('carol', 'USD', 'CUSTOMER', 0, 0, 1, 1), ('dave', 'USD', 'CUSTOMER', 0, 0, 1, 1); \
                 INSERT INTO orders (merchant_id, order_no, payee_account_id, amount, currency, subject, status, \
                 out_trade_no, refunded_amount, created_at, updated_at, expires_at, close_reason) VALUES \
                 ('m1', 'o1', 'bob', 100, 'USD', 'paid \"one\"', 'PAID', 't1', 0, 1, 2, NULL, NULL), \
                 ('m1', 'o2', 'carol', 250, 'USD', 'é', 'PENDING', NULL, 0, 1, 1, 9, NULL); \
                 INSERT INTO payment_flow (trade_no, merchant_id, out_trade_no, order_no, payer_account_id, \
                 payee_account_id, amount, currency, status, created_at, created_by) \
                 VALUES ('T1', 'm1', 't1', 'o1', 'dave', 'bob', 100, 'USD', 'SUCCEEDED', 2, 'merchant:m1'); \
                 INSERT INTO idempotency_record (scope, idempotency_key, method, request_fingerprint, request_fields, \
                 response, response_message, caller_scope, status, created_at, expires_at) VALUES \
                 ('merchant:m1', 'k1', 'Pay', repeat('f', 64), 'amount=1.00'::bytea, ''::bytea, '\\x0a00ff'::bytea, \
                 NULL, 'COMPLETED', 1, 4611686018427387903), \
                 ('merchant:m1', 'k2', 'Pay', repeat('f', 64), ''::bytea, NULL, NULL, NULL, 'IN_PROGRESS', 1, 9)";
            for statement in rows.split("; ") {
                ledger.store().on_pooled_session(statement).await.unwrap();
            }
            let mut reader = ledger.store().reader().await.unwrap();
            let mut queries = reader.queries();
            let expected_orders = queries.lock_orders(&[("m1", "o1"), ("m1", "o2")], RowLocks::None).await.unwrap();
            let expected_payment = queries.find_payments_and_orders(&[("m1", "t1")]).await.unwrap();

            let keys = KeysAtOnce {
                payments: vec![("m1", "t1"), ("m1", "t9")],
                orders: vec![("m1", "o2"), ("m1", "o9")],
                accounts: vec!["alice", "nobody"],
                records: vec![("merchant:m1", "k1"), ("merchant:m1", "k2"), ("merchant:m1", "k9")],
            };
            let read = queries.read_at_once(&keys).await.unwrap();

            assert_eq!(read.payments, expected_payment, "the payment with its order");
            let mut orders = read.orders.clone();
            orders.sort_by(|a, b| a.order_no.cmp(&b.order_no));
            assert_eq!(orders, expected_orders, "the order asked for and the payment's, as stored");
            let mut accounts: Vec<&str> = read.accounts.iter().map(|account| account.account_id.as_str()).collect();
            accounts.sort_unstable();
            assert_eq!(accounts, ["alice", "bob", "carol", "dave"], "named, the orders' payees, the payment's payer");
            let alice = queries.find_account("alice").await.unwrap().unwrap();
            assert!(read.accounts.contains(&alice), "{:?}", read.accounts);
            assert_eq!(read.records, vec![record("k1")], "the answered record only, bytes and NULLs as stored");
        }
    }

    #[tokio::test]
    async fn a_write_set_with_a_leg_dropped_is_refused_and_nothing_of_its_transaction_is_written() {
        for database in test_databases().await {
            let ledger = ledger_of_two(&database).await;
            let before = books(&ledger).await;

            let refused = write_broken(&ledger, |_, _, entries| {
                entries.pop();
            })
            .await;

            let url = &database.url;
            assert!(
                matches!(refused, Err(Error::InvariantBroken(invariant)) if invariant.contains("two legs")),
                "{url}"
            );
            assert_eq!(books(&ledger).await, before, "{url}: the intact posting before it was rolled back too");
        }
    }

    #[tokio::test]
    async fn a_write_set_with_a_version_skipped_is_refused_and_nothing_of_its_transaction_is_written() {
        for database in test_databases().await {
            let ledger = ledger_of_two(&database).await;
            let before = books(&ledger).await;

            let refused = write_broken(&ledger, |moves, balances, entries| {
                moves[1].version_after += 1;
                balances[1].version += 1;
                entries[1].version_after += 1;
            })
            .await;

            let url = &database.url;
            let skipped =
                matches!(refused, Err(Error::InvariantBroken(invariant)) if invariant.contains("version_after"));
            assert!(skipped, "{url}");
            assert_eq!(books(&ledger).await, before, "{url}: the intact posting before it was rolled back too");
        }
    }

    #[tokio::test]
    async fn a_write_set_moving_a_held_amount_without_its_hold_is_refused_and_nothing_of_its_transaction_is_written() {
        for database in test_databases().await {
            let ledger = ledger_of_two(&database).await;
            let before = books(&ledger).await;

            let refused = write_broken(&ledger, |moves, balances, _| {
                moves[0].held_after += 50;
                balances[0].held += 50;
            })
            .await;

            let url = &database.url;
            let unheld = matches!(refused, Err(Error::InvariantBroken(invariant)) if invariant.contains("held amount"));
            assert!(unheld, "{url}");
            assert_eq!(books(&ledger).await, before, "{url}: the intact posting before it was rolled back too");
        }
    }
}
