-- stripe-inbox schema, version 20: the queue table's trigger finds each entry it deletes by a probe
-- of the primary key, whatever the planner estimates.
--
-- V19's delete joined the entries of rows that left the queue to the queue table by its key, with
-- sequential scans, hash joins and merge joins turned off for the function. That left the planner
-- one more plan than the probes: a nested loop whose outer side is a whole scan of the queue's
-- primary key, each entry compared with the departed rows. The planner takes the size of an index
-- of a table from the table's row estimate: after an analyse that found the queue (nearly) empty
-- — the steady state, the backlog is a few rows — it costs a whole scan of the index at one page,
-- cheaper than a probe per row. In the steady state vacuum keeps the index small and nobody
-- notices. While a long snapshot is open elsewhere (a reporting query held for minutes) the index
-- keeps every dead entry of every claim and mark, and each claim and each mark read all of them:
-- in a 6-minute soak with a 150 s snapshot this delete was the second-largest cost of PostgreSQL
-- (3.9 ms a call, 1960 buffers per row deleted), the machine ran at 100 %, and events waited
-- seconds (docs/performance.md, "Plans that read a grown index").
--
-- Now each departed row's entry is found by a LATERAL subquery with its key as the only condition
-- (its LIMIT keeps the planner from merging it into the join: it runs once per row, and the only
-- scan that answers it, sequential scans being off, is the primary key's probe), and the delete
-- takes the entries found by their TID (a TID scan per entry, one page each). No entry can move in
-- between: every write of the queue comes from these triggers on webhook_inbox, and the statement
-- that fired this one holds the lock on each departed row. What the queue holds does not change.
CREATE OR REPLACE FUNCTION webhook_inbox_queue_follow() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = public, pg_temp
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $function$
BEGIN
    DELETE FROM webhook_inbox_queue AS q
     USING (SELECT entry.ctid
              FROM (SELECT provider, endpoint, event_id FROM before_rows
                    EXCEPT
                    SELECT provider, endpoint, event_id FROM after_rows
                     WHERE processed_at IS NULL AND parked_at IS NULL) AS gone
             CROSS JOIN LATERAL (
                   SELECT e.ctid
                     FROM webhook_inbox_queue AS e
                    WHERE e.provider = gone.provider AND e.endpoint = gone.endpoint
                      AND e.event_id = gone.event_id
                    LIMIT 1) AS entry) AS found
     WHERE q.ctid = found.ctid;
    INSERT INTO webhook_inbox_queue (provider, endpoint, event_id, event_type, available_at, received_at)
    SELECT provider, endpoint, event_id, event_type, available_at, received_at FROM after_rows
     WHERE processed_at IS NULL AND parked_at IS NULL
    EXCEPT
    SELECT provider, endpoint, event_id, event_type, available_at, received_at FROM before_rows
     WHERE processed_at IS NULL AND parked_at IS NULL
        ON CONFLICT (provider, endpoint, event_id) DO UPDATE
       SET event_type = EXCLUDED.event_type, available_at = EXCLUDED.available_at,
           received_at = EXCLUDED.received_at;
    RETURN NULL;
END
$function$;

REVOKE ALL ON FUNCTION webhook_inbox_queue_follow() FROM PUBLIC;
