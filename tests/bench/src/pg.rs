//! The PostgreSQL side: the server's settings, a fresh database per phase, statistics snapshots,
//! seeding the queue and `EXPLAIN` of the claim.

use std::sync::Mutex;
use std::time::Duration;

use anyhow::Context as _;
use inbox_test_support::db::url_with_dbname;
use serde_json::json;
use tokio_postgres::{Client, NoTls};

/// Connects and drives the connection on the runtime.
pub async fn connect(url: &str) -> anyhow::Result<Client> {
    let (client, connection) =
        tokio_postgres::connect(url, NoTls).await.context("connecting to PostgreSQL")?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// The server every phase runs on.
pub struct Server {
    pub admin_url: String,
    pub admin: Client,
    pub version_num: i32,
    /// `pg_stat_force_next_flush()` exists (PostgreSQL 15+).
    pub force_flush: bool,
    /// `pg_stat_wal` exists (PostgreSQL 14+).
    pub stat_wal: bool,
    /// The postmaster's pid when the server runs on this machine and we can read its pid file.
    pub postmaster: Option<u32>,
    pub max_connections: i64,
    created: Mutex<Vec<String>>,
}

const PREFIX: &str = "inbox_bench_";

impl Server {
    pub async fn open(admin_url: &str) -> anyhow::Result<Server> {
        let admin = connect(admin_url).await?;
        let version_num: i32 =
            admin.query_one("SELECT current_setting('server_version_num')::int", &[]).await?.get(0);
        let max_connections: i64 =
            admin.query_one("SELECT current_setting('max_connections')::bigint", &[]).await?.get(0);
        let data_dir: Option<String> = admin
            .query_one("SELECT current_setting('data_directory', true)", &[])
            .await
            .ok()
            .and_then(|r| r.get(0));
        let postmaster = data_dir
            .and_then(|d| std::fs::read_to_string(format!("{d}/postmaster.pid")).ok())
            .and_then(|s| s.lines().next().and_then(|l| l.trim().parse::<u32>().ok()))
            .filter(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/comm"))
                    .is_ok_and(|c| c.trim().starts_with("postgres"))
            });
        let server = Server {
            admin_url: admin_url.to_owned(),
            admin,
            version_num,
            force_flush: version_num >= 150000,
            stat_wal: version_num >= 140000,
            postmaster,
            max_connections,
            created: Mutex::new(Vec::new()),
        };
        server.drop_stale().await;
        Ok(server)
    }

    /// fsync, synchronous_commit and the rest of what the numbers depend on.
    pub async fn machine_info(&self) -> anyhow::Result<serde_json::Value> {
        let mut settings = serde_json::Map::new();
        for name in [
            "server_version",
            "fsync",
            "synchronous_commit",
            "full_page_writes",
            "wal_sync_method",
            "wal_level",
            "commit_delay",
            "shared_buffers",
            "max_wal_size",
            "max_connections",
            "autovacuum",
            "data_checksums",
            "wal_compression",
        ] {
            let v: Option<String> = self
                .admin
                .query_one("SELECT current_setting($1, true)", &[&name])
                .await
                .ok()
                .and_then(|r| r.get(0));
            settings.insert(name.to_owned(), json!(v));
        }
        Ok(serde_json::Value::Object(settings))
    }

    /// Connections the server can still accept (for ordinary roles too).
    pub async fn free_connections(&self) -> anyhow::Result<i64> {
        let row = self
            .admin
            .query_one(
                "SELECT current_setting('max_connections')::bigint
                        - current_setting('superuser_reserved_connections')::bigint
                        - (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')",
                &[],
            )
            .await?;
        Ok(row.get(0))
    }

    /// Creates `inbox_bench_<pid>_<suffix>` (dropping a leftover of that name first).
    pub async fn create_db(&self, suffix: &str) -> anyhow::Result<BenchDb> {
        let name = format!("{PREFIX}{}_{suffix}", std::process::id());
        self.admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await?;
        self.admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .with_context(|| format!("creating {name}"))?;
        self.created.lock().unwrap().push(name.clone());
        Ok(BenchDb { url: url_with_dbname(&self.admin_url, &name), name })
    }

    /// Creates `inbox_bench_<pid>_<suffix>` as a copy of `template` (no session may be connected
    /// to it), file by file: the copy's pages are on disk and in the OS's cache, none in
    /// shared_buffers (PostgreSQL 15 would otherwise write the copy through its WAL and buffers).
    pub async fn create_db_from(&self, suffix: &str, template: &BenchDb) -> anyhow::Result<BenchDb> {
        let name = format!("{PREFIX}{}_{suffix}", std::process::id());
        self.admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await?;
        let strategy = if self.version_num >= 150000 { " STRATEGY FILE_COPY" } else { "" };
        self.admin
            .batch_execute(&format!("CREATE DATABASE {name} TEMPLATE {}{strategy}", template.name))
            .await
            .with_context(|| format!("creating {name} from {}", template.name))?;
        self.created.lock().unwrap().push(name.clone());
        Ok(BenchDb { url: url_with_dbname(&self.admin_url, &name), name })
    }

    pub async fn drop_db(&self, db: &BenchDb) {
        if let Err(e) =
            self.admin.batch_execute(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", db.name)).await
        {
            eprintln!("bench: warning: dropping {}: {e}", db.name);
        }
        self.created.lock().unwrap().retain(|n| *n != db.name);
    }

    /// Drops every database this run created and has not dropped yet.
    pub async fn drop_all(&self) {
        let names = std::mem::take(&mut *self.created.lock().unwrap());
        for name in names {
            let _ = self.admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await;
        }
    }

    /// Databases of earlier runs whose process is gone (killed or crashed).
    async fn drop_stale(&self) {
        let Ok(rows) = self
            .admin
            .query("SELECT datname FROM pg_database WHERE datname LIKE 'inbox\\_bench\\_%'", &[])
            .await
        else {
            return;
        };
        for row in rows {
            let name: String = row.get(0);
            let pid = name[PREFIX.len()..].split('_').next().and_then(|p| p.parse::<u32>().ok());
            if pid.is_some_and(|pid| {
                pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists()
            }) {
                eprintln!("bench: dropping {name}, left by an earlier run");
                let _ =
                    self.admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await;
            }
        }
    }

    /// Waits (up to 5 s) until no pgbench session is connected to `db`, and a little longer for
    /// the postmaster to reap the backends.
    pub async fn wait_pgbench_gone(&self, db: &str) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while std::time::Instant::now() < deadline {
            let n: i64 = match self
                .admin
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name = 'pgbench'",
                    &[&db],
                )
                .await
            {
                Ok(r) => r.get(0),
                Err(_) => return,
            };
            if n == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    /// Makes this session's pending statistics visible (PG 15+), or waits for the collector.
    pub async fn flush_stats(&self, client: &Client) {
        if self.force_flush {
            let _ = client.batch_execute("SELECT pg_stat_force_next_flush()").await;
        } else {
            tokio::time::sleep(Duration::from_millis(700)).await;
        }
    }

    /// Commits, WAL position and WAL counters, as seen from `client`'s database. One simple
    /// query (one transaction: the caller counts its own transactions to subtract them).
    pub async fn snapshot(&self, client: &Client) -> anyhow::Result<StatSnap> {
        let wal = if self.stat_wal {
            "SELECT wal_records, wal_fpi, wal_bytes::bigint FROM pg_stat_wal"
        } else {
            "SELECT"
        };
        // The next transaction id (not consuming one): its advance counts write transactions.
        let next_xid = if self.version_num >= 130000 {
            "pg_snapshot_xmax(pg_current_snapshot())::text::bigint"
        } else {
            "txid_snapshot_xmax(txid_current_snapshot())"
        };
        let rows = simple_rows(
            client,
            &format!(
                "SELECT xact_commit, xact_rollback, pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint,
                        {next_xid}, blks_read, blks_hit
                   FROM pg_stat_database WHERE datname = current_database(); {wal}"
            ),
        )
        .await?;
        let num = |r: usize, c: usize| -> anyhow::Result<i64> {
            rows.get(r)
                .and_then(|row| row.get(c))
                .context("statistics row missing")?
                .parse()
                .context("not a number")
        };
        let mut snap = StatSnap {
            commits: num(0, 0)?,
            rollbacks: num(0, 1)?,
            lsn: num(0, 2)?,
            next_xid: num(0, 3)?,
            blks_read: num(0, 4)?,
            blks_hit: num(0, 5)?,
            wal: None,
        };
        if self.stat_wal {
            snap.wal = Some((num(1, 0)?, num(1, 1)?, num(1, 2)?));
        }
        Ok(snap)
    }
}

/// Runs `sql` with the simple query protocol (one transaction, no prepare round trip) and returns
/// the rows' text values.
pub async fn simple_rows(client: &Client, sql: &str) -> anyhow::Result<Vec<Vec<String>>> {
    let mut out = Vec::new();
    for m in client.simple_query(sql).await? {
        if let tokio_postgres::SimpleQueryMessage::Row(row) = m {
            out.push((0..row.len()).map(|i| row.get(i).unwrap_or_default().to_owned()).collect());
        }
    }
    Ok(out)
}

pub struct BenchDb {
    pub name: String,
    pub url: String,
}

/// Statistics at one instant (see [`Server::snapshot`]).
#[derive(Debug, Clone)]
pub struct StatSnap {
    pub commits: i64,
    pub rollbacks: i64,
    pub lsn: i64,
    /// Next transaction id (cluster-wide): the difference counts transactions that wrote.
    pub next_xid: i64,
    /// Blocks the database's backends read into shared buffers (from the OS: its page cache or
    /// the disk) and found there: how much of a phase's work fit in shared_buffers.
    pub blks_read: i64,
    pub blks_hit: i64,
    /// pg_stat_wal: records, full-page images, bytes (cluster-wide).
    pub wal: Option<(i64, i64, i64)>,
}

/// Queues `rows` unprocessed `invoice.paid` rows (each its own invoice), bodies from `template`
/// with `@EVT@` / `@INV@` replaced, in statements of at most 50k rows. Like the ingest, each row's
/// `payload_bytes` is the length in bytes of its body as sent (the text before the `jsonb` cast);
/// so for [`seed_processed`].
pub async fn seed_queued(client: &Client, template: &str, tag: &str, rows: u64) -> anyhow::Result<()> {
    seed(client, template, tag, rows).await
}

/// Rows already processed a while ago (history), `rows` of them, received 10 days ago one
/// millisecond apart.
///
/// Written with `COPY`, which goes through a small ring of shared buffers (16 MB) instead of the
/// whole pool, as a restore does: `INSERT … SELECT` would leave a million rows' pages filling
/// shared_buffers for whatever runs next, which rows processed days ago do not do in a running
/// system. (The scale phase then drains in file copies of the database, whose pages are in no
/// buffer at all.)
pub async fn seed_processed(
    client: &Client,
    template: &str,
    tag: &str,
    rows: u64,
    progress: impl Fn(u64),
) -> anyhow::Result<()> {
    use tokio_postgres::binary_copy::BinaryCopyInWriter;
    use tokio_postgres::types::Type;

    let chunk = 100_000;
    let start = std::time::SystemTime::now() - Duration::from_secs(10 * 24 * 3600);
    let mut done = 0;
    while done < rows {
        let n = chunk.min(rows - done);
        let sink = client
            .copy_in(
                "COPY webhook_inbox (provider, endpoint, event_id, event_type, payload, payload_bytes,
                                     received_at, available_at, attempts, processed_at)
                 FROM STDIN (FORMAT binary)",
            )
            .await
            .context("seeding webhook_inbox: COPY")?;
        let types = [
            Type::TEXT,
            Type::TEXT,
            Type::TEXT,
            Type::TEXT,
            Type::JSONB,
            Type::INT4,
            Type::TIMESTAMPTZ,
            Type::TIMESTAMPTZ,
            Type::INT4,
            Type::TIMESTAMPTZ,
        ];
        let writer = BinaryCopyInWriter::new(sink, &types);
        let mut writer = std::pin::pin!(writer);
        for i in done..done + n {
            let event_id = crate::payload::event_id(tag, i as usize);
            let body = template
                .replace(crate::payload::EVT, &event_id)
                .replace(crate::payload::INV, &crate::payload::invoice_id(tag, i as usize));
            let payload: serde_json::Value = serde_json::from_str(&body).context("the history template")?;
            let received = start + Duration::from_millis(i);
            let processed = received + Duration::from_millis(50);
            writer
                .as_mut()
                .write(&[
                    &"stripe",
                    &"billing",
                    &event_id,
                    &"invoice.paid",
                    &payload,
                    &(body.len() as i32),
                    &received,
                    &received,
                    &1i32,
                    &processed,
                ])
                .await
                .context("seeding webhook_inbox: a COPY row")?;
        }
        writer.finish().await.context("seeding webhook_inbox: COPY")?;
        done += n;
        progress(done);
    }
    Ok(())
}

async fn seed(client: &Client, template: &str, tag: &str, rows: u64) -> anyhow::Result<()> {
    let chunk = 50_000;
    let mut done = 0;
    while done < rows {
        let n = chunk.min(rows - done);
        seed_range(client, template, tag, done, n).await?;
        done += n;
    }
    Ok(())
}

async fn seed_range(client: &Client, template: &str, tag: &str, from: u64, n: u64) -> anyhow::Result<()> {
    let sql = "INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, payload_bytes)
         SELECT 'stripe', 'billing', e, 'invoice.paid', body::jsonb, octet_length(body)
           FROM generate_series($3::bigint, $4::bigint) AS i,
                LATERAL (SELECT 'evt_' || $2::text || lpad(i::text, 10, '0') AS e) AS ids,
                LATERAL (SELECT replace(replace($1::text, '@EVT@', e), '@INV@',
                                        'in_' || $2::text || lpad(i::text, 10, '0')) AS body) AS b";
    let (first, last) = (from as i64, (from + n) as i64 - 1);
    client.execute(sql, &[&template, &tag, &first, &last]).await.context("seeding webhook_inbox")?;
    Ok(())
}

/// The inbox's statistics and sizes (pg_stat_user_tables / pg_stat_user_indexes), with the
/// indexes of its queue table (`webhook_inbox_queue_by_type`, V17) among the inbox's.
pub async fn table_stats(client: &Client) -> anyhow::Result<serde_json::Value> {
    let r = client
        .query_one(
            "SELECT n_live_tup, n_dead_tup, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del,
                    vacuum_count, autovacuum_count, analyze_count, autoanalyze_count,
                    pg_relation_size(relid), pg_total_relation_size(relid),
                    (SELECT reloptions::text FROM pg_class WHERE oid = relid)
               FROM pg_stat_user_tables WHERE relname = 'webhook_inbox'",
            &[],
        )
        .await?;
    let indexes = client
        .query(
            "SELECT indexrelname::text, pg_relation_size(indexrelid), idx_scan
               FROM pg_stat_user_indexes WHERE relname IN ('webhook_inbox', 'webhook_inbox_queue') ORDER BY 1",
            &[],
        )
        .await?;
    let live: i64 = r.get(0);
    let dead: i64 = r.get(1);
    Ok(json!({
        "n_live_tup": live,
        "n_dead_tup": dead,
        "dead_per_live": if live > 0 { json!((dead as f64 / live as f64 * 1000.0).round() / 1000.0) } else { json!(null) },
        "n_tup_ins": r.get::<_, i64>(2),
        "n_tup_upd": r.get::<_, i64>(3),
        "n_tup_hot_upd": r.get::<_, i64>(4),
        "n_tup_del": r.get::<_, i64>(5),
        "vacuum_count": r.get::<_, i64>(6),
        "autovacuum_count": r.get::<_, i64>(7),
        "analyze_count": r.get::<_, i64>(8),
        "autoanalyze_count": r.get::<_, i64>(9),
        "table_bytes": r.get::<_, i64>(10),
        "total_bytes": r.get::<_, i64>(11),
        "reloptions": r.get::<_, Option<String>>(12),
        "indexes": indexes.iter().map(|i| json!({
            "name": i.get::<_, String>(0), "bytes": i.get::<_, i64>(1), "idx_scan": i.get::<_, i64>(2),
        })).collect::<Vec<_>>(),
    }))
}

/// Exact tuple counts of the inbox and the density of its indexes and its queue table's (the `pgstattuple` extension,
/// created in the bench database if the server has it); `null` when it is not available.
pub async fn tuple_stats(client: &Client) -> serde_json::Value {
    if client.batch_execute("CREATE EXTENSION IF NOT EXISTS pgstattuple").await.is_err() {
        return json!(null);
    }
    let table = match client
        .query_one(
            "SELECT tuple_count, dead_tuple_count, dead_tuple_len, free_space, table_len
               FROM pgstattuple('webhook_inbox')",
            &[],
        )
        .await
    {
        Ok(r) => r,
        Err(e) => return json!({ "error": e.to_string() }),
    };
    let mut indexes = Vec::new();
    if let Ok(rows) = client
        .query(
            "SELECT i.indexrelname::text, s.leaf_pages, s.avg_leaf_density
               FROM pg_stat_user_indexes i, LATERAL pgstatindex(i.indexrelid::regclass) s
              WHERE i.relname IN ('webhook_inbox', 'webhook_inbox_queue') ORDER BY 1",
            &[],
        )
        .await
    {
        for r in rows {
            indexes.push(json!({
                "name": r.get::<_, String>(0), "leaf_pages": r.get::<_, i64>(1), "avg_leaf_density": r.get::<_, f64>(2),
            }));
        }
    }
    json!({
        "live_tuples": table.get::<_, i64>(0),
        "dead_tuples": table.get::<_, i64>(1),
        "dead_tuple_bytes": table.get::<_, i64>(2),
        "free_bytes": table.get::<_, i64>(3),
        "table_bytes": table.get::<_, i64>(4),
        "indexes": indexes,
    })
}

/// Size in bytes of the named index in a [`table_stats`] value.
pub fn index_bytes(stats: &serde_json::Value, name: &str) -> Option<i64> {
    stats["indexes"].as_array()?.iter().find(|i| i["name"] == name)?["bytes"].as_i64()
}

/// `EXPLAIN (ANALYZE, BUFFERS)` of the workers' claim (`CLAIM_SQL`, LIMIT 32), rolled back; run
/// twice, the second (warm) run reported.
pub async fn explain_claim(client: &mut Client) -> serde_json::Value {
    match explain_claim_inner(client).await {
        Ok(v) => v,
        Err(e) => json!({ "error": format!("{e:#}") }),
    }
}

async fn explain_claim_inner(client: &mut Client) -> anyhow::Result<serde_json::Value> {
    // $1 max attempts, $2 batch size, $3 lease in seconds, $4 the free memory budget in payload
    // bytes (as the worker binds them; the budget of an idle worker at the default 32 MiB), $5
    // where the scans start (NULL: the whole queue, as a worker's first claim).
    let mut sql = inbox_domain::inbox::store::queue::CLAIM_SQL.to_owned();
    for (param, value) in [("$5", "NULL"), ("$4", "33554432"), ("$3", "120.0"), ("$2", "32"), ("$1", "10")] {
        sql = sql.replace(param, value);
    }
    let sql = format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}");
    let mut last = None;
    for _ in 0..2 {
        let tx = client.transaction().await?;
        let row = tx.query_one(&sql, &[]).await.context("EXPLAIN of the claim")?;
        tx.rollback().await?;
        last = Some(row.get::<_, serde_json::Value>(0));
    }
    let plan = last.unwrap();
    let top = &plan[0];
    let mut nodes = Vec::new();
    collect_nodes(&top["Plan"], &mut nodes);
    Ok(json!({
        "execution_ms": top["Execution Time"],
        "planning_ms": top["Planning Time"],
        "shared_hit_blocks": top["Plan"]["Shared Hit Blocks"],
        "shared_read_blocks": top["Plan"]["Shared Read Blocks"],
        "shared_dirtied_blocks": top["Plan"]["Shared Dirtied Blocks"],
        "rows_claimed": top["Plan"]["Actual Rows"],
        "nodes": nodes,
        "plan": plan,
    }))
}

fn collect_nodes(node: &serde_json::Value, out: &mut Vec<String>) {
    let Some(kind) = node["Node Type"].as_str() else { return };
    out.push(match node["Index Name"].as_str() {
        Some(index) => format!("{kind} on {index}"),
        None => kind.to_owned(),
    });
    if let Some(children) = node["Plans"].as_array() {
        for c in children {
            collect_nodes(c, out);
        }
    }
}

/// Whether any row is unprocessed: from the queue table (V17) and the parked rows' index, never
/// the processed history; on a schema before V17 (`--bin-dir` with older binaries), from the
/// table itself.
const UNPROCESSED_EXISTS_SQL: &str = "\
SELECT CASE WHEN to_regclass('webhook_inbox_queue') IS NULL
            THEN EXISTS (SELECT 1 FROM webhook_inbox WHERE processed_at IS NULL)
            ELSE EXISTS (SELECT 1 FROM webhook_inbox_queue)
                 OR EXISTS (SELECT 1 FROM webhook_inbox WHERE parked_at IS NOT NULL AND processed_at IS NULL)
       END";

/// Waits until no row is unprocessed, polling every `every` with a cheap `EXISTS` (each poll one
/// transaction; a `count(*)` over the queue would compete with the workers for the server's CPU);
/// every 15 s counts the rows left for `progress`. Returns the number of our transactions and
/// when the queue was seen empty. `alive` is checked between polls (a worker that died makes
/// this fail).
pub async fn wait_drained(
    client: &Client,
    every: Duration,
    timeout: Duration,
    mut progress: impl FnMut(i64),
    mut alive: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<(u64, std::time::Instant)> {
    let start = std::time::Instant::now();
    let mut last_progress = start;
    let mut polls = 0;
    loop {
        let rows = simple_rows(client, UNPROCESSED_EXISTS_SQL).await?;
        polls += 1;
        if rows[0][0] == "f" {
            return Ok((polls, std::time::Instant::now()));
        }
        alive()?;
        if last_progress.elapsed() >= Duration::from_secs(15) {
            last_progress = std::time::Instant::now();
            let left =
                simple_rows(client, "SELECT count(*) FROM webhook_inbox WHERE processed_at IS NULL").await?;
            polls += 1;
            progress(left[0][0].parse().unwrap_or(-1));
        }
        if start.elapsed() > timeout {
            anyhow::bail!("rows still unprocessed after {timeout:?}");
        }
        tokio::time::sleep(every).await;
    }
}

/// What autovacuum did on one database while a measured window ran: each table's vacuum or
/// analyse, from the first to the last sample that saw it (seconds from the window's start).
/// A phase's database is new, so autovacuum's first round finds every table over its threshold;
/// on a machine near saturation that round is enough to turn a second's p99 over its target, and
/// the report should say when it ran.
pub struct AutovacuumSampler {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Vec<AutovacuumRun>>,
}

#[derive(Debug, Clone)]
pub struct AutovacuumRun {
    /// `VACUUM ANALYZE webhook_inbox`, `ANALYZE pg_catalog.pg_class`, … (`pg_stat_activity.query`
    /// of the autovacuum worker, without its "autovacuum: " prefix and the `public.` schema).
    pub what: String,
    pub from_s: f64,
    pub to_s: f64,
}

impl AutovacuumSampler {
    /// How often `pg_stat_activity` is read: fine enough to place a round in its second, and
    /// ten cheap queries a second on a connection of its own.
    const EVERY: Duration = Duration::from_millis(100);

    /// Samples database `datname` from `t0` until [`AutovacuumSampler::finish`], on `client`: a
    /// connection of its own, opened before the window (a new backend is itself a disturbance),
    /// to another database when its own transactions must not count in `datname`'s.
    pub fn start(client: Client, datname: String, t0: std::time::Instant) -> AutovacuumSampler {
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let mut runs: Vec<AutovacuumRun> = Vec::new();
            let mut tick = tokio::time::interval(Self::EVERY);
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = tick.tick() => {}
                }
                let at = t0.elapsed().as_secs_f64();
                let Ok(rows) = client
                    .query(
                        "SELECT replace(regexp_replace(query, '^autovacuum: ', ''), 'public.', '') FROM pg_stat_activity
                          WHERE backend_type = 'autovacuum worker' AND datname = $1
                            AND query <> ''",
                        &[&datname],
                    )
                    .await
                else {
                    break;
                };
                for row in rows {
                    let what: String = row.get(0);
                    match runs.iter_mut().rev().find(|r| r.what == what && at - r.to_s <= 0.5) {
                        Some(run) => run.to_s = at,
                        None => runs.push(AutovacuumRun { what, from_s: at, to_s: at }),
                    }
                }
            }
            runs
        });
        AutovacuumSampler { stop, task }
    }

    pub async fn finish(self) -> Vec<AutovacuumRun> {
        let _ = self.stop.send(());
        self.task.await.unwrap_or_default()
    }
}

impl AutovacuumRun {
    pub fn json(&self) -> serde_json::Value {
        json!({ "what": self.what, "from_s": crate::util::r3(self.from_s), "to_s": crate::util::r3(self.to_s) })
    }

    pub fn describe(runs: &[AutovacuumRun]) -> String {
        if runs.is_empty() {
            return "none".into();
        }
        runs.iter()
            .map(|r| format!("{} {:.1}–{:.1} s", r.what, r.from_s, r.to_s))
            .collect::<Vec<_>>()
            .join(", ")
    }
}
