//! `payledger.v1.AccountService`.

use tonic::{Request, Response, Status};
use tracing::info_span;

use crate::auth::Permission;
use crate::ledger::Ledger;
use crate::proto;
use crate::proto::account_service_server::AccountService;

use super::{decode, permitted, reply, reply_replayable, run_detached, Admission};
use crate::ledger::response;

/// The AccountService handlers.
#[derive(Clone)]
pub struct AccountApi {
    ledger: Ledger,
    admission: Admission,
}

impl AccountApi {
    /// Handlers without a concurrency limit until [`AccountApi::with_admission`].
    pub fn new(ledger: Ledger) -> Self {
        Self { ledger, admission: Admission::default() }
    }

    /// Admits calls through `admission` (the server's `--max-concurrent-calls`).
    pub fn with_admission(mut self, admission: Admission) -> Self {
        self.admission = admission;
        self
    }
}

#[tonic::async_trait]
impl AccountService for AccountApi {
    async fn open_account(
        &self,
        request: Request<proto::OpenAccountRequest>,
    ) -> Result<Response<proto::OpenAccountResponse>, Status> {
        let caller = permitted(&request, "OpenAccount", Permission::AccountsAdmin)?;
        let guards = decode::guards(&request, &caller.actor)?;
        let command = decode::open_account(request.into_inner())?;
        let span = info_span!("OpenAccount", sub = %caller.subject(), account_id = %command.account_id);
        let ledger = self.ledger.clone();
        let answer =
            run_detached(&self.admission, span, async move { ledger.open_account(command, &guards).await }).await?;
        Ok(reply_replayable(answer))
    }

    async fn deposit(
        &self,
        request: Request<proto::DepositRequest>,
    ) -> Result<Response<proto::DepositResponse>, Status> {
        let caller = permitted(&request, "Deposit", Permission::AccountsAdmin)?;
        let guards = decode::guards(&request, &caller.actor)?;
        let command = decode::deposit(request.into_inner(), &caller.actor)?;
        let span = info_span!("Deposit", sub = %caller.subject(), request_id = %command.request_id, account_id = %command.account_id);
        let ledger = self.ledger.clone();
        let answer = run_detached(&self.admission, span, async move { ledger.deposit(command, &guards).await }).await?;
        Ok(reply_replayable(answer))
    }

    async fn withdraw(
        &self,
        request: Request<proto::WithdrawRequest>,
    ) -> Result<Response<proto::WithdrawResponse>, Status> {
        let caller = permitted(&request, "Withdraw", Permission::AccountsAdmin)?;
        let guards = decode::guards(&request, &caller.actor)?;
        let command = decode::withdraw(request.into_inner(), &caller.actor)?;
        let span = info_span!("Withdraw", sub = %caller.subject(), request_id = %command.request_id, account_id = %command.account_id);
        let ledger = self.ledger.clone();
        let answer =
            run_detached(&self.admission, span, async move { ledger.withdraw(command, &guards).await }).await?;
        Ok(reply_replayable(answer))
    }

    async fn get_account(
        &self,
        request: Request<proto::GetAccountRequest>,
    ) -> Result<Response<proto::GetAccountResponse>, Status> {
        let caller = permitted(&request, "GetAccount", Permission::AccountsRead)?;
        let account_id = decode::account_id(request.into_inner())?;
        let span = info_span!("GetAccount", sub = %caller.subject(), account_id = %account_id);
        let ledger = self.ledger.clone();
        let account = run_detached(&self.admission, span, async move { ledger.get_account(&account_id).await }).await?;
        Ok(reply(proto::GetAccountResponse { account: Some(response::account(account)?) }, false))
    }

    async fn list_entries(
        &self,
        request: Request<proto::ListEntriesRequest>,
    ) -> Result<Response<proto::ListEntriesResponse>, Status> {
        let caller = permitted(&request, "ListEntries", Permission::AccountsRead)?;
        let query = decode::list_entries(request.into_inner())?;
        let span = info_span!("ListEntries", sub = %caller.subject(), account_id = %query.account_id);
        let ledger = self.ledger.clone();
        let page = run_detached(&self.admission, span, async move { ledger.list_entries(query).await }).await?;
        let entries = page.entries.into_iter().map(response::entry).collect::<Result<Vec<_>, _>>()?;
        let next_page_token = page.next_before_entry_id.map(|id| id.to_string()).unwrap_or_default();
        Ok(reply(proto::ListEntriesResponse { entries, next_page_token }, false))
    }

    async fn transfer(
        &self,
        request: Request<proto::TransferRequest>,
    ) -> Result<Response<proto::TransferResponse>, Status> {
        let caller = permitted(&request, "Transfer", Permission::AccountsWrite)?;
        let guards = decode::guards(&request, &caller.actor)?;
        let command = decode::transfer(request.into_inner(), &caller.actor)?;
        let span = info_span!("Transfer", sub = %caller.subject(), from_account_id = %command.from_account_id, to_account_id = %command.to_account_id);
        let ledger = self.ledger.clone();
        let answer =
            run_detached(&self.admission, span, async move { ledger.transfer(command, &guards).await }).await?;
        Ok(reply_replayable(answer))
    }
}
