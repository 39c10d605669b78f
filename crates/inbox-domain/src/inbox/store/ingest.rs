//! What the ingest writes: verified events, as unprocessed rows, and the workers' wake-up.

use tokio_postgres::types::{ToSql, Type};

use crate::db::Pooler;

use crate::inbox::event::JsonBytes;

/// Stores verified events as unprocessed rows, unless the same (provider, endpoint, event_id) is
/// already stored: one statement for a whole batch of concurrent requests (group commit). Its
/// transaction has only this statement: when it returns, every row (or the proof it existed) is
/// committed, which is what makes answering 2xx afterwards safe. The caller sends each key at
/// most once per batch.
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

/// Runs [`INSERT_EVENTS_SQL`]; returns the keys (endpoint, event_id) that were inserted.
///
/// Directly ([`Pooler::None`]) the statement is prepared once per connection and runs in
/// autocommit, bounded by the session's `statement_timeout` (set when the ingest's pool opens the
/// connection): planning the insert at every execution, or wrapping it in BEGIN and COMMIT to set
/// the timeout per transaction, costs PostgreSQL a tenth to a quarter more CPU per request.
/// Behind a transaction pooler ([`Pooler::Transaction`]) no statement or setting survives its
/// transaction: the insert is sent unnamed, in a transaction of its own whose `statement_timeout`
/// (and `lock_timeout`) is `timeout` — BEGIN, the limits, the insert and COMMIT in one write, one
/// round trip.
pub async fn insert_events(
    client: &deadpool_postgres::Object,
    pooler: Pooler,
    provider: &str,
    events: &[NewEvent<'_>],
    timeout: std::time::Duration,
) -> Result<Vec<(String, String)>, tokio_postgres::Error> {
    let endpoints: Vec<&str> = events.iter().map(|e| e.endpoint).collect();
    let ids: Vec<&str> = events.iter().map(|e| e.event_id).collect();
    let types: Vec<&str> = events.iter().map(|e| e.event_type).collect();
    let payloads: Vec<JsonBytes<'_>> = events.iter().map(|e| JsonBytes(e.payload)).collect();
    // Bodies are at most --max-body (far below 2 GiB); saturate rather than wrap all the same.
    let sizes: Vec<i32> = events.iter().map(|e| i32::try_from(e.payload.len()).unwrap_or(i32::MAX)).collect();
    let params: [(&(dyn ToSql + Sync), Type); 6] = [
        (&provider, Type::TEXT),
        (&endpoints, Type::TEXT_ARRAY),
        (&ids, Type::TEXT_ARRAY),
        (&types, Type::TEXT_ARRAY),
        (&payloads, Type::JSONB_ARRAY),
        (&sizes, Type::INT4_ARRAY),
    ];
    let rows = match pooler {
        Pooler::None => {
            let insert = client.prepare_cached(INSERT_EVENTS_SQL).await?;
            let params: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(value, _)| *value).collect();
            client.query(&insert, &params).await?
        }
        Pooler::Transaction => {
            super::query_in_own_transaction(client, timeout, INSERT_EVENTS_SQL, &params).await?
        }
    };
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// Wakes idle workers. Sent by the ingest at most once per short interval, outside the insert
/// transactions (a NOTIFY inside each would serialise their commits). Workers LISTEN with
/// [`super::queue::LISTEN_SQL`].
pub const NOTIFY_SQL: &str = "SELECT pg_notify('webhook_inbox', '')";
