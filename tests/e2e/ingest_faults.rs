//! The database failing under the ingest: connections refused, backends terminated, a database
//! that never answers, a statement timeout. Never a hang, never a 2xx without a row, and
//! recovery without a restart.

use std::time::{Duration, Instant};

use inbox_test_support::db::{column, slow_writes};
use inbox_test_support::events::invoice_paid;
use inbox_test_support::proxy::{postgres_addr, FaultProxy, Mode};
use inbox_test_support::{spawn_app_with, TestApp, TestDb};

const DB_TIMEOUT: Duration = Duration::from_secs(1);

/// The service behind a fault proxy, with a 1 s database timeout.
async fn app_behind_proxy() -> (TestApp, FaultProxy) {
    app_behind_proxy_with(DB_TIMEOUT).await
}

async fn app_behind_proxy_with(db_timeout: Duration) -> (TestApp, FaultProxy) {
    let proxy = FaultProxy::start(postgres_addr()).await;
    let db = TestDb::new().await;
    let config = db.config_via_port(proxy.port);
    let app = spawn_app_with(db, |s| {
        s.database = config.into();
        s.db_timeout = db_timeout;
    })
    .await;
    (app, proxy)
}

async fn assert_503_in_time(app: &TestApp, event_id: &str) {
    let started = Instant::now();
    let reply = app.post_signed(invoice_paid(event_id, "in_1", 1)).await;
    let took = started.elapsed();
    assert_eq!(reply.status, 503, "{}", reply.text);
    assert!(took < DB_TIMEOUT * 3, "503 took {took:?}");
    let ready = app.get("/readyz").await;
    assert_eq!(ready.status, 503, "{}", ready.text);
}

#[tokio::test]
async fn refused_connections_answer_503_and_the_service_recovers_by_itself() {
    let (app, proxy) = app_behind_proxy().await;
    assert_eq!(app.post_signed(invoice_paid("evt_before", "in_1", 1)).await.status, 200);

    proxy.set(Mode::Refuse);
    assert_503_in_time(&app, "evt_during").await;

    proxy.set(Mode::Pass);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let reply = app.post_signed(invoice_paid("evt_after", "in_1", 1)).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    // /readyz keeps its answer for a second (crate::readiness::CACHE_FOR).
    let ready = inbox_test_support::worker::eventually(Duration::from_secs(3), || async {
        app.get("/readyz").await.status == 200
    })
    .await;
    assert!(ready, "ready again");
    // The redelivery of the refused event is accepted now.
    assert_eq!(app.post_signed(invoice_paid("evt_during", "in_1", 1)).await.body["status"], "accepted");
    let ids: Vec<String> =
        column(&app.db.client().await, "SELECT event_id FROM webhook_inbox ORDER BY 1").await;
    assert_eq!(ids, ["evt_after", "evt_before", "evt_during"]);
}

#[tokio::test]
async fn a_database_that_never_answers_is_503_within_the_timeout() {
    let (app, proxy) = app_behind_proxy().await;
    assert_eq!(app.post_signed(invoice_paid("evt_before", "in_1", 1)).await.status, 200);
    proxy.set(Mode::Blackhole);
    assert_503_in_time(&app, "evt_hole").await;
    proxy.set(Mode::Pass);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(app.post_signed(invoice_paid("evt_hole", "in_1", 1)).await.status, 200);
    assert_eq!(app.inbox_rows().await, 2);
}

/// A connection the network dropped without a word (no FIN, no RST: the proxy holds it open and
/// passes nothing) fails the one batch that meets it, within the timeout, and is given up on: the
/// pool does not test connections at checkout, so without that every later batch would wait
/// behind it until TCP keepalive noticed, minutes on.
#[tokio::test]
async fn connections_the_network_dropped_silently_fail_one_batch_each_and_are_replaced() {
    let (app, proxy) = app_behind_proxy().await;
    let name = app.db.name.clone();
    for i in 0..3 {
        assert_eq!(app.post_signed(invoice_paid(&format!("evt_before_{i}"), "in_1", 1)).await.status, 200);
    }
    let admin = inbox_test_support::db::connect(&inbox_test_support::db::admin_config()).await;
    let open: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name = 'inbox-ingest'",
            &[&name],
        )
        .await
        .unwrap()
        .get(0);
    assert!(open >= 1, "no ingest connection open before the freeze");

    proxy.set(Mode::Freeze);
    let mut failed = 0;
    let mut stored = false;
    for attempt in 0..=open {
        let started = Instant::now();
        let reply = app.post_signed(invoice_paid("evt_after", "in_1", 1)).await;
        let took = started.elapsed();
        assert!(took < DB_TIMEOUT * 3, "attempt {attempt} took {took:?}");
        match reply.status {
            200 => {
                stored = true;
                break;
            }
            503 => failed += 1,
            status => panic!("attempt {attempt}: {status} {}", reply.text),
        }
    }
    assert!(stored, "still 503 after {failed} attempts with {open} connections frozen");
    assert!(failed <= open, "{failed} failed batches for {open} frozen connections");
    let ids: Vec<String> =
        column(&app.db.client().await, "SELECT event_id FROM webhook_inbox ORDER BY 1").await;
    assert_eq!(ids, ["evt_after", "evt_before_0", "evt_before_1", "evt_before_2"]);
}

/// The wake-up NOTIFY has the batches' deadline: a NOTIFY that meets a connection the network
/// dropped silently gives that connection up, and the rows stored after it still wake the workers.
/// Without the deadline the notifier waits on that connection for good and the workers only poll.
/// Webhooks keep arriving while every open connection is frozen, fifteen times, each after the
/// previous freeze's batches gave up, so that the NOTIFY is on the wire, or about to take a
/// connection that was open at the freeze, at some of those moments: a race by nature, which
/// without the deadline was lost in 12 runs of 12. Every 200 among them has its row.
#[tokio::test]
async fn the_wake_up_outlives_connections_the_network_dropped_silently() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let db_timeout = Duration::from_millis(250);
    let (app, proxy) = app_behind_proxy_with(db_timeout).await;
    let mut wake_ups = listen(&app.db, "webhook_inbox").await;
    assert_eq!(app.post_signed(invoice_paid("evt_first", "in_1", 1)).await.status, 200);
    assert!(wake_ups.recv_within(Duration::from_secs(5)).await, "no wake-up before the freezes");

    let (stop, sent) = (AtomicBool::new(false), AtomicUsize::new(0));
    let poster = |task: usize| {
        let (app, stop, sent) = (&app, &stop, &sent);
        async move {
            let mut accepted = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let id = format!("evt_load_{task}_{}", sent.fetch_add(1, Ordering::Relaxed));
                match app.post_signed(invoice_paid(&id, "in_1", 1)).await.status {
                    200 => accepted.push(id),
                    503 => {}
                    status => panic!("{id}: {status}"),
                }
            }
            accepted
        }
    };
    let freezes = async {
        for _ in 0..15 {
            tokio::time::sleep(db_timeout + Duration::from_millis(150)).await;
            proxy.set(Mode::Freeze);
        }
        tokio::time::sleep(db_timeout * 2).await;
        stop.store(true, Ordering::Relaxed);
    };
    let (accepted, ()) =
        futures_util::future::join(futures_util::future::join_all((0..8).map(poster)), freezes).await;
    let accepted: Vec<String> = accepted.into_iter().flatten().collect();
    assert!(!accepted.is_empty(), "no webhook accepted between the freezes");
    let stored: std::collections::HashSet<String> =
        column(&app.db.client().await, "SELECT event_id FROM webhook_inbox").await.into_iter().collect();
    let lost: Vec<&String> = accepted.iter().filter(|id| !stored.contains(*id)).collect();
    assert!(lost.is_empty(), "answered 200 but not stored: {lost:?}");

    // Every frozen connection has been given up by now: the rows stored next are announced. (One
    // row each try, so that a NOTIFY slower than the timeout on a busy machine fails no run.)
    wake_ups.drain();
    let mut heard = false;
    for attempt in 0..10 {
        let status = app.post_signed(invoice_paid(&format!("evt_after_{attempt}"), "in_1", 1)).await.status;
        assert!(status == 200 || status == 503, "evt_after_{attempt}: {status}");
        if status == 200 && wake_ups.recv_within(Duration::from_secs(1)).await {
            heard = true;
            break;
        }
    }
    assert!(heard, "no wake-up for rows stored after the freezes: the notifier is stuck");
}

/// NOTIFYs on a channel, heard on a connection of the test's own (not through the proxy).
struct WakeUps {
    messages: tokio::sync::mpsc::UnboundedReceiver<tokio_postgres::AsyncMessage>,
    /// The listening session: dropping it would end the LISTEN.
    _session: tokio_postgres::Client,
}

impl WakeUps {
    async fn recv_within(&mut self, limit: Duration) -> bool {
        let heard = async {
            while let Some(message) = self.messages.recv().await {
                if let tokio_postgres::AsyncMessage::Notification(_) = message {
                    return true;
                }
            }
            false
        };
        tokio::time::timeout(limit, heard).await.unwrap_or(false)
    }

    fn drain(&mut self) {
        while self.messages.try_recv().is_ok() {}
    }
}

async fn listen(db: &TestDb, channel: &str) -> WakeUps {
    let (session, messages) = inbox_test_support::db::connect_with_messages(&db.config()).await;
    session.batch_execute(&format!("LISTEN {channel}")).await.unwrap();
    WakeUps { messages, _session: session }
}

#[tokio::test]
async fn terminated_backends_are_replaced_without_a_failed_request() {
    let db = TestDb::new().await;
    let name = db.name.clone();
    let app = spawn_app_with(db, |_| {}).await;
    for i in 0..5 {
        assert_eq!(app.post_signed(invoice_paid(&format!("evt_pre_{i}"), "in_1", 1)).await.status, 200);
    }
    let admin = inbox_test_support::db::connect(&inbox_test_support::db::admin_config()).await;
    let killed: i64 = admin
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
              WHERE datname = $1 AND application_name = 'inbox-ingest'",
            &[&name],
        )
        .await
        .unwrap()
        .get(0);
    assert!(killed >= 1, "no ingest backend to terminate");
    tokio::time::sleep(Duration::from_millis(100)).await;
    for i in 0..5 {
        let reply = app.post_signed(invoice_paid(&format!("evt_post_{i}"), "in_1", 1)).await;
        assert_eq!(reply.status, 200, "request {i} after the termination: {}", reply.text);
    }
    assert_eq!(app.get("/readyz").await.status, 200);
    assert_eq!(app.inbox_rows().await, 10);
}

#[tokio::test]
async fn a_statement_timeout_is_503_and_stores_nothing() {
    let db = TestDb::new().await;
    slow_writes(&db.client().await, "webhook_inbox", "BEFORE INSERT", 5.0).await;
    let app = spawn_app_with(db, |s| s.db_timeout = DB_TIMEOUT).await;
    let started = Instant::now();
    let reply = app.post_signed(invoice_paid("evt_slow", "in_1", 1)).await;
    assert_eq!(reply.status, 503, "{}", reply.text);
    assert!(started.elapsed() < DB_TIMEOUT * 3, "took {:?}", started.elapsed());
    // The server cancelled the statement: no row, even after the trigger would have finished.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(app.inbox_rows().await, 0);

    app.db.client().await.batch_execute("DROP TRIGGER slow ON webhook_inbox").await.unwrap();
    let reply = app.post_signed(invoice_paid("evt_slow", "in_1", 1)).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert_eq!(reply.body["status"], "accepted");
}

/// An outage is one line when it starts — naming where the database is and the cause — and one
/// when it ends, however many requests failed in between; and a command that cannot connect says
/// where it tried.
#[tokio::test]
async fn an_outage_is_one_line_naming_the_database_then_one_reconnected_line() {
    use inbox_test_support::events::{sign, SECRET_A};
    let proxy = FaultProxy::start(postgres_addr()).await;
    let db = TestDb::new().await;
    let via = format!("postgres://postgres@127.0.0.1:{}/{}", proxy.port, db.name);
    let mut cmd = inbox_test_support::process::command("inbox-ingest");
    cmd.env("DATABASE_URL", &via)
        .env("INBOX_ENDPOINTS", format!("billing={SECRET_A}"))
        .env("INBOX_LISTEN", "127.0.0.1:0")
        .env("INBOX_DB_TIMEOUT", "1s");
    let (ingest, base) =
        tokio::task::spawn_blocking(move || inbox_test_support::process::start_ingest(cmd)).await.unwrap();
    let post = |i: usize| {
        let base = base.clone();
        async move {
            let body = invoice_paid(&format!("evt_outage_{i}"), "in_1", 1);
            inbox_test_support::app::http_client()
                .post(format!("{base}/webhooks/stripe/billing"))
                .header("Stripe-Signature", sign(SECRET_A, &body))
                .body(body)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    assert_eq!(post(0).await, 200);
    proxy.set(Mode::Refuse);
    for i in 1..=6 {
        assert_eq!(post(i).await, 503);
    }
    proxy.set(Mode::Pass);
    let mut status = 0;
    for _ in 0..20 {
        status = post(100).await;
        if status == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(status, 200, "{}", ingest.output());
    // The answer can arrive before the process's log line has been read.
    ingest.wait_for_line("answers again (reconnected)", Duration::from_secs(10));
    let logs = ingest.output();
    let failing: Vec<&str> = logs.lines().filter(|l| l.contains("the database is failing")).collect();
    assert_eq!(failing.len(), 1, "one line for the outage:\n{logs}");
    let target = format!("127.0.0.1:{} (user postgres, database {})", proxy.port, db.name);
    assert!(failing[0].contains(&target) && failing[0].contains("refused"), "{}", failing[0]);
    let back: Vec<&str> = logs.lines().filter(|l| l.contains("answers again (reconnected)")).collect();
    assert_eq!(back.len(), 1, "{logs}");
    assert!(back[0].contains("\"failed_calls\""), "{}", back[0]);
    drop(ingest);

    // A command that cannot connect says where it tried.
    proxy.set(Mode::Refuse);
    let mut cmd = inbox_test_support::process::command("inbox-worker");
    cmd.env("DATABASE_URL", &via).arg("stats");
    let (code, output) =
        tokio::task::spawn_blocking(move || inbox_test_support::process::run(cmd, Duration::from_secs(30)))
            .await
            .unwrap();
    assert_eq!(code, 1, "{output}");
    assert!(output.contains(&format!("cannot connect to the database at {target}")), "{output}");
}
