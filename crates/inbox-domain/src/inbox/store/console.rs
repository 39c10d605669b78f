//! What the operator console (`inbox-worker console`) reads that no command read before: the
//! queue's split the gauges leave out, the throughput and latency of the last hours, the parked
//! rows filtered and paged, one event whole, and the audit log. Its other figures come from the
//! statements the commands already run (`admin::queue_gauges`, `outbox::stats`,
//! `reconciliation::list`, …). Every statement here only reads.
//!
//! The console is read by people reloading a page, not scraped: each statement says what it
//! reads, and the console runs them in a read-only transaction with a statement timeout.

use serde::Serialize;
use tokio_postgres::types::{Json, ToSql, Type};
use tokio_postgres::GenericClient;

use crate::PROVIDER_STRIPE;

/// An RFC 3339 text in UTC of the timestamptz expression `$e` (a string literal, for `concat!`).
macro_rules! utc_text {
    ($e:literal) => {
        concat!("to_char(", $e, " AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')")
    };
}

// --------------------------------------------------------------------------------- overview

/// The figures of the overview that the queue gauges (`admin::QUEUE_GAUGES_SQL`, which gives
/// unprocessed, ready, parked, no_handler and the oldest age) do not split out: the rows in the
/// queue but not available now — *leased* (no failure recorded) and *retry_wait* (after a failure),
/// as `stats` splits them — and the parked rows the ingest held on arrival, per reason. All
/// providers, as the gauges. Reads only unprocessed rows: the first count the queue table (the
/// rows not available now, each one's `last_error` read from its inbox row by key), the second the
/// partial index `webhook_inbox_parked`; never the processed history.
pub const QUEUE_SPLIT_SQL: &str = concat!(
    "\
SELECT q.leased, q.retry_wait, p.held, p.held_unstorable, p.held_livemode
  FROM (SELECT count(*) FILTER (WHERE w.last_error IS NULL) AS leased,
               count(*) FILTER (WHERE w.last_error IS NOT NULL) AS retry_wait
          FROM webhook_inbox_queue AS q
          JOIN webhook_inbox AS w
               ON (w.provider, w.endpoint, w.event_id) = (q.provider, q.endpoint, q.event_id)
         WHERE q.available_at > now() AND ",
    waiting!("w."),
    ") AS q,
       (SELECT count(*) FILTER (WHERE held IS NOT NULL) AS held,
               count(*) FILTER (WHERE held = 'unstorable') AS held_unstorable,
               count(*) FILTER (WHERE held = 'livemode') AS held_livemode
          FROM webhook_inbox
         WHERE ",
    parked!(),
    ") AS p"
);

/// A row of [`QUEUE_SPLIT_SQL`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct QueueSplit {
    /// In the queue, leased by a worker, no failure recorded (in flight).
    pub leased: i64,
    /// In the queue, waiting for the backoff after a failure.
    pub retry_wait: i64,
    /// Parked rows the ingest held on arrival (a subset of the parked rows).
    pub held: i64,
    pub held_unstorable: i64,
    pub held_livemode: i64,
}

/// Runs [`QUEUE_SPLIT_SQL`].
pub async fn queue_split(client: &(impl GenericClient + Sync)) -> Result<QueueSplit, tokio_postgres::Error> {
    let r = client.query_typed_one(QUEUE_SPLIT_SQL, &[]).await?;
    Ok(QueueSplit {
        leased: r.get("leased"),
        retry_wait: r.get("retry_wait"),
        held: r.get("held"),
        held_unstorable: r.get("held_unstorable"),
        held_livemode: r.get("held_livemode"),
    })
}

/// The start of the charts' window: `$3` intervals of `$2` seconds back from the one in progress
/// (`date_bin` from the Unix epoch). A string literal, for `concat!`.
macro_rules! window_start {
    () => {
        "date_bin(make_interval(secs => $2), now(), 'epoch'::timestamptz) - make_interval(secs => $2 * ($3 - 1))"
    };
}

/// Throughput and latency per interval, for the overview's charts: `$3` intervals of `$2` seconds
/// (`date_bin` from the Unix epoch, the last one the interval in progress), and for each the
/// rows of `$1` (provider) processed in it, and the p50 and p95 of their time from receipt to
/// processing, in seconds (NULL for an interval without rows). Rows a person dismissed are left
/// out (closed unapplied: no processing to time). A replayed row counts when its replay
/// processed it, timed from its first receipt (replay renews `processed_at`, not `received_at`):
/// a replay of old events shows as a latency peak, which is what it was for the handlers.
///
/// Plan: a sequential scan of `webhook_inbox` keeping the rows processed since the first
/// interval's start (a filter of the scan), one sort of them by interval, and a merge with the
/// intervals (`generate_series`, so that an interval without rows still has its bar) computing
/// the count and both percentiles in one pass per interval. There is no index on `processed_at`
/// nor on `received_at` for processed rows (one would cost every processed mark an index
/// insertion: see `admin::PURGE_BATCH_SQL`), so the scan reads the whole table — the processed
/// history `purge` keeps (30 days by default) — as `stats` does: about 250 ms for 200,000 rows of
/// 1 KB payloads (550 MB at fillfactor 50), linear in the table. The console runs it under its
/// statement timeout and keeps the result for half a minute, so operators reloading the overview
/// do not each scan the table.
pub const THROUGHPUT_SQL: &str = concat!(
    "\
WITH intervals AS (
    SELECT generate_series(",
    window_start!(),
    ", date_bin(make_interval(secs => $2), now(), 'epoch'::timestamptz),
                           make_interval(secs => $2)) AS start
), processed AS (
    SELECT date_bin(make_interval(secs => $2), processed_at, 'epoch'::timestamptz) AS start,
           extract(epoch FROM processed_at - received_at)::float8 AS latency
      FROM webhook_inbox
     WHERE provider = $1 AND dismissed_at IS NULL AND processed_at >= ",
    window_start!(),
    "
)
SELECT ",
    utc_text!("i.start"),
    " AS start,
       count(p.latency) AS processed,
       percentile_cont(ARRAY[0.5, 0.95]::float8[]) WITHIN GROUP (ORDER BY p.latency) AS percentiles
  FROM intervals AS i
  LEFT JOIN processed AS p ON p.start = i.start
 GROUP BY i.start
 ORDER BY i.start"
);

/// One interval of [`THROUGHPUT_SQL`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ThroughputInterval {
    /// The interval's start, RFC 3339, UTC.
    pub start: String,
    /// Rows processed in it.
    pub processed: i64,
    /// Median seconds from receipt to processing; None without rows.
    pub p50_seconds: Option<f64>,
    /// 95th percentile of the same; None without rows.
    pub p95_seconds: Option<f64>,
}

/// Runs [`THROUGHPUT_SQL`]: `intervals` of `interval_seconds`, oldest first.
pub async fn throughput(
    client: &(impl GenericClient + Sync),
    interval_seconds: f64,
    intervals: i32,
) -> Result<Vec<ThroughputInterval>, tokio_postgres::Error> {
    let params: [(&(dyn ToSql + Sync), Type); 3] =
        [(&PROVIDER_STRIPE, Type::TEXT), (&interval_seconds, Type::FLOAT8), (&intervals, Type::INT4)];
    let rows = client.query_typed(THROUGHPUT_SQL, &params).await?;
    Ok(rows
        .iter()
        .map(|r| {
            let percentiles: Option<Vec<Option<f64>>> = r.get("percentiles");
            let at = |i: usize| percentiles.as_ref().and_then(|p| p.get(i).copied().flatten());
            ThroughputInterval {
                start: r.get("start"),
                processed: r.get("processed"),
                p50_seconds: at(0),
                p95_seconds: at(1),
            }
        })
        .collect())
}

// ------------------------------------------------------------------------------ needs review

/// Which held rows a needs-review listing keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HeldFilter {
    /// Held as unstorable (the body is in `raw_body`).
    Unstorable,
    /// Held because its livemode disagrees with the endpoint's.
    Livemode,
    /// Held for any reason.
    Any,
    /// Not held: parked by a worker.
    None,
}

impl HeldFilter {
    /// The filter's name, as the console's `held` parameter and [`REVIEW_PAGE_SQL`]'s `$4` say it.
    pub fn as_str(self) -> &'static str {
        match self {
            HeldFilter::Unstorable => "unstorable",
            HeldFilter::Livemode => "livemode",
            HeldFilter::Any => "any",
            HeldFilter::None => "none",
        }
    }

    /// The filter named `name` ([`HeldFilter::as_str`]).
    pub fn parse(name: &str) -> Option<HeldFilter> {
        [HeldFilter::Unstorable, HeldFilter::Livemode, HeldFilter::Any, HeldFilter::None]
            .into_iter()
            .find(|h| h.as_str() == name)
    }
}

/// The filters of the console's needs-review list (and of its "requeue the filtered set"): each
/// None keeps every row.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ReviewFilter {
    /// This event type exactly.
    pub event_type: Option<String>,
    /// This endpoint exactly.
    pub endpoint: Option<String>,
    pub held: Option<HeldFilter>,
    /// Text `last_error` contains, whatever its case (taken literally: `%` and `_` are no
    /// wildcards).
    pub error_contains: Option<String>,
    /// Received more than this many seconds ago.
    pub older_than_seconds: Option<f64>,
    /// The connected account the event names (`account`, or a thin event's `context`), exactly.
    pub account: Option<String>,
}

/// How many parked rows match the filters of `parked_filters!` (`matching`), and how many of them
/// were not held on arrival (`not_held`: what a requeue of the set takes — it leaves held rows,
/// each a person's decision). Reads the partial index `webhook_inbox_parked` (the parked rows
/// only, however large the processed history) and the rows it points to, for the filters'
/// columns; the account filter reads their payloads.
pub const REVIEW_COUNT_SQL: &str = concat!(
    "SELECT count(*) AS matching, count(*) FILTER (WHERE held IS NULL) AS not_held
  FROM webhook_inbox
 WHERE ",
    parked_filters!("now()")
);

/// What [`REVIEW_COUNT_SQL`] counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ReviewCount {
    pub matching: i64,
    /// Of those, the rows not held on arrival.
    pub not_held: i64,
}

/// One page of the parked rows matching the filters of `parked_filters!`, oldest first —
/// `(received_at, endpoint, event_id)`, the provider being fixed — `$8` rows after the first `$9`.
/// Times as RFC 3339 text in UTC, the account and livemode read from the payload as
/// `admin::PARKED_ROWS_SQL` reads them.
///
/// Plan: `page` walks `webhook_inbox_parked` in `received_at` order (an incremental sort breaks
/// the ties by endpoint and event id), filters, skips `$9` rows and keeps `$8`, carrying only the
/// key columns; the page's rows are then read whole by primary key. So the payloads of the rows
/// skipped are never read — with 10,000 parked rows, the last page costs one walk of the small
/// index and its rows' heap tuples, and 50 payloads.
pub const REVIEW_PAGE_SQL: &str = concat!(
    "\
WITH page AS (
    SELECT provider, endpoint, event_id, received_at
      FROM webhook_inbox
     WHERE ",
    parked_filters!("now()"),
    "
     ORDER BY received_at, endpoint, event_id
     LIMIT $8 OFFSET $9
)
SELECT w.endpoint, w.event_id, w.event_type, w.attempts, w.last_error, w.held,
       ",
    utc_text!("w.received_at"),
    " AS received_at,
       ",
    utc_text!("w.parked_at"),
    " AS parked_at,
       CASE jsonb_typeof(w.payload->'livemode') WHEN 'boolean' THEN (w.payload->'livemode')::boolean END
           AS livemode,
       ",
    event_account!("w."),
    " AS account
  FROM page AS p
  JOIN webhook_inbox AS w ON (w.provider, w.endpoint, w.event_id) = (p.provider, p.endpoint, p.event_id)
 ORDER BY p.received_at, p.endpoint, p.event_id"
);

/// A row of [`REVIEW_PAGE_SQL`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReviewRow {
    pub endpoint: String,
    pub event_id: String,
    pub event_type: String,
    pub attempts: i32,
    pub last_error: Option<String>,
    /// Why the ingest parked it on arrival (`unstorable`, `livemode`); None when a worker did.
    pub held: Option<String>,
    /// RFC 3339, UTC.
    pub received_at: String,
    /// RFC 3339, UTC.
    pub parked_at: String,
    pub livemode: Option<bool>,
    pub account: Option<String>,
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

impl ReviewFilter {
    /// The store's filter of parked rows for these filters, `error_pattern` being
    /// [`like_literal`] of `error_contains` (owned by the caller, so that the filter can borrow it).
    pub fn parked<'a>(&'a self, error_pattern: Option<&'a str>) -> super::admin::ParkedFilter<'a> {
        super::admin::ParkedFilter {
            event_type: self.event_type.as_deref(),
            error_pattern,
            endpoint: self.endpoint.as_deref(),
            held: self.held.map(HeldFilter::as_str),
            older_than_seconds: self.older_than_seconds,
            account: self.account.as_deref(),
        }
    }
}

/// Runs [`REVIEW_COUNT_SQL`].
pub async fn review_count(
    client: &(impl GenericClient + Sync),
    filter: &ReviewFilter,
) -> Result<ReviewCount, tokio_postgres::Error> {
    let error = filter.error_contains.as_deref().map(like_literal);
    let row = client.query_typed_one(REVIEW_COUNT_SQL, &filter.parked(error.as_deref()).params()).await?;
    Ok(ReviewCount { matching: row.get("matching"), not_held: row.get("not_held") })
}

/// Runs [`REVIEW_PAGE_SQL`]: up to `limit` rows after the first `offset`.
pub async fn review_page(
    client: &(impl GenericClient + Sync),
    filter: &ReviewFilter,
    limit: i64,
    offset: i64,
) -> Result<Vec<ReviewRow>, tokio_postgres::Error> {
    let error = filter.error_contains.as_deref().map(like_literal);
    let parked = filter.parked(error.as_deref());
    let mut params: Vec<(&(dyn ToSql + Sync), Type)> = parked.params().to_vec();
    params.push((&limit, Type::INT8));
    params.push((&offset, Type::INT8));
    let rows = client.query_typed(REVIEW_PAGE_SQL, &params).await?;
    Ok(rows
        .iter()
        .map(|r| ReviewRow {
            endpoint: r.get("endpoint"),
            event_id: r.get("event_id"),
            event_type: r.get("event_type"),
            attempts: r.get("attempts"),
            last_error: r.get("last_error"),
            held: r.get("held"),
            received_at: r.get("received_at"),
            parked_at: r.get("parked_at"),
            livemode: r.get("livemode"),
            account: r.get("account"),
        })
        .collect())
}

// --------------------------------------------------------------------------------- one event

/// One row whole (`$1` provider, `$2` endpoint, `$3` event id), by primary key: its state, its
/// provenance, what the event says of itself, and its payload — or, for a row held as
/// unstorable, the bytes as received (`raw_body`, only then: a row kept with `--keep-raw` has them
/// too, but its payload says the same). Times as RFC 3339 text in UTC; the signature's `t` also as
/// text.
pub const EVENT_SQL: &str = concat!(
    "\
SELECT provider, endpoint, event_id, event_type, source, attempts, interruptions, last_error, held,
       ",
    utc_text!("received_at"),
    " AS received_at,
       ",
    utc_text!("available_at"),
    " AS available_at,
       ",
    utc_text!("processed_at"),
    " AS processed_at,
       ",
    utc_text!("parked_at"),
    " AS parked_at,
       ",
    utc_text!("dismissed_at"),
    " AS dismissed_at,
       secret_position, secret_fingerprint, signature_t,
       ",
    utc_text!("to_timestamp(signature_t)"),
    " AS signed_at,
       CASE jsonb_typeof(payload->'livemode') WHEN 'boolean' THEN (payload->'livemode')::boolean END
           AS livemode,
       ",
    event_account!(""),
    " AS account,
       CASE jsonb_typeof(payload->'api_version') WHEN 'string' THEN payload->>'api_version' END
           AS api_version,
       payload,
       CASE WHEN payload IS NULL THEN raw_body END AS raw_body,
       octet_length(raw_body) AS raw_body_bytes
  FROM webhook_inbox
 WHERE provider = $1 AND endpoint = $2 AND event_id = $3"
);

/// A row of [`EVENT_SQL`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventDetail {
    pub provider: String,
    pub endpoint: String,
    pub event_id: String,
    pub event_type: String,
    /// How the row reached the inbox: `webhook` (the ingest) or `api` (`reconcile`).
    pub source: String,
    pub attempts: i32,
    pub interruptions: i32,
    pub last_error: Option<String>,
    /// Why the ingest parked it on arrival (`unstorable`, `livemode`).
    pub held: Option<String>,
    /// RFC 3339, UTC, as every time below.
    pub received_at: String,
    pub available_at: String,
    pub processed_at: Option<String>,
    pub parked_at: Option<String>,
    pub dismissed_at: Option<String>,
    /// Which of the endpoint's secrets verified it (position from 0, fingerprint); None before
    /// provenance was recorded, and for rows `reconcile` fetched.
    pub secret_position: Option<i16>,
    pub secret_fingerprint: Option<String>,
    /// The signature's `t` (Unix seconds), and as RFC 3339.
    pub signature_t: Option<i64>,
    pub signed_at: Option<String>,
    pub livemode: Option<bool>,
    pub account: Option<String>,
    pub api_version: Option<String>,
    /// The stored payload; None for a row held as unstorable.
    pub payload: Option<serde_json::Value>,
    /// The body as received, for a row without a payload only.
    pub raw_body: Option<Vec<u8>>,
    /// Bytes kept in `raw_body` (an unstorable body, or `--keep-raw`).
    pub raw_body_bytes: Option<i32>,
}

/// Runs [`EVENT_SQL`]; None when there is no such row.
pub async fn event(
    client: &(impl GenericClient + Sync),
    endpoint: &str,
    event_id: &str,
) -> Result<Option<EventDetail>, tokio_postgres::Error> {
    let params: [(&(dyn ToSql + Sync), Type); 3] =
        [(&PROVIDER_STRIPE, Type::TEXT), (&endpoint, Type::TEXT), (&event_id, Type::TEXT)];
    let row = client.query_typed_opt(EVENT_SQL, &params).await?;
    Ok(row.map(|r| EventDetail {
        provider: r.get("provider"),
        endpoint: r.get("endpoint"),
        event_id: r.get("event_id"),
        event_type: r.get("event_type"),
        source: r.get("source"),
        attempts: r.get("attempts"),
        interruptions: r.get("interruptions"),
        last_error: r.get("last_error"),
        held: r.get("held"),
        received_at: r.get("received_at"),
        available_at: r.get("available_at"),
        processed_at: r.get("processed_at"),
        parked_at: r.get("parked_at"),
        dismissed_at: r.get("dismissed_at"),
        secret_position: r.get("secret_position"),
        secret_fingerprint: r.get("secret_fingerprint"),
        signature_t: r.get("signature_t"),
        signed_at: r.get("signed_at"),
        livemode: r.get("livemode"),
        account: r.get("account"),
        api_version: r.get("api_version"),
        payload: r.get::<_, Option<Json<serde_json::Value>>>("payload").map(|p| p.0),
        raw_body: r.get("raw_body"),
        raw_body_bytes: r.get("raw_body_bytes"),
    }))
}

// ------------------------------------------------------------------------------------ audit

/// The audit records that name one event (`$1` endpoint, `$2` event id), oldest first: those
/// whose target has that `event_id` and that endpoint, or no endpoint (requeue, replay, dismiss
/// of one event write both). The records of a batch run (`requeue --all`, a bulk replay, a purge)
/// name their filters, not each row, and are not among them. `operator_audit` holds a record per
/// operator change, a small table: a sequential scan, no expression index on `target`.
pub const EVENT_AUDIT_SQL: &str = concat!(
    "\
SELECT id, ",
    utc_text!("at"),
    " AS at, actor, action, target, affected
  FROM operator_audit
 WHERE target->>'event_id' = $2
   AND (target->>'endpoint' IS NULL OR target->>'endpoint' = $1)
 ORDER BY id"
);

/// The audit log, newest first: `$1` records after the first `$2`. A walk of the primary key
/// backwards, stopping at the page's end.
pub const AUDIT_PAGE_SQL: &str = concat!(
    "\
SELECT id, ",
    utc_text!("at"),
    " AS at, actor, action, target, affected
  FROM operator_audit
 ORDER BY id DESC
 LIMIT $1 OFFSET $2"
);

/// How many audit records there are (a count of the small table).
pub const AUDIT_COUNT_SQL: &str = "SELECT count(*) FROM operator_audit";

/// An `operator_audit` record.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AuditRecord {
    pub id: i64,
    /// RFC 3339, UTC.
    pub at: String,
    pub actor: String,
    pub action: String,
    pub target: serde_json::Value,
    pub affected: i32,
}

fn audit_records(rows: &[tokio_postgres::Row]) -> Vec<AuditRecord> {
    rows.iter()
        .map(|r| AuditRecord {
            id: r.get("id"),
            at: r.get("at"),
            actor: r.get("actor"),
            action: r.get("action"),
            target: r.get::<_, Json<serde_json::Value>>("target").0,
            affected: r.get("affected"),
        })
        .collect()
}

/// Runs [`EVENT_AUDIT_SQL`].
pub async fn event_audit(
    client: &(impl GenericClient + Sync),
    endpoint: &str,
    event_id: &str,
) -> Result<Vec<AuditRecord>, tokio_postgres::Error> {
    let params: [(&(dyn ToSql + Sync), Type); 2] = [(&endpoint, Type::TEXT), (&event_id, Type::TEXT)];
    Ok(audit_records(&client.query_typed(EVENT_AUDIT_SQL, &params).await?))
}

/// Runs [`AUDIT_PAGE_SQL`].
pub async fn audit_page(
    client: &(impl GenericClient + Sync),
    limit: i64,
    offset: i64,
) -> Result<Vec<AuditRecord>, tokio_postgres::Error> {
    let params: [(&(dyn ToSql + Sync), Type); 2] = [(&limit, Type::INT8), (&offset, Type::INT8)];
    Ok(audit_records(&client.query_typed(AUDIT_PAGE_SQL, &params).await?))
}

/// Runs [`AUDIT_COUNT_SQL`].
pub async fn audit_count(client: &(impl GenericClient + Sync)) -> Result<i64, tokio_postgres::Error> {
    Ok(client.query_typed_one(AUDIT_COUNT_SQL, &[]).await?.get(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_held_filters_read_back_their_names() {
        for h in [HeldFilter::Unstorable, HeldFilter::Livemode, HeldFilter::Any, HeldFilter::None] {
            assert_eq!(HeldFilter::parse(h.as_str()), Some(h));
        }
        assert_eq!(HeldFilter::parse("all"), None);
    }

    #[test]
    fn the_error_filter_is_taken_literally() {
        assert_eq!(like_literal(r"50% of a_b\c"), r"50\% of a\_b\\c");
    }

    #[test]
    fn the_count_and_the_page_filter_alike() {
        let count = REVIEW_COUNT_SQL.split_once("\n WHERE ").unwrap().1;
        assert!(REVIEW_PAGE_SQL.contains(count), "{REVIEW_PAGE_SQL}");
    }
}
