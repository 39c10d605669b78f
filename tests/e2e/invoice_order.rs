//! Every delivery order of an invoice lifecycle ends in the same state: exhaustively over the
//! permutations, and as a property with duplicates and second Event objects mixed in.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use inbox_domain::handler::Registry;
use inbox_test_support::db::scalar;
use inbox_test_support::events::invoice_event;
use inbox_test_support::worker::{claim, execute, pool, store_event, test_limits};
use inbox_test_support::TestDb;
use proptest::prelude::*;

/// The lifecycles a real invoice can have, and the state each ends in.
const LIFECYCLES: [(&[&str], &str); 5] = [
    (&["invoice.created", "invoice.finalized", "invoice.paid"], "paid"),
    (&["invoice.created", "invoice.finalized", "invoice.voided"], "void"),
    (&["invoice.created", "invoice.finalized", "invoice.marked_uncollectible"], "uncollectible"),
    (&["invoice.created", "invoice.finalized", "invoice.marked_uncollectible", "invoice.paid"], "paid"),
    (&["invoice.created", "invoice.finalized", "invoice.marked_uncollectible", "invoice.voided"], "void"),
];

static NEXT_INVOICE: AtomicUsize = AtomicUsize::new(0);

fn status_in_payload(event_type: &str) -> &'static str {
    match event_type {
        "invoice.created" => "draft",
        "invoice.finalized" => "open",
        "invoice.paid" => "paid",
        "invoice.voided" => "void",
        _ => "uncollectible",
    }
}

/// One delivery: which lifecycle event, and which Event object (0 = the first; 1 = a second
/// object Stripe generated for the same fact).
type Delivery = (usize, u8);

/// Delivers `deliveries` of lifecycle `lifecycle` to a fresh invoice, processing each as it
/// arrives; returns (status, ledger rows, outbox rows, amount_paid).
async fn deliver(
    pool: &deadpool_postgres::Pool,
    client: &tokio_postgres::Client,
    lifecycle: usize,
    deliveries: &[Delivery],
) -> (String, i64, i64, i64) {
    let invoice = format!("in_{}", NEXT_INVOICE.fetch_add(1, Ordering::SeqCst));
    let registry = Registry::with_invoice_handlers();
    for &(step, object) in deliveries {
        let event_type = LIFECYCLES[lifecycle].0[step];
        let event_id = format!("evt_{invoice}_{step}_{object}");
        let amount = if event_type == "invoice.paid" { 4200 } else { 0 };
        store_event(
            client,
            "billing",
            &invoice_event(&event_id, event_type, &invoice, status_in_payload(event_type), amount),
        )
        .await;
        while let Some(row) = claim(pool, 1, Duration::from_secs(30), 10).await.pop() {
            execute(pool, &registry, &row, &test_limits(Duration::from_secs(5))).await;
        }
    }
    let row = client
        .query_one("SELECT status, amount_paid FROM invoices WHERE id = $1", &[&invoice])
        .await
        .unwrap();
    let ledger =
        scalar(client, &format!("SELECT count(*) FROM ledger_entries WHERE invoice_id = '{invoice}'")).await;
    let outbox =
        scalar(client, &format!("SELECT count(*) FROM outbox WHERE aggregate_id = '{invoice}'")).await;
    (row.get(0), ledger, outbox, row.get(1))
}

fn expected(lifecycle: usize) -> (String, i64, i64, i64) {
    let status = LIFECYCLES[lifecycle].1;
    let paid = status == "paid";
    (status.to_owned(), i64::from(paid), i64::from(paid), if paid { 4200 } else { 0 })
}

fn permutations(n: usize) -> Vec<Vec<usize>> {
    if n == 0 {
        return vec![vec![]];
    }
    let mut out = Vec::new();
    for p in permutations(n - 1) {
        for i in 0..=p.len() {
            let mut q = p.clone();
            q.insert(i, n - 1);
            out.push(q);
        }
    }
    out
}

#[tokio::test]
async fn every_permutation_of_every_lifecycle_ends_in_the_same_state() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let pool = pool(&db, 2);
    for (lifecycle, (events, _)) in LIFECYCLES.iter().enumerate() {
        for order in permutations(events.len()) {
            let deliveries: Vec<Delivery> = order.iter().map(|&s| (s, 0)).collect();
            let got = deliver(&pool, &client, lifecycle, &deliveries).await;
            let names: Vec<&str> = order.iter().map(|&s| events[s]).collect();
            assert_eq!(got, expected(lifecycle), "order {names:?}");
        }
    }
}

fn lifecycle_deliveries() -> impl Strategy<Value = (usize, Vec<Delivery>)> {
    (0..LIFECYCLES.len()).prop_flat_map(|lifecycle| {
        let n = LIFECYCLES[lifecycle].0.len();
        let extras = prop::collection::vec((0..n, 0u8..2), 0..4);
        extras
            .prop_flat_map(move |extras| {
                let mut all: Vec<Delivery> = (0..n).map(|s| (s, 0)).collect();
                all.extend(extras); // (s, 0) again is a redelivery, (s, 1) a second Event object
                Just(all).prop_shuffle()
            })
            .prop_map(move |deliveries| (lifecycle, deliveries))
    })
}

#[test]
fn any_order_with_duplicates_and_second_event_objects_ends_in_the_same_state() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let db = rt.block_on(TestDb::new());
    let client = rt.block_on(db.client());
    let pool = pool(&db, 2);
    let config = ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() };
    proptest!(config, |((lifecycle, deliveries) in lifecycle_deliveries())| {
        let got = rt.block_on(deliver(&pool, &client, lifecycle, &deliveries));
        prop_assert_eq!(got, expected(lifecycle), "deliveries {:?} of lifecycle {}", deliveries, lifecycle);
    });
}
