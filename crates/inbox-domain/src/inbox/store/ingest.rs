//! What the ingest writes: verified events, as unprocessed rows, and the workers' wake-up.

use deadpool_postgres::GenericClient;

use crate::inbox::event::JsonBytes;

/// Stores verified events as unprocessed rows, unless the same (provider, endpoint, event_id) is
/// already stored: one statement for a whole batch of concurrent requests (group commit). Runs in
/// autocommit: when it returns, every row (or the proof it existed) is committed, which is what
/// makes answering 2xx afterwards safe. The caller sends each key at most once per batch.
///
/// A concurrent insert of the same key by another batch waits on the primary key for the first
/// one's outcome: if it commits, this one skips the row; if it rolls back, this one inserts it.
///
/// Parameters: provider, then one array per column: endpoints, event ids, event types, payloads,
/// and the payloads' sizes in bytes as received (the workers' memory budget counts them).
/// Returns the (endpoint, event_id) of the rows inserted; the others were duplicates.
pub const INSERT_EVENTS_SQL: &str = "\
INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, payload_bytes)
SELECT $1, e.endpoint, e.event_id, e.event_type, e.payload, e.payload_bytes
  FROM unnest($2::text[], $3::text[], $4::text[], $5::jsonb[], $6::int4[])
       AS e(endpoint, event_id, event_type, payload, payload_bytes)
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
    // Bodies are at most --max-body (far below 2 GiB); saturate rather than wrap all the same.
    let sizes: Vec<i32> = events.iter().map(|e| i32::try_from(e.payload.len()).unwrap_or(i32::MAX)).collect();
    let stmt = client.prepare_cached(INSERT_EVENTS_SQL).await?;
    let rows = client.query(&stmt, &[&provider, &endpoints, &ids, &types, &payloads, &sizes]).await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// Wakes idle workers. Sent by the ingest at most once per short interval, outside the insert
/// transactions (a NOTIFY inside each would serialise their commits). Workers LISTEN with
/// [`super::queue::LISTEN_SQL`].
pub const NOTIFY_SQL: &str = "SELECT pg_notify('webhook_inbox', '')";
