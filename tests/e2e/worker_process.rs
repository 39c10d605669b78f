//! `inbox-worker run` as processes, with real faults: SIGKILL mid-handler, SIGSTOP past the
//! lease, statement timeouts, SIGTERM with events in flight, several processes at once.

use std::time::Duration;

use inbox_test_support::db::{scalar, slow_writes, snapshot};
use inbox_test_support::events::{invoice_paid, SECRET_A};
use inbox_test_support::process::{command, json_lines, rss_kib, run, Proc};
use inbox_test_support::worker::{eventually, store_event};
use inbox_test_support::{spawn_app_with, TestDb};

/// `inbox-worker run` on `db` with `flags`.
fn worker(db: &TestDb, flags: &[&str]) -> std::process::Command {
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", db.url()).arg("run").args(["--poll-interval", "100ms"]).args(flags);
    cmd
}

fn start(cmd: std::process::Command) -> Proc {
    let proc = Proc::spawn(cmd);
    proc.wait_for_line("inbox-worker running", Duration::from_secs(30));
    proc
}

/// A trigger that sleeps `seconds` in every ledger booking (BEFORE or AFTER the insert).
async fn slow_bookings(client: &tokio_postgres::Client, when: &str, seconds: f64) {
    slow_writes(client, "ledger_entries", &format!("{when} INSERT"), seconds).await;
}

/// Waits until a worker backend is inside the ledger booking; panics with `worker`'s output and
/// every inbox row if none gets there.
async fn wait_for_booking_in_progress(client: &tokio_postgres::Client, worker: &Proc) {
    let seen = eventually(Duration::from_secs(20), || async {
        scalar(
            client,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
               AND application_name = 'inbox-worker' AND state = 'active' AND query LIKE '%ledger_entries%'",
        )
        .await
            > 0
    })
    .await;
    if !seen {
        panic!("no worker reached the booking\n{}\n{}", snapshot(client).await.join("\n"), worker.output());
    }
}

/// Stores `n` `invoice.paid` events: `evt_i` pays `in_i` 100 + i.
async fn store_invoices(client: &tokio_postgres::Client, n: i64) {
    for i in 0..n {
        store_event(client, "billing", &invoice_paid(&format!("evt_{i}"), &format!("in_{i}"), 100 + i)).await;
    }
}

async fn all_processed(client: &tokio_postgres::Client, timeout: Duration) -> bool {
    eventually(timeout, || async {
        scalar(client, "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NULL").await == 0
    })
    .await
}

#[tokio::test]
async fn a_worker_killed_mid_handler_loses_nothing_and_books_once() {
    let db = TestDb::new().await;
    let client = db.client().await;
    slow_bookings(&client, "BEFORE", 1.5).await;
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    let flags = ["--lease", "4s", "--statement-timeout", "2s"];
    let mut a = start(worker(&db, &flags));
    wait_for_booking_in_progress(&client, &a).await;
    a.signal(libc::SIGKILL);
    a.wait(Duration::from_secs(10));
    tokio::time::sleep(Duration::from_secs(2)).await; // the server notices and rolls back
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 0);
    assert_eq!(
        scalar(&client, "SELECT attempts::bigint FROM webhook_inbox WHERE processed_at IS NULL").await,
        1
    );

    let b = start(worker(&db, &flags));
    assert!(all_processed(&client, Duration::from_secs(20)).await, "{}", b.output());
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 1);
    assert_eq!(scalar(&client, "SELECT count(*) FROM outbox").await, 1);
    assert_eq!(scalar(&client, "SELECT attempts::bigint FROM webhook_inbox").await, 2);
}

#[tokio::test]
async fn a_worker_frozen_past_its_lease_and_resumed_books_nothing_twice() {
    let db = TestDb::new().await;
    let client = db.client().await;
    // The booking takes 1 s; the worker is frozen right in it, holding the row lock.
    slow_bookings(&client, "AFTER", 1.0).await;
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    let flags = ["--lease", "3s", "--statement-timeout", "1500ms"];
    let a = start(worker(&db, &flags));
    wait_for_booking_in_progress(&client, &a).await;
    a.signal(libc::SIGSTOP);
    // B takes the row once A's lease expires; A's idle transaction is cut off by the server.
    let b = start(worker(&db, &flags));
    assert!(all_processed(&client, Duration::from_secs(20)).await, "{}", b.output());
    a.signal(libc::SIGCONT);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 1);
    assert_eq!(scalar(&client, "SELECT count(*) FROM outbox").await, 1);
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NOT NULL").await, 1);
    let last_error: Option<String> =
        client.query_one("SELECT last_error FROM webhook_inbox", &[]).await.unwrap().get(0);
    assert_eq!(last_error, None, "A's late failure must not touch the processed row");
}

/// An outage is not the events' fault: three storms of `pg_terminate_backend` on the workers'
/// sessions, each while the same events are mid-booking, with an attempt limit of 3, park
/// nothing — each interrupted attempt is given back — and every event is booked once.
#[tokio::test]
async fn three_storms_of_terminated_backends_park_nothing_and_book_every_event_once() {
    let db = TestDb::new().await;
    let client = db.client().await;
    slow_bookings(&client, "AFTER", 1.0).await;
    for i in 0..3 {
        store_event(&client, "billing", &invoice_paid(&format!("evt_{i}"), &format!("in_{i}"), 100)).await;
    }
    let w = start(worker(&db, &["--max-attempts", "3", "--lease", "30s", "--statement-timeout", "10s"]));
    for storm in 1..=3 {
        wait_for_booking_in_progress(&client, &w).await;
        let killed = scalar(
            &client,
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
              WHERE datname = current_database() AND application_name LIKE 'inbox-worker%') AS t",
        )
        .await;
        assert!(killed > 0, "storm {storm} terminated no worker session\n{}", w.output());
        // The next storm must meet the next attempt, not this one's dying session.
        let gone = eventually(Duration::from_secs(10), || async {
            scalar(
                &client,
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
                   AND application_name = 'inbox-worker' AND state = 'active' AND query LIKE '%ledger_entries%'",
            )
            .await
                == 0
        })
        .await;
        assert!(
            gone,
            "storm {storm}: the terminated session is still booking\n{}\n{}",
            snapshot(&client).await.join("\n"),
            w.output()
        );
    }
    if !all_processed(&client, Duration::from_secs(30)).await {
        panic!("not all processed\n{}\n{}", snapshot(&client).await.join("\n"), w.output());
    }
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE parked_at IS NOT NULL").await, 0);
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 3);
    assert_eq!(scalar(&client, "SELECT count(*) FROM outbox").await, 3);
    // Every interrupted attempt was given back: each row counts only the attempt that booked it.
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE attempts <> 1").await, 0);
    assert!(w.output().contains("\"outcome\":\"interrupted\""), "{}", w.output());
}

#[tokio::test]
async fn a_handler_over_the_statement_timeout_is_recorded_then_retried() {
    let db = TestDb::new().await;
    let client = db.client().await;
    slow_bookings(&client, "BEFORE", 3.0).await;
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    let w = start(worker(&db, &["--lease", "2s", "--statement-timeout", "1s"]));
    let recorded = eventually(Duration::from_secs(15), || async {
        scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE last_error LIKE '%statement timeout%'")
            .await
            == 1
    })
    .await;
    assert!(recorded, "{}", w.output());
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 0);
    client.batch_execute("DROP TRIGGER slow ON ledger_entries").await.unwrap();
    assert!(all_processed(&client, Duration::from_secs(20)).await, "{}", w.output());
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 1);
    assert!(scalar(&client, "SELECT attempts::bigint FROM webhook_inbox").await >= 2);
}

#[tokio::test]
async fn sigterm_finishes_events_in_flight_and_exits_0_losing_nothing() {
    let db = TestDb::new().await;
    let client = db.client().await;
    slow_bookings(&client, "AFTER", 1.0).await;
    for i in 0..8 {
        store_event(&client, "billing", &invoice_paid(&format!("evt_{i}"), &format!("in_{i}"), 100)).await;
    }
    let mut w = start(worker(&db, &["--concurrency", "4", "--shutdown-timeout", "20s"]));
    wait_for_booking_in_progress(&client, &w).await;
    w.signal(libc::SIGTERM);
    let status = w.wait(Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "{}", w.output());
    let processed =
        scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NOT NULL").await;
    assert!(processed >= 1, "the events in flight were finished");
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, processed);
    // Nothing is left leased or half-counted: every unprocessed row is claimable now, unattempted.
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NULL AND (attempts <> 0 OR available_at > now())").await,
        0
    );
    let _next = start(worker(&db, &[]));
    assert!(all_processed(&client, Duration::from_secs(30)).await);
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 8);
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE attempts <> 1").await, 0);
}

#[tokio::test]
async fn two_hundred_events_over_four_worker_processes_are_each_booked_once_in_one_attempt() {
    let db = TestDb::new().await;
    let client = db.client().await;
    store_invoices(&client, 200).await;
    let mut workers: Vec<Proc> = (0..4).map(|_| Proc::spawn(worker(&db, &["--concurrency", "4"]))).collect();
    assert!(all_processed(&client, Duration::from_secs(60)).await);
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 200);
    assert_eq!(scalar(&client, "SELECT count(*) FROM outbox").await, 200);
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE attempts <> 1").await, 0);
    assert_eq!(
        scalar(&client, "SELECT sum(amount)::bigint FROM ledger_entries").await,
        (0..200).map(|i| 100 + i).sum::<i64>()
    );
    for w in &workers {
        w.signal(libc::SIGTERM);
    }
    for w in &mut workers {
        assert_eq!(w.wait(Duration::from_secs(30)).code(), Some(0), "{}", w.output());
    }
}

/// A worker at its defaults (`--concurrency 256`, `--batch-size 64`: four process transactions)
/// that starts with 200 rows waiting claims them in one claim, and works them in batches of 64 at
/// most, each in a transaction of its own: with a backlog, one claim of several batches instead of
/// a claim per batch, so that the claims keep up when they are slow. One claim leases every row
/// at the same `now()` (one `available_at`); the rows one process transaction marks share its
/// `xmin`.
#[tokio::test]
async fn a_backlog_is_claimed_several_batches_at_a_time_and_processed_a_batch_per_transaction() {
    let db = TestDb::new().await;
    let client = db.client().await;
    store_invoices(&client, 200).await;
    let mut w = start(worker(&db, &[]));
    assert!(all_processed(&client, Duration::from_secs(60)).await);
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 200);
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE attempts <> 1").await, 0);
    assert_eq!(scalar(&client, "SELECT count(DISTINCT available_at) FROM webhook_inbox").await, 1, "claims");
    let batches = "SELECT count(*) AS n FROM webhook_inbox GROUP BY xmin::text";
    assert_eq!(scalar(&client, &format!("SELECT max(n) FROM ({batches}) b")).await, 64, "largest batch");
    assert_eq!(scalar(&client, &format!("SELECT count(*) FROM ({batches}) b")).await, 4, "batches");
    w.signal(libc::SIGTERM);
    assert_eq!(w.wait(Duration::from_secs(30)).code(), Some(0), "{}", w.output());
}

#[tokio::test]
async fn an_idle_worker_wakes_when_the_ingest_stores_a_row() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let url = db.url();
    // Polling once a minute: only the wake-up can make it quick.
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", &url).args(["run", "--poll-interval", "60s"]);
    let w = start(cmd);
    let app = spawn_app_with(db, |_| {}).await;
    tokio::time::sleep(Duration::from_millis(500)).await; // the listener is subscribed
    let started = std::time::Instant::now();
    let body = invoice_paid("evt_wake", "in_1", 100);
    let reply = app.post("billing", Some(&inbox_test_support::events::sign(SECRET_A, &body)), body).await;
    assert_eq!(reply.status, 200);
    assert!(all_processed(&client, Duration::from_secs(10)).await, "{}", w.output());
    assert!(started.elapsed() < Duration::from_secs(5), "woken after {:?}", started.elapsed());
}

#[tokio::test]
async fn worker_metrics_report_outcomes_and_queue_gauges() {
    let db = TestDb::new().await;
    let client = db.client().await;
    store_event(&client, "billing", &invoice_paid("evt_1", "in_1", 100)).await;
    store_event(
        &client,
        "billing",
        &inbox_test_support::events::invoice_event("evt_2", "customer.created", "in_2", "open", 0),
    )
    .await;
    // A type this worker neither handles nor ignores: left for a worker that handles it.
    store_event(
        &client,
        "billing",
        &inbox_test_support::events::invoice_event("evt_3", "charge.refunded", "in_3", "open", 0),
    )
    .await;
    // A parked row: the gauges must come from the database, not from defaults.
    store_event(&client, "billing", &invoice_paid("evt_parked", "in_3", 100)).await;
    client
        .execute(
            "UPDATE webhook_inbox SET attempts = 10, last_error = 'boom' WHERE event_id = 'evt_parked'",
            &[],
        )
        .await
        .unwrap();
    let (_worker, address) = inbox_test_support::process::start_worker_with_metrics(worker(
        &db,
        &["--metrics-listen", "127.0.0.1:0", "--ignore", "customer.*"],
    ));
    let http = inbox_test_support::app::http_client();
    let scrape = || {
        let (http, address) = (http.clone(), address.clone());
        async move { http.get(format!("http://{address}/metrics")).send().await.unwrap().text().await.unwrap() }
    };
    let complete = eventually(Duration::from_secs(10), || async {
        let text = scrape().await;
        text.contains(r#"inbox_worker_events_total{outcome="processed"} 1"#)
            && text.contains(r#"inbox_worker_events_total{outcome="ignored"} 1"#)
            && text.contains("inbox_unprocessed 2")
            && text.contains("inbox_needs_review 1")
            && text.contains("inbox_no_handler 1")
    })
    .await;
    let text = scrape().await;
    assert!(complete, "{text}");
    for name in [
        "inbox_worker_processing_seconds_bucket",
        "inbox_worker_receive_to_processed_seconds_bucket",
        "inbox_worker_claim_batch_size_bucket",
        "inbox_ready 0",
        "inbox_oldest_unprocessed_age_seconds",
    ] {
        assert!(text.contains(name), "missing {name} in\n{text}");
    }
    let health = http.get(format!("http://{address}/healthz")).send().await.unwrap();
    assert_eq!(health.status().as_u16(), 200);
}

#[tokio::test]
async fn start_up_refuses_a_statement_timeout_not_well_under_the_lease() {
    let db = TestDb::new().await;
    let (code, output) =
        run(worker(&db, &["--lease", "1m", "--statement-timeout", "31s"]), Duration::from_secs(20));
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("at most half of --lease"), "{output}");
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", format!("postgres://postgres@127.0.0.1:{closed}/x")).arg("run");
    let (code, output) = run(cmd, Duration::from_secs(20));
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("cannot connect to the database"), "{output}");
}

/// An operator command on `db`; returns (exit code, output).
/// An operator command with no flags but `args`: the operator's limit is the default.
fn operator(db: &TestDb, args: &[&str]) -> (i32, String) {
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", db.url()).args(args);
    run(cmd, Duration::from_secs(30))
}

#[tokio::test]
async fn a_poison_row_parked_by_a_worker_is_listed_without_flags_requeued_after_the_fix_and_audited() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let mut poison: serde_json::Value =
        serde_json::from_slice(&invoice_paid("evt_poison", "in_p", 100)).unwrap();
    poison["data"]["object"].as_object_mut().unwrap().remove("amount_paid");
    store_event(&client, "billing", &serde_json::to_vec(&poison).unwrap()).await;
    store_event(&client, "billing", &invoice_paid("evt_fine", "in_f", 100)).await;

    let w = start(worker(&db, &["--max-attempts", "3"]));
    let parked = eventually(Duration::from_secs(30), || async {
        scalar(
            &client,
            "SELECT count(*) FROM webhook_inbox
              WHERE event_id = 'evt_poison' AND attempts = 3 AND parked_at IS NOT NULL",
        )
        .await
            == 1
    })
    .await;
    assert!(parked, "{}", w.output());
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Parked: never claimed again, the rest of the queue flows.
    assert_eq!(
        scalar(&client, "SELECT attempts::bigint FROM webhook_inbox WHERE event_id = 'evt_poison'").await,
        3
    );
    assert_eq!(
        scalar(
            &client,
            "SELECT count(*) FROM webhook_inbox WHERE event_id = 'evt_fine' AND processed_at IS NOT NULL"
        )
        .await,
        1
    );

    // Parked is the row's state: an operator's needs-review with no flags (its limit the default
    // 10) lists the row a worker with --max-attempts 3 parked; stats counts it.
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", db.url()).args(["needs-review", "--json"]);
    let (code, stdout, out) = inbox_test_support::process::run_split(cmd, Duration::from_secs(30));
    assert_eq!(code, 0, "{out}");
    let listed: serde_json::Value =
        serde_json::from_str(&stdout).expect("needs-review --json prints one JSON document");
    assert_eq!(listed["rows"][0]["event_id"], "evt_poison", "{out}");
    assert!(listed["rows"][0]["last_error"].as_str().unwrap().contains("amount_paid"), "{out}");
    let (code, out) = operator(&db, &["stats", "--json"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("\"needs_review\": 1"), "{out}");

    // The fix (here: the payload is corrected), then requeue: processed by the running worker.
    client
        .execute("UPDATE webhook_inbox SET payload = jsonb_set(payload, '{data,object,amount_paid}', '100') WHERE event_id = 'evt_poison'", &[])
        .await
        .unwrap();
    let (code, out) = operator(&db, &["requeue", "--event-id", "evt_poison", "--actor", "alice"]);
    assert_eq!(code, 0, "{out}");
    assert!(all_processed(&client, Duration::from_secs(10)).await, "{}", w.output());
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 2);
    let audit = client.query_one("SELECT actor, action, affected FROM operator_audit", &[]).await.unwrap();
    assert_eq!(
        (audit.get::<_, String>(0), audit.get::<_, String>(1), audit.get::<_, i32>(2)),
        ("alice".into(), "requeue".into(), 1)
    );
}

/// With its defaults (256 events in flight, 32 MiB of payload), a worker draining events of
/// 1 MiB holds the bytes, not the count: its peak memory stays far below the 256 MiB of the pod
/// it ships in, where 256 such events in flight would need several times that.
#[tokio::test]
async fn a_worker_with_default_flags_drains_one_mib_events_within_its_memory_budget() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload)
             SELECT 'stripe', 'billing', 'evt_big_' || i, 'invoice.paid',
                    jsonb_build_object('id', 'evt_big_' || i, 'object', 'event', 'type', 'invoice.paid',
                        'data', jsonb_build_object('object', jsonb_build_object(
                            'id', 'in_big_' || i, 'object', 'invoice', 'customer', 'cus_1', 'amount_paid', 100,
                            'description', repeat(md5(i::text), 32768))))
               FROM generate_series(1, 120) AS i;
             UPDATE webhook_inbox SET payload_bytes = octet_length(payload::text);",
        )
        .await
        .unwrap();
    let size = scalar(&client, "SELECT min(payload_bytes)::bigint FROM webhook_inbox").await;
    assert!(size > 1 << 20, "each event is over 1 MiB: {size}");

    let w = start(worker(&db, &[]));
    assert!(all_processed(&client, Duration::from_secs(60)).await, "{}", w.output());
    let (_, peak_kib) = rss_kib(w.child.id()).expect("the worker runs");
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 120);
    // 32 MiB of payloads in flight, each read once from the wire and held once as text, plus the
    // process itself (a debug build): well under 160 MiB.
    assert!(peak_kib < 160 * 1024, "peak RSS {} MiB", peak_kib / 1024);
}

/// Logs a file or a collector can read: text logs off a terminal carry no colour codes, and
/// durations are rounded to a tenth of a millisecond, in both formats.
#[tokio::test]
async fn logs_off_a_terminal_are_plain_text_with_rounded_durations_and_the_events_span_once() {
    let db = TestDb::new().await;
    let client = db.client().await;
    for format in ["text", "json"] {
        let id = format!("evt_log_{format}");
        store_event(&client, "billing", &invoice_paid(&id, &format!("in_{format}"), 100)).await;
        let mut cmd = worker(&db, &[]);
        cmd.env("LOG_FORMAT", format);
        let proc = start(cmd);
        let line = proc.wait_for_line("event done", Duration::from_secs(30));
        let output = proc.output();
        assert!(
            !output.contains('\u{1b}'),
            "no ANSI escape codes in a {format} log off a terminal:\n{output}"
        );
        let elapsed = match format {
            "text" => line
                .split_whitespace()
                .find_map(|field| field.strip_prefix("elapsed_ms="))
                .unwrap_or_else(|| panic!("no elapsed_ms in {line}"))
                .to_owned(),
            _ => {
                let value: serde_json::Value = serde_json::from_str(&line).unwrap();
                // The event's span once, under "span": not again in a list of every span.
                assert_eq!(value["span"]["event_id"], id.as_str(), "the event's span: {line}");
                assert!(value.get("spans").is_none(), "one copy of the span's fields per line: {line}");
                value["elapsed_ms"].to_string()
            }
        };
        let decimals = elapsed.split_once('.').map_or(0, |(_, d)| d.len());
        assert!(decimals <= 1, "elapsed_ms={elapsed} is rounded to a tenth: {line}");
        drop(proc);
    }
}

/// A JSON line from a crate that logs through `log` (refinery's migrations, tokio-postgres's
/// notices) names that crate as its target, so `RUST_LOG=refinery_core=warn` and a collector's
/// filter agree on it; "log", the bridge's own target, would name every such crate alike.
#[tokio::test]
async fn a_json_line_from_a_crate_logging_through_log_names_that_crate_as_its_target() {
    let db = TestDb::empty().await;
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", db.url()).env("LOG_FORMAT", "json").env("RUST_LOG", "info").arg("migrate");
    let (code, output) = run(cmd, Duration::from_secs(60));
    assert_eq!(code, 0, "{output}");
    let lines = json_lines(&output);
    let applying = lines.iter().find(|l| l["message"] == "applying migration: V1__inbox_schema");
    let applying = applying.unwrap_or_else(|| panic!("no line for V1:\n{output}"));
    assert_eq!(applying["target"], "refinery_core::traits::r#async", "{applying}");
    assert_eq!(applying["level"], "INFO", "{applying}");
}
