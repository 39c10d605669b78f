//! `inbox-worker reconcile` against a local stand-in for Stripe's API (`stripe_api`), fed with
//! Stripe's own invoice fixture: it stores exactly the events the inbox lacks, once, whatever
//! arrives meanwhile or fails mid-way, and the worker then applies each once.

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use inbox_test_support::app::{spawn_app_with, TestApp};
use inbox_test_support::db::{column, scalar};
use inbox_test_support::events::{now, sign, SECRET_A};
use inbox_test_support::process::{command, run_split, Proc};
use inbox_test_support::stripe_api::{Fault, StripeApi};
use inbox_test_support::stripe_fixtures::{resource, snapshot_event};
use inbox_test_support::TestDb;
use serde_json::{json, Value};

/// The key the stand-in accepts: a restricted live-looking key, so that a leak would be visible.
const KEY: &str = "rk_test_51InboxReconcileKeyThatMustNeverBeLogged";
const TIMEOUT: Duration = Duration::from_secs(120);

/// `n` events as Stripe lists them: `n / 2` invoices from Stripe's fixture, each finalized then
/// paid, created over the last hour (one second apart), oldest first.
fn invoice_events(n: usize) -> Vec<Value> {
    let start = now() - 3600;
    (0..n)
        .map(|i| {
            let invoice_id = format!("in_rec{:05}", i / 2);
            let event_type = if i % 2 == 0 { "invoice.finalized" } else { "invoice.paid" };
            let mut invoice = resource("invoice");
            invoice["id"] = json!(invoice_id);
            invoice["status"] = json!(if i % 2 == 0 { "open" } else { "paid" });
            if i % 2 == 1 {
                invoice["amount_paid"] = invoice["amount_due"].clone();
                invoice["amount_remaining"] = json!(0);
            }
            snapshot_event(&format!("evt_rec{i:05}"), event_type, invoice, start + i as i64)
        })
        .collect()
}

/// The ingest in-process on a fresh database, endpoint `billing` signed with secret A.
async fn ingest() -> TestApp {
    spawn_app_with(TestDb::new().await, |_| {}).await
}

/// Sends `events` as signed webhooks to `billing`, 32 at a time; returns each answer's status and
/// body `status` ("accepted" or "duplicate").
async fn send(app: &TestApp, events: &[&Value]) -> Vec<(u16, String)> {
    let mut answers = Vec::new();
    for chunk in events.chunks(32) {
        let posts = chunk.iter().map(|event| async move {
            let body = serde_json::to_vec(event).unwrap();
            let signature = sign(SECRET_A, &body);
            app.post("billing", Some(&signature), body).await
        });
        for reply in futures_util::future::join_all(posts).await {
            answers.push((reply.status, reply.body["status"].as_str().unwrap_or_default().to_owned()));
        }
    }
    answers
}

/// `inbox-worker reconcile --endpoint billing <flags>` against `api`, logging at debug level (so
/// that the test sees every line a key could leak into).
fn reconcile(db: &TestDb, api: &StripeApi, flags: &[&str]) -> Command {
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", db.url())
        .env("USER", "tester")
        .env("STRIPE_API_KEY", KEY)
        .env("STRIPE_API_BASE", api.base_url())
        .env("RUST_LOG", "debug")
        .args(["reconcile", "--endpoint", "billing", "--since", "2h"])
        .args(flags);
    cmd
}

/// Runs reconcile with `--json`; returns (exit code, the report or Null, all output). Asserts that
/// the key appears nowhere in what it printed.
async fn run_reconcile(db: &TestDb, api: &StripeApi, flags: &[&str]) -> (i32, Value, String) {
    let mut cmd = reconcile(db, api, flags);
    cmd.arg("--json");
    let (code, stdout, output) = tokio::task::spawn_blocking(move || run_split(cmd, TIMEOUT)).await.unwrap();
    assert!(!output.contains(KEY) && !output.contains(&KEY[8..]), "the API key leaked:\n{output}");
    let report = serde_json::from_str(&stdout).unwrap_or(Value::Null);
    (code, report, output)
}

/// Event ids of the rows stored for `billing` with `source` = `source`.
async fn stored(db: &TestDb, source: &str) -> BTreeSet<String> {
    let client = db.client().await;
    column::<String>(
        &client,
        &format!("SELECT event_id FROM webhook_inbox WHERE endpoint = 'billing' AND source = '{source}'"),
    )
    .await
    .into_iter()
    .collect()
}

/// Runs `inbox-worker run` until every row is processed, then stops it.
async fn process_all(db: &TestDb, rows: i64) {
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", db.url()).args(["run", "--poll-interval", "100ms"]);
    let mut worker = Proc::spawn(cmd);
    let client = db.client().await;
    let done = inbox_test_support::worker::eventually(Duration::from_secs(60), || async {
        scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NOT NULL").await == rows
    })
    .await;
    worker.signal(libc::SIGTERM);
    worker.wait(Duration::from_secs(30));
    assert!(done, "the worker did not process all {rows} rows:\n{}", worker.output());
}

#[tokio::test]
async fn reconcile_stores_exactly_the_events_stripe_never_sent_and_a_second_run_stores_none() {
    let app = ingest().await;
    let api = StripeApi::start(KEY).await;
    let events = invoice_events(1000);
    api.add_events(events.iter().cloned());
    // 137 of the 1,000 never arrive as webhooks (an outage); the others do.
    let missing: BTreeSet<String> = (0..137).map(|i| format!("evt_rec{:05}", i * 7 % 1000)).collect();
    let sent: Vec<&Value> = events.iter().filter(|e| !missing.contains(e["id"].as_str().unwrap())).collect();
    let answers = send(&app, &sent).await;
    assert!(answers.iter().all(|(status, body)| *status == 200 && body == "accepted"), "{answers:?}");
    // Stripe's API misbehaves mid-way: rate limited (with Retry-After), then a 500.
    api.fail_nth("/v1/events", 3, Fault::RateLimited { retry_after: Some(1) });
    api.fail_nth("/v1/events", 6, Fault::ServerError);

    let (code, report, output) = run_reconcile(&app.db, &api, &[]).await;
    assert_eq!(code, 0, "{output}");
    assert_eq!(
        (&report["found"], &report["already_present"], &report["inserted"], &report["skipped_no_handler"]),
        (&json!(1000), &json!(863), &json!(137), &json!(0)),
        "{report}"
    );
    assert_eq!(stored(&app.db, "api").await, missing, "exactly the missing events, from the API");
    assert_eq!(stored(&app.db, "webhook").await.len(), 863);
    let statuses: Vec<u16> =
        api.requests().iter().filter(|r| r.path == "/v1/events").map(|r| r.status).collect();
    assert!(statuses.contains(&429) && statuses.contains(&500), "the faults happened: {statuses:?}");
    let retried_the_page =
        api.requests().iter().filter(|r| r.path == "/v1/events" && r.status == 200).count();
    assert_eq!(retried_the_page, 10, "ten pages of 100, each answered once: {statuses:?}");

    // The worker applies every event once: each row processed at its first attempt, one payment
    // booked per invoice.
    process_all(&app.db, 1000).await;
    let client = app.db.client().await;
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE attempts <> 1").await, 0);
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 500);
    assert_eq!(scalar(&client, "SELECT count(*) FROM invoices WHERE status = 'paid'").await, 500);

    let (code, again, output) = run_reconcile(&app.db, &api, &[]).await;
    assert_eq!(code, 0, "{output}");
    assert_eq!((&again["inserted"], &again["already_present"]), (&json!(0), &json!(1000)), "{again}");
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox").await, 1000);
    let audits =
        column::<i32>(&client, "SELECT affected FROM operator_audit WHERE action = 'reconcile' ORDER BY id")
            .await;
    assert_eq!(audits, [137, 0]);
}

#[tokio::test]
async fn a_webhook_arriving_while_reconcile_runs_is_stored_once_and_counted_once() {
    let app = ingest().await;
    let api = StripeApi::start(KEY).await;
    let events = invoice_events(300);
    api.add_events(events.iter().cloned());
    // Every page answers after 300 ms: the webhooks below arrive while reconcile walks, from the
    // moment its first page is stored.
    api.fail_every("/v1/events", 1, Fault::Stall(Duration::from_millis(300)));
    let cmd = {
        let mut cmd = reconcile(&app.db, &api, &["--json"]);
        cmd.env("RUST_LOG", "info");
        cmd
    };
    let walking = tokio::task::spawn_blocking(move || run_split(cmd, TIMEOUT));
    let client = app.db.client().await;
    let first_page = inbox_test_support::worker::eventually(Duration::from_secs(30), || async {
        scalar(&client, "SELECT count(*) FROM webhook_inbox").await > 0
    })
    .await;
    assert!(first_page);
    let all: Vec<&Value> = events.iter().rev().collect();
    let answers = send(&app, &all).await;
    let (code, stdout, output) = walking.await.unwrap();
    assert_eq!(code, 0, "{output}");
    let report: Value = serde_json::from_str(&stdout).unwrap();

    assert!(answers.iter().all(|(status, _)| *status == 200), "{answers:?}");
    let accepted = answers.iter().filter(|(_, body)| body == "accepted").count() as i64;
    let inserted = report["inserted"].as_i64().unwrap();
    assert_eq!(accepted + inserted, 300, "each event stored by exactly one of the two: {report}");
    assert_eq!(stored(&app.db, "api").await.len() as i64, inserted);
    assert_eq!(app.db.count("webhook_inbox").await, 300);
    assert!(
        accepted > 0 && inserted > 0,
        "both paths stored some (the race happened): {accepted} / {inserted}"
    );
}

#[tokio::test]
async fn a_reconcile_stopped_mid_way_resumes_at_its_last_committed_page() {
    let app = ingest().await;
    let api = StripeApi::start(KEY).await;
    let events = invoice_events(450);
    api.add_events(events.iter().cloned());
    // The key is revoked while page 3 is asked for: two pages are stored, then the run stops.
    api.fail_nth("/v1/events", 3, Fault::Unauthorized);
    let (code, _, output) = run_reconcile(&app.db, &api, &[]).await;
    assert_eq!(code, 1, "{output}");
    assert!(
        output.contains("401 Unauthorized") && output.contains("req_"),
        "names the status and the request id:\n{output}"
    );
    assert!(output.contains("run the same command again to resume it"), "{output}");
    assert_eq!(app.db.count("webhook_inbox").await, 200, "the two committed pages");

    api.reset_requests();
    let (code, report, output) = run_reconcile(&app.db, &api, &[]).await;
    assert_eq!(code, 0, "{output}");
    assert!(output.contains("resuming run"), "{output}");
    assert_eq!(report["resumed"], json!(true), "{report}");
    assert_eq!(
        (&report["found"], &report["inserted"], &report["pages"]),
        (&json!(450), &json!(450), &json!(5)),
        "{report}"
    );
    let first = api.requests().into_iter().find(|r| r.path == "/v1/events").unwrap();
    // Newest first: the 200 newest were stored, so the walk goes on after the 200th newest.
    assert!(first.query.contains("starting_after=evt_rec00250"), "resumed at the cursor: {}", first.query);
    assert_eq!(app.db.count("webhook_inbox").await, 450);
}

#[tokio::test]
async fn a_killed_reconcile_holds_its_run_for_the_lease_then_the_next_one_resumes_it() {
    let app = ingest().await;
    let api = StripeApi::start(KEY).await;
    api.add_events(invoice_events(300));
    // Page 3 takes long: the process is killed while it waits.
    api.fail_nth("/v1/events", 3, Fault::Stall(Duration::from_secs(20)));
    let mut first = Proc::spawn(reconcile(&app.db, &api, &["--lease", "3s"]));
    let client = app.db.client().await;
    let two_pages = inbox_test_support::worker::eventually(Duration::from_secs(30), || async {
        scalar(&client, "SELECT count(*) FROM webhook_inbox").await == 200
    })
    .await;
    assert!(two_pages, "{}", first.output());
    first.signal(libc::SIGKILL);
    first.wait(Duration::from_secs(10));

    let (code, _, output) = run_reconcile(&app.db, &api, &["--lease", "3s"]).await;
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("another reconcile of endpoint billing is running"), "{output}");
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (code, report, output) = run_reconcile(&app.db, &api, &["--lease", "3s"]).await;
    assert_eq!(code, 0, "{output}");
    assert_eq!(
        (&report["resumed"], &report["found"], &report["inserted"]),
        (&json!(true), &json!(300), &json!(300))
    );
    assert_eq!(app.db.count("webhook_inbox").await, 300);
}

#[tokio::test]
async fn a_dry_run_with_types_asks_stripe_for_those_types_and_writes_nothing() {
    let app = ingest().await;
    let api = StripeApi::start(KEY).await;
    api.add_events(invoice_events(100));
    let (code, report, output) =
        run_reconcile(&app.db, &api, &["--dry-run", "--types", "invoice.paid"]).await;
    assert_eq!(code, 0, "{output}");
    assert_eq!(
        (&report["found"], &report["inserted"], &report["run"]),
        (&json!(50), &json!(50), &Value::Null)
    );
    assert_eq!(app.db.count("webhook_inbox").await, 0);
    assert_eq!(app.db.count("reconcile_runs").await, 0);
    let request = api.requests().into_iter().find(|r| r.path == "/v1/events").unwrap();
    assert!(request.query.contains("types%5B%5D=invoice.paid"), "{}", request.query);
}

#[tokio::test]
async fn a_key_stripe_refuses_is_named_with_the_request_id_and_never_echoed() {
    let app = ingest().await;
    let api = StripeApi::start("rk_test_theRightKeyIsAnotherOne000000000").await;
    api.add_events(invoice_events(10));
    let (code, _, output) = run_reconcile(&app.db, &api, &[]).await;
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("401 Unauthorized: the API key is wrong, revoked or expired"), "{output}");
    assert!(output.contains("req_"), "{output}");

    // A key of the wrong kind is refused before anything is sent, without echoing it.
    let mut cmd = reconcile(&app.db, &api, &[]);
    cmd.env("STRIPE_API_KEY", "pk_live_notASecretKeyButStillNotToBeEchoed");
    let (code, _, output) = tokio::task::spawn_blocking(move || run_split(cmd, TIMEOUT)).await.unwrap();
    assert_eq!(code, 1);
    assert!(output.contains("publishable key") && !output.contains("notASecretKey"), "{output}");
    assert_eq!(app.db.count("webhook_inbox").await, 0);
}
