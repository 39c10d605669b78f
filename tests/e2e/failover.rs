//! After a database failover: a primary PostgreSQL and its asynchronous streaming replica
//! (`inbox_test_support::replica`), `inbox-ingest` acknowledging signed webhooks on the primary,
//! the replica falling behind (its walreceiver stopped), the primary SIGKILLed and the replica
//! promoted — the events acknowledged last are not on it, and Stripe will not send them again.
//! `inbox-worker reconcile` against the local Stripe API stand-in, which holds every event, brings
//! back exactly those; `inbox-worker run` then applies every event once. All binaries run as
//! processes, as operators run them. `docs/operations.md`, "After a database failover".

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use inbox_test_support::app::http_client;
use inbox_test_support::db::{column, scalar};
use inbox_test_support::events::{now, sign, SECRET_A};
use inbox_test_support::process::{command, run_split, start_ingest, Proc};
use inbox_test_support::replica::ReplicaPair;
use inbox_test_support::stripe_api::StripeApi;
use inbox_test_support::stripe_fixtures::{resource, snapshot_event};
use inbox_test_support::worker::eventually;
use serde_json::{json, Value};

const ENDPOINT: &str = "billing";
const API_KEY: &str = "sk_test_51InboxFailoverStandInKey0000";
/// Events acknowledged while the replica streams (all of them reach it).
const BEFORE_THE_PAUSE: usize = 150;
/// Events posted after the pause, per round.
const ROUND: usize = 25;
/// Rounds whose every commit lies beyond the WAL the primary sent before it is killed.
const ROUNDS_PAST_SENT: usize = 2;
/// At most this many events in all: past it the fault did not hold (the walsender kept sending).
const MAX_EVENTS: usize = 1000;
/// Requests in flight at once.
const IN_FLIGHT: usize = 8;

/// The events Stripe created (the stand-in holds each before it is posted), and the ingest's
/// answers.
struct Stripe {
    api: StripeApi,
    base: String,
    http: reqwest::Client,
    /// Every event created, in order.
    events: Vec<String>,
    /// The events the ingest answered 2xx.
    acknowledged: Vec<String>,
    /// Invoice id → amount, of the `invoice.paid` events.
    payments: BTreeMap<String, i64>,
    /// Invoices an `invoice.created` was sent for.
    invoices: HashSet<String>,
}

impl Stripe {
    /// Event `n`: `invoice.created` (even) or `invoice.paid` (odd) of invoice `n / 2`, the
    /// invoice fixture of Stripe's OpenAPI repository with its id, status and amounts set.
    fn event(&mut self, n: usize) -> Value {
        let invoice_id = format!("in_1Failover{:05}", n / 2);
        let amount = 1000 + (n / 2) as i64;
        let mut invoice = resource("invoice");
        invoice["id"] = json!(invoice_id);
        invoice["amount_due"] = json!(amount);
        invoice["total"] = json!(amount);
        invoice["subtotal"] = json!(amount);
        let event_type = if n % 2 == 0 {
            invoice["status"] = json!("draft");
            self.invoices.insert(invoice_id);
            "invoice.created"
        } else {
            invoice["status"] = json!("paid");
            invoice["amount_paid"] = json!(amount);
            invoice["amount_remaining"] = json!(0);
            invoice["status_transitions"]["paid_at"] = json!(now());
            self.payments.insert(invoice_id, amount);
            "invoice.paid"
        };
        snapshot_event(&format!("evt_1Failover{n:05}"), event_type, invoice, now())
    }

    /// Creates `count` events (the stand-in lists them from now on) and posts each, signed, to
    /// the ingest, `IN_FLIGHT` at a time; records those answered 2xx.
    async fn deliver(&mut self, count: usize) {
        let mut bodies = Vec::with_capacity(count);
        for _ in 0..count {
            let event = self.event(self.events.len());
            let id = event["id"].as_str().unwrap().to_owned();
            // The webhook's body is the event Stripe lists: the same JSON.
            bodies.push((id.clone(), serde_json::to_vec(&event).unwrap()));
            self.api.add_event(event);
            self.events.push(id);
        }
        let url = format!("{}/webhooks/stripe/{ENDPOINT}", self.base);
        for chunk in bodies.chunks(IN_FLIGHT) {
            let mut posts = tokio::task::JoinSet::new();
            for (id, body) in chunk.iter().cloned() {
                let request =
                    self.http.post(&url).header("Stripe-Signature", sign(SECRET_A, &body)).body(body);
                posts.spawn(async move { (id, request.send().await.map(|r| r.status().as_u16())) });
            }
            while let Some(done) = posts.join_next().await {
                let (id, status) = done.unwrap();
                let status = status.unwrap_or_else(|e| panic!("posting {id}: {e}"));
                assert!((200..300).contains(&status), "{id} answered {status} by a healthy primary");
                self.acknowledged.push(id);
            }
        }
    }
}

/// `inbox-worker reconcile --endpoint billing --since 1h --json` on `database_url`: its report.
async fn reconcile(database_url: &str, stripe_base: &str) -> Value {
    let mut cmd = command("inbox-worker");
    cmd.env("DATABASE_URL", database_url)
        .env("STRIPE_API_KEY", API_KEY)
        .env("STRIPE_API_BASE", stripe_base)
        .env("USER", "failover-test")
        .args(["reconcile", "--endpoint", ENDPOINT, "--since", "1h", "--json"]);
    let (code, stdout, output) =
        tokio::task::spawn_blocking(move || run_split(cmd, Duration::from_secs(60))).await.unwrap();
    assert_eq!(code, 0, "reconcile failed:\n{output}");
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not one JSON document ({e}):\n{output}"))
}

#[tokio::test]
async fn acknowledged_events_lost_by_promoting_an_async_replica_are_all_back_after_reconcile() {
    let started = Instant::now();
    let mut pair = ReplicaPair::start().await;
    let set_up = started.elapsed();
    let api = StripeApi::start(API_KEY).await;
    let stripe_base = api.base_url();
    let mut ingest = command("inbox-ingest");
    ingest
        .env("DATABASE_URL", pair.primary_url())
        .env("INBOX_ENDPOINTS", format!("{ENDPOINT}={SECRET_A}"))
        .env("INBOX_LISTEN", "127.0.0.1:0");
    let (ingest, base) = tokio::task::spawn_blocking(move || start_ingest(ingest)).await.unwrap();
    let mut stripe = Stripe {
        api,
        base,
        http: http_client(),
        events: Vec::new(),
        acknowledged: Vec::new(),
        payments: BTreeMap::new(),
        invoices: HashSet::new(),
    };

    // The replica streams: everything acknowledged reaches it.
    stripe.deliver(BEFORE_THE_PAUSE).await;
    pair.wait_replayed().await;
    let on_the_replica_at_the_pause: HashSet<String> = stripe.acknowledged.iter().cloned().collect();

    // The fault: the replica stops receiving WAL; the ingest goes on acknowledging. A burst of
    // writes (as a batch job makes a real replica lag) fills the socket buffers between the two
    // until the primary's walsender sends nothing more; then whole rounds of acknowledged commits
    // lie beyond what it sent, while what it sent does not move.
    pair.pause_replica().await;
    let at_the_pause = pair.wal_positions().await;
    stripe.deliver(ROUND).await;
    let mut stalled = pair.write_until_the_walsender_stalls().await;
    let mut positions = stalled;
    let mut rounds_past_sent = 0;
    while rounds_past_sent < ROUNDS_PAST_SENT {
        assert!(
            stripe.events.len() < MAX_EVENTS,
            "the primary kept sending WAL to the paused replica: {positions:?}\n{}",
            pair.logs()
        );
        let round_starts_at = pair.wal_positions().await.written;
        stripe.deliver(ROUND).await;
        positions = pair.wal_positions().await;
        if positions.sent != stalled.sent {
            // The walsender was slow, not stuck: more writes, and count the rounds again.
            stalled = pair.write_until_the_walsender_stalls().await;
            rounds_past_sent = 0;
        } else if round_starts_at > positions.sent.expect("the paused replica is still connected") {
            rounds_past_sent += 1;
        }
    }
    let sent = positions.sent.unwrap_or(0);
    eprintln!(
        "paused replica: {} events acknowledged after the pause; the walsender sent {} KiB more (into \
         the socket buffers) and stopped; the primary wrote {} KiB past that",
        stripe.events.len() - BEFORE_THE_PAUSE,
        (sent - at_the_pause.written) / 1024,
        (positions.written - sent) / 1024
    );

    // The failover: the primary dies, the replica gets what its socket still held, is promoted.
    pair.kill_primary();
    drop(ingest);
    pair.resume_replica();
    let failover_at = Instant::now();
    pair.promote_replica().await;
    let promotion = failover_at.elapsed();
    let promoted = pair.replica_client().await;
    let present: HashSet<String> =
        column(&promoted, "SELECT event_id FROM webhook_inbox").await.into_iter().collect();
    let lost: Vec<&String> = stripe.acknowledged.iter().filter(|id| !present.contains(*id)).collect();
    let (k, m) = (lost.len(), stripe.acknowledged.len());
    eprintln!("lost by the promotion: {k} of {m} acknowledged");
    assert!(k > 0, "the promotion lost nothing: the fault was not real\n{}", pair.logs());
    assert!(
        lost.iter().all(|id| !on_the_replica_at_the_pause.contains(*id)),
        "an event the replica had replayed before the pause is missing"
    );
    assert_eq!(present.len(), m - k, "the promoted replica holds an event nobody acknowledged");

    // The services on the promoted replica: reconcile brings back exactly what was lost.
    let url = pair.replica_url();
    let report = reconcile(&url, &stripe_base).await;
    eprintln!("reconcile: {report}");
    let count = |field: &str| report[field].as_i64().unwrap_or_else(|| panic!("no {field} in {report}"));
    assert_eq!(count("inserted"), k as i64, "{report}");
    assert_eq!(count("found"), stripe.events.len() as i64, "{report}");
    assert_eq!(count("already_present"), (m - k) as i64, "{report}");
    assert_eq!(count("skipped_no_handler"), 0, "{report}");
    let mut inbox: Vec<String> = column(&promoted, "SELECT event_id FROM webhook_inbox").await;
    inbox.sort();
    let mut created = stripe.events.clone();
    created.sort();
    assert_eq!(inbox, created, "the inbox holds every event Stripe lists, once");
    let from_the_api: HashSet<String> =
        column(&promoted, "SELECT event_id FROM webhook_inbox WHERE source = 'api'")
            .await
            .into_iter()
            .collect();
    assert_eq!(from_the_api, lost.iter().map(|id| (*id).clone()).collect(), "the rows reconcile inserted");

    // The worker applies every event, once.
    let mut worker = command("inbox-worker");
    worker.env("DATABASE_URL", &url).args(["run", "--poll-interval", "100ms"]);
    let worker = Proc::spawn(worker);
    worker.wait_for_line("inbox-worker running", Duration::from_secs(30));
    let processed = eventually(Duration::from_secs(30), || async {
        scalar(&promoted, "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NULL").await == 0
    })
    .await;
    assert!(processed, "not every row was processed:\n{}", worker.output());
    drop(worker);
    let paid = stripe.payments.len() as i64;
    let booked: Vec<(String, i64)> = promoted
        .query("SELECT invoice_id, amount FROM ledger_entries ORDER BY invoice_id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let expected: Vec<(String, i64)> =
        stripe.payments.iter().map(|(id, amount)| (id.clone(), *amount)).collect();
    assert_eq!(booked, expected, "one ledger entry per paid invoice, with its amount");
    assert_eq!(scalar(&promoted, "SELECT count(*) FROM outbox").await, paid, "one announcement per booking");
    assert_eq!(
        scalar(&promoted, "SELECT count(*) FROM invoices WHERE status = 'paid'").await,
        paid,
        "every paid invoice is paid"
    );
    assert_eq!(scalar(&promoted, "SELECT count(*) FROM invoices").await, stripe.invoices.len() as i64);

    // A second reconcile finds nothing more to insert.
    let again = reconcile(&url, &stripe_base).await;
    assert_eq!(again["inserted"].as_i64(), Some(0), "{again}");
    assert_eq!(again["already_present"].as_i64(), Some(stripe.events.len() as i64), "{again}");
    eprintln!(
        "failover test: {:.1} s in all (the pair {:.1} s, kill to promoted {:.1} s)",
        started.elapsed().as_secs_f64(),
        set_up.as_secs_f64(),
        promotion.as_secs_f64()
    );
}
