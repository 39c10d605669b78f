//! The operator commands: `stats`, `needs-review`, `requeue`, `replay`, `purge`.
//!
//! Each command works over one connection, prints a table on stdout (a JSON document with
//! `--json`), and refuses with an error saying why (the binary prints `inbox-worker: error: …`
//! and exits 1).
//!
//! Words used below, for `max_attempts` (the global `--max-attempts`):
//! * *unprocessed*: `processed_at IS NULL`;
//! * *parked* (needs review): unprocessed and `attempts >= max_attempts`; the workers never claim
//!   it again until `requeue`;
//! * *ready*: unprocessed, not parked, `available_at <= now()` (the next claim may take it);
//! * *leased*: unprocessed, not parked, `available_at > now()`, `last_error IS NULL`: a worker
//!   holds it (in flight);
//! * *retry_wait*: unprocessed, not parked, `available_at > now()`, `last_error IS NOT NULL`:
//!   waiting for its backoff after a failure. A row claimed again after a failure keeps its
//!   `last_error` until it is processed, so it counts here, not as leased, while in flight.
//!
//! Ready, leased, retry_wait and parked partition the unprocessed rows.
//!
//! Every change an operator makes (requeue, replay, purge) writes one `operator_audit` row — for
//! requeue and replay in the same transaction as the change, so the audit and the change commit
//! together or not at all. `--dry-run` changes nothing and writes no audit. The commands work on
//! the rows of provider `stripe` ([`PROVIDER_STRIPE`]), the only provider this service stores;
//! [`queue_gauges`] (for the worker's metrics) covers the whole queue, as the claim does.
//!
//! Every SQL statement is a documented constant next to the function that runs it.

use std::io::Write as _;
use std::time::{Duration, SystemTime};

use inbox_domain::db::{build_pool, describe_pool_error, PoolOptions};
use inbox_domain::handlers::{describe_db_error, InboxEvent, Registry};
use inbox_domain::PROVIDER_STRIPE;
use serde::Serialize;
use tokio_postgres::GenericClient;

use crate::cli::{NeedsReviewArgs, OutputArgs, PurgeArgs, ReplayArgs, RequeueArgs};

// ---------------------------------------------------------------------------------------------
// Shared pieces
// ---------------------------------------------------------------------------------------------

/// How long an operator transaction waits for a row lock before giving up. A worker holds a row
/// lock for at most its statement timeout while processing; an operator command fails rather
/// than hang behind something stuck.
pub const LOCK_TIMEOUT: &str = "10s";
/// Bound on each statement of an operator transaction (replay runs handlers).
pub const STATEMENT_TIMEOUT: &str = "60s";

/// Bounds of an operator transaction, transaction-local (they end with it): `$1` lock_timeout,
/// `$2` statement_timeout.
pub const SET_LIMITS_SQL: &str = "\
SELECT set_config('lock_timeout', $1, true),
       set_config('statement_timeout', $2, true)";

/// Runs [`SET_LIMITS_SQL`] with [`LOCK_TIMEOUT`] and [`STATEMENT_TIMEOUT`].
async fn set_limits(tx: &(impl GenericClient + Sync)) -> anyhow::Result<()> {
    tx.query_one(SET_LIMITS_SQL, &[&LOCK_TIMEOUT, &STATEMENT_TIMEOUT])
        .await
        .map_err(db_error("setting the transaction's timeouts"))?;
    Ok(())
}

/// One audit record: who (`$1` actor) did what (`$2` action: requeue, replay, purge) to which
/// rows (`$3` target, jsonb: the key or the filters) and how many rows it changed (`$4`).
/// Returns the record's id.
pub const INSERT_AUDIT_SQL: &str = "\
INSERT INTO operator_audit (actor, action, target, affected)
VALUES ($1, $2, $3, $4)
RETURNING id";

/// Runs [`INSERT_AUDIT_SQL`]; returns the audit record's id.
pub async fn insert_audit(
    client: &(impl GenericClient + Sync),
    actor: &str,
    action: &str,
    target: &serde_json::Value,
    affected: u64,
) -> Result<i64, tokio_postgres::Error> {
    let affected = i32::try_from(affected).unwrap_or(i32::MAX);
    let row = client.query_one(INSERT_AUDIT_SQL, &[&actor, &action, target, &affected]).await?;
    Ok(row.get(0))
}

/// Maps a database error to a message naming what we were doing and the server's reason.
fn db_error(doing: &'static str) -> impl FnOnce(tokio_postgres::Error) -> anyhow::Error {
    move |e| anyhow::anyhow!("{doing}: {}", describe_db_error(&e))
}

/// Prints `text` on stdout.
fn emit(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| anyhow::anyhow!("writing to stdout: {e}"))
}

/// Prints `value` as a pretty JSON document.
fn emit_json(value: &impl Serialize) -> anyhow::Result<()> {
    let mut text = serde_json::to_string_pretty(value)?;
    text.push('\n');
    emit(&text)
}

/// A text table: a header row and rows, each column as wide as its widest cell; columns marked
/// numeric are right-aligned.
struct Table {
    headers: Vec<&'static str>,
    numeric: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn new(columns: &[(&'static str, bool)]) -> Self {
        Table {
            headers: columns.iter().map(|c| c.0).collect(),
            numeric: columns.iter().map(|c| c.1).collect(),
            rows: Vec::new(),
        }
    }

    fn push(&mut self, row: Vec<String>) {
        self.rows.push(row);
    }

    fn render(&self) -> String {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let mut out = String::new();
        let headers: Vec<String> = self.headers.iter().map(|h| (*h).to_owned()).collect();
        for row in std::iter::once(&headers).chain(&self.rows) {
            let mut line = String::new();
            for (i, cell) in row.iter().enumerate() {
                if i > 0 {
                    line.push_str("  ");
                }
                let pad = widths[i].saturating_sub(cell.chars().count());
                if self.numeric[i] {
                    line.extend(std::iter::repeat_n(' ', pad));
                    line.push_str(cell);
                } else {
                    line.push_str(cell);
                    line.extend(std::iter::repeat_n(' ', pad));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// `text` on one line, cut to `max` characters (with `…`): for table cells only.
fn one_line(text: &str, max: usize) -> String {
    let flat: String = text.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    if flat.chars().count() <= max {
        return flat;
    }
    let mut cut: String = flat.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
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

fn format_age(seconds: f64) -> String {
    let whole = Duration::from_secs(seconds.max(0.0) as u64);
    format!("{} ({seconds:.1} s)", humantime::format_duration(whole))
}

// ---------------------------------------------------------------------------------------------
// stats
// ---------------------------------------------------------------------------------------------

/// The queue's health in one statement: the grand total (`total = true`, `event_type` NULL) and
/// one row per event type (`GROUPING SETS`). `$1` provider, `$2` max_attempts. Only rows that
/// are unprocessed or were processed in the last hour are read into the groups, so an event type
/// shows only when it has something to report; finding the recently processed rows still reads
/// the table (there is no index on `processed_at`): this is for operators, not for a scrape
/// every few seconds — the worker's metrics use [`QUEUE_GAUGES_SQL`].
pub const STATS_SQL: &str = "\
SELECT GROUPING(event_type) = 1 AS total,
       event_type,
       count(*) FILTER (WHERE processed_at IS NULL) AS unprocessed,
       count(*) FILTER (WHERE processed_at IS NULL AND attempts < $2
                          AND available_at <= now()) AS ready,
       count(*) FILTER (WHERE processed_at IS NULL AND attempts < $2
                          AND available_at > now() AND last_error IS NULL) AS leased,
       count(*) FILTER (WHERE processed_at IS NULL AND attempts < $2
                          AND available_at > now() AND last_error IS NOT NULL) AS retry_wait,
       count(*) FILTER (WHERE processed_at IS NULL AND attempts >= $2) AS needs_review,
       extract(epoch FROM now() - min(received_at) FILTER (WHERE processed_at IS NULL))::float8
           AS oldest_unprocessed_age_seconds,
       count(*) FILTER (WHERE processed_at >= now() - interval '1 hour') AS processed_last_hour
  FROM webhook_inbox
 WHERE provider = $1
   AND (processed_at IS NULL OR processed_at >= now() - interval '1 hour')
 GROUP BY GROUPING SETS ((), (event_type))
 ORDER BY total DESC, event_type";

/// What `stats` reports (also its JSON document).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Stats {
    pub unprocessed: i64,
    pub ready: i64,
    /// In flight: leased by a worker, no failure recorded.
    pub leased: i64,
    /// Waiting for the backoff after a failure (see the module documentation).
    pub retry_wait: i64,
    /// Parked: `attempts >= max_attempts`.
    pub needs_review: i64,
    /// Age of the oldest unprocessed row (since it was received); None when there is none.
    pub oldest_unprocessed_age_seconds: Option<f64>,
    pub processed_last_hour: i64,
    pub by_event_type: Vec<EventTypeStats>,
}

/// `stats` of one event type.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventTypeStats {
    pub event_type: String,
    pub unprocessed: i64,
    pub needs_review: i64,
    pub processed_last_hour: i64,
}

/// Runs [`STATS_SQL`].
pub async fn read_stats(
    client: &(impl GenericClient + Sync),
    max_attempts: i32,
) -> Result<Stats, tokio_postgres::Error> {
    let rows = client.query(STATS_SQL, &[&PROVIDER_STRIPE, &max_attempts]).await?;
    let mut stats = Stats {
        unprocessed: 0,
        ready: 0,
        leased: 0,
        retry_wait: 0,
        needs_review: 0,
        oldest_unprocessed_age_seconds: None,
        processed_last_hour: 0,
        by_event_type: Vec::new(),
    };
    for row in rows {
        if row.get::<_, bool>("total") {
            stats.unprocessed = row.get("unprocessed");
            stats.ready = row.get("ready");
            stats.leased = row.get("leased");
            stats.retry_wait = row.get("retry_wait");
            stats.needs_review = row.get("needs_review");
            stats.oldest_unprocessed_age_seconds = row.get("oldest_unprocessed_age_seconds");
            stats.processed_last_hour = row.get("processed_last_hour");
        } else {
            stats.by_event_type.push(EventTypeStats {
                event_type: row.get("event_type"),
                unprocessed: row.get("unprocessed"),
                needs_review: row.get("needs_review"),
                processed_last_hour: row.get("processed_last_hour"),
            });
        }
    }
    Ok(stats)
}

/// `inbox-worker stats`.
pub async fn stats(
    client: &mut tokio_postgres::Client,
    max_attempts: i32,
    args: &OutputArgs,
) -> anyhow::Result<()> {
    let stats = read_stats(&*client, max_attempts).await.map_err(db_error("reading the queue statistics"))?;
    if args.json {
        return emit_json(&stats);
    }
    let mut summary = Table::new(&[("queue", false), ("rows", true)]);
    let oldest = stats.oldest_unprocessed_age_seconds.map_or_else(|| "-".to_owned(), format_age);
    for (name, value) in [
        ("unprocessed", stats.unprocessed.to_string()),
        ("  ready", stats.ready.to_string()),
        ("  leased (in flight)", stats.leased.to_string()),
        ("  retry_wait (after a failure)", stats.retry_wait.to_string()),
        (&*format!("  needs_review (attempts >= {max_attempts})"), stats.needs_review.to_string()),
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
            ("processed_last_hour", true),
        ]);
        for t in &stats.by_event_type {
            by_type.push(vec![
                t.event_type.clone(),
                t.unprocessed.to_string(),
                t.needs_review.to_string(),
                t.processed_last_hour.to_string(),
            ]);
        }
        text.push_str(&by_type.render());
    }
    emit(&text)
}

/// The gauges the worker exports, cheap enough for every few seconds: it reads only unprocessed
/// rows (`WHERE processed_at IS NULL`, the predicate of the partial index
/// `webhook_inbox_unprocessed`), never the processed history. All providers, as the claim.
/// `$1` max_attempts. Columns: unprocessed, oldest unprocessed age in seconds (0 when none),
/// needs_review (parked), ready.
pub const QUEUE_GAUGES_SQL: &str = "\
SELECT count(*) AS unprocessed,
       COALESCE(extract(epoch FROM now() - min(received_at))::float8, 0) AS oldest_unprocessed_age_seconds,
       count(*) FILTER (WHERE attempts >= $1) AS needs_review,
       count(*) FILTER (WHERE attempts < $1 AND available_at <= now()) AS ready
  FROM webhook_inbox
 WHERE processed_at IS NULL";

/// The queue gauges of [`QUEUE_GAUGES_SQL`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QueueGauges {
    pub unprocessed: i64,
    /// Seconds since the oldest unprocessed row was received; 0 when there is none.
    pub oldest_unprocessed_age_seconds: f64,
    /// Parked rows (`attempts >= max_attempts`).
    pub needs_review: i64,
    pub ready: i64,
}

/// Runs [`QUEUE_GAUGES_SQL`].
pub async fn queue_gauges(
    client: &(impl GenericClient + Sync),
    max_attempts: i32,
) -> Result<QueueGauges, tokio_postgres::Error> {
    let row = client.query_one(QUEUE_GAUGES_SQL, &[&max_attempts]).await?;
    Ok(QueueGauges {
        unprocessed: row.get(0),
        oldest_unprocessed_age_seconds: row.get(1),
        needs_review: row.get(2),
        ready: row.get(3),
    })
}

// ---------------------------------------------------------------------------------------------
// needs-review
// ---------------------------------------------------------------------------------------------

/// The parked rows, oldest first (`$1` provider, `$2` max_attempts, `$3` limit), `received_at`
/// as RFC 3339 text in UTC. The ORDER BY names `w.received_at`, the column, not the text alias.
pub const NEEDS_REVIEW_SQL: &str = "\
SELECT w.provider, w.endpoint, w.event_id, w.event_type, w.attempts, w.last_error,
       to_char(w.received_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') AS received_at
  FROM webhook_inbox AS w
 WHERE w.provider = $1 AND w.processed_at IS NULL AND w.attempts >= $2
 ORDER BY w.received_at, w.endpoint, w.event_id
 LIMIT $3";

/// A parked row, as `needs-review` lists it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ParkedRow {
    pub provider: String,
    pub endpoint: String,
    pub event_id: String,
    pub event_type: String,
    pub attempts: i32,
    pub last_error: Option<String>,
    /// RFC 3339, UTC.
    pub received_at: String,
}

/// Runs [`NEEDS_REVIEW_SQL`].
pub async fn parked_rows(
    client: &(impl GenericClient + Sync),
    max_attempts: i32,
    limit: i64,
) -> Result<Vec<ParkedRow>, tokio_postgres::Error> {
    let rows = client.query(NEEDS_REVIEW_SQL, &[&PROVIDER_STRIPE, &max_attempts, &limit]).await?;
    Ok(rows
        .iter()
        .map(|r| ParkedRow {
            provider: r.get(0),
            endpoint: r.get(1),
            event_id: r.get(2),
            event_type: r.get(3),
            attempts: r.get(4),
            last_error: r.get(5),
            received_at: r.get(6),
        })
        .collect())
}

/// The widest `last_error` shown in the table (JSON has it whole).
const TABLE_ERROR_WIDTH: usize = 80;

/// `inbox-worker needs-review`.
pub async fn needs_review(
    client: &mut tokio_postgres::Client,
    max_attempts: i32,
    args: &NeedsReviewArgs,
) -> anyhow::Result<()> {
    if args.limit < 1 {
        anyhow::bail!("--limit must be at least 1 (got {})", args.limit);
    }
    let rows =
        parked_rows(&*client, max_attempts, args.limit).await.map_err(db_error("listing the parked rows"))?;
    if args.output.json {
        #[derive(Serialize)]
        struct Report<'a> {
            rows: &'a [ParkedRow],
            count: usize,
        }
        return emit_json(&Report { rows: &rows, count: rows.len() });
    }
    if rows.is_empty() {
        return emit(&format!("no parked rows (none at {max_attempts} attempts or more)\n"));
    }
    let mut table = Table::new(&[
        ("provider", false),
        ("endpoint", false),
        ("event_id", false),
        ("event_type", false),
        ("attempts", true),
        ("received_at", false),
        ("last_error", false),
    ]);
    for r in &rows {
        table.push(vec![
            r.provider.clone(),
            r.endpoint.clone(),
            r.event_id.clone(),
            r.event_type.clone(),
            r.attempts.to_string(),
            r.received_at.clone(),
            r.last_error.as_deref().map_or_else(|| "-".to_owned(), |e| one_line(e, TABLE_ERROR_WIDTH)),
        ]);
    }
    let mut text = table.render();
    text.push_str(&format!("{} parked row{}", rows.len(), plural(rows.len())));
    if rows.len() as i64 == args.limit {
        text.push_str(&format!(" shown (the first {}; pass --limit for more)", args.limit));
    }
    text.push('\n');
    emit(&text)
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

// ---------------------------------------------------------------------------------------------
// Rows of one event id (requeue --event-id, replay)
// ---------------------------------------------------------------------------------------------

/// Locks the rows of one event id: every endpoint's, or only `$3`'s when not NULL (`$1`
/// provider, `$2` event_id). `processed_at` comes as RFC 3339 text in UTC, NULL when unprocessed.
/// FOR UPDATE: a worker processing the row holds its lock until it commits, so we see the
/// outcome (bounded by [`LOCK_TIMEOUT`]); nothing moves the row under us afterwards.
pub const LOCK_EVENT_SQL: &str = "\
SELECT endpoint, event_type, attempts, payload,
       to_char(processed_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') AS processed_at
  FROM webhook_inbox
 WHERE provider = $1 AND event_id = $2 AND ($3::text IS NULL OR endpoint = $3)
 ORDER BY endpoint
   FOR UPDATE";

/// A row of [`LOCK_EVENT_SQL`].
#[derive(Debug, Clone)]
struct EventRow {
    endpoint: String,
    event_type: String,
    attempts: i32,
    /// The stored payload as JSON text.
    payload: Box<serde_json::value::RawValue>,
    processed_at: Option<String>,
}

/// Runs [`LOCK_EVENT_SQL`] and returns the one row it designates, or refuses: no such event, or
/// the id is stored for several endpoints and none was named.
async fn lock_event(
    tx: &(impl GenericClient + Sync),
    event_id: &str,
    endpoint: Option<&str>,
) -> anyhow::Result<EventRow> {
    let rows = tx
        .query(LOCK_EVENT_SQL, &[&PROVIDER_STRIPE, &event_id, &endpoint])
        .await
        .map_err(db_error("looking up the event"))?;
    let mut rows: Vec<EventRow> = rows
        .iter()
        .map(|r| EventRow {
            endpoint: r.get(0),
            event_type: r.get(1),
            attempts: r.get(2),
            payload: r.get::<_, tokio_postgres::types::Json<_>>(3).0,
            processed_at: r.get(4),
        })
        .collect();
    match rows.len() {
        0 => match endpoint {
            Some(endpoint) => anyhow::bail!("no event {event_id} for endpoint {endpoint} in the inbox"),
            None => anyhow::bail!("no event {event_id} in the inbox"),
        },
        1 => Ok(rows.remove(0)),
        _ => {
            let endpoints: Vec<&str> = rows.iter().map(|r| r.endpoint.as_str()).collect();
            anyhow::bail!(
                "event {event_id} is stored for several endpoints ({}): pass --endpoint to choose one",
                endpoints.join(", ")
            )
        }
    }
}

// ---------------------------------------------------------------------------------------------
// requeue
// ---------------------------------------------------------------------------------------------

/// The parked rows `requeue --all` takes, locked, oldest first (a stable lock order, so two
/// concurrent requeues cannot deadlock): `$1` provider, `$2` max_attempts, `$3` event type or
/// NULL, `$4` a pattern `last_error` must contain (LIKE-escaped by the caller) or NULL.
pub const LOCK_PARKED_SQL: &str = "\
SELECT endpoint, event_id, event_type, attempts
  FROM webhook_inbox
 WHERE provider = $1 AND processed_at IS NULL AND attempts >= $2
   AND ($3::text IS NULL OR event_type = $3)
   AND ($4::text IS NULL OR last_error ILIKE '%' || $4 || '%')
 ORDER BY received_at, endpoint, event_id
   FOR UPDATE";

/// Puts rows back in the queue: attempts 0, available now; `last_error` is kept for history
/// (the next failure or the processing overwrites it). `$1` provider, `$2` endpoints and `$3`
/// event ids (parallel arrays: the rows locked before). Only unprocessed rows.
pub const REQUEUE_SQL: &str = "\
UPDATE webhook_inbox
   SET attempts = 0, available_at = now()
 WHERE provider = $1
   AND (endpoint, event_id) IN (SELECT * FROM unnest($2::text[], $3::text[]))
   AND processed_at IS NULL";

/// A row `requeue` takes: `attempts` is the count before the requeue.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequeueRow {
    pub endpoint: String,
    pub event_id: String,
    pub event_type: String,
    pub attempts: i32,
}

/// Runs [`LOCK_PARKED_SQL`].
async fn lock_parked(
    tx: &(impl GenericClient + Sync),
    max_attempts: i32,
    event_type: Option<&str>,
    error_pattern: Option<&str>,
) -> anyhow::Result<Vec<RequeueRow>> {
    let rows = tx
        .query(LOCK_PARKED_SQL, &[&PROVIDER_STRIPE, &max_attempts, &event_type, &error_pattern])
        .await
        .map_err(db_error("selecting the parked rows"))?;
    Ok(rows
        .iter()
        .map(|r| RequeueRow {
            endpoint: r.get(0),
            event_id: r.get(1),
            event_type: r.get(2),
            attempts: r.get(3),
        })
        .collect())
}

/// Runs [`REQUEUE_SQL`] on `rows`; returns how many changed.
async fn requeue_rows(tx: &(impl GenericClient + Sync), rows: &[RequeueRow]) -> anyhow::Result<u64> {
    let endpoints: Vec<&str> = rows.iter().map(|r| r.endpoint.as_str()).collect();
    let event_ids: Vec<&str> = rows.iter().map(|r| r.event_id.as_str()).collect();
    tx.execute(REQUEUE_SQL, &[&PROVIDER_STRIPE, &endpoints, &event_ids])
        .await
        .map_err(db_error("requeuing the rows"))
}

/// `inbox-worker requeue`.
///
/// `--event-id`: the row of that id (and `--endpoint`) when it is unprocessed — parked, or
/// waiting for a retry; a processed row is refused (that is `replay`). `--all`: every parked
/// row, narrowed by `--event-type` and `--error-contains`; the count is printed first, then all
/// are requeued in one transaction. The audit row is written in that transaction (also when
/// nothing matched: the attempt is worth seeing); `--dry-run` only lists.
pub async fn requeue(
    client: &mut tokio_postgres::Client,
    max_attempts: i32,
    args: &RequeueArgs,
) -> anyhow::Result<()> {
    let tx = client.transaction().await.map_err(db_error("starting a transaction"))?;
    set_limits(&tx).await?;
    let (rows, target) = match (&args.event_id, args.all) {
        (Some(event_id), false) => {
            let row = lock_event(&tx, event_id, args.endpoint.as_deref()).await?;
            if let Some(at) = &row.processed_at {
                anyhow::bail!(
                    "event {event_id} (endpoint {}) was processed at {at}; \
                     use `inbox-worker replay` to run it again",
                    row.endpoint
                );
            }
            let target = serde_json::json!({
                "provider": PROVIDER_STRIPE,
                "endpoint": row.endpoint,
                "event_id": event_id,
            });
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
            let rows = lock_parked(&tx, max_attempts, args.event_type.as_deref(), pattern.as_deref()).await?;
            let n = rows.len();
            let line = format!("{n} parked row{} match{}\n", plural(n), if n == 1 { "es" } else { "" });
            if args.output.json {
                // stdout carries only the JSON document; the count still comes first, for people.
                eprint!("{line}");
            } else {
                emit(&line)?;
            }
            let target = serde_json::json!({
                "provider": PROVIDER_STRIPE,
                "all": true,
                "max_attempts": max_attempts,
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
        let requeued = requeue_rows(&tx, &rows).await?;
        let id = insert_audit(&tx, &args.actor.actor, "requeue", &target, requeued)
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

// ---------------------------------------------------------------------------------------------
// replay
// ---------------------------------------------------------------------------------------------

/// Marks a replayed row processed again, in the handler's transaction (`$1` provider, `$2`
/// endpoint, `$3` event_id): `processed_at = now()` restarts its retention.
pub const REPLAY_MARK_SQL: &str = "\
UPDATE webhook_inbox
   SET processed_at = now(), last_error = NULL
 WHERE provider = $1 AND endpoint = $2 AND event_id = $3
   AND processed_at IS NOT NULL";

/// The `application_name` of the connection `replay` opens.
pub const OPS_APPLICATION_NAME: &str = "inbox-worker-ops";

/// `inbox-worker replay`: runs an already processed event's handler again, in one transaction
/// with the row locked, the row's `processed_at` renewed and the audit record. Handlers are
/// idempotent (forward-only transitions, unique business keys), so a replay repairs business
/// rows that went missing and never books twice. An event type without a handler has nothing
/// to apply and still counts as replayed. A handler error rolls everything back.
///
/// Handlers take a `deadpool_postgres::Transaction`, so this opens its own one-connection pool
/// from the connection settings rather than using a plain client.
pub async fn replay(database: &tokio_postgres::Config, args: &ReplayArgs) -> anyhow::Result<()> {
    let pool = build_pool(
        database.clone(),
        &PoolOptions {
            max_size: 1,
            timeout: Duration::from_secs(10),
            application_name: OPS_APPLICATION_NAME,
            statement_timeout: None,
            verify_on_checkout: true,
        },
    )?;
    let mut client = pool
        .get()
        .await
        .map_err(|e| anyhow::anyhow!("cannot connect to the database: {}", describe_pool_error(&e)))?;
    let tx = client.transaction().await.map_err(db_error("starting a transaction"))?;
    set_limits(&*tx).await?;
    let event_id = args.event_id.as_str();
    let row = lock_event(&*tx, event_id, args.endpoint.as_deref()).await?;
    if row.processed_at.is_none() {
        anyhow::bail!(
            "event {event_id} (endpoint {}) is not processed yet; requeue it instead \
             (`inbox-worker requeue --event-id {event_id}`) or let the workers take it",
            row.endpoint
        );
    }
    let event = InboxEvent::new(
        PROVIDER_STRIPE.to_owned(),
        row.endpoint.clone(),
        event_id.to_owned(),
        row.event_type.clone(),
        row.payload,
    );
    let registry = Registry::with_invoice_handlers();
    let outcome = match registry.get(&event.event_type) {
        Some(handler) => {
            if let Err(e) = handler(&tx, &event).await {
                let _ = tx.rollback().await;
                anyhow::bail!(
                    "replay of event {event_id} (endpoint {}, {}) failed, nothing changed: {e}",
                    event.endpoint,
                    event.event_type
                );
            }
            "applied"
        }
        None => "no handler",
    };
    tx.execute(REPLAY_MARK_SQL, &[&PROVIDER_STRIPE, &event.endpoint, &event_id])
        .await
        .map_err(db_error("marking the event processed"))?;
    let target = serde_json::json!({
        "provider": PROVIDER_STRIPE,
        "endpoint": event.endpoint,
        "event_id": event_id,
        "event_type": event.event_type,
        "handler": outcome,
    });
    let audit_id = insert_audit(&*tx, &args.actor.actor, "replay", &target, 1)
        .await
        .map_err(db_error("writing the audit record"))?;
    tx.commit().await.map_err(db_error("committing the replay"))?;

    if args.output.json {
        #[derive(Serialize)]
        struct Report<'a> {
            action: &'static str,
            endpoint: &'a str,
            event_id: &'a str,
            event_type: &'a str,
            handler: &'static str,
        }
        return emit_json(&Report {
            action: "replay",
            endpoint: &event.endpoint,
            event_id,
            event_type: &event.event_type,
            handler: outcome,
        });
    }
    let what = match outcome {
        "applied" => "handler applied",
        _ => "no handler for this event type: nothing to apply",
    };
    emit(&format!(
        "replayed event {event_id} (endpoint {}, {}): {what}; audit record {audit_id}\n",
        event.endpoint, event.event_type
    ))
}

// ---------------------------------------------------------------------------------------------
// purge
// ---------------------------------------------------------------------------------------------

/// Stripe retries a delivery for up to 3 days: a row purged sooner would not stop a redelivery
/// of its event from being applied again.
pub const STRIPE_RETRY_WINDOW: Duration = Duration::from_secs(3 * 24 * 3600);

/// The purge cutoff, computed once so every batch agrees: `now() - $1 seconds`, and the same as
/// RFC 3339 text in UTC (for the output and the audit record).
pub const PURGE_CUTOFF_SQL: &str = "\
SELECT c.cutoff, to_char(c.cutoff AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')
  FROM (SELECT now() - make_interval(secs => $1) AS cutoff) AS c";

/// How many rows a purge would delete (`--dry-run`): processed before `$2` (`$1` provider).
pub const PURGE_COUNT_SQL: &str = "\
SELECT count(*)
  FROM webhook_inbox
 WHERE provider = $1 AND processed_at IS NOT NULL AND processed_at < $2";

/// One purge batch, one autocommit statement (its own transaction, so a long purge holds no
/// locks for long and leaves vacuum free to clean behind it): up to `$3` rows processed before
/// `$2` (`$1` provider). Unprocessed rows are never touched. SKIP LOCKED: a row someone else
/// holds (a replay) is left for the next purge.
pub const PURGE_BATCH_SQL: &str = "\
DELETE FROM webhook_inbox
 WHERE (provider, endpoint, event_id) IN (
        SELECT provider, endpoint, event_id
          FROM webhook_inbox
         WHERE provider = $1 AND processed_at IS NOT NULL AND processed_at < $2
         LIMIT $3
           FOR UPDATE SKIP LOCKED)";

/// `inbox-worker purge`: deletes processed rows older than `--older-than` in batches until a
/// batch deletes nothing, then writes one audit record with the total. Refuses an age under
/// [`STRIPE_RETRY_WINDOW`] unless `--force`.
pub async fn purge(client: &mut tokio_postgres::Client, args: &PurgeArgs) -> anyhow::Result<()> {
    let older_than = humantime::format_duration(args.older_than).to_string();
    if args.older_than < STRIPE_RETRY_WINDOW && !args.force {
        anyhow::bail!(
            "--older-than {older_than} is under Stripe's 3-day retry window: a redelivery after the \
             purge would be applied again; pass --force to do it anyway"
        );
    }
    let seconds = args.older_than.as_secs_f64();
    let row = client
        .query_one(PURGE_CUTOFF_SQL, &[&seconds])
        .await
        .map_err(db_error("computing the purge cutoff"))?;
    let cutoff: SystemTime = row.get(0);
    let cutoff_text: String = row.get(1);

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
        cutoff: &'a str,
        older_than_seconds: u64,
    }

    if args.dry_run {
        let matched: i64 = client
            .query_one(PURGE_COUNT_SQL, &[&PROVIDER_STRIPE, &cutoff])
            .await
            .map_err(db_error("counting the rows to purge"))?
            .get(0);
        if args.output.json {
            return emit_json(&Report {
                action: "purge",
                dry_run: true,
                matched: Some(matched),
                deleted: None,
                batches: None,
                cutoff: &cutoff_text,
                older_than_seconds: args.older_than.as_secs(),
            });
        }
        return emit(&format!(
            "dry run: {matched} processed row{} older than {older_than} (processed before {cutoff_text}) \
             would be deleted; nothing changed\n",
            plural(matched as usize)
        ));
    }

    let mut target = serde_json::json!({
        "provider": PROVIDER_STRIPE,
        "older_than_seconds": args.older_than.as_secs(),
        "cutoff": cutoff_text,
        "batch_size": args.batch_size,
        "force": args.force,
    });
    let mut deleted = 0u64;
    let mut batches = 0u64;
    loop {
        match client.execute(PURGE_BATCH_SQL, &[&PROVIDER_STRIPE, &cutoff, &args.batch_size]).await {
            Ok(0) => break,
            Ok(n) => {
                deleted += n;
                batches += 1;
            }
            Err(e) => {
                // The batches before this one are committed: record them if the database lets us.
                if deleted > 0 {
                    target["incomplete"] = serde_json::Value::Bool(true);
                    let _ = insert_audit(&*client, &args.actor.actor, "purge", &target, deleted).await;
                }
                anyhow::bail!(
                    "purge stopped after deleting {deleted} row{} in {batches} batch{}: {}",
                    plural(deleted as usize),
                    if batches == 1 { "" } else { "es" },
                    describe_db_error(&e)
                );
            }
        }
    }
    let audit_id = insert_audit(&*client, &args.actor.actor, "purge", &target, deleted)
        .await
        .map_err(db_error("writing the audit record"))?;
    if args.output.json {
        return emit_json(&Report {
            action: "purge",
            dry_run: false,
            matched: None,
            deleted: Some(deleted),
            batches: Some(batches),
            cutoff: &cutoff_text,
            older_than_seconds: args.older_than.as_secs(),
        });
    }
    emit(&format!(
        "deleted {deleted} processed row{} older than {older_than} (processed before {cutoff_text}) \
         in {batches} batch{}; audit record {audit_id}\n",
        plural(deleted as usize),
        if batches == 1 { "" } else { "es" }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn like_literal_escapes_wildcards_and_the_escape_character() {
        assert_eq!(like_literal("plain text"), "plain text");
        assert_eq!(like_literal("100%_done\\"), "100\\%\\_done\\\\");
    }

    #[test]
    fn one_line_flattens_and_cuts_on_characters() {
        assert_eq!(one_line("a\nb", 10), "a b");
        let long = "é".repeat(100);
        let cut = one_line(&long, 80);
        assert_eq!(cut.chars().count(), 80);
        assert!(cut.ends_with('…'));
    }

    #[test]
    fn tables_align_columns() {
        let mut t = Table::new(&[("name", false), ("n", true)]);
        t.push(vec!["a".into(), "10".into()]);
        t.push(vec!["longer".into(), "2".into()]);
        assert_eq!(t.render(), "name     n\na       10\nlonger   2\n");
    }

    #[test]
    fn the_retry_window_is_three_days() {
        assert_eq!(STRIPE_RETRY_WINDOW, humantime::parse_duration("3d").unwrap());
    }
}
