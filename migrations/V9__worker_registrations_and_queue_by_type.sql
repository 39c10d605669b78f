-- stripe-inbox schema, version 9: a worker claims only the event types it can apply, and says so.
--
-- A worker used to claim every ready row and mark the types it had no handler for processed with
-- no effect. In a rolling deploy that adds a handler, or with two worker binaries on one database
-- (the stock invoice worker and a team's own), events were marked done by a worker that could not
-- apply them. Now a worker claims only the types its registry handles or explicitly ignores; the
-- others wait, unclaimed, for a worker that can.

-- The queue by event type, replacing webhook_inbox_queue (by availability only). A worker's claim
-- reads, for each type it claims, the oldest ready rows of that type — an ordered scan from the
-- type's first entry — so the ready rows of types it does not claim are never read, however many
-- wait in front; a worker that claims every type (`run --ignore '*'`) finds the types with ready
-- rows by a skip scan of the same index, one probe per type. In byte order ("C"), so that a
-- prefix (`customer.*`) is a range whatever the database's collation: the statements compare
-- event_type COLLATE "C". One queue index, not two: every insert, claim and processed mark
-- writes the queue index entries of its row.
--
-- Building it holds a SHARE lock on webhook_inbox (inserts wait: the ingest answers 503 and Stripe
-- retries) for one scan of the table: run `migrate` of this version at a quiet time.
CREATE INDEX webhook_inbox_queue_by_type
    ON webhook_inbox (event_type COLLATE "C", available_at)
 WHERE processed_at IS NULL AND parked_at IS NULL;
DROP INDEX webhook_inbox_queue;

-- Each running worker's row: what it claims, refreshed every few seconds (seen_at) and removed
-- when it stops. The rows nobody alive claims are counted as having no handler (`stats`, the
-- gauge inbox_no_handler and its alert) and are left out of the ready count that KEDA scales on:
-- more workers of the same binary would not take them either. A worker killed without stopping
-- leaves its row behind; it stops counting when seen_at is a minute old, and is deleted a day
-- later by the next worker that starts.
CREATE TABLE inbox_workers (
    id            text        PRIMARY KEY,   -- host, process id and start time
    program       text        NOT NULL,      -- the binary's name (a team's own, or inbox-worker)
    started_at    timestamptz NOT NULL DEFAULT now(),
    seen_at       timestamptz NOT NULL DEFAULT now(),
    handles       text[]      NOT NULL,      -- event types with a handler
    ignores       text[]      NOT NULL,      -- ignore patterns, as given (`*`, `prefix.*`, a type)
    claims_all    boolean     NOT NULL,      -- claims every type (`*` ignored)
    claims_exact  text[]      NOT NULL,      -- types claimed by name
    claims_prefix text[]      NOT NULL       -- prefixes of the types claimed by an ignored prefix.*
);

-- The queue gauges gain the rows no live worker claims.
ALTER TABLE queue_gauges ADD COLUMN no_handler bigint NOT NULL DEFAULT 0;
