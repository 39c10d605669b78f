//! What cannot be recovered becomes work for a person: an event Stripe failed to generate
//! (`v2.core.health.event_generation_failure.resolved`) is one reconciliation item naming the
//! object to re-fetch, however often it is processed; `inbox-worker reconciliation` lists the open
//! items (a payment on a voided invoice among them) and `reconciliation resolve` closes one, once,
//! with its audit record; the worker's gauge counts the open ones. The binaries run as processes,
//! as operators run them.

use std::time::Duration;

use inbox_domain::handler::Registry;
use inbox_domain::health::EVENT_GENERATION_FAILURE_RESOLVED;
use inbox_test_support::db::scalar;
use inbox_test_support::events::{invoice_event, invoice_paid, sign, SECRET_C};
use inbox_test_support::process::{command, run, start_worker_with_metrics};
use inbox_test_support::stripe_fixtures::{thin_event, Related};
use inbox_test_support::worker::{eventually, spawn_worker, store_event};
use inbox_test_support::{spawn_app, TestDb};
use serde_json::Value;
use tokio_postgres::Client;

const TIMEOUT: Duration = Duration::from_secs(60);
/// The object whose event Stripe failed to generate, and the connected account it belongs to.
const LOST_OBJECT: &str = "pi_1QA8PKDTvO5jCVb3TVDZP75a";
const LOST_OBJECT_URL: &str = "/v1/payment_intents/pi_1QA8PKDTvO5jCVb3TVDZP75a";
const ACCOUNT: &str = "acct_1HealthConnected";

/// The announcement, built to Stripe's `v2.core.event` schema.
fn failure_announced(event_id: &str) -> Value {
    let related = Related { id: LOST_OBJECT, object_type: "payment_intent", url: LOST_OBJECT_URL };
    thin_event(
        event_id,
        EVENT_GENERATION_FAILURE_RESOLVED,
        related,
        Some(ACCOUNT),
        "2026-10-30T16:05:44.000Z",
    )
}

/// `inbox-worker <args>` on `db` with `USER=tester`; returns (exit code, stdout + stderr).
async fn exec(db: &TestDb, args: &[&str]) -> (i32, String) {
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", db.url()).env("USER", "tester").args(args);
    tokio::task::spawn_blocking(move || run(cmd, TIMEOUT)).await.unwrap()
}

async fn ok(db: &TestDb, args: &[&str]) -> String {
    let (code, output) = exec(db, args).await;
    assert_eq!(code, 0, "inbox-worker {args:?} failed:\n{output}");
    output
}

/// `<args> --json`, which must succeed: its stdout parsed (one document).
async fn json_of(db: &TestDb, args: &[&str]) -> Value {
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", db.url()).env("USER", "tester").args(args).arg("--json");
    let output = tokio::task::spawn_blocking(move || cmd.output()).await.unwrap().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{args:?} --json: {stdout}{}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not one JSON document ({e}):\n{stdout}"))
}

/// The items of `reason`: (id, object_type, object_id, object_url, detail).
async fn items(
    client: &Client,
    reason: &str,
) -> Vec<(i64, Option<String>, Option<String>, Option<String>, Value)> {
    client
        .query(
            "SELECT id, object_type, object_id, object_url, detail FROM reconciliation_items
              WHERE reason = $1 ORDER BY id",
            &[&reason],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect()
}

async fn all_processed(client: &Client) -> bool {
    scalar(client, "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NULL").await == 0
}

#[tokio::test]
async fn an_event_stripe_failed_to_generate_is_one_item_naming_the_object_whatever_the_redeliveries_endpoints_and_replays(
) {
    let app = spawn_app().await;
    let client = app.db.client().await;
    let body = serde_json::to_vec(&failure_announced("evt_health_1")).unwrap();
    // Stripe delivers it, delivers it again (stored once), and the same event reaches a second
    // endpoint (a row of its own there, processed on its own).
    assert_eq!(app.post_signed(body.clone()).await.body["status"], "accepted");
    assert_eq!(app.post_signed(body.clone()).await.body["status"], "duplicate");
    let second = app.post("analytics", Some(&sign(SECRET_C, &body)), body.clone()).await;
    assert_eq!(second.body["status"], "accepted", "{}", second.text);
    // And a payment on a voided invoice: voided first, then paid.
    let voided = invoice_event("evt_void_1", "invoice.voided", "in_void_1", "void", 0);
    assert_eq!(app.post_signed(voided).await.status, 200);

    let mut worker = command("inbox-worker");
    worker.env("DATABASE_URL", app.db.url()).args([
        "run",
        "--poll-interval",
        "100ms",
        "--metrics-listen",
        "127.0.0.1:0",
    ]);
    let (worker, metrics_address) = start_worker_with_metrics(worker);
    assert!(
        eventually(Duration::from_secs(20), || all_processed(&client)).await,
        "not processed: {}",
        worker.output()
    );
    assert_eq!(app.post_signed(invoice_paid("evt_void_2", "in_void_1", 4200)).await.status, 200);
    assert!(eventually(Duration::from_secs(20), || all_processed(&client)).await, "{}", worker.output());

    let failures = items(&client, "event_generation_failure").await;
    assert_eq!(failures.len(), 1, "one item for the two endpoints' rows: {failures:?}");
    let (id, object_type, object_id, object_url, detail) = failures[0].clone();
    assert_eq!(
        (object_type.as_deref(), object_id.as_deref(), object_url.as_deref()),
        (Some("payment_intent"), Some(LOST_OBJECT), Some(LOST_OBJECT_URL)),
        "the item names the object to re-fetch"
    );
    assert_eq!(detail["account"], ACCOUNT, "{detail}");
    assert_eq!(detail["event_url"], "/v2/core/events/evt_health_1", "{detail}");
    assert!(["billing", "analytics"].contains(&detail["endpoint"].as_str().unwrap()), "{detail}");
    let invoice_id: Option<String> = client
        .query_one("SELECT invoice_id FROM reconciliation_items WHERE id = $1", &[&id])
        .await
        .unwrap()
        .get(0);
    assert_eq!(invoice_id, None, "not about an invoice");
    assert_eq!(items(&client, "payment_on_void_invoice").await.len(), 1);

    // A replay runs the handler again: still one item, the same.
    ok(&app.db, &["replay", "--event-id", "evt_health_1", "--endpoint", "billing", "--actor", "alice"]).await;
    ok(&app.db, &["replay", "--event-id", "evt_health_1", "--endpoint", "analytics", "--actor", "alice"])
        .await;
    assert_eq!(items(&client, "event_generation_failure").await, failures, "a replay adds no item");

    // The listing shows both open items, the object to fetch and the invoice.
    let listing = ok(&app.db, &["reconciliation"]).await;
    for needle in [
        &format!("payment_intent {LOST_OBJECT}") as &str,
        LOST_OBJECT_URL,
        "invoice in_void_1",
        "event_generation_failure",
        "payment_on_void_invoice",
        "2 open items",
    ] {
        assert!(listing.contains(needle), "the listing lacks {needle:?}:\n{listing}");
    }

    // The worker's gauge counts them, and follows a resolution.
    let http = inbox_test_support::app::http_client();
    let gauge_reads = |expected: &'static str| {
        let (http, address) = (http.clone(), metrics_address.clone());
        async move {
            let text =
                http.get(format!("http://{address}/metrics")).send().await.unwrap().text().await.unwrap();
            text.lines().any(|line| line == format!("inbox_reconciliation_items_open {expected}"))
        }
    };
    assert!(eventually(Duration::from_secs(20), || gauge_reads("2")).await, "the gauge never read 2");
    ok(
        &app.db,
        &["reconciliation", "resolve", "--id", &id.to_string(), "--note", "re-fetched the PaymentIntent"],
    )
    .await;
    assert!(eventually(Duration::from_secs(20), || gauge_reads("1")).await, "the gauge never read 1");
}

#[tokio::test]
async fn resolve_closes_an_open_item_once_with_its_audit_record_and_the_default_listing_leaves_it_out() {
    let db = TestDb::new().await;
    let client = db.client().await;
    store_event(&client, "billing", &serde_json::to_vec(&failure_announced("evt_health_2")).unwrap()).await;
    // As Stripe's webhook may carry it: the envelope alone, no object named.
    let mut bare = failure_announced("evt_health_3");
    bare.as_object_mut().unwrap().remove("related_object");
    store_event(&client, "billing", &serde_json::to_vec(&bare).unwrap()).await;
    let worker = spawn_worker(&db, Registry::with_invoice_handlers(), |_| {}).await;
    assert!(eventually(Duration::from_secs(20), || all_processed(&client)).await, "not processed");
    worker.stop().await;

    let listed = json_of(&db, &["reconciliation"]).await;
    assert_eq!((listed["count"].as_u64(), listed["open"].as_u64()), (Some(2), Some(2)), "{listed}");
    let by_event = |event_id: &str| {
        listed["items"].as_array().unwrap().iter().find(|i| i["event_id"] == event_id).cloned().unwrap()
    };
    let named = by_event("evt_health_2");
    let nameless = by_event("evt_health_3");
    assert_eq!((named["object_id"].as_str(), named["resolved_at"].as_null()), (Some(LOST_OBJECT), Some(())));
    assert_eq!(
        (nameless["object_id"].as_null(), nameless["detail"]["event_url"].as_str()),
        (Some(()), Some("/v2/core/events/evt_health_3")),
        "an announcement naming no object still makes an item, saying where to read the alert: {nameless}"
    );
    let table = ok(&db, &["reconciliation"]).await;
    assert!(
        table.contains("/v2/core/events/evt_health_3"),
        "what to fetch when no object is named:\n{table}"
    );

    let id = named["id"].as_i64().unwrap().to_string();
    let note = "re-fetched pi_1QA8…: requires_action, customer emailed";
    let output =
        ok(&db, &["reconciliation", "resolve", "--id", &id, "--note", note, "--actor", "alice"]).await;
    assert!(
        output.contains(&format!("resolved reconciliation item {id} (event_generation_failure")),
        "{output}"
    );
    let audit = client
        .query_one("SELECT actor, action, target, affected FROM operator_audit ORDER BY id DESC LIMIT 1", &[])
        .await
        .unwrap();
    let target: Value = audit.get(2);
    assert_eq!(
        (
            audit.get::<_, String>(0),
            audit.get::<_, String>(1),
            target["id"].to_string(),
            audit.get::<_, i32>(3)
        ),
        ("alice".to_owned(), "resolve-reconciliation".to_owned(), id.clone(), 1)
    );
    assert_eq!(target["note"], note);

    let open = json_of(&db, &["reconciliation"]).await;
    assert_eq!(open["count"], 1, "the resolved item left the default listing: {open}");
    assert_eq!(open["items"][0]["event_id"], "evt_health_3");
    let all = json_of(&db, &["reconciliation", "--all"]).await;
    assert_eq!((all["count"].as_u64(), all["open"].as_u64()), (Some(2), Some(1)), "{all}");
    let resolved = &all["items"][1];
    assert_eq!(
        (resolved["id"].to_string(), resolved["resolved_by"].as_str(), resolved["resolution_note"].as_str()),
        (id.clone(), Some("alice"), Some(note)),
        "--all lists it after the open ones, with who closed it and how: {all}"
    );
    let table = ok(&db, &["reconciliation", "--all"]).await;
    assert!(table.contains("2 items (1 open)") && table.contains("alice"), "{table}");

    // Refusals: resolving it again, an unknown id (exit 1, saying why); a note that says nothing
    // (a usage error, exit 2). None writes an audit record.
    let (code, output) = exec(&db, &["reconciliation", "resolve", "--id", &id, "--note", "again"]).await;
    assert_eq!(code, 1, "{output}");
    assert!(
        output.contains(&format!(
            "reconciliation item {id} (event_generation_failure) was already resolved at"
        )) && output.contains("by alice"),
        "{output}"
    );
    let (code, output) = exec(&db, &["reconciliation", "resolve", "--id", "999999", "--note", "x"]).await;
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("no reconciliation item 999999"), "{output}");
    let nameless_id = nameless["id"].to_string();
    let (code, output) =
        exec(&db, &["reconciliation", "resolve", "--id", &nameless_id, "--note", "  "]).await;
    assert_eq!(code, 2, "{output}");
    assert!(output.contains("the note must say what was done"), "{output}");
    assert_eq!(scalar(&client, "SELECT count(*) FROM operator_audit").await, 1, "refusals are not audited");
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM reconciliation_items WHERE resolved_at IS NULL").await,
        1,
        "the nameless item is still open"
    );

    // JSON of a resolution.
    let report = json_of(
        &db,
        &["reconciliation", "resolve", "--id", &nameless_id, "--note", "read the alert in Workbench"],
    )
    .await;
    assert_eq!(
        (report["action"].as_str(), report["id"].to_string(), report["resolved_by"].as_str()),
        (Some("resolve-reconciliation"), nameless_id, Some("tester"))
    );
    assert!(ok(&db, &["reconciliation"]).await.contains("no open reconciliation items"));
}
