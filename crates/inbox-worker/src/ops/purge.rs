//! `purge`: deletes processed rows older than an age, in batches, each its own short transaction
//! under the operator limits ([`super::LIMITS`]: statement and lock timeouts); then the outbox rows
//! published before the same cutoff (undelivered ones are never touched), the same way.
//!
//! Ages: under Stripe's 3-day retry window only with `--force`; under twice the ingest's
//! signature tolerance (`--tolerance`, 5 minutes by default) never, `--force` or not.
//!
//! Audit (insert-only, see `admin::INSERT_AUDIT_SQL`): a record is written before the first
//! delete (`affected` 0: the cutoff, the batch size, `--force`), so even a purge that dies in its
//! first batch is on record; each batch writes one in its own transaction (`affected`: the rows it
//! deleted, `target.run`: the first record's id), so the records always add up to what was
//! deleted; the purge ends with a record of how it ended (`affected` 0, `target.outcome`:
//! `completed`, `interrupted` or `failed`, and the totals).
//!
//! SIGTERM/SIGINT: the batch in flight finishes (it is short), no other starts, the end record is
//! written, what was deleted is printed, and the command exits 1 (it did not finish: run it again).
//! A second signal exits at once; the batch in flight then rolls back with its audit record.
//!
//! The batches walk the heap once, in ranges of pages, instead of scanning it from the start for
//! each batch (`admin::PURGE_BATCH_SQL` says why): [`Walk`].

use std::time::{Duration, Instant};

use clap::Args as ClapArgs;
use inbox_domain::config::parse_duration;
use inbox_domain::db::describe_db_error;
use inbox_domain::inbox::store::admin::{self, HeapPosition, PurgeBatch};
use inbox_domain::inbox::store::set_limits;
use inbox_domain::PROVIDER_STRIPE;
use serde::Serialize;
use tokio::sync::watch;

use super::output::{emit, emit_json, plural, AfterReport, OutputArgs};
use super::{db_error, ActorArgs, LIMITS};

/// Flags of `purge`.
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// Delete processed rows older than this (processed_at), e.g. 30d.
    #[arg(long, value_parser = parse_duration)]
    pub older_than: Duration,
    /// Count what would be deleted, delete nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Allow an age under Stripe's 3-day retry window (a redelivery could then be applied again);
    /// never under twice the ingest's signature tolerance (10m by default).
    #[arg(long)]
    pub force: bool,
    /// The ingest's signature tolerance (its --tolerance): a request it still accepts must find
    /// its row, so rows are never purged younger than twice this (a signature may be that far in
    /// the past, and that far in the future). Read from the same variable as the ingest's.
    #[arg(long, env = "INBOX_SIGNATURE_TOLERANCE", default_value = "5m", value_parser = parse_duration)]
    pub tolerance: Duration,
    /// Rows deleted per transaction.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..=100_000))]
    pub batch_size: i64,
    /// Percent of the time spent deleting: after each batch the purge rests in proportion to the
    /// time the batch took (at 50, as long again), so that a purge beside live traffic leaves
    /// PostgreSQL's CPU and WAL to the ingest and the workers; 100 never rests.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u8).range(1..=100))]
    pub duty_cycle: u8,
    #[command(flatten)]
    pub actor: ActorArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// Stripe retries a delivery for up to 3 days: a row purged sooner would not stop a redelivery
/// of its event from being applied again.
pub const STRIPE_RETRY_WINDOW: Duration = Duration::from_secs(3 * 24 * 3600);

/// The youngest rows `purge` may delete, `--force` or not: twice the ingest's signature
/// tolerance. The ingest accepts a signature whose `t` is up to `tolerance` in the past or in the
/// future, so the very same request — replayed by whoever captured it — is accepted until `t +
/// tolerance`, at most `2 × tolerance` after the row was received (and processed_at is later
/// still): were its row gone, it would be stored and applied again. Clocks are assumed in sync.
pub fn purge_floor(tolerance: Duration) -> Duration {
    tolerance * 2
}

/// What `purge --json` prints.
#[derive(Serialize)]
struct Report<'a> {
    action: &'static str,
    dry_run: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    matched: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    deleted: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    batches: Option<u64>,
    /// Published outbox rows (`matched` and `deleted` count the inbox's).
    #[serde(skip_serializing_if = "Option::is_none")]
    outbox_matched: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    outbox_deleted: Option<u64>,
    cutoff: &'a str,
    older_than_seconds: u64,
    /// The first audit record of the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    audit_id: Option<i64>,
    /// The signal that stopped the purge before it finished.
    #[serde(skip_serializing_if = "Option::is_none")]
    interrupted_by: Option<&'static str>,
}

/// How a purge ended.
enum Outcome {
    Completed,
    Interrupted(&'static str),
    Failed(tokio_postgres::Error),
}

/// `purge`.
pub async fn run(client: &mut deadpool_postgres::Object, args: &Args) -> anyhow::Result<()> {
    let older_than = humantime::format_duration(args.older_than).to_string();
    let floor = purge_floor(args.tolerance);
    if args.older_than < floor {
        anyhow::bail!(
            "--older-than {older_than} is under twice the ingest's signature tolerance ({} × 2 = {}; \
             --tolerance / INBOX_SIGNATURE_TOLERANCE), which --force does not override: a request \
             signed that recently is still accepted by the ingest, so the same request replayed \
             after the purge would be stored and applied again",
            humantime::format_duration(args.tolerance),
            humantime::format_duration(floor)
        );
    }
    if args.older_than < STRIPE_RETRY_WINDOW && !args.force {
        anyhow::bail!(
            "--older-than {older_than} is under Stripe's 3-day retry window: a redelivery after the \
             purge would be applied again; pass --force to do it anyway"
        );
    }
    let start = admin::purge_start(&***client, args.older_than.as_secs_f64())
        .await
        .map_err(db_error("computing the purge cutoff"))?;
    let cutoff_text = start.cutoff_text.as_str();

    if args.dry_run {
        let matched = admin::purge_count(&***client, start.cutoff)
            .await
            .map_err(db_error("counting the rows to purge"))?;
        let outbox_matched = inbox_domain::inbox::store::outbox::count_purgeable(&***client, start.cutoff)
            .await
            .map_err(db_error("counting the outbox rows to purge"))?;
        if args.output.json {
            return emit_json(&Report {
                action: "purge",
                dry_run: true,
                matched: Some(matched),
                deleted: None,
                batches: None,
                outbox_matched: Some(outbox_matched),
                outbox_deleted: None,
                cutoff: cutoff_text,
                older_than_seconds: args.older_than.as_secs(),
                audit_id: None,
                interrupted_by: None,
            });
        }
        return emit(&format!(
            "dry run: {matched} processed row{} older than {older_than} (processed before {cutoff_text}) \
             and {outbox_matched} outbox row{} published before it would be deleted; nothing changed\n",
            plural(matched as usize),
            plural(outbox_matched as usize)
        ));
    }

    // From here a signal stops the purge between batches. Then the run's first record, before
    // the first delete.
    let stop = StopSignal::install();
    let target = serde_json::json!({
        "provider": PROVIDER_STRIPE,
        "older_than_seconds": args.older_than.as_secs(),
        "cutoff": cutoff_text,
        "batch_size": args.batch_size,
        "duty_cycle": args.duty_cycle,
        "force": args.force,
    });
    let run_id = admin::insert_audit(&***client, args.actor.name(), "purge", &target, 0)
        .await
        .map_err(db_error("writing the audit record"))?;

    let mut walk = Walk::new(start.pages, args.batch_size);
    let mut deleted = 0u64;
    let mut batches = 0u64;
    let outcome = loop {
        if let Some(signal) = stop.received() {
            break Outcome::Interrupted(signal);
        }
        let Some((from, to_page)) = walk.next_range() else { break Outcome::Completed };
        let began = Instant::now();
        match purge_one_batch(client, args, run_id, batches + 1, start.cutoff, from, to_page).await {
            Ok(batch) => {
                tracing::debug!(
                    from = %format!("({},{})", from.page, from.item),
                    to_page,
                    deleted = batch.deleted,
                    millis = began.elapsed().as_secs_f64() * 1000.0,
                    "purge batch"
                );
                if batch.deleted > 0 {
                    deleted += batch.deleted;
                    batches += 1;
                    rest(args.duty_cycle, began.elapsed()).await;
                }
                walk.advance(from, to_page, batch);
            }
            Err(e) => break Outcome::Failed(e),
        }
    };
    // Then the published outbox rows, in id order from the start: one pass over the primary key.
    let mut outbox_deleted = 0u64;
    let outcome = match outcome {
        Outcome::Completed => {
            let mut after_id = 0i64;
            loop {
                if let Some(signal) = stop.received() {
                    break Outcome::Interrupted(signal);
                }
                let began = Instant::now();
                match purge_outbox_batch(client, args, run_id, batches + 1, start.cutoff, after_id).await {
                    Ok((n, last)) => {
                        if n > 0 {
                            outbox_deleted += n as u64;
                            batches += 1;
                            rest(args.duty_cycle, began.elapsed()).await;
                        }
                        match last {
                            Some(last) => after_id = last,
                            None => break Outcome::Completed,
                        }
                    }
                    Err(e) => break Outcome::Failed(e),
                }
            }
        }
        other => other,
    };

    // The run's last record: how it ended. Best effort after a failure (the database may be gone;
    // the batch records already say what was deleted).
    let (outcome_name, error) = match &outcome {
        Outcome::Completed => ("completed", None),
        Outcome::Interrupted(_) => ("interrupted", None),
        Outcome::Failed(e) => ("failed", Some(describe_db_error(e))),
    };
    let mut end = serde_json::json!({
        "provider": PROVIDER_STRIPE,
        "run": run_id,
        "outcome": outcome_name,
        "deleted": deleted,
        "outbox_deleted": outbox_deleted,
        "batches": batches,
    });
    if let (Some(error), Some(end)) = (&error, end.as_object_mut()) {
        end.insert("error".to_owned(), serde_json::Value::String(error.clone()));
    }
    let end_written = admin::insert_audit(&***client, args.actor.name(), "purge", &end, 0).await;

    let batch_word = if batches == 1 { "batch" } else { "batches" };
    let summary = format!(
        "deleted {deleted} processed row{} older than {older_than} (processed before {cutoff_text}) \
         and {outbox_deleted} outbox row{} published before it, in {batches} {batch_word}; audit record {run_id}",
        plural(deleted as usize),
        plural(outbox_deleted as usize),
    );
    match outcome {
        Outcome::Failed(_) => anyhow::bail!(
            "purge stopped after deleting {deleted} row{} in {batches} {batch_word} (audit record \
             {run_id}): {}",
            plural(deleted as usize),
            error.unwrap_or_default()
        ),
        Outcome::Completed | Outcome::Interrupted(_) => {
            end_written.map_err(db_error("writing the audit record"))?;
        }
    }
    let interrupted_by = match outcome {
        Outcome::Interrupted(signal) => Some(signal),
        _ => None,
    };
    if args.output.json {
        emit_json(&Report {
            action: "purge",
            dry_run: false,
            matched: None,
            deleted: Some(deleted),
            batches: Some(batches),
            outbox_matched: None,
            outbox_deleted: Some(outbox_deleted),
            cutoff: cutoff_text,
            older_than_seconds: args.older_than.as_secs(),
            audit_id: Some(run_id),
            interrupted_by,
        })?;
    } else {
        emit(&format!("{summary}\n"))?;
    }
    if let Some(signal) = interrupted_by {
        return Err(AfterReport(format!(
            "purge interrupted by {signal} after deleting {deleted} row{} in {batches} {batch_word} \
             (audit record {run_id}); rows processed before {cutoff_text} are left: run it again to \
             delete them",
            plural(deleted as usize)
        ))
        .into());
    }
    Ok(())
}

/// The longest rest between two batches, however long the batch took: a stop signal is seen
/// within it.
const MAX_REST: Duration = Duration::from_secs(2);

/// Rests after a batch that took `worked`, so that the purge works `duty_cycle` percent of the
/// time (`--duty-cycle`). A purge deletes as fast as PostgreSQL lets it: beside live traffic on a
/// busy server its batches and their WAL took the CPU and the WAL flushes the ingest's and the
/// workers' commits wait for (in the soak, a purge of 216k rows at full speed cut the workers'
/// rate to a third and pushed receive→processed p99 to 9–14 s while it ran).
async fn rest(duty_cycle: u8, worked: Duration) {
    if duty_cycle >= 100 {
        return;
    }
    let ratio = f64::from(100 - duty_cycle) / f64::from(duty_cycle);
    tokio::time::sleep(worked.mul_f64(ratio).min(MAX_REST)).await;
}

/// One batch in its own transaction: the operator limits, the delete of one range, and — when it
/// deleted something — the batch's audit record, committed together.
async fn purge_one_batch(
    client: &mut deadpool_postgres::Object,
    args: &Args,
    run_id: i64,
    batch: u64,
    cutoff: std::time::SystemTime,
    from: HeapPosition,
    to_page: i64,
) -> Result<PurgeBatch, tokio_postgres::Error> {
    let tx = client.transaction().await?;
    set_limits(&tx, &LIMITS).await?;
    let done = admin::purge_batch(&*tx, cutoff, from, to_page, args.batch_size).await?;
    if done.deleted > 0 {
        let target = serde_json::json!({"provider": PROVIDER_STRIPE, "run": run_id, "batch": batch});
        admin::insert_audit(&*tx, args.actor.name(), "purge", &target, done.deleted).await?;
    }
    tx.commit().await?;
    Ok(done)
}

/// One batch of published outbox rows in its own transaction, with its audit record
/// (`target.table`: `outbox`); returns the rows deleted and the last id looked at.
async fn purge_outbox_batch(
    client: &mut deadpool_postgres::Object,
    args: &Args,
    run_id: i64,
    batch: u64,
    cutoff: std::time::SystemTime,
    after_id: i64,
) -> Result<(i64, Option<i64>), tokio_postgres::Error> {
    let tx = client.transaction().await?;
    set_limits(&tx, &LIMITS).await?;
    let done =
        inbox_domain::inbox::store::outbox::purge_batch(&*tx, cutoff, after_id, args.batch_size).await?;
    if done.0 > 0 {
        let target = serde_json::json!({"table": "outbox", "run": run_id, "batch": batch});
        admin::insert_audit(&*tx, args.actor.name(), "purge", &target, done.0 as u64).await?;
    }
    tx.commit().await?;
    Ok(done)
}

/// Pages one batch's range covers at most: one statement reads at most 128 MiB of the heap.
const MAX_SPAN: i64 = 16_384;
/// The first range, before any density has been seen.
const FIRST_SPAN: i64 = 64;

/// The walk of the heap, from page 0 to the size it had when the purge started, in ranges that
/// each hold about one batch of rows to delete. A full batch (it deleted `limit` rows) continues
/// after its last row, in a range sized from the pages those rows took; a batch that emptied its
/// range continues at the range's end, in a range sized from the density it saw (four times as
/// many pages when it found nothing, up to [`MAX_SPAN`]). A row deleted by an earlier batch is
/// never read again, and each page is read about once.
#[derive(Debug, Clone, PartialEq)]
struct Walk {
    next: HeapPosition,
    end_page: i64,
    span: i64,
    limit: i64,
}

impl Walk {
    fn new(pages: i64, limit: i64) -> Walk {
        Walk { next: HeapPosition { page: 0, item: 0 }, end_page: pages, span: FIRST_SPAN, limit }
    }

    /// The next range: from a row position up to a page (not included); None at the end.
    fn next_range(&self) -> Option<(HeapPosition, i64)> {
        (self.next.page < self.end_page)
            .then(|| (self.next, self.next.page.saturating_add(self.span).min(self.end_page)))
    }

    /// Moves past what the batch over `from..to_page` did.
    fn advance(&mut self, from: HeapPosition, to_page: i64, batch: PurgeBatch) {
        let deleted = i64::try_from(batch.deleted).unwrap_or(i64::MAX);
        match batch.last {
            Some(last) if deleted >= self.limit => {
                // Full: the range may hold more; continue right after the last row deleted.
                self.next = HeapPosition { page: last.page, item: last.item + 1 };
                self.span = span_for(self.limit, deleted, last.page - from.page + 1);
            }
            _ => {
                self.next = HeapPosition { page: to_page, item: 0 };
                self.span = if deleted == 0 {
                    self.span.saturating_mul(4).min(MAX_SPAN)
                } else {
                    span_for(self.limit, deleted, to_page - from.page)
                };
            }
        }
    }
}

/// Pages that hold about `limit` rows to delete (with a tenth more), at the density of `deleted`
/// rows in `pages` pages.
fn span_for(limit: i64, deleted: i64, pages: i64) -> i64 {
    let span = (limit as f64 * 1.1 * pages.max(1) as f64 / deleted.max(1) as f64).ceil();
    (span as i64).clamp(1, MAX_SPAN)
}

/// The first SIGTERM or SIGINT asks a batched command (`purge`, `requeue --all`) to stop after the
/// batch in flight; a second exits at once (the batch in flight then rolls back, its audit record
/// with it, when the connection closes).
pub struct StopSignal(watch::Receiver<Option<&'static str>>);

impl StopSignal {
    /// Starts listening (from now on the signals no longer end the process at once).
    pub fn install() -> StopSignal {
        let (tx, rx) = watch::channel(None);
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            if let (Ok(mut term), Ok(mut int)) =
                (signal(SignalKind::terminate()), signal(SignalKind::interrupt()))
            {
                tokio::spawn(async move {
                    let name = tokio::select! {
                        _ = term.recv() => "SIGTERM",
                        _ = int.recv() => "SIGINT",
                    };
                    tracing::info!(
                        signal = name,
                        "stop signal: stopping after the batch in flight (signal again to exit now)"
                    );
                    let _ = tx.send(Some(name));
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = int.recv() => {}
                    }
                    tracing::warn!("second stop signal: exiting now; the batch in flight rolls back");
                    std::process::exit(130);
                });
            }
        }
        #[cfg(not(unix))]
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                let _ = tx.send(Some("SIGINT"));
            }
        });
        StopSignal(rx)
    }

    /// The signal received, if one was.
    pub fn received(&self) -> Option<&'static str> {
        *self.0.borrow()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_retry_window_is_three_days_and_the_floor_twice_the_tolerance() {
        assert_eq!(STRIPE_RETRY_WINDOW, humantime::parse_duration("3d").unwrap());
        assert_eq!(
            purge_floor(humantime::parse_duration("5m").unwrap()),
            humantime::parse_duration("10m").unwrap()
        );
    }

    fn batch(deleted: u64, last: Option<(i64, i64)>) -> PurgeBatch {
        PurgeBatch { deleted, last: last.map(|(page, item)| HeapPosition { page, item }) }
    }

    #[test]
    fn the_walk_covers_the_heap_once_and_sizes_ranges_to_a_batch() {
        let mut walk = Walk::new(10_000, 1000);
        assert_eq!(walk.next_range(), Some((HeapPosition { page: 0, item: 0 }, 64)));
        // 64 pages held 128 rows: 2 a page, so about 550 pages hold a batch.
        walk.advance(HeapPosition { page: 0, item: 0 }, 64, batch(128, Some((63, 2))));
        assert_eq!(walk.next_range(), Some((HeapPosition { page: 64, item: 0 }, 64 + 550)));
        // Full: continue after the last row deleted, in the same page.
        walk.advance(HeapPosition { page: 64, item: 0 }, 614, batch(1000, Some((563, 1))));
        assert_eq!(walk.next, HeapPosition { page: 563, item: 2 });
        assert_eq!(walk.span, 550);
        // Nothing more to delete: the ranges grow fourfold (550, 2200, 8800 pages), to the end.
        let mut ranges = Vec::new();
        while let Some((from, to)) = walk.next_range() {
            ranges.push((from.page, to));
            walk.advance(from, to, batch(0, None));
        }
        assert_eq!(ranges, [(563, 1113), (1113, 3313), (3313, 10_000)]);
        // Up to the cap.
        let mut walk = Walk::new(1_000_000, 10);
        for _ in 0..20 {
            let (from, to) = walk.next_range().unwrap();
            walk.advance(from, to, batch(0, None));
        }
        assert_eq!(walk.span, MAX_SPAN);
    }

    #[test]
    fn an_empty_table_has_no_range() {
        assert_eq!(Walk::new(0, 1000).next_range(), None);
    }
}
