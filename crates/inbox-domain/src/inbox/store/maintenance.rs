//! What the queue tables need besides autovacuum: after PostgreSQL lost its cumulative statistics,
//! analysing `webhook_inbox`, its queue table and `outbox` again (migration V16, done by the
//! workers); after a long snapshot, rebuilding their grown indexes (`reindex`, by the owner: below).
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
//!
//! # Rebuilding the queue tables' indexes
//! The queue table's and the outbox's indexes hold few live entries (the backlog, the undelivered
//! rows) and take many dead ones (every claim and mark). Vacuum removes the dead entries and
//! frees their pages for reuse, but an index never gives pages back. While a snapshot is held
//! elsewhere (a report, a session idle in transaction, a standby's feedback) nothing dead can be
//! removed, and these indexes grow by every entry since it began: in the soak, a 5-minute snapshot
//! at 800 events/s took them from 1–6 MiB to 18–22 MiB each, where they stayed (docs/performance.md).
//! `inbox-worker reindex`, run by the tables' owner, rebuilds each of them that has grown well past
//! what a rebuild would give it, when what it gives back is worth reading the table for, with `REINDEX INDEX CONCURRENTLY`: the ingest, the workers and the
//! relays go on writing while it runs. [`QueueIndex::verdict`] decides, from the statistics' count
//! of an index's entries, or from a count made just then when it would act on them
//! ([`Verdict::wants_a_count`]); the statements are below.

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

/// The indexes of `webhook_inbox_queue` and `outbox`, with what [`QueueIndex::verdict`] needs: the
/// index's size, its entries as the last vacuum or analyse counted them (`reltuples`, -1 before
/// any), and an estimate of one entry's bytes on a leaf page — the line pointer (4) and the index
/// tuple's header (8), then the key columns: a fixed-width type's length, a variable one's average
/// width from `pg_stats` (plus its 1-byte header; 32 without statistics), rounded up to 8 as tuples
/// are aligned. `leftover`: an invalid index named as `REINDEX CONCURRENTLY` names its temporary
/// copies (`<index>_ccnew`, `_ccold`, with a digit when taken): what an interrupted rebuild leaves,
/// which every write still maintains. `table_bytes`: the table's heap, which a rebuild reads
/// twice. `owned`: whether the current role may rebuild it (only the
/// table's owner, or a member of its role, may). `name` is the index quoted for a statement,
/// `table_quoted` its table, and `predicate` a partial index's `WHERE` as PostgreSQL prints it:
/// what [`count_entries`] reads.
pub const QUEUE_INDEXES_SQL: &str = "\
SELECT format('%I.%I', n.nspname, ic.relname) AS name,
       ic.relname::text AS index,
       t.relname::text AS table_name,
       format('%I.%I', n.nspname, t.relname) AS table_quoted,
       pg_get_expr(i.indpred, i.indrelid) AS predicate,
       pg_relation_size(ic.oid) AS bytes,
       pg_relation_size(t.oid) AS table_bytes,
       ic.reltuples::float8 AS entries,
       12 + ((SELECT COALESCE(sum(CASE WHEN a.attlen > 0 THEN a.attlen
                                        ELSE COALESCE(s.avg_width, 32) + 1 END), 0)
                FROM pg_attribute a
                LEFT JOIN pg_stats s
                  ON s.schemaname = n.nspname AND s.tablename = t.relname AND s.attname = a.attname
               WHERE a.attrelid = ic.oid AND a.attnum > 0) + 7) / 8 * 8 AS entry_bytes,
       i.indisvalid AS valid,
       (NOT i.indisvalid AND ic.relname ~ '_cc(new|old)[0-9]*$') AS leftover,
       pg_has_role(t.relowner, 'USAGE') AS owned
  FROM pg_index i
  JOIN pg_class ic ON ic.oid = i.indexrelid
  JOIN pg_class t ON t.oid = i.indrelid
  JOIN pg_namespace n ON n.oid = ic.relnamespace
 WHERE i.indrelid IN ('webhook_inbox_queue'::regclass, 'outbox'::regclass)
 ORDER BY t.relname, ic.relname";

/// One index of [`QUEUE_INDEXES_SQL`].
#[derive(Debug, Clone, PartialEq)]
pub struct QueueIndex {
    /// The index, schema-qualified and quoted, for a statement.
    pub name: String,
    /// Its bare name, for people.
    pub index: String,
    /// `webhook_inbox_queue` or `outbox`.
    pub table: String,
    /// Its table, schema-qualified and quoted, for [`count_entries`].
    pub table_quoted: String,
    /// A partial index's predicate (SQL, as PostgreSQL prints it), for [`count_entries`].
    pub predicate: Option<String>,
    /// Its size on disk.
    pub bytes: i64,
    /// The size of its table's heap, which a rebuild reads (twice: to build, then to validate).
    pub table_bytes: i64,
    /// Its entries as the last vacuum or analyse counted them (None before any), or as
    /// [`count_entries`] counted them just now (`entries_counted`).
    pub entries: Option<f64>,
    /// Whether `entries` is [`count_entries`]'s count rather than the statistics' figure.
    pub entries_counted: bool,
    /// The estimated bytes of one entry on a leaf page (see [`QUEUE_INDEXES_SQL`]).
    pub entry_bytes: i64,
    /// Whether the index is valid (an interrupted concurrent build leaves an invalid one).
    pub valid: bool,
    /// An invalid temporary copy left by an interrupted `REINDEX CONCURRENTLY`.
    pub leftover: bool,
    /// Whether the current role may rebuild or drop it.
    pub owned: bool,
}

/// Bytes of a leaf page that entries fill when an index is built: the page less its header (24)
/// and the B-tree's special space (16), at the default leaf fillfactor of 90 %.
const LEAF_BYTES_AT_BUILD: f64 = (8192.0 - 24.0 - 16.0) * 0.9;

/// How many times what a rebuild would give it an index must be before `reindex` rebuilds it. An
/// index that takes dead entries between vacuums is always somewhat larger than a fresh build, and
/// grows back to that size after one: rebuilding it then would buy nothing for a scan of its table.
pub const REBUILD_WHEN_GROWN: f64 = 4.0;

/// The least share of its table's heap a rebuild must give back to be worth its reads: it reads the
/// heap twice. The queue table's heap is as short as the backlog, so its indexes always pass; the
/// outbox's holds the retention's rows, and a partial index of a few MiB past its size is not worth
/// reading a large outbox for.
pub const REBUILD_WHEN_FREEING_OF_TABLE: f64 = 0.1;

/// What `reindex` does with an index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// A leftover of an interrupted rebuild: dropped.
    DropLeftover,
    /// At least the minimum size and [`REBUILD_WHEN_GROWN`] × its estimated rebuilt size, and
    /// what a rebuild would give back is worth reading its table for: rebuilt.
    Rebuild,
    /// Smaller than the minimum size asked for: left.
    Small,
    /// Within [`REBUILD_WHEN_GROWN`] × its estimated rebuilt size: left.
    NotGrown,
    /// Grown, but what a rebuild would give back is under [`REBUILD_WHEN_FREEING_OF_TABLE`] of
    /// the table it reads: left.
    NotWorthReading,
    /// No vacuum or analyse has counted its entries yet: left.
    NoStatistics,
    /// Invalid, and not a leftover of a rebuild (someone else's build): left, and reported.
    Invalid,
}

impl Verdict {
    /// Whether acting on this verdict needs the index's entries counted first ([`count_entries`]).
    /// The statistics' figure is from the last vacuum or analyse that counted them, and a rebuild
    /// read from it may be wrong by every row inserted since: an index built on an empty table
    /// counts 0 entries until its first vacuum, and a queue counted while it was empty may hold a
    /// million rows an hour later, after the workers stopped. Such an index is dense, not grown,
    /// and a rebuild would read its table twice for nothing. A verdict that leaves the index
    /// cannot be wrong that way (more entries only make it less grown), so only a rebuild, or an
    /// index never counted, pays for a count.
    pub fn wants_a_count(self) -> bool {
        matches!(self, Verdict::Rebuild | Verdict::NoStatistics)
    }
}

impl QueueIndex {
    /// The size a rebuild would give the index, estimated: its entries at [`LEAF_BYTES_AT_BUILD`]
    /// a page, at least one page. None without a count of its entries.
    pub fn rebuilt_bytes(&self) -> Option<i64> {
        let entries = self.entries?;
        let pages = (entries * self.entry_bytes as f64 / LEAF_BYTES_AT_BUILD).ceil().max(1.0);
        Some(pages as i64 * 8192)
    }

    /// What `reindex` does with this index, given the smallest size worth a rebuild.
    pub fn verdict(&self, min_bytes: i64) -> Verdict {
        if self.leftover {
            return Verdict::DropLeftover;
        }
        if !self.valid {
            return Verdict::Invalid;
        }
        if self.bytes < min_bytes {
            return Verdict::Small;
        }
        match self.rebuilt_bytes() {
            None => Verdict::NoStatistics,
            Some(rebuilt) if (self.bytes as f64) < REBUILD_WHEN_GROWN * rebuilt as f64 => Verdict::NotGrown,
            Some(rebuilt)
                if ((self.bytes - rebuilt) as f64)
                    < REBUILD_WHEN_FREEING_OF_TABLE * self.table_bytes as f64 =>
            {
                Verdict::NotWorthReading
            }
            Some(_) => Verdict::Rebuild,
        }
    }
}

/// Lists the indexes of the queue tables ([`QUEUE_INDEXES_SQL`]).
pub async fn queue_indexes(client: &Client) -> Result<Vec<QueueIndex>, tokio_postgres::Error> {
    let rows = client.query_typed(QUEUE_INDEXES_SQL, &[]).await?;
    Ok(rows
        .iter()
        .map(|row| {
            let entries: f64 = row.get("entries");
            QueueIndex {
                name: row.get("name"),
                index: row.get("index"),
                table: row.get("table_name"),
                table_quoted: row.get("table_quoted"),
                predicate: row.get("predicate"),
                bytes: row.get("bytes"),
                table_bytes: row.get("table_bytes"),
                entries: (entries >= 0.0).then_some(entries),
                entries_counted: false,
                entry_bytes: row.get("entry_bytes"),
                valid: row.get("valid"),
                leftover: row.get("leftover"),
                owned: row.get("owned"),
            }
        })
        .collect())
}

/// The statement that counts `index`'s entries as a rebuild now would write them: the live rows
/// of its table, those its predicate holds for when it is partial. The planner reads them the
/// cheapest way it knows: for a partial index of the outbox, that index's own entries (few live,
/// the dead ones the index grew by); for the queue table, its heap, as short as the backlog. At
/// worst it reads the table once, which the rebuild it checks would read twice. Its text is the
/// catalog's, quoted by [`QUEUE_INDEXES_SQL`], never input.
pub fn count_entries_sql(index: &QueueIndex) -> String {
    match &index.predicate {
        Some(predicate) => format!("SELECT count(*) FROM {} WHERE {predicate}", index.table_quoted),
        None => format!("SELECT count(*) FROM {}", index.table_quoted),
    }
}

/// Counts now ([`count_entries_sql`]) the entries of each of `indexes` whose verdict at
/// `min_bytes` wants a count ([`Verdict::wants_a_count`]), and sets them as its `entries`. Indexes
/// with the same statement (a table's primary key and its other full indexes) share one count:
/// each statement reads the table once. On an error, the index it was counting.
pub async fn count_entries(
    client: &Client,
    indexes: &mut [QueueIndex],
    min_bytes: i64,
) -> Result<(), (String, tokio_postgres::Error)> {
    let mut counted: Vec<(String, f64)> = Vec::new();
    for index in indexes.iter_mut().filter(|i| i.verdict(min_bytes).wants_a_count()) {
        let sql = count_entries_sql(index);
        let entries = match counted.iter().find(|(done, _)| *done == sql) {
            Some((_, entries)) => *entries,
            None => {
                let rows = client.query_typed(&sql, &[]).await.map_err(|e| (index.index.clone(), e))?;
                let entries = rows.first().map_or(0, |r| r.get::<_, i64>(0)) as f64;
                counted.push((sql, entries));
                entries
            }
        };
        index.entries = Some(entries);
        index.entries_counted = true;
    }
    Ok(())
}

/// Key of the session advisory lock a `reindex` run holds ("STRIPER1"): a second run at the same
/// time would take the first one's copy in the making (invalid until built) for a leftover.
pub const REINDEX_LOCK_KEY: i64 = 0x5354_5249_5045_5231;

/// Takes [`REINDEX_LOCK_KEY`] for this session if no other session holds it; false if one does.
/// The lock ends with the session.
pub async fn try_lock_reindex(client: &Client) -> Result<bool, tokio_postgres::Error> {
    let row = client
        .query_typed(
            "SELECT pg_try_advisory_lock($1)",
            &[(&REINDEX_LOCK_KEY, tokio_postgres::types::Type::INT8)],
        )
        .await?;
    Ok(row.first().is_some_and(|r| r.get(0)))
}

/// The other sessions of this database whose snapshot is older than every transaction still
/// running: a report or a session idle in a REPEATABLE READ transaction, a long statement. A
/// rebuild started now would copy every entry such a snapshot keeps (a concurrent build keeps what
/// any snapshot may still see), then wait for it to end. `backend_xmin` and `usename` are what
/// `pg_stat_activity` shows of other roles' sessions to any role (their start times, queries and
/// backend types it hides without `pg_read_all_stats`); vacuums, whose snapshots no rebuild waits
/// for, are left out by their progress rows.
pub const OLD_SNAPSHOTS_SQL: &str = "\
SELECT a.pid, a.backend_xmin::text AS xmin, a.usename::text AS role
  FROM pg_stat_activity a
 WHERE a.datname = current_database()
   AND a.pid <> pg_backend_pid()
   AND a.backend_xmin IS NOT NULL
   AND age(a.backend_xmin) > age(pg_snapshot_xmin(pg_current_snapshot())::xid)
   AND a.pid NOT IN (SELECT v.pid FROM pg_stat_progress_vacuum v)
 ORDER BY age(a.backend_xmin) DESC";

/// A session of [`OLD_SNAPSHOTS_SQL`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotHolder {
    /// Its backend's process id (for `pg_terminate_backend`).
    pub pid: i32,
    /// Its snapshot's xmin: the same pid with the same xmin later has held the same snapshot.
    pub xmin: String,
    /// The role it logged in as.
    pub role: Option<String>,
}

/// Lists the sessions holding an old snapshot ([`OLD_SNAPSHOTS_SQL`]), oldest first.
pub async fn old_snapshot_holders(client: &Client) -> Result<Vec<SnapshotHolder>, tokio_postgres::Error> {
    let rows = client.query_typed(OLD_SNAPSHOTS_SQL, &[]).await?;
    Ok(rows
        .iter()
        .map(|row| SnapshotHolder { pid: row.get("pid"), xmin: row.get("xmin"), role: row.get("role") })
        .collect())
}

/// Sets the session's timeouts for [`rebuild_index`] and [`drop_leftover_index`], which run
/// outside any transaction (PostgreSQL refuses `CONCURRENTLY` in one): how long any wait for a
/// lock may last — including `REINDEX CONCURRENTLY`'s waits for the transactions that hold the
/// table, and for those whose snapshot is older than its build — and how long a statement may run.
pub async fn set_rebuild_timeouts(
    client: &Client,
    lock_timeout: std::time::Duration,
    statement_timeout: std::time::Duration,
) -> Result<(), tokio_postgres::Error> {
    let ms = |d: std::time::Duration| format!("{}ms", d.as_millis().max(1));
    client
        .query_typed(
            "SELECT set_config('lock_timeout', $1, false), set_config('statement_timeout', $2, false)",
            &[
                (&ms(lock_timeout), tokio_postgres::types::Type::TEXT),
                (&ms(statement_timeout), tokio_postgres::types::Type::TEXT),
            ],
        )
        .await
        .map(drop)
}

/// Rebuilds an index of [`queue_indexes`] without blocking its table's writers: `REINDEX INDEX
/// CONCURRENTLY` builds a copy beside it, swaps them and drops the old one. Interrupted (a lock
/// timeout, a statement timeout, a cancel), it leaves the copy behind, invalid
/// (`<index>_ccnew`): [`drop_leftover_index`] removes it. `name` must be an index's `name` as
/// [`queue_indexes`] returned it (already quoted).
pub async fn rebuild_index(client: &Client, name: &str) -> Result<(), tokio_postgres::Error> {
    client.batch_execute(&format!("REINDEX INDEX CONCURRENTLY {name}")).await
}

/// Drops a leftover of an interrupted rebuild (`DROP INDEX CONCURRENTLY`, which waits only for the
/// transactions using its table). `name` as for [`rebuild_index`].
pub async fn drop_leftover_index(client: &Client, name: &str) -> Result<(), tokio_postgres::Error> {
    client.batch_execute(&format!("DROP INDEX CONCURRENTLY IF EXISTS {name}")).await
}

/// The size of an index now (after a rebuild).
pub async fn index_bytes(client: &Client, name: &str) -> Result<i64, tokio_postgres::Error> {
    let row = client
        .query_typed("SELECT pg_relation_size($1::regclass)", &[(&name, tokio_postgres::types::Type::TEXT)])
        .await?;
    Ok(row.first().map_or(0, |r| r.get(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: i64 = 1024 * 1024;

    /// A queue index of 20 MiB holding 1000 entries of 24 bytes, in a table of 8 MiB.
    fn grown() -> QueueIndex {
        QueueIndex {
            name: "public.webhook_inbox_queue_by_type".into(),
            index: "webhook_inbox_queue_by_type".into(),
            table: "webhook_inbox_queue".into(),
            table_quoted: "public.webhook_inbox_queue".into(),
            predicate: None,
            bytes: 20 * MIB,
            table_bytes: 8 * MIB,
            entries: Some(1000.0),
            entries_counted: false,
            entry_bytes: 24,
            valid: true,
            leftover: false,
            owned: true,
        }
    }

    #[test]
    fn an_index_grown_past_four_times_its_rebuilt_size_and_the_minimum_is_rebuilt() {
        assert_eq!(grown().rebuilt_bytes(), Some(4 * 8192));
        assert_eq!(grown().verdict(8 * MIB), Verdict::Rebuild);
    }

    #[test]
    fn an_index_under_the_minimum_size_is_left_however_empty() {
        assert_eq!(grown().verdict(32 * MIB), Verdict::Small);
    }

    #[test]
    fn an_index_within_four_times_its_rebuilt_size_is_left() {
        // 1M entries of 24 bytes: ~3.2k pages (~25 MiB) when rebuilt.
        let dense = QueueIndex { entries: Some(1_000_000.0), bytes: 60 * MIB, ..grown() };
        assert_eq!(dense.verdict(8 * MIB), Verdict::NotGrown);
    }

    #[test]
    fn a_grown_index_of_a_large_table_is_left_when_a_rebuild_frees_under_a_tenth_of_the_table() {
        let big_outbox = QueueIndex { table: "outbox".into(), table_bytes: 10_000 * MIB, ..grown() };
        assert_eq!(big_outbox.verdict(8 * MIB), Verdict::NotWorthReading);
    }

    #[test]
    fn leftovers_are_dropped_other_invalid_indexes_and_uncounted_ones_are_left() {
        let leftover = QueueIndex { valid: false, leftover: true, bytes: 8192, ..grown() };
        assert_eq!(leftover.verdict(8 * MIB), Verdict::DropLeftover);
        let invalid = QueueIndex { valid: false, ..grown() };
        assert_eq!(invalid.verdict(8 * MIB), Verdict::Invalid);
        let uncounted = QueueIndex { entries: None, ..grown() };
        assert_eq!(uncounted.verdict(8 * MIB), Verdict::NoStatistics);
    }

    #[test]
    fn only_a_verdict_that_would_act_on_the_statistics_or_has_none_asks_for_a_count() {
        let asks: Vec<Verdict> = [
            Verdict::DropLeftover,
            Verdict::Rebuild,
            Verdict::Small,
            Verdict::NotGrown,
            Verdict::NotWorthReading,
            Verdict::NoStatistics,
            Verdict::Invalid,
        ]
        .into_iter()
        .filter(|v| v.wants_a_count())
        .collect();
        assert_eq!(asks, [Verdict::Rebuild, Verdict::NoStatistics]);
        // Counted, an index the statistics called empty is as dense as a rebuild would make it.
        let backlog = QueueIndex { entries: Some(0.0), ..grown() };
        assert_eq!(backlog.verdict(8 * MIB), Verdict::Rebuild);
        let counted = QueueIndex { entries: Some(600_000.0), entries_counted: true, ..backlog };
        assert_eq!(counted.verdict(8 * MIB), Verdict::NotGrown);
    }

    #[test]
    fn a_partial_index_is_counted_by_its_own_predicate() {
        let ready = QueueIndex {
            table_quoted: "public.outbox".into(),
            predicate: Some("((published_at IS NULL) AND (parked_at IS NULL))".into()),
            ..grown()
        };
        assert_eq!(
            count_entries_sql(&ready),
            "SELECT count(*) FROM public.outbox WHERE ((published_at IS NULL) AND (parked_at IS NULL))"
        );
        assert_eq!(count_entries_sql(&grown()), "SELECT count(*) FROM public.webhook_inbox_queue");
    }
}
