//! Maintenance an operator runs by hand while the service goes on (docs/operations.md, "A long
//! transaction elsewhere on the database"): each runbook step is run here as written, under load,
//! and what it promises is checked — space given back, nothing lost or booked twice.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use inbox_domain::handler::Registry;
use inbox_test_support::db::{hold_snapshot, scalar, unprocessed};
use inbox_test_support::events::invoice_paid;
use inbox_test_support::spawn_app;
use inbox_test_support::worker::{eventually, spawn_worker};

/// Events sent while the snapshot is held (each leaves dead entries in the queue table's indexes
/// that vacuum may not remove until it ends), and then while the runbook runs.
const HELD: i64 = 2000;

/// The runbook's statements, each on its own (`VACUUM` may not run in the implicit transaction of
/// a multi-statement query): a short `lock_timeout`, so that the ingest's inserts and the workers'
/// claims never queue behind the rewrite for long, and the rewrite, retried when it times out.
const LOCK_TIMEOUT: &str = "SET lock_timeout = '100ms'";
const VACUUM_FULL_QUEUE: &str = "VACUUM FULL webhook_inbox_queue";

/// The queue table's indexes, the part vacuum never shrinks.
async fn queue_index_bytes(client: &tokio_postgres::Client) -> i64 {
    scalar(client, "SELECT pg_indexes_size('webhook_inbox_queue')").await
}

/// After a long snapshot the queue table keeps what it grew to: vacuum frees its index pages for
/// reuse but never gives them back. The runbook's `VACUUM FULL webhook_inbox_queue`, under a short
/// lock timeout and retried, rewrites it to the rows waiting while webhooks keep arriving and the
/// worker keeps booking them: afterwards the indexes are a fraction of their size, every event sent
/// is booked exactly once, and the queue still holds every waiting row (a row missing from it
/// would never be claimed, and the drain below would not finish).
#[tokio::test]
async fn after_a_long_snapshot_a_vacuum_full_of_the_queue_table_under_load_gives_its_space_back_and_loses_nothing(
) {
    let app = Arc::new(spawn_app().await);
    let client = app.db.client().await;
    let worker = spawn_worker(&app.db, Registry::with_invoice_handlers(), |s| {
        s.poll_interval = Duration::from_millis(100)
    })
    .await;

    let reporting = hold_snapshot(&app.db, "webhook_inbox").await;
    for chunk in (0..HELD).collect::<Vec<_>>().chunks(50) {
        let replies =
            futures_util::future::join_all(chunk.iter().map(|i| {
                app.post_signed(invoice_paid(&format!("evt_held_{i}"), &format!("in_held_{i}"), 100))
            }))
            .await;
        assert!(replies.iter().all(|r| r.status == 200), "{replies:?}");
    }
    assert!(eventually(Duration::from_secs(60), || async { unprocessed(&client).await == 0 }).await);
    reporting.batch_execute("COMMIT").await.unwrap();
    client.batch_execute("VACUUM webhook_inbox_queue").await.unwrap();
    let grown = queue_index_bytes(&client).await;

    // Webhooks keep coming while the runbook runs.
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicI64::new(0));
    let load = tokio::spawn({
        let (app, stop, sent) = (app.clone(), stop.clone(), sent.clone());
        async move {
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                let replies = futures_util::future::join_all((i..i + 10).map(|i| {
                    app.post_signed(invoice_paid(&format!("evt_load_{i}"), &format!("in_load_{i}"), 100))
                }))
                .await;
                assert!(replies.iter().all(|r| r.status == 200), "{replies:?}");
                i += 10;
                sent.store(i, Ordering::SeqCst);
            }
        }
    });
    assert!(eventually(Duration::from_secs(30), || async { sent.load(Ordering::SeqCst) >= 100 }).await);

    let operator = app.db.client().await;
    operator.batch_execute(LOCK_TIMEOUT).await.unwrap();
    let mut timed_out = 0;
    let rewritten = loop {
        match operator.batch_execute(VACUUM_FULL_QUEUE).await {
            Ok(()) => break queue_index_bytes(&operator).await,
            Err(e)
                if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE)
                    && timed_out < 100 =>
            {
                timed_out += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("VACUUM FULL after {timed_out} lock timeouts: {e:?}"),
        }
    };
    // …and go on after it: the ingest's inserts did not stay blocked (the worker's claims and
    // marks did not either: the drain below finishes).
    let during = sent.load(Ordering::SeqCst);
    assert!(
        eventually(Duration::from_secs(30), || async { sent.load(Ordering::SeqCst) >= during + 100 }).await
    );
    stop.store(true, Ordering::SeqCst);
    load.await.unwrap();

    assert!(
        rewritten * 4 < grown,
        "the queue table's indexes: {grown} bytes after the snapshot and a vacuum, {rewritten} after VACUUM FULL"
    );
    assert!(
        eventually(Duration::from_secs(60), || async { unprocessed(&client).await == 0 }).await,
        "{} rows left unprocessed, {} in the queue",
        unprocessed(&client).await,
        scalar(&client, "SELECT count(*) FROM webhook_inbox_queue").await
    );
    let events = HELD + sent.load(Ordering::SeqCst);
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox").await, events);
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM ledger_entries").await,
        events,
        "each event booked once"
    );
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox_queue").await, 0);
    worker.stop().await;
}
