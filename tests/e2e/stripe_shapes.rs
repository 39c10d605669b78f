//! Every event type Stripe sends, in Stripe's own shapes: the 265 types of its API's list and the
//! 10 its Python SDK adds, each wrapping the resource fixture of Stripe's OpenAPI repository
//! (`tests/fixtures/stripe-openapi/`, see `inbox_test_support::stripe_fixtures`), plus Connect
//! events, thin events (`v2.core.event`) and Accounts v2 invoices (`customer: null`,
//! `customer_account`). Signed and posted to `inbox-ingest`, processed by the stock
//! `inbox-worker run` (the invoice handlers, every other type ignored), both as processes; every
//! claim and processed mark of their rows, ~0.3 KB to ~7 KB, is a HOT update.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_test_support::app::http_client;
use inbox_test_support::db::scalar;
use inbox_test_support::events::{now, sign, SECRET_A};
use inbox_test_support::process::{command, start_ingest, Proc};
use inbox_test_support::stripe_fixtures::{
    all_event_types, object_for, on_connected_account, resource, snapshot_event, thin_event, Related,
};
use inbox_test_support::worker::eventually;
use inbox_test_support::TestDb;
use serde_json::{json, Value};

const ENDPOINT: &str = "billing";
/// The connected account the Connect copies happened on.
const CONNECTED_ACCOUNT: &str = "acct_1ShapesConnected01";
/// The event types also sent as Connect events (`"account": …` at the top level).
const CONNECT_TYPES: [&str; 12] = [
    "account.updated",
    "account.external_account.created",
    "capability.updated",
    "person.updated",
    "customer.created",
    "customer.subscription.updated",
    "charge.succeeded",
    "payment_intent.succeeded",
    "checkout.session.completed",
    "payout.paid",
    "invoice.created",
    "invoice.paid",
];
/// The Accounts v2 customer (an account, not a `cus_…`) and its invoice.
const ACCOUNTS_V2_CUSTOMER: &str = "acct_1ShapesCustomerV2";
const ACCOUNTS_V2_INVOICE: &str = "in_shapes_accounts_v2";
const ACCOUNTS_V2_AMOUNT: i64 = 4200;
/// How long every event may take to be processed (the worker alone needs a second or two).
const PROCESSING_BOUND: Duration = Duration::from_secs(30);

/// One event to send: its id, its type and the JSON body.
struct Delivery {
    event_id: String,
    event_type: String,
    body: Vec<u8>,
}

/// The events to send and what the invoice handlers must have made of them.
#[derive(Default)]
struct Plan {
    deliveries: Vec<Delivery>,
    /// Invoice id → the status its event leaves it in (the types with a handler).
    invoices: BTreeMap<String, &'static str>,
    /// Invoice id → the amount its `invoice.paid` books.
    payments: BTreeMap<String, i64>,
    /// Types whose object is a real fixture.
    real_fixtures: usize,
    /// Types whose object is a minimal stand-in (no fixture has it).
    stand_ins: Vec<String>,
    /// How many Connect copies, thin events and Accounts v2 events.
    connect: usize,
    thin: usize,
    accounts_v2: usize,
}

impl Plan {
    fn push(&mut self, event: &Value) {
        self.deliveries.push(Delivery {
            event_id: event["id"].as_str().expect("an event id").to_owned(),
            event_type: event["type"].as_str().expect("an event type").to_owned(),
            body: serde_json::to_vec(event).unwrap(),
        });
    }

    fn next_event_id(&self) -> String {
        format!("evt_1Shapes{:03}", self.deliveries.len())
    }

    /// A snapshot event of `event_type` on the platform, or on `account`; invoice events each get
    /// an invoice of their own, so the handlers book real rows.
    fn snapshot(&mut self, event_type: &str, account: Option<&str>) {
        let event_id = self.next_event_id();
        let object = if event_type.starts_with("invoice.") {
            let invoice_id = format!("in_1Shapes{}", &event_id["evt_1Shapes".len()..]);
            let invoice = invoice_as_of(event_type, &invoice_id);
            self.expect_invoice(event_type, &invoice_id, invoice["amount_paid"].as_i64().unwrap());
            invoice
        } else {
            object_for(event_type).0
        };
        let mut event = snapshot_event(&event_id, event_type, object, now());
        if let Some(account) = account {
            self.connect += 1;
            event = on_connected_account(event, account);
        }
        self.push(&event);
    }

    fn expect_invoice(&mut self, event_type: &str, invoice_id: &str, amount: i64) {
        if let Some(status) = handled_status(event_type) {
            self.invoices.insert(invoice_id.to_owned(), status);
        }
        if event_type == "invoice.paid" {
            self.payments.insert(invoice_id.to_owned(), amount);
        }
    }

    fn thin(&mut self, event_type: &str, related: Related<'_>, context: Option<&str>) {
        let event_id = self.next_event_id();
        self.thin += 1;
        self.push(&thin_event(&event_id, event_type, related, context, "2026-10-01T12:00:00.000Z"));
    }

    /// `event_type` for the Accounts v2 invoice: `customer` null, the customer is an account.
    fn accounts_v2(&mut self, event_type: &str) {
        let event_id = self.next_event_id();
        let mut invoice = invoice_as_of(event_type, ACCOUNTS_V2_INVOICE);
        invoice["customer"] = Value::Null;
        invoice["customer_account"] = json!(ACCOUNTS_V2_CUSTOMER);
        for field in ["amount_due", "subtotal", "total"] {
            invoice[field] = json!(ACCOUNTS_V2_AMOUNT);
        }
        if event_type == "invoice.paid" {
            invoice["amount_paid"] = json!(ACCOUNTS_V2_AMOUNT);
        } else {
            invoice["amount_remaining"] = json!(ACCOUNTS_V2_AMOUNT);
        }
        self.expect_invoice(event_type, ACCOUNTS_V2_INVOICE, ACCOUNTS_V2_AMOUNT);
        self.accounts_v2 += 1;
        self.push(&snapshot_event(&event_id, event_type, invoice, now()));
    }
}

/// The status the invoice handlers leave a new invoice in after `event_type`; None for the types
/// without a handler (stored and processed with no effect).
fn handled_status(event_type: &str) -> Option<&'static str> {
    match event_type {
        "invoice.created" => Some("draft"),
        "invoice.finalized" => Some("open"),
        "invoice.paid" => Some("paid"),
        "invoice.voided" => Some("void"),
        "invoice.marked_uncollectible" => Some("uncollectible"),
        _ => None,
    }
}

/// Stripe's invoice fixture (a draft of 1000 due) as `invoice_id`, in the status `event_type`
/// implies: paid in full for `invoice.paid`.
fn invoice_as_of(event_type: &str, invoice_id: &str) -> Value {
    let mut invoice = resource("invoice");
    invoice["id"] = json!(invoice_id);
    if let Some(status) = handled_status(event_type) {
        invoice["status"] = json!(status);
    }
    if event_type == "invoice.paid" {
        invoice["amount_paid"] = invoice["amount_due"].clone();
        invoice["amount_remaining"] = json!(0);
    }
    invoice
}

/// Every type of Stripe's lists once, the Connect copies, the thin events, the Accounts v2
/// invoice.
fn plan() -> Plan {
    let mut plan = Plan::default();
    for event_type in all_event_types() {
        if object_for(&event_type).1 {
            plan.real_fixtures += 1;
        } else {
            plan.stand_ins.push(event_type.clone());
        }
        plan.snapshot(&event_type, None);
    }
    for event_type in CONNECT_TYPES {
        plan.snapshot(event_type, Some(CONNECTED_ACCOUNT));
    }
    let meter = resource("billing.meter")["id"].as_str().expect("the meter fixture has an id").to_owned();
    let meter_url = format!("/v1/billing/meters/{meter}");
    for context in [None, Some(CONNECTED_ACCOUNT)] {
        let related = Related { id: &meter, object_type: "billing.meter", url: &meter_url };
        plan.thin("v1.billing.meter.error_report_triggered", related, context);
    }
    let account_url = format!("/v2/core/accounts/{ACCOUNTS_V2_CUSTOMER}");
    for event_type in ["v2.core.account.created", "v2.core.account.updated"] {
        let related = Related { id: ACCOUNTS_V2_CUSTOMER, object_type: "v2.core.account", url: &account_url };
        plan.thin(event_type, related, None);
    }
    plan.accounts_v2("invoice.created");
    plan.accounts_v2("invoice.paid");
    plan
}

/// Posts every delivery to the ingest at `base`, freshly signed with the endpoint's secret, 16 at
/// a time; returns those not answered 200, with the status and body.
async fn post_all<'a>(base: &str, deliveries: impl IntoIterator<Item = &'a Delivery>) -> Vec<String> {
    let http = http_client();
    let url = format!("{base}/webhooks/stripe/{ENDPOINT}");
    let permits = Arc::new(tokio::sync::Semaphore::new(16));
    let mut posts = tokio::task::JoinSet::new();
    for delivery in deliveries {
        let (http, url, permits) = (http.clone(), url.clone(), permits.clone());
        let (label, body) = (format!("{} {}", delivery.event_id, delivery.event_type), delivery.body.clone());
        posts.spawn(async move {
            let _permit = permits.acquire_owned().await.unwrap();
            let sent = http
                .post(&url)
                .header("Content-Type", "application/json")
                .header("Stripe-Signature", sign(SECRET_A, &body))
                .body(body)
                .send()
                .await;
            match sent {
                Ok(response) if response.status().as_u16() == 200 => None,
                Ok(response) => {
                    let status = response.status().as_u16();
                    Some(format!("{label}: {status} {}", response.text().await.unwrap_or_default()))
                }
                Err(e) => Some(format!("{label}: no answer: {e}")),
            }
        });
    }
    let mut refused = Vec::new();
    while let Some(outcome) = posts.join_next().await {
        refused.extend(outcome.unwrap());
    }
    refused.sort();
    refused
}

/// The rows not processed: event id, type, attempts, parked or not, and the last error.
async fn unprocessed_rows(client: &tokio_postgres::Client) -> Vec<String> {
    client
        .query(
            "SELECT event_id, event_type, attempts, parked_at IS NOT NULL, coalesce(last_error, '')
               FROM webhook_inbox WHERE processed_at IS NULL ORDER BY event_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| {
            let (id, event_type): (String, String) = (row.get(0), row.get(1));
            let (attempts, parked, error): (i32, bool, String) = (row.get(2), row.get(3), row.get(4));
            let state = if parked { "PARKED" } else { "unprocessed" };
            format!("  {id} {event_type}: {state} after {attempts} attempt(s), last_error: {error}")
        })
        .collect()
}

#[tokio::test]
async fn every_stripe_event_type_from_stripes_fixtures_is_stored_and_processed_in_hot_updates_none_parked() {
    let started = Instant::now();
    let plan = plan();
    let types = all_event_types().len();
    eprintln!(
        "{} events: {types} Stripe event types ({} built from a real Stripe fixture, {} without one: {}), \
         {} Connect copies, {} thin events, {} Accounts v2 invoice events",
        plan.deliveries.len(),
        plan.real_fixtures,
        plan.stand_ins.len(),
        plan.stand_ins.join(", "),
        plan.connect,
        plan.thin,
        plan.accounts_v2,
    );
    assert_eq!(types, 275, "Stripe's 265 listed types and the SDK's 10");
    assert_eq!(plan.real_fixtures, 265, "every type of Stripe's API list has its fixture");

    let db = TestDb::new().await;
    let client = db.client().await;
    let mut ingest = command("inbox-ingest");
    ingest
        .env("DATABASE_URL", db.url())
        .env("INBOX_ENDPOINTS", format!("{ENDPOINT}={SECRET_A}"))
        .env("INBOX_LISTEN", "127.0.0.1:0");
    let (ingest, base) = start_ingest(ingest);
    // A short attempt budget: an event a handler refuses parks within seconds, and the failure
    // below names it with its error, instead of the test waiting out the default backoff. Every
    // type without a handler is ignored explicitly (`--ignore '*'`): a worker claims only the
    // types it handles or ignores.
    let mut worker = command("inbox-worker");
    worker.env("DATABASE_URL", db.url()).args([
        "run",
        "--poll-interval",
        "100ms",
        "--max-attempts",
        "3",
        "--ignore",
        "*",
    ]);
    let mut worker = Proc::spawn(worker);
    worker.wait_for_line("inbox-worker running", Duration::from_secs(30));

    // Every event is answered 200 …
    let refused = post_all(&base, &plan.deliveries).await;
    assert!(refused.is_empty(), "not answered 200:\n{}\ningest:\n{}", refused.join("\n"), ingest.output());
    let sent = plan.deliveries.len() as i64;
    assert_eq!(db.count("webhook_inbox").await, sent, "one row per event");

    // … and a second delivery of some of them too, stored once.
    let again: Vec<&Delivery> = plan
        .deliveries
        .iter()
        .filter(|d| {
            d.event_type.starts_with("v1.")
                || d.event_type.starts_with("v2.")
                || d.event_type == "invoice.paid"
                || ["account.updated", "charge.succeeded", "customer.subscription.updated"]
                    .contains(&d.event_type.as_str())
        })
        .collect();
    let refused = post_all(&base, again.iter().copied()).await;
    assert!(refused.is_empty(), "duplicates not answered 200:\n{}", refused.join("\n"));
    assert_eq!(db.count("webhook_inbox").await, sent, "the {} duplicates were stored again", again.len());

    // Every row is processed (handled, or ignored for the types without a handler), none parked.
    let settled = eventually(PROCESSING_BOUND, || async {
        scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NULL AND parked_at IS NULL")
            .await
            == 0
    })
    .await;
    let unprocessed = unprocessed_rows(&client).await;
    assert!(
        unprocessed.is_empty(),
        "{} of {sent} events not processed{}:\n{}",
        unprocessed.len(),
        if settled { "" } else { " (some still retrying after the bound)" },
        unprocessed.join("\n")
    );
    assert_eq!(scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE parked_at IS NOT NULL").await, 0);
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NOT NULL").await,
        sent
    );

    // The Accounts v2 payment is booked once, in full, and its invoice is paid.
    let booked: Vec<(String, i64)> = client
        .query("SELECT kind, amount FROM ledger_entries WHERE invoice_id = $1", &[&ACCOUNTS_V2_INVOICE])
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    assert_eq!(booked, [("payment".to_owned(), ACCOUNTS_V2_AMOUNT)], "the Accounts v2 invoice.paid booking");
    // The invoice handlers made a real invoice of every invoice event they handle, Stripe's
    // fixture included, and booked each payment once (the duplicates booked nothing).
    let invoices: BTreeMap<String, String> = client
        .query("SELECT id, status FROM invoices", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    let expected: BTreeMap<String, String> =
        plan.invoices.iter().map(|(id, status)| (id.clone(), (*status).to_owned())).collect();
    assert_eq!(invoices, expected, "the invoices and their statuses");
    assert_eq!(invoices.get(ACCOUNTS_V2_INVOICE).map(String::as_str), Some("paid"));
    let payer = client
        .query_one(
            "SELECT customer_id, customer_account FROM invoices WHERE id = $1",
            &[&ACCOUNTS_V2_INVOICE],
        )
        .await
        .unwrap();
    assert_eq!(
        (payer.get::<_, Option<String>>(0), payer.get::<_, Option<String>>(1).as_deref()),
        (None, Some(ACCOUNTS_V2_CUSTOMER)),
        "the Accounts v2 payer is recorded as Stripe sent it"
    );
    let payments: BTreeMap<String, i64> = client
        .query("SELECT invoice_id, amount FROM ledger_entries WHERE kind = 'payment'", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    assert_eq!(payments, plan.payments, "one ledger booking per invoice.paid");
    assert_eq!(db.count("ledger_entries").await, plan.payments.len() as i64);
    assert_eq!(db.count("outbox").await, plan.payments.len() as i64);

    // Every claim and every processed mark was a HOT update, whatever the event's size: no index
    // of webhook_inbox names a column they write, and fillfactor 30 leaves each row room on its
    // page for both new versions, whether its payload stays in the row (Stripe's events under ~2 KB:
    // `customer.*`, `payment_intent.*`, …) or goes out of line (docs/performance.md, "A claim HOT
    // can serve"). The worker's sessions report their counts as they end.
    worker.signal(libc::SIGTERM);
    assert!(worker.wait(Duration::from_secs(30)).success(), "{}", worker.output());
    let updates = || async {
        client.batch_execute("SELECT pg_stat_clear_snapshot()").await.unwrap();
        let row = client
            .query_one(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'webhook_inbox'",
                &[],
            )
            .await
            .unwrap();
        (row.get::<_, i64>(0), row.get::<_, i64>(1))
    };
    eventually(Duration::from_secs(10), || async { updates().await.0 >= 2 * sent }).await;
    let (updated, hot) = updates().await;
    assert!(
        updated >= 2 * sent,
        "{updated} updates of webhook_inbox counted, a claim and a mark per event expected"
    );
    // A retry (a handler's transaction that failed, under a loaded machine) writes the failure and
    // claims again: those versions need not fit on the page. None is expected here.
    let retried = scalar(&client, "SELECT count(*) FROM webhook_inbox WHERE attempts > 1").await;
    assert!(
        updated - hot <= 3 * retried,
        "{} of {updated} updates of webhook_inbox not HOT, with {retried} rows retried",
        updated - hot
    );
    eprintln!(
        "{sent} events stored and processed, none parked, {hot} of {updated} updates HOT, in {:?}",
        started.elapsed()
    );
}
