//! Group commit in the ingest: concurrent requests share one INSERT, each answered after its
//! commit; duplicates inside a batch, a failing batch and one bad payload in a batch.

use std::time::Duration;

use inbox_ingest::configuration::Settings;
use inbox_test_support::app::concurrent_posts;
use inbox_test_support::db::scalar;
use inbox_test_support::events::{invoice_paid, sign, SECRET_A};
use inbox_test_support::worker::eventually;
use inbox_test_support::{spawn_app_with, TestApp, TestDb};

/// An ingest with one batch writer whose every INSERT takes 300 ms (plus `extra` SQL in the
/// statement trigger), so concurrent requests queue up behind it and form batches.
async fn slow_single_writer(extra: &str) -> TestApp {
    let db = TestDb::new().await;
    db.client()
        .await
        .batch_execute(&format!(
            "CREATE FUNCTION slow_batch() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN PERFORM pg_sleep(0.3); {extra} RETURN NULL; END $$;
             CREATE TRIGGER slow_batch BEFORE INSERT ON webhook_inbox FOR EACH STATEMENT EXECUTE FUNCTION slow_batch();"
        ))
        .await
        .unwrap();
    spawn_app_with(db, |s| {
        s.pool_size = 3;
        s.db_timeout = Duration::from_secs(10);
        s.max_body = 1 << 20;
    })
    .await
}

/// (batches, requests) written so far, from the batch-size histogram.
async fn batches(app: &TestApp) -> (f64, f64) {
    let text = app.get("/metrics").await.text;
    let value = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (value("inbox_ingest_batch_size_count"), value("inbox_ingest_batch_size_sum"))
}

fn signed(body: Vec<u8>) -> (String, String, Vec<u8>) {
    ("billing".to_owned(), sign(SECRET_A, &body), body)
}

#[test]
fn concurrent_requests_share_batches_and_duplicates_inside_a_batch_are_answered_as_such() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let app = rt.block_on(slow_single_writer(""));
    let mut requests: Vec<_> = (0..8).map(|i| signed(invoice_paid(&format!("evt_{i}"), "in_1", 1))).collect();
    requests.extend((0..8).map(|_| signed(invoice_paid("evt_same", "in_2", 1))));
    let replies = concurrent_posts(&app.address, requests);
    assert!(replies.iter().all(|r| r.status == 200), "{replies:?}");
    let accepted = |range: std::ops::Range<usize>| {
        replies[range].iter().filter(|r| r.body["status"] == "accepted").count()
    };
    assert_eq!(accepted(0..8), 8);
    assert_eq!(accepted(8..16), 1, "one of the eight copies is new, seven are duplicates");
    assert_eq!(rt.block_on(app.inbox_rows()), 9);
    let (count, sum) = rt.block_on(batches(&app));
    assert_eq!(sum, 16.0);
    assert!(count < 16.0, "requests were coalesced: {count} batches for 16 requests");
}

#[test]
fn a_failing_batch_answers_503_to_each_of_its_requests() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let app = rt.block_on(slow_single_writer("RAISE EXCEPTION 'disk full, say';"));
    let requests: Vec<_> = (0..8).map(|i| signed(invoice_paid(&format!("evt_{i}"), "in_1", 1))).collect();
    let replies = concurrent_posts(&app.address, requests);
    assert!(replies.iter().all(|r| r.status == 503), "{replies:?}");
    assert_eq!(rt.block_on(app.inbox_rows()), 0);
    let (count, sum) = rt.block_on(batches(&app));
    assert!(count < sum, "the failure hit batches, not single requests: {count} batches, {sum} requests");
}

/// One poison request — a body `jsonb` refuses for its data (a NUL escape, class 22) or for its
/// depth (the server's stack, 54001) — in a batch: every other request is 200 and stored, and
/// the poison is kept too (held as unstorable), not 400 nor 503 on every retry.
#[test]
fn one_poison_request_in_a_batch_leaves_its_batch_mates_200_and_is_kept_itself() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let app = rt.block_on(slow_single_writer(""));
    let deep = format!(
        r#"{{"id":"evt_deep","type":"invoice.paid","data":{}{}}}"#,
        "[".repeat(50_000),
        "]".repeat(50_000)
    );
    for poison in [br#"{"id":"evt_nul","type":"invoice.paid","data":"\u0000"}"#.to_vec(), deep.into_bytes()] {
        rt.block_on(async { app.db.client().await.batch_execute("TRUNCATE webhook_inbox").await.unwrap() });
        let mut requests: Vec<_> =
            (0..15).map(|i| signed(invoice_paid(&format!("evt_{i}"), "in_1", 1))).collect();
        requests.insert(7, signed(poison));
        let replies = concurrent_posts(&app.address, requests);
        assert!(replies.iter().all(|r| r.status == 200), "{replies:?}");
        assert_eq!(rt.block_on(app.inbox_rows()), 16);
        let held = rt.block_on(async {
            inbox_test_support::db::scalar(
                &app.db.client().await,
                "SELECT count(*) FROM webhook_inbox WHERE held = 'unstorable'",
            )
            .await
        });
        assert_eq!(held, 1);
    }
    let (count, sum) = rt.block_on(batches(&app));
    assert!(count < sum, "the poison shared batches with others: {count} batches, {sum} requests");
}

/// An ingest with four batch writers whose every INSERT takes 300 ms; each committed batch is
/// logged with its statement's start, end and row count in `batch_log`. `adjust` changes the
/// settings further.
async fn slow_writers_with_log(adjust: impl FnOnce(&mut Settings)) -> TestApp {
    writers_with_log("PERFORM pg_sleep(0.3);", adjust).await
}

/// An ingest with four batch writers whose every INSERT first runs `wait` (PL/pgSQL) in a
/// statement trigger; each committed batch is logged in `batch_log` with its statement's start,
/// end, row count and backend. The table `gate` is there for `wait` to lock.
async fn writers_with_log(wait: &str, adjust: impl FnOnce(&mut Settings)) -> TestApp {
    let db = TestDb::new().await;
    db.client()
        .await
        .batch_execute(&format!(
            "CREATE TABLE gate ();
             CREATE TABLE batch_log (started timestamptz, ended timestamptz, rows bigint, backend int);
             CREATE FUNCTION wait_batch() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN {wait} RETURN NULL; END $$;
             CREATE TRIGGER wait_batch BEFORE INSERT ON webhook_inbox FOR EACH STATEMENT EXECUTE FUNCTION wait_batch();
             CREATE FUNCTION log_batch() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN INSERT INTO batch_log
                        SELECT statement_timestamp(), clock_timestamp(), count(*), pg_backend_pid() FROM new_rows;
                        RETURN NULL; END $$;
             CREATE TRIGGER log_batch AFTER INSERT ON webhook_inbox REFERENCING NEW TABLE AS new_rows
               FOR EACH STATEMENT EXECUTE FUNCTION log_batch();",
        ))
        .await
        .unwrap();
    spawn_app_with(db, |s| {
        s.pool_size = 6; // four writers
        s.db_timeout = Duration::from_secs(10);
        adjust(s);
    })
    .await
}

/// Sends one request in the background and returns once its batch is being written.
fn first_batch_in_flight(
    rt: &tokio::runtime::Runtime,
    app: &TestApp,
) -> std::thread::JoinHandle<Vec<inbox_test_support::app::Reply>> {
    let address = app.address.clone();
    let first = std::thread::spawn(move || {
        concurrent_posts(&address, vec![signed(invoice_paid("evt_first", "in_0", 1))])
    });
    rt.block_on(async {
        let client = app.db.client().await;
        let started =
            eventually(Duration::from_secs(5), || async { scalar(&client, INSERTING).await > 0 }).await;
        assert!(started, "the first request's batch never started");
    });
    first
}

/// How many of the ingest's inserts are running now.
const INSERTING: &str = "SELECT count(*) FROM pg_stat_activity
                          WHERE datname = current_database() AND state = 'active'
                            AND query LIKE 'INSERT INTO webhook_inbox%'";

/// (rows, overlaps the previous batch) of each committed batch, in order of start.
async fn batch_log(app: &TestApp) -> Vec<(i64, bool)> {
    batch_log_with_backends(app).await.into_iter().map(|(rows, overlaps, _)| (rows, overlaps)).collect()
}

/// (rows, overlaps the previous batch, backend's pid) of each committed batch, in order of start.
async fn batch_log_with_backends(app: &TestApp) -> Vec<(i64, bool, i32)> {
    app.db
        .client()
        .await
        .query(
            "SELECT rows, started < lag(ended) OVER (ORDER BY started) IS TRUE, backend
               FROM batch_log ORDER BY started",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

/// A few requests arriving while a batch is written wait for its commit and share the next one,
/// although three writers are idle: a commit per request would cost the database more.
#[test]
fn a_few_requests_behind_a_batch_in_flight_wait_and_share_the_next_batch() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let app = rt.block_on(slow_writers_with_log(|_| {}));
    let first = first_batch_in_flight(&rt, &app);
    let wave: Vec<_> = (0..3).map(|i| signed(invoice_paid(&format!("evt_{i}"), "in_1", 1))).collect();
    let replies = concurrent_posts(&app.address, wave);
    assert!(replies.iter().chain(&first.join().unwrap()).all(|r| r.status == 200), "{replies:?}");
    assert_eq!(rt.block_on(batch_log(&app)), [(1, false), (3, false)]);
}

/// As many requests as make a batch worth its own commit (`JOIN_AT`) form a batch while the first
/// is in flight, and it is sent at once behind the first on the same connection: one backend runs
/// both, one after the other, instead of two extending the table side by side.
#[test]
fn enough_requests_behind_a_batch_in_flight_are_sent_behind_it_on_the_same_connection() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    // Every batch waits for the gate, which the test holds locked until it has looked.
    let app = rt.block_on(writers_with_log("LOCK TABLE gate IN ACCESS SHARE MODE;", |_| {}));
    let (gate, observer) = rt.block_on(async {
        let gate = app.db.client().await;
        gate.batch_execute("BEGIN; LOCK TABLE gate IN ACCESS EXCLUSIVE MODE").await.unwrap();
        // Outside the gate's transaction, which would keep its first view of pg_stat_activity.
        (gate, app.db.client().await)
    });
    let first = first_batch_in_flight(&rt, &app);
    let n = inbox_ingest::batcher::JOIN_AT + 2;
    let wave: Vec<_> = (0..n).map(|i| signed(invoice_paid(&format!("evt_{i}"), "in_1", 1))).collect();
    let address = app.address.clone();
    let wave = std::thread::spawn(move || concurrent_posts(&address, wave));
    rt.block_on(async {
        let sent = eventually(Duration::from_secs(5), || async { batches(&app).await.0 >= 2.0 }).await;
        assert!(sent, "no second batch while the first waits: {:?}", batches(&app).await);
        assert_eq!(scalar(&observer, INSERTING).await, 1, "the second batch went to a connection of its own");
        gate.batch_execute("COMMIT").await.unwrap();
    });
    let replies: Vec<_> = first.join().unwrap().into_iter().chain(wave.join().unwrap()).collect();
    assert!(replies.iter().all(|r| r.status == 200 && r.body["status"] == "accepted"), "{replies:?}");
    let log = rt.block_on(batch_log_with_backends(&app));
    assert_eq!(log.iter().map(|b| b.0).sum::<i64>(), n as i64 + 1, "{log:?}");
    assert_eq!(log[0].0, 1, "{log:?}");
    assert!(log[1].0 >= inbox_ingest::batcher::JOIN_AT as i64, "{log:?}");
    assert!(log.iter().all(|b| !b.1 && b.2 == log[0].2), "one backend, one batch after another: {log:?}");
}

/// Room for the bytes of one payload and no more.
fn room_for_one(body: &[u8]) -> u64 {
    body.len() as u64 * 3 / 2
}

/// What bounds the ingest's memory is the payload bytes waiting for their commit, not a count of
/// requests: with room for one payload, requests arriving together are written one at a time,
/// each waiting for the previous commit to give its bytes back — and every one is stored.
#[test]
fn payload_bytes_waiting_for_a_commit_are_bounded_and_the_requests_past_the_bound_wait_their_turn() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let body = invoice_paid("evt_0", "in_1", 1);
    let app = rt.block_on(slow_writers_with_log(|s| s.max_bytes_in_flight = room_for_one(&body)));
    let wave: Vec<_> = (0..6).map(|i| signed(invoice_paid(&format!("evt_{i}"), "in_1", 1))).collect();
    let replies = concurrent_posts(&app.address, wave);
    assert!(replies.iter().all(|r| r.status == 200 && r.body["status"] == "accepted"), "{replies:?}");
    assert_eq!(rt.block_on(batch_log(&app)), [(1, false); 6], "one payload in flight at a time");
}

/// A request still waiting for room when its database timeout passes is answered 503 in time
/// (Stripe retries) and leaves nothing half-stored: every retry ends with the event stored once.
#[test]
fn a_request_that_gets_no_room_in_time_is_503_and_its_retry_is_stored_once() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let body = invoice_paid("evt_0", "in_1", 1);
    let app = rt.block_on(slow_writers_with_log(|s| {
        s.max_bytes_in_flight = room_for_one(&body);
        s.db_timeout = Duration::from_secs(1);
    }));
    let events: Vec<_> = (0..8).map(|i| invoice_paid(&format!("evt_{i}"), "in_1", 1)).collect();
    let started = std::time::Instant::now();
    let replies = concurrent_posts(&app.address, events.iter().cloned().map(signed).collect());
    assert!(started.elapsed() < Duration::from_secs(3), "answers took {:?}", started.elapsed());
    let refused = replies.iter().filter(|r| r.status == 503).count();
    assert!(refused >= 4, "8 payloads × 300 ms one at a time cannot fit 1 s: {replies:?}");
    assert!(replies.iter().all(|r| r.status == 200 || r.status == 503), "{replies:?}");
    rt.block_on(async {
        for (event, reply) in events.into_iter().zip(&replies) {
            if reply.status == 503 {
                let retry = app.post_signed(event).await;
                assert_eq!(retry.status, 200, "{}", retry.text);
            }
        }
        assert_eq!(app.inbox_rows().await, 8);
    });
}
