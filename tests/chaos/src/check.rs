//! After the run: wait for the queue to drain, then compare what was acknowledged with what the
//! database holds.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use crate::faults::connect;
use crate::load::Offered;

/// Waits until no row is unprocessed and not parked (ready, leased or waiting for its retry), up
/// to `timeout`. Returns how long it took and whether it drained.
pub async fn drain(config: &tokio_postgres::Config, timeout: Duration) -> (Duration, bool) {
    let started = Instant::now();
    let mut last_report = Instant::now();
    loop {
        let pending = async {
            let client = connect(config).await?;
            let row = client
                .query_one(
                    "SELECT count(*) FILTER (WHERE available_at <= now()),
                            count(*)
                       FROM webhook_inbox WHERE processed_at IS NULL AND parked_at IS NULL",
                    &[],
                )
                .await?;
            anyhow::Ok((row.get::<_, i64>(0), row.get::<_, i64>(1)))
        }
        .await;
        match pending {
            Ok((_, 0)) => return (started.elapsed(), true),
            Ok((ready, all)) if last_report.elapsed() >= Duration::from_secs(5) => {
                println!("chaos: draining: {all} unprocessed ({ready} ready, the rest leased or in backoff)");
                last_report = Instant::now();
            }
            Ok(_) => {}
            Err(e) => println!("chaos: draining: {e:#}"),
        }
        if started.elapsed() >= timeout {
            return (started.elapsed(), false);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[derive(Debug, Default)]
pub struct Verdict {
    pub inbox_rows: i64,
    pub processed_rows: i64,
    /// Acknowledged events missing from webhook_inbox.
    pub lost: u64,
    pub lost_examples: Vec<String>,
    /// Acknowledged payments booked more than once (ledger or outbox).
    pub doubled: u64,
    pub doubled_examples: Vec<String>,
    /// Unprocessed rows below the attempt limit after the drain.
    pub stuck: u64,
    pub stuck_examples: Vec<String>,
    /// Rows at the attempt limit (parked for review).
    pub parked: u64,
    pub parked_without_reason: u64,
    pub parked_examples: Vec<String>,
    /// Acknowledged payments whose rows are all processed but that have no ledger entry.
    pub unbooked: u64,
    pub unbooked_examples: Vec<String>,
    /// Acknowledged payments not booked because their rows are parked (reported, not lost).
    pub unbooked_parked: u64,
    /// Bookings whose amount differs from the payment's.
    pub wrong_amount: u64,
    /// Booked invoices whose status is not `paid`.
    pub wrong_status: u64,
    pub ledger_rows: i64,
    pub outbox_rows: i64,
    pub acked_payments: u64,
    pub latency_max_ms: f64,
    pub latency_p50_ms: f64,
    pub latency_p99_ms: f64,
}

impl Verdict {
    pub fn ok(&self) -> bool {
        self.lost == 0
            && self.doubled == 0
            && self.stuck == 0
            && self.unbooked == 0
            && self.parked_without_reason == 0
            && self.wrong_amount == 0
            && self.wrong_status == 0
            && self.ledger_rows == self.outbox_rows
    }
}

const EXAMPLES: usize = 10;

fn example(list: &mut Vec<String>, text: impl FnOnce() -> String) {
    if list.len() < EXAMPLES {
        list.push(text());
    }
}

pub async fn verify(
    config: &tokio_postgres::Config,
    offered: &[std::sync::Arc<Offered>],
) -> anyhow::Result<Verdict> {
    let client = connect(config).await?;
    let mut v = Verdict::default();

    // Every row of the inbox: (processed, parked).
    let mut rows: HashMap<String, (bool, bool)> = HashMap::new();
    for r in client
        .query(
            "SELECT event_id, processed_at IS NOT NULL, attempts, last_error, available_at - now() > interval '0',
                    parked_at IS NOT NULL
               FROM webhook_inbox WHERE endpoint = 'billing'",
            &[],
        )
        .await?
    {
        let id: String = r.get(0);
        let processed: bool = r.get(1);
        let attempts: i32 = r.get(2);
        let last_error: Option<String> = r.get(3);
        let waiting: bool = r.get(4);
        v.inbox_rows += 1;
        let parked: bool = r.get(5);
        if processed {
            v.processed_rows += 1;
        } else if parked {
            v.parked += 1;
            if last_error.is_none() {
                v.parked_without_reason += 1;
            }
            example(&mut v.parked_examples, || format!("{id}: attempts {attempts}, last_error {last_error:?}"));
        } else {
            v.stuck += 1;
            example(&mut v.stuck_examples, || {
                format!("{id}: attempts {attempts}, available later: {waiting}, last_error {last_error:?}")
            });
        }
        rows.insert(id, (processed, parked));
    }

    // Bookings per invoice.
    let mut ledger: HashMap<String, (i64, i64, i64)> = HashMap::new();
    for r in client
        .query(
            "SELECT invoice_id, count(*), min(amount), max(amount) FROM ledger_entries
              WHERE kind = 'payment' GROUP BY invoice_id",
            &[],
        )
        .await?
    {
        ledger.insert(r.get(0), (r.get(1), r.get(2), r.get(3)));
    }
    let mut outbox: HashMap<String, i64> = HashMap::new();
    for r in client
        .query(
            "SELECT aggregate_id, count(*) FROM outbox
              WHERE event_type = 'InvoicePaymentBooked' GROUP BY aggregate_id",
            &[],
        )
        .await?
    {
        outbox.insert(r.get(0), r.get(1));
    }
    v.ledger_rows = client.query_one("SELECT count(*) FROM ledger_entries", &[]).await?.get(0);
    v.outbox_rows = client.query_one("SELECT count(*) FROM outbox", &[]).await?.get(0);
    let statuses: HashMap<String, String> = client
        .query("SELECT id, status FROM invoices", &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();

    // Acknowledged events must be in the inbox.
    let mut payments: HashMap<&str, (i64, Vec<&str>)> = HashMap::new();
    for e in offered.iter().filter(|e| e.acked.load(Relaxed)) {
        if !rows.contains_key(&e.id) {
            v.lost += 1;
            example(&mut v.lost_examples, || format!("{} ({}, {})", e.id, e.event_type, e.invoice_id));
        }
        if e.event_type == "invoice.paid" {
            payments.entry(&e.invoice_id).or_insert((e.amount, Vec::new())).1.push(&e.id);
        }
    }
    // Every payment of an acknowledged event is booked exactly once, with its amount.
    v.acked_payments = payments.len() as u64;
    let mut doubled: HashSet<&str> = HashSet::new();
    for (invoice, (amount, event_ids)) in &payments {
        match ledger.get(*invoice) {
            None => {
                let parked = event_ids.iter().any(|id| rows.get(*id).is_some_and(|(_, parked)| *parked));
                let all_processed = event_ids.iter().all(|id| rows.get(*id).is_some_and(|(p, _)| *p));
                if parked && !all_processed {
                    v.unbooked_parked += 1;
                } else if event_ids.iter().all(|id| rows.contains_key(*id)) {
                    v.unbooked += 1;
                    example(&mut v.unbooked_examples, || format!("{invoice} (events {event_ids:?})"));
                }
            }
            Some((count, min, max)) => {
                if *count > 1 {
                    doubled.insert(invoice);
                }
                if min != amount || max != amount {
                    v.wrong_amount += 1;
                }
                if statuses.get(*invoice).map(String::as_str) != Some("paid") {
                    v.wrong_status += 1;
                }
            }
        }
        if outbox.get(*invoice).is_some_and(|n| *n > 1) {
            doubled.insert(invoice);
        }
    }
    v.doubled = doubled.len() as u64;
    for invoice in doubled.iter().take(EXAMPLES) {
        v.doubled_examples.push(format!(
            "{invoice}: ledger {:?}, outbox {:?}",
            ledger.get(*invoice).map(|l| l.0),
            outbox.get(*invoice)
        ));
    }

    let r = client
        .query_one(
            "SELECT coalesce(max(ms), 0), coalesce(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), 0),
                    coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms), 0)
               FROM (SELECT extract(epoch FROM processed_at - received_at)::float8 * 1000 AS ms
                       FROM webhook_inbox WHERE processed_at IS NOT NULL) t",
            &[],
        )
        .await?;
    v.latency_max_ms = r.get(0);
    v.latency_p50_ms = r.get(1);
    v.latency_p99_ms = r.get(2);
    Ok(v)
}
