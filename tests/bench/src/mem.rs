//! mem: the memory of one worker at its defaults with large events. `--mem-rows` queued
//! `invoice.paid` rows of ~1 MiB each (each its own invoice) are drained by one `inbox-worker run`
//! started without tuning flags (its own `--concurrency`, `--batch-size` and
//! `--max-bytes-in-flight`); its RSS is sampled during the drain, and its peak (VmHWM at the end,
//! or the highest sample if higher) is held against the worker pod's memory limit.

use std::time::{Duration, Instant};

use anyhow::ensure;
use serde_json::json;

use crate::pg::{self, simple_rows};
use crate::services::{check_alive, stop};
use crate::util::{rss_kib, CpuSample};
use crate::Ctx;

/// Size of each body as sent (before its ids are filled in).
pub const EVENT_BYTES: usize = 1 << 20;

/// The worker container's memory limit (`resources.limits.memory` in
/// deploy/k8s/base/worker-deployment.yaml): the target of the peak RSS.
pub const WORKER_MEMORY_LIMIT_KIB: u64 = 256 * 1024;

pub async fn run(ctx: &Ctx) -> anyhow::Result<serde_json::Value> {
    let db = ctx.server.create_db("mem").await?;
    let result = drain(ctx, &db).await;
    ctx.server.drop_db(&db).await;
    result
}

async fn drain(ctx: &Ctx, db: &pg::BenchDb) -> anyhow::Result<serde_json::Value> {
    let rows = ctx.args.mem_rows;
    ensure!(rows > 0, "--mem-rows must be at least 1");
    ctx.migrate(&db.url).await?;
    let client = pg::connect(&db.url).await?;
    let template = crate::payload::invoice_paid_template_of(EVENT_BYTES);
    let seed_start = Instant::now();
    ctx.say(&format!("mem: queueing {rows} invoice.paid rows (~{} KiB payloads)", template.len() / 1024));
    pg::seed_queued(&client, &template, "m_", rows).await?;
    client.batch_execute("VACUUM ANALYZE webhook_inbox").await?;
    let _ = client.batch_execute("CHECKPOINT").await;
    let seed_seconds = seed_start.elapsed().as_secs_f64();
    let sizes = simple_rows(
        &client,
        "SELECT sum(payload_bytes), min(payload_bytes), max(payload_bytes),
                pg_total_relation_size('webhook_inbox')
           FROM webhook_inbox",
    )
    .await?;
    let size = |i: usize| sizes[0][i].parse::<i64>().unwrap_or(0);
    let (payload_bytes, min_bytes, max_bytes, stored_bytes) = (size(0), size(1), size(2), size(3));

    let poll = ctx.args.worker_poll_interval.clone();
    let started = Instant::now();
    let mut worker = ctx.bins.start_worker(&db.url, None, None, &["--poll-interval", &poll]);
    let pid = worker.child.id();
    let cpu0 = CpuSample::take(ctx.server.postmaster, &[("worker", pid)]);
    ctx.say(&format!(
        "mem: 1 worker process, no tuning flags (the worker's defaults: {}), draining {rows} rows of {:.1} MiB",
        defaults_text(&ctx.worker_defaults),
        payload_bytes as f64 / rows as f64 / f64::from(1 << 20)
    ));
    // (milliseconds since the start, VmRSS KiB), taken between the polls of the queue.
    let mut samples: Vec<(u64, u64)> = Vec::new();
    let progress = |left: i64| {
        let secs = started.elapsed().as_secs_f64();
        ctx.say(&format!(
            "mem:   {secs:.0} s, {left} rows left ({:.0} events/s so far)",
            (rows as i64 - left) as f64 / secs
        ))
    };
    let drained =
        pg::wait_drained(&client, Duration::from_millis(20), ctx.args.drain_timeout, progress, || {
            check_alive(&mut worker, "inbox-worker")?;
            if let Some((rss, _)) = rss_kib(pid) {
                samples.push((started.elapsed().as_millis() as u64, rss));
            }
            Ok(())
        })
        .await;
    let end_rss = rss_kib(pid);
    let cpu1 = CpuSample::take(ctx.server.postmaster, &[("worker", pid)]);
    if !stop(&mut worker, Duration::from_secs(30)).await {
        ctx.say("mem: warning: the worker did not exit within 30 s of SIGTERM");
    }
    let (_, drained_at) = drained?;
    let seconds = drained_at.duration_since(started).as_secs_f64();
    let checks = simple_rows(
        &client,
        "SELECT (SELECT count(*) FROM ledger_entries),
                (SELECT count(*) FROM webhook_inbox WHERE processed_at IS NULL),
                (SELECT count(*) FROM webhook_inbox WHERE attempts > 1),
                (SELECT count(*) FROM webhook_inbox WHERE last_error IS NOT NULL)",
    )
    .await?;
    let num = |i: usize| checks[0][i].parse::<i64>().unwrap_or(-1);
    let (ledger, unprocessed, retried, with_error) = (num(0), num(1), num(2), num(3));
    ensure!(unprocessed == 0, "{unprocessed} rows unprocessed after the drain");
    let sampled_max = samples.iter().map(|s| s.1).max();
    // VmHWM lags VmRSS a little (the kernel folds per-thread RSS counts in now and then): the
    // peak is the higher of the two readings.
    let hwm = end_rss.map(|r| r.1);
    let peak_kib = hwm.max(sampled_max);
    let events_per_s = rows as f64 / seconds;
    let mib_per_s = payload_bytes as f64 / f64::from(1 << 20) / seconds;
    let cpu = cpu0.usage(&cpu1, Some(rows as f64));
    ctx.say(&format!(
        "mem: {events_per_s:.1} events/s, {mib_per_s:.1} MiB/s in {seconds:.1} s; worker peak RSS {} \
         (max sampled {}, {} samples), ledger {ledger}, retried {retried}, with error {with_error} ({})",
        peak_kib.map_or("?".into(), |k| format!("{:.1} MiB", k as f64 / 1024.0)),
        sampled_max.map_or("?".into(), |k| format!("{:.1} MiB", k as f64 / 1024.0)),
        samples.len(),
        crate::util::cpu_summary(&cpu)
    ));
    Ok(json!({
        "processes": 1,
        "default_flags": true,
        "worker_defaults": ctx.worker_defaults,
        "poll_interval": poll,
        "rows": rows,
        "event_bytes_target": EVENT_BYTES,
        "payload_bytes": payload_bytes,
        "payload_bytes_min": min_bytes,
        "payload_bytes_max": max_bytes,
        "table_total_bytes": stored_bytes,
        "seed_seconds": seed_seconds,
        "seconds": seconds,
        "events_per_s": events_per_s,
        "payload_mib_per_s": mib_per_s,
        "worker_peak_rss_kib": peak_kib,
        "worker_vmhwm_kib": hwm,
        "worker_rss_end_kib": end_rss.map(|r| r.0),
        "worker_rss_max_sampled_kib": sampled_max,
        "rss_samples_ms_kib": samples,
        "memory_limit_kib": WORKER_MEMORY_LIMIT_KIB,
        "peak_within_limit": peak_kib.map(|k| k <= WORKER_MEMORY_LIMIT_KIB),
        "ledger_rows": ledger,
        "ledger_matches": ledger == rows as i64,
        "rows_retried": retried,
        "rows_with_error": with_error,
        "cpu": cpu,
    }))
}

/// `--concurrency 256 --batch-size 64 --max-bytes-in-flight 32MiB` from
/// [`crate::services::Bins::worker_defaults`] (`?` for what the worker's help does not state).
fn defaults_text(d: &serde_json::Value) -> String {
    let v = |k: &str| d[k].as_str().unwrap_or("?").to_owned();
    format!(
        "--concurrency {} --batch-size {} --max-bytes-in-flight {}",
        v("concurrency"),
        v("batch_size"),
        v("max_bytes_in_flight")
    )
}
