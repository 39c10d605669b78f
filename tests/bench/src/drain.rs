//! (c) and scale: the workers drain a queue of `invoice.paid` rows (each its own invoice) with the
//! full handler; events/s, commits and WAL per event, and the table's state after the drain.

use std::time::{Duration, Instant};

use anyhow::ensure;
use serde_json::json;

use crate::pg::{self, simple_rows};
use crate::services::{check_alive, stop};
use crate::util::{rss_kib, CpuSample, LogSample};
use crate::Ctx;

/// What to drain: `queued` rows, in a database holding `history` processed rows (seeded by the
/// caller: the scale phase); how: `processes` workers, each with `--concurrency` /
/// `--batch-size` when given, else the worker's defaults.
pub struct Plan<'a> {
    pub label: &'a str,
    pub db_suffix: String,
    pub processes: usize,
    pub concurrency: Option<usize>,
    pub batch_size: Option<usize>,
    pub queued: u64,
    pub history: u64,
    /// Count the table's tuples with `pgstattuple` after the drain: a read of the whole table,
    /// seconds with a million rows, so the scale phase's rounds do it once.
    pub pgstattuple: bool,
}

/// Drains `plan.queued` rows in a fresh database of their own.
pub async fn run(ctx: &Ctx, plan: &Plan<'_>) -> anyhow::Result<serde_json::Value> {
    let db = ctx.server.create_db(&plan.db_suffix).await?;
    let result = match ctx.migrate(&db.url).await {
        Ok(()) => drain(ctx, plan, &db).await,
        Err(e) => Err(e),
    };
    ctx.server.drop_db(&db).await;
    result
}

/// Queues `plan.queued` rows in `db` (new and migrated: the ledger and outbox it counts are the
/// drain's) and drains them.
pub async fn drain(ctx: &Ctx, plan: &Plan<'_>, db: &pg::BenchDb) -> anyhow::Result<serde_json::Value> {
    let label = plan.label;
    let mut client = pg::connect(&db.url).await?;
    let seed_start = Instant::now();
    ctx.say(&format!("{label}: queueing {} invoice.paid rows (~2 KB payloads)", plan.queued));
    pg::seed_queued(&client, &ctx.template, "q_", plan.queued).await?;
    client.batch_execute("VACUUM ANALYZE webhook_inbox").await?;
    let _ = client.batch_execute("CHECKPOINT").await;
    let seed_seconds = seed_start.elapsed().as_secs_f64();
    let table_before = pg::table_stats(&client).await?;
    let explain_before = pg::explain_claim(&mut client).await;

    // Autovacuum's reads and CPU count in the drain's figures when it runs meanwhile: say when
    // (from the server's own database, so that the samples are not transactions of this one).
    let sampler = pg::connect(&ctx.server.admin_url).await?;
    ctx.server.flush_stats(&client).await;
    let snap0 = ctx.server.snapshot(&client).await?;
    let started = Instant::now();
    let autovacuum = pg::AutovacuumSampler::start(sampler, db.name.clone(), started);
    let poll = ctx.args.worker_poll_interval.clone();
    let mut workers: Vec<_> = (0..plan.processes)
        .map(|_| {
            ctx.bins.start_worker(&db.url, plan.concurrency, plan.batch_size, &["--poll-interval", &poll])
        })
        .collect();
    let pids: Vec<(&str, u32)> = workers.iter().map(|w| ("worker", w.child.id())).collect();
    let cpu0 = CpuSample::take(ctx.server.postmaster, &pids);
    let named = |workers: &[inbox_test_support::process::Proc]| {
        LogSample::take(&workers.iter().map(|w| ("worker", w)).collect::<Vec<_>>())
    };
    let log0 = named(&workers);
    let flags = match (plan.concurrency, plan.batch_size) {
        (None, None) => "no tuning flags (the worker's defaults)".to_owned(),
        (c, b) => {
            let c = c.map_or(String::new(), |c| format!(" --concurrency {c}"));
            let b = b.map_or(String::new(), |b| format!(" --batch-size {b}"));
            format!("{}{}", c.trim_start(), b)
        }
    };
    ctx.say(&format!(
        "{label}: {} worker process(es), {flags}, draining {} rows",
        plan.processes, plan.queued
    ));
    let progress = |left: i64| {
        let secs = started.elapsed().as_secs_f64();
        ctx.say(&format!(
            "{label}:   {secs:.0} s, {left} rows left ({:.0} events/s so far)",
            (plan.queued as i64 - left) as f64 / secs
        ))
    };
    let (polls, drained_at) =
        pg::wait_drained(&client, Duration::from_millis(50), ctx.args.drain_timeout, progress, || {
            workers.iter_mut().try_for_each(|w| check_alive(w, "inbox-worker"))
        })
        .await?;
    let seconds = drained_at.duration_since(started).as_secs_f64();
    let autovacuum = autovacuum.finish().await;
    let cpu1 = CpuSample::take(ctx.server.postmaster, &pids);
    let log1 = named(&workers);
    let rss: Vec<Option<(u64, u64)>> = workers.iter().map(|w| rss_kib(w.child.id())).collect();
    for w in workers.iter_mut() {
        if !stop(w, Duration::from_secs(30)).await {
            ctx.say(&format!("{label}: warning: a worker did not exit within 30 s of SIGTERM"));
        }
    }
    // The workers' backends flushed their statistics when they exited; ours on demand.
    ctx.server.flush_stats(&client).await;
    let snap1 = ctx.server.snapshot(&client).await?;
    // Our own transactions between the two snapshots: the first snapshot, the polls, the flush.
    let own = 1 + polls as i64 + i64::from(ctx.server.force_flush);
    let commits = snap1.commits - snap0.commits - own;
    let n = plan.queued as f64;
    let wal_bytes = snap1.lsn - snap0.lsn;
    let checks = simple_rows(
        &client,
        "SELECT (SELECT count(*) FROM ledger_entries),
                (SELECT count(*) FROM webhook_inbox WHERE processed_at IS NULL),
                (SELECT count(*) FROM webhook_inbox WHERE attempts > 1 AND left(event_id, 6) = 'evt_q_'),
                (SELECT count(*) FROM webhook_inbox WHERE last_error IS NOT NULL),
                (SELECT count(*) FROM outbox)",
    )
    .await?;
    let num = |i: usize| checks[0][i].parse::<i64>().unwrap_or(-1);
    let (ledger, unprocessed, retried, with_error, outbox) = (num(0), num(1), num(2), num(3), num(4));
    let table_after = pg::table_stats(&client).await?;
    let tuples_after = if plan.pgstattuple { pg::tuple_stats(&client).await } else { json!(null) };
    let explain_after = pg::explain_claim(&mut client).await;
    let events_per_s = n / seconds;
    let cpu = cpu0.usage(&cpu1, Some(n));
    let logs = log0.per_unit(&log1, n);
    ctx.say(&format!(
        "{label}: {events_per_s:.0} events/s in {seconds:.1} s, {:.2} commits/event, {:.0} WAL bytes/event, \
         {:.2} blocks read/event, ledger {ledger}, dead/live {}/{} ({}; {}); autovacuum meanwhile: {}",
        commits as f64 / n,
        wal_bytes as f64 / n,
        (snap1.blks_read - snap0.blks_read) as f64 / n,
        table_after["n_dead_tup"],
        table_after["n_live_tup"],
        crate::util::cpu_summary(&cpu),
        crate::util::log_summary(&logs),
        pg::AutovacuumRun::describe(&autovacuum)
    ));
    ensure!(unprocessed == 0, "{unprocessed} rows unprocessed after the drain");
    let wal = match (snap0.wal, snap1.wal) {
        (Some(a), Some(b)) => json!({
            "records_per_event": (b.0 - a.0) as f64 / n,
            "fpi_per_event": (b.1 - a.1) as f64 / n,
            "bytes_per_event": (b.2 - a.2) as f64 / n,
        }),
        _ => json!(null),
    };
    let upd = |t: &serde_json::Value, k: &str| t[k].as_i64().unwrap_or(0);
    let updates = upd(&table_after, "n_tup_upd") - upd(&table_before, "n_tup_upd");
    let hot = upd(&table_after, "n_tup_hot_upd") - upd(&table_before, "n_tup_hot_upd");
    Ok(json!({
        "processes": plan.processes,
        "concurrency": plan.concurrency,
        "batch_size": plan.batch_size,
        "default_flags": plan.concurrency.is_none() && plan.batch_size.is_none(),
        "poll_interval": poll,
        "queued_rows": plan.queued,
        "history_rows": plan.history,
        "seed_seconds": seed_seconds,
        "seconds": seconds,
        "events_per_s": events_per_s,
        "commits": commits,
        "commits_per_event": commits as f64 / n,
        "rollbacks": snap1.rollbacks - snap0.rollbacks,
        "xids_per_event": (snap1.next_xid - snap0.next_xid) as f64 / n,
        "own_transactions_subtracted": own,
        "wal_bytes": wal_bytes,
        "wal_bytes_per_event": wal_bytes as f64 / n,
        "pg_stat_wal": wal,
        // Our own statements between the snapshots read a handful of blocks; the drain, thousands.
        "blocks_read_per_event": (snap1.blks_read - snap0.blks_read) as f64 / n,
        "blocks_hit_per_event": (snap1.blks_hit - snap0.blks_hit) as f64 / n,
        "autovacuum_in_window": autovacuum.iter().map(pg::AutovacuumRun::json).collect::<Vec<_>>(),
        "ledger_rows": ledger,
        "ledger_matches": ledger == plan.queued as i64,
        "outbox_rows": outbox,
        "rows_retried": retried,
        "rows_with_error": with_error,
        "updates": updates,
        "hot_updates": hot,
        "hot_update_ratio": if updates > 0 { json!(hot as f64 / updates as f64) } else { json!(null) },
        "worker_rss_kib": rss.iter().map(|r| r.map(|r| r.0)).collect::<Vec<_>>(),
        "worker_peak_rss_kib": rss.iter().map(|r| r.map(|r| r.1)).collect::<Vec<_>>(),
        "cpu": cpu,
        "logs": logs,
        "table_before": table_before,
        "table_after": table_after,
        "pgstattuple_after": tuples_after,
        "explain_claim_before": explain_before,
        "explain_claim_after": explain_after,
    }))
}
