//! `custom-worker` end to end: the built binary (and `inbox-ingest`) as processes against a
//! database of their own, with subscription events built from Stripe's own `subscription`
//! fixture (`fixtures/subscription.json`) and thin events built to Stripe's `v2.core.event` schema
//! (`inbox_test_support::stripe_fixtures::thin_event`, which checks each against the schema),
//! signed and posted over HTTP the way Stripe does.
//!
//! Needs `DATABASE_URL` (`make test`, or `scripts/with-db.sh cargo nextest run -p custom-worker`)
//! and the binaries built (`make build`).

use std::process::Command;
use std::time::Duration;

use inbox_test_support::app::raw_request;
use inbox_test_support::db::{column, scalar};
use inbox_test_support::events::{invoice_paid, now, sign, SECRET_A};
use inbox_test_support::process::{command, run, run_split, start_ingest, Proc};
use inbox_test_support::stripe_fixtures::{assert_matches_thin_event_schema, thin_event, Related};
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

/// `custom-worker run` on `db`, started and ready.
async fn start_worker(db: &TestDb, flags: &[&str]) -> Proc {
    let mut cmd = custom_worker(db, &["run", "--poll-interval", "100ms"]);
    cmd.args(flags);
    tokio::task::spawn_blocking(move || {
        let proc = Proc::spawn(cmd);
        proc.wait_for_line("inbox-worker running", TIMEOUT);
        proc
    })
    .await
    .unwrap()
}

/// Stops a worker with SIGTERM; it must exit 0.
async fn stop_worker(mut worker: Proc) {
    worker.signal(SIGTERM);
    let (status, output) =
        tokio::task::spawn_blocking(move || (worker.wait(TIMEOUT), worker.output())).await.unwrap();
    assert_eq!(status.code(), Some(0), "SIGTERM must stop the worker cleanly:\n{output}");
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

/// A `stripe_fetches` row: (object_type, url, account, last_event_id, whether it was fetched since).
type FetchRow = (String, String, Option<String>, String, bool);

async fn fetch_row(client: &Client, object_id: &str) -> Option<FetchRow> {
    client
        .query_opt(
            "SELECT object_type, url, account, last_event_id, fetched_at IS NOT NULL
               FROM stripe_fetches WHERE object_id = $1",
            &[&object_id],
        )
        .await
        .unwrap()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
}

fn fetch(
    related: &(String, &str, String),
    account: Option<&str>,
    last_event_id: &str,
    fetched: bool,
) -> Option<FetchRow> {
    let (_, object_type, url) = related;
    Some((
        (*object_type).to_owned(),
        url.clone(),
        account.map(str::to_owned),
        last_event_id.to_owned(),
        fetched,
    ))
}

/// What the fetcher described in the README does before its `GET`: reads the due fetch of
/// `object_id`, as the version it will complete.
async fn take_due_fetch(client: &Client, object_id: &str) -> (String, std::time::SystemTime) {
    let row = client
        .query_one(
            "SELECT last_event_id, queued_at FROM stripe_fetches WHERE object_id = $1 AND fetched_at IS NULL",
            &[&object_id],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

/// What the fetcher does once it applied the object it fetched: marks the fetch done unless an
/// event queued it again meanwhile. Returns whether it did.
async fn complete_fetch(client: &Client, object_id: &str, taken: &(String, std::time::SystemTime)) -> bool {
    let marked = client
        .execute(
            "UPDATE stripe_fetches SET fetched_at = now()
              WHERE object_id = $1 AND last_event_id = $2 AND queued_at = $3 AND fetched_at IS NULL",
            &[&object_id, &taken.0, &taken.1],
        )
        .await
        .unwrap();
    marked == 1
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
    assert_eq!(ours, [(1, "subscriptions".to_owned()), (2, "stripe_fetches".to_owned())]);
    assert_eq!(
        scalar(
            &client,
            "SELECT count(*) FROM refinery_schema_history WHERE name IN ('subscriptions', 'stripe_fetches')"
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
    assert!(inbox_done < ours_applied, "the inbox's migrations must run first:\n{first}");
    assert!(ours_applied < ours_v2_applied, "V1 before V2:\n{first}");
    position("custom_worker_schema_history is at version 2");
    for table in ["webhook_inbox", "ledger_entries", "operator_audit", "subscriptions", "stripe_fetches"] {
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
    // And a fetch of anything but a path on api.stripe.com.
    let refused = client
        .execute(
            "INSERT INTO stripe_fetches (object_id, object_type, url, last_event_id) \
             VALUES ('mtr_x', 'billing.meter', 'https://evil.example/v1/billing/meters/mtr_x', 'evt_x')",
            &[],
        )
        .await
        .unwrap_err();
    assert!(format!("{refused:?}").contains("stripe_fetches_url_is_a_path"), "{refused:?}");

    let second = ok(&db, &["migrate"]).await;
    assert!(second.contains("schema is up to date at version"), "{second}");
    assert!(second.contains("custom_worker_schema_history is up to date at version 2"), "{second}");
    assert!(!second.contains("applied"), "{second}");
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM refinery_schema_history").await,
        inbox_versions.len() as i64
    );
    assert_eq!(scalar(&client, "SELECT count(*) FROM custom_worker_schema_history").await, 2);
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

#[tokio::test]
async fn thin_events_about_one_object_queue_one_fetch_of_its_url_due_again_after_each_new_event_but_not_a_redelivery(
) {
    let db = migrated_db().await;
    let client = db.client().await;
    let (_ingest, base) = start_ingest_on(&db).await;
    let worker = start_worker(&db, &[]).await;
    let mtr = meter("mtr_1ErrorsReported");
    let first = bytes(&thin("evt_thin_1", METER_ERROR, &mtr, None));
    let second = bytes(&thin("evt_thin_2", METER_ERROR, &mtr, None));
    let third = bytes(&thin("evt_thin_3", METER_ERROR, &mtr, None));

    // The first event queues a fetch of the meter, on the platform (no context); the fetcher
    // takes it and marks it done.
    deliver(&base, &client, &worker, &first).await;
    assert_eq!(fetch_row(&client, &mtr.0).await, fetch(&mtr, None, "evt_thin_1", false));
    let taken = take_due_fetch(&client, &mtr.0).await;
    assert!(complete_fetch(&client, &mtr.0, &taken).await);
    assert_eq!(fetch_row(&client, &mtr.0).await, fetch(&mtr, None, "evt_thin_1", true));

    // A second event about the meter after the fetch: the same row, due again, for that event.
    deliver(&base, &client, &worker, &second).await;
    assert_eq!(fetch_row(&client, &mtr.0).await, fetch(&mtr, None, "evt_thin_2", false));

    // A third arrives while the fetcher's GET for the second is in flight: the fetcher's
    // completion must not hide it (the object it read may predate the third change).
    let in_flight = take_due_fetch(&client, &mtr.0).await;
    deliver(&base, &client, &worker, &third).await;
    assert!(!complete_fetch(&client, &mtr.0, &in_flight).await, "a stale fetch marked the row done");
    assert_eq!(fetch_row(&client, &mtr.0).await, fetch(&mtr, None, "evt_thin_3", false));
    let taken = take_due_fetch(&client, &mtr.0).await;
    assert!(complete_fetch(&client, &mtr.0, &taken).await);

    // Stripe delivers the first and the third again: the inbox has them already, so no fetch is
    // due again and the row keeps the latest event.
    for body in [&first, &third] {
        deliver(&base, &client, &worker, body).await;
    }
    assert_eq!(fetch_row(&client, &mtr.0).await, fetch(&mtr, None, "evt_thin_3", true));
    assert_eq!(scalar(&client, "SELECT count(*) FROM stripe_fetches").await, 1);
    assert_eq!(
        scalar(
            &client,
            "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NOT NULL AND last_error IS NULL"
        )
        .await,
        3
    );
    stop_worker(worker).await;
}

#[tokio::test]
async fn a_connect_thin_event_queues_its_fetch_on_behalf_of_the_connected_account_in_its_context() {
    let db = migrated_db().await;
    let client = db.client().await;
    let (_ingest, base) = start_ingest_on(&db).await;
    let worker = start_worker(&db, &[]).await;

    // A meter of a connected account reported errors: the event names the account in `context`,
    // and the fetch is made on its behalf (Stripe-Context).
    let connected = "acct_1ConnectedSeller";
    let mtr = meter("mtr_1OnConnectedAccount");
    deliver(&base, &client, &worker, &bytes(&thin("evt_thin_connect", METER_ERROR, &mtr, Some(connected))))
        .await;
    assert_eq!(fetch_row(&client, &mtr.0).await, fetch(&mtr, Some(connected), "evt_thin_connect", false));

    // The platform's own event about that account (Accounts v2) has no context: fetched as the
    // platform, at the v2 path.
    let acct = account(connected);
    deliver(&base, &client, &worker, &bytes(&thin("evt_thin_account", ACCOUNT_UPDATED, &acct, None))).await;
    assert_eq!(fetch_row(&client, connected).await, fetch(&acct, None, "evt_thin_account", false));
    assert_eq!(
        fetch_row(&client, connected).await.unwrap().1,
        format!("/v2/core/accounts/{connected}"),
        "the path the fetcher appends to https://api.stripe.com"
    );
    assert_eq!(scalar(&client, "SELECT count(*) FROM stripe_fetches").await, 2);
    stop_worker(worker).await;
}

#[tokio::test]
async fn a_thin_event_without_related_object_fails_with_a_clear_error_and_parks_while_the_others_are_processed(
) {
    let db = migrated_db().await;
    let client = db.client().await;
    // Stripe's schema does not require related_object, so the event is a valid `v2.core.event`;
    // this handler cannot do anything with it.
    let mut without = thin("evt_thin_no_related", ACCOUNT_UPDATED, &account("acct_1Unnamed"), None);
    without.as_object_mut().unwrap().remove("related_object");
    assert_matches_thin_event_schema(&without);
    store_event(&client, "billing", &bytes(&without)).await;
    let mtr = meter("mtr_1FlowsPast");
    store_event(&client, "billing", &bytes(&thin("evt_thin_meter", METER_ERROR, &mtr, Some("acct_1Seller"))))
        .await;
    let acct = account("acct_1AlsoFlowsPast");
    store_event(&client, "billing", &bytes(&thin("evt_thin_account", ACCOUNT_UPDATED, &acct, None))).await;

    let worker = start_worker(&db, &["--max-attempts", "2"]).await;
    let review = parked_for_review(&db, &client, &worker, "evt_thin_no_related").await;
    let last_error = review["rows"][0]["last_error"].as_str().unwrap_or_default();
    assert!(
        last_error.contains("related_object {id, type, url} is missing")
            && last_error.contains("v2.core.account.updated must name the object to fetch"),
        "{review}"
    );
    // The rest of the queue flowed past it; the parked event queued nothing.
    assert_eq!(fetch_row(&client, &mtr.0).await, fetch(&mtr, Some("acct_1Seller"), "evt_thin_meter", false));
    assert_eq!(fetch_row(&client, &acct.0).await, fetch(&acct, None, "evt_thin_account", false));
    assert_eq!(scalar(&client, "SELECT count(*) FROM stripe_fetches").await, 2);
    stop_worker(worker).await;
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

    // The team's worker starts: it takes its types; nothing was lost, nothing is left.
    let team = start_worker(&db, &[]).await;
    wait_all_processed(&client, &team).await;
    assert_eq!(scalar(&client, "SELECT count(*) FROM subscriptions").await, 12);
    assert_eq!(scalar(&client, "SELECT count(*) FROM stripe_fetches").await, 1);
    assert_eq!(scalar(&client, "SELECT count(*) FROM ledger_entries").await, 2, "booked once");
    let stats = json_of(&db, &["stats"]).await;
    assert_eq!(stats["no_handler"], 0, "{stats}");
    assert_eq!(stats["workers"].as_array().map(Vec::len), Some(2), "{stats}");
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
