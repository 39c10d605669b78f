-- stripe-inbox schema, version 16: analysing the queues after PostgreSQL lost its statistics.
--
-- Autovacuum decides what to vacuum and analyse from the cumulative statistics
-- (pg_stat_user_tables: n_dead_tup, n_mod_since_analyze, n_ins_since_vacuum). PostgreSQL 15 keeps
-- them in shared memory and saves them only at a clean shutdown: after crash recovery (an
-- immediate shutdown, a server process killed by SIGKILL or the OOM killer, a machine that died),
-- on a promoted replica, or after pg_stat_reset(), every counter of every table starts again from
-- 0 and no vacuum or analyse is recorded. The dead row versions that the claims and the processed
-- marks left on webhook_inbox (and the relays' marks on outbox) before that are then counted
-- nowhere: autovacuum leaves the table and its partial indexes to bloat until enough *new* changes
-- accumulate (1% + 1000 rows of the table, V1) — with repeated crashes, never. An ANALYZE
-- re-estimates n_live_tup and n_dead_tup from its sample, and autovacuum takes over from there.
--
-- The workers do that (`inbox-worker run`, at start and then periodically: store::maintenance).
-- They run as inbox_worker (deploy/roles.sql), which does not own the tables, and PostgreSQL 15
-- lets only a table's owner (or the database's owner, or a superuser) ANALYZE it. So this
-- function is SECURITY DEFINER, owned by the tables' owner (the role running this migration;
-- deploy/roles.sql hands it to inbox_owner with the tables), executable by inbox_worker only, and
-- it does that one thing: for webhook_inbox, its queue (V17) and outbox, and nothing else, when the statistics
-- record no vacuum and no analyse of the table (last_vacuum, last_autovacuum, last_analyze and
-- last_autoanalyze all NULL: its counters started from nothing since) while the table has pages
-- on disk, it analyses the table. One row per table it found so: `analysed` true with the new
-- estimates, or false when another VACUUM or ANALYZE holds the table right now (LOCK … NOWAIT:
-- it neither waits for one nor makes autovacuum cancel one; the next check tries again). No row:
-- nothing to do (or another worker is checking right now).
--
-- Why that condition, rather than "n_live_tup = 0 AND n_dead_tup = 0": the workers keep running
-- through a crash and reconnect, and their first claims count again, so the counters are no
-- longer 0 by the time anyone looks; what stays true until a vacuum or an analyse re-estimates
-- them is that none is recorded. A table's size on disk rather than pg_class.reltuples or a row:
-- reltuples is -1 for a table never vacuumed or analysed before the crash, and a queue of only
-- dead rows has no row to find (looking for one would read every dead page). The condition also
-- holds on a new database until its first analyse: the one extra ANALYZE it costs there is cheap.
-- With track_counts off nothing would ever record the analyse (and autovacuum does not run), and a
-- standby cannot analyse: the function then does nothing.
--
-- Names resolve in the schema the tables are in (public, as deploy/roles.sql has it) with
-- pg_catalog first and temporary objects last, whatever the caller's search_path.
CREATE FUNCTION inbox_analyze_after_stats_reset()
RETURNS TABLE (relation text, bytes bigint, analysed boolean, live_tuples bigint, dead_tuples bigint)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = public, pg_temp
AS $function$
DECLARE
    tbl text;
    rel regclass;
BEGIN
    IF pg_catalog.pg_is_in_recovery() OR NOT pg_catalog.current_setting('track_counts')::boolean THEN
        RETURN;
    END IF;
    -- One caller at a time ("STRIPES1"); the others return at once, having done nothing.
    IF NOT pg_catalog.pg_try_advisory_xact_lock(6004514678024524593) THEN
        RETURN;
    END IF;
    -- Statistics read in a transaction are cached until cleared: read what a caller that held the
    -- lock just before recorded.
    PERFORM pg_catalog.pg_stat_clear_snapshot();
    FOREACH tbl IN ARRAY ARRAY['webhook_inbox', 'webhook_inbox_queue', 'outbox'] LOOP
        -- webhook_inbox_queue comes with V17: a database between the two has none.
        rel := pg_catalog.to_regclass(tbl);
        CONTINUE WHEN rel IS NULL;
        -- pg_stat_user_tables' last_vacuum, last_autovacuum, last_analyze and last_autoanalyze.
        CONTINUE WHEN pg_catalog.pg_stat_get_last_vacuum_time(rel) IS NOT NULL
                   OR pg_catalog.pg_stat_get_last_autovacuum_time(rel) IS NOT NULL
                   OR pg_catalog.pg_stat_get_last_analyze_time(rel) IS NOT NULL
                   OR pg_catalog.pg_stat_get_last_autoanalyze_time(rel) IS NOT NULL;
        relation := tbl;
        bytes := pg_catalog.pg_relation_size(rel);
        CONTINUE WHEN bytes = 0;
        BEGIN
            EXECUTE pg_catalog.format('LOCK TABLE %s IN SHARE UPDATE EXCLUSIVE MODE NOWAIT', rel);
        EXCEPTION WHEN lock_not_available THEN
            analysed := false;
            live_tuples := NULL;
            dead_tuples := NULL;
            RETURN NEXT;
            CONTINUE;
        END;
        EXECUTE pg_catalog.format('ANALYZE %s', rel);
        PERFORM pg_catalog.pg_stat_clear_snapshot();
        analysed := true;
        live_tuples := pg_catalog.pg_stat_get_live_tuples(rel);
        dead_tuples := pg_catalog.pg_stat_get_dead_tuples(rel);
        RETURN NEXT;
    END LOOP;
END
$function$;

-- Executable by the workers only (inbox-worker fetch's role is a member of inbox_worker).
-- deploy/roles.sql grants it too, for a database migrated before the roles existed.
REVOKE ALL ON FUNCTION inbox_analyze_after_stats_reset() FROM PUBLIC;
DO $grant$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'inbox_worker') THEN
        GRANT EXECUTE ON FUNCTION inbox_analyze_after_stats_reset() TO inbox_worker;
    END IF;
END
$grant$;
