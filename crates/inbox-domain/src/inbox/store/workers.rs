//! Each running worker's row in `inbox_workers` (migration V9): what it claims, so that the rows
//! no live worker claims can be counted as having no handler (`stats`, the `inbox_no_handler`
//! gauge, KEDA's ready count) instead of waiting unseen.

use std::time::Duration;

use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::GenericClient;

use crate::handler::{ClaimFilter, Registry};

/// A worker whose row was refreshed within this long is live (the `1 minute` of the SQL): a
/// worker refreshes its row every few seconds, so a minute covers a slow database and a
/// restart, and a worker killed without stopping stops counting within a minute.
pub const LIVE_FOR: Duration = Duration::from_secs(60);

/// Writes (or refreshes) a worker's row: `$1` id, `$2` program, `$3` handled types, `$4` ignore
/// patterns as given, `$5`…`$7` its [`ClaimFilter`]. Rows of workers not seen for a day (killed
/// without stopping) are deleted on the way.
pub const REGISTER_SQL: &str = "\
WITH gone AS (
    DELETE FROM inbox_workers WHERE seen_at < now() - interval '1 day'
)
INSERT INTO inbox_workers (id, program, handles, ignores, claims_all, claims_exact, claims_prefix)
VALUES ($1, $2, $3, $4, $5, $6, $7)
ON CONFLICT (id) DO UPDATE
   SET seen_at = now(), program = EXCLUDED.program, handles = EXCLUDED.handles,
       ignores = EXCLUDED.ignores, claims_all = EXCLUDED.claims_all,
       claims_exact = EXCLUDED.claims_exact, claims_prefix = EXCLUDED.claims_prefix";

/// Removes a worker's row (`$1` id) when it stops.
pub const UNREGISTER_SQL: &str = "DELETE FROM inbox_workers WHERE id = $1";

/// The live workers, oldest first.
pub const LIVE_SQL: &str = "\
SELECT id, program, handles, ignores, claims_all, claims_exact, claims_prefix,
       to_char(started_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') AS started_at,
       extract(epoch FROM now() - seen_at)::float8 AS seen_seconds_ago
  FROM inbox_workers
 WHERE seen_at > now() - interval '1 minute'
 ORDER BY started_at, id";

/// One worker as [`LIVE_SQL`] reads it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct WorkerRow {
    pub id: String,
    pub program: String,
    /// Event types with a handler.
    pub handles: Vec<String>,
    /// Ignore patterns, as given.
    pub ignores: Vec<String>,
    #[serde(skip)]
    pub claims: ClaimFilter,
    /// RFC 3339, UTC.
    pub started_at: String,
    /// Seconds since the worker last refreshed its row.
    pub seen_seconds_ago: f64,
}

/// Runs [`REGISTER_SQL`] for a worker `id` of `program` with `registry`.
pub async fn register(
    client: &(impl GenericClient + Sync),
    id: &str,
    program: &str,
    registry: &Registry,
) -> Result<(), tokio_postgres::Error> {
    let filter = registry.claim_filter();
    let handles: Vec<&str> = registry.event_types();
    let ignores: Vec<String> = registry.ignore_patterns().iter().map(ToString::to_string).collect();
    let params: [(&(dyn ToSql + Sync), Type); 7] = [
        (&id, Type::TEXT),
        (&program, Type::TEXT),
        (&handles, Type::TEXT_ARRAY),
        (&ignores, Type::TEXT_ARRAY),
        (&filter.all, Type::BOOL),
        (&filter.exact, Type::TEXT_ARRAY),
        (&filter.prefixes, Type::TEXT_ARRAY),
    ];
    client.execute_typed(REGISTER_SQL, &params).await.map(|_| ())
}

/// Runs [`UNREGISTER_SQL`].
pub async fn unregister(client: &(impl GenericClient + Sync), id: &str) -> Result<(), tokio_postgres::Error> {
    client.execute_typed(UNREGISTER_SQL, &[(&id, Type::TEXT)]).await.map(|_| ())
}

/// Runs [`LIVE_SQL`].
pub async fn live(client: &(impl GenericClient + Sync)) -> Result<Vec<WorkerRow>, tokio_postgres::Error> {
    Ok(client
        .query_typed(LIVE_SQL, &[])
        .await?
        .iter()
        .map(|r| WorkerRow {
            id: r.get("id"),
            program: r.get("program"),
            handles: r.get("handles"),
            ignores: r.get("ignores"),
            claims: ClaimFilter {
                all: r.get("claims_all"),
                exact: r.get("claims_exact"),
                prefixes: r.get("claims_prefix"),
            },
            started_at: r.get("started_at"),
            seen_seconds_ago: r.get("seen_seconds_ago"),
        })
        .collect())
}

/// Whether some worker of `live` claims `event_type`; true when none is live (nobody can tell).
pub fn claimed(live: &[WorkerRow], event_type: &str) -> bool {
    live.is_empty() || live.iter().any(|w| w.claims.claims(event_type))
}
