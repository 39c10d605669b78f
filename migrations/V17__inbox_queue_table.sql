-- stripe-inbox schema, version 17: the queue as a table of its own, so that claiming a row and
-- marking it processed are HOT updates of webhook_inbox.
--
-- PostgreSQL can update a row in place on its page, without a new entry in any index (a HOT
-- update), only when no column any index uses changes — a key column, or a column of a partial
-- index's predicate. The queue index (V9: event_type, available_at WHERE processed_at IS NULL AND
-- parked_at IS NULL) used both columns the worker writes: the claim writes available_at (the
-- lease), the processed mark processed_at. So every claim and every mark put a new entry in the
-- primary key and in the queue index, left the old ones dead, and copied the row (payload
-- included) wherever the page had no room: in `make bench` no update of webhook_inbox was HOT,
-- and each processed event left four dead index entries for vacuum. No index on webhook_inbox can
-- tell unprocessed rows from processed ones without naming processed_at, so the queue moves out:
-- webhook_inbox_queue holds, for each row that is neither processed nor parked, the columns the
-- index held (event type and availability) and the key, and nothing else. webhook_inbox keeps its
-- primary key and the parked rows' index, neither of which names a column the hot path writes, so
-- its claims and marks are HOT; the churn is on a table as narrow as an index and as short as
-- the backlog, which vacuum keeps small in a fraction of the time. The decision, measured against
-- the other choices (a lease column, fillfactor, the predicate, partitions), is in
-- docs/performance.md ("A claim HOT can serve").
--
-- Kept by triggers, not by the statements that change a row: every writer of webhook_inbox — the
-- ingest, reconcile, the worker, the operator commands, a team's own SQL, a restore, a test
-- inserting a row by hand — keeps the queue right without knowing it exists, exactly as it kept
-- the index right. The triggers do only that (no business rule): a row enters when it is stored
-- unprocessed and not parked, follows its availability while it waits, and leaves when it is
-- processed, parked, or deleted. The trigger functions are SECURITY DEFINER (they run as the
-- tables' owner), so the roles that write webhook_inbox need no privilege on the queue; the roles
-- that read it are granted SELECT in deploy/roles.sql. Their names resolve in public (where
-- deploy/roles.sql has the tables) with temporary objects last, whatever the caller's search_path:
-- a caller's temporary table named webhook_inbox_queue is never the one they write.
--
-- Building it locks webhook_inbox against writes (the ingest answers 503 and Stripe retries) for
-- one read of the unprocessed rows and the parked index's build (one scan of the table): run
-- `migrate` of this version at a quiet time.
LOCK TABLE webhook_inbox IN SHARE ROW EXCLUSIVE MODE;

-- The queue. Every claim moves its row's available_at (the lease) and every mark deletes it: its
-- pages turn over as fast as events arrive, so it is vacuumed after 1% of it (+ 500 rows) changed,
-- with no cost delay, and analysed as often — the claim's plan reads it.
CREATE TABLE webhook_inbox_queue (
    provider     text        NOT NULL,
    endpoint     text        NOT NULL,
    event_id     text        NOT NULL,
    event_type   text        NOT NULL,
    -- webhook_inbox.available_at: when the row may next be claimed (lease end, backoff).
    available_at timestamptz NOT NULL,
    -- webhook_inbox.received_at: the oldest waiting row's age (the gauges) without the big table.
    received_at  timestamptz NOT NULL,
    PRIMARY KEY (provider, endpoint, event_id)
)
WITH (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 500,
    autovacuum_vacuum_insert_scale_factor = 0.01,
    autovacuum_vacuum_insert_threshold = 500,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_analyze_threshold = 500,
    autovacuum_vacuum_cost_delay = 0
);

-- What the claim reads (the name of the index it replaces, as V9 made it): per event type, the
-- rows in order of availability; the types with ready rows by a skip scan of the same index. In
-- byte order ("C"), so that a prefix (`customer.*`) is a range whatever the database's collation:
-- the claim compares event_type COLLATE "C".
DROP INDEX webhook_inbox_queue_by_type;
CREATE INDEX webhook_inbox_queue_by_type ON webhook_inbox_queue (event_type COLLATE "C", available_at);

-- A row enters when it is stored neither processed nor parked. Once per INSERT statement (the
-- ingest's group commit stores many rows in one), over the rows it inserted (ON CONFLICT DO
-- NOTHING leaves the duplicates out of `entered`).
CREATE FUNCTION webhook_inbox_queue_enter() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = public, pg_temp
AS $function$
BEGIN
    INSERT INTO webhook_inbox_queue (provider, endpoint, event_id, event_type, available_at, received_at)
    SELECT provider, endpoint, event_id, event_type, available_at, received_at
      FROM entered
     WHERE processed_at IS NULL AND parked_at IS NULL
        ON CONFLICT (provider, endpoint, event_id) DO UPDATE
       SET event_type = EXCLUDED.event_type, available_at = EXCLUDED.available_at,
           received_at = EXCLUDED.received_at;
    RETURN NULL;
END
$function$;

CREATE TRIGGER webhook_inbox_queue_enter
    AFTER INSERT ON webhook_inbox
    REFERENCING NEW TABLE AS entered
    FOR EACH STATEMENT EXECUTE FUNCTION webhook_inbox_queue_enter();

-- An updated row follows: in the queue (its availability moved, or it was requeued) it is written
-- there — an upsert, so a queue row missing for any reason is restored by the row's next change —,
-- out of it (processed, parked) it is removed. Called only for the rows whose queue entry changes
-- (the WHEN clause is evaluated without calling the function): a failure record that only writes
-- last_error, a mark of a parked row's dismissal, costs nothing here.
CREATE FUNCTION webhook_inbox_queue_follow() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = public, pg_temp
AS $function$
BEGIN
    IF (OLD.provider, OLD.endpoint, OLD.event_id) IS DISTINCT FROM (NEW.provider, NEW.endpoint, NEW.event_id) THEN
        DELETE FROM webhook_inbox_queue
         WHERE (provider, endpoint, event_id) = (OLD.provider, OLD.endpoint, OLD.event_id);
    END IF;
    IF NEW.processed_at IS NULL AND NEW.parked_at IS NULL THEN
        INSERT INTO webhook_inbox_queue (provider, endpoint, event_id, event_type, available_at, received_at)
        VALUES (NEW.provider, NEW.endpoint, NEW.event_id, NEW.event_type, NEW.available_at, NEW.received_at)
            ON CONFLICT (provider, endpoint, event_id) DO UPDATE
           SET event_type = EXCLUDED.event_type, available_at = EXCLUDED.available_at,
               received_at = EXCLUDED.received_at;
    ELSE
        DELETE FROM webhook_inbox_queue
         WHERE (provider, endpoint, event_id) = (NEW.provider, NEW.endpoint, NEW.event_id);
    END IF;
    RETURN NULL;
END
$function$;

CREATE TRIGGER webhook_inbox_queue_follow
    AFTER UPDATE OF provider, endpoint, event_id, event_type, available_at, received_at, processed_at, parked_at
    ON webhook_inbox
    FOR EACH ROW
    WHEN ((OLD.processed_at IS NULL AND OLD.parked_at IS NULL)
              IS DISTINCT FROM (NEW.processed_at IS NULL AND NEW.parked_at IS NULL)
          OR (NEW.processed_at IS NULL AND NEW.parked_at IS NULL
              AND (OLD.provider, OLD.endpoint, OLD.event_id, OLD.event_type, OLD.available_at, OLD.received_at)
                  IS DISTINCT FROM
                  (NEW.provider, NEW.endpoint, NEW.event_id, NEW.event_type, NEW.available_at, NEW.received_at)))
    EXECUTE FUNCTION webhook_inbox_queue_follow();

-- A deleted row leaves. Only a row still in the queue calls the function: purge deletes processed
-- rows, which left it when they were processed.
CREATE FUNCTION webhook_inbox_queue_leave() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = public, pg_temp
AS $function$
BEGIN
    DELETE FROM webhook_inbox_queue
     WHERE (provider, endpoint, event_id) = (OLD.provider, OLD.endpoint, OLD.event_id);
    RETURN NULL;
END
$function$;

CREATE TRIGGER webhook_inbox_queue_leave
    AFTER DELETE ON webhook_inbox
    FOR EACH ROW
    WHEN (OLD.processed_at IS NULL AND OLD.parked_at IS NULL)
    EXECUTE FUNCTION webhook_inbox_queue_leave();

-- TRUNCATE webhook_inbox empties the queue too.
CREATE FUNCTION webhook_inbox_queue_clear() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = public, pg_temp
AS $function$
BEGIN
    DELETE FROM webhook_inbox_queue;
    RETURN NULL;
END
$function$;

CREATE TRIGGER webhook_inbox_queue_clear
    AFTER TRUNCATE ON webhook_inbox
    FOR EACH STATEMENT EXECUTE FUNCTION webhook_inbox_queue_clear();

REVOKE ALL ON FUNCTION webhook_inbox_queue_enter(), webhook_inbox_queue_follow(),
                       webhook_inbox_queue_leave(), webhook_inbox_queue_clear() FROM PUBLIC;

-- The rows waiting now.
INSERT INTO webhook_inbox_queue (provider, endpoint, event_id, event_type, available_at, received_at)
SELECT provider, endpoint, event_id, event_type, available_at, received_at
  FROM webhook_inbox
 WHERE processed_at IS NULL AND parked_at IS NULL;

-- The parked rows' index (V3) without processed_at in its predicate, which kept every processed
-- mark from being HOT. It now also holds the parked rows an operator dismissed or replayed (they
-- keep parked_at until purged): few, and every reader of parked rows asks for processed_at IS NULL
-- on the rows it reads.
DROP INDEX webhook_inbox_parked;
CREATE INDEX webhook_inbox_parked ON webhook_inbox (received_at) WHERE parked_at IS NOT NULL;

ANALYZE webhook_inbox_queue;
