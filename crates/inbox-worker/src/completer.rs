//! The completer: writes what the process transaction could not — the failures of a batch
//! (transaction 3, one statement for all of them: `last_error` and the backoff, only while each row
//! still carries this worker's claim) after the process transaction rolled back, and at shutdown
//! the claimed rows handed back unstarted.

use deadpool_postgres::Pool;
use inbox_domain::db::describe_db_error;
use inbox_domain::inbox::store::queue::{self, Claimed, Failure};

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
    if rows.is_empty() {
        return 0;
    }
    let Ok(mut conn) = Conn::get(pool).await else {
        tracing::warn!(rows = rows.len(), "could not hand back claimed rows: their leases will expire");
        return 0;
    };
    match queue::hand_back(conn.client(), rows).await {
        Ok(handed) => {
            conn.set_clean(true);
            handed
        }
        Err(e) => {
            tracing::warn!(error = %describe_db_error(&e), rows = rows.len(), "could not hand back claimed rows: their leases will expire");
            0
        }
    }
}
