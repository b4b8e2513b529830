//! Connections that move: past its maximum age a caller's HTTP/2 connection gets a GOAWAY,
//! and the caller's next calls go over a new connection, none of them failing (gRFC A9). The
//! connections are counted by a proxy between the caller and the server.

use crate::common;

use std::time::{Duration, Instant};

use payledger::client::{PayledgerClient, RetrySettings};
use payledger::proto;
use payledger::startup::Application;
use payledger_tools::storm::{FaultProxy, FaultSettings};
use tokio::net::TcpListener;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_past_its_maximum_age_is_replaced_and_no_call_fails() {
    let directory = tempfile::tempdir().unwrap();
    let ledger = common::sqlite_ledger(directory.path()).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let application = Application::with_listener(listener, ledger, Duration::from_secs(1))
        .with_max_connection_age(Some(Duration::from_millis(300)));
    let address = application.local_addr();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(application.run_until(async {
        let _ = stopped.await;
    }));
    let proxy = FaultProxy::start(address, FaultSettings::none()).await.unwrap();
    let client =
        PayledgerClient::connect_lazy(&format!("http://{}", proxy.address()), RetrySettings::default()).unwrap();

    let open = |number: usize| proto::OpenAccountRequest { account_id: format!("a-{number}"), currency: "USD".into() };
    client.open_account(open(0)).await.expect("the first call");
    let first = proxy.counters().connections;
    let started = Instant::now();
    let mut calls = 1;
    // Until two more connections than the first call needed have been made: the client's
    // second (it keeps two) and one made because the server closed an older one.
    while proxy.counters().connections < first + 2 {
        assert!(started.elapsed() < Duration::from_secs(30), "no connection replaced within 30 s");
        let opened = client.open_account(open(calls)).await.expect("no call fails while its connection ages out");
        assert_eq!(opened.into_inner().account.unwrap().account_id, format!("a-{calls}"));
        calls += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(calls > 2, "calls went over the replaced connections ({calls} calls)");
    let _ = stop.send(());
    server.await.unwrap().unwrap();
}
