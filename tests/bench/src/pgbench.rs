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
