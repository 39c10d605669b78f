-- stripe-inbox: one PostgreSQL role per component, each allowed what that component does and no more.
--
-- Apply as a superuser (or a role with CREATEROLE that owns the tables) on the inbox database, right
-- after `inbox-worker migrate`, and again after every migrate that adds a table:
--
--     psql "$SUPERUSER_DATABASE_URL" -v ON_ERROR_STOP=1 -f deploy/roles.sql
--
-- Applying it twice is harmless. The roles get no password here: set one per role (ALTER ROLE …
-- PASSWORD '…'), or map them to your provider's IAM users, and give each component its own
-- DATABASE_URL (deploy/k8s, compose and systemd take one secret per component).
--
--   inbox_owner     owns the tables; runs `inbox-worker migrate` (and your own worker's migrate)
--                   and `inbox-worker reindex` (only the owner may rebuild an index)
--   inbox_ingest    inbox-ingest: inserts verified events, reads the schema version (readiness)
--   inbox_worker    inbox-worker run: claims and marks inbox rows, writes the invoice tables
--   inbox_relay     inbox-worker relay: claims, reads and marks outbox rows, nothing else
--   inbox_operator  stats, needs-review, requeue, replay, dismiss, purge, reconciliation; audit rows insert-only
--   inbox_metrics   read-only counts for KEDA and dashboards: no payloads, no errors
--   inbox_reconciler  inbox-worker reconcile: inserts the events Stripe's API lists and the inbox lacks
--   inbox_fetcher   inbox-worker fetch (a team's binary): what inbox_worker has, and the object snapshots
--   inbox_console   inbox-worker console (the operators' web page): what inbox_operator has, and reading the audit log
--
-- A team's own worker writes its own tables: grant them to inbox_worker and inbox_operator (replay
-- runs the same handlers) in a file of your own, applied the same way. inbox_fetcher is a member
-- of inbox_worker, so what is granted to inbox_worker reaches `fetch` too; inbox_console is a
-- member of inbox_operator, so what is granted to inbox_operator reaches the console's replay too.

-- Names in this file resolve in pg_catalog only, before anything is called: on a database where
-- others may create objects in public (every database created before PostgreSQL 15), a function
-- planted there (a public.format(text, text), say) would otherwise be the better match for a call
-- below and run with the rights of the superuser applying this file. The inbox's tables are
-- named with their schema for the same reason.
SET search_path = pg_catalog, pg_temp;

-- Nobody but the owner creates objects in public: PostgreSQL 15's default, which databases made
-- before it (and upgraded since) do not have. Harmless where it already holds.
REVOKE CREATE ON SCHEMA public FROM PUBLIC;

-- Roles. A role already there is kept as it is (its password and attributes untouched).
DO $roles$
DECLARE
    name text;
BEGIN
    FOREACH name IN ARRAY ARRAY['inbox_owner', 'inbox_ingest', 'inbox_worker', 'inbox_relay', 'inbox_operator', 'inbox_metrics', 'inbox_reconciler', 'inbox_fetcher', 'inbox_console'] LOOP
        BEGIN
            EXECUTE format('CREATE ROLE %I LOGIN', name);
        EXCEPTION WHEN duplicate_object THEN
            NULL;  -- created before, or by a concurrent run of this file
        END;
    END LOOP;
END
$roles$;

-- Connecting to this database (PUBLIC may too, by PostgreSQL's default: revoking that is the
-- database owner's call, as other roles may use this database).
DO $connect$
BEGIN
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO inbox_owner, inbox_ingest, inbox_worker, inbox_relay, inbox_operator, inbox_metrics, inbox_reconciler, inbox_fetcher, inbox_console',
                   current_database());
END
$connect$;

-- The owner: the tables, and the right to create more in the schema (later migrations).
GRANT USAGE, CREATE ON SCHEMA public TO inbox_owner;
GRANT USAGE ON SCHEMA public TO inbox_ingest, inbox_worker, inbox_relay, inbox_operator, inbox_metrics,
                                inbox_reconciler, inbox_fetcher, inbox_console;
ALTER TABLE public.webhook_inbox OWNER TO inbox_owner;
ALTER TABLE public.invoices OWNER TO inbox_owner;
ALTER TABLE public.outbox OWNER TO inbox_owner;
ALTER TABLE public.ledger_entries OWNER TO inbox_owner;
ALTER TABLE public.operator_audit OWNER TO inbox_owner;
ALTER TABLE public.reconciliation_items OWNER TO inbox_owner;
ALTER TABLE public.refinery_schema_history OWNER TO inbox_owner;
ALTER TABLE public.queue_gauges OWNER TO inbox_owner;
ALTER TABLE public.inbox_workers OWNER TO inbox_owner;
ALTER TABLE public.reconcile_runs OWNER TO inbox_owner;
ALTER TABLE public.stripe_object_snapshots OWNER TO inbox_owner;
ALTER TABLE public.webhook_inbox_queue OWNER TO inbox_owner;
-- V17's triggers keep webhook_inbox_queue for every writer of webhook_inbox: SECURITY DEFINER, so
-- they write the queue as its owner, whoever wrote the row.
ALTER FUNCTION public.webhook_inbox_queue_enter() OWNER TO inbox_owner;
ALTER FUNCTION public.webhook_inbox_queue_follow() OWNER TO inbox_owner;
ALTER FUNCTION public.webhook_inbox_queue_leave() OWNER TO inbox_owner;
ALTER FUNCTION public.webhook_inbox_queue_clear() OWNER TO inbox_owner;
-- V16's SECURITY DEFINER function, which analyses webhook_inbox, webhook_inbox_queue and outbox for the workers after
-- PostgreSQL lost its statistics (a crash restart): it runs as its owner, so it is the tables'.
ALTER FUNCTION public.inbox_analyze_after_stats_reset() OWNER TO inbox_owner;

-- Every session of these roles, in this database, resolves names the same way, whatever the
-- server's default: the inbox's schema, and temporary objects last (pg_catalog, not listed, is
-- searched first, as always; listing it first would also make it where migrations create tables).
-- The default "$user", public would let a schema named after a role shadow webhook_inbox, and
-- pg_temp left implicit is searched before everything. Per role and database, so it holds through
-- PgBouncer's transaction mode too, where nothing a client SETs per session survives. A
-- connection's own `options=-c search_path=…` still wins: do not put one in a DATABASE_URL.
DO $search_path$
DECLARE
    name text;
BEGIN
    FOREACH name IN ARRAY ARRAY['inbox_owner', 'inbox_ingest', 'inbox_worker', 'inbox_relay', 'inbox_operator', 'inbox_metrics', 'inbox_reconciler', 'inbox_fetcher', 'inbox_console'] LOOP
        EXECUTE format('ALTER ROLE %I IN DATABASE %I SET search_path = public, pg_temp',
                       name, current_database());
    END LOOP;
END
$search_path$;

-- Everyone may read the schema version (the ingest's /readyz; `migrate` as the owner).
GRANT SELECT ON public.refinery_schema_history TO inbox_ingest, inbox_worker, inbox_relay, inbox_operator, inbox_metrics,
                                                   inbox_reconciler;

-- inbox_ingest: the group-commit INSERT … ON CONFLICT DO NOTHING RETURNING endpoint, event_id.
-- Column privileges: it can neither read payloads nor change a row once stored. Besides the event
-- it writes how the delivery was verified, and parks on arrival a row it must hold (raw_body,
-- held, parked_at, last_error: an unstorable body, a livemode that disagrees with the endpoint).
GRANT INSERT (provider, endpoint, event_id, event_type, payload, payload_bytes, raw_body, held, parked_at,
              last_error, secret_position, secret_fingerprint, signature_t, signature_v1)
      ON public.webhook_inbox TO inbox_ingest;
GRANT SELECT (provider, endpoint, event_id) ON public.webhook_inbox TO inbox_ingest;

-- What a row says happened is evidence: the event as Stripe signed it (event_id, event_type,
-- payload, raw_body, payload_bytes), how it was verified (secret_position, secret_fingerprint,
-- signature_t, signature_v1) and when it arrived (received_at). No role but the owner may change
-- those: the worker and the operator update the queue's columns only. Granted again from scratch,
-- so that a table-wide UPDATE granted by an earlier version of this file is taken back.
REVOKE UPDATE ON public.webhook_inbox FROM inbox_worker, inbox_operator;

-- inbox_worker: claim, lock, mark, record failures and hand back (UPDATE … RETURNING reads), and
-- the invoice handlers' tables. It never inserts or deletes inbox rows.
GRANT SELECT ON public.webhook_inbox TO inbox_worker;
-- The queue (V17), which the claim and the gauges read; only its triggers write it.
GRANT SELECT ON public.webhook_inbox_queue TO inbox_worker, inbox_operator, inbox_metrics;
GRANT UPDATE (attempts, interruptions, available_at, parked_at, held, last_error, processed_at)
      ON public.webhook_inbox TO inbox_worker;
GRANT SELECT, INSERT, UPDATE ON public.invoices TO inbox_worker;
GRANT SELECT, INSERT ON public.ledger_entries, public.reconciliation_items TO inbox_worker;
GRANT INSERT ON public.outbox TO inbox_worker;
-- The queue gauges one worker per interval counts and every worker reads (V7).
GRANT SELECT, UPDATE ON public.queue_gauges TO inbox_worker;
-- Each worker's row saying what it claims (V9): written at start, refreshed, removed at stop.
GRANT SELECT, INSERT, UPDATE, DELETE ON public.inbox_workers TO inbox_worker;
-- The analyse of webhook_inbox, its queue and outbox after PostgreSQL lost its statistics (V16): only the
-- owner may ANALYZE, and the function does that for those three tables and nothing else.
GRANT EXECUTE ON FUNCTION public.inbox_analyze_after_stats_reset() TO inbox_worker;

-- inbox_relay: claim (lease, attempt, fencing token), read what it delivers, mark published,
-- record failures, park, hand back — on outbox rows only. It never inserts or deletes one, never
-- rewrites what a handler wrote (aggregate, event type, payload), and reads nothing else. Granted
-- again from scratch, like the inbox's UPDATE above.
REVOKE UPDATE ON public.outbox FROM inbox_relay, inbox_operator;
GRANT SELECT ON public.outbox TO inbox_relay;
GRANT UPDATE (attempts, available_at, fencing_token, last_error, parked_at, published_at)
      ON public.outbox TO inbox_relay;

-- inbox_operator: reads and requeues (the queue's columns), purges (DELETE), replays (the
-- handlers' tables, and the processed mark). Audit rows: insert only, and only the columns an
-- operator declares; the database fills in db_user and client_addr itself.
GRANT SELECT, DELETE ON public.webhook_inbox TO inbox_operator;
GRANT UPDATE (attempts, interruptions, available_at, parked_at, held, last_error, processed_at, dismissed_at)
      ON public.webhook_inbox TO inbox_operator;
GRANT SELECT, INSERT, UPDATE ON public.invoices TO inbox_operator;
GRANT SELECT, INSERT ON public.ledger_entries, public.reconciliation_items TO inbox_operator;
-- `reconciliation resolve` closes an item: who, when and what was done, nothing else of it (what
-- the handler recorded stays as it wrote it). Granted again from scratch, like the UPDATEs above.
REVOKE UPDATE ON public.reconciliation_items FROM inbox_worker, inbox_operator;
GRANT UPDATE (resolved_at, resolved_by, resolution_note) ON public.reconciliation_items TO inbox_operator;
GRANT INSERT ON public.outbox TO inbox_operator;
-- Outbox rows: needs-review --outbox, requeue --outbox (the delivery columns), purge of published rows.
GRANT SELECT, DELETE ON public.outbox TO inbox_operator;
GRANT UPDATE (attempts, available_at, parked_at, last_error) ON public.outbox TO inbox_operator;
GRANT SELECT ON public.inbox_workers TO inbox_operator;
GRANT INSERT (actor, action, target, affected) ON public.operator_audit TO inbox_operator;
GRANT SELECT (id) ON public.operator_audit TO inbox_operator;
-- Looking at reconcile's runs (how far an interrupted one got, who started it): read only; only
-- `reconcile` itself (inbox_reconciler) starts, moves or finishes one.
GRANT SELECT ON public.reconcile_runs TO inbox_operator;
-- replay of a thin event re-applies the object snapshot `fetch` kept (the handler reads it in its
-- transaction): read only, a replay never fetches.
GRANT SELECT ON public.stripe_object_snapshots TO inbox_operator;

-- inbox_metrics: the columns the gauges, `stats` and the KEDA query count by; not payload or
-- last_error (which can quote a payload).
GRANT SELECT (provider, endpoint, event_id, event_type, received_at, available_at, attempts,
              processed_at, parked_at, payload_bytes, held, secret_position, secret_fingerprint,
              signature_t) ON public.webhook_inbox TO inbox_metrics;
GRANT SELECT ON public.queue_gauges, public.inbox_workers TO inbox_metrics;
-- The outbox's pending, parked and blocked counts (`stats`, the relay's KEDA query): not payload
-- or last_error.
GRANT SELECT (id, aggregate_type, aggregate_id, event_type, created_at, published_at, attempts,
              available_at, parked_at, fencing_token) ON public.outbox TO inbox_metrics;

-- inbox_reconciler: `inbox-worker reconcile` stores the events Stripe's API lists and the inbox
-- lacks, with the ingest's own INSERT … ON CONFLICT DO NOTHING RETURNING endpoint, event_id, marked
-- source = 'api' (no signature: the columns of one stay NULL). Column privileges, as the ingest's:
-- it inserts, reads the key columns (the conflict, RETURNING, and --dry-run's lookup by key) and
-- never a payload; it updates and deletes no inbox row, and touches no handler's table (the workers
-- apply what it stores).
GRANT INSERT (provider, endpoint, event_id, event_type, payload, payload_bytes, held, parked_at, last_error,
              secret_position, secret_fingerprint, signature_t, source)
      ON public.webhook_inbox TO inbox_reconciler;
GRANT SELECT (provider, endpoint, event_id) ON public.webhook_inbox TO inbox_reconciler;
-- Its runs (V14): finds the endpoint's unfinished one, starts one, and moves its cursor, counts and
-- lease (every UPDATE fenced on `owner`) until it finishes it. What a run was started with — the
-- endpoint, account, types, window, actor and start — is never changed. No DELETE: finished runs
-- stay, as the record of what each walk found. The id is an identity column: inserting draws from
-- its sequence without a grant on it.
GRANT SELECT, INSERT ON public.reconcile_runs TO inbox_reconciler;
GRANT UPDATE (owner, heartbeat_at, starting_after, pages, found, present, inserted, skipped, finished_at, outcome)
      ON public.reconcile_runs TO inbox_reconciler;
-- One audit record per finished run (affected = inserted), as the operators write theirs: insert of
-- the declared columns only (the database fills in db_user and client_addr), RETURNING id.
GRANT INSERT (actor, action, target, affected) ON public.operator_audit TO inbox_reconciler;
GRANT SELECT (id) ON public.operator_audit TO inbox_reconciler;

-- inbox_fetcher: `inbox-worker fetch` of a team's binary (the stock one registers no fetched type
-- and refuses to start it). It claims, marks and applies rows exactly as `run` does, with handlers
-- that write the same tables: a member of inbox_worker, so it has what the worker has — including
-- what a team grants inbox_worker for its own tables — and no more, but for the snapshots of the
-- objects it fetches (V15): which it holds (a join on the claimed events), the first of an object
-- (INSERT), a newer one replacing an older (ON CONFLICT DO UPDATE). Never deletes one. Granted
-- again, the membership is only noticed; two runs of this file at once may both add it, and the
-- second then finds it there.
DO $fetcher$
BEGIN
    GRANT inbox_worker TO inbox_fetcher;
EXCEPTION WHEN unique_violation THEN
    NULL;  -- granted by a concurrent run of this file
END
$fetcher$;
GRANT SELECT, INSERT, UPDATE ON public.stripe_object_snapshots TO inbox_fetcher;

-- inbox_console: `inbox-worker console`, the operators' web page. Its actions are the operator
-- commands' own code (requeue, release, replay, dismiss, resolve, a filtered requeue) run for the
-- signed-in operator, so it has exactly what the CLI runs with: it is a member of inbox_operator —
-- the CLI's replay runs as inbox_operator, and a replay from the console runs the same handlers,
-- writing the handlers' tables through inbox_operator's grants (a team's own tables too, when it
-- grants them to inbox_operator as said above). Not of inbox_worker: the console claims nothing.
-- Beyond the CLI it reads the audit log it shows (an event's history, the log page); the CLI only
-- inserts records. Its records carry db_user inbox_console, so that a change made in the console
-- is told apart from one made with the CLI whatever actor it names. Granted again, the membership
-- is only noticed (as inbox_fetcher's above).
DO $console$
BEGIN
    GRANT inbox_operator TO inbox_console;
EXCEPTION WHEN unique_violation THEN
    NULL;  -- granted by a concurrent run of this file
END
$console$;
GRANT SELECT (id, at, actor, action, target, affected) ON public.operator_audit TO inbox_console;

-- Write-back for every session of this database, autovacuum's included, where nobody chose a value
-- for the server, the database or this role: what migration V22 does when the migrating role may
-- change the database's settings, done here for databases migrated by one that may not (a table
-- owner such as inbox_owner). See docs/operations.md, "Scaling". A value already chosen is kept.
DO $write_back$
BEGIN
    IF (SELECT source FROM pg_settings WHERE name = 'backend_flush_after') = 'default' THEN
        EXECUTE format('ALTER DATABASE %I SET backend_flush_after = %L', current_database(), '256kB');
    END IF;
END
$write_back$;

RESET search_path;
