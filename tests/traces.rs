//! OpenTelemetry traces, seen through an in-memory span exporter: the caller's W3C
//! `traceparent` (sent by `payledger::client`) becomes the parent of the server's span, and a
//! group commit's span links the Pays it carried. One test per binary: the tracing
//! subscriber is process-wide.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use opentelemetry::trace::{FutureExt as _, SpanId, TraceContextExt as _, Tracer as _, TracerProvider as _};
use opentelemetry::Context;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use payledger::client::{PayledgerClient, RetrySettings};
use payledger::proto;
use payledger::startup::Application;
use tokio::net::TcpListener;
use tracing_subscriber::layer::SubscriberExt as _;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_callers_trace_parents_the_server_span_and_a_group_commit_links_its_pays() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder().with_simple_exporter(exporter.clone()).build();
    let subscriber =
        tracing_subscriber::registry().with(tracing_opentelemetry::layer().with_tracer(provider.tracer("payledger")));
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber of this binary");
    opentelemetry::global::set_text_map_propagator(opentelemetry_sdk::propagation::TraceContextPropagator::new());

    let directory = tempfile::tempdir().unwrap();
    let ledger = common::sqlite_ledger(directory.path()).await;
    let application =
        Application::with_listener(TcpListener::bind("127.0.0.1:0").await.unwrap(), ledger, Duration::from_secs(5));
    let address = application.local_addr();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(application.run_until(async {
        let _ = stopped.await;
    }));
    let client = PayledgerClient::connect_lazy(&format!("http://{address}"), RetrySettings::default()).unwrap();

    client
        .open_account(proto::OpenAccountRequest { account_id: "alice".into(), currency: "USD".into() })
        .await
        .unwrap();
    client.open_account(proto::OpenAccountRequest { account_id: "shop".into(), currency: "USD".into() }).await.unwrap();
    let deposit = proto::DepositRequest {
        request_id: "d1".into(),
        account_id: "alice".into(),
        amount: "100.00".into(),
        currency: "USD".into(),
    };
    client.deposit(deposit).await.unwrap();
    let pays = 12;
    for index in 0..pays {
        let order = proto::CreateOrderRequest {
            merchant_id: "m1".into(),
            order_no: format!("o{index}"),
            payee_account_id: "shop".into(),
            amount: "1.00".into(),
            currency: "USD".into(),
            subject: String::new(),
            expires_at: None,
        };
        client.create_order(order).await.unwrap();
    }

    // Each Pay in a trace of the caller's own, sent concurrently so that batches form.
    let tracer = provider.tracer("checkout");
    let mut callers = Vec::new();
    let mut calls = Vec::new();
    for index in 0..pays {
        let span = tracer.start(format!("checkout {index}"));
        let context = Context::current_with_span(span);
        callers.push(context.span().span_context().clone());
        let client = client.clone();
        let request = proto::PayRequest {
            merchant_id: "m1".into(),
            out_trade_no: format!("t{index}"),
            order_no: format!("o{index}"),
            payer_account_id: "alice".into(),
            amount: "1.00".into(),
            currency: "USD".into(),
        };
        calls.push(tokio::spawn(async move { client.pay(request).await }.with_context(context)));
    }
    for call in calls {
        call.await.unwrap().expect("the Pay succeeds");
    }
    let _ = stop.send(());
    server.await.unwrap().unwrap();
    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();

    // One server span per Pay, each a child of its caller's span, in its caller's trace.
    let server_pays: Vec<&SpanData> =
        spans.iter().filter(|span| span.name == "payledger.v1.PaymentService/Pay").collect();
    assert_eq!(server_pays.len(), pays, "{:#?}", names(&spans));
    for caller in &callers {
        let child = server_pays
            .iter()
            .find(|span| span.span_context.trace_id() == caller.trace_id())
            .unwrap_or_else(|| panic!("no server span in the caller's trace {:?}", caller.trace_id()));
        assert_eq!(child.parent_span_id, caller.span_id(), "the caller's span is the parent");
        assert!(child.parent_span_is_remote);
        assert_eq!(child.span_kind, opentelemetry::trace::SpanKind::Server);
        let attribute =
            |key: &str| child.attributes.iter().find(|kv| kv.key.as_str() == key).map(|kv| kv.value.to_string());
        assert_eq!(attribute("rpc.system.name").as_deref(), Some("grpc"));
        assert_eq!(attribute("rpc.method").as_deref(), Some("payledger.v1.PaymentService/Pay"));
        assert_eq!(attribute("rpc.status_code").as_deref(), Some("OK"));
        assert_eq!(attribute("error.type"), None, "a call that succeeded");
        for old in ["rpc.system", "rpc.service", "rpc.grpc.status_code"] {
            assert_eq!(attribute(old), None, "{old}: the old conventions only with rpc/dup");
        }
    }

    // Group commits link the calls they carried: every fresh Pay, and the set-up's Deposit and
    // CreateOrders, exactly once, each link to a span inside that call's own trace; the batch's transaction
    // is its child.
    let server_deposits: Vec<&SpanData> =
        spans.iter().filter(|span| span.name == "payledger.v1.AccountService/Deposit").collect();
    assert_eq!(server_deposits.len(), 1, "{:#?}", names(&spans));
    let server_orders: Vec<&SpanData> =
        spans.iter().filter(|span| span.name == "payledger.v1.PaymentService/CreateOrder").collect();
    assert_eq!(server_orders.len(), pays, "{:#?}", names(&spans));
    let carried: Vec<&SpanData> = server_pays.iter().chain(&server_deposits).chain(&server_orders).copied().collect();
    let pay_spans: HashSet<(opentelemetry::trace::TraceId, SpanId)> = spans
        .iter()
        .filter(|span| carried.iter().any(|call| call.span_context.trace_id() == span.span_context.trace_id()))
        .map(|span| (span.span_context.trace_id(), span.span_context.span_id()))
        .collect();
    let batches: Vec<&SpanData> = spans.iter().filter(|span| span.name == "group_commit").collect();
    assert!(!batches.is_empty(), "{:#?}", names(&spans));
    let mut linked_traces = HashSet::new();
    for batch in &batches {
        for link in &batch.links.links {
            let target = (link.span_context.trace_id(), link.span_context.span_id());
            assert!(pay_spans.contains(&target), "a link to a span of a Pay's, the Deposit's or a CreateOrder's trace");
            assert!(linked_traces.insert(link.span_context.trace_id()), "each call is linked once");
        }
        assert!(
            spans
                .iter()
                .any(|span| span.name == "db.transaction" && span.parent_span_id == batch.span_context.span_id()),
            "the batch's transaction is its child"
        );
    }
    assert_eq!(
        linked_traces.len(),
        2 * pays + 1,
        "every Pay, the Deposit and every CreateOrder was carried by a group commit and linked"
    );
}

fn names(spans: &[SpanData]) -> Vec<&str> {
    spans.iter().map(|span| span.name.as_ref()).collect()
}
