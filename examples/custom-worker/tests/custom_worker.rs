//! `custom-worker` end to end: the built binary (and `inbox-ingest`) as processes against a
//! database of their own, with subscription events built from Stripe's own `subscription`
//! fixture (`fixtures/subscription.json`) and thin events built to Stripe's `v2.core.event` schema
//! (`inbox_test_support::stripe_fixtures::thin_event`, which checks each against the schema),
//! signed and posted over HTTP the way Stripe does (or stored as the ingest stores them). The
//! objects thin events name are served to `custom-worker fetch` by a stand-in for Stripe's API
//! (`inbox_test_support::stripe_api`), which counts the GETs and fails on cue.
//!
//! Needs `DATABASE_URL` (`make test`, or `scripts/with-db.sh cargo nextest run -p custom-worker`)
//! and the binaries built (`make build`).

use std::process::Command;
use std::time::{Duration, SystemTime};

use inbox_test_support::app::raw_request;
use inbox_test_support::db::{column, scalar};
use inbox_test_support::events::{invoice_paid, now, sign, SECRET_A};
use inbox_test_support::process::{command, run, run_split, start_ingest, Proc};
use inbox_test_support::stripe_api::{Fault, StripeApi};
use inbox_test_support::stripe_fixtures::{assert_matches_thin_event_schema, resource, thin_event, Related};
use inbox_test_support::worker::{eventually, store_event};
use inbox_test_support::TestDb;
use serde_json::{json, Value};
use tokio_postgres::Client;

/// SIGTERM: how operators (and Kubernetes) stop a worker.
const SIGTERM: i32 = 15;
/// The price of the fixture's only item: what this product sells in these tests.
const OUR_PRICE: &str = "price_1PgafmB7WZ01zgkW6dKueIc5";
/// Another product's price on the same Stripe account.
const OTHER_PRICE: &str = "price_1OtherProductMonthly";
/// Bound of every wait on a process or on the database.
const TIMEOUT: Duration = Duration::from_secs(20);

// ---- Events ---------------------------------------------------------------------------------

/// Stripe's `subscription` fixture, unchanged.
fn fixture() -> Value {
    serde_json::from_str(include_str!("fixtures/subscription.json")).expect("the fixture is JSON")
}

/// The fixture as subscription `id` in `status`, paid by `cus_<id without sub_>`, with one item at
/// each of `prices`, not canceled.
fn subscription(id: &str, status: &str, prices: &[&str]) -> Value {
    let mut sub = fixture();
    let template = sub["items"]["data"][0].clone();
    let items: Vec<Value> = prices
        .iter()
        .enumerate()
        .map(|(n, price)| {
            let mut item = template.clone();
            item["id"] = json!(format!("si_{n}{}", id.trim_start_matches("sub_")));
            item["subscription"] = json!(id);
            item["price"]["id"] = json!(price);
            item
        })
        .collect();
    sub["id"] = json!(id);
    sub["status"] = json!(status);
    sub["customer"] = json!(customer_of(id));
    sub["items"]["data"] = json!(items);
    sub["items"]["url"] = json!(format!("/v1/subscription_items?subscription={id}"));
    for field in ["cancel_at", "canceled_at", "ended_at"] {
        sub[field] = Value::Null;
    }
    sub["cancel_at_period_end"] = json!(false);
    sub
}

/// The customer [`subscription`] gives subscription `id`.
fn customer_of(id: &str) -> String {
    format!("cus_{}", id.trim_start_matches("sub_"))
}

/// `sub` canceled at `canceled_at`, ended at `ended_at` (unix seconds), as Stripe renders it in
/// `customer.subscription.deleted`.
fn canceled(mut sub: Value, canceled_at: i64, ended_at: i64) -> Value {
    sub["status"] = json!("canceled");
    sub["canceled_at"] = json!(canceled_at);
    sub["ended_at"] = json!(ended_at);
    sub
}

/// A Stripe event of `event_type` about `object`, as Stripe sends it.
fn event(event_id: &str, event_type: &str, object: &Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "id": event_id,
        "object": "event",
        "api_version": "2026-07-29.dahlia",
        "created": now(),
        "data": { "object": object },
        "livemode": false,
        "pending_webhooks": 1,
        "request": { "id": null, "idempotency_key": null },
        "type": event_type
    }))
    .unwrap()
}

/// The thin event type about a billing meter (a v1 object).
const METER_ERROR: &str = "v1.billing.meter.error_report_triggered";
/// The thin event type about an Accounts v2 account.
const ACCOUNT_UPDATED: &str = "v2.core.account.updated";

/// A billing meter as a thin event's `related_object`.
fn meter(id: &str) -> (String, &'static str, String) {
    (id.to_owned(), "billing.meter", format!("/v1/billing/meters/{id}"))
}

/// An Accounts v2 account as a thin event's `related_object`.
fn account(id: &str) -> (String, &'static str, String) {
    (id.to_owned(), "v2.core.account", format!("/v2/core/accounts/{id}"))
}

/// A thin event (`"object": "v2.core.event"`) of `event_type` about `related` (id, type, url), on
/// the connected account `context` if any, as Stripe sends it: no `data.object`, `created` as RFC
/// 3339 text.
fn thin(event_id: &str, event_type: &str, related: &(String, &str, String), context: Option<&str>) -> Value {
    let (id, object_type, url) = related;
    thin_event(event_id, event_type, Related { id, object_type, url }, context, "2026-10-01T12:00:00.000Z")
}

fn bytes(event: &Value) -> Vec<u8> {
    serde_json::to_vec(event).unwrap()
}

/// Stripe's `billing.meter` resource fixture as meter `id`, in test mode, named `display_name`:
/// what `GET /v1/billing/meters/{id}` answers.
fn meter_object(id: &str, display_name: &str) -> Value {
    let mut meter = resource("billing.meter");
    meter["id"] = json!(id);
    meter["livemode"] = json!(false);
    meter["display_name"] = json!(display_name);
    meter
}

/// `meter` deactivated at `at` (unix seconds), as Stripe renders it afterwards.
fn deactivated(mut meter: Value, at: i64) -> Value {
    meter["status"] = json!("inactive");
    meter["status_transitions"]["deactivated_at"] = json!(at);
    meter["updated"] = json!(at);
    meter
}

/// An Accounts v2 account as `GET /v2/core/accounts/{id}` answers it (the fields this example
/// could read; Stripe's fixtures have no v2 resources).
fn account_object(id: &str) -> Value {
    json!({
        "id": id,
        "object": "v2.core.account",
        "applied_configurations": ["customer", "merchant"],
        "contact_email": "seller@example.com",
        "created": "2026-09-01T10:00:00.000Z",
        "dashboard": "express",
        "display_name": "A seller",
        "livemode": false,
        "metadata": {}
    })
}

// ---- Processes ------------------------------------------------------------------------------

/// `custom-worker <args>` on `db`, tracking only `OUR_PRICE`, with `USER=tester` (the audit's
/// actor).
fn custom_worker(db: &TestDb, args: &[&str]) -> Command {
    let mut cmd = command("custom-worker");
    cmd.env("DATABASE_URL", db.url()).env("SUBSCRIPTION_PRICES", OUR_PRICE).env("USER", "tester").args(args);
    cmd
}

/// Runs a command to completion off the async runtime; returns (exit code, stdout + stderr).
async fn exec(cmd: Command) -> (i32, String) {
    tokio::task::spawn_blocking(move || run(cmd, TIMEOUT)).await.unwrap()
}

/// Runs `custom-worker <args>`, which must succeed; returns its output.
async fn ok(db: &TestDb, args: &[&str]) -> String {
    let (code, output) = exec(custom_worker(db, args)).await;
    assert_eq!(code, 0, "custom-worker {args:?} failed:\n{output}");
    output
}

/// Runs `custom-worker <args> --json`, which must succeed, and parses its stdout.
async fn json_of(db: &TestDb, args: &[&str]) -> Value {
    let mut cmd = custom_worker(db, args);
    cmd.arg("--json");
    let (code, stdout, output) = tokio::task::spawn_blocking(move || run_split(cmd, TIMEOUT)).await.unwrap();
    assert_eq!(code, 0, "custom-worker {args:?} --json failed:\n{output}");
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not one JSON document ({e}):\n{stdout}"))
}

/// `cmd` (a worker) started and ready.
async fn start_ready(cmd: Command) -> Proc {
    tokio::task::spawn_blocking(move || {
        let proc = Proc::spawn(cmd);
        proc.wait_for_line("inbox-worker running", TIMEOUT);
        proc
    })
    .await
    .unwrap()
}

/// `custom-worker run` on `db`, started and ready.
async fn start_worker(db: &TestDb, flags: &[&str]) -> Proc {
    let mut cmd = custom_worker(db, &["run", "--poll-interval", "100ms"]);
    cmd.args(flags);
    start_ready(cmd).await
}

/// The restricted key the Stripe stand-in accepts.
const API_KEY: &str = "rk_test_51CustomWorkerReadsMetersAndAccounts";

/// `custom-worker fetch` on `db`, fetching from the Stripe stand-in `api` with [`API_KEY`] given
/// the way operators give it (`STRIPE_API_KEY`), started and ready.
async fn start_fetch(db: &TestDb, api: &StripeApi, flags: &[&str]) -> Proc {
    let mut cmd = custom_worker(db, &["fetch", "--poll-interval", "100ms"]);
    // Every log line, debug included, is checked for the key when the worker stops.
    cmd.env("STRIPE_API_KEY", API_KEY)
        .env("STRIPE_API_BASE", api.base_url())
        .env("RUST_LOG", "debug")
        .args(flags);
    start_ready(cmd).await
}

/// Stops a worker with SIGTERM; it must exit 0.
async fn stop_worker(mut worker: Proc) {
    worker.signal(SIGTERM);
    let (status, output) =
        tokio::task::spawn_blocking(move || (worker.wait(TIMEOUT), worker.output())).await.unwrap();
    assert_eq!(status.code(), Some(0), "SIGTERM must stop the worker cleanly:\n{output}");
    assert!(!output.contains(API_KEY) && !output.contains(&API_KEY[8..]), "the Stripe key leaked:\n{output}");
}

/// `inbox-ingest` on `db` with endpoint `billing` (secret A); returns it and its base URL.
async fn start_ingest_on(db: &TestDb) -> (Proc, String) {
    let mut cmd = command("inbox-ingest");
    cmd.env("DATABASE_URL", db.url())
        .env("INBOX_ENDPOINTS", format!("billing={SECRET_A}"))
        .env("INBOX_LISTEN", "127.0.0.1:0");
    tokio::task::spawn_blocking(move || start_ingest(cmd)).await.unwrap()
}

/// POSTs `body` to the ingest's `billing` endpoint, signed now with secret A, over a plain
/// HTTP/1.1 connection; returns the response's status line.
async fn post(base: &str, body: &[u8]) -> String {
    let host = base.trim_start_matches("http://");
    let mut request = format!(
        "POST /webhooks/stripe/billing HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         Stripe-Signature: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        sign(SECRET_A, body),
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    raw_request(base, &request).await
}

// ---- Database -------------------------------------------------------------------------------

/// Waits until every inbox row is processed; panics as soon as one failed (with its error), or
/// with the worker's output after `TIMEOUT`.
async fn wait_all_processed(client: &Client, worker: &Proc) {
    let settled = eventually(TIMEOUT, || async {
        // Settled: every row processed, or failed at least once.
        scalar(client, "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NULL AND last_error IS NULL")
            .await
            == 0
    })
    .await;
    let failed: Vec<(String, String)> = client
        .query("SELECT event_id, last_error FROM webhook_inbox WHERE last_error IS NOT NULL", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert!(failed.is_empty(), "events failed: {failed:?}");
    assert!(settled, "inbox rows left unprocessed; worker output:\n{}", worker.output());
}

/// Posts `body` to the ingest (it must answer 200), then waits until the worker processed it.
async fn deliver(base: &str, client: &Client, worker: &Proc, body: &[u8]) {
    let status = post(base, body).await;
    assert!(status.starts_with("HTTP/1.1 200"), "the ingest answered {status:?}");
    wait_all_processed(client, worker).await;
}

/// A subscription row: (customer, stage, ended_at as unix seconds).
type SubscriptionRow = (String, String, Option<i64>);

async fn subscription_row(client: &Client, id: &str) -> Option<SubscriptionRow> {
    client
        .query_opt(
            "SELECT customer, stage, extract(epoch FROM ended_at)::bigint FROM subscriptions WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
}

fn row(customer: &str, stage: &str, ended_at: Option<i64>) -> Option<SubscriptionRow> {
    Some((customer.to_owned(), stage.to_owned(), ended_at))
}

/// A `stripe_objects` row: what the thin-event handler wrote.
#[derive(Debug, Clone, PartialEq)]
struct ObjectRow {
    object_type: String,
    url: String,
    account: Option<String>,
    event_id: String,
    object: Option<Value>,
    gone: bool,
    as_of: Option<SystemTime>,
}

async fn object_row(client: &Client, object_id: &str) -> Option<ObjectRow> {
    client
        .query_opt(
            "SELECT object_type, url, account, event_id, object, gone, as_of
               FROM stripe_objects WHERE object_id = $1",
            &[&object_id],
        )
        .await
        .unwrap()
        .map(|r| ObjectRow {
            object_type: r.get(0),
            url: r.get(1),
            account: r.get(2),
            event_id: r.get(3),
            object: r.get(4),
            gone: r.get(5),
            as_of: r.get(6),
        })
}

/// The `as_of` of the snapshot `fetch` keeps of (`account`, `url`) (`""` the platform's).
async fn snapshot_as_of(client: &Client, account: &str, url: &str) -> Option<SystemTime> {
    client
        .query_opt(
            "SELECT as_of FROM stripe_object_snapshots WHERE account = $1 AND url = $2",
            &[&account, &url],
        )
        .await
        .unwrap()
        .map(|r| r.get(0))
}

/// Waits until every inbox row is processed, whatever failed on the way (a fetch that failed
/// and was retried); panics with `worker`'s output after `TIMEOUT`.
async fn wait_all_processed_eventually(client: &Client, worker: &Proc) {
    let done = eventually(TIMEOUT, || async {
        scalar(client, "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NULL").await == 0
    })
    .await;
    assert!(done, "inbox rows left unprocessed; worker output:\n{}", worker.output());
}

/// The requests the Stripe stand-in got for exactly `path`: (status, Stripe-Context).
fn requests_for(api: &StripeApi, path: &str) -> Vec<(u16, Option<String>)> {
    api.requests().into_iter().filter(|r| r.path == path).map(|r| (r.status, r.stripe_context)).collect()
}

/// A database with the inbox's schema and, applied by `custom-worker migrate`, the example's.
async fn migrated_db() -> TestDb {
    let db = TestDb::new().await;
    ok(&db, &["migrate"]).await;
    db
}

// ---- Specifications -------------------------------------------------------------------------

#[tokio::test]
async fn migrate_applies_the_inbox_schema_then_the_examples_tables_each_in_its_own_history() {
    let db = TestDb::empty().await;
    let client = db.client().await;
    let first = ok(&db, &["migrate"]).await;

    let inbox_versions: Vec<i32> =
        column(&client, "SELECT version FROM refinery_schema_history ORDER BY 1").await;
    assert!(inbox_versions.len() >= 2 && inbox_versions[0] == 1, "{inbox_versions:?}");
    let ours: Vec<(i32, String)> = client
        .query("SELECT version, name FROM custom_worker_schema_history ORDER BY 1", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        ours,
        [(1, "subscriptions".to_owned()), (2, "stripe_fetches".to_owned()), (3, "stripe_objects".to_owned())]
    );
    assert_eq!(
        scalar(
            &client,
            "SELECT count(*) FROM refinery_schema_history
              WHERE name IN ('subscriptions', 'stripe_fetches', 'stripe_objects')"
        )
        .await,
        0,
        "the example's migrations are not recorded in the inbox's history"
    );

    // The inbox's set first, then the example's.
    let position = |needle: &str| first.find(needle).unwrap_or_else(|| panic!("no {needle:?} in:\n{first}"));
    let inbox_done = position(&format!("schema is at version {}", inbox_versions.last().unwrap()));
    let ours_applied = position("applied V1 subscriptions (custom_worker_schema_history)");
    let ours_v2_applied = position("applied V2 stripe_fetches (custom_worker_schema_history)");
    let ours_v3_applied = position("applied V3 stripe_objects (custom_worker_schema_history)");
    assert!(inbox_done < ours_applied, "the inbox's migrations must run first:\n{first}");
    assert!(ours_applied < ours_v2_applied && ours_v2_applied < ours_v3_applied, "V1, V2, V3:\n{first}");
    position("custom_worker_schema_history is at version 3");
    for table in ["webhook_inbox", "ledger_entries", "operator_audit", "subscriptions", "stripe_objects"] {
        assert_eq!(db.count(table).await, 0, "{table}");
    }
    // The table refuses what the handler must never write: a live subscription with an end date.
    let refused = client
        .execute(
            "INSERT INTO subscriptions (id, customer, stage, ended_at) \
             VALUES ('sub_x', 'cus_x', 'live', now())",
            &[],
        )
        .await
        .unwrap_err();
    assert!(format!("{refused:?}").contains("subscriptions_ended_at_iff_ended"), "{refused:?}");
    // An object at anything but a path on api.stripe.com.
    let refused = client
        .execute(
            "INSERT INTO stripe_objects (object_id, object_type, url, event_id) \
             VALUES ('mtr_x', 'billing.meter', 'https://evil.example/v1/billing/meters/mtr_x', 'evt_x')",
            &[],
        )
        .await
        .unwrap_err();
    assert!(format!("{refused:?}").contains("stripe_objects_url_is_a_path"), "{refused:?}");
    // An object both present and gone, or known without a snapshot.
    for (object, gone, as_of) in
        [("'{}'", "true", "now()"), ("'{}'", "false", "NULL"), ("NULL", "true", "NULL")]
    {
        let refused = client
            .execute(
                &format!(
                    "INSERT INTO stripe_objects (object_id, object_type, url, event_id, object, gone, as_of) \
                     VALUES ('mtr_x', 'billing.meter', '/v1/billing/meters/mtr_x', 'evt_x', {object}, {gone}, {as_of})"
                ),
                &[],
            )
            .await
            .unwrap_err();
        assert!(format!("{refused:?}").contains("stripe_objects_state"), "{refused:?}");
    }

    let second = ok(&db, &["migrate"]).await;
    assert!(second.contains("schema is up to date at version"), "{second}");
    assert!(second.contains("custom_worker_schema_history is up to date at version 3"), "{second}");
    assert!(!second.contains("applied"), "{second}");
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM refinery_schema_history").await,
        inbox_versions.len() as i64
    );
    assert_eq!(scalar(&client, "SELECT count(*) FROM custom_worker_schema_history").await, 3);
}

#[tokio::test]
async fn subscriptions_reach_the_same_stage_in_any_delivery_order_beside_the_stock_invoice_handlers() {
    let db = migrated_db().await;
    let client = db.client().await;
    let (_ingest, base) = start_ingest_on(&db).await;
    let worker = start_worker(&db, &[]).await;

    // Subscription A: its whole lifecycle, backwards, with a redelivery and a second Event object
    // of the same fact. Each event is processed before the next is sent, so this is the order the
    // handler sees; after the first, nothing may change.
    let a = "sub_1LifecycleBackwards";
    let ended_at = 1_790_000_500;
    let deleted = event(
        "evt_a_deleted",
        "customer.subscription.deleted",
        &canceled(subscription(a, "active", &[OUR_PRICE]), 1_790_000_400, ended_at),
    );
    let updated =
        event("evt_a_updated", "customer.subscription.updated", &subscription(a, "active", &[OUR_PRICE]));
    let created =
        event("evt_a_created", "customer.subscription.created", &subscription(a, "incomplete", &[OUR_PRICE]));
    let same_fact_again =
        event("evt_a_updated_2", "customer.subscription.updated", &subscription(a, "active", &[OUR_PRICE]));
    for body in [&deleted, &updated, &created, &updated, &same_fact_again] {
        deliver(&base, &client, &worker, body).await;
        assert_eq!(subscription_row(&client, a).await, row(&customer_of(a), "ended", Some(ended_at)));
    }

    // Subscription B: updated (active) before created (trialing); paid by a customer account
    // (Accounts v2: `customer` is null); one of its two items is at our price.
    let b = "sub_1UpdatedBeforeCreated";
    let for_account = |status: &str| {
        let mut sub = subscription(b, status, &[OTHER_PRICE, OUR_PRICE]);
        sub["customer"] = Value::Null;
        sub["customer_account"] = json!("acct_1PayerAccountV2");
        sub
    };
    deliver(
        &base,
        &client,
        &worker,
        &event("evt_b_updated", "customer.subscription.updated", &for_account("active")),
    )
    .await;
    assert_eq!(subscription_row(&client, b).await, row("acct_1PayerAccountV2", "live", None));
    deliver(
        &base,
        &client,
        &worker,
        &event("evt_b_created", "customer.subscription.created", &for_account("trialing")),
    )
    .await;
    assert_eq!(subscription_row(&client, b).await, row("acct_1PayerAccountV2", "live", None));

    // Subscription C: its first payment succeeded (updated, active) before its creation
    // (incomplete) arrived: live, never back to pending.
    let c = "sub_1PaidBeforeCreated";
    let paid =
        event("evt_c_updated", "customer.subscription.updated", &subscription(c, "active", &[OUR_PRICE]));
    let created =
        event("evt_c_created", "customer.subscription.created", &subscription(c, "incomplete", &[OUR_PRICE]));
    for body in [&paid, &created] {
        deliver(&base, &client, &worker, body).await;
        assert_eq!(subscription_row(&client, c).await, row(&customer_of(c), "live", None));
    }

    // Subscription D: another product's. Processed, no row.
    let d = "sub_1AnotherProducts";
    deliver(
        &base,
        &client,
        &worker,
        &event("evt_d_created", "customer.subscription.created", &subscription(d, "active", &[OTHER_PRICE])),
    )
    .await;
    assert_eq!(subscription_row(&client, d).await, None);

    // The stock invoice handlers run in the same binary: one payment, sent as two Event objects,
    // booked once.
    deliver(&base, &client, &worker, &invoice_paid("evt_invoice_paid", "in_1Custom", 4200)).await;
    deliver(&base, &client, &worker, &invoice_paid("evt_invoice_paid_2", "in_1Custom", 4200)).await;

    assert_eq!(scalar(&client, "SELECT count(*) FROM subscriptions").await, 3);
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM ledger_entries WHERE invoice_id = 'in_1Custom'").await,
        1
    );
    assert_eq!(scalar(&client, "SELECT sum(amount)::bigint FROM ledger_entries").await, 4200);
    // Every event (the redelivery deduplicated by the ingest) processed, none failed.
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox").await, 11);
    assert_eq!(
        scalar(
            &client,
            "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NOT NULL AND last_error IS NULL"
        )
        .await,
        11
    );
    let stats = json_of(&db, &["stats"]).await;
    assert_eq!((&stats["unprocessed"], &stats["needs_review"]), (&json!(0), &json!(0)), "{stats}");
    assert_eq!(stats["processed_last_hour"], 11, "{stats}");

    stop_worker(worker).await;
}

#[tokio::test]
async fn replay_rebuilds_a_lost_subscription_row_with_the_same_handler_and_refuses_types_it_does_not_handle()
{
    let db = migrated_db().await;
    let client = db.client().await;
    let id = "sub_1ReplayedAfterLoss";
    let ended_at = 1_790_000_900;
    let subscription_ended = canceled(subscription(id, "active", &[OUR_PRICE]), 1_790_000_800, ended_at);
    store_event(
        &client,
        "billing",
        &event("evt_r_created", "customer.subscription.created", &subscription(id, "active", &[OUR_PRICE])),
    )
    .await;
    store_event(
        &client,
        "billing",
        &event("evt_r_deleted", "customer.subscription.deleted", &subscription_ended),
    )
    .await;
    let worker = start_worker(&db, &[]).await;
    wait_all_processed(&client, &worker).await;
    stop_worker(worker).await;
    let before = subscription_row(&client, id).await;
    assert_eq!(before, row(&customer_of(id), "ended", Some(ended_at)));

    client.execute("DELETE FROM subscriptions", &[]).await.unwrap();
    let output = ok(&db, &["replay", "--event-id", "evt_r_deleted"]).await;
    assert!(output.contains("replayed event evt_r_deleted"), "{output}");
    assert_eq!(subscription_row(&client, id).await, before, "the same row, ended_at from the payload");
    let audit = client
        .query("SELECT actor, action, target->>'event_id', affected FROM operator_audit", &[])
        .await
        .unwrap();
    assert_eq!(audit.len(), 1);
    assert_eq!(
        (
            audit[0].get::<_, String>(0),
            audit[0].get::<_, String>(1),
            audit[0].get::<_, String>(2),
            audit[0].get::<_, i32>(3)
        ),
        ("tester".to_owned(), "replay".to_owned(), "evt_r_deleted".to_owned(), 1)
    );

    // A processed event of a type this binary has no handler for: refused, nothing changes.
    client
        .execute(
            "INSERT INTO webhook_inbox
                    (provider, endpoint, event_id, event_type, payload, attempts, processed_at)
             VALUES ('stripe', 'billing', 'evt_customer', 'customer.created', $1, 1, '2026-01-01T00:00:00Z')",
            &[&json!({"id": "evt_customer", "type": "customer.created",
                      "data": {"object": {"id": "cus_1", "object": "customer"}}})],
        )
        .await
        .unwrap();
    let (code, output) = exec(custom_worker(&db, &["replay", "--event-id", "evt_customer"])).await;
    assert_eq!(code, 1, "{output}");
    assert!(
        output.contains("custom-worker: error: ")
            && output.contains("customer.created event, which this binary has no handler for")
            && output.contains("customer.subscription.deleted"),
        "{output}"
    );
    assert_eq!(scalar(&client, "SELECT count(*) FROM operator_audit").await, 1);
    assert_eq!(
        scalar(
            &client,
            "SELECT count(*) FROM webhook_inbox
              WHERE event_id = 'evt_customer' AND processed_at = '2026-01-01T00:00:00Z'"
        )
        .await,
        1,
        "the refused replay must not renew processed_at"
    );
    assert_eq!(subscription_row(&client, id).await, before);
}

#[tokio::test]
async fn a_subscription_without_a_payer_fails_with_a_clear_error_and_parks_for_review() {
    let db = migrated_db().await;
    let client = db.client().await;
    let mut no_payer = subscription("sub_1NoPayer", "active", &[OUR_PRICE]);
    no_payer["customer"] = Value::Null;
    no_payer["customer_account"] = Value::Null;
    store_event(&client, "billing", &event("evt_no_payer", "customer.subscription.updated", &no_payer)).await;
    let fine = subscription("sub_1Fine", "active", &[OUR_PRICE]);
    store_event(&client, "billing", &event("evt_fine", "customer.subscription.updated", &fine)).await;

    let worker = start_worker(&db, &["--max-attempts", "2"]).await;
    let review = parked_for_review(&db, &client, &worker, "evt_no_payer").await;
    let last_error = review["rows"][0]["last_error"].as_str().unwrap_or_default();
    assert!(
        last_error.contains("data.object.customer and data.object.customer_account are both null"),
        "{review}"
    );
    assert_eq!(subscription_row(&client, "sub_1NoPayer").await, None);
    // The rest of the queue flowed past it.
    assert_eq!(subscription_row(&client, "sub_1Fine").await, row(&customer_of("sub_1Fine"), "live", None));
    stop_worker(worker).await;
}

/// The design of `fetch` seen from outside: events about one object that wait together cost one
/// GET of it, made on behalf of the account the events name, and every handler reads that one
/// snapshot in its own transaction; `run` never takes them.
#[tokio::test]
async fn a_burst_of_thin_events_about_one_object_is_applied_with_one_fetch_and_each_handler_sees_the_snapshot(
) {
    let db = migrated_db().await;
    let client = db.client().await;
    let api = StripeApi::start(API_KEY).await;
    // The platform's meter, and a meter of a connected account: Stripe shows that one only to a
    // request made in the account's context, so finding it proves `Stripe-Context` was sent.
    let ours = meter("mtr_1BurstOfErrors");
    let ours_object = meter_object(&ours.0, "API calls");
    api.add_object(&ours.2, ours_object.clone());
    let seller = "acct_1ConnectedSeller";
    let theirs = meter("mtr_1SellersMeter");
    let theirs_object = meter_object(&theirs.0, "Seller's API calls");
    api.add_object_for_account(seller, &theirs.2, theirs_object.clone());

    // A burst: five events about our meter, two about the seller's, stored as the ingest stores
    // them.
    for n in 1..=5 {
        store_event(&client, "billing", &bytes(&thin(&format!("evt_burst_{n}"), METER_ERROR, &ours, None)))
            .await;
    }
    for n in 1..=2 {
        let event = thin(&format!("evt_seller_{n}"), METER_ERROR, &theirs, Some(seller));
        store_event(&client, "billing", &bytes(&event)).await;
    }

    // `run` alone: it leaves them, unclaimed, counted as waiting for a handler.
    let worker = start_worker(&db, &[]).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    let untouched = "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NULL AND attempts = 0";
    assert_eq!(scalar(&client, untouched).await, 7, "run claimed a thin event:\n{}", worker.output());
    let stats = json_of(&db, &["stats"]).await;
    assert_eq!(stats["no_handler"], 7, "{stats}");
    assert!(api.requests().is_empty());

    // `fetch` beside it: one GET per object, each answered at once.
    let fetcher = start_fetch(&db, &api, &[]).await;
    wait_all_processed(&client, &fetcher).await;
    assert_eq!(api.count(&ours.2), 1, "one GET for the five events: {:?}", api.requests());
    assert_eq!(api.count(&theirs.2), 1, "one GET for the two events: {:?}", api.requests());
    assert_eq!(api.requests().len(), 2, "{:?}", api.requests());
    assert_eq!(requests_for(&api, &ours.2), [(200, None)], "the platform's meter, no context");
    assert_eq!(requests_for(&api, &theirs.2), [(200, Some(seller.to_owned()))]);

    // Each event claimed once, by `fetch`, and processed without error: a handler that found no
    // snapshot would have failed (snapshot() is an error then), so each one read it.
    let by_fetch = "SELECT count(*) FROM webhook_inbox
                     WHERE processed_at IS NOT NULL AND attempts = 1 AND last_error IS NULL";
    assert_eq!(scalar(&client, by_fetch).await, 7);
    let claimers: Vec<String> =
        column(&client, &format!("SELECT program FROM inbox_workers WHERE '{METER_ERROR}' = ANY(handles)"))
            .await;
    assert_eq!(claimers, ["custom-worker"], "only the fetch process handles the thin types");

    // The example's table holds the snapshots, one row per object.
    let row = object_row(&client, &ours.0).await.expect("our meter's row");
    assert_eq!(
        (row.object_type.as_str(), row.url.as_str(), &row.account),
        ("billing.meter", ours.2.as_str(), &None)
    );
    assert_eq!((row.object, row.gone), (Some(ours_object), false));
    assert!(row.event_id.starts_with("evt_burst_"), "{}", row.event_id);
    assert_eq!(row.as_of, snapshot_as_of(&client, "", &ours.2).await);
    let row = object_row(&client, &theirs.0).await.expect("the seller's meter's row");
    assert_eq!((row.account.as_deref(), row.object, row.gone), (Some(seller), Some(theirs_object), false));
    assert!(row.event_id.starts_with("evt_seller_"), "{}", row.event_id);
    assert_eq!(row.as_of, snapshot_as_of(&client, seller, &theirs.2).await);
    assert_eq!(scalar(&client, "SELECT count(*) FROM stripe_objects").await, 2);
    assert_eq!(scalar(&client, "SELECT count(*) FROM stripe_object_snapshots").await, 2);

    stop_worker(fetcher).await;
    stop_worker(worker).await;
}

/// Stripe failing on the way: a 500 is retried by the client inside one attempt; an answer
/// that is final (401) fails the attempt of the object's events, which are retried; a 404 is a
/// state like any other, the object is recorded as gone.
#[tokio::test]
async fn stripe_errors_are_retried_and_an_object_stripe_no_longer_has_is_recorded_as_gone() {
    let db = migrated_db().await;
    let client = db.client().await;
    let api = StripeApi::start(API_KEY).await;
    let flaky = meter("mtr_1FlakyFirst");
    let flaky_object = meter_object(&flaky.0, "Flaky");
    api.add_object(&flaky.2, flaky_object.clone());
    api.fail_nth(&flaky.2, 1, Fault::ServerError);
    api.fail_nth(&flaky.2, 2, Fault::ServerError);
    let refused = meter("mtr_1RefusedOnce");
    api.add_object(&refused.2, meter_object(&refused.0, "Refused once"));
    api.fail_nth(&refused.2, 1, Fault::Unauthorized);
    // The platform's event about an Accounts v2 account Stripe no longer has.
    let closed = account("acct_1ClosedSeller");

    store_event(&client, "billing", &bytes(&thin("evt_flaky_1", METER_ERROR, &flaky, None))).await;
    store_event(&client, "billing", &bytes(&thin("evt_flaky_2", METER_ERROR, &flaky, None))).await;
    store_event(&client, "billing", &bytes(&thin("evt_refused", METER_ERROR, &refused, None))).await;
    store_event(&client, "billing", &bytes(&thin("evt_closed", ACCOUNT_UPDATED, &closed, None))).await;

    let fetcher = start_fetch(&db, &api, &[]).await;
    wait_all_processed_eventually(&client, &fetcher).await;

    // 500, 500, 200: the client's retries, one attempt of the events, one object kept.
    assert_eq!(requests_for(&api, &flaky.2), [(500, None), (500, None), (200, None)]);
    assert_eq!(api.count(&flaky.2), 1);
    let attempts = |id: &str| {
        let sql = format!("SELECT attempts FROM webhook_inbox WHERE event_id = '{id}'");
        let client = &client;
        async move { client.query_one(&sql, &[]).await.unwrap().get::<_, i32>(0) }
    };
    assert_eq!((attempts("evt_flaky_1").await, attempts("evt_flaky_2").await), (1, 1));
    let row = object_row(&client, &flaky.0).await.unwrap();
    assert_eq!((row.object, row.gone), (Some(flaky_object), false));

    // 401 is final for the client: that attempt failed (the log says why), the next one fetched.
    assert_eq!(requests_for(&api, &refused.2), [(401, None), (200, None)]);
    assert_eq!(attempts("evt_refused").await, 2);
    assert!(fetcher.output().contains("fetching the related object"), "{}", fetcher.output());
    assert!(object_row(&client, &refused.0).await.unwrap().object.is_some());

    // 404: gone, at the v2 path, as the platform (the event has no context).
    assert_eq!(requests_for(&api, &closed.2), [(404, None)]);
    let row = object_row(&client, &closed.0).await.expect("a row for the closed account");
    assert_eq!(
        (row.object_type.as_str(), row.url.as_str(), row.object, row.gone, row.event_id.as_str()),
        ("v2.core.account", "/v2/core/accounts/acct_1ClosedSeller", None, true, "evt_closed")
    );
    assert!(row.as_of.is_some());
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE last_error IS NOT NULL").await, 0);
    stop_worker(fetcher).await;
}

/// After a fetch, a new event about the object means it changed again: exactly one more GET, and
/// the table shows the new version. What does not come with a newer snapshot — a replay, an older
/// snapshot — never takes the row back.
#[tokio::test]
async fn a_thin_event_arriving_after_the_fetch_gets_one_more_get_and_nothing_older_overwrites_the_newer_object(
) {
    let db = migrated_db().await;
    let client = db.client().await;
    let api = StripeApi::start(API_KEY).await;
    let mtr = meter("mtr_1ChangesTwice");
    let first = meter_object(&mtr.0, "Changes twice");
    api.add_object(&mtr.2, first.clone());
    let fetcher = start_fetch(&db, &api, &[]).await;

    store_event(&client, "billing", &bytes(&thin("evt_change_1", METER_ERROR, &mtr, None))).await;
    wait_all_processed(&client, &fetcher).await;
    assert_eq!(api.count(&mtr.2), 1);
    let row = object_row(&client, &mtr.0).await.unwrap();
    assert_eq!((row.object.as_ref(), row.event_id.as_str()), (Some(&first), "evt_change_1"));
    let first_as_of = row.as_of.unwrap();

    // The meter is deactivated; Stripe sends an event about it. It arrived after the snapshot
    // was taken, so the snapshot may predate its change: fetched again, once.
    let second = deactivated(first.clone(), 1_790_000_600);
    api.set_object(&mtr.2, second.clone());
    store_event(&client, "billing", &bytes(&thin("evt_change_2", METER_ERROR, &mtr, None))).await;
    wait_all_processed(&client, &fetcher).await;
    assert_eq!(api.count(&mtr.2), 2, "{:?}", api.requests());
    let row = object_row(&client, &mtr.0).await.unwrap();
    assert_eq!((row.object.as_ref(), row.event_id.as_str()), (Some(&second), "evt_change_2"));
    assert!(row.as_of.unwrap() > first_as_of);
    stop_worker(fetcher).await;

    // A replay of the first event re-applies the kept snapshot: no GET, nothing changes.
    let output = ok(&db, &["replay", "--event-id", "evt_change_1"]).await;
    assert!(output.contains("replayed event evt_change_1"), "{output}");
    assert_eq!(api.count(&mtr.2), 2);
    assert_eq!(object_row(&client, &mtr.0).await, Some(row.clone()));
    // ... and rebuilds the row when it was lost, from the same snapshot.
    client.execute("DELETE FROM stripe_objects", &[]).await.unwrap();
    ok(&db, &["replay", "--event-id", "evt_change_1"]).await;
    let rebuilt = object_row(&client, &mtr.0).await.unwrap();
    assert_eq!((rebuilt.object.as_ref(), rebuilt.as_of), (Some(&second), row.as_of));
    assert_eq!(api.count(&mtr.2), 2);

    // A handler that reads an older snapshot than the row shows (as a handler of a late event
    // would, had another view of the object been fetched earlier) leaves the newer state: the
    // row only moves to a later `as_of`.
    client
        .execute(
            "UPDATE stripe_object_snapshots SET object = $1, as_of = as_of - interval '1 minute' WHERE url = $2",
            &[&first, &mtr.2],
        )
        .await
        .unwrap();
    ok(&db, &["replay", "--event-id", "evt_change_2"]).await;
    assert_eq!(object_row(&client, &mtr.0).await.unwrap().object, Some(second));
    assert_eq!(api.count(&mtr.2), 2, "replay never fetches");
}

/// A database migrated by the previous build of this binary (V1, V2, with fetches queued) gets
/// only V3 at the next `migrate`, and every object it knew is kept, to be filled in by the next
/// event about it.
#[tokio::test]
async fn a_database_at_v2_with_queued_fetches_migrates_to_v3_keeping_every_object() {
    let db = TestDb::empty().await;
    let client = db.client().await;
    // Stop this binary's set at V2: a table in V3's way makes V3 fail, and refinery rolls back
    // that migration alone.
    client.batch_execute("CREATE TABLE stripe_objects (in_the_way int)").await.unwrap();
    let (code, output) = exec(custom_worker(&db, &["migrate"])).await;
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("custom_worker_schema_history") && output.contains("stripe_objects"), "{output}");
    let versions: Vec<i32> =
        column(&client, "SELECT version FROM custom_worker_schema_history ORDER BY 1").await;
    assert_eq!(versions, [1, 2]);
    client.batch_execute("DROP TABLE stripe_objects").await.unwrap();

    // What V2's handler and a fetcher of the team's own left: one fetch due, one done.
    let due = meter("mtr_1QueuedUnderV2");
    let done = account("acct_1FetchedUnderV2");
    client
        .execute(
            "INSERT INTO stripe_fetches (object_id, object_type, url, account, last_event_id, queued_at, fetched_at)
             VALUES ($1, $2, $3, 'acct_1Seller', 'evt_v2_due', '2026-10-01T12:00:00Z', NULL),
                    ($4, $5, $6, NULL, 'evt_v2_done', '2026-10-01T12:00:01Z', '2026-10-01T12:00:02Z')",
            &[&due.0, &due.1, &due.2, &done.0, &done.1, &done.2],
        )
        .await
        .unwrap();

    let output = ok(&db, &["migrate"]).await;
    assert!(output.contains("applied V3 stripe_objects (custom_worker_schema_history)"), "{output}");
    assert!(!output.contains("applied V1") && !output.contains("applied V2"), "{output}");
    assert!(output.contains("custom_worker_schema_history is at version 3"), "{output}");
    assert_eq!(
        scalar(
            &client,
            "SELECT count(*) FROM pg_class WHERE relname IN ('stripe_fetches', 'stripe_fetches_due')"
        )
        .await,
        0
    );
    let kept = client
        .query(
            "SELECT object_id, account, event_id, updated_at = '2026-10-01T12:00:00Z'::timestamptz + (event_id = 'evt_v2_done')::int * interval '1 second',
                    object IS NULL AND as_of IS NULL AND NOT gone
               FROM stripe_objects ORDER BY object_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect::<Vec<(String, Option<String>, String, bool, bool)>>();
    assert_eq!(
        kept,
        [
            (done.0.clone(), None, "evt_v2_done".to_owned(), true, true),
            (due.0.clone(), Some("acct_1Seller".to_owned()), "evt_v2_due".to_owned(), true, true),
        ]
    );

    // The next event about the meter V2 left due fills its row in.
    let api = StripeApi::start(API_KEY).await;
    let object = meter_object(&due.0, "Queued under V2");
    api.add_object_for_account("acct_1Seller", &due.2, object.clone());
    store_event(&client, "billing", &bytes(&thin("evt_v3_first", METER_ERROR, &due, Some("acct_1Seller"))))
        .await;
    let fetcher = start_fetch(&db, &api, &[]).await;
    wait_all_processed(&client, &fetcher).await;
    let row = object_row(&client, &due.0).await.unwrap();
    assert_eq!((row.object, row.event_id.as_str()), (Some(object), "evt_v3_first"));
    stop_worker(fetcher).await;
}

#[tokio::test]
async fn a_thin_event_without_related_object_fails_with_a_clear_error_and_parks_while_the_others_are_processed(
) {
    let db = migrated_db().await;
    let client = db.client().await;
    // Stripe's schema does not require related_object, so the event is a valid `v2.core.event`;
    // there is nothing to fetch for it.
    let mut without = thin("evt_thin_no_related", ACCOUNT_UPDATED, &account("acct_1Unnamed"), None);
    without.as_object_mut().unwrap().remove("related_object");
    assert_matches_thin_event_schema(&without);
    store_event(&client, "billing", &bytes(&without)).await;
    let api = StripeApi::start(API_KEY).await;
    let mtr = meter("mtr_1FlowsPast");
    api.add_object_for_account("acct_1Seller", &mtr.2, meter_object(&mtr.0, "Flows past"));
    store_event(&client, "billing", &bytes(&thin("evt_thin_meter", METER_ERROR, &mtr, Some("acct_1Seller"))))
        .await;
    let acct = account("acct_1AlsoFlowsPast");
    api.add_object(&acct.2, account_object(&acct.0));
    store_event(&client, "billing", &bytes(&thin("evt_thin_account", ACCOUNT_UPDATED, &acct, None))).await;

    let fetcher = start_fetch(&db, &api, &["--max-attempts", "2"]).await;
    let review = parked_for_review(&db, &client, &fetcher, "evt_thin_no_related").await;
    let last_error = review["rows"][0]["last_error"].as_str().unwrap_or_default();
    assert!(last_error.contains("no related_object {id, type, url}"), "{review}");
    // The rest of the queue flowed past it; the parked event fetched nothing and wrote nothing.
    let flowed = "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NOT NULL AND last_error IS NULL";
    assert_eq!(scalar(&client, flowed).await, 2);
    assert_eq!(object_row(&client, &mtr.0).await.unwrap().account.as_deref(), Some("acct_1Seller"));
    assert_eq!(object_row(&client, &acct.0).await.unwrap().object, Some(account_object(&acct.0)));
    assert_eq!(scalar(&client, "SELECT count(*) FROM stripe_objects").await, 2);
    assert_eq!(api.requests().len(), 2, "{:?}", api.requests());
    stop_worker(fetcher).await;
}

#[tokio::test]
async fn a_malformed_price_list_stops_the_binary_before_it_touches_the_database() {
    // Nothing listens on this port: a binary that tried the database would say it cannot connect.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let unreachable = format!("postgres://postgres@127.0.0.1:{closed}/inbox");
    let with_prices = |prices: &str, url: &str, args: &[&str]| {
        let mut cmd = command("custom-worker");
        cmd.env("DATABASE_URL", url).env("SUBSCRIPTION_PRICES", prices).args(args);
        cmd
    };
    for (prices, reason) in [
        (",,", "item 1 of \",,\" is empty"),
        ("price_a,,price_b", "item 2"),
        ("", "is set but empty"),
        ("price_a, price b", "not a Stripe price id"),
    ] {
        let (code, output) = exec(with_prices(prices, &unreachable, &["run"])).await;
        assert_eq!(code, 1, "{prices:?}: {output}");
        assert!(
            output.contains("custom-worker: error: SUBSCRIPTION_PRICES: ") && output.contains(reason),
            "{prices:?}: {output}"
        );
        assert!(!output.contains("database"), "{prices:?}: the database was tried:\n{output}");
    }
    // The control: with a valid list the same command does reach for the database.
    let (code, output) = exec(with_prices(OUR_PRICE, &unreachable, &["run"])).await;
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("cannot connect to the database"), "{output}");

    // On a reachable, empty database, `migrate` with a malformed list creates nothing.
    let db = TestDb::empty().await;
    let (code, output) = exec(with_prices(",,", &db.url(), &["migrate"])).await;
    assert_eq!(code, 1, "{output}");
    let client = db.client().await;
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").await,
        0,
        "nothing may be migrated"
    );
}

/// Waits until the worker parked `event_id` (its second and last attempt failed) and returns
/// `needs-review --json`, which must list that row alone.
async fn parked_for_review(db: &TestDb, client: &Client, worker: &Proc, event_id: &str) -> Value {
    let sql = format!(
        "SELECT count(*) FROM webhook_inbox
          WHERE event_id = '{event_id}' AND attempts = 2 AND processed_at IS NULL AND parked_at IS NOT NULL"
    );
    let parked = eventually(TIMEOUT, || async { scalar(client, &sql).await == 1 }).await;
    assert!(parked, "{event_id} was not retried up to the limit and parked:\n{}", worker.output());
    let review = json_of(db, &["needs-review"]).await;
    assert_eq!(review["count"], 1, "{review}");
    assert_eq!(review["rows"][0]["event_id"], event_id, "{review}");
    review
}

/// The stock worker and this team's worker on one database, as a rolling deploy or a second
/// binary has them: the stock worker takes only the invoice types, and the team's events — which
/// it has no handler for — wait, unclaimed and counted as having no handler, until the team's
/// worker takes them. Nothing is marked done by a worker that cannot apply it.
#[tokio::test]
async fn the_stock_worker_leaves_this_workers_types_for_it_and_nothing_is_lost_on_one_database() {
    let db = migrated_db().await;
    let client = db.client().await;
    let (_ingest, base) = start_ingest_on(&db).await;
    let mut stock = command("inbox-worker");
    stock.env("DATABASE_URL", db.url()).args(["run", "--poll-interval", "100ms"]);
    let stock = tokio::task::spawn_blocking(move || {
        let proc = Proc::spawn(stock);
        proc.wait_for_line("inbox-worker running", TIMEOUT);
        proc
    })
    .await
    .unwrap();

    // Twelve subscriptions, a thin event and two invoice payments.
    for i in 0..12 {
        let sub = subscription(&format!("sub_1Mixed{i:02}"), "active", &[OUR_PRICE]);
        let status =
            post(&base, &event(&format!("evt_sub_{i}"), "customer.subscription.created", &sub)).await;
        assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    }
    let thin_body = bytes(&thin("evt_thin_mixed", ACCOUNT_UPDATED, &account("acct_1Mixed"), None));
    assert!(post(&base, &thin_body).await.starts_with("HTTP/1.1 200"));
    for i in 0..2 {
        let status = post(&base, &invoice_paid(&format!("evt_inv_{i}"), &format!("in_mixed_{i}"), 500)).await;
        assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    }
    let invoices_done =
        eventually(TIMEOUT, || async { scalar(&client, "SELECT count(*) FROM ledger_entries").await == 2 })
            .await;
    assert!(invoices_done, "the stock worker books the payments:\n{}", stock.output());
    // Give the stock worker time to have claimed anything it would claim.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let untouched = "SELECT count(*) FROM webhook_inbox
                      WHERE processed_at IS NULL AND attempts = 0 AND event_type <> 'invoice.paid'";
    assert_eq!(
        scalar(&client, untouched).await,
        13,
        "never claimed by the stock worker:\n{}",
        stock.output()
    );
    assert_eq!(scalar(&client, "SELECT count(*) FROM subscriptions").await, 0);
    assert!(!stock.output().contains(r#""outcome":"ignored""#), "{}", stock.output());

    // stats (either binary) names what waits for a handler, per type.
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", db.url()).args(["stats", "--json"]);
    let (code, stdout, output) = tokio::task::spawn_blocking(move || run_split(cmd, TIMEOUT)).await.unwrap();
    assert_eq!(code, 0, "{output}");
    let stats: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(stats["no_handler"], 13, "{stats}");
    let by_type = |t: &str| {
        stats["by_event_type"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["event_type"] == t)
            .cloned()
            .unwrap_or_default()
    };
    assert_eq!(by_type("customer.subscription.created")["no_handler"], 12, "{stats}");
    assert_eq!(by_type(ACCOUNT_UPDATED)["no_handler"], 1, "{stats}");
    assert_eq!(stats["workers"].as_array().map(Vec::len), Some(1), "{stats}");

    // The team's workers start — `run`, and `fetch` for the thin event: they take their types;
    // nothing was lost, nothing is left.
    let api = StripeApi::start(API_KEY).await;
    api.add_object("/v2/core/accounts/acct_1Mixed", account_object("acct_1Mixed"));
    let team = start_worker(&db, &[]).await;
    let fetcher = start_fetch(&db, &api, &[]).await;
    wait_all_processed(&client, &team).await;
    assert_eq!(scalar(&client, "SELECT count(*) FROM subscriptions").await, 12);
    assert_eq!(scalar(&client, "SELECT count(*) FROM stripe_objects WHERE object IS NOT NULL").await, 1);
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 2, "booked once");
    let stats = json_of(&db, &["stats"]).await;
    assert_eq!(stats["no_handler"], 0, "{stats}");
    assert_eq!(stats["workers"].as_array().map(Vec::len), Some(3), "{stats}");
    stop_worker(fetcher).await;
    stop_worker(team).await;
    stop_worker(stock).await;
    // A worker that stopped is no longer counted.
    let stats = json_of(&db, &["stats"]).await;
    assert_eq!(stats["workers"], json!([]), "{stats}");
}

/// The way back after a handler was added: events a worker marked done without a handler (told to
/// ignore them) are run again with this binary's handler by one bulk replay, once each.
#[tokio::test]
async fn a_bulk_replay_applies_events_an_earlier_worker_ignored_once_the_handler_exists() {
    let db = migrated_db().await;
    let client = db.client().await;
    let (_ingest, base) = start_ingest_on(&db).await;
    let mut stock = command("inbox-worker");
    stock.env("DATABASE_URL", db.url()).args(["run", "--poll-interval", "100ms", "--ignore", "customer.*"]);
    let stock = tokio::task::spawn_blocking(move || {
        let proc = Proc::spawn(stock);
        proc.wait_for_line("inbox-worker running", TIMEOUT);
        proc
    })
    .await
    .unwrap();
    for i in 0..5 {
        let sub = subscription(&format!("sub_1Ignored{i}"), "active", &[OUR_PRICE]);
        deliver(
            &base,
            &client,
            &stock,
            &event(&format!("evt_ign_{i}"), "customer.subscription.created", &sub),
        )
        .await;
    }
    stop_worker(stock).await;
    assert_eq!(scalar(&client, "SELECT count(*) FROM subscriptions").await, 0, "ignored: no effect");

    let output =
        ok(&db, &["replay", "--event-type", "customer.subscription.created", "--actor", "alice"]).await;
    assert!(
        output.contains("5 processed customer.subscription.created events matched: 5 replayed"),
        "{output}"
    );
    assert_eq!(scalar(&client, "SELECT count(*) FROM subscriptions").await, 5);
    ok(&db, &["replay", "--event-type", "customer.subscription.created"]).await;
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM subscriptions").await,
        5,
        "a second replay changes nothing"
    );
}

#[tokio::test]
async fn the_custom_worker_names_its_own_binary_when_it_starts_and_stops() {
    let db = migrated_db().await;
    let mut cmd = custom_worker(&db, &["run", "--poll-interval", "100ms"]);
    cmd.env("LOG_FORMAT", "json");
    let (running, stopped, status) = tokio::task::spawn_blocking(move || {
        let mut worker = Proc::spawn(cmd);
        let running = worker.wait_for_line("inbox-worker running", TIMEOUT);
        worker.signal(SIGTERM);
        let stopped = worker.wait_for_line("inbox-worker stopped", TIMEOUT);
        (running, stopped, worker.wait(TIMEOUT))
    })
    .await
    .unwrap();
    assert_eq!(status.code(), Some(0));
    for line in [running, stopped] {
        let line: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(line["program"], "custom-worker", "a log collector tells the fleets apart: {line}");
    }
}

/// `main_with` gives the team's binary the relay too: the outbox row the stock invoice handler
/// writes for a payment (the example keeps those handlers) reaches an HTTP receiver, signed,
/// and is marked published.
#[tokio::test]
async fn the_teams_binary_relays_what_its_handlers_write_to_the_outbox() {
    let db = migrated_db().await;
    let client = db.client().await;
    store_event(&client, "billing", &invoice_paid("evt_relayed", "in_relayed", 4200)).await;
    let worker = start_worker(&db, &[]).await;
    wait_all_processed(&client, &worker).await;

    let receiver = inbox_test_support::receiver::Receiver::start(true).await;
    let mut relay = custom_worker(&db, &["relay", "--to-url", &receiver.url, "--poll-interval", "100ms"]);
    relay.env("INBOX_RELAY_SECRET", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw");
    let relay = tokio::task::spawn_blocking(move || {
        let proc = Proc::spawn(relay);
        proc.wait_for_line("inbox-relay running", TIMEOUT);
        proc
    })
    .await
    .unwrap();
    let published = eventually(TIMEOUT, || async {
        scalar(&client, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL").await == 1
    })
    .await;
    assert!(published, "{}", relay.output());
    let accepted = receiver.accepted();
    assert_eq!(accepted.len(), 1);
    let body: Value = serde_json::from_slice(&accepted[0].body).unwrap();
    assert_eq!(body["invoice_id"], "in_relayed", "{body}");
    assert!(accepted[0].signature.starts_with("v1,"), "{}", accepted[0].signature);
    stop_worker(worker).await;
    drop(relay);
}

#[tokio::test]
async fn run_refuses_an_ignore_pattern_that_would_swallow_the_thin_types_fetch_applies() {
    let db = migrated_db().await;
    let client = db.client().await;
    store_event(
        &client,
        "billing",
        &bytes(&thin("evt_ignored_by_run", METER_ERROR, &meter("mtr_1Kept"), None)),
    )
    .await;
    for pattern in ["*", "v1.billing.*", METER_ERROR] {
        let (code, output) = exec(custom_worker(&db, &["run", "--ignore", pattern])).await;
        assert_eq!(code, 1, "{output}");
        assert!(
            output.contains(&format!("the ignore pattern {pattern}"))
                && output.contains("applies with `fetch`"),
            "{output}"
        );
    }
    // Nothing was marked done: the event waits for `fetch`.
    let untouched = "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NULL AND attempts = 0";
    assert_eq!(scalar(&client, untouched).await, 1);
    // A pattern that leaves the fetched types out is taken.
    let worker = start_worker(&db, &["--ignore", "customer.*"]).await;
    stop_worker(worker).await;
}
