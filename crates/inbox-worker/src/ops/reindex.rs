//! `reindex`: rebuilds the indexes of the queue table and the outbox that have grown well past what
//! a rebuild would give them — after a long snapshot held elsewhere, typically — with `REINDEX
//! INDEX CONCURRENTLY`, and drops what an interrupted rebuild left. Run by the tables' owner
//! (`inbox_owner`), from a timer or by hand; the ingest, the workers and the relays go on meanwhile.
//! Which index and why: `inbox_domain::inbox::store::maintenance` ("Rebuilding the queue tables'
//! indexes"). It changes no row, so it writes no audit record.
//!
//! A rebuild started while a session holds an old snapshot would copy every entry that snapshot
//! keeps, and then wait for it to end. So before each rebuild `reindex` waits, up to
//! `--lock-timeout`, until no session of the database has held a snapshot older than every running
//! transaction across two looks [`SNAPSHOT_POLL`] apart (`maintenance::OLD_SNAPSHOTS_SQL`); a
//! snapshot held longer is reported and the index left. The rebuild itself waits for the
//! transactions that hold its table, under the same `--lock-timeout`; one that runs out of it is
//! given up, its copy dropped. Either way the command exits 1 saying so (run it again once the
//! snapshot has ended), after trying the next indexes.

use std::time::{Duration, Instant};

use clap::Args as ClapArgs;
use inbox_domain::config::{format_byte_size, parse_byte_size, parse_duration};
use inbox_domain::db::describe_db_error;
use inbox_domain::inbox::store::maintenance::{self, QueueIndex, Verdict};
use serde::Serialize;

use super::db_error;
use super::output::{emit, emit_json, AfterReport, OutputArgs, Table};

/// How often `reindex` looks for sessions holding an old snapshot while it waits for them.
pub const SNAPSHOT_POLL: Duration = Duration::from_millis(500);

/// Flags of `reindex`.
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// Say what would be rebuilt or dropped; change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Leave indexes smaller than this, however much of them is empty: they cost little, and
    /// the churn of claims and marks grows a queue index back to a few MiB between vacuums.
    #[arg(long, default_value = "8MiB", value_parser = parse_byte_size)]
    pub min_size: u64,
    /// The longest `reindex` waits, before a rebuild, for a session holding a snapshot older than
    /// every running transaction to end, and, during one, for a lock (PostgreSQL's lock_timeout
    /// for this session).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub lock_timeout: Duration,
    /// The longest one rebuild may take (statement_timeout for this session).
    #[arg(long, default_value = "30m", value_parser = parse_duration)]
    pub timeout: Duration,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// One index in the report.
#[derive(Debug, Serialize)]
struct Outcome {
    index: String,
    table: String,
    bytes: i64,
    entries: Option<f64>,
    /// Whether `entries` was counted just now (before a rebuild) rather than read from the
    /// statistics.
    entries_counted: bool,
    rebuilt_bytes_estimate: Option<i64>,
    /// `rebuilt`, `dropped` (a leftover), `would_rebuild`, `would_drop` (--dry-run), `left`,
    /// `failed`.
    action: &'static str,
    /// Why it was left or failed.
    reason: Option<String>,
    bytes_after: Option<i64>,
    seconds: Option<f64>,
}

/// `reindex`.
pub async fn run(client: &tokio_postgres::Client, args: &Args) -> anyhow::Result<()> {
    if !maintenance::try_lock_reindex(client).await.map_err(db_error("taking the reindex lock"))? {
        super::refuse!(
            "another reindex is running on this database (it holds the reindex advisory lock): let it finish"
        );
    }
    let mut indexes =
        maintenance::queue_indexes(client).await.map_err(db_error("listing the queue tables' indexes"))?;
    let min_bytes = i64::try_from(args.min_size).unwrap_or(i64::MAX);
    // The timeouts bound the counts below as well as the rebuilds.
    maintenance::set_rebuild_timeouts(client, args.lock_timeout, args.timeout)
        .await
        .map_err(db_error("setting the session's timeouts"))?;
    // What the statistics would have rebuilt is counted first: they may predate the rows since.
    maintenance::count_entries(client, &mut indexes, min_bytes)
        .await
        .map_err(|(index, e)| inbox_domain::db::db_error(&format!("counting the entries of {index}"), &e))?;
    // Leftovers first: each is maintained by every write until it is dropped.
    let mut order: Vec<(&QueueIndex, Verdict)> = indexes.iter().map(|i| (i, i.verdict(min_bytes))).collect();
    order.sort_by_key(|(_, verdict)| *verdict != Verdict::DropLeftover);
    let to_change: Vec<&QueueIndex> = order
        .iter()
        .filter(|(_, verdict)| matches!(verdict, Verdict::Rebuild | Verdict::DropLeftover))
        .map(|(index, _)| *index)
        .collect();
    if let Some(index) = to_change.iter().find(|i| !i.owned).filter(|_| !args.dry_run) {
        super::refuse!(
            "{} needs rebuilding or dropping, and only the owner of {} may do it: run reindex as the \
             tables' owner (inbox_owner)",
            index.index,
            index.table
        );
    }
    let mut outcomes = Vec::with_capacity(order.len());
    // The session whose snapshot outlasted --lock-timeout: while it still holds the same one, the
    // next indexes are left without waiting for it again.
    let mut outlasted = None;
    for (index, verdict) in order {
        outcomes.push(act(client, index, verdict, min_bytes, args, &mut outlasted).await);
    }
    let failed = outcomes.iter().filter(|o| o.action == "failed").count();
    if args.output.json {
        #[derive(Serialize)]
        struct Report<'a> {
            action: &'static str,
            dry_run: bool,
            min_size_bytes: u64,
            indexes: &'a [Outcome],
        }
        emit_json(&Report {
            action: "reindex",
            dry_run: args.dry_run,
            min_size_bytes: args.min_size,
            indexes: &outcomes,
        })?;
    } else {
        emit(&render(&outcomes))?;
    }
    if failed > 0 {
        return Err(AfterReport(format!(
            "{failed} of the indexes were not rebuilt or dropped (see the report for why): run reindex again"
        ))
        .into());
    }
    Ok(())
}

/// Does what the verdict says with one index and reports it.
async fn act(
    client: &tokio_postgres::Client,
    index: &QueueIndex,
    verdict: Verdict,
    min_bytes: i64,
    args: &Args,
    outlasted: &mut Option<maintenance::SnapshotHolder>,
) -> Outcome {
    let mut outcome = Outcome {
        index: index.index.clone(),
        table: index.table.clone(),
        bytes: index.bytes,
        entries: index.entries,
        entries_counted: index.entries_counted,
        rebuilt_bytes_estimate: index.rebuilt_bytes(),
        action: "left",
        reason: None,
        bytes_after: None,
        seconds: None,
    };
    match verdict {
        Verdict::Small => outcome.reason = Some(format!("under --min-size ({})", size(min_bytes))),
        Verdict::NotGrown => {
            outcome.reason =
                Some(format!("under {}× the size a rebuild would give it", maintenance::REBUILD_WHEN_GROWN))
        }
        Verdict::NotWorthReading => {
            outcome.reason = Some(format!(
                "a rebuild would read its table ({}) twice to give back {}",
                size(index.table_bytes),
                size(index.bytes - index.rebuilt_bytes().unwrap_or(0))
            ))
        }
        Verdict::NoStatistics => {
            outcome.reason = Some("no vacuum or analyse has counted its entries yet".to_owned())
        }
        Verdict::Invalid => {
            outcome.reason = Some("invalid, and not a leftover of a rebuild: not ours to drop".to_owned())
        }
        Verdict::DropLeftover if args.dry_run => outcome.action = "would_drop",
        Verdict::Rebuild if args.dry_run => outcome.action = "would_rebuild",
        Verdict::DropLeftover => {
            let started = Instant::now();
            match maintenance::drop_leftover_index(client, &index.name).await {
                Ok(()) => outcome.action = "dropped",
                Err(e) => {
                    outcome.action = "failed";
                    outcome.reason = Some(format!("dropping it: {}", describe_db_error(&e)));
                }
            }
            outcome.seconds = Some(started.elapsed().as_secs_f64());
        }
        Verdict::Rebuild => rebuild(client, index, args, outlasted, &mut outcome).await,
    }
    outcome
}

/// Rebuilds `index` unless a session holding an old snapshot is in the way (see the module's doc),
/// and records what happened in `outcome`.
async fn rebuild(
    client: &tokio_postgres::Client,
    index: &QueueIndex,
    args: &Args,
    outlasted: &mut Option<maintenance::SnapshotHolder>,
    outcome: &mut Outcome,
) {
    let started = Instant::now();
    match snapshot_in_the_way(client, args.lock_timeout, outlasted).await {
        Ok(None) => match maintenance::rebuild_index(client, &index.name).await {
            Ok(()) => {
                outcome.action = "rebuilt";
                outcome.bytes_after = maintenance::index_bytes(client, &index.name).await.ok();
            }
            Err(e) => {
                outcome.action = "failed";
                outcome.reason = Some(failure(&e, args));
                drop_copies(client, index).await;
            }
        },
        Ok(Some((holder, waited_now))) => {
            outcome.action = "failed";
            outcome.reason = Some(format!(
                "session {} (role {}) {} a snapshot older than every running transaction for \
                 longer than --lock-timeout ({}): a rebuild now would keep every entry it keeps; \
                 not started. docs/operations.md, \"A long transaction elsewhere on the database\"",
                holder.pid,
                holder.role.as_deref().unwrap_or("?"),
                if waited_now { "has held" } else { "still holds, not waited for again," },
                humantime::format_duration(args.lock_timeout)
            ));
            *outlasted = Some(holder);
        }
        Err(e) => {
            outcome.action = "failed";
            outcome.reason = Some(format!("looking for old snapshots: {}", describe_db_error(&e)));
            return;
        }
    }
    outcome.seconds = Some(started.elapsed().as_secs_f64());
}

/// The session whose old snapshot keeps a rebuild from starting, and whether it was waited for
/// now (false: `outlasted`, which already outlasted `patience` in this run, still holds the same
/// snapshot, and is not waited for again). None: nothing in the way.
async fn snapshot_in_the_way(
    client: &tokio_postgres::Client,
    patience: Duration,
    outlasted: &mut Option<maintenance::SnapshotHolder>,
) -> Result<Option<(maintenance::SnapshotHolder, bool)>, tokio_postgres::Error> {
    if let Some(holder) = outlasted.take() {
        if maintenance::old_snapshot_holders(client).await?.contains(&holder) {
            return Ok(Some((holder, false)));
        }
    }
    Ok(wait_for_old_snapshots(client, patience).await?.map(|holder| (holder, true)))
}

/// Waits until no session has held an old snapshot across two looks [`SNAPSHOT_POLL`] apart
/// (sessions that hold one only for a moment, as busy ones do, are not waited for), for at most
/// `patience`; returns the oldest holder still there after it.
async fn wait_for_old_snapshots(
    client: &tokio_postgres::Client,
    patience: Duration,
) -> Result<Option<maintenance::SnapshotHolder>, tokio_postgres::Error> {
    let deadline = Instant::now() + patience;
    let mut held = maintenance::old_snapshot_holders(client).await?;
    while !held.is_empty() {
        let now = Instant::now();
        if now >= deadline {
            return Ok(held.into_iter().next());
        }
        tokio::time::sleep(SNAPSHOT_POLL.min(deadline - now)).await;
        let seen = maintenance::old_snapshot_holders(client).await?;
        held = seen.into_iter().filter(|h| held.contains(h)).collect();
    }
    Ok(None)
}

/// Why a rebuild failed, in words an operator can act on.
fn failure(e: &tokio_postgres::Error, args: &Args) -> String {
    use tokio_postgres::error::SqlState;
    match e.code() {
        Some(&SqlState::LOCK_NOT_AVAILABLE) => format!(
            "waited longer than --lock-timeout ({}) for a transaction holding the table, or one whose \
             snapshot is older than the rebuild (a long report, a session idle in transaction): \
             docs/operations.md, \"A long transaction elsewhere on the database\"",
            humantime::format_duration(args.lock_timeout)
        ),
        Some(&SqlState::QUERY_CANCELED) => {
            format!("cancelled, or ran longer than --timeout ({})", humantime::format_duration(args.timeout))
        }
        _ => describe_db_error(e),
    }
}

/// Drops the copies an interrupted rebuild of `index` left (best effort: the next run drops what
/// is still there).
async fn drop_copies(client: &tokio_postgres::Client, index: &QueueIndex) {
    let Ok(now) = maintenance::queue_indexes(client).await else { return };
    for leftover in now.iter().filter(|i| i.leftover && i.table == index.table) {
        if leftover.index.starts_with(&index.index) {
            if let Err(e) = maintenance::drop_leftover_index(client, &leftover.name).await {
                tracing::warn!(
                    index = leftover.index,
                    error = describe_db_error(&e),
                    "could not drop a rebuild's copy"
                );
            }
        }
    }
}

fn size(bytes: i64) -> String {
    format_byte_size(u64::try_from(bytes).unwrap_or(0))
}

fn render(outcomes: &[Outcome]) -> String {
    let mut table = Table::new(&[
        ("index", false),
        ("size", true),
        ("entries", true),
        ("rebuilt (est.)", true),
        ("action", false),
        ("after", true),
        ("seconds", true),
    ]);
    for o in outcomes {
        table.push(vec![
            format!("{}.{}", o.table, o.index),
            size(o.bytes),
            match (o.entries, o.entries_counted) {
                (None, _) => "-".to_owned(),
                (Some(e), false) => format!("{e:.0}"),
                (Some(e), true) => format!("{e:.0} (counted)"),
            },
            o.rebuilt_bytes_estimate.map_or_else(|| "-".to_owned(), size),
            match (o.action, &o.reason) {
                ("left", Some(reason)) => format!("left: {reason}"),
                (action, _) => action.to_owned(),
            },
            o.bytes_after.map_or_else(|| "-".to_owned(), size),
            o.seconds.map_or_else(|| "-".to_owned(), |s| format!("{s:.2}")),
        ]);
    }
    let mut text = table.render();
    for o in outcomes.iter().filter(|o| o.reason.is_some() && o.action != "left") {
        text.push_str(&format!("{}: {}\n", o.index, o.reason.as_deref().unwrap_or_default()));
    }
    text
}
