//! What operators read and change, and the queue gauges the workers export.
//!
//! The operator statements work on the rows of one provider (`stripe`, the only provider this
//! service stores); [`QUEUE_GAUGES_SQL`] covers the whole queue, as the claim does. Every change
//! an operator makes is recorded with [`INSERT_AUDIT_SQL`].

use std::time::SystemTime;

use serde::Serialize;
use tokio_postgres::types::{Json, ToSql, Type};
use tokio_postgres::GenericClient;

use crate::PROVIDER_STRIPE;

// ------------------------------------------------------------------------------------ stats

/// The queue's health in one statement: the grand total (`total = true`, `event_type` NULL) and
/// one row per event type (`GROUPING SETS`). `$1` provider. Only rows that are unprocessed or were
/// processed in the last hour are read into the groups, so an event type shows only when it has
/// something to report; finding the recently processed rows still reads the table (there is no
/// index on `processed_at`): this is for operators, not for a scrape every few seconds — the
/// worker's metrics use [`QUEUE_GAUGES_SQL`].
pub const STATS_SQL: &str = concat!(
    "\
SELECT GROUPING(event_type) = 1 AS total,
       event_type,
       count(*) FILTER (WHERE processed_at IS NULL) AS unprocessed,
       count(*) FILTER (WHERE ",
    ready!(),
    ") AS ready,
       count(*) FILTER (WHERE ",
    waiting!(),
    " AND last_error IS NULL) AS leased,
       count(*) FILTER (WHERE ",
    waiting!(),
    " AND last_error IS NOT NULL) AS retry_wait,
       count(*) FILTER (WHERE ",
    parked!(),
    ") AS needs_review,
       extract(epoch FROM now() - min(received_at) FILTER (WHERE processed_at IS NULL))::float8
           AS oldest_unprocessed_age_seconds,
       count(*) FILTER (WHERE processed_at >= now() - interval '1 hour') AS processed_last_hour
  FROM webhook_inbox
 WHERE provider = $1
   AND (processed_at IS NULL OR processed_at >= now() - interval '1 hour')
 GROUP BY GROUPING SETS ((), (event_type))
 ORDER BY total DESC, event_type"
);

/// What `stats` reports (also its JSON document). Ready, leased, retry_wait and needs_review
/// partition the unprocessed rows (see the store's "The states of a row"), except that the ready
/// rows of types no live worker claims are counted in `no_handler` instead of `ready`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Stats {
    pub unprocessed: i64,
    pub ready: i64,
    /// In flight: leased by a worker, no failure recorded.
    pub leased: i64,
    /// Waiting for the backoff after a failure.
    pub retry_wait: i64,
    /// Parked by a worker, waiting for an operator.
    pub needs_review: i64,
    /// Age of the oldest unprocessed row (since it was received); None when there is none.
    pub oldest_unprocessed_age_seconds: Option<f64>,
    pub processed_last_hour: i64,
    /// Rows in the queue (not parked) of types no live worker claims: they wait for a worker with
    /// a handler (or an `--ignore`). 0 when no worker is live (nobody can tell).
    pub no_handler: i64,
    pub by_event_type: Vec<EventTypeStats>,
    /// Rows per endpoint and verifying secret ([`SECRETS_SQL`]).
    pub by_secret: Vec<SecretStats>,
    /// The workers seen in the last minute, and what they claim.
    pub workers: Vec<super::workers::WorkerRow>,
}

/// `stats` of one event type.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventTypeStats {
    pub event_type: String,
    pub unprocessed: i64,
    pub needs_review: i64,
    /// Of the unprocessed rows, those in the queue when no live worker claims the type.
    pub no_handler: i64,
    pub processed_last_hour: i64,
}

/// The rows each signing secret verified (`$1` provider), per endpoint and secret, in total and in
/// the last 24 hours, with the last one received: during a secret roll, the old secret is safe to
/// remove once it verified nothing for a day. Rows stored before provenance was recorded are not
/// counted. Reads the whole table, like [`STATS_SQL`].
pub const SECRETS_SQL: &str = "\
SELECT endpoint, secret_position, secret_fingerprint,
       count(*) AS rows,
       count(*) FILTER (WHERE received_at >= now() - interval '24 hours') AS rows_last_24h,
       to_char(max(received_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') AS last_received_at
  FROM webhook_inbox
 WHERE provider = $1 AND secret_fingerprint IS NOT NULL
 GROUP BY endpoint, secret_position, secret_fingerprint
 ORDER BY endpoint, secret_position, secret_fingerprint";

/// The rows one secret verified, as [`SECRETS_SQL`] counts them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SecretStats {
    pub endpoint: String,
    /// Position of the secret in the endpoint's list when the rows were stored, from 0.
    pub position: i16,
    /// The secret's fingerprint (first 8 hex digits of its SHA-256).
    pub fingerprint: String,
    pub rows: i64,
    pub rows_last_24h: i64,
    /// RFC 3339, UTC.
    pub last_received_at: String,
}

/// Runs [`STATS_SQL`].
pub async fn stats(client: &(impl GenericClient + Sync)) -> Result<Stats, tokio_postgres::Error> {
    let rows = client.query_typed(STATS_SQL, &[(&PROVIDER_STRIPE, Type::TEXT)]).await?;
    let mut stats = Stats {
        unprocessed: 0,
        ready: 0,
        leased: 0,
        retry_wait: 0,
        needs_review: 0,
        oldest_unprocessed_age_seconds: None,
        processed_last_hour: 0,
        no_handler: 0,
        by_event_type: Vec::new(),
        by_secret: Vec::new(),
        workers: super::workers::live(client).await?,
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
            let event_type: String = row.get("event_type");
            let (unprocessed, needs_review): (i64, i64) = (row.get("unprocessed"), row.get("needs_review"));
            let no_handler = if super::workers::claimed(&stats.workers, &event_type) {
                0
            } else {
                // Ready, as the gauges and KEDA count it, is what a live worker would take.
                stats.ready -= row.get::<_, i64>("ready");
                unprocessed - needs_review
            };
            stats.no_handler += no_handler;
            stats.by_event_type.push(EventTypeStats {
                event_type,
                unprocessed,
                needs_review,
                no_handler,
                processed_last_hour: row.get("processed_last_hour"),
            });
        }
    }
    stats.by_secret = client
        .query_typed(SECRETS_SQL, &[(&PROVIDER_STRIPE, Type::TEXT)])
        .await?
        .iter()
        .map(|r| SecretStats {
            endpoint: r.get("endpoint"),
            position: r.get("secret_position"),
            fingerprint: r.get("secret_fingerprint"),
            rows: r.get("rows"),
            rows_last_24h: r.get("rows_last_24h"),
            last_received_at: r.get("last_received_at"),
        })
        .collect();
    Ok(stats)
}

/// The gauges the worker exports, cheap enough for every few seconds: it reads only unprocessed
/// rows — the queue table (see the store's "The queue table") grouped by type, and the parked rows
/// through `webhook_inbox_parked` —, never the processed history. All providers, as the claim. The
/// rows in the queue are counted per type first, so that whether a live worker claims a type is
/// asked once per type, not once per row: `ready` counts the ready rows some live worker claims
/// (what more workers would take now), `no_handler` the rows in the queue no live worker claims.
pub const QUEUE_GAUGES_SQL: &str = concat!(
    "\
WITH queue AS (
    SELECT event_type, count(*) AS rows, count(*) FILTER (WHERE available_at <= now()) AS ready,
           min(received_at) AS oldest
      FROM webhook_inbox_queue
     GROUP BY event_type
), typed AS (
    SELECT q.*, ",
    claimed_by_a_live_worker!("q.event_type"),
    " AS claimed
      FROM queue AS q
), parked AS (
    SELECT count(*) AS rows, min(received_at) AS oldest
      FROM webhook_inbox
     WHERE ",
    parked!(),
    "
)
SELECT (SELECT COALESCE(sum(rows), 0) FROM typed)::int8 + parked.rows AS unprocessed,
       COALESCE(extract(epoch FROM now() - least((SELECT min(oldest) FROM typed), parked.oldest))::float8, 0)
           AS oldest_unprocessed_age_seconds,
       parked.rows AS needs_review,
       (SELECT COALESCE(sum(ready), 0) FROM typed WHERE claimed)::int8 AS ready,
       (SELECT COALESCE(sum(rows), 0) FROM typed WHERE NOT claimed)::int8 AS no_handler
  FROM parked"
);

/// What KEDA scales the workers on (`deploy/k8s/base/worker-scaledobject.yaml`, on one line): the
/// `ready` of [`QUEUE_GAUGES_SQL`] — ready rows a live worker claims, read from the queue table.
/// Rows of types no worker handles are left out: more workers of the same binaries would not take
/// them either.
pub const KEDA_READY_SQL: &str = concat!(
    "SELECT COALESCE(sum(n), 0)::int8 FROM (SELECT event_type, count(*) AS n FROM webhook_inbox_queue ",
    "WHERE available_at <= now() GROUP BY event_type) AS q WHERE ",
    claimed_by_a_live_worker!("q.event_type")
);

/// The queue gauges of [`QUEUE_GAUGES_SQL`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QueueGauges {
    pub unprocessed: i64,
    /// Seconds since the oldest unprocessed row was received; 0 when there is none.
    pub oldest_unprocessed_age_seconds: f64,
    /// Parked rows.
    pub needs_review: i64,
    /// Ready rows a live worker claims.
    pub ready: i64,
    /// Rows in the queue (not parked) of types no live worker claims: they wait for a worker that
    /// handles them (or an `--ignore`).
    pub no_handler: i64,
}

/// Runs [`QUEUE_GAUGES_SQL`].
pub async fn queue_gauges(
    client: &(impl GenericClient + Sync),
) -> Result<QueueGauges, tokio_postgres::Error> {
    Ok(QueueGauges::from_row(&client.query_typed_one(QUEUE_GAUGES_SQL, &[]).await?))
}

impl QueueGauges {
    /// The gauges from a row with their five columns by name ([`QUEUE_GAUGES_SQL`], and the
    /// shared figures of `store::gauges`).
    pub fn from_row(row: &tokio_postgres::Row) -> Self {
        QueueGauges {
            unprocessed: row.get("unprocessed"),
            oldest_unprocessed_age_seconds: row.get("oldest_unprocessed_age_seconds"),
            needs_review: row.get("needs_review"),
            ready: row.get("ready"),
            no_handler: row.get("no_handler"),
        }
    }
}

// ----------------------------------------------------------------------------- parked rows

/// The parked rows, oldest first (`$1` provider, `$2` limit), `received_at` and `parked_at` as
/// RFC 3339 text in UTC, with what the event says of itself — `livemode`, the connected account
/// (`account`, or a thin event's `context`), `api_version` — read from the payload (NULL when it
/// does not say, and for an unstorable row, which has no payload). The ORDER BY names `w.received_at`, the column, not the text alias; it is
/// the key of the partial index `webhook_inbox_parked`.
pub const PARKED_ROWS_SQL: &str = concat!(
    "\
SELECT w.provider, w.endpoint, w.event_id, w.event_type, w.attempts, w.last_error, w.held,
       to_char(w.received_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') AS received_at,
       to_char(w.parked_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') AS parked_at,
       CASE jsonb_typeof(w.payload->'livemode') WHEN 'boolean' THEN (w.payload->'livemode')::boolean END
           AS livemode,
       CASE WHEN jsonb_typeof(w.payload->'account') = 'string' THEN w.payload->>'account'
            WHEN jsonb_typeof(w.payload->'context') = 'string' THEN w.payload->>'context' END AS account,
       CASE jsonb_typeof(w.payload->'api_version') WHEN 'string' THEN w.payload->>'api_version' END
           AS api_version
  FROM webhook_inbox AS w
 WHERE w.provider = $1 AND ",
    parked!(),
    "
 ORDER BY w.received_at, w.endpoint, w.event_id
 LIMIT $2"
);

/// A parked row, as `needs-review` lists it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ParkedRow {
    pub provider: String,
    pub endpoint: String,
    pub event_id: String,
    pub event_type: String,
    pub attempts: i32,
    pub last_error: Option<String>,
    /// Why the ingest parked it on arrival (`unstorable`, `livemode`); None when a worker did.
    pub held: Option<String>,
    /// RFC 3339, UTC.
    pub received_at: String,
    /// When it was parked (by a worker, or by the ingest on arrival); RFC 3339, UTC.
    pub parked_at: String,
    pub livemode: Option<bool>,
    /// The connected account (Connect), or a thin event's context.
    pub account: Option<String>,
    pub api_version: Option<String>,
}

/// Runs [`PARKED_ROWS_SQL`].
pub async fn parked_rows(
    client: &(impl GenericClient + Sync),
    limit: i64,
) -> Result<Vec<ParkedRow>, tokio_postgres::Error> {
    let rows =
        client.query_typed(PARKED_ROWS_SQL, &[(&PROVIDER_STRIPE, Type::TEXT), (&limit, Type::INT8)]).await?;
    Ok(rows
        .iter()
        .map(|r| ParkedRow {
            provider: r.get("provider"),
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
            api_version: r.get("api_version"),
        })
        .collect())
}

// ------------------------------------------------------------------- one event (requeue, replay)

/// Locks the rows of one event id: every endpoint's, or only `$3`'s when not NULL (`$1`
/// provider, `$2` event_id). `processed_at` comes as RFC 3339 text in UTC, NULL when unprocessed;
/// `ctid` (text) locates the locked row for [`super::queue::mark_processed`]. FOR UPDATE: a worker
/// processing the row holds its lock until it commits, so we see the outcome (bounded by the
/// transaction's lock_timeout); nothing moves the row under us afterwards.
pub const LOCK_EVENT_SQL: &str = "\
SELECT endpoint, event_type, attempts, payload, held, parked_at IS NOT NULL AS parked,
       to_char(processed_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') AS processed_at,
       ctid::text
  FROM webhook_inbox
 WHERE provider = $1 AND event_id = $2 AND ($3::text IS NULL OR endpoint = $3)
 ORDER BY endpoint
   FOR UPDATE";

/// A row of [`LOCK_EVENT_SQL`].
#[derive(Debug, Clone)]
pub struct EventRow {
    pub endpoint: String,
    pub event_type: String,
    pub attempts: i32,
    /// The stored payload as JSON text; None for a row held as unstorable (its body is in
    /// `raw_body`).
    pub payload: Option<Box<serde_json::value::RawValue>>,
    /// Why the ingest parked it on arrival, if it did.
    pub held: Option<String>,
    /// Parked (by a worker, or held by the ingest).
    pub parked: bool,
    /// RFC 3339, UTC; None while unprocessed.
    pub processed_at: Option<String>,
    /// Where the locked row is, while the transaction holds the lock.
    pub ctid: String,
}

/// Runs [`LOCK_EVENT_SQL`]: the rows of `event_id` (of `endpoint`, when given), locked.
pub async fn lock_event(
    tx: &(impl GenericClient + Sync),
    event_id: &str,
    endpoint: Option<&str>,
) -> Result<Vec<EventRow>, tokio_postgres::Error> {
    let params: [(&(dyn ToSql + Sync), Type); 3] =
        [(&PROVIDER_STRIPE, Type::TEXT), (&event_id, Type::TEXT), (&endpoint, Type::TEXT)];
    let rows = tx.query_typed(LOCK_EVENT_SQL, &params).await?;
    Ok(rows
        .iter()
        .map(|r| EventRow {
            endpoint: r.get("endpoint"),
            event_type: r.get("event_type"),
            attempts: r.get("attempts"),
            payload: r.get::<_, Option<Json<_>>>("payload").map(|p| p.0),
            held: r.get("held"),
            parked: r.get("parked"),
            processed_at: r.get("processed_at"),
            ctid: r.get("ctid"),
        })
        .collect())
}

// ----------------------------------------------------------------------------- bulk replay

/// The processed events `replay --event-type` runs again (`$1` provider, `$2` event type, `$3`/`$4`
/// received from / before, each NULL for no bound): their keys, oldest first, and the time of the
/// reading (`as_of`). Rows a person dismissed and rows without a payload (kept as raw bytes) are
/// not among them. One read of the table (there is no index on `event_type` for processed rows);
/// the keys are what the run then works through, in batches.
pub const REPLAY_KEYS_SQL: &str = "\
SELECT endpoint, event_id, now() AS as_of
  FROM webhook_inbox
 WHERE provider = $1 AND event_type = $2
   AND processed_at IS NOT NULL AND dismissed_at IS NULL AND payload IS NOT NULL
   AND ($3::timestamptz IS NULL OR received_at >= $3)
   AND ($4::timestamptz IS NULL OR received_at < $4)
 ORDER BY received_at, endpoint, event_id";

/// One event `replay --event-type` would run again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplayKey {
    pub endpoint: String,
    pub event_id: String,
}

/// Runs [`REPLAY_KEYS_SQL`]; returns the keys and the time of the reading (None when none matched).
pub async fn replay_keys(
    client: &(impl GenericClient + Sync),
    event_type: &str,
    since: Option<SystemTime>,
    until: Option<SystemTime>,
) -> Result<(Vec<ReplayKey>, Option<SystemTime>), tokio_postgres::Error> {
    let params: [(&(dyn ToSql + Sync), Type); 4] = [
        (&PROVIDER_STRIPE, Type::TEXT),
        (&event_type, Type::TEXT),
        (&since, Type::TIMESTAMPTZ),
        (&until, Type::TIMESTAMPTZ),
    ];
    let rows = client.query_typed(REPLAY_KEYS_SQL, &params).await?;
    let as_of = rows.first().map(|r| r.get("as_of"));
    Ok((
        rows.iter().map(|r| ReplayKey { endpoint: r.get("endpoint"), event_id: r.get("event_id") }).collect(),
        as_of,
    ))
}

/// Locks one batch of [`REPLAY_KEYS_SQL`]'s events (`$1` provider, `$2`/`$3` endpoints and event
/// ids), still processed no later than `$4` (the run's `as_of`: a row processed since, by a worker
/// or another replay, already ran with the handler of now) and not dismissed meanwhile. SKIP
/// LOCKED: a row another session holds is left, and counted as skipped. Returns what
/// `replay` needs of each, `ctid` for [`super::queue::mark_processed`].
pub const LOCK_REPLAY_BATCH_SQL: &str = "\
SELECT w.endpoint, w.event_id, w.event_type, w.payload, w.ctid::text
  FROM webhook_inbox AS w
  JOIN unnest($2::text[], $3::text[]) AS k(endpoint, event_id)
       ON (w.endpoint, w.event_id) = (k.endpoint, k.event_id)
 WHERE w.provider = $1 AND w.processed_at IS NOT NULL AND w.processed_at <= $4
   AND w.dismissed_at IS NULL AND w.payload IS NOT NULL
 ORDER BY w.endpoint, w.event_id
   FOR UPDATE OF w SKIP LOCKED";

/// A row of [`LOCK_REPLAY_BATCH_SQL`].
#[derive(Debug)]
pub struct ReplayRow {
    pub endpoint: String,
    pub event_id: String,
    pub event_type: String,
    pub payload: Box<serde_json::value::RawValue>,
    pub ctid: String,
}

/// Runs [`LOCK_REPLAY_BATCH_SQL`] for `keys`.
pub async fn lock_replay_batch(
    tx: &(impl GenericClient + Sync),
    keys: &[ReplayKey],
    as_of: SystemTime,
) -> Result<Vec<ReplayRow>, tokio_postgres::Error> {
    let endpoints: Vec<&str> = keys.iter().map(|k| k.endpoint.as_str()).collect();
    let ids: Vec<&str> = keys.iter().map(|k| k.event_id.as_str()).collect();
    let params: [(&(dyn ToSql + Sync), Type); 4] = [
        (&PROVIDER_STRIPE, Type::TEXT),
        (&endpoints, Type::TEXT_ARRAY),
        (&ids, Type::TEXT_ARRAY),
        (&as_of, Type::TIMESTAMPTZ),
    ];
    Ok(tx
        .query_typed(LOCK_REPLAY_BATCH_SQL, &params)
        .await?
        .iter()
        .map(|r| ReplayRow {
            endpoint: r.get("endpoint"),
            event_id: r.get("event_id"),
            event_type: r.get("event_type"),
            payload: r.get::<_, Json<_>>("payload").0,
            ctid: r.get("ctid"),
        })
        .collect())
}

// ---------------------------------------------------------------------------------- dismiss

/// Closes one held or parked row without processing it (`$1` provider, `$2` endpoint, `$3` event
/// id, `$4` the reason for `last_error`): `processed_at` and `dismissed_at` now, the park and hold
/// left as they were (what the row went through). Only a row still unprocessed and parked or held:
/// a row in the queue is the workers'. Returns whether a row was closed.
pub const DISMISS_SQL: &str = "\
UPDATE webhook_inbox
   SET processed_at = now(), dismissed_at = now(), last_error = left($4, 1024)
 WHERE provider = $1 AND endpoint = $2 AND event_id = $3
   AND processed_at IS NULL AND (parked_at IS NOT NULL OR held IS NOT NULL)";

/// Runs [`DISMISS_SQL`].
pub async fn dismiss(
    tx: &(impl GenericClient + Sync),
    endpoint: &str,
    event_id: &str,
    reason: &str,
) -> Result<bool, tokio_postgres::Error> {
    let params: [(&(dyn ToSql + Sync), Type); 4] = [
        (&PROVIDER_STRIPE, Type::TEXT),
        (&endpoint, Type::TEXT),
        (&event_id, Type::TEXT),
        (&reason, Type::TEXT),
    ];
    Ok(tx.execute_typed(DISMISS_SQL, &params).await? == 1)
}

/// Clears `dismissed_at` of one row (`$1` provider, `$2` endpoint, `$3` event id): a replay applied
/// it after all.
pub const UNDISMISS_SQL: &str = "\
UPDATE webhook_inbox SET dismissed_at = NULL
 WHERE provider = $1 AND endpoint = $2 AND event_id = $3 AND dismissed_at IS NOT NULL";

/// Runs [`UNDISMISS_SQL`]; returns whether the row had been dismissed.
pub async fn undismiss(
    tx: &(impl GenericClient + Sync),
    endpoint: &str,
    event_id: &str,
) -> Result<bool, tokio_postgres::Error> {
    let params: [(&(dyn ToSql + Sync), Type); 3] =
        [(&PROVIDER_STRIPE, Type::TEXT), (&endpoint, Type::TEXT), (&event_id, Type::TEXT)];
    Ok(tx.execute_typed(UNDISMISS_SQL, &params).await? == 1)
}

// ----------------------------------------------------------------------------------- verify

/// The evidence kept for one event id (every endpoint's row, or only `$3`'s when not NULL; `$1`
/// provider, `$2` event id): the exact signed bytes and the `v1` that matched (NULL unless the
/// ingest ran with `--keep-raw`, or the body was unstorable), the signature's `t` as a number and
/// as RFC 3339 text, and the secret the ingest recorded.
pub const EVIDENCE_SQL: &str = "\
SELECT endpoint, event_type, raw_body, signature_v1, signature_t,
       to_char(to_timestamp(signature_t) AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') AS signed_at,
       secret_position, secret_fingerprint, payload IS NOT NULL AS has_payload
  FROM webhook_inbox
 WHERE provider = $1 AND event_id = $2 AND ($3::text IS NULL OR endpoint = $3)
 ORDER BY endpoint";

/// A row of [`EVIDENCE_SQL`].
#[derive(Debug, Clone)]
pub struct Evidence {
    pub endpoint: String,
    pub event_type: String,
    pub raw_body: Option<Vec<u8>>,
    pub signature_v1: Option<Vec<u8>>,
    pub signature_t: Option<i64>,
    /// `signature_t` as RFC 3339, UTC.
    pub signed_at: Option<String>,
    pub secret_position: Option<i16>,
    pub secret_fingerprint: Option<String>,
    pub has_payload: bool,
}

/// Runs [`EVIDENCE_SQL`].
pub async fn evidence(
    client: &(impl GenericClient + Sync),
    event_id: &str,
    endpoint: Option<&str>,
) -> Result<Vec<Evidence>, tokio_postgres::Error> {
    let params: [(&(dyn ToSql + Sync), Type); 3] =
        [(&PROVIDER_STRIPE, Type::TEXT), (&event_id, Type::TEXT), (&endpoint, Type::TEXT)];
    Ok(client
        .query_typed(EVIDENCE_SQL, &params)
        .await?
        .iter()
        .map(|r| Evidence {
            endpoint: r.get("endpoint"),
            event_type: r.get("event_type"),
            raw_body: r.get("raw_body"),
            signature_v1: r.get("signature_v1"),
            signature_t: r.get("signature_t"),
            signed_at: r.get("signed_at"),
            secret_position: r.get("secret_position"),
            secret_fingerprint: r.get("secret_fingerprint"),
            has_payload: r.get("has_payload"),
        })
        .collect())
}

/// Whether the stored payload is the raw body as `jsonb` reads it (`$1` the raw bytes; `$2..$4`
/// provider, endpoint, event id): what handlers were given is what Stripe signed. Fails when the
/// bytes are not JSON `jsonb` accepts (which, for a row with a payload, means they were altered).
pub const PAYLOAD_MATCHES_SQL: &str = "\
SELECT convert_from($1, 'UTF8')::jsonb = payload
  FROM webhook_inbox
 WHERE provider = $2 AND endpoint = $3 AND event_id = $4";

/// Runs [`PAYLOAD_MATCHES_SQL`].
pub async fn payload_matches(
    client: &(impl GenericClient + Sync),
    raw_body: &[u8],
    endpoint: &str,
    event_id: &str,
) -> Result<bool, tokio_postgres::Error> {
    let raw_body = crate::inbox::event::RawBytes(raw_body);
    let params: [(&(dyn ToSql + Sync), Type); 4] = [
        (&raw_body, Type::BYTEA),
        (&PROVIDER_STRIPE, Type::TEXT),
        (&endpoint, Type::TEXT),
        (&event_id, Type::TEXT),
    ];
    Ok(client.query_typed_one(PAYLOAD_MATCHES_SQL, &params).await?.get(0))
}

// ---------------------------------------------------------------------------------- requeue

/// The filters of `parked_filters!`: `requeue --all` sets the first two, the console any of them.
/// None is "any".
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ParkedFilter<'a> {
    pub event_type: Option<&'a str>,
    /// A pattern `last_error` contains, LIKE-escaped by the caller (matched case-insensitively).
    pub error_pattern: Option<&'a str>,
    pub endpoint: Option<&'a str>,
    /// Held on arrival as `unstorable` or `livemode`, or held at all (`any`), or not held (`none`).
    pub held: Option<&'a str>,
    /// Received more than this many seconds before the count.
    pub older_than_seconds: Option<f64>,
    /// The connected account (or a thin event's context).
    pub account: Option<&'a str>,
}

impl ParkedFilter<'_> {
    /// The parameters `$1` to `$7` of `parked_filters!`.
    pub(crate) fn params(&self) -> [(&(dyn ToSql + Sync), Type); 7] {
        [
            (&PROVIDER_STRIPE, Type::TEXT),
            (&self.event_type, Type::TEXT),
            (&self.error_pattern, Type::TEXT),
            (&self.endpoint, Type::TEXT),
            (&self.held, Type::TEXT),
            (&self.older_than_seconds, Type::FLOAT8),
            (&self.account, Type::TEXT),
        ]
    }
}

/// What `requeue --all` is about to do, before it locks or changes anything: `takes`, the parked
/// rows with the filters of `parked_filters!` that it requeues (not held on arrival); `held`, how
/// many more match but were held on arrival by the ingest, which it leaves (each needs a person's
/// decision, and `requeue` says how many it left); `as_of`, the time of the count: the batches
/// take only rows parked by then, so that a row parked while the command runs waits for the next
/// requeue instead of joining a run the operator confirmed for `takes` rows. Reads the partial
/// index `webhook_inbox_parked`, without locks.
pub const COUNT_PARKED_SQL: &str = concat!(
    "\
SELECT count(*) FILTER (WHERE held IS NULL) AS takes,
       count(*) FILTER (WHERE held IS NOT NULL) AS held,
       now() AS as_of
  FROM webhook_inbox
 WHERE ",
    parked_filters!("now()")
);

/// What [`COUNT_PARKED_SQL`] found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ParkedCount {
    /// Parked rows `requeue --all` takes (not held on arrival).
    pub takes: i64,
    /// Parked rows with the same filters that the ingest held on arrival: left as they are.
    pub held: i64,
    /// When the count was made (the database's clock).
    pub as_of: SystemTime,
}

/// Runs [`COUNT_PARKED_SQL`].
pub async fn count_parked(
    client: &(impl GenericClient + Sync),
    filter: &ParkedFilter<'_>,
) -> Result<ParkedCount, tokio_postgres::Error> {
    let row = client.query_typed_one(COUNT_PARKED_SQL, &filter.params()).await?;
    Ok(ParkedCount { takes: row.get("takes"), held: row.get("held"), as_of: row.get("as_of") })
}

/// One batch of `requeue --all` (`--dry-run` lists the same rows without `FOR UPDATE`, see
/// [`lock_parked`]): up to `$12` parked rows with the filters of `parked_filters!` (`$1` to `$7`),
/// not held on arrival, parked by `$8` (the count's `as_of`), oldest first — `(received_at,
/// endpoint, event_id)` after `($9, $10, $11)`, the key of the previous batch's last row (NULLs:
/// from the start). `FOR UPDATE SKIP LOCKED`: a row another session holds (a requeue or a replay
/// of that event) is left as it is, never waited for, and two concurrent requeues never wait on
/// each other. The key continues the index scan of `webhook_inbox_parked` where the previous batch
/// ended, so a batch does not step again over the index entries of the rows requeued before it
/// (they stay in the index, pointing to dead row versions, until vacuum); `received_at >= $9` is
/// that key's index condition, the row comparison breaks its ties.
pub const LOCK_PARKED_SQL: &str = concat!(
    "\
SELECT endpoint, event_id, event_type, attempts, received_at
  FROM webhook_inbox
 WHERE ",
    parked_filters!("$8"),
    "
   AND held IS NULL
   AND parked_at <= $8
   AND received_at >= COALESCE($9, '-infinity')
   AND (received_at, endpoint, event_id) > (COALESCE($9, '-infinity'), COALESCE($10, ''), COALESCE($11, ''))
 ORDER BY received_at, endpoint, event_id
 LIMIT $12
   FOR UPDATE SKIP LOCKED"
);

/// [`LOCK_PARKED_SQL`] without its last line: what a dry run lists, locking nothing.
pub fn list_parked_sql() -> &'static str {
    LOCK_PARKED_SQL
        .strip_suffix("\n   FOR UPDATE SKIP LOCKED")
        .expect("LOCK_PARKED_SQL ends with its lock clause")
}

/// A row `requeue` takes: `attempts` is the count before the requeue.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequeueRow {
    pub endpoint: String,
    pub event_id: String,
    pub event_type: String,
    pub attempts: i32,
}

/// Where a batch of [`LOCK_PARKED_SQL`] ended: its last row's `(received_at, endpoint,
/// event_id)`, from which the next batch continues.
#[derive(Debug, Clone, PartialEq)]
pub struct ParkedKey {
    pub received_at: SystemTime,
    pub endpoint: String,
    pub event_id: String,
}

/// Runs [`LOCK_PARKED_SQL`] (with `lock`; else the same rows unlocked, for a dry run): up to
/// `limit` rows after `after`, and the key the next batch starts after (None when there was no
/// row).
pub async fn lock_parked(
    client: &(impl GenericClient + Sync),
    filter: &ParkedFilter<'_>,
    as_of: SystemTime,
    after: Option<&ParkedKey>,
    limit: i64,
    lock: bool,
) -> Result<(Vec<RequeueRow>, Option<ParkedKey>), tokio_postgres::Error> {
    let (received_at, endpoint, event_id) = match after {
        Some(k) => (Some(k.received_at), Some(k.endpoint.as_str()), Some(k.event_id.as_str())),
        None => (None, None, None),
    };
    let mut params: Vec<(&(dyn ToSql + Sync), Type)> = filter.params().into();
    params.extend([
        (&as_of as &(dyn ToSql + Sync), Type::TIMESTAMPTZ),
        (&received_at, Type::TIMESTAMPTZ),
        (&endpoint, Type::TEXT),
        (&event_id, Type::TEXT),
        (&limit, Type::INT8),
    ]);
    let sql = if lock { LOCK_PARKED_SQL } else { list_parked_sql() };
    let rows = client.query_typed(sql, &params).await?;
    let next = rows.last().map(|r| ParkedKey {
        received_at: r.get("received_at"),
        endpoint: r.get("endpoint"),
        event_id: r.get("event_id"),
    });
    let rows = rows
        .iter()
        .map(|r| RequeueRow {
            endpoint: r.get("endpoint"),
            event_id: r.get("event_id"),
            event_type: r.get("event_type"),
            attempts: r.get("attempts"),
        })
        .collect();
    Ok((rows, next))
}

/// Puts rows back in the queue: not parked (nor held), attempts 0, available now; `last_error` is
/// kept for history (the next failure or the processing overwrites it). `requeue` never passes a
/// row without a payload (held as unstorable); were one requeued, the next claim would park it
/// again ([`super::queue::CLAIM_SQL`]). `$1` provider, `$2` endpoints and
/// `$3` event ids (parallel arrays: the rows locked before). Only unprocessed rows.
pub const REQUEUE_SQL: &str = "\
UPDATE webhook_inbox
   SET attempts = 0, interruptions = 0, available_at = now(), parked_at = NULL, held = NULL
 WHERE provider = $1
   AND (endpoint, event_id) IN (SELECT * FROM unnest($2::text[], $3::text[]))
   AND processed_at IS NULL";

/// Runs [`REQUEUE_SQL`] on `rows`; returns how many changed.
pub async fn requeue(
    tx: &(impl GenericClient + Sync),
    rows: &[RequeueRow],
) -> Result<u64, tokio_postgres::Error> {
    let endpoints: Vec<&str> = rows.iter().map(|r| r.endpoint.as_str()).collect();
    let event_ids: Vec<&str> = rows.iter().map(|r| r.event_id.as_str()).collect();
    tx.execute_typed(
        REQUEUE_SQL,
        &[(&PROVIDER_STRIPE, Type::TEXT), (&endpoints, Type::TEXT_ARRAY), (&event_ids, Type::TEXT_ARRAY)],
    )
    .await
}

// ------------------------------------------------------------------------------------ purge

/// What a purge fixes before its first batch, so that every batch agrees: the cutoff `now() - $1
/// seconds` (and as RFC 3339 text in UTC, for the output and the audit record), and the size of
/// `webhook_inbox` in pages (`pages`): the walk of [`PURGE_BATCH_SQL`] ends there. No row the purge
/// deletes lies beyond it: a row version written since (a new row, or one moved by an update) is
/// unprocessed or was processed after the cutoff — the only update of a processed row, `replay`,
/// renews its `processed_at`.
pub const PURGE_START_SQL: &str = "\
SELECT c.cutoff, to_char(c.cutoff AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') AS cutoff_text,
       pg_relation_size('webhook_inbox'::regclass) / current_setting('block_size')::int8 AS pages
  FROM (SELECT now() - make_interval(secs => $1) AS cutoff) AS c";

/// What [`PURGE_START_SQL`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct PurgeStart {
    pub cutoff: SystemTime,
    /// The cutoff as RFC 3339, UTC.
    pub cutoff_text: String,
    /// Pages of the table when the purge started.
    pub pages: i64,
}

/// Runs [`PURGE_START_SQL`] for a purge of rows processed more than `older_than_seconds` ago.
pub async fn purge_start(
    client: &(impl GenericClient + Sync),
    older_than_seconds: f64,
) -> Result<PurgeStart, tokio_postgres::Error> {
    let row = client.query_typed_one(PURGE_START_SQL, &[(&older_than_seconds, Type::FLOAT8)]).await?;
    Ok(PurgeStart { cutoff: row.get("cutoff"), cutoff_text: row.get("cutoff_text"), pages: row.get("pages") })
}

/// How many rows a purge would delete (`--dry-run`): processed before `$2` (`$1` provider).
pub const PURGE_COUNT_SQL: &str = "\
SELECT count(*)
  FROM webhook_inbox
 WHERE provider = $1 AND processed_at IS NOT NULL AND processed_at < $2";

/// Runs [`PURGE_COUNT_SQL`].
pub async fn purge_count(
    client: &(impl GenericClient + Sync),
    cutoff: SystemTime,
) -> Result<i64, tokio_postgres::Error> {
    Ok(client
        .query_typed_one(PURGE_COUNT_SQL, &[(&PROVIDER_STRIPE, Type::TEXT), (&cutoff, Type::TIMESTAMPTZ)])
        .await?
        .get(0))
}

/// One purge batch, in its own short transaction (the caller's, with the operator limits and the
/// batch's audit record): the rows processed before `$2` (`$1` provider) in one range of the heap
/// — from the row position `($3,$4)` (page, item) up to page `$5`, not included — in physical
/// order, at most `$6`, locked `SKIP LOCKED` (a row someone else holds, a replay, is left for the
/// next purge) and deleted. Returns how many it deleted and the position of the last one (NULL when
/// none). Unprocessed rows are never touched.
///
/// A purge walks the heap once, from page 0 to the end [`PURGE_START_SQL`] recorded: each batch
/// starts where the previous one stopped — after its last row when it was full, else at the end of
/// its range — so no batch reads the pages of the rows deleted before it. Those rows are dead
/// tuples until vacuum (and their pages stay in the table after it), and the previous statement —
/// `LIMIT n` over a sequential scan filtered on `processed_at`, which has no index — read all of
/// them again at every batch: batch k read the k−1 batches' pages before it found a row, so a
/// purge of a large backlog was quadratic (docs/operations.md, "Retention", has the figures). A
/// TID range scan (PostgreSQL 14+) reads only the range's pages; the sort by `ctid` is over the
/// range's rows, which the caller sizes to about one batch from the density it has seen. No index
/// is needed: one on `processed_at` would cost every processed mark an index insertion.
pub const PURGE_BATCH_SQL: &str = "\
WITH victims AS (
        SELECT ctid
          FROM webhook_inbox
         WHERE ctid >= format('(%s,%s)', $3::int8, $4::int8)::tid
           AND ctid < format('(%s,0)', $5::int8)::tid
           AND provider = $1 AND processed_at IS NOT NULL AND processed_at < $2
         ORDER BY ctid
         LIMIT $6
           FOR UPDATE SKIP LOCKED),
     gone AS (
        DELETE FROM webhook_inbox
         WHERE ctid = ANY (ARRAY(SELECT ctid FROM victims))
           AND provider = $1 AND processed_at IS NOT NULL AND processed_at < $2
        RETURNING ctid)
SELECT count(*) AS deleted, max(ctid)::text AS last FROM gone";

/// A row's position in the heap (its `ctid`): page and item number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct HeapPosition {
    pub page: i64,
    pub item: i64,
}

impl HeapPosition {
    /// Reads a `tid` as PostgreSQL prints it: `(page,item)`.
    pub fn parse(text: &str) -> Option<HeapPosition> {
        let (page, item) = text.strip_prefix('(')?.strip_suffix(')')?.split_once(',')?;
        Some(HeapPosition { page: page.trim().parse().ok()?, item: item.trim().parse().ok()? })
    }
}

/// What one [`PURGE_BATCH_SQL`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PurgeBatch {
    pub deleted: u64,
    /// Position of the last row it deleted; None when it deleted none.
    pub last: Option<HeapPosition>,
}

/// Runs [`PURGE_BATCH_SQL`] on the range from `from` to page `to_page` (not included).
pub async fn purge_batch(
    tx: &(impl GenericClient + Sync),
    cutoff: SystemTime,
    from: HeapPosition,
    to_page: i64,
    limit: i64,
) -> Result<PurgeBatch, tokio_postgres::Error> {
    let params: [(&(dyn ToSql + Sync), Type); 6] = [
        (&PROVIDER_STRIPE, Type::TEXT),
        (&cutoff, Type::TIMESTAMPTZ),
        (&from.page, Type::INT8),
        (&from.item, Type::INT8),
        (&to_page, Type::INT8),
        (&limit, Type::INT8),
    ];
    let row = tx.query_typed_one(PURGE_BATCH_SQL, &params).await?;
    let deleted: i64 = row.get("deleted");
    let last: Option<String> = row.get("last");
    Ok(PurgeBatch {
        deleted: u64::try_from(deleted).unwrap_or(0),
        last: last.as_deref().and_then(HeapPosition::parse),
    })
}

// ------------------------------------------------------------------------------------ audit

/// One audit record: who (`$1` actor) did what (`$2` action: requeue, replay, purge) to which
/// rows (`$3` target, jsonb: the key or the filters) and how many rows it changed (`$4`).
/// Returns the record's id.
///
/// The audit is insert-only: `deploy/roles.sql` lets the operators' role insert these four columns
/// and read `id`, never change a record. A change made in one transaction (requeue or replay of
/// one event) has one record, in that transaction. A command that works in batches (`requeue
/// --all`, `purge`) writes a *run*: a first record before it changes anything (`affected` 0; the
/// target says what it is about to do), then one per batch in the batch's own transaction
/// (`affected`: the rows that batch changed; `target.run`: the first record's id), so the records
/// commit with the changes they count whatever stops the command — a signal, a lost connection,
/// a kill. `purge` ends its run with a record saying how it ended (`affected` 0, `target.outcome`,
/// the totals). The rows a run changed: `SELECT sum(affected) FROM operator_audit WHERE id = $run
/// OR target->>'run' = '$run'`.
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
    let params: [(&(dyn ToSql + Sync), Type); 4] =
        [(&actor, Type::TEXT), (&action, Type::TEXT), (target, Type::JSONB), (&affected, Type::INT4)];
    let row = client.query_typed_one(INSERT_AUDIT_SQL, &params).await?;
    Ok(row.get(0))
}

/// What the current transaction changed, per table (`replay --dry-run`, before its rollback): the
/// rows it inserted, updated and deleted, from PostgreSQL's own per-transaction counters
/// (`pg_stat_xact_user_tables`), and whether this role may read the table (to list the rows).
pub const TRANSACTION_CHANGES_SQL: &str = "\
SELECT format('%I.%I', schemaname, relname) AS table_name, relname,
       n_tup_ins AS inserted, n_tup_upd AS updated, n_tup_del AS deleted,
       has_table_privilege(relid, 'SELECT') AS readable
  FROM pg_stat_xact_user_tables
 WHERE n_tup_ins + n_tup_upd + n_tup_del > 0
 ORDER BY relname";

/// A row of [`TRANSACTION_CHANGES_SQL`], with the rows the transaction wrote there.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TableChange {
    pub table: String,
    pub inserted: i64,
    pub updated: i64,
    pub deleted: i64,
    /// The rows the transaction inserted or updated, as JSON (at most [`ROWS_SHOWN`]); empty where
    /// the role may not read the table. Deleted rows are gone: counted only.
    pub rows: Vec<serde_json::Value>,
}

/// Most rows listed per table by [`transaction_changes`].
pub const ROWS_SHOWN: i64 = 20;

/// What the current transaction changed so far, per table; the rows it wrote in `skip_rows_of`
/// (the inbox, whose rows carry whole payloads) are counted but not listed. The rows written are
/// those whose `xmin` is this transaction's id (its top level: a savepoint's rows carry their
/// own).
pub async fn transaction_changes(
    client: &(impl GenericClient + Sync),
    skip_rows_of: &[&str],
) -> Result<Vec<TableChange>, tokio_postgres::Error> {
    let mut changes = Vec::new();
    for r in client.query_typed(TRANSACTION_CHANGES_SQL, &[]).await? {
        let table: String = r.get("table_name");
        let name: String = r.get("relname");
        let listed = r.get::<_, bool>("readable") && !skip_rows_of.contains(&name.as_str());
        let rows = if listed {
            // The name comes from the catalog, quoted by format('%I.%I').
            let sql = format!(
                "SELECT to_jsonb(t) FROM {table} AS t \
                  WHERE t.xmin::text::int8 = txid_current() % 4294967296 LIMIT {ROWS_SHOWN}"
            );
            client.query_typed(&sql, &[]).await?.iter().map(|row| row.get(0)).collect()
        } else {
            Vec::new()
        };
        changes.push(TableChange {
            table: name,
            inserted: r.get("inserted"),
            updated: r.get("updated"),
            deleted: r.get("deleted"),
            rows,
        });
    }
    Ok(changes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_positions_read_as_postgresql_prints_them() {
        assert_eq!(HeapPosition::parse("(0,1)"), Some(HeapPosition { page: 0, item: 1 }));
        assert_eq!(
            HeapPosition::parse("(4294967294,291)"),
            Some(HeapPosition { page: 4_294_967_294, item: 291 })
        );
        assert_eq!(HeapPosition::parse("0,1"), None);
        assert_eq!(HeapPosition::parse("(x,1)"), None);
    }

    #[test]
    fn a_dry_run_lists_what_a_batch_locks() {
        assert!(!list_parked_sql().contains("FOR UPDATE"));
        assert!(LOCK_PARKED_SQL.starts_with(list_parked_sql()));
    }
}
