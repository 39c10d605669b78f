-- custom-worker's own schema, version 3: the fetch queue of V2 becomes the objects themselves.
--
-- Why: V2 had the thin-event handler (src/thin.rs) record, in the worker's transaction, that the
-- object a thin event names must be fetched, for a fetcher of the team's own to call Stripe after
-- the commit and apply the object in a second transaction. The library now does the fetch itself:
-- the thin types are registered with Registry::register_fetched, and `custom-worker fetch` claims
-- their events like `run`, GETs each object once for every waiting event about it (outside any
-- transaction, Stripe-Context: the event's account), keeps the answer in the inbox's
-- stripe_object_snapshots, and only then runs the handler, which reads that snapshot in its
-- transaction. So the handler no longer queues anything: it writes the object's current state,
-- and this table holds that state — the object, when it was seen (as_of), whether Stripe no longer
-- has it (gone). The queue-only parts go: fetched_at and the partial index of the due fetches
-- (nothing is ever due now), and the name, which would say the opposite of what the table holds.
--
-- V2 is applied in existing databases and is never edited: this is a new version of the same
-- set, and a database at V2 gets only this at its next `migrate`. Every V2 row is kept — the
-- object's id, type, path, account, the last event about it (now event_id) and when it came (now
-- updated_at) — with no object yet (as_of NULL): an object V2 queued and a fetcher of the team's
-- own may have applied elsewhere, never fetched into this table. The next thin event about it
-- fills it in.
--
-- Deploy: run this binary's `migrate`, then replace `custom-worker run` and start
-- `custom-worker fetch`. A `custom-worker run` of the V2 build still running meanwhile handles
-- the thin types itself and fails them (stripe_fetches is gone): they are retried with backoff
-- and taken by `fetch` once it runs, or, if one reached the attempt limit first, parked for
-- `requeue`.

ALTER TABLE stripe_fetches RENAME TO stripe_objects;
ALTER TABLE stripe_objects RENAME CONSTRAINT stripe_fetches_pkey TO stripe_objects_pkey;
ALTER TABLE stripe_objects RENAME CONSTRAINT stripe_fetches_url_is_a_path TO stripe_objects_url_is_a_path;

-- Queue-only: what the fetcher of V2 read and marked. Nothing is due any more.
DROP INDEX stripe_fetches_due;
ALTER TABLE stripe_objects DROP COLUMN fetched_at;

-- The event whose handler last changed the row (for a person tracing where a state came from):
-- the first event applied with the snapshot the row shows; later events served by the same
-- snapshot change nothing.
ALTER TABLE stripe_objects RENAME COLUMN last_event_id TO event_id;
-- When the row last changed.
ALTER TABLE stripe_objects RENAME COLUMN queued_at TO updated_at;

ALTER TABLE stripe_objects
    -- The object as Stripe's API returned it (GET url, with Stripe-Context: account when set).
    -- NULL when Stripe answered 404 (gone) or when no snapshot was ever applied (a V2 row).
    ADD COLUMN object     jsonb,
    -- Stripe answered 404: deleted, or no longer visible to the key. A current state like any
    -- other: a later snapshot replaces it.
    ADD COLUMN gone       boolean NOT NULL DEFAULT false,
    -- The snapshot shows the object as it was at this time or later (`fetch` read the database's
    -- clock just before its GET). The row only moves to a later as_of, so events applied in any
    -- order, twice, or replayed never bring back an older state. NULL: never fetched (a V2 row).
    ADD COLUMN as_of      timestamptz,
    -- Stripe's request id of the fetch (what Stripe's support asks for).
    ADD COLUMN request_id text,
    -- Never fetched: nothing known. Fetched: either the object, or gone.
    ADD CONSTRAINT stripe_objects_state CHECK (
        CASE WHEN as_of IS NULL THEN object IS NULL AND NOT gone
             ELSE (object IS NULL) = gone
        END
    );
