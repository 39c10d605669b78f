//! relay: one `inbox-worker relay` process started with nothing but its destination (its
//! defaults) delivers `--drain-rows` outbox rows — each its own aggregate, the payload the invoice
//! handler writes — to an HTTP receiver in this process (Standard Webhooks signed; it answers 200
//! and counts the requests per id, nothing more),
//! then to a nats-server with JetStream (an R1 file stream; waits for each ack). Deliveries/s,
//! commits and WAL bytes per delivered row, CPU µs per row; the report sets the rate beside the
//! worker's default-flag drain of (c): the relay must never be what limits the pipeline.

use std::time::{Duration, Instant};

use anyhow::{bail, ensure};
use serde_json::json;

use crate::pg::{self, simple_rows};
use crate::services::{check_alive, stop};
use crate::util::{rss_kib, CpuSample};
use crate::Ctx;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const SUBJECT: &str = "bench.outbox";
const STREAM: &str = "BENCH_OUTBOX";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Destination {
    Http,
    Nats,
}

impl Destination {
    pub fn name(self) -> &'static str {
        match self {
            Destination::Http => "http",
            Destination::Nats => "nats",
        }
    }
}

/// The relay's flags that deliver to `receiver` (an HTTP receiver in this process); it needs
/// [`HTTP_ENV`] too.
pub fn http_args(receiver: &inbox_test_support::receiver::Counter) -> Vec<String> {
    vec!["--to-url".to_owned(), receiver.url.clone()]
}

/// The environment of a relay delivering over HTTP: the Standard Webhooks signing secret.
pub const HTTP_ENV: &[(&str, &str)] = &[("INBOX_RELAY_SECRET", SECRET)];

pub async fn run(ctx: &Ctx, destination: Destination) -> anyhow::Result<serde_json::Value> {
    let db = ctx.server.create_db(&format!("relay{}", destination.name())).await?;
    let result = deliver(ctx, destination, &db).await;
    ctx.server.drop_db(&db).await;
    result
}

async fn deliver(ctx: &Ctx, destination: Destination, db: &pg::BenchDb) -> anyhow::Result<serde_json::Value> {
    let label = format!("relay-{}", destination.name());
    let rows = ctx.args.drain_rows;
    ctx.migrate(&db.url).await?;
    let client = pg::connect(&db.url).await?;
    ctx.say(&format!("{label}: writing {rows} outbox rows (each its own invoice)"));
    client
        .execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'Invoice', 'in_bench_' || g, 'InvoicePaymentBooked',
                    jsonb_build_object('invoice_id', 'in_bench_' || g, 'customer', 'cus_bench_' || (g % 997),
                                       'amount', 2000 + g % 5000, 'currency', 'jpy',
                                       'stripe_event_id', 'evt_bench_' || g, 'paid_at', '2026-12-01T00:00:00Z')
               FROM generate_series(1, $1::int8) AS g",
            &[&(rows as i64)],
        )
        .await?;
    client.batch_execute("VACUUM ANALYZE outbox").await?;
    let _ = client.batch_execute("CHECKPOINT").await;

    // The destination.
    let mut receiver = None;
    let mut nats = None;
    let args: Vec<String> = match destination {
        Destination::Http => {
            let r = inbox_test_support::receiver::Counter::start().await;
            let args = http_args(&r);
            receiver = Some(r);
            args
        }
        Destination::Nats => {
            let Some(server) = tokio::task::spawn_blocking(inbox_test_support::nats::Nats::single).await?
            else {
                bail!("nats-server is not installed (make deps installs it)");
            };
            let js = inbox_test_support::nats::jetstream(&server.urls()).await;
            inbox_test_support::nats::create_stream(&js, STREAM, SUBJECT, 1).await;
            let args =
                vec!["--to-nats".to_owned(), server.urls(), "--subject".to_owned(), SUBJECT.to_owned()];
            nats = Some((server, js));
            args
        }
    };

    ctx.server.flush_stats(&client).await;
    let snap0 = ctx.server.snapshot(&client).await?;
    let started = Instant::now();
    let mut argv: Vec<&str> = args.iter().map(String::as_str).collect();
    argv.extend(ctx.args.relay_args.split_whitespace());
    let defaults = ctx.args.relay_args.trim().is_empty();
    let env: &[(&str, &str)] = if destination == Destination::Http { HTTP_ENV } else { &[] };
    let mut relay = ctx.bins.start_relay(&db.url, &argv, env);
    let pids = [("relay", relay.child.id())];
    let cpu0 = CpuSample::take(ctx.server.postmaster, &pids);
    let flags = if defaults { "no tuning flags".to_owned() } else { ctx.args.relay_args.clone() };
    ctx.say(&format!("{label}: 1 relay process, {flags}, delivering {rows} rows"));
    let mut polls = 0u64;
    let mut last_progress = Instant::now();
    loop {
        let left =
            simple_rows(&client, "SELECT EXISTS (SELECT 1 FROM outbox WHERE published_at IS NULL)").await?;
        polls += 1;
        if left[0][0] == "f" {
            break;
        }
        check_alive(&mut relay, "inbox-worker relay")?;
        if last_progress.elapsed() >= Duration::from_secs(15) {
            last_progress = Instant::now();
            let n = simple_rows(&client, "SELECT count(*) FROM outbox WHERE published_at IS NULL").await?;
            polls += 1;
            ctx.say(&format!("{label}:   {:.0} s, {} rows left", started.elapsed().as_secs_f64(), n[0][0]));
        }
        if started.elapsed() > ctx.args.drain_timeout {
            bail!("outbox rows still unpublished after {:?}", ctx.args.drain_timeout);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu1 = CpuSample::take(ctx.server.postmaster, &pids);
    let rss = rss_kib(relay.child.id());
    if !stop(&mut relay, Duration::from_secs(30)).await {
        ctx.say(&format!("{label}: warning: the relay did not exit within 30 s of SIGTERM"));
    }
    ctx.server.flush_stats(&client).await;
    let snap1 = ctx.server.snapshot(&client).await?;
    let own = 1 + polls as i64 + i64::from(ctx.server.force_flush);
    let commits = snap1.commits - snap0.commits - own;
    let n = rows as f64;
    let wal_bytes = snap1.lsn - snap0.lsn;

    // What the destination holds: every row, once.
    let (delivered, distinct) = match (&receiver, &nats) {
        (Some(r), _) => (r.requests(), r.distinct() as u64),
        (_, Some((_, js))) => {
            let mut stream = js.get_stream(STREAM).await?;
            let messages = stream.info().await?.state.messages;
            (messages, messages)
        }
        _ => unreachable!(),
    };
    ensure!(distinct == rows, "{label}: the destination holds {distinct} distinct rows of {rows}");
    let per_s = n / seconds;
    let cpu = cpu0.usage(&cpu1, Some(n));
    ctx.say(&format!(
        "{label}: {per_s:.0} deliveries/s in {seconds:.1} s, {:.3} commits/row, {:.0} WAL bytes/row ({})",
        commits as f64 / n,
        wal_bytes as f64 / n,
        crate::util::cpu_summary(&cpu)
    ));
    drop(nats);
    Ok(json!({
        "destination": destination.name(),
        "rows": rows,
        "seconds": seconds,
        "deliveries_per_s": per_s,
        "delivered": delivered,
        "duplicates": delivered - distinct,
        "commits": commits,
        "commits_per_row": commits as f64 / n,
        "wal_bytes_per_row": wal_bytes as f64 / n,
        "own_transactions_subtracted": own,
        "relay_rss_kib": rss.map(|r| r.0),
        "relay_peak_rss_kib": rss.map(|r| r.1),
        "cpu": cpu,
        "default_flags": defaults,
        "flags": ctx.args.relay_args,
    }))
}
