//! (b) Ingest: pre-signed unique `invoice.paid` webhooks from N keep-alive connections, closed
//! loop, a warm-up, then the measured window; afterwards the rows stored must equal the 2xx
//! answers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::http;
use crate::payload::Requests;
use crate::services::stop;
use crate::util::{rss_kib, CpuSample, LogSample};
use crate::Ctx;

/// Pre-signed requests are kept in memory (~2.3 KB each): at most this many per run; beyond it
/// the load generator signs on the fly (reported as `signed_during_run`).
const MAX_PRESIGNED: usize = 300_000;

/// One measured window: its figures, and its latencies for [`combine`].
pub struct Round {
    pub json: serde_json::Value,
    micros: Vec<u32>,
}

pub async fn run(ctx: &Ctx, conns: usize, pgbench_tps: Option<f64>) -> anyhow::Result<Round> {
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
        let log0 = LogSample::take(&[("ingest", &ingest)]);
        tokio::time::sleep_until((t0 + window).into()).await;
        let cpu1 = CpuSample::take(ctx.server.postmaster, &[("ingest", pid)]);
        let log1 = LogSample::take(&[("ingest", &ingest)]);
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
        let answered = (load.measured.ok + load.measured.non_2xx) as f64;
        let cpu = cpu0.usage(&cpu1, Some(answered));
        let logs = log0.per_unit(&log1, answered);
        let rate = load.rate();
        ctx.say(&format!(
            "b: {rate:.0} req/s, p50 {:.1} ms, p99 {:.1} ms, non-2xx {}, unanswered {}, rows {rows} / 2xx {}, \
             {:.0} WAL bytes/request ({}; {})",
            load.latency.p50,
            load.latency.p99,
            load.measured.non_2xx + load.warmup.non_2xx,
            load.total_unanswered(),
            load.total_ok(),
            (snap1.lsn - snap0.lsn) as f64 / sent,
            crate::util::cpu_summary(&cpu),
            crate::util::log_summary(&logs)
        ));
        if let Some(e) = &load.first_error {
            ctx.say(&format!("b: first connection error: {e}"));
        }
        let json = json!({
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
            "logs": logs,
        });
        Ok(Round { json, micros: load.micros })
    }
    .await;
    ctx.server.drop_db(&db).await;
    result
}

/// Rounds of one connection count as one figure: the measured requests of all over their
/// seconds, the percentiles of all their latencies, counts summed, per-request figures weighted
/// by each round's requests; each round's rate under `rounds_req_per_s`.
pub fn combine(rounds: Vec<Round>) -> serde_json::Value {
    if rounds.len() == 1 {
        return rounds.into_iter().next().unwrap().json;
    }
    let num = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap_or(0.0);
    let answered = |c: &serde_json::Value| num(c, "ok_2xx") + num(c, "non_2xx");
    let measured = |r: &Round| answered(&r.json["measured"]);
    let sent = |r: &Round| (answered(&r.json["warmup"]) + measured(r)).max(1.0);
    let sum = |k: &str| rounds.iter().map(|r| num(&r.json, k)).sum::<f64>();
    let per_sent = |k: &str| {
        rounds.iter().map(|r| num(&r.json, k) * sent(r)).sum::<f64>() / rounds.iter().map(sent).sum::<f64>()
    };
    let seconds = sum("seconds");
    let requests: f64 = rounds.iter().map(measured).sum();
    let ok: f64 = rounds.iter().map(|r| num(&r.json["measured"], "ok_2xx")).sum();
    let micros: Vec<u32> = rounds.iter().flat_map(|r| r.micros.iter().copied()).collect();
    let cpu: Vec<_> = rounds.iter().map(|r| (&r.json["cpu"], measured(r))).collect();
    let mut out = rounds.last().unwrap().json.clone();
    out["seconds"] = json!(seconds);
    out["req_per_s"] = json!(requests / seconds.max(1e-9));
    out["ok_per_s"] = json!(ok / seconds.max(1e-9));
    out["latency"] = crate::util::Percentiles::of(micros).json();
    for k in [
        "non_2xx",
        "unanswered",
        "total_2xx",
        "rows_stored",
        "requests_sent",
        "signed_during_run",
        "reconnects",
    ] {
        out[k] = json!(sum(k) as u64);
    }
    out["rows_match_2xx"] = json!(rounds.iter().all(|r| r.json["rows_match_2xx"] == true));
    for k in ["commits_per_request", "xids_per_request", "wal_bytes_per_request"] {
        out[k] = json!(per_sent(k));
    }
    out["first_error"] = rounds.iter().map(|r| &r.json["first_error"]).find(|e| !e.is_null()).cloned().into();
    out["ingest_peak_rss_kib"] =
        rounds.iter().filter_map(|r| r.json["ingest_peak_rss_kib"].as_u64()).max().into();
    out["cpu"] = crate::util::combine_cpu(&cpu);
    out["rounds_req_per_s"] = rounds.iter().map(|r| r.json["req_per_s"].clone()).collect();
    for k in ["warmup", "measured"] {
        out[k] = rounds.iter().map(|r| r.json[k].clone()).collect();
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{combine, Round};

    #[test]
    fn rounds_combine_into_the_percentiles_of_all_their_requests_and_the_sum_of_their_counts() {
        let round = |n: u64, ms: u32, matched: bool| Round {
            json: json!({
                "seconds": 1.0, "req_per_s": n, "warmup": {"ok_2xx": 10, "non_2xx": 0},
                "measured": {"ok_2xx": n, "non_2xx": 0}, "non_2xx": 0, "unanswered": 0,
                "total_2xx": n + 10, "rows_stored": n + 10, "rows_match_2xx": matched,
                "commits_per_request": 0.1, "first_error": null, "ingest_peak_rss_kib": 1000 + n,
                "cpu": {"seconds": 1.0},
            }),
            micros: vec![ms * 1000; n as usize],
        };
        let v = combine(vec![round(300, 1, true), round(100, 10, false)]);
        assert_eq!(v["req_per_s"], json!(200.0));
        // 300 requests at 1 ms and 100 at 10 ms: the median is 1 ms, the 99th percentile 10 ms.
        assert_eq!(v["latency"]["p50_ms"], json!(1.0));
        assert_eq!(v["latency"]["p99_ms"], json!(10.0));
        assert_eq!(v["total_2xx"], json!(420));
        assert_eq!(v["rows_match_2xx"], json!(false));
        assert_eq!(v["ingest_peak_rss_kib"], json!(1300));
        assert_eq!(v["rounds_req_per_s"], json!([300, 100]));
    }
}
