//! `payledger.v1.PaymentService`.

use tonic::{Request, Response, Status};
use tracing::info_span;

use crate::auth::Permission;
use crate::ledger::{Ledger, QueryKey};
use crate::proto;
use crate::proto::payment_service_server::PaymentService;

use super::{decode, for_merchant, permitted, reply, reply_replayable, run_detached, Admission};
use crate::ledger::response;

/// The PaymentService handlers.
#[derive(Clone)]
pub struct PaymentApi {
    ledger: Ledger,
    admission: Admission,
}

impl PaymentApi {
    /// Handlers without a concurrency limit until [`PaymentApi::with_admission`].
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
impl PaymentService for PaymentApi {
    async fn create_order(
        &self,
        request: Request<proto::CreateOrderRequest>,
    ) -> Result<Response<proto::CreateOrderResponse>, Status> {
        let caller = permitted(&request, "CreateOrder", Permission::PaymentsWrite)?;
        let guards = decode::guards(&request, &caller.actor)?;
        let command = decode::create_order(request.into_inner())?;
        for_merchant(&caller, "CreateOrder", &command.merchant_id)?;
        let span = info_span!("CreateOrder", sub = %caller.subject(), merchant_id = %command.merchant_id, order_no = %command.order_no);
        let ledger = self.ledger.clone();
        let answer =
            run_detached(&self.admission, span, async move { ledger.create_order(command, &guards).await }).await?;
        Ok(reply_replayable(answer))
    }

    async fn close_order(
        &self,
        request: Request<proto::CloseOrderRequest>,
    ) -> Result<Response<proto::CloseOrderResponse>, Status> {
        let caller = permitted(&request, "CloseOrder", Permission::PaymentsWrite)?;
        let guards = decode::guards(&request, &caller.actor)?;
        let (merchant_id, order_no) = decode::close_order(request.into_inner())?;
        for_merchant(&caller, "CloseOrder", &merchant_id)?;
        let span = info_span!("CloseOrder", sub = %caller.subject(), merchant_id = %merchant_id, order_no = %order_no);
        let ledger = self.ledger.clone();
        let answer =
            run_detached(
                &self.admission,
                span,
                async move { ledger.close_order(&merchant_id, &order_no, &guards).await },
            )
            .await?;
        Ok(reply_replayable(answer))
    }

    async fn pay(&self, request: Request<proto::PayRequest>) -> Result<Response<proto::PayResponse>, Status> {
        let caller = permitted(&request, "Pay", Permission::PaymentsWrite)?;
        let guards = decode::guards(&request, &caller.actor)?;
        let command = decode::pay(request.into_inner(), &caller.actor)?;
        for_merchant(&caller, "Pay", &command.merchant_id)?;
        let span = info_span!("Pay", sub = %caller.subject(), merchant_id = %command.merchant_id, out_trade_no = %command.out_trade_no, order_no = %command.order_no);
        let ledger = self.ledger.clone();
        let answer = run_detached(&self.admission, span, async move { ledger.pay(command, &guards).await }).await?;
        Ok(reply_replayable(answer))
    }

    async fn refund(&self, request: Request<proto::RefundRequest>) -> Result<Response<proto::RefundResponse>, Status> {
        let caller = permitted(&request, "Refund", Permission::PaymentsWrite)?;
        let guards = decode::guards(&request, &caller.actor)?;
        let command = decode::refund(request.into_inner(), &caller.actor)?;
        for_merchant(&caller, "Refund", &command.merchant_id)?;
        let span = info_span!("Refund", sub = %caller.subject(), merchant_id = %command.merchant_id, out_trade_no = %command.out_trade_no, out_refund_no = %command.out_refund_no);
        let ledger = self.ledger.clone();
        let answer = run_detached(&self.admission, span, async move { ledger.refund(command, &guards).await }).await?;
        Ok(reply_replayable(answer))
    }

    async fn authorize(
        &self,
        request: Request<proto::AuthorizeRequest>,
    ) -> Result<Response<proto::AuthorizeResponse>, Status> {
        let caller = permitted(&request, "Authorize", Permission::PaymentsWrite)?;
        let guards = decode::guards(&request, &caller.actor)?;
        let command = decode::authorize(request.into_inner(), &caller.actor)?;
        for_merchant(&caller, "Authorize", &command.merchant_id)?;
        let span = info_span!("Authorize", sub = %caller.subject(), merchant_id = %command.merchant_id, out_auth_no = %command.out_auth_no, order_no = %command.order_no);
        let ledger = self.ledger.clone();
        let answer =
            run_detached(&self.admission, span, async move { ledger.authorize(command, &guards).await }).await?;
        Ok(reply_replayable(answer))
    }

    async fn capture(
        &self,
        request: Request<proto::CaptureRequest>,
    ) -> Result<Response<proto::CaptureResponse>, Status> {
        let caller = permitted(&request, "Capture", Permission::PaymentsWrite)?;
        let guards = decode::guards(&request, &caller.actor)?;
        let command = decode::capture(request.into_inner(), &caller.actor)?;
        for_merchant(&caller, "Capture", &command.merchant_id)?;
        let span = info_span!("Capture", sub = %caller.subject(), merchant_id = %command.merchant_id, out_auth_no = %command.out_auth_no, out_trade_no = %command.out_trade_no);
        let ledger = self.ledger.clone();
        let answer = run_detached(&self.admission, span, async move { ledger.capture(command, &guards).await }).await?;
        Ok(reply_replayable(answer))
    }

    async fn void(&self, request: Request<proto::VoidRequest>) -> Result<Response<proto::VoidResponse>, Status> {
        let caller = permitted(&request, "Void", Permission::PaymentsWrite)?;
        let guards = decode::guards(&request, &caller.actor)?;
        let command = decode::void(request.into_inner())?;
        for_merchant(&caller, "Void", &command.merchant_id)?;
        let span = info_span!("Void", sub = %caller.subject(), merchant_id = %command.merchant_id, out_auth_no = %command.out_auth_no);
        let ledger = self.ledger.clone();
        let answer = run_detached(&self.admission, span, async move { ledger.void(command, &guards).await }).await?;
        Ok(reply_replayable(answer))
    }

    async fn query(&self, request: Request<proto::QueryRequest>) -> Result<Response<proto::QueryResponse>, Status> {
        let caller = permitted(&request, "Query", Permission::PaymentsRead)?;
        let (merchant_id, key) = decode::query(request.into_inner())?;
        for_merchant(&caller, "Query", &merchant_id)?;
        let span = match &key {
            QueryKey::OutTradeNo(no) => {
                info_span!("Query", sub = %caller.subject(), merchant_id = %merchant_id, out_trade_no = %no)
            }
            QueryKey::OrderNo(no) => {
                info_span!("Query", sub = %caller.subject(), merchant_id = %merchant_id, order_no = %no)
            }
            QueryKey::OutRefundNo(no) => {
                info_span!("Query", sub = %caller.subject(), merchant_id = %merchant_id, out_refund_no = %no)
            }
        };
        let ledger = self.ledger.clone();
        let details =
            run_detached(&self.admission, span, async move { ledger.query(&merchant_id, &key).await }).await?;
        let response = proto::QueryResponse {
            order: Some(response::order(details.order)?),
            payment: details.payment.map(response::payment).transpose()?,
            refunds: details.refunds.into_iter().map(response::refund).collect::<Result<_, _>>()?,
            hold: details.hold.map(response::hold).transpose()?,
        };
        Ok(reply(response, false))
    }

    async fn issue_token(
        &self,
        request: Request<proto::IssueTokenRequest>,
    ) -> Result<Response<proto::IssueTokenResponse>, Status> {
        let caller = permitted(&request, "IssueToken", Permission::PaymentsWrite)?;
        let (merchant_id, purpose) = decode::issue_token(request.into_inner())?;
        for_merchant(&caller, "IssueToken", &merchant_id)?;
        let span = info_span!("IssueToken", sub = %caller.subject(), merchant_id = %merchant_id);
        let ledger = self.ledger.clone();
        let actor = caller.actor;
        let issued =
            run_detached(
                &self.admission,
                span,
                async move { ledger.issue_token(&merchant_id, &actor, &purpose).await },
            )
            .await?;
        Ok(reply(
            proto::IssueTokenResponse { token: issued.token, expires_at: response::timestamp(issued.expires_at) },
            false,
        ))
    }
}
