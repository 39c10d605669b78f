//! The queue tables analysed again after PostgreSQL lost its statistics (a crash restart, a
//! promoted replica, `pg_stat_reset()`): autovacuum counts dead tuples from those statistics, so
//! without an analyse the dead row versions made before the crash are never vacuumed until enough
//! new ones pile up. Checked at start and then every [`CHECK_INTERVAL`] by every worker — a look
//! at three tables' statistics entries — and analysed by whichever finds it needed first
//! (`inbox_domain::inbox::store::maintenance`, migration V16). Runs whether or not metrics are
//! served.

use std::time::Duration;

use inbox_domain::db::{describe_db_error, describe_pool_error, discard, within, DatabaseConfig};
use inbox_domain::inbox::store::{maintenance, TransactionLimits};
use tokio_postgres::error::SqlState;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

/// How often a worker checks (after the check at its start).
pub const CHECK_INTERVAL: Duration = Duration::from_secs(30);

/// How soon a check that could not reach the database is tried again: right after a crash
/// restart — when the check matters — the pool's connections are broken, and the first check
/// fails on one.
pub const RETRY_AFTER: Duration = Duration::from_secs(5);

/// Bounds of one check: an ANALYZE of a large table reads up to 30,000 pages (minutes on a slow
/// disk, at worst); the tables' locks are not waited for long (the ANALYZE itself takes its own
/// without waiting: V16).
const LIMITS: TransactionLimits = TransactionLimits {
    statement_timeout: Duration::from_secs(300),
    lock_timeout: Duration::from_secs(5),
    idle_timeout: Duration::from_secs(300),
};

/// Checks now and then every [`CHECK_INTERVAL`] ([`RETRY_AFTER`] after a failure) until `stop`.
pub async fn run(
    pool: deadpool_postgres::Pool,
    database: DatabaseConfig,
    metrics: Metrics,
    stop: CancellationToken,
) {
    let mut refusal_said = false;
    loop {
        let next = if check(&pool, &database, &metrics, &mut refusal_said).await {
            CHECK_INTERVAL
        } else {
            RETRY_AFTER
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(next) => {}
        }
    }
}

/// One check; false when it could not reach the database (no connection, a broken one, a server
/// shutting down or starting): a retry soon may succeed. Anything else waits for the next
/// interval: a refusal (no EXECUTE on the function, no function: said once, only an operator cures
/// it), an analyse cancelled at the statement timeout (another would take as long).
async fn check(
    pool: &deadpool_postgres::Pool,
    database: &DatabaseConfig,
    metrics: &Metrics,
    refusal_said: &mut bool,
) -> bool {
    let client = match pool.get().await {
        Ok(client) => client,
        Err(e) => {
            tracing::debug!(error = %describe_pool_error(&e), "checking the inbox's statistics: no connection");
            return false;
        }
    };
    let deadline = tokio::time::Instant::now() + LIMITS.statement_timeout + Duration::from_secs(5);
    let analyze = async |client: &mut deadpool_postgres::Object| {
        maintenance::analyze_after_stats_reset(client, &LIMITS).await
    };
    match within(client, deadline, database, analyze).await {
        Some((_, Ok(tables))) => {
            for table in tables {
                if table.analysed {
                    metrics.count_stats_reset_analysis(&table.table);
                    tracing::info!(
                        table = table.table,
                        bytes = table.bytes,
                        live_tuples = table.live_tuples,
                        dead_tuples = table.dead_tuples,
                        "analysed {}: PostgreSQL's statistics recorded no vacuum or analyse of it while it holds \
                         {} bytes (statistics lost to crash recovery, an immediate shutdown, a promoted \
                         replica or pg_stat_reset — or a new table); autovacuum counts its dead tuples again \
                         from these estimates",
                        table.table,
                        table.bytes,
                    );
                } else {
                    tracing::info!(
                        table = table.table,
                        bytes = table.bytes,
                        "{} needs an analyse (PostgreSQL's statistics record no vacuum or analyse of it) but \
                         another VACUUM or ANALYZE holds it: trying again in {} s",
                        table.table,
                        CHECK_INTERVAL.as_secs(),
                    );
                }
            }
            true
        }
        Some((client, Err(e))) => {
            let refused = matches!(
                e.code(),
                Some(&SqlState::INSUFFICIENT_PRIVILEGE) | Some(&SqlState::UNDEFINED_FUNCTION)
            );
            if refused && !*refusal_said {
                *refusal_said = true;
                tracing::warn!(
                    error = %describe_db_error(&e),
                    "cannot check whether PostgreSQL lost the inbox's statistics (after a crash, autovacuum \
                     would then leave its dead tuples): run `inbox-worker migrate` and apply deploy/roles.sql, \
                     which grants inbox_analyze_after_stats_reset() to inbox_worker"
                );
            } else {
                tracing::debug!(error = %describe_db_error(&e), "checking the inbox's statistics failed");
            }
            discard(client);
            // No SQLSTATE: the connection failed. Class 08: connection exceptions; 57P01..57P03:
            // the server shutting down, crashed, or still starting.
            e.code().is_some_and(|code| !code.code().starts_with("08") && !code.code().starts_with("57P0"))
        }
        None => {
            tracing::warn!("checking the inbox's statistics timed out: cancelled");
            true
        }
    }
}
