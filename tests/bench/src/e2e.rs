//! (d) End to end: one ingest and one worker, webhooks sent at a fixed rate (open loop), then
//! receive-to-processed latency from the rows (`processed_at - received_at`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _};
use serde_json::json;

use crate::http;
use crate::payload::Requests;
use crate::pg::{self, simple_rows};
use crate::services::{check_alive, stop};
use crate::util::{rss_kib, CpuSample, LogSample, MachineSampler, MachineSecond};
use crate::Ctx;

pub async fn run(ctx: &Ctx, rate: f64, rate_source: &str) -> anyhow::Result<serde_json::Value> {
    let db = ctx.server.create_db("d").await?;
    let result = async {
        ctx.migrate(&db.url).await?;
        let (mut ingest, addr) = ctx.bins.start_ingest(&db.url).await?;
        let mut extra = Vec::new();
        if let Some(p) = &ctx.args.e2e_poll_interval {
            extra.extend(["--poll-interval", p.as_str()]);
        }
        let mut worker = ctx.bins.start_worker(
            &db.url,
            Some(ctx.args.worker_concurrency),
            ctx.args.worker_batch_size,
            &extra,
        );
        let client = pg::connect(&db.url).await?;
        let sampler = pg::connect(&db.url).await?;
        let host = addr.to_string();
        let warm_n = (rate * ctx.args.warmup.as_secs_f64()).ceil() as usize + 1;
        let n = (rate * ctx.args.duration.as_secs_f64()).ceil() as usize + 1;
        let (t1, t2, h1, h2) = (ctx.template.clone(), ctx.template.clone(), host.clone(), host);
        let warm = Arc::new(tokio::task::spawn_blocking(move || Requests::new(&t1, &h1, "w_", warm_n)).await?);
        let measured = Arc::new(tokio::task::spawn_blocking(move || Requests::new(&t2, &h2, "m_", n)).await?);
        let conns = ctx.args.e2e_connections.unwrap_or(((rate * 0.1).ceil() as usize).clamp(32, 256)).max(1);
        ctx.say(&format!(
            "d: {rate:.0} webhooks/s ({rate_source}) over {conns} connections, {} s warm-up + {} s, 1 ingest + 1 worker",
            ctx.args.warmup.as_secs_f64(),
            ctx.args.duration.as_secs_f64()
        ));
        let warm_load = if ctx.args.warmup > Duration::ZERO {
            let c = http::connect_all(addr, conns).await?;
            Some(http::open_loop(c, warm, Instant::now(), rate, ctx.args.warmup).await)
        } else {
            None
        };
        let c = http::connect_all(addr, conns).await?;
        let procs = [("ingest", ingest.child.id()), ("worker", worker.child.id())];
        let cpu0 = CpuSample::take(ctx.server.postmaster, &procs);
        let log0 = LogSample::take(&[("ingest", &ingest), ("worker", &worker)]);
        let t0 = Instant::now();
        let t0_wall = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let autovacuum = pg::AutovacuumSampler::start(sampler, db.name.clone(), t0);
        let machine = MachineSampler::start(t0);
        let load = http::open_loop(c, measured, t0, rate, ctx.args.duration).await;
        let cpu1 = CpuSample::take(ctx.server.postmaster, &procs);
        let autovacuum = autovacuum.finish().await;
        let machine = machine.finish().await;
        let sent_at = Instant::now();
        check_alive(&mut ingest, "inbox-ingest")?;
        let progress = |left: i64| ctx.say(&format!("d:   {left} rows not yet processed"));
        let (_, drained_at) =
            pg::wait_drained(&client, Duration::from_millis(20), ctx.args.drain_timeout, progress, || {
                check_alive(&mut worker, "inbox-worker")
            })
            .await?;
        // After the drain: the worker's lines for the measured rows come up to its end.
        let log1 = LogSample::take(&[("ingest", &ingest), ("worker", &worker)]);
        let ingest_rss = rss_kib(ingest.child.id());
        let worker_rss = rss_kib(worker.child.id());
        stop(&mut ingest, Duration::from_secs(10)).await;
        stop(&mut worker, Duration::from_secs(30)).await;
        // Where the time goes, besides the total: from the insert's transaction to the claim's, and
        // from the claim's to the process transaction's (`processed_at`). The claim's start is its
        // lease's end less the lease, the worker's default (the bench passes no --lease), for rows
        // claimed once.
        let lease = ctx.worker_defaults["lease"]
            .as_str()
            .and_then(|l| humantime::parse_duration(l).ok())
            .context("inbox-worker run --help states no default --lease")?;
        let rows = simple_rows(
            &client,
            &format!(
                "SELECT count(*),
                        count(*) FILTER (WHERE left(event_id, 6) = 'evt_m_'),
                        percentile_cont(ARRAY[0.5, 0.9, 0.99, 0.999]) WITHIN GROUP (ORDER BY
                            extract(epoch FROM processed_at - received_at) * 1000)
                            FILTER (WHERE left(event_id, 6) = 'evt_m_'),
                        max(extract(epoch FROM processed_at - received_at) * 1000) FILTER (WHERE left(event_id, 6) = 'evt_m_'),
                        (SELECT count(*) FROM ledger_entries),
                        percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY
                            extract(epoch FROM available_at - make_interval(secs => {lease}) - received_at) * 1000)
                            FILTER (WHERE left(event_id, 6) = 'evt_m_' AND attempts = 1),
                        percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY
                            extract(epoch FROM processed_at - (available_at - make_interval(secs => {lease}))) * 1000)
                            FILTER (WHERE left(event_id, 6) = 'evt_m_' AND attempts = 1)
                   FROM webhook_inbox",
                lease = lease.as_secs_f64()
            ),
        )
        .await?;
        // Per second of receipt: a p99 over the target from one stall of the machine shows as one
        // bad second, a queue that grows as a rising series.
        let seconds = simple_rows(
            &client,
            "WITH m AS (SELECT received_at, extract(epoch FROM processed_at - received_at) * 1000 AS ms
                          FROM webhook_inbox WHERE left(event_id, 6) = 'evt_m_')
             SELECT round(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)::numeric, 1), round(max(ms)::numeric, 1)
               FROM m, (SELECT min(received_at) AS t0 FROM m) s
              GROUP BY floor(extract(epoch FROM received_at - t0))
              ORDER BY floor(extract(epoch FROM received_at - t0))",
        )
        .await?;
        let per_second: Vec<(f64, f64)> =
            seconds.iter().filter_map(|r| Some((r[0].parse().ok()?, r[1].parse().ok()?))).collect();
        let r = &rows[0];
        // A PostgreSQL array in text form, `{1.5,2}`.
        let floats = |text: &str| -> Vec<f64> {
            text.trim_matches(|c| c == '{' || c == '}').split(',').filter_map(|v| v.parse().ok()).collect()
        };
        let total: i64 = r[0].parse()?;
        let measured_rows: i64 = r[1].parse()?;
        let pct = floats(&r[2]);
        ensure!(pct.len() == 4, "no receive-to-processed percentiles (no rows?)");
        let (to_claim, to_process) = (floats(&r[5]), floats(&r[6]));
        ensure!(to_claim.len() == 2 && to_process.len() == 2, "no stage percentiles (no rows claimed once?)");
        ctx.say(&format!(
            "d:   p50 / p99 ms: receive→claim {:.1} / {:.1}, claim→process {:.1} / {:.1}",
            to_claim[0], to_claim[1], to_process[0], to_process[1]
        ));
        let max_ms: f64 = r[3].parse().unwrap_or(f64::NAN);
        let ledger: i64 = r[4].parse()?;
        let total_ok = load.measured.ok + warm_load.as_ref().map_or(0, |w| w.measured.ok);
        let unanswered = load.measured.errors + warm_load.as_ref().map_or(0, |w| w.measured.errors);
        let non_2xx = load.measured.non_2xx + warm_load.as_ref().map_or(0, |w| w.measured.non_2xx);
        let cpu = cpu0.usage(&cpu1, Some(load.measured.ok as f64));
        let logs = log0.per_unit(&log1, load.measured.ok as f64);
        let series = |f: fn(&(f64, f64)) -> f64| per_second.iter().map(|v| format!("{:.0}", f(v))).collect::<Vec<_>>().join(" ");
        ctx.say(&format!("d:   p99 / max ms per second of receipt: {} / {}", series(|v| v.0), series(|v| v.1)));
        let machine_series = |f: fn(&MachineSecond) -> Option<f64>| {
            machine.iter().map(|m| f(m).map_or("-".into(), |v| format!("{v:.0}"))).collect::<Vec<_>>().join(" ")
        };
        ctx.say(&format!(
            "d:   machine per second: busy % {}; every task waiting on I/O, ms {}; steal % {}",
            machine_series(|m| m.busy_pct),
            machine_series(|m| m.io_stall_ms),
            machine_series(|m| m.steal_pct)
        ));
        ctx.say(&format!("d:   autovacuum in the measured window: {}", pg::AutovacuumRun::describe(&autovacuum)));
        // The second that decided the window's p99 most, with what the machine and autovacuum did
        // in it: seconds of receipt start at the first measured row, within milliseconds of t0.
        let worst_second = per_second
            .iter()
            .enumerate()
            .max_by(|a, b| a.1 .0.total_cmp(&b.1 .0))
            .map(|(k, &(p99, _))| {
                let m = machine.get(k).copied().unwrap_or_default();
                let rounds: Vec<&str> = autovacuum
                    .iter()
                    .filter(|r| r.from_s < (k + 1) as f64 && r.to_s >= k as f64)
                    .map(|r| r.what.as_str())
                    .collect();
                json!({ "second": k, "p99_ms": p99, "machine": m.json(), "autovacuum": rounds })
            });
        ctx.say(&format!(
            "d: sent {:.0}/s, receive-to-processed p50 {:.1} ms p99 {:.1} ms max {max_ms:.1} ms; HTTP p99 {:.1} ms; \
             drained {:.2} s after the last send ({}; {})",
            load.rate(),
            pct[0],
            pct[2],
            load.latency.p99,
            drained_at.duration_since(sent_at).as_secs_f64(),
            crate::util::cpu_summary(&cpu),
            crate::util::log_summary(&logs)
        ));
        Ok(json!({
            "target_rate": rate,
            "rate_source": rate_source,
            "achieved_rate": load.rate(),
            "connections": conns,
            "seconds": load.seconds,
            "window_started_unix_s": t0_wall.as_secs_f64(),
            "worker_concurrency": ctx.args.worker_concurrency,
            "worker_batch_size": ctx.args.worker_batch_size,
            "worker_poll_interval": ctx.args.e2e_poll_interval.clone().unwrap_or_else(|| "service default".into()),
            "receive_to_processed": {
                "rows": measured_rows, "p50_ms": pct[0], "p90_ms": pct[1], "p99_ms": pct[2], "p99_9_ms": pct[3],
                "max_ms": max_ms,
                "per_second": per_second.iter().enumerate().map(|(k, (p99, max))| json!({
                    "p99_ms": p99, "max_ms": max, "machine": machine.get(k).map(MachineSecond::json),
                })).collect::<Vec<_>>(),
                "worst_second": worst_second,
            },
            "stages": {
                "receive_to_claim": { "p50_ms": to_claim[0], "p99_ms": to_claim[1] },
                "claim_to_process": { "p50_ms": to_process[0], "p99_ms": to_process[1] },
            },
            "autovacuum_in_window": autovacuum.iter().map(pg::AutovacuumRun::json).collect::<Vec<_>>(),
            "http_latency": load.latency.json(),
            "measured": load.measured.json(),
            "non_2xx": non_2xx,
            "unanswered": unanswered,
            "total_2xx": total_ok,
            "rows_stored": total,
            "rows_match_2xx": total as u64 == total_ok,
            "ledger_rows": ledger,
            "drain_after_last_send_s": drained_at.duration_since(sent_at).as_secs_f64(),
            "first_error": load.first_error,
            "ingest_rss_kib": ingest_rss.map(|r| r.0),
            "ingest_peak_rss_kib": ingest_rss.map(|r| r.1),
            "worker_rss_kib": worker_rss.map(|r| r.0),
            "worker_peak_rss_kib": worker_rss.map(|r| r.1),
            "cpu": cpu,
            "logs": logs,
        }))
    }
    .await;
    ctx.server.drop_db(&db).await;
    result
}
