//! `stats`: the queue's health — unprocessed rows split into ready, leased, waiting for a retry
//! and parked, the oldest unprocessed age, what was processed in the last hour — in total and
//! per event type, with the rows of types no live worker claims (`no_handler`); the live workers
//! and what each claims; the rows each signing secret verified, per endpoint (for secret
//! rolls); and the outbox — rows pending delivery, the oldest pending age, parked rows and the
//! aggregates they hold back.

use clap::Args as ClapArgs;
use inbox_domain::inbox::store::{admin, outbox};
use serde::Serialize;

use super::db_error;
use super::output::{emit, emit_json, format_age, OutputArgs, Table};

/// Flags of `stats`.
#[derive(Debug, ClapArgs)]
pub struct Args {
    #[command(flatten)]
    pub output: OutputArgs,
}

/// `stats`.
pub async fn run(client: &(impl tokio_postgres::GenericClient + Sync), args: &Args) -> anyhow::Result<()> {
    let stats = admin::stats(client).await.map_err(db_error("reading the queue statistics"))?;
    let outbox = outbox::stats(client).await.map_err(db_error("reading the outbox statistics"))?;
    if args.output.json {
        #[derive(Serialize)]
        struct Report<'a> {
            #[serde(flatten)]
            inbox: &'a admin::Stats,
            outbox: &'a outbox::OutboxStats,
        }
        return emit_json(&Report { inbox: &stats, outbox: &outbox });
    }
    let mut summary = Table::new(&[("queue", false), ("rows", true)]);
    let oldest = stats.oldest_unprocessed_age_seconds.map_or_else(|| "-".to_owned(), format_age);
    for (name, value) in [
        ("unprocessed", stats.unprocessed.to_string()),
        ("  ready", stats.ready.to_string()),
        ("  leased (in flight)", stats.leased.to_string()),
        ("  retry_wait (after a failure)", stats.retry_wait.to_string()),
        ("  needs_review (parked)", stats.needs_review.to_string()),
        ("  no_handler (no live worker claims the type)", stats.no_handler.to_string()),
        ("oldest_unprocessed_age", oldest),
        ("processed_last_hour", stats.processed_last_hour.to_string()),
    ] {
        summary.push(vec![name.to_owned(), value]);
    }
    let mut text = summary.render();
    text.push('\n');
    if stats.by_event_type.is_empty() {
        text.push_str("no unprocessed rows and nothing processed in the last hour\n");
    } else {
        let mut by_type = Table::new(&[
            ("event_type", false),
            ("unprocessed", true),
            ("needs_review", true),
            ("no_handler", true),
            ("processed_last_hour", true),
        ]);
        for t in &stats.by_event_type {
            by_type.push(vec![
                t.event_type.clone(),
                t.unprocessed.to_string(),
                t.needs_review.to_string(),
                t.no_handler.to_string(),
                t.processed_last_hour.to_string(),
            ]);
        }
        text.push_str(&by_type.render());
    }
    // Who claims what: the types nobody claims are the no_handler rows above.
    text.push('\n');
    if stats.workers.is_empty() {
        text.push_str("no worker seen in the last minute\n");
    } else {
        let mut workers =
            Table::new(&[("worker", false), ("program", false), ("claims", false), ("seen", true)]);
        for w in &stats.workers {
            let mut claims: Vec<String> = w.handles.clone();
            claims.extend(w.ignores.iter().map(|p| format!("{p} (ignored)")));
            workers.push(vec![
                w.id.clone(),
                w.program.clone(),
                if claims.is_empty() { "nothing".to_owned() } else { claims.join(", ") },
                format_age(w.seen_seconds_ago),
            ]);
        }
        text.push_str(&workers.render());
    }
    if !stats.by_secret.is_empty() {
        // During a secret roll: the old secret is safe to remove once it verified nothing for a day.
        text.push('\n');
        let mut by_secret = Table::new(&[
            ("endpoint", false),
            ("secret", true),
            ("fingerprint", false),
            ("rows", true),
            ("rows_last_24h", true),
            ("last_received_at", false),
        ]);
        for s in &stats.by_secret {
            by_secret.push(vec![
                s.endpoint.clone(),
                s.position.to_string(),
                s.fingerprint.clone(),
                s.rows.to_string(),
                s.rows_last_24h.to_string(),
                s.last_received_at.clone(),
            ]);
        }
        text.push_str(&by_secret.render());
    }
    // What the relays deliver: a parked row holds back the later rows of its aggregate.
    text.push('\n');
    let mut table = Table::new(&[("outbox", false), ("rows", true)]);
    for (name, value) in [
        ("pending (to deliver)", outbox.pending.to_string()),
        ("  held behind a parked row", outbox.blocked_rows.to_string()),
        ("parked (needs-review --outbox)", outbox.parked.to_string()),
        ("blocked aggregates", outbox.blocked_aggregates.to_string()),
        ("oldest_pending_age", outbox.oldest_pending_age_seconds.map_or_else(|| "-".to_owned(), format_age)),
    ] {
        table.push(vec![name.to_owned(), value]);
    }
    text.push_str(&table.render());
    emit(&text)
}
