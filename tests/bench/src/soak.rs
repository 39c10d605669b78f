//! soak: the pipeline in steady state over a long run (`make soak`: `bench --phases b,soak`).
//!
//! One `inbox-ingest`, one `inbox-worker run` and one `inbox-worker relay` (to an HTTP receiver in
//! this process), worker and relay with no tuning flags; signed unique `invoice.paid` webhooks
//! sent open loop at `--soak-rate` (default: half of (b)'s 32-connection rate) for
//! `--soak-duration`; `inbox-worker purge` at its shortest retention every `--soak-purge-every`,
//! each followed by `inbox-worker reindex` at its defaults (as a deployment's timer runs it);
//! a REPEATABLE READ transaction (a reporting query) held open for `--soak-snapshot` from the
//! middle of the run. Every `--soak-sample` one sample: events processed and their
//! receive→processed p50/p99, the worker's claim latency (its `inbox_worker_claim_seconds`), the
//! size of every table and of each index of webhook_inbox and outbox, dead tuples, HOT share, WAL
//! bytes, commits and dead index entries per event, RSS and CPU per event of each process. Writes
//! `<out>/soak/samples.csv`, `samples.json` and one SVG chart per series.
//!
//! The ingest runs with a signature tolerance of [`TOLERANCE`] (the purge reads the same
//! variable), so that the purge may delete rows processed [`RETENTION`] ago: twice the tolerance,
//! the floor `purge` enforces.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use inbox_test_support::process::Proc;
use serde_json::{json, Value};
use tokio_postgres::Client;

use crate::http;
use crate::payload::Requests;
use crate::pg::{self, simple_rows};
use crate::services::{check_alive, stop};
use crate::svg::{self, Chart, Series};
use crate::util::{rss_kib, CpuSample, LogSample};
use crate::Ctx;

/// The ingest's (and the purge's) signature tolerance in this phase.
pub const TOLERANCE: &str = "1m";
/// `purge --older-than`: twice [`TOLERANCE`], the shortest the command allows.
pub const RETENTION: &str = "2m";

/// Requests are signed on the fly (none held in memory), per chunk of the run: each chunk's
/// signatures carry its start as their timestamp, and each chunk opens its own connections.
const CHUNK: Duration = Duration::from_secs(10);

/// A sample counts the rows whose processed_at lies in its interval shifted back by this much: a
/// batch transaction that started before then has committed when the sample reads.
const LAG_S: f64 = 2.0;

/// The sampler's own transactions per sample (flush, counters, tables, sizes, queue, window; and
/// the WAL by record type when the server lets it read that).
const OWN_XACTS: i64 = 6;

/// Resolution of the receive→processed histogram kept per sample: buckets of ln(ms) × this
/// (2.5 % wide), from which the percentiles of several samples together are read.
const HIST_SCALE: f64 = 40.0;

const PROCS: [&str; 3] = ["ingest", "worker", "relay"];
/// The tables whose statistics are sampled: the inbox, its queue (a table of its own from schema
/// version 17 on, when present) and the outbox.
const TABLES: [&str; 3] = ["webhook_inbox", "webhook_inbox_queue", "outbox"];
/// The tables of the dead-index-entries estimate.
const DEAD_INDEX_TABLES: [&str; 2] = ["webhook_inbox", "outbox"];

struct Services {
    ingest: Proc,
    worker: Proc,
    relay: Proc,
    worker_metrics: SocketAddr,
}

impl Services {
    fn pids(&self) -> [(&'static str, u32); 3] {
        [
            ("ingest", self.ingest.child.id()),
            ("worker", self.worker.child.id()),
            ("relay", self.relay.child.id()),
        ]
    }

    /// What each has logged so far.
    fn logs(&self) -> LogSample {
        LogSample::take(&[("ingest", &self.ingest), ("worker", &self.worker), ("relay", &self.relay)])
    }

    fn check(&mut self) -> anyhow::Result<()> {
        check_alive(&mut self.ingest, "inbox-ingest")?;
        check_alive(&mut self.worker, "inbox-worker run")?;
        check_alive(&mut self.relay, "inbox-worker relay")
    }
}

/// pg_stat_user_tables of one table: counters cumulative, at one instant (or, in a [`Sample`], the
/// counters' change over its interval and the gauges at its end).
#[derive(Debug, Clone, Copy, Default)]
struct TableStats {
    live: i64,
    dead: i64,
    ins: i64,
    upd: i64,
    hot: i64,
    del: i64,
    autovacuum: i64,
    autoanalyze: i64,
    indexes: i64,
}

impl TableStats {
    fn delta(&self, before: &TableStats) -> TableStats {
        TableStats {
            ins: self.ins - before.ins,
            upd: self.upd - before.upd,
            hot: self.hot - before.hot,
            del: self.del - before.del,
            ..*self
        }
    }
}

/// A Prometheus histogram as scraped: (upper bound, cumulative count), sum, count.
#[derive(Debug, Clone, Default)]
struct Histogram {
    buckets: Vec<(f64, f64)>,
    sum: f64,
    count: f64,
}

impl Histogram {
    fn parse(text: &str, name: &str) -> Option<Histogram> {
        let mut h = Histogram::default();
        for line in text.lines() {
            let value = || line.split_whitespace().nth(1).and_then(|v| v.parse::<f64>().ok());
            if let Some(rest) = line.strip_prefix(&format!("{name}_bucket{{le=\"")) {
                let le = rest.split('"').next()?;
                let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
                h.buckets.push((le, value()?));
            } else if line.starts_with(&format!("{name}_sum ")) {
                h.sum = value()?;
            } else if line.starts_with(&format!("{name}_count ")) {
                h.count = value()?;
            }
        }
        (!h.buckets.is_empty()).then_some(h)
    }

    /// Observations since `before`, their mean and p99 (in ms; the p99 interpolated within its
    /// bucket, as `histogram_quantile` does).
    fn since(&self, before: Option<&Histogram>) -> (f64, Option<f64>, Option<f64>) {
        let zero = Histogram::default();
        let before = before.unwrap_or(&zero);
        let n = self.count - before.count;
        if n <= 0.0 {
            return (0.0, None, None);
        }
        let mean = (self.sum - before.sum) / n * 1e3;
        let target = 0.99 * n;
        let (mut lo, mut cum_lo) = (0.0, 0.0);
        for (i, &(le, cum)) in self.buckets.iter().enumerate() {
            let cum = cum - before.buckets.get(i).map_or(0.0, |b| b.1);
            if cum >= target {
                let p99 = if le.is_finite() {
                    lo + (le - lo) * (target - cum_lo) / (cum - cum_lo).max(1e-9)
                } else {
                    lo
                };
                return (n, Some(mean), Some(p99 * 1e3));
            }
            (lo, cum_lo) = (le, cum);
        }
        (n, Some(mean), None)
    }
}

/// Cumulative readings at one instant.
#[derive(Clone)]
struct Probe {
    at: Instant,
    /// The server's clock, epoch seconds.
    server_s: f64,
    lsn: i64,
    /// The WAL flushed to disk (what `pg_get_wal_stats` may read up to), bytes from 0/0.
    flush_lsn: i64,
    commits: i64,
    tables: BTreeMap<String, TableStats>,
    /// (table, "heap" | "TOAST" | index name) → bytes.
    sizes: BTreeMap<(String, String), i64>,
    claims: Option<Histogram>,
    cpu: CpuSample,
    /// (VmRSS, VmHWM) KiB of each service and of this process (the load generator, the relay's
    /// receiver).
    rss: BTreeMap<&'static str, Option<(u64, u64)>>,
    /// RssAnon summed over the postmaster and its children: the server's private memory
    /// (shared_buffers would count once per backend in their VmRSS).
    postgres_private_kib: Option<u64>,
    /// No row processed after this instant has a smaller event id: the oldest unprocessed row's
    /// and that of the chunk two before the one being sent, whichever is smaller.
    floor_key: String,
}

/// One interval's figures.
#[derive(Debug, Clone, Default)]
struct Sample {
    /// End of the interval, seconds since the load started.
    t: f64,
    interval: f64,
    /// Length of the processed_at window counted (the interval, shifted back by [`LAG_S`]; the
    /// last sample's reaches [`LAG_S`] further, to the end of the drain).
    window: f64,
    /// The held snapshot was open during (most of) the interval.
    snapshot: bool,
    processed: i64,
    p50_ms: Option<f64>,
    p99_ms: Option<f64>,
    max_ms: Option<f64>,
    hist: BTreeMap<i32, i64>,
    claims: f64,
    claim_mean_ms: Option<f64>,
    claim_p99_ms: Option<f64>,
    wal_bytes: i64,
    commits: i64,
    tables: BTreeMap<String, TableStats>,
    sizes: BTreeMap<(String, String), i64>,
    rss_kib: BTreeMap<&'static str, Option<u64>>,
    cpu_us_per_event: BTreeMap<&'static str, Option<f64>>,
    cpu_pct: BTreeMap<&'static str, Option<f64>>,
    machine_busy_pct: Option<f64>,
}

fn per(n: f64, events: i64) -> Option<f64> {
    (events > 0).then(|| n / events as f64)
}

impl Sample {
    fn table(&self, name: &str) -> TableStats {
        self.tables.get(name).copied().unwrap_or_default()
    }

    fn events_per_s(&self) -> f64 {
        self.processed as f64 / self.window.max(1e-9)
    }

    fn hot_share(&self, table: &str) -> Option<f64> {
        let t = self.table(table);
        (t.upd > 0).then(|| t.hot as f64 / t.upd as f64)
    }

    /// Index entries the interval's non-HOT updates and deletes left dead, counting every index
    /// of the table for each (an upper estimate): (from updates, from deletes).
    fn dead_index_entries(&self) -> (i64, i64) {
        DEAD_INDEX_TABLES
            .iter()
            .map(|n| self.table(n))
            .fold((0, 0), |(u, d), t| (u + (t.upd - t.hot) * t.indexes, d + t.del * t.indexes))
    }

    /// The same for the queue's table (when the schema has one): (from updates, from deletes).
    fn queue_dead_index_entries(&self) -> (i64, i64) {
        let t = self.table("webhook_inbox_queue");
        ((t.upd - t.hot) * t.indexes, t.del * t.indexes)
    }

    /// Heap + TOAST + indexes of `table`.
    fn total_bytes(&self, table: &str) -> i64 {
        self.sizes.iter().filter(|((t, _), _)| t == table).map(|(_, b)| b).sum()
    }

    /// The CSV / JSON columns.
    fn fields(&self) -> Vec<(String, Option<f64>)> {
        let mut f: Vec<(String, Option<f64>)> = Vec::new();
        let mut put = |k: &str, v: Option<f64>| f.push((k.to_owned(), v));
        let (upd_dead, del_dead) = self.dead_index_entries();
        put("elapsed_s", Some(self.t));
        put("interval_s", Some(self.interval));
        put("snapshot_open", Some(f64::from(u8::from(self.snapshot))));
        put("processed", Some(self.processed as f64));
        put("events_per_s", Some(self.events_per_s()));
        put("receive_to_processed_p50_ms", self.p50_ms);
        put("receive_to_processed_p99_ms", self.p99_ms);
        put("receive_to_processed_max_ms", self.max_ms);
        put("claims", Some(self.claims));
        put("claim_mean_ms", self.claim_mean_ms);
        put("claim_p99_ms", self.claim_p99_ms);
        put("wal_bytes", Some(self.wal_bytes as f64));
        put("wal_bytes_per_event", per(self.wal_bytes as f64, self.processed));
        put("commits", Some(self.commits as f64));
        put("commits_per_event", per(self.commits as f64, self.processed));
        put("dead_index_entries_per_event", per((upd_dead + del_dead) as f64, self.processed));
        put("dead_index_entries_per_event_updates", per(upd_dead as f64, self.processed));
        put("dead_index_entries_per_event_deletes", per(del_dead as f64, self.processed));
        if self.tables.contains_key("webhook_inbox_queue") {
            let (u, d) = self.queue_dead_index_entries();
            put("webhook_inbox_queue.dead_index_entries_per_event", per((u + d) as f64, self.processed));
        }
        for name in TABLES.iter().filter(|t| self.tables.contains_key(**t)) {
            let t = self.table(name);
            for (k, v) in [
                ("n_live_tup", t.live),
                ("n_dead_tup", t.dead),
                ("n_tup_ins", t.ins),
                ("n_tup_upd", t.upd),
                ("n_tup_hot_upd", t.hot),
                ("n_tup_del", t.del),
                ("autovacuum_count", t.autovacuum),
                ("autoanalyze_count", t.autoanalyze),
            ] {
                put(&format!("{name}.{k}"), Some(v as f64));
            }
            put(&format!("{name}.hot_share"), self.hot_share(name));
        }
        for (p, v) in &self.rss_kib {
            put(&format!("rss_kib.{p}"), v.map(|v| v as f64));
        }
        for (p, v) in &self.cpu_us_per_event {
            put(&format!("cpu_us_per_event.{p}"), *v);
        }
        for (p, v) in &self.cpu_pct {
            put(&format!("cpu_pct_of_core.{p}"), *v);
        }
        put("machine_busy_pct", self.machine_busy_pct);
        for ((t, part), b) in &self.sizes {
            put(&format!("bytes.{t}.{part}"), Some(*b as f64));
        }
        f
    }
}

/// The tables of [`TABLES`] the schema has.
fn present(samples: &[Sample]) -> Vec<&'static str> {
    TABLES.into_iter().filter(|t| samples.iter().any(|s| s.tables.contains_key(*t))).collect()
}

/// Percentile `q` of the merged receive→processed histograms (ms).
fn hist_quantile<'a>(hists: impl Iterator<Item = &'a BTreeMap<i32, i64>>, q: f64) -> Option<f64> {
    let mut merged: BTreeMap<i32, i64> = BTreeMap::new();
    for h in hists {
        for (b, n) in h {
            *merged.entry(*b).or_default() += n;
        }
    }
    let n: i64 = merged.values().sum();
    let target = ((q * n as f64).ceil() as i64).max(1);
    let mut cum = 0;
    for (b, c) in &merged {
        cum += c;
        if cum >= target {
            return Some(((f64::from(*b) + 0.5) / HIST_SCALE).exp());
        }
    }
    None
}

/// The event-id prefix of chunk `k`.
fn chunk_tag(k: usize) -> String {
    format!("s{k:04}_")
}

fn postgres_private_kib(postmaster: u32) -> Option<u64> {
    let field = |pid: u32, file: &str| std::fs::read_to_string(format!("/proc/{pid}/{file}")).ok();
    let anon = |pid: u32| {
        field(pid, "status")?
            .lines()
            .find(|l| l.starts_with("RssAnon:"))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
    };
    let mut total = anon(postmaster)?;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let parent = field(pid, "stat").and_then(|s| {
            let rest = s[s.rfind(')')? + 2..].to_owned();
            rest.split_whitespace().nth(1)?.parse::<u32>().ok()
        });
        if parent == Some(postmaster) {
            total += anon(pid).unwrap_or(0);
        }
    }
    Some(total)
}

/// The WAL between two flush positions (`$1`, `$2`: bytes from 0/0) by record type: (type, NULL,
/// records, record bytes, full-page image bytes). `pg_get_wal_stats` only counts; cheap.
const WAL_BY_TYPE_SQL: &str = r#"
SELECT "resource_manager/record_type", NULL::text, count, record_size, fpi_size
  FROM pg_get_wal_stats('0/0'::pg_lsn + $1::text::numeric, '0/0'::pg_lsn + $2::text::numeric, true)
 WHERE count > 0"#;

/// The same by record type and by the table each record changed, read from each record's first
/// block reference (`rel <tablespace>/<database>/<filenode>`): an index counts as its table, a TOAST
/// table and its index as "<table> TOAST" (where a payload's bytes go); another database's records
/// as "(other databases)". Every record is described as text, so this costs far more than
/// [`WAL_BY_TYPE_SQL`].
const WAL_BY_TABLE_SQL: &str = r#"
WITH r AS (
  SELECT regexp_match(block_ref, '^blkref #0: rel \d+/(\d+)/(\d+)') AS m,
         resource_manager || '/' || record_type AS kind, record_length - fpi_length AS rec, fpi_length AS fpi
    FROM pg_get_wal_records_info('0/0'::pg_lsn + $1::text::numeric, '0/0'::pg_lsn + $2::text::numeric)
), g AS (
  SELECT m[1]::oid AS db, pg_filenode_relation(0, m[2]::oid) AS rel, kind,
         count(*) AS n, sum(rec)::int8 AS rec, sum(fpi)::int8 AS fpi
    FROM r GROUP BY 1, 2, 3
)
SELECT kind,
       CASE WHEN db IS NULL THEN '(no relation)'
            WHEN db <> (SELECT oid FROM pg_database WHERE datname = current_database()) THEN '(other databases)'
            ELSE coalesce(
              (SELECT t.relname || ' TOAST' FROM pg_class t WHERE t.reltoastrelid = rel),
              (SELECT t.relname || ' TOAST' FROM pg_index i JOIN pg_class t ON t.reltoastrelid = i.indrelid WHERE i.indexrelid = rel),
              (SELECT t.relname FROM pg_index i JOIN pg_class t ON t.oid = i.indrelid WHERE i.indexrelid = rel),
              (SELECT relname FROM pg_class WHERE oid = rel),
              '(unresolved)')::text
       END,
       n, rec, fpi
  FROM g"#;

/// The sampler: one connection, the worker's metrics, /proc.
struct Sampler {
    client: Client,
    http: reqwest::Client,
    t0: Instant,
    postmaster: Option<u32>,
    prev: Probe,
    /// The floor key of the probe before `prev`.
    floor: String,
    samples: Vec<Sample>,
    first: Option<Probe>,
    /// The schema has the table webhook_inbox_queue.
    queue_table: bool,
    /// The WAL of the run by record type (`pg_walinspect`'s `pg_get_wal_stats`, read interval by
    /// interval while the segments are still there): record type → (records, record bytes,
    /// full-page image bytes). None when the server does not let the bench read its WAL (the
    /// extension missing, or not a superuser): then only the total is known.
    wal_kinds: Option<BTreeMap<String, [i64; 3]>>,
    /// With `--soak-wal-by-table`: the same by the table each record changed (indexes counted as
    /// their table, TOAST apart), "(no relation)" for commits and the like.
    wal_tables: Option<BTreeMap<String, [i64; 3]>>,
}

impl Sampler {
    async fn probe(&self, ctx: &Ctx, services: &Services) -> anyhow::Result<Probe> {
        ctx.server.flush_stats(&self.client).await;
        let c = &self.client;
        let r = c
            .query_one(
                "SELECT extract(epoch FROM clock_timestamp())::float8,
                        pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8,
                        (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()),
                        pg_wal_lsn_diff(pg_current_wal_flush_lsn(), '0/0')::int8",
                &[],
            )
            .await?;
        let (server_s, lsn, commits, flush_lsn): (f64, i64, i64, i64) =
            (r.get(0), r.get(1), r.get(2), r.get(3));
        let cpu = CpuSample::take(self.postmaster, &services.pids());
        let mut tables = BTreeMap::new();
        for r in c
            .query(
                "SELECT relname::text, n_live_tup, n_dead_tup, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del,
                        autovacuum_count, autoanalyze_count,
                        (SELECT count(*) FROM pg_index i WHERE i.indrelid = s.relid)
                   FROM pg_stat_user_tables s
                  WHERE relname IN ('webhook_inbox', 'webhook_inbox_queue', 'outbox')",
                &[],
            )
            .await?
        {
            let v = |i: usize| r.get::<_, i64>(i);
            tables.insert(
                r.get::<_, String>(0),
                TableStats {
                    live: v(1),
                    dead: v(2),
                    ins: v(3),
                    upd: v(4),
                    hot: v(5),
                    del: v(6),
                    autovacuum: v(7),
                    autoanalyze: v(8),
                    indexes: v(9),
                },
            );
        }
        let mut sizes = BTreeMap::new();
        for r in c
            .query(
                "SELECT relname::text, 'heap', pg_relation_size(relid) FROM pg_stat_user_tables
                 UNION ALL
                 SELECT relname::text, indexrelname::text, pg_relation_size(indexrelid)
                   FROM pg_stat_user_indexes
                  WHERE relname IN ('webhook_inbox', 'webhook_inbox_queue', 'outbox')
                 UNION ALL
                 SELECT relname::text, 'TOAST', coalesce(pg_total_relation_size(nullif(reltoastrelid, 0)), 0)
                   FROM pg_class WHERE oid = 'webhook_inbox'::regclass",
                &[],
            )
            .await?
        {
            sizes.insert((r.get::<_, String>(0), r.get::<_, String>(1)), r.get::<_, i64>(2));
        }
        // The queue's own table when there is one (from schema version 17), else the queue index.
        let oldest_sql = if self.queue_table {
            "SELECT min(event_id) FROM webhook_inbox_queue"
        } else {
            "SELECT min(event_id) FROM webhook_inbox WHERE processed_at IS NULL AND parked_at IS NULL"
        };
        let oldest: Option<String> = c.query_one(oldest_sql, &[]).await?.get(0);
        let chunk =
            (Instant::now().saturating_duration_since(self.t0).as_secs_f64() / CHUNK.as_secs_f64()) as usize;
        let key = format!("evt_{}", chunk_tag(chunk.saturating_sub(2)));
        let floor_key = oldest.map_or(key.clone(), |o| o.min(key));
        let claims = async {
            let text = self
                .http
                .get(format!("http://{}/metrics", services.worker_metrics))
                .timeout(Duration::from_secs(5))
                .send()
                .await
                .ok()?
                .text()
                .await
                .ok()?;
            Histogram::parse(&text, "inbox_worker_claim_seconds")
        }
        .await;
        Ok(Probe {
            at: Instant::now(),
            server_s,
            lsn,
            flush_lsn,
            commits,
            tables,
            sizes,
            claims,
            cpu,
            rss: services
                .pids()
                .iter()
                .map(|&(n, pid)| (n, rss_kib(pid)))
                .chain([("bench", rss_kib(std::process::id()))])
                .collect(),
            postgres_private_kib: self.postmaster.and_then(postgres_private_kib),
            floor_key,
        })
    }

    async fn start(ctx: &Ctx, url: &str, services: &Services, t0: Instant) -> anyhow::Result<Sampler> {
        let client = pg::connect(url).await?;
        let queue_table: bool =
            client.query_one("SELECT to_regclass('webhook_inbox_queue') IS NOT NULL", &[]).await?.get(0);
        // In the phase's own database, dropped with it.
        let wal_kinds = match client.batch_execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect").await {
            Ok(()) => Some(BTreeMap::new()),
            Err(e) => {
                ctx.say(&format!(
                    "soak: no WAL by record type (pg_walinspect: {})",
                    inbox_domain::db::describe_db_error(&e)
                ));
                None
            }
        };
        let mut s = Sampler {
            queue_table,
            client,
            http: inbox_test_support::app::http_client(),
            t0,
            postmaster: ctx.server.postmaster,
            // Replaced below.
            prev: Probe {
                at: t0,
                server_s: 0.0,
                lsn: 0,
                flush_lsn: 0,
                commits: 0,
                tables: BTreeMap::new(),
                sizes: BTreeMap::new(),
                claims: None,
                cpu: CpuSample::take(None, &[]),
                rss: BTreeMap::new(),
                postgres_private_kib: None,
                floor_key: String::new(),
            },
            floor: "evt_".into(),
            samples: Vec::new(),
            first: None,
            wal_tables: (wal_kinds.is_some() && ctx.args.soak_wal_by_table).then(BTreeMap::new),
            wal_kinds,
        };
        s.prev = s.probe(ctx, services).await?;
        s.first = Some(s.prev.clone());
        Ok(s)
    }

    /// Probes and records the interval since the last probe; `last`: after the drain, counting
    /// every row processed since (and `extra_own` more transactions of ours).
    async fn step(
        &mut self,
        ctx: &Ctx,
        services: &mut Services,
        last: bool,
        extra_own: i64,
    ) -> anyhow::Result<()> {
        services.check()?;
        let now = self.probe(ctx, services).await?;
        let upper = if last { now.server_s + 3600.0 } else { now.server_s - LAG_S };
        let row = self
            .client
            .query_one(
                &format!(
                    "WITH w AS (
                       SELECT extract(epoch FROM processed_at - received_at)::float8 * 1000 AS ms
                         FROM webhook_inbox
                        WHERE provider = 'stripe' AND endpoint = 'billing' AND event_id >= $1 AND event_id < 'evt_t'
                          AND processed_at >= to_timestamp($2) AND processed_at < to_timestamp($3)),
                     h AS (SELECT floor(ln(greatest(ms, 0.01)) * {HIST_SCALE})::int AS b, count(*) AS n FROM w GROUP BY 1)
                     SELECT (SELECT count(*) FROM w),
                            (SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ms) FROM w),
                            (SELECT percentile_cont(0.99) WITHIN GROUP (ORDER BY ms) FROM w),
                            (SELECT max(ms) FROM w),
                            (SELECT coalesce(array_agg(b ORDER BY b), '{{}}') FROM h),
                            (SELECT coalesce(array_agg(n ORDER BY b), '{{}}') FROM h)"
                ),
                &[&self.floor, &(self.prev.server_s - LAG_S), &upper],
            )
            .await
            .context("counting the interval's processed rows")?;
        let processed: i64 = row.get(0);
        let own_wal_read = self.add_wal_kinds(ctx, now.flush_lsn).await;
        let buckets: Vec<i32> = row.get(4);
        let counts: Vec<i64> = row.get(5);
        let prev = &self.prev;
        let (claims, claim_mean_ms, claim_p99_ms) =
            now.claims.as_ref().map_or((0.0, None, None), |h| h.since(prev.claims.as_ref()));
        let cpu = prev.cpu.usage(&now.cpu, Some(processed as f64));
        let names = PROCS.iter().copied().chain(["postgres"]);
        let mut rss_kib: BTreeMap<&'static str, Option<u64>> =
            now.rss.iter().map(|(n, r)| (*n, r.map(|r| r.0))).collect();
        rss_kib.insert("postgres_private", now.postgres_private_kib);
        let sample = Sample {
            t: now.at.saturating_duration_since(self.t0).as_secs_f64(),
            interval: now.at.duration_since(prev.at).as_secs_f64(),
            window: now.server_s - prev.server_s + if last { LAG_S } else { 0.0 },
            snapshot: false,
            processed,
            p50_ms: row.get(1),
            p99_ms: row.get(2),
            max_ms: row.get(3),
            hist: buckets.into_iter().zip(counts).collect(),
            claims,
            claim_mean_ms,
            claim_p99_ms,
            wal_bytes: now.lsn - prev.lsn,
            commits: (now.commits - prev.commits - OWN_XACTS - own_wal_read - extra_own).max(0),
            tables: now
                .tables
                .iter()
                .map(|(k, t)| (k.clone(), t.delta(&prev.tables.get(k).copied().unwrap_or_default())))
                .collect(),
            sizes: now.sizes.clone(),
            rss_kib,
            cpu_us_per_event: names
                .clone()
                .map(|n| (n, cpu[format!("{n}_cpu_us_per_unit")].as_f64()))
                .collect(),
            cpu_pct: names.map(|n| (n, cpu[format!("{n}_pct_of_core")].as_f64())).collect(),
            machine_busy_pct: cpu["machine_busy_pct"].as_f64(),
        };
        let minute = |t: f64| (t / 60.0).floor();
        let prev_t = self.samples.last().map_or(0.0, |s| s.t);
        if last || minute(sample.t) > minute(prev_t) {
            ctx.say(&format!(
                "soak: {:5.1} min: {:.0} events/s, receive→processed p50/p99 {}/{} ms, claim p99 {} ms, \
                 webhook_inbox {:.0} MiB, dead tuples {}, HOT {}%, {} WAL B/event, {}",
                sample.t / 60.0,
                sample.events_per_s(),
                opt(sample.p50_ms, 1),
                opt(sample.p99_ms, 1),
                opt(sample.claim_p99_ms, 2),
                sample.total_bytes("webhook_inbox") as f64 / f64::from(1 << 20),
                sample.table("webhook_inbox").dead,
                opt(sample.hot_share("webhook_inbox").map(|h| h * 100.0), 0),
                opt(per(sample.wal_bytes as f64, sample.processed), 0),
                crate::util::cpu_summary(&cpu)
            ));
        }
        self.samples.push(sample);
        self.floor = std::mem::replace(&mut self.prev, now).floor_key;
        Ok(())
    }

    /// Adds the WAL from the last probe's flush position to `flush_lsn`, by record type, to
    /// [`Sampler::wal_kinds`]; returns the transactions it took (0 or 1). A read that fails (a
    /// segment already recycled) stops the breakdown, which would then be short, and says so.
    async fn add_wal_kinds(&mut self, ctx: &Ctx, flush_lsn: i64) -> i64 {
        let Some(kinds) = self.wal_kinds.as_mut() else { return 0 };
        let from = self.prev.flush_lsn;
        if flush_lsn <= from {
            return 0;
        }
        let sql = if self.wal_tables.is_some() { WAL_BY_TABLE_SQL } else { WAL_BY_TYPE_SQL };
        let read = self.client.query(sql, &[&from.to_string(), &flush_lsn.to_string()]).await;
        match read {
            Ok(rows) => {
                for r in rows {
                    let v = [r.get::<_, i64>(2), r.get(3), r.get(4)];
                    let add = |k: &mut [i64; 3]| (0..3).for_each(|i| k[i] += v[i]);
                    add(kinds.entry(r.get(0)).or_insert([0; 3]));
                    if let Some(tables) = self.wal_tables.as_mut() {
                        add(tables.entry(r.get(1)).or_insert([0; 3]));
                    }
                }
            }
            Err(e) => {
                ctx.say(&format!(
                    "soak: WAL by record type stopped: {}",
                    inbox_domain::db::describe_db_error(&e)
                ));
                (self.wal_kinds, self.wal_tables) = (None, None);
            }
        }
        1
    }
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or("–".into(), |v| format!("{v:.digits$}"))
}

/// One run of `inbox-worker purge`, and of the `inbox-worker reindex` after it.
#[derive(Debug, Clone)]
struct Purge {
    at: f64,
    seconds: f64,
    report: Value,
    error: Option<String>,
    reindex: Reindex,
}

/// One run of `inbox-worker reindex` at its defaults: its report (also when it exits 1, having
/// given up a rebuild) and what went wrong.
#[derive(Debug, Clone)]
struct Reindex {
    seconds: f64,
    report: Value,
    error: Option<String>,
}

impl Reindex {
    /// The report's entries of the indexes it rebuilt, dropped or failed on.
    fn acted(&self) -> Vec<&Value> {
        self.report["indexes"]
            .as_array()
            .map(|all| all.iter().filter(|i| i["action"] != "left").collect())
            .unwrap_or_default()
    }

    /// `index action` of each index it rebuilt, dropped or failed on.
    fn summary(&self) -> String {
        let acted: Vec<String> = self
            .acted()
            .iter()
            .map(|i| {
                format!("{} {}", i["index"].as_str().unwrap_or("?"), i["action"].as_str().unwrap_or("?"))
            })
            .collect();
        match (&self.error, acted.is_empty()) {
            (Some(e), _) => format!("reindex {:.1} s: {} — {e}", self.seconds, acted.join(", ")),
            (None, true) => format!("reindex {:.1} s: nothing to rebuild", self.seconds),
            (None, false) => format!("reindex {:.1} s: {}", self.seconds, acted.join(", ")),
        }
    }
}

/// Runs an operator command to its end: its seconds, its stdout, and what went wrong (it could not
/// run, or it exited non-zero: the status and its stderr).
async fn run_command(mut cmd: std::process::Command) -> (f64, Vec<u8>, Option<String>) {
    let started = Instant::now();
    let out = tokio::task::spawn_blocking(move || cmd.output()).await;
    let seconds = started.elapsed().as_secs_f64();
    match out {
        Ok(Ok(o)) => {
            let error = (!o.status.success())
                .then(|| format!("{}: {}", o.status, String::from_utf8_lossy(&o.stderr).trim()));
            (seconds, o.stdout, error)
        }
        Ok(Err(e)) => (seconds, Vec::new(), Some(e.to_string())),
        Err(e) => (seconds, Vec::new(), Some(e.to_string())),
    }
}

async fn reindex(ctx: &Ctx, url: &str) -> Reindex {
    let mut cmd = ctx.bins.command("inbox-worker", url);
    cmd.args(["reindex", "--json"]);
    // Its report is on stdout also when it exits 1, having left an index.
    let (seconds, stdout, error) = run_command(cmd).await;
    Reindex { seconds, report: serde_json::from_slice(&stdout).unwrap_or(Value::Null), error }
}

async fn purge(ctx: &Ctx, url: &str, t0: Instant) -> Purge {
    let mut cmd = ctx.bins.command("inbox-worker", url);
    cmd.env("INBOX_SIGNATURE_TOLERANCE", TOLERANCE).args([
        "purge",
        "--older-than",
        RETENTION,
        "--force",
        "--actor",
        "bench-soak",
        "--json",
    ]);
    let at = t0.elapsed().as_secs_f64();
    let (seconds, stdout, error) = run_command(cmd).await;
    let (report, error) = match error {
        Some(e) => (Value::Null, Some(e)),
        None => match serde_json::from_slice::<Value>(&stdout) {
            Ok(report) => (report, None),
            Err(e) => (Value::Null, Some(format!("purge --json output: {e}"))),
        },
    };
    let reindex = reindex(ctx, url).await;
    Purge { at, seconds, report, error, reindex }
}

/// The open-loop load, chunk by chunk; returns the counts and each chunk's HTTP p99.
async fn send(
    addr: SocketAddr,
    template: String,
    rate: f64,
    conns: usize,
    t0: Instant,
    duration: Duration,
) -> anyhow::Result<(http::Counts, Vec<f64>, Option<String>)> {
    let chunks = (duration.as_secs_f64() / CHUNK.as_secs_f64()).ceil() as usize;
    let host = addr.to_string();
    let mut running = Vec::new();
    for k in 0..chunks {
        let start = t0 + CHUNK * k as u32;
        let len = CHUNK.min(duration.saturating_sub(CHUNK * k as u32));
        tokio::time::sleep_until((start - Duration::from_millis(500)).into()).await;
        let c = http::connect_all(addr, conns).await?;
        let requests = Arc::new(Requests::new(&template, &host, &chunk_tag(k), 0));
        running.push(tokio::spawn(http::open_loop(c, requests, start, rate, len)));
    }
    let mut counts = http::Counts::default();
    let mut p99s = Vec::new();
    let mut first_error = None;
    for r in running {
        let r = r.await?;
        counts.ok += r.measured.ok;
        counts.non_2xx += r.measured.non_2xx;
        counts.errors += r.measured.errors;
        p99s.push(r.latency.p99);
        first_error = first_error.or(r.first_error);
    }
    Ok((counts, p99s, first_error))
}

/// The held snapshot: (start, end) seconds since `t0`, and what its count(*) saw.
async fn hold_snapshot(
    url: &str,
    t0: Instant,
    from: Duration,
    hold: Duration,
    until: Instant,
) -> anyhow::Result<(f64, f64, i64)> {
    let client = pg::connect(url).await?;
    tokio::time::sleep_until((t0 + from).into()).await;
    let start = t0.elapsed().as_secs_f64();
    client.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ").await?;
    let rows: i64 = client.query_one("SELECT count(*) FROM webhook_inbox", &[]).await?.get(0);
    tokio::time::sleep_until((t0 + from + hold).min(until).into()).await;
    client.batch_execute("COMMIT").await?;
    Ok((start, t0.elapsed().as_secs_f64(), rows))
}

/// Why the soak stops early, if `sample`'s events waited longer than `max_lag` (p99) from receipt
/// to processing: the load outruns the pipeline, and the backlog only grows from there. What a
/// healthy run shows is far below: a p99 of tens of milliseconds, a second or two while a purge
/// or the held snapshot runs (docs/performance.md, "Soak").
fn fell_behind(sample: &Sample, rate: f64, max_lag: Duration) -> Option<String> {
    let p99_ms = sample.p99_ms?;
    if max_lag.is_zero() || p99_ms <= max_lag.as_secs_f64() * 1000.0 {
        return None;
    }
    Some(format!(
        "the pipeline fell behind the load: the events processed in the sample ending at {:.1} min \
         waited {:.0} s (p99) from receipt to processing, over --soak-max-lag {}; they were processed \
         at {:.0}/s against {rate:.0} sent/s. This machine does not carry that rate: choose one it \
         does with --soak-rate (make soak: SOAK_ARGS='--soak-rate N'), well below the rate processed \
         here (the soaks in docs/performance.md ran 2 cores at 800/s)",
        sample.t / 60.0,
        p99_ms / 1000.0,
        humantime::format_duration(max_lag),
        sample.events_per_s()
    ))
}

pub async fn run(ctx: &Ctx, rate: f64, rate_source: &str) -> anyhow::Result<Value> {
    let db = ctx.server.create_db("soak").await?;
    let result = soak(ctx, rate, rate_source, &db).await;
    ctx.server.drop_db(&db).await;
    result
}

async fn soak(ctx: &Ctx, rate: f64, rate_source: &str, db: &pg::BenchDb) -> anyhow::Result<Value> {
    let a = &ctx.args;
    let (duration, every, hold) = (a.soak_duration, a.soak_sample, a.soak_snapshot);
    if every.is_zero() || a.soak_purge_every.is_zero() || duration < every {
        bail!(
            "--soak-sample and --soak-purge-every must be above 0, and --soak-duration at least one sample"
        );
    }
    ctx.migrate(&db.url).await?;
    let (ingest, addr) =
        ctx.bins.start_ingest_with_env(&db.url, &[("INBOX_SIGNATURE_TOLERANCE", TOLERANCE)]).await?;
    let port = inbox_test_support::port::free();
    let worker_metrics: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let metrics_arg = worker_metrics.to_string();
    // No tuning flags: only where to serve the metrics the claim latency is read from.
    let worker = ctx.bins.start_worker(&db.url, None, None, &["--metrics-listen", &metrics_arg]);
    let receiver = inbox_test_support::receiver::Counter::start().await;
    let relay_args = crate::relay::http_args(&receiver);
    let relay_argv: Vec<&str> = relay_args.iter().map(String::as_str).collect();
    let relay = ctx.bins.start_relay(&db.url, &relay_argv, crate::relay::HTTP_ENV);
    let mut services = Services { ingest, worker, relay, worker_metrics };
    let logs0 = services.logs();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !matches!(http::get_status(worker_metrics, "/healthz").await, Ok(200)) {
        services.check()?;
        if Instant::now() > deadline {
            bail!("inbox-worker did not serve /healthz on {worker_metrics} within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let conns = ((rate * 0.1).ceil() as usize).clamp(32, 128);
    ctx.say(&format!(
        "soak: {rate:.0} webhooks/s ({rate_source}) over {conns} connections for {}, 1 ingest (signature \
         tolerance {TOLERANCE}) + 1 worker + 1 relay → HTTP, worker and relay with no tuning flags; purge \
         --older-than {RETENTION} every {}, a snapshot held {} from the middle, a sample every {}",
        humantime::format_duration(duration),
        humantime::format_duration(a.soak_purge_every),
        humantime::format_duration(hold),
        humantime::format_duration(every)
    ));

    let t0 = Instant::now() + Duration::from_secs(1);
    let end = t0 + duration;
    let mut sampler = Sampler::start(ctx, &db.url, &services, t0).await?;
    let sampling = async {
        let mut k = 1u32;
        while t0 + every * k <= end {
            tokio::time::sleep_until((t0 + every * k).into()).await;
            sampler.step(ctx, &mut services, false, 0).await?;
            if let Some(why) = sampler.samples.last().and_then(|s| fell_behind(s, rate, a.soak_max_lag)) {
                bail!("{why}");
            }
            k += 1;
        }
        anyhow::Ok(())
    };
    let purging = async {
        let mut purges: Vec<Purge> = Vec::new();
        let mut k = 1u32;
        while t0 + a.soak_purge_every * k < end {
            tokio::time::sleep_until((t0 + a.soak_purge_every * k).into()).await;
            let p = purge(ctx, &db.url, t0).await;
            ctx.say(&format!(
                "soak: purge at {:.1} min: {:.2} s, {} inbox + {} outbox rows deleted{}; {}",
                p.at / 60.0,
                p.seconds,
                p.report["deleted"],
                p.report["outbox_deleted"],
                p.error.as_ref().map_or(String::new(), |e| format!(" — FAILED: {e}")),
                p.reindex.summary()
            ));
            purges.push(p);
            k += 1;
        }
        anyhow::Ok(purges)
    };
    let snapshot = hold_snapshot(&db.url, t0, duration / 2, hold, end);
    let load = send(addr, crate::payload::stripe_invoice_paid_template(), rate, conns, t0, duration);
    let ((), purges, window, (counts, http_p99s, first_error)) =
        tokio::try_join!(sampling, purging, snapshot, load)?;
    let (snap_start, snap_end, snap_rows) = window;

    // Drain: the inbox, then the outbox; then the last sample.
    let sent_at = Instant::now();
    let progress = |left: i64| ctx.say(&format!("soak:   {left} rows not yet processed"));
    let (polls, _) =
        pg::wait_drained(&sampler.client, Duration::from_millis(100), a.drain_timeout, progress, || {
            check_alive(&mut services.worker, "inbox-worker run")
        })
        .await?;
    let mut outbox_polls = 0;
    loop {
        let left =
            simple_rows(&sampler.client, "SELECT EXISTS (SELECT 1 FROM outbox WHERE published_at IS NULL)")
                .await?;
        outbox_polls += 1;
        if left[0][0] == "f" {
            break;
        }
        check_alive(&mut services.relay, "inbox-worker relay")?;
        if sent_at.elapsed() > a.drain_timeout {
            bail!("outbox rows still unpublished {:?} after the load", a.drain_timeout);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let drain_s = sent_at.elapsed().as_secs_f64();
    sampler.step(ctx, &mut services, true, polls as i64 + outbox_polls).await?;
    let hwm: BTreeMap<&str, Option<u64>> =
        services.pids().iter().map(|&(n, pid)| (n, rss_kib(pid).map(|r| r.1))).collect();
    let first = sampler.first.take().expect("the first probe");
    let logs1 = services.logs();
    for (p, what) in [
        (&mut services.ingest, "inbox-ingest"),
        (&mut services.worker, "inbox-worker run"),
        (&mut services.relay, "inbox-worker relay"),
    ] {
        if !stop(p, Duration::from_secs(30)).await {
            ctx.say(&format!("soak: warning: {what} did not exit within 30 s of SIGTERM"));
        }
    }
    let (delivered, distinct) = (receiver.requests(), receiver.distinct() as u64);

    let mut samples = std::mem::take(&mut sampler.samples);
    for s in &mut samples {
        let mid = s.t - s.interval / 2.0;
        s.snapshot = mid >= snap_start && mid < snap_end;
    }
    let mut summary = summarize(&samples, &purges, duration.as_secs_f64(), (snap_start, snap_end));
    let processed: i64 = samples.iter().map(|s| s.processed).sum();
    summary.insert("wal_by_record_type".into(), wal_breakdown(sampler.wal_kinds.as_ref(), processed));
    summary.insert("wal_by_table".into(), wal_breakdown(sampler.wal_tables.as_ref(), processed));
    let cpu_total = first.cpu.usage(&sampler.prev.cpu, Some(processed as f64));
    let logs = logs0.per_unit(&logs1, processed as f64);
    let last = &sampler.prev;
    let claims = last.claims.as_ref().map(|h| h.since(first.claims.as_ref()));
    let peak_postgres_private = samples.iter().filter_map(|s| s.rss_kib["postgres_private"]).max();

    // Files.
    let dir = ctx.out_dir.join("soak");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    write_samples(&dir, &samples)?;
    let charts = charts(&samples, &purges, (snap_start, snap_end), rate, duration.as_secs_f64());
    for (name, chart) in &charts {
        std::fs::write(dir.join(name), svg::render(chart))?;
    }
    let published = if a.soak_publish {
        let docs = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/performance/soak"));
        std::fs::create_dir_all(docs).with_context(|| format!("creating {}", docs.display()))?;
        for (name, _) in &charts {
            std::fs::copy(dir.join(name), docs.join(name))?;
        }
        Some(docs.canonicalize().unwrap_or(docs.to_path_buf()).display().to_string())
    } else {
        None
    };
    ctx.say(&format!("soak: {} samples, charts and samples.csv in {}", samples.len(), dir.display()));

    let mut out = json!({
        "rate": rate,
        "rate_source": rate_source,
        "connections": conns,
        "duration_s": duration.as_secs_f64(),
        "sample_s": every.as_secs_f64(),
        "purge_every_s": a.soak_purge_every.as_secs_f64(),
        "purge_older_than": RETENTION,
        "signature_tolerance": TOLERANCE,
        "snapshot": { "start_s": snap_start, "end_s": snap_end, "rows_counted": snap_rows },
        "sent": counts.json(),
        "achieved_rate": (counts.ok + counts.non_2xx) as f64 / duration.as_secs_f64(),
        "http_p99_ms_worst_chunk": http_p99s.iter().copied().fold(0.0, f64::max),
        "first_error": first_error,
        "processed": processed,
        "processed_matches_2xx": processed as u64 == counts.ok,
        "relay_delivered": delivered,
        "relay_distinct": distinct,
        "relay_duplicates": delivered - distinct,
        "drain_after_load_s": drain_s,
        "claims": claims.map(|(n, mean, p99)| json!({ "count": n, "mean_ms": mean, "p99_ms": p99 })),
        "cpu": cpu_total,
        "logs": logs,
        "peak_rss_kib": {
            "ingest": hwm["ingest"], "worker": hwm["worker"], "relay": hwm["relay"],
            "postgres_private_max_sampled": peak_postgres_private,
            "bench": rss_kib(std::process::id()).map(|r| r.1),
        },
        "purges": purges.iter().map(|p| json!({
            "at_s": p.at, "seconds": p.seconds, "deleted": p.report["deleted"],
            "outbox_deleted": p.report["outbox_deleted"], "batches": p.report["batches"], "error": p.error,
            "reindex": {
                "seconds": p.reindex.seconds, "error": p.reindex.error,
                "indexes": p.reindex.acted(),
            },
        })).collect::<Vec<_>>(),
        "worker_defaults": ctx.worker_defaults,
        "dir": dir.display().to_string(),
        "published_to": published,
        "charts": charts.iter().map(|c| c.0.clone()).collect::<Vec<_>>(),
    });
    for (k, v) in summary {
        out[k] = v;
    }
    Ok(out)
}

/// The run's WAL by record type (or by table), per processed event, the largest first: where the
/// bytes of `wal_bytes_per_event` come from (the records themselves, and the full-page images
/// written by the first change of a page after each checkpoint). Null when it was not read.
fn wal_breakdown(kinds: Option<&BTreeMap<String, [i64; 3]>>, processed: i64) -> Value {
    let Some(kinds) = kinds else { return Value::Null };
    let total: i64 = kinds.values().map(|k| k[1] + k[2]).sum();
    let fpi: i64 = kinds.values().map(|k| k[2]).sum();
    let mut rows: Vec<(&String, &[i64; 3])> = kinds.iter().collect();
    rows.sort_by_key(|(_, k)| -(k[1] + k[2]));
    json!({
        "bytes_per_event": per(total as f64, processed),
        "full_page_image_share": (total > 0).then(|| fpi as f64 / total as f64),
        "parts": rows.iter().map(|(name, k)| json!({
            "name": name,
            "records_per_event": per(k[0] as f64, processed),
            "record_bytes_per_event": per(k[1] as f64, processed),
            "fpi_bytes_per_event": per(k[2] as f64, processed),
        })).collect::<Vec<_>>(),
    })
}

/// The whole run's figures from the samples.
fn summarize(
    samples: &[Sample],
    purges: &[Purge],
    duration: f64,
    snap: (f64, f64),
) -> serde_json::Map<String, Value> {
    let mut out = serde_json::Map::new();
    // The sampled run, without the last sample (the drain after the load).
    let run: Vec<&Sample> = samples.iter().filter(|s| s.t <= duration + 1.0).collect();
    let window = (duration / 3.0).min(300.0);
    let pct = |set: &[&Sample], q: f64| hist_quantile(set.iter().map(|s| &s.hist), q);
    let first: Vec<&Sample> = run.iter().copied().filter(|s| s.t <= window + 1.0).collect();
    let last: Vec<&Sample> =
        run.iter().copied().filter(|s| s.t - s.interval >= duration - window - 1.0).collect();
    let before: Vec<&Sample> = run.iter().copied().filter(|s| s.t <= snap.0).collect();
    let during: Vec<&Sample> = run.iter().copied().filter(|s| s.snapshot).collect();
    let after: Vec<&Sample> = run.iter().copied().filter(|s| s.t - s.interval >= snap.1).collect();
    let all: Vec<&Sample> = samples.iter().collect();
    let (f99, l99) = (pct(&first, 0.99), pct(&last, 0.99));
    out.insert(
        "receive_to_processed".into(),
        json!({
            "window_s": window,
            "first": { "p50_ms": pct(&first, 0.5), "p99_ms": f99 },
            "last": { "p50_ms": pct(&last, 0.5), "p99_ms": l99 },
            "p99_last_over_first": f99.zip(l99).map(|(f, l)| l / f),
            "overall": { "p50_ms": pct(&all, 0.5), "p99_ms": pct(&all, 0.99), "max_ms": all.iter().filter_map(|s| s.max_ms).fold(0.0, f64::max) },
            "before_snapshot_p99_ms": pct(&before, 0.99),
            "during_snapshot_p99_ms": pct(&during, 0.99),
            "after_snapshot_p99_ms": pct(&after, 0.99),
            "histogram_resolution_pct": ((1.0 / HIST_SCALE).exp() - 1.0) * 100.0,
        }),
    );
    let claim_p99 = |set: &[&Sample]| {
        set.iter()
            .filter_map(|s| s.claim_p99_ms)
            .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))))
    };
    out.insert(
        "claim_interval_p99_ms_max".into(),
        json!({ "before_snapshot": claim_p99(&before), "during_snapshot": claim_p99(&during), "after_snapshot": claim_p99(&after) }),
    );
    // Sizes: after the first purge that deleted rows (else the first purge), after the second,
    // and at the end. Only from the second is the comparison a test of flatness: the first comes
    // one interval into the run, with that interval's rows in the table, and until the second the
    // table fills up to what it holds just before a purge in the steady state, the retention plus
    // one interval of rows (a table that never grows past that ends at 1 + retention / interval
    // times its size after the first purge: 1.67 with the soak's 2 and 3 minutes).
    let deleting: Vec<&Purge> =
        purges.iter().filter(|p| p.report["deleted"].as_u64().is_some_and(|d| d > 0)).collect();
    let after = |p: Option<&Purge>| p.and_then(|p| samples.iter().find(|s| s.t >= p.at + p.seconds));
    let after_first = after(deleting.first().copied().or(purges.first()));
    let after_second = after(deleting.get(1).copied());
    // And the last sample before the snapshot: a small table's indexes (the queue table's) reach
    // their working size over the first ten minutes or so, between vacuums, after the second purge;
    // against this one, what the snapshot left at the end is measured apart from that.
    let before_snapshot = samples.iter().rev().find(|s| s.t <= snap.0);
    let end = samples.last();
    let mut sizes = serde_json::Map::new();
    for table in present(samples) {
        let e = end.map(|s| s.total_bytes(table));
        let at = |s: Option<&Sample>| s.map(|s| s.total_bytes(table));
        let ratio = |a: Option<i64>| a.zip(e).and_then(|(a, e)| (a > 0).then(|| e as f64 / a as f64));
        let (a1, a2) = (at(after_first), at(after_second));
        sizes.insert(
            table.into(),
            json!({
                "after_first_purge_bytes": a1, "after_first_purge_at_s": after_first.map(|s| s.t),
                "end_over_after_first_purge": ratio(a1),
                "after_second_purge_bytes": a2, "after_second_purge_at_s": after_second.map(|s| s.t),
                "end_over_after_second_purge": ratio(a2), "flat": ratio(a2).map(|r| r <= 1.2),
                "before_snapshot_bytes": at(before_snapshot), "before_snapshot_at_s": before_snapshot.map(|s| s.t),
                "end_over_before_snapshot": ratio(at(before_snapshot)),
                "end_bytes": e,
                "end_parts": end.map(|s| s.sizes.iter().filter(|((t, _), _)| t == table).map(|((_, p), b)| (p.clone(), json!(b))).collect::<serde_json::Map<_, _>>()),
            }),
        );
    }
    out.insert("sizes".into(), Value::Object(sizes));
    let processed: i64 = samples.iter().map(|s| s.processed).sum();
    let sum = |f: &dyn Fn(&Sample) -> i64| samples.iter().map(f).sum::<i64>();
    let mut tables = serde_json::Map::new();
    for table in present(samples) {
        let (upd, hot) = (sum(&|s| s.table(table).upd), sum(&|s| s.table(table).hot));
        tables.insert(
            table.into(),
            json!({
                "max_dead_tuples": samples.iter().map(|s| s.table(table).dead).max(),
                "updates": upd, "hot_updates": hot,
                "hot_share": (upd > 0).then(|| hot as f64 / upd as f64),
                "deletes": sum(&|s| s.table(table).del),
                "autovacuum_runs": end.map(|s| s.table(table).autovacuum),
                "autoanalyze_runs": end.map(|s| s.table(table).autoanalyze),
            }),
        );
    }
    out.insert("tables".into(), Value::Object(tables));
    let (upd_dead, del_dead) =
        samples.iter().map(Sample::dead_index_entries).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    out.insert("wal_bytes_per_event".into(), json!(per(sum(&|s| s.wal_bytes) as f64, processed)));
    out.insert("commits_per_event".into(), json!(per(sum(&|s| s.commits) as f64, processed)));
    out.insert(
        "dead_index_entries_per_event".into(),
        json!({
            "total": per((upd_dead + del_dead) as f64, processed),
            "from_updates": per(upd_dead as f64, processed),
            "from_deletes": per(del_dead as f64, processed),
        }),
    );
    if present(samples).contains(&"webhook_inbox_queue") {
        let (u, d) =
            samples.iter().map(Sample::queue_dead_index_entries).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        out.insert(
            "queue_dead_index_entries_per_event".into(),
            json!({ "from_updates": per(u as f64, processed), "from_deletes": per(d as f64, processed) }),
        );
    }
    out
}

fn write_samples(dir: &Path, samples: &[Sample]) -> anyhow::Result<()> {
    let rows: Vec<Vec<(String, Option<f64>)>> = samples.iter().map(Sample::fields).collect();
    let mut header: Vec<String> = Vec::new();
    for row in &rows {
        for (k, _) in row {
            if !header.contains(k) {
                header.push(k.clone());
            }
        }
    }
    let mut csv = header.join(",") + "\n";
    for row in &rows {
        let map: BTreeMap<&str, Option<f64>> = row.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        let cells: Vec<String> = header
            .iter()
            .map(|k| match map.get(k.as_str()).copied().flatten() {
                Some(v) if v.fract() == 0.0 && v.abs() < 1e15 => format!("{v:.0}"),
                Some(v) => format!("{v:.4}"),
                None => String::new(),
            })
            .collect();
        csv.push_str(&cells.join(","));
        csv.push('\n');
    }
    std::fs::write(dir.join("samples.csv"), csv)?;
    let json: Vec<Value> = rows
        .iter()
        .map(|row| Value::Object(row.iter().map(|(k, v)| (k.clone(), json!(v))).collect()))
        .collect();
    std::fs::write(dir.join("samples.json"), serde_json::to_string_pretty(&json)?)?;
    Ok(())
}

/// One chart per series, named by its file.
fn charts(
    samples: &[Sample],
    purges: &[Purge],
    snap: (f64, f64),
    rate: f64,
    duration: f64,
) -> Vec<(String, Chart)> {
    let x = |s: &Sample| s.t / 60.0;
    let line = |name: &str, f: &dyn Fn(&Sample) -> Option<f64>| Series {
        name: name.to_owned(),
        points: samples.iter().map(|s| (x(s), f(s))).collect(),
    };
    let chart = |file: &str, title: &str, y: &str, series: Vec<Series>| {
        (
            file.to_owned(),
            Chart {
                title: title.to_owned(),
                y_label: y.to_owned(),
                x_label: "minutes since the load started".to_owned(),
                series,
                band: Some((snap.0 / 60.0, snap.1 / 60.0, "snapshot held".to_owned())),
                marks: (purges.iter().map(|p| p.at / 60.0).collect(), "purge".to_owned()),
                end: Some((duration / 60.0, "load stops; drain".to_owned())),
            },
        )
    };
    let mib = |b: i64| Some(b as f64 / f64::from(1 << 20));
    let parts = |table: &str| -> Vec<Series> {
        let mut names: Vec<&String> = Vec::new();
        for s in samples {
            for (t, p) in s.sizes.keys() {
                if t == table && !names.contains(&p) {
                    names.push(p);
                }
            }
        }
        names
            .into_iter()
            .map(|p| {
                line(p, &|s: &Sample| s.sizes.get(&(table.to_owned(), p.clone())).copied().and_then(mib))
            })
            .collect()
    };
    let mut others: Vec<&String> = Vec::new();
    for s in samples {
        for (t, p) in s.sizes.keys() {
            if p == "heap" && !TABLES.contains(&t.as_str()) && !others.contains(&t) {
                others.push(t);
            }
        }
    }
    let per_table = |f: fn(&Sample, &str) -> Option<f64>| -> Vec<Series> {
        present(samples).into_iter().map(|t| line(t, &|s: &Sample| f(s, t))).collect()
    };
    let per_proc = |f: fn(&Sample, &str) -> Option<f64>, names: &[&str]| -> Vec<Series> {
        names.iter().map(|p| line(p, &|s: &Sample| f(s, p))).collect()
    };
    let all = vec![
        chart(
            "latency.svg",
            "receive → processed (processed_at − received_at)",
            "ms",
            vec![line("p50", &|s| s.p50_ms), line("p99", &|s| s.p99_ms)],
        ),
        chart(
            "claim_latency.svg",
            "worker claim statement (inbox_worker_claim_seconds)",
            "ms",
            vec![line("mean", &|s| s.claim_mean_ms), line("p99", &|s| s.claim_p99_ms)],
        ),
        chart(
            "events_per_s.svg",
            "events processed per second",
            "events/s",
            vec![line("processed", &|s| Some(s.events_per_s())), line("sent (target rate)", &|_| Some(rate))],
        ),
        chart(
            "sizes_webhook_inbox.svg",
            "webhook_inbox: heap, TOAST (with its index), each index",
            "MiB",
            parts("webhook_inbox"),
        ),
        chart("sizes_outbox.svg", "outbox: heap and each index", "MiB", parts("outbox")),
        chart(
            "sizes_webhook_inbox_queue.svg",
            "webhook_inbox_queue: heap and each index",
            "MiB",
            parts("webhook_inbox_queue"),
        ),
        chart(
            "sizes_other_tables.svg",
            "other tables (heap)",
            "MiB",
            others
                .iter()
                .map(|t| {
                    line(t, &|s: &Sample| {
                        s.sizes.get(&((*t).clone(), "heap".to_owned())).copied().and_then(mib)
                    })
                })
                .collect(),
        ),
        chart(
            "dead_tuples.svg",
            "dead tuples (n_dead_tup)",
            "tuples",
            per_table(|s, t| Some(s.table(t).dead as f64)),
        ),
        chart(
            "hot_share.svg",
            "HOT updates / updates in the interval",
            "%",
            per_table(|s, t| s.hot_share(t).map(|h| h * 100.0)),
        ),
        chart(
            "wal_per_event.svg",
            "WAL per processed event (whole cluster)",
            "bytes/event",
            vec![line("WAL", &|s| per(s.wal_bytes as f64, s.processed))],
        ),
        chart(
            "commits_per_event.svg",
            "commits per processed event (this database)",
            "commits/event",
            vec![line("commits", &|s| per(s.commits as f64, s.processed))],
        ),
        chart(
            "dead_index_entries_per_event.svg",
            "dead index entries per processed event (upper estimate)",
            "entries/event",
            vec![
                line("total", &|s| {
                    let (u, d) = s.dead_index_entries();
                    per((u + d) as f64, s.processed)
                }),
                line("from non-HOT updates", &|s| per(s.dead_index_entries().0 as f64, s.processed)),
                line("from deletes (purge)", &|s| per(s.dead_index_entries().1 as f64, s.processed)),
            ],
        ),
        chart(
            "rss.svg",
            "resident memory (bench: load generator and receiver; PostgreSQL: RssAnon of all its processes)",
            "MiB",
            per_proc(
                |s, p| s.rss_kib.get(p).copied().flatten().map(|k| k as f64 / 1024.0),
                &["ingest", "worker", "relay", "bench", "postgres_private"],
            ),
        ),
        chart(
            "cpu_per_event.svg",
            "CPU per processed event (PostgreSQL: all its processes)",
            "CPU µs/event",
            per_proc(
                |s, p| s.cpu_us_per_event.get(p).copied().flatten(),
                &["ingest", "worker", "relay", "postgres"],
            ),
        ),
        chart(
            "autovacuum.svg",
            "autovacuum runs (cumulative)",
            "runs",
            per_table(|s, t| Some(s.table(t).autovacuum as f64)),
        ),
    ];
    all.into_iter().filter(|(_, c)| !c.series.is_empty()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(p99_ms: Option<f64>) -> Sample {
        Sample { t: 90.0, window: 10.0, processed: 8_500, p99_ms, ..Sample::default() }
    }

    #[test]
    fn a_soak_stops_once_a_samples_p99_is_past_the_allowed_lag() {
        let lag = Duration::from_secs(30);
        assert_eq!(fell_behind(&sample(Some(800.0)), 6000.0, lag), None, "a purge's second is not a backlog");
        assert_eq!(fell_behind(&sample(Some(30_000.0)), 6000.0, lag), None, "at the limit, not past it");
        let why = fell_behind(&sample(Some(75_000.0)), 6000.0, lag).expect("past the limit");
        for part in
            ["1.5 min", "waited 75 s", "--soak-max-lag 30s", "at 850/s against 6000 sent/s", "--soak-rate"]
        {
            assert!(why.contains(part), "{part:?} in {why}");
        }
    }

    #[test]
    fn a_soak_without_a_lag_limit_or_without_processed_events_goes_on() {
        assert_eq!(fell_behind(&sample(Some(600_000.0)), 6000.0, Duration::ZERO), None);
        assert_eq!(fell_behind(&sample(None), 6000.0, Duration::from_secs(30)), None);
    }
}
