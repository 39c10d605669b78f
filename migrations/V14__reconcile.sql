-- stripe-inbox schema, version 14: events recovered from Stripe's API, and the runs that recover them.
--
-- `source`: how a row reached the inbox. 'webhook' (every row the ingest stores: its provenance is
-- the secret that verified the signature, in secret_position / secret_fingerprint / signature_t)
-- or 'api' (`inbox-worker reconcile` found the event in Stripe's GET /v1/events and the inbox
-- lacked it: there is no signature, the API key's TLS connection to Stripe is the proof, and the
-- signature columns stay NULL). The key is the same (provider, endpoint, event_id) either way, so
-- a webhook and a reconcile storing one event at the same moment store it once. A constant
-- default: PostgreSQL 11+ records it in the catalogue, no rewrite, and the ingest's insert does not
-- name the column.
ALTER TABLE webhook_inbox ADD COLUMN source text NOT NULL DEFAULT 'webhook';

-- One walk of `reconcile` through Stripe's event list, newest first, so that an interrupted one
-- resumes where it stopped instead of paging 30 days again:
--   types        the `types[]` sent to Stripe (empty: every type, filtered by the worker's handlers);
--   created_gte  the `created[gte]` sent to Stripe, fixed when the run starts (a resumed run keeps
--                its window, so its cursor stays meaningful);
--   starting_after  the last event id of the last page whose inserts committed — committed in the
--                same transaction as those inserts, so a crash never skips a page;
--   heartbeat_at / owner  the lease: a process renews it with every page; another one takes a run
--                over only when its lease ran out (the process died), and every write is fenced on
--                `owner`, so a stalled process that wakes up cannot move the cursor back;
--   found / present / inserted / skipped  running totals, the report of a resumed run included.
-- One unfinished run per endpoint (the partial unique index): two concurrent `reconcile`s of one
-- endpoint cannot both walk; the second is told who is walking.
CREATE TABLE reconcile_runs (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    provider       text        NOT NULL,
    endpoint       text        NOT NULL,
    account        text        NOT NULL DEFAULT '',
    types          text[]      NOT NULL,
    created_gte    bigint      NOT NULL,
    actor          text        NOT NULL,
    owner          text        NOT NULL,
    started_at     timestamptz NOT NULL DEFAULT now(),
    heartbeat_at   timestamptz NOT NULL DEFAULT now(),
    starting_after text,
    pages          integer     NOT NULL DEFAULT 0,
    found          bigint      NOT NULL DEFAULT 0,
    present        bigint      NOT NULL DEFAULT 0,
    inserted       bigint      NOT NULL DEFAULT 0,
    skipped        bigint      NOT NULL DEFAULT 0,
    finished_at    timestamptz,
    outcome        text
);
CREATE UNIQUE INDEX reconcile_runs_one_unfinished
    ON reconcile_runs (provider, endpoint, account) WHERE finished_at IS NULL;
