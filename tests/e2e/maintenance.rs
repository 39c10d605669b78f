//! Maintenance run while the service goes on (docs/operations.md, "A long transaction elsewhere on
//! the database"): each runbook step and `inbox-worker reindex` are run here as written, under
//! load, and what they promise is checked — space given back, nothing lost or booked twice.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use inbox_domain::handler::Registry;
use inbox_test_support::db::{hold_snapshot, in_batches_of_64, scalar, unprocessed};
use inbox_test_support::events::invoice_paid;
use inbox_test_support::process::command;
use inbox_test_support::worker::{eventually, spawn_worker};
use inbox_test_support::{spawn_app, TestApp, TestDb};
use serde_json::Value;

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

/// Sends `held` webhooks while a snapshot is held and waits until the worker has booked them;
/// then ends the snapshot and vacuums the queue table. Returns its indexes' size: what the
/// snapshot left in them.
async fn grow_the_queue_under_a_snapshot(app: &TestApp, client: &tokio_postgres::Client, held: i64) -> i64 {
    let reporting = hold_snapshot(&app.db, "webhook_inbox").await;
    for chunk in (0..held).collect::<Vec<_>>().chunks(50) {
        let replies =
            futures_util::future::join_all(chunk.iter().map(|i| {
                app.post_signed(invoice_paid(&format!("evt_held_{i}"), &format!("in_held_{i}"), 100))
            }))
            .await;
        assert!(replies.iter().all(|r| r.status == 200), "{replies:?}");
    }
    assert!(eventually(Duration::from_secs(60), || async { unprocessed(client).await == 0 }).await);
    reporting.batch_execute("COMMIT").await.unwrap();
    client.batch_execute("VACUUM webhook_inbox_queue").await.unwrap();
    queue_index_bytes(client).await
}

/// Webhooks sent ten at a time, each batch answered before the next, until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicI64>,
    task: tokio::task::JoinHandle<()>,
}

impl Load {
    /// Starts the load and returns once 100 webhooks were answered.
    async fn start(app: &Arc<TestApp>) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicI64::new(0));
        let task = tokio::spawn({
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
        let load = Load { stop, sent, task };
        assert!(eventually(Duration::from_secs(30), || async { load.sent() >= 100 }).await);
        load
    }

    /// Webhooks answered so far.
    fn sent(&self) -> i64 {
        self.sent.load(Ordering::SeqCst)
    }

    /// Waits until 100 more are answered (the service did not stay blocked), then stops the
    /// load; returns how many were answered in all.
    async fn finish(self) -> i64 {
        let during = self.sent();
        assert!(eventually(Duration::from_secs(30), || async { self.sent() >= during + 100 }).await);
        self.stop.store(true, Ordering::SeqCst);
        let sent = self.sent.clone();
        self.task.await.unwrap();
        sent.load(Ordering::SeqCst)
    }
}

/// Every event sent is stored and booked once, and the queue drains to empty (a row missing from
/// the queue table would never be claimed).
async fn every_event_booked_once(client: &tokio_postgres::Client, events: i64) {
    assert!(
        eventually(Duration::from_secs(60), || async { unprocessed(client).await == 0 }).await,
        "{} rows left unprocessed, {} in the queue",
        unprocessed(client).await,
        scalar(client, "SELECT count(*) FROM webhook_inbox_queue").await
    );
    assert_eq!(scalar(client, "SELECT count(*) FROM webhook_inbox").await, events);
    assert_eq!(scalar(client, "SELECT count(*) FROM ledger_entries").await, events, "each event booked once");
    assert_eq!(scalar(client, "SELECT count(*) FROM webhook_inbox_queue").await, 0);
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
    let grown = grow_the_queue_under_a_snapshot(&app, &client, HELD).await;

    // Webhooks keep coming while the runbook runs.
    let load = Load::start(&app).await;

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
    let sent = load.finish().await;

    assert!(
        rewritten * 4 < grown,
        "the queue table's indexes: {grown} bytes after the snapshot and a vacuum, {rewritten} after VACUUM FULL"
    );
    every_event_booked_once(&client, HELD + sent).await;
    worker.stop().await;
}

/// `inbox-worker reindex <args> --json` on `url`: its exit code, its report (stdout) and stderr.
async fn reindex(url: &str, args: &[&str]) -> (i32, Option<Value>, String) {
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", url).arg("reindex").args(args).arg("--json");
    let (code, stdout, stderr) = tokio::task::spawn_blocking(move || {
        inbox_test_support::process::run_split(cmd, Duration::from_secs(120))
    })
    .await
    .unwrap();
    (code, serde_json::from_str(&stdout).ok(), format!("{stdout}\n{stderr}"))
}

/// The report's entry for `index`.
fn entry<'a>(report: &'a Value, index: &str) -> &'a Value {
    report["indexes"]
        .as_array()
        .and_then(|all| all.iter().find(|i| i["index"] == index))
        .unwrap_or_else(|| panic!("no {index} in {report}"))
}

/// Invalid indexes on the queue tables: what an interrupted rebuild leaves.
async fn invalid_indexes(client: &tokio_postgres::Client) -> i64 {
    scalar(
        client,
        "SELECT count(*) FROM pg_index
          WHERE indrelid IN ('webhook_inbox_queue'::regclass, 'outbox'::regclass) AND NOT indisvalid",
    )
    .await
}

/// The same as the runbook's `VACUUM FULL`, without its exclusive lock: after a long snapshot,
/// `inbox-worker reindex` rebuilds the queue table's grown indexes with `REINDEX CONCURRENTLY`
/// while webhooks keep arriving and the worker keeps booking them. Its report says it rebuilt
/// them, the indexes are a fraction of their size, no copy is left behind, every event sent is
/// booked exactly once, and the queue still holds every waiting row (the drain finishes).
#[tokio::test]
async fn after_a_long_snapshot_reindex_rebuilds_the_grown_queue_indexes_under_load_and_loses_nothing() {
    let app = Arc::new(spawn_app().await);
    let client = app.db.client().await;
    let worker = spawn_worker(&app.db, Registry::with_invoice_handlers(), |s| {
        s.poll_interval = Duration::from_millis(100)
    })
    .await;
    // Three times as many as for VACUUM FULL: a concurrent rebuild runs beside the load, whose
    // rows enter the new index while it is built, so the snapshot must leave more than that.
    grow_the_queue_under_a_snapshot(&app, &client, 3 * HELD).await;
    let by_type_bytes = "SELECT pg_relation_size('webhook_inbox_queue_by_type')";
    let grown = scalar(&client, by_type_bytes).await;

    let load = Load::start(&app).await;
    // The test's indexes are far under the default --min-size.
    let (code, report, output) = reindex(&app.db.url(), &["--min-size", "0"]).await;
    assert_eq!(code, 0, "{output}");
    let report = report.unwrap();
    let by_type = entry(&report, "webhook_inbox_queue_by_type");
    assert_eq!(by_type["action"], "rebuilt", "{report}");
    // Its size right after its rebuild, as reindex read it then: the load goes on writing the
    // queue, and by the time reindex has also rebuilt the primary key, the index by type has grown
    // back by a few pages, as much as the test's snapshot left in it.
    let rebuilt = by_type["bytes_after"].as_i64().unwrap();
    let sent = load.finish().await;

    assert!(
        rebuilt * 4 < grown,
        "the queue's index by type: {grown} bytes after the snapshot and a vacuum, {rebuilt} after reindex: {report}"
    );
    assert_eq!(invalid_indexes(&client).await, 0, "a rebuild's copy left behind");
    every_event_booked_once(&client, 3 * HELD + sent).await;
    worker.stop().await;
}

/// While a snapshot is still held, a rebuild would copy every entry it keeps and wait for it:
/// `reindex` waits for it up to its `--lock-timeout` (once, not once per index), starts no
/// rebuild, says why and exits 1. A
/// writer holding the table keeps a rebuild from finishing: given up at the same timeout, its copy
/// left invalid is shown by `--dry-run`, which changes nothing, and dropped by the next run, which
/// then rebuilds the grown index; an index that has not grown is left alone. A second run while
/// one holds the reindex lock is refused.
#[tokio::test]
async fn reindex_starts_no_rebuild_under_a_held_snapshot_and_drops_what_an_interrupted_rebuild_left() {
    let db = TestDb::new().await;
    let client = db.client().await;
    // Stored, leased and processed 64 at a time, under a snapshot: dead entries in the queue
    // table's indexes that nothing may remove while it is held.
    let batch = "(provider, endpoint, event_id) IN (SELECT 'stripe', 'billing', 'evt_' || i FROM generate_series($1::int4, $2::int4) i)";
    let reporting = hold_snapshot(&db, "webhook_inbox").await;
    in_batches_of_64(
        &client,
        3000,
        &[
            "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload)
             SELECT 'stripe', 'billing', 'evt_' || i, 'invoice.paid', '{}' FROM generate_series($1::int4, $2::int4) i",
            &format!("UPDATE webhook_inbox SET available_at = now() + interval '30 s', attempts = 1 WHERE {batch}"),
            &format!("UPDATE webhook_inbox SET processed_at = now() WHERE {batch}"),
        ],
    )
    .await;
    client.batch_execute("ANALYZE webhook_inbox_queue, outbox").await.unwrap();
    let grown = scalar(&client, "SELECT pg_relation_size('webhook_inbox_queue_by_type')").await;

    // One run at a time: a second would take the first one's copy in the making for a leftover.
    let running = db.client().await;
    running
        .execute("SELECT pg_advisory_lock($1)", &[&inbox_domain::inbox::store::maintenance::REINDEX_LOCK_KEY])
        .await
        .unwrap();
    let (code, _, output) = reindex(&db.url(), &["--min-size", "0"]).await;
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("another reindex is running"), "{output}");
    drop(running);

    // While the snapshot is held: no rebuild is started (it would copy every entry the snapshot
    // keeps); the index is left as it was, with no copy beside it.
    let (code, report, output) = reindex(&db.url(), &["--min-size", "0", "--lock-timeout", "1s"]).await;
    assert_eq!(code, 1, "{output}");
    let report = report.unwrap();
    let by_type = entry(&report, "webhook_inbox_queue_by_type");
    assert_eq!(by_type["action"], "failed", "{report}");
    let reason = by_type["reason"].as_str().unwrap();
    assert!(reason.contains("has held a snapshot") && reason.contains("--lock-timeout (1s)"), "{report}");
    assert!(reason.contains("not started"), "{report}");
    // The next index is left without waiting for the same snapshot again.
    let pkey = entry(&report, "webhook_inbox_queue_pkey");
    assert_eq!(pkey["action"], "failed", "{report}");
    assert!(pkey["reason"].as_str().unwrap().contains("still holds, not waited for again"), "{report}");
    assert!(output.contains("run reindex again"), "{output}");
    assert_eq!(invalid_indexes(&client).await, 0, "no copy started");
    assert_eq!(
        scalar(&client, "SELECT pg_relation_size('webhook_inbox_queue_by_type')").await,
        grown,
        "the index is the one it was"
    );
    reporting.batch_execute("COMMIT").await.unwrap();

    // A transaction that holds the queue table (a writer stuck before its commit) keeps a rebuild
    // from finishing: it is given up at --lock-timeout, and its copy, which cannot be dropped while
    // that transaction holds the table either, is left for the next run.
    let stuck = db.client().await;
    stuck.batch_execute("BEGIN; LOCK webhook_inbox_queue IN ROW EXCLUSIVE MODE;").await.unwrap();
    let (code, report, output) = reindex(&db.url(), &["--min-size", "0", "--lock-timeout", "1s"]).await;
    assert_eq!(code, 1, "{output}");
    let report = report.unwrap();
    let reason = entry(&report, "webhook_inbox_queue_by_type")["reason"].as_str().unwrap().to_owned();
    assert!(reason.contains("waited longer than --lock-timeout (1s)"), "{report}");
    stuck.batch_execute("COMMIT").await.unwrap();
    let left = invalid_indexes(&client).await;
    assert!(left >= 1, "the copies of the rebuilds given up under the stuck writer: {report}");

    let (code, report, output) = reindex(&db.url(), &["--min-size", "0", "--dry-run"]).await;
    assert_eq!(code, 0, "{output}");
    let report = report.unwrap();
    assert_eq!(entry(&report, "webhook_inbox_queue_by_type_ccnew")["action"], "would_drop", "{report}");
    assert_eq!(entry(&report, "webhook_inbox_queue_by_type")["action"], "would_rebuild", "{report}");
    assert_eq!(invalid_indexes(&client).await, left, "a dry run changes nothing");

    let (code, report, output) = reindex(&db.url(), &["--min-size", "0"]).await;
    assert_eq!(code, 0, "{output}");
    let report = report.unwrap();
    assert_eq!(entry(&report, "webhook_inbox_queue_by_type_ccnew")["action"], "dropped", "{report}");
    assert_eq!(entry(&report, "webhook_inbox_queue_by_type")["action"], "rebuilt", "{report}");
    assert_eq!(entry(&report, "outbox_pkey")["action"], "left", "an empty outbox's index: {report}");
    assert_eq!(invalid_indexes(&client).await, 0);
    let rebuilt = scalar(&client, "SELECT pg_relation_size('webhook_inbox_queue_by_type')").await;
    assert!(rebuilt * 4 < grown, "{grown} bytes before, {rebuilt} after");
}

/// The statistics count an index's entries only when a vacuum or an analyse runs: a queue counted
/// while it was empty (or never, right after the migration) may hold a backlog of thousands of
/// rows since — the workers stopped, a burst — and its indexes are then dense, not grown. `reindex`
/// counts the entries of what the statistics would have it rebuild, and leaves such an index as it
/// is, saying how many it counted; the index counted by its partial predicate is the outbox's.
#[tokio::test]
async fn reindex_counts_a_backlog_the_statistics_missed_and_leaves_its_dense_indexes() {
    let db = TestDb::new().await;
    let client = db.client().await;
    // Counted empty, and no autovacuum to count them again during the test.
    client
        .batch_execute(
            "ALTER TABLE webhook_inbox_queue SET (autovacuum_enabled = off);
             ANALYZE webhook_inbox_queue;",
        )
        .await
        .unwrap();
    let counted = "SELECT reltuples::int8 FROM pg_class WHERE relname = 'webhook_inbox_queue_pkey'";
    assert_eq!(scalar(&client, counted).await, 0);
    // The backlog: stored, never claimed.
    const BACKLOG: i64 = 20_000;
    client
        .execute(
            "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload)
             SELECT 'stripe', 'billing', 'evt_' || i, 'invoice.paid', '{}' FROM generate_series(1, $1::int8) i",
            &[&BACKLOG],
        )
        .await
        .unwrap();
    let pkey_bytes = "SELECT pg_relation_size('webhook_inbox_queue_pkey')";
    let before = scalar(&client, pkey_bytes).await;
    assert!(before > 40 * 8192, "a backlog's index of many pages: {before} bytes");

    let (code, report, output) = reindex(&db.url(), &["--min-size", "0"]).await;
    assert_eq!(code, 0, "{output}");
    let report = report.unwrap();
    let pkey = entry(&report, "webhook_inbox_queue_pkey");
    assert_eq!(pkey["action"], "left", "{report}");
    assert_eq!(pkey["entries"], BACKLOG as f64, "{report}");
    assert_eq!(pkey["entries_counted"], true, "{report}");
    assert!(pkey["reason"].as_str().unwrap().contains("the size a rebuild would give it"), "{report}");
    // The index by type is left by the statistics alone (what it would give back is little beside
    // the table a rebuild reads): a verdict that leaves an index costs no count.
    let by_type = entry(&report, "webhook_inbox_queue_by_type");
    assert_eq!(by_type["action"], "left", "{report}");
    assert_eq!(by_type["entries_counted"], false, "{report}");
    assert_eq!(scalar(&client, pkey_bytes).await, before, "not rebuilt");
    assert_eq!(unprocessed(&client).await, BACKLOG, "the backlog is all still there");

    // The human report says the same.
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", db.url()).args(["reindex", "--min-size", "0", "--dry-run"]);
    let (code, output) =
        tokio::task::spawn_blocking(move || inbox_test_support::process::run(cmd, Duration::from_secs(60)))
            .await
            .unwrap();
    assert_eq!(code, 0, "{output}");
    assert!(output.contains("20000 (counted)"), "{output}");
    assert!(!output.contains("would_rebuild"), "{output}");
}
