//! `inbox-worker relay` to an HTTP receiver, as processes: what the handlers commit reaches the
//! receiver signed as Standard Webhooks define (checked with the reference library, not our own
//! code), once per claim, marked published; a relay that lost its lease never marks a row another
//! relay delivered; an aggregate's rows arrive in id order and a parked row holds back only its
//! own aggregate; the receiver's Retry-After and 410 are honoured; configuration mistakes are
//! refused at start without echoing a secret.

use std::collections::HashMap;
use std::time::Duration;

use base64::Engine as _;
use inbox_domain::db::Pooler;
use inbox_test_support::db::{explain_rolled_back, hold_snapshot, scalar, timestamptz_literal};
use inbox_test_support::events::invoice_paid;
use inbox_test_support::process::{command, run, Proc};
use inbox_test_support::receiver::{Receiver, Reply};
use inbox_test_support::worker::{eventually, store_event};
use inbox_test_support::TestDb;
use serde_json::Value;

const TIMEOUT: Duration = Duration::from_secs(30);

/// A Standard Webhooks secret: whsec_ and the base64 of 32 bytes.
fn secret(byte: u8) -> String {
    format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode([byte; 32]))
}

/// `inbox-worker relay --to-url <receiver>` on `db`, signing with `secret`, polling every 100 ms.
fn relay(db: &TestDb, url: &str, secret: &str, flags: &[&str]) -> std::process::Command {
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", db.url())
        .env("INBOX_RELAY_SECRET", secret)
        .args(["relay", "--to-url", url, "--poll-interval", "100ms"])
        .args(flags);
    cmd
}

pub(crate) async fn start(cmd: std::process::Command) -> Proc {
    tokio::task::spawn_blocking(move || {
        let proc = Proc::spawn(cmd);
        proc.wait_for_line("inbox-relay running", TIMEOUT);
        proc
    })
    .await
    .unwrap()
}

/// An outbox row as a handler writes it; returns its id.
pub(crate) async fn write_outbox(
    client: &tokio_postgres::Client,
    aggregate_id: &str,
    event_type: &str,
    n: i64,
) -> i64 {
    client
        .query_one(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('Invoice', $1, $2, jsonb_build_object('invoice_id', $1::text, 'n', $3::int8))
             RETURNING id",
            &[&aggregate_id, &event_type, &n],
        )
        .await
        .unwrap()
        .get(0)
}

async fn unpublished(client: &tokio_postgres::Client) -> i64 {
    scalar(client, "SELECT count(*) FROM outbox WHERE published_at IS NULL").await
}

/// The deliveries verified with the Standard Webhooks reference library (PyPI `standardwebhooks`,
/// installed by scripts/ci-deps.sh into target/python-deps): (verified, failed). None, saying so,
/// where it is not installed.
fn verify_with_reference_library(deliveries: &[Value], secret: &str) -> Option<(u64, u64)> {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let deps = format!("{root}/target/python-deps");
    if !std::path::Path::new(&deps).join("standardwebhooks").is_dir() {
        eprintln!(
            "skipped the reference verification: standardwebhooks is not installed (scripts/ci-deps.sh)"
        );
        return None;
    }
    let mut child = std::process::Command::new("python3")
        .arg(format!("{root}/tests/fixtures/verify_standard_webhooks.py"))
        .arg(secret)
        .env("PYTHONPATH", deps)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3");
    serde_json::to_writer(child.stdin.take().unwrap(), deliveries).unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stdout));
    let report: Value = serde_json::from_slice(&output.stdout).unwrap();
    Some((report["verified"].as_u64().unwrap(), report["failed"].as_u64().unwrap()))
}

#[tokio::test]
async fn what_the_handlers_commit_reaches_the_receiver_signed_and_is_marked_published() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let receiver = Receiver::start(false).await;
    for i in 0..20 {
        store_event(&client, "billing", &invoice_paid(&format!("evt_{i}"), &format!("in_{i}"), 100 + i))
            .await;
    }
    let mut worker = command("inbox-worker");
    worker.env("DATABASE_URL", db.url()).args(["run", "--poll-interval", "100ms"]);
    let worker = tokio::task::spawn_blocking(move || Proc::spawn(worker)).await.unwrap();
    let (old, new) = (secret(1), secret(2));
    let relay = start(relay(&db, &receiver.url, &format!("{new},{old}"), &[])).await;

    let all_published = eventually(TIMEOUT, || async {
        scalar(&client, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL").await == 20
    })
    .await;
    assert!(all_published, "{}\n{}", worker.output(), relay.output());
    let accepted = receiver.accepted();
    assert_eq!(accepted.len(), 20, "each row once: {accepted:?}");

    // Each delivery is its row: the id, the payload, the event, the first claim's token.
    let rows = client
        .query("SELECT id, aggregate_id, event_type, payload::text, fencing_token, attempts FROM outbox", &[])
        .await
        .unwrap();
    let by_id: HashMap<String, _> = accepted.iter().map(|d| (d.id.clone(), d)).collect();
    for row in &rows {
        let id: i64 = row.get(0);
        let delivery = by_id.get(&id.to_string()).unwrap_or_else(|| panic!("row {id} not delivered"));
        let sent: Value = serde_json::from_slice(&delivery.body).unwrap();
        let stored: Value = serde_json::from_str(row.get::<_, &str>(3)).unwrap();
        assert_eq!(sent, stored);
        assert_eq!(sent["currency"], "jpy", "the booking says its currency: {sent}");
        assert_eq!((delivery.event_type.as_str(), delivery.aggregate_type.as_str()), (row.get(2), "Invoice"));
        assert_eq!(delivery.aggregate_id, row.get::<_, String>(1));
        assert_eq!((delivery.fencing_token, row.get::<_, i64>(4), row.get::<_, i32>(5)), (1, 1, 1));
        assert_eq!(delivery.signature.split(' ').count(), 2, "one signature per secret of the rotation");
    }

    // The reference library verifies every delivery with either secret of the rotation, and none
    // with a secret the relay does not have.
    let documents: Vec<Value> = accepted.iter().map(|d| d.to_json()).collect();
    if let Some(verified) = verify_with_reference_library(&documents, &old) {
        assert_eq!(verified, (20, 0));
        assert_eq!(verify_with_reference_library(&documents, &new), Some((20, 0)));
        assert_eq!(verify_with_reference_library(&documents, &secret(3)), Some((0, 20)));
    }
    drop((worker, relay));
}

/// A relay frozen (SIGSTOP) after the receiver got its request and before it could mark the row
/// loses its lease; a second relay claims the row (the next fencing token), delivers and marks it.
/// Resumed, the first relay's mark — or its failure record — is fenced out: the row stays as the
/// second relay left it.
#[tokio::test]
async fn a_relay_that_lost_its_lease_never_marks_or_fails_the_row_another_relay_delivered() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let receiver = Receiver::start(false).await;
    // The first request is answered after 1.5 s: time to freeze its relay with the answer pending.
    receiver.script(|_, before| Reply {
        delay: if before == 0 { Duration::from_millis(1500) } else { Duration::ZERO },
        ..Reply::ok()
    });
    let id = write_outbox(&client, "in_fenced", "InvoicePaymentBooked", 1).await;
    let flags = ["--lease", "2s", "--delivery-timeout", "1s"];
    let key = secret(1);
    let first = start(relay(&db, &receiver.url, &key, &flags)).await;
    assert!(receiver.wait_for(1, TIMEOUT).await, "{}", first.output());
    first.signal(libc::SIGSTOP);

    // Past the first lease: the second relay takes the row with the next token.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let second = start(relay(&db, &receiver.url, &key, &flags)).await;
    let published = eventually(TIMEOUT, || async {
        scalar(&client, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL").await == 1
    })
    .await;
    assert!(published, "{}", second.output());
    first.signal(libc::SIGCONT);
    // Resumed, the first relay tries to record its outcome and says it was not recorded.
    let said =
        |output: &str| output.contains("\"outcome\":\"superseded\"") || output.contains("\"recorded\":false");
    let fenced = eventually(TIMEOUT, || async { said(&first.output()) }).await;

    let row = client
        .query_one(
            "SELECT attempts, fencing_token, last_error, published_at IS NOT NULL FROM outbox WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i32>(0), 2, "two claims");
    assert_eq!(row.get::<_, i64>(1), 2, "the second claim's token");
    assert_eq!(row.get::<_, Option<String>>(2), None, "the first relay's late outcome was fenced out");
    assert!(row.get::<_, bool>(3));
    let tokens: Vec<i64> = receiver.deliveries().iter().map(|d| d.fencing_token).collect();
    assert_eq!(tokens, [1, 2], "each claim delivered once, with its own token");
    assert!(fenced, "the first relay says its outcome was not recorded:\n{}", first.output());
    drop((first, second));
}

#[tokio::test]
async fn an_aggregates_rows_arrive_in_order_and_a_parked_row_holds_back_only_its_own_aggregate() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let receiver = Receiver::start(false).await;
    let refuse = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let refusing = refuse.clone();
    // The first row of aggregate A is refused with 500 while `refuse` holds.
    receiver.script(move |d, _| {
        let n = serde_json::from_slice::<Value>(&d.body).ok().and_then(|b| b["n"].as_i64());
        if d.aggregate_id == "in_A" && n == Some(1) && refusing.load(std::sync::atomic::Ordering::SeqCst) {
            Reply::status(500)
        } else {
            Reply::ok()
        }
    });
    let mut ids = Vec::new();
    for (aggregate, n) in [("in_A", 1), ("in_B", 1), ("in_A", 2), ("in_B", 2), ("in_A", 3), ("in_B", 3)] {
        ids.push(write_outbox(&client, aggregate, "InvoiceChanged", n).await);
    }
    let flags = ["--max-attempts", "2", "--backoff", "100ms", "--max-backoff", "200ms"];
    let relay = start(relay(&db, &receiver.url, &secret(1), &flags)).await;

    // B's rows arrive, in order; A's first row parks after two attempts and A's others wait.
    let parked = eventually(TIMEOUT, || async {
        scalar(&client, "SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL").await == 1
            && scalar(&client, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL").await == 3
    })
    .await;
    assert!(parked, "{}", relay.output());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let order = |aggregate: &str| -> Vec<i64> {
        receiver
            .accepted()
            .iter()
            .filter(|d| d.aggregate_id == aggregate)
            .map(|d| d.id.parse().unwrap())
            .collect()
    };
    assert_eq!(order("in_B"), [ids[1], ids[3], ids[5]]);
    assert_eq!(order("in_A"), Vec::<i64>::new(), "nothing of A passes its parked first row");
    let a_attempts: Vec<i64> = receiver
        .deliveries()
        .iter()
        .filter(|d| d.aggregate_id == "in_A")
        .map(|d| d.id.parse().unwrap())
        .collect();
    assert_eq!(a_attempts, [ids[0], ids[0]], "A's later rows were never sent");

    // stats and needs-review --outbox say which row blocks which aggregate.
    let stats = json(&db, &["stats", "--json"]).await;
    assert_eq!(stats["outbox"]["parked"], 1, "{stats}");
    assert_eq!(stats["outbox"]["blocked_aggregates"], 1, "{stats}");
    assert_eq!(stats["outbox"]["blocked_rows"], 2, "{stats}");
    let review = json(&db, &["needs-review", "--outbox", "--json"]).await;
    assert_eq!(review["count"], 1, "{review}");
    let parked_row = &review["rows"][0];
    assert_eq!((parked_row["id"].as_i64(), parked_row["held_behind"].as_i64()), (Some(ids[0]), Some(2)));
    assert!(parked_row["last_error"].as_str().unwrap().contains("500"), "{parked_row}");

    // Requeued once the receiver takes it: A's rows follow in order.
    refuse.store(false, std::sync::atomic::Ordering::SeqCst);
    let report = json(&db, &["requeue", "--outbox", "--id", &ids[0].to_string(), "--json"]).await;
    assert_eq!(report["requeued"], 1, "{report}");
    let done = eventually(TIMEOUT, || async { unpublished(&client).await == 0 }).await;
    assert!(done, "{}", relay.output());
    assert_eq!(order("in_A"), [ids[0], ids[2], ids[4]]);
    let audit = scalar(&client, "SELECT count(*) FROM operator_audit WHERE action = 'requeue-outbox'").await;
    assert_eq!(audit, 1);
    drop(relay);
}

#[tokio::test]
async fn retry_after_is_honoured_and_410_parks_the_row_at_once() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let receiver = Receiver::start(false).await;
    receiver.script(|d, before| match (d.aggregate_id.as_str(), before) {
        ("in_busy", 0) => Reply { retry_after: Some("3".into()), ..Reply::status(429) },
        ("in_gone", _) => Reply::status(410),
        _ => Reply::ok(),
    });
    let busy = write_outbox(&client, "in_busy", "InvoiceChanged", 1).await;
    let gone = write_outbox(&client, "in_gone", "InvoiceChanged", 1).await;
    let relay = start(relay(&db, &receiver.url, &secret(1), &["--backoff", "100ms"])).await;

    let settled = eventually(TIMEOUT, || async {
        scalar(&client, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL OR parked_at IS NOT NULL")
            .await
            == 2
    })
    .await;
    assert!(settled, "{}", relay.output());
    let busy_attempts: Vec<_> =
        receiver.deliveries().into_iter().filter(|d| d.aggregate_id == "in_busy").collect();
    assert_eq!(busy_attempts.len(), 2, "{busy_attempts:?}");
    let waited = busy_attempts[1].at - busy_attempts[0].at;
    assert!(
        waited >= Duration::from_millis(2900),
        "Retry-After: 3 honoured over a 100ms backoff: {waited:?}"
    );
    let row = client
        .query_one("SELECT attempts, parked_at IS NOT NULL, last_error FROM outbox WHERE id = $1", &[&gone])
        .await
        .unwrap();
    assert_eq!((row.get::<_, i32>(0), row.get::<_, bool>(1)), (1, true), "410: parked at the first attempt");
    assert!(row.get::<_, String>(2).contains("410"), "{:?}", row.get::<_, String>(2));
    assert_eq!(
        scalar(
            &client,
            &format!("SELECT count(*) FROM outbox WHERE id = {busy} AND published_at IS NOT NULL")
        )
        .await,
        1
    );
    drop(relay);
}

#[tokio::test]
async fn relay_configuration_mistakes_are_refused_at_start_naming_the_fix_never_the_secret() {
    let db = TestDb::new().await;
    let url = "http://127.0.0.1:9/hooks";
    // (environment, arguments, what the refusal must say)
    type Case<'a> = (Vec<(&'a str, String)>, Vec<&'a str>, &'a str);
    let cases: Vec<Case> = vec![
        (vec![], vec!["relay", "--to-url", url], "needs a signing secret"),
        (
            vec![("INBOX_RELAY_SECRET", "sk_live_hunter2hunter2".into())],
            vec!["relay", "--to-url", url],
            "whsec_",
        ),
        (
            vec![("INBOX_RELAY_SECRET", "whsec_hunter2!!".into())],
            vec!["relay", "--to-url", url],
            "not base64",
        ),
        (
            vec![("INBOX_RELAY_SECRET", secret(1))],
            vec!["relay", "--to-url", url, "--delivery-timeout", "2m", "--lease", "2m"],
            "at most half of --lease",
        ),
        (vec![], vec!["relay", "--to-nats", "nats://127.0.0.1:9"], "--subject"),
        (
            vec![("INBOX_RELAY_SECRET", secret(1))],
            vec!["relay", "--to-url", "ftp://x/hooks"],
            "http:// or https://",
        ),
    ];
    for (env, args, expected) in cases {
        let mut cmd = command("inbox-worker");
        cmd.env("DATABASE_URL", db.url()).args(&args);
        for (k, v) in &env {
            cmd.env(k, v);
        }
        let (code, output) = tokio::task::spawn_blocking(move || run(cmd, TIMEOUT)).await.unwrap();
        assert_ne!(code, 0, "{args:?}: {output}");
        assert!(output.contains(expected), "{args:?}: expected {expected:?} in:\n{output}");
        assert!(!output.contains("hunter2"), "a secret echoed: {output}");
    }
}

/// Runs an inbox-worker command that must succeed and parses its stdout.
async fn json(db: &TestDb, args: &[&str]) -> Value {
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", db.url()).env("USER", "tester").args(args);
    let output = tokio::task::spawn_blocking(move || cmd.output()).await.unwrap().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{args:?}: {stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// SIGTERM while deliveries are in flight (the receiver answers after 1.5 s): the relay claims
/// nothing more, lets them finish, marks them published and exits 0; the rows it had not claimed
/// stay for the next relay, untouched (no attempt counted).
#[tokio::test]
async fn sigterm_lets_deliveries_in_flight_finish_and_marks_them_before_exiting() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let receiver = Receiver::start(false).await;
    receiver.script(|_, _| Reply { delay: Duration::from_millis(1500), ..Reply::ok() });
    for i in 0..10 {
        write_outbox(&client, &format!("in_term_{i}"), "InvoicePaymentBooked", i).await;
    }
    // Ten places: the ten rows are claimed and in flight at once.
    let mut relay = start(relay(&db, &receiver.url, &secret(1), &["--concurrency", "10"])).await;
    assert!(receiver.wait_for(10, TIMEOUT).await, "{}", relay.output());
    // Written after the claim: no relay has taken them.
    for i in 10..15 {
        write_outbox(&client, &format!("in_term_{i}"), "InvoicePaymentBooked", i).await;
    }
    relay.signal(libc::SIGTERM);
    let status = tokio::task::spawn_blocking(move || {
        let status = relay.wait(TIMEOUT);
        (status, relay)
    })
    .await
    .unwrap();
    let (status, relay) = status;
    assert!(status.success(), "exit 0 after SIGTERM: {status}\n{}", relay.output());
    assert!(relay.output().contains("inbox-relay stopped"), "{}", relay.output());
    assert_eq!(receiver.accepted().len(), 10, "nothing delivered after SIGTERM");
    let rows =
        client.query("SELECT published_at IS NOT NULL, attempts FROM outbox ORDER BY id", &[]).await.unwrap();
    let states: Vec<(bool, i32)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let mut expected = vec![(true, 1); 10];
    expected.extend(vec![(false, 0); 5]);
    assert_eq!(states, expected, "the ten in flight marked published; the five later rows untouched");
}

/// A receiver that answers 200 with a body (here 32 KiB) keeps serving on the connection the
/// relay opened: the relay reads the answer before reusing the connection (an answer left unread
/// makes the client close it, and every delivery would open a new one).
#[tokio::test]
async fn a_receiver_answering_with_a_body_is_delivered_to_over_one_kept_connection() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let receiver = Receiver::start(false).await;
    // 32 KiB: more than arrives with the answer's headers.
    let body: &'static str =
        Box::leak(format!(r#"{{"received":true,"note":"{}"}}"#, "x".repeat(32 << 10)).into_boxed_str());
    receiver.script(move |_, _| Reply { body, ..Reply::ok() });
    // One aggregate: its rows go one after the other, each after the previous one's mark.
    for i in 0..20 {
        write_outbox(&client, "in_kept", "InvoicePaymentBooked", i).await;
    }
    let relay = start(relay(&db, &receiver.url, &secret(1), &[])).await;
    let all = eventually(TIMEOUT, || async {
        scalar(&client, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL").await == 20
    })
    .await;
    assert!(all, "{}", relay.output());
    assert_eq!(receiver.accepted().len(), 20);
    assert_eq!(receiver.connections(), 1, "one connection for twenty deliveries, one after the other");
}

/// Under a held snapshot the outbox's partial indexes (`outbox_ready`, and
/// `outbox_unpublished_by_aggregate`) keep the entry of every row claimed and published, while
/// autovacuum's analyse finds none of them unpublished and the planner costs a whole scan of them at
/// one page. 30,000 rows are written, claimed and published under such a snapshot, 64 at a time,
/// and the outbox analysed; a batch of 8 is then claimed, and marked published as the relay does:
/// the mark must find each row by its id, not read the whole index of unpublished rows at each
/// statement (a hash join over it: 25,494 buffers in all against the index's 414 pages; by id: 263).
#[tokio::test]
async fn under_a_held_snapshot_a_relay_batch_finds_its_rows_by_id_not_by_reading_the_grown_indexes() {
    use inbox_domain::inbox::store::outbox::{self, Fence};
    use inbox_test_support::db::{buffers_read, in_batches_of_64};
    let db = TestDb::new().await;
    let client = db.client().await;
    // Written, claimed and published 64 at a time. The rows were written hours ago (as far as the
    // claim knows): its cursor below starts after them.
    let batch = "aggregate_id IN (SELECT 'in_old_' || i FROM generate_series($1::int4, $2::int4) i)";
    let reporting = hold_snapshot(&db, "outbox").await;
    in_batches_of_64(
        &client,
        30_000,
        &[
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at, available_at)
             SELECT 'Invoice', 'in_old_' || i, 'InvoicePaymentBooked', '{}', now() - interval '10 hours', now() - interval '10 hours'
               FROM generate_series($1::int4, $2::int4) i",
            &format!(
                "UPDATE outbox SET attempts = 1, fencing_token = 1, available_at = now() + interval '30 s' WHERE {batch}"
            ),
            &format!("UPDATE outbox SET published_at = now() WHERE {batch}"),
        ],
    )
    .await;
    client.batch_execute("ANALYZE outbox").await.unwrap();
    client
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'Invoice', 'in_new_' || i, 'InvoicePaymentBooked', '{}' FROM generate_series(1, 8) i",
        )
        .await
        .unwrap();
    let index_pages =
        scalar(&client, "SELECT pg_relation_size('outbox_unpublished_by_aggregate') / 8192").await;

    // A relay's connection: the claim is prepared on it.
    let pool = inbox_test_support::worker::pool(&db, 1);
    let conn = pool.get().await.unwrap();
    let before = buffers_read(&conn, "outbox").await;
    // Where the next claim would start: the cursor's slack before now.
    let since = std::time::SystemTime::now() - inbox_domain::inbox::store::cursor::ClaimCursor::SLACK;
    let claim = outbox::claim(
        &conn,
        Pooler::None,
        Some(since),
        16,
        8,
        i64::MAX,
        Duration::from_secs(120),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    assert_eq!(claim.claimed.len(), 8, "the new batch is claimed");
    let fences: Vec<Fence> = claim.claimed.iter().map(Fence::from).collect();
    let marked = outbox::mark_published(&conn, Pooler::None, &fences, Duration::from_secs(10)).await.unwrap();
    let read = buffers_read(&conn, "outbox").await - before;
    reporting.batch_execute("COMMIT").await.unwrap();

    assert_eq!(marked.len(), 8, "each row of the batch is marked published");
    assert_eq!(unpublished(&client).await, 0);
    assert!(
        read < index_pages,
        "claiming and marking 8 rows read {read} buffers of the outbox, whose index of unpublished rows has {index_pages} pages"
    );
}

/// The relay's claim takes its candidates from `outbox_ready` in its order, whatever the statistics
/// say. Both partial indexes of the outbox hold the pending rows, and the planner takes the size of
/// each from its last vacuum or analyse: when those left `outbox_unpublished_by_aggregate` counted
/// empty and `outbox_ready` with a few entries over many pages (as in a soak under a held
/// snapshot), it preferred to read the whole index of unpublished rows, filter and sort it — at
/// every claim, over every dead entry the snapshot kept (35k buffers a claim, 29 ms). Set here by
/// hand to those statistics, over indexes left large by 20,000 published rows, the claim must
/// still read `outbox_ready` from its cursor, with no sort below its lock.
#[tokio::test]
async fn the_relays_claim_reads_outbox_ready_in_order_whatever_the_statistics_say() {
    use inbox_domain::inbox::store::outbox::CLAIM_SQL;
    use inbox_domain::inbox::store::queue::CLAIM_PLANNER_SQL;
    let db = TestDb::new().await;
    let mut client = db.client().await;
    // Each on its own: VACUUM may not run in the implicit transaction of a multi-statement query.
    for statement in [
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'Invoice', 'in_old_' || i, 'InvoicePaymentBooked', '{}' FROM generate_series(1, 20000) i",
        "UPDATE outbox SET published_at = now()",
        "VACUUM ANALYZE outbox",
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'Invoice', 'in_' || i, 'InvoicePaymentBooked', '{}' FROM generate_series(1, 50) i",
        "UPDATE pg_class SET reltuples = 0 WHERE relname = 'outbox_unpublished_by_aggregate'",
        "UPDATE pg_class SET reltuples = 20 WHERE relname = 'outbox_ready'",
    ] {
        client.batch_execute(statement).await.unwrap();
    }
    client.batch_execute("SET plan_cache_mode = force_custom_plan").await.unwrap();
    client.batch_execute(&CLAIM_PLANNER_SQL.replace("SET LOCAL", "SET")).await.unwrap();
    client
        .batch_execute(&format!("PREPARE claim(int, bigint, float8, bigint, timestamptz) AS {CLAIM_SQL}"))
        .await
        .unwrap();
    let (plan, claimed) = explain_rolled_back(
        &mut client,
        "EXECUTE claim(16, 32, 120.0, 33554432, now() - interval '1 minute')",
        "SELECT count(*)::text FROM outbox WHERE attempts = 1",
    )
    .await;
    assert_eq!(claimed, ["32"], "{plan}");
    let candidates: Vec<&str> = plan
        .lines()
        .skip_while(|l| !l.contains("LockRows"))
        .take_while(|l| !l.contains("CTE ranked"))
        .collect();
    assert!(
        candidates.iter().any(|l| l.contains("Index Scan using outbox_ready"))
            && !candidates.iter().any(|l| l.contains("Sort")),
        "the candidates must come from outbox_ready in its order:\n{plan}"
    );
}

/// Prepared on a relay's connection, the claim runs one generic plan, made at its first execution
/// (on an empty outbox when the relay starts on a fresh database) and kept until an analyse or a
/// vacuum of the outbox. Under the claim's settings that plan reads `outbox_ready` in its order and
/// probes each candidate's aggregate in `outbox_unpublished_by_aggregate`, whatever sizes the
/// planner saw: made on an empty outbox and run on one grown to 20k rows that nothing has analysed
/// yet, no step of it scans the outbox otherwise, and nothing below its lock sorts.
#[tokio::test]
async fn the_relays_claim_generic_plan_made_on_an_empty_outbox_reads_outbox_ready_once_it_grew() {
    use inbox_domain::inbox::store::outbox::CLAIM_SQL;
    use inbox_test_support::db::{other_scans, prepare_generic_claim};
    let db = TestDb::new().await;
    let client = db.client().await;
    // The first claim, on the empty outbox, makes the plan.
    let args = "(16, 32, 120.0, 33554432, NULL)";
    prepare_generic_claim(&client, "claim", "int, bigint, float8, bigint, timestamptz", CLAIM_SQL, args)
        .await;
    client
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'Invoice', 'in_' || i, 'InvoicePaymentBooked', '{}' FROM generate_series(1, 20000) i",
        )
        .await
        .unwrap();
    let plan: Vec<String> =
        inbox_test_support::db::column(&client, &format!("EXPLAIN (COSTS OFF) EXECUTE claim{args}")).await;
    let plan = plan.join("\n");
    assert!(plan.contains("$5"), "the cached generic plan (its arguments unknown):\n{plan}");
    let candidates: Vec<&str> = plan
        .lines()
        .skip_while(|l| !l.contains("LockRows"))
        .take_while(|l| !l.contains("CTE ranked"))
        .collect();
    let allowed = ["using outbox_ready", "using outbox_unpublished_by_aggregate", "using outbox_pkey"];
    let other_scans = other_scans(&plan, " on outbox", &allowed);
    assert!(
        candidates.iter().any(|l| l.contains("Index Scan using outbox_ready"))
            && !candidates.iter().any(|l| l.contains("Sort"))
            && plan.contains("using outbox_unpublished_by_aggregate")
            && other_scans.is_empty()
            && !plan.contains("Hash"),
        "the candidates must come from outbox_ready in its order, each aggregate probed by its index:\n{plan}"
    );
}

/// The published mark is prepared like the claim (`outbox::mark_published`), so its generic plan
/// may be made when the outbox is empty. Made then, and run once 20,000 unpublished rows (and
/// their index entries) are there, it must still find each delivered row by its primary key and
/// each aggregate's next row by `outbox_unpublished_by_aggregate`: no sequential scan, no hash of
/// the table, whatever sizes the planner saw.
#[tokio::test]
async fn the_published_marks_generic_plan_made_on_an_empty_outbox_probes_the_outboxs_indexes_once_it_grew() {
    use inbox_domain::inbox::store::outbox::MARK_PUBLISHED_SQL;
    use inbox_test_support::db::{other_scans, prepare_generic_claim};
    let db = TestDb::new().await;
    let client = db.client().await;
    let args = "(ARRAY[1, 2]::int8[], ARRAY[1, 1]::int4[], ARRAY[now(), now()])";
    let types = "int8[], int4[], timestamptz[]";
    prepare_generic_claim(&client, "mark", types, MARK_PUBLISHED_SQL, args).await;
    client
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'Invoice', 'in_' || (i % 5000), 'InvoicePaymentBooked', '{}' FROM generate_series(1, 20000) i",
        )
        .await
        .unwrap();
    let plan: Vec<String> =
        inbox_test_support::db::column(&client, &format!("EXPLAIN (COSTS OFF) EXECUTE mark{args}")).await;
    let plan = plan.join("\n");
    let plans: Vec<String> = inbox_test_support::db::column(
        &client,
        "SELECT generic_plans || '/' || custom_plans FROM pg_prepared_statements WHERE name = 'mark'",
    )
    .await;
    assert_eq!(plans, ["2/0"], "generic / custom plans: the cached generic plan, made on the empty outbox");
    // The rows found are updated by the ctid just read (Tid Scan).
    let allowed = ["using outbox_pkey", "using outbox_unpublished_by_aggregate", "Tid Scan"];
    let other_scans = other_scans(&plan, " on outbox", &allowed);
    assert!(
        other_scans.is_empty()
            && !plan.contains("Hash")
            && plan.contains("using outbox_unpublished_by_aggregate"),
        "each delivered row by its key, each aggregate's next row by its index:\n{plan}"
    );
}

/// A snapshot held open elsewhere (a reporting query) keeps every published row's entry in
/// `outbox_ready` where claims from the index's start step over it. 19,500 of 20,000 outbox rows
/// are claimed and published under such a snapshot, by claims that each start where the one before
/// left off (`ClaimCursor`); the next claim from there takes the same oldest ready rows as a claim
/// from the start (the cursor's periodic full scan), and its scan of `outbox_ready` reads a tenth
/// of the buffers at most (4 against 577 when it was written).
#[tokio::test]
async fn a_relay_claim_under_a_held_snapshot_starts_where_the_last_claim_left_off_not_at_the_published_rows()
{
    use inbox_domain::inbox::store::cursor::ClaimCursor;
    use inbox_domain::inbox::store::outbox::{self, CLAIM_SQL};
    let db = TestDb::new().await;
    let mut client = db.client().await;
    client
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at, available_at)
             SELECT 'Invoice', 'in_' || i, 'InvoicePaymentBooked', jsonb_build_object('n', i),
                    now() - interval '10 hours' + i * interval '1 s', now() - interval '10 hours' + i * interval '1 s'
               FROM generate_series(1, 20000) i",
        )
        .await
        .unwrap();
    client.batch_execute("VACUUM ANALYZE outbox").await.unwrap();
    let reporting = hold_snapshot(&db, "outbox").await;

    let pool = inbox_test_support::worker::pool(&db, 1);
    let conn = pool.get().await.unwrap();
    let mut cursor = ClaimCursor::new();
    let mut resume_from = None;
    for limit in std::iter::repeat_n(1000, 19).chain([500]) {
        let claim = outbox::claim(
            &conn,
            Pooler::None,
            cursor.start(),
            16,
            limit,
            i64::MAX,
            Duration::from_secs(120),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
        assert_eq!(claim.claimed.len() as i64, limit, "every claim takes its oldest rows");
        cursor.advance(claim.resume_from);
        client
            .execute(
                "UPDATE outbox SET published_at = now() WHERE attempts = 1 AND published_at IS NULL",
                &[],
            )
            .await
            .unwrap();
        resume_from = claim.resume_from;
    }
    assert_eq!(unpublished(&client).await, 500);
    let since = resume_from.unwrap() - ClaimCursor::SLACK;
    let since = timestamptz_literal(&client, since).await;
    let expected: Vec<String> = (19_501..19_533).map(|i| format!("in_{i}")).collect();

    // The plan a relay runs directly and the one behind a transaction pooler.
    for (n, planner) in inbox_test_support::db::claim_planners().iter().enumerate() {
        let types = "int, bigint, float8, bigint, timestamptz";
        inbox_test_support::db::prepare_claim(&client, planner, &format!("claim{n}"), types, CLAIM_SQL).await;
        let mut buffers = Vec::new();
        for start in [since.clone(), "NULL".to_owned()] {
            let (plan, claimed) = explain_rolled_back(
                &mut client,
                &format!("EXECUTE claim{n}(16, 32, 120.0, 33554432, {start})"),
                "SELECT aggregate_id FROM outbox WHERE attempts = 1 AND published_at IS NULL ORDER BY id",
            )
            .await;
            assert_eq!(claimed, expected, "from {start}, the oldest 32 ready rows: {plan}");
            // The buffers of the scan of outbox_ready (the next line that counts them): its index
            // pages, and the table's pages of each entry it visits, dead or live.
            let scan = plan.lines().skip_while(|l| !l.contains("using outbox_ready"));
            let scan = scan.filter_map(|l| l.trim().strip_prefix("Buffers: shared hit=")).next();
            let scan = scan.unwrap_or_else(|| panic!("a scan of outbox_ready:\n{plan}"));
            buffers.push(scan.split(|c: char| !c.is_ascii_digit()).next().unwrap().parse::<u64>().unwrap());
        }
        let [from_cursor, from_start] = buffers[..] else { unreachable!() };
        assert!(
            from_cursor * 10 < from_start,
            "under `{planner}`, the claim's scan of outbox_ready read {from_cursor} buffers from the cursor, {from_start} from the start"
        );
    }
    reporting.batch_execute("COMMIT").await.unwrap();
}
