//! Every SQL statement on `webhook_inbox`, each a documented constant next to the function that
//! runs it and maps its rows. Handlers' statements on the business tables live with the handlers.

use deadpool_postgres::GenericClient;

use crate::event::{EventHead, JsonBytes};

/// Stores a verified event as an unprocessed row, unless the same (provider, endpoint, event_id)
/// is already stored. Runs as one autocommit statement: when it returns, the row (or the proof it
/// existed) is committed, which is what makes answering 2xx afterwards safe.
///
/// A concurrent insert of the same key waits on the primary key for the first one's outcome:
/// if it commits, this one is a duplicate; if it rolls back, this one inserts.
///
/// Parameters: provider, endpoint, event_id, event_type, payload (jsonb).
/// Returns one row when the event is new, none when it is a duplicate.
pub const INSERT_EVENT_SQL: &str = "\
INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (provider, endpoint, event_id) DO NOTHING
RETURNING 1";

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

/// Runs [`INSERT_EVENT_SQL`] (prepared once per connection and cached).
pub async fn insert_event<C: GenericClient + Sync>(
    client: &C,
    provider: &str,
    endpoint: &str,
    head: &EventHead<'_>,
    payload: &[u8],
) -> Result<InsertOutcome, tokio_postgres::Error> {
    let stmt = client.prepare_cached(INSERT_EVENT_SQL).await?;
    let rows = client
        .query(
            &stmt,
            &[&provider, &endpoint, &head.id.as_ref(), &head.event_type.as_ref(), &JsonBytes(payload)],
        )
        .await?;
    Ok(if rows.is_empty() { InsertOutcome::Duplicate } else { InsertOutcome::Accepted })
}
