-- stripe-inbox schema, version 24: autovacuum's analyse of the outbox reads 3,000 rows, not 30,000.
--
-- What V23 did for webhook_inbox, for the table beside it: the outbox gets a row per event the
-- handlers publish, changes it twice more (claimed, published) and keeps it until purge, so it
-- is analysed as often as the inbox, and ANALYZE's sample is 300 rows per unit of the largest
-- statistics target among its columns. With the inbox's analyse at 3,000 rows, the outbox's was
-- the larger one: in a 30-minute soak at 800 events/s, 49 analyses of the outbox took 8.8 s of
-- CPU against the inbox's 2.6 s. Measured on an outbox of a million published rows (90,902 pages,
-- a local PostgreSQL 15): ANALYZE took 402–458 ms at the default target and 32–41 ms at 10
-- (docs/performance.md, "The inbox's analyse: 3,000 rows").
--
-- The plans that read the outbox do not hang on its histograms: the relay's claim and published
-- mark are prepared with their plan held to one shape (no sequential scans, hash or merge joins,
-- no sorts: store::queue::CLAIM_GENERIC_PLANNER_SQL), and the counts of unpublished rows read the
-- partial indexes, whose predicates' selectivity comes from null fractions that 3,000 rows give
-- as well as 30,000.
--
-- Every column, since the largest target sets the sample: a migration that adds a column to the
-- outbox sets its target too (migrate::every_column_of_the_outbox_has_a_statistics_target_of_10_so_its_analyse_samples_3000_rows).
-- Takes a SHARE UPDATE EXCLUSIVE lock for a catalog update: the handlers and the relays go on.
ALTER TABLE outbox
    ALTER COLUMN id SET STATISTICS 10,
    ALTER COLUMN aggregate_type SET STATISTICS 10,
    ALTER COLUMN aggregate_id SET STATISTICS 10,
    ALTER COLUMN event_type SET STATISTICS 10,
    ALTER COLUMN payload SET STATISTICS 10,
    ALTER COLUMN created_at SET STATISTICS 10,
    ALTER COLUMN published_at SET STATISTICS 10,
    ALTER COLUMN attempts SET STATISTICS 10,
    ALTER COLUMN available_at SET STATISTICS 10,
    ALTER COLUMN fencing_token SET STATISTICS 10,
    ALTER COLUMN last_error SET STATISTICS 10,
    ALTER COLUMN parked_at SET STATISTICS 10;
