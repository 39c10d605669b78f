//! `replay`: runs already processed events again with this binary's handler — the same registry
//! `run` uses. Handlers are idempotent (forward-only transitions, unique business keys), so a
//! replay repairs business rows that went missing and never books twice; it is also the way back
//! after a handler was added or fixed: events an earlier worker ignored, or applied wrongly, run
//! with the handler of now. An event type this binary has no handler for is refused (nothing to
//! apply, and most likely the wrong binary), and nothing changes.
//!
//! `--event-id`: one event, in one transaction with the row locked, its `processed_at` renewed and
//! the audit record; a handler error rolls everything back. With `--dry-run` the handler runs in a
//! transaction that is rolled back: what it changed per table is read before the rollback
//! (PostgreSQL's per-transaction counters, and the rows the transaction wrote), printed, and the
//! look audited in a transaction of its own (`replay-dry-run`, `affected` 0).
//!
//! `--event-type T [--since D] [--until D]`: every processed event of the type received in that
//! span, oldest first. The count is printed first; more than [`CONFIRM_ABOVE`] events at once are
//! refused without `--yes` (`--dry-run` lists them and never needs it). Then batches of
//! `--batch-size` events, each its own transaction under the operator limits: lock (`SKIP LOCKED`:
//! a row another session holds is left, and counted), run each handler in a savepoint of its own
//! (a failure stays with its event, which keeps its processed mark as it was), mark the others
//! processed, audit, commit. Audit: a record before the first batch (`affected` 0: the type, the
//! span, the count), then one per batch (`target.run`: the first record's id, and the ids that
//! failed). The run takes only events processed before it started: one a worker processes
//! meanwhile already ran with today's handler. SIGTERM/SIGINT stop it between batches. Exit 1
//! when an event failed (each named with its error) or the run was stopped.

use std::time::SystemTime;

use clap::Args as ClapArgs;
use inbox_domain::db::Pooler;
use inbox_domain::handler::Registry;
use inbox_domain::inbox::event::InboxEvent;
use inbox_domain::inbox::store::admin::{self, ReplayKey};
use inbox_domain::inbox::store::{queue, set_limits};
use inbox_domain::PROVIDER_STRIPE;
use serde::Serialize;

use super::output::{emit, emit_json, plural, AfterReport, OutputArgs};
use super::purge::StopSignal;
use super::{db_error, lock_one_event, refuse, Actor, ActorArgs, LIMITS};

/// `replay --event-type` refuses more events than this at once without `--yes`.
pub const CONFIRM_ABOVE: usize = 100;

/// Flags of `replay`.
#[derive(Debug, ClapArgs)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["event_id", "event_type"])))]
pub struct Args {
    /// The event to replay (`evt_…`).
    #[arg(long)]
    pub event_id: Option<String>,
    /// The endpoint of --event-id (needed when the id is stored for several endpoints).
    #[arg(long, requires = "event_id")]
    pub endpoint: Option<String>,
    /// Every processed event of this type (narrow with --since / --until): the way back after a
    /// handler was added or fixed.
    #[arg(long, conflicts_with = "event_id")]
    pub event_type: Option<String>,
    /// With --event-type: received at or after this time — RFC 3339 (2026-11-30T00:00:00Z) or an
    /// age (24h, 7d).
    #[arg(long, requires = "event_type", value_parser = parse_time)]
    pub since: Option<SystemTime>,
    /// With --event-type: received before this time (RFC 3339 or an age).
    #[arg(long, requires = "event_type", value_parser = parse_time)]
    pub until: Option<SystemTime>,
    /// Change nothing. With --event-id: run the handler in a transaction that is rolled back and
    /// print what it would insert, update and delete per table (and the rows it would write, the
    /// outbox's among them); the look is audited. With --event-type: count and list the events.
    #[arg(long)]
    pub dry_run: bool,
    /// With --event-type: confirm a replay of more than 100 events at once.
    #[arg(long, requires = "event_type")]
    pub yes: bool,
    /// With --event-type: events replayed per transaction.
    #[arg(long, requires = "event_type", default_value_t = 100,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub batch_size: u32,
    #[command(flatten)]
    pub actor: ActorArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// An RFC 3339 time (`2026-11-30T00:00:00Z`, or without the zone: UTC) or an age before now
/// (`24h`, `7d`).
fn parse_time(text: &str) -> Result<SystemTime, String> {
    let text = text.trim();
    if let Ok(at) = humantime::parse_rfc3339_weak(text) {
        return Ok(at);
    }
    let ago = humantime::parse_duration(text)
        .map_err(|_| "expected an RFC 3339 time (2026-11-30T00:00:00Z) or an age (24h, 7d)".to_owned())?;
    SystemTime::now().checked_sub(ago).ok_or_else(|| "that age reaches before 1970".to_owned())
}

/// `replay`.
pub async fn run(
    client: &mut deadpool_postgres::Object,
    registry: &Registry,
    pooler: Pooler,
    args: &Args,
) -> anyhow::Result<()> {
    match (&args.event_id, &args.event_type) {
        (Some(event_id), None) => present_one(client, registry, pooler, args, event_id).await,
        (None, Some(event_type)) => replay_type(client, registry, pooler, args, event_type).await,
        _ => anyhow::bail!("pass either --event-id or --event-type"),
    }
}

/// `replay --event-id`: [`replay_one`], presented.
async fn present_one(
    client: &mut deadpool_postgres::Object,
    registry: &Registry,
    pooler: Pooler,
    args: &Args,
    event_id: &str,
) -> anyhow::Result<()> {
    let report = replay_one(
        client,
        registry,
        pooler,
        event_id,
        args.endpoint.as_deref(),
        args.actor.actor(),
        args.dry_run,
    )
    .await?;
    if args.output.json {
        return emit_json(&report);
    }
    let OneReport { endpoint, event_type, audit_id, .. } = &report;
    let Some(changes) = &report.would_change else {
        return emit(&format!(
            "replayed event {event_id} (endpoint {endpoint}, {event_type}): handler applied; audit record {audit_id}\n"
        ));
    };
    let mut text = format!(
        "dry run of event {event_id} (endpoint {endpoint}, {event_type}): nothing changed (rolled back); audit record {audit_id}\n"
    );
    if changes.is_empty() {
        text.push_str("a replay would change no row (besides renewing the event's processed mark)\n");
    } else {
        text.push_str("a replay would (besides renewing the event's processed mark):\n");
        for c in changes {
            text.push_str(&format!(
                "  {:<24} {} inserted, {} updated, {} deleted\n",
                c.table, c.inserted, c.updated, c.deleted
            ));
            for row in &c.rows {
                text.push_str(&format!("    {row}\n"));
            }
        }
    }
    emit(&text)
}

/// `replay --event-id`: runs this binary's handler on one processed event, in one transaction with
/// the row locked, its processed mark renewed (and a dismissal cleared) and the audit record; a
/// handler error rolls everything back. Refused, changing nothing: an unprocessed event, a type
/// `registry` has no handler for, a row without a payload. `dry_run`: the handler runs in a
/// transaction that is rolled back, what it changed per table is read before the rollback, and the
/// look is audited (`replay-dry-run`, `affected` 0) in a transaction of its own.
pub async fn replay_one(
    client: &mut deadpool_postgres::Object,
    registry: &Registry,
    pooler: Pooler,
    event_id: &str,
    endpoint: Option<&str>,
    actor: Actor<'_>,
    dry_run: bool,
) -> anyhow::Result<OneReport> {
    let tx = client.transaction().await.map_err(db_error("starting a transaction"))?;
    set_limits(&tx, &LIMITS).await.map_err(db_error("setting the transaction's timeouts"))?;
    let row = lock_one_event(&*tx, event_id, endpoint).await?;
    if row.processed_at.is_none() {
        refuse!(
            "event {event_id} (endpoint {}) is not processed yet; requeue it instead \
             (`requeue --event-id {event_id}`) or let the workers take it",
            row.endpoint
        );
    }
    let Some(handler) = registry.get(&row.event_type) else {
        refuse!(
            "event {event_id} (endpoint {}) is a {} event, which this binary has no handler for \
             (it handles: {}): nothing to replay, nothing changed",
            row.endpoint,
            row.event_type,
            registry.event_types().join(", ")
        );
    };
    let Some(payload) = row.payload else {
        refuse!(
            "event {event_id} (endpoint {}) has no payload to replay: its body was kept as raw bytes \
             (unstorable as jsonb); nothing changed",
            row.endpoint
        );
    };
    let event = InboxEvent::new(
        PROVIDER_STRIPE.to_owned(),
        row.endpoint.clone(),
        event_id.to_owned(),
        row.event_type.clone(),
        payload,
    );
    let applied = handler.handle(&tx, &event).await;
    if dry_run {
        let changes = match applied {
            Ok(()) => admin::transaction_changes(&*tx, &["webhook_inbox"])
                .await
                .map_err(db_error("reading what the handler changed"))?,
            Err(e) => {
                let _ = tx.rollback().await;
                refuse!(
                    "dry run of event {event_id} (endpoint {}, {}): the handler fails, so a replay \
                     would change nothing: {e}",
                    event.endpoint,
                    event.event_type
                );
            }
        };
        if pooler == Pooler::Transaction {
            tx.statement_cache.clear();
        }
        tx.rollback().await.map_err(db_error("rolling the dry run back"))?;
        let audit_id = audit_dry_run(client, actor, &event, &changes).await?;
        return Ok(OneReport::of("replay-dry-run", &event, Some(changes), audit_id));
    }
    if pooler == Pooler::Transaction {
        // Close the statements the handler prepared before the transaction ends, on the server
        // connection that has them (as the worker's executor does).
        tx.statement_cache.clear();
    }
    if let Err(e) = applied {
        let _ = tx.rollback().await;
        refuse!(
            "replay of event {event_id} (endpoint {}, {}) failed, nothing changed: {e}",
            event.endpoint,
            event.event_type
        );
    }
    queue::mark_processed(&tx, &[row.ctid.as_str()])
        .await
        .map_err(db_error("marking the event processed"))?;
    // A row a person dismissed is applied after all: it is no longer "closed unapplied".
    admin::undismiss(&*tx, &event.endpoint, event_id).await.map_err(db_error("clearing the dismissal"))?;
    let target = event_target(&event);
    let audit_id =
        actor.audit(&*tx, "replay", &target, 1).await.map_err(db_error("writing the audit record"))?;
    tx.commit().await.map_err(db_error("committing the replay"))?;
    Ok(OneReport::of("replay", &event, None, audit_id))
}

/// The audit target of a replay of one event.
fn event_target(event: &InboxEvent) -> serde_json::Value {
    serde_json::json!({
        "provider": PROVIDER_STRIPE,
        "endpoint": event.endpoint,
        "event_id": event.event_id,
        "event_type": event.event_type,
    })
}

/// What [`replay_one`] did; what `replay --event-id --json` prints (with `--dry-run`: nothing
/// changed, and what would).
#[derive(Debug, Clone, Serialize)]
pub struct OneReport {
    /// `replay`, or `replay-dry-run`.
    pub action: &'static str,
    pub endpoint: String,
    pub event_id: String,
    pub event_type: String,
    /// `Some(false)` for a dry run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub changed: Option<bool>,
    /// A dry run: what the replay would insert, update and delete, per table.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub would_change: Option<Vec<admin::TableChange>>,
    pub audit_id: i64,
}

impl OneReport {
    fn of(
        action: &'static str,
        event: &InboxEvent,
        would_change: Option<Vec<admin::TableChange>>,
        audit_id: i64,
    ) -> Self {
        OneReport {
            action,
            endpoint: event.endpoint.clone(),
            event_id: event.event_id.clone(),
            event_type: event.event_type.clone(),
            changed: would_change.as_ref().map(|_| false),
            would_change,
            audit_id,
        }
    }
}

/// Audits a `replay --event-id --dry-run`: what it would change, `affected` 0.
async fn audit_dry_run(
    client: &deadpool_postgres::Object,
    actor: Actor<'_>,
    event: &InboxEvent,
    changes: &[admin::TableChange],
) -> anyhow::Result<i64> {
    let counts: serde_json::Map<String, serde_json::Value> = changes
        .iter()
        .map(|c| {
            let counts =
                serde_json::json!({"inserted": c.inserted, "updated": c.updated, "deleted": c.deleted});
            (c.table.clone(), counts)
        })
        .collect();
    let mut target = event_target(event);
    target["would_change"] = counts.into();
    actor.audit(&***client, "replay-dry-run", &target, 0).await.map_err(db_error("writing the audit record"))
}

/// What `replay --event-type --json` prints.
#[derive(Serialize)]
struct TypeReport<'a> {
    action: &'static str,
    event_type: &'a str,
    dry_run: bool,
    /// Events matched when the run started.
    matched: usize,
    replayed: u64,
    /// Events whose handler failed: left as they were.
    failed: Vec<Failed>,
    /// Events another session held, or processed since the count: left.
    skipped: u64,
    batches: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    audit_id: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    interrupted_by: Option<&'static str>,
    /// `--dry-run`: the events, oldest first.
    #[serde(skip_serializing_if = "Option::is_none")]
    events: Option<&'a [ReplayKey]>,
}

/// An event whose handler failed in a bulk replay.
#[derive(Debug, Clone, Serialize)]
struct Failed {
    endpoint: String,
    event_id: String,
    error: String,
}

/// `replay --event-type`: count, confirm, then batches.
async fn replay_type(
    client: &mut deadpool_postgres::Object,
    registry: &Registry,
    pooler: Pooler,
    args: &Args,
    event_type: &str,
) -> anyhow::Result<()> {
    let Some(handler) = registry.get(event_type) else {
        anyhow::bail!(
            "this binary has no handler for {event_type} (it handles: {}): nothing to replay, nothing changed",
            registry.event_types().join(", ")
        );
    };
    if let (Some(since), Some(until)) = (args.since, args.until) {
        anyhow::ensure!(since < until, "--since must be before --until");
    }
    let (keys, as_of) = admin::replay_keys(&***client, event_type, args.since, args.until)
        .await
        .map_err(db_error("finding the events to replay"))?;
    let mut report = TypeReport {
        action: "replay",
        event_type,
        dry_run: args.dry_run,
        matched: keys.len(),
        replayed: 0,
        failed: Vec::new(),
        skipped: 0,
        batches: 0,
        audit_id: None,
        interrupted_by: None,
        events: None,
    };
    if args.dry_run || keys.is_empty() {
        report.events = Some(&keys);
        return print_type_report(&report, args.output.json);
    }
    if keys.len() > CONFIRM_ABOVE && !args.yes {
        anyhow::bail!(
            "{} processed {event_type} events match: more than {CONFIRM_ABOVE} at once needs --yes (see them \
             with --dry-run); nothing changed",
            keys.len()
        );
    }
    let as_of = as_of.expect("keys were read");
    let stop = StopSignal::install();
    let span = |t: Option<SystemTime>| t.map(|t| humantime::format_rfc3339_millis(t).to_string());
    let target = serde_json::json!({
        "provider": PROVIDER_STRIPE,
        "event_type": event_type,
        "since": span(args.since),
        "until": span(args.until),
        "matched": keys.len(),
        "batch_size": args.batch_size,
    });
    let run = admin::insert_audit(&***client, args.actor.name(), "replay", &target, 0)
        .await
        .map_err(db_error("writing the audit record"))?;
    report.audit_id = Some(run);
    for batch in keys.chunks(args.batch_size as usize) {
        if let Some(signal) = stop.received() {
            report.interrupted_by = Some(signal);
            break;
        }
        report.batches += 1;
        let mut tx = client.transaction().await.map_err(db_error("starting a transaction"))?;
        set_limits(&tx, &LIMITS).await.map_err(db_error("setting the transaction's timeouts"))?;
        let rows = admin::lock_replay_batch(&*tx, batch, as_of).await.map_err(db_error("locking a batch"))?;
        report.skipped += (batch.len() - rows.len()) as u64;
        let mut done: Vec<&str> = Vec::with_capacity(rows.len());
        let mut failed_here = Vec::new();
        for row in &rows {
            let event = InboxEvent::new(
                PROVIDER_STRIPE.to_owned(),
                row.endpoint.clone(),
                row.event_id.clone(),
                row.event_type.clone(),
                row.payload.clone(),
            );
            let savepoint = tx.savepoint("event").await.map_err(db_error("starting a savepoint"))?;
            let applied = handler.handle(&savepoint, &event).await;
            if pooler == Pooler::Transaction {
                savepoint.statement_cache.clear();
            }
            match applied {
                Ok(()) => {
                    savepoint.commit().await.map_err(db_error("releasing a savepoint"))?;
                    done.push(&row.ctid);
                }
                Err(e) => {
                    savepoint.rollback().await.map_err(db_error("rolling back a savepoint"))?;
                    failed_here.push(Failed {
                        endpoint: row.endpoint.clone(),
                        event_id: row.event_id.clone(),
                        error: e.to_string(),
                    });
                }
            }
        }
        if !done.is_empty() {
            queue::mark_processed(&tx, &done).await.map_err(db_error("marking the events processed"))?;
        }
        let target = serde_json::json!({
            "provider": PROVIDER_STRIPE,
            "event_type": event_type,
            "run": run,
            "batch": report.batches,
            "failed": failed_here.iter().map(|f| &f.event_id).collect::<Vec<_>>(),
        });
        admin::insert_audit(&*tx, args.actor.name(), "replay", &target, done.len() as u64)
            .await
            .map_err(db_error("writing the batch's audit record"))?;
        tx.commit().await.map_err(db_error("committing a batch"))?;
        report.replayed += done.len() as u64;
        report.failed.extend(failed_here);
    }
    print_type_report(&report, args.output.json)?;
    if let Some(signal) = report.interrupted_by {
        return Err(AfterReport(format!(
            "stopped by {signal} after {} batch{}: {} replayed, the rest not",
            report.batches,
            if report.batches == 1 { "" } else { "es" },
            report.replayed
        ))
        .into());
    }
    if let Some(first) = report.failed.first() {
        return Err(AfterReport(format!(
            "{} event{} failed and kept their processed mark as it was (the first: {} of endpoint {}: {})",
            report.failed.len(),
            plural(report.failed.len()),
            first.event_id,
            first.endpoint,
            first.error
        ))
        .into());
    }
    Ok(())
}

fn print_type_report(report: &TypeReport<'_>, json: bool) -> anyhow::Result<()> {
    if json {
        return emit_json(report);
    }
    let mut text = if report.dry_run {
        format!(
            "{} processed {} event{} would be replayed (dry run, nothing changed)\n",
            report.matched,
            report.event_type,
            plural(report.matched)
        )
    } else {
        format!(
            "{} processed {} event{} matched: {} replayed in {} batch{}, {} failed, {} skipped (held by another \
             session or processed since){}\n",
            report.matched,
            report.event_type,
            plural(report.matched),
            report.replayed,
            report.batches,
            if report.batches == 1 { "" } else { "es" },
            report.failed.len(),
            report.skipped,
            report.audit_id.map(|id| format!("; audit run {id}")).unwrap_or_default()
        )
    };
    for key in report.events.unwrap_or_default().iter().take(20) {
        text.push_str(&format!("  {} {}\n", key.endpoint, key.event_id));
    }
    if report.events.is_some_and(|e| e.len() > 20) {
        text.push_str(&format!("  … and {} more\n", report.matched - 20));
    }
    for f in &report.failed {
        text.push_str(&format!("  failed: {} {}: {}\n", f.endpoint, f.event_id, f.error));
    }
    emit(&text)
}
