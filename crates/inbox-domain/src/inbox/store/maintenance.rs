//! What the queue tables need after PostgreSQL lost its cumulative statistics, done by the workers:
//! analysing `webhook_inbox`, its queue table and `outbox` again (migration V16).
//!
//! Autovacuum decides from `pg_stat_user_tables` (dead tuples, changes since the last analyse).
//! After crash recovery — an immediate shutdown, a server process killed by SIGKILL or the OOM
//! killer — on a promoted replica, or after `pg_stat_reset()`, PostgreSQL 15 starts every counter
//! from 0: the dead row versions the queue made before are counted nowhere, and autovacuum leaves
//! the table and its partial indexes to bloat until enough new changes pile up. An ANALYZE
//! re-estimates the live and dead tuples from its sample, and autovacuum takes over.
//!
//! The check is the SECURITY DEFINER function of V16, which only the workers may execute (the
//! worker's role does not own the tables, and only the owner may ANALYZE): it analyses a table
//! when the statistics record no vacuum and no analyse of it while it has pages on disk, returns
//! what it did, and costs a look at three tables' statistics entries otherwise. Every worker checks
//! for itself at start and then every interval (`inbox_worker`'s `statistics` task), as each
//! counts the open reconciliation items: a shared row electing one worker per interval would cost
//! more (a row lock and a write) than the look itself. The function takes an advisory lock, so two
//! workers never analyse at once, and once one has analysed a table the condition is false for
//! everyone until the next reset.

use tokio_postgres::Client;

use super::{set_limits, TransactionLimits};

/// Analyses `webhook_inbox`, `webhook_inbox_queue` and `outbox` if PostgreSQL's statistics lost them (see the module's
/// doc, and V16 for the condition): one row per table found so — `relation`, its `bytes` on disk,
/// `analysed` (false: another VACUUM or ANALYZE holds the table now; the next check tries again),
/// and the re-estimated `live_tuples` and `dead_tuples` when analysed. No row: nothing to do, or
/// another worker is checking right now.
pub const ANALYZE_AFTER_STATS_RESET_SQL: &str = "\
SELECT relation, bytes, analysed, live_tuples, dead_tuples
  FROM inbox_analyze_after_stats_reset()";

/// One table [`ANALYZE_AFTER_STATS_RESET_SQL`] found without statistics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatsResetAnalysis {
    /// `webhook_inbox`, `webhook_inbox_queue` or `outbox`.
    pub table: String,
    /// The table's size on disk (`pg_relation_size`): what the lost statistics no longer accounted for.
    pub bytes: i64,
    /// Whether it was analysed (false: another VACUUM or ANALYZE held it).
    pub analysed: bool,
    /// `n_live_tup` and `n_dead_tup` as the ANALYZE estimated them (None when not analysed).
    pub live_tuples: Option<i64>,
    pub dead_tuples: Option<i64>,
}

/// Runs [`ANALYZE_AFTER_STATS_RESET_SQL`] in a transaction of its own bounded by `limits` (an
/// ANALYZE of a large table reads up to 30,000 pages: give it a statement timeout of minutes, and
/// a short lock timeout). On error the caller discards the connection.
pub async fn analyze_after_stats_reset(
    client: &mut Client,
    limits: &TransactionLimits,
) -> Result<Vec<StatsResetAnalysis>, tokio_postgres::Error> {
    let tx = client.transaction().await?;
    set_limits(&tx, limits).await?;
    let rows = tx.query_typed(ANALYZE_AFTER_STATS_RESET_SQL, &[]).await?;
    tx.commit().await?;
    Ok(rows
        .iter()
        .map(|row| StatsResetAnalysis {
            table: row.get("relation"),
            bytes: row.get("bytes"),
            analysed: row.get("analysed"),
            live_tuples: row.get("live_tuples"),
            dead_tuples: row.get("dead_tuples"),
        })
        .collect())
}
