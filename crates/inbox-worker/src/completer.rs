//! The completer: writes a failed event's outcome (transaction 3) after the process transaction
//! rolled back — `last_error` and the backoff, only while the row is unprocessed.

use deadpool_postgres::Pool;
use inbox_domain::store::{self, Claimed};

use crate::executor::Conn;

/// What became of a failed row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureRecord {
    /// Will be retried after the backoff.
    Retrying,
    /// At the attempt limit: parked until an operator requeues it.
    Parked,
    /// Processed by another worker meanwhile: nothing recorded.
    AlreadyProcessed,
    /// The failure could not be written (database down); the lease expiry retries the row.
    NotRecorded,
}

/// Records `error` for `claimed`, on `conn` when it is clean, else on a new connection.
pub async fn record_failure(
    pool: &Pool,
    conn: Option<Conn>,
    claimed: &Claimed,
    error: &str,
    max_attempts: i32,
) -> FailureRecord {
    let mut conn = match conn.filter(Conn::is_clean) {
        Some(c) => c,
        None => match Conn::get(pool).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "could not record the failure: no connection");
                return FailureRecord::NotRecorded;
            }
        },
    };
    conn.set_clean(false);
    match store::record_failure(&*conn.client(), &claimed.key, error).await {
        Ok(Some(attempts)) => {
            conn.set_clean(true);
            if attempts >= max_attempts {
                FailureRecord::Parked
            } else {
                FailureRecord::Retrying
            }
        }
        Ok(None) => {
            conn.set_clean(true);
            FailureRecord::AlreadyProcessed
        }
        Err(e) => {
            tracing::warn!(error = %inbox_domain::handlers::describe_db_error(&e), "could not record the failure");
            FailureRecord::NotRecorded
        }
    }
}

/// Hands back rows claimed but never started (at shutdown), returning their attempt.
pub async fn hand_back(pool: &Pool, rows: &[Claimed]) -> usize {
    if rows.is_empty() {
        return 0;
    }
    let Ok(mut conn) = Conn::get(pool).await else {
        tracing::warn!(rows = rows.len(), "could not hand back claimed rows: their leases will expire");
        return 0;
    };
    let mut handed = 0;
    for claimed in rows {
        match store::hand_back(&*conn.client(), claimed).await {
            Ok(true) => handed += 1,
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(error = %e, "could not hand back a claimed row: its lease will expire");
                return handed;
            }
        }
    }
    conn.set_clean(true);
    handed
}
