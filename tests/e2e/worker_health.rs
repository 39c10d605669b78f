//! The worker tells the truth about itself and costs the database little while it does: `/healthz`
//! follows the processing runtime, the queue gauges are counted by one worker per interval, and a
//! count that outlives its limit is cancelled rather than left running.

use std::time::{Duration, Instant};

use inbox_domain::handler::{HandlerFuture, Registry};
use inbox_domain::inbox::event::InboxEvent;
use inbox_domain::inbox::store::gauges;
use inbox_test_support::db::scalar;
use inbox_test_support::events::{invoice_event, invoice_paid};
use inbox_test_support::process::{command, Proc};
use inbox_test_support::worker::{eventually, store_event, test_settings};
use inbox_test_support::TestDb;
use inbox_worker::runner;
use tokio_util::sync::CancellationToken;

/// A handler that blocks its thread (a synchronous call where an `.await` belonged).
fn blocking<'a>(_tx: &'a deadpool_postgres::Transaction<'_>, _event: &'a InboxEvent) -> HandlerFuture<'a> {
    Box::pin(async move {
        std::thread::sleep(Duration::from_secs(16));
        Ok(())
    })
}

async fn healthz(address: std::net::SocketAddr) -> u16 {
    let client = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(5)).build().unwrap();
    client.get(format!("http://{address}/healthz")).send().await.map(|r| r.status().as_u16()).unwrap_or(0)
}

/// The worker's runtime is single-threaded: a handler that blocks the thread stops every claim,
/// batch and timeout. `/healthz` is served from another thread, so it must look at the
/// processing runtime's heartbeat to say so: 503 within the stall limit, 200 again after.
#[tokio::test]
async fn healthz_turns_503_while_a_handler_blocks_the_processing_runtime_and_recovers_after() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let mut settings = test_settings(&db);
    settings.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    settings.lease = Duration::from_secs(60);
    settings.limits.deadline = Duration::from_secs(40);
    // The blocked handler's transaction sits idle for 16 s: it must not be cut off meanwhile.
    settings.limits.idle_timeout = Duration::from_secs(60);
    let shutdown = CancellationToken::new();
    let (tx, rx) = std::sync::mpsc::channel();
    // The worker's own current-thread runtime, on its own thread, as `main_with` runs it.
    let stop = shutdown.clone();
    let worker = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let mut registry = Registry::new();
        registry.register("test.block", blocking);
        rt.block_on(runner::run_with(settings, registry, stop, move |address| async move {
            let _ = tx.send(address.expect("metrics are served"));
        }))
    });
    let address = rx.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!(healthz(address).await, 200);

    store_event(&client, "billing", &invoice_event("evt_block", "test.block", "in_1", "open", 0)).await;
    let started = Instant::now();
    let stalled = eventually(Duration::from_secs(15), || async { healthz(address).await == 503 }).await;
    let after = started.elapsed();
    assert!(stalled, "healthz stayed 200 while the runtime was blocked");
    assert!(
        after <= inbox_worker::metrics::STALLED_AFTER + Duration::from_secs(4),
        "503 only after {after:?}: later than the stated {:?} (+ the time to claim)",
        inbox_worker::metrics::STALLED_AFTER
    );
    // The handler returns after 16 s: the runtime beats again and the event is processed.
    assert!(eventually(Duration::from_secs(20), || async { healthz(address).await == 200 }).await);
    assert!(
        eventually(Duration::from_secs(10), || async {
            scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NOT NULL").await == 1
        })
        .await
    );
    shutdown.cancel();
    worker.join().unwrap().unwrap();
}

/// Three workers refreshing at once: one counts, the others read its figures; within the
/// interval nobody counts again; all report the same values.
#[tokio::test]
async fn the_queue_gauges_are_counted_by_one_worker_per_interval_and_read_by_the_others() {
    let db = TestDb::new().await;
    let client = db.client().await;
    for i in 0..5 {
        store_event(&client, "billing", &invoice_paid(&format!("evt_{i}"), &format!("in_{i}"), 100)).await;
    }
    let interval = Duration::from_secs(30);
    let mut clients = Vec::new();
    for _ in 0..3 {
        clients.push(db.client().await);
    }
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(3));
    let refreshes: Vec<_> = clients
        .into_iter()
        .map(|mut c| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                gauges::refresh(&mut c, interval).await.unwrap()
            })
        })
        .collect();
    let mut results = Vec::new();
    for refresh in refreshes {
        results.push(refresh.await.unwrap());
    }
    let counted = results.iter().filter(|(_, counted)| *counted).count();
    assert_eq!(counted, 1, "exactly one of three concurrent refreshes counted: {results:?}");
    // The ones that did not count either read the figures or (if they ran while the count was in
    // progress) the previous, empty ones; asked again now, everyone reads the count.
    let mut again = db.client().await;
    let (read, counted_again) = gauges::refresh(&mut again, interval).await.unwrap();
    assert!(!counted_again, "fresh figures are not counted again within the interval");
    assert_eq!((read.unprocessed, read.ready), (5, 5));
    // Once the figures are older than the interval, the next refresh counts.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (_, counted_later) = gauges::refresh(&mut again, Duration::from_secs(1)).await.unwrap();
    assert!(counted_later);
}

/// A gauge count that cannot finish (the inbox locked by another session) is stopped by the
/// server within the interval and its connection discarded: no worker backend is left waiting
/// behind the lock.
#[tokio::test]
async fn a_gauge_count_that_outlives_its_interval_does_not_stay_running_on_the_server() {
    let db = TestDb::new().await;
    let mut locker = db.client().await;
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", db.url()).args([
        "run",
        "--poll-interval",
        "100ms",
        "--metrics-listen",
        "127.0.0.1:0",
    ]);
    let worker = Proc::spawn(cmd);
    worker.wait_for_line("inbox-worker running", Duration::from_secs(30));
    let tx = locker.transaction().await.unwrap();
    // Readers of webhook_inbox now wait on this lock.
    tx.batch_execute("LOCK TABLE webhook_inbox IN ACCESS EXCLUSIVE MODE").await.unwrap();
    let observer = db.client().await;
    let waiting_count = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
                           AND application_name = 'inbox-worker' AND wait_event_type = 'Lock'
                           AND query LIKE 'WITH queue AS (%'";
    // A count starts within the gauge interval and waits behind the lock...
    assert!(
        eventually(Duration::from_secs(12), || async { scalar(&observer, waiting_count).await > 0 }).await,
        "no gauge count reached the lock"
    );
    // ...and is gone within the interval, though the lock is still held.
    assert!(
        eventually(Duration::from_secs(8), || async { scalar(&observer, waiting_count).await == 0 }).await,
        "a gauge count stayed waiting on the server after its interval\n{}",
        worker.output()
    );
    tx.rollback().await.unwrap();
}
