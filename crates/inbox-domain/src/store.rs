//! Every SQL statement on `webhook_inbox`, each a documented constant next to the function that
//! runs it and maps its rows. Handlers' statements on the business tables live with the handlers.
//!
//! # Plans
//! The statements the worker runs on the queue — [`CLAIM_SQL`], [`LOCK_BY_CTID_SQL`],
//! [`LOCK_BY_KEY_SQL`], [`MARK_PROCESSED_SQL`], [`RECORD_FAILURE_SQL`], [`HAND_BACK_SQL`] — are
//! sent unnamed (`query_typed`), so PostgreSQL plans each execution for its arguments and the
//! table as it is now. A prepared statement gets a generic plan cached after five executions, and
//! one cached while the queue was small stays when the queue grows: a worker started on an empty
//! queue claimed with a bitmap scan and sort of every ready row and locked and marked with scans
//! of the partial index, so under a backlog each batch read the whole backlog and the worker fell
//! further behind (end-to-end p99 of 5 to 12 s in the benchmark). Planning these statements once
//! per batch costs far less than that risk. The ingest's insert keeps its prepared statement: its
//! plan has no choice to make.

use deadpool_postgres::GenericClient;
use tokio_postgres::types::Type;
use tokio_postgres::Client;

use crate::event::JsonBytes;

/// Stores verified events as unprocessed rows, unless the same (provider, endpoint, event_id) is
/// already stored: one statement for a whole batch of concurrent requests (group commit). Runs in
/// autocommit: when it returns, every row (or the proof it existed) is committed, which is what
/// makes answering 2xx afterwards safe. The caller sends each key at most once per batch.
///
/// A concurrent insert of the same key by another batch waits on the primary key for the first
/// one's outcome: if it commits, this one skips the row; if it rolls back, this one inserts it.
///
/// Parameters: provider, then one array per column: endpoints, event ids, event types, payloads.
/// Returns the (endpoint, event_id) of the rows inserted; the others were duplicates.
pub const INSERT_EVENTS_SQL: &str = "\
INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload)
SELECT $1, e.endpoint, e.event_id, e.event_type, e.payload
  FROM unnest($2::text[], $3::text[], $4::text[], $5::jsonb[]) AS e(endpoint, event_id, event_type, payload)
ON CONFLICT (provider, endpoint, event_id) DO NOTHING
RETURNING endpoint, event_id";

/// One event to store.
#[derive(Debug, Clone, Copy)]
pub struct NewEvent<'a> {
    pub endpoint: &'a str,
    pub event_id: &'a str,
    pub event_type: &'a str,
    /// The verified body, stored as `jsonb`.
    pub payload: &'a [u8],
}

/// Whether an insert stored a new row or found the event already there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InsertOutcome {
    Accepted,
    Duplicate,
}

impl InsertOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            InsertOutcome::Accepted => "accepted",
            InsertOutcome::Duplicate => "duplicate",
        }
    }
}

/// Runs [`INSERT_EVENTS_SQL`] (prepared once per connection and cached); returns the keys
/// (endpoint, event_id) that were inserted.
pub async fn insert_events<C: GenericClient + Sync>(
    client: &C,
    provider: &str,
    events: &[NewEvent<'_>],
) -> Result<Vec<(String, String)>, tokio_postgres::Error> {
    let endpoints: Vec<&str> = events.iter().map(|e| e.endpoint).collect();
    let ids: Vec<&str> = events.iter().map(|e| e.event_id).collect();
    let types: Vec<&str> = events.iter().map(|e| e.event_type).collect();
    let payloads: Vec<JsonBytes<'_>> = events.iter().map(|e| JsonBytes(e.payload)).collect();
    let stmt = client.prepare_cached(INSERT_EVENTS_SQL).await?;
    let rows = client.query(&stmt, &[&provider, &endpoints, &ids, &types, &payloads]).await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// The identity of an inbox row.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct InboxKey {
    pub provider: String,
    pub endpoint: String,
    pub event_id: String,
}

/// A row a worker claimed: its key, and the values the claim wrote, which identify this claim
/// (a later claim of the same row by another worker has a higher `attempts`).
#[derive(Debug, Clone)]
pub struct Claimed {
    pub key: InboxKey,
    pub event_type: String,
    /// The attempt this claim counted (1 for the first).
    pub attempts: i32,
    pub received_at: std::time::SystemTime,
    /// Where the claimed version of the row is (`ctid`, as text): the process transaction finds
    /// the row there by a TID scan, unless the row has moved since (see [`LOCK_BY_CTID_SQL`]).
    pub ctid: String,
}

/// Claim (transaction 1 of the worker): picks up to `$2` ready rows — unprocessed, available,
/// below the attempt limit `$1` — skipping rows other workers hold, and for each counts the
/// attempt and leases it for `$3` seconds. Runs as one autocommit statement, so the attempt is
/// committed before any work starts: a worker that dies mid-event still used up an attempt, and a
/// poison row stops at the limit.
///
/// Oldest availability first; `ORDER BY` inside the locking subquery keeps the scan on the
/// partial index `webhook_inbox_unprocessed`. The update finds the locked rows by `ctid` (a TID
/// scan) instead of a second primary-key lookup per row: a locked row cannot move. A row another
/// session updated and committed after this statement's snapshot comes out of the lock as its
/// new version, which that snapshot cannot see: it is left unclaimed this time and stays ready.
pub const CLAIM_SQL: &str = "\
WITH picked AS (
    SELECT ctid
      FROM webhook_inbox
     WHERE processed_at IS NULL
       AND available_at <= now()
       AND attempts < $1
     ORDER BY available_at
     LIMIT $2
       FOR UPDATE SKIP LOCKED
)
UPDATE webhook_inbox AS w
   SET attempts = w.attempts + 1,
       available_at = now() + make_interval(secs => $3)
  FROM picked
 WHERE w.ctid = picked.ctid
RETURNING w.provider, w.endpoint, w.event_id, w.event_type, w.attempts, w.received_at, w.ctid::text";

/// Runs [`CLAIM_SQL`], unnamed (see the module's "Plans").
pub async fn claim(
    client: &Client,
    max_attempts: i32,
    limit: i64,
    lease: std::time::Duration,
) -> Result<Vec<Claimed>, tokio_postgres::Error> {
    let lease = lease.as_secs_f64();
    let rows = client
        .query_typed(CLAIM_SQL, &[(&max_attempts, Type::INT4), (&limit, Type::INT8), (&lease, Type::FLOAT8)])
        .await?;
    Ok(rows
        .iter()
        .map(|r| Claimed {
            key: InboxKey { provider: r.get(0), endpoint: r.get(1), event_id: r.get(2) },
            event_type: r.get(3),
            attempts: r.get(4),
            received_at: r.get(5),
            ctid: r.get(6),
        })
        .collect())
}

/// Bounds of the process transaction (transaction 2), transaction-local: they end with it and
/// never leak into the next use of the connection. `$1` statement_timeout, `$2` lock_timeout,
/// `$3` idle_in_transaction_session_timeout (a worker that stalls mid-transaction is cut off
/// and its row lock released).
pub const SET_LIMITS_SQL: &str = "\
SELECT set_config('statement_timeout', $1, true),
       set_config('lock_timeout', $2, true),
       set_config('idle_in_transaction_session_timeout', $3, true)";

/// Locks the claimed rows for processing and re-checks they are still unprocessed (`$1`: the
/// claims' `ctid`s, as text). Deliberately without SKIP LOCKED: another worker's claim may hold a
/// row for an instant, and skipping would leave it until the lease expires; the wait is bounded by
/// lock_timeout. Rows in a stable order, so two transactions that share rows (possible only after
/// a lease expired) lock them in the same order instead of deadlocking. Returns each row's
/// current `ctid` (as text), valid while this transaction holds the lock: [`MARK_PROCESSED_SQL`]
/// uses it.
///
/// By `ctid`: planned for its array (unnamed, see the module's "Plans"), a TID scan of the batch's
/// rows whatever the queue's size. A claimed version another transaction updated (and committed)
/// since is not visible here and comes back missing: [`LOCK_BY_KEY_SQL`] looks for those rows by
/// key.
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

/// Marks rows processed in the handlers' transaction, so each effect and its mark commit together
/// or not at all. `$1`: the rows' `ctid`s (text) as the lock statements returned them in
/// this same transaction — the rows are locked since, so they are still there (a TID scan instead
/// of a primary-key lookup per row).
pub const MARK_PROCESSED_SQL: &str = "\
UPDATE webhook_inbox
   SET processed_at = now(), last_error = NULL
 WHERE ctid = ANY($1::text[]::tid[])";

/// Runs [`MARK_PROCESSED_SQL`] for the rows at `ctids`, unnamed (see the module's "Plans").
pub async fn mark_processed(
    tx: &tokio_postgres::Transaction<'_>,
    ctids: &[&str],
) -> Result<u64, tokio_postgres::Error> {
    tx.execute_typed(MARK_PROCESSED_SQL, &[(&ctids, Type::TEXT_ARRAY)]).await
}

/// Splits keys into the three column arrays the batch statements take.
pub fn key_columns<'a>(
    keys: impl Iterator<Item = &'a InboxKey>,
) -> (Vec<&'a str>, Vec<&'a str>, Vec<&'a str>) {
    let mut columns = (Vec::new(), Vec::new(), Vec::new());
    for key in keys {
        columns.0.push(key.provider.as_str());
        columns.1.push(key.endpoint.as_str());
        columns.2.push(key.event_id.as_str());
    }
    columns
}

/// Fail (transaction 3, after the process transaction rolled back): records the error and moves
/// the row to `now() + least(300, 2^attempts) * random()` seconds (full jitter). Only while the
/// row is unprocessed: a row another worker finished is left alone. Returns the attempts, so the
/// caller can tell whether the row is now parked.
pub const RECORD_FAILURE_SQL: &str = "\
UPDATE webhook_inbox
   SET last_error = $4,
       available_at = now() + make_interval(secs => least(300, 2 ^ attempts) * random())
 WHERE provider = $1 AND endpoint = $2 AND event_id = $3
   AND processed_at IS NULL
RETURNING attempts";

/// Hands back a row this worker claimed but never started (shutdown): the claim's attempt is
/// returned and the row is available at once. Only when the row still carries this claim
/// (`attempts = $4`, unprocessed): if the lease expired and another worker claimed it, nothing.
pub const HAND_BACK_SQL: &str = "\
UPDATE webhook_inbox
   SET attempts = attempts - 1, available_at = now()
 WHERE provider = $1 AND endpoint = $2 AND event_id = $3
   AND processed_at IS NULL AND attempts = $4";

/// The longest `last_error` stored.
pub const MAX_ERROR_LEN: usize = 1024;

/// Truncates an error message to [`MAX_ERROR_LEN`] bytes on a character boundary.
pub fn truncate_error(message: &str) -> &str {
    if message.len() <= MAX_ERROR_LEN {
        return message;
    }
    let mut end = MAX_ERROR_LEN;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    &message[..end]
}

/// Runs [`RECORD_FAILURE_SQL`] (unnamed, see the module's "Plans"); returns the row's attempts,
/// or None when it was processed meanwhile.
pub async fn record_failure(
    client: &Client,
    key: &InboxKey,
    error: &str,
) -> Result<Option<i32>, tokio_postgres::Error> {
    let error = truncate_error(error);
    let row = client
        .query_typed_opt(
            RECORD_FAILURE_SQL,
            &[
                (&key.provider, Type::TEXT),
                (&key.endpoint, Type::TEXT),
                (&key.event_id, Type::TEXT),
                (&error, Type::TEXT),
            ],
        )
        .await?;
    Ok(row.map(|r| r.get(0)))
}

/// Runs [`HAND_BACK_SQL`] (unnamed, see the module's "Plans"); true when the row was handed back.
pub async fn hand_back(client: &Client, claimed: &Claimed) -> Result<bool, tokio_postgres::Error> {
    let key = &claimed.key;
    let n = client
        .execute_typed(
            HAND_BACK_SQL,
            &[
                (&key.provider, Type::TEXT),
                (&key.endpoint, Type::TEXT),
                (&key.event_id, Type::TEXT),
                (&claimed.attempts, Type::INT4),
            ],
        )
        .await?;
    Ok(n == 1)
}

/// Wakes idle workers. Sent by the ingest at most once per short interval, outside the insert
/// transactions (a NOTIFY inside each would serialise their commits).
pub const NOTIFY_SQL: &str = "SELECT pg_notify('webhook_inbox', '')";
/// What workers LISTEN on.
pub const LISTEN_SQL: &str = "LISTEN webhook_inbox";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_truncated_on_a_character_boundary() {
        assert_eq!(truncate_error("short"), "short");
        let long = "é".repeat(MAX_ERROR_LEN);
        let cut = truncate_error(&long);
        assert!(cut.len() <= MAX_ERROR_LEN && cut.len() >= MAX_ERROR_LEN - 1);
        assert!(cut.chars().all(|c| c == 'é'));
    }
}
