//! `inbox-worker relay --to-nats` against Debian's nats-server with JetStream, as processes: rows
//! written while the relay runs are stored exactly once in the stream — one message per row,
//! `Nats-Msg-Id` = the outbox id, each aggregate's rows in id order — across a single server
//! SIGKILLed and restarted on its store, and across the leader of an R3 stream on a three-node
//! cluster SIGKILLed and brought back (which then catches up). Skipped, saying so, where
//! nats-server is not installed (`make deps` installs it).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use inbox_test_support::db::scalar;
use inbox_test_support::nats::{self, Nats};
use inbox_test_support::process::command;
use inbox_test_support::worker::eventually;
use inbox_test_support::TestDb;

use crate::relay::{start, write_outbox};

const SUBJECT: &str = "billing.outbox";
const STREAM: &str = "OUTBOX";
const AGGREGATES: usize = 25;

/// `inbox-worker relay --to-nats <urls>` with retries short enough for a test: a publish that
/// gets no ack in 2 s is retried 200 ms – 2 s later.
fn relay(db: &TestDb, urls: &str) -> std::process::Command {
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", db.url()).args([
        "relay",
        "--to-nats",
        urls,
        "--subject",
        SUBJECT,
        "--poll-interval",
        "100ms",
        "--delivery-timeout",
        "2s",
        "--backoff",
        "200ms",
        "--max-backoff",
        "2s",
    ]);
    cmd
}

/// Writes `count` rows from `from` on, spread over the aggregates, `per_batch` per transaction
/// every 50 ms, as handlers commit them while the relay runs.
async fn write_rows(url: String, from: usize, count: usize, per_batch: usize) {
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    for start in (from..from + count).step_by(per_batch) {
        for n in start..(start + per_batch).min(from + count) {
            write_outbox(&client, &format!("in_{}", n % AGGREGATES), "InvoicePaymentBooked", n as i64).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn published(client: &tokio_postgres::Client) -> i64 {
    scalar(client, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL").await
}

/// The stream against the table: one message per row and no other, each the row's payload with
/// its id as `Nats-Msg-Id`, each aggregate's messages in id order.
async fn assert_stored_exactly_once(js: &async_nats::jetstream::Context, client: &tokio_postgres::Client) {
    let rows =
        client.query("SELECT id, aggregate_id, payload::text FROM outbox ORDER BY id", &[]).await.unwrap();
    let stored = nats::stored(js, STREAM).await;
    let ids: BTreeSet<String> = rows.iter().map(|r| r.get::<_, i64>(0).to_string()).collect();
    let stored_ids: BTreeSet<String> = stored.iter().map(|m| m.msg_id.clone()).collect();
    assert_eq!(
        stored_ids.len(),
        stored.len(),
        "a row stored twice: {} messages, {} ids",
        stored.len(),
        stored_ids.len()
    );
    assert_eq!(stored_ids, ids, "the stream holds exactly the outbox");
    let mut by_aggregate: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    let payloads: BTreeMap<String, String> =
        rows.iter().map(|r| (r.get::<_, i64>(0).to_string(), r.get::<_, String>(2))).collect();
    for message in &stored {
        let sent: serde_json::Value = serde_json::from_slice(&message.payload).unwrap();
        let row: serde_json::Value = serde_json::from_str(&payloads[&message.msg_id]).unwrap();
        assert_eq!(sent, row, "message {} is its row", message.msg_id);
        assert!(message.fencing_token >= 1, "every message carries its claim's fencing token");
        by_aggregate.entry(message.aggregate_id.clone()).or_default().push(message.msg_id.parse().unwrap());
    }
    for (aggregate, ids) in &by_aggregate {
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "aggregate {aggregate} out of id order: {ids:?}");
    }
}

#[tokio::test]
async fn every_row_is_stored_once_in_jetstream_across_a_server_killed_and_restarted() {
    let Some(mut server) = tokio::task::spawn_blocking(Nats::single).await.unwrap() else {
        eprintln!("skipped: nats-server is not installed (make deps installs it)");
        return;
    };
    let js = nats::jetstream(&server.urls()).await;
    nats::create_stream(&js, STREAM, SUBJECT, 1).await;
    let db = TestDb::new().await;
    let client = db.client().await;
    write_rows(db.url(), 0, 200, 200).await;
    let relay = start(relay(&db, &server.urls())).await;
    let writer = tokio::spawn(write_rows(db.url(), 200, 400, 20));

    assert!(eventually(Duration::from_secs(30), || async { published(&client).await >= 150 }).await);
    server.kill(0);
    let at_kill = published(&client).await;
    assert!(at_kill < 600, "the server is killed mid-run: {at_kill} of 600 published");
    tokio::time::sleep(Duration::from_secs(1)).await;
    server.start_node(0);
    writer.await.unwrap();
    let all = eventually(Duration::from_secs(60), || async { published(&client).await == 600 }).await;
    assert!(all, "{} of 600 published\n{}\n{}", published(&client).await, relay.output(), server.logs());
    assert_stored_exactly_once(&js, &client).await;
    drop(relay);
}

#[tokio::test]
async fn every_row_is_stored_once_in_an_r3_stream_while_its_leader_is_killed_and_brought_back() {
    let Some(mut cluster) = tokio::task::spawn_blocking(|| Nats::cluster(3)).await.unwrap() else {
        eprintln!("skipped: nats-server is not installed (make deps installs it)");
        return;
    };
    let js = nats::jetstream(&cluster.urls()).await;
    nats::create_stream(&js, STREAM, SUBJECT, 3).await;
    let db = TestDb::new().await;
    let client = db.client().await;
    write_rows(db.url(), 0, 200, 200).await;
    let relay = start(relay(&db, &cluster.urls())).await;
    let writer = tokio::spawn(write_rows(db.url(), 200, 400, 20));

    assert!(eventually(Duration::from_secs(30), || async { published(&client).await >= 150 }).await);
    let mut stream = js.get_stream(STREAM).await.unwrap();
    let leader =
        stream.info().await.unwrap().cluster.clone().and_then(|c| c.leader).expect("a stream leader");
    let node = (0..3).find(|&i| cluster.name(i) == leader).expect("the leader is one of ours");
    cluster.kill(node);
    let at_kill = published(&client).await;
    assert!(at_kill < 600, "the leader is killed mid-run: {at_kill} of 600 published");
    tokio::time::sleep(Duration::from_secs(3)).await;
    cluster.start_node(node);
    writer.await.unwrap();
    let all = eventually(Duration::from_secs(90), || async { published(&client).await == 600 }).await;
    assert!(all, "{} of 600 published\n{}\n{}", published(&client).await, relay.output(), cluster.logs());
    assert_stored_exactly_once(&js, &client).await;

    // The node brought back catches up: every replica current, none offline.
    let caught_up = eventually(Duration::from_secs(30), || async {
        let Ok(mut stream) = js.get_stream(STREAM).await else { return false };
        let Ok(info) = stream.info().await else { return false };
        let cluster = info.cluster.clone().unwrap_or_default();
        cluster.replicas.len() == 2 && cluster.replicas.iter().all(|p| p.current && !p.offline)
    })
    .await;
    assert!(caught_up, "the R3 stream's replicas did not catch up\n{}", cluster.logs());
    drop(relay);
}
