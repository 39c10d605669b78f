//! Every statement on `outbox` as a queue: the relay's claim, its published mark and its failure
//! record, the hand-back at shutdown, and what operators read and change (statistics, parked rows,
//! requeue, purge). The handlers write the rows (`crate::invoice`); everything after that is here.
//!
//! # The states of an outbox row
//! * *pending*: not published, not parked — *ready* when `available_at <= now()`, else leased to a
//!   relay, waiting for a retry, or *held* behind its aggregate's first row;
//! * *published*: `published_at` is set — the destination acknowledged it (kept until `purge`);
//! * *parked*: `parked_at` is set, not published — its last allowed attempt failed (or the
//!   receiver answered 410 Gone); no relay takes it, and the later rows of its aggregate wait behind
//!   it, until an operator requeues it.
//!
//! # Claim, lease and fence
//! As the worker's on the inbox (see [`super::queue`]): the claim counts the attempt and leases the
//! row in a transaction of its own, committed before the delivery starts; the published mark and
//! the failure record apply only while the row carries that claim (`fenced!`), so a relay that
//! lost its lease can deliver a row twice (at least once, with a stable id) but never marks or
//! fails a row another relay holds. Every claim also adds one to `fencing_token`, which each
//! delivery carries to the receiver.
//!
//! # One aggregate in order
//! Only an aggregate's first unpublished row (the lowest id) is claimed: the others wait until it
//! is published, so the rows of one `aggregate_id` are delivered in id order, one at a time, and a
//! parked row holds back the later rows of its aggregate — no other aggregate waits for it. A
//! later row the claim finds ready while its first row is still undelivered is *held*: moved past
//! now (to the first row's retry time, or an hour while it is parked), so that a blocked aggregate
//! is not read again by every claim; publishing or requeuing the first row releases the next.
//!
//! The id order is the order of insertion. Rows of one aggregate written by concurrent
//! transactions could commit out of id order, so write them after locking the aggregate's row
//! (the invoice handlers write the outbox after updating the invoice, whose row lock orders them).

use std::time::{Duration, SystemTime};

use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Client;

use crate::db::Pooler;

#[cfg(doc)]
use super::cursor::ClaimCursor;
use super::truncate_error;

/// The condition of a *pending* outbox row (`o`): not published, not parked. A string literal, for
/// `concat!`.
macro_rules! outbox_pending {
    () => {
        "o.published_at IS NULL AND o.parked_at IS NULL"
    };
}

/// The version of the outbox row `<claim>.id` that the statement sees, as `cur`: its TID, and the
/// columns a relay's write checks (published, the fence). For the statements that then write the
/// row by its TID (`o.ctid = cur.ctid`), with every condition on `cur`, none on `o`. A string
/// literal, for `concat!`.
///
/// Why not `o.id = c.id AND o.published_at IS NULL`: that condition lets the planner read the
/// rows through an index of unpublished rows (`outbox_unpublished_by_aggregate`), whose size it
/// takes from the last analyse — after one that found no row unpublished (the steady state), one
/// page, cheaper than a probe of the primary key per row. While a long snapshot is open elsewhere
/// that index keeps the entry of every row published since, and each mark read all of them: the
/// relay's mark was PostgreSQL's largest cost in a soak with a held snapshot (21 ms a call). Here
/// the row's id is the subquery's only condition (its LIMIT keeps the planner from merging it into
/// the join), so the primary key's probe is the only index that answers it. The TID also pins the
/// version checked: a row another session changed meanwhile has a new one, and the write leaves it
/// alone — as the fence would: every other write to a row a relay holds moves its attempts or its
/// lease.
macro_rules! current_version {
    ($claim:literal) => {
        concat!(
            "CROSS JOIN LATERAL (
           SELECT v.ctid, v.published_at, v.attempts, v.available_at
             FROM outbox AS v
            WHERE v.id = ",
            $claim,
            ".id
            LIMIT 1) AS cur"
        )
    };
}

/// Claim (the relay's first transaction): up to `$2` ready outbox rows — pending and available —
/// oldest availability first, skipping rows other relays hold, each the first unpublished row of
/// its aggregate; for each, counts the attempt, adds one to its fencing token and leases it for
/// `$3` seconds. Committed before any delivery starts.
///
/// Plan: an ordered scan of `outbox_ready` from `$5` (a [`ClaimCursor`]'s start; NULL: from the
/// index's start; rows leased, waiting or held are past now and not read), locking up to `$2`
/// candidates with SKIP LOCKED; for each, one probe of
/// `outbox_unpublished_by_aggregate` finds its aggregate's first unpublished row. Candidates that
/// are not their aggregate's first row are *held* (see the module's "One aggregate in order").
///
/// Memory: as the worker's claim, rows are taken while the payload bytes before them stay under
/// `$4` (at least one row). A picked row already at the attempt limit `$1` is parked, not claimed:
/// its last allowed attempt ended without an outcome (its relay stopped or lost its lease), or the
/// limit was lowered. Returns each row claimed (`outcome` 'claimed'), parked ('parked'), and one
/// row per held row ('held', payload NULL), so that the relay can tell a full claim from an empty
/// queue.
///
/// Every row also carries `resume_from`, where the next claim may start: every ready row this
/// claim found unlocked and did not take or hold is at or after it. That is the oldest candidate
/// left over the budget; when none was, the newest of `$2` candidates, or the snapshot's `now()`
/// when there were fewer (every ready row was read). A claim that took nothing returns one row
/// of NULLs and `resume_from`. Why a start: the published mark leaves a dead entry at the front
/// of `outbox_ready`, which a claim from its start steps over, and while a long snapshot is open
/// nothing removes them (see [`ClaimCursor`]).
pub const CLAIM_SQL: &str = concat!(
    "\
WITH candidates AS (
    SELECT o.id, o.attempts, o.available_at, o.aggregate_type, o.aggregate_id,
           octet_length(o.payload::text)::int8 AS bytes
      FROM outbox AS o
     WHERE ",
    outbox_pending!(),
    " AND o.available_at >= coalesce($5::timestamptz, '-infinity') AND o.available_at <= now()
     ORDER BY o.available_at, o.id
     LIMIT $2
       FOR UPDATE OF o SKIP LOCKED
), ranked AS (
    SELECT c.*, f.id AS first_id, f.available_at AS first_available_at,
           f.parked_at IS NOT NULL AS first_parked
      FROM candidates AS c
     CROSS JOIN LATERAL (
           SELECT f.id, f.available_at, f.parked_at
             FROM outbox AS f
            WHERE f.aggregate_type = c.aggregate_type AND f.aggregate_id = c.aggregate_id
              AND f.published_at IS NULL
            ORDER BY f.id
            LIMIT 1) AS f
), budgeted AS (
    SELECT id, attempts, bytes, available_at,
           sum(bytes) OVER (ORDER BY available_at, id ROWS UNBOUNDED PRECEDING) - bytes AS before
      FROM ranked
     WHERE first_id = id
), picked AS (
    SELECT id, attempts, bytes FROM budgeted WHERE before < $4
), claimed AS (
    UPDATE outbox AS o
       SET attempts = o.attempts + 1,
           fencing_token = o.fencing_token + 1,
           available_at = now() + make_interval(secs => $3)
      FROM picked
     WHERE o.id = picked.id AND picked.attempts < $1
    RETURNING o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.payload::text AS payload,
              o.created_at, o.attempts, o.available_at, o.fencing_token, picked.bytes, 'claimed' AS outcome
), exhausted AS (
    UPDATE outbox AS o
       SET parked_at = now(),
           last_error = CASE
               WHEN o.attempts > $1 THEN
                   left('attempt limit lowered to ' || $1 || ' (--max-attempts): the row had used '
                        || o.attempts || ' attempts' || COALESCE('; its last error: ' || o.last_error, ''), 1024)
               ELSE left('attempt ' || o.attempts || ' of ' || $1
                         || ' ended without an outcome (its relay stopped or lost its lease)'
                         || COALESCE('; the attempt before: ' || o.last_error, ''), 1024)
           END
      FROM picked
     WHERE o.id = picked.id AND picked.attempts >= $1
    RETURNING o.id, o.aggregate_type, o.aggregate_id, o.event_type, NULL::text AS payload,
              o.created_at, o.attempts, o.available_at, o.fencing_token, picked.bytes, 'parked' AS outcome
), held AS (
    UPDATE outbox AS o
       SET available_at = CASE
               WHEN r.first_parked THEN now() + interval '1 hour'
               ELSE greatest(r.first_available_at, now() + make_interval(secs => $3))
           END
      FROM ranked AS r
     WHERE o.id = r.id AND r.first_id <> r.id
    RETURNING o.id, o.aggregate_type, o.aggregate_id, o.event_type, NULL::text AS payload,
              o.created_at, o.attempts, o.available_at, o.fencing_token, 0::int8 AS bytes, 'held' AS outcome
), taken AS (
    SELECT * FROM claimed
    UNION ALL
    SELECT * FROM exhausted
    UNION ALL
    SELECT * FROM held
), resume AS (
    SELECT coalesce((SELECT min(available_at) FROM budgeted WHERE before >= $4),
                    (SELECT CASE WHEN count(*) >= $2 THEN max(available_at) END FROM candidates),
                    now()) AS resume_from
)
SELECT taken.*, resume.resume_from
  FROM resume
  LEFT JOIN taken ON true"
);

/// A claimed outbox row: what to deliver, and the claim (`attempts` and `leased_until`, the fence
/// of every later write).
#[derive(Debug, Clone)]
pub struct OutboxClaimed {
    /// The outbox id: the delivery's stable id (`webhook-id`, `Nats-Msg-Id`).
    pub id: i64,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    /// The payload as JSON text: the body delivered (shared, not copied, by each attempt).
    pub payload: bytes::Bytes,
    pub created_at: SystemTime,
    /// The attempt this claim counted (1 for the first).
    pub attempts: i32,
    /// The end of this claim's lease, as stored.
    pub leased_until: SystemTime,
    /// This claim's fencing token: one more than the claim before it.
    pub fencing_token: i64,
    /// The payload's size in bytes: what holding the row costs in memory.
    pub bytes: i64,
}

/// A row the claim parked (at the attempt limit) instead of claiming it.
#[derive(Debug, Clone)]
pub struct OutboxParked {
    pub id: i64,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub attempts: i32,
}

/// What an outbox claim came to.
#[derive(Debug, Clone, Default)]
pub struct OutboxClaim {
    pub claimed: Vec<OutboxClaimed>,
    pub parked: Vec<OutboxParked>,
    /// Rows held behind their aggregate's first undelivered row.
    pub held: usize,
    /// Where the next claim may start (see [`CLAIM_SQL`]): what [`ClaimCursor::advance`] takes.
    pub resume_from: Option<SystemTime>,
}

/// Runs [`CLAIM_SQL`] in a transaction of its own under `timeout`, its scan starting at `since` (a
/// [`ClaimCursor`]'s; None: the whole queue), as the worker's claim runs (`queue::run_claim`):
/// with the claims' planner settings, which keep the candidates read from `outbox_ready` in its
/// order whatever the statistics say; prepared once per connection, unless behind a transaction
/// pooler.
#[allow(clippy::too_many_arguments)]
pub async fn claim(
    client: &deadpool_postgres::Object,
    pooler: Pooler,
    since: Option<SystemTime>,
    max_attempts: i32,
    limit: i64,
    budget: i64,
    lease: Duration,
    timeout: Duration,
) -> Result<OutboxClaim, tokio_postgres::Error> {
    let lease = lease.as_secs_f64();
    let params: [(&(dyn ToSql + Sync), Type); 5] = [
        (&max_attempts, Type::INT4),
        (&limit, Type::INT8),
        (&lease, Type::FLOAT8),
        (&budget, Type::INT8),
        (&since, Type::TIMESTAMPTZ),
    ];
    let rows = super::queue::run_claim(client, pooler, timeout, CLAIM_SQL, &params).await?;
    let mut claim = OutboxClaim::default();
    for r in &rows {
        claim.resume_from = r.get("resume_from");
        match r.get::<_, Option<&str>>("outcome") {
            // The one row of a claim that took nothing.
            None => {}
            Some("claimed") => claim.claimed.push(OutboxClaimed {
                id: r.get("id"),
                aggregate_type: r.get("aggregate_type"),
                aggregate_id: r.get("aggregate_id"),
                event_type: r.get("event_type"),
                payload: bytes::Bytes::from(r.get::<_, String>("payload")),
                created_at: r.get("created_at"),
                attempts: r.get("attempts"),
                leased_until: r.get("available_at"),
                fencing_token: r.get("fencing_token"),
                bytes: r.get("bytes"),
            }),
            Some("parked") => claim.parked.push(OutboxParked {
                id: r.get("id"),
                aggregate_type: r.get("aggregate_type"),
                aggregate_id: r.get("aggregate_id"),
                event_type: r.get("event_type"),
                attempts: r.get("attempts"),
            }),
            Some(_) => claim.held += 1,
        }
    }
    // Oldest first, as the claim picked them (UNION ALL keeps no order).
    claim.claimed.sort_by_key(|c| c.id);
    Ok(claim)
}

/// Published (the relay's second transaction, one statement for the delivered rows of a batch):
/// `published_at = now()` for each row that still carries the claim that delivered it (`fenced!`,
/// the row found by its id: `current_version!`); and for each row marked, its aggregate's next
/// unpublished row, if held (never attempted, its `available_at` moved past now by a claim), is
/// released: available now. Arrays `$1` ids, `$2` the claims' attempts, `$3` their lease ends.
/// Returns the ids marked: a delivered row missing from the result lost its lease to another relay
/// meanwhile (which delivers and marks it: the receiver gets it twice, with the same id).
pub const MARK_PUBLISHED_SQL: &str = concat!(
    "\
WITH published AS (
    UPDATE outbox AS o
       SET published_at = now(), last_error = NULL
      FROM unnest($1::int8[], $2::int4[], $3::timestamptz[]) AS c(id, attempts, leased_until)
     ",
    current_version!("c"),
    "
     WHERE o.ctid = cur.ctid AND cur.published_at IS NULL AND ",
    fenced!("cur", "c"),
    "
    RETURNING o.id, o.aggregate_type, o.aggregate_id
), released AS (
    UPDATE outbox AS n
       SET available_at = now()
      FROM published AS p
     CROSS JOIN LATERAL (
           SELECT f.id
             FROM outbox AS f
            WHERE f.aggregate_type = p.aggregate_type AND f.aggregate_id = p.aggregate_id
              AND f.published_at IS NULL AND f.id > p.id
            ORDER BY f.id
            LIMIT 1) AS next
     WHERE n.id = next.id AND n.parked_at IS NULL AND n.attempts = 0 AND n.available_at > now()
    RETURNING n.id
)
SELECT id FROM published"
);

/// A delivered row, identified by its claim.
#[derive(Debug, Clone, Copy)]
pub struct Fence {
    pub id: i64,
    pub attempts: i32,
    pub leased_until: SystemTime,
}

impl From<&OutboxClaimed> for Fence {
    fn from(c: &OutboxClaimed) -> Self {
        Fence { id: c.id, attempts: c.attempts, leased_until: c.leased_until }
    }
}

/// Runs [`MARK_PUBLISHED_SQL`] in a transaction of its own under `timeout`; returns the ids marked.
///
/// Prepared once per connection with its generic plan, like the claim, unless behind a
/// transaction pooler (see `queue::run_prepared`): planned for its arguments, the mark of a few
/// rows cost PostgreSQL 0.2–0.4 ms of planning for 0.05–0.08 ms of work. Its plan made on an
/// empty outbox, without the settings it runs under, probed the aggregate's next row by a
/// sequential scan of the outbox for every row marked
/// (`the_published_marks_generic_plan_made_on_an_empty_outbox_probes_the_outboxs_indexes_once_it_grew`).
pub async fn mark_published(
    client: &deadpool_postgres::Object,
    pooler: Pooler,
    rows: &[Fence],
    timeout: Duration,
) -> Result<Vec<i64>, tokio_postgres::Error> {
    let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
    let attempts: Vec<i32> = rows.iter().map(|r| r.attempts).collect();
    let leases: Vec<SystemTime> = rows.iter().map(|r| r.leased_until).collect();
    let params: [(&(dyn ToSql + Sync), Type); 3] =
        [(&ids, Type::INT8_ARRAY), (&attempts, Type::INT4_ARRAY), (&leases, Type::TIMESTAMPTZ_ARRAY)];
    let rows = super::queue::run_prepared(client, pooler, timeout, "", MARK_PUBLISHED_SQL, &params).await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Failed deliveries (the relay's other second transaction, one statement for a batch's
/// failures): records each error and makes the row available again after its backoff `$5` with
/// ±20 % jitter (so the rows of one outage do not all come back at one instant), and never before
/// `$6` (the receiver's `Retry-After`); a row whose attempt was the last
/// allowed (`attempts >= $8`) or that must not be retried (`$7`, e.g. 410 Gone) is parked
/// instead. Only while the row still carries the claim (`fenced!`). Arrays `$1` ids, `$2` attempts,
/// `$3` lease ends, `$4` errors, `$5` backoffs and `$6` Retry-Afters in seconds, `$7` park now;
/// `$8` the attempt limit.
/// Returns the rows recorded, each with whether it is now parked.
pub const RECORD_FAILURES_SQL: &str = concat!(
    "\
UPDATE outbox AS o
   SET last_error = f.error,
       available_at = now() + make_interval(secs => greatest(f.not_before, f.backoff * (0.8 + 0.4 * random()))),
       parked_at = CASE WHEN f.park OR o.attempts >= $8 THEN now() END
  FROM unnest($1::int8[], $2::int4[], $3::timestamptz[], $4::text[], $5::float8[], $6::float8[], $7::bool[])
       AS f(id, attempts, leased_until, error, backoff, not_before, park)
 ",
    current_version!("f"),
    "
 WHERE o.ctid = cur.ctid AND cur.published_at IS NULL AND ",
    fenced!("cur", "f"),
    "
RETURNING o.id, o.parked_at IS NOT NULL"
);

/// One failed delivery: its claim, the error, when to try again, and whether never to.
#[derive(Debug, Clone)]
pub struct DeliveryFailure {
    pub fence: Fence,
    pub error: String,
    /// The relay's backoff for this attempt (jittered by the statement).
    pub backoff: Duration,
    /// The receiver's `Retry-After`, if it gave one: no retry before it.
    pub not_before: Duration,
    pub park: bool,
}

/// Runs [`RECORD_FAILURES_SQL`]; returns `(id, parked)` for each row recorded.
pub async fn record_failures(
    client: &Client,
    failures: &[DeliveryFailure],
    max_attempts: i32,
    timeout: Duration,
) -> Result<Vec<(i64, bool)>, tokio_postgres::Error> {
    let ids: Vec<i64> = failures.iter().map(|f| f.fence.id).collect();
    let attempts: Vec<i32> = failures.iter().map(|f| f.fence.attempts).collect();
    let leases: Vec<SystemTime> = failures.iter().map(|f| f.fence.leased_until).collect();
    let errors: Vec<&str> = failures.iter().map(|f| truncate_error(&f.error)).collect();
    let backoffs: Vec<f64> = failures.iter().map(|f| f.backoff.as_secs_f64()).collect();
    let not_before: Vec<f64> = failures.iter().map(|f| f.not_before.as_secs_f64()).collect();
    let parks: Vec<bool> = failures.iter().map(|f| f.park).collect();
    let params: [(&(dyn ToSql + Sync), Type); 8] = [
        (&ids, Type::INT8_ARRAY),
        (&attempts, Type::INT4_ARRAY),
        (&leases, Type::TIMESTAMPTZ_ARRAY),
        (&errors, Type::TEXT_ARRAY),
        (&backoffs, Type::FLOAT8_ARRAY),
        (&not_before, Type::FLOAT8_ARRAY),
        (&parks, Type::BOOL_ARRAY),
        (&max_attempts, Type::INT4),
    ];
    let rows = super::query_in_own_transaction(client, timeout, RECORD_FAILURES_SQL, &params).await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// Hands back rows claimed but never delivered (at shutdown): the attempt is given back and the
/// row is available now; its fencing token keeps growing (a token is never reused). Only while the
/// row carries the claim (`fenced!`). Arrays as [`MARK_PUBLISHED_SQL`]'s.
pub const HAND_BACK_SQL: &str = concat!(
    "\
UPDATE outbox AS o
   SET attempts = o.attempts - 1, available_at = now()
  FROM unnest($1::int8[], $2::int4[], $3::timestamptz[]) AS c(id, attempts, leased_until)
 ",
    current_version!("c"),
    "
 WHERE o.ctid = cur.ctid AND cur.published_at IS NULL AND ",
    fenced!("cur", "c")
);

/// Runs [`HAND_BACK_SQL`]; returns how many rows were handed back.
pub async fn hand_back(client: &Client, rows: &[Fence]) -> Result<u64, tokio_postgres::Error> {
    let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
    let attempts: Vec<i32> = rows.iter().map(|r| r.attempts).collect();
    let leases: Vec<SystemTime> = rows.iter().map(|r| r.leased_until).collect();
    let params: [(&(dyn ToSql + Sync), Type); 3] =
        [(&ids, Type::INT8_ARRAY), (&attempts, Type::INT4_ARRAY), (&leases, Type::TIMESTAMPTZ_ARRAY)];
    client.execute_typed(HAND_BACK_SQL, &params).await
}

/// What relays LISTEN on; the worker sends [`NOTIFY_SQL`] after batches that may have written
/// outbox rows.
pub const LISTEN_SQL: &str = "LISTEN outbox";

/// Wakes idle relays: sent by workers at most once per short interval, outside their transactions
/// (a NOTIFY inside each would serialise their commits).
pub const NOTIFY_SQL: &str = "SELECT pg_notify('outbox', '')";

/// The outbox's state, for `stats` and the relay's gauges: rows pending (not published, not
/// parked), parked, the age of the oldest pending row, and the aggregates a parked row holds back
/// with the rows waiting behind them. One scan of `outbox_unpublished_by_aggregate` (undelivered
/// rows only).
pub const STATS_SQL: &str = "\
SELECT count(*) FILTER (WHERE parked_at IS NULL) AS pending,
       count(*) FILTER (WHERE parked_at IS NOT NULL) AS parked,
       extract(epoch FROM now() - min(created_at) FILTER (WHERE parked_at IS NULL))::float8
           AS oldest_pending_age_seconds,
       count(DISTINCT (aggregate_type, aggregate_id)) FILTER (WHERE parked_at IS NOT NULL) AS blocked_aggregates,
       count(*) FILTER (WHERE parked_at IS NULL AND EXISTS (
           SELECT 1 FROM outbox AS p
            WHERE p.aggregate_type = o.aggregate_type AND p.aggregate_id = o.aggregate_id
              AND p.published_at IS NULL AND p.parked_at IS NOT NULL AND p.id < o.id)) AS blocked_rows
  FROM outbox AS o
 WHERE published_at IS NULL";

/// A row of [`STATS_SQL`].
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct OutboxStats {
    pub pending: i64,
    pub parked: i64,
    /// None when nothing is pending (as `stats` says of the inbox's oldest unprocessed row).
    pub oldest_pending_age_seconds: Option<f64>,
    /// Aggregates whose first undelivered row is parked.
    pub blocked_aggregates: i64,
    /// Pending rows waiting behind a parked row of their aggregate.
    pub blocked_rows: i64,
}

/// Runs [`STATS_SQL`].
pub async fn stats(
    client: &(impl tokio_postgres::GenericClient + Sync),
) -> Result<OutboxStats, tokio_postgres::Error> {
    let r = client.query_typed_one(STATS_SQL, &[]).await?;
    Ok(OutboxStats {
        pending: r.get("pending"),
        parked: r.get("parked"),
        oldest_pending_age_seconds: r.get("oldest_pending_age_seconds"),
        blocked_aggregates: r.get("blocked_aggregates"),
        blocked_rows: r.get("blocked_rows"),
    })
}

/// The parked outbox rows, oldest first, at most `$1`: each with its last error and the rows of its
/// aggregate waiting behind it (`held_behind`), so that `needs-review --outbox` says which row
/// blocks which aggregate.
pub const PARKED_SQL: &str = "\
SELECT o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.attempts, o.fencing_token,
       to_char(o.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') AS created_at,
       to_char(o.parked_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') AS parked_at,
       o.last_error,
       (SELECT count(*) FROM outbox AS b
         WHERE b.aggregate_type = o.aggregate_type AND b.aggregate_id = o.aggregate_id
           AND b.published_at IS NULL AND b.id > o.id) AS held_behind
  FROM outbox AS o
 WHERE o.published_at IS NULL AND o.parked_at IS NOT NULL
 ORDER BY o.id
 LIMIT $1";

/// A row of [`PARKED_SQL`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct ParkedOutboxRow {
    pub id: i64,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub attempts: i32,
    pub fencing_token: i64,
    pub created_at: String,
    pub parked_at: String,
    pub last_error: Option<String>,
    /// Undelivered rows of the same aggregate after this one: they wait until it is delivered.
    pub held_behind: i64,
}

/// Runs [`PARKED_SQL`].
pub async fn parked_rows(
    client: &(impl tokio_postgres::GenericClient + Sync),
    limit: i64,
) -> Result<Vec<ParkedOutboxRow>, tokio_postgres::Error> {
    let rows = client.query_typed(PARKED_SQL, &[(&limit, Type::INT8)]).await?;
    Ok(rows
        .iter()
        .map(|r| ParkedOutboxRow {
            id: r.get("id"),
            aggregate_type: r.get("aggregate_type"),
            aggregate_id: r.get("aggregate_id"),
            event_type: r.get("event_type"),
            attempts: r.get("attempts"),
            fencing_token: r.get("fencing_token"),
            created_at: r.get("created_at"),
            parked_at: r.get("parked_at"),
            last_error: r.get("last_error"),
            held_behind: r.get("held_behind"),
        })
        .collect())
}

/// How many parked outbox rows match `requeue --outbox --all`'s filters (`$1` event type or NULL,
/// `$2` text `last_error` contains, LIKE-escaped, or NULL).
pub const COUNT_PARKED_SQL: &str = "\
SELECT count(*) FROM outbox
 WHERE published_at IS NULL AND parked_at IS NOT NULL
   AND ($1::text IS NULL OR event_type = $1)
   AND ($2::text IS NULL OR last_error ILIKE '%' || $2 || '%')";

/// Runs [`COUNT_PARKED_SQL`].
pub async fn count_parked(
    client: &(impl tokio_postgres::GenericClient + Sync),
    event_type: Option<&str>,
    error_like: Option<&str>,
) -> Result<i64, tokio_postgres::Error> {
    let row = client
        .query_typed_one(COUNT_PARKED_SQL, &[(&event_type, Type::TEXT), (&error_like, Type::TEXT)])
        .await?;
    Ok(row.get(0))
}

/// Requeue (an operator's transaction): parked rows back in the queue — `attempts` 0, not parked,
/// available now, `last_error` kept until a delivery succeeds — and the rows held behind each
/// released (available now: the next claim holds again all but the first). `$1` the ids to take,
/// or NULL for the oldest parked rows matching `$2` (event type or NULL) and `$3` (text `last_error`
/// contains, LIKE-escaped, or NULL), at most `$4`; rows another session holds are skipped (SKIP LOCKED),
/// never waited for. The fencing token is kept: it only grows. Returns the ids requeued.
pub const REQUEUE_SQL: &str = "\
WITH picked AS (
    SELECT o.id FROM outbox AS o
     WHERE o.published_at IS NULL AND o.parked_at IS NOT NULL
       AND ($1::int8[] IS NULL OR o.id = ANY ($1))
       AND ($2::text IS NULL OR o.event_type = $2)
       AND ($3::text IS NULL OR o.last_error ILIKE '%' || $3 || '%')
     ORDER BY o.id
     LIMIT $4
       FOR UPDATE SKIP LOCKED
), requeued AS (
    UPDATE outbox AS o
       SET attempts = 0, parked_at = NULL, available_at = now()
      FROM picked
     WHERE o.id = picked.id
    RETURNING o.id, o.aggregate_type, o.aggregate_id
), released AS (
    UPDATE outbox AS n
       SET available_at = now()
      FROM requeued AS r
     WHERE n.aggregate_type = r.aggregate_type AND n.aggregate_id = r.aggregate_id
       AND n.published_at IS NULL AND n.parked_at IS NULL AND n.id > r.id
       AND n.attempts = 0 AND n.available_at > now()
    RETURNING n.id
)
SELECT id FROM requeued ORDER BY id";

/// Runs [`REQUEUE_SQL`]; returns the ids requeued.
pub async fn requeue(
    client: &(impl tokio_postgres::GenericClient + Sync),
    ids: Option<&[i64]>,
    event_type: Option<&str>,
    error_like: Option<&str>,
    limit: i64,
) -> Result<Vec<i64>, tokio_postgres::Error> {
    let ids = ids.map(<[i64]>::to_vec);
    let params: [(&(dyn ToSql + Sync), Type); 4] = [
        (&ids, Type::INT8_ARRAY),
        (&event_type, Type::TEXT),
        (&error_like, Type::TEXT),
        (&limit, Type::INT8),
    ];
    let rows = client.query_typed(REQUEUE_SQL, &params).await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// One outbox row by id: whether it exists, is published or parked (for `requeue --outbox --id`'s
/// refusals).
pub const ROW_STATE_SQL: &str = "\
SELECT published_at IS NOT NULL AS published, parked_at IS NOT NULL AS parked FROM outbox WHERE id = $1";

/// Runs [`ROW_STATE_SQL`]: `(published, parked)`, None when there is no such row.
pub async fn row_state(
    client: &(impl tokio_postgres::GenericClient + Sync),
    id: i64,
) -> Result<Option<(bool, bool)>, tokio_postgres::Error> {
    let row = client.query_typed_opt(ROW_STATE_SQL, &[(&id, Type::INT8)]).await?;
    Ok(row.map(|r| (r.get(0), r.get(1))))
}

/// Purge (an operator's batch): deletes up to `$3` published rows published before `$1`, in id
/// order from after id `$2` — one pass over the primary key however many batches it takes;
/// undelivered rows are never touched. Returns the number deleted and the last id looked at (the
/// next batch starts after it; NULL when none was left).
pub const PURGE_SQL: &str = "\
WITH batch AS (
    SELECT id, published_at < $1 AS old
      FROM outbox
     WHERE id > $2
     ORDER BY id
     LIMIT $3
), deleted AS (
    DELETE FROM outbox AS o
     USING batch
     WHERE o.id = batch.id AND batch.old AND o.published_at IS NOT NULL
    RETURNING o.id
)
SELECT (SELECT count(*) FROM deleted) AS deleted, (SELECT max(id) FROM batch) AS last_id";

/// Runs [`PURGE_SQL`]: `(deleted, last id looked at)`.
pub async fn purge_batch(
    client: &(impl tokio_postgres::GenericClient + Sync),
    published_before: SystemTime,
    after_id: i64,
    batch: i64,
) -> Result<(i64, Option<i64>), tokio_postgres::Error> {
    let params: [(&(dyn ToSql + Sync), Type); 3] =
        [(&published_before, Type::TIMESTAMPTZ), (&after_id, Type::INT8), (&batch, Type::INT8)];
    let row = client.query_typed_one(PURGE_SQL, &params).await?;
    Ok((row.get(0), row.get(1)))
}

/// How many published rows a purge with this cutoff would delete (`purge --dry-run`).
pub const COUNT_PURGEABLE_SQL: &str = "SELECT count(*) FROM outbox WHERE published_at < $1";

/// Runs [`COUNT_PURGEABLE_SQL`].
pub async fn count_purgeable(
    client: &(impl tokio_postgres::GenericClient + Sync),
    published_before: SystemTime,
) -> Result<i64, tokio_postgres::Error> {
    let row = client.query_typed_one(COUNT_PURGEABLE_SQL, &[(&published_before, Type::TIMESTAMPTZ)]).await?;
    Ok(row.get(0))
}
