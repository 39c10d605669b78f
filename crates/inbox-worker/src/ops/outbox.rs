//! The outbox's side of `needs-review --outbox` and `requeue --outbox`: the parked outbox rows with
//! the aggregates they hold back, and putting them back in the relays' queue (audited, in batches).
//! The statements are in `inbox_domain::inbox::store::outbox`.

use inbox_domain::inbox::store::outbox::{self, ParkedOutboxRow};
use inbox_domain::inbox::store::{admin, set_limits};
use serde::Serialize;

use super::output::{emit, emit_json, one_line, plural, AfterReport, Table};
use super::purge::StopSignal;
use super::{db_error, LIMITS};

/// The widest `last_error` shown in the table (JSON has it whole).
const TABLE_ERROR_WIDTH: usize = 80;

/// `needs-review --outbox`.
pub async fn needs_review(
    client: &(impl tokio_postgres::GenericClient + Sync),
    limit: i64,
    json: bool,
) -> anyhow::Result<()> {
    let rows =
        outbox::parked_rows(client, limit).await.map_err(db_error("listing the parked outbox rows"))?;
    if json {
        #[derive(Serialize)]
        struct Report<'a> {
            rows: &'a [ParkedOutboxRow],
            count: usize,
        }
        return emit_json(&Report { rows: &rows, count: rows.len() });
    }
    if rows.is_empty() {
        return emit("no parked outbox rows\n");
    }
    let mut table = Table::new(&[
        ("id", true),
        ("aggregate", false),
        ("event_type", false),
        ("attempts", true),
        ("held_behind", true),
        ("created_at", false),
        ("parked_at", false),
        ("last_error", false),
    ]);
    for r in &rows {
        table.push(vec![
            r.id.to_string(),
            format!("{} {}", r.aggregate_type, r.aggregate_id),
            r.event_type.clone(),
            r.attempts.to_string(),
            r.held_behind.to_string(),
            r.created_at.clone(),
            r.parked_at.clone(),
            r.last_error.as_deref().map_or_else(|| "-".to_owned(), |e| one_line(e, TABLE_ERROR_WIDTH)),
        ]);
    }
    let mut text = table.render();
    let blocking = rows.iter().filter(|r| r.held_behind > 0).count();
    text.push_str(&format!(
        "{} parked outbox row{}; {blocking} of them hold{} back later rows of {} aggregate (held_behind)",
        rows.len(),
        plural(rows.len()),
        if blocking == 1 { "s" } else { "" },
        if blocking == 1 { "its" } else { "their" },
    ));
    if rows.len() as i64 == limit {
        text.push_str(&format!("; the first {limit} shown (pass --limit for more)"));
    }
    text.push('\n');
    emit(&text)
}

/// What `requeue --outbox` is asked to do.
pub struct Requeue<'a> {
    /// `--id`: these rows; else every parked row matching the filters.
    pub id: Option<i64>,
    pub event_type: Option<&'a str>,
    /// Text `last_error` contains (LIKE-escaped).
    pub error_like: Option<&'a str>,
    pub limit: Option<i64>,
    pub yes: bool,
    pub batch_size: i64,
    pub dry_run: bool,
    pub actor: &'a str,
    pub json: bool,
}

/// What `requeue --outbox --json` prints.
#[derive(Serialize)]
struct Report {
    action: &'static str,
    dry_run: bool,
    matched: i64,
    requeued: usize,
    batches: u64,
    ids: Vec<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    interrupted_by: Option<&'static str>,
}

/// `requeue --outbox`: one row by `--id`, or the parked rows in audited batches, each its own
/// transaction (SKIP LOCKED: a row another session holds is left, never waited for); the count
/// first, more than [`super::requeue::CONFIRM_ABOVE`] only with `--yes`.
pub async fn requeue(client: &mut deadpool_postgres::Object, what: &Requeue<'_>) -> anyhow::Result<()> {
    let matched = match what.id {
        Some(id) => {
            match outbox::row_state(&***client, id).await.map_err(db_error("reading the outbox row"))? {
                None => anyhow::bail!("no outbox row {id}"),
                Some((true, _)) => {
                    anyhow::bail!("outbox row {id} was delivered (published_at is set): nothing to requeue")
                }
                Some((false, false)) => anyhow::bail!(
                    "outbox row {id} is not parked: it is pending, and a relay delivers it (see `stats`)"
                ),
                Some((false, true)) => 1,
            }
        }
        None => outbox::count_parked(&***client, what.event_type, what.error_like)
            .await
            .map_err(db_error("counting the parked outbox rows"))?,
    };
    let takes = matched.min(what.limit.unwrap_or(i64::MAX));
    if !what.json {
        emit(&format!("{matched} parked outbox row{} match\n", plural(matched as usize)))?;
    }
    if !what.dry_run && takes > super::requeue::CONFIRM_ABOVE && !what.yes {
        anyhow::bail!(
            "{takes} rows would be requeued at once: pass --yes to confirm (or --limit, or --dry-run to list them)"
        );
    }
    let mut report = Report {
        action: "requeue-outbox",
        dry_run: what.dry_run,
        matched,
        requeued: 0,
        batches: 0,
        ids: Vec::new(),
        interrupted_by: None,
    };
    if what.dry_run {
        let rows = outbox::parked_rows(&***client, takes.max(1))
            .await
            .map_err(db_error("listing the parked outbox rows"))?;
        report.ids = rows
            .iter()
            .filter(|r| what.id.is_none_or(|id| r.id == id))
            .filter(|r| what.event_type.is_none_or(|t| r.event_type == t))
            .map(|r| r.id)
            .take(takes as usize)
            .collect();
    } else {
        let stop = StopSignal::install();
        let ids = what.id.map(|id| vec![id]);
        while (report.requeued as i64) < takes {
            if let Some(signal) = stop.received() {
                report.interrupted_by = Some(signal);
                break;
            }
            let batch = what.batch_size.min(takes - report.requeued as i64);
            let tx = client.transaction().await.map_err(db_error("starting a transaction"))?;
            set_limits(&tx, &LIMITS).await.map_err(db_error("setting the transaction's timeouts"))?;
            let requeued = outbox::requeue(&*tx, ids.as_deref(), what.event_type, what.error_like, batch)
                .await
                .map_err(db_error("requeuing the outbox rows"))?;
            if requeued.is_empty() {
                tx.rollback().await.map_err(db_error("ending the transaction"))?;
                break;
            }
            let target = serde_json::json!({
                "table": "outbox",
                "ids": requeued,
                "event_type": what.event_type,
                "error_like": what.error_like,
            });
            admin::insert_audit(&*tx, what.actor, "requeue-outbox", &target, requeued.len() as u64)
                .await
                .map_err(db_error("writing the audit record"))?;
            tx.commit().await.map_err(db_error("committing the requeue"))?;
            report.batches += 1;
            report.requeued += requeued.len();
            report.ids.extend(requeued);
        }
    }
    if what.json {
        emit_json(&report)?;
    } else if what.dry_run {
        emit(&format!(
            "dry run: would requeue {} row{} ({}); nothing changed\n",
            report.ids.len(),
            plural(report.ids.len()),
            report.ids.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
        ))?;
    } else {
        emit(&format!(
            "requeued {} outbox row{} in {} batch{} (attempts 0, available now; the rows held behind \
             them follow in order); audited as requeue-outbox\n",
            report.requeued,
            plural(report.requeued),
            report.batches,
            if report.batches == 1 { "" } else { "es" }
        ))?;
    }
    if let Some(signal) = report.interrupted_by {
        return Err(AfterReport(format!(
            "requeue --outbox interrupted by {signal} after requeuing {} of {takes} rows; the others are still parked",
            report.requeued
        ))
        .into());
    }
    Ok(())
}
