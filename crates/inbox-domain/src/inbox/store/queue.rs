//! The worker's statements, one group per transaction: claim (1), lock, re-check and mark
//! processed (2), record failures (3), and return claims whose attempt did not happen (at
//! shutdown, and after an infrastructure fault). The claim is prepared once per connection with a
//! plan it is held to; the others are sent unnamed (see the store's "Plans").

use tokio_postgres::types::{Json, ToSql, Type};
use tokio_postgres::{Client, Row, Transaction};

#[cfg(doc)]
use super::cursor::ClaimCursor;
use super::{key_columns, truncate_error, InboxKey};
use crate::db::Pooler;
use crate::handler::ClaimFilter;
use crate::inbox::event::InboxEvent;

/// A row a worker claimed: its key, and the values the claim wrote, which identify this claim:
/// `attempts` and the lease's end `leased_until` together. Every later write of this worker —
/// a failure, an interrupted attempt returned, a hand-back — applies only while the row still
/// carries both: after the lease expired and another worker claimed the row, `attempts` differs;
/// after an operator requeued it (attempts back to 0) and another claim counted the same attempt
/// number again, `leased_until` differs.
#[derive(Debug, Clone)]
pub struct Claimed {
    pub key: InboxKey,
    pub event_type: String,
    /// The attempt this claim counted (1 for the first).
    pub attempts: i32,
    /// The `available_at` this claim wrote: the end of its lease (microseconds, as stored).
    pub leased_until: std::time::SystemTime,
    pub received_at: std::time::SystemTime,
    /// Where the claimed version of the row is (`ctid`, as text): the process transaction finds
    /// the row there by a TID scan, unless the row has moved since (see [`LOCK_BY_CTID_SQL`]).
    pub ctid: String,
    /// The payload's size in bytes as received: what holding the row costs in memory.
    pub bytes: i64,
}

/// The oldest ready rows of one event type, `t.event_type`, at most `$2`, locked (SKIP LOCKED): an
/// ordered scan of `webhook_inbox_queue_by_type` (on the queue table, see the store's "The queue
/// table") from the type's first ready row, reading nothing of the other types, each row found in
/// `webhook_inbox` by its key and locked there. The queue's row and the inbox's are written in
/// the same transactions, so the versions this statement sees agree, and the inbox's columns are
/// not asked again here: a condition on them would be estimated on the whole table's statistics
/// (`processed_at IS NULL` on a table of processed rows), and the planner would then expect to
/// read the whole queue for `$2` rows and sort it. The updates check the rows they change (see
/// [`CLAIM_SQL`]). A string literal, for `concat!`.
macro_rules! ready_rows_of_type {
    () => {
        concat!(
            "SELECT w.ctid, w.attempts, w.available_at,
                          COALESCE(w.payload_bytes, octet_length(w.payload::text)) AS bytes,
                          w.payload IS NULL AS unreadable
                     FROM webhook_inbox_queue AS q
                     JOIN webhook_inbox AS w
                          ON (w.provider, w.endpoint, w.event_id) = (q.provider, q.endpoint, q.event_id)
                    WHERE q.event_type COLLATE \"C\" = t.event_type
                      AND q.available_at >= coalesce($5::timestamptz, '-infinity') AND q.available_at <= now()
                    ORDER BY q.available_at
                    LIMIT $2
                      FOR UPDATE OF w SKIP LOCKED"
        )
    };
}

/// What both claims do with their candidates (see [`CLAIM_SQL`]): the budget, the attempt limit,
/// the lease, the park. A string literal, for `concat!`.
macro_rules! claim_after_candidates {
    () => {
        concat!(
            "), ranked AS (
    SELECT ctid, attempts, bytes, unreadable, available_at,
           sum(bytes) OVER (ORDER BY available_at, ctid ROWS UNBOUNDED PRECEDING) - bytes AS before
      FROM candidates
), picked AS (
    SELECT ctid, attempts, bytes, unreadable FROM ranked WHERE before < $4
), claimed AS (
    UPDATE webhook_inbox AS w
       SET attempts = w.attempts + 1,
           available_at = now() + make_interval(secs => $3)
      FROM picked
     WHERE w.ctid = picked.ctid AND picked.attempts < $1 AND NOT picked.unreadable AND ",
    ready!("w."),
    "
    RETURNING w.provider, w.endpoint, w.event_id, w.event_type, w.attempts, w.received_at,
              w.ctid::text AS ctid, picked.bytes::int8 AS bytes, false AS parked, w.available_at
), exhausted AS (
    UPDATE webhook_inbox AS w
       SET parked_at = now(),
           held = CASE WHEN picked.unreadable THEN 'unstorable' ELSE w.held END,
           last_error = CASE
               WHEN picked.unreadable THEN
                   'unstorable: no payload to process, the body is kept in raw_body'
               WHEN w.attempts > $1 THEN
                   left('attempt limit lowered to ' || $1 || ' (--max-attempts): the row had used '
                        || w.attempts || ' attempts' || COALESCE('; its last error: ' || w.last_error, ''), 1024)
               ELSE left('attempt ' || w.attempts || ' of ' || $1
                         || ' ended without an outcome (its worker stopped or lost its lease)'
                         || COALESCE('; the attempt before: ' || w.last_error, ''), 1024)
           END
      FROM picked
     WHERE w.ctid = picked.ctid AND (picked.attempts >= $1 OR picked.unreadable) AND ",
    ready!("w."),
    "
    RETURNING w.provider, w.endpoint, w.event_id, w.event_type, w.attempts, w.received_at,
              w.ctid::text AS ctid, picked.bytes::int8 AS bytes, true AS parked, w.available_at
), taken AS (
    SELECT * FROM claimed
    UNION ALL
    SELECT * FROM exhausted
), resume AS (
    SELECT coalesce(min(available_at) FILTER (WHERE before >= $4),
                    CASE WHEN count(*) >= $2 THEN max(available_at) END,
                    now()) AS resume_from
      FROM ranked
)
SELECT taken.*, resume.resume_from
  FROM resume
  LEFT JOIN taken ON true"
        )
    };
}

/// Claim (transaction 1 of the worker): picks up to `$2` ready rows — unprocessed, not parked,
/// available — skipping rows other workers hold, and for each counts the attempt and leases it for
/// `$3` seconds. Its transaction commits before any work starts: a worker that dies mid-event still
/// used up an attempt, and a poison row stops at the limit.
///
/// Memory: the rows are taken in order while the payload bytes before them stay under `$4` (the
/// worker's free budget), so a claim never holds much more than the budget — at most one row more,
/// and always at least one row. A row's size is `payload_bytes` (written by the ingest), or for a
/// row stored before that column existed, its text measured here.
///
/// A picked row already at the attempt limit `$1` is not claimed but parked (`parked_at`, and a
/// `last_error` saying why): its last allowed attempt ended without an outcome — its worker died
/// or lost its lease — so no failure write parked it; or, past the limit, the limit was lowered
/// since its attempts were made (said so, with its last error). Rows at the limit from before parking was a
/// state of the row are parked the same way. So is a picked row without a payload (an unstorable
/// body whose hold someone cleared by hand): nothing could process it, so it is held as
/// `unstorable` again, not claimed.
///
/// Oldest availability first, over every type: the types with ready rows are found by a skip
/// scan of the queue table's `webhook_inbox_queue_by_type` (one probe per type: the next type
/// after the last), and
/// for each the oldest ready rows are read in order and locked, skipping rows other workers hold
/// ([`ready_rows_of_type!`]); of those, the oldest `$2`. The updates find the locked rows by
/// `ctid` (a TID scan) instead of a second primary-key lookup per row: a locked row cannot move. A
/// row another session updated and committed after this statement's snapshot comes out of the
/// lock as its new version, which that snapshot cannot see: it is left unclaimed this time and
/// stays ready. Candidates not picked (over the budget, or newer than the oldest `$2` of all
/// types) were locked only for the statement's short transaction. Returns the claimed rows
/// (`parked` false) and the rows it parked (`parked` true), each with its size.
///
/// Where the scans start: at `$5` (a [`ClaimCursor`]'s `since`; NULL for the whole queue), in
/// every type's part of the index, the skip scan's probes included. Each claim and each processed
/// mark leaves a dead entry at the front of its type's part of the index, where every claim from
/// the type's first entry would step over it; while any snapshot older than those rows is open (a
/// long reporting query, a `pg_dump`), neither vacuum nor the scans themselves can remove them,
/// and a claim that starts from the front reads more of them with each event processed. Returns,
/// besides the rows, `resume_from`, where the next claim may start: every ready row this claim
/// found unlocked and did not take is at or after it. That is the oldest candidate not picked
/// (over the budget, or newer than the oldest `$2` of all types); when every candidate was picked,
/// the newest of `$2` candidates (each type's rows past its candidates are newer than it: the
/// candidates are the oldest `$2` of the oldest `$2` of each type), or the snapshot's `now()` when
/// there were fewer (every ready row was read). The result always has one row: the rows taken,
/// each with `resume_from`, or one row of NULLs and `resume_from`.
///
/// The updates write no column an index of `webhook_inbox` names, so each is a HOT update (in
/// place on the row's page, no new index entry) when the page has room; the trigger on
/// `available_at` (or `parked_at`) moves the row's entry in the queue table in the same
/// transaction.
pub const CLAIM_SQL: &str = concat!(
    "\
WITH RECURSIVE ready_types(event_type) AS (
    (SELECT q.event_type COLLATE \"C\"
       FROM webhook_inbox_queue AS q
      WHERE q.available_at >= coalesce($5::timestamptz, '-infinity') AND q.available_at <= now()
      ORDER BY q.event_type COLLATE \"C\"
      LIMIT 1)
    UNION ALL
    SELECT (SELECT q.event_type COLLATE \"C\"
              FROM webhook_inbox_queue AS q
             WHERE q.event_type COLLATE \"C\" > r.event_type
               AND q.available_at >= coalesce($5::timestamptz, '-infinity') AND q.available_at <= now()
             ORDER BY q.event_type COLLATE \"C\"
             LIMIT 1)
      FROM ready_types AS r
     WHERE r.event_type IS NOT NULL
), candidates AS (
    SELECT c.*
      FROM ready_types AS t
     CROSS JOIN LATERAL (",
    ready_rows_of_type!(),
    ") AS c
     WHERE t.event_type IS NOT NULL
     ORDER BY available_at
     LIMIT $2
",
    claim_after_candidates!()
);

/// [`CLAIM_SQL`] for a worker that claims some event types only (see `handler::ClaimFilter`):
/// `$6` the types it claims by name, `$7`/`$8` the bounds (`low` ≤ type < `high`, in byte order) of
/// each ignored `prefix.*`; `$1`…`$5` as there. For each type named, its oldest ready rows
/// ([`ready_rows_of_type!`]: ready rows of the types this worker does not claim are never read,
/// however many wait in front); for each prefix, any ready rows in its range (ignored types: their
/// order does not matter). Of those, the oldest `$2`, then the same budget, attempt limit and
/// updates. A worker that claims several types with backlogs locks up to `$2` rows of each for
/// the instant the claim takes, and claims the oldest `$2` of them. The rows of an ignored
/// prefix are read type by type (in the order of the queue's index, which the `ORDER BY` names
/// so that no plan reads another index of the queue whole: a generic plan made on an empty queue
/// found the primary key as cheap), not in order of availability, so `resume_from` may pass some
/// of them: they wait for the cursor's next full scan (see [`ClaimCursor`]).
pub const CLAIM_TYPED_SQL: &str = concat!(
    "\
WITH candidates AS (
    SELECT c.*
      FROM (SELECT c.*
              FROM unnest($6::text[]) AS t(event_type)
             CROSS JOIN LATERAL (",
    ready_rows_of_type!(),
    ") AS c
            UNION ALL
            SELECT c.*
              FROM unnest($7::text[], $8::text[]) AS p(low, high)
             CROSS JOIN LATERAL (
                   SELECT w.ctid, w.attempts, w.available_at,
                          COALESCE(w.payload_bytes, octet_length(w.payload::text)) AS bytes,
                          w.payload IS NULL AS unreadable
                     FROM webhook_inbox_queue AS q
                     JOIN webhook_inbox AS w
                          ON (w.provider, w.endpoint, w.event_id) = (q.provider, q.endpoint, q.event_id)
                    WHERE q.event_type COLLATE \"C\" >= p.low AND q.event_type COLLATE \"C\" < p.high
                      AND q.available_at >= coalesce($5::timestamptz, '-infinity') AND q.available_at <= now()
                    ORDER BY q.event_type COLLATE \"C\", q.available_at
                    LIMIT $2
                      FOR UPDATE OF w SKIP LOCKED) AS c) AS c
     ORDER BY available_at
     LIMIT $2
",
    claim_after_candidates!()
);

/// The text of [`CLAIM_PLANNER_SQL`], a string literal for `concat!`
/// ([`CLAIM_GENERIC_PLANNER_SQL`] adds to it).
macro_rules! claim_planner {
    () => {
        "SET LOCAL enable_bitmapscan = off; SET LOCAL enable_sort = off; SET LOCAL jit = off"
    };
}

/// What a claim's transaction sets before the claim — the worker's here, the relay's
/// (`outbox::claim`) too: no bitmap scans and no sorts, so that the planner's only plan for the
/// candidates is the one they are written for, an ordered scan of the queue's index from the
/// cursor that stops after `$2` rows, whatever the statistics say. Local to the transaction (`SET
/// LOCAL`), in which no handler runs: nothing else the connection runs is affected.
///
/// * Bitmap scans: right after a burst, before autovacuum analysed the grown queue table (up to a
///   minute), the planner estimates a type's rows with its defaults — a few dozen, for twenty
///   thousand — and prefers a bitmap scan of all of them, a primary-key probe of the inbox for
///   each, and a sort: every claim would read the whole queue.
/// * Sorts: the planner takes an index's size from the last vacuum or analyse of its table. After
///   one that counted an index empty — the queue table with no backlog, the outbox's index of
///   unpublished rows with every row published — it costs a whole scan of that index at one page,
///   and a scan of all of it, filtered and sorted, comes out cheaper than the ordered scan. While a
///   long snapshot is open elsewhere those indexes keep every dead entry, and such a plan read all
///   of them at each claim: in soaks with a held snapshot, the worker's claim read the queue's
///   whole primary key (31k buffers a claim), the relay's the outbox's index of unpublished rows
///   (35k buffers, 29 ms a claim). With sorts off that plan costs what a forbidden one does. The
///   sorts the claim cannot do without (the candidates of all types, the budget's running sum) are
///   still done: every plan pays the same for them.
/// * JIT: a forbidden step's cost is added to every plan, and a plan that costly would otherwise
///   be compiled, which takes longer than the claim itself.
pub const CLAIM_PLANNER_SQL: &str = claim_planner!();

/// What a claim's transaction sets before the claim when it is prepared (the worker's, [`claim`],
/// and the relay's, `outbox::claim`; see `run_claim`):
/// [`CLAIM_PLANNER_SQL`], the generic plan always, and no sequential scans, hash joins or merge
/// joins. Planned at each claim, the claim cost PostgreSQL 0.5–0.75 ms of planning, as much as
/// running it; prepared, it is planned once per connection, and again after an analyse or a
/// vacuum of a table it reads (they invalidate cached plans), for no arguments in particular and
/// for the tables as they are then — empty, when a worker starts on a fresh database. What the
/// plan may be is therefore set here, not left to those sizes: with sorts off, each type's part of
/// the queue's index read in order from the cursor is the only plan for the candidates without a
/// forbidden step (on PostgreSQL 15 that alone gives it on an empty queue), and without sequential
/// scans, hash and merge joins nothing is left to find each candidate's inbox row but a probe of
/// its primary key — the three the queue's trigger runs without (V20), for the same reason. A
/// generic plan of the claim was what made a worker started on an empty queue read the whole
/// backlog at each claim (the store's "Plans"); these settings are what rule that plan out, and
/// `the_claims_generic_plan_made_on_an_empty_queue_reads_only_the_queues_index_once_it_grew` (and
/// the relay's `…_reads_outbox_ready_once_it_grew`) check it. Local to the claim's transaction, and
/// the claim is its only statement. The relay's published mark runs under them too
/// ([`run_prepared`]): made on an empty outbox, its plan otherwise found each aggregate's next row
/// by a sequential scan of the outbox.
pub const CLAIM_GENERIC_PLANNER_SQL: &str = concat!(
    claim_planner!(),
    "; SET LOCAL enable_seqscan = off; SET LOCAL enable_hashjoin = off; SET LOCAL enable_mergejoin = off; \
     SET LOCAL plan_cache_mode = force_generic_plan"
);

/// What a claim came to: the rows this worker now holds, and those it parked instead.
#[derive(Debug, Clone, Default)]
pub struct Claim {
    pub claimed: Vec<Claimed>,
    /// Ready rows already at the attempt limit, parked by this claim (see [`CLAIM_SQL`]).
    pub parked: Vec<Claimed>,
    /// Where the next claim may start (see [`CLAIM_SQL`]): what [`ClaimCursor::advance`] takes.
    pub resume_from: Option<std::time::SystemTime>,
}

/// Runs [`CLAIM_SQL`] for up to `limit` rows and `budget` payload bytes (see there), in a
/// transaction of its own whose `statement_timeout` (and `lock_timeout`) is `timeout`: the server abandons a claim that takes longer, so a claim the caller stopped
/// waiting for (its own deadline is longer) cannot commit leases nobody works (one round trip:
/// see `query_in_own_transaction`).
///
/// `filter` says which event types: every type ([`CLAIM_SQL`]), or those it names and prefixes
/// ([`CLAIM_TYPED_SQL`]); `since` where the scans start (a [`ClaimCursor`]'s; None: the whole
/// queue).
///
/// Prepared once per connection with a generic plan, unless behind a transaction pooler: see
/// `run_claim`.
#[allow(clippy::too_many_arguments)]
pub async fn claim(
    client: &deadpool_postgres::Object,
    pooler: Pooler,
    filter: &ClaimFilter,
    since: Option<std::time::SystemTime>,
    max_attempts: i32,
    limit: i64,
    budget: i64,
    lease: std::time::Duration,
    timeout: std::time::Duration,
) -> Result<Claim, tokio_postgres::Error> {
    let lease = lease.as_secs_f64();
    let lows: Vec<&str> = filter.prefixes.iter().map(String::as_str).collect();
    let highs: Vec<String> = filter.prefixes.iter().map(|p| prefix_end(p)).collect();
    let mut params: Vec<(&(dyn ToSql + Sync), Type)> = vec![
        (&max_attempts, Type::INT4),
        (&limit, Type::INT8),
        (&lease, Type::FLOAT8),
        (&budget, Type::INT8),
        (&since, Type::TIMESTAMPTZ),
    ];
    let sql = if filter.all {
        CLAIM_SQL
    } else {
        params.extend([
            (&filter.exact as &(dyn ToSql + Sync), Type::TEXT_ARRAY),
            (&lows, Type::TEXT_ARRAY),
            (&highs, Type::TEXT_ARRAY),
        ]);
        CLAIM_TYPED_SQL
    };
    // On a failed COMMIT the caller discards the connection; leases that did commit expire.
    let rows = run_claim(client, pooler, timeout, sql, &params).await?;
    let mut claim = Claim::default();
    for r in &rows {
        claim.resume_from = r.get(10);
        if r.get::<_, Option<String>>(0).is_none() {
            // The one row of a claim that took nothing.
            continue;
        }
        let row = Claimed {
            key: InboxKey { provider: r.get(0), endpoint: r.get(1), event_id: r.get(2) },
            event_type: r.get(3),
            attempts: r.get(4),
            received_at: r.get(5),
            ctid: r.get(6),
            bytes: r.get(7),
            leased_until: r.get(9),
        };
        if r.get::<_, bool>(8) {
            claim.parked.push(row);
        } else {
            claim.claimed.push(row);
        }
    }
    Ok(claim)
}

/// Runs a claim (`sql`: [`CLAIM_SQL`], [`CLAIM_TYPED_SQL`], the relay's `outbox::CLAIM_SQL`) in a
/// transaction of its own under `timeout` (see `query_in_own_transaction`): [`run_prepared`],
/// under [`CLAIM_PLANNER_SQL`] when sent unnamed.
pub(super) async fn run_claim(
    client: &deadpool_postgres::Object,
    pooler: Pooler,
    timeout: std::time::Duration,
    sql: &str,
    params: &[(&(dyn ToSql + Sync), Type)],
) -> Result<Vec<Row>, tokio_postgres::Error> {
    run_prepared(client, pooler, timeout, CLAIM_PLANNER_SQL, sql, params).await
}

/// Runs `sql` in a transaction of its own under `timeout` (see `query_in_own_transaction`).
/// Directly ([`Pooler::None`]) prepared once per connection (the pool's statement cache) and run
/// with its generic plan under [`CLAIM_GENERIC_PLANNER_SQL`]; behind a transaction pooler, where
/// no statement outlives its transaction, sent unnamed under `unnamed_setup` (empty for none).
/// For the statements whose planning costs as much as their work and whose only good plan those
/// settings leave: the claims and the relay's published mark (`outbox::mark_published`).
pub(super) async fn run_prepared(
    client: &deadpool_postgres::Object,
    pooler: Pooler,
    timeout: std::time::Duration,
    unnamed_setup: &str,
    sql: &str,
    params: &[(&(dyn ToSql + Sync), Type)],
) -> Result<Vec<Row>, tokio_postgres::Error> {
    match pooler {
        Pooler::None => {
            let types: Vec<Type> = params.iter().map(|(_, t)| t.clone()).collect();
            let prepared = client.prepare_typed_cached(sql, &types).await?;
            let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(value, _)| *value).collect();
            let statement = client.query(&prepared, &values);
            super::in_own_transaction(client, timeout, CLAIM_GENERIC_PLANNER_SQL, statement).await
        }
        Pooler::Transaction => {
            super::query_in_own_transaction_with(client, timeout, unnamed_setup, sql, params).await
        }
    }
}

/// The first string after every string that starts with `prefix`, in byte order: `prefix` with its
/// last byte one higher (a prefix of event-type characters, all ASCII below `~`).
fn prefix_end(prefix: &str) -> String {
    let mut bytes = prefix.as_bytes().to_vec();
    if let Some(last) = bytes.last_mut() {
        *last += 1;
    }
    String::from_utf8(bytes).expect("ASCII stays ASCII")
}

/// Locks the claimed rows for processing and re-checks they are still unprocessed (`$1`: the
/// claims' `ctid`s, as text). Deliberately without SKIP LOCKED: another worker's claim may hold a
/// row for an instant, and skipping would leave it until the lease expires; the wait is bounded by
/// lock_timeout. Rows in a stable order, so two transactions that share rows (possible only after
/// a lease expired) lock them in the same order instead of deadlocking. Returns each row's
/// current `ctid` (as text), valid while this transaction holds the lock: [`MARK_PROCESSED_SQL`]
/// uses it.
///
/// By `ctid`: a TID scan of the batch's rows whatever the queue's size. A claimed version another
/// transaction updated (and committed) since is not visible here and comes back missing:
/// [`LOCK_BY_KEY_SQL`] looks for those rows by key.
pub const LOCK_BY_CTID_SQL: &str = "\
SELECT w.provider, w.endpoint, w.event_id, w.event_type, w.payload, w.ctid::text
  FROM webhook_inbox AS w
 WHERE w.ctid = ANY($1::text[]::tid[])
   AND w.processed_at IS NULL
 ORDER BY w.provider, w.endpoint, w.event_id
   FOR UPDATE";

/// [`LOCK_BY_CTID_SQL`] by key (`$1..$3`: arrays of provider, endpoint, event_id), for the rare
/// claims whose row moved since: the lease expired and another worker claimed the row (we may
/// still process it first; its processing then finds it done), or processed it (the row is
/// missing from the result too, and we do nothing with it).
pub const LOCK_BY_KEY_SQL: &str = "\
SELECT w.provider, w.endpoint, w.event_id, w.event_type, w.payload, w.ctid::text
  FROM webhook_inbox AS w
  JOIN unnest($1::text[], $2::text[], $3::text[]) AS k(provider, endpoint, event_id)
       ON (w.provider, w.endpoint, w.event_id) = (k.provider, k.endpoint, k.event_id)
 WHERE w.processed_at IS NULL
 ORDER BY w.provider, w.endpoint, w.event_id
   FOR UPDATE OF w";

/// A row the process transaction locked, still unprocessed: its event, and where it is.
#[derive(Debug)]
pub struct LockedRow {
    pub event: InboxEvent,
    /// The row's `ctid` (as text) while this transaction holds its lock, for [`mark_processed`].
    pub ctid: String,
}

impl LockedRow {
    fn from_row(row: Row) -> LockedRow {
        let payload: Json<Box<serde_json::value::RawValue>> = row.get(4);
        LockedRow {
            event: InboxEvent::new(row.get(0), row.get(1), row.get(2), row.get(3), payload.0),
            ctid: row.get(5),
        }
    }

    /// The row's key.
    pub fn key(&self) -> InboxKey {
        InboxKey {
            provider: self.event.provider.clone(),
            endpoint: self.event.endpoint.clone(),
            event_id: self.event.event_id.clone(),
        }
    }
}

/// Runs [`LOCK_BY_CTID_SQL`] for the claims.
pub async fn lock_by_ctid(
    tx: &Transaction<'_>,
    claimed: &[Claimed],
) -> Result<Vec<LockedRow>, tokio_postgres::Error> {
    let ctids: Vec<&str> = claimed.iter().map(|c| c.ctid.as_str()).collect();
    let params: [(&(dyn ToSql + Sync), Type); 1] = [(&ctids, Type::TEXT_ARRAY)];
    Ok(tx.query_typed(LOCK_BY_CTID_SQL, &params).await?.into_iter().map(LockedRow::from_row).collect())
}

/// Runs [`LOCK_BY_KEY_SQL`] for the claims.
pub async fn lock_by_key(
    tx: &Transaction<'_>,
    claimed: &[&Claimed],
) -> Result<Vec<LockedRow>, tokio_postgres::Error> {
    let (providers, endpoints, ids) = key_columns(claimed.iter().map(|c| &c.key));
    let params: [(&(dyn ToSql + Sync), Type); 3] =
        [(&providers, Type::TEXT_ARRAY), (&endpoints, Type::TEXT_ARRAY), (&ids, Type::TEXT_ARRAY)];
    Ok(tx.query_typed(LOCK_BY_KEY_SQL, &params).await?.into_iter().map(LockedRow::from_row).collect())
}

/// Marks rows processed in the handlers' transaction, so each effect and its mark commit together
/// or not at all (the worker's, and an operator's replay). `$1`: the rows' `ctid`s (text) as a
/// lock statement returned them in this same transaction — the rows are locked since, so they
/// are still there (a TID scan instead of a primary-key lookup per row). `processed_at = now()`
/// also restarts a replayed row's retention. A HOT update (no index of `webhook_inbox` names
/// `processed_at` or `last_error`); the row's trigger removes it from the queue table.
pub const MARK_PROCESSED_SQL: &str = "\
UPDATE webhook_inbox
   SET processed_at = now(), last_error = NULL
 WHERE ctid = ANY($1::text[]::tid[])";

/// Runs [`MARK_PROCESSED_SQL`] for the rows at `ctids`.
pub async fn mark_processed(tx: &Transaction<'_>, ctids: &[&str]) -> Result<u64, tokio_postgres::Error> {
    tx.execute_typed(MARK_PROCESSED_SQL, &[(&ctids, Type::TEXT_ARRAY)]).await
}

/// Fail (transaction 3, after the process transaction rolled back), for every failed event of a
/// batch at once: records each error and moves the row to `now() + least(300, 2^attempts) *
/// random()` seconds (full jitter); a row whose attempt was the last allowed (`attempts >= $6`,
/// the worker's limit) is parked instead, for a person. Only while the row is unprocessed and
/// still carries this worker's claim (`attempts` and `available_at` as the claim left them, see
/// [`Claimed`]): a row another worker finished, or claimed again after this worker's lease
/// expired, is left to that worker. Arrays `$1..$3` key, `$4` the claims' attempts, `$5` their
/// lease ends, `$6` the errors; `$7` the attempt limit. Returns the rows recorded, each with
/// whether it is now parked. A counted failure ends a run of interruptions (see
/// [`RETURN_CLAIMS_SQL`]).
pub const RECORD_FAILURES_SQL: &str = concat!(
    "\
UPDATE webhook_inbox AS w
   SET last_error = f.error,
       interruptions = 0,
       available_at = now() + make_interval(secs => least(300, 2 ^ w.attempts) * random()),
       parked_at = CASE WHEN w.attempts >= $7 THEN now() END
  FROM unnest($1::text[], $2::text[], $3::text[], $4::int4[], $5::timestamptz[], $6::text[])
       AS f(provider, endpoint, event_id, attempts, leased_until, error)
 WHERE (w.provider, w.endpoint, w.event_id) = (f.provider, f.endpoint, f.event_id)
   AND w.processed_at IS NULL
   AND ",
    fenced!("w", "f"),
    "
RETURNING w.provider, w.endpoint, w.event_id, w.parked_at IS NOT NULL"
);

/// One failed event of a batch: its claim and the error to record (truncated to
/// [`super::MAX_ERROR_LEN`]).
#[derive(Debug, Clone, Copy)]
pub struct Failure<'a> {
    pub claimed: &'a Claimed,
    pub error: &'a str,
}

/// Runs [`RECORD_FAILURES_SQL`] with the worker's attempt limit; returns the keys recorded, each
/// with whether its row is now parked. A failure missing from the result was not recorded: its
/// row was processed, or claimed again, meanwhile.
pub async fn record_failures(
    client: &Client,
    failures: &[Failure<'_>],
    max_attempts: i32,
) -> Result<Vec<(InboxKey, bool)>, tokio_postgres::Error> {
    let (providers, endpoints, ids) = key_columns(failures.iter().map(|f| &f.claimed.key));
    let attempts: Vec<i32> = failures.iter().map(|f| f.claimed.attempts).collect();
    let leases: Vec<std::time::SystemTime> = failures.iter().map(|f| f.claimed.leased_until).collect();
    let errors: Vec<&str> = failures.iter().map(|f| truncate_error(f.error)).collect();
    let params: [(&(dyn ToSql + Sync), Type); 7] = [
        (&providers, Type::TEXT_ARRAY),
        (&endpoints, Type::TEXT_ARRAY),
        (&ids, Type::TEXT_ARRAY),
        (&attempts, Type::INT4_ARRAY),
        (&leases, Type::TIMESTAMPTZ_ARRAY),
        (&errors, Type::TEXT_ARRAY),
        (&max_attempts, Type::INT4),
    ];
    let rows = client.query_typed(RECORD_FAILURES_SQL, &params).await?;
    Ok(rows
        .iter()
        .map(|r| (InboxKey { provider: r.get(0), endpoint: r.get(1), event_id: r.get(2) }, r.get(3)))
        .collect())
}

/// Returns claims whose attempt did not happen: rows claimed but never started (at shutdown:
/// available at once, `last_error` kept, `$8` false), and rows whose batch an infrastructure fault
/// interrupted (`$8` true: the connection lost mid-transaction, a lock timeout on the batch's rows;
/// available after up to `$6` seconds, jittered so a whole storm's rows do not come back at one
/// instant, with `$7` as `last_error`). The attempt is given back, so an outage never walks healthy
/// events to the attempt limit — except past `$9` interruptions in a row (`interruptions`, V8):
/// a handler that stalls until the server cuts its session off looks like an outage, and must
/// still park one day, so from then on its interrupted attempts count. Only where the row still
/// carries this claim (see [`Claimed`]) and is unprocessed: a batch whose COMMIT was lost with its
/// connection may have committed, and then there is nothing to return. Arrays `$1..$3` key, `$4`
/// the claims' attempts, `$5` their lease ends.
pub const RETURN_CLAIMS_SQL: &str = concat!(
    "\
UPDATE webhook_inbox AS w
   SET attempts = w.attempts - CASE WHEN $8 AND w.interruptions >= $9 THEN 0 ELSE 1 END,
       interruptions = w.interruptions + CASE WHEN $8 THEN 1 ELSE 0 END,
       available_at = now() + make_interval(secs => $6 * random()),
       last_error = CASE
           WHEN $8 AND w.interruptions >= $9 THEN
               left($7 || ' (interrupted ' || (w.interruptions + 1) || ' times in a row: this attempt counts)', 1024)
           ELSE COALESCE($7, w.last_error)
       END
  FROM unnest($1::text[], $2::text[], $3::text[], $4::int4[], $5::timestamptz[])
       AS c(provider, endpoint, event_id, attempts, leased_until)
 WHERE (w.provider, w.endpoint, w.event_id) = (c.provider, c.endpoint, c.event_id)
   AND w.processed_at IS NULL
   AND ",
    fenced!("w", "c")
);

/// Why claims are returned ([`return_claims`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Return<'a> {
    /// Claimed but never started (shutdown): available now, `last_error` kept.
    Unstarted,
    /// Interrupted by an infrastructure fault: available within `within`, `error` recorded;
    /// not counted while the row has had fewer than `limit` interruptions in a row.
    Interrupted { within: std::time::Duration, error: &'a str, limit: i32 },
}

/// Runs [`RETURN_CLAIMS_SQL`] for `claimed`; returns how many rows were returned.
pub async fn return_claims(
    client: &Client,
    claimed: &[Claimed],
    why: Return<'_>,
) -> Result<u64, tokio_postgres::Error> {
    let (providers, endpoints, ids) = key_columns(claimed.iter().map(|c| &c.key));
    let attempts: Vec<i32> = claimed.iter().map(|c| c.attempts).collect();
    let leases: Vec<std::time::SystemTime> = claimed.iter().map(|c| c.leased_until).collect();
    let (delay, error, interrupted, limit) = match why {
        Return::Unstarted => (0.0, None, false, 0),
        Return::Interrupted { within, error, limit } => {
            (within.as_secs_f64(), Some(truncate_error(error)), true, limit)
        }
    };
    let params: [(&(dyn ToSql + Sync), Type); 9] = [
        (&providers, Type::TEXT_ARRAY),
        (&endpoints, Type::TEXT_ARRAY),
        (&ids, Type::TEXT_ARRAY),
        (&attempts, Type::INT4_ARRAY),
        (&leases, Type::TIMESTAMPTZ_ARRAY),
        (&delay, Type::FLOAT8),
        (&error, Type::TEXT),
        (&interrupted, Type::BOOL),
        (&limit, Type::INT4),
    ];
    client.execute_typed(RETURN_CLAIMS_SQL, &params).await
}

/// What workers LISTEN on; the ingest sends [`super::ingest::NOTIFY_SQL`].
pub const LISTEN_SQL: &str = "LISTEN webhook_inbox";
