//! (b) Ingest: pre-signed unique `invoice.paid` webhooks from N keep-alive connections, closed
//! loop, a warm-up, then the measured window; afterwards the rows stored must equal the 2xx
//! answers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::http;
use crate::payload::Requests;
use crate::services::stop;
use crate::util::{rss_kib, CpuSample};
use crate::Ctx;

/// Pre-signed requests are kept in memory (~2.3 KB each): at most this many per run; beyond it
/// the load generator signs on the fly (reported as `signed_during_run`).
const MAX_PRESIGNED: usize = 300_000;

pub async fn run(ctx: &Ctx, conns: usize, pgbench_tps: Option<f64>) -> anyhow::Result<serde_json::Value> {
    let db = ctx.server.create_db(&format!("b{conns}")).await?;
    let result = async {
        ctx.migrate(&db.url).await?;
        let (mut ingest, addr) = ctx.bins.start_ingest(&db.url).await?;
        let client = crate::pg::connect(&db.url).await?;
        let window = ctx.args.warmup + ctx.args.duration;
        // Batching commits lets the ingest pass pgbench's rate: budget for 2.5 times it.
        let per_s = pgbench_tps.map_or(12_000.0, |t| t * 2.5).max(3_000.0);
        let budget = ((per_s * window.as_secs_f64()) as usize + 1_000).min(MAX_PRESIGNED);
        ctx.say(&format!("b: signing {budget} requests for {conns} connections"));
        let template = ctx.template.clone();
        let host = addr.to_string();
        let tag = format!("b{conns}_");
        let requests =
            Arc::new(tokio::task::spawn_blocking(move || Requests::new(&template, &host, &tag, budget)).await?);
        let conns_v = http::connect_all(addr, conns).await?;
        ctx.say(&format!(
            "b: {conns} connections, {} s warm-up + {} s measured",
            ctx.args.warmup.as_secs_f64(),
            ctx.args.duration.as_secs_f64()
        ));
        ctx.server.flush_stats(&client).await;
        let snap0 = ctx.server.snapshot(&client).await?;
        let t0 = Instant::now();
        let load = tokio::spawn(http::closed_loop(conns_v, requests.clone(), t0, ctx.args.warmup, ctx.args.duration));
        let pid = ingest.child.id();
        tokio::time::sleep_until((t0 + ctx.args.warmup).into()).await;
        let cpu0 = CpuSample::take(ctx.server.postmaster, &[("ingest", pid)]);
        tokio::time::sleep_until((t0 + window).into()).await;
        let cpu1 = CpuSample::take(ctx.server.postmaster, &[("ingest", pid)]);
        let load = load.await?;
        let rss = rss_kib(pid);
        crate::services::check_alive(&mut ingest, "inbox-ingest")?;
        // The ingest's backends flush their statistics when it exits.
        stop(&mut ingest, Duration::from_secs(10)).await;
        ctx.server.flush_stats(&client).await;
        let snap1 = ctx.server.snapshot(&client).await?;
        // Our own: the first snapshot and the flush.
        let own = 1 + i64::from(ctx.server.force_flush);
        let sent = (load.warmup.ok + load.warmup.non_2xx + load.measured.ok + load.measured.non_2xx).max(1) as f64;
        let rows: i64 = client.query_one("SELECT count(*) FROM webhook_inbox", &[]).await?.get(0);
        let (taken, signed_live) = requests.taken();
        let cpu = cpu0.usage(&cpu1, Some((load.measured.ok + load.measured.non_2xx) as f64));
        let rate = load.rate();
        ctx.say(&format!(
            "b: {rate:.0} req/s, p50 {:.1} ms, p99 {:.1} ms, non-2xx {}, unanswered {}, rows {rows} / 2xx {}, \
             {:.0} WAL bytes/request ({})",
            load.latency.p50,
            load.latency.p99,
            load.measured.non_2xx + load.warmup.non_2xx,
            load.total_unanswered(),
            load.total_ok(),
            (snap1.lsn - snap0.lsn) as f64 / sent,
            crate::util::cpu_summary(&cpu)
        ));
        if let Some(e) = &load.first_error {
            ctx.say(&format!("b: first connection error: {e}"));
        }
        Ok(json!({
            "connections": conns,
            "warmup_s": ctx.args.warmup.as_secs_f64(),
            "seconds": load.seconds,
            "req_per_s": rate,
            "ok_per_s": load.measured.ok as f64 / load.seconds,
            "latency": load.latency.json(),
            "warmup": load.warmup.json(),
            "measured": load.measured.json(),
            "non_2xx": load.warmup.non_2xx + load.measured.non_2xx,
            "unanswered": load.total_unanswered(),
            "total_2xx": load.total_ok(),
            "rows_stored": rows,
            "rows_match_2xx": rows as u64 == load.total_ok(),
            "requests_sent": taken,
            "signed_during_run": signed_live,
            "reconnects": load.reconnects,
            "commits_per_request": (snap1.commits - snap0.commits - own) as f64 / sent,
            "xids_per_request": (snap1.next_xid - snap0.next_xid) as f64 / sent,
            "wal_bytes_per_request": (snap1.lsn - snap0.lsn) as f64 / sent,
            "first_error": load.first_error,
            "ingest_rss_kib": rss.map(|r| r.0),
            "ingest_peak_rss_kib": rss.map(|r| r.1),
            "cpu": cpu,
        }))
    }
    .await;
    ctx.server.drop_db(&db).await;
    result
}
