//! The completer: writes what the process transaction could not — the failures of a batch
//! (transaction 3, one statement for all of them: `last_error` and the backoff, only while each row
//! still carries this worker's claim) after the process transaction rolled back; the attempts an
//! infrastructure fault interrupted, given back; and at shutdown the claimed rows handed back
//! unstarted.

use std::time::Duration;

use deadpool_postgres::Pool;
use inbox_domain::db::describe_db_error;
use inbox_domain::inbox::store::queue::{self, Claimed, Failure, Return};

use crate::conn::Conn;

/// What became of a failed row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureRecord {
    /// Will be retried after the backoff.
    Retrying,
    /// At the attempt limit: parked until an operator requeues it.
    Parked,
    /// Processed, or claimed again after this worker's lease expired, by another worker
    /// meanwhile: nothing recorded (that worker records its own outcome).
    Superseded,
    /// The failure could not be written (database down); the lease expiry retries the row.
    NotRecorded,
}

/// Records `failures` in one statement, on `conn` when it is clean, else on a new connection.
/// Returns one record per failure, in order.
pub async fn record_failures(
    pool: &Pool,
    conn: Option<Conn>,
    failures: &[Failure<'_>],
    max_attempts: i32,
) -> Vec<FailureRecord> {
    if failures.is_empty() {
        return Vec::new();
    }
    let not_recorded = || vec![FailureRecord::NotRecorded; failures.len()];
    let mut conn = match conn.filter(Conn::is_clean) {
        Some(c) => c,
        None => match Conn::get(pool).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, rows = failures.len(), "could not record failures: no connection");
                return not_recorded();
            }
        },
    };
    conn.set_clean(false);
    match queue::record_failures(conn.client(), failures, max_attempts).await {
        Ok(recorded) => {
            conn.set_clean(true);
            failures
                .iter()
                .map(|f| match recorded.iter().find(|(key, _)| *key == f.claimed.key) {
                    Some((_, true)) => FailureRecord::Parked,
                    Some((_, false)) => FailureRecord::Retrying,
                    None => FailureRecord::Superseded,
                })
                .collect()
        }
        Err(e) => {
            tracing::warn!(error = %describe_db_error(&e), rows = failures.len(), "could not record failures");
            not_recorded()
        }
    }
}

/// Hands back rows claimed but never started (at shutdown), returning their attempt; returns
/// how many were handed back (a row whose lease another worker took meanwhile is not).
pub async fn hand_back(pool: &Pool, rows: &[Claimed]) -> u64 {
    try_return(pool, rows, Return::Unstarted, "hand back claimed rows").await.unwrap_or_else(|| {
        tracing::warn!(rows = rows.len(), "could not hand back claimed rows: their leases will expire");
        0
    })
}

/// Longest delay before an interrupted row is claimable again: long enough for a restarting
/// database to come back, short enough not to matter; jittered, so the rows of a whole storm do
/// not return at one instant.
pub const INTERRUPTED_RETRY_WITHIN: Duration = Duration::from_secs(5);

/// Gives back the attempts of rows whose batch an infrastructure fault interrupted (not counted
/// toward the attempt limit until a row has been interrupted `max_attempts` times in a row;
/// `error` kept as `last_error`), retrying once on a fresh connection (the fault that interrupted
/// the batch may have taken this one's first connection too); returns how many were returned.
/// Rows not returned keep the attempt and come back when the lease expires.
pub async fn return_interrupted(pool: &Pool, rows: &[Claimed], error: &str, max_attempts: i32) -> u64 {
    let what = "return interrupted attempts";
    let why = Return::Interrupted { within: INTERRUPTED_RETRY_WITHIN, error, limit: max_attempts };
    for _ in 0..2 {
        if let Some(returned) = try_return(pool, rows, why, what).await {
            return returned;
        }
    }
    tracing::warn!(rows = rows.len(), "could not {what}: the attempts stay counted, the leases will expire");
    0
}

/// One [`queue::return_claims`] on a pooled connection; None when it could not be written.
async fn try_return(pool: &Pool, rows: &[Claimed], why: Return<'_>, what: &str) -> Option<u64> {
    if rows.is_empty() {
        return Some(0);
    }
    let mut conn = match Conn::get(pool).await {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!(error = %e, "no connection to {what}");
            return None;
        }
    };
    match queue::return_claims(conn.client(), rows, why).await {
        Ok(returned) => {
            conn.set_clean(true);
            Some(returned)
        }
        Err(e) => {
            tracing::debug!(error = %describe_db_error(&e), "could not {what}");
            None
        }
    }
}
