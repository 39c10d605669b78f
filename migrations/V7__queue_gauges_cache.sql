-- stripe-inbox schema, version 7: the queue gauges, computed by one worker per interval.
--
-- Every worker exports the queue gauges (unprocessed, ready, needs review, oldest age) so that
-- any one of them scraped tells the state of the queue. Counting them scans every unprocessed
-- row; done by each of N workers every 5 s, a backlog of a million rows costs the server N scans
-- per interval. Instead the first worker whose refresh finds this row older than the interval
-- locks it (FOR UPDATE SKIP LOCKED: the others do not wait), counts, and writes the figures here;
-- every other worker reads them. One scan per interval, whatever the number of workers.
--
-- A single row (id is always true). `refreshed_at` starts at -infinity: the first refresh counts.
CREATE TABLE queue_gauges (
    id                             boolean     PRIMARY KEY DEFAULT true CHECK (id),
    refreshed_at                   timestamptz NOT NULL DEFAULT '-infinity',
    unprocessed                    bigint      NOT NULL DEFAULT 0,
    ready                          bigint      NOT NULL DEFAULT 0,
    needs_review                   bigint      NOT NULL DEFAULT 0,
    oldest_unprocessed_age_seconds float8      NOT NULL DEFAULT 0
);
INSERT INTO queue_gauges DEFAULT VALUES;
