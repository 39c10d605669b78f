//! After the run: wait for the queue to drain, then compare what was acknowledged with what the
//! database holds. Also: webhook_inbox's dead tuples and size, and what the server's log says.

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
    /// Parked rows (`parked_at` set: at the attempt limit, or held on arrival). Fails the run:
    /// under these faults a parked row is a bug (infrastructure faults give the attempt back).
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
            && self.parked == 0
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

/// webhook_inbox's tuples and size at one moment.
#[derive(Debug, Clone, Default)]
pub struct TableStats {
    /// `pg_stat_user_tables` counters: approximate, and restarted from zero by a crash restart.
    pub live_tuples: i64,
    pub dead_tuples: i64,
    pub autovacuums: i64,
    pub vacuums: i64,
    pub updates: i64,
    pub hot_updates: i64,
    /// `pg_total_relation_size` (heap, indexes, TOAST) and `pg_relation_size` (heap).
    pub total_bytes: i64,
    pub heap_bytes: i64,
    /// Counted by `pgstattuple` (a full scan), when the extension is there: exact.
    pub exact_live_tuples: Option<i64>,
    pub exact_dead_tuples: Option<i64>,
    pub free_bytes: Option<i64>,
}

impl TableStats {
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "n_live_tup": self.live_tuples,
            "n_dead_tup": self.dead_tuples,
            "autovacuum_count": self.autovacuums,
            "vacuum_count": self.vacuums,
            "n_tup_upd": self.updates,
            "n_tup_hot_upd": self.hot_updates,
            "total_bytes": self.total_bytes,
            "heap_bytes": self.heap_bytes,
            "pgstattuple_live": self.exact_live_tuples,
            "pgstattuple_dead": self.exact_dead_tuples,
            "pgstattuple_free_bytes": self.free_bytes,
        })
    }

    pub fn describe(&self) -> String {
        let exact = match (self.exact_live_tuples, self.exact_dead_tuples, self.free_bytes) {
            (Some(l), Some(d), Some(f)) => format!("; pgstattuple: {l} live, {d} dead, {} free", mib(f)),
            _ => String::new(),
        };
        format!(
            "{} live / {} dead tuples, {} total ({} heap), {} autovacuum(s){exact}",
            self.live_tuples,
            self.dead_tuples,
            mib(self.total_bytes),
            mib(self.heap_bytes),
            self.autovacuums
        )
    }
}

pub fn mib(bytes: i64) -> String {
    format!("{:.1} MiB", bytes as f64 / 1048576.0)
}

/// webhook_inbox's statistics and size; with pgstattuple's exact counts when `exact` and the
/// extension is installed in the database.
pub async fn table_stats(config: &tokio_postgres::Config, exact: bool) -> anyhow::Result<TableStats> {
    let client = connect(config).await?;
    let r = client
        .query_one(
            "SELECT n_live_tup, n_dead_tup, autovacuum_count, vacuum_count, n_tup_upd, n_tup_hot_upd,
                    pg_total_relation_size(relid), pg_relation_size(relid)
               FROM pg_stat_user_tables WHERE relname = 'webhook_inbox'",
            &[],
        )
        .await?;
    let mut stats = TableStats {
        live_tuples: r.get(0),
        dead_tuples: r.get(1),
        autovacuums: r.get(2),
        vacuums: r.get(3),
        updates: r.get(4),
        hot_updates: r.get(5),
        total_bytes: r.get(6),
        heap_bytes: r.get(7),
        ..TableStats::default()
    };
    let has_pgstattuple = exact
        && client
            .query_one("SELECT count(*) > 0 FROM pg_extension WHERE extname = 'pgstattuple'", &[])
            .await?
            .get::<_, bool>(0);
    if has_pgstattuple {
        let r = client
            .query_one(
                "SELECT tuple_count, dead_tuple_count, free_space FROM pgstattuple('webhook_inbox')",
                &[],
            )
            .await?;
        stats.exact_live_tuples = Some(r.get(0));
        stats.exact_dead_tuples = Some(r.get(1));
        stats.free_bytes = Some(r.get(2));
    }
    Ok(stats)
}

/// The largest values seen while the load ran.
#[derive(Debug, Clone, Default)]
pub struct Peaks {
    pub dead_tuples: i64,
    pub total_bytes: i64,
    /// The oldest snapshot's age in the database (`age(backend_xmin)`), in transactions.
    pub xmin_age: i32,
    pub samples: u64,
}

/// Samples webhook_inbox's dead tuples and size and the oldest xmin every two seconds until
/// `stop`; a failed sample (the server away) is skipped.
pub async fn sample_peaks(
    config: tokio_postgres::Config,
    stop: tokio_util::sync::CancellationToken,
) -> Peaks {
    let mut peaks = Peaks::default();
    let mut client: Option<tokio_postgres::Client> = None;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return peaks,
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
        }
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            client = connect(&config).await.ok();
        }
        let Some(c) = &client else { continue };
        let sample = c
            .query_one(
                "SELECT (SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'webhook_inbox'),
                        pg_total_relation_size('webhook_inbox'),
                        (SELECT coalesce(max(age(backend_xmin)), 0) FROM pg_stat_activity
                          WHERE datname = current_database())",
                &[],
            )
            .await;
        if let Ok(r) = sample {
            peaks.dead_tuples = peaks.dead_tuples.max(r.get::<_, Option<i64>>(0).unwrap_or(0));
            peaks.total_bytes = peaks.total_bytes.max(r.get(1));
            peaks.xmin_age = peaks.xmin_age.max(r.get(2));
            peaks.samples += 1;
        }
    }
}

/// What the server's log says about the run (the run's own cluster).
#[derive(Debug, Clone, Default)]
pub struct ServerLog {
    pub panics: u64,
    pub no_space: u64,
    pub crash_recoveries: u64,
    pub startup_failures: u64,
    pub ready: u64,
    pub terminated_by_admin: u64,
    /// Sessions ended by `idle_in_transaction_session_timeout` (none expected: the services
    /// never sit in a transaction, the xmin pin turns the timeout off for itself).
    pub idle_in_transaction_timeouts: u64,
    /// Connections refused because the server was full, by user.
    pub full_refusals: std::collections::BTreeMap<String, u64>,
}

impl ServerLog {
    pub fn read(path: &std::path::Path) -> Option<ServerLog> {
        let text = std::fs::read_to_string(path).ok()?;
        let mut log = ServerLog::default();
        for line in text.lines() {
            if line.contains(" PANIC: ") {
                log.panics += 1;
            }
            if line.contains("No space left on device") {
                log.no_space += 1;
            }
            if line.contains("automatic recovery in progress") {
                log.crash_recoveries += 1;
            }
            if line.contains("shutting down due to startup process failure") {
                log.startup_failures += 1;
            }
            if line.contains("database system is ready to accept connections") {
                log.ready += 1;
            }
            if line.contains("terminating connection due to administrator command") {
                log.terminated_by_admin += 1;
            }
            if line.contains("terminating connection due to idle-in-transaction timeout") {
                log.idle_in_transaction_timeouts += 1;
            }
            if line.contains("FATAL:")
                && (line.contains("too many clients already")
                    || line.contains("remaining connection slots are reserved"))
            {
                // "<time> [<pid>] <user>@<database> FATAL: …"
                let user = line
                    .split_once("] ")
                    .and_then(|(_, rest)| rest.split_once('@'))
                    .map_or("?", |(user, _)| user);
                *log.full_refusals.entry(user.to_owned()).or_default() += 1;
            }
        }
        Some(log)
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "panics": self.panics,
            "no_space_left_errors": self.no_space,
            "crash_recoveries": self.crash_recoveries,
            "startup_failures": self.startup_failures,
            "ready_to_accept_connections": self.ready,
            "terminated_by_administrator_command": self.terminated_by_admin,
            "idle_in_transaction_timeouts": self.idle_in_transaction_timeouts,
            "refused_server_full_by_user": self.full_refusals,
        })
    }
}
