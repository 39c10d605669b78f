//! (a) The limit: `pgbench -M prepared` running the ingest's own `INSERT … ON CONFLICT DO
//! NOTHING` with the same ~2 KB body and its size (`payload_bytes`), bound as parameters like the
//! service binds them.

use anyhow::{bail, Context as _};
use serde_json::json;

use crate::util::CpuSample;
use crate::Ctx;

/// The statement of `inbox_domain::inbox::store::ingest::INSERT_EVENTS_SQL`, with pgbench variables: a unique
/// event id per transaction, the body from `-D payload=…` and its length in bytes from
/// `-D payload_bytes=…` (both sent with every execution, as the ingest binds them).
const SCRIPT: &str = "\\set r random(1, 1000000000000)
INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, payload_bytes)
VALUES ('stripe', 'billing', 'evt_' || :client_id || '_' || :r, 'invoice.paid', :payload::jsonb,
        :payload_bytes::int4)
ON CONFLICT (provider, endpoint, event_id) DO NOTHING
RETURNING 1;
";

pub async fn run(ctx: &Ctx, clients: usize) -> anyhow::Result<serde_json::Value> {
    let free = ctx.server.free_connections().await?;
    let mut note = None;
    let mut clients_run = clients;
    if clients as i64 > free - 2 {
        clients_run = (free - 2).max(1) as usize;
        note = Some(format!("only {free} free connections on the server: ran {clients_run} clients"));
        ctx.say(&format!("a: warning: {}", note.as_ref().unwrap()));
    }
    let db = ctx.server.create_db(&format!("a{clients}")).await?;
    let result = async {
        ctx.migrate(&db.url).await?;
        let client = crate::pg::connect(&db.url).await?;
        let script = ctx.out_dir.join("pgbench_insert.sql");
        std::fs::write(&script, SCRIPT).with_context(|| format!("writing {}", script.display()))?;
        let body = crate::payload::invoice_paid_template()
            .replace(crate::payload::EVT, "evt_pgbench_0000000000")
            .replace(crate::payload::INV, "in_pgbench_0000000000");
        let threads = ctx.args.pgbench_threads.min(clients_run).max(1);
        let pgbench = |secs: u64| {
            let mut cmd = std::process::Command::new("pgbench");
            cmd.args(["-M", "prepared", "-n"])
                .args(["-c", &clients_run.to_string(), "-j", &threads.to_string(), "-T", &secs.to_string()])
                .arg("-f")
                .arg(&script)
                .arg("-D")
                .arg(format!("payload={body}"))
                .arg("-D")
                .arg(format!("payload_bytes={}", body.len()))
                .arg(&db.url);
            cmd
        };
        let warmup = ctx.args.warmup.as_secs();
        if warmup > 0 {
            ctx.say(&format!("a: pgbench {clients_run} clients, {warmup} s warm-up"));
            run_pgbench(pgbench(warmup)).await?;
        }
        let secs = ctx.args.duration.as_secs().max(1);
        ctx.say(&format!("a: pgbench -M prepared -c {clients_run} -j {threads} -T {secs}"));
        let _ = client.batch_execute("CHECKPOINT").await;
        let cpu0 = CpuSample::take(ctx.server.postmaster, &[]);
        let out = run_pgbench(pgbench(secs)).await?;
        // pgbench's backends count once the postmaster has reaped them (its children's CPU time).
        ctx.server.wait_pgbench_gone(&db.name).await;
        let cpu1 = CpuSample::take(ctx.server.postmaster, &[]);
        std::fs::write(ctx.out_dir.join(format!("pgbench_{clients}.log")), &out)?;
        let tps = find_number(&out, "tps = ").context("no tps line in pgbench's output")?;
        let transactions = find_number(&out, "number of transactions actually processed: ");
        let rows: i64 = client.query_one("SELECT count(*) FROM webhook_inbox", &[]).await?.get(0);
        let cpu = cpu0.usage(&cpu1, transactions);
        ctx.say(&format!("a: {tps:.0} tps ({})", crate::util::cpu_summary(&cpu)));
        Ok(json!({
            "clients": clients_run,
            "threads": threads,
            "seconds": secs,
            "tps": tps,
            "latency_avg_ms": find_number(&out, "latency average = "),
            "transactions": transactions,
            "failed": find_number(&out, "number of failed transactions: "),
            "rows_stored": rows,
            "body_bytes": body.len(),
            "cpu": cpu,
            "note": note,
        }))
    }
    .await;
    ctx.server.drop_db(&db).await;
    result
}

/// Rounds of one client count as one figure: the transactions of all over their time (each
/// round's transactions at its rate), and each round's rate under `rounds_tps`.
pub fn combine(rounds: Vec<serde_json::Value>) -> serde_json::Value {
    if rounds.len() == 1 {
        return rounds.into_iter().next().unwrap();
    }
    let num = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap_or(0.0);
    let sum = |k: &str| rounds.iter().map(|r| num(r, k)).sum::<f64>();
    let transactions = sum("transactions");
    let busy: f64 = rounds.iter().map(|r| num(r, "transactions") / num(r, "tps").max(1e-9)).sum();
    let latency: f64 = rounds.iter().map(|r| num(r, "latency_avg_ms") * num(r, "transactions")).sum();
    let cpu: Vec<_> = rounds.iter().map(|r| (&r["cpu"], num(r, "transactions"))).collect();
    let mut out = rounds.last().unwrap().clone();
    out["tps"] = json!(transactions / busy.max(1e-9));
    out["transactions"] = json!(transactions);
    out["seconds"] = json!(sum("seconds"));
    out["latency_avg_ms"] = json!(crate::util::r3(latency / transactions.max(1.0)));
    out["failed"] = json!(sum("failed"));
    out["rows_stored"] = json!(sum("rows_stored"));
    out["cpu"] = crate::util::combine_cpu(&cpu);
    out["rounds_tps"] = rounds.iter().map(|r| r["tps"].clone()).collect();
    out
}

async fn run_pgbench(mut cmd: std::process::Command) -> anyhow::Result<String> {
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await?
        .context("running pgbench (is it installed?)")?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        bail!("pgbench failed ({}):\n{text}", out.status);
    }
    Ok(text)
}

fn find_number(text: &str, prefix: &str) -> Option<f64> {
    let line = text.lines().find_map(|l| l.trim().strip_prefix(prefix))?;
    line.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn rounds_combine_into_their_transactions_over_their_time_not_the_mean_of_their_rates() {
        let round = |transactions: f64, tps: f64, pct: f64, us: f64| {
            json!({
                "transactions": transactions, "tps": tps, "seconds": transactions / tps,
                "latency_avg_ms": 1.0, "failed": 0, "rows_stored": transactions,
                "cpu": {"seconds": transactions / tps, "postgres_pct_of_core": pct, "postgres_cpu_us_per_unit": us},
            })
        };
        let v = super::combine(vec![round(100.0, 10.0, 100.0, 50.0), round(600.0, 30.0, 200.0, 100.0)]);
        // 700 transactions in 10 s + 20 s, where the mean of the rates would be 20.
        assert!((v["tps"].as_f64().unwrap() - 700.0 / 30.0).abs() < 1e-9, "{v}");
        assert_eq!(v["rounds_tps"], json!([10.0, 30.0]));
        assert_eq!(v["rows_stored"], json!(700.0));
        // A share of a core weighted by seconds, CPU per transaction by transactions.
        assert_eq!(v["cpu"]["postgres_pct_of_core"], json!(166.7)); // (100 × 10 + 200 × 20) / 30
        assert_eq!(v["cpu"]["postgres_cpu_us_per_unit"], json!(92.9)); // (50 × 100 + 100 × 600) / 700
        assert_eq!(v["cpu"]["seconds"], json!(30.0));
    }
}
