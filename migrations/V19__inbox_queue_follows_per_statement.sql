-- stripe-inbox schema, version 19: the queue table follows an UPDATE of webhook_inbox once per
-- statement, over all the rows it changed, instead of once per row.
--
-- V17's row trigger ran its PL/pgSQL function for each row a claim leased and each row a mark
-- processed: a batch of 64 made 64 calls, each switching to the owner (SECURITY DEFINER), setting
-- its search_path and running one upsert or delete through SPI. Profiled in the benchmark's
-- drain, those calls were a quarter of PostgreSQL's CPU. One call per statement makes the same
-- change with two set-wise statements over the statement's transition tables (the rows before
-- and after it), whatever the batch's size: an eighth of PostgreSQL's CPU in the same drain
-- (docs/performance.md, "The queue table kept once per statement").
--
-- Both statements read only the key and queue columns of the transition tables: a join that
-- kept whole rows of them (as DELETE … USING a transition table does, for its recheck) would
-- fetch every row's out-of-line payload.
--
-- The delete finds each entry by its key, by a probe of the primary key per row, whatever the
-- planner estimates: the function turns off sequential scans, hash joins and merge joins for its
-- own statements. The queue table is as short as the backlog, so the planner would read all of
-- it for each statement (a hash join over a sequential scan, or over a full index scan) — cheap
-- until a long snapshot is open elsewhere, while the table keeps every dead entry of every claim
-- and mark: in the soak, each claim and mark then read hundreds of thousands of them, and the
-- workers fell up to 17 s behind.
--
-- What the queue holds does not change: a row is there while it is neither processed nor parked,
-- with its event type, availability and arrival. After an UPDATE:
-- * the entries of rows that left (processed, parked) or changed their key are deleted, unless
--   another row of the same statement now waits under that key;
-- * the rows waiting after it whose entry changed (availability, type, arrival, key) or that
--   entered (requeued) are written by an upsert, so an entry missing for any reason is restored
--   by the row's next change, as before.
-- PostgreSQL allows transition tables only on a trigger without a column list, so this one fires
-- for every UPDATE of webhook_inbox, also those that write none of the queue's columns (a
-- failure's last_error alone, a dismissal): then both statements find nothing to do.
--
-- The function keeps its name and owner (deploy/roles.sql), and its safeguards: SECURITY
-- DEFINER, names resolved in public with temporary objects last, no EXECUTE for PUBLIC.
DROP TRIGGER webhook_inbox_queue_follow ON webhook_inbox;

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
     USING (SELECT provider, endpoint, event_id FROM before_rows
            EXCEPT
            SELECT provider, endpoint, event_id FROM after_rows
             WHERE processed_at IS NULL AND parked_at IS NULL) AS gone
     WHERE q.provider = gone.provider AND q.endpoint = gone.endpoint AND q.event_id = gone.event_id;
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

CREATE TRIGGER webhook_inbox_queue_follow
    AFTER UPDATE ON webhook_inbox
    REFERENCING OLD TABLE AS before_rows NEW TABLE AS after_rows
    FOR EACH STATEMENT EXECUTE FUNCTION webhook_inbox_queue_follow();

REVOKE ALL ON FUNCTION webhook_inbox_queue_follow() FROM PUBLIC;
