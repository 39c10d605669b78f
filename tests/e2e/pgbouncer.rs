//! Through PgBouncer in transaction mode (Debian's 1.18) with `INBOX_DB_POOLER=transaction`: the
//! ingest, the worker and the relay do their whole job — concurrent and duplicate deliveries stored once,
//! every payment booked once — and the operator commands work, with server connections shared by
//! every client and each transaction on whichever is free; `migrate`, which needs a session, is
//! refused saying so. Skipped, saying so, where pgbouncer is not installed (`scripts/ci-deps.sh`
//! installs it; CI runs it).

use std::time::Duration;

use inbox_test_support::app::concurrent_posts;
use inbox_test_support::db::{scalar, url_with_dbname};
use inbox_test_support::events::{invoice_paid, sign, SECRET_A};
use inbox_test_support::pgbouncer::PgBouncer;
use inbox_test_support::process::{command, json_lines, run, start_ingest, Proc};
use inbox_test_support::proxy::postgres_addr;
use inbox_test_support::worker::eventually;
use inbox_test_support::TestDb;

/// A PgBouncer in transaction mode in front of the test cluster with two server connections for
/// every client (the ingest's writers, the worker's claims and batches and the operators take
/// turns on them); None, saying so, where pgbouncer is not installed.
async fn bouncer() -> Option<PgBouncer> {
    let server = postgres_addr();
    let user = inbox_test_support::db::admin_config().get_user().unwrap_or("postgres").to_owned();
    let start = move || PgBouncer::start(&server.ip().to_string(), server.port(), &user, 2);
    let bouncer = tokio::task::spawn_blocking(start).await.unwrap();
    if bouncer.is_none() {
        eprintln!("skipped: pgbouncer is not installed (scripts/ci-deps.sh installs it)");
    }
    bouncer
}

/// The connection string of `db` through `bouncer`.
fn through(bouncer: &PgBouncer, db: &TestDb) -> String {
    url_with_dbname(&format!("postgres://postgres@127.0.0.1:{}/postgres", bouncer.port), &db.name)
}

#[tokio::test]
async fn ingest_worker_and_operators_work_through_pgbouncer_in_transaction_mode() {
    let Some(bouncer) = bouncer().await else { return };
    let db = TestDb::new().await;
    let client = db.client().await;
    let via = through(&bouncer, &db);

    let mut ingest = command("inbox-ingest");
    ingest
        .env("DATABASE_URL", &via)
        .env("INBOX_DB_POOLER", "transaction")
        .env("INBOX_ENDPOINTS", format!("billing={SECRET_A}"))
        .env("INBOX_LISTEN", "127.0.0.1:0");
    let (ingest, base) = tokio::task::spawn_blocking(move || start_ingest(ingest)).await.unwrap();
    let mut worker = command("inbox-worker");
    // LISTEN cannot work through a transaction pooler: the worker finds rows by polling.
    worker.env("DATABASE_URL", &via).env("INBOX_DB_POOLER", "transaction");
    worker.args(["run", "--poll-interval", "100ms", "--batch-size", "8"]);
    let worker = Proc::spawn(worker);
    worker.wait_for_line("no LISTEN wake-ups, polling", Duration::from_secs(30));
    worker.wait_for_line("inbox-worker running", Duration::from_secs(30));

    // 40 payments at once, each delivered twice (and a redelivery of the first eight).
    let mut requests = Vec::new();
    for i in 0..48 {
        let n = i % 40;
        let body = invoice_paid(&format!("evt_pgb_{n}"), &format!("in_pgb_{n}"), 100 + n as i64);
        requests.push(("billing".to_owned(), sign(SECRET_A, &body), body));
    }
    let replies = tokio::task::spawn_blocking({
        let base = base.clone();
        move || concurrent_posts(&base, requests)
    })
    .await
    .unwrap();
    let failed: Vec<_> = replies.iter().filter(|r| r.status != 200).map(|r| &r.text).collect();
    assert!(failed.is_empty(), "{failed:?}\n{}\n{}", ingest.output(), bouncer.log());

    let drained = eventually(Duration::from_secs(30), || async {
        scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NULL").await == 0
    })
    .await;
    assert!(drained, "the worker processed every row:\n{}\n{}", worker.output(), bouncer.log());
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox").await, 40, "stored once each");
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 40, "booked once each");
    assert_eq!(scalar(&client, "SELECT count(*) FROM outbox").await, 40);
    let (health, ready) = tokio::join!(get(&base, "/readyz"), get(&base, "/healthz"));
    assert!(health.starts_with("HTTP/1.1 200") && ready.starts_with("HTTP/1.1 200"), "{health} {ready}");

    // The relay delivers the 40 outbox rows through the pooler too, polling.
    let receiver = inbox_test_support::receiver::Receiver::start(false).await;
    let mut relay = command("inbox-worker");
    relay
        .env("DATABASE_URL", &via)
        .env("INBOX_DB_POOLER", "transaction")
        .env("INBOX_RELAY_SECRET", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
        .args(["relay", "--to-url", &receiver.url, "--poll-interval", "100ms", "--batch-size", "8"]);
    let relay = Proc::spawn(relay);
    relay.wait_for_line("no LISTEN wake-ups, polling", Duration::from_secs(30));
    let published = eventually(Duration::from_secs(30), || async {
        scalar(&client, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL").await == 40
    })
    .await;
    assert!(published, "the relay delivered every row:\n{}\n{}", relay.output(), bouncer.log());
    assert_eq!(receiver.accepted().len(), 40, "each once");

    for output in [worker.output(), ingest.output(), relay.output()] {
        assert!(!output.contains("prepared statement"), "no statement outlived its transaction:\n{output}");
    }

    // The operator commands, through the pooler too.
    for args in [
        vec!["stats", "--json"],
        vec!["needs-review", "--json"],
        vec!["requeue", "--all", "--dry-run"],
        vec!["replay", "--event-id", "evt_pgb_7", "--actor", "pgb"],
        vec!["purge", "--older-than", "30d", "--dry-run"],
    ] {
        let mut cmd = command("inbox-worker");
        cmd.env("DATABASE_URL", &via).env("INBOX_DB_POOLER", "transaction").args(&args);
        let (code, output) =
            tokio::task::spawn_blocking(move || run(cmd, Duration::from_secs(30))).await.unwrap();
        assert_eq!(code, 0, "inbox-worker {args:?} through pgbouncer:\n{output}");
    }
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM ledger_entries").await,
        40,
        "replay books nothing twice"
    );
    assert_eq!(scalar(&client, "SELECT count(*) FROM operator_audit").await, 1);

    let mut migrate = command("inbox-worker");
    migrate.env("DATABASE_URL", &via).env("INBOX_DB_POOLER", "transaction").arg("migrate");
    let (code, output) =
        tokio::task::spawn_blocking(move || run(migrate, Duration::from_secs(30))).await.unwrap();
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("session-level lock"), "migrate says why it needs a session: {output}");
}

async fn get(base: &str, path: &str) -> String {
    inbox_test_support::app::raw_request(
        base,
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
}

#[tokio::test]
async fn behind_a_transaction_pooler_without_the_setting_the_ingest_names_the_fix_and_turns_unready() {
    let Some(bouncer) = bouncer().await else { return };
    let db = TestDb::new().await;
    let via = through(&bouncer, &db);

    // INBOX_DB_POOLER left at its default: the insert is prepared once per client connection,
    // and the next transaction of that connection may run on another server connection. Alone
    // behind the pooler, the ingest's batches (all on one client connection) would keep getting the
    // server connection they last released, as PgBouncer hands out the most recently used one
    // first. Two neighbours, as other clients of a shared pooler, take turns holding one of the two
    // server connections in an open transaction: before each round the next takes the one the
    // ingest used last, then the other lets its own go, so every round runs on the other one.
    let neighbours = [
        inbox_test_support::db::connect(&via.parse().unwrap()).await,
        inbox_test_support::db::connect(&via.parse().unwrap()).await,
    ];
    let mut ingest = command("inbox-ingest");
    ingest
        .env("DATABASE_URL", &via)
        .env("INBOX_ENDPOINTS", format!("billing={SECRET_A}"))
        .env("INBOX_LISTEN", "127.0.0.1:0");
    let (ingest, base) = tokio::task::spawn_blocking(move || start_ingest(ingest)).await.unwrap();
    let mut unavailable = 0;
    for round in 0..4 {
        neighbours[round % 2].batch_execute("BEGIN; SELECT 1").await.unwrap();
        if round > 0 {
            neighbours[(round + 1) % 2].batch_execute("COMMIT").await.unwrap();
        }
        let requests: Vec<_> = (0..40)
            .map(|i| {
                let body = invoice_paid(&format!("evt_mis_{round}_{i}"), &format!("in_mis_{i}"), 100);
                ("billing".to_owned(), sign(SECRET_A, &body), body)
            })
            .collect();
        let replies = tokio::task::spawn_blocking({
            let base = base.clone();
            move || concurrent_posts(&base, requests)
        })
        .await
        .unwrap();
        unavailable += replies.iter().filter(|r| r.status == 503).count();
    }
    drop(neighbours);
    assert!(
        unavailable > 0,
        "statements prepared on one server connection were missed on another:\n{}",
        ingest.output()
    );
    // A 503 can arrive before the ingest's reader thread has its line.
    let logs = ingest.wait_for_output("the database settings are wrong", Duration::from_secs(10));

    // The log names the SQLSTATE, the server's message and the setting, at error level.
    let named = json_lines(&logs).into_iter().find(|l| {
        l["level"] == "ERROR" && l["fix"].as_str().is_some_and(|f| f.contains("INBOX_DB_POOLER=transaction"))
    });
    let named = named.unwrap_or_else(|| panic!("an error line naming the fix:\n{logs}"));
    let sqlstate = named["sqlstate"].as_str().unwrap_or_default();
    assert!(["26000", "42P05"].contains(&sqlstate), "{named}");
    assert!(named["error"].as_str().unwrap_or_default().contains("prepared statement"), "{named}");
    // Every request refused for the database says why in its own line, SQLSTATE included.
    for line in logs.lines().filter(|l| l.contains("webhook not stored")) {
        assert!(
            line.contains("(26000)") || line.contains("(42P05)") || line.contains("INBOX_DB_POOLER"),
            "{line}"
        );
    }

    // /readyz says so, and stays so: retrying will not fix a setting.
    let ready = get(&base, "/readyz").await;
    assert!(ready.starts_with("HTTP/1.1 503"), "{ready}");
    let ready = inbox_test_support::app::http_client().get(format!("{base}/readyz")).send().await.unwrap();
    let body: serde_json::Value = serde_json::from_slice(&ready.bytes().await.unwrap()).unwrap();
    assert!(body["error"].as_str().unwrap_or_default().contains("INBOX_DB_POOLER=transaction"), "{body}");
    drop(ingest);
}

/// The worker behind a transaction pooler without `INBOX_DB_POOLER=transaction`: its claim (and
/// its handlers' statements) are prepared once per client connection, and the next transaction of
/// that connection may run on a server connection that does not have them, or has another
/// client's statement of the same name. Sixteen batches in flight over two server connections
/// meet that at once; the worker says so at error level, with the setting that fixes it.
#[tokio::test]
async fn behind_a_transaction_pooler_without_the_setting_the_worker_names_the_fix() {
    let Some(bouncer) = bouncer().await else { return };
    let db = TestDb::new().await;
    let client = db.client().await;
    let via = through(&bouncer, &db);
    for i in 0..200 {
        let body = invoice_paid(&format!("evt_mis_{i}"), &format!("in_mis_{i}"), 100);
        inbox_test_support::worker::store_event(&client, "billing", &body).await;
    }

    let mut worker = command("inbox-worker");
    worker.env("DATABASE_URL", &via);
    worker.args(["run", "--poll-interval", "50ms", "--batch-size", "1", "--concurrency", "16"]);
    let worker = Proc::spawn(worker);
    let logs = worker.wait_for_output("the database settings are wrong", Duration::from_secs(30));
    let named = json_lines(&logs).into_iter().find(|l| {
        l["level"] == "ERROR"
            && l["error"].as_str().is_some_and(|e| {
                e.contains("prepared statement") && e.contains("INBOX_DB_POOLER=transaction")
            })
    });
    assert!(named.is_some(), "an error line naming the SQLSTATE's cause and the setting:\n{logs}");
    drop(worker);
}
