//! `requeue`: parked rows (or one unprocessed row) back in the queue — attempts 0, available now —
//! each change with its audit record in the same transaction.
//!
//! `--event-id`: the row of that id (and `--endpoint`) when it is unprocessed — parked, or
//! waiting for a retry; a processed row is refused (that is `replay`). One transaction, one audit
//! record.
//!
//! `--all`: the parked rows, narrowed by `--event-type` and `--error-contains`, oldest first, at
//! most `--limit`. The count is printed first; more than [`CONFIRM_ABOVE`] rows at once are
//! refused without `--yes` (a dry run never needs it). Then batches of `--batch-size` rows, each
//! its own transaction under the operator limits: lock (`FOR UPDATE SKIP LOCKED`: never waits for
//! a row another session holds, and leaves it), requeue, audit, commit — so no transaction holds
//! more than one batch of row locks, however many rows are parked. The run takes only what the
//! count counted (rows parked by then, at most that many): a row parked meanwhile waits for the
//! next requeue. Audit: a record before the first batch (`affected` 0: the filters, the count,
//! the limit — written also when nothing matched: the attempt is worth seeing), then one per
//! batch in its transaction (`target.run`: the first record's id). SIGTERM/SIGINT stop it between
//! batches (exit 1, saying how many were requeued). `--dry-run` only lists.
//!
//! Rows the ingest held on arrival are a person's decision, one at a time: `--all` leaves them
//! (and says how many it left); `--event-id` takes a row held for its `livemode` (the person
//! decided the event belongs to this endpoint after all) and refuses one held as unstorable,
//! which has no payload a handler could read.

use clap::Args as ClapArgs;
use inbox_domain::inbox::store::admin::{self, ParkedCount, ParkedFilter, RequeueRow};
use inbox_domain::inbox::store::set_limits;
use inbox_domain::PROVIDER_STRIPE;
use serde::Serialize;

use super::output::{emit, emit_json, plural, AfterReport, OutputArgs, Table};
use super::purge::StopSignal;
use super::{db_error, lock_one_event, refuse, Actor, ActorArgs, LIMITS};

/// `requeue --all` refuses to requeue more rows than this at once without `--yes`.
pub const CONFIRM_ABOVE: i64 = 100;

/// Flags of `requeue`.
#[derive(Debug, ClapArgs)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["event_id", "all", "id"])))]
pub struct Args {
    /// The event to requeue.
    #[arg(long)]
    pub event_id: Option<String>,
    /// Parked outbox rows instead (deliveries the relays gave up on): `--id` one, or `--all`.
    /// The rows of an aggregate held behind a requeued row follow it, in order.
    #[arg(long, conflicts_with_all = ["event_id", "endpoint"])]
    pub outbox: bool,
    /// With --outbox: the outbox row to requeue.
    #[arg(long, requires = "outbox", conflicts_with = "all")]
    pub id: Option<i64>,
    /// The endpoint of --event-id (needed when the id is stored for several endpoints).
    #[arg(long, requires = "event_id")]
    pub endpoint: Option<String>,
    /// Every parked row (narrow with --event-type / --error-contains / --limit).
    #[arg(long, conflicts_with = "event_id")]
    pub all: bool,
    /// With --all: only rows of this event type.
    #[arg(long, requires = "all")]
    pub event_type: Option<String>,
    /// With --all: only rows whose last_error contains this text.
    #[arg(long, requires = "all")]
    pub error_contains: Option<String>,
    /// With --all: at most this many rows, the oldest first.
    #[arg(long, requires = "all", value_parser = clap::value_parser!(i64).range(1..))]
    pub limit: Option<i64>,
    /// With --all: confirm a requeue of more than 100 rows at once.
    #[arg(long, requires = "all")]
    pub yes: bool,
    /// With --all: rows requeued per transaction.
    #[arg(long, requires = "all", default_value_t = 1000,
          value_parser = clap::value_parser!(i64).range(1..=100_000))]
    pub batch_size: i64,
    /// Show what would be requeued, change nothing.
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub actor: ActorArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// What `requeue --json` prints.
#[derive(Serialize)]
struct Report<'a> {
    action: &'static str,
    dry_run: bool,
    /// The rows that matched (`--all`: the count, before `--limit`).
    matched: i64,
    requeued: u64,
    /// `--all`: the transactions that requeued rows.
    #[serde(skip_serializing_if = "Option::is_none")]
    batches: Option<u64>,
    /// `--all`: the run's first audit record.
    #[serde(skip_serializing_if = "Option::is_none")]
    audit_id: Option<i64>,
    /// The signal that stopped `--all` before it finished.
    #[serde(skip_serializing_if = "Option::is_none")]
    interrupted_by: Option<&'static str>,
    rows: &'a [RequeueRow],
}

/// `requeue`.
pub async fn run(client: &mut deadpool_postgres::Object, args: &Args) -> anyhow::Result<()> {
    if args.outbox {
        let pattern = args.error_contains.as_deref().map(like_literal);
        let what = super::outbox::Requeue {
            id: args.id,
            event_type: args.event_type.as_deref(),
            error_like: pattern.as_deref(),
            limit: args.limit,
            yes: args.yes,
            batch_size: args.batch_size,
            dry_run: args.dry_run,
            actor: args.actor.name(),
            json: args.output.json,
        };
        return super::outbox::requeue(client, &what).await;
    }
    match (&args.event_id, args.all) {
        (Some(event_id), false) => present_one(client, args, event_id).await,
        (None, true) => requeue_all(client, args).await,
        _ => anyhow::bail!("pass either --event-id or --all"),
    }
}

/// What [`requeue_one`] did (or, in a dry run, would do).
#[derive(Debug, Clone)]
pub struct Requeued {
    /// The row, `attempts` as it was before.
    pub row: RequeueRow,
    /// Why the ingest had held it, when it had: the person released it.
    pub released_hold: Option<String>,
    /// Rows changed: 1, or 0 in a dry run.
    pub requeued: u64,
    /// The audit record; None in a dry run.
    pub audit_id: Option<i64>,
}

/// Which rows [`requeue_one`] takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// Any unprocessed row with a payload: parked, held for its livemode, or waiting for a retry
    /// (`requeue --event-id`, the console's Requeue).
    Unprocessed,
    /// Only a row the ingest held for its livemode (the console's Release).
    HeldForLivemode,
}

/// `requeue --event-id`: the row of `event_id` (and `endpoint`) back in the queue — attempts 0,
/// available now, not parked nor held — with its audit record, in one transaction; refused for a
/// processed row, a row without a payload, and (with [`Take::HeldForLivemode`]) a row not held for
/// its livemode. `dry_run`: the same checks, nothing changed, no audit.
pub async fn requeue_one(
    client: &mut deadpool_postgres::Object,
    event_id: &str,
    endpoint: Option<&str>,
    take: Take,
    actor: Actor<'_>,
    dry_run: bool,
) -> anyhow::Result<Requeued> {
    let tx = client.transaction().await.map_err(db_error("starting a transaction"))?;
    set_limits(&tx, &LIMITS).await.map_err(db_error("setting the transaction's timeouts"))?;
    let row = lock_one_event(&*tx, event_id, endpoint).await?;
    if let Some(at) = &row.processed_at {
        refuse!(
            "event {event_id} (endpoint {}) was processed at {at}; use `replay` to run it again",
            row.endpoint
        );
    }
    if row.payload.is_none() {
        refuse!(
            "event {event_id} (endpoint {}) cannot be requeued: PostgreSQL refused its body as jsonb, \
             so it is kept byte for byte in raw_body and no handler could read it (see its \
             last_error in `needs-review`); nothing changed",
            row.endpoint
        );
    }
    if take == Take::HeldForLivemode && row.held.as_deref() != Some("livemode") {
        refuse!(
            "event {event_id} (endpoint {}) is not held for its livemode: nothing to release \
             (requeue takes a parked row); nothing changed",
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
    let released_hold = row.held;
    let rows = [RequeueRow {
        endpoint: row.endpoint,
        event_id: event_id.to_owned(),
        event_type: row.event_type,
        attempts: row.attempts,
    }];
    let (requeued, audit_id) = if dry_run {
        tx.rollback().await.map_err(db_error("ending the dry run"))?;
        (0, None)
    } else {
        let requeued = admin::requeue(&*tx, &rows).await.map_err(db_error("requeuing the rows"))?;
        let id = actor
            .audit(&*tx, "requeue", &target, requeued)
            .await
            .map_err(db_error("writing the audit record"))?;
        tx.commit().await.map_err(db_error("committing the requeue"))?;
        (requeued, Some(id))
    };
    let [row] = rows;
    Ok(Requeued { row, released_hold, requeued, audit_id })
}

/// `requeue --event-id`: [`requeue_one`], presented.
async fn present_one(
    client: &mut deadpool_postgres::Object,
    args: &Args,
    event_id: &str,
) -> anyhow::Result<()> {
    let done = requeue_one(
        client,
        event_id,
        args.endpoint.as_deref(),
        Take::Unprocessed,
        args.actor.actor(),
        args.dry_run,
    )
    .await?;
    let rows = [done.row];
    let report = Report {
        action: "requeue",
        dry_run: args.dry_run,
        matched: 1,
        requeued: done.requeued,
        batches: None,
        audit_id: None,
        interrupted_by: None,
        rows: &rows,
    };
    if args.output.json {
        return emit_json(&report);
    }
    let mut text = table(&rows);
    match done.audit_id {
        None => text.push_str("dry run: would requeue 1 row; nothing changed\n"),
        Some(id) => text.push_str(&format!(
            "requeued {} row{} (attempts 0, available now); audit record {id}\n",
            report.requeued,
            plural(report.requeued as usize)
        )),
    }
    emit(&text)
}

/// The rows a filtered requeue takes: how many the count found, and how many it takes.
#[derive(Debug, Clone, Copy)]
pub struct Matching {
    /// The count ([`count_matching`]): the batches take only rows parked by its `as_of`.
    pub count: ParkedCount,
    /// At most this many rows, the oldest first.
    pub takes: i64,
    /// Rows per transaction.
    pub batch_size: i64,
}

/// What [`requeue_matching`] did.
#[derive(Debug, Clone)]
pub struct RequeuedMatching {
    /// The rows requeued, oldest first (`attempts` as they were before).
    pub rows: Vec<RequeueRow>,
    pub requeued: u64,
    /// The transactions that requeued rows.
    pub batches: u64,
    /// The run's first audit record.
    pub audit_id: i64,
    /// The signal that stopped the run before it finished.
    pub interrupted_by: Option<&'static str>,
}

/// The parked rows `filter` matches (those a requeue takes, and those held on arrival it leaves),
/// as `requeue --all` counts them before it asks for a confirmation.
pub async fn count_matching(
    client: &(impl tokio_postgres::GenericClient + Sync),
    filter: &ParkedFilter<'_>,
) -> anyhow::Result<ParkedCount> {
    admin::count_parked(client, filter).await.map_err(db_error("counting the parked rows"))
}

/// `requeue --all` after its count and confirmation: the run's first audit record (`target`: what
/// it is about to do), then batches of `batch_size` rows, each its own transaction under the
/// operator limits — lock (`SKIP LOCKED`), requeue, audit, commit — until `takes` rows (parked by
/// the count's `as_of`, matching `filter`) are requeued, none is left, or `stop` says a signal came.
pub async fn requeue_matching(
    client: &mut deadpool_postgres::Object,
    filter: &ParkedFilter<'_>,
    matching: &Matching,
    target: &serde_json::Value,
    actor: Actor<'_>,
    stop: Option<&StopSignal>,
) -> anyhow::Result<RequeuedMatching> {
    let run_id =
        actor.audit(&***client, "requeue", target, 0).await.map_err(db_error("writing the audit record"))?;
    let takes = matching.takes;
    let mut rows: Vec<RequeueRow> = Vec::new();
    let mut requeued = 0u64;
    let mut batches = 0u64;
    let mut after = None;
    let mut interrupted_by = None;
    while (rows.len() as i64) < takes {
        if let Some(signal) = stop.and_then(StopSignal::received) {
            interrupted_by = Some(signal);
            break;
        }
        let want = (takes - rows.len() as i64).min(matching.batch_size);
        let batch = async {
            let tx = client.transaction().await?;
            set_limits(&tx, &LIMITS).await?;
            let (batch, next) =
                admin::lock_parked(&*tx, filter, matching.count.as_of, after.as_ref(), want, true).await?;
            if batch.is_empty() {
                return Ok((batch, next, 0));
            }
            let changed = admin::requeue(&*tx, &batch).await?;
            let target =
                serde_json::json!({"provider": PROVIDER_STRIPE, "run": run_id, "batch": batches + 1});
            actor.audit(&*tx, "requeue", &target, changed).await?;
            tx.commit().await?;
            Ok::<_, tokio_postgres::Error>((batch, next, changed))
        }
        .await;
        match batch {
            Ok((batch, _, _)) if batch.is_empty() => break,
            Ok((batch, next, changed)) => {
                batches += 1;
                requeued += changed;
                rows.extend(batch);
                after = next;
            }
            Err(e) => anyhow::bail!(
                "requeue stopped after requeuing {requeued} row{} in {batches} batch{} (audit record \
                 {run_id}): {}",
                plural(requeued as usize),
                if batches == 1 { "" } else { "es" },
                inbox_domain::db::describe_db_error(&e)
            ),
        }
    }
    Ok(RequeuedMatching { rows, requeued, batches, audit_id: run_id, interrupted_by })
}

/// `requeue --all`: the count, the confirmation, then the batches ([`requeue_matching`]).
async fn requeue_all(client: &mut deadpool_postgres::Object, args: &Args) -> anyhow::Result<()> {
    let pattern = args.error_contains.as_deref().map(like_literal);
    let filter = ParkedFilter {
        event_type: args.event_type.as_deref(),
        error_pattern: pattern.as_deref(),
        ..ParkedFilter::default()
    };
    let count = count_matching(&***client, &filter).await?;
    let n = count.takes;
    let takes = n.min(args.limit.unwrap_or(i64::MAX));
    let mut line = format!("{n} parked row{} match{}", plural(n as usize), if n == 1 { "es" } else { "" });
    if takes < n {
        line.push_str(&format!(" (--limit: the oldest {takes})"));
    }
    line.push('\n');
    if count.held > 0 {
        line.push_str(&format!(
            "{} more held on arrival (unstorable body or livemode mismatch) left as they are: \
             see `needs-review`, requeue one with --event-id after checking it\n",
            count.held
        ));
    }
    if args.output.json {
        // stdout carries only the JSON document; the count still comes first, for people.
        eprint!("{line}");
    } else {
        emit(&line)?;
    }

    if args.dry_run {
        let rows = if takes > 0 {
            admin::lock_parked(&***client, &filter, count.as_of, None, takes, false)
                .await
                .map_err(db_error("listing the parked rows"))?
                .0
        } else {
            Vec::new()
        };
        let report = Report {
            action: "requeue",
            dry_run: true,
            matched: n,
            requeued: 0,
            batches: None,
            audit_id: None,
            interrupted_by: None,
            rows: &rows,
        };
        if args.output.json {
            return emit_json(&report);
        }
        let mut text = table(&rows);
        text.push_str(&format!(
            "dry run: would requeue {} row{}; nothing changed\n",
            rows.len(),
            plural(rows.len())
        ));
        return emit(&text);
    }
    if takes > CONFIRM_ABOVE && !args.yes {
        anyhow::bail!(
            "{takes} rows would be requeued, more than {CONFIRM_ABOVE} at once: pass --yes to requeue \
             them (--dry-run lists them; --limit N takes the oldest N); nothing changed"
        );
    }

    // From here a signal stops the run between batches. The run's first record comes before the
    // first batch.
    let stop = StopSignal::install();
    let target = serde_json::json!({
        "provider": PROVIDER_STRIPE,
        "all": true,
        "event_type": args.event_type,
        "error_contains": args.error_contains,
        "matched": n,
        "limit": args.limit,
        "batch_size": args.batch_size,
    });
    let matching = Matching { count, takes, batch_size: args.batch_size };
    let done = requeue_matching(client, &filter, &matching, &target, args.actor.actor(), Some(&stop)).await?;
    let RequeuedMatching { rows, requeued, batches, audit_id: run_id, interrupted_by } = done;

    let report = Report {
        action: "requeue",
        dry_run: false,
        matched: n,
        requeued,
        batches: Some(batches),
        audit_id: Some(run_id),
        interrupted_by,
        rows: &rows,
    };
    if args.output.json {
        emit_json(&report)?;
    } else {
        let mut text = table(&rows);
        text.push_str(&format!(
            "requeued {requeued} row{} (attempts 0, available now) in {batches} batch{}; audit record {run_id}\n",
            plural(requeued as usize),
            if batches == 1 { "" } else { "es" }
        ));
        let left = takes - requeued as i64;
        if left > 0 && interrupted_by.is_none() {
            text.push_str(&format!(
                "{left} of the {takes} counted {} not requeued: no longer parked, or locked by another \
                 session (see `needs-review`)\n",
                if left == 1 { "was" } else { "were" },
            ));
        }
        emit(&text)?;
    }
    if let Some(signal) = interrupted_by {
        return Err(AfterReport(format!(
            "requeue interrupted by {signal} after requeuing {requeued} of {takes} row{} in {batches} \
             batch{} (audit record {run_id}); the others are still parked",
            plural(takes as usize),
            if batches == 1 { "" } else { "es" }
        ))
        .into());
    }
    Ok(())
}

/// The rows as a table (empty when there are none).
fn table(rows: &[RequeueRow]) -> String {
    if rows.is_empty() {
        return String::new();
    }
    let mut table =
        Table::new(&[("endpoint", false), ("event_id", false), ("event_type", false), ("attempts", true)]);
    for r in rows {
        table.push(vec![
            r.endpoint.clone(),
            r.event_id.clone(),
            r.event_type.clone(),
            r.attempts.to_string(),
        ]);
    }
    table.render()
}

/// `text` as a LIKE/ILIKE pattern matching it literally (`\` is the default escape character).
pub fn like_literal(text: &str) -> String {
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
