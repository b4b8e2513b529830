//! Accounts: open, deposit, read, list the journal.

use crate::domain::{AccountId, Actor, Amount, FieldViolation, FreeText, MerchantId, Rejection, RequestId};
use crate::error::{Error, Resource, ReusedKey};
use crate::proto;
use crate::store::{AccountRow, EntryRow, FundingRow, FundingTable, Queries, TransferRow};

use super::commands::{Deposit, ListEntries, OpenAccount, Transfer, Withdraw};
use super::engine::book::{Book, WriteSet};
use super::engine::group_commit::{
    write_alone, Accepted, Answer, BatchKey, BatchWrite, Batchable, Committed, Entries, KeyToFind, Outcome, ReadFirst,
    Rows, View,
};
use super::engine::posting::{EntryKind, Legs, Posting, KIND_CUSTOMER, KIND_EXTERNAL};
use crate::metrics::LedgerMetrics;

use super::guards::{Guards, Scope, IDEMPOTENCY_KEY_HEADER};
use super::idempotent::{differing_from, reply_message, Fields, IdempotentCall};
use super::response;
use super::tokens::IssuedToken;
use super::{new_id, now_micros, read_ended, Identified, Inserted, Ledger, Replayable};
use prometheus_client::metrics::counter::Counter;
use prost::Message as _;

/// The per-currency funding account: the counterparty of deposits and withdrawals, and the
/// only account allowed below zero. Its id starts with `@`, which caller-chosen ids cannot contain.
pub(super) fn external_account_id(currency_code: &str) -> String {
    format!("@external:{currency_code}")
}

/// Most shards of a currency's funding account (`--funding-account-shards`). The bound keeps
/// every sum of balances within 64 bits: each shard stays within the balance limit (10^17
/// minor units), so a currency's funding accounts together hold at most 32 x 10^17.
pub const FUNDING_ACCOUNT_SHARDS_MAX: u32 = 32;

/// The id of shard `shard` of a currency's funding account: shard 0 is the external account
/// itself (`@external:USD`), shard k > 0 is `@external:USD:k`. Every shard is an EXTERNAL
/// account of its own, with its own balance and version, so Deposits and Withdraws spread
/// over N shards do not all write one row (on a multi-primary cluster, do not all certify
/// against one row); the currency's money from outside is the sum of its shards.
/// Why: `docs/decisions/009-funding-account-shards.md`.
pub(super) fn funding_account_id(currency_code: &str, shard: u32) -> String {
    if shard == 0 {
        external_account_id(currency_code)
    } else {
        format!("@external:{currency_code}:{shard}")
    }
}

/// The shard (in `0..shards`) of a Deposit or Withdraw with `request_id`: FNV-1a of its
/// bytes, so that every run of the same request picks the same shard.
pub(super) fn funding_shard(request_id: &str, shards: u32) -> u32 {
    const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const FNV_PRIME: u64 = 0x0100_0000_01b3;
    let hash = request_id.bytes().fold(FNV_OFFSET, |hash, byte| (hash ^ u64::from(byte)).wrapping_mul(FNV_PRIME));
    u32::try_from(hash % u64::from(shards.max(1))).expect("below a u32")
}

/// The answer to a Deposit: the account as it stood right after the deposit, and the entry
/// that credited it. A replay rebuilds exactly the same answer from the stored entry.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DepositReceipt {
    pub account: AccountRow,
    pub entry: EntryRow,
}

/// The answer to a Withdraw: the account as it stood right after the payout, and the entry
/// that debited it (the same shape as a Deposit's).
pub type WithdrawalReceipt = DepositReceipt;

/// The answer to a Transfer: the transfer and its two entries (each with the balance right
/// after it).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TransferReceipt {
    pub transfer: TransferRow,
    pub from_entry: EntryRow,
    pub to_entry: EntryRow,
}

/// One page of journal entries, newest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryPage {
    pub entries: Vec<EntryRow>,
    /// The entry_id to continue below, when there are more entries.
    pub next_before_entry_id: Option<i64>,
}

impl Ledger {
    /// Opens an account, and the currency's external funding account on first use.
    ///
    /// # Errors
    /// [`Error::KeyReused`] (ACCOUNT_ALREADY_EXISTS) when the id exists with another currency.
    pub async fn open_account(
        &self,
        command: OpenAccount,
        guards: &Guards,
    ) -> Result<Replayable<proto::OpenAccountResponse>, Error> {
        self.run_idempotent(&command, guards).await
    }

    /// Credits an account from the currency's external funding account, once per request_id.
    ///
    /// # Errors
    /// [`Error::NotFound`] (account), [`crate::domain::Rejection::CurrencyMismatch`],
    /// [`Error::KeyReused`] (REQUEST_ID_REUSED) when the request_id was used for another deposit.
    ///
    /// With group commit on, a Deposit or Withdraw is written by a batch, routed by its
    /// funding account shard (see `group_commit`); one whose shard has no row yet runs alone.
    pub async fn deposit(
        &self,
        command: Deposit,
        guards: &Guards,
    ) -> Result<Replayable<proto::DepositResponse>, Error> {
        self.run_funding(self.funding_call(command, 'D'), guards).await
    }

    /// Pays money out of an account to the currency's external funding account, once per
    /// request_id: the mirror of [`Ledger::deposit`], with its own request_ids.
    ///
    /// # Errors
    /// [`Error::NotFound`] (account), [`Rejection::CurrencyMismatch`],
    /// [`Rejection::InsufficientFunds`] when the balance is short, [`Error::KeyReused`]
    /// (REQUEST_ID_REUSED) when the request_id was used for another withdrawal.
    ///
    /// With group commit on, written by a batch as [`Ledger::deposit`] is; a full queue is
    /// RESOURCE_EXHAUSTED (OVERLOADED), as for every batched call.
    pub async fn withdraw(
        &self,
        command: Withdraw,
        guards: &Guards,
    ) -> Result<Replayable<proto::WithdrawResponse>, Error> {
        self.run_funding(self.funding_call(command, 'W'), guards).await
    }

    /// A Deposit or Withdraw with its posting id (`prefix` then a fresh id) and the funding
    /// account (shard) it moves money against: one of `LedgerSettings::funding_account_shards`,
    /// chosen by its request_id.
    pub(super) fn funding_call<F: Funding>(&self, command: F, prefix: char) -> FundingCall<F> {
        let (request_id, _, amount, _) = command.parts();
        let shard = funding_shard(request_id.as_str(), self.settings.funding_account_shards);
        let funding_account_id = funding_account_id(amount.currency().code(), shard);
        FundingCall { command, id: new_id(prefix), funding_account_id }
    }

    /// A Deposit or Withdraw through the group commit when it is on (routed by its funding
    /// account, the row every call of that shard moves), else in its own transaction.
    async fn run_funding<F: Funding>(
        &self,
        call: FundingCall<F>,
        guards: &Guards,
    ) -> Result<Replayable<F::Message>, Error> {
        match self.batcher() {
            Some(batcher) => self.run_in_batch(batcher, &call, guards).await?.try_map(reply_message::<FundingCall<F>>),
            None => self.run_idempotent(&call, guards).await,
        }
    }

    /// Moves money between two accounts of one currency. Transfers have no natural key, so
    /// the call must carry an `idempotency-key`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] without an idempotency key; [`Error::NotFound`] (account);
    /// [`crate::domain::Rejection`]s INSUFFICIENT_FUNDS, CURRENCY_MISMATCH;
    /// [`Error::IdempotencyKeyReused`].
    ///
    /// With group commit on, a Transfer is written by a batch (routed by its
    /// from_account_id), its key's record claimed and completed inside the batch's
    /// transaction (see `group_commit`).
    pub async fn transfer(
        &self,
        command: Transfer,
        guards: &Guards,
    ) -> Result<Replayable<proto::TransferResponse>, Error> {
        check_transfer(&command, guards)?;
        let call = Identified { command, id: new_id('X') };
        match self.batcher() {
            Some(batcher) => {
                self.run_in_batch(batcher, &call, guards).await?.try_map(reply_message::<Identified<Transfer>>)
            }
            None => self.run_idempotent(&call, guards).await,
        }
    }

    /// Issues a one-time token to `merchant_id` and the caller `actor`, for the
    /// `idempotency-token` header.
    ///
    /// # Errors
    /// [`Error::Database`] or [`Error::TokenStore`].
    pub async fn issue_token(
        &self,
        merchant_id: &MerchantId,
        actor: &Actor,
        purpose: &FreeText,
    ) -> Result<IssuedToken, Error> {
        let caller_tag = actor.scope_tag();
        let (store, ttl) = (&self.store, self.settings.token_ttl);
        let issued =
            self.tokens.issue(store, merchant_id, caller_tag.as_deref(), purpose.as_str(), now_micros(), ttl).await?;
        self.metrics.tokens_issued.inc();
        Ok(issued)
    }

    /// # Errors
    /// [`Error::NotFound`] (ACCOUNT_NOT_FOUND).
    pub async fn get_account(&self, account_id: &AccountId) -> Result<AccountRow, Error> {
        let mut reader = self.store.reader().await?;
        let account = reader.queries().find_account(account_id.as_str()).await?;
        reader.release();
        account.ok_or(Error::NotFound(Resource::Account))
    }

    /// # Errors
    /// [`Error::NotFound`] (ACCOUNT_NOT_FOUND).
    pub async fn list_entries(&self, request: ListEntries) -> Result<EntryPage, Error> {
        // The account's existence and its page, at one moment.
        let mut snapshot = self.store.snapshot().await?;
        let page = Self::entry_page(&mut snapshot.queries(), request).await;
        read_ended(snapshot, page).await
    }

    /// [`Ledger::list_entries`]'s reads, in the caller's snapshot.
    async fn entry_page(queries: &mut Queries<'_>, request: ListEntries) -> Result<EntryPage, Error> {
        let account_id = request.account_id.as_str();
        if queries.find_account(account_id).await?.is_none() {
            return Err(Error::NotFound(Resource::Account));
        }
        let page_size = usize::try_from(request.page_size).unwrap_or(usize::MAX);
        // One more than the page tells whether another page follows.
        let mut entries = queries
            .list_entries(account_id, request.before_entry_id.unwrap_or(i64::MAX), i64::from(request.page_size) + 1)
            .await?;
        let next_before_entry_id = if entries.len() > page_size {
            entries.truncate(page_size);
            entries.last().map(|entry| entry.entry_id)
        } else {
            None
        };
        Ok(EntryPage { entries, next_before_entry_id })
    }
}

/// What a Transfer needs before anything is read: an `idempotency-key` (it has no natural
/// key), and two accounts (the edge checks this too; a posting on one account is a bug).
///
/// # Errors
/// [`Error::InvalidArgument`].
pub(super) fn check_transfer(command: &Transfer, guards: &Guards) -> Result<(), Error> {
    if guards.idempotency_key.is_none() {
        return Err(
            FieldViolation::new(IDEMPOTENCY_KEY_HEADER, "is required on Transfer, which has no natural key").into()
        );
    }
    if command.from_account_id == command.to_account_id {
        return Err(FieldViolation::new("to_account_id", "must differ from from_account_id").into());
    }
    Ok(())
}

/// OpenAccount's business fields, from a request or a stored account.
fn open_account_fields(account_id: &str, currency: &str) -> Fields {
    vec![("account_id", account_id.to_owned()), ("currency", currency.to_owned())]
}

impl IdempotentCall for OpenAccount {
    type Answer = AccountRow;
    type Message = proto::OpenAccountResponse;
    const METHOD: &'static str = "OpenAccount";

    fn message(account: AccountRow) -> Result<Self::Message, Error> {
        Ok(proto::OpenAccountResponse { account: Some(response::account(account)?) })
    }

    fn scope(&self) -> Scope<'_> {
        Scope::Account(&self.account_id)
    }

    fn fields(&self) -> Fields {
        open_account_fields(self.account_id.as_str(), self.currency.code())
    }

    async fn natural_replay(&self, ledger: &Ledger) -> Result<Option<AccountRow>, Error> {
        let mut reader = ledger.store.reader().await?;
        let Some(account) = reader.queries().find_account(self.account_id.as_str()).await? else {
            return Ok(None);
        };
        let fields = differing_from(&self.fields(), &open_account_fields(&account.account_id, &account.currency));
        if !fields.is_empty() {
            return Err(Error::KeyReused { key: ReusedKey::AccountId, fields });
        }
        Ok(Some(account))
    }

    async fn body(&self, queries: &mut Queries<'_>, now: i64) -> Result<Inserted<AccountRow>, Error> {
        write_alone(self, queries, now).await
    }
}

impl BatchWrite for OpenAccount {
    fn route(&self) -> &str {
        self.account_id.as_str()
    }

    /// None: an OpenAccount runs alone.
    fn batch_keys(&self, _read: &ReadFirst) -> Option<Vec<BatchKey>> {
        None
    }

    /// Its account_id, locked to find one committed before (a row lock on no row orders
    /// nothing: a concurrent OpenAccount of it fails the INSERT, and is then a replay).
    fn accounts_to_lock<'a>(&'a self, _rows: Rows<'a>) -> Vec<&'a str> {
        vec![self.account_id.as_str()]
    }

    /// An account of this id is a replay (or ALREADY_EXISTS in another currency); otherwise a
    /// new customer account, empty.
    fn decide(&self, view: &mut View<'_>) -> Result<Box<dyn Accepted>, Outcome> {
        if view.book.get(self.account_id.as_str()).is_some() {
            return Err(Outcome::TakenBefore);
        }
        Ok(Box::new(Opened(new_account(self.account_id.as_str(), self.currency.code(), KIND_CUSTOMER, view.now))))
    }
}

/// An account an OpenAccount opened.
struct Opened(AccountRow);

impl Accepted for Opened {
    fn add_to<'s>(&'s self, set: &mut WriteSet<'s>) {
        set.accounts.push(self.0.clone());
    }

    fn message(&self) -> Result<Option<Vec<u8>>, Error> {
        Ok(Some(OpenAccount::message(self.0.clone())?.encode_to_vec()))
    }

    fn answer(self: Box<Self>, _entries: &mut Entries, _locked: &Book) -> Result<(Answer, Option<Vec<u8>>), Error> {
        Ok((Box::new(self.0), None))
    }
}

impl Batchable for OpenAccount {
    fn write(&self) -> Box<dyn BatchWrite> {
        Box::new(self.clone())
    }

    /// Its currency's funding account, created if absent (every currency's first account
    /// creates it).
    async fn before_alone(&self, queries: &mut Queries<'_>, _read: &mut ReadFirst, now: i64) -> Result<(), Error> {
        let code = self.currency.code();
        ensure_funding_account(queries, &external_account_id(code), code, now).await?;
        Ok(())
    }
}

/// Deposit and Withdraw: money between an account and its currency's external funding
/// account, once per request_id (each kind with its own table of request_ids).
pub(super) trait Funding: Sync {
    const METHOD: &'static str;
    const TABLE: FundingTable;
    const ENTRY_KIND: EntryKind;
    /// True when money comes into the account (Deposit), false when it leaves (Withdraw).
    const INTO_ACCOUNT: bool;
    type Message: prost::Message + Default + Send;

    fn parts(&self) -> (&RequestId, &AccountId, Amount, &Actor);
    fn message(account: proto::Account, entry: proto::Entry) -> Self::Message;
}

impl Funding for Deposit {
    const METHOD: &'static str = "Deposit";
    const TABLE: FundingTable = FundingTable::Deposits;
    const ENTRY_KIND: EntryKind = EntryKind::Deposit;
    const INTO_ACCOUNT: bool = true;
    type Message = proto::DepositResponse;

    fn parts(&self) -> (&RequestId, &AccountId, Amount, &Actor) {
        (&self.request_id, &self.account_id, self.amount, &self.created_by)
    }

    fn message(account: proto::Account, entry: proto::Entry) -> Self::Message {
        proto::DepositResponse { account: Some(account), entry: Some(entry) }
    }
}

impl Funding for Withdraw {
    const METHOD: &'static str = "Withdraw";
    const TABLE: FundingTable = FundingTable::Withdrawals;
    const ENTRY_KIND: EntryKind = EntryKind::Withdrawal;
    const INTO_ACCOUNT: bool = false;
    type Message = proto::WithdrawResponse;

    fn parts(&self) -> (&RequestId, &AccountId, Amount, &Actor) {
        (&self.request_id, &self.account_id, self.amount, &self.created_by)
    }

    fn message(account: proto::Account, entry: proto::Entry) -> Self::Message {
        proto::WithdrawResponse { account: Some(account), entry: Some(entry) }
    }
}

/// A Deposit's or Withdraw's business fields, from a request or a stored row.
fn funding_fields(request_id: &str, account_id: &str, amount: i64, currency: &str) -> Fields {
    vec![
        ("request_id", request_id.to_owned()),
        ("account_id", account_id.to_owned()),
        ("amount", amount.to_string()),
        ("currency", currency.to_owned()),
    ]
}

/// A Deposit or Withdraw with what the server adds to it: the posting id, and the funding
/// account (the currency's external account, or one of its shards) on the other side.
pub(super) struct FundingCall<F> {
    command: F,
    id: String,
    funding_account_id: String,
}

/// A Deposit or Withdraw as a group commit writes it (and its own transaction, should it run
/// alone): every field its row and its posting take.
#[derive(Debug, Clone)]
pub(super) struct FundingWrite {
    pub(super) table: FundingTable,
    pub(super) kind: EntryKind,
    /// True for a Deposit (the funding account pays the account), false for a Withdraw.
    pub(super) into_account: bool,
    pub(super) request_id: String,
    pub(super) funding_id: String,
    pub(super) account_id: String,
    pub(super) amount: Amount,
    pub(super) created_by: String,
    pub(super) funding_account_id: String,
    /// Its answer's response message, as its guards record it.
    encode: fn(DepositReceipt) -> Result<Vec<u8>, Error>,
}

impl FundingWrite {
    /// Its row at `now`, in the account's currency (the caller has checked the amount's), with
    /// what the account's holds reserve right after it.
    pub(super) fn row(&self, now: i64, held_after: Option<i64>) -> FundingRow {
        FundingRow {
            request_id: self.request_id.clone(),
            funding_id: self.funding_id.clone(),
            account_id: self.account_id.clone(),
            amount: self.amount.minor_units(),
            currency: self.amount.currency().code().to_owned(),
            created_at: now,
            created_by: self.created_by.clone(),
            held_after,
        }
    }

    /// The accounts its posting moves money from and to.
    fn legs(&self) -> (&str, &str) {
        let (account, funding) = (self.account_id.as_str(), self.funding_account_id.as_str());
        if self.into_account {
            (funding, account)
        } else {
            (account, funding)
        }
    }

    /// Its posting, recorded by `row` (its [`FundingWrite::row`]): a Deposit moves the amount
    /// from the funding account to the account, a Withdraw the other way.
    pub(super) fn posting<'a>(&'a self, row: &'a FundingRow) -> Posting<'a> {
        let (from_account_id, to_account_id) = self.legs();
        Posting {
            posting_id: &row.funding_id,
            kind: self.kind,
            reference: &row.request_id,
            from_account_id,
            to_account_id,
            amount: row.amount,
            currency: &row.currency,
            created_by: &row.created_by,
        }
    }

    /// The account's side of its rules, checked before its money moves (the account exists
    /// and holds the amount's currency); the legs' own rules are [`balance_after`](super::engine::posting::balance_after)'s.
    ///
    /// # Errors
    /// [`Error::NotFound`] (ACCOUNT), [`Rejection::CurrencyMismatch`].
    pub(super) fn check_account<'r>(&self, account: Option<&'r AccountRow>) -> Result<&'r AccountRow, Error> {
        let account = account.ok_or(Error::NotFound(Resource::Account))?;
        if account.currency != self.amount.currency().code() {
            return Err(Rejection::CurrencyMismatch.into());
        }
        Ok(account)
    }
}

impl<F: Funding> FundingCall<F> {
    fn funding_write(&self) -> FundingWrite {
        let (request_id, account_id, amount, created_by) = self.command.parts();
        FundingWrite {
            table: F::TABLE,
            kind: F::ENTRY_KIND,
            into_account: F::INTO_ACCOUNT,
            request_id: request_id.as_str().to_owned(),
            funding_id: self.id.clone(),
            account_id: account_id.as_str().to_owned(),
            amount,
            created_by: created_by.created_by().to_owned(),
            funding_account_id: self.funding_account_id.clone(),
            encode: encode_funding::<F>,
        }
    }
}

/// The response message of a Deposit or Withdraw, which its guards record.
fn encode_funding<F: Funding>(receipt: DepositReceipt) -> Result<Vec<u8>, Error> {
    Ok(<FundingCall<F> as IdempotentCall>::message(receipt)?.encode_to_vec())
}

impl BatchWrite for FundingWrite {
    /// Its answer holds the entry ids its write makes.
    fn answered_before_write(&self) -> bool {
        false
    }

    /// Its funding account, the row every one of them moves: the calls of one shard share a
    /// worker.
    fn route(&self) -> &str {
        self.funding_account_id.as_str()
    }

    /// Its request_id: a second Deposit (or Withdraw) of it, alone after the batch, is a
    /// replay of the first (or REQUEST_ID_REUSED).
    fn batch_keys(&self, _read: &ReadFirst) -> Option<Vec<BatchKey>> {
        let of = match self.table {
            FundingTable::Deposits => "deposit request_id",
            FundingTable::Withdrawals => "withdrawal request_id",
        };
        Some(vec![BatchKey::sole(of, self.request_id.as_str(), "")])
    }

    fn accounts_to_lock<'a>(&'a self, _rows: Rows<'a>) -> Vec<&'a str> {
        vec![self.account_id.as_str(), self.funding_account_id.as_str()]
    }

    /// Its request_id, read under its funding account's lock (every call of a request_id moves
    /// that account; one taken after the read fails the batch's INSERT on the primary key, and
    /// the batch runs alone).
    fn key_to_find(&self) -> Option<KeyToFind> {
        Some(KeyToFind::Funding(self.table, self.request_id.clone()))
    }

    /// A request_id committed before is a replay; a funding account (a shard not used yet)
    /// with no row runs alone, where its own transaction creates it; then its account's checks
    /// ([`FundingWrite::check_account`]) and its posting.
    fn decide(&self, view: &mut View<'_>) -> Result<Box<dyn Accepted>, Outcome> {
        if view.taken(&KeyToFind::Funding(self.table, self.request_id.clone())) {
            return Err(Outcome::TakenBefore);
        }
        if view.book.get(&self.funding_account_id).is_none() {
            return Err(Outcome::Alone);
        }
        let account = self.check_account(view.book.get(&self.account_id)).map_err(Outcome::Rejected)?;
        // A posting moves no hold: the account's holds right after it are those it holds now.
        let row = self.row(view.now, Some(account.held));
        let legs = view.book.post(&self.posting(&row)).map_err(Outcome::Rejected)?;
        Ok(Box::new(Funded { funding: self.clone(), row, legs }))
    }

    /// Refused in a batch, it runs alone, where it inserts its request_id before its refusal
    /// is answered (see [`Batchable::key_taken_in_flight`]).
    fn alone_when_refused(&self) -> bool {
        true
    }
}

/// A Deposit or Withdraw a batch accepted: its row and its legs (from, to). Its receipt holds
/// its account's entry, whose id only the write gives: its guards are claimed IN_PROGRESS and
/// completed after it.
struct Funded {
    funding: FundingWrite,
    row: FundingRow,
    legs: Legs,
}

impl Accepted for Funded {
    fn add_to<'s>(&'s self, set: &mut WriteSet<'s>) {
        match self.funding.table {
            FundingTable::Deposits => set.deposits.push(self.row.clone()),
            FundingTable::Withdrawals => set.withdrawals.push(self.row.clone()),
        }
        set.postings.push((self.funding.posting(&self.row), self.legs));
    }

    fn message(&self) -> Result<Option<Vec<u8>>, Error> {
        Ok(None)
    }

    fn entries_to_read(&self) -> Vec<(&str, &str)> {
        vec![(self.funding.funding_id.as_str(), self.funding.account_id.as_str())]
    }

    /// Its account as read under its lock, moved by its entry.
    fn answer(self: Box<Self>, entries: &mut Entries, locked: &Book) -> Result<(Answer, Option<Vec<u8>>), Error> {
        let funding = &self.funding;
        let entry = entries
            .remove(&(funding.funding_id.clone(), funding.account_id.clone()))
            .ok_or_else(|| Error::Internal("the entry of a deposit or withdrawal is missing".into()))?;
        let account =
            locked.get(&funding.account_id).ok_or_else(|| Error::Internal("a funded account is not locked".into()))?;
        let receipt = receipt_after(account.clone(), entry);
        let message = (funding.encode)(receipt.clone())?;
        Ok((Box::new(receipt), Some(message)))
    }

    fn committed(&self) -> Option<Committed> {
        Some(match self.funding.table {
            FundingTable::Deposits => deposits_committed,
            FundingTable::Withdrawals => withdrawals_committed,
        })
    }
}

fn deposits_committed(metrics: &LedgerMetrics) -> &Counter {
    &metrics.group_committed_deposits
}

fn withdrawals_committed(metrics: &LedgerMetrics) -> &Counter {
    &metrics.group_committed_withdrawals
}

impl<F: Funding> Batchable for FundingCall<F> {
    fn write(&self) -> Box<dyn BatchWrite> {
        Box::new(self.funding_write())
    }

    /// Its funding account's shard, created (an EXTERNAL account of its currency).
    async fn create_missing(&self, queries: &mut Queries<'_>, now: i64) -> Result<bool, Error> {
        let currency = self.command.parts().2.currency().code();
        ensure_funding_account(queries, &self.funding_account_id, currency, now).await?;
        Ok(true)
    }

    /// Its request_id inserted.
    async fn key_taken_in_flight(
        &self,
        queries: &mut Queries<'_>,
        _read: &ReadFirst,
        _refusal: &Error,
        now: i64,
    ) -> Result<bool, Error> {
        let funding = self.funding_write();
        // Rolled back with the refusal: what the account holds does not matter.
        Ok(!queries.insert_funding(funding.table, &funding.row(now, None)).await?)
    }
}

impl<F: Funding> IdempotentCall for FundingCall<F> {
    type Answer = DepositReceipt;
    type Message = F::Message;
    const METHOD: &'static str = F::METHOD;

    fn message(receipt: DepositReceipt) -> Result<Self::Message, Error> {
        Ok(F::message(response::account(receipt.account)?, response::entry(receipt.entry)?))
    }

    fn scope(&self) -> Scope<'_> {
        Scope::Account(self.command.parts().1)
    }

    fn fields(&self) -> Fields {
        let (request_id, account_id, amount, _) = self.command.parts();
        funding_fields(request_id.as_str(), account_id.as_str(), amount.minor_units(), amount.currency().code())
    }

    async fn natural_replay(&self, ledger: &Ledger) -> Result<Option<DepositReceipt>, Error> {
        let mut reader = ledger.store.reader().await?;
        let mut queries = reader.queries();
        let Some(row) = queries.find_funding(F::TABLE, self.command.parts().0.as_str()).await? else {
            return Ok(None);
        };
        let stored = funding_fields(&row.request_id, &row.account_id, row.amount, &row.currency);
        let fields = differing_from(&self.fields(), &stored);
        if !fields.is_empty() {
            return Err(Error::KeyReused { key: ReusedKey::RequestId, fields });
        }
        let account = queries
            .find_account(&row.account_id)
            .await?
            .ok_or_else(|| Error::Internal(format!("the account of a {} is missing", F::METHOD)))?;
        Ok(Some(funding_receipt(&mut queries, account, &row).await?))
    }

    async fn body(&self, queries: &mut Queries<'_>, now: i64) -> Result<Inserted<DepositReceipt>, Error> {
        write_alone(self, queries, now).await
    }
}

impl IdempotentCall for Identified<Transfer> {
    type Answer = TransferReceipt;
    type Message = proto::TransferResponse;
    const METHOD: &'static str = "Transfer";

    fn message(receipt: TransferReceipt) -> Result<Self::Message, Error> {
        Ok(proto::TransferResponse {
            transfer: Some(response::transfer(receipt.transfer)?),
            from_entry: Some(response::entry(receipt.from_entry)?),
            to_entry: Some(response::entry(receipt.to_entry)?),
        })
    }

    fn scope(&self) -> Scope<'_> {
        Scope::Account(&self.command.from_account_id)
    }

    fn fields(&self) -> Fields {
        let Transfer { from_account_id, to_account_id, amount, memo, created_by: _ } = &self.command;
        vec![
            ("from_account_id", from_account_id.to_string()),
            ("to_account_id", to_account_id.to_string()),
            ("amount", amount.minor_units().to_string()),
            ("currency", amount.currency().to_string()),
            ("memo", memo.as_str().to_owned()),
        ]
    }

    async fn body(&self, queries: &mut Queries<'_>, now: i64) -> Result<Inserted<TransferReceipt>, Error> {
        write_alone(self, queries, now).await
    }
}

impl BatchWrite for Identified<Transfer> {
    /// Its answer holds the entry ids its write makes.
    fn answered_before_write(&self) -> bool {
        false
    }

    /// Its from_account_id: the Transfers of one account share a worker (their to-accounts may
    /// be another worker's too: those batches then wait for each other's row locks, taken in
    /// account_id order).
    fn route(&self) -> &str {
        self.command.from_account_id.as_str()
    }

    /// None: its key is its guard.
    fn batch_keys(&self, _read: &ReadFirst) -> Option<Vec<BatchKey>> {
        Some(Vec::new())
    }

    fn accounts_to_lock<'a>(&'a self, _rows: Rows<'a>) -> Vec<&'a str> {
        vec![self.command.from_account_id.as_str(), self.command.to_account_id.as_str()]
    }

    fn decide(&self, view: &mut View<'_>) -> Result<Box<dyn Accepted>, Outcome> {
        let transfer = transfer_row(&self.command, &self.id, view.now);
        let legs = view.book.post(&transfer_posting(&transfer)).map_err(Outcome::Rejected)?;
        Ok(Box::new(Transferred { transfer, legs }))
    }
}

/// A Transfer a batch accepted: its row and its legs (from, to). Its receipt holds its
/// entries, whose ids only the write gives: its guards are claimed IN_PROGRESS and completed
/// after it.
struct Transferred {
    transfer: TransferRow,
    legs: Legs,
}

impl Accepted for Transferred {
    fn add_to<'s>(&'s self, set: &mut WriteSet<'s>) {
        set.transfers.push(self.transfer.clone());
        set.postings.push((transfer_posting(&self.transfer), self.legs));
    }

    fn message(&self) -> Result<Option<Vec<u8>>, Error> {
        Ok(None)
    }

    fn entries_to_read(&self) -> Vec<(&str, &str)> {
        let transfer_id = self.transfer.transfer_id.as_str();
        vec![(transfer_id, self.transfer.from_account_id.as_str()), (transfer_id, self.transfer.to_account_id.as_str())]
    }

    fn answer(self: Box<Self>, entries: &mut Entries, _locked: &Book) -> Result<(Answer, Option<Vec<u8>>), Error> {
        let transfer = self.transfer;
        let mut entry = |account_id: &str| {
            entries
                .remove(&(transfer.transfer_id.clone(), account_id.to_owned()))
                .ok_or_else(|| Error::Internal("a transfer's entry is missing".into()))
        };
        let (from_entry, to_entry) = (entry(&transfer.from_account_id)?, entry(&transfer.to_account_id)?);
        let receipt = TransferReceipt { transfer, from_entry, to_entry };
        let message = <Identified<Transfer> as IdempotentCall>::message(receipt.clone())?.encode_to_vec();
        Ok((Box::new(receipt), Some(message)))
    }

    fn committed(&self) -> Option<Committed> {
        Some(|metrics| &metrics.group_committed_transfers)
    }
}

impl Batchable for Identified<Transfer> {
    fn write(&self) -> Box<dyn BatchWrite> {
        Box::new(self.clone())
    }
}

/// The row a Transfer writes at `now`, as its own transaction and a group commit write it.
pub(super) fn transfer_row(command: &Transfer, transfer_id: &str, now: i64) -> TransferRow {
    TransferRow {
        transfer_id: transfer_id.to_owned(),
        from_account_id: command.from_account_id.as_str().to_owned(),
        to_account_id: command.to_account_id.as_str().to_owned(),
        amount: command.amount.minor_units(),
        currency: command.amount.currency().code().to_owned(),
        memo: command.memo.as_str().to_owned(),
        created_at: now,
        created_by: command.created_by.created_by().to_owned(),
    }
}

/// The posting of a transfer: its amount from its from account to its to account.
pub(super) fn transfer_posting(transfer: &TransferRow) -> Posting<'_> {
    Posting {
        posting_id: &transfer.transfer_id,
        kind: EntryKind::Transfer,
        reference: &transfer.transfer_id,
        from_account_id: &transfer.from_account_id,
        to_account_id: &transfer.to_account_id,
        amount: transfer.amount,
        currency: &transfer.currency,
        created_by: &transfer.created_by,
    }
}

/// The row of a funding account, inserted on its first use (a shard other than the first is
/// created by the first Deposit or Withdraw that needs it; OpenAccount creates the first).
/// `None` when a concurrent transaction inserted it first: the posting then reads it.
pub(super) async fn ensure_funding_account(
    queries: &mut Queries<'_>,
    account_id: &str,
    currency: &str,
    now: i64,
) -> Result<Option<AccountRow>, Error> {
    if let Some(row) = queries.find_account(account_id).await? {
        return Ok(Some(row));
    }
    let row = new_account(account_id, currency, KIND_EXTERNAL, now);
    Ok(queries.insert_account(&row).await?.then_some(row))
}

/// A new account's row: no money, no holds, version 0.
fn new_account(account_id: &str, currency: &str, kind: &str, now: i64) -> AccountRow {
    AccountRow {
        account_id: account_id.to_owned(),
        currency: currency.to_owned(),
        kind: kind.to_owned(),
        balance: 0,
        version: 0,
        created_at: now,
        updated_at: now,
        held: 0,
        chain_hash: None,
    }
}

/// The account as it stood right after the Deposit or Withdraw of `row` (its balance and
/// version from its entry, what its holds reserved from the row; a row older than that column
/// leaves the account's holds as they are now), with that entry.
async fn funding_receipt(
    queries: &mut Queries<'_>,
    account: AccountRow,
    row: &FundingRow,
) -> Result<DepositReceipt, Error> {
    let entry = queries
        .find_entry(&row.funding_id, &account.account_id)
        .await?
        .ok_or_else(|| Error::Internal("the entry of a deposit or withdrawal is missing".into()))?;
    let held = row.held_after.unwrap_or(account.held);
    Ok(receipt_after(AccountRow { held, ..account }, entry))
}

/// The receipt of a Deposit or Withdraw: `account` (as read before it) as its `entry` on it
/// left it.
pub(super) fn receipt_after(account: AccountRow, entry: EntryRow) -> DepositReceipt {
    let account = AccountRow {
        balance: entry.balance_after,
        version: entry.version_after,
        updated_at: entry.created_at,
        ..account
    };
    DepositReceipt { account, entry }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_shard_is_the_external_account_and_the_others_are_numbered() {
        assert_eq!(funding_account_id("USD", 0), "@external:USD");
        assert_eq!(funding_account_id("USD", 7), "@external:USD:7");
    }

    #[test]
    fn one_shard_is_always_the_first_and_requests_spread_over_many() {
        assert!((0..100).all(|n| funding_shard(&format!("d-{n}"), 1) == 0));
        let mut used = std::collections::BTreeSet::new();
        for n in 0..400 {
            let shard = funding_shard(&format!("d-{n}"), 16);
            assert!(shard < 16);
            used.insert(shard);
        }
        assert_eq!(used.len(), 16, "400 request ids reach every one of 16 shards");
        assert_eq!(funding_shard("d-1", 16), funding_shard("d-1", 16), "the same request, the same shard");
    }
}
