-- stripe-inbox schema, version 23: autovacuum's analyse of webhook_inbox reads 3,000 rows, not 30,000.
--
-- ANALYZE samples 300 rows per unit of the largest statistics target among a table's columns
-- (default_statistics_target, 100: 30,000 rows), and reads a page for nearly every row it samples
-- when the rows are sparse, as the inbox's are at fillfactor 30 (V18): 30,000 pages, 234 MB, from
-- outside shared_buffers once the table is larger than they are. Autovacuum analyses the table
-- after 10 % of it changed (autovacuum_analyze_scale_factor), and an event changes a row three
-- times (stored, claimed, processed): an inbox keeping a million processed rows is analysed every
-- ~35,000 events, and each analyse read 30,000 pages the pipeline itself never touches. Measured
-- on a million-row inbox (333,334 pages, a local PostgreSQL 15): ANALYZE took 708–741 ms at the
-- default target and 54–59 ms at 10 (docs/performance.md, "The inbox's analyse: 3,000 rows").
--
-- What the planner needs from these statistics is little: the inbox's own statements find rows by
-- primary key, by the parked rows' index or by ranges of the heap (purge), and the claim reads the
-- queue table (V17), whose statistics keep the default. Counts and fractions (null_frac for
-- processed_at, n_distinct) come out of 3,000 rows as well as out of 30,000; what is coarser is the
-- histograms (10 buckets) and the most common values (10 per column). A team that reports on a
-- column of the inbox with its own SQL may give that column a larger target (`ALTER TABLE
-- webhook_inbox ALTER COLUMN event_type SET STATISTICS 100`), which every analyse then pays for.
--
-- Every column, since the largest target sets the sample: a migration that adds a column to
-- webhook_inbox sets its target too (migrate::every_column_of_the_inbox_has_a_statistics_target_of_10_so_its_analyse_samples_3000_rows).
-- Takes a SHARE UPDATE EXCLUSIVE lock for a catalog update: the ingest and the workers go on. The
-- statistics of the last analyse are kept until the next one.
ALTER TABLE webhook_inbox
    ALTER COLUMN provider SET STATISTICS 10,
    ALTER COLUMN endpoint SET STATISTICS 10,
    ALTER COLUMN event_id SET STATISTICS 10,
    ALTER COLUMN event_type SET STATISTICS 10,
    ALTER COLUMN payload SET STATISTICS 10,
    ALTER COLUMN received_at SET STATISTICS 10,
    ALTER COLUMN available_at SET STATISTICS 10,
    ALTER COLUMN attempts SET STATISTICS 10,
    ALTER COLUMN last_error SET STATISTICS 10,
    ALTER COLUMN processed_at SET STATISTICS 10,
    ALTER COLUMN parked_at SET STATISTICS 10,
    ALTER COLUMN payload_bytes SET STATISTICS 10,
    ALTER COLUMN raw_body SET STATISTICS 10,
    ALTER COLUMN held SET STATISTICS 10,
    ALTER COLUMN secret_position SET STATISTICS 10,
    ALTER COLUMN secret_fingerprint SET STATISTICS 10,
    ALTER COLUMN signature_t SET STATISTICS 10,
    ALTER COLUMN signature_v1 SET STATISTICS 10,
    ALTER COLUMN interruptions SET STATISTICS 10,
    ALTER COLUMN dismissed_at SET STATISTICS 10,
    ALTER COLUMN source SET STATISTICS 10;
