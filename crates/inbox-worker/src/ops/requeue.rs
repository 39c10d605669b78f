//! `requeue`: parked rows (or one unprocessed row) back in the queue — attempts 0, available now —
//! with the audit record in the same transaction.
//!
//! `--event-id`: the row of that id (and `--endpoint`) when it is unprocessed — parked, or
//! waiting for a retry; a processed row is refused (that is `replay`). `--all`: every parked
//! row, narrowed by `--event-type` and `--error-contains`; the count is printed first, then all
//! are requeued in one transaction. The audit row is written also when nothing matched (the
//! attempt is worth seeing); `--dry-run` only lists.
//!
//! Rows the ingest held on arrival are a person's decision, one at a time: `--all` leaves them
//! (and says how many it left); `--event-id` takes a row held for its `livemode` (the person
//! decided the event belongs to this endpoint after all) and refuses one held as unstorable,
//! which has no payload a handler could read.

use clap::Args as ClapArgs;
use inbox_domain::inbox::store::admin::{self, RequeueRow};
use inbox_domain::inbox::store::set_limits;
use inbox_domain::PROVIDER_STRIPE;
use serde::Serialize;

use super::output::{emit, emit_json, plural, OutputArgs, Table};
use super::{db_error, lock_one_event, ActorArgs, LIMITS};

/// Flags of `requeue`.
#[derive(Debug, ClapArgs)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["event_id", "all"])))]
pub struct Args {
    /// The event to requeue.
    #[arg(long)]
    pub event_id: Option<String>,
    /// The endpoint of --event-id (needed when the id is stored for several endpoints).
    #[arg(long, requires = "event_id")]
    pub endpoint: Option<String>,
    /// Every parked row (narrow with --event-type / --error-contains).
    #[arg(long, conflicts_with = "event_id")]
    pub all: bool,
    /// With --all: only rows of this event type.
    #[arg(long, requires = "all")]
    pub event_type: Option<String>,
    /// With --all: only rows whose last_error contains this text.
    #[arg(long, requires = "all")]
    pub error_contains: Option<String>,
    /// Show what would be requeued, change nothing.
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub actor: ActorArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// `requeue`.
pub async fn run(client: &mut deadpool_postgres::Object, args: &Args) -> anyhow::Result<()> {
    let tx = client.transaction().await.map_err(db_error("starting a transaction"))?;
    set_limits(&tx, &LIMITS).await.map_err(db_error("setting the transaction's timeouts"))?;
    let (rows, target) = match (&args.event_id, args.all) {
        (Some(event_id), false) => {
            let row = lock_one_event(&*tx, event_id, args.endpoint.as_deref()).await?;
            if let Some(at) = &row.processed_at {
                anyhow::bail!(
                    "event {event_id} (endpoint {}) was processed at {at}; use `replay` to run it again",
                    row.endpoint
                );
            }
            if row.payload.is_none() {
                anyhow::bail!(
                    "event {event_id} (endpoint {}) cannot be requeued: PostgreSQL refused its body as jsonb, \
                     so it is kept byte for byte in raw_body and no handler could read it (see its \
                     last_error in `needs-review`); nothing changed",
                    row.endpoint
                );
            }
            let mut target = serde_json::json!({
                "provider": PROVIDER_STRIPE,
                "endpoint": row.endpoint,
                "event_id": event_id,
            });
            if let Some(held) = &row.held {
                // The person released a row the ingest held: the record says so.
                target["released_hold"] = serde_json::json!(held);
            }
            let rows = vec![RequeueRow {
                endpoint: row.endpoint,
                event_id: event_id.clone(),
                event_type: row.event_type,
                attempts: row.attempts,
            }];
            (rows, target)
        }
        (None, true) => {
            let pattern = args.error_contains.as_deref().map(like_literal);
            let rows = admin::lock_parked(&*tx, args.event_type.as_deref(), pattern.as_deref())
                .await
                .map_err(db_error("selecting the parked rows"))?;
            let held = admin::held_count(&*tx, args.event_type.as_deref(), pattern.as_deref())
                .await
                .map_err(db_error("counting the held rows"))?;
            let n = rows.len();
            let mut line = format!("{n} parked row{} match{}\n", plural(n), if n == 1 { "es" } else { "" });
            if held > 0 {
                line.push_str(&format!(
                    "{held} more held on arrival (unstorable body or livemode mismatch) left as they are: \
                     see `needs-review`, requeue one with --event-id after checking it\n"
                ));
            }
            if args.output.json {
                // stdout carries only the JSON document; the count still comes first, for people.
                eprint!("{line}");
            } else {
                emit(&line)?;
            }
            let target = serde_json::json!({
                "provider": PROVIDER_STRIPE,
                "all": true,
                "event_type": args.event_type,
                "error_contains": args.error_contains,
            });
            (rows, target)
        }
        _ => anyhow::bail!("pass either --event-id or --all"),
    };

    let (requeued, audit_id) = if args.dry_run {
        tx.rollback().await.map_err(db_error("ending the dry run"))?;
        (0, None)
    } else {
        let requeued = admin::requeue(&*tx, &rows).await.map_err(db_error("requeuing the rows"))?;
        let id = admin::insert_audit(&*tx, &args.actor.actor, "requeue", &target, requeued)
            .await
            .map_err(db_error("writing the audit record"))?;
        tx.commit().await.map_err(db_error("committing the requeue"))?;
        (requeued, Some(id))
    };

    if args.output.json {
        #[derive(Serialize)]
        struct Report<'a> {
            action: &'static str,
            dry_run: bool,
            matched: usize,
            requeued: u64,
            rows: &'a [RequeueRow],
        }
        return emit_json(&Report {
            action: "requeue",
            dry_run: args.dry_run,
            matched: rows.len(),
            requeued,
            rows: &rows,
        });
    }
    let mut text = String::new();
    if !rows.is_empty() {
        let mut table = Table::new(&[
            ("endpoint", false),
            ("event_id", false),
            ("event_type", false),
            ("attempts", true),
        ]);
        for r in &rows {
            table.push(vec![
                r.endpoint.clone(),
                r.event_id.clone(),
                r.event_type.clone(),
                r.attempts.to_string(),
            ]);
        }
        text.push_str(&table.render());
    }
    match audit_id {
        None => text.push_str(&format!(
            "dry run: would requeue {} row{}; nothing changed\n",
            rows.len(),
            plural(rows.len())
        )),
        Some(id) => text.push_str(&format!(
            "requeued {requeued} row{} (attempts 0, available now); audit record {id}\n",
            plural(requeued as usize)
        )),
    }
    emit(&text)
}

/// `text` as a LIKE/ILIKE pattern matching it literally (`\` is the default escape character).
fn like_literal(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    for c in text.chars() {
        if matches!(c, '\\' | '%' | '_') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn like_literal_escapes_wildcards_and_the_escape_character() {
        assert_eq!(like_literal("plain text"), "plain text");
        assert_eq!(like_literal("100%_done\\"), "100\\%\\_done\\\\");
    }
}
